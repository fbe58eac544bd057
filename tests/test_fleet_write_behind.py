"""The run's studies in memory, written behind the driver (harness/search/write_behind.py):
finished trials reach the SQLite storage in the order of their numbers, a reopened study
has them all, and changes to a trial the storage already had are written too; a batch of
trials written in one transaction reads back as Optuna's own ``create_new_trial`` writes
it, and where that transaction fails the trials are written one by one."""

from __future__ import annotations

import logging
from pathlib import Path

import optuna
import pytest
import ray
from optuna.trial import TrialState

from harness.fleet.cluster import start_local_ray
from harness.search import make_storage, storage_url, write_behind
from harness.search.write_behind import WriteBehindStorage


@pytest.fixture(scope="module")
def local_ray():
    started = not ray.is_initialized()
    if started:
        start_local_ray(num_cpus=1, logging_level=logging.WARNING, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


def _stored(url: str, name: str) -> dict[int, tuple[str, float | None]]:
    study = optuna.load_study(study_name=name, storage=make_storage(url))
    return {t.number: (t.state.name, t.value) for t in study.trials}


@pytest.mark.slow
@pytest.mark.parametrize("process", [True, False], ids=["process", "thread"])
def test_trials_are_written_in_order_once_finished(local_ray, tmp_path: Path,
                                                   process: bool) -> None:
    url = storage_url(tmp_path, "wb")
    wb = WriteBehindStorage(url, process=process)
    study = optuna.create_study(study_name="s", storage=wb, load_if_exists=True)
    study.set_user_attr("eager", {"latency_ms": 2.0})
    t0, t1, t2 = study.ask(), study.ask(), study.ask()
    study.tell(t1, 1.0)  # finished before trial 0: held back, numbers stay in order
    wb.poll_stored(timeout_s=60)
    assert _stored(url, "s") == {}
    study.tell(t0, 3.0)
    study.tell(t2, state=TrialState.FAIL)
    got = wb.poll_stored(timeout_s=60)
    assert got == {("s", 0), ("s", 1), ("s", 2)}
    assert _stored(url, "s") == {0: ("COMPLETE", 3.0), 1: ("COMPLETE", 1.0),
                                 2: ("FAIL", None)}
    t3 = study.ask()  # left running: written as it is when the storage closes
    assert t3.number == 3
    wb.close()
    assert _stored(url, "s")[3] == ("RUNNING", None)
    assert optuna.load_study(study_name="s", storage=url).user_attrs["eager"] == {
        "latency_ms": 2.0}

    # Reopened: the same trials, numbers and attributes; the running trial, told now, is
    # updated where it is stored; new trials follow it.
    wb2 = WriteBehindStorage(url, process=process)
    again = optuna.create_study(study_name="s", storage=wb2, load_if_exists=True)
    assert [(t.number, t.state.name) for t in again.trials] == [
        (0, "COMPLETE"), (1, "COMPLETE"), (2, "FAIL"), (3, "RUNNING")]
    assert again.user_attrs["eager"] == {"latency_ms": 2.0}
    again.tell(3, 0.5)
    t4 = again.ask()
    again.tell(t4, 4.0)
    wb2.close()
    assert _stored(url, "s") == {0: ("COMPLETE", 3.0), 1: ("COMPLETE", 1.0),
                                 2: ("FAIL", None), 3: ("COMPLETE", 0.5),
                                 4: ("COMPLETE", 4.0)}


def _trials() -> list[optuna.trial.FrozenTrial]:
    """Trials of every kind a study holds: each distribution, state and attribute, an
    infinite value, a NaN intermediate value."""
    from optuna.distributions import (
        CategoricalDistribution,
        FloatDistribution,
        IntDistribution,
    )

    dists = {"x": FloatDistribution(1e-3, 1.0, log=True), "n": IntDistribution(16, 256, step=16),
             "kind": CategoricalDistribution([None, "tma", 3, 2.5])}
    out = []
    for i, (state, value) in enumerate([
            (TrialState.COMPLETE, 1.5), (TrialState.FAIL, None),
            (TrialState.PRUNED, 2.5), (TrialState.COMPLETE, float("inf")),
            (TrialState.RUNNING, None), (TrialState.COMPLETE, -0.25)]):
        out.append(optuna.trial.create_trial(
            state=state, value=value,
            params={"x": 0.01 * (i + 1), "n": 16 * (i + 1),
                    "kind": [None, "tma", 3, 2.5][i % 4]},
            distributions=dists,
            user_attrs={"status": "measured", "result": {"latency_ms": i, "extra": [1, "a"]}},
            system_attrs={"fixed_params": {"n": 16}} if i % 2 else {},
            intermediate_values={0: 3.0, 1: float("nan")} if state == TrialState.PRUNED
            else {}))
    return out


def _read(storage, study_id: int) -> list[tuple]:
    return [(t.number, t.state, t.values, t.params, t.distributions, t.user_attrs,
             t.system_attrs, str(t.intermediate_values), t.datetime_start, t.datetime_complete)
            for t in storage.get_all_trials(study_id)]


def test_a_batch_reads_back_as_create_new_trial_writes_it(tmp_path: Path) -> None:
    """``_insert_trials`` (one transaction, the storage's own ORM models) against
    ``create_new_trial(template_trial=...)`` one by one, read back through Optuna:
    numbers (following the trials already stored), states, values, params, distributions,
    attributes, intermediate values, start and end. It fails where a new Optuna writes
    its trials otherwise. Multi-objective too."""
    from optuna.study import StudyDirection

    storage = make_storage(storage_url(tmp_path, "bulk"))
    trials = _trials()
    for directions, batch in (([StudyDirection.MINIMIZE], trials),
                              ([StudyDirection.MINIMIZE, StudyDirection.MAXIMIZE], [
                                  optuna.trial.create_trial(values=[1.0, float("-inf")]),
                                  optuna.trial.create_trial(state=TrialState.FAIL)])):
        read = {}
        for way in ("one_by_one", "bulk"):
            sid = storage.create_new_study(directions, f"{way}-{len(directions)}")
            storage.create_new_trial(sid, template_trial=batch[0])  # one stored before
            if way == "bulk":
                write_behind._insert_trials(storage, [(sid, t) for t in batch[1:]])
            else:
                for t in batch[1:]:
                    storage.create_new_trial(sid, template_trial=t)
            read[way] = _read(storage, sid)
        assert [r[0] for r in read["bulk"]] == list(range(len(batch)))
        assert read["bulk"] == read["one_by_one"]


def test_the_writer_writes_one_by_one_where_a_batch_fails(tmp_path: Path, monkeypatch) -> None:
    """A batch the one transaction cannot write goes through ``create_new_trial``, trial
    by trial, and every trial is answered as written; after BULK_FAILURES batches in a
    row the writer no longer tries."""
    tries = []

    def refuse(*a, **k):
        tries.append(1)
        raise RuntimeError("no such table")

    monkeypatch.setattr(write_behind, "_insert_trials", refuse)
    writer = write_behind._Writer(storage_url(tmp_path, "refused"))
    writer.apply([("study", "s", [optuna.study.StudyDirection.MINIMIZE])])
    trials = _trials()
    written = []
    for i in range(0, len(trials), 2):
        written += writer.apply([("trial", "s", t) for t in trials[i:i + 2]])
    assert len(tries) == write_behind.BULK_FAILURES
    assert len(written) == len(trials)
    stored = optuna.load_study(study_name="s", storage=writer.storage).trials
    assert [t.state for t in stored] == [t.state for t in trials]
