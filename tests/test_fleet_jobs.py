"""``ray job submit --working-dir . -- kharness run ...`` against a real ``ray start
--head`` on 127.0.0.1, with Ray's token authentication on (the default since 2.59)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from harness import packs
from harness.cli.run_command import _trial_count

# Each run's MLflow store is a copy of one built once: a new store migrates (seconds of CPU).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("mlflow_db")]

BIN = Path(sys.executable).parent


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _ours(temp_dir: str) -> list[int]:
    """The processes of this head: every Ray process names its temp dir on its command
    line. (`ray stop` would stop every Ray on the machine, other users' included.)"""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if temp_dir.encode() in (d / "cmdline").read_bytes():
                    pids.append(int(d.name))
            except OSError:  # gone meanwhile
                continue
    return pids


def _runs(pid: int, name: bytes) -> bool:
    """Whether process ``pid`` is alive and runs ``name`` (a zombie's command line is
    empty)."""
    try:
        return name in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module")
def head() -> Iterator[SimpleNamespace]:
    # A short temp dir: Ray's unix sockets live under it and their paths must stay short.
    # It is RAY_TMPDIR's "ray", Ray's default for the processes given this env: there
    # `ray start` leaves the address a bare ray.init() joins.
    base = tempfile.mkdtemp(prefix="kh-ray-", dir="/tmp")
    temp_dir = os.path.join(base, "ray")
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           "RAY_AUTH_MODE": "token", "RAY_TMPDIR": base}
    for var in ("RAY_ADDRESS", "TRITON_INTERPRET"):  # the workers decide for themselves
        env.pop(var, None)
    try:
        # Ray gives its raylet 30 s to register, fixed. On a loaded 2-core CI machine, or
        # when a port picked here was taken meanwhile by another test's cluster, that is
        # missed: the head is killed and started again on fresh ports, twice at most.
        failures = []
        for _ in range(3):
            gcs, dash, client, agent, metrics = _free_ports(5)
            cmd = [str(BIN / "ray"), "start", "--head", "--node-ip-address=127.0.0.1",
                   "--dashboard-host=127.0.0.1", f"--port={gcs}", f"--dashboard-port={dash}",
                   f"--ray-client-server-port={client}",
                   f"--dashboard-agent-listen-port={agent}",
                   f"--metrics-export-port={metrics}", "--num-cpus=2",
                   f"--temp-dir={temp_dir}", "--disable-usage-stats"]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
            if proc.returncode == 0:
                break
            failures.append(proc.stdout[-1500:] + proc.stderr[-1500:])
            _signal(_ours(temp_dir), signal.SIGKILL)
            shutil.rmtree(temp_dir, ignore_errors=True)
        else:
            pytest.fail("`ray start --head` failed 3 times:\n" + "\n---\n".join(failures))
        yield SimpleNamespace(address=f"http://127.0.0.1:{dash}", gcs=f"127.0.0.1:{gcs}",
                              env=env, base=base)
    finally:
        # Killed outright: the GCS server, the raylet and the autoscaler's monitor outlive
        # a SIGTERM by more than 8 s (measured), and nothing of this head is kept. Its
        # kept drivers too: their sockets are under ``base``.
        _signal(_ours(base), signal.SIGKILL)
        shutil.rmtree(base, ignore_errors=True)


def test_jobs_api_requires_the_token(head) -> None:
    try:
        urllib.request.urlopen(f"{head.address}/api/jobs/", timeout=10)
    except urllib.error.HTTPError as exc:
        assert exc.code in (401, 403)
    else:
        pytest.fail("the Jobs API answered without a token")


