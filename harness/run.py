"""The ``run`` job: experiment -> plan -> search on the fleet -> track -> freeze packs.

This module only wires the homes together; each decision lives in its own module.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import itertools
import json
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from harness import experiment, kernel_api, remeasure, spaces, warmstart
from harness.fleet import Fleet, NoHardwareError, Task
from harness.fleet import code_version as fleet_code_version
from harness.hardware import spec_for_key
from harness.kernel_api import DeviceSpec
from harness.measure import Timing, TrialResult
from harness.packs import format as packfmt
from harness.search import ATTR_RESULT, ATTR_STATUS, Search, grid_order, make_storage, storage_url
from harness.tracking.redact import redact
from harness.tracking.tracker import (
    Tracker,
    TrialLogger,
    git_sha,
    log_trial_record,
    start_trial_logger,
)

log = logging.getLogger(__name__)

#: ``search.remeasure_top_k: auto`` on GPUs. Five, not three: a config's search time is
#: taken at the clock of its moment (an H200 at its power cap moves between ~1500 and
#: 1980 MHz), and in one of four runs of the 8192^3 grid (2026-11-23, session 8) the config
#: the other three chose was fifth by its search time, 16 % behind, and never re-measured.
AUTO_TOP_K = 5

#: How long the end of a run waits for the MLflow logger to catch up.
LOGGER_FLUSH_S = 300.0

#: The most configs a new worker is given to compile while it starts (``_known_configs``):
#: the first of a larger grid, in the order they will be asked for. Well under what the
#: compile-ahead keeps track of (``Precompiler.MAX_PENDING``), which forgets the oldest.
MAX_KNOWN = 512
#: Grid positions ``_known_configs`` checks at most (a large space, valid configs sparse).
MAX_GRID_SCAN = 20_000


@dataclass
class StudyState:
    spec: experiment.StudySpec
    search: Search
    run_id: str
    device: DeviceSpec
    worker: dict[str, Any]
    in_flight: int = 0
    eager: dict[str, Any] | None = None  # the PyTorch eager baseline's result
    default: dict[str, Any] | None = None  # the kernel's default config's result
    compiled: dict[str, Any] | None = None  # the eager code under torch.compile
    want_compile: bool = False  # whether this study times the torch.compile baseline
    pending: set[str] = field(default_factory=set)  # baselines in flight
    failures: int = 0
    best_ms: float = math.inf
    candidates: list[remeasure.Candidate] = field(default_factory=list)  # re-measured top k
    # The pack's current winner as this study measured it (config, result), if near the best
    incumbent: tuple[dict[str, Any], dict[str, Any]] | None = None
    final: tuple[dict[str, Any], str] | None = None  # (winner config, why) after re-measuring
    full: list[tuple[Any, dict[str, Any]]] = field(default_factory=list)  # past the cheap pass


@dataclass
class Summary:
    rows: list[dict[str, Any]] = field(default_factory=list)
    packs: list[str] = field(default_factory=list)
    missing_hardware: list[str] = field(default_factory=list)
    interpreted: bool = False
    parent_run_id: str = ""
    tracking_uri: str = ""
    wall_s: float = 0.0
    busy_s: dict[str, float] = field(default_factory=dict)
    held_s: float = 0.0  # GPU-held seconds: every worker from ready to released, summed
    timing_s: float = 0.0  # of which inside the kernel timer (do_bench)
    timing_fraction: float = math.nan  # timing_s / held_s: 1 - the harness's overhead
    overhead: dict[str, float] = field(default_factory=dict)  # held seconds by phase
    first_calls: dict[str, int] = field(default_factory=dict)  # Fleet.first_calls
    timeline: dict[str, float] = field(default_factory=dict)  # wall seconds at each step
    #: hardware key -> its first worker's start-up by step, seconds (Worker.startup_s)
    worker_startup: dict[str, dict[str, float]] = field(default_factory=dict)
    #: The search's MLflow logger: when it was ready and last caught up (wall seconds),
    #: trials logged, seconds spent on them and on the plots
    mlflow_logger: dict[str, float] = field(default_factory=dict)
    t0: float = field(default_factory=time.monotonic, repr=False)

    def mark(self, step: str) -> None:
        """Note the wall time (seconds since the run started) at which ``step`` ended."""
        self.timeline.setdefault(step, round(time.monotonic() - self.t0, 2))
    replaced: int = 0  # workers replaced (device fault, hang, lost)
    reused: int = 0  # kept workers of an earlier run this run leased (fleet.keep_workers_s)
    retried: int = 0  # trials sent again after their worker was lost
    events: list[str] = field(default_factory=list)
    resumed: dict[str, Any] = field(default_factory=dict)  # what --resume found


def _device_from_info(info: dict[str, Any]) -> DeviceSpec:
    """The study's device: what the worker sees, or, for a worker that runs the
    interpreter on a node standing in for a GPU type (a simulated cluster), that type's
    static spec, so that the study prunes and picks its vendor's space as on the GPU."""
    key = info["worker_hardware"]
    if info["interpreted"] and key != "cpu":
        return dataclasses.replace(spec_for_key(key), interpreted=True)
    return DeviceSpec(key=key, vendor=info["vendor"],
                      name=info["device_name"], sm_count=info["sm_count"],
                      smem_per_block=info["smem_per_block"], has_tma=info["has_tma"],
                      interpreted=info["interpreted"],
                      has_wgmma=bool(info.get("has_wgmma", False)))


def _state_file(exp: experiment.Experiment) -> Path:
    return Path(exp.output.runs_dir) / exp.name / "state.json"


def _trial_log_file(exp: experiment.Experiment) -> Path:
    """Which trials have their MLflow run: one JSON line per trial, written after the run
    is logged, so that a resumed run logs exactly the trials a killed driver had not."""
    return Path(exp.output.runs_dir) / exp.name / "mlflow_trials.jsonl"


