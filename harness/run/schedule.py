"""The scheduler: which study's work each GPU gets next, from the first baseline to the
last re-measurement, with no step that waits for all studies.

Each worker with room takes work from the study it serves; a worker whose study has
nothing to hand out takes the study served by the fewest workers, so that studies spread
over every GPU of their hardware key, and several GPUs share a study once fewer studies
than GPUs are left. A study re-measures its finalists (``harness.run.remeasure``) as soon as
its own search is over, on one GPU, while other studies still search; that takes
precedence over search work, so that the last studies do not end in a long tail.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from harness import experiment
from harness.fleet import Fleet, Task
from harness.kernel.api import DeviceSpec, Kernel
from harness.measure.timing import TrialResult
from harness.run import remeasure
from harness.search import Search, warmstart
from harness.search.keys import config_key
from harness.search.strategies import registry as strategies
from harness.search.strategies.base import Setup

log = logging.getLogger(__name__)

#: The most configs a new worker is given to compile while it starts (``known_configs``):
#: the first of a larger grid, in the order they will be asked for. Well under what the
#: compile-ahead keeps track of (``Precompiler.MAX_PENDING``), which forgets the oldest.
MAX_KNOWN = 512


@dataclass
class StudyState:
    """One study through the run: its search, then its final phase (``start_remeasure``):
    the finalists re-measured in interleaved rounds and, in the same rounds, the
    baselines (PyTorch eager, torch.compile, and the kernel's default config where the
    search did not measure it), so that the first trial never waits behind a baseline
    and every speed-up compares measurements taken side by side. ``plan``: the study
    as the run planned it, on the device its workers report."""

    plan: experiment.StudyPlan
    search: Search
    run_id: str
    worker: dict[str, Any]
    in_flight: int = 0
    eager: dict[str, Any] | None = None  # the PyTorch eager baseline's result
    default: dict[str, Any] | None = None  # the kernel's default config's result
    compiled: dict[str, Any] | None = None  # the eager code under torch.compile
    want_compile: bool = False  # whether this study times the torch.compile baseline
    prebuilt: bool = False  # its torch.compile baseline was sent to be built off the GPU
    pending: set[str] = field(default_factory=set)  # work in flight outside the search
    failures: int = 0
    best_ms: float = math.inf
    candidates: list[remeasure.Candidate] = field(default_factory=list)  # re-measured top k
    # The pack's current winner as this study measured it (config, result), if near the best
    incumbent: tuple[dict[str, Any], dict[str, Any]] | None = None
    default_config: dict[str, Any] | None = None  # the default among the candidates
    final: tuple[dict[str, Any], str] | None = None  # (winner config, why) after re-measuring
    full: list[tuple[Any, dict[str, Any]]] = field(default_factory=list)  # past the cheap pass
    #: "search", then "remeasure" (its finalists, on ``slot``), then "done"
    phase: str = "search"
    remeasure_todo: list[Task] = field(default_factory=list)
    remeasure_left: int = 0
    slot: int | None = None  # the worker that re-measures it
    #: The baselines timed in the final phase's rounds: eager, compile, default
    baselines: dict[str, remeasure.Candidate] = field(default_factory=dict)
    #: When its search ended and its re-measurement began and ended (monotonic seconds)
    times: dict[str, float] = field(default_factory=dict)
    #: Its experiment's do_bench budgets where they differ from the fleet's defaults
    #: (a campaign's experiments share one fleet), sent with each of its tasks
    timing: dict[str, float] = field(default_factory=dict)

    @property
    def spec(self) -> experiment.StudySpec:
        return self.plan.spec

    @property
    def device(self) -> DeviceSpec:
        return self.plan.device

    @property
    def family(self) -> Kernel:
        return self.plan.family


def first_studies(studies: list[experiment.StudyPlan]) -> dict[str, experiment.StudyPlan]:
    """Each hardware key's first study: the one its workers start on."""
    out: dict[str, experiment.StudyPlan] = {}
    for study in studies:
        out.setdefault(study.spec.hardware, study)
    return out


