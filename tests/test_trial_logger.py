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

from harness.fleet.cluster import NO_PRESTART
from harness.search.sqlite_commits import fast_commits
from harness.tracking import run_logging as run_mod
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
    # Two logger processes (cores=16) on a loaded 2-core machine: the plots' one, importing
    # the plotting stack beside the suite's other worker, once answered after the stall
    # bound. Stalls have tests of their own (test_bookkeeping_faults.py).
    monkeypatch.setattr(run_mod, "LOGGER_STALL_S", 120.0)
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
    """Through the client (a tracking server), the study run's history gets every
    measured trial's point, written HISTORY_BATCH at a time and at the flush, not one
    write per trial."""
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    monkeypatch.chdir(tmp_path)
    logger = track.TrialLogger(f"sqlite:///{empty_mlflow_db(tmp_path / 'h.db')}", "history")
    monkeypatch.setattr(logger.tracker, "sql_store", lambda: None)  # the client's path
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
    from harness.run.bookkeeping import bookkeeping_processes

    def exp(mode: str) -> Experiment:
        return Experiment.model_validate({"name": "b", "kernel": "tests.fault_kernels:Faulty",
                                          "shapes": [{"N": 256}],
                                          "fleet": {"bookkeeping": mode}})

    assert bookkeeping_processes(exp("auto"), ["H100", "cpu"])
    assert not bookkeeping_processes(exp("auto"), ["cpu"])
    assert bookkeeping_processes(exp("processes"), ["cpu"])
    assert not bookkeeping_processes(exp("threads"), ["H200"])


def _read_trials(client: MlflowClient, experiment_id: str, study_run: str) -> dict[str, dict]:
    """The study run's trial runs as MlflowClient reads them back, by name: everything
    but the run's own id (replaced where it shows, in the artifact location)."""
    out = {}
    for r in client.search_runs([experiment_id],
                                filter_string=f"tags.mlflow.parentRunId = '{study_run}'"):
        rid = r.info.run_id
        out[r.info.run_name] = {
            "tags": dict(r.data.tags), "params": dict(r.data.params),
            "metrics": dict(r.data.metrics), "status": r.info.status,
            "start": r.info.start_time, "end": r.info.end_time,
            "stage": r.info.lifecycle_stage, "user": r.info.user_id,
            "artifact_uri": r.info.artifact_uri.replace(rid, "<id>"),
            "history": {k: [(m.value, m.timestamp, m.step)
                            for m in client.get_metric_history(rid, k)]
                        for k in r.data.metrics}}
    return out


def test_bulk_runs_read_back_as_the_clients(tmp_path, monkeypatch, empty_mlflow_db):
    """A batch of trials written in one transaction of MLflow's SQL store
    (``track._insert_trial_runs``) reads back through MlflowClient exactly as the same
    trials logged through the client (create_run, log_batch, set_terminated): name,
    tags (the parent included), params (a long one truncated alike), metrics and their
    history, status, start and end, and the study run's latency history. It fails where
    a new MLflow writes its runs otherwise."""
    from harness.tracking.run_logging import logged

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{empty_mlflow_db(tmp_path / 'parity.db')}"
    tracker = track.Tracker(uri, "parity")
    assert tracker.sql_store() is not None  # the default store takes the bulk path
    now = 1_750_000_000_123
    monkeypatch.setattr(track, "_now_ms", lambda: now)  # one clock for both ways
    client = MlflowClient(uri)
    read: dict[str, dict] = {}
    history: dict[str, tuple] = {}
    for way in ("client", "bulk"):
        study_run = tracker.start_run(f"study {way}", {"harness.level": "study"})
        recs = [_record(study_run, n, "failed" if n == 2 else "measured") for n in range(5)]
        recs[1]["config"]["long"] = "x" * 7000  # over MLflow's limit: truncated
        recs[3]["status"] = "cut"  # a run, no history point
        recs[4]["result"]["tflops"] = float("nan")  # not a metric
        tracker._sql = False if way == "client" else None
        assert (tracker.sql_store() is None) == (way == "client")
        trial_log = tmp_path / f"{way}.jsonl"
        assert track.log_trial_records(tracker, trial_log, recs) == []
        read[way] = _read_trials(client, tracker.experiment_id, study_run)
        for run in read[way].values():
            assert run["tags"].pop("mlflow.parentRunId") == study_run
        points = client.get_metric_history(study_run, track.HISTORY_METRIC)
        history[way] = ([(m.step, m.value, m.timestamp) for m in points],
                        client.get_run(study_run).data.metrics[track.HISTORY_METRIC])
        # Each trial noted with its run, and done.
        noted = logged(trial_log)
        assert sorted(n for _, n in noted) == list(range(5))
        assert all(v["done"] for v in noted.values())
        assert {v["run"] for v in noted.values()} == {
            r.info.run_id for r in client.search_runs(
                [tracker.experiment_id], f"tags.mlflow.parentRunId = '{study_run}'")}
    assert sorted(read["bulk"]) == [f"trial-{n}" for n in range(5)]
    assert read["bulk"] == read["client"]
    assert history["bulk"] == history["client"]
    assert [s for s, _, _ in history["bulk"][0]] == [0, 1, 4]
    run1 = read["bulk"]["trial-1"]
    assert len(run1["params"]["long"]) == 6000 and run1["status"] == "FINISHED"
    assert read["bulk"]["trial-2"]["status"] == "FAILED"
    assert read["bulk"]["trial-0"]["tags"]["mlflow.runName"] == "trial-0"