def _missing_message(key: str, available: dict[str, int], unlabelled: int,
                     waited_s: float) -> str:
    found = ", ".join(f"{k}×{n}" for k, n in available.items()) or "no GPUs"
    msg = f"hardware {key}: no {key} GPUs in this cluster (found: {found})"
    if waited_s:
        msg += f", after waiting {waited_s:g} s for the autoscaler"
    else:
        msg += "; set fleet.wait_for_nodes_s to wait for an autoscaler to add them"
    if unlabelled:
        msg += (f"; {unlabelled} GPU(s) advertise no accelerator_type, so their type is "
                "unknown: Ray does not recognise every GPU (a V710 node needs `ray start "
                "--resources='{\"accelerator_type:V710\": 1}'`)")
    elif key == "V710":
        msg += (" (Ray does not detect the V710 itself: start its nodes with "
                "--resources='{\"accelerator_type:V710\": 1}')")
    return msg + "; its studies are skipped"


class _Background:
    """Calls run in order on one thread of the driver (the MLflow logger's stand-in where
    no Ray actor could be started for it)."""

    def __init__(self) -> None:
        self._q: queue.Queue = queue.Queue()
        self.errors: list[str] = []
        self._thread = threading.Thread(target=self._work, name="harness-mlflow", daemon=True)
        self._thread.start()

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self._q.put((fn, args, kwargs))

    def _work(self) -> None:
        while True:
            item = self._q.get()
            try:
                if item is None:
                    return
                fn, args, kwargs = item
                fn(*args, **kwargs)
            except Exception as exc:  # tracking must not stop the tuning
                self.errors.append(f"{type(exc).__name__}: {exc}"[:300])
                log.warning("MLflow logging failed: %s", exc)
            finally:
                self._q.task_done()

    def flush(self) -> None:
        self._q.join()

    def close(self) -> None:
        self._q.put(None)
        self._thread.join()


class _Logs:
    """Where the search's MLflow logging goes, in order and off the driver's loop: a
    ``TrialLogger`` in a process of its own (``track.start_trial_logger``) for the
    trials, and a second one that imports the plotting code as the search starts and
    draws the studies' plots at its end, beside the first one catching up (one
    process doing both fell seconds behind the trials); or, where no actor can be
    started, one sharing the driver's Tracker on a thread."""

    def __init__(self, tracker: Tracker, experiment_name: str) -> None:
        self._actor: Any = None
        self._plotter: Any = None
        self._bg: _Background | None = None
        self.stats: dict[str, float] = {}  # TrialLogger.stats, as of the last flush
        try:
            self._actor = start_trial_logger(tracker.uri, experiment_name)
            self._plotter = start_trial_logger(tracker.uri, experiment_name, plots=True)
        except Exception as exc:
            log.warning("MLflow logger process unavailable (%s): logging on a thread", exc)
            self._local = TrialLogger.sharing(tracker)
            self._bg = _Background()
            self._bg.call(self._local.warm_plots)

    def trial(self, trial_log: Path, rec: dict[str, Any]) -> None:
        if self._actor is not None:
            self._actor.trial.remote(str(trial_log), rec)
        else:
            self._bg.call(self._local.trial, str(trial_log), rec)  # type: ignore[union-attr]

    def log(self, run_id: str, params: dict[str, Any] | None = None,
            metrics: dict[str, Any] | None = None) -> None:
        if self._actor is not None:
            self._actor.log.remote(run_id, params=params, metrics=metrics)
        else:
            self._bg.call(self._local.log, run_id, params=params,  # type: ignore[union-attr]
                          metrics=metrics)

    def plots(self, run_id: str, storage: str, study_name: str, title: str) -> None:
        """Draw a finished study's plots into its MLflow run (``TrialLogger.plots``)."""
        if self._plotter is not None:
            self._plotter.plots.remote(run_id, storage, study_name, title)
        else:
            self._bg.call(self._local.plots, run_id, storage,  # type: ignore[union-attr]
                          study_name, title)

    def flush(self) -> list[str]:
        """Wait until every call so far has run; the errors they met."""
        if self._actor is None:
            self._bg.call(self._local.flush)  # type: ignore[union-attr]
            self._bg.flush()  # type: ignore[union-attr]
            self.stats = self._local.stats()  # type: ignore[union-attr]
            return self._local.errors + self._bg.errors  # type: ignore[union-attr]
        try:
            errors = ray.get([a.flush.remote() for a in (self._actor, self._plotter)],
                             timeout=LOGGER_FLUSH_S)
            trials, plots = ray.get([a.stats.remote() for a in (self._actor, self._plotter)],
                                    timeout=LOGGER_FLUSH_S)
            self.stats = {**trials, "plots_s": plots["plots_s"],
                          "plotter_ready_at": plots["ready_at"]}
            return [e for group in errors for e in group]
        except Exception as exc:  # the logger died or hangs: its trials are reconciled
            return [f"the MLflow logger was lost: {type(exc).__name__}: {exc}"[:300]]

    def close(self) -> None:
        if self._actor is not None:
            ray.kill(self._actor)
            ray.kill(self._plotter)
        else:
            self._bg.close()  # type: ignore[union-attr]


def _trial_record(st: StudyState, number: int, config: dict[str, Any],
                  result: dict[str, Any], status: str, run: str | None = None
                  ) -> dict[str, Any]:
    """What ``track.log_trial_record`` logs of one trial: plain data, sent to the
    logger's process."""
    w = st.worker
    return {"study": st.spec.name, "study_run": st.run_id, "number": number,
            "config": config, "result": result, "status": status, "run": run,
            "tags": {"hardware": st.spec.hardware, "kernel": st.spec.kernel,
                     "shape": st.spec.shape_key, "git_sha": git_sha(),
                     "triton": w.get("triton", ""), "torch": w.get("torch", ""),
                     "cuda": w.get("cuda", "")}}


