"""The worker: one Ray actor per GPU (or one CPU worker running Triton's interpreter).

It keeps a queue of tasks so that it never waits on the driver between trials, hands
the queued configs to its node's compile service (``compile_service``), runs whichever
queued measurement has its binary first, and loads the next config's binary into its
process while it times the current one. A worker checks that the GPU it sees is the
one its node advertises (``cluster.check_placement``, on the driver's side).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace as _replace
from typing import Any

import ray

from harness.fleet.cluster import normal_priority
from harness.fleet.compile import (
    AHEAD,
    PRECOMPILE_WAIT_S,
    URGENT,
    gpu_device_nodes,
    pin_triton_cache_dir,
    precompile_enabled,
    problem_key,
)
from harness.fleet.compile_child import skeleton
from harness.fleet.compile_service import NodeCompiler
from harness.fleet.compiled_baseline import CompiledBaseline
from harness.measure.timing import Measurer, Timing, TrialResult, hardware
from harness.run import faults
from harness.search.keys import config_key

log = logging.getLogger(__name__)


def _warm_check() -> None:
    """Build the accuracy check's fused kernel while the worker starts: its compile and
    launcher would otherwise land on the first trials' checks (GPU-held time)."""
    try:
        import torch

        if torch.cuda.is_available():
            from harness.measure import accuracy

            accuracy.warm_up("cuda")
    except Exception as exc:  # the first checks build it instead
        log.warning("accuracy check warm-up failed: %s", exc)



@ray.remote(max_restarts=0, max_task_retries=0,
            concurrency_groups={"control": 1, "results": 128})