def test_a_killed_logger_neither_loses_nor_duplicates_a_trial(tmp_path, monkeypatch,
                                                             empty_mlflow_db):
    """A batch's run ids are noted before its transaction commits and marked done after:
    a logger killed in between leaves ids that never existed, which the resume logs anew
    (one run each); one killed after the commit leaves runs that the resume completes in
    place (no second run)."""
    from harness.tracking import run_logging

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{empty_mlflow_db(tmp_path / 'killed.db')}"
    tracker = track.Tracker(uri, "killed")
    study_run = tracker.start_run("study", {"harness.level": "study"})
    trial_log = tmp_path / "trials.jsonl"

    def killed(*a, **k):
        raise KeyboardInterrupt  # as a SIGKILL would, between the two notes

    monkeypatch.setattr(track, "_insert_trial_runs", killed)
    with pytest.raises(KeyboardInterrupt):
        track.log_trial_records(tracker, trial_log, [_record(study_run, n) for n in (0, 1)])
    monkeypatch.undo()
    # Committed, then killed before the done notes.
    real_append = track._append
    monkeypatch.setattr(track, "_append", lambda path, records: (
        real_append(path, records) if not records[0].get("done") else None))
    track.log_trial_records(tracker, trial_log, [_record(study_run, n) for n in (2, 3)])
    monkeypatch.undo()
    noted = run_logging.logged(trial_log)
    assert sorted(noted) == [("s", n) for n in range(4)] and not any(
        v["done"] for v in noted.values())
    # The resume logs each noted trial once, in its committed run where there is one.
    for n in range(4):
        track.log_trial_record(tracker, trial_log, {**_record(study_run, n),
                                                    "run": noted[("s", n)]["run"]})
    client = MlflowClient(uri)
    runs = client.search_runs([tracker.experiment_id],
                              f"tags.mlflow.parentRunId = '{study_run}'")
    by_trial = {int(r.data.tags["harness.trial"]): r for r in runs}
    assert len(runs) == 4 and sorted(by_trial) == [0, 1, 2, 3]
    for n in (2, 3):  # completed in place
        assert by_trial[n].info.run_id == noted[("s", n)]["run"]
    for r in runs:
        assert r.info.status == "FINISHED" and r.data.tags["hardware"] == "H200"
        assert r.data.params["BLOCK"] and r.data.metrics["latency_ms"] > 0
    after = run_logging.logged(trial_log)
    assert all(v["done"] for v in after.values())
    assert {v["run"] for v in after.values()} == {r.info.run_id for r in runs}