def _logged(trial_log: Path) -> dict[tuple[str, int], dict[str, Any]] | None:
    """(study, trial) -> {"run": id, "done": bool} from the record, None without one."""
    if not trial_log.is_file():
        return None
    out: dict[tuple[str, int], dict[str, Any]] = {}
    for line in trial_log.read_text().splitlines():
        try:
            rec = json.loads(line)
            key = (rec["study"], int(rec["trial"]))
        except (ValueError, KeyError, TypeError):  # a line cut by a kill
            continue
        done = out.get(key, {}).get("done", False) or bool(rec.get("done"))
        out[key] = {"run": rec.get("run"), "done": done}
    return out


def _reconcile(st: StudyState, tracker: Tracker, trial_log: Path,
               logged: dict[tuple[str, int], dict[str, Any]]) -> int:
    """Log the finished trials whose MLflow run a killed driver never wrote or never
    completed."""
    n = 0
    for t in st.search.study.get_trials(deepcopy=False):
        status = t.user_attrs.get(ATTR_STATUS)
        if not t.state.is_finished() or status not in ("measured", "failed"):
            continue
        rec = logged.get((st.spec.name, t.number))
        if rec is not None and rec["done"]:
            continue
        log_trial_record(tracker, trial_log, _trial_record(
            st, t.number, dict(t.params), dict(t.user_attrs.get(ATTR_RESULT) or {}), status,
            run=rec["run"] if rec else None))
        n += 1
    return n


def run(path: str | Path, resume: bool = False, console: Console | None = None,
        progress: bool = True, overrides: Sequence[str] = (),
        started_at: float | None = None, stop_own_ray: bool = False) -> Summary:
    """Run an experiment file end to end. Raises ExperimentError for a bad file and
    NoHardwareError where none of its hardware is in the cluster. ``started_at``
    (time.monotonic()) is the origin of the wall time: the command line passes its
    process's start, so that its imports count too; by default, this call.
    ``stop_own_ray``: a Ray this run started is stopped once the search is done, while
    MLflow catches up (the command line, whose process ends with the run); by default
    it stays up for the caller's next run."""
    console = console or Console(stderr=True)
    exp = experiment.load(path, overrides, semantics=False)  # the file's form: milliseconds
    lock = experiment.lock_run_dir(path, exp)  # a second run of it exits 2, naming this one
    summary = Summary() if started_at is None else Summary(t0=started_at)
    summary.mark("run_called")
    t_start = summary.t0
    # While Ray starts (seconds): the checks that import the kernel family (torch:
    # seconds), then MLflow's import and tables. Nothing is written before the whole
    # file is validated; Ray itself starts in this (the main) thread, whose life its
    # processes are tied to. The plotting code is imported by the MLflow logger's own
    # process (``_Logs``): on a thread here it ran into the search's start, where each
    # of the driver's SQLite calls handed it the GIL and the GPU waited for the asks.
    pool = ThreadPoolExecutor(1, thread_name_prefix="harness-prepare")
    checked = pool.submit(_check, path, exp, summary)
    tracker_f = pool.submit(_tracker_once_valid, checked, exp)
    pool.shutdown(wait=False)

    try:
        where = Fleet.connect()
    finally:
        error = checked.exception()
    if error is not None:
        if where == "local":  # started for this run only
            ray.shutdown()
        lock.release(undo=True)
        raise error
    summary.mark("ray_connected")
    fs = exp.fleet
    keep_s = fs.keep_workers_s
    if keep_s and where == "local":
        console.print("[yellow]fleet.keep_workers_s: this run started its own Ray, which "
                      "ends with it; workers are kept only on a cluster that outlives the "
                      "run (`ray start --head`, `ray job submit`)[/]")
        keep_s = 0.0
    fleet = Fleet(Timing(exp.timing.warmup_ms, exp.timing.rep_ms), exp.timing.trial_timeout_s,
                  queue_depth=fs.queue_depth, compile_workers=fs.compile_workers,
                  max_retries=fs.max_retries, start_timeout_s=fs.start_timeout_s,
                  keep_s=keep_s, version=_code_version(exp) if keep_s else "")
    stopping: list[threading.Thread] = []

    def stop_ray() -> None:
        fleet.shutdown()
        if stop_own_ray and where == "local" and not stopping:
            # Stopping Ray's processes takes ~1.5 s: meanwhile the packs are frozen.
            stopping.append(threading.Thread(target=ray.shutdown, name="harness-ray-stop"))
            stopping[0].start()

    try:
        _run(exp, path, resume, console, progress, fleet, summary, tracker_f, stop_ray)
    finally:
        stop_ray()
        for thread in stopping:
            thread.join()
        lock.release()
    summary.wall_s = time.monotonic() - t_start
    summary.mark("done")
    return summary


def _targets(exp: experiment.Experiment, fleet: Fleet, console: Console,
             summary: Summary) -> tuple[list[str], dict[str, int]]:
    """The experiment's hardware keys present in the cluster (after waiting for an
    autoscaler where asked to), with their GPU counts; what is missing is reported."""
    auto = exp.hardware == ["auto"]
    available = fleet.discover()
    wanted = list(available) if auto else list(exp.hardware)
    missing = [k for k in wanted if k not in available]
    waited = 0.0
    if missing and exp.fleet.wait_for_nodes_s > 0:
        waited = exp.fleet.wait_for_nodes_s
        console.print(f"waiting up to {waited:g} s for nodes with {', '.join(missing)} GPUs "
                      "(asked the autoscaler for one of each)")
        available = fleet.wait_for_nodes(missing, waited)
        missing = [k for k in wanted if k not in available]
    for key in missing:
        console.print(f"[bold red]{_missing_message(key, available, fleet.unlabelled, waited)}[/]")
    summary.missing_hardware = missing
    targets = [k for k in wanted if k in available]
    if not targets:
        hint = (f" ({fleet.unlabelled} GPU(s) have no accelerator_type resource)"
                if fleet.unlabelled else "")
        raise NoHardwareError(f"none of {wanted or exp.hardware} is present in the cluster"
                              f"{hint}")
    return targets, available


