"""The run's studies in memory, written to their SQLite storage behind the driver.

Optuna's RDB storage costs the driver tens of milliseconds of Python per trial (a few
dozen SQL statements through SQLAlchemy's ORM for one ask and one tell): with a GPU
finishing a trial every 30-50 ms, the driver, not the GPUs, set the pace of a many-GPU
run. ``WriteBehindStorage`` keeps the run's studies in an ``InMemoryStorage`` (an ask and
a tell: about a millisecond) and a writer process copies each finished trial, whole and
in the order the trials were created, into the persistent storage (a Ray actor beside
the driver; on a run without GPUs, a thread of the driver: the interpreter sets its pace,
and a process costs seconds of CPU to start), so that a trial keeps its number there.
The writer writes each batch of finished trials in one transaction through the storage's
own session and ORM models (``_insert_trials``: hundreds of trials a second, where
``create_new_trial`` one by one managed about fifty), falling back to ``create_new_trial``
where that fails. A driver killed mid-run loses the trials not yet written, which the
resumed run asks for again; ``close`` writes everything.

The driver learns which trials are stored (``stored``, ``poll_stored``): a trial's MLflow
record is sent only once its trial is (``run_logging.Logs.hold``/``release``), so that
MLflow never has a trial Optuna lost, and ``--resume`` (which trusts the persistent
storage) and MLflow agree after a killed driver. That ordering costs a trial one or two
passes of the scheduler's loop (milliseconds) while the writer keeps pace, and nothing at
the end of a run: ``close`` then has only the last batch to wait for.

No wait here is silent: the writer answers every batch (at most ``MAX_BATCH`` operations,
so that answers come every few seconds even one trial at a time), and ``close`` waits
only while answers come: a writer that answers no batch for ``WRITER_STALL_S`` is
reported as an error naming the trials not stored (``errors``), and the run goes on.
During the search such a stall is logged as a warning.

Fault injection (``harness.run.faults``): ``writer_hang``, the writer never answers a batch
(until ``close`` gives up on it).
"""

from __future__ import annotations

import copy
import json
import logging
import threading
import time
from collections.abc import Sequence
from concurrent import futures
from typing import Any

import optuna
import ray
from optuna.exceptions import DuplicatedStudyError
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial

from harness.run import faults

log = logging.getLogger(__name__)

#: How long ``close`` waits for the writer to answer a batch before it reports the
#: trials not stored and gives up on it.
WRITER_STALL_S = 20.0
#: Operations per batch at most: the writer answers every few seconds even on its slow
#: path (one trial at a time), so that a stall is told from a long batch.
MAX_BATCH = 256
#: Batches unanswered at once while the search goes on: one being written, one waiting;
#: what comes meanwhile goes into the next, so that a writer that falls behind writes
#: larger (cheaper per trial) batches.
IN_FLIGHT = 2
#: Batches in a row that failed to go in one transaction before the writer writes
#: every trial one by one.
BULK_FAILURES = 3


def _insert_trials(storage: Any, trials: list[tuple[int, FrozenTrial]]) -> None:
    """Trials (study id, trial) written in ONE transaction of the RDB storage's own
    session, through its ORM models: the rows ``create_new_trial(template_trial=...)``
    writes for each, numbered after the study's trials already stored as it numbers
    them, without its few dozen queries per trial (``test_fleet_write_behind.py`` holds
    them to what it writes). Raises where this Optuna's storage differs."""
    from optuna import distributions
    from optuna.storages._rdb import models
    from optuna.storages._rdb.storage import _create_scoped_session
    from sqlalchemy import func

    with _create_scoped_session(storage.scoped_session) as session:
        count: dict[int, int] = {}
        rows = []
        for sid, t in trials:
            if sid not in count:
                count[sid] = session.query(func.count(models.TrialModel.trial_id)).filter(
                    models.TrialModel.study_id == sid).scalar()
            rows.append(models.TrialModel(study_id=sid, number=count[sid], state=t.state,
                                          datetime_start=t.datetime_start,
                                          datetime_complete=t.datetime_complete))
            count[sid] += 1
        session.add_all(rows)
        session.flush()  # the trials' ids, which their values, params and attributes name
        children: list[Any] = []
        for row, (_, t) in zip(rows, trials, strict=True):
            tid = row.trial_id
            if t.values is not None and len(t.values) > 1:
                values = list(t.values)
            else:
                values = [] if t.value is None else [t.value]
            for objective, value in enumerate(values):
                stored, kind = models.TrialValueModel.value_to_stored_repr(value)
                children.append(models.TrialValueModel(trial_id=tid, objective=objective,
                                                       value=stored, value_type=kind))
            for name, value in t.params.items():
                dist = t.distributions[name]
                children.append(models.TrialParamModel(
                    trial_id=tid, param_name=name, param_value=dist.to_internal_repr(value),
                    distribution_json=distributions.distribution_to_json(dist)))
            for model, attrs in ((models.TrialUserAttributeModel, t.user_attrs),
                                 (models.TrialSystemAttributeModel, t.system_attrs)):
                children += [model(trial_id=tid, key=k, value_json=json.dumps(v))
                             for k, v in attrs.items()]
            for step, value in t.intermediate_values.items():
                stored, kind = models.TrialIntermediateValueModel \
                    .intermediate_value_to_stored_repr(value)
                children.append(models.TrialIntermediateValueModel(
                    trial_id=tid, step=step, intermediate_value=stored,
                    intermediate_value_type=kind))
        session.add_all(children)


