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


# -- a run's own Ray ends with it, however the run ends ----------------------------------
DRIVER = """
import json, os, sys, time
from harness.fleet import cluster
from tests.test_ray_start import _start
assert cluster.Cluster.connect() == "local"
import ray
node = ray._private.worker._global_node
raylet = node.all_processes["raylet"][0].process.pid
pids = {i.process.pid for infos in node.all_processes.values() for i in infos}
for name in filter(str.isdigit, os.listdir("/proc")):
    try:
        stat = open(f"/proc/{name}/stat").read()
    except OSError:
        continue
    if int(stat.rsplit(")", 1)[1].split()[1]) == raylet:  # the raylet's agents
        pids.add(int(name))
print(json.dumps([[p, _start(p)] for p in sorted(pids)]), flush=True)
time.sleep(300)
"""


def _start(pid: int) -> int | None:
    """The process's start time (ticks since boot): tells it from a later one given the
    pid; None where there is no such process, or only its zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == b"Z" else int(fields[19])


def _alive(procs: list[list[int]]) -> list[list[int]]:
    return [p for p in procs if p[1] is not None and _start(p[0]) == p[1]]


@pytest.mark.slow
def test_a_killed_driver_takes_its_ray_with_it(tmp_path: Path) -> None:
    """``kill -9`` of a driver that started its own Ray: GCS and raylet died with it, but
    the raylet's agents (ray::DashboardAgent, ray::RuntimeEnvAgent) lived on for a
    minute, re-parented to pid 1, 127.0.0.1:52365 open. Now the session's watchdog ends
    every process of it within seconds, and drops the session's record."""
    import json
    import signal
    import tempfile
    import time

    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": root, "XDG_RUNTIME_DIR": str(tmp_path),
           "RAY_TMPDIR": tempfile.mkdtemp(prefix="kh-kill-", dir="/tmp")}
    env.pop("RAY_ADDRESS", None)
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, text=True)
    procs: list[list[int]] = []
    try:
        procs = json.loads(driver.stdout.readline())
        assert len(procs) >= 4 and _alive([[driver.pid, _start(driver.pid)]])
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        deadline = time.monotonic() + 20
        while _alive(procs) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = _alive(procs)
        names = [Path(f"/proc/{p}/cmdline").read_bytes()[:40] for p, _ in left]
        assert not left, f"outlived their driver: {names}"
        records = tmp_path / f"kernel-harness-{os.getuid()}" / "ray-sessions"
        assert records.is_dir()
        while any(records.iterdir()) and time.monotonic() < deadline:
            time.sleep(0.1)  # the watchdog drops the record once its last sweep is done
        assert not any(records.iterdir())  # written, then dropped
    finally:
        driver.kill()
        for pid, _ in _alive(procs):  # a failed test leaves nothing either
            os.kill(pid, signal.SIGKILL)


def test_the_next_run_ends_a_session_whose_run_and_watchdog_were_killed(
        tmp_path: Path, monkeypatch) -> None:
    """Where the watchdog went with its driver (``kill -9`` of the process group), the
    next run's start ends what the session left: a process that ignores SIGTERM and names
    the dead raylet in its environment, as the agents do, gets SIGKILL. A session whose
    run goes on is left alone."""
    import json
    import signal

    monkeypatch.setattr(cluster, "sessions_dir", lambda: tmp_path)
    gone = subprocess.Popen(["sleep", "30"])  # the session's raylet, and its run
    raylet = [gone.pid, _start(gone.pid)]
    gone.kill()
    gone.wait()
    agent = subprocess.Popen(
        [sys.executable, "-c", "import signal, time\n"
         "signal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('up', flush=True)\n"
         "time.sleep(60)"], env={**os.environ, "RAY_RAYLET_PID": str(gone.pid)},
        stdout=subprocess.PIPE, text=True)
    bystander = subprocess.Popen(["sleep", "30"])
    try:
        assert agent.stdout.readline() == "up\n"
        me = [os.getpid(), _start(os.getpid())]
        live = [bystander.pid, _start(bystander.pid)]
        (tmp_path / "a.json").write_text(json.dumps({
            "owner": raylet, "raylet": raylet, "session_dir": "/nowhere/session_a",
            "pids": [raylet], "watchdog": raylet}))
        (tmp_path / "b.json").write_text(json.dumps({
            "owner": me, "raylet": raylet, "session_dir": "/nowhere/session_b",
            "pids": [live]}))
        assert cluster.end_orphaned_sessions() == 1
        assert agent.wait(timeout=10) == -signal.SIGKILL
        assert bystander.poll() is None  # its run (this process) goes on
        assert sorted(p.name for p in tmp_path.iterdir()) == ["b.json"]
    finally:
        agent.kill()
        bystander.kill()
        agent.wait()
        bystander.wait()
