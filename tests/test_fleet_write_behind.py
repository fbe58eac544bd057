"""The run's studies in memory, written behind the driver (harness/write_behind.py):
finished trials reach the SQLite storage in the order of their numbers, a reopened study
has them all, and changes to a trial the storage already had are written too."""

from __future__ import annotations

import logging
from pathlib import Path

import optuna
import pytest
import ray
from optuna.trial import TrialState

from harness.fleet.cluster import start_local_ray
from harness.search import make_storage, storage_url
from harness.write_behind import WriteBehindStorage

pytestmark = pytest.mark.slow


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