class _Writer:
    """The writer: applies batches of operations to the storage at ``url`` in the order
    they come (one caller, one thread) and answers with the trials written, as (study
    name, number)."""

    def __init__(self, url: str) -> None:
        from harness.search import make_storage

        self.storage = make_storage(url)
        self.ids: dict[str, int] = {}
        self.bulk_failures = 0
        self._stop = threading.Event()  # set by ``stop``: what a hung batch waits for

    def _study(self, name: str) -> int:
        if name not in self.ids:
            self.ids[name] = self.storage.get_study_id_from_name(name)
        return self.ids[name]

    def apply(self, ops: list[tuple]) -> list[tuple[str, int]]:
        if faults.active("writer_hang"):  # testing aid: an answer that never comes
            self._stop.wait()
            raise RuntimeError("writer_hang: given up on")
        written: list[tuple[str, int]] = []
        storage = self.storage
        trials: list[tuple[str, FrozenTrial]] = []  # consecutive ones, written together
        for kind, name, *rest in ops:
            if kind == "trial":
                trials.append((name, rest[0]))
                continue
            written += self._trials(trials)
            trials = []
            try:
                if kind == "study":
                    try:
                        self.ids[name] = storage.create_new_study(rest[0], name)
                    except DuplicatedStudyError:
                        self.ids[name] = storage.get_study_id_from_name(name)
                elif kind == "study_user_attr":
                    storage.set_study_user_attr(self._study(name), *rest)
                elif kind == "study_system_attr":
                    storage.set_study_system_attr(self._study(name), *rest)
                elif kind == "trial_update":  # a trial loaded from the storage changed
                    _update(storage, self._study(name), rest[0])
            except Exception as exc:  # one bad write must not stop the others
                log.warning("writing %s of study %s failed: %s", kind, name, exc)
        return written + self._trials(trials)

    def _trials(self, trials: list[tuple[str, FrozenTrial]]) -> list[tuple[str, int]]:
        """New trials, in one transaction where it can, else one by one."""
        if not trials:
            return []
        if self.bulk_failures < BULK_FAILURES:
            try:
                _insert_trials(self.storage, [(self._study(n), t) for n, t in trials])
                self.bulk_failures = 0
                return [(n, t.number) for n, t in trials]
            except Exception as exc:
                self.bulk_failures += 1
                log.warning("a batch of %d trials could not be written in one transaction "
                            "(%s: %s); written one by one", len(trials), type(exc).__name__,
                            str(exc)[:300])
        written = []
        for name, t in trials:
            try:
                self.storage.create_new_trial(self._study(name), template_trial=t)
                written.append((name, t.number))
            except Exception as exc:  # one bad write must not stop the others
                log.warning("writing trial %d of study %s failed: %s", t.number, name, exc)
        return written

    def stop(self) -> None:
        """Wake a batch that hangs (an injected ``writer_hang``): the driver gave up."""
        self._stop.set()


_WriterActor = ray.remote(num_cpus=0, max_restarts=0)(_Writer)


def _update(storage: Any, study_id: int, t: FrozenTrial) -> None:
    tid = storage.get_trial_id_from_study_id_trial_number(study_id, t.number)
    for k, v in t.user_attrs.items():
        storage.set_trial_user_attr(tid, k, v)
    if t.state.is_finished() and storage.get_trial(tid).state != t.state:
        storage.set_trial_state_values(tid, t.state, t.values)