def _started(targets: list[str], fleet: Fleet, console: Console,
             summary: Summary) -> tuple[list[str], dict[str, list[dict[str, Any]]]]:
    """Wait for the workers; a key none of whose workers started is reported missing."""
    infos = fleet.wait_started()
    for key in [k for k in targets if not infos.get(k)]:
        console.print(f"[bold red]hardware {key}: no worker started[/] "
                      f"({'; '.join(fleet.events) or 'unknown reason'}); its studies are skipped")
        summary.missing_hardware.append(key)
    targets = [k for k in targets if infos.get(k)]
    if not targets:
        raise NoHardwareError(f"no worker started on any of {summary.missing_hardware}")
    return targets, infos


def _first_studies(specs: list[experiment.StudySpec]) -> dict[str, experiment.StudySpec]:
    """Each hardware key's first study: the one its workers start on."""
    out: dict[str, experiment.StudySpec] = {}
    for spec in specs:
        out.setdefault(spec.hardware, spec)
    return out


def _known_configs(exp: experiment.Experiment, spec: experiment.StudySpec,
                   path: str | Path) -> list[dict[str, Any]]:
    """The configs a study is known to measure before its search starts: the kernel's
    default (a baseline), the packs' winners it starts from (``search.seed_from_packs``)
    and, for a grid, its first ``trials`` configs that pass static pruning on the
    hardware key's static spec, in the grid's order (the worker's own device prunes
    again; a config compiled ahead in vain costs a compile child's time, not the GPU's)."""
    fam = kernel_api.get(spec.kernel)
    device = spec_for_key(spec.hardware)
    space = spaces.resolve([spaces.for_kernel(fam), exp.search_space], device.vendor,
                           spec.hardware, where=str(path))
    # The search asks first for the configs it enqueues (the winners of packs), then
    # for the grid in its sampler's order: compiled in that order, what is timed first
    # is compiled first.
    out = [dict(fam.default_config)]
    if exp.search.seed_from_packs:
        out += [dict(c) for c, _ in warmstart.seeds_from_packs(
            exp.output.packs_dir, fam, spec.dtype, spec.hardware, spec.shape, space, device)]
    if exp.search.sampler != "grid":
        return out  # the sampler's choices are not known ahead
    grid = 0  # the grid walks the valid configs in its order: these come first
    for config in itertools.islice(grid_order(space, exp.seed), MAX_GRID_SCAN):
        if len(out) >= MAX_KNOWN or grid >= exp.search.trials:
            break
        if fam.check_config({**fam.default_config, **config}, spec.shape, device) is None:
            out.append(config)
            grid += 1
    return out


