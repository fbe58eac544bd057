"""The command's side of a kept driver (``harness.cli.kept_driver``): which commands it
takes, which socket serves which command, and a command that finds none answering runs
in its own process. The kept driver itself, on a real `ray start`, is in
``test_fleet_jobs.py``."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import pytest

from harness.cli import kept_driver


@pytest.fixture
def runtime_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
                ) -> Path:
    # Short: a socket's path is at most 107 bytes.
    base = Path(os.path.realpath("/tmp")) / f"khkd-{os.getpid()}-{id(monkeypatch) % 9999}"
    base.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(base))
    monkeypatch.delenv(kept_driver.OFF, raising=False)
    yield base
    for p in sorted(base.rglob("*"), reverse=True):
        p.rmdir() if p.is_dir() else p.unlink()
    base.rmdir()


@pytest.mark.parametrize(("argv", "env", "taken"), [
    (["run", "x.yaml"], {}, True),
    (["--log-level", "DEBUG", "run", "x.yaml"], {}, True),
    (["--log-level=INFO", "run", "x.yaml", "--json"], {}, True),
    (["packs", "list"], {}, False),
    (["report", "run"], {}, False),
    ([], {}, False),
    (["run", "x.yaml"], {kept_driver.OFF: "1"}, False),
    (["run", "x.yaml"], {kept_driver.OFF: "0"}, True),
    (["run", "x.yaml"], {"RAY_JOB_SUBMISSION_ID": "raysubmit_1"}, False),
])
def test_only_a_run_outside_a_ray_job_is_handed_over(argv, env, taken) -> None:
    assert kept_driver.wanted(argv, env) is taken


def test_the_socket_is_keyed_on_what_a_started_process_cannot_change(
        runtime_dir: Path) -> None:
    env = {"PATH": "/usr/bin", "RAY_ADDRESS": "127.0.0.1:6379"}
    here = kept_driver.address("/work/a", env)
    assert here == kept_driver.address("/work/a", {**env, "HARNESS_GIT_SHA": "abc"})
    assert here != kept_driver.address("/work/b", env)
    assert here != kept_driver.address("/work/a", {**env, "CUDA_VISIBLE_DEVICES": "0"})
    assert here != kept_driver.address("/work/a", {**env, "RAY_ADDRESS": "10.0.0.2:6379"})
    assert here != kept_driver.address("/work/a", {**env, "TRITON_INTERPRET": "1"})
    assert here.parent == runtime_dir / f"kharness-{os.getuid()}"
    assert here.parent.stat().st_mode & 0o777 == 0o700
    assert len(str(here)) < 108


def test_a_folder_others_can_write_is_not_used(runtime_dir: Path) -> None:
    shared = runtime_dir / f"kharness-{os.getuid()}"
    shared.mkdir(mode=0o700)
    shared.chmod(0o777)
    with pytest.raises(PermissionError, match="not this user's alone"):
        kept_driver.address()
    assert kept_driver.forward(["run", "x.yaml"], 0.0) is None


def test_a_stale_socket_is_removed_and_the_command_runs_here(runtime_dir: Path) -> None:
    path = kept_driver.address()
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))
    dead.close()  # bound, never listening: what a killed kept driver leaves
    assert path.exists()
    assert kept_driver.forward(["run", "x.yaml"], 0.0) is None
    assert not path.exists()
    assert kept_driver.forward(["run", "x.yaml"], 0.0) is None  # no socket at all


def test_a_kept_driver_ending_as_the_command_comes_leaves_it_to_run_here(
        runtime_dir: Path, capsys: pytest.CaptureFixture) -> None:
    path = kept_driver.address()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)
    got: dict = {}

    def ending() -> None:  # takes the request, then closes without a reply
        conn, _ = listener.accept()
        got["request"], fds = kept_driver.receive(conn, max_fds=3)
        got["fds"] = len(fds)
        for fd in fds:
            os.close(fd)
        conn.close()

    t = threading.Thread(target=ending)
    t.start()
    try:
        assert kept_driver.forward(["run", "x.yaml"], 12.5) is None
    finally:
        t.join(10)
        listener.close()
    assert got["request"]["argv"] == ["run", "x.yaml"]
    assert got["request"]["started_at"] == 12.5
    assert got["request"]["cwd"] == os.getcwd()
    assert got["fds"] == 3
    assert "ended without taking the command; running it here" in capsys.readouterr().err


def test_messages_and_descriptors_cross_the_socket(tmp_path: Path) -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    out = tmp_path / "out.txt"
    with a, b, open(out, "w") as f:
        kept_driver.send(a, {"argv": ["run", "é.yaml"], "n": 1}, [f.fileno()])
        kept_driver.send(a, {"rc": 4})
        message, fds = kept_driver.receive(b, max_fds=3)
        assert message == {"argv": ["run", "é.yaml"], "n": 1} and len(fds) == 1
        os.write(fds[0], b"through the passed descriptor")
        os.close(fds[0])
        assert kept_driver.receive(b) == ({"rc": 4}, [])
        a.close()
        assert kept_driver.receive(b) == (None, [])
    assert out.read_text() == "through the passed descriptor"


def test_a_run_served_by_a_kept_driver_starts_no_other(monkeypatch) -> None:
    """A run in its own process leaves a kept driver for the next command; one a kept
    driver serves does not (that driver's reserve takes the socket)."""
    from harness.cli import kept_server, run_command

    started: list = []
    monkeypatch.setattr(kept_server, "ensure", lambda keep_s, env: started.append(keep_s))
    monkeypatch.setattr(kept_driver, "SERVED", {})
    run_command._keep_driver(60.0, {})
    assert started == [60.0]
    monkeypatch.setattr(kept_driver, "SERVED", {"pid": 1, "ready_s": 1.0, "idle_s": 0.0})
    run_command._keep_driver(60.0, {})
    assert started == [60.0]
