"""Fleet: owns Ray. Finds GPUs by hardware key, keeps one long-lived worker per GPU,
sends it work, replaces it when a kernel poisons its context or hangs, retries a trial
whose node died. It never decides what to try.

Hardware keys come from Ray's ``accelerator_type:<name>`` node resources: Ray sets them
itself for NVIDIA GPUs (``H100``, ``H200``, ``A100-80G``, ...); GPUs Ray does not
recognise, such as the AMD Radeon PRO V710, need the resource declared at ``ray start
--resources='{"accelerator_type:V710": 1}'``. A worker checks that the GPU it sees is the
one its node advertises.

Each worker keeps a queue of tasks (``queue_depth``) so that it never waits on the
driver between trials, and compiles the queued configs ahead in child processes
(Triton's on-disk cache carries the binaries over) while it times the current one.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from dataclasses import replace as _replace
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError, WorkerCrashedError

from harness import hardware
from harness.measure import Measurer, Timing, TrialResult
from harness.search.keys import config_key

log = logging.getLogger(__name__)


def _answers(address: str, timeout_s: float = 2.0) -> bool:
    """Whether a server accepts connections at ``address`` ("host:port")."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


#: Kept workers (``keep_s``) are detached actors named KEPT_PREFIX + key + a random
#: suffix in this Ray namespace, so that a later run on the cluster finds them.
KEPT_NS = "kharness"
KEPT_PREFIX = "kharness-worker-"
#: How often a trial whose worker vanished (node lost) is retried elsewhere.
MAX_RETRIES = 2
#: How long a trial waits for its config's ahead-of-time compilation before compiling
#: itself (the compile keeps going; only the wait is cut short).
PRECOMPILE_WAIT_S = 120.0
#: Niceness of the compile children. They are throughput work that fills every spare
#: core; the driver, the GPU worker and Ray are latency work the GPU waits on, and with
#: 14 children on 16 cores they were starved at a search's start (the GPU idled 0.6-1 s
#: waiting for the driver at an H200 run's start).
COMPILE_NICE = 10

_LOST = (RayActorError, WorkerCrashedError)


# -- compiling ahead ----------------------------------------------------------------------


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


def _lower_priority() -> None:
    """Each compile child's initializer: yield the CPU to the processes the GPU waits on."""
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
                                             initializer=_lower_priority)
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


def _finite(x: float | None) -> float:
    return x if isinstance(x, (int, float)) and x == x and abs(x) != float("inf") else 0.0


def _gpu_device_nodes() -> bool:
    """Whether this machine has an NVIDIA or AMD GPU device node: known before torch is
    imported, unlike torch.cuda.is_available(). Ray's simulated GPUs (tests) have none."""
    return any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/kfd"))


def _auto_compile_workers() -> int:
    """This worker's share of its node's cores, less one for itself (at most 16)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    node = ray.get_runtime_context().get_node_id()
    gpus = next((n["Resources"].get("GPU", 0) for n in ray.nodes() if n["NodeID"] == node), 1)
    return max(1, min(16, int((cores or 2) // max(1, gpus)) - 1))


def _warm_check() -> None:
    """Build the accuracy check's fused kernel while the worker starts: its compile and
    launcher would otherwise land on the first trials' checks (GPU-held time)."""
    try:
        import torch

        if torch.cuda.is_available():
            from harness import accuracy

            accuracy.warm_up("cuda")
    except Exception as exc:  # the first checks build it instead
        log.warning("accuracy check warm-up failed: %s", exc)


