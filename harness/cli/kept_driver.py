"""A kept driver: the ``kharness run`` of a warm fleet, already imported and joined to Ray.

A run on a cluster that outlives it (``ray start --head``) with ``fleet.keep_workers_s``
leaves, beside its kept workers, one standby driver process: the harness, torch, Triton,
Optuna and Ray imported, the cluster joined. The next ``kharness run`` from the same
directory and environment hands its command to it over a Unix socket (its arguments,
environment, and its own stdin, stdout and stderr, passed as file descriptors) and
waits for its exit status: the run starts at once, prints to the user's terminal as if
local, and Ctrl-C reaches it. Each standby serves one run, in a process of its own, and
first starts its successor. Where none answers, the command runs as always.

This module is the command's side and imports nothing beyond the standard library (it
runs before anything else); ``harness.cli.kept_server`` is the standby's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import select
import signal
import socket
import struct
import sys
import time
from pathlib import Path
from typing import Any

#: Set to 1 to run here even where a kept driver waits (its environment is not passed on).
OFF = "KHARNESS_NO_KEPT_DRIVER"

#: Read when a process starts or joins Ray: a kept driver started under other values
#: cannot serve the command (another address, other GPUs, the interpreter's mode).
_START_ENV = ("RAY_ADDRESS", "RAY_TMPDIR", "TMPDIR", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN",
              "RAY_AUTH_TOKEN_PATH", "PYTHONPATH", "TRITON_INTERPRET", "TRITON_CACHE_DIR",
              "TRITON_HOME", "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
              "ROCR_VISIBLE_DEVICES", "TORCHINDUCTOR_CACHE_DIR", "VIRTUAL_ENV", "HOME")

#: Set in a kept driver's process for the command it runs: its pid, seconds it took to
#: be ready and seconds it then waited (the run's summary shows them).
SERVED: dict[str, Any] = {}

#: How long a command waits for a kept driver still starting (its imports, joining Ray)
#: to take it; after this it runs here, saying so.
ACCEPT_TIMEOUT_S = 60.0


def _code_stamp() -> str:
    """The harness's own files (names, sizes, modification times): a kept driver runs
    the code it imported, so an edited or upgraded harness needs a new one."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256(str(root).encode())
    for path in sorted(root.rglob("*.py")):
        with contextlib.suppress(OSError):
            st = path.stat()
            h.update(f"{path.relative_to(root)}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


def _ray_head(env: dict[str, str]) -> str:
    """The Ray head this machine's last ``ray start`` left: its address and its session
    (a restarted head is another cluster, which a kept driver did not join). Ray's
    own folder: RAY_TMPDIR's, else TMPDIR's, else /tmp's ``ray``."""
    base = Path(env.get("RAY_TMPDIR") or env.get("TMPDIR") or "/tmp") / "ray"
    try:
        where = (base / "ray_current_cluster").read_text().strip()
    except OSError:
        return ""
    try:
        return f"{where} {os.readlink(base / 'session_latest')}"
    except OSError:
        return where


def folder() -> Path:
    """This user's folder of kept-driver sockets, readable by no one else."""
    path = Path(os.environ.get("XDG_RUNTIME_DIR") or "/tmp") / f"kharness-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"{path} is not this user's alone (owner {st.st_uid}, mode "
                              f"{oct(st.st_mode & 0o777)}): no kept driver is used")
    return path


def address(cwd: str | None = None, env: dict[str, str] | None = None) -> Path:
    """The socket of the kept driver that can serve a command run from ``cwd`` under
    ``env`` (default: this process's): one per interpreter, harness code, directory,
    Ray cluster and start-up environment. Short, since a socket's path is."""
    env = dict(os.environ) if env is None else env
    key = json.dumps([sys.executable, _code_stamp(), cwd or os.getcwd(), _ray_head(env),
                      [env.get(k, "") for k in _START_ENV]])
    return folder() / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.sock"


