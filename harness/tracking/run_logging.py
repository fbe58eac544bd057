"""The run's MLflow logging, off the driver's loop: each trial's record sent to a logger
process in order (``track.TrialLogger``), the studies' plots drawn by a second one, and,
after a killed driver, the trials whose MLflow run it never wrote logged again
(``reconcile``). The driver never waits on MLflow until the packs are frozen.

Batches. What the driver logs (``trial``, ``log``, the records ``release`` lets go) is
gathered and sent to the trial logger as one batch (``TrialLogger.apply``) whenever fewer
than ``IN_FLIGHT`` of its batches are unanswered: one being written, one waiting, and
whatever comes meanwhile goes into the next, so that the further the logger falls
behind, the larger (and the cheaper per trial) its batches: on a database store a batch
of trials is one transaction (``track.log_trial_records``).

Order. A trial's record is held (``hold``) until the Optuna writer has stored its trial
(``release(storage.poll_stored())``), so that MLflow never has a trial Optuna lost (a
killed driver: ``--resume`` trusts Optuna and logs what MLflow lacks, ``reconcile``).
Once the writer and the logger both keep pace, that order costs a trial one or two
passes of the scheduler's loop and nothing at the end of a run (``storage.close()`` and
``flush`` each wait for one last batch), so it stays: having the writer forward the
records to the logger, or one process doing both, would save no measurable time and
would tie the Optuna storage, which ``--resume`` depends on, to MLflow's failures.

Waits. ``flush`` waits only while the loggers answer: a logger that answers no batch for
``LOGGER_STALL_S`` (a batch is at most ``MAX_BATCH`` trials, seconds of work even one by
one) is reported as an error that names the trials not logged, which ``kharness run
--resume`` logs, and the run goes on: tracking never stops the tuning. During the search
such a stall is logged as a warning.

Testing aid: ``HARNESS_FAULTS=logger_hang`` makes the logger never answer (see
``harness.tracking.tracker``); a test shows the run reporting it within seconds.
"""

from __future__ import annotations

import json
import logging
import os
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import ray

from harness.search import ATTR_RESULT, ATTR_STATUS
from harness.tracking import spares
from harness.tracking.tracker import (
    Tracker,
    TrackingError,
    TrialLogger,
    git_sha,
    log_trial_record,
    log_trial_records,
    start_trial_logger,
    tracking_uri,
)

log = logging.getLogger(__name__)

#: How long a logger may answer no batch before the end of a run gives up on it.
LOGGER_STALL_S = 20.0
#: Batches to the trial logger unanswered at once: one being written, one waiting.
IN_FLIGHT = 2
#: Operations per batch at most, so that answers come every few seconds even where the
#: trials are logged one by one (a tracking server), and a stall is told from a batch.
MAX_BATCH = 256

#: Cores below which the trial logger draws the plots itself (no second process).
SEPARATE_PLOTTER_CORES = 4
#: How long the driver waits for one of its MLflow calls through the trial logger's
#: process (the first waits for the process to import MLflow and open the store).
REMOTE_CALL_S = 120.0