def code_version(paths: Iterable[str | os.PathLike]) -> str:
    """A digest of the Python sources under ``paths`` (files or folders): a kept worker
    has imported its code once, so a run with other code must not use it."""
    import hashlib
    from pathlib import Path

    h = hashlib.sha256()
    for root in sorted({str(p) for p in paths}):
        base = Path(root)
        files = [base] if base.is_file() else sorted(base.rglob("*.py"))
        for f in files:
            h.update(str(f).encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _problem_key(kernel: str, shape: Mapping[str, int], dtype: str, seed: int) -> str:
    return json.dumps([kernel, dict(sorted(shape.items())), dtype, seed])


# -- the worker -----------------------------------------------------------------------


@ray.remote(max_restarts=0, max_task_retries=0,
            concurrency_groups={"control": 1, "results": 128})
class Worker:
    """One per GPU (or one CPU worker running Triton's interpreter).

    The driver ``enqueue``s numbered tasks and collects each with ``result``; one
    thread runs them one at a time, so nothing else runs on the GPU while a kernel is
    timed: in number order, except that a measurement whose config is compiled may run
    ahead of an older one still compiling (``_pick``). Queued configs are compiled ahead
    by a ``Precompiler``.
    """

    def __init__(self, hardware_key: str, timing: dict[str, float],
                 compile_workers: int | str = 0, keep_s: float = 0.0, version: str = "",
                 first: tuple | None = None):
        t0 = time.monotonic()
        # Where a worker's start-up goes, in seconds, by step (reported by ``info``).
        self.startup_s: dict[str, float] = {}
        tick = [t0]

        def step(name: str) -> None:
            now = time.monotonic()
            self.startup_s[name] = round(now - tick[0], 2)
            tick[0] = now

        ctx = ray.get_runtime_context()
        gpu_ids = [str(g) for g in ctx.get_accelerator_ids().get("GPU", [])]
        # The compile children's server starts on a thread while this process imports
        # torch (each import takes ~3 s; in turn they took 6 s of every start on an
        # H200 box): a worker given a GPU by Ray compiles ahead; one without runs
        # Triton's interpreter and only does so when forced (the plumbing's tests).
        pin_triton_cache_dir()
        if compile_workers == "auto":
            compile_workers = _auto_compile_workers()
        self.pre: Precompiler | None = None
        warm: threading.Thread | None = None
        pool: threading.Thread | None = None
        if gpu_ids and _gpu_device_nodes():
            pool = threading.Thread(target=self._start_precompiler,
                                    args=(int(compile_workers), True),
                                    name="harness-compile-pool", daemon=True)
            pool.start()
            warm = threading.Thread(target=_warm_check, name="harness-warm-check", daemon=True)
            warm.start()
        import torch

        step("import_torch")

        if not torch.cuda.is_available():
            # Before any kernel module is imported, so its @triton.jit is interpreted
            # (and before compile children are started, which inherit it).
            os.environ["TRITON_INTERPRET"] = "1"
        if pool is not None:
            pool.join()  # the rest hands it configs
            step("compile_pool")
        self._start_precompiler(int(compile_workers), torch.cuda.is_available())
        self.expected = hardware_key
        self.spec = hardware.current_device()
        step("device")
        self.measurer = Measurer(Timing(**timing))
        self._peaks: dict[str, float] | None = None
        self.poisoned = ""  # why the device context cannot be trusted any more
        # Loading ahead: while one config is timed, a thread brings the next queued
        # config's binary into this process (see _load_ahead).
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="harness-load-ahead")
        self._loads: dict[tuple[str, str], Future] = {}
        self._seq = -1  # the task the loop is running
        self._current: tuple[str, Any, dict, str, int] | None = None  # its problem
        self._load_lock = threading.Lock()
        self._skeletons: dict[str, Any] = {}  # problem -> skeleton of its inputs
        self._stash: dict[str, list[dict]] = {}  # problem -> configs hinted before it loaded
        self._hint_lock = threading.Lock()
        self.where = {
            "node_id": ctx.get_node_id(),
            "worker_hardware": hardware_key,
            "gpu_ids": gpu_ids,
            "device_name": self.spec.name,
            "pid": os.getpid(),
        }
        self._cv = threading.Condition()
        self._tasks: dict[int, tuple[str, tuple]] = {}
        self._results: dict[int, dict] = {}
        self._next = 0  # the oldest task not run yet
        self._ran: set[int] = set()  # tasks run ahead of an older one
        self._busy = False  # the loop is running a task
        # Kept workers (keep_s > 0) outlive a run; a run leases one (``lease``).
        self.keep_s, self.version = keep_s, version
        self._lessee: str | None = None
        self._leased_at = 0.0  # perf_counter() when the lessee took it
        self._last_call = time.monotonic()  # the lessee's last sign of life
        if keep_s > 0:
            threading.Thread(target=self._reaper, name="harness-reaper", daemon=True).start()
        if first is not None:
            self._prepare_first(*first)
            step("first_problem")
        if self.pre is not None:
            # The roofline's ceilings (cached on disk per device): measured now, while the
            # GPU waits for the first compiles anyway, not in the first baseline's time.
            try:
                self.peaks()
            except Exception as exc:  # the first baseline tries again
                log.warning("measuring the device's peaks failed: %s", exc)
                self._peaks = None
            step("peaks")
        if self.pre is not None:  # a count, not seconds: configs sent to compile so far
            self.startup_s["compiles_sent"] = self.pre.submitted
        if warm is not None:
            warm.join(timeout=60)
        step("accuracy_check_build")
        self.startup_s["total_in_init"] = round(time.monotonic() - t0, 2)
        threading.Thread(target=self._loop, name="harness-worker", daemon=True).start()

    def _prepare_first(self, kernel: str, shape: dict, dtype: str, seed: int,
                       configs: list) -> None:
        """The run's first problem (``first``: kernel, shape, dtype, seed, configs known
        before the search, such as the default config): its inputs built and those
        configs sent to compile while this worker starts, so that after it reports ready
        the GPU does not wait for the first compiles. A failure only loses the head start:
        the first task builds and compiles as usual."""
        if self.pre is None:
            return
        try:
            from harness import kernel_api

            fam = kernel_api.get(kernel)
            self._problem_loaded(kernel, fam, shape, dtype, seed, None)
            self._hint(kernel, shape, dtype, seed, configs)
        except Exception as exc:
            log.warning("preparing the first problem failed: %s", exc)

    def _start_precompiler(self, processes: int, has_gpu: bool) -> None:
        if self.pre is None and processes > 0 and precompile_enabled(has_gpu):
            self.pre = Precompiler(processes)
            self.pre.start()

    # -- the driver's interface ----------------------------------------------------------
    @ray.method(concurrency_group="control")
    def info(self) -> dict[str, Any]:
        import torch
        import triton

        return {
            **self.where,
            "device_key": self.spec.key,
            "vendor": self.spec.vendor,
            "sm_count": self.spec.sm_count,
            "smem_per_block": self.spec.smem_per_block,
            "has_tma": self.spec.has_tma,
            "has_wgmma": self.spec.has_wgmma,
            "interpreted": self.spec.interpreted,
            "precompile": self.pre is not None,
            "compile_workers": self.pre.processes if self.pre is not None else 0,
            "torch": torch.__version__,
            "triton": triton.__version__,
            "cuda": torch.version.cuda or getattr(torch.version, "hip", None) or "none",
            "startup_s": dict(self.startup_s),
        }

    @ray.method(concurrency_group="control")
    def enqueue(self, seq: int, method: str, args: tuple) -> None:
        with self._cv:
            self._last_call = time.monotonic()
            self._tasks[seq] = (method, args)
            self._cv.notify_all()
        if method == "measure" and self.pre is not None:
            kernel, shape, dtype, config, seed = args[:5]
            self._hint(kernel, shape, dtype, seed, [config])
            self._load_ahead()  # it may be the one to run next

    @ray.method(concurrency_group="results")
    def result(self, seq: int) -> dict[str, Any]:
        with self._cv:
            self._cv.wait_for(lambda: seq in self._results)
            return self._results.pop(seq)

    # -- the one thread that touches the device ------------------------------------------
    def _loop(self) -> None:
        while True:
            t_idle = time.perf_counter()
            with self._cv:
                self._cv.wait_for(lambda: self._next in self._tasks)
            # The driver had nothing queued (a kept worker: since this run leased it).
            idle_s = time.perf_counter() - max(t_idle, self._leased_at)
            t_pick = time.perf_counter()
            seq = self._pick(block=True)
            ahead_s = time.perf_counter() - t_pick  # every queued config still compiling
            with self._cv:
                method, args = self._tasks.pop(seq)
                self._seq = seq
                self._busy = True
                self._ran.add(seq)
                while self._next in self._ran:
                    self._ran.discard(self._next)
                    self._next += 1
            t_task = time.perf_counter()
            try:
                if self.poisoned:
                    out = TrialResult(ok=False, reason=f"not run: {self.poisoned}",
                                      extra={"requeue": True}).to_dict()
                else:
                    out = getattr(self, f"_{method}")(*args)
            except BaseException as exc:  # a harness bug must not kill the loop
                out = TrialResult(ok=False, reason=f"harness error: {type(exc).__name__}: "
                                  f"{exc}"[:400]).to_dict()
            extra = out.setdefault("extra", {})
            extra.update(idle_s=idle_s, task_s=time.perf_counter() - t_task + ahead_s,
                         setup_s=extra.get("setup_s", 0.0) + ahead_s)
            with self._cv:
                self._results[seq] = out
                self._busy = False
                self._cv.notify_all()

    @ray.method(concurrency_group="control")
    def running(self) -> int:
        """The task the loop runs now (or ran last): the one a hang is blamed on."""
        return self._seq

    # -- kept workers: leased by one run at a time ----------------------------------------
    #: A lessee silent this long (no task sent, no heartbeat) is taken for dead.
    LEASE_S = 30.0

    @ray.method(concurrency_group="control")
    def lease(self, run: str, timing: dict[str, float], version: str,
              first: tuple | None = None) -> dict[str, Any]:
        """Let ``run`` use this kept worker: its ``info()``, or ``{"refused": why}``:
        ``busy`` (another live run has it), ``stale`` (other code, or a poisoned context,
        or still running a dead run's task): the caller kills a stale worker. ``first``:
        the run's first problem, prepared before the lease returns (``_prepare_first``);
        ``startup_s`` then describes this lease."""
        with self._cv:
            now = time.monotonic()
            if version != self.version or self.poisoned:
                return {"refused": "stale"}
            if self._lessee is not None and now - self._last_call < self.LEASE_S:
                return {"refused": "busy"}
            if self._busy or self._tasks:
                return {"refused": "stale"}
            # Sequence numbers start again with each run's own.
            self._results.clear()
            self._next, self._seq = 0, -1
            self._ran.clear()
            self._lessee, self._last_call = run, now
            self._leased_at = time.perf_counter()
            self.measurer.timing = Timing(**timing)
        if first is not None and self.pre is not None:
            t0, sent = time.monotonic(), self.pre.submitted
            self._prepare_first(*first)
            self.startup_s = {"first_problem": round(time.monotonic() - t0, 2),
                              "compiles_sent": self.pre.submitted - sent}
            self._leased_at = time.perf_counter()  # the driver's clock starts after this
        return self.info()

    @ray.method(concurrency_group="control")
    def release(self, run: str) -> None:
        """``run`` is done with this worker; it stays for ``keep_s`` for the next run."""
        with self._cv:
            if self._lessee == run:
                self._lessee, self._last_call = None, time.monotonic()

    @ray.method(concurrency_group="control")
    def heartbeat(self) -> None:
        self._last_call = time.monotonic()

    def _reaper(self) -> None:
        """A kept worker leaves once no run has used it for ``keep_s``: it holds a GPU."""
        while True:
            time.sleep(min(1.0, self.keep_s / 4))
            with self._cv:
                quiet = time.monotonic() - self._last_call
                lessee_gone = self._lessee is None or quiet > self.LEASE_S
                idle = lessee_gone and not self._busy and not self._tasks
            if idle and quiet > self.keep_s:
                if self.pre is not None:
                    self.pre.close()
                os._exit(0)

    def _compiling(self, task: tuple[str, tuple]) -> Future | None:
        """The ahead-of-time compile of a queued measurement of the problem in hand (None:
        another problem's, a baseline, or a config not compiled ahead)."""
        method, args = task
        current = self._current
        if method != "measure" or self.pre is None or current is None:
            return None
        kernel, shape, dtype, config, seed = args[:5]
        if _problem_key(kernel, shape, dtype, seed) != current[0]:
            return None
        return self.pre.pending(current[0], config)

    def _pick(self, block: bool) -> int | None:
        """The task to run next: the oldest, unless it waits for its compile child while
        a later measurement of the same problem has its binary: then the oldest of those.
        The GPU times whatever is compiled instead of waiting for one slow compile (the
        first configs of a run, a config with deep pipelines). ``block``: wait until one
        can run; else None when none can now."""
        while True:
            with self._cv:
                head = self._next
                queued = sorted(self._tasks.items())
            if not queued or queued[0][0] != head:
                return None if not block else head  # the oldest has not arrived (no block)
            waits: list[Future] = []
            for seq, task in queued:
                fut = self._compiling(task)
                if seq == head and fut is None:
                    return head
                if fut is not None:
                    if fut.done():
                        return seq
                    waits.append(fut)
            if not block:
                return None
            futures_wait(waits, timeout=0.02, return_when=FIRST_COMPLETED)

    def peaks(self) -> dict[str, float]:
        from harness.measure import device_peaks

        if self._peaks is None:
            self._peaks = device_peaks(self.spec)
        return self._peaks

    def _measure(self, kernel: str, shape: dict, dtype: str, config: dict, seed: int,
                 timing: dict | None = None) -> dict:
        """``timing``: this task's own do_bench budgets (multi-fidelity's cheap pass)."""
        from harness import kernel_api

        fam = kernel_api.get(kernel)
        t_wait = time.perf_counter()
        pre = self._problem_loaded(kernel, fam, shape, dtype, seed, config)
        problem = _problem_key(kernel, shape, dtype, seed)
        self._loaded(problem, config)
        wait_s = time.perf_counter() - t_wait
        self._current = (problem, fam, shape, dtype, seed)
        self._load_ahead()
        full = self.measurer.timing
        if timing:
            self.measurer.timing = _replace(full, **timing)
        try:
            res = self.measurer.measure(fam, shape, dtype, config, seed, peaks=self.peaks())
        finally:
            self.measurer.timing = full
        res.extra["setup_s"] = wait_s  # inputs built, waited on the ahead-of-time compile
        if res.fatal:
            self.poisoned = f"the device context was poisoned by an earlier trial ({res.reason})"
        res.extra.update(self.where)
        if pre is not None:
            res.extra["precompile"] = pre
        return res.to_dict()

    def _eager(self, kernel: str, shape: dict, dtype: str, seed: int, compiled: bool) -> dict:
        from harness import kernel_api

        fam = kernel_api.get(kernel)
        self._problem_loaded(kernel, fam, shape, dtype, seed, None)
        if self.pre is not None:  # the problem in hand: its trials may run as they compile
            self._current = (_problem_key(kernel, shape, dtype, seed), fam, shape, dtype, seed)
        res = self.measurer.measure_eager(fam, shape, dtype, seed, compiled)
        if res.fatal:
            self.poisoned = f"the device context was poisoned by an earlier task ({res.reason})"
        res.extra.update(self.where)
        res.extra["peaks"] = self.peaks()
        return res.to_dict()

    # -- loading ahead --------------------------------------------------------------------
    def _load_ahead(self) -> None:
        """While the current task is measured, load the binary of the config to run next
        (``_pick``) into this process (``load_only``: Triton's in-memory cache,
        the GPU module, the launcher), once its compile child is done, so that its first
        launch only launches (1.7 ms less a config of an 8192^3 matmul on an H200). Only
        binaries compiled ahead successfully: a compile here would compete with the
        timing for the CPU. Called when a measure task starts and when the next one
        arrives."""
        from harness import kernel_api

        current = self._current
        if self.pre is None or current is None:
            return
        problem, fam, shape, dtype, seed = current
        upcoming = self._pick(block=False)
        with self._cv:
            nxt = self._tasks.get(self._next if upcoming is None else upcoming)
        if nxt is None or nxt[0] != "measure" or not hasattr(fam, "load_only"):
            return
        kernel, n_shape, n_dtype, config, n_seed = nxt[1][:5]
        if (kernel_api.get(kernel) is not fam
                or _problem_key(kernel, n_shape, n_dtype, n_seed) != problem):
            return
        inputs = self.measurer.held(fam, shape, dtype, seed)
        compiling = self.pre.pending(problem, config)
        key = (problem, config_key(config))
        with self._load_lock:
            # Only a config whose compile is done: the one loading thread must never wait
            # on a compile (it held up every later load: 3-4 s of GPU idle at an H200
            # run's start, when the oldest task's config was still compiling).
            if inputs is None or compiling is None or not compiling.done() or key in self._loads:
                return
            while len(self._loads) > 8:  # never collected (the task was requeued elsewhere)
                self._loads.pop(next(iter(self._loads)))
            self._loads[key] = self._loader.submit(self._load_one, compiling, fam, inputs,
                                                   dict(shape), dict(config))

    def _load_one(self, compiling: Future, fam: Any, inputs: Any, shape: dict,
                  config: dict) -> None:
        try:
            if not compiling.result(timeout=PRECOMPILE_WAIT_S).get("ok") or self.poisoned:
                return
            fam.load_only(inputs, shape, config)
        except Exception:  # the config's own first launch meets the error and reports it
            pass

    def _loaded(self, problem: str, config: dict) -> None:
        """Wait for a load ahead of ``config`` that is under way (so that its first launch
        does not load it a second time)."""
        with self._load_lock:
            fut = self._loads.pop((problem, config_key(config)), None)
        if fut is not None:
            try:
                fut.result(timeout=60)
            except Exception:  # timed out: the first launch loads it itself
                pass

    # -- compiling ahead ------------------------------------------------------------------
    def _hint(self, kernel: str, shape: dict, dtype: str, seed: int, configs: list) -> None:
        """Start compiling ``configs`` now if their problem's inputs are known, else as
        soon as the task loop has built them."""
        from harness import kernel_api

        if not hasattr(kernel_api.get(kernel), "compile_only"):
            return  # the family compiles on first launch only
        problem = _problem_key(kernel, shape, dtype, seed)
        with self._hint_lock:
            skel = self._skeletons.get(problem)
            if skel is None:
                self._stash.setdefault(problem, []).extend(configs)
                return
        self.pre.submit(problem, kernel, shape, skel, configs)  # type: ignore[union-attr]

    def _problem_loaded(self, kernel: str, fam: Any, shape: dict, dtype: str, seed: int,
                        config: dict | None) -> dict[str, Any] | None:
        """Build the problem's inputs, start the compiles hinted for it, and wait for
        ``config``'s own (None where it has none)."""
        if self.pre is None or not hasattr(fam, "compile_only"):
            return None
        problem = _problem_key(kernel, shape, dtype, seed)
        try:
            inputs = self.measurer.prepare(fam, shape, dtype, seed)
        except Exception:
            return None  # the measurement reports it
        with self._hint_lock:
            if problem not in self._skeletons:
                while len(self._skeletons) >= 8:
                    self._skeletons.pop(next(iter(self._skeletons)))
                self._skeletons[problem] = skeleton(inputs)
            skel = self._skeletons[problem]
            stashed = self._stash.pop(problem, [])
        if stashed:
            self.pre.submit(problem, kernel, shape, skel, stashed)
        if config is None:
            return None
        return self.pre.wait(problem, config)