def enabled(env: dict[str, str]) -> bool:
    """Whether kept drivers serve commands run under ``env``: outside a Ray job (whose
    entrypoint is the job: its logs, its stop), and not turned off."""
    return env.get(OFF, "") in ("", "0") and not env.get("RAY_JOB_SUBMISSION_ID")


def wanted(argv: list[str], env: dict[str, str] | None = None) -> bool:
    """Whether a command may be handed to a kept driver: a ``run``, where they serve."""
    if not enabled(dict(os.environ) if env is None else env):
        return False
    args = list(argv)
    while args and args[0].startswith("--log-level"):  # the one option before the command
        args = args[2:] if args[0] == "--log-level" else args[1:]
    return args[:1] == ["run"]


# --- the wire: one length-prefixed JSON message each way, then the status ---------------

def send(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(message).encode()
    frame = struct.pack("!I", len(data)) + data
    if fds:
        socket.send_fds(sock, [frame], fds)
    else:
        sock.sendall(frame)


def receive(sock: socket.socket, max_fds: int = 0) -> tuple[dict[str, Any] | None, list[int]]:
    """One message (None at end of stream) and the descriptors that came with it. Reads
    no byte past the message."""
    buf, fds = b"", []
    while True:
        size = struct.unpack("!I", buf[:4])[0] if len(buf) >= 4 else None
        if size is not None and len(buf) >= 4 + size:
            return json.loads(buf[4:4 + size]), fds
        want = 4 - len(buf) if size is None else 4 + size - len(buf)
        if max_fds and not fds:
            chunk, got, _, _ = socket.recv_fds(sock, want, max_fds)
            fds += got
        else:
            chunk = sock.recv(want)
        if not chunk:
            return None, fds
        buf += chunk


def forward(argv: list[str], started_at: float) -> int | None:
    """Run the command in a kept driver if one serves it: its exit status, else None
    (none here, or none took it: the command runs in this process)."""
    if not wanted(argv):
        return None
    try:
        path = address()
    except OSError:
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
    except FileNotFoundError:
        sock.close()
        return None
    except (ConnectionRefusedError, OSError):  # its driver is gone: the path is stale
        sock.close()
        with contextlib.suppress(OSError):
            path.unlink()
        return None
    with sock:
        try:
            send(sock, {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ),
                        "started_at": started_at}, [0, 1, 2])
        except OSError:  # a closed stdin, or the driver ended as we came
            return None
        reply = _accepted(sock)
        if reply is None:
            return None
        return _wait(sock, int(reply["pid"]))


def _accepted(sock: socket.socket) -> dict[str, Any] | None:
    """The kept driver's reply that it took the command; it may still be starting (its
    imports, joining Ray), which the user is told of after a second."""
    t0 = time.monotonic()
    told = False
    while not select.select([sock], [], [], 1.0)[0]:
        if time.monotonic() - t0 >= ACCEPT_TIMEOUT_S:
            sys.stderr.write(f"kharness: the kept driver did not take the command within "
                             f"{ACCEPT_TIMEOUT_S:g} s; running it here\n")
            return None
        if not told:
            sys.stderr.write("kharness: the kept driver is still starting (imports, "
                             "joining Ray); waiting for it\n")
            told = True
    try:
        reply, _ = receive(sock)
    except OSError:
        reply = None
    if reply is None or "pid" not in reply:  # it ended as we came (its keep time ran out)
        sys.stderr.write("kharness: the kept driver ended without taking the command; "
                         "running it here\n")
        return None
    return reply


def _wait(sock: socket.socket, pid: int) -> int:
    """Until the kept driver's run ends: its exit status. Ctrl-C, SIGTERM and a closed
    terminal reach the run, which stops as a local one does."""
    def relay(signum: int, _frame: Any) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM if signum == signal.SIGHUP else signum)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, relay)
    while True:
        try:
            message, _ = receive(sock)
        except OSError:
            message = None
        if message is None:
            sys.stderr.write(f"kharness: the kept driver (pid {pid}) ended without an exit "
                             "status\n")
            return 1
        if "rc" in message:
            return int(message["rc"])