class RemoteTracker:
    """The driver's MLflow runs (the experiment's, the studies'), created and ended by
    the trial logger's process, which imports MLflow and opens the store while the GPU
    workers start: the driver itself never imports MLflow. On a warm fleet the workers
    are ready at once, and the driver's own MLflow set-up (8.6 s after its checks on a
    2x H200 host) was the last thing before the first trial. The methods the run calls
    of ``Tracker``, each answered in order after what was sent to the logger before."""

    def __init__(self, actor: Any, uri: str | None, open_now: bool = True) -> None:
        """Created once the run's files passed their checks. ``open_now``: the logger
        opens the store now (a new SQLite store's tables: seconds), while the workers
        start, not at the first run it is asked for; False for all but one tracker of a
        store (two processes creating one SQLite store's tables at once collide)."""
        self.actor = actor
        self.uri = tracking_uri(uri)
        self._opening = False
        if open_now:
            self.open()

    def open(self) -> None:
        """Have the logger open the store now, without waiting for it (once the store
        exists, trackers that were not to open it at once do so side by side: a
        campaign's experiments' loggers each opened it only at their experiment's first
        run, one after another, before the first trial)."""
        if not self._opening:
            self._opening = True
            self.actor.open.remote()  # answered in order before later calls; never raises

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        from harness.tracking.redact import redact

        ref = self.actor.tracker_call.remote(method, *args, **kwargs)
        try:
            return ray.get(ref, timeout=REMOTE_CALL_S)
        except GetTimeoutError:
            raise TrackingError(f"MLflow: the logger process did not answer {method} within "
                                f"{REMOTE_CALL_S:g} s") from None
        except (RayActorError, RayTaskError) as exc:
            cause = getattr(exc, "cause", None) or exc
            raise TrackingError(redact(f"MLflow tracking at {self.uri}: {method} failed: "
                                       f"{str(cause)[:500]}")) from None

    def start_run(self, name: str, tags: dict[str, str], parent: str | None = None,
                  resume: str | None = None) -> str:
        # Plain str values: an object of another package (torch's TorchVersion) would
        # make the logger import that package to unpickle it (seconds, on the way to
        # the first trial).
        return self._call("start_run", name, {k: str(v) for k, v in tags.items()}, parent,
                          resume)

    def log(self, run_id: str, params: dict[str, Any] | None = None,
            metrics: dict[str, Any] | None = None, tags: dict[str, Any] | None = None,
            step: int = 0) -> None:
        self._call("log", run_id, params, metrics, tags, step)

    def finish(self, run_id: str, ok: bool = True) -> None:
        self._call("finish", run_id, ok)

    def log_artifact(self, run_id: str, path: str, artifact_path: str | None = None) -> None:
        self._call("log_artifact", run_id, str(path), artifact_path)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        return os.cpu_count() or 1


class _Lane:
    """Where one logger's calls go, answered in order: a Ray actor, or one thread of the
    driver running a ``TrialLogger`` that shares the driver's Tracker."""

    def __init__(self, name: str, actor: Any = None, local: TrialLogger | None = None) -> None:
        self.name, self.actor, self.local = name, actor, local
        self.pool = (futures.ThreadPoolExecutor(1, thread_name_prefix="harness-mlflow")
                     if local is not None else None)
        self.progress_at = time.monotonic()  # its last answer, or first call since
        self.stalled = False

    def call(self, method: str, *args: Any) -> futures.Future:
        if self.actor is not None:
            return getattr(self.actor, method).remote(*args).future()
        return self.pool.submit(getattr(self.local, method), *args)  # type: ignore[union-attr]

    def close(self) -> None:
        if self.actor is not None:
            ray.kill(self.actor)
        else:
            self.local.stop()  # type: ignore[union-attr]  # a hung call returns
            self.pool.shutdown(wait=False, cancel_futures=True)  # type: ignore[union-attr]