def test_ray_job_submit_runs_an_experiment(head, tmp_path: Path) -> None:
    workdir = tmp_path / "job"  # small: just the experiment (the harness is installed)
    workdir.mkdir()
    exp = {
        "name": "jobrun",
        "kernel": "matmul",
        "shapes": [{"M": 64, "N": 64, "K": 64}],
        "dtypes": ["fp16"],
        "search": {"sampler": "grid", "trials": 2},
        "tracking": {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
        "output": {"packs_dir": str(tmp_path / "packs"), "runs_dir": str(tmp_path / "runs")},
        "fleet": {"compile_workers": 0},
    }
    (workdir / "exp.yaml").write_text(yaml.safe_dump(exp))
    t0 = time.monotonic()
    proc = subprocess.run(
        [str(BIN / "ray"), "job", "submit", "--working-dir", str(workdir), "--",
         "kharness", "run", "exp.yaml"],
        env={**head.env, "RAY_ADDRESS": head.address}, cwd=workdir,
        capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "succeeded" in out, out[-4000:]
    assert "pack: " in out and time.monotonic() - t0 < 600
    data = packs.read(tmp_path / "packs" / "cpu" / "matmul.json")  # checksum verified
    entry = data["kernels"]["matmul"]["fp16"]["M=64,N=64,K=64"]
    assert entry["provenance"]["interpreted"] is True


def _kept_experiment(tmp_path: Path, keep_s: float) -> dict:
    """One trial of a small matmul whose workers are kept ``keep_s`` after the run."""
    return {
        "kernel": "matmul", "shapes": [{"M": 64, "N": 64, "K": 64}], "dtypes": ["fp16"],
        "search": {"sampler": "grid", "trials": 1},
        "tracking": {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
        "output": {"packs_dir": str(tmp_path / "packs"), "runs_dir": str(tmp_path / "runs")},
        "fleet": {"compile_workers": 0, "keep_workers_s": keep_s, "bookkeeping": "processes"},
    }


def test_runs_join_the_head_with_or_without_ray_address_and_keep_workers(
        head, tmp_path: Path) -> None:
    """A user's `ray start --head` has token authentication on by default: `kharness run`
    with only RAY_ADDRESS set must still join it (it sends the token itself). With no
    RAY_ADDRESS, `kharness run` joins the Ray a user started on this machine with
    `ray start` (as a bare ray.init() would). Either way it treats it as what it is, a
    cluster that outlives the run: fleet.keep_workers_s holds, and the second run leases
    the first run's worker and takes the MLflow logger process it left."""
    exp = _kept_experiment(tmp_path, keep_s=60)
    by_address = {**{k: v for k, v in head.env.items() if k != "RAY_AUTH_MODE"},
                  "RAY_ADDRESS": head.gcs}
    # A user's shell: neither RAY_ADDRESS nor RAY_AUTH_MODE (Ray sends the token it finds
    # on disk only to an address it found itself).
    this_machine = {k: v for k, v in head.env.items()
                    if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    summaries = []
    for name, env in (("kept1", by_address), ("kept2", this_machine)):
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump({**exp, "name": name}))
        proc = subprocess.run([str(BIN / "kharness"), "run", f"{name}.yaml", "--json"],
                              env=env, cwd=tmp_path, capture_output=True, text=True,
                              timeout=600)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-4000:]
        assert "InvalidAuthToken" not in proc.stderr
        assert "started its own Ray" not in out, out[-4000:]
        summaries.append(json.loads(proc.stdout))
    assert [s["rows"][0]["counts"]["measured"] for s in summaries] == [1, 1]
    assert [s["workers_reused"] for s in summaries] == [0, 1], [s["events"] for s in summaries]
    assert [s["mlflow_logger"].get("spare") for s in summaries] == [None, 1]


def test_the_next_command_runs_in_the_kept_driver_the_last_run_left(
        head, tmp_path: Path) -> None:
    """A run that keeps its workers on the machine's `ray start` leaves a kept driver; the
    next `kharness run` from the same directory is handed to it, and prints, exits and
    stops as a local one: its summary names the kept driver; a bad file's error reaches
    the command's stderr with exit code 2; Ctrl-C (SIGINT to the command) stops the run
    it handed over, which says how to resume."""
    env = {k: v for k, v in head.env.items()
           if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "KHARNESS_NO_KEPT_DRIVER")}
    env["XDG_RUNTIME_DIR"] = head.base  # its sockets beside this head, killed with it
    exp = _kept_experiment(tmp_path, keep_s=120)

    def kharness(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN / "kharness"), *args], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=600)

    summaries = []
    for name in ("kd1", "kd2"):
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump({**exp, "name": name}))
        proc = kharness("run", f"{name}.yaml", "--json")
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        summaries.append(json.loads(proc.stdout))
    assert [s["rows"][0]["counts"]["measured"] for s in summaries] == [1, 1]
    assert summaries[0]["kept_driver"] == {}
    served = summaries[1]["kept_driver"]
    assert served["pid"] > 0 and served["ready_s"] > 0, served
    assert summaries[1]["workers_reused"] == 1
    assert (tmp_path / "packs").is_dir()

    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({**exp, "name": "bad",
                                                       "search": {"trials": "many"}}))
    proc = kharness("run", "bad.yaml")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "bad.yaml" in proc.stderr and "search.trials" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    # Each kept driver starts its reserve as it becomes ready: the one that ran kd2 had
    # one prepared, which took the socket as kd2 came and ran this command.
    logs = "".join(p.read_text() for p in Path(head.base).glob("kharness-*/*.log"))
    (bad,) = re.findall(r"pid (\d+): running `kharness run bad.yaml`", logs)
    assert re.search(rf"pid {bad}: ready in [\d.]+ s on .*; a reserve, waiting for its turn",
                     logs), logs

    def long_run(name: str) -> subprocess.Popen:
        """A long run handed over, once its trials are under way."""
        shapes = [{"M": m, "N": n, "K": 64} for m in (64, 128) for n in (64, 128)]
        long = {**exp, "name": name, "shapes": shapes,
                "search": {"sampler": "random", "trials": 500}}
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(long))
        cmd = subprocess.Popen([str(BIN / "kharness"), "run", f"{name}.yaml"], env=env,
                               cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
        deadline = time.monotonic() + 300
        while not _trial_count(tmp_path / "runs" / name / "optuna.db"):
            if cmd.poll() is not None or time.monotonic() > deadline:
                cmd.kill()
                pytest.fail(f"{name} did not start: {cmd.communicate()}")
            time.sleep(0.2)
        return cmd

    cmd = long_run("kd3")
    try:
        cmd.send_signal(signal.SIGINT)
        out, err = cmd.communicate(timeout=120)
    finally:
        if cmd.poll() is None:
            cmd.kill()
    assert cmd.returncode == 130, out + err
    assert "stopped (SIGINT)" in err and "--resume" in err, err
    assert "run by a kept driver" not in out  # stopped: no summary table

    # A command killed outright: the kept driver running it stops the run (what it
    # measured stored, its run directory unlocked) and ends.
    cmd = long_run("kd4")
    logs = "".join(p.read_text() for p in Path(head.base).glob("kharness-*/*.log"))
    (pid,) = [int(m) for m in re.findall(r"pid (\d+): running `kharness run kd4.yaml`", logs)]
    cmd.kill()
    cmd.wait(timeout=30)
    deadline = time.monotonic() + 120
    while _runs(pid, b"kept_server"):
        assert time.monotonic() < deadline, "the kept driver ran on after its command died"
        time.sleep(0.5)
    logs = "".join(p.read_text() for p in Path(head.base).glob("kharness-*/*.log"))
    assert f"pid {pid}: the command's process is gone: stopping its run" in logs, logs
    proc = kharness("run", "kd4.yaml", "--resume", "--json")  # its directory unlocked
    assert proc.returncode == 0, proc.stderr[-4000:]
    resumed = json.loads(proc.stdout)
    assert resumed["resumed"], resumed  # the trials the stopped run measured were kept
    assert len(resumed["rows"]) == 4 and all(r["counts"]["measured"] for r in resumed["rows"])


def test_run_starts_its_own_ray_when_the_last_ray_start_is_dead(tmp_path: Path) -> None:
    """A head killed without `ray stop` leaves its address in RAY_TMPDIR's
    ray/ray_current_cluster; joined, Ray waits on the dead GCS for minutes. `kharness run`
    finds that nothing answers there, says so, and starts a Ray of its own."""
    base = tempfile.mkdtemp(prefix="kh-ray-", dir="/tmp")  # short: Ray's socket paths
    temp_dir = os.path.join(base, "ray")
    try:
        os.makedirs(temp_dir)
        (dead,) = _free_ports(1)  # nothing listens there
        Path(temp_dir, "ray_current_cluster").write_text(f"127.0.0.1:{dead}\n")
        exp = {
            "name": "stale", "kernel": "matmul", "shapes": [{"M": 64, "N": 64, "K": 64}],
            "dtypes": ["fp16"], "search": {"sampler": "grid", "trials": 1},
            "tracking": {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
            "output": {"packs_dir": str(tmp_path / "packs"),
                       "runs_dir": str(tmp_path / "runs")},
            "fleet": {"compile_workers": 0},
        }
        (tmp_path / "exp.yaml").write_text(yaml.safe_dump(exp))
        env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
               "RAY_TMPDIR": base}
        for var in ("RAY_ADDRESS", "TRITON_INTERPRET"):
            env.pop(var, None)
        proc = subprocess.run([str(BIN / "kharness"), "run", "exp.yaml", "--json"], env=env,
                              cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        assert f"(127.0.0.1:{dead}) does not answer" in proc.stderr
        assert json.loads(proc.stdout)["rows"][0]["counts"]["measured"] == 1
    finally:
        _signal(_ours(temp_dir), signal.SIGKILL)
        shutil.rmtree(base, ignore_errors=True)