def known_configs(study: experiment.StudyPlan, strategy_asks: int | None = None
                  ) -> list[dict[str, Any]]:
    """The configs a study is known to measure before its search starts: the kernel's
    default (a baseline), the packs' winners it starts from (``search.seed_from_packs``)
    and the first ``trials`` configs its strategy asks whatever the results
    (``Strategy.ahead``: a grid's order; at most ``strategy_asks`` of them where given),
    where they pass static pruning on the hardware key's static spec (the worker's own
    device prunes again; a config compiled ahead in vain costs a compile child's time,
    not the GPU's)."""
    fam, spec, device, settings = study.family, study.spec, study.device, study.search
    space = study.space
    # The search asks first for the configs it enqueues (the winners of packs), then
    # for what its strategy chooses: compiled in that order, what is timed first is
    # compiled first.
    out = [dict(fam.default_config)]
    seeds = []
    if settings.seed_from_packs:
        seeds = [dict(c) for c, _ in warmstart.seeds_from_packs(
            study.packs_dir, fam, spec.dtype, spec.hardware, spec.shape, space, device)]
    out += seeds
    n = min(MAX_KNOWN - len(out), settings.trials,
            MAX_KNOWN if strategy_asks is None else strategy_asks)
    if n <= 0:
        return out
    # As the study's own search checks them (every config of a space of up to
    # ``EXACT_LIMIT``, else lazily): a sampler's proposal is repaired into the valid set
    # by another path in each, and the guesses must be the study's asks.
    valid = study.valid()

    def point(config: dict[str, Any]) -> Any:
        """The config's valid point of the space, as the study's own set-up finds it."""
        config = {k: v for k, v in config.items() if k in valid.names}
        idx = valid.index(config) if set(config) == set(valid.names) else None
        return idx if idx is not None and valid.reason(idx) is None else None

    starts = tuple(p for p in map(point, seeds) if p is not None)
    strategy = strategies.get(settings.strategy)(
        Setup(valid, study.seed, settings.trials, 1, point(out[0]), starts))
    return out + [valid.config(p) for p in strategy.ahead(n)]


def study_task(st: StudyState, hw: str, searching: bool = True) -> Task | None:
    """The study's next search task: its trials (the kernel's default config first where
    ``search.warm_start``); None when it has none to hand out now. The baselines come in
    its final phase (``start_remeasure``), never ahead of a trial. ``searching``: False
    once the run's time is up (configs in their full pass only)."""
    spec = st.spec
    own = (st.timing,) if st.timing else ()  # its experiment's budgets, not the fleet's
    if st.full:  # configs the pruner let through their cheap pass: now in full
        trial, config = st.full.pop(0)
        return Task(hw, "measure", (spec.kernel, spec.shape, spec.dtype, config, 0, *own),
                    ("trial", st, trial, config))
    if not searching:
        return None
    asked = st.search.ask()
    if asked is None:
        return None
    trial, config = asked
    st.in_flight += 1
    settings = st.search.settings
    if settings.pruner != "none":  # multi-fidelity: a cheap pass first
        return Task(hw, "measure", (spec.kernel, spec.shape, spec.dtype, config, 0,
                                    {"rep_ms": settings.cheap_rep_ms,
                                     "warmup_ms": settings.cheap_rep_ms}),
                    ("cheap", st, trial, config))
    return Task(hw, "measure", (spec.kernel, spec.shape, spec.dtype, config, 0, *own),
                ("trial", st, trial, config))


