"""Search: owns the Optuna studies and their storage; decides what to try next.

It asks for configs, prunes those that cannot run (statically, before any GPU time),
answers repeated configs from what was already measured, and tells results back. It
never touches a GPU.
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from harness import kernel_api, spaces
from harness.experiment import SearchSettings, StudySpec
from harness.jsonsafe import json_safe
from harness.kernel_api import DeviceSpec
from harness.measure import TrialResult
from harness.sqlite_commits import fast_commits

optuna.logging.set_verbosity(optuna.logging.WARNING)
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)

#: Trial user attributes the harness writes. The objective value is the median latency.
ATTR_STATUS = "status"  # measured | failed | pruned | cut | duplicate | interrupted
ATTR_REASON = "reason"
ATTR_RESULT = "result"


def storage_url(runs_dir: str | Path, experiment: str) -> str:
    path = Path(runs_dir).resolve() / experiment / "optuna.db"
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


def make_storage(url: str) -> optuna.storages.BaseStorage:
    """The studies' storage. SQLite runs in WAL mode with ``synchronous=NORMAL``: a
    commit no longer waits for fsync (3-4x faster ask/tell, which the driver does for
    every trial), and a killed driver still loses no committed trial (only a power loss
    could lose the last ones)."""
    if not url.startswith("sqlite:"):
        return optuna.storages.RDBStorage(url)
    from sqlalchemy import event

    storage = optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 60}})

    event.listen(storage.engine, "connect", fast_commits)
    storage.engine.dispose()  # connections opened before the listener reconnect with it
    return storage


class _GridSampler(optuna.samplers.GridSampler):
    """GridSampler for ask/tell: its ``after_trial`` calls ``study.stop()`` once the grid
    is used up, which raises outside ``study.optimize``; the harness's budget stops it.

    It also hands out a trial's whole grid point at once, as relative parameters: the
    plain GridSampler reads the trial's system attributes back from the storage for each
    parameter it samples (six SQLite reads per ask on the matmul grid: asks 40 ms apart
    on the H200 box, slower than the GPU times a config at 5/20 ms budgets)."""

    def infer_relative_search_space(self, study: optuna.Study, trial: optuna.trial.FrozenTrial
                                    ) -> dict[str, optuna.distributions.BaseDistribution]:
        return {name: optuna.distributions.CategoricalDistribution(choices)
                for name, choices in self._search_space.items()}

    def sample_relative(self, study: optuna.Study, trial: optuna.trial.FrozenTrial,
                        search_space: dict[str, optuna.distributions.BaseDistribution]
                        ) -> dict[str, Any]:
        # The grid id is written by ``before_trial`` after ``trial`` was read: one read.
        grid_id = study._storage.get_trial_system_attrs(trial._trial_id).get("grid_id")
        if grid_id is None:  # an enqueued trial: its fixed parameters apply
            return {}
        point = self._all_grids[grid_id]
        return {name: point[i] for i, name in enumerate(self._param_names)
                if name in search_space}

    def after_trial(self, study: optuna.Study, trial: optuna.trial.FrozenTrial,
                    state: TrialState, values: Any) -> None:
        pass


def grid_order(space: spaces.Space, seed: int) -> list[dict[str, Any]]:
    """The grid's configs in the order a study's grid sampler (seeded ``seed``) hands them
    out: Optuna 5's gives trial n the n-th point of its seeded shuffle. A worker compiling
    the grid ahead in this order has first what is asked first (elsewhere the order is
    only less useful)."""
    sampler = _GridSampler(dict(space), seed=seed)
    return [dict(zip(sampler._param_names, point, strict=True))
            for point in sampler._all_grids]


def make_sampler(settings: SearchSettings, space: spaces.Space, seed: int,
                 n_parallel: int) -> optuna.samplers.BaseSampler:
    name = settings.sampler
    if name == "tpe":
        # constant_liar keeps parallel workers from being handed the same config.
        return optuna.samplers.TPESampler(seed=seed, constant_liar=n_parallel > 1,
                                          multivariate=True, n_startup_trials=8)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "grid":
        return _GridSampler(dict(space), seed=seed)
    if name == "cmaes":
        return optuna.samplers.CmaEsSampler(seed=seed, warn_independent_sampling=False)
    if name == "gp":
        return optuna.samplers.GPSampler(seed=seed)
    raise ValueError(f"unknown sampler {name!r}")


class ThresholdPruner(optuna.pruners.BasePruner):
    """Multi-fidelity cut: a trial whose cheap measurement (step 0) is more than ``margin``
    slower than the best full measurement so far stops there, once ``n_startup_trials``
    trials are complete. Cheap timings are noisier, hence the margin."""

    def __init__(self, margin: float = 0.10, n_startup_trials: int = 4):
        self.margin = margin
        self.n_startup_trials = n_startup_trials

    def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
        step = trial.last_step
        if step is None:
            return False
        done = [t.value for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                if t.value is not None]
        if len(done) < self.n_startup_trials:
            return False
        return trial.intermediate_values[step] > min(done) * (1 + self.margin)


def make_pruner(settings: SearchSettings) -> optuna.pruners.BasePruner:
    """The multi-fidelity pruner (``search.pruner``); ``none``: every config is timed in
    full at once."""
    name, startup = settings.pruner, settings.prune_startup_trials
    if name == "none":
        return optuna.pruners.NopPruner()
    if name == "threshold":
        return ThresholdPruner(settings.prune_margin, startup)
    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=startup, n_warmup_steps=0)
    if name == "percentile":
        return optuna.pruners.PercentilePruner(settings.prune_percentile,
                                               n_startup_trials=startup, n_warmup_steps=0)
    raise ValueError(f"unknown pruner {name!r}")


def config_key(config: Mapping[str, Any]) -> str:
    return json.dumps(dict(config), sort_keys=True)


class Search:
    """One Optuna study for one (kernel, shape, dtype, hardware)."""

    def __init__(self, spec: StudySpec, space: spaces.Space, device: DeviceSpec,
                 settings: SearchSettings, storage: str | optuna.storages.BaseStorage,
                 seed: int, n_parallel: int,
                 seeds: Sequence[tuple[dict[str, Any], str]] = ()):
        self.spec = spec
        self.space = space
        self.device = device
        self.settings = settings
        self.kernel = kernel_api.get(spec.kernel)
        self.study = optuna.create_study(
            study_name=spec.name,
            storage=storage,
            direction="minimize",
            sampler=make_sampler(settings, space, seed, n_parallel),
            pruner=make_pruner(settings),
            load_if_exists=True,
        )
        self.grid = spaces.grid_size(space)
        self._seen: dict[str, float | None] = {}  # config -> latency (None = failed)
        self._asks_left = 20 * settings.trials + self.grid
        self._pruned: set[str] = set()  # distinct configs rejected by static pruning
        self._stall = 0  # asks in a row that brought no new config
        self.stalled = False
        self._seeds = list(seeds)  # (config, where it won) enqueued on a fresh study
        self._resume()

    # -- resume ---------------------------------------------------------------------
    def _resume(self) -> None:
        """Load what a previous run finished. A trial a killed driver left running is
        finished from its stored result if the result had arrived, else closed as
        ``interrupted`` and its config queued again: no finished trial is lost or re-run."""
        fresh = len(self.study.trials) == 0
        self.interrupted: list[dict[str, Any]] = []  # configs queued again
        self.recovered: list[int] = []  # trial numbers finished from a stored result
        for t in self.study.get_trials(deepcopy=False):
            if t.state == TrialState.RUNNING:
                t = self._finish_left_running(t)
            key = config_key(t.params)
            if t.state == TrialState.COMPLETE:
                self._seen[key] = t.value
            elif t.state == TrialState.FAIL and t.user_attrs.get(ATTR_STATUS) == "failed":
                self._seen[key] = None
            elif t.state == TrialState.PRUNED and t.user_attrs.get(ATTR_STATUS) == "cut":
                self._seen[key] = math.inf  # stopped after its cheap pass: measured
            elif t.state == TrialState.PRUNED:
                self._pruned.add(key)
        if fresh and self.settings.warm_start:
            default = {k: v for k, v in self.kernel.default_config.items() if k in self.space}
            missing = set(self.space) - set(default)
            # Only enqueue when the default is a point of this space.
            if not missing and all(default[k] in self.space[k] for k in default):
                self.study.enqueue_trial(default)
        if fresh and self._seeds:
            for config, _ in self._seeds:
                self.study.enqueue_trial(dict(config), skip_if_exists=True)
            self.study.set_user_attr("warm_start_seeds",
                                     [{"config": c, "from": w} for c, w in self._seeds])

    def _finish_left_running(self, t: optuna.trial.FrozenTrial) -> optuna.trial.FrozenTrial:
        storage, tid = self.study._storage, t._trial_id
        stored = t.user_attrs.get(ATTR_RESULT)
        if stored is not None and t.user_attrs.get(ATTR_STATUS) in ("measured", "failed"):
            # Killed between storing the result and telling it: tell it now.
            if t.user_attrs[ATTR_STATUS] == "measured":
                self.study.tell(t.number, stored["latency_ms"])
            else:
                self.study.tell(t.number, state=TrialState.FAIL)
            self.recovered.append(t.number)
        else:
            storage.set_trial_user_attr(tid, ATTR_STATUS, "interrupted")
            storage.set_trial_user_attr(tid, ATTR_REASON, "the driver stopped during the trial")
            self.study.tell(t.number, state=TrialState.FAIL)
            if t.params:
                self.study.enqueue_trial(t.params, skip_if_exists=True)
                self.interrupted.append(dict(t.params))
        return self.study._storage.get_trial(tid)

    # -- the budget -----------------------------------------------------------------
    @property
    def pruned(self) -> int:
        """Distinct configs rejected by static pruning (a sampler may ask for one often)."""
        return len(self._pruned)

    @property
    def measured(self) -> int:
        """Distinct configs measured (succeeded or failed): what the budget counts."""
        return len(self._seen)

    def done(self, in_flight: int = 0) -> bool:
        return (self.measured + in_flight >= self.settings.trials
                or self.measured + in_flight >= self.grid - self.pruned
                or self._asks_left <= 0 or self.stalled)

    # -- ask / tell -----------------------------------------------------------------
    def ask(self, in_flight: int = 0) -> tuple[optuna.trial.Trial, dict[str, Any]] | None:
        """The next config worth measuring, or None when the study has nothing left."""
        while not self.done(in_flight):
            self._asks_left -= 1
            self._stall += 1
            if self._stall > self.settings.max_stalled_asks:
                # GP, say, keeps proposing configs it cannot learn from (pruned ones are
                # not in its model): nothing new would be measured before the ask limit.
                self.stalled = True
                self.study.set_user_attr("stopped", f"stalled: {self._stall - 1} asks in a "
                                         "row brought no new config")
                break
            trial = self.study.ask()
            config = {name: trial.suggest_categorical(name, choices)
                      for name, choices in self.space.items()}
            reason = self.kernel.check_config(
                {**self.kernel.default_config, **config}, self.spec.shape, self.device)
            if reason:
                key = config_key(config)
                if key not in self._pruned:
                    # A config newly found invalid is progress through the space (a grid
                    # of mostly invalid points is walked to its valid ones); only asks
                    # that repeat what is known count towards a stall.
                    self._stall = 0
                self._pruned.add(key)
                trial.set_user_attr(ATTR_STATUS, "pruned")
                trial.set_user_attr(ATTR_REASON, reason)
                self.study.tell(trial, state=TrialState.PRUNED)
                continue
            key = config_key(config)
            if key in self._seen:
                # Samplers repeat themselves on small spaces; answer from what we know.
                trial.set_user_attr(ATTR_STATUS, "duplicate")
                value = self._seen[key]
                if value is not None and math.isinf(value):
                    self.study.tell(trial, state=TrialState.PRUNED)
                elif value is None or math.isnan(value):
                    # Failed, or still in flight (no value yet): Optuna takes no NaN value.
                    self.study.tell(trial, state=TrialState.FAIL)
                else:
                    self.study.tell(trial, value)
                continue
            self._seen[key] = math.nan  # claimed: in flight
            self._stall = 0
            return trial, config
        return None

    def tell(self, trial: optuna.trial.Trial, config: Mapping[str, Any],
             result: TrialResult) -> None:
        # Reason and status before the result: a trial whose result is stored is finished
        # from it on resume, so the result attr goes last and the tell right after.
        key = config_key(config)
        if result.ok:
            result = self._require_accuracy(result)
        if not result.ok:
            trial.set_user_attr(ATTR_REASON, result.reason)
        trial.set_user_attr(ATTR_STATUS, "measured" if result.ok else "failed")
        trial.set_user_attr(ATTR_RESULT, json_safe(result.to_dict()))
        if result.ok:
            self._seen[key] = result.latency_ms
            self.study.tell(trial, result.latency_ms)
        else:
            self._seen[key] = None
            self.study.tell(trial, state=TrialState.FAIL)

    def cheap(self, trial: optuna.trial.Trial, config: Mapping[str, Any],
              result: TrialResult) -> bool:
        """Multi-fidelity: report a cheap measurement as step 0; True when the pruner stops
        the trial there (it is then told PRUNED, status ``cut``), False when it goes on to
        the full measurement. A failed cheap pass is the trial's result (failed)."""
        if result.ok:
            result = self._require_accuracy(result)
        if not result.ok:
            self.tell(trial, config, result)
            return True
        trial.report(result.latency_ms, 0)
        if not trial.should_prune():
            return False
        trial.set_user_attr(ATTR_STATUS, "cut")
        trial.set_user_attr(ATTR_REASON, f"cheap pass {result.latency_ms:.4g} ms: pruned "
                            f"by the {self.settings.pruner} pruner")
        trial.set_user_attr("cheap_ms", result.latency_ms)
        self._seen[config_key(config)] = math.inf
        self.study.tell(trial, state=TrialState.PRUNED)
        return True

    def _require_accuracy(self, result: TrialResult) -> TrialResult:
        """The experiment's accuracy requirement: a fast but less accurate config fails."""
        for name, limit in (("max_abs_err", self.settings.max_abs_err),
                            ("max_rel_err", self.settings.max_rel_err)):
            value = getattr(result, name)
            if limit is not None and not (value <= limit):  # NaN fails too
                return dataclasses.replace(
                    result, ok=False,
                    reason=f"accuracy requirement: {name} {value:.3g} > required {limit:g}")
        return result

    def release(self, config: Mapping[str, Any]) -> None:
        """Forget a claimed config whose measurement never came back (lost worker)."""
        self._seen.pop(config_key(config), None)

    # -- results --------------------------------------------------------------------
    def best(self) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """(config, result dict) of the fastest measured trial, or None."""
        measured = [t for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                    if t.user_attrs.get(ATTR_STATUS) == "measured"]
        if not measured:
            return None
        t = min(measured, key=lambda t: t.value)
        return dict(t.params), dict(t.user_attrs.get(ATTR_RESULT, {}))

    def top(self, k: int) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """The ``k`` fastest measured configs (distinct), fastest first, with results."""
        out: dict[str, tuple[float, dict[str, Any], dict[str, Any]]] = {}
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            if t.user_attrs.get(ATTR_STATUS) != "measured":
                continue
            key = config_key(t.params)
            if key not in out or t.value < out[key][0]:
                out[key] = (t.value, dict(t.params), dict(t.user_attrs.get(ATTR_RESULT, {})))
        ranked = sorted(out.values(), key=lambda x: x[0])[:k]
        return [(cfg, res) for _, cfg, res in ranked]

    def latencies(self) -> dict[str, float]:
        """Config key -> measured latency, for every measured config."""
        return {config_key(cfg): res["latency_ms"] for cfg, res in self.top(10**9)
                if res.get("latency_ms") is not None}

    def counts(self) -> dict[str, int]:
        out = {"measured": 0, "failed": 0, "pruned": 0, "cut": 0, "duplicate": 0}
        for t in self.study.get_trials(deepcopy=False):
            status = t.user_attrs.get(ATTR_STATUS)
            if status in out:
                out[status] += 1
        return out

    def failures(self) -> list[tuple[dict[str, Any], str]]:
        return [(dict(t.params), t.user_attrs.get(ATTR_REASON, ""))
                for t in self.study.get_trials(deepcopy=False)
                if t.user_attrs.get(ATTR_STATUS) == "failed"]

    def set_attr(self, key: str, value: Any) -> None:
        # Optuna stores attrs as JSON: NaN goes in as None.
        self.study.set_user_attr(key, json_safe(value))

    def attr(self, key: str, default: Any = None) -> Any:
        return self.study.user_attrs.get(key, default)
