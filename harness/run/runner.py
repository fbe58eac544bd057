"""The ``run`` job: experiments -> plan -> search on the fleet -> track -> freeze packs.

``run`` takes one experiment file; ``execute`` runs the studies of one or several
(``harness.run.campaign``) on one Ray and one fleet, each experiment keeping its own
packs, MLflow experiment, ``runs/<name>/`` and summary (``harness.run.members``).
This module only wires the homes together; each decision lives in its own module.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import ray
from rich.console import Console
from rich.markup import escape

from harness import experiment
from harness.fleet import Fleet, NoHardwareError
from harness.fleet import code_version as fleet_code_version
from harness.fleet.head_start import HeadStart, starts_own_ray
from harness.kernel.api import Kernel
from harness.measure.timing import Timing
from harness.run import bookkeeping as bk
from harness.run import freeze, schedule
from harness.run import members as mem
from harness.run.members import Member
from harness.run.results import Summary, account, logger_stats
from harness.tracking import spares
from harness.tracking.run_logging import Logs, RemoteTracker
from harness.tracking.tracker import Tracker, tracking_uri

__all__ = ["Summary", "execute", "run"]

log = logging.getLogger(__name__)


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


def run(path: str | Path, resume: bool = False, console: Console | None = None,
        progress: bool = True, overrides: Sequence[str] = (),
        started_at: float | None = None, stop_own_ray: bool = False,
        summary: Summary | None = None) -> Summary:
    """Run an experiment file end to end. Raises ExperimentError for a bad file and
    NoHardwareError where none of its hardware is in the cluster. ``started_at``
    (time.monotonic()) is the origin of the wall time: the command line passes its
    process's start, so that its imports count too; by default, this call.
    ``stop_own_ray``: a Ray this run started is stopped once the search is done, while
    MLflow catches up (the command line, whose process ends with the run); by default
    it stays up for the caller's next run. ``summary``: the one to fill (a caller that
    is stopped, Ctrl-C or SIGTERM, still reads how far the run got)."""
    console = console or Console(stderr=True)
    exp = experiment.load(path, overrides, semantics=False)  # the file's form: milliseconds
    # Its surroundings (folders writable, tracking store known and answering): before
    # anything is written, and before Ray starts, which a refusal would have to stop.
    experiment.preflight(path, exp)
    lock = experiment.lock_run_dir(path, exp)  # a second run of it exits 2, naming this one
    if summary is None:
        summary = Summary() if started_at is None else Summary(t0=started_at)
    execute([Member(path, exp, resume, summary, lock)], summary, console, progress,
            stop_own_ray)
    return summary


def execute(members: list[Member], summary: Summary, console: Console, progress: bool,
            stop_own_ray: bool = False) -> None:
    """Run the studies of ``members`` (their files' form and surroundings checked, their
    run directories locked) on one Ray and one fleet. ``summary`` takes the fleet's
    figures (a run of one file: that member's own summary). The checks that import the
    kernel families run while Ray starts; a file that fails them stops a Ray started
    here, and leaves nothing written. Every lock is released at the end."""
    summary.mark("run_called")
    t_start = summary.t0
    # While Ray starts (seconds): the checks that import the kernel family (torch:
    # seconds), then MLflow's import and tables. Nothing is written before every file
    # is validated; Ray itself starts in this (the main) thread, whose life its
    # processes are tied to. The plotting code is imported by the MLflow logger's own
    # process (``_Logs``): on a thread here it ran into the search's start, where each
    # of the driver's SQLite calls handed it the GIL and the GPU waited for the asks.
    # A Ray of this run's own: the first configs compile in the driver's children while
    # Ray and the fleet start (``harness.fleet.head_start``).
    pre_fs = mem.shared_fleet([m.exp for m in members])
    head = HeadStart.maybe(pre_fs.compile_workers, pre_fs.compile_timeout_s,
                           pre_fs.compile_timeout_ratio)
    pool = ThreadPoolExecutor(4, thread_name_prefix="harness-prepare")
    checked = pool.submit(_check, members, summary)
    # MLflow in the driver only where no logger process will set it up (``_run``).
    trackers_f = (pool.submit(bk.trackers_once_valid, checked, members)
                  if bk.tracks_locally(pre_fs, members) else None)
    if trackers_f is None and starts_own_ray():
        # A new SQLite store is built while Ray starts, not by the logger after it.
        pool.submit(bk.prepare_stores_once_valid, checked, members)
    if head is not None:
        pool.submit(_head_start_once_valid, checked, members, head)
    # The studies' storages once the studies are known (after Ray's discovery): an
    # earlier run's studies deleted and the storages opened off the main thread.
    planned_f: Future = Future()
    storages_f = pool.submit(bk.storages_once_planned, checked, planned_f, members)
    pool.shutdown(wait=False)

    early: dict[str, tuple[Any, Any] | None] = {}
    try:
        try:
            where = Fleet.connect()
            if trackers_f is None:
                # The logger processes import MLflow while the checks run; they open the
                # store once first used: nothing is written before every file passed.
                # On a kept fleet, the first file's loggers are a spare the last run
                # left (and leave one for the next): one per run, not per file.
                kept = pre_fs.keep_workers_s if where != "local" else 0.0
                early = {m.name: bk.start_loggers(m, open_now=False,
                                                  keep_s=kept if i == 0 else 0.0)
                         for i, m in enumerate(members)}
        finally:
            error = checked.exception()
    except BaseException:
        if head is not None:
            head.close()
        for m in members:
            m.lock.release()
        raise
    if error is not None:
        if head is not None:
            head.close()
        bk.kill_loggers(early.values())
        if where == "local":  # started for this run only
            ray.shutdown()
        for m in reversed(members):  # the last lock's folders first: runs/ may be shared
            m.lock.release(undo=True)
        raise error
    summary.mark("ray_connected")
    exps = [m.exp for m in members]
    fs = mem.shared_fleet(exps)
    keep_s = fs.keep_workers_s
    if keep_s and where == "local":
        console.print("[yellow]fleet.keep_workers_s: this run started its own Ray, which "
                      "ends with it; workers are kept only on a cluster that outlives the "
                      "run (`ray start --head`, `ray job submit`)[/]")
        keep_s = 0.0
    # The workers' default budgets are the first file's; an experiment whose differ
    # sends its own with each task (``StudyState.timing``).
    timing = exps[0].timing
    fleet = Fleet(Timing(timing.warmup_ms, timing.rep_ms), mem.trial_timeout_s(exps),
                  queue_depth=fs.queue_depth, compile_workers=fs.compile_workers,
                  max_retries=fs.max_retries, start_timeout_s=fs.start_timeout_s,
                  keep_s=keep_s, version=_code_version(members) if keep_s else "",
                  compile_timeout_s=fs.compile_timeout_s,
                  compile_timeout_ratio=fs.compile_timeout_ratio)
    stopping: list[threading.Thread] = []

    def stop_ray() -> None:
        fleet.shutdown()
        if stop_own_ray and where == "local" and not stopping:
            # Stopping Ray's processes takes ~1.5 s: meanwhile the packs are frozen.
            stopping.append(threading.Thread(target=ray.shutdown, name="harness-ray-stop"))
            stopping[0].start()

    try:
        _run(members, summary, fs, console, progress, fleet,
             trackers_f or partial(bk.trackers_once_valid, checked, members), early, planned_f,
             storages_f, stop_ray, head)
    finally:
        if not planned_f.done():  # the storages' thread waits for nothing more
            planned_f.set_exception(RuntimeError("the run ended before its studies were planned"))
        stop_ray()
        if head is not None:
            head.close()
            summary.head_start = head.report()
            first = summary.head_start.get("first_trials")
            if first is not None:
                # How many the search took, and when the first result came.
                first["used"] = (summary.fleet or {}).get("first_trials", {}).get("used", 0)
                at = first.pop("first_at", None)
                first["first_result_s"] = None if at is None else round(at - t_start, 2)
        for thread in stopping:
            thread.join()
        for m in members:
            m.lock.release()
    summary.wall_s = time.monotonic() - t_start
    summary.mark("done")
    for m in members:
        m.summary.wall_s = summary.wall_s


def _targets(members: list[Member], fs: experiment.FleetSettings, fleet: Fleet,
             console: Console) -> tuple[list[str], dict[str, int]]:
    """The hardware keys of the experiments present in the cluster (after waiting for an
    autoscaler where asked to), with their GPU counts; what is missing is reported.
    Each member's own keys present are its ``targets``; one with none is skipped."""
    available = fleet.discover()
    wanted = {m.name: list(available) if m.exp.hardware == ["auto"] else list(m.exp.hardware)
              for m in members}
    union = list(dict.fromkeys(k for keys in wanted.values() for k in keys))
    missing = [k for k in union if k not in available]
    waited = 0.0
    if missing and fs.wait_for_nodes_s > 0:
        waited = fs.wait_for_nodes_s
        console.print(f"waiting up to {waited:g} s for nodes with {', '.join(missing)} GPUs "
                      "(asked the autoscaler for one of each)")
        available = fleet.wait_for_nodes(missing, waited)
        missing = [k for k in union if k not in available]
    for key in missing:
        console.print(f"[bold red]{_missing_message(key, available, fleet.unlabelled, waited)}[/]")
    for m in members:
        m.summary.missing_hardware = [k for k in wanted[m.name] if k not in available]
        m.targets = [k for k in wanted[m.name] if k in available]
    targets = [k for k in union if k in available]
    if not targets:
        hint = (f" ({fleet.unlabelled} GPU(s) have no accelerator_type resource)"
                if fleet.unlabelled else "")
        shown = union or list(dict.fromkeys(k for m in members for k in m.exp.hardware))
        raise NoHardwareError(f"none of {shown} is present in the cluster{hint}")
    _skip(members, console, "is present in the cluster")
    return targets, available


def _skip(members: list[Member], console: Console, why: str) -> None:
    """Members left without hardware are skipped: the others run."""
    for m in members:
        if not m.targets and not m.skipped:
            m.skipped = True
            console.print(f"[bold red]experiment {m.name}: none of its hardware "
                          f"({', '.join(m.summary.missing_hardware)}) {why}; its studies "
                          "are skipped[/]")


def _started(targets: list[str], members: list[Member], fleet: Fleet, console: Console
             ) -> tuple[list[str], dict[str, list[dict[str, Any]]]]:
    """Wait for the workers; a key none of whose workers started is reported missing."""
    infos = fleet.wait_started()
    failed = [k for k in targets if not infos.get(k)]
    for key in failed:
        console.print(f"[bold red]hardware {key}: no worker started[/] "
                      f"({'; '.join(fleet.events) or 'unknown reason'}); its studies are skipped")
    for m in members:
        m.summary.missing_hardware += [k for k in m.targets if k in failed]
        m.targets = [k for k in m.targets if k not in failed]
    targets = [k for k in targets if infos.get(k)]
    if not targets:
        missing = list(dict.fromkeys(k for m in members for k in m.summary.missing_hardware))
        raise NoHardwareError(f"no worker started on any of {missing}")
    _skip(members, console, "started a worker")
    return targets, infos


def _run(members: list[Member], summary: Summary, fs: experiment.FleetSettings,
         console: Console, progress: bool, fleet: Fleet,
         trackers_f: Future | Callable[[], dict[str, Tracker]],
         early: dict[str, tuple[Any, Any] | None],
         planned_f: Future, storages_f: Future, release: Callable[[], None],
         head: HeadStart | None = None) -> None:
    """The run's steps once Ray is up; ``release`` gives the GPUs back and stops a Ray
    this run started; ``head``: the head start, whose first trials the search takes."""
    targets, available = _targets(members, fs, fleet, console)
    for m in members:  # each study's device spec and space, resolved once for the run
        m.plan = _plan(m).for_hardware(m.targets)
    for line in mem.overlaps(members):
        console.print(f"[yellow]{escape(line)}[/]")
    by_name = {m.name: m for m in members}
    # Each key's first study and the configs it is known to measure: prepared and
    # compiled while the workers start.
    first = {}
    for hw, planned in schedule.first_studies(
            [s for m in members for s in _plan(m).studies]).items():
        spec = planned.spec
        # Where the head start measures this study's first trials, the worker must not
        # touch the GPU before the scheduler has stopped it: no first problem built.
        if not by_name[spec.experiment].resume and not (head is not None
                                                        and head.measuring(hw)):
            first[hw] = (spec.kernel, spec.shape, spec.dtype, 0,
                         schedule.known_configs(planned))
    fleet.launch({k: available[k] for k in targets}, first=first or None)
    # MLflow and Optuna start up while the workers do (each takes seconds).
    procs = bk.bookkeeping_processes(fs, targets)
    planned_f.set_result(procs)
    # The logger processes start now, beside the workers: ready when the first trials are.
    active = [m for m in members if not m.skipped]
    loggers = {m.name: (early.get(m.name) or bk.start_loggers(
                   m, keep_s=fleet.keep_s if i == 0 else 0.0)) if procs else None
               for i, m in enumerate(active)}
    bk.kill_loggers(pair for name, pair in early.items() if loggers.get(name) is not pair)
    # Where the logger processes run, the driver's runs are theirs too: MLflow is set up
    # there while the workers start (on a warm fleet: while nothing else is left).
    remote = (not isinstance(trackers_f, Future) and procs
              and all(loggers[m.name] is not None for m in active))
    if remote:
        # One store opened at once per URI: a campaign's experiments share one.
        opening: set[str] = set()
        trackers: dict[str, Any] = {}
        for m in active:
            uri = tracking_uri(m.exp.tracking.uri)
            trackers[m.name] = RemoteTracker(loggers[m.name][0], uri,  # type: ignore[index]
                                             open_now=uri not in opening)
            opening.add(uri)
    else:
        trackers = trackers_f.result() if isinstance(trackers_f, Future) else trackers_f()
    # The search's MLflow logger starts (its own process: seconds) while the workers do.
    for m in active:
        m.tracker = trackers[m.name]
        m.summary.tracking_uri = m.tracker.uri
        m.logs = Logs(m.tracker, m.mlflow_experiment, processes=procs, started=loggers[m.name])
    if summary is not members[0].summary:
        summary.tracking_uri = members[0].summary.tracking_uri
    if not remote:
        summary.mark("tracking_ready")
    targets, infos = _started(targets, members, fleet, console)
    summary.mark("workers_ready")
    storages = storages_f.result()
    summary.mark("storages_ready")
    for m in [m for m in active if m.skipped]:  # its workers never started
        m.logs.close()
        storages[m.name].close()
    active = [m for m in active if not m.skipped]
    summary.worker_startup = {k: dict(v[0].get("startup_s", {})) for k, v in infos.items()}
    summary.worker_nice = {k: max(i.get("nice", 0) for i in v) for k, v in infos.items()}
    summary.interpreted = any(i["interpreted"] for group in infos.values() for i in group)
    if summary.interpreted:
        console.print("[bold yellow]No GPU: kernels run under Triton's interpreter on the CPU. "
                      "These timings say NOTHING about GPU performance; this run checks the "
                      "pipeline and correctness only.[/]")
    campaign = [m.name for m in members] if len(members) > 1 else []
    for m in active:
        m.storage = storages[m.name]
        m.summary.interpreted = any(i["interpreted"] for k in m.targets for i in infos[k])
        mem.start_tracking(m, campaign)
        if remote:
            summary.mark("tracking_ready")  # the logger's process answered
            spares.store_ready(m.tracker.uri)
            for other in active:  # the store exists: the others open it side by side
                if other.tracker.uri == m.tracker.uri:
                    other.tracker.open()
        # The studies, on the hardware that started, as its workers see it.
        m.studies = [_study(m, planned, infos[planned.spec.hardware][0], fleet)
                     for planned in _plan(m).studies if planned.spec.hardware in m.targets]
        if m.resume:
            mem.report_resume(m, console)

    summary.mark("search_started")
    studies = [st for m in active for st in m.studies]

    def owner(st: schedule.StudyState) -> Member:
        return by_name[st.spec.experiment]

    def tick() -> None:
        for m in active:
            m.logs.release(m.storage.poll_stored())

    def study_done(st: schedule.StudyState) -> None:
        m = owner(st)
        mem.log_baselines(st, m)
        # A campaign's experiment whose studies are all done has its packs written now:
        # a campaign stopped later (a time limit, Ctrl-C) keeps them.
        if campaign and all(s.phase == "done" for s in m.studies):
            mem.freeze_packs(m)

    sched = schedule.Scheduler(
        [m.exp for m in active], fleet, studies,
        lambda t, r: mem.record(t, r, owner(t.tag[1])), tick,
        lambda st: mem.plots(owner(st), st), study_done,
        first_trials=head.take if head is not None else None)
    stopped = False
    try:
        sched.run(console, progress)
    except BaseException as exc:
        stopped = isinstance(exc, KeyboardInterrupt)
        for m in active:
            m.storage.close()  # what was measured stays measured
        raise
    finally:
        summary.mark("search_done")
        fleet.shutdown()  # the GPUs go back now, not after MLflow has caught up
        if stopped:  # Ctrl-C, SIGTERM: the summary says how far the run got
            _books(summary, sched, studies, fleet, console)
            for m in active:
                m.summary.rows = [freeze.row(st) for st in m.studies]
    _books(summary, sched, studies, fleet, console)
    # The packs first: MLflow's catching up and the plots come after them.
    for m in active:
        if m.summary is not summary:  # a campaign's experiment: its own steps
            m.summary.fleet = {"studies": _study_times(m.studies, summary.t0)}
            frozen = {k: v for k, v in m.summary.timeline.items() if k == "packs_frozen"}
            m.summary.timeline = {**_own_timeline(m, sched.began.get(m.name), summary.t0),
                                  **frozen}  # its packs, where written as it finished
        mem.freeze_packs(m)
        m.summary.rows = [freeze.row(st) for st in m.studies]
    summary.mark("packs_frozen")
    if summary is not members[0].summary:
        summary.packs = [p for m in active for p in m.summary.packs]
    _catch_up(active, summary, release, campaign=bool(campaign))
    summary.mark("plots_logged")


def _books(summary: Summary, sched: schedule.Scheduler, studies: list[schedule.StudyState],
           fleet: Fleet, console: Console) -> None:
    """The search's figures into ``summary``: its timeline, the workers' and studies'
    times, where the GPU-held time went."""
    for step in ("first_trial", "last_trial", "last_result"):
        if step in sched.times:
            summary.timeline[step] = round(sched.times[step] - summary.t0, 2)
    summary.fleet = {
        "workers": fleet.worker_report(),
        "driver_s": {k: round(v, 3) for k, v in sched.driver_s.items()},
        "studies": _study_times(studies, summary.t0),
        **({"first_trials": dict(sched.premeasured)} if sched.premeasured else {})}
    account(fleet, summary, console)


def _catch_up(active: list[Member], summary: Summary, release: Callable[[], None],
              campaign: bool = False) -> None:
    """Every trial into its Optuna storage (what --resume trusts), then into MLflow, with
    each study's plots and the run's figures and packs; Ray is stopped meanwhile
    (``release``). ``campaign``: several experiments ran on the fleet."""
    log_errors: dict[str, list[str]] = {}
    try:
        for m in active:
            m.storage.close()
            m.logs.release(m.storage.stored)
        summary.mark("studies_stored")
        for m in active:
            for st in m.studies:
                mem.plots(m, st)  # a study whose workers were lost before its search ended
                m.logs.log(st.run_id, metrics={f"trials_{k}": v
                                               for k, v in st.search.counts().items()})
            mem.log_summary(m, summary, campaign)
        for m in active:
            log_errors[m.name] = m.logs.flush()
            m.summary.mlflow_logger = logger_stats(m.logs.stats, summary.t0)
    finally:
        for m in active:
            m.logs.close()
        release()  # Ray itself, where this run started it and stops it
    summary.mark("mlflow_caught_up")
    for m in active:
        m.summary.events += [f"MLflow: {e}" for e in log_errors.get(m.name, [])[:5]]
        m.summary.events += [f"Optuna: {e}" for e in m.storage.errors[:5]]


def _study_times(studies: list[schedule.StudyState], t0: float) -> dict[str, dict[str, float]]:
    """Wall seconds at which each study's search ended and its re-measurement began and
    ended."""
    return {st.spec.name: {k: round(v - t0, 2) for k, v in st.times.items()} for st in studies}


def _own_timeline(m: Member, began: float | None, t0: float) -> dict[str, float]:
    """A campaign's experiment's steps, in wall seconds of the campaign: its first task,
    the end of its last study's search and of its last re-measurement."""
    out = {"search_started": round(began - t0, 2)} if began is not None else {}
    for step, key in (("search_done", "search_done"), ("studies_done", "done")):
        times = [st.times[key] for st in m.studies if key in st.times]
        if times:
            out[step] = round(max(times) - t0, 2)
    return out


def _plan(m: Member) -> experiment.ExperimentPlan:
    """The member's plan (made as its file was checked: ``_check``)."""
    if m.plan is None:
        raise RuntimeError(f"experiment {m.name} was not planned")
    return m.plan


def _study(m: Member, planned: experiment.StudyPlan, worker: dict[str, Any],
           fleet: Fleet) -> schedule.StudyState:
    """One study set up, on the device its worker reports (the plan's static spec
    stands in for a GPU type the worker simulates)."""
    device = mem.device_from_info(worker, planned.device)
    return mem.study(m, _plan(m).on(planned, device), worker, fleet)


def _code_version(members: Sequence[Member]) -> str:
    """The code a kept worker must have imported to serve this run: the harness, the
    shipped kernels and each experiment's kernel family's own file."""
    import inspect

    import harness
    import kernels

    paths = [Path(harness.__file__).parent, Path(kernels.__file__).parent]
    families = {m.exp.kernel: _plan(m).family for m in members}
    for family in families.values():
        try:
            paths.append(Path(inspect.getfile(type(family))))
        except (TypeError, OSError):  # defined where inspect cannot find a file
            pass
    return fleet_code_version(paths)


def _check(members: list[Member], summary: Summary) -> None:
    """Each file's checks that import its kernel family, and its plan: each kernel
    name resolved once for the whole run."""
    families: dict[str, Kernel] = {}
    for m in members:
        m.plan = experiment.ExperimentPlan.checked(m.path, m.exp, families)
    summary.mark("validated")


def _head_start_once_valid(checked: Future, members: list[Member], head: HeadStart) -> None:
    """The head start's processes started at once (beside Ray's start and the checks);
    once every file passed its checks, the configs known for the first study of this
    machine's GPU type (as ``_run`` sends the workers) compiled there."""
    try:
        if not head.start() or checked.exception() is not None:
            head.close()
            return
        # The files that run on this GPU type (``_targets``' rule): the others' studies
        # would compile here in vain.
        key = str(head.key)
        here = [m for m in members if m.exp.hardware == ["auto"] or key in m.exp.hardware]
        studies = [s for m in here for s in _plan(m).for_hardware([key]).studies]
        first = schedule.first_studies(studies).get(key)
        owner = None if first is None else next(m for m in members
                                                if m.name == first.spec.experiment)
        if first is None or owner is None or owner.resume:
            head.close()
            return
        # Its first trials measured here too, where each is one plain measurement (a
        # multi-fidelity study times a cheap pass first).
        timing = owner.exp.timing
        measure = ({"warmup_ms": timing.warmup_ms, "rep_ms": timing.rep_ms}
                   if owner.exp.search.pruner == "none" else None)
        head.submit(first, schedule.known_configs(first),
                    prebuild=mem.want_compile(owner.exp, first.device, first.family),
                    measure=measure)
    except Exception as exc:  # only a head start: the fleet compiles them as usual
        log.warning("the head start of the first compiles failed: %s", exc)
        head.close()