class Logs:
    """Where the search's MLflow logging goes, in order and off the driver's loop: a
    ``TrialLogger`` in a process of its own (``track.start_trial_logger``) for the
    trials, and a second one that imports the plotting code as the search starts and
    draws the studies' plots at its end, beside the first one catching up (one
    process doing both fell seconds behind the trials); or one sharing the driver's
    Tracker on a thread: where no actor can be started, or ``processes=False`` (a run
    without GPUs, whose pace the interpreter sets: a process costs seconds of CPU to
    start and import MLflow, on the machine that also runs the kernels). See the
    module's docstring for batches, order and waits."""

    def __init__(self, tracker: Tracker, experiment_name: str, processes: bool = True,
                 started: tuple[Any, Any] | None = None) -> None:
        """``started``: the logger processes ``start_loggers`` started earlier (as Ray
        comes up, so that they are ready when the first trials are)."""
        self._actor: Any = None
        self._plotter: Any = None
        self.stats: dict[str, float] = {}  # TrialLogger.stats, as of the last flush
        self._held: dict[tuple[str, int], tuple[Path, dict[str, Any]]] = {}  # see ``hold``
        self._pending: list[tuple] = []  # operations not sent yet, in order
        self._inflight: list[tuple[futures.Future, int, _Lane]] = []  # (answer, trials, lane)
        self._errors: list[str] = []
        self._answers: dict[str, dict[str, Any]] = {}  # lane -> its last answer's stats
        self._lost: str | None = None
        lanes: list[_Lane] | None = None
        if processes:
            try:
                # Where the driver's machine has few cores, a second process importing
                # the plotting code competes with the workers' start-up: one draws the
                # plots too.
                one = _cores() < SEPARATE_PLOTTER_CORES
                self._actor, self._plotter = started or start_loggers(tracker.uri,
                                                                      experiment_name)
                trials = _Lane("trials", actor=self._actor)
                lanes = [trials, trials if one else _Lane("plots", actor=self._plotter)]
            except Exception as exc:
                log.warning("MLflow logger process unavailable (%s): logging on a thread",
                            exc)
        if lanes is None:
            self._local = TrialLogger.sharing(tracker)
            local = _Lane("trials", local=self._local)
            local.pool.submit(self._local.warm_plots)  # type: ignore[union-attr]
            lanes = [local, local]
        self._trials, self._plots = lanes

    # -- what the run logs ----------------------------------------------------------------
    def hold(self, key: tuple[str, int], trial_log: Path, rec: dict[str, Any]) -> None:
        """Log a trial's record once its trial is in the persistent storage (``release``
        with its (study, number)), so that MLflow never has a trial Optuna lost."""
        self._held[key] = (trial_log, rec)

    def release(self, stored: set[tuple[str, int]] | None = None) -> None:
        """Log the held records of the trials in ``stored`` (None: every one held)."""
        keys = list(self._held) if stored is None else [k for k in stored if k in self._held]
        for key in sorted(keys, key=lambda k: k[1]):
            trial_log, rec = self._held.pop(key)
            self._pending.append(("trial", str(trial_log), rec))
        self._pump()

    def trial(self, trial_log: Path, rec: dict[str, Any]) -> None:
        self._pending.append(("trial", str(trial_log), rec))
        self._pump()

    def log(self, run_id: str, params: dict[str, Any] | None = None,
            metrics: dict[str, Any] | None = None) -> None:
        self._pending.append(("log", run_id, params, metrics))
        self._pump()

    def call(self, method: str, *args: Any) -> None:
        """One of the Tracker's ``TrialLogger.FORWARDED`` calls (ending a run, a pack as
        an artifact), made in order with the rest."""
        self._pending.append(("call", method, args))
        self._pump()

    def trial_plots(self, run_id: str, trials: list[Any], direction: str, title: str) -> None:
        """Draw a study's plots from its trials (``TrialLogger.trial_plots``), after
        what was logged before."""
        self._pump(everything=self._plots is self._trials)
        self._call(self._plots, 0, "trial_plots", run_id, trials, direction, title)

    # -- batches --------------------------------------------------------------------------
    def _pump(self, everything: bool = False) -> None:
        """Collect the answers in; send what is pending while fewer than ``IN_FLIGHT``
        batches are unanswered (``everything``: all of it now)."""
        self._collect()
        busy = sum(lane is self._trials for _, _, lane in self._inflight)
        while self._pending and (everything or busy < IN_FLIGHT):
            ops, self._pending = self._pending[:MAX_BATCH], self._pending[MAX_BATCH:]
            self._call(self._trials, sum(op[0] == "trial" for op in ops), "apply", ops)
            busy += 1

    def _call(self, lane: _Lane, trials: int, method: str, *args: Any) -> None:
        if self._lost is not None:  # nothing more reaches a lost logger
            return
        if not any(lane is other for _, _, other in self._inflight):
            lane.progress_at = time.monotonic()  # it was idle: its clock starts now
        try:
            answer = lane.call(method, *args)
        except Exception as exc:  # a logger that can take no call is lost
            self._lose(exc, trials)
            return
        self._inflight.append((answer, trials, lane))

    def _collect(self) -> None:
        """The answered batches' errors and figures; a stall or a lost logger noted."""
        now = time.monotonic()
        waiting = []
        for i, (answer, trials, lane) in enumerate(self._inflight):
            if not answer.done():
                waiting.append((answer, trials, lane))
                continue
            lane.progress_at = now
            if lane.stalled:
                lane.stalled = False
                log.warning("the MLflow %s logger answers again", lane.name)
            try:
                got = answer.result()
                self._errors += got["errors"]
                self._answers[lane.name] = got["stats"]
            except Exception as exc:  # the logger died: what it had is reconciled
                self._lose(exc, sum(t for _, t, _ in waiting)
                           + sum(t for _, t, _ in self._inflight[i:]))
        self._inflight = waiting if self._lost is None else []
        for _, _, lane in waiting:
            if not lane.stalled and now - lane.progress_at >= LOGGER_STALL_S:
                lane.stalled = True
                log.warning("%s", self._stall_message(lane))

    def _not_logged(self) -> int:
        return (sum(t for _, t, _ in self._inflight)
                + sum(op[0] == "trial" for op in self._pending))

    def _stall_message(self, lane: _Lane) -> str:
        return (f"the MLflow {'' if lane.name == 'trials' else lane.name + ' '}logger answered "
                f"no batch for {LOGGER_STALL_S:g} s ({self._not_logged()} trials not "
                "logged; `kharness run --resume` logs them)")

    def _lose(self, exc: BaseException, trials: int) -> None:
        if self._lost is None:
            not_logged = trials + sum(op[0] == "trial" for op in self._pending)
            self._lost = (f"the MLflow logger was lost: {type(exc).__name__}: "
                          f"{str(exc)[:200]} ({not_logged} trials not logged; "
                          "`kharness run --resume` logs them)")
            log.error("%s", self._lost)
            self._errors.append(self._lost)
            self._pending = []

    def flush(self) -> list[str]:
        """Send everything and wait while the loggers answer, until every call so far has
        run; the errors they met. A logger that answers no batch for ``LOGGER_STALL_S``
        is an error (the trials it has not logged are named), not a wait without end."""
        self._pump(everything=True)
        self._call(self._trials, 0, "apply", [("flush",)])
        if self._plots is not self._trials:
            self._call(self._plots, 0, "apply", [("flush",)])
        while self._inflight:
            lanes = [lane for _, _, lane in self._inflight]
            stalled = min(lanes, key=lambda lane: lane.progress_at)
            left = stalled.progress_at + LOGGER_STALL_S - time.monotonic()
            if left <= 0:
                msg = self._stall_message(stalled)
                log.error("%s", msg)
                if msg not in self._errors:
                    self._errors.append(msg)
                break
            futures.wait([a for a, _, _ in self._inflight], timeout=left,
                         return_when=futures.FIRST_COMPLETED)
            self._collect()
        if self._actor is None:
            self.stats = self._local.stats()
        elif "trials" in self._answers:
            plots = self._answers.get("plots", self._answers["trials"])
            self.stats = {**self._answers["trials"], "plots_s": plots["plots_s"],
                          "plotter_ready_at": plots["ready_at"]}
        return list(self._errors)

    def close(self) -> None:
        for lane in {id(lane): lane for lane in (self._trials, self._plots)}.values():
            lane.close()


