"""``--json``'s stdout: the object alone, whatever else a run prints there."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

from harness.tracking import jsonsafe

#: The command's own stdout, kept aside (``keep_apart``).
_FD: list[int] = []


def keep_apart() -> None:
    """From here on, whatever is printed to stdout goes to stderr, and the object (``emit``)
    to the command's stdout, kept aside: Ray relays its workers' and daemons' messages to
    the driver's stdout (at a stop, the autoscaler's traceback came ahead of the object)."""
    if sys.stdout is not sys.__stdout__:  # captured in-process (tests): nothing to keep apart
        return
    sys.stdout.flush()
    _FD.append(os.dup(1))
    os.dup2(2, 1)


def emit(obj: Any) -> None:
    """The object, on the command's stdout; its descriptor is closed after, so that a
    reader of the command's output sees it end with the object."""
    text = jsonsafe.dumps(obj, default=str, indent=1) + "\n"
    if not _FD:
        print(text, end="", flush=True)
        return
    sys.stdout.flush()
    with os.fdopen(_FD.pop(), "w", encoding="utf-8") as out:
        out.write(text)


def let_go() -> None:
    """The command's stdout kept aside and not used (a run that ended in an error),
    closed: a kept driver gives the command's descriptors back."""
    while _FD:
        with contextlib.suppress(OSError):
            os.close(_FD.pop())