# -- the driver's side ------------------------------------------------------------------


@dataclass
class Task:
    """A unit of work: ``method`` on a worker of ``hardware`` with ``args``; ``tag`` is the
    caller's and comes back with the result."""

    hardware: str
    method: str  # "measure" or "eager"
    args: tuple
    tag: Any
    tries: int = 0
    seq: int = -1  # its number on the worker it was last sent to
    # Tasks of one group run on one GPU (the first free one the group gets; its
    # replacement worker if it dies): measurements to be compared with each other.
    group: str | None = None


@dataclass
class _Slot:
    """One GPU's worker (replaced in place when it dies)."""

    hardware: str
    ray_name: str | None
    actor: Any
    created: float
    ready_ref: Any = None  # info() of a worker still starting
    info: dict[str, Any] = field(default_factory=dict)
    ready_at: float | None = None
    queue: list[tuple[Task, Any]] = field(default_factory=list)  # in order of sending
    seq: int = 0
    head_started: float = 0.0
    kept: bool = False  # a detached worker that outlives the run


class NoHardwareError(RuntimeError):
    pass


def check_placement(expected: str, ray_name: str | None, info: Mapping[str, Any]) -> None:
    """Raise where a worker placed as ``expected`` sees another GPU (a node whose
    ``accelerator_type`` resource is wrong). Interpreted workers see no GPU: no check."""
    if info.get("interpreted") or info.get("device_key") == expected:
        return
    resource = f"accelerator_type:{ray_name or expected}"
    raise NoHardwareError(
        f"a worker placed on a node advertising {resource} (hardware {expected}) sees a "
        f"{info.get('device_name')!r}, which is {info.get('device_key')}: fix that node's "
        f"resources at `ray start` (a V710 node: --resources='{{\"accelerator_type:V710\": 1}}')")


