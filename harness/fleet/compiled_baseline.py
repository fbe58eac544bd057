"""The torch.compile baseline, timed in a process of the GPU worker's own.

torch.compile's modules take seconds to import (8.7 s in a new H200 worker while its
node's compile service filled 14 cores), and a worker that imported them itself held its
GPU for them while the search's compiled configs waited. This process imports them on
another core from the worker's first trial on, beside the search, and times the baseline when the
final phase asks for it: the worker sends the problem, waits with its GPU idle, and
takes the result, so the baseline is still timed in the same interleaved rounds, on the
same GPU, by the same code (``Measurer.measure_eager``) as before. Its inputs and
reference are built again from the problem's seed, as every measurement builds them.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
from typing import Any

from harness.measure.timing import Timing, TrialResult
from harness.run import faults

log = logging.getLogger(__name__)

#: The longest the worker waits for the process's imports (seconds, minutes on a host
#: starved of CPU), then for its answer to one task (a first torch.compile build can take
#: minutes); the driver's trial time-out bounds a task sooner (a hung worker is replaced).
READY_S = 600.0
WAIT_S = 900.0
#: Processes started per worker (the first and replacements of one that died), after
#: which the worker times the baseline itself.
MAX_STARTS = 3


def recv_within(conn: Any, proc: Any, who: str, what: str, bound_s: float) -> tuple:
    """The next message from ``who`` (process ``proc`` at the other end of ``conn``),
    woken by it; an error naming ``what`` where none comes within ``bound_s``
    (``TimeoutError``) or the process ends first (``ChildProcessError``)."""
    if not conn.poll(bound_s):
        raise TimeoutError(f"no {what} from {who} (pid {proc.pid}) after {bound_s:g} s")
    try:
        return conn.recv()
    except (EOFError, OSError):
        proc.join(5)
        raise ChildProcessError(f"{who} ended before its {what} "
                                f"(exit code {proc.exitcode})") from None


def _main(conn: Any) -> None:
    """The process: import torch.compile's modules, say so, then time each problem's
    compiled baseline the worker sends until it sends None or goes away."""
    steps: dict[str, float] = {}
    t0 = time.perf_counter()
    try:
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # as in the worker
        import torch
        import torch._dynamo  # noqa: F401
        import torch._inductor.compile_fx  # noqa: F401

        from harness.kernel import api as kernel_api
        from harness.measure.timing import Measurer

        if torch.cuda.is_available():
            torch.cuda.init()
        steps["imports_s"] = round(time.perf_counter() - t0, 3)
        measurer = Measurer(Timing(), keep=1)
    except BaseException as exc:  # the worker times the baseline itself
        conn.send(("failed", f"{type(exc).__name__}: {exc}"[:300]))
        return
    try:
        conn.send(("ready", os.getpid(), steps))
        while True:
            task = conn.recv()
            if task is None:
                return
            kernel, shape, dtype, seed, timing = task
            if faults.active("baseline_hang"):
                threading.Event().wait()  # never answers
            measurer.timing = Timing(**timing)
            try:
                res = measurer.measure_eager(kernel_api.get(kernel), shape, dtype, seed,
                                             compiled=True)
            except BaseException as exc:  # measure_eager reports its own; not this
                res = TrialResult(ok=False, reason=f"{type(exc).__name__}: {exc}"[:400])
            conn.send(("done", res.to_dict()))
    except (EOFError, OSError, KeyboardInterrupt):
        return  # the worker is gone


class CompiledBaseline:
    """The worker's side: ``start`` the process (at once, so that its imports overlap
    the worker's own start), ``measure`` a problem's baseline in it, ``close`` it.
    ``measure`` returns None where the process cannot serve (it failed to import, or
    died too often): the worker then times the baseline itself."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: Any = None
        self._conn: Any = None
        self._ready = False
        self._broken = ""  # why the worker times the baseline itself from now on
        self.starts = 0
        self.stats: dict[str, Any] = {"measured": 0, "died": 0}

    def start(self) -> None:
        with self._lock:
            self._start_locked()

    def _start_locked(self) -> None:
        if self._broken or (self._proc is not None and self._proc.is_alive()):
            return
        if self.starts >= MAX_STARTS:
            self._broken = f"its process was started {self.starts} times and did not last"
            return
        ctx = multiprocessing.get_context("spawn")  # no CUDA context inherited
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_main, args=(child,), name="harness-compiled-baseline",
                           daemon=True)
        proc.start()
        child.close()
        self._proc, self._conn, self._ready = proc, parent, False
        self._t_start = time.monotonic()
        self.starts += 1

    def _recv(self, what: str, bound_s: float) -> tuple:
        return recv_within(self._conn, self._proc, "the torch.compile baseline's process",
                           what, bound_s)

    def _stop_locked(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(5)
            self._conn.close()
        self._proc = self._conn = None
        self._ready = False

    def measure(self, kernel: str, shape: dict, dtype: str, seed: int,
                timing: Timing) -> dict[str, Any] | None:
        """The baseline's result (``TrialResult.to_dict``), or None: the worker times it
        itself (the process could not import torch.compile, or cannot be started)."""
        with self._lock:
            try:
                self._start_locked()
            except Exception as exc:  # cannot start a process here: the worker times it
                self._broken = f"its process could not be started: {exc}"
            if self._broken:
                return None
            if not self._ready:
                t_wait = time.monotonic()
                try:
                    msg = self._recv("readiness", READY_S)
                except (TimeoutError, ChildProcessError) as exc:
                    msg = ("failed", str(exc))
                if msg[0] == "failed":
                    self._broken = f"its process could not start: {msg[1]}"
                    log.warning("the torch.compile baseline is timed in the worker: %s",
                                self._broken)
                    self._stop_locked()
                    return None
                self._ready = True
                self.stats["ready_s"] = round(time.monotonic() - self._t_start, 2)
                # How long a baseline waited, the GPU idle, for the process's imports.
                self.stats["waited_s"] = round(self.stats.get("waited_s", 0.0)
                                               + time.monotonic() - t_wait, 2)
                self.stats.update(msg[2])
            try:
                self._conn.send((kernel, dict(shape), dtype, seed,
                                 {"warmup_ms": timing.warmup_ms, "rep_ms": timing.rep_ms,
                                  "cpu_reps": timing.cpu_reps}))
                msg = self._recv("result", WAIT_S)
            except (TimeoutError, ChildProcessError, OSError) as exc:
                # The baseline fails, the study goes on; a later one gets a new process.
                self.stats["died"] += 1
                self._stop_locked()
                return TrialResult(ok=False, reason=str(exc)).to_dict()
            self.stats["measured"] += 1
            out = msg[1]
            if out.get("fatal"):
                # The process's own device context is poisoned, not the worker's: the
                # next baseline gets a new process.
                out["fatal"] = False
                self._stop_locked()
            out.setdefault("extra", {}).update(timed_in="compiled-baseline process",
                                               compiled_baseline=dict(self.stats))
            return out

    def close(self) -> None:
        with self._lock:
            if self._proc is not None and self._proc.is_alive():
                try:
                    self._conn.send(None)
                    self._proc.join(5)
                except OSError:
                    pass
            self._stop_locked()
