"""The ``run`` job: experiment -> plan -> search on the fleet -> track -> freeze packs.

This module only wires the homes together; each decision lives in its own module.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from rich.console import Console

from harness import experiment
from harness.fleet import Fleet, NoHardwareError
from harness.fleet import code_version as fleet_code_version
from harness.kernel import api as kernel_api
from harness.kernel.api import DeviceSpec
from harness.measure.hardware import spec_for_key
from harness.measure.timing import Timing
from harness.packs import winners
from harness.run import schedule
from harness.search import Search, drop_studies, spaces, storage_url, warmstart
from harness.search.write_behind import WriteBehindStorage
from harness.tracking import run_logging
from harness.tracking.redact import redact
from harness.tracking.run_logging import Logs
from harness.tracking.tracker import Tracker, git_sha, import_mlflow

log = logging.getLogger(__name__)


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
    worker_nice: dict[str, int] = field(default_factory=dict)  # CPU priority, by hardware
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
    #: The fleet's figures: ``workers`` (each GPU's held seconds and where they went),
    #: ``driver_s`` (the driver's own seconds choosing and sending tasks and handling
    #: results, and the tasks), ``studies`` (wall seconds at which each study's search
    #: ended and its re-measurement began and ended), ``compile_services`` (per node)
    fleet: dict[str, Any] = field(default_factory=dict)


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


def bookkeeping_processes(exp: experiment.Experiment, targets: list[str]) -> bool:
    """Whether the Optuna writer and the MLflow logger run as processes of their own
    (``fleet.bookkeeping``): beside a driver that feeds GPUs, so that it never waits on
    SQLite; threads of the driver where no GPU runs (the interpreter sets the pace, and
    each process would take seconds of the same CPUs to start)."""
    mode = exp.fleet.bookkeeping
    return mode == "processes" or (mode == "auto" and any(k != "cpu" for k in targets))


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
    # Its surroundings (folders writable, tracking store known and answering): before
    # anything is written, and before Ray starts, which a refusal would have to stop.
    experiment.preflight(path, exp)
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
    pool = ThreadPoolExecutor(2, thread_name_prefix="harness-prepare")
    checked = pool.submit(_check, path, exp, summary)
    tracker_f = pool.submit(_tracker_once_valid, checked, exp)
    # The studies' storage once the studies are known (after Ray's discovery): an
    # earlier run's studies deleted and the storage opened off the main thread.
    planned_f: Future = Future()
    storage_f = pool.submit(_storage_once_planned, checked, planned_f, exp, resume)
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
                  keep_s=keep_s, version=_code_version(exp) if keep_s else "",
                  compile_timeout_s=fs.compile_timeout_s)
    stopping: list[threading.Thread] = []

    def stop_ray() -> None:
        fleet.shutdown()
        if stop_own_ray and where == "local" and not stopping:
            # Stopping Ray's processes takes ~1.5 s: meanwhile the packs are frozen.
            stopping.append(threading.Thread(target=ray.shutdown, name="harness-ray-stop"))
            stopping[0].start()

    try:
        _run(exp, path, resume, console, progress, fleet, summary, tracker_f, planned_f,
             storage_f, stop_ray)
    finally:
        if not planned_f.done():  # the storage's thread waits for nothing more
            planned_f.set_exception(RuntimeError("the run ended before its studies were planned"))
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


def _run(exp: experiment.Experiment, path: str | Path, resume: bool, console: Console,
         progress: bool, fleet: Fleet, summary: Summary, tracker_f: Future,
         planned_f: Future, storage_f: Future, release: Callable[[], None]) -> None:
    """The run's steps once Ray is up; ``release`` gives the GPUs back and stops a Ray
    this run started."""
    targets, available = _targets(exp, fleet, console, summary)
    planned = experiment.plan(exp, targets)
    # Each key's first study and the configs it is known to measure: prepared and
    # compiled while the workers start.
    first = {hw: (spec.kernel, spec.shape, spec.dtype, 0, schedule.known_configs(exp, spec, path))
             for hw, spec in schedule.first_studies(planned).items()}
    fleet.launch({k: available[k] for k in targets}, first=None if resume else first)
    # MLflow and Optuna start up while the workers do (each takes seconds).
    procs = bookkeeping_processes(exp, targets)
    planned_f.set_result((planned, procs))
    # The logger processes start now, beside the workers: ready when the first trials are.
    loggers = (_start_loggers(exp) if procs else None)
    tracker = tracker_f.result()
    summary.tracking_uri = tracker.uri
    # The search's MLflow logger starts (its own process: seconds) while the workers do.
    logs = Logs(tracker, exp.tracking.experiment or exp.name, processes=procs,
                started=loggers)
    summary.mark("tracking_ready")
    targets, infos = _started(targets, fleet, console, summary)
    summary.mark("workers_ready")
    storage = storage_f.result()
    summary.worker_startup = {k: dict(v[0].get("startup_s", {})) for k, v in infos.items()}
    summary.worker_nice = {k: max(i.get("nice", 0) for i in v) for k, v in infos.items()}
    specs = experiment.plan(exp, targets)  # the studies, on the hardware that started
    summary.interpreted = any(i["interpreted"] for group in infos.values() for i in group)
    if summary.interpreted:
        console.print("[bold yellow]No GPU: kernels run under Triton's interpreter on the CPU. "
                      "These timings say NOTHING about GPU performance; this run checks the "
                      "pipeline and correctness only.[/]")
    state_path, run_state, trial_log, logged = _start_tracking(exp, path, resume, tracker,
                                                               summary)
    studies = [_study(exp, path, spec, infos[spec.hardware][0], fleet, storage, tracker,
                      summary, resume) for spec in specs]
    if resume:
        _report_resume(studies, tracker, trial_log, logged, console, summary)

    summary.mark("search_started")
    plotted: set[str] = set()

    def plots(st: schedule.StudyState) -> None:
        """A study's plots, drawn by the logger once its search has ended."""
        if st.spec.name not in plotted:
            plotted.add(st.spec.name)
            study = st.search.study
            logs.trial_plots(st.run_id, study.get_trials(deepcopy=False),
                             study.direction.name.lower(), st.spec.name)

    sched = schedule.Scheduler(exp, fleet, studies,
                               lambda t, r: schedule.record(t, r, logs, trial_log),
                               lambda: logs.release(storage.poll_stored()), plots,
                               lambda st: schedule.log_baselines(st, logs))
    try:
        sched.run(console, progress)
    except BaseException:
        storage.close()  # what was measured stays measured
        raise
    finally:
        summary.mark("search_done")
        fleet.shutdown()  # the GPUs go back now, not after MLflow has caught up
    for step in ("first_trial", "last_trial", "last_result"):
        if step in sched.times:
            summary.timeline[step] = round(sched.times[step] - summary.t0, 2)
    summary.fleet = {
        "workers": fleet.worker_report(),
        "driver_s": {k: round(v, 3) for k, v in sched.driver_s.items()},
        "studies": {st.spec.name: {k: round(v - summary.t0, 2) for k, v in st.times.items()}
                    for st in studies}}
    _account(fleet, summary, console)
    # The packs first: MLflow's catching up and the plots come after them.
    winners.keep_previous_packs(exp, studies)
    summary.packs = winners.freeze(exp, studies, logs, summary.parent_run_id)
    summary.mark("packs_frozen")
    state_path.write_text(json.dumps({**run_state, "packs": summary.packs}))
    summary.rows = [winners.row(st) for st in studies]
    try:
        storage.close()  # every trial in optuna.db (what --resume trusts), then in MLflow
        logs.release(storage.stored)
        summary.mark("studies_stored")
        for st in studies:
            plots(st)  # a study whose workers were lost before its search ended
            logs.log(st.run_id, metrics={f"trials_{k}": v
                                         for k, v in st.search.counts().items()})
        log_errors = logs.flush()
        summary.mlflow_logger = _logger_stats(logs.stats, summary.t0)
    finally:
        logs.close()
        release()  # Ray itself, where this run started it and stops it
    summary.mark("mlflow_caught_up")
    summary.events += [f"MLflow: {e}" for e in log_errors[:5]]
    summary.events += [f"Optuna: {e}" for e in storage.errors[:5]]
    _log_summary(tracker, fleet, summary, studies)