def test_a_batch_the_store_refuses_is_logged_one_by_one(tmp_path, monkeypatch,
                                                        empty_mlflow_db):
    """Where the one transaction fails (a store that differs), the batch goes through
    the client instead, every trial noted with the run it got; after BULK_FAILURES
    failures in a row every batch does."""
    from harness.tracking import run_logging

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{empty_mlflow_db(tmp_path / 'refused.db')}"
    tracker = track.Tracker(uri, "refused")
    study_run = tracker.start_run("study", {"harness.level": "study"})
    trial_log = tmp_path / "trials.jsonl"
    tries = []

    def refuse(*a, **k):
        tries.append(1)
        raise RuntimeError("no such column")

    monkeypatch.setattr(track, "_insert_trial_runs", refuse)
    for b in range(track.BULK_FAILURES + 1):
        recs = [_record(study_run, 2 * b + i) for i in (0, 1)]
        assert track.log_trial_records(tracker, trial_log, recs) == []
    assert len(tries) == track.BULK_FAILURES and tracker.sql_store() is None
    client = MlflowClient(uri)
    runs = client.search_runs([tracker.experiment_id],
                              f"tags.mlflow.parentRunId = '{study_run}'")
    noted = run_logging.logged(trial_log)
    assert len(runs) == len(noted) == 2 * (track.BULK_FAILURES + 1)
    assert all(v["done"] for v in noted.values())
    assert {v["run"] for v in noted.values()} == {r.info.run_id for r in runs}
    steps = [m.step for m in client.get_metric_history(study_run, track.HISTORY_METRIC)]
    assert sorted(steps) == list(range(2 * (track.BULK_FAILURES + 1)))


class _Version(str):
    """A str of the test's own module, as torch's TorchVersion is of torch's."""


@pytest.mark.slow
def test_the_driver_s_runs_through_the_logger_process(local_ray, tmp_path, mlflow_db):
    """``RemoteTracker``: the driver's experiment and study runs are created, logged to and
    ended by the trial logger's process, as a Tracker of the driver's own would; a call
    the store refuses is a TrackingError naming it, never a hang."""
    uri = f"sqlite:///{mlflow_db}"
    actor = track.start_trial_logger(uri, "remote-exp", open_now=False)
    assert MlflowClient(uri).get_experiment_by_name("remote-exp") is None
    remote = run_mod.RemoteTracker(actor, uri)
    assert remote.uri == uri
    # The store is opened as the RemoteTracker is made, before any run is asked for.
    ray.get(actor.flush.remote())
    assert MlflowClient(uri).get_experiment_by_name("remote-exp") is not None
    parent = remote.start_run("exp", {"harness.level": "experiment"})
    # A tag value of a str subclass (as torch.__version__) reaches MLflow as plain text.
    child = remote.start_run("study", {"harness.level": "study", "torch": _Version("2.11")},
                             parent=parent)
    assert remote.start_run("study", {}, resume=child) == child  # reopened, not new
    remote.log(child, params={"kernel": "k"}, metrics={"best_ms": 1.5})
    (tmp_path / "pack.json").write_text("{}")
    remote.log_artifact(parent, tmp_path / "pack.json", "packs")
    remote.finish(child)
    client = MlflowClient(uri)
    run = client.get_run(child)
    assert run.data.params == {"kernel": "k"} and run.data.metrics == {"best_ms": 1.5}
    assert run.data.tags["mlflow.parentRunId"] == parent and run.info.status == "FINISHED"
    assert run.data.tags["torch"] == "2.11"
    assert [a.path for a in client.list_artifacts(parent, "packs")] == ["packs/pack.json"]
    with pytest.raises(track.TrackingError, match="log failed"):
        remote.log("no-such-run", params={"a": 1})
    with pytest.raises(track.TrackingError, match="not a forwarded"):
        remote._call("flush")
    ray.kill(actor)


def test_a_tracker_not_opened_at_once_opens_its_store_once_when_told():
    """A campaign's other trackers of one store open it as soon as it exists, each once,
    without waiting for the logger's answer."""
    calls = []

    class Method:
        def remote(self, *args):
            calls.append(args)

    actor = type("Actor", (), {"open": Method()})()
    later = run_mod.RemoteTracker(actor, "sqlite:///x.db", open_now=False)
    assert calls == []
    later.open()
    later.open()
    assert len(calls) == 1
    run_mod.RemoteTracker(actor, "sqlite:///x.db").open()
    assert len(calls) == 2
