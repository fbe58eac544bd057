"""Spare MLflow loggers on a kept fleet: a run leaves one (MLflow imported) for the next
run on the machine, which takes it instead of waiting seconds for a new process; a
spare serves one run only, and one never taken leaves after ``keep_s``."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

VERSION = "test-version"


def _names() -> list[str]:
    from ray.util import list_named_actors

    from harness.tracking import spares

    return [e["name"] for e in list_named_actors(all_namespaces=True)
            if e.get("namespace") == spares.NAMESPACE
            and e.get("name", "").startswith(spares.PREFIX)]


def _take(uri: str, experiment: str, deadline_s: float = 90.0):
    from harness.tracking import spares

    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        actor = spares.take(uri, experiment, plots=False, version=VERSION)
        if actor is not None:
            return actor
        time.sleep(0.5)  # still starting (importing MLflow)
    pytest.fail(f"no spare logger could be taken within {deadline_s:g} s")


def test_a_spare_serves_the_run_that_takes_it_and_no_other(faulty_ray: Path,
                                                          mlflow_db: Path) -> None:
    import ray
    from mlflow.tracking import MlflowClient

    from harness.tracking import spares
    from harness.tracking.run_logging import RemoteTracker

    uri = f"sqlite:///{mlflow_db}"
    assert spares.take(uri, "spare-exp", False, VERSION) is None  # none yet
    # Left by a run of that store: the spare opens it once the run set it up, not once
    # claimed.
    spares.leave(keep_s=120, plots=False, version=VERSION)
    spares.store_ready(uri)
    assert any(n.startswith(spares.PREFIX + VERSION) for n in _names())
    # A run of other code does not take it (it imported this code once).
    assert spares.take(uri, "spare-exp", False, "other-code") is None
    actor = _take(uri, "spare-exp")
    try:
        assert spares.take(uri, "other", False, VERSION) is None  # taken
        run_id = RemoteTracker(actor, uri).start_run("study", {"kernel": "matmul"})
        client = MlflowClient(uri)
        exp = client.get_experiment_by_name("spare-exp")
        assert exp is not None
        assert client.get_run(run_id).info.experiment_id == exp.experiment_id
        stats = ray.get(actor.stats.remote(), timeout=30)
        assert stats["spare"] == 1 and stats["store_ahead"] == 1
    finally:
        ray.kill(actor)


def test_a_spare_opens_the_store_once_the_run_that_left_it_set_it_up(
        faulty_ray: Path, mlflow_db: Path) -> None:
    """A run's first spare is left before its store exists (opened then, a store being
    created would be migrated twice at once); told the store is set up, it opens it for
    the next run."""
    import ray

    from harness.tracking import spares

    uri = f"sqlite:///{mlflow_db}"
    spares.leave(keep_s=120, plots=False, version=VERSION)
    spares.store_ready(uri)
    assert spares._LEFT == []  # told once
    actor = _take(uri, "ahead-exp")
    try:
        assert ray.get(actor.stats.remote(), timeout=30)["store_ahead"] == 1
    finally:
        ray.kill(actor)


def test_a_spare_never_taken_leaves_after_keep_s(faulty_ray: Path) -> None:
    from harness.tracking import spares

    before = set(_names())
    spares.leave(keep_s=2, plots=False, version=VERSION)
    deadline = time.monotonic() + 90  # its start (imports), then keep_s
    new = set(_names()) - before
    assert len(new) == 1
    while new & set(_names()):
        assert time.monotonic() < deadline, "the spare outlived keep_s"
        time.sleep(0.5)