def _run(exp: experiment.Experiment, path: str | Path, resume: bool, console: Console,
         progress: bool, fleet: Fleet, summary: Summary, tracker_f: Future,
         release: Callable[[], None]) -> None:
    """The run's steps once Ray is up; ``release`` gives the GPUs back and stops a Ray
    this run started."""
    targets, available = _targets(exp, fleet, console, summary)
    planned = experiment.plan(exp, targets)
    # Each key's first study and the configs it is known to measure: prepared and
    # compiled while the workers start.
    first = {hw: (spec.kernel, spec.shape, spec.dtype, 0, _known_configs(exp, spec, path))
             for hw, spec in _first_studies(planned).items()}
    fleet.launch({k: available[k] for k in targets}, first=None if resume else first)
    # MLflow and Optuna start up while the workers do (each takes seconds).
    url = storage_url(exp.output.runs_dir, exp.name)
    storage = make_storage(url)
    if not resume:  # an earlier run's studies of this name: seconds to delete from sqlite
        for spec in planned:
            _drop_study(url, spec.name)
    tracker = tracker_f.result()
    summary.tracking_uri = tracker.uri
    # The search's MLflow logger starts (its own process: seconds) while the workers do.
    logs = _Logs(tracker, exp.tracking.experiment or exp.name)
    summary.mark("tracking_ready")
    targets, infos = _started(targets, fleet, console, summary)
    summary.mark("workers_ready")
    summary.worker_startup = {k: dict(v[0].get("startup_s", {})) for k, v in infos.items()}
    # Each GPU's first study's eager baseline goes out now: the GPU works on it while the
    # studies are set up below (MLflow runs, Optuna studies: about half a second).
    specs = experiment.plan(exp, targets)  # the studies, on the hardware that started
    early: dict[str, Task] = {}
    for hw, spec in ({} if resume else _first_studies(specs)).items():
        early[hw] = Task(hw, "eager", (spec.kernel, spec.shape, spec.dtype, 0, False),
                         ("eager", spec.name))
        fleet.submit(early[hw])
    summary.interpreted = any(i["interpreted"] for group in infos.values() for i in group)
    if summary.interpreted:
        console.print("[bold yellow]No GPU: kernels run under Triton's interpreter on the CPU. "
                      "These timings say NOTHING about GPU performance; this run checks the "
                      "pipeline and correctness only.[/]")

    state_path = _state_file(exp)
    trial_log = _trial_log_file(exp)
    prior = json.loads(state_path.read_text()) if (resume and state_path.is_file()) else {}
    summary.parent_run_id = tracker.start_run(
        exp.name, {"harness.level": "experiment", "harness.git_sha": git_sha(),
                   "harness.config": str(path)}, resume=prior.get("parent_run_id"))
    state_path.parent.mkdir(parents=True, exist_ok=True)
    run_state = {"parent_run_id": summary.parent_run_id, "tracking_uri": redact(tracker.uri),
                 "mlflow_experiment": exp.tracking.experiment or exp.name,
                 "config": str(Path(path).resolve()),
                 "packs_dir": str(Path(exp.output.packs_dir).resolve())}
    state_path.write_text(json.dumps(run_state))
    # A resume reconciles MLflow with Optuna only where the previous run kept a record.
    logged = _logged(trial_log) if resume else None
    if logged is None:
        trial_log.write_text("")
    tracker.log(summary.parent_run_id, params={"kernel": exp.kernel,
                                               "sampler": exp.search.sampler,
                                               "trials_per_study": exp.search.trials},
                tags={"harness.missing_hardware": ",".join(summary.missing_hardware) or "-"})

    studies: list[StudyState] = []
    for spec in specs:
        worker = infos[spec.hardware][0]
        device = _device_from_info(worker)
        space = spaces.resolve([spaces.for_kernel(kernel_api.get(spec.kernel)), exp.search_space],
                               device.vendor, spec.hardware, where=str(path))
        fam = kernel_api.get(spec.kernel)
        seeds = (warmstart.seeds_from_packs(exp.output.packs_dir, fam, spec.dtype,
                                            spec.hardware, spec.shape, space, device)
                 if exp.search.seed_from_packs and not resume else [])
        search = Search(spec, space, device, exp.search, storage, exp.seed,
                        n_parallel=fleet.depth(spec.hardware), seeds=seeds)
        run_id = tracker.start_run(
            f"{spec.kernel} {spec.shape_key} {spec.dtype} {spec.hardware}",
            {"harness.level": "study", "hardware": spec.hardware, "kernel": spec.kernel,
             "shape": spec.shape_key, "dtype": spec.dtype, "device_name": worker["device_name"],
             "triton": worker["triton"], "torch": worker["torch"], "cuda": worker["cuda"],
             "git_sha": git_sha()},
            parent=summary.parent_run_id, resume=search.attr("mlflow_run_id"))
        search.set_attr("mlflow_run_id", run_id)
        st = StudyState(spec, search, run_id, device, worker,
                        eager=search.attr("eager"), default=search.attr("default"),
                        compiled=search.attr("compile"),
                        want_compile=_want_compile(exp, device))
        best = search.best()
        if best:
            st.best_ms = best[1].get("latency_ms") or math.inf
        task = early.get(spec.hardware)
        if task is not None and task.tag == ("eager", spec.name):
            task.tag = ("eager", st)  # sent before the study existed
            st.pending.add("eager")
        studies.append(st)
        if resume:
            relogged = _reconcile(st, tracker, trial_log, logged) if logged is not None else 0
            summary.resumed[spec.name] = {
                "finished": search.measured, "requeued": search.interrupted,
                "recovered": search.recovered, "mlflow_relogged": relogged}
            if search.interrupted or relogged:
                console.print(f"resume {spec.name}: {search.measured} trials kept, "
                              f"{len(search.interrupted)} interrupted configs queued again, "
                              f"{relogged} trial runs logged to MLflow")

    summary.mark("search_started")
    try:
        _search_loop(exp, fleet, studies, logs, trial_log, console, progress)
        _remeasure_top(exp, fleet, studies, console)
        # Drawn by the logger's process from the studies' storage while this one
        # freezes the packs; the flush below waits for them.
        for st in studies:
            logs.plots(st.run_id, url, st.search.study.study_name, st.spec.name)
    finally:
        summary.mark("search_done")
        fleet.shutdown()  # the GPUs go back now, not after MLflow has caught up
        log_errors = logs.flush()
        summary.mlflow_logger = _logger_stats(logs.stats, summary.t0)
        logs.close()
        release()  # Ray itself, where this run started it and stops it
        summary.mark("mlflow_caught_up")
    summary.busy_s = dict(fleet.busy_s)
    summary.held_s = fleet.held_s()
    summary.timing_s = sum(fleet.timing_s.values())
    summary.timing_fraction = summary.timing_s / summary.held_s if summary.held_s else math.nan
    summary.overhead = _overhead(fleet.phases, summary.held_s)
    summary.first_calls = dict(fleet.first_calls)
    if fleet.first_calls["ahead_missed"]:
        console.print(f"[yellow]compile-ahead: {fleet.first_calls['ahead_missed']} first "
                      "launches compiled again in the worker although a compile child had "
                      "built them: the worker and its children use different Triton caches[/]")
    summary.replaced, summary.retried = fleet.replaced, fleet.retried
    summary.reused = fleet.reused
    summary.events = list(fleet.events) + [f"MLflow: {e}" for e in log_errors[:5]]
    tracker.log(summary.parent_run_id, metrics={
        "gpu_held_s": summary.held_s, "kernel_timing_s": summary.timing_s,
        "timing_fraction": summary.timing_fraction, "workers_replaced": fleet.replaced,
        "workers_reused": fleet.reused,
        "trials_retried": fleet.retried,
        **{f"held_{k}_s": v for k, v in summary.overhead.items()},
        **{f"first_calls_{k}": v for k, v in fleet.first_calls.items()}})
    _keep_previous_packs(exp, studies)
    summary.packs = _freeze(exp, studies, tracker, summary.parent_run_id)
    summary.mark("packs_frozen")
    state_path.write_text(json.dumps({**run_state, "packs": summary.packs}))
    for st in studies:
        summary.rows.append(_row(st))
        tracker.log(st.run_id, metrics={f"trials_{k}": v for k, v in st.search.counts().items()})
        tracker.finish(st.run_id)
    summary.mark("plots_logged")
    for p in summary.packs:
        tracker.log_artifact(summary.parent_run_id, p, "packs")
    tracker.finish(summary.parent_run_id)


def _code_version(exp: experiment.Experiment) -> str:
    """The code a kept worker must have imported to serve this run: the harness, the
    shipped kernels and the experiment's kernel family's own file."""
    import inspect

    import harness
    import kernels

    paths = [Path(harness.__file__).parent, Path(kernels.__file__).parent]
    try:
        paths.append(Path(inspect.getfile(type(kernel_api.get(exp.kernel)))))
    except (TypeError, OSError):  # defined where inspect cannot find a file
        pass
    return fleet_code_version(paths)


