"""One run of an experiment at a time: a lock on its run directory (``runs/<name>/``).

Two runs of the same experiment would share its Optuna studies, its state and its MLflow
parent run, each marking the other's trials interrupted. The lock is an ``flock`` on
``runs/<name>/run.lock``: the kernel drops it when its process ends, however it ends
(``kill -9`` included), so a stale lock never blocks the next run. The file names its
holder (process, host, start, command) for the message of the run it refuses.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

from harness.experiment.schema import Experiment, ExperimentError

LOCK_FILE = "run.lock"


class RunLock:
    """The held lock of one run directory; ``release()`` (or the process's end) frees it."""

    def __init__(self, path: Path, fd: int, created: list[Path]):
        self.path, self._fd, self._created = path, fd, created

    def release(self, undo: bool = False) -> None:
        """Drop the lock. ``undo``: the run wrote nothing (its file failed its checks):
        the directories created for the lock go too."""
        if self._fd < 0:
            return
        if undo and self._created:
            self.path.unlink(missing_ok=True)
            _remove(self._created)
        os.close(self._fd)  # closing the descriptor drops the flock
        self._fd = -1

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def _remove(created: list[Path]) -> None:
    """Remove the folders a lock created (deepest first), where they are still empty."""
    for folder in created:
        try:
            folder.rmdir()
        except OSError:
            if os.path.lexists(folder):
                break  # something else is there now: leave it
            # never made (mkdir failed there, a name too long for instance): its parent next


def _holder(path: Path) -> str:
    try:
        info = json.loads(path.read_text())
        return (f"process {info['pid']} on {info['host']}, started {info['started']}: "
                f"{info['command']}")
    except (OSError, ValueError, KeyError, TypeError):
        return "another process (its details are not written yet)"


def lock_run_dir(config: str | Path, exp: Experiment) -> RunLock:
    """Take the lock of ``exp``'s run directory, or raise ExperimentError (exit 2) naming
    the run that holds it. Nothing else is written before it is held."""
    run_dir = Path(exp.output.runs_dir) / exp.name
    path = run_dir / LOCK_FILE
    created = [p for p in (run_dir, *run_dir.parents) if not p.exists()]
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        _remove(created)  # a name too long for the file system left runs/ behind
        raise ExperimentError(config, "output.runs_dir",
                              f"cannot lock {run_dir}: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ExperimentError(config, "output.runs_dir",
                              f"{run_dir} is in use by another run of {exp.name!r} "
                              f"({_holder(path)}); wait for it to end") from None
    info = {"pid": os.getpid(), "host": socket.gethostname(),
            "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(sys.argv) or sys.executable}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
    return RunLock(path, fd, created)