def remeasure_tasks(exp: experiment.Experiment, st: Any,
                    timing: Mapping[str, float] | None = None) -> list[Task]:
    """The final phase's tasks: ``remeasure_rounds`` interleaved rounds (one where no
    finalist is re-measured: under the interpreter), each timing every finalist of
    ``st.candidates`` and then every baseline of ``st.baselines`` with
    ``remeasure_rep_ms`` (at least the search's budget), tagged with what it times and
    its round, with ``remeasure_warmup_ms`` of warm-up. One GPU times them all (one
    group): interleaving only cancels drifts where they are compared on the same
    device. ``timing``: the experiment's own budgets, where they differ from the
    fleet's (``StudyState.timing``)."""
    rep = max(exp.search.remeasure_rep_ms, exp.timing.rep_ms)
    budgets = dict(timing or {})
    if rep > exp.timing.rep_ms:
        budgets["rep_ms"] = rep
    full_warmup = budgets.get("warmup_ms", exp.timing.warmup_ms)
    if exp.search.remeasure_warmup_ms < full_warmup:
        budgets["warmup_ms"] = exp.search.remeasure_warmup_ms
    longer = (budgets,) if budgets else ()
    spec, group = st.spec, f"remeasure {st.spec.name}"
    n_cands = len(st.candidates)
    rounds = exp.search.remeasure_rounds if n_cands else 1
    out: list[Task] = []
    for round_ in range(rounds):
        for i in range(n_cands):
            out.append(Task(spec.hardware, "measure",
                            (spec.kernel, spec.shape, spec.dtype, st.candidates[i].config, 0,
                             *longer), ("remeasure", st, i, round_), group=group))
        for name, cand in st.baselines.items() if round_ < remeasure.BASELINE_ROUNDS else ():
            if name == "default":
                args: tuple = (spec.kernel, spec.shape, spec.dtype, cand.config, 0, *longer)
                method = "measure"
            else:
                args = (spec.kernel, spec.shape, spec.dtype, 0, name == "compile", *longer)
                method = "eager"
            out.append(Task(spec.hardware, method, args, ("baseline", st, name, round_),
                            group=group))
    return out


def incumbent(st: StudyState, top: list[tuple[dict[str, Any], dict[str, Any]]]
              ) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The pack's current winner for the study's shape, as the study measured it (its
    trial's config and result), where the search found it within
    ``remeasure.INCUMBENT_BAND`` of its best; where the search never measured it (a
    narrower space, or a sampler that did not draw it), the pack's config with no
    result, so that it is re-measured beside the top configs all the same and a search
    cannot replace it unseen; None where there is none, or it cannot run here."""
    fam = st.family
    held = warmstart.incumbent(st.plan.packs_dir, fam, st.spec.dtype, st.spec.hardware,
                               st.spec.shape)
    if held is None:
        return None
    best = top[0][1].get("latency_ms", math.nan)
    for cfg, res in st.search.top(10**9):
        if {**fam.default_config, **cfg} == held:
            near = res.get("latency_ms", math.inf) <= best * (1 + remeasure.INCUMBENT_BAND)
            return (cfg, res) if near else None
    if fam.check_config(held, st.spec.shape, st.device) is not None:
        return None
    return held, {}


def searched_default(st: StudyState) -> dict[str, Any] | None:
    """What the search measured of the kernel's default config (``search.warm_start``
    asks it first), None where it did not measure it successfully."""
    fam = st.family
    for cfg, res in st.search.top(10**9):
        if fam.is_default(cfg):
            return dict(res)
    return None


def _default_candidate(st: StudyState) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The kernel's default config, with what the search measured of it ({} where it
    did not): it is re-measured beside the finalists and is never beaten within noise.
    None where it cannot run on this device."""
    fam = st.family
    if fam.check_config(dict(fam.default_config), st.spec.shape, st.device) is not None:
        return None
    space = st.search.space
    cfg = {k: v for k, v in fam.default_config.items() if k in space}
    return cfg, (searched_default(st) or {})