def _check(path: str | Path, exp: experiment.Experiment, summary: Summary) -> None:
    experiment.check_semantics(path, exp)
    summary.mark("validated")


def _tracker_once_valid(checked: Future, exp: experiment.Experiment) -> Tracker | None:
    """The run's Tracker, created only once the experiment passed its checks (MLflow
    writes its store as it starts); None otherwise."""
    if checked.exception() is not None:
        return None
    return Tracker(exp.tracking.uri, exp.tracking.experiment or exp.name)


def _logger_stats(stats: dict[str, float], t0: float) -> dict[str, float]:
    """The MLflow logger's figures, its clock readings as wall seconds of this run."""
    out = {}
    for k, v in stats.items():
        name = k.removesuffix("_at") + "_s" if k.endswith("_at") else k
        out[name] = round(v - t0 if k.endswith("_at") else v, 3)
    return out


def _overhead(phases: dict[str, float], held_s: float) -> dict[str, float]:
    """Where the GPU-held seconds went: timing, and each kind of overhead. ``other`` is
    what no worker accounted for (starting, result transport, the tail after the last
    task)."""
    out = {k.removesuffix("_s"): round(v, 3) for k, v in phases.items()}
    out["other"] = round(max(0.0, held_s - sum(phases.values())), 3)
    return out


def _want_compile(exp: experiment.Experiment, device: DeviceSpec) -> bool:
    """The torch.compile baseline: on by default on GPUs; under the interpreter it times
    CPU code generated by Inductor, which says nothing and costs a C++ build."""
    setting = exp.baselines.compile
    return (not device.interpreted) if setting == "auto" else bool(setting)


def previous_packs_dir(exp: experiment.Experiment) -> Path:
    return Path(exp.output.runs_dir) / exp.name / "previous_packs"


def _keep_previous_packs(exp: experiment.Experiment, studies: list[StudyState]) -> None:
    """Copy the packs this run is about to change into runs/<name>/previous_packs/, so
    that the report can show what the run changed (a pack not there before has none)."""
    import shutil

    dest_root = previous_packs_dir(exp)
    if dest_root.exists():
        shutil.rmtree(dest_root)
    for hw, kernel in {(st.spec.hardware, st.spec.kernel) for st in studies}:
        src = packfmt.pack_path(exp.output.packs_dir, hw, kernel_api.get(kernel).name)
        if src.is_file():
            dest = dest_root / hw / src.name
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest)


def _drop_study(storage: str, name: str) -> None:
    import optuna

    try:
        optuna.delete_study(study_name=name, storage=storage)
    except KeyError:
        pass


def _search_loop(exp, fleet: Fleet, studies: list[StudyState], logs: _Logs,
                 trial_log: Path, console: Console, show: bool) -> None:
    deadline = (time.monotonic() + exp.search.timeout_s) if exp.search.timeout_s else math.inf
    by_hw: dict[str, list[StudyState]] = {}
    for st in studies:
        by_hw.setdefault(st.spec.hardware, []).append(st)
    rr = dict.fromkeys(by_hw, 0)

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TextColumn("{task.fields[status]}"),
                  console=console, disable=not show, transient=False) as prog:
        bars = {hw: prog.add_task(f"{hw:>6}", total=sum(min(s.search.settings.trials,
                                                             s.search.grid) for s in sts),
                                  completed=sum(s.search.measured for s in sts), status="")
                for hw, sts in by_hw.items()}

        def refresh(hw: str) -> None:
            sts = by_hw[hw]
            best = [f"{s.spec.shape_key}: {s.best_ms:.3g} ms" for s in sts if s.best_ms < math.inf]
            fails = sum(s.failures for s in sts)
            prog.update(bars[hw], completed=sum(s.search.measured - s.in_flight for s in sts),
                        status=f"best {'; '.join(best[-2:]) or '-'} | failed {fails}")

        while True:
            out_of_time = time.monotonic() > deadline
            exhausted = set()  # hardware whose studies had nothing more to hand out
            for hw, sts in by_hw.items():
                while fleet.capacity(hw) and not out_of_time:
                    task = _next_task(sts, rr, hw)
                    if task is None:
                        exhausted.add(hw)
                        break
                    fleet.submit(task)
            # Done when nothing is in flight and no hardware has both work left and a
            # worker (a replacement still starting counts: its studies wait for it).
            if fleet.in_flight() == 0 and (out_of_time or all(
                    hw in exhausted or not fleet.workers(hw) for hw in by_hw)):
                break
            for task, result in fleet.poll(0.5):
                _handle(task, result, logs, trial_log)
                refresh(task.hardware)
        for hw in by_hw:
            refresh(hw)


