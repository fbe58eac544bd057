"""The run's studies in memory, written to their SQLite storage behind the driver.

Optuna's RDB storage costs the driver tens of milliseconds of Python per trial (a few
dozen SQL statements through SQLAlchemy's ORM for one ask and one tell): with a GPU
finishing a trial every 30-50 ms, the driver, not the GPUs, set the pace of a many-GPU
run. ``WriteBehindStorage`` keeps the run's studies in an ``InMemoryStorage`` (an ask and
a tell: about a millisecond) and a writer process copies each finished trial, whole and
in the order the trials were created, into the persistent storage (a Ray actor beside
the driver; on a run without GPUs, a thread of the driver: the interpreter sets its pace,
and a process costs seconds of CPU to start), so that a trial keeps its number there.
The driver learns which trials are stored (``stored``): a trial's MLflow record is sent
only once its trial is, so that ``--resume`` (which trusts the persistent storage) and
MLflow agree after a killed driver. A driver killed mid-run loses the trials not yet
written, which the resumed run asks for again; ``close`` writes everything.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Sequence
from concurrent import futures
from typing import Any

import optuna
import ray
from optuna.exceptions import DuplicatedStudyError
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial

log = logging.getLogger(__name__)

#: How long ``close`` waits for the writer to finish.
CLOSE_TIMEOUT_S = 600.0


class _Writer:
    """The writer: applies batches of operations to the storage at ``url`` in the order
    they come (one caller, one thread) and answers with the trials written, as (study
    name, number)."""

    def __init__(self, url: str) -> None:
        from harness.search import make_storage

        self.storage = make_storage(url)
        self.ids: dict[str, int] = {}

    def _study(self, name: str) -> int:
        if name not in self.ids:
            self.ids[name] = self.storage.get_study_id_from_name(name)
        return self.ids[name]

    def apply(self, ops: list[tuple]) -> list[tuple[str, int]]:
        written = []
        storage = self.storage
        for kind, name, *rest in ops:
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
                elif kind == "trial":
                    storage.create_new_trial(self._study(name), template_trial=rest[0])
                    written.append((name, rest[0].number))
                elif kind == "trial_update":  # a trial loaded from the storage changed
                    _update(storage, self._study(name), rest[0])
            except Exception as exc:  # one bad write must not stop the others
                log.warning("writing %s of study %s failed: %s", kind, name, exc)
        return written


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
                scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False)
            ).remote(url)
        else:
            self._thread = futures.ThreadPoolExecutor(1, thread_name_prefix="harness-optuna")
            self._local = self._thread.submit(_Writer, url)
        self._batch: list[tuple] = []
        self._acks: list[futures.Future] = []  # each batch's answer, not collected yet
        self._lock = threading.RLock()
        self._names: dict[int, str] = {}  # study id -> name
        self._next: dict[int, int] = {}  # study id -> the first number not sent yet
        self._loaded: dict[int, int] = {}  # study id -> trials loaded from the storage
        self.stored: set[tuple[str, int]] = set()  # (study, number) written
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

    def flush(self) -> None:
        """Send the operations gathered so far to the writer (one batch)."""
        with self._lock:
            batch, self._batch = self._batch, []
        if batch:
            if self._thread is not None:  # one thread: batches apply in order
                self._acks.append(self._thread.submit(
                    lambda b=batch: self._local.result().apply(b)))
            else:
                self._acks.append(self._writer.apply.remote(batch).future())

    def poll_stored(self, timeout_s: float = 0.0) -> set[tuple[str, int]]:
        """Send what is gathered; the trials written since the last call, (study name,
        number), waiting up to ``timeout_s`` for the writer."""
        self.flush()
        new: set[tuple[str, int]] = set()
        if self._acks:
            # The writer answers its batches in order: the answered ones are a prefix.
            futures.wait(self._acks, timeout=timeout_s)
            n = next((i for i, f in enumerate(self._acks) if not f.done()), len(self._acks))
            ready, self._acks = self._acks[:n], self._acks[n:]
            for ack in ready:
                try:
                    new.update(tuple(x) for x in ack.result())  # type: ignore[misc]
                except Exception as exc:  # the writer is gone: nothing more is stored
                    log.warning("the study writer failed: %s", exc)
        self.stored |= new
        return new

    def close(self) -> None:
        """Write everything (unfinished trials as they are) and wait for the writer."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for sid in self._names:
                self._send(sid, everything=True)
        self.poll_stored(timeout_s=CLOSE_TIMEOUT_S)
        if self._acks:
            log.warning("the study writer did not finish within %g s", CLOSE_TIMEOUT_S)
        if self._thread is not None:
            self._thread.shutdown(wait=False)
        else:
            ray.kill(self._writer)