def start_remeasure(exp: experiment.Experiment, st: StudyState) -> None:
    """The study's search is over: plan its final phase, the finalists' re-measurement
    and the baselines in the same rounds (or, with nothing to time, be done)."""
    st.times["search_done"] = time.monotonic()
    k = remeasure.top_k(exp.search.remeasure_top_k, st.device.interpreted)
    top = st.search.top(k) if k > 1 else []
    default = _default_candidate(st)
    if st.default is None and default is not None and default[1]:
        st.default = default[1]  # the search's measurement, until a re-measurement
    if len(top) >= 2:
        st.incumbent = incumbent(st, top)
        st.default_config = default[0] if default else None
        st.candidates = remeasure.candidates(top, st.incumbent, default)
    wanted = {"eager": st.eager is None, "compile": st.want_compile and st.compiled is None,
              # Timed on its own where no finalist round times it and the search did not
              # (even where it fails the static checks: it is what runs without a pack):
              # a kernel's default is one of the speed-ups the summary shows.
              "default": st.default is None and (default is None or not st.candidates)}
    fam = st.family
    st.baselines = {name: remeasure.Candidate(
        dict(fam.default_config) if name == "default" else {"baseline": name}, math.nan)
        for name, want in wanted.items() if want}
    if st.search.best() is None:
        st.baselines = {}  # nothing to compare them with: the study tuned nothing
    st.remeasure_todo = remeasure_tasks(exp, st, st.timing)
    st.remeasure_left = len(st.remeasure_todo)
    st.phase = "remeasure" if st.remeasure_todo else "done"
    if st.phase == "done":
        st.times["done"] = time.monotonic()


def finish_baselines(st: StudyState) -> dict[str, dict[str, Any]]:
    """Each baseline's outcome once its rounds are timed: the measurement of its median
    round (a failure where no round succeeded), set on the study and in its Optuna
    study (what ``--resume`` reads). The default config, where it was a finalist, takes
    its re-measured median: the speed-up over it compares rounds taken side by side."""
    out: dict[str, dict[str, Any]] = {}
    for name, cand in st.baselines.items():
        if cand.samples:
            out[name] = {**cand.median_result, "latency_ms": cand.median,
                         "rounds": len(cand.samples)}
        else:
            reason = cand.failures[0] if cand.failures else "not measured"
            out[name] = TrialResult(ok=False, reason=reason).to_dict()
    if st.default_config is not None:
        fam = st.family
        mine = next((c for c in st.candidates if c.samples and fam.is_default(c.config)),
                    None)
        if mine is not None:
            out["default"] = {**mine.median_result, "latency_ms": mine.median,
                              "rounds": len(mine.samples)}
    for name, res in out.items():
        setattr(st, "compiled" if name == "compile" else name, res)
        st.search.set_attr(name, res)
    return out


def decide(studies: list[StudyState]) -> None:
    """Each re-measured study's winner: its fastest finalist, ties broken by robustness
    across the neighbouring studies of the same experiment, kernel, dtype and hardware
    (a campaign decides each experiment as a run of it alone would), the pack's
    current winner, and the kernel's default config above all (``remeasure.decide``)."""
    for st in studies:
        if not st.candidates:
            continue
        others = [remeasure.best_estimates(o.search.latencies(), o.candidates)
                  for o in studies if o is not st
                  and (o.spec.experiment, o.spec.kernel, o.spec.dtype, o.spec.hardware)
                  == (st.spec.experiment, st.spec.kernel, st.spec.dtype, st.spec.hardware)]
        chosen = remeasure.decide(st.candidates,
                                  lambda c, n=others: remeasure.robustness(c, n),
                                  incumbent=st.incumbent[0] if st.incumbent else None,
                                  default=st.default_config)
        if chosen is not None:
            st.final = (chosen[0].config, chosen[1])