def _start_tracking(exp: experiment.Experiment, path: str | Path, resume: bool,
                    tracker: Tracker, summary: Summary
                    ) -> tuple[Path, dict[str, Any], Path, dict | None]:
    """The experiment's parent MLflow run, runs/<name>/state.json and the trial record
    (on resume: what the previous run logged, None without a record)."""
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
    logged = run_logging.logged(trial_log) if resume else None
    if logged is None:
        trial_log.write_text("")
    tracker.log(summary.parent_run_id, params={"kernel": exp.kernel,
                                               "strategy": exp.search.strategy,
                                               "trials_per_study": exp.search.trials},
                tags={"harness.missing_hardware": ",".join(summary.missing_hardware) or "-"})
    return state_path, run_state, trial_log, logged


def _study(exp: experiment.Experiment, path: str | Path, spec: experiment.StudySpec,
           worker: dict[str, Any], fleet: Fleet, storage: Any, tracker: Tracker,
           summary: Summary, resume: bool) -> schedule.StudyState:
    """One study set up: its space on the device its workers see, its Optuna study
    (seeded from the packs), its MLflow run, its baselines from an earlier run."""
    device = _device_from_info(worker)
    fam = kernel_api.get(spec.kernel)
    space = spaces.resolve([spaces.for_kernel(fam), exp.search_space],
                           device.vendor, spec.hardware, where=str(path))
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
    st = schedule.StudyState(spec, search, run_id, device, worker,
                             eager=search.attr("eager"), default=search.attr("default"),
                             compiled=search.attr("compile"),
                             want_compile=_want_compile(exp, device))
    best = search.best()
    if best:
        st.best_ms = best[1].get("latency_ms") or math.inf
    return st


