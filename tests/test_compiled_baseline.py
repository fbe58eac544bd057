"""The torch.compile baseline timed in a process of the worker's own
(``harness.fleet.compiled_baseline``): a real spawned process, Inductor's CPU backend."""

from __future__ import annotations

import os
import signal
import time

import pytest

from harness.fleet import compiled_baseline
from harness.kernel import api as kernel_api
from harness.measure.timing import Measurer, Timing

TIMING = Timing(cpu_reps=1)


def _shape(kernel: str) -> dict:
    return dict(kernel_api.get(kernel).shapes["test"])


@pytest.fixture
def proc():
    cb = compiled_baseline.CompiledBaseline()
    cb.start()
    yield cb
    cb.close()


def test_the_baseline_is_timed_and_checked_in_its_own_process(proc) -> None:
    """The process builds the problem from its seed, compiles ``eager`` with
    torch.compile and checks it against the reference as the worker would; a second
    problem replaces the first."""
    got = proc.measure("rmsnorm", _shape("rmsnorm"), "fp32", 0, TIMING)
    assert got is not None and got["ok"], got
    assert got["extra"]["timed_in"] == "compiled-baseline process"
    assert got["max_abs_err"] < 1e-4 and got["latency_ms"] > 0
    pid = proc._proc.pid
    assert pid != os.getpid()
    assert proc.stats["measured"] == 1 and proc.stats["ready_s"] > 0
    assert proc.stats["imports_s"] > 0
    # What the run's summary reports per worker: ready, imports, the baselines' wait.
    assert got["extra"]["compiled_baseline"]["measured"] == 1
    assert 0 <= got["extra"]["compiled_baseline"]["waited_s"] <= proc.stats["ready_s"] + 1
    # The same as this process measures it (accuracy: the same inputs from the seed).
    here = Measurer(TIMING).measure_eager(kernel_api.get("rmsnorm"), _shape("rmsnorm"),
                                          "fp32", 0, compiled=True)
    assert here.max_abs_err == pytest.approx(got["max_abs_err"], rel=1e-3, abs=1e-7)
    again = proc.measure("silu", _shape("silu"), "fp32", 1, TIMING)
    assert again["ok"], again
    assert proc._proc.pid == pid and proc.stats["measured"] == 2
    proc.close()
    assert proc._proc is None


def test_a_process_that_ended_is_replaced_between_tasks(proc) -> None:
    assert proc.measure("silu", _shape("silu"), "fp32", 0, TIMING)["ok"]
    first = proc._proc
    os.kill(first.pid, signal.SIGKILL)
    first.join(10)
    got = proc.measure("silu", _shape("silu"), "fp32", 0, TIMING)
    assert got["ok"], got
    assert proc._proc.pid != first.pid and proc.starts == 2


def test_a_lost_answer_fails_the_baseline_within_its_bound(monkeypatch) -> None:
    """A process that never answers (the ``baseline_hang`` fault): the baseline fails
    once the bound passes, naming what it waited for; the study goes on, and the next
    baseline gets a new process."""
    monkeypatch.setenv("HARNESS_FAULTS", "baseline_hang")
    monkeypatch.setattr(compiled_baseline, "WAIT_S", 2.0)
    cb = compiled_baseline.CompiledBaseline()
    cb.start()
    try:
        t0 = time.monotonic()
        got = cb.measure("silu", _shape("silu"), "fp32", 0, TIMING)
        waited = time.monotonic() - t0 - cb.stats["ready_s"]
        assert got is not None and not got["ok"]
        assert "no result from the torch.compile baseline's process" in got["reason"]
        assert "after 2 s" in got["reason"] and waited < 10
        assert cb._proc is None and cb.stats["died"] == 1
        monkeypatch.delenv("HARNESS_FAULTS")
        # A new process: its first torch.compile build takes seconds on a loaded machine.
        monkeypatch.setattr(compiled_baseline, "WAIT_S", 600.0)
        again = cb.measure("silu", _shape("silu"), "fp32", 0, TIMING)
        assert again["ok"], again
        assert cb.starts == 2
    finally:
        cb.close()