class WriteBehindStorage(optuna.storages.InMemoryStorage):
    """Studies in memory, finished trials written to ``url`` by a writer process (or,
    ``process=False``, a thread), in the order of their numbers (see the module's
    docstring)."""

    def __init__(self, url: str, process: bool = True) -> None:
        super().__init__()
        from harness.search import make_storage

        self.url = url
        self._backend = make_storage(url)  # read once per study, when it is opened
        self._writer: Any = None
        self._thread: futures.ThreadPoolExecutor | None = None
        if process:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            # Beside the driver: the storage is a file of the driver's machine.
            here = ray.get_runtime_context().get_node_id()
            self._writer = _WriterActor.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
                **faults.actor_env(),
            ).remote(url)
        else:
            self._thread = futures.ThreadPoolExecutor(1, thread_name_prefix="harness-optuna")
            self._local = self._thread.submit(_Writer, url)
        self._batch: list[tuple] = []
        # Each batch's answer not collected yet, with the trials it writes.
        self._acks: list[tuple[futures.Future, int]] = []
        self._progress_at = time.monotonic()  # the writer's last answer, or first batch since
        self._stalled = False
        self._lock = threading.RLock()
        self._names: dict[int, str] = {}  # study id -> name
        self._next: dict[int, int] = {}  # study id -> the first number not sent yet
        self._loaded: dict[int, int] = {}  # study id -> trials loaded from the storage
        self.stored: set[tuple[str, int]] = set()  # (study, number) written
        self._new: set[tuple[str, int]] = set()  # written, not yet returned by poll_stored
        self.errors: list[str] = []  # what went wrong with the writer, for the run's report
        self._closed = False

    # -- studies ------------------------------------------------------------------------
    def create_new_study(self, directions: Sequence[StudyDirection],
                         study_name: str | None = None) -> int:
        with self._lock:
            if study_name is not None and self._load(study_name) is not None:
                raise DuplicatedStudyError(f"study {study_name!r} exists")
            sid = super().create_new_study(directions, study_name)
            name = self.get_study_name_from_id(sid)
            self._names[sid], self._next[sid], self._loaded[sid] = name, 0, 0
            self._batch.append(("study", name, list(directions)))
            return sid

    def get_study_id_from_name(self, study_name: str) -> int:
        with self._lock:
            sid = self._load(study_name)
            return sid if sid is not None else super().get_study_id_from_name(study_name)

    def _load(self, name: str) -> int | None:
        """The study ``name`` in memory, copied from the storage on first use (its
        trials keep their numbers); None where neither holds it."""
        try:
            return super().get_study_id_from_name(name)
        except KeyError:
            pass
        try:
            bid = self._backend.get_study_id_from_name(name)
        except KeyError:
            return None
        sid = super().create_new_study(self._backend.get_study_directions(bid), name)
        for k, v in self._backend.get_study_user_attrs(bid).items():
            super().set_study_user_attr(sid, k, v)
        for k, v in self._backend.get_study_system_attrs(bid).items():
            super().set_study_system_attr(sid, k, v)
        trials = self._backend.get_all_trials(bid, deepcopy=False)
        for t in sorted(trials, key=lambda t: t.number):
            super().create_new_trial(sid, template_trial=t)
        self._names[sid], self._next[sid], self._loaded[sid] = name, len(trials), len(trials)
        return sid

    def set_study_user_attr(self, study_id: int, key: str, value: Any) -> None:
        with self._lock:
            super().set_study_user_attr(study_id, key, value)
            self._batch.append(("study_user_attr", self._names[study_id], key, value))

    def set_study_system_attr(self, study_id: int, key: str, value: Any) -> None:
        with self._lock:
            super().set_study_system_attr(study_id, key, value)
            self._batch.append(("study_system_attr", self._names[study_id], key, value))

    def delete_study(self, study_id: int) -> None:
        raise NotImplementedError("delete a study in its persistent storage")

    # -- trials: written once finished, in order ----------------------------------------
    def create_new_trial(self, study_id: int, template_trial: FrozenTrial | None = None
                         ) -> int:
        with self._lock:
            tid = super().create_new_trial(study_id, template_trial)
            self._send(study_id)
            return tid

    def set_trial_state_values(self, trial_id: int, state: Any,
                               values: Sequence[float] | None = None) -> bool:
        with self._lock:
            ok = super().set_trial_state_values(trial_id, state, values)
            self._changed(trial_id)
            return ok

    def set_trial_user_attr(self, trial_id: int, key: str, value: Any) -> None:
        with self._lock:
            super().set_trial_user_attr(trial_id, key, value)
            self._changed(trial_id, send=False)

    def _changed(self, trial_id: int, send: bool = True) -> None:
        sid = self._trial_id_to_study_id_and_number[trial_id][0]
        t = self.get_trial(trial_id)
        if t.number < self._loaded[sid]:  # a trial the storage had: update it there
            if t.state.is_finished():
                self._batch.append(("trial_update", self._names[sid], copy.deepcopy(t)))
        elif send:
            self._send(sid)

    def _send(self, study_id: int, everything: bool = False) -> None:
        """Send the study's finished trials that follow the last one sent, in order
        (``everything``: the trials left unfinished too, as they are)."""
        trials = self.get_all_trials(study_id, deepcopy=False)
        n = self._next[study_id]
        while n < len(trials) and (everything or trials[n].state.is_finished()):
            self._batch.append(("trial", self._names[study_id], copy.deepcopy(trials[n])))
            n += 1
        self._next[study_id] = n

    def flush(self, everything: bool = True) -> None:
        """Send the operations gathered so far to the writer, in batches of at most
        ``MAX_BATCH`` (not ``everything``: only while fewer than ``IN_FLIGHT`` batches
        are unanswered; the rest waits for the next call, in a larger batch)."""
        self._collect()
        with self._lock:
            n = len(self._batch) if everything else \
                MAX_BATCH * max(0, IN_FLIGHT - len(self._acks))
            batch, self._batch = self._batch[:n], self._batch[n:]
        for i in range(0, len(batch), MAX_BATCH):
            chunk = batch[i:i + MAX_BATCH]
            if not self._acks:  # the writer was idle: its clock starts now
                self._progress_at = time.monotonic()
            if self._thread is not None:  # one thread: batches apply in order
                ack = self._thread.submit(lambda b=chunk: self._local.result().apply(b))
            else:
                ack = self._writer.apply.remote(chunk).future()
            self._acks.append((ack, sum(op[0] == "trial" for op in chunk)))

    def _collect(self) -> None:
        """The trials the answered batches wrote, into ``stored`` and ``_new`` (the
        writer answers in order: the answered ones are a prefix); a stall is warned of."""
        n = next((i for i, (f, _) in enumerate(self._acks) if not f.done()), len(self._acks))
        ready, self._acks = self._acks[:n], self._acks[n:]
        for ack, trials in ready:
            try:
                written = {tuple(x) for x in ack.result()}  # type: ignore[misc]
            except Exception as exc:  # the writer is gone: nothing more is stored
                self._error(f"the Optuna writer failed: {type(exc).__name__}: {exc} "
                            f"({trials} trials not stored in {self.url})"[:400])
                continue
            self._new |= written  # type: ignore[arg-type]
            self.stored |= written  # type: ignore[arg-type]
        if ready:
            self._progress_at = time.monotonic()
            if self._stalled:
                self._stalled = False
                log.warning("the Optuna writer answers again")
        elif self._acks and not self._stalled \
                and time.monotonic() - self._progress_at >= WRITER_STALL_S:
            self._stalled = True
            log.warning("%s", self._stall_message())

    def _stall_message(self) -> str:
        waiting = sum(n for _, n in self._acks) + sum(op[0] == "trial" for op in self._batch)
        return (f"the Optuna writer answered no batch for {WRITER_STALL_S:g} s ({waiting} "
                f"trials not stored in {self.url}; a resumed run measures them again)")

    def _error(self, msg: str) -> None:
        log.error("%s", msg)
        self.errors.append(msg)

    def poll_stored(self, timeout_s: float = 0.0) -> set[tuple[str, int]]:
        """Send what is gathered (while the writer keeps up; with ``timeout_s``, all of
        it); the trials written since the last call, (study name, number), waiting up to
        ``timeout_s`` for the writer to answer every batch (woken by its answers)."""
        self.flush(everything=timeout_s > 0)
        if self._acks and timeout_s > 0:
            futures.wait([f for f, _ in self._acks], timeout=timeout_s)
        self._collect()
        if self._acks and timeout_s > 0:
            log.warning("the Optuna writer did not answer every batch within %g s (%d trials "
                        "not stored yet)", timeout_s, sum(n for _, n in self._acks))
        new, self._new = self._new, set()
        return new

    def close(self) -> None:
        """Write everything (unfinished trials as they are) and wait for the writer while
        it answers: one that answers no batch for ``WRITER_STALL_S`` is reported (an
        error naming the trials not stored) and given up on."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for sid in self._names:
                self._send(sid, everything=True)
        self.flush()
        while self._acks:
            left = self._progress_at + WRITER_STALL_S - time.monotonic()
            if left <= 0:
                self._error(self._stall_message())
                break
            futures.wait([f for f, _ in self._acks], timeout=left,
                         return_when=futures.FIRST_COMPLETED)
            self._collect()
        if self._thread is not None:
            if self._local.done() and self._local.exception() is None:
                self._local.result().stop()  # a hung batch returns, its thread ends
            self._thread.shutdown(wait=False, cancel_futures=True)
        else:
            ray.kill(self._writer)
