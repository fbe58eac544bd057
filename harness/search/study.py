"""A study: one Optuna study for one (kernel, shape, dtype, hardware).

It asks its search strategy for configs (valid ones: ``harness.search.strategies``),
answers repeated configs from what was already measured, tells results back to the study
and the strategy, and on resume finishes or queues again what a stopped driver left
running. It never touches a GPU.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import optuna
from optuna.trial import TrialState

from harness.experiment import SearchSettings, StudySpec
from harness.kernel import api as kernel_api
from harness.kernel.api import DeviceSpec
from harness.measure.timing import TrialResult
from harness.search import progress, spaces
from harness.search.keys import config_key
from harness.search.samplers import StrategySampler, make_pruner
from harness.search.strategies import registry
from harness.search.strategies.base import Outcome, Setup, Strategy
from harness.search.valid import ValidSpace
from harness.tracking.jsonsafe import json_safe

optuna.logging.set_verbosity(optuna.logging.WARNING)
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)

#: Trial user attributes the harness writes. The objective value is the median latency.
ATTR_STATUS = "status"  # measured | failed | pruned | cut | duplicate | interrupted
ATTR_REASON = "reason"
ATTR_RESULT = "result"
ATTR_CHEAP_S = progress.ATTR_CHEAP_S


def trial_cost_s(t: optuna.trial.FrozenTrial) -> float:
    return progress.trial_cost_s(t.user_attrs)


class Search:
    """One Optuna study for one (kernel, shape, dtype, hardware)."""

    def __init__(self, spec: StudySpec, space: spaces.Space, device: DeviceSpec,
                 settings: SearchSettings, storage: str | optuna.storages.BaseStorage,
                 seed: int, n_parallel: int,
                 seeds: Sequence[tuple[dict[str, Any], str]] = (),
                 check: Callable[[Mapping[str, Any]], str | None] | None = None,
                 default_config: Mapping[str, Any] | None = None,
                 strategy: Callable[[Setup], Strategy] | None = None,
                 max_asks: int | None = None):
        """``check`` (config -> why it cannot run, or None) defaults to the kernel's
        ``check_config`` at the study's shape on ``device``; ``default_config`` (the warm
        start's first config and the base of every checked config) to the kernel's;
        ``strategy`` (a Strategy class, or any callable of a Setup) to the one
        ``settings.strategy`` names; ``max_asks`` (configs asked of the strategy at most,
        pruned and repeated ones included) to 20 per budgeted trial plus the grid."""
        self.spec = spec
        self.space = space
        self.device = device
        self.settings = settings
        if check is None or default_config is None:
            self.kernel = kernel_api.get(spec.kernel)
        self.default_config = dict(self.kernel.default_config if default_config is None
                                   else default_config)
        self._check = check or self._kernel_check
        self.valid = ValidSpace(space, self._check, seed)
        self._seeds = list(seeds)  # (config, where it won) enqueued on a fresh study
        self.strategy = (strategy or registry.get(settings.strategy))(
            self._setup(seed, n_parallel))
        self.study = optuna.create_study(
            study_name=spec.name,
            storage=storage,
            direction="minimize",
            sampler=StrategySampler(self.strategy, self.valid),
            pruner=make_pruner(settings),
            load_if_exists=True,
        )
        #: The configs there are to measure: the valid ones where known, else the grid.
        self.grid = self.valid.count if self.valid.count is not None else spaces.grid_size(space)
        self._seen: dict[str, float | None] = {}  # config -> latency (None = failed)
        self._asks_left = (max_asks if max_asks is not None
                           else 20 * settings.trials + self.grid)
        self.asks = 0  # configs asked of the sampler by this object
        self._pruned: set[str] = set()  # distinct configs rejected by static pruning
        self._cheap_s: dict[str, float] = {}  # config -> its cheap pass's device seconds
        self._stall = 0  # asks in a row that brought no new config
        self.stalled = False
        self.exhausted = False  # the sampler found no valid untried config
        #: Why the study has nothing to measure (every config of its space is pruned).
        self.no_valid: str | None = self.valid.empty_reason
        self._resume()
        if self.no_valid:
            self.study.set_user_attr("stopped", self.no_valid)

    def _setup(self, seed: int, n_parallel: int) -> Setup:
        def point(config: Mapping[str, Any]) -> Any:
            return self.valid.index(config) if self._valid_point(config) else None

        default = point({k: v for k, v in self.default_config.items() if k in self.space})
        starts = tuple(p for p in (point(c) for c, _ in self._seeds) if p is not None)
        return Setup(self.valid, seed, self.settings.trials, n_parallel, default, starts)

    def _inform(self, config: Mapping[str, Any], outcome: Outcome) -> None:
        """Tell the strategy what became of a config (asked by it or not)."""
        point = self.valid.index(config)
        if point is not None:
            self.strategy.tell(point, outcome)

    def _kernel_check(self, config: Mapping[str, Any]) -> str | None:
        return self.kernel.check({**self.default_config, **config}, self.spec.shape,
                                 self.spec.dtype, self.device)

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
            status = t.user_attrs.get(ATTR_STATUS)
            if t.state == TrialState.COMPLETE:
                self._seen[key] = t.value
                if status == "measured":  # the strategy learns the past (not repeats)
                    self._inform(t.params, Outcome("measured", t.value, trial_cost_s(t)))
            elif t.state == TrialState.FAIL and status == "failed":
                self._seen[key] = None
                self._inform(t.params, Outcome("failed", None, trial_cost_s(t)))
            elif t.state == TrialState.PRUNED and status == "cut":
                self._seen[key] = math.inf  # stopped after its cheap pass: measured
                self._inform(t.params, Outcome("cut", t.user_attrs.get("cheap_ms"),
                                               trial_cost_s(t)))
            elif t.state == TrialState.PRUNED:
                self._pruned.add(key)
        if fresh and self.settings.warm_start:
            default = {k: v for k, v in self.default_config.items() if k in self.space}
            # Only enqueue the default where it is a valid point of this space.
            if self._valid_point(default):
                self.study.enqueue_trial(default)
        if fresh:
            self.study.set_user_attr("strategy", self.strategy.name
                                     or type(self.strategy).__name__)
        if fresh and self._seeds:
            for config, _ in self._seeds:
                if self._valid_point(config):
                    self.study.enqueue_trial(dict(config), skip_if_exists=True)
            self.study.set_user_attr("warm_start_seeds",
                                     [{"config": c, "from": w} for c, w in self._seeds])

    def enqueue(self, config: Mapping[str, Any]) -> None:
        """Have ``config`` asked next (after what is already queued), whatever it is."""
        self.study.enqueue_trial(dict(config))

    def _valid_point(self, config: Mapping[str, Any]) -> bool:
        idx = self.valid.index(config) if set(config) == set(self.space) else None
        return idx is not None and self.valid.reason(idx) is None

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
            if t.params and not self._waiting(t.params):
                # Not ``skip_if_exists``: the trial just failed has these very parameters.
                self.study.enqueue_trial(t.params)
                self.interrupted.append(dict(t.params))
        return self.study._storage.get_trial(tid)

    def _waiting(self, params: Mapping[str, Any]) -> bool:
        """Whether a trial with these parameters is already queued."""
        key = config_key(params)
        return any(config_key(w.params) == key
                   for w in self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))

    # -- the budget -----------------------------------------------------------------
    @property
    def pruned(self) -> int:
        """Distinct configs rejected by static pruning (a sampler may ask for one often)."""
        return len(self._pruned)

    @property
    def measured(self) -> int:
        """Distinct configs handed out (measured, failed, or still in flight): what the
        budget counts."""
        return len(self._seen)

    def done(self) -> bool:
        # ``measured`` already counts the configs in flight: adding the caller's in-flight
        # count would end the search early and leave the GPU's queue empty at its end.
        left = self.grid if self.valid.exact else self.grid - self.pruned
        return (self.measured >= self.settings.trials
                or self.measured >= left
                or self._asks_left <= 0 or self.stalled or self.exhausted
                or self.no_valid is not None)

    # -- ask / tell -----------------------------------------------------------------
    def ask(self) -> tuple[optuna.trial.Trial, dict[str, Any]] | None:
        """The next config worth measuring, or None when the study has nothing left."""
        while not self.done():
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
            self.asks += 1
            sampler = self.study.sampler
            if isinstance(sampler, StrategySampler):
                _ = trial.relative_params  # the strategy's ask (Optuna's is lazy)
                if sampler.exhausted_at == trial.number:
                    # No valid untried config is left (a large space: none was found).
                    self.exhausted = True
                    if self.measured == 0:
                        self.no_valid = self.valid.why_none_found()
                        self.study.set_user_attr("stopped", self.no_valid)
                    trial.set_user_attr(ATTR_REASON, "the strategy has no config left")
                    self.study.tell(trial, state=TrialState.FAIL)
                    break
            config = {name: trial.suggest_categorical(name, choices)
                      for name, choices in self.space.items()}
            idx = self.valid.index(config)
            reason = self.valid.reason(idx) if idx is not None else self._check(config)
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
            result = self.require_accuracy(result)
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
        cost = progress.result_cost_s(result.to_dict()) + self._cheap_s.pop(key, 0.0)
        self._inform(config, Outcome("measured" if result.ok else "failed",
                                     result.latency_ms if result.ok else None, cost))

    def cheap(self, trial: optuna.trial.Trial, config: Mapping[str, Any],
              result: TrialResult) -> bool:
        """Multi-fidelity: report a cheap measurement as step 0; True when the pruner stops
        the trial there (it is then told PRUNED, status ``cut``), False when it goes on to
        the full measurement. A failed cheap pass is the trial's result (failed)."""
        if result.ok:
            result = self.require_accuracy(result)
        if not result.ok:
            self.tell(trial, config, result)
            return True
        trial.report(result.latency_ms, 0)
        cost = progress.result_cost_s(result.to_dict())
        trial.set_user_attr(ATTR_CHEAP_S, cost)  # the trial's cost: its full pass adds to it
        self._cheap_s[config_key(config)] = cost
        if not trial.should_prune():
            return False
        trial.set_user_attr(ATTR_STATUS, "cut")
        trial.set_user_attr(ATTR_REASON, f"cheap pass {result.latency_ms:.4g} ms: pruned "
                            f"by the {self.settings.pruner} pruner")
        trial.set_user_attr("cheap_ms", result.latency_ms)
        self._seen[config_key(config)] = math.inf
        self.study.tell(trial, state=TrialState.PRUNED)
        self._inform(config, Outcome("cut", result.latency_ms, cost))
        return True

    def require_accuracy(self, result: TrialResult) -> TrialResult:
        """The experiment's accuracy requirement: a fast but less accurate config fails
        (in the search and in the finalists' re-measurement alike)."""
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

    def found_at(self, config: Mapping[str, Any] | None) -> dict[str, Any] | None:
        """How far into its search the study first measured ``config`` (its winner):
        ``progress.found_at``, against the study's budget."""
        return progress.found_at(self.study.get_trials(deepcopy=False), config,
                                 self.settings.trials)

    def counts(self) -> dict[str, int]:
        out = {"measured": 0, "failed": 0, "pruned": 0, "cut": 0, "duplicate": 0}
        for t in self.study.get_trials(deepcopy=False):
            status = t.user_attrs.get(ATTR_STATUS)
            if status in out:
                out[status] += 1
        return out

    def not_tuned(self) -> str | None:
        """Why the study has no winner (None: it has one): every config of its space
        pruned (with the kernel's reasons), every measured config failed, or none measured."""
        if self.best() is not None:
            return None
        if self.no_valid:
            return self.no_valid
        failed = self.failures()
        if failed:
            first = (failed[0][1] or "failed").splitlines()[0][:200]
            return f"every measured config failed ({len(failed)}), e.g. {first}"
        return "no config was measured"

    def failures(self) -> list[tuple[dict[str, Any], str]]:
        return [(dict(t.params), t.user_attrs.get(ATTR_REASON, ""))
                for t in self.study.get_trials(deepcopy=False)
                if t.user_attrs.get(ATTR_STATUS) == "failed"]

    def set_attr(self, key: str, value: Any) -> None:
        # Optuna stores attrs as JSON: NaN goes in as None.
        self.study.set_user_attr(key, json_safe(value))

    def attr(self, key: str, default: Any = None) -> Any:
        return self.study.user_attrs.get(key, default)