def _remeasure_top(exp: experiment.Experiment, fleet: Fleet, studies: list[StudyState],
                   console: Console) -> None:
    """Re-measure each study's best configs interleaved and decide its winner
    (``harness.remeasure``); every hardware key's studies in one queue, run in order."""
    k = exp.search.remeasure_top_k
    todo: dict[str, list[Task]] = {}
    for st in studies:
        kk = (0 if st.device.interpreted else AUTO_TOP_K) if k == "auto" else int(k)
        top = st.search.top(kk) if kk > 1 else []
        if len(top) < 2:
            continue
        st.incumbent = _incumbent(exp, st, top)
        if st.incumbent is not None and all(cfg != st.incumbent[0] for cfg, _ in top):
            top.append(st.incumbent)
        st.candidates = [remeasure.Candidate(cfg, res.get("latency_ms", math.nan))
                         for cfg, res in top]
        todo.setdefault(st.spec.hardware, []).extend(_remeasure_tasks(exp, st))
    if not todo:
        return
    console.print(f"re-measuring the top configs of {sum(bool(s.candidates) for s in studies)}"
                  f" studies, interleaved ({sum(map(len, todo.values()))} measurements)")
    left = sum(map(len, todo.values()))
    while left:
        for hw, tasks in todo.items():
            while tasks and fleet.capacity(hw):
                fleet.submit(tasks.pop(0))
        if fleet.in_flight() == 0 and not any(todo.values()):
            break
        for task, result in fleet.poll(0.5):
            left -= 1
            _, st, i, round_ = task.tag
            cand = st.candidates[i]
            if result.ok:
                cand.add(result.latency_ms, round_, result.to_dict())
            else:
                cand.failures.append(result.reason)
        if not any(fleet.workers(hw) for hw in todo):
            break  # every worker of these keys is gone: keep what came back
    for st in studies:
        if not st.candidates:
            continue
        others = [remeasure.best_estimates(o.search.latencies(), o.candidates)
                  for o in studies if o is not st
                  and (o.spec.kernel, o.spec.dtype, o.spec.hardware)
                  == (st.spec.kernel, st.spec.dtype, st.spec.hardware)]
        chosen = remeasure.pick(st.candidates, lambda c, n=others: remeasure.robustness(c, n),
                                incumbent=st.incumbent[0] if st.incumbent else None)
        if chosen is not None:
            st.final = (chosen[0].config, chosen[1])