def _report_resume(studies: list[schedule.StudyState], tracker: Tracker, trial_log: Path,
                   logged: dict | None, console: Console, summary: Summary) -> None:
    for st in studies:
        search = st.search
        relogged = (run_logging.reconcile(st, tracker, trial_log, logged)
                    if logged is not None else 0)
        summary.resumed[st.spec.name] = {
            "finished": search.measured, "requeued": search.interrupted,
            "recovered": search.recovered, "mlflow_relogged": relogged}
        if search.interrupted or relogged:
            console.print(f"resume {st.spec.name}: {search.measured} trials kept, "
                          f"{len(search.interrupted)} interrupted configs queued again, "
                          f"{relogged} trial runs logged to MLflow")


def _account(fleet: Fleet, summary: Summary, console: Console) -> None:
    """Where the GPU-held time went, from the fleet's books."""
    summary.busy_s = dict(fleet.busy_s)
    summary.held_s = fleet.held_s()
    summary.timing_s = sum(fleet.timing_s.values())
    summary.timing_fraction = summary.timing_s / summary.held_s if summary.held_s else math.nan
    summary.overhead = _overhead(fleet.phases, summary.held_s)
    summary.first_calls = dict(fleet.first_calls)
    summary.fleet["compile_services"] = fleet.last_compile_stats
    if fleet.first_calls["ahead_missed"]:
        console.print(f"[yellow]compile-ahead: {fleet.first_calls['ahead_missed']} first "
                      "launches compiled again in the worker although a compile child had "
                      "built them: the worker and its children use different Triton caches[/]")
    summary.replaced, summary.retried = fleet.replaced, fleet.retried
    summary.reused = fleet.reused
    summary.events = list(fleet.events)


def _log_summary(tracker: Tracker, fleet: Fleet, summary: Summary,
                 studies: list[schedule.StudyState]) -> None:
    """The run's figures and packs into its parent MLflow run, once all else is done."""
    tracker.log(summary.parent_run_id, metrics={
        "gpu_held_s": summary.held_s, "kernel_timing_s": summary.timing_s,
        "timing_fraction": summary.timing_fraction, "workers_replaced": fleet.replaced,
        "workers_reused": fleet.reused,
        "trials_retried": fleet.retried,
        **{f"held_{k}_s": v for k, v in summary.overhead.items()},
        **{f"first_calls_{k}": v for k, v in fleet.first_calls.items()}})
    for st in studies:
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
    writes its store as it starts); None otherwise. MLflow is imported after the checks'
    imports, not beside them: on one interpreter lock, two imports at once ended both
    later (the checks 10 s after the run's call on a 64-core H200 host, where Ray's own
    start took 7 s), and the checks are what the run waits for once Ray is up."""
    if checked.exception() is not None:
        return None
    import_mlflow()
    return Tracker(exp.tracking.uri, exp.tracking.experiment or exp.name)


def _start_loggers(exp: experiment.Experiment) -> tuple[Any, Any] | None:
    """The MLflow logger processes, started before the run's Tracker exists; None where
    they cannot be (``Logs`` then logs on a thread)."""
    from harness.tracking.tracker import tracking_uri

    try:
        return run_logging.start_loggers(tracking_uri(exp.tracking.uri),
                                         exp.tracking.experiment or exp.name)
    except Exception as exc:
        log.warning("MLflow logger processes unavailable (%s)", exc)
        return None


def _storage_once_planned(checked: Future, planned_f: Future, exp: experiment.Experiment,
                          resume: bool) -> WriteBehindStorage | None:
    """The studies' storage, once the experiment passed its checks and its studies are
    planned: without ``--resume``, an earlier run's studies of the same names deleted
    (seconds on SQLite); None where the checks failed."""
    if checked.exception() is not None:
        return None
    planned, procs = planned_f.result()
    url = storage_url(exp.output.runs_dir, exp.name)
    if not resume:
        drop_studies(url, [spec.name for spec in planned])
    return WriteBehindStorage(url, process=procs)


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


