"""The search's MLflow logging away from the driver: a TrialLogger Ray actor (real local
Ray, real MLflow on SQLite) logs trial runs in order into the driver's store, and the
thread stand-in does the same where no actor can start."""

from __future__ import annotations

import json
import os
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
import ray
from mlflow.tracking import MlflowClient

from harness import run_logging as run_mod
from harness.fleet.cluster import NO_PRESTART
from harness.sqlite_commits import fast_commits
from harness.tracking import tracker as track


@pytest.fixture(scope="module")
def local_ray():
    started = not ray.is_initialized()
    if started:
        # "local": a Ray of its own, never one another process left an address file for.
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR",
                 runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}},
                 _system_config=NO_PRESTART)
    yield
    if started:
        ray.shutdown()


def _record(study_run: str, number: int, status: str = "measured") -> dict:
    result = {"latency_ms": 1.0 + number, "max_abs_err": 1e-3, "extra": {"node_id": "n1"}}
    if status == "failed":
        result = {"reason": "compile error: boom", "extra": {}}
    return {"study": "s", "study_run": study_run, "number": number, "status": status,
            "config": {"BLOCK": 64 * (number + 1)}, "result": result, "run": None,
            "tags": {"hardware": "H200", "kernel": "k"}}


def _study_with_three_trials() -> Any:
    import optuna

    study = optuna.create_study(study_name="plots")
    for block, ms in ((64, 2.0), (128, 1.5), (256, 1.8)):
        study.enqueue_trial({"BLOCK": block})
        trial = study.ask()
        assert trial.suggest_categorical("BLOCK", [64, 128, 256]) == block
        trial.set_user_attr("status", "measured")
        trial.set_user_attr("result", {"latency_ms": ms, "roofline": 0.5, "tflops": 100.0})
        study.tell(trial, ms)
    return study


@pytest.mark.slow
@pytest.mark.parametrize("actor,cores,processes",
                         [(True, 16, True), (True, 2, True), (False, 2, False),
                          (False, 2, True)],
                         ids=["actors", "one-actor", "thread", "no-actor"])