def _remeasure_tasks(exp: experiment.Experiment, st: StudyState) -> list[Task]:
    """The re-measurements of ``st.candidates``: ``remeasure_rounds`` interleaved
    rounds, each timed with ``remeasure_rep_ms`` (at least the search's budget), tagged
    with the candidate and the round."""
    rep = max(exp.search.remeasure_rep_ms, exp.timing.rep_ms)
    longer = ({"rep_ms": rep},) if rep > exp.timing.rep_ms else ()
    n_cands = len(st.candidates)
    # One GPU for all of a study's re-measurements (one group): interleaving only
    # cancels drifts if the candidates are compared on the same device.
    return [Task(st.spec.hardware, "measure",
                 (st.spec.kernel, st.spec.shape, st.spec.dtype, st.candidates[i].config, 0,
                  *longer),
                 ("remeasure", st, i, n // n_cands), group=f"remeasure {st.spec.name}")
            for n, i in enumerate(remeasure.schedule(n_cands, exp.search.remeasure_rounds))]


def _incumbent(exp: experiment.Experiment, st: StudyState,
               top: list[tuple[dict[str, Any], dict[str, Any]]]
               ) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The pack's current winner for the study's shape, as the study measured it (its
    trial's config and result), where the search found it within
    ``remeasure.INCUMBENT_BAND`` of its best; where the search never measured it (a
    narrower space, or a sampler that did not draw it), the pack's config with no
    result, so that it is re-measured beside the top configs all the same and a search
    cannot replace it unseen; None where there is none, or it cannot run here."""
    fam = kernel_api.get(st.spec.kernel)
    held = warmstart.incumbent(exp.output.packs_dir, fam, st.spec.dtype, st.spec.hardware,
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


def _next_task(sts: list[StudyState], rr: dict[str, int], hw: str) -> Task | None:
    """The hardware's next task: the baselines of a study first (PyTorch eager and the
    kernel's default config, measured even where the default is outside the space), then
    its trials. A study keeps the hardware while it has work to hand out, and the next
    one takes over after it: a worker holds one problem's inputs at a time, so switching
    problems on every task would rebuild them each time."""
    n = len(sts)
    for i in range(n):
        idx = (rr[hw] + i) % n
        task = _study_task(sts[idx], hw)
        if task is not None:
            rr[hw] = idx
            return task
    return None


def _study_task(st: StudyState, hw: str) -> Task | None:
    spec = st.spec
    if st.eager is None and "eager" not in st.pending:
        st.pending.add("eager")
        return Task(hw, "eager", (spec.kernel, spec.shape, spec.dtype, 0, False), ("eager", st))
    if st.default is None and "default" not in st.pending:
        st.pending.add("default")
        default = kernel_api.get(spec.kernel).default_config
        return Task(hw, "measure", (spec.kernel, spec.shape, spec.dtype, default, 0),
                    ("default", st))
    if st.want_compile and st.compiled is None and "compile" not in st.pending:
        st.pending.add("compile")
        return Task(hw, "eager", (spec.kernel, spec.shape, spec.dtype, 0, True), ("compile", st))
    if st.full:  # configs the pruner let through their cheap pass: now in full
        trial, config = st.full.pop(0)
        return Task(hw, "measure", (spec.kernel, spec.shape, spec.dtype, config, 0),
                    ("trial", st, trial, config))
    asked = st.search.ask(st.in_flight)
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
    return Task(hw, "measure", (spec.kernel, spec.shape, spec.dtype, config, 0),
                ("trial", st, trial, config))


def _handle(task: Task, result: TrialResult, logs: _Logs, trial_log: Path) -> None:
    kind, st = task.tag[0], task.tag[1]
    if isinstance(st, str):
        return  # a baseline sent before its study was set up, which then was not
    if kind in ("eager", "default", "compile"):
        st.pending.discard(kind)
        setattr(st, "compiled" if kind == "compile" else kind, result.to_dict())
        st.search.set_attr(kind, result.to_dict())
        logs.log(st.run_id, metrics={f"{kind}_latency_ms": result.latency_ms},
                 params={f"{kind}_status": "ok" if result.ok else result.reason[:400]})
        return
    _, st, trial, config = task.tag
    if kind == "cheap":
        if not st.search.cheap(trial, config, result):
            st.full.append((trial, config))  # may win: measured in full next
            return
        if result.ok:  # cut by the pruner after its cheap pass
            st.in_flight -= 1
            logs.trial(trial_log, _trial_record(st, trial.number, dict(config),
                                                result.to_dict(), "cut"))
            return
    else:
        st.search.tell(trial, config, result)  # Optuna first: it is what --resume trusts
    st.in_flight -= 1
    status = "measured" if result.ok else "failed"
    if result.ok:
        st.best_ms = min(st.best_ms, result.latency_ms)
    else:
        st.failures += 1
    logs.trial(trial_log, _trial_record(st, trial.number, dict(config), result.to_dict(),
                                        status))


def _speedup(base: Any, new: Any) -> float:
    if not base or not new or not (base == base) or not (new == new):
        return math.nan
    return float(base) / float(new)


#: What a re-measurement replaces in the winner's metrics: its timing and the rates
#: derived from it.
_TIMED = ("latency_ms", "p20_ms", "p80_ms", "tflops", "gbps", "roofline")


def _outcome(st: StudyState) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The study's winner (full config) and its metrics against the baselines."""
    best = st.search.best()
    if best is None:
        return None
    config, res = best
    extra: dict[str, Any] = {}
    if st.final is not None:
        winner = next(c for c in st.candidates if c.config == st.final[0])
        # The incumbent may rank below the top k by its search measurement, or, outside
        # the search's space, have none: then its re-measurement (accuracy included)
        # stands in.
        config, res = winner.config, next((r for c, r in st.search.top(10**9)
                                           if c == winner.config), winner.median_result)
        # Latency, p20/p80 and rates of one re-measurement (the median one), not the
        # search's rates beside a re-measured latency; the accuracy stays the search's.
        timed = {k: v for k, v in winner.median_result.items() if k in _TIMED}
        res = {**res, **timed} if timed else {**res, "latency_ms": winner.median}
        extra = {"search_latency_ms": winner.search_ms, "remeasured_ms": winner.median,
                 "remeasure_min_ms": winner.lo, "remeasure_max_ms": winner.hi,
                 "remeasure_spread": winner.spread, "remeasure_rounds": len(winner.samples),
                 "remeasure_candidates": len(st.candidates)}
    fam = kernel_api.get(st.spec.kernel)
    default_res = st.default or {}
    eager_ms = (st.eager or {}).get("latency_ms")
    compile_ms = (st.compiled or {}).get("latency_ms")
    metrics = {k: res.get(k) for k in ("latency_ms", "p20_ms", "p80_ms", "tflops", "gbps",
                                       "roofline", "max_abs_err", "max_rel_err")}
    metrics.update({
        "eager_latency_ms": eager_ms,
        "default_latency_ms": default_res.get("latency_ms"),
        "compile_latency_ms": compile_ms,
        "speedup_vs_eager": _speedup(eager_ms, res.get("latency_ms")),
        "speedup_vs_compile": _speedup(compile_ms, res.get("latency_ms")),
        "speedup_vs_default": _speedup(default_res.get("latency_ms"), res.get("latency_ms")),
        **extra,
    })
    return {**fam.default_config, **config}, metrics


def _freeze(exp, studies: list[StudyState], tracker: Tracker, parent: str) -> list[str]:
    """Write each study's winner into its (hardware, kernel) pack."""
    groups: dict[tuple[str, str, str], dict[str, dict[str, Any]]] = {}
    now = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    for st in studies:
        out = _outcome(st)
        if out is None:
            continue
        config, metrics = out
        w = st.worker
        fam = kernel_api.get(st.spec.kernel)
        tol = fam.tolerance(st.spec.dtype, config)
        # The bound the entry met: the family's tolerance, and the experiment's own where set.
        bound = {"atol": tol.atol, "rtol": tol.rtol, **{
            k: getattr(exp.search, k) for k in ("max_abs_err", "max_rel_err")
            if getattr(exp.search, k) is not None}}
        groups.setdefault((st.spec.hardware, st.spec.kernel, st.spec.dtype), {})[
            st.spec.shape_key] = {
            "config": config,
            "metrics": metrics,
            "provenance": {
                "device_name": w["device_name"], "triton": w["triton"], "torch": w["torch"],
                "cuda": w["cuda"], "date": now, "mlflow_run_id": st.run_id,
                "experiment": exp.name, "git_sha": git_sha(),
                "interpreted": w["interpreted"], "trials": st.search.counts(),
                "precision": fam.precision(config, st.spec.dtype), "accuracy_bound": bound,
            },
        }
        why = {"winner_reason": st.final[1]} if st.final else {}
        tracker.log(st.run_id, params={**{f"best.{k}": v for k, v in config.items()}, **why},
                    metrics={f"best_{k}": v for k, v in metrics.items()})
    paths = []
    for (hw, kernel, dtype), entries in groups.items():
        name = kernel_api.get(kernel).name
        paths.append(str(packfmt.freeze(exp.output.packs_dir, hw, name, dtype, entries)))
    return sorted(set(paths))


def _row(st: StudyState) -> dict[str, Any]:
    row: dict[str, Any] = {
        "hardware": st.spec.hardware, "kernel": st.spec.kernel, "shape": st.spec.shape_key,
        "dtype": st.spec.dtype, "counts": st.search.counts(), "mlflow_run_id": st.run_id,
        "failures": [r for _, r in st.search.failures()][:5],
    }
    out = _outcome(st)
    if out is None:  # nothing frozen for this study: the summary says why
        row["not_tuned"] = st.search.not_tuned()
    if out:
        row["config"], metrics = out
        row["params"] = st.final[0] if st.final else st.search.best()[0]  # type: ignore[index]
        row.update(metrics)
        if st.final:
            row["winner_reason"] = st.final[1]
            # Every candidate's re-measurements, in round order: why this one won.
            row["remeasured"] = [
                {"config": c.config, "search_ms": c.search_ms,
                 "samples_ms": [x for _, x in sorted(zip(c.rounds, c.samples, strict=True))],
                 "median_ms": c.median, "incumbent": bool(st.incumbent)
                 and c.config == st.incumbent[0]} for c in st.candidates]
    return row
