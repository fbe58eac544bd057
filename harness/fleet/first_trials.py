"""The first study's first trials, measured by the head start before the fleet exists.

A run that starts its own Ray waits seconds for it, then seconds more for its GPU worker
(a Ray worker process, ``import torch``, the first problem's inputs): 8 s after Ray's own
start on an H200. Meanwhile the head start's compile children have compiled the configs
the first study is known to ask (``schedule.known_configs``) into Triton's cache. One
more process of the head start (forked from the same server, torch already imported)
builds the study's inputs and reference on this machine's GPU and measures those configs
as their compiles land, with the worker's own code (``Measurer.measure``) and the
experiment's budgets. When the scheduler starts, it stops this process (after the
measurement in hand) before any task reaches a worker, so that the two never time on the
GPU at once, and answers the study's first asks with these results instead of sending
them (``Scheduler``). A failure here loses the head start, nothing else: those configs
are measured by the fleet as usual.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any

from harness.fleet.compiled_baseline import recv_within
from harness.search.keys import config_key

log = logging.getLogger(__name__)

#: The longest one step of the process may take (building the problem, one measurement)
#: before it is taken for stuck: it is then killed and the fleet measures the rest.
STEP_S = 120.0


def _main(conn: Any, environ: dict[str, str]) -> None:
    """The measuring process: build the problem, then measure each config sent until
    told to stop (None) or the driver goes away."""
    os.environ.clear()
    os.environ.update(environ)
    try:
        from harness.kernel import api as kernel_api
        from harness.measure import hardware
        from harness.measure.timing import Measurer, Timing

        kernel, shape, dtype, seed, timing = conn.recv()
        fam = kernel_api.get(kernel)
        where = {"measured_by": "head start", "pid": os.getpid(),
                 "device_name": hardware.current_device().name}
        measurer = Measurer(Timing(**timing))
        measurer.prepare(fam, shape, dtype, seed)
        conn.send(("ready", os.getpid()))
        while True:
            config = conn.recv()
            if config is None:
                return
            res = measurer.measure(fam, shape, dtype, config, seed)
            res.extra.update(where)
            conn.send(("done", res.to_dict(), time.monotonic()))
    except (EOFError, OSError, KeyboardInterrupt):
        return  # the driver is gone, or stopped it
    except BaseException as exc:  # the fleet measures them instead
        try:
            conn.send(("failed", f"{type(exc).__name__}: {exc}"[:300]))
        except OSError:
            pass


class FirstTrials:
    """Measures ``configs`` of one study in a process of its own, each once its compile
    is done (``compiled(config)``: the head start's compile future, None where there is
    none); ``stop`` ends it and returns what it measured."""

    def __init__(self, ctx: Any, study: str, kernel: str, shape: dict, dtype: str,
                 seed: int, timing: dict[str, float], configs: Sequence[dict[str, Any]],
                 compiled: Callable[[dict[str, Any]], Future | None]) -> None:
        self.study = study
        self._problem = (kernel, dict(shape), dtype, seed, dict(timing))
        self._configs = [dict(c) for c in configs]
        self._compiled = compiled
        self._ctx = ctx
        self._stop = threading.Event()
        self._ready = threading.Event()  # the problem is built: measuring began
        self._lock = threading.Lock()
        #: config key -> (the result, when it came: time.monotonic())
        self.results: dict[str, tuple[dict[str, Any], float]] = {}
        self.why_stopped = ""
        self._proc: Any = None
        self._thread = threading.Thread(target=self._run, name="harness-first-trials",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _recv(self, conn: Any, what: str) -> tuple:
        return recv_within(conn, self._proc, "the head start's measuring process", what,
                           STEP_S)

    def _run(self) -> None:
        parent, child = self._ctx.Pipe()
        try:
            with self._lock:  # ``stop`` sees the process, or none is started
                if self._stop.is_set():
                    raise RuntimeError("stopped before it began")
                # Not niced, unlike the compile children: it times the GPU.
                self._proc = self._ctx.Process(target=_main, args=(child, dict(os.environ)),
                                               name="harness-first-trials", daemon=True)
                self._proc.start()
            child.close()
            parent.send(self._problem)
            msg = self._recv(parent, "inputs")
            if msg[0] != "ready":
                raise RuntimeError(msg[1])
            self._ready.set()
            for config in self._configs:
                fut = self._compiled(config)
                while fut is not None and not self._stop.is_set():
                    if wait_futures([fut], timeout=0.2).done:
                        break
                if self._stop.is_set():
                    break
                if fut is not None and not (fut.exception() is None
                                            and (fut.result() or {}).get("ok")):
                    continue  # a failed or timed-out compile: the fleet's to report
                parent.send(config)
                msg = self._recv(parent, "result")
                if msg[0] != "done":
                    raise RuntimeError(msg[1])
                with self._lock:
                    self.results[config_key(config)] = (msg[1], msg[2])
                if msg[1].get("fatal"):
                    # Its device context is poisoned: what it measured next would be that
                    # config's error, not theirs. The fleet measures the rest.
                    self.why_stopped = f"the device context was poisoned: {msg[1]['reason']}"
                    return
            self.why_stopped = "stopped" if self._stop.is_set() else "all measured"
        except Exception as exc:  # only a head start
            if self._stop.is_set() and not self._ready.is_set():
                self.why_stopped = "stopped while it built its inputs"
            else:
                self.why_stopped = f"failed: {exc}"[:300]
                log.warning("the head start's first trials stopped: %s", exc)
        finally:
            try:
                parent.send(None)
            except OSError:
                pass
            if self._proc is not None:
                self._proc.join(5)
                if self._proc.is_alive():
                    self._proc.kill()
                    self._proc.join(5)
            parent.close()

    def stop(self, timeout_s: float = STEP_S + 15) -> dict[str, tuple[dict[str, Any], float]]:
        """Stop after the measurement in hand, with the process gone (its GPU free), and
        return the results: config key -> (result, when it came). A process that does
        not end within ``timeout_s`` is killed and its measurement in hand lost."""
        with self._lock:
            self._stop.set()
            if not self._ready.is_set() and self._proc is not None and self._proc.is_alive():
                self._proc.kill()  # still building the problem: nothing measured to wait for
        if self._thread.is_alive() or self._thread.ident is None:
            if self._thread.ident is not None:
                self._thread.join(timeout_s)
            if self._thread.is_alive() and self._proc is not None and self._proc.is_alive():
                log.warning("the head start's measuring process did not stop within %g s: "
                            "killed", timeout_s)
                self._proc.kill()
                self._thread.join(10)
        with self._lock:
            return dict(self.results)

    def report(self) -> dict[str, Any]:
        with self._lock:
            done = sorted(t for _, t in self.results.values())
        return {"measured": len(done), "asked": len(self._configs),
                "why_stopped": self.why_stopped, "first_at": done[0] if done else None}
