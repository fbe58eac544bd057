"""The run's bookkeeping never waits in silence: an MLflow logger or an Optuna writer
that stops answering (injected through ``HARNESS_FAULTS``) is reported within seconds
at the end of the run, as an error naming what it waited for and the trials it leaves
to ``--resume``, and the end of the run goes on."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import optuna
import pytest
import ray
from mlflow.tracking import MlflowClient

from harness.fleet.cluster import NO_PRESTART
from harness.search import storage_url, write_behind
from harness.tracking import run_logging
from harness.tracking import tracker as track

STALL_S = 2.0  # the waits' limit, scaled down from 20 s: the same code path


@pytest.fixture(scope="module")
def local_ray():
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR",
                 runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}},
                 _system_config=NO_PRESTART)
    yield
    if started:
        ray.shutdown()


def _record(study_run: str, number: int) -> dict:
    return {"study": "s", "study_run": study_run, "number": number, "status": "measured",
            "config": {"BLOCK": 64}, "result": {"latency_ms": 1.0 + number}, "run": None,
            "tags": {"hardware": "H200"}}


def _bookkeeping(tmp_path: Path, db: Path, processes: bool, trials: int = 6
                 ) -> tuple[float, float, list[str], write_behind.WriteBehindStorage, str]:
    """A search's bookkeeping as ``harness/run/runner.py`` does it (trials told, their records
    held and released as they are stored), then the run's end: ``storage.close()``,
    ``logs.release(storage.stored)``, ``logs.flush()``. Returns the seconds ``close``
    took, the seconds the end took, the flush's errors, the storage and the study run."""
    tracker = track.Tracker(f"sqlite:///{db}", "faults")
    study_run = tracker.start_run("study", {"harness.level": "study"})
    storage = write_behind.WriteBehindStorage(storage_url(tmp_path, "faults"),
                                              process=processes)
    logs = run_logging.Logs(tracker, "faults", processes=processes)
    trial_log = tmp_path / "mlflow_trials.jsonl"
    try:
        study = optuna.create_study(study_name="s", storage=storage)
        # The writer started (a run starts it while its workers start); a hung one
        # keeps this batch, which then counts towards its silence.
        storage.poll_stored(timeout_s=60 if processes else 0)
        for n in range(trials):
            trial = study.ask()
            trial.suggest_int("BLOCK", 16, 256)
            study.tell(trial, 1.0 + n)
            logs.hold(("s", trial.number), trial_log, _record(study_run, trial.number))
            if n % 2:
                logs.release(storage.poll_stored())
        t0 = time.monotonic()
        storage.close()
        closed_s = time.monotonic() - t0
        logs.release(storage.stored)
        errors = logs.flush()
        end_s = time.monotonic() - t0
    finally:
        t0 = time.monotonic()
        logs.close()
        assert time.monotonic() - t0 < 1.0  # nothing waits for the hung call
    return closed_s, end_s, errors, storage, study_run


@pytest.mark.parametrize("processes", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["threads", "processes"])
def test_a_hung_mlflow_logger_is_reported_within_seconds(tmp_path, monkeypatch, caplog,
                                                         empty_mlflow_db, processes, request):
    """``logger_hang``: the logger never answers. The Optuna writer stores every trial;
    the end of the run reports the logger within STALL_S of its last sign of life, with
    the trials it did not log, and returns."""
    if processes:
        request.getfixturevalue("local_ray")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HARNESS_FAULTS", "logger_hang")
    monkeypatch.setattr(run_logging, "LOGGER_STALL_S", STALL_S)
    db = empty_mlflow_db(tmp_path / f"logger-hang-{processes}.db")
    with caplog.at_level(logging.WARNING):
        closed_s, end_s, errors, storage, _ = _bookkeeping(tmp_path, db, processes)
    assert storage.errors == [] and len(storage.stored) == 6 and closed_s < 1.0
    msg = (f"the MLflow logger answered no batch for {STALL_S:g} s (6 trials not logged; "
           "`kharness run --resume` logs them)")
    assert errors == [msg]
    assert end_s < STALL_S + 1.5
    assert msg in caplog.text  # logged as it happens, not only returned


def test_a_hung_optuna_writer_is_reported_within_seconds(tmp_path, monkeypatch, caplog,
                                                         empty_mlflow_db):
    """``writer_hang``: the writer never answers. ``close`` reports it within STALL_S of
    its last sign of life, naming the trials not stored, and returns; MLflow gets none
    of them (it never has a trial Optuna lost) and the logger's flush returns at once."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HARNESS_FAULTS", "writer_hang")
    monkeypatch.setattr(write_behind, "WRITER_STALL_S", STALL_S)
    db = empty_mlflow_db(tmp_path / "writer-hang.db")
    with caplog.at_level(logging.WARNING):
        closed_s, end_s, errors, storage, study_run = _bookkeeping(tmp_path, db, False)
    msg = (f"the Optuna writer answered no batch for {STALL_S:g} s (6 trials not stored in "
           f"{storage.url}; a resumed run measures them again)")
    assert storage.errors == [msg] and msg in caplog.text
    assert closed_s < STALL_S + 1.5 and end_s - closed_s < 1.0
    assert errors == [] and storage.stored == set()
    client = MlflowClient(f"sqlite:///{db}")
    assert client.search_runs([client.get_experiment_by_name("faults").experiment_id],
                              f"tags.mlflow.parentRunId = '{study_run}'") == []


def test_the_bookkeeping_keeps_pace_and_ends_at_once(tmp_path, monkeypatch, empty_mlflow_db):
    """Without faults: every trial stored and logged, and the end of the run (close,
    release, flush) takes well under a second once the search is over."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HARNESS_FAULTS", raising=False)
    db = empty_mlflow_db(tmp_path / "pace.db")
    closed_s, end_s, errors, storage, study_run = _bookkeeping(tmp_path, db, False, 40)
    assert errors == [] and storage.errors == [] and len(storage.stored) == 40
    assert end_s < 1.0
    client = MlflowClient(f"sqlite:///{db}")
    runs = client.search_runs([client.get_experiment_by_name("faults").experiment_id],
                              f"tags.mlflow.parentRunId = '{study_run}'", max_results=100)
    assert len(runs) == 40