class Fleet:
    """Long-lived workers grouped by hardware key."""

    def __init__(self, timing: Timing, trial_timeout_s: float, *,
                 queue_depth: int | str = 2, compile_workers: int | str = 0,
                 max_retries: int = MAX_RETRIES,
                 start_timeout_s: float = 600.0, keep_s: float = 0.0, version: str = "",
                 run_id: str = ""):
        """``keep_s`` > 0: workers outlive the run by that many idle seconds (Ray detached
        actors), and a run first leases kept workers of the same ``version`` (code)."""
        self.timing = {"warmup_ms": timing.warmup_ms, "rep_ms": timing.rep_ms,
                       "cpu_reps": timing.cpu_reps}
        self.trial_timeout_s = trial_timeout_s
        self.queue_depth = queue_depth  # "auto": the worker's compile processes + 2
        self.compile_workers = compile_workers
        self.max_retries = max_retries
        self.start_timeout_s = start_timeout_s
        self.slots: list[_Slot] = []
        self._names: dict[str, dict[str, int]] = {}  # hardware key -> Ray name -> GPUs
        self.nodes: dict[str, str] = {}  # node id -> hardware key (GPU nodes)
        self.unlabelled = 0  # GPUs on nodes with no accelerator_type resource
        self.replaced = 0
        self.retried = 0
        self.events: list[str] = []  # what happened to workers, for the summary
        self.busy_s: dict[str, float] = {}  # worker-seconds spent on tasks, per hardware
        self.timing_s: dict[str, float] = {}  # seconds inside the kernel timer, per hardware
        self.phases: dict[str, float] = {}  # worker seconds by what they went to (overhead)
        # First launches of trials: how many compiled in the worker (compile-ahead missed
        # or not used) rather than loading a binary; see measure.CompileWatch.
        self.first_calls = {"watched": 0, "compiled_in_worker": 0, "ahead_missed": 0}
        self._held_closed = 0.0  # GPU-held seconds of workers already gone
        self._requeue: list[Task] = []  # tasks to send again (worker lost or replaced)
        self._requested = False  # an autoscaler request is outstanding
        self._groups: dict[str, _Slot] = {}  # Task.group -> the slot its tasks run on
        self.keep_s, self.version = keep_s, version
        self.run_id = run_id or f"run-{os.getpid()}-{time.time_ns()}"
        self.reused = 0  # kept workers this run leased
        self._to_lease: dict[str, int] = {}  # key -> kept workers to lease in wait_started
        self.first: dict[str, tuple] = {}  # key -> the first problem (see ``launch``)
        self._beat = 0.0  # when the kept workers last heard from this run

    # -- connecting and discovering ---------------------------------------------------
    @staticmethod
    def connect() -> str:
        """Join RAY_ADDRESS / the job's cluster if there is one, or a Ray already running
        on this machine (``ray start --head``: its GCS address is returned), else start a
        Ray for this run only ("local")."""
        if ray.is_initialized():
            return "existing"
        if os.environ.get("RAY_ADDRESS"):
            ray.init(logging_level=logging.WARNING)
            return os.environ["RAY_ADDRESS"]
        # Workers must import a user's kernel module from the working directory. Only the
        # cwd and the caller's PYTHONPATH: the driver's whole sys.path would put the base
        # interpreter's site-packages ahead of the venv's (crashing workers).
        path = os.pathsep.join(p for p in [os.getcwd(), os.environ.get("PYTHONPATH", "")] if p)
        kw: dict[str, Any] = {"logging_level": logging.WARNING, "log_to_driver": False,
                              "runtime_env": {"env_vars": {"PYTHONPATH": path}}}
        try:
            # The address the last `ray start` on this machine left: what a bare ray.init()
            # joins (not address="auto", which joins any Ray here, another driver's own
            # included). Ray's reader is private: where it moved, decide as before.
            from ray._private.services import find_bootstrap_address

            running = find_bootstrap_address(None)
        except (ImportError, AttributeError):
            running = None
        if running and not _answers(running):
            # The file outlives a head that was killed (or crashed); joining it, Ray waits
            # on the dead GCS for minutes (measured: still waiting after 150 s).
            log.warning("the Ray this machine's last `ray start` left (%s) does not answer: "
                        "starting a Ray for this run (`ray stop` clears the stale address)",
                        running)
            running = None
        if running:
            # Joined rather than a second Ray over the same GPUs; it outlives this run, so
            # it keeps workers and is not stopped.
            ray.init(address=running, **kw)
            return running
        # Ray starts a Python worker per core up front; the harness needs one per GPU, and
        # on a 16-core box those imports slow the start and the compile children.
        os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
        # "local": a new Ray even where a stale address file is left (a bare ray.init()
        # would join the address in it).
        ray.init(address="local", include_dashboard=False, **kw)
        return "local"

    def discover(self) -> dict[str, int]:
        """GPUs in the cluster per hardware key; ``{"cpu": 1}`` where there are none.

        A node's key comes from its ``accelerator_type:<name>`` resource. GPUs with no
        such resource are counted in ``unlabelled`` and left out: their type is unknown.
        """
        counts: dict[str, int] = {}
        self._names, self.nodes, self.unlabelled = {}, {}, 0
        for node in ray.nodes():
            if not node.get("Alive"):
                continue
            res = node.get("Resources", {})
            gpus = int(res.get("GPU", 0))
            if gpus <= 0:
                continue
            names = [k.split(":", 1)[1] for k in res if k.startswith("accelerator_type:")]
            if not names:
                self.unlabelled += gpus
                continue
            # Two names (Ray's own and a declared one) may name the same GPU: a known key
            # wins, and a name that is the key itself (the declared one) before others.
            name = min(names, key=lambda n: (hardware.hardware_key(n) not in
                                             hardware.KNOWN_KEYS, hardware.hardware_key(n) != n,
                                             n))
            key = hardware.hardware_key(name)
            self.nodes[node["NodeID"]] = key
            by_name = self._names.setdefault(key, {})
            by_name[name] = by_name.get(name, 0) + gpus
            counts[key] = counts.get(key, 0) + gpus
        if not counts and not self.unlabelled:
            return {"cpu": 1}
        return counts

    def wait_for_nodes(self, keys: list[str], timeout_s: float, poll_s: float = 2.0,
                       on_poll: Callable[[dict[str, int]], None] | None = None) -> dict[str, int]:
        """Ask the autoscaler for one GPU of each of ``keys`` and wait up to ``timeout_s``
        until each is in the cluster; return the GPUs found then."""
        bundles = [{"GPU": 1, f"accelerator_type:{k}": 1} for k in keys]
        try:
            from ray.autoscaler import sdk

            sdk.request_resources(bundles=bundles)
            self._requested = True
        except Exception as exc:  # no autoscaler API: waiting may still see nodes join
            log.warning("could not ask the autoscaler for %s: %s", keys, exc)
        deadline = time.monotonic() + timeout_s
        while True:
            available = self.discover()
            if on_poll is not None:
                on_poll(available)
            left = deadline - time.monotonic()
            if all(k in available for k in keys) or left <= 0:
                return available
            time.sleep(min(poll_s, left))

    def _release_request(self) -> None:
        if not self._requested:
            return
        self._requested = False
        try:
            from ray.autoscaler import sdk

            sdk.request_resources(bundles=[])  # the nodes may scale down again
        except Exception as exc:
            log.warning("could not withdraw the autoscaler request: %s", exc)

    # -- workers --------------------------------------------------------------------
    def _pick_name(self, key: str) -> str | None:
        """The Ray accelerator name with the most GPUs left for a new worker of ``key``."""
        names = self._names.get(key)
        if not names:
            return None
        used: dict[str, int] = {}
        for s in self.slots:
            if s.hardware == key and s.ray_name:
                used[s.ray_name] = used.get(s.ray_name, 0) + 1
        return max(names, key=lambda n: (names[n] - used.get(n, 0), n))

    def _options(self, key: str, name: str | None) -> dict[str, Any]:
        if key == "cpu":
            return {"num_cpus": 1, "num_gpus": 0}
        return {"num_cpus": 1, "num_gpus": 1,
                "resources": {f"accelerator_type:{name or key}": 0.001}}

    def _new_slot(self, key: str, replacing: bool = False) -> _Slot:
        name = self._pick_name(key)
        opts = self._options(key, name)
        if self.keep_s > 0:
            opts.update(name=f"{KEPT_PREFIX}{key}-{os.urandom(4).hex()}", namespace=KEPT_NS,
                        lifetime="detached")
        actor = Worker.options(**opts).remote(key, self.timing, self.compile_workers,
                                              self.keep_s, self.version,
                                              None if replacing else self.first.get(key))
        slot = _Slot(key, name, actor, time.monotonic(), kept=self.keep_s > 0)
        slot.ready_ref = actor.info.remote() if self.keep_s <= 0 else actor.lease.remote(
            self.run_id, self.timing, self.version)
        return slot

    @staticmethod
    def _kept_names(key: str) -> list[str]:
        """Names of the cluster's kept workers of ``key`` (leased or not)."""
        from ray.util import list_named_actors

        prefix = f"{KEPT_PREFIX}{key}-"
        return [e["name"] for e in list_named_actors(all_namespaces=True)
                if e.get("namespace") == KEPT_NS and e.get("name", "").startswith(prefix)]

    def _lease_kept(self, key: str, n: int) -> list[_Slot]:
        """Up to ``n`` kept workers of ``key`` that this run may use now; stale ones
        (other code, a poisoned context) are killed, so their GPUs come free."""
        handles = []
        for name in self._kept_names(key):
            try:
                handles.append(ray.get_actor(name, namespace=KEPT_NS))
            except ValueError:  # gone since listed
                continue
        refs = {h.lease.remote(self.run_id, self.timing, self.version, self.first.get(key)): h
                for h in handles}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=10) if refs else ([], [])
        out: list[_Slot] = []
        for ref in ready:
            actor = refs[ref]
            try:
                info = ray.get(ref)
            except Exception:  # died meanwhile
                continue
            if info.get("refused") == "stale":
                ray.kill(actor, no_restart=True)
            elif "refused" not in info:
                if len(out) >= n:
                    actor.release.remote(self.run_id)
                    continue
                slot = _Slot(key, None, actor, time.monotonic(), kept=True)
                check_placement(key, None, info)
                slot.info, slot.ready_at = info, time.monotonic()
                out.append(slot)
        return out

    def start(self, wanted: Mapping[str, int]) -> dict[str, list[dict[str, Any]]]:
        """Start ``wanted[key]`` workers per hardware key; return the info of each that
        started within ``start_timeout_s``. Raises NoHardwareError where a worker sees
        another GPU than its node advertises."""
        self.launch(wanted)
        return self.wait_started()

    def launch(self, wanted: Mapping[str, int],
               first: Mapping[str, tuple] | None = None) -> None:
        """Create the workers (they start in the background; see ``wait_started``). With
        kept workers, only as many as the kept ones of each key fall short: those are
        leased in ``wait_started``, so that this run holds them from then on, not while
        the driver sets up. ``first``: per key, the first problem and the configs known
        before the search (kernel, shape, dtype, seed, configs), which a new worker
        prepares and compiles while it starts (``Worker._prepare_first``)."""
        self.first = dict(first or {})
        for key, n in wanted.items():
            if self.keep_s > 0:
                kept = len(self._kept_names(key))
                self._to_lease[key] = min(n, kept)
                n -= min(n, kept)
            for _ in range(n):
                self.slots.append(self._new_slot(key))

    def wait_started(self) -> dict[str, list[dict[str, Any]]]:
        """Wait for the launched workers: the info of each that started within
        ``start_timeout_s``, by hardware key; the others are dropped."""
        for key, n in self._to_lease.items():
            kept = self._lease_kept(key, n)
            self.reused += len(kept)
            self.slots.extend(kept)
            for _ in range(n - len(kept)):  # taken by another run meanwhile: new ones
                self.slots.append(self._new_slot(key))
        self._to_lease = {}
        deadline = time.monotonic() + self.start_timeout_s
        while any(s.ready_ref is not None for s in self.slots) and time.monotonic() < deadline:
            refs = {s.ready_ref: s for s in self.slots if s.ready_ref is not None}
            ready, _ = ray.wait(list(refs), num_returns=len(refs),
                                timeout=max(0.0, deadline - time.monotonic()))
            for ref in ready:
                self._started(refs[ref], ref, strict=True)
        for slot in [s for s in self.slots if s.ready_ref is not None]:
            self._drop(slot, f"{slot.hardware}: a worker did not start within "
                             f"{self.start_timeout_s:g} s (is its GPU taken?)")
        out: dict[str, list[dict[str, Any]]] = {}
        for slot in self.slots:
            out.setdefault(slot.hardware, []).append(slot.info)
        return out

    def _started(self, slot: _Slot, ref: Any, strict: bool = False) -> None:
        try:
            info = ray.get(ref)
        except _LOST as exc:
            self._drop(slot, f"{slot.hardware}: a worker died while starting "
                             f"({type(exc).__name__})")
            return
        slot.ready_ref = None
        if "refused" in info:  # a new kept worker another run leased first
            self._drop(slot, f"{slot.hardware}: a new worker refused this run "
                             f"({info['refused']})")
            return
        try:
            check_placement(slot.hardware, slot.ray_name, info)
        except NoHardwareError as exc:
            if strict:
                raise
            self._drop(slot, str(exc))
            return
        slot.info, slot.ready_at = info, time.monotonic()
        # The driver's view: from creating the actor (or asking a kept one) to its info;
        # what __init__ does not account for is Ray starting the process and loading it.
        steps = dict(info.get("startup_s", {}))
        steps["launch_to_ready"] = round(slot.ready_at - slot.created, 2)
        if "total_in_init" in steps and not slot.kept:
            steps["before_init"] = round(steps["launch_to_ready"] - steps["total_in_init"], 2)
        slot.info["startup_s"] = steps

    def _drop(self, slot: _Slot, why: str) -> None:
        self._close(slot)
        if slot in self.slots:
            self.slots.remove(slot)
        self.events.append(why)
        log.warning("%s", why)

    def _close(self, slot: _Slot) -> None:
        """Stop the slot's actor and book its GPU-held time."""
        if slot.ready_at is not None:
            self._held_closed += time.monotonic() - slot.ready_at
            slot.ready_at = None
        try:
            ray.kill(slot.actor, no_restart=True)
        except Exception:  # already dead
            pass

    def _replace(self, slot: _Slot, why: str) -> None:
        """Kill the slot's worker, send its queued tasks again, start a new worker."""
        self._close(slot)
        self._requeue[:0] = [t for t, _ in slot.queue]
        fresh = self._new_slot(slot.hardware, replacing=True)
        slot.ray_name, slot.actor, slot.created = fresh.ray_name, fresh.actor, fresh.created
        slot.ready_ref, slot.info, slot.queue, slot.seq = fresh.ready_ref, {}, [], 0
        slot.kept = fresh.kept
        self.replaced += 1
        self.events.append(why)
        log.warning("%s", why)

    # -- sending work ---------------------------------------------------------------------
    def _ready(self, key: str) -> list[_Slot]:
        return [s for s in self.slots if s.hardware == key and s.ready_at is not None]

    def size(self, key: str) -> int:
        """Workers of ``key`` running now."""
        return len(self._ready(key))

    def workers(self, key: str) -> int:
        """Workers of ``key`` running or starting."""
        return sum(1 for s in self.slots if s.hardware == key)

    def idle(self, key: str) -> int:
        return sum(1 for s in self._ready(key) if not s.queue)

    def capacity(self, key: str) -> int:
        """How many more tasks of ``key`` the fleet takes now."""
        room = sum(self._depth(s) - len(s.queue) for s in self._ready(key))
        return max(0, room - sum(1 for t in self._requeue if t.hardware == key))

    def _depth(self, slot: _Slot) -> int:
        if self.queue_depth == "auto":
            return int(slot.info.get("compile_workers") or 0) + 2
        return max(1, int(self.queue_depth))

    def depth(self, key: str) -> int:
        """Tasks the running workers of ``key`` hold at once (queued and running)."""
        return sum(self._depth(s) for s in self._ready(key))

    def in_flight(self) -> int:
        return sum(len(s.queue) for s in self.slots) + len(self._requeue)

    def _pick(self, task: Task) -> _Slot | None:
        """The worker for ``task``: its group's if it has one, else the least loaded
        ready worker of its hardware with room; None: none now."""
        if task.group is not None:
            slot = self._groups.get(task.group)
            if slot is not None and any(s is slot for s in self.slots):
                ok = slot.ready_at is not None and len(slot.queue) < self._depth(slot)
                return slot if ok else None
        free = [s for s in self._ready(task.hardware) if len(s.queue) < self._depth(s)]
        slot = min(free, key=lambda s: len(s.queue)) if free else None
        if slot is not None and task.group is not None:
            self._groups[task.group] = slot
        return slot

    def submit(self, task: Task) -> None:
        slot = self._pick(task)
        if slot is None:
            self._requeue.append(task)
            return
        self._send(slot, task)

    def _send(self, slot: _Slot, task: Task) -> None:
        if not slot.queue:
            slot.head_started = time.monotonic()
        seq, slot.seq = slot.seq, slot.seq + 1
        task.seq = seq
        slot.actor.enqueue.remote(seq, task.method, task.args)
        slot.queue.append((task, slot.actor.result.remote(seq)))

    # -- collecting -------------------------------------------------------------------
    def poll(self, timeout_s: float = 1.0) -> list[tuple[Task, TrialResult]]:
        """Results that finished within ``timeout_s``. Handles hangs (time-out, worker
        replaced), poisoned contexts (worker replaced), lost workers (trial retried on
        another GPU of its type) and workers that start or fail to."""
        done: list[tuple[Task, TrialResult]] = []
        refs: dict[Any, tuple[_Slot, Task | None]] = {}
        for slot in self.slots:
            if slot.ready_ref is not None:
                refs[slot.ready_ref] = (slot, None)
            for task, ref in slot.queue:
                refs[ref] = (slot, task)
        if refs:
            ready, _ = ray.wait(list(refs), num_returns=1, timeout=timeout_s)
            if ready:  # collect everything else that is ready too, without waiting
                ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
            for ref in ready:
                slot, task = refs[ref]
                if task is None:
                    if slot in self.slots and slot.ready_ref is ref:
                        self._started(slot, ref)
                elif any(r is ref for _, r in slot.queue):  # not requeued meanwhile
                    self._collect(slot, task, ref, done)
        else:
            time.sleep(min(timeout_s, 0.05))
        self._check_time(done)
        self._drain(done)
        if self.keep_s > 0 and time.monotonic() - self._beat > 5:
            self._beat = time.monotonic()
            for slot in self.slots:  # a trial may run longer than the lease's silence
                if slot.kept and slot.ready_at is not None:
                    slot.actor.heartbeat.remote()
        return done

    def _collect(self, slot: _Slot, task: Task, ref: Any, done: list) -> None:
        try:
            raw = ray.get(ref)
        except _LOST as exc:
            self._lost(slot, exc, done)
            return
        except RayTaskError as exc:  # result() itself failed: a harness bug
            raw = TrialResult(ok=False, reason=f"harness error: {exc}"[:400]).to_dict()
        now = time.monotonic()
        idx = next(i for i, (_, r) in enumerate(slot.queue) if r is ref)
        slot.queue.pop(idx)
        hw = slot.hardware
        # A worker runs one task at a time, though not always the oldest first: the
        # time between two of its results is the later one's.
        self.busy_s[hw] = self.busy_s.get(hw, 0.0) + now - slot.head_started
        slot.head_started = now
        result = TrialResult(**raw)
        self.timing_s[hw] = self.timing_s.get(hw, 0.0) + (result.timing_s or 0.0)
        self._book(task, result)
        if result.extra.get("requeue"):  # skipped by a poisoned worker: not its fault
            self._requeue.append(task)
            return
        result.extra["tries"] = task.tries + 1
        if result.fatal:
            result.reason += "; worker replaced"
            self._replace(slot, f"{hw}: worker on node {slot.info.get('node_id', '?')[:12]} "
                                f"replaced after a device fault ({result.reason[:120]})")
        done.append((task, result))

    def _lost(self, slot: _Slot, exc: BaseException, done: list) -> None:
        """The worker died under its tasks (node gone, process killed): retry the one it
        was running elsewhere, send the rest again, start a replacement."""
        tasks = [t for t, _ in slot.queue]
        slot.queue = []
        head, rest = tasks[0], tasks[1:]
        node = slot.info.get("node_id", "?")
        self._requeue[:0] = rest
        if head.tries < self.max_retries:
            head.tries += 1
            self.retried += 1
            self._requeue.insert(0, head)
        else:
            done.append((head, TrialResult(
                ok=False, reason=f"worker lost {head.tries + 1} times (last on node "
                f"{node[:12]}: {type(exc).__name__}); not retried again")))
        self._replace(slot, f"{slot.hardware}: worker on node {node[:12]} lost "
                            f"({type(exc).__name__}); its trial is retried on another "
                            f"{slot.hardware} GPU")

    def _check_time(self, done: list) -> None:
        now = time.monotonic()
        for slot in list(self.slots):
            if slot.ready_ref is not None:
                if now - slot.created > self.start_timeout_s:
                    self._drop(slot, f"{slot.hardware}: a replacement worker did not start "
                                     f"within {self.start_timeout_s:g} s")
                continue
            if slot.queue and now - slot.head_started > self.trial_timeout_s:
                task = slot.queue.pop(self._running(slot))[0]
                self.busy_s[slot.hardware] = (self.busy_s.get(slot.hardware, 0.0)
                                              + now - slot.head_started)
                done.append((task, TrialResult(
                    ok=False, reason=f"timeout: no result after {self.trial_timeout_s:g} s "
                    "(hang); worker killed and replaced", extra={"tries": task.tries + 1})))
                self._replace(slot, f"{slot.hardware}: worker on node "
                                    f"{slot.info.get('node_id', '?')[:12]} killed after a "
                                    f"{self.trial_timeout_s:g} s time-out")

    def _running(self, slot: _Slot) -> int:
        """Which of ``slot``'s queued tasks its worker is running (the oldest where the
        worker does not answer: a hang may hold the whole process)."""
        try:
            seq = ray.get(slot.actor.running.remote(), timeout=5)
        except Exception:
            return 0
        return next((i for i, (t, _) in enumerate(slot.queue) if t.seq == seq), 0)

    def _drain(self, done: list) -> None:
        """Send requeued tasks to workers of their hardware with room; fail those whose
        hardware has no worker left at all."""
        keep: list[Task] = []
        for task in self._requeue:
            slot = self._pick(task)
            if slot is not None:
                self._send(slot, task)
            elif any(s.hardware == task.hardware for s in self.slots):
                keep.append(task)  # a worker is starting
            else:
                done.append((task, TrialResult(
                    ok=False, reason=f"no {task.hardware} worker left in the cluster")))
        self._requeue = keep

    # -- accounting -------------------------------------------------------------------
    def _book(self, task: Task, result: TrialResult) -> None:
        """Add a result's worker time to ``phases``: where the GPU-held time went."""
        extra = result.extra
        baseline = task.method == "eager"
        parts = {
            "timing_s": result.timing_s or 0.0,
            # Baselines (eager, torch.compile) build and check their own way: one bucket.
            "baselines_other_s": (extra.get("task_s", 0.0) - (result.timing_s or 0.0)
                                  if baseline else 0.0),
            "idle_s": extra.get("idle_s", 0.0),
            "setup_s": extra.get("setup_s", 0.0),
            "first_call_s": 0.0 if baseline else _finite(result.compile_s),
            "check_s": extra.get("check_s", 0.0),
        }
        for k, v in parts.items():
            self.phases[k] = self.phases.get(k, 0.0) + max(0.0, float(v))
        if not baseline and "first_call_compiled" in extra:
            self.first_calls["watched"] += 1
            if extra["first_call_compiled"]:
                self.first_calls["compiled_in_worker"] += 1
                if (extra.get("precompile") or {}).get("ok"):
                    self.first_calls["ahead_missed"] += 1

    def held_s(self) -> float:
        """GPU-held seconds: each worker from ready to gone, summed."""
        now = time.monotonic()
        return self._held_closed + sum(now - s.ready_at for s in self.slots
                                       if s.ready_at is not None)

    def shutdown(self) -> None:
        for slot in self.slots:
            if slot.kept and slot.ready_at is not None and not slot.queue:
                self._held_closed += time.monotonic() - slot.ready_at
                slot.ready_at = None
                slot.actor.release.remote(self.run_id)  # stays for the next run
            else:
                self._close(slot)
        self.slots.clear()
        self._release_request()
