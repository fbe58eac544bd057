"""A run's own Ray that does not come up in Ray's fixed 30 s: started once more, then a
clear error (exit 1, no traceback). Ray's start timeout cannot be forced on a healthy
machine, so ``ray.init`` raises it here as Ray does (a bare Exception)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import ray
import yaml

from harness.cli import main
from harness.fleet import RayStartError, cluster
from tests.fault_kernels import may_renice

TIMEOUT = Exception("The current node timed out during startup. This could happen because "
                    "some of the raylet failed to startup or the GCS has become overloaded.")


def _failing(times: int, calls: list[dict]):
    def init(**kw):
        calls.append(kw)
        if len(calls) <= times:
            raise TIMEOUT
        return None
    return init


def test_a_start_that_timed_out_is_tried_once_more(monkeypatch) -> None:
    calls: list[dict] = []
    monkeypatch.setattr(ray, "init", _failing(1, calls))
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    cluster.start_local_ray(num_cpus=1)
    assert len(calls) == 2 and all(c["address"] == "local" for c in calls)


def test_two_timeouts_raise_a_clear_error_and_others_pass_through(monkeypatch) -> None:
    calls: list[dict] = []
    monkeypatch.setattr(ray, "init", _failing(5, calls))
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    with pytest.raises(RayStartError, match="did not start on this machine, twice"):
        cluster.start_local_ray(num_cpus=1)
    assert len(calls) == 2

    def broken(**kw):
        calls.append(kw)
        raise ValueError("bad argument")
    calls.clear()
    monkeypatch.setattr(ray, "init", broken)
    with pytest.raises(ValueError, match="bad argument"):  # not retried, not renamed
        cluster.start_local_ray(num_cpus=1)
    assert len(calls) == 1


def test_the_cli_says_so_and_exits_1(monkeypatch, tmp_path: Path, capsys) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "init", _failing(5, []))
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr("ray._private.services.find_bootstrap_address", lambda _: None)
    exp = tmp_path / "exp.yaml"
    exp.write_text(yaml.safe_dump({
        "name": "nostart", "kernel": "rmsnorm",
        "shapes": [{"rows": 64, "cols": 64}], "dtypes": ["fp32"],
        "search": {"trials": 2},
        "tracking": {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
        "output": {"packs_dir": str(tmp_path / "packs"), "runs_dir": str(tmp_path / "runs")},
    }))
    assert main(["run", str(exp)]) == 1
    err = capsys.readouterr().err
    assert "Ray did not start on this machine, twice" in err and "Traceback" not in err
    assert not (tmp_path / "packs").exists()


def test_a_worker_takes_back_the_default_cpu_priority() -> None:
    """Ray starts workers at nice 15, where a timing waits behind every other process on
    the node. ``normal_priority`` sets every thread of the process, those started before
    it too, to nice 0 where the OS allows it, and says what it got."""
    code = (
        "import os, threading\n"
        "from harness.fleet.cluster import normal_priority\n"
        "os.nice(15)\n"
        "stop = threading.Event()\n"
        "for _ in range(3):\n"
        "    threading.Thread(target=stop.wait, daemon=True).start()\n"
        "got = normal_priority()\n"
        "def nice(t):\n"
        "    return int(open(f'/proc/self/task/{t}/stat').read().rsplit(')', 1)[1].split()[16])\n"
        "print(got, sorted({nice(t) for t in os.listdir('/proc/self/task')}))\n")
    root = str(Path(__file__).resolve().parent.parent)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=root, env={**os.environ, "PYTHONPATH": root}, check=True)
    want = 0 if may_renice() else 15
    assert out.stdout.split(None, 1) == [str(want), f"[{want}]\n"], out