def start_loggers(uri: str, experiment_name: str, open_now: bool = True,
                  keep_s: float = 0.0, version: str = "") -> tuple[Any, Any]:
    """The run's MLflow logger processes (the trials', and the plots' where the driver's
    machine has the cores for a second one): each takes seconds to start and import
    MLflow, so a run starts them as soon as Ray is up and hands them to ``Logs``. On a
    kept fleet (``keep_s`` > 0), a spare the previous run left is taken where there is
    one, and a spare is left for the next run (``spares``), both of the harness's code
    ``version``."""
    one = _cores() < SEPARATE_PLOTTER_CORES

    def logger(plots: bool) -> Any:
        if keep_s <= 0:
            return start_trial_logger(uri, experiment_name, plots=plots, open_now=open_now)
        taken = spares.take(uri, experiment_name, plots, version)
        spares.leave(keep_s, plots, version)
        return taken or start_trial_logger(uri, experiment_name, plots=plots,
                                           open_now=open_now)

    trials = logger(one)
    return trials, (trials if one else logger(True))


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
    completed: a noted run completed (or, never committed, written anew), the others
    in batches (``log_trial_records``). Returns the trials logged; one that fails is
    logged as a warning (tracking never stops the tuning)."""
    noted, new = [], []
    for t in st.search.study.get_trials(deepcopy=False):
        status = t.user_attrs.get(ATTR_STATUS)
        if not t.state.is_finished() or status not in ("measured", "failed"):
            continue
        rec = logged.get((st.spec.name, t.number))
        if rec is not None and rec["done"]:
            continue
        record = trial_record(st, t.number, dict(t.params),
                              dict(t.user_attrs.get(ATTR_RESULT) or {}), status,
                              run=rec["run"] if rec else None)
        (new if record["run"] is None else noted).append(record)
    errors = []
    for record in noted:
        try:
            log_trial_record(tracker, trial_log, record)
        except Exception as exc:
            errors.append(f"trial {record['number']}: {type(exc).__name__}: {exc}"[:300])
    for i in range(0, len(new), MAX_BATCH):
        errors += log_trial_records(tracker, trial_log, new[i:i + MAX_BATCH])
    for error in errors:
        log.warning("MLflow: reconciling %s: %s", st.spec.name, error)
    return len(noted) + len(new) - len(errors)
