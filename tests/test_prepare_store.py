"""A new SQLite MLflow store built off the run's critical path: whole or not at all, never
over a store that exists, and what MLflow opens as its own."""

from __future__ import annotations

import os
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

from mlflow.tracking import MlflowClient

from harness.run import bookkeeping as bk
from harness.tracking import prepare_store


def test_a_new_store_is_built_whole_and_opened_by_mlflow(tmp_path: Path) -> None:
    path = tmp_path / "runs" / "mlflow.db"
    uri = f"sqlite:///{path}"
    assert prepare_store.new_sqlite_store(uri) == path
    assert prepare_store.prepare(path)
    assert prepare_store.new_sqlite_store(uri) is None  # it exists now
    assert sorted(p.name for p in path.parent.iterdir()) == ["mlflow.db"]  # nothing beside
    client = MlflowClient(uri)
    exp_id = client.create_experiment("after")
    run = client.create_run(exp_id)
    client.log_metric(run.info.run_id, "latency_ms", 1.5)
    assert client.get_run(run.info.run_id).data.metrics == {"latency_ms": 1.5}


def test_a_store_that_appeared_meanwhile_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "mlflow.db"
    uri = f"sqlite:///{path}"
    client = MlflowClient(uri)
    kept = client.create_experiment("the logger's")
    before = os.stat(path).st_ino
    assert not prepare_store.prepare(path)
    assert os.stat(path).st_ino == before
    assert client.get_experiment_by_name("the logger's").experiment_id == kept
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("mlflow.db")) == []
    # Not SQLite, or a store that exists: nothing to build.
    assert prepare_store.new_sqlite_store("http://127.0.0.1:5000") is None
    assert prepare_store.new_sqlite_store(uri) is None


def _members(*uris: str) -> list:
    return [SimpleNamespace(exp=SimpleNamespace(tracking=SimpleNamespace(uri=u))) for u in uris]


def test_the_run_builds_each_new_store_once_its_files_passed(tmp_path: Path) -> None:
    new, other = tmp_path / "a" / "mlflow.db", tmp_path / "b.db"
    failed: Future = Future()
    failed.set_exception(ValueError("a bad file"))
    assert bk.prepare_stores_once_valid(failed, _members(f"sqlite:///{new}")) == []
    assert not new.exists()  # nothing written before every file passed
    passed: Future = Future()
    passed.set_result(None)
    # A campaign's two files share one store: built once; a server is left alone.
    built = bk.prepare_stores_once_valid(passed, _members(
        f"sqlite:///{new}", f"sqlite:///{new}", f"sqlite:///{other}", "http://127.0.0.1:1"))
    assert built == [f"sqlite:///{new}", f"sqlite:///{other}"]
    assert new.is_file() and other.is_file()
    assert bk.prepare_stores_once_valid(passed, _members(f"sqlite:///{new}")) == []
