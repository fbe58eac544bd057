"""Compiling ahead: a kernel's configs compiled in child processes, before the GPU needs
them, into Triton's on-disk cache, so that a worker's first launch of a config only loads
its binary.

A family opts in with ``compile_only(inputs, shape, config)``: the same launch as its
launcher, compiled and not run (``JITFunction.warmup``), given inputs as meta tensors
(layout and dtype, no memory). ``Precompiler`` is the process pool; one per node runs in
that node's compile service (``harness.fleet.compile_service``), shared by its GPUs.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from harness import hardware
from harness.search.keys import config_key

log = logging.getLogger(__name__)

#: How long a trial waits for its config's ahead-of-time compilation before compiling
#: itself (the compile keeps going; only the wait is cut short).
PRECOMPILE_WAIT_S = 120.0
#: Niceness of the compile children. They are throughput work that fills every spare
#: core; the driver, the GPU worker and Ray are latency work the GPU waits on, and with
#: 14 children on 16 cores they were starved at a search's start (the GPU idled 0.6-1 s
#: waiting for the driver at an H200 run's start).
COMPILE_NICE = 10

@dataclass(frozen=True)
class TensorSpec:
    """A tensor's layout without its data: enough to compile a kernel for it."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    device: str


def skeleton(value: Any) -> Any:
    """Inputs with every tensor replaced by its TensorSpec (cheap to send to a child)."""
    import torch

    if isinstance(value, torch.Tensor):
        return TensorSpec(tuple(value.shape), tuple(value.stride()),
                          str(value.dtype).removeprefix("torch."), value.device.type)
    if isinstance(value, dict):
        return {k: skeleton(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(skeleton(v) for v in value)
    return value


def materialise(value: Any, device: str = "meta") -> Any:
    """Tensors laid out as a skeleton says, on ``device``. The default, ``meta``, holds no
    memory: a compile child must never take device memory from the worker it serves, and
    Triton specializes a meta tensor exactly as an aligned device tensor."""
    import torch

    if isinstance(value, TensorSpec):
        return torch.empty_strided(value.shape, value.stride, dtype=getattr(torch, value.dtype),
                                   device=device)
    if isinstance(value, dict):
        return {k: materialise(v, device) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(materialise(v, device) for v in value)
    return value




_CHILD: dict[str, Any] = {}  # problem -> inputs a compile child built (the last two)


def pin_triton_cache_dir() -> str:
    """Fix Triton's on-disk cache directory for this process and the children it starts.

    torch.compile (Inductor) points ``TRITON_CACHE_DIR`` at a directory of its own the
    first time it runs a Triton kernel, unless the variable is set: after a torch.compile
    baseline, a worker would look for its binaries where its compile children never
    wrote them, and compile every config again itself (seen on an H200: 0.2-1.5 s per
    grouped-GEMM trial)."""
    path = os.environ.get("TRITON_CACHE_DIR")
    if not path:
        # Triton's own default, spelled out: importing triton here, before the worker
        # has decided about TRITON_INTERPRET, would fix the interpreter choice too early.
        home = os.environ.get("TRITON_HOME") or os.path.expanduser("~/")
        path = os.path.join(home, ".triton", "cache")
        os.environ["TRITON_CACHE_DIR"] = path
    return path


def _pool_context() -> Any:
    """forkserver where the platform has it: one server process imports torch and Triton
    once and each child is forked from it, ready in a fraction of a second, where 14
    spawned children importing torch at once took 6 s on a 16-core H200 box
    (benchmarks/device/diag_startup.py). The server is a fresh process, so, as with spawn,
    no child inherits the worker's CUDA context."""
    import multiprocessing

    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "triton", "harness.kernel_api"])
        return ctx
    return multiprocessing.get_context("spawn")


def _init_child(environ: dict[str, str]) -> None:
    """Each compile child's initializer. A forkserver is started once per process, so its
    children inherit the environment of that moment: take the pool owner's current one
    (cache directory, device selection, ...). Then yield the CPU to the processes the GPU
    waits on."""
    os.environ.clear()
    os.environ.update(environ)
    try:
        os.nice(COMPILE_NICE)
    except OSError as exc:  # a sandbox that forbids it: children at normal priority
        log.warning("compile children keep their priority: %s", exc)


def _warm_child() -> int:
    """Import what compiling needs and open the device, before the first config comes."""
    import importlib

    import torch

    for name in ("triton", "harness.kernel_api"):
        importlib.import_module(name)
    if torch.cuda.is_available() and not hardware.interpreted():
        torch.cuda.init()
        try:
            from harness import _compile_warmup

            _compile_warmup.compile_once()
        except Exception as exc:  # only a warm-up: the first config pays instead
            log.warning("compile warm-up failed: %s", exc)
    return os.getpid()


def _compile_in_child(kernel: str, shape: dict, problem: str, skel: Any,
                      config: dict) -> dict[str, Any]:
    """Runs in a compile child: the family's ``compile_only`` for one config, on meta
    tensors. It compiles without launching or allocating, so it never touches the GPU the
    parent is timing."""
    t0 = time.perf_counter()
    try:
        from harness import kernel_api

        fam = kernel_api.get(kernel)
        if problem not in _CHILD:
            while len(_CHILD) >= 2:
                _CHILD.pop(next(iter(_CHILD)))
            _CHILD[problem] = materialise(skel)
        fam.compile_only(_CHILD[problem], shape, config)  # type: ignore[attr-defined]
        return {"ok": True, "pid": os.getpid(), "compile_s": time.perf_counter() - t0}
    except BaseException as exc:  # the parent measures this config anyway
        return {"ok": False, "pid": os.getpid(), "compile_s": time.perf_counter() - t0,
                "reason": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}


class Precompiler:
    """Compiles configs ahead in child processes.

    A family opts in with ``compile_only(inputs, shape, config)``: the same launch as its
    launcher, compiled and not run (``JITFunction.warmup``), given inputs as meta tensors
    (layout and dtype, no memory) on a machine whose GPU it may query. The children write
    Triton's
    on-disk cache, so the worker's own first launch of that config only loads the binary.
    A failed or crashed compile is ignored: the worker's measurement compiles again and
    reports the error as the trial's.
    """

    #: Outstanding compiles kept; the oldest are forgotten beyond this (never waited on).
    MAX_PENDING = 1024

    def __init__(self, processes: int):
        self.processes = processes
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()
        self._futures: dict[tuple[str, str], Future] = {}
        self.submitted = 0

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(self.processes, mp_context=_pool_context(),
                                             initializer=_init_child,
                                             initargs=(dict(os.environ),))
        return self._pool

    def start(self) -> None:
        """Start the children now (they take seconds to import torch and Triton), so
        that the first configs do not wait for them. Returns once the processes exist
        (with forkserver: once its preload is imported), not once they are warm."""
        with self._lock:
            try:
                pool = self._executor()
                for _ in range(self.processes):
                    pool.submit(_warm_child)
            except Exception as exc:
                log.warning("compile-ahead unavailable: %s", exc)
                self._reset()

    def _reset(self) -> None:
        pool, self._pool = self._pool, None
        self._futures.clear()
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def submit(self, problem: str, kernel: str, shape: Mapping[str, int], skel: Any,
               configs: Iterable[Mapping[str, Any]]) -> None:
        with self._lock:
            for config in configs:
                key = (problem, config_key(config))
                if key in self._futures:
                    continue
                try:
                    self._futures[key] = self._executor().submit(
                        _compile_in_child, kernel, dict(shape), problem, skel, dict(config))
                    self.submitted += 1
                except Exception as exc:  # a broken pool: start over on the next call
                    log.warning("compile-ahead unavailable: %s", exc)
                    self._reset()
                    return
            while len(self._futures) > self.MAX_PENDING:
                self._futures.pop(next(iter(self._futures)))

    def pending(self, problem: str, config: Mapping[str, Any]) -> Future | None:
        """The compile of ``config`` under way or done, left for ``wait`` to collect."""
        with self._lock:
            return self._futures.get((problem, config_key(config)))

    def wait(self, problem: str, config: Mapping[str, Any],
             timeout_s: float = PRECOMPILE_WAIT_S) -> dict[str, Any] | None:
        """The ahead-of-time compile's outcome for ``config`` (None: none was started)."""
        with self._lock:
            fut = self._futures.pop((problem, config_key(config)), None)
        if fut is None:
            return None
        try:
            return fut.result(timeout=timeout_s)
        except FutureTimeout:
            return {"ok": False, "reason": f"still compiling after {timeout_s:g} s"}
        except Exception as exc:  # a child died (compiler crash): new children next time
            with self._lock:
                self._reset()
            return {"ok": False, "reason": f"compile child lost: {type(exc).__name__}"}

    def close(self) -> None:
        with self._lock:
            self._reset()


def gpu_device_nodes() -> bool:
    """Whether this machine has an NVIDIA or AMD GPU device node: known before torch is
    imported, unlike torch.cuda.is_available(). Ray's simulated GPUs (tests) have none."""
    return any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/kfd"))


def precompile_enabled(has_gpu: bool | None = None) -> bool:
    """Compiling ahead needs a real compiler, so a GPU (``has_gpu``; by default: not under
    the interpreter); ``HARNESS_PRECOMPILE=force`` turns it on under the interpreter too
    (the plumbing's tests), ``off`` turns it off."""
    mode = os.environ.get("HARNESS_PRECOMPILE", "")
    if mode == "off":
        return False
    if mode == "force":
        return True
    return has_gpu if has_gpu is not None else not hardware.interpreted()



def problem_key(kernel: str, shape: Mapping[str, int], dtype: str, seed: int) -> str:
    """The identity of a problem's inputs (what a worker holds and builds once)."""
    return json.dumps([kernel, dict(sorted(shape.items())), dtype, seed])