class Scheduler:
    """Hands each worker its next tasks and takes the results back (``run``)."""

    def __init__(self, experiments: Sequence[experiment.Experiment], fleet: Fleet,
                 studies: list[StudyState],
                 on_result: Callable[[Task, TrialResult], None],
                 on_tick: Callable[[], None] = lambda: None,
                 on_search_done: Callable[[StudyState], None] = lambda st: None,
                 on_done: Callable[[StudyState], None] = lambda st: None,
                 first_trials: Callable[[], tuple[str, dict[str, tuple[dict[str, Any], float]]]
                                        | None] | None = None) -> None:
        """``experiments``: the studies' experiments (several: a campaign, one fleet);
        ``on_result``: a search task's result (``members.record``); ``on_tick``: called once
        per turn of the loop (the storage's and the logger's bookkeeping);
        ``on_search_done``: a study's search has ended (its plots can be drawn);
        ``on_done``: its final phase has ended (its baselines are known);
        ``first_trials``: stops the head start's measuring and returns what it measured
        of one study's first asks (``harness.fleet.first_trials``), called before any
        task is sent: those asks are answered with it."""
        self.exps = {e.name: e for e in experiments}
        self.fleet, self.studies = fleet, studies
        self.on_result, self.on_tick = on_result, on_tick
        self.on_search_done = on_search_done
        self.on_done = on_done
        self.by_hw: dict[str, list[StudyState]] = {}
        for st in studies:
            self.by_hw.setdefault(st.spec.hardware, []).append(st)
        self.serving: dict[int, StudyState] = {}  # worker slot -> the study it serves
        #: Each experiment's search.timeout_s runs from its first task: in a campaign on
        #: few GPUs, an experiment may wait for others before its studies get one.
        self.began: dict[str, float] = {}
        #: Driver seconds spent choosing and sending tasks, and handling results
        self.driver_s = {"hand_out": 0.0, "results": 0.0, "tasks": 0}
        #: When the first and last search trials' results came, and the last result
        self.times: dict[str, float] = {}
        self._hinted: set[int] = set()  # worker slots told the coming studies' configs
        self._coming: dict[int, list[dict[str, Any]]] = {}  # id(study) -> what it tells
        self._take_first = first_trials
        #: The head start's results not asked for yet: (study name, config key) ->
        #: (result, when it came); and how many it measured and the search used.
        self._first: dict[tuple[str, str], tuple[dict[str, Any], float]] = {}
        self.premeasured: dict[str, int] = {}


    # -- choosing ---------------------------------------------------------------------
    def _exp(self, st: StudyState) -> experiment.Experiment:
        return self.exps[st.spec.experiment]

    def _searching(self, st: StudyState) -> bool:
        """Whether the study's experiment is still inside its ``search.timeout_s``."""
        limit = self._exp(st).search.timeout_s
        began = self.began.get(st.spec.experiment)
        return not limit or began is None or time.monotonic() <= began + limit

    def _advance(self, st: StudyState) -> None:
        """A study whose search has nothing left and nothing in flight re-measures."""
        if (st.phase == "search" and st.in_flight == 0 and not st.pending and not st.full
                and (not self._searching(st) or st.search.done())):
            start_remeasure(self._exp(st), st)
            self.on_search_done(st)
            if st.phase == "done":
                self._finish(st)

    def _task_for(self, st: StudyState, slot: int, hw: str) -> Task | None:
        if st.phase == "remeasure":
            if st.slot is None:
                st.slot = slot
                st.times["remeasure_started"] = time.monotonic()
            if st.slot != slot or not st.remeasure_todo:
                return None
            return st.remeasure_todo.pop(0)
        if st.phase != "search":
            return None
        task = study_task(st, hw, self._searching(st))
        if task is None:
            self._advance(st)
        else:
            self.began.setdefault(st.spec.experiment, time.monotonic())
        return task

    def _next(self, slot: int, hw: str) -> Task | None:
        """The slot's next task: its study's re-measurement, a re-measurement waiting
        for a GPU, its own study's search, then the study the fewest workers serve."""
        sts = self.by_hw[hw]
        mine = self.serving.get(slot)
        waiting = [s for s in sts if s.phase == "remeasure" and s.slot is None]
        order: list[StudyState] = []
        if mine is not None and mine.phase == "remeasure" and mine.slot == slot:
            order.append(mine)
        order += [s for s in sts if s.phase == "remeasure" and s.slot == slot
                  and s is not mine]
        order += waiting
        if mine is not None and mine.phase == "search":
            order.append(mine)
        load = {id(s): 0 for s in sts}
        for s in self.serving.values():
            if id(s) in load:
                load[id(s)] += 1
        order += sorted((s for s in sts if s.phase == "search" and s is not mine),
                        key=lambda s: load[id(s)])
        for st in order:
            task = self._task_for(st, slot, hw)
            if task is not None:
                self.serving[slot] = st
                if st.want_compile and not st.prebuilt:
                    # Built by the node's compile service while the study searches, so
                    # that its final rounds find Inductor's output in the caches.
                    st.prebuilt = True
                    self.fleet.prebuild(hw, st.spec.kernel, st.spec.shape, st.spec.dtype, 0)
                return task
        return None

    def _hand_out(self) -> bool:
        """Fill every worker's queue; whether any work is left to hand out later."""
        t0 = time.perf_counter()
        left = False
        alive = {s.id for s in self.fleet.slots}
        for st in self.studies:  # its worker left the fleet: another one re-measures it
            if st.slot is not None and st.slot not in alive:
                st.slot = None
        for hw in self.by_hw:
            for slot in self.fleet.rooms(hw).keys() - self._hinted:
                self._hint(slot, hw)
            for slot, room in self.fleet.rooms(hw).items():
                sent = 0
                while sent < room:
                    task = self._next(slot, hw)
                    if task is None:
                        break
                    if self._answered(task):
                        continue
                    self.fleet.submit(task, to=slot)
                    self.driver_s["tasks"] += 1
                    sent += 1
            left |= any(s.phase != "done" for s in self.by_hw[hw]) and bool(
                self.fleet.workers(hw))
        self.driver_s["hand_out"] += time.perf_counter() - t0
        return left

    def _hint(self, slot: int, hw: str) -> None:
        """Tell a newly ready worker what the studies it may serve are known to measure
        (``known_configs``), in the order they run, up to ``MAX_KNOWN`` configs: their
        compiles then overlap the timing of the studies before them. On a grid of many
        small studies (the outside softmax: 12 x 40 configs, a second each to compile,
        50 ms to time) the GPU otherwise waited for each config's compile as it was
        queued: 62 s of a 1-GPU run's 109 s on an H200."""
        self._hinted.add(slot)
        budget = MAX_KNOWN
        for st in self.by_hw[hw]:
            if budget <= 0:
                break
            if st.phase != "search" or st.search.measured:
                continue  # begun: its configs are queued as it asks for them
            configs = self._coming.get(id(st))
            if configs is None:
                # Past its first asks (those in flight before a result) a walk follows
                # the measurements: its later guesses would keep the compile processes
                # busy for nothing, and take the driver 70 ms a study to draw.
                exact = strategies.get(st.plan.search.strategy).ahead_whatever_results
                configs = self._coming[id(st)] = known_configs(
                    st.plan, None if exact else self.fleet.depth(hw))
            configs = configs[:budget]
            budget -= len(configs)
            self.fleet.hint(slot, st.spec.kernel, st.spec.shape, st.spec.dtype, 0, configs)

    def _answered(self, task: Task) -> bool:
        """A trial the head start measured already: its result taken as if a worker had
        just returned it (the first trial's time: when the head start had it)."""
        if task.tag[0] != "trial" or not self._first:
            return False
        got = self._first.pop((task.tag[1].spec.name, config_key(task.tag[3])), None)
        if got is None:
            return False
        res, at = got
        self.times["first_trial"] = min(self.times.get("first_trial", at), at)
        self.premeasured["used"] = self.premeasured.get("used", 0) + 1
        self._result(task, TrialResult(**res))
        return True

    def _take_first_trials(self) -> None:
        if self._take_first is None:
            return
        try:
            taken = self._take_first()
        except Exception as exc:  # only a head start: the fleet measures them
            log.warning("the head start's first trials were not taken: %s", exc)
            return
        if taken:
            study, results = taken
            self._first = {(study, key): v for key, v in results.items()}
            self.premeasured = {"measured": len(results), "used": 0}

    # -- results ----------------------------------------------------------------------
    def _result(self, task: Task, result: TrialResult) -> None:
        kind, st = task.tag[0], task.tag[1]
        self.times["last_result"] = time.monotonic()
        if kind in ("remeasure", "baseline"):
            _, st, i, round_ = task.tag
            cand = st.candidates[i] if kind == "remeasure" else st.baselines[i]
            if kind == "remeasure" and result.ok:
                # A finalist the search never measured (the pack's incumbent, the
                # kernel's default) meets the experiment's accuracy requirement here.
                result = st.search.require_accuracy(result)
            if result.ok:
                cand.add(result.latency_ms, round_, result.to_dict())
                if kind == "remeasure":
                    self._prune(st)
            else:
                cand.failures.append(result.reason)
                if kind == "baseline":
                    self._drop_rounds(st, i)
            st.remeasure_left -= 1
            if st.remeasure_left <= 0:
                self._finish(st)
            return
        if kind in ("trial", "cheap"):
            self.times.setdefault("first_trial", time.monotonic())
            self.times["last_trial"] = time.monotonic()
        self.on_result(task, result)
        self._advance(st)

    @staticmethod
    def _drop_unsent(st: StudyState, kind: str, names: Collection[Any]) -> None:
        """The final-phase tasks of ``kind`` for ``names`` not sent yet are not sent."""
        keep = [t for t in st.remeasure_todo if not (t.tag[0] == kind and t.tag[2] in names)]
        st.remeasure_left -= len(st.remeasure_todo) - len(keep)
        st.remeasure_todo = keep

    def _prune(self, st: StudyState) -> None:
        """Finalists clearly behind the best (``remeasure.outclassed``): their rounds not
        yet sent are dropped."""
        self._drop_unsent(st, "remeasure", set(remeasure.outclassed(st.candidates)))

    def _drop_rounds(self, st: StudyState, name: str) -> None:
        """A baseline failed a round: its later rounds are not sent. Its failure is an
        error that repeats, or a hang that would cost a worker and a trial time-out per
        round (a torch.compile that never finishes) and hold the study's GPU meanwhile."""
        self._drop_unsent(st, "baseline", {name})

    def _finish(self, st: StudyState) -> None:
        """The study's final phase is over: its baselines are known."""
        st.phase = "done"
        st.times.setdefault("done", time.monotonic())
        finish_baselines(st)
        self.on_done(st)

    def _give_up(self, hw: str) -> None:
        """Every worker of ``hw`` is gone: its studies keep what came back."""
        for st in self.by_hw[hw]:
            if st.phase != "done":
                st.phase = "done"
                st.times["done"] = time.monotonic()

    # -- the loop ---------------------------------------------------------------------
    def run(self, console: Console, show: bool) -> None:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), TextColumn("{task.fields[status]}"),
                      console=console, disable=not show, transient=False) as prog:
            bars = {hw: prog.add_task(
                f"{hw:>6}", total=sum(min(s.search.settings.trials, s.search.grid) for s in sts),
                completed=sum(s.search.measured for s in sts), status="")
                for hw, sts in self.by_hw.items()}

            def refresh(hw: str) -> None:
                sts = self.by_hw[hw]
                best = [f"{s.spec.shape_key}: {s.best_ms:.3g} ms" for s in sts
                        if s.best_ms < math.inf]
                fails = sum(s.failures for s in sts)
                done = sum(s.phase == "done" for s in sts)
                prog.update(bars[hw],
                            completed=sum(s.search.measured - s.in_flight for s in sts),
                            status=f"best {'; '.join(best[-2:]) or '-'} | failed {fails} | "
                                   f"studies done {done}/{len(sts)}")

            # Before any task reaches a worker: the head start's measuring ends first.
            self._take_first_trials()
            while True:
                for sts in self.by_hw.values():
                    for st in sts:
                        self._advance(st)
                left = self._hand_out()
                if self.fleet.in_flight() == 0 and not left:
                    break
                polled = self.fleet.poll(0.5)
                t0 = time.perf_counter()
                for task, result in polled:
                    self._result(task, result)
                self.driver_s["results"] += time.perf_counter() - t0
                for hw in {t.hardware for t, _ in polled}:
                    refresh(hw)
                for hw in self.by_hw:
                    if not self.fleet.workers(hw):
                        self._give_up(hw)
                self.on_tick()
            for hw in self.by_hw:
                refresh(hw)
        decide(self.studies)
