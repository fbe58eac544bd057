"""A whole run in which messages never come (``harness.run.faults``): a worker's result, the
MLflow logger's answers and the Optuna writer's answers. The run says so, naming what it
waited for, and ends within seconds of those waits' limits; it never waits in silence."""

from __future__ import annotations

import io
import os
import time
from pathlib import Path

import pytest
import ray
import yaml
from rich.console import Console

from harness.fleet.cluster import NO_PRESTART
from harness.run.runner import run
from harness.search import write_behind
from harness.tracking import run_logging

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("mlflow_db")]

ROOT = Path(__file__).resolve().parent.parent
STALL_S = 2.0  # the bookkeeping's wait limits, scaled down from 20 s: the same code path
TRIAL_TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR",
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}}, _system_config=NO_PRESTART)
    yield
    ray.shutdown()


def test_a_lost_result_a_silent_logger_and_writer_are_reported_within_seconds(
        local_ray, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HARNESS_FAULTS", "result_lost,logger_hang,writer_hang")
    monkeypatch.setattr(run_logging, "LOGGER_STALL_S", STALL_S)
    monkeypatch.setattr(write_behind, "WRITER_STALL_S", STALL_S)
    exp = {
        "name": "lost", "kernel": "tests.fault_kernels:Faulty", "shapes": [{"N": 256}],
        "dtypes": ["fp32"],
        "search": {"sampler": "grid", "trials": 4, "warm_start": False,
                   "remeasure_top_k": 0},
        "search_space": {"params": {"FAULT": ["none"], "SLEEP_MS": [0, 5, 10, 15]}},
        "timing": {"trial_timeout_s": TRIAL_TIMEOUT_S},
        "tracking": {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
        "output": {"packs_dir": str(tmp_path / "packs"), "runs_dir": str(tmp_path / "runs")},
        # The driver's threads write the bookkeeping: the limits above apply to them.
        "fleet": {"compile_workers": 0, "bookkeeping": "threads"},
    }
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(exp))
    t0 = time.monotonic()
    summary = run(path, console=Console(file=io.StringIO(), width=300), progress=False)
    wall = time.monotonic() - t0
    events = "\n".join(summary.events)
    # The dropped result: its trial fails as a hang, named, and its worker is replaced.
    (row,) = summary.rows
    assert row["counts"]["measured"] == 3 and row["counts"]["failed"] == 1, row
    assert any(f"no result after {TRIAL_TIMEOUT_S:g} s" in r for r in row["failures"]), row
    assert summary.replaced == 1 and "time-out" in events
    # The silent bookkeeping: each named, with what it leaves to --resume.
    assert "the MLflow logger answered no batch" in events, events
    assert "the Optuna writer answered no batch" in events, events
    assert summary.packs, "the run froze its winner all the same"
    # Bounded: the trial's time-out and the two waits' limits, plus the run's own work.
    assert wall < TRIAL_TIMEOUT_S + 2 * STALL_S + 40, (wall, summary.timeline)
    assert os.environ["HARNESS_FAULTS"]  # (monkeypatch restores it)