def test_the_logger_logs_in_order_draws_plots_and_reports_failures(local_ray, tmp_path,
                                                                   monkeypatch, actor, cores,
                                                                   processes, empty_mlflow_db):
    """One logger (its own processes; a thread of the driver, as on a run without GPUs
    or where no actor starts) for a whole study, as in a run: trial runs logged in order
    into the driver's store, the finished study's plots drawn from its Optuna storage,
    and a failed call reported by the flush, not raised. (One logger per case: each
    logger process takes seconds to start.)"""
    monkeypatch.chdir(tmp_path)  # the relative store path resolves against the driver's cwd
    monkeypatch.setattr(run_mod, "_cores", lambda: cores)
    if not actor:
        def refuse(*a, **k):
            raise RuntimeError("no actor here")
        monkeypatch.setattr(run_mod, "start_trial_logger", refuse)
    # A relative path, as the default store is (MLflow caches a store per URI string in
    # a process: one name per case).
    db = f"mlflow-{actor}-{cores}-{processes}.db"
    empty_mlflow_db(tmp_path / db)
    tracker = track.Tracker(f"sqlite:///{db}", "logger-test")
    study_run = tracker.start_run("study", {"harness.level": "study"})
    logs = run_mod.Logs(tracker, "logger-test", processes=processes)
    assert (logs._actor is not None) == actor
    # A process of its own for the plots, beside the trials' one, on a machine with
    # cores to spare; with few, the trials' one draws them too.
    assert (logs._plotter is not None) == actor
    if actor:
        assert (logs._plotter is logs._actor) == (cores < run_mod.SEPARATE_PLOTTER_CORES)
    trial_log = tmp_path / "trials.jsonl"
    try:
        for n in range(4):
            logs.trial(trial_log, _record(study_run, n, "failed" if n == 2 else "measured"))
        logs.log(study_run, metrics={"eager_latency_ms": 3.5}, params={"eager_status": "ok"})
        t_sent = time.monotonic()
        assert logs.flush() == []
        # Its figures: four trials, and its clock readings on this process's clock.
        assert logs.stats["trials"] == 4 and logs.stats["trials_s"] > 0
        assert logs.stats["ready_at"] <= logs.stats["caught_up_at"] <= time.monotonic()
        assert logs.stats["caught_up_at"] >= t_sent - 60
        study = _study_with_three_trials()
        logs.trial_plots(study_run, study.get_trials(deepcopy=False), "minimize", "a title")
        assert logs.flush() == []
        logs.log("no-such-run", metrics={"x": 1.0})
        errors = logs.flush()
    finally:
        logs.close()
    assert len(errors) == 1 and "no-such-run" in errors[0]
    client = MlflowClient(f"sqlite:///{tmp_path / db}")
    runs = client.search_runs([tracker.experiment_id],
                              filter_string=f"tags.mlflow.parentRunId = '{study_run}'")
    by_trial = {int(r.data.tags["harness.trial"]): r for r in runs}
    assert sorted(by_trial) == [0, 1, 2, 3]
    assert by_trial[2].info.status == "FAILED" and by_trial[1].info.status == "FINISHED"
    assert by_trial[2].data.tags["harness.failure_reason"] == "compile error: boom"
    assert by_trial[3].data.params["BLOCK"] == "256" and by_trial[0].data.tags["hardware"] == "H200"
    history = client.get_metric_history(study_run, "trial_latency_ms")
    assert [m.step for m in history] == [0, 1, 3]  # in order; the failed trial has none
    assert client.get_run(study_run).data.metrics["eager_latency_ms"] == 3.5
    lines = [json.loads(x) for x in trial_log.read_text().splitlines()]
    assert [x["trial"] for x in lines if x.get("done")] == [0, 1, 2, 3]
    # The harness commits in WAL mode (a property of the file), logger process or thread.
    with sqlite3.connect(tmp_path / db) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    names = {a.path for a in client.list_artifacts(study_run, "plots")}
    assert "plots/history.png" in names
    png = Path(client.download_artifacts(study_run, "plots/history.png", str(tmp_path)))
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_absolute_uri(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert track.absolute_uri("sqlite:///m.db") == f"sqlite:///{tmp_path / 'm.db'}"
    assert track.absolute_uri("sqlite:////abs/m.db") == "sqlite:////abs/m.db"
    assert track.absolute_uri("http://127.0.0.1:5000") == "http://127.0.0.1:5000"
    assert Path(track.absolute_uri("sqlite:///x/../m.db")[len("sqlite:///"):]).is_absolute()


def test_history_points_are_written_in_batches(tmp_path, monkeypatch, empty_mlflow_db):
    """The study run's history gets every measured trial's point, written
    HISTORY_BATCH at a time and at the flush, not one write per trial."""
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    monkeypatch.chdir(tmp_path)
    logger = track.TrialLogger(f"sqlite:///{empty_mlflow_db(tmp_path / 'h.db')}", "history")
    logger.HISTORY_BATCH = batch = 4  # the class's 32, scaled down: the same code path
    try:
        writes = []
        real = logger.tracker.log_history
        monkeypatch.setattr(logger.tracker, "log_history",
                            lambda *a, **k: (writes.append(len(a[2])), real(*a, **k)))
        study_run = logger.tracker.start_run("study", {"harness.level": "study"})
        n = 2 * batch + 3
        for i in range(n):
            logger.trial(str(tmp_path / "t.jsonl"),
                         _record(study_run, i, "failed" if i == 3 else "measured"))
        assert writes == [batch, batch]  # two batches so far (trial 3 failed: no point)
        assert logger.flush() == []
        assert writes == [batch, batch, n - 1 - 2 * batch]  # the rest at the flush
        steps = sorted(m.step for m in logger.tracker.client.get_metric_history(
            study_run, track.HISTORY_METRIC))
        assert steps == [i for i in range(n) if i != 3]
    finally:
        event.remove(Engine, "connect", fast_commits)


def test_git_sha_is_the_checkouts_unless_overridden(monkeypatch: pytest.MonkeyPatch) -> None:
    """Provenance names the checkout's commit; HARNESS_GIT_SHA names it where the code
    runs from a copy whose .git is not the code's (the device's synced working tree
    carried a stale one: packs named a commit older than the code that tuned them)."""
    import subprocess

    root = Path(track.__file__).resolve().parents[2]
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, cwd=root).stdout.strip()
    track.git_sha.cache_clear()
    monkeypatch.delenv("HARNESS_GIT_SHA", raising=False)
    try:
        assert track.git_sha() == (head or "unknown")
        track.git_sha.cache_clear()
        monkeypatch.setenv("HARNESS_GIT_SHA", "0123abc")
        assert track.git_sha() == "0123abc"
    finally:
        track.git_sha.cache_clear()


def test_bookkeeping_runs_in_processes_beside_gpus_and_as_told() -> None:
    """fleet.bookkeeping: auto starts the writer and logger processes only for a run
    with GPU targets; processes or threads are taken as given."""
    from harness.experiment import Experiment
    from harness.run import bookkeeping_processes

    def exp(mode: str) -> Experiment:
        return Experiment.model_validate({"name": "b", "kernel": "tests.fault_kernels:Faulty",
                                          "shapes": [{"N": 256}],
                                          "fleet": {"bookkeeping": mode}})

    assert bookkeeping_processes(exp("auto"), ["H100", "cpu"])
    assert not bookkeeping_processes(exp("auto"), ["cpu"])
    assert bookkeeping_processes(exp("processes"), ["cpu"])
    assert not bookkeeping_processes(exp("threads"), ["H200"])
