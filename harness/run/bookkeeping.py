"""A run's bookkeeping set up beside Ray's and the workers' start: where Optuna's trials
are written and MLflow logged (processes of their own, or threads of the driver), the
MLflow logger processes, the driver's MLflow runs (``RemoteTracker``, or a Tracker of the
driver's own) and the studies' storages."""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import ray

from harness import experiment
from harness.fleet import code_version
from harness.fleet.compile import gpu_device_nodes
from harness.fleet.head_start import starts_own_ray
from harness.run.members import Member
from harness.search import drop_studies, storage_url
from harness.search.write_behind import WriteBehindStorage
from harness.tracking import run_logging
from harness.tracking.redact import redact
from harness.tracking.tracker import Tracker, absolute_uri, import_mlflow, tracking_uri

log = logging.getLogger(__name__)


def bookkeeping_processes(exp: experiment.Experiment | experiment.FleetSettings,
                          targets: list[str]) -> bool:
    """Whether the Optuna writer and the MLflow logger run as processes of their own
    (``fleet.bookkeeping``): beside a driver that feeds GPUs, so that it never waits on
    SQLite; threads of the driver where no GPU runs (the interpreter sets the pace, and
    each process would take seconds of the same CPUs to start)."""
    fs = exp.fleet if isinstance(exp, experiment.Experiment) else exp
    mode = fs.bookkeeping
    return mode == "processes" or (mode == "auto" and any(k != "cpu" for k in targets))


def tracks_locally(fs: experiment.FleetSettings, members: list[Member]) -> bool:
    """Whether the run sets MLflow up in the driver (beside Ray's start): where no logger
    process will (``fleet.bookkeeping``: threads, or auto on a machine without a GPU that
    starts its own Ray), and for ``--resume``, which reconciles MLflow with the Optuna
    storage in the driver. Elsewhere the trial logger's process does, while the workers
    start (``RemoteTracker``), and the driver never imports MLflow."""
    if any(m.resume for m in members) or fs.bookkeeping == "threads":
        return True
    if fs.bookkeeping == "processes":
        return False
    return not gpu_device_nodes() and starts_own_ray()


def trackers_once_valid(checked: Future, members: list[Member]) -> dict[str, Tracker]:
    """Each experiment's Tracker, created only once every file passed its checks (MLflow
    writes its store as it starts); none otherwise. MLflow is imported after the checks'
    imports, not beside them: on one interpreter lock, two imports at once ended both
    later (the checks 10 s after the run's call on a 64-core H200 host, where Ray's own
    start took 7 s), and the checks are what the run waits for once Ray is up."""
    if checked.exception() is not None:
        return {}
    import_mlflow()
    return {m.name: Tracker(m.exp.tracking.uri, m.mlflow_experiment) for m in members}


def start_loggers(m: Member, open_now: bool = True,
                  keep_s: float = 0.0) -> tuple[Any, Any] | None:
    """The MLflow logger processes, started before the run's Tracker exists; None where
    they cannot be (``Logs`` then logs on a thread). ``open_now``: see ``TrialLogger``;
    ``keep_s``: a kept fleet's, whose runs leave each other spare loggers."""
    try:
        return run_logging.start_loggers(tracking_uri(m.exp.tracking.uri),
                                         m.mlflow_experiment, open_now=open_now,
                                         keep_s=keep_s,
                                         version=harness_version() if keep_s > 0 else "")
    except Exception as exc:
        log.warning("MLflow logger processes unavailable (%s)", exc)
        return None


@functools.lru_cache(maxsize=1)
def harness_version() -> str:
    """The harness's code version: a spare logger of other code is not taken."""
    import harness

    return code_version([Path(harness.__file__).parent])


def kill_loggers(pairs: Iterable[tuple[Any, Any] | None]) -> None:
    """Logger processes started early that the run does not use (its checks failed, its
    studies were skipped, or it logs on threads)."""
    for pair in pairs:
        for actor in {id(a): a for a in (pair or ())}.values():
            try:
                ray.kill(actor)
            except Exception:  # already gone with its Ray
                pass


#: How long a new MLflow store may take to build off the critical path (``prepare_stores``).
PREPARE_TIMEOUT_S = 120.0


def prepare_stores_once_valid(checked: Future, members: list[Member]) -> list[str]:
    """Build each new SQLite MLflow store of ``members`` in a process of its own
    (``harness.tracking.prepare_store``), once every file passed its checks, while Ray
    starts: the run's logger process then opens a store that exists. Only for a run that
    starts its own Ray (a first run in a directory; on a running cluster the logger may
    work in another directory). Returns the stores built; one that could not be is left
    to the logger, as before, and said so."""
    if checked.exception() is not None:
        return []
    import subprocess
    import sys

    from harness.tracking.prepare_store import new_sqlite_store

    built = []
    for uri in dict.fromkeys(absolute_uri(tracking_uri(m.exp.tracking.uri)) for m in members):
        if new_sqlite_store(uri) is None:
            continue
        try:
            rc = subprocess.run([sys.executable, "-m", "harness.tracking.prepare_store", uri],
                                capture_output=True, text=True, timeout=PREPARE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("the new MLflow store %s was not built within %g s; the logger "
                        "builds it", redact(uri), PREPARE_TIMEOUT_S)
            continue
        if rc.returncode == 0:
            built.append(uri)
        elif rc.returncode != 1:  # 1: a store appeared meanwhile (kept)
            log.warning("building the new MLflow store %s ahead failed (exit %d): %s",
                        redact(uri), rc.returncode, rc.stderr.strip()[-300:])
    return built


def storages_once_planned(checked: Future, planned_f: Future, members: list[Member]
                          ) -> dict[str, WriteBehindStorage]:
    """Each planned experiment's studies' storage, once every file passed its checks and
    the studies are planned: without ``--resume``, an earlier run's studies of the same
    names deleted (seconds on SQLite); none where the checks failed."""
    if checked.exception() is not None:
        return {}
    procs = planned_f.result()
    out = {}
    for m in members:
        if not m.planned:  # skipped: none of its hardware is in the cluster
            continue
        url = storage_url(m.exp.output.runs_dir, m.name)
        if not m.resume:
            drop_studies(url, [spec.name for spec in m.planned])
        out[m.name] = WriteBehindStorage(url, process=procs)
    return out