class Worker:
    """One per GPU (or one CPU worker running Triton's interpreter).

    The driver ``enqueue``s numbered tasks and collects each with ``result``; one
    thread runs them one at a time, so nothing else runs on the GPU while a kernel is
    timed: in number order, except that a measurement whose config is compiled may run
    ahead of an older one still compiling (``_pick``). Queued configs are compiled ahead
    by the node's compile service.
    """

    def __init__(self, hardware_key: str, timing: dict[str, float],
                 compilers: dict[str, tuple[Any, int]] | None = None, keep_s: float = 0.0,
                 version: str = "", first: tuple | None = None):
        """``compilers``: node id -> that node's compile service and each worker's share
        of its processes (none for this node: configs compile on their first launch)."""
        t0 = time.monotonic()
        self.nice = normal_priority()  # first: the threads started below inherit it
        # Where a worker's start-up goes, in seconds, by step (reported by ``info``).
        self.startup_s: dict[str, float] = {}
        tick = [t0]

        def step(name: str) -> None:
            now = time.monotonic()
            self.startup_s[name] = round(now - tick[0], 2)
            tick[0] = now

        # torch.compile baselines compile in this process: Inductor's own pool of compile
        # processes (one per core) would start beside the node's compile service for
        # seconds, to build kernels the service has mostly built already (``prebuild``).
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
        ctx = ray.get_runtime_context()
        gpu_ids = [str(g) for g in ctx.get_accelerator_ids().get("GPU", [])]
        pin_triton_cache_dir()  # where the node's compile service writes the binaries
        # The torch.compile baseline's own process (``compiled_baseline``), started once
        # the first trial is done (``_measure``): started with the worker, its imports
        # slowed the node's compile service's start (an H200's first trials then
        # compiled in the worker).
        self._compiled: CompiledBaseline | None = None
        if gpu_ids and gpu_device_nodes():
            if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
                self._compiled = CompiledBaseline()
            threading.Thread(target=_warm_check, name="harness-warm-check", daemon=True).start()
        import torch

        step("import_torch")

        if not torch.cuda.is_available():
            # Before any kernel module is imported, so its @triton.jit is interpreted.
            os.environ["TRITON_INTERPRET"] = "1"
        # A worker given a GPU by Ray compiles ahead; one without runs Triton's
        # interpreter and only does so when forced (the plumbing's tests).
        self.pre: NodeCompiler | None = None
        compiler = (compilers or {}).get(ctx.get_node_id())
        if compiler is not None and compiler[1] > 0 and precompile_enabled(
                torch.cuda.is_available()):
            self.pre = NodeCompiler(*compiler)
        self.expected = hardware_key
        self.spec = hardware.current_device()
        step("device")
        # Two problems held: a worker may time another study's compiled configs while its
        # own study's last ones compile, and comes back without rebuilding its inputs.
        self.measurer = Measurer(Timing(**timing), keep=2)
        self._peaks: dict[str, float] | None = None
        self._inductor = False  # torch.compile's modules imported (``_idle_work``)
        self._idle_s: dict[str, float] = {}  # how long each piece of ``_idle_work`` took
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
        # Coming studies' configs (``hint``) whose problem's inputs are not built yet:
        # problem -> (kernel, shape, dtype, seed, configs), built between tasks.
        self._later: dict[str, tuple[str, dict, str, int, list[dict]]] = {}
        self._hint_lock = threading.Lock()
        self.where = {
            "node_id": ctx.get_node_id(),
            "worker_hardware": hardware_key,
            "gpu_ids": gpu_ids,
            "device_name": self.spec.name,
            "pid": os.getpid(),
        }
        self._cv = threading.Condition()
        self._gen = 0  # bumped by every event the task loop may wait for (``_wake``)
        # Compile futures that wake the loop when done (by the object: an id is reused
        # once its future is gone, and a new future taken for a watched one never woke it)
        self._watched: weakref.WeakSet[Future] = weakref.WeakSet()
        self._tasks: dict[int, tuple[str, tuple]] = {}
        self._results: dict[int, dict] = {}
        self._next = 0  # the oldest task not run yet
        self._ran: set[int] = set()  # tasks run ahead of an older one
        self._busy = False  # the loop is running a task
        self._busy_since = 0.0  # time.monotonic() as it began it
        self._dropped = False  # a result dropped (fault injection: ``result_lost``)
        #: Where this run's first trial on this worker spent its time (``_measure``):
        #: reported once per run, in that trial's result.
        self._first_task: dict[str, float] | None = {}
        self._head_since: tuple[int, float] | None = None  # the oldest task, since when
        self._here: set[int] = set()  # tasks that compile in this worker (_compile_here)
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
        if self.pre is not None:  # a count, not seconds: configs sent to compile so far
            self.startup_s["compiles_sent"] = self.pre.submitted
        # Not waited for: the accuracy check's kernel builds beside the first trial, and
        # the device's peaks are measured while the GPU would wait for a compile anyway
        # (``_pick``); a trial timed before them has no roofline share.
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
            from harness.kernel import api as kernel_api

            fam = kernel_api.get(kernel)
            self._problem_loaded(kernel, fam, shape, dtype, seed, None)
            self._hint(kernel, shape, dtype, seed, configs, priority=AHEAD)
        except Exception as exc:
            log.warning("preparing the first problem failed: %s", exc)

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
            # Plain str: torch's TorchVersion would make whoever unpickles it import torch.
            "torch": str(torch.__version__),
            "triton": str(triton.__version__),
            "cuda": torch.version.cuda or getattr(torch.version, "hip", None) or "none",
            "startup_s": dict(self.startup_s),
            "nice": self.nice,
            "compiled_baseline": None if self._compiled is None else dict(self._compiled.stats),
        }

    @ray.method(concurrency_group="control")
    def enqueue(self, seq: int, method: str, args: tuple) -> None:
        with self._cv:
            self._last_call = time.monotonic()
            self._tasks[seq] = (method, args)
            self._gen += 1
            self._cv.notify_all()
        if method == "measure" and self.pre is not None:
            kernel, shape, dtype, config, seed = args[:5]
            self._hint(kernel, shape, dtype, seed, [config])
            self._load_ahead()  # it may be the one to run next

    @ray.method(concurrency_group="control")
    def hint(self, kernel: str, shape: dict, dtype: str, seed: int, configs: list) -> None:
        """Configs a coming study is known to measure (``Fleet.hint``): compiled ahead,
        behind the configs queued here, once this worker has built their problem's inputs'
        layout (between two tasks: milliseconds of the GPU). A study's configs then
        compile while the studies before it are timed, not one by one as they are queued."""
        if self.pre is None:
            return
        from harness.kernel import api as kernel_api

        try:
            if not kernel_api.get(kernel).compiles_ahead:
                return
        except Exception:  # its measurement reports it
            return
        problem = problem_key(kernel, shape, dtype, seed)
        with self._hint_lock:
            if problem not in self._skeletons:
                later = self._later.setdefault(problem, (kernel, dict(shape), dtype, seed, []))
                later[4].extend(configs)
                return
            skel = self._skeletons[problem]
        if skel is not None:  # (None: its inputs failed to build; the measurement says why)
            self.pre.submit(problem, kernel, shape, skel, configs, AHEAD)

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
            assert seq is not None
            ahead_s = time.perf_counter() - t_pick  # every queued config still compiling
            with self._cv:
                method, args = self._tasks.pop(seq)
                self._seq = seq
                self._busy = True
                self._busy_since = time.monotonic()
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
            if "first_task" in extra:  # of its wait, the part before it was picked
                extra["first_task"]["pick_s"] = round(ahead_s, 3)
            if method == "measure" and not self._dropped and faults.active("result_lost"):
                self._dropped = True  # the driver never hears of this task
                with self._cv:
                    self._busy = False
                continue
            with self._cv:
                self._results[seq] = out
                self._busy = False
                self._cv.notify_all()
            self._prepare_later()

    @ray.method(concurrency_group="control")
    def running(self) -> dict[str, Any]:
        """The task the loop runs now (or ran last), the one a hang is blamed on, and for
        how long it has run (``busy_s``; None: the loop runs none), and the tasks queued
        here not run yet (``queued``: while it runs none, it waits for their compiles,
        which is no hang)."""
        with self._cv:
            busy_s = time.monotonic() - self._busy_since if self._busy else None
            return {"seq": self._seq, "busy_s": busy_s, "queued": sorted(self._tasks)}

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
            self._first_task = {}
            self.measurer.timing = Timing(**timing)
        with self._hint_lock:
            self._later.clear()  # the last run's coming studies: this run sends its own
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
                if self._compiled is not None:
                    self._compiled.close()
                os._exit(0)

    def _wake(self, *_: Any) -> None:
        """Wake the task loop: a task came, or a compile it may wait for is done."""
        with self._cv:
            self._gen += 1
            self._cv.notify_all()

    def _compiling(self, task: tuple[str, tuple]) -> Future | None:
        """The ahead-of-time compile of a queued measurement (None: a baseline, or a
        config not compiled ahead, or one whose problem's inputs are not known yet). Its
        completion wakes the task loop. Never called with ``_cv`` held (its callback
        takes it)."""
        method, args = task
        if method != "measure" or self.pre is None:
            return None
        kernel, shape, dtype, config, seed = args[:5]
        fut = self.pre.pending(problem_key(kernel, shape, dtype, seed), config)
        if fut is not None and fut not in self._watched:
            self._watched.add(fut)
            fut.add_done_callback(self._wake)
        return fut

    def _unprepared(self, task: tuple[str, tuple]) -> tuple | None:
        """The problem of a queued measurement whose inputs this worker has not built
        yet, where its family compiles ahead: (kernel, family, shape, dtype, seed)."""
        method, args = task
        if method != "measure" or self.pre is None:
            return None
        from harness.kernel import api as kernel_api

        kernel, shape, dtype, _config, seed = args[:5]
        try:
            fam = kernel_api.get(kernel)
        except Exception:  # the measurement reports it
            return None
        if not fam.compiles_ahead:
            return None
        with self._hint_lock:
            known = problem_key(kernel, shape, dtype, seed) in self._skeletons
        return None if known else (kernel, fam, shape, dtype, seed)

    def _pick(self, block: bool) -> int | None:
        """The task to run next: the oldest, unless it waits for its compile while a
        later measurement, of any problem, has its binary: then the oldest of those. The
        GPU times whatever is compiled instead of waiting for one slow compile (the
        first configs of a run, a config that spills registers) or for a study's last
        configs while another study's are ready. Where only the loop thread can help
        (``block``), it builds the inputs of a queued problem it has not seen (so that
        its configs start compiling) and measures the device's peaks while it waits.
        ``block``: wait, woken by a task's arrival or a compile's end, until one can
        run; else None when none can now."""
        while True:
            with self._cv:
                gen = self._gen
                head = self._next
                queued = sorted(self._tasks.items())
            if not queued or queued[0][0] != head:
                if not block:
                    return None  # the oldest has not arrived
                with self._cv:
                    self._cv.wait_for(lambda: self._next in self._tasks)
                continue
            ready = None
            for seq, task in queued:
                fut = self._compiling(task)
                if fut is None:
                    if seq == head and (not block or self._unprepared(task) is None):
                        return head
                    continue
                if fut.done():
                    ready = seq
                    break
            if ready is not None:
                return ready
            if not block:
                return None
            if self._prepare_queued(queued):
                continue
            if self._compile_here(queued[0]):
                return head
            if self._idle_work():
                continue
            # Woken by a task or a compile; while the service starts, also when the GPU
            # has waited long enough to compile the oldest config itself.
            left = (None if self._head_since is None or self.pre is None or self.pre.warm()
                    else max(0.0, self._head_since[1] + self.SELF_COMPILE_AFTER_S
                             - time.monotonic()))
            with self._cv:
                self._cv.wait_for(lambda g=gen: self._gen != g, timeout=left)

    #: How long the GPU waits on a node's compile service that has compiled nothing for
    #: this worker yet before it compiles its oldest config itself. Short: the first
    #: config is mostly in the Triton cache already (the head start compiled it), and
    #: every first task of the 4x H200 scaling job waited the whole 1.0 s it was.
    SELF_COMPILE_AFTER_S = 0.25

    def _compile_here(self, head: tuple[int, tuple[str, tuple]]) -> bool:
        """Whether the oldest task should compile in this worker: while the node's
        compile service is still starting (its processes import torch and Triton and
        open the GPU: seconds after this worker is ready) and the GPU has waited
        ``SELF_COMPILE_AFTER_S`` for it, the run's first config compiles here instead
        (one compile, seconds sooner). Never once the service compiles: a config it has
        not started may be one that compiles for minutes."""
        seq, (method, _args) = head
        if method != "measure" or self.pre is None or self.spec.interpreted:
            return False  # (the interpreter's compile-ahead is the plumbing's tests)
        now = time.monotonic()
        if self._head_since is None or self._head_since[0] != seq:
            self._head_since = (seq, now)
            return False
        if now - self._head_since[1] < self.SELF_COMPILE_AFTER_S or self.pre.warm():
            return False
        self._here.add(seq)
        return True

    def _prepare_queued(self, queued: list[tuple[int, tuple[str, tuple]]]) -> bool:
        """Build the inputs' layout of the oldest queued problem this worker has not
        seen and send its queued configs to compile; whether one was. The problem's
        inputs are made and dropped (the measurement builds them again, with its
        reference): a few milliseconds of the GPU, where its configs would otherwise
        start compiling only once the GPU reached them."""
        for _seq, task in queued:
            todo = self._unprepared(task)
            if todo is None:
                continue
            kernel, fam, shape, dtype, seed = todo
            self._layout(kernel, fam, shape, dtype, seed)
            return True
        return self._prepare_later()

    def _prepare_later(self) -> bool:
        """Build the inputs' layout of the oldest problem hinted for later (``hint``)
        and send its configs to compile; whether there was one. Loop thread only."""
        with self._hint_lock:
            if not self._later:
                return False
            problem = next(iter(self._later))
            kernel, shape, dtype, seed, _configs = self._later[problem]
        from harness.kernel import api as kernel_api

        try:
            fam = kernel_api.get(kernel)
        except Exception:  # its measurement reports it
            with self._hint_lock:
                self._later.pop(problem, None)
            return True
        self._layout(kernel, fam, shape, dtype, seed)
        return True

    def _layout(self, kernel: str, fam: Any, shape: dict, dtype: str, seed: int) -> None:
        """Build a problem's inputs on the device (held ones are reused), keep their
        layout and send the configs hinted for it to compile; the inputs are dropped
        (the measurement builds them again, with its reference)."""
        try:
            held = self.measurer.held(fam, shape, dtype, seed)
            inputs = held if held is not None else fam.make_inputs(
                shape, dtype, seed, self.measurer.device)
            skel = skeleton(inputs)
        except Exception:  # the measurement meets the error and reports it
            skel = None
        inputs = None
        self._keep_layout(problem_key(kernel, shape, dtype, seed), kernel, shape, skel)

    def _keep_layout(self, problem: str, kernel: str, shape: dict, skel: Any) -> Any:
        """Keep ``skel`` as the problem's layout (None: tried, the measurement builds
        them) unless one is kept already, and send what was hinted for it to compile:
        the configs queued here (urgent) and those of a coming study (ahead). Returns
        the layout kept."""
        with self._hint_lock:
            if self._skeletons.get(problem) is None:
                while len(self._skeletons) >= 64:
                    self._skeletons.pop(next(iter(self._skeletons)))
                self._skeletons[problem] = skel
            skel = self._skeletons[problem]
            stashed = self._stash.pop(problem, []) if skel is not None else []
            later = self._later.pop(problem, None)
        if skel is not None and stashed:
            self.pre.submit(problem, kernel, shape, skel, stashed,  # type: ignore[union-attr]
                            URGENT)
        if skel is not None and later and later[4]:
            self.pre.submit(problem, kernel, shape, skel, later[4],  # type: ignore[union-attr]
                            AHEAD)
        return skel

    def _idle_work(self) -> bool:
        """Work for a GPU that would wait for compiles, each once: the device's peaks
        (the roofline's ceilings, cached on disk per device), then torch.compile's own
        import (seconds, which a study's first torch.compile baseline would otherwise
        pay while it holds the GPU); whether it did any."""
        if self.pre is None:
            return False
        t0 = time.perf_counter()
        if self._peaks is None:
            try:
                self.peaks()
            except Exception as exc:  # a baseline tries again
                log.warning("measuring the device's peaks failed: %s", exc)
                self._peaks = {}
            self._idle_s["peaks_s"] = round(time.perf_counter() - t0, 3)
            return True
        # Not before the first trial: the import holds this thread for seconds (9 s on a
        # 64-core host busy starting its compile service) while the first compiles land.
        # Not at all where the baseline's own process times it.
        if (not self._inductor and not self.spec.interpreted and self._first_task is None
                and self._compiled is None):
            self._inductor = True
            try:
                import torch._dynamo  # noqa: F401
                import torch._inductor.compile_fx  # noqa: F401
            except Exception as exc:  # the baseline imports it, or reports why not
                log.warning("importing torch.compile failed: %s", exc)
            self._idle_s["inductor_import_s"] = round(time.perf_counter() - t0, 3)
            return True
        return False

    def peaks(self) -> dict[str, float]:
        from harness.measure.timing import device_peaks

        if self._peaks is None:
            self._peaks = device_peaks(self.spec)
        return self._peaks

    def _measure(self, kernel: str, shape: dict, dtype: str, config: dict, seed: int,
                 timing: dict | None = None) -> dict:
        """``timing``: this task's own do_bench budgets (multi-fidelity's cheap pass)."""
        from harness.kernel import api as kernel_api

        fam = kernel_api.get(kernel)
        t_wait = time.perf_counter()
        # A config this worker compiles itself (``_compile_here``) does not wait for the
        # compile service.
        here = self._seq in self._here
        self._here.discard(self._seq)
        pre = self._problem_loaded(kernel, fam, shape, dtype, seed, None if here else config)
        problem = problem_key(kernel, shape, dtype, seed)
        self._loaded(problem, config)
        wait_s = time.perf_counter() - t_wait
        first = self._first_task
        if first is not None:
            first["setup_s"] = round(wait_s, 3)  # inputs, reference, the compile's outcome
        self._current = (problem, fam, shape, dtype, seed)
        self._load_ahead()
        if pre is not None and pre.get("timeout"):
            # Compiling it took longer than the fleet allows (a config that spills
            # registers compiles for minutes): the trial fails, the worker does not
            # compile it itself.
            res = TrialResult(ok=False, reason=str(pre.get("reason") or "compile time-out"),
                              extra={"precompile": pre, "setup_s": wait_s, **self.where})
            return res.to_dict()
        full = self.measurer.timing
        if timing:
            self.measurer.timing = _replace(full, **timing)
        # Where the worker compiles ahead, its peaks come when the GPU would idle
        # (``_idle_work``): a trial before them has no roofline share, not a wait.
        peaks = self._peaks if self.pre is not None else self.peaks()
        t_measure = time.perf_counter()
        try:
            res = self.measurer.measure(fam, shape, dtype, config, seed, peaks=peaks)
        finally:
            self.measurer.timing = full
        res.extra["setup_s"] = wait_s  # inputs built, waited on the ahead-of-time compile
        if first is not None:
            self._start_compiled_baseline()
            # The first trial's own breakdown: what a cold start waits for in the worker.
            self._first_task = None
            res.extra["first_task"] = {
                **first, "measure_s": round(time.perf_counter() - t_measure, 3),
                "first_call_s": round(res.compile_s, 3)
                if res.compile_s is not None and math.isfinite(res.compile_s) else None,
                "compile_s": (pre or {}).get("compile_s"), "ahead": pre is not None,
                "here": here, **self._idle_s}
        if res.fatal:
            self.poisoned = f"the device context was poisoned by an earlier trial ({res.reason})"
        res.extra.update(self.where)
        if pre is not None:
            res.extra["precompile"] = pre
        if here:
            res.extra["compiled_here"] = True  # by choice: the service was still starting
        return res.to_dict()

    def _start_compiled_baseline(self) -> None:
        if self._compiled is None:
            return
        try:
            self._compiled.start()
        except Exception as exc:  # the worker times the baseline itself
            log.warning("the torch.compile baseline's process did not start: %s", exc)
            self._compiled = None

    def _eager(self, kernel: str, shape: dict, dtype: str, seed: int, compiled: bool,
               timing: dict | None = None) -> dict:
        """``timing``: this task's own do_bench budgets (the final phase's rounds)."""
        from harness.kernel import api as kernel_api

        fam = kernel_api.get(kernel)
        self._problem_loaded(kernel, fam, shape, dtype, seed, None)
        if self.pre is not None:  # the problem in hand: its trials may run as they compile
            self._current = (problem_key(kernel, shape, dtype, seed), fam, shape, dtype, seed)
        full = self.measurer.timing
        budgets = _replace(full, **timing) if timing else full
        if compiled and self._compiled is not None:
            # Timed in its own process while this thread waits: the GPU runs nothing else.
            out = self._compiled.measure(kernel, shape, dtype, seed, budgets)
            if out is not None:
                out.setdefault("extra", {}).update(self.where, peaks=self.peaks())
                return out
        self.measurer.timing = budgets
        try:
            res = self.measurer.measure_eager(fam, shape, dtype, seed, compiled)
        finally:
            self.measurer.timing = full
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
        from harness.kernel import api as kernel_api

        current = self._current
        if self.pre is None or current is None:
            return
        problem, fam, shape, dtype, seed = current
        upcoming = self._pick(block=False)
        with self._cv:
            nxt = self._tasks.get(self._next if upcoming is None else upcoming)
        if nxt is None or nxt[0] != "measure" or not fam.compiles_ahead:
            return
        kernel, n_shape, n_dtype, config, n_seed = nxt[1][:5]
        if (kernel_api.get(kernel) is not fam
                or problem_key(kernel, n_shape, n_dtype, n_seed) != problem):
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
    def _hint(self, kernel: str, shape: dict, dtype: str, seed: int, configs: list,
              priority: int = URGENT) -> None:
        """Start compiling ``configs`` now if their problem's inputs are known, else as
        soon as the task loop has built them. ``priority``: ``URGENT`` for configs queued
        on this worker (the stashed ones are), ``AHEAD`` for those known to come."""
        from harness.kernel import api as kernel_api

        if not kernel_api.get(kernel).compiles_ahead:
            return  # the family compiles on first launch only
        problem = problem_key(kernel, shape, dtype, seed)
        with self._hint_lock:
            skel = self._skeletons.get(problem)
            if skel is None:
                self._stash.setdefault(problem, []).extend(configs)
                return
        self.pre.submit(problem, kernel, shape, skel, configs,  # type: ignore[union-attr]
                        priority)

    def _problem_loaded(self, kernel: str, fam: Any, shape: dict, dtype: str, seed: int,
                        config: dict | None) -> dict[str, Any] | None:
        """Build the problem's inputs, start the compiles hinted for it, and wait for
        ``config``'s own (None where it has none)."""
        if self.pre is None or not fam.compiles_ahead:
            return None
        problem = problem_key(kernel, shape, dtype, seed)
        t0 = time.perf_counter()
        try:
            inputs = self.measurer.prepare(fam, shape, dtype, seed)
        except Exception:
            return None  # the measurement reports it
        prepared = time.perf_counter()
        with self._hint_lock:
            skel = self._skeletons.get(problem)
        if skel is None:
            self._keep_layout(problem, kernel, shape, skeleton(inputs))
        if config is None:
            return None
        out = self.pre.wait(problem, config)
        if self._first_task is not None and "prepare_s" not in self._first_task:
            self._first_task.update(prepare_s=round(prepared - t0, 3),
                                    compile_wait_s=round(time.perf_counter() - prepared, 3))
        return out

