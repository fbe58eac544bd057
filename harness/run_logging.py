"""The run's MLflow logging, off the driver's loop: each trial's record sent to a logger
process in order (``track.TrialLogger``), the studies' plots drawn by a second one, and,
after a killed driver, the trials whose MLflow run it never wrote logged again
(``reconcile``). The driver never waits on MLflow until the packs are frozen.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from harness.search import ATTR_RESULT, ATTR_STATUS
from harness.tracking.tracker import (
    Tracker,
    TrialLogger,
    git_sha,
    log_trial_record,
    start_trial_logger,
)

log = logging.getLogger(__name__)

#: How long the end of a run waits for the MLflow logger to catch up.
LOGGER_FLUSH_S = 300.0


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


#: Cores below which the trial logger draws the plots itself (no second process).
SEPARATE_PLOTTER_CORES = 4


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        return os.cpu_count() or 1


class Logs:
    """Where the search's MLflow logging goes, in order and off the driver's loop: a
    ``TrialLogger`` in a process of its own (``track.start_trial_logger``) for the
    trials, and a second one that imports the plotting code as the search starts and
    draws the studies' plots at its end, beside the first one catching up (one
    process doing both fell seconds behind the trials); or one sharing the driver's
    Tracker on a thread: where no actor can be started, or ``processes=False`` (a run
    without GPUs, whose pace the interpreter sets: a process costs seconds of CPU to
    start and import MLflow, on the machine that also runs the kernels)."""

    def __init__(self, tracker: Tracker, experiment_name: str, processes: bool = True) -> None:
        self._actor: Any = None
        self._plotter: Any = None
        self._bg: _Background | None = None
        self.stats: dict[str, float] = {}  # TrialLogger.stats, as of the last flush
        self._held: dict[tuple[str, int], tuple[Path, dict[str, Any]]] = {}  # see ``hold``
        if processes:
            try:
                # Where the driver's machine has few cores, a second process importing
                # the plotting code competes with the workers' start-up: one draws the
                # plots too.
                one = _cores() < SEPARATE_PLOTTER_CORES
                self._actor = start_trial_logger(tracker.uri, experiment_name, plots=one)
                self._plotter = (self._actor if one else
                                 start_trial_logger(tracker.uri, experiment_name, plots=True))
                return
            except Exception as exc:
                log.warning("MLflow logger process unavailable (%s): logging on a thread",
                            exc)
        self._local = TrialLogger.sharing(tracker)
        self._bg = _Background()
        self._bg.call(self._local.warm_plots)

    def hold(self, key: tuple[str, int], trial_log: Path, rec: dict[str, Any]) -> None:
        """Log a trial's record once its trial is in the persistent storage (``release``
        with its (study, number)), so that MLflow never has a trial Optuna lost."""
        self._held[key] = (trial_log, rec)

    def release(self, stored: set[tuple[str, int]] | None = None) -> None:
        """Log the held records of the trials in ``stored`` (None: every one held)."""
        keys = list(self._held) if stored is None else [k for k in stored if k in self._held]
        for key in sorted(keys, key=lambda k: k[1]):
            self.trial(*self._held.pop(key))

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

    def trial_plots(self, run_id: str, trials: list[Any], direction: str, title: str) -> None:
        """Draw a study's plots from its trials (``TrialLogger.trial_plots``)."""
        if self._plotter is not None:
            self._plotter.trial_plots.remote(run_id, trials, direction, title)
        else:
            self._bg.call(self._local.trial_plots, run_id,  # type: ignore[union-attr]
                          trials, direction, title)

    def flush(self) -> list[str]:
        """Wait until every call so far has run; the errors they met."""
        if self._actor is None:
            self._bg.call(self._local.flush)  # type: ignore[union-attr]
            self._bg.flush()  # type: ignore[union-attr]
            self.stats = self._local.stats()  # type: ignore[union-attr]
            return self._local.errors + self._bg.errors  # type: ignore[union-attr]
        try:
            actors = self._actors()
            errors = ray.get([a.flush.remote() for a in actors], timeout=LOGGER_FLUSH_S)
            stats = ray.get([a.stats.remote() for a in actors], timeout=LOGGER_FLUSH_S)
            trials, plots = stats[0], stats[-1]
            self.stats = {**trials, "plots_s": plots["plots_s"],
                          "plotter_ready_at": plots["ready_at"]}
            return [e for group in errors for e in group]
        except Exception as exc:  # the logger died or hangs: its trials are reconciled
            return [f"the MLflow logger was lost: {type(exc).__name__}: {exc}"[:300]]

    def _actors(self) -> list[Any]:
        return [self._actor] if self._plotter is self._actor else [self._actor, self._plotter]

    def close(self) -> None:
        if self._actor is not None:
            for actor in self._actors():
                ray.kill(actor)
        else:
            self._bg.close()  # type: ignore[union-attr]


def trial_record(st: Any, number: int, config: dict[str, Any],
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


def logged(trial_log: Path) -> dict[tuple[str, int], dict[str, Any]] | None:
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


def reconcile(st: Any, tracker: Tracker, trial_log: Path,
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
        log_trial_record(tracker, trial_log, trial_record(
            st, t.number, dict(t.params), dict(t.user_attrs.get(ATTR_RESULT) or {}), status,
            run=rec["run"] if rec else None))
        n += 1
    return n

