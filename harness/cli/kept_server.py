"""The kept driver's own process (``harness.cli.kept_driver`` is the command's side).

``python -m harness.cli.kept_server --socket PATH --keep-s S`` binds this directory's and
environment's socket at once (a command that comes meanwhile waits in its backlog),
imports what a run imports, joins the cluster, starts its reserve (the next standby,
which prepares at once and waits for its turn), then waits up to S seconds for one
command. It takes the command, hands its listening socket to the reserve, runs the
command as ``kharness`` would (the command's directory, environment and terminal), sends
back the exit status and ends. A second standby for the same socket ends at once (a lock
file says which one serves).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from harness.cli import kept_driver

#: What a run imports before its first trial, imported before the command comes.
_MODULES = ("harness.cli.main", "harness.run.runner", "harness.run.campaign",
            "harness.experiment.checks", "harness.tracking.spares", "optuna", "torch",
            "triton")


def _lock(path: Path) -> int | None:
    """This socket's lock, held while a standby waits for its command; None where
    another holds it."""
    fd = os.open(path.with_suffix(".lock"), os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def spawn(keep_s: float, path: Path, env: dict[str, str], listen_fd: int | None = None,
          turn_fd: int | None = None) -> subprocess.Popen:
    """Start a standby for the socket ``path`` with the environment ``env``, in a
    session of its own (it outlives the command); its output goes to ``<socket>.log``.
    ``turn_fd``: it is a reserve, which prepares at once and takes the socket when told
    on that pipe (``_turn``)."""
    cmd = [sys.executable, "-m", "harness.cli.kept_server", "--socket", str(path),
           "--keep-s", f"{keep_s:g}"]
    fds = tuple(fd for fd in (listen_fd, turn_fd) if fd is not None)
    if listen_fd is not None:
        cmd += ["--listen-fd", str(listen_fd)]
    if turn_fd is not None:
        cmd += ["--turn-fd", str(turn_fd)]
    with open(path.with_suffix(".log"), "ab") as log:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                cwd=os.getcwd(), env=env, pass_fds=fds)


#: What a standby tells its reserve: take the socket now, or end (no command came).
GO, QUIT = b"g", b"q"


def _reserve(keep_s: float, path: Path, env: dict[str, str], listener: socket.socket
             ) -> tuple[subprocess.Popen, int]:
    """The next standby, started as this one becomes ready, so that it has prepared by
    the time a command takes this one: commands run back to back (a run of 7 s on an
    H200) found the successor started at the previous command still importing, 2 s
    before their first trial. It shares the listening socket and waits on a pipe
    (returned: its write end) for its turn."""
    read, write = os.pipe()
    proc = spawn(keep_s, path, env, listener.fileno(), read)
    os.close(read)
    return proc, write


def _tell(fd: int, what: bytes) -> None:
    with contextlib.suppress(OSError):  # a reserve that ended (it found no cluster)
        os.write(fd, what)
    os.close(fd)


def _turn(fd: int) -> bool:
    """A reserve's wait for its turn: True when told to go, or when its standby ended
    without a word (killed: the socket needs a server); False when told to end."""
    try:
        said = os.read(fd, 1)
    finally:
        os.close(fd)
    return said != QUIT


def ensure(keep_s: float, env: dict[str, str]) -> bool:
    """After a run that keeps its workers: a standby for the next command under ``env``
    (the command's environment as it started: the socket's key), unless one is there.
    It starts with this process's environment as it is now (joining Ray by RAY_ADDRESS
    needs the RAY_AUTH_MODE that the command set before importing Ray). Whether one was
    started."""
    try:
        path = kept_driver.address(env=env)
        fd = _lock(path)
    except OSError:  # no folder of this user's alone: none is kept
        return False
    if fd is None:
        return False
    os.close(fd)  # the standby takes it
    spawn(keep_s, path, dict(os.environ))
    return True


#: This process's log (``<socket>.log``), kept open apart from stdout, which becomes the
#: command's.
_LOG = {"fd": 1}


def _say(message: str) -> None:
    line = f"{time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()}: {message}\n"
    with contextlib.suppress(OSError):
        os.write(_LOG["fd"], line.encode())


def _listen(path: Path, fd: int | None) -> socket.socket:
    if fd is not None:  # the socket its predecessor listened on: no command is lost
        return socket.socket(fileno=fd)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    os.chmod(path, 0o600)
    sock.listen(16)
    return sock


def _prepare() -> str:
    """What a run does before it can take its first trial, done now: the imports and
    joining the cluster. The cluster's address, or "" where there is none to keep a
    driver on (a Ray of its own would end with this process)."""
    import importlib

    from harness.fleet.cluster import Cluster

    if not os.environ.get("RAY_ADDRESS") and Cluster.running_head() is None:
        return ""
    for name in _MODULES:
        importlib.import_module(name)
    from harness.search import make_storage

    # SQLAlchemy's dialect and Optuna's schema code, loaded once: a run's first storage
    # took seconds to open here, on the way to its first trial.
    make_storage("sqlite://").engine.dispose()
    return Cluster.connect()


def _command(listener: socket.socket, keep_s: float
             ) -> tuple[socket.socket, dict[str, Any], list[int]] | None:
    """The next command of this user, or None once ``keep_s`` pass without one."""
    listener.settimeout(keep_s)
    while True:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            return None
        _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                        struct.calcsize("3i")))
        conn.settimeout(10.0)  # the command sends its request at once
        try:
            request, fds = kept_driver.receive(conn, max_fds=3)
        except OSError:
            request, fds = None, []
        if uid == os.getuid() and request is not None and len(fds) == 3:
            conn.settimeout(None)
            return conn, request, fds
        for fd in fds:
            os.close(fd)
        conn.close()


def _serve(request: dict[str, Any], fds: list[int], served: dict[str, Any],
           start_env: set[str]) -> int:
    """Run the command as the ``kharness`` process it replaces: its directory,
    environment, arguments, terminal and start time."""
    import importlib

    import harness

    cli = importlib.import_module("harness.cli.main")  # the package's ``main`` is the function

    os.chdir(request["cwd"])
    for name in start_env - request["env"].keys():  # what Ray or an import set stays
        os.environ.pop(name, None)
    os.environ.update(request["env"])
    for target, fd in zip((0, 1, 2), fds, strict=True):
        os.dup2(fd, target)
        os.close(fd)
    # The streams stay the objects that loggers hold; a terminal's lines show at once.
    sys.stdout.reconfigure(line_buffering=os.isatty(1))
    sys.argv = ["kharness", *request["argv"]]
    harness.IMPORTED_AT = float(request["started_at"])
    kept_driver.SERVED.update(served)
    return cli.here()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.cli.kept_server")
    p.add_argument("--socket", type=Path, required=True, help="where to listen (its key: "
                   "this directory and the command's environment)")
    p.add_argument("--keep-s", type=float, required=True)
    p.add_argument("--listen-fd", type=int)
    p.add_argument("--turn-fd", type=int, help="a reserve: its standby says on this pipe "
                   "when it takes the socket")
    args = p.parse_args(argv)
    started = time.monotonic()
    _LOG["fd"] = os.dup(1)
    env = dict(os.environ)  # the successor's too
    # Ctrl-C, relayed by the command, stops the run as in a terminal (a process started
    # with SIGINT ignored would keep that).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    path = args.socket
    reserve = args.turn_fd is not None
    lock = None if reserve else _lock(path)
    if lock is None and not reserve:
        _say("another kept driver serves this socket; ending")
        return 0
    listener = _listen(path, args.listen_fd)
    bound = os.stat(path).st_ino
    where = _prepare()
    if not where:
        _say("no cluster outlives a run here (no `ray start`, no RAY_ADDRESS); ending")
        listener.close()
        return 0
    ready_at = time.monotonic()
    prepared_s = ready_at - started
    if reserve:
        _say(f"ready in {prepared_s:.1f} s on {where}; a reserve, waiting for its turn")
        lock = _lock(path) if _turn(args.turn_fd) else None
        if lock is None:
            _say("its standby ended without a command, or another serves; ending")
            listener.close()
            return 0
        ready_at = time.monotonic()  # idle from its turn
    nxt, turn = _reserve(args.keep_s, path, env, listener)
    _say(f"ready in {prepared_s:.1f} s on {where}; waiting {args.keep_s:g} s for a command")
    taken = _command(listener, args.keep_s)
    if taken is None:
        _say("no command came; ending")
        _tell(turn, QUIT)
        with contextlib.suppress(OSError):
            if os.stat(path).st_ino == bound:  # not a later standby's
                path.unlink()
        return 0
    conn, request, fds = taken
    # The reserve takes this listening socket at once: the next command waits in its
    # backlog at most until it is told, never in a gap between two standbys.
    os.close(lock)
    if nxt.poll() is None:
        _tell(turn, GO)
    else:  # it ended (its log says why): a successor starts now instead
        os.close(turn)
        spawn(args.keep_s, path, env, listener.fileno())
    listener.close()
    served = {"pid": os.getpid(), "ready_s": round(prepared_s, 2),
              "idle_s": round(time.monotonic() - ready_at, 2)}
    from harness.tracking.redact import redact

    _say(redact(f"running `kharness {' '.join(request['argv'])}` from {request['cwd']}"))
    kept_driver.send(conn, served)
    running = threading.Event()
    running.set()
    threading.Thread(target=_watch_command, args=(conn, running), daemon=True,
                     name="harness-kept-command").start()
    rc = 1
    try:
        rc = _serve(request, fds, served, set(env))
    finally:
        running.clear()
        _let_go()
        with contextlib.suppress(OSError):
            kept_driver.send(conn, {"rc": rc})
        conn.close()
    return rc


def _watch_command(conn: socket.socket, running: threading.Event) -> None:
    """The command sends nothing more: its socket ends when its process does. A command
    killed outright (SIGKILL, its terminal gone) stops its run here as SIGTERM stops a
    local one, with what was measured stored."""
    with contextlib.suppress(OSError):
        while conn.recv(1):
            pass
    if running.is_set():
        _say("the command's process is gone: stopping its run (as SIGTERM would)")
        # Its terminal or pipe is gone too: what the run still prints on its way out
        # goes nowhere rather than failing it.
        null = os.open(os.devnull, os.O_WRONLY)
        for fd in (1, 2):
            os.dup2(null, fd)
        os.close(null)
        os.kill(os.getpid(), signal.SIGTERM)


def _let_go() -> None:
    """The command's stdin, stdout and stderr given back before its exit status goes:
    a caller that reads its output through a pipe sees it end with the command, not
    once this process has left Ray."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a reader that stopped reading
            stream.flush()
    from harness.cli import json_stdout

    json_stdout.let_go()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)


if __name__ == "__main__":
    code = main()
    import ray  # the run's Ray driver ends cleanly: its job is marked finished

    if ray.is_initialized():
        ray.shutdown()
    os._exit(code)
