"""Compiling ahead: a kernel's configs compiled in child processes, before the GPU needs
them, into Triton's on-disk cache, so that a worker's first launch of a config only loads
its binary.

A family compiles ahead where its ``compiles_ahead`` is set (the launch mix-ins of
``harness.kernel.launch`` set it): its ``compile_only(inputs, shape, config)`` is the
same launch as its launcher, compiled and not run (``JITFunction.warmup``), given inputs
as meta tensors (layout and dtype, no memory). ``Precompiler`` is the process pool; one
per node runs in that node's compile service (``harness.fleet.compile_service``), shared
by its GPUs. What runs inside each of its processes is ``harness.fleet.compile_child``.

Every compile has a time-out (``fleet.compile_timeout_s``): a config that compiles for
longer (one that spills registers can take minutes) fails its trial as a compile time-out
instead of holding a GPU's worker. Once a problem's first configs have compiled, the time-out
of its others is also relative (``fleet.compile_timeout_ratio``): a config still compiling
after that many times the problem's median compile is cut there (never under
``RELATIVE_FLOOR_S``). A grid of a row-wise softmax at 12 shapes spent most of its compile
time on configs that hold thousands of values per thread, each compiling 5-50x longer than
the others and never fast. The child's own timer (``SIGALRM``) interrupts the
compile, ptxas included (``subprocess.run`` kills it when its wait is interrupted), and
the child takes the next config; the pool records the time-out itself if the child does
not answer (stuck in C code), and kills and replaces a child still stuck a grace later,
without disturbing the other children's compiles.

Fault injection, for tests (``harness.run.faults``): ``HARNESS_FAULTS`` holds comma-separated
names, read when a compile is submitted (so a test may turn one on for some compiles only):

- ``compile_hang``: the compile child sleeps forever inside the compile, deaf to its timer
  (as if stuck in C code);
- ``compile_lost``: the node's compile service records no outcome for the compile (as if
  the message were lost; see ``harness.fleet.compile_service``).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import statistics
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from harness.fleet.compile_child import PREBUILD, child_main, timeout_outcome
from harness.measure import hardware
from harness.run import faults
from harness.search.keys import config_key

log = logging.getLogger(__name__)

#: A config still compiling after this many seconds fails its trial as a compile time-out
#: (the schema's ``fleet.compile_timeout_s`` default). A softmax holding 8 rows of 4096 in
#: one warp's registers compiled for sm_90 in 35 s (fp32) and 109 s (bf16) on a CPU.
COMPILE_TIMEOUT_S = 30.0
#: A config still compiling after this many times the median compile of its problem's
#: configs fails as a compile time-out (``fleet.compile_timeout_ratio``; 0: off). On an
#: H200 host a softmax's configs compiled in 2-3 s, its spilling ones in 12 s to minutes.
COMPILE_TIMEOUT_RATIO = 5.0
#: The relative time-out is never shorter than this: a loaded machine's slow compile of a
#: good config is not cut.
RELATIVE_FLOOR_S = 10.0
#: Compiles of a problem measured before its relative time-out applies.
RELATIVE_AFTER = 5
#: Compiles shorter than this are taken for loads from Triton's cache (a real compile of
#: the smallest kernel takes longer) and left out of the median: a warm cache must not
#: make the relative time-out cut a config the cache lacks.
CACHE_HIT_S = 0.25
#: How much longer than its time-out a compile may go unanswered before its waiter stops
#: waiting and says so (the outcome's message, the service's queue or the service itself
#: was lost).
ANSWER_GRACE_S = 15.0
#: How long after its time-out a child that has not answered is killed and replaced: its
#: timer interrupts Python code and ptxas at once, but not a long call into LLVM.
KILL_GRACE_S = 5.0
#: The default bound of a wait for a compile at the default time-out (``wait``'s own
#: default follows the pool's or the service's time-out).
PRECOMPILE_WAIT_S = COMPILE_TIMEOUT_S + ANSWER_GRACE_S

Key = tuple[str, str]  # (problem, config key)


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
        ctx.set_forkserver_preload(["torch", "triton", "harness.kernel.api",
                                   "harness.fleet.compile_child"])
        return ctx
    return multiprocessing.get_context("spawn")


#: Which queued compile a free child takes first (lowest first): a config a worker has
#: queued to measure, one known to come (the first study's first asks), a torch.compile
#: baseline built ahead. In a campaign of slow compiles, configs the GPUs already wait
#: for went behind whole grids of known ones and baselines.
URGENT, AHEAD, BACKGROUND = 0, 1, 2


@dataclass(eq=False)
class _Task:
    """One config to compile, from its submission to its outcome."""

    tid: int
    key: Key
    args: tuple
    hang: bool  # the compile_hang fault
    priority: int = AHEAD
    future: Future = field(default_factory=Future)
    started: float | None = None  # when a child took it (monotonic)
    timed_out: bool = False


class _Queue:
    """The configs not yet taken by a child: in order of submission within each priority,
    the most urgent first; a config asked for again more urgently moves up."""

    def __init__(self) -> None:
        self._by: tuple[deque[_Task], ...] = (deque(), deque(), deque())

    def append(self, task: _Task) -> None:
        self._by[task.priority].append(task)

    def raise_to(self, task: _Task, priority: int) -> None:
        if priority < task.priority and task in self._by[task.priority]:
            self._by[task.priority].remove(task)
            task.priority = priority
            self._by[priority].append(task)

    def popleft(self) -> _Task:
        return next(q for q in self._by if q).popleft()

    def clear(self) -> None:
        for q in self._by:
            q.clear()

    def __iter__(self) -> Iterator[_Task]:
        return (t for q in self._by for t in q)

    def __len__(self) -> int:
        return sum(map(len, self._by))


@dataclass(eq=False)
class _Child:
    """One compile process and the pool's end of its pipe."""

    proc: Any
    conn: Any
    ready: bool = False  # warmed up: it takes a config at once
    pid: int | None = None
    nice: int | None = None
    task: _Task | None = None
    killed: bool = False


def _close_at_exit(ref: weakref.ref) -> None:
    # Before multiprocessing's own exit handler, which joins every non-daemonic child.
    pre = ref()
    if pre is not None:
        pre.close()


class Precompiler:
    """Compiles configs ahead in child processes.

    A family whose ``compiles_ahead`` is set gives ``compile_only(inputs, shape,
    config)``: the same launch as its launcher, compiled and not run
    (``JITFunction.warmup``), given inputs as meta tensors (layout and dtype, no memory)
    on a machine whose GPU it may query. The children write
    Triton's on-disk cache, so the worker's own first launch of that config only loads the
    binary. A failed or crashed compile is reported, not fatal: the worker's measurement
    compiles again and reports the error as the trial's. A compile past ``timeout_s`` is
    the exception: its outcome (``timeout_outcome``) fails the trial.

    The pool is its own: a thread hands one config at a time to each warmed-up child over
    a pipe of its own, so it knows when each compile starts (its time-out counts from
    there, not from the queue), records a time-out whether or not the child answers, and
    kills and replaces a child stuck past it without disturbing the others (a
    ``ProcessPoolExecutor`` breaks as a whole when one of its children dies).
    ``on_start(key)`` is called as a child takes a config.
    """

    #: Outstanding compiles kept; the oldest are forgotten beyond this (never waited on).
    MAX_PENDING = 1024
    #: Problems whose compile times are kept (for the relative time-out).
    MAX_PROBLEMS = 256
    #: A child's time-out is recorded this much after its own timer should have answered.
    ANSWER_SLACK_S = 0.5
    #: How long the pool waits before starting children again after one failed to start.
    RESTART_S = 5.0
    #: Failed starts in a row after which compiling ahead is given up.
    MAX_START_FAILURES = 5

    def __init__(self, processes: int, timeout_s: float = COMPILE_TIMEOUT_S,
                 on_start: Callable[[Key], None] | None = None,
                 kill_grace_s: float | None = None, ratio: float = COMPILE_TIMEOUT_RATIO,
                 floor_s: float = RELATIVE_FLOOR_S) -> None:
        self.processes = processes
        self.timeout_s = timeout_s
        self.ratio, self.floor_s = ratio, floor_s
        #: problem -> its configs' compile seconds (successful, not torch.compile builds)
        self._compile_s: dict[str, deque[float]] = {}
        self.kill_grace_s = KILL_GRACE_S if kill_grace_s is None else kill_grace_s
        self.on_start = on_start
        self.submitted = 0
        self.stats = {"timed_out": 0, "relative": 0, "killed": 0, "lost": 0}
        self._lock = threading.Lock()
        self._futures: dict[Key, _Task] = {}  # for pending() and wait()
        self._queue = _Queue()  # not yet taken by a child
        self._children: list[_Child] = []
        self._pump: threading.Thread | None = None
        self._ctx: Any = None
        self._environ: dict[str, str] = {}
        self._wake_r = self._wake_w = -1
        self._tids = 0
        self._closed = False
        self._broken = ""
        self._start_failures = 0
        self._retry_at = 0.0
        self._progress = time.monotonic()  # the last start, outcome or ready child
        #: Seconds from the pool's start to each child's first "ready" and to its first
        #: compile done (``timeline``): how long a cold start waits for the pool.
        self._t_boot = 0.0
        self._ready_s: list[float] = []
        self._first_done_s: float | None = None
        #: Where the children's start went: the seconds to start them all (with a fork
        #: server: its preload first), then each child's own steps as it reported them
        #: (when it was forked, from the first start; its imports, the device opened, the
        #: warm-up compile).
        self._spawn_at = self._spawn_s = 0.0
        self._child_steps: list[dict[str, float]] = []

    # -- the pool's life ----------------------------------------------------------------
    def start(self) -> None:
        """Start the children now (they take seconds to import torch and Triton), so
        that the first configs do not wait for them. Returns once the processes exist
        (with forkserver: once its preload is imported), not once they are warm."""
        with self._lock:
            self._boot_locked()

    def _boot_locked(self) -> bool:
        """Start the children and the thread that feeds them, once (under the lock)."""
        if self._closed or self._broken or self.processes <= 0:
            return False
        if self._pump is not None:
            return True
        try:
            self._ctx = _pool_context()
            self._environ = dict(os.environ)
            self._wake_r, self._wake_w = os.pipe()
            os.set_blocking(self._wake_r, False)
            os.set_blocking(self._wake_w, False)
            self._spawn_at = time.monotonic()
            for _ in range(self.processes):
                self._children.append(self._spawn())
            self._spawn_s = time.monotonic() - self._spawn_at
        except Exception as exc:  # tried again on the next submit
            log.warning("compile-ahead unavailable: %s", exc)
            for ch in self._children:
                ch.proc.kill()
            self._children.clear()
            for fd in (self._wake_r, self._wake_w):
                if fd >= 0:
                    os.close(fd)
            self._wake_r = self._wake_w = -1
            return False
        self._progress = self._t_boot = time.monotonic()
        self._pump = threading.Thread(target=self._run, name="harness-compile-pool",
                                      daemon=True)
        self._pump.start()
        atexit.register(_close_at_exit, weakref.ref(self))
        return True

    def _spawn(self) -> _Child:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=child_main, args=(child, self._environ),
                                 name="harness-compile", daemon=False)
        try:
            proc.start()
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        return _Child(proc, parent)

    def _poke(self) -> None:
        """Wake the feeding thread (a new config, a close)."""
        try:
            os.write(self._wake_w, b"x")
        except OSError:  # full (it is awake anyway) or closed
            pass

    # -- the interface ------------------------------------------------------------------
    def submit(self, problem: str, kernel: str, shape: Mapping[str, int], skel: Any,
               configs: Iterable[Mapping[str, Any]], priority: int = AHEAD) -> None:
        """Compile ``configs`` of ``problem``, queued at ``priority`` (``URGENT`` ...); a
        config already queued less urgently moves up."""
        hang = faults.active("compile_hang")
        with self._lock:
            if not self._boot_locked():
                return
            for config in configs:
                key = (problem, config_key(config))
                if key in self._futures:
                    self._queue.raise_to(self._futures[key], priority)
                    continue
                self._tids += 1
                task = _Task(self._tids, key, (kernel, dict(shape), problem, skel,
                                               dict(config)), hang, priority)
                self._futures[key] = task
                self._queue.append(task)
                self.submitted += 1
            while len(self._futures) > self.MAX_PENDING:
                self._futures.pop(next(iter(self._futures)))
        self._poke()

    def pending(self, problem: str, config: Mapping[str, Any]) -> Future | None:
        """The compile of ``config`` under way or done, left for ``wait`` to collect."""
        with self._lock:
            task = self._futures.get((problem, config_key(config)))
        return None if task is None else task.future

    def wait(self, problem: str, config: Mapping[str, Any],
             timeout_s: float | None = None) -> dict[str, Any] | None:
        """The ahead-of-time compile's outcome for ``config`` (None: none was started).
        ``timeout_s`` (default: the time-out and ``ANSWER_GRACE_S``) bounds the wait; a
        compile that started resolves within its time-out, so only one still queued
        behind others is left waiting, and the outcome says so."""
        with self._lock:
            task = self._futures.pop((problem, config_key(config)), None)
        if task is None:
            return None
        limit = self.timeout_s + ANSWER_GRACE_S if timeout_s is None else timeout_s
        try:
            return task.future.result(timeout=limit)
        except FutureTimeout:
            if task.started is None:
                return {"ok": False,
                        "reason": f"not compiled after {limit:g} s: queued behind other "
                                  "compiles"}
            return {"ok": False, "reason": f"still compiling after {limit:g} s"}

    def backlog(self) -> int:
        """Configs waiting for a free child."""
        with self._lock:
            return len(self._queue)

    def stalled_s(self) -> float:
        """How long configs have waited for a child with none started or finished (0:
        none waits)."""
        with self._lock:
            return time.monotonic() - self._progress if self._queue else 0.0

    def children(self) -> list[dict[str, Any]]:
        """Each compile process: its pid, niceness, and whether it is warm and busy."""
        with self._lock:
            return [{"pid": ch.pid, "nice": ch.nice, "ready": ch.ready,
                     "busy": ch.task is not None} for ch in self._children]

    def timeline(self) -> dict[str, Any]:
        """Seconds from the pool's start until its first child, half of them and all of
        them were ready (imported, warmed up), and until its first compile was done."""
        with self._lock:
            ready = sorted(self._ready_s)
            first_done = self._first_done_s
            steps = list(self._child_steps)
        n = self.processes

        def at(k: int) -> float | None:
            return round(ready[k - 1], 2) if 0 < k <= len(ready) else None

        # Each step's median and slowest child: a step that all children wait on
        # together (forking, opening the device) shows in both.
        child_start = {}
        for key in sorted({k for s in steps for k in s}):
            vals = sorted(s[key] for s in steps if key in s)
            child_start[key] = {"median": round(vals[len(vals) // 2], 2),
                                "max": round(vals[-1], 2)}
        return {"first_ready_s": at(1), "half_ready_s": at((n + 1) // 2),
                "all_ready_s": at(n), "ready": len(ready),
                "first_compile_done_s": None if first_done is None else round(first_done, 2),
                "spawn_s": round(self._spawn_s, 2), "child_start": child_start}

    def close(self) -> None:
        """End the children (a busy one is killed: Triton writes its cache files whole, by
        renaming) and fail the compiles not done."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            children, self._children = self._children, []
            tasks = list(self._queue) + [ch.task for ch in children if ch.task is not None]
            self._queue.clear()
            self._futures.clear()
            pump = self._pump
        self._poke()
        for task in tasks:
            self._resolve(task, {"ok": False, "reason": "the compile pool was closed"})
        for ch in children:
            if ch.ready and ch.task is None:
                try:
                    ch.conn.send(None)
                except OSError:
                    ch.proc.kill()
            else:
                ch.proc.kill()
        for ch in children:
            ch.proc.join(timeout=2.0)
            if ch.proc.is_alive():
                ch.proc.kill()
                ch.proc.join(timeout=1.0)
        if pump is not None and pump is not threading.current_thread():
            pump.join(timeout=2.0)
        for ch in children:
            ch.conn.close()
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1

    # -- the feeding thread -------------------------------------------------------------
    def _resolve(self, task: _Task, out: dict[str, Any]) -> None:
        """Give ``task`` its outcome, once (never under the lock: the future's callbacks
        may submit more)."""
        try:
            task.future.set_result(out)
        except InvalidStateError:  # the time-out came first
            return
        if out.get("timeout"):
            with self._lock:
                self.stats["timed_out"] += 1

    def _run(self) -> None:
        from multiprocessing.connection import wait as mp_wait

        while True:
            try:
                with self._lock:
                    if self._closed:
                        return
                    plan = self._plan_locked(time.monotonic())
                    watch: dict[Any, _Child] = {}
                    for ch in self._children:
                        watch[ch.conn] = ch
                        watch[ch.proc.sentinel] = ch
                    wake = self._wake_r
                resolved, kills, alarms, sends, missing, wait_s = plan
                for task, out in resolved:
                    self._resolve(task, out)
                for ch in alarms:  # the child's timer, early: it takes the next config
                    try:
                        os.kill(ch.pid, signal.SIGALRM)  # type: ignore[arg-type]
                    except (OSError, TypeError):
                        pass
                for ch in kills:
                    log.warning("compile child %s still busy %g s past its %g s time-out: "
                                "killed, a new one replaces it", ch.pid, self.kill_grace_s,
                                self.timeout_s)
                    ch.proc.kill()
                for ch, task in sends:
                    self._send(ch, task)
                if missing:
                    self._respawn(missing)
                    continue
                ready = mp_wait([*watch, wake], timeout=wait_s)
                dead: list[_Child] = []
                for obj in ready:
                    if obj == wake:
                        try:
                            os.read(wake, 4096)
                        except OSError:
                            pass
                        continue
                    ch = watch[obj]
                    if ch in dead:
                        continue
                    if obj is ch.conn and self._drain(ch):
                        continue
                    dead.append(ch)
                for ch in dead:
                    self._bury(ch)
            except Exception:  # never a silent stop: the pool goes on
                log.exception("compile pool")
                time.sleep(1.0)

    def _plan_locked(self, now: float) -> tuple:
        """What the feeding thread does next: time-outs to record, stuck children to kill,
        configs to hand to idle children, children to start, and how long it may sleep."""
        resolved: list[tuple[_Task, dict[str, Any]]] = []
        kills: list[_Child] = []
        alarms: list[_Child] = []  # cut before their own timer: it is rung now
        sends: list[tuple[_Child, _Task]] = []
        wait_s = 30.0
        for ch in self._children:  # first, so that the deadlines below count these too
            task = self._take_locked(ch, now)
            if task is not None:
                sends.append((ch, task))
        for ch in self._children:
            task = ch.task
            if task is None or task.started is None:
                continue
            limit, median = self._limit_locked(task.key[0])
            due = task.started + limit + self.ANSWER_SLACK_S
            if not task.timed_out:
                if now >= due:
                    task.timed_out = True
                    resolved.append((task, timeout_outcome(limit, pid=ch.pid,
                                                           median_s=median)))
                    if median is not None:
                        self.stats["relative"] += 1
                        alarms.append(ch)
                else:
                    wait_s = min(wait_s, due - now)
            if not ch.killed:
                if now >= due + self.kill_grace_s:
                    ch.killed = True
                    self.stats["killed"] += 1
                    kills.append(ch)
                else:
                    wait_s = min(wait_s, due + self.kill_grace_s - now)
        if self._start_failures >= self.MAX_START_FAILURES and not self._broken:
            self._broken = f"{self._start_failures} compile children in a row failed to start"
            log.warning("compile-ahead off: %s; configs compile in the workers", self._broken)
        if self._broken:
            out = {"ok": False, "reason": f"compile-ahead off: {self._broken}"}
            resolved.extend((task, out) for task in self._queue)
            self._queue.clear()
            return resolved, kills, alarms, sends, 0, wait_s
        missing = self.processes - len(self._children)
        if missing > 0 and now < self._retry_at:
            wait_s = min(wait_s, self._retry_at - now)
            missing = 0
        return resolved, kills, alarms, sends, max(0, missing), max(0.0, wait_s)

    def _drain(self, ch: _Child) -> bool:
        """Read what ``ch`` sent; False once its pipe is closed (it ended)."""
        try:
            while ch.conn.poll():
                self._message(ch, ch.conn.recv())
        except (EOFError, OSError):
            return False
        return True

    def _message(self, ch: _Child, msg: tuple) -> None:
        done: tuple[_Task, dict[str, Any]] | None = None
        nxt: _Task | None = None
        with self._lock:
            now = time.monotonic()
            self._progress = now
            if msg[0] == "ready":
                ch.ready, ch.pid, ch.nice = True, msg[1], msg[2]
                self._start_failures = 0
                if len(self._ready_s) < 4096:
                    self._ready_s.append(now - self._t_boot)
                    if len(msg) > 3:
                        steps = dict(msg[3])
                        # From the first child's start (the pool's timeline begins
                        # once all are started).
                        steps["forked_s"] = steps.pop("entered", now) - self._spawn_at
                        self._child_steps.append(steps)
            elif msg[0] == "done" and ch.task is not None and ch.task.tid == msg[1]:
                done, ch.task = (ch.task, msg[2]), None
                self._record_locked(*done)
                if self._first_done_s is None:
                    self._first_done_s = now - self._t_boot
            nxt = self._take_locked(ch, now)
        # The child's next config first, its outcome after: the outcome's callbacks (the
        # service, its clients) would otherwise leave the child idle meanwhile, and a
        # burst of short compiles reach the workers in more answers.
        if nxt is not None:
            self._send(ch, nxt)
        if done is not None:
            self._resolve(*done)

    def _limit_locked(self, problem: str) -> tuple[float, float | None]:
        """The time-out of a compile of ``problem`` now, and the median compile it is
        relative to (None: the absolute one applies)."""
        times = self._compile_s.get(problem)
        if self.ratio <= 0 or times is None or len(times) < RELATIVE_AFTER:
            return self.timeout_s, None
        median = statistics.median(times)
        limit = max(self.floor_s, self.ratio * median)
        return (limit, median) if limit < self.timeout_s else (self.timeout_s, None)

    def _record_locked(self, task: _Task, out: dict[str, Any]) -> None:
        """A compile's duration, for its problem's relative time-out."""
        seconds = out.get("compile_s")
        if not out.get("ok") or not isinstance(seconds, (int, float)) \
                or seconds < CACHE_HIT_S or task.args[4].get(PREBUILD):
            return
        problem = task.key[0]
        if problem not in self._compile_s:
            while len(self._compile_s) >= self.MAX_PROBLEMS:
                self._compile_s.pop(next(iter(self._compile_s)))
            self._compile_s[problem] = deque(maxlen=256)
        self._compile_s[problem].append(float(seconds))

    def _take_locked(self, ch: _Child, now: float) -> _Task | None:
        """Give the idle, warm child ``ch`` the oldest queued config (under the lock)."""
        if not self._queue or self._broken or not ch.ready or ch.task is not None \
                or ch.killed or ch not in self._children:
            return None
        task = self._queue.popleft()
        ch.task, task.started = task, now
        self._progress = now
        return task

    def _send(self, ch: _Child, task: _Task) -> None:
        try:
            ch.conn.send((task.tid, task.args, self.timeout_s, task.hang))
        except OSError:  # it died: its sentinel says so next
            pass
        if self.on_start is not None:
            self.on_start(task.key)

    def _bury(self, ch: _Child) -> None:
        """A child ended (killed, crashed): fail its compile, if not done, and let a new
        one take its place."""
        self._drain(ch)  # an outcome sent before it ended counts
        with self._lock:
            if ch in self._children:
                self._children.remove(ch)
            task, ch.task = ch.task, None
            if not ch.ready and not ch.killed:  # died while starting: not too fast again
                self._start_failures += 1
                self._retry_at = time.monotonic() + self.RESTART_S
            self._progress = time.monotonic()
        ch.proc.join(timeout=1.0)
        ch.conn.close()
        if not ch.killed:
            log.warning("compile child %s ended (exit code %s)", ch.pid, ch.proc.exitcode)
        if task is not None and not task.future.done():
            with self._lock:
                self.stats["lost"] += 1
            self._resolve(task, {"ok": False, "pid": ch.pid, "reason": "compile child lost: "
                                 f"exit code {ch.proc.exitcode}"})

    def _respawn(self, n: int) -> None:
        """Start ``n`` children in place of those that ended."""
        for _ in range(n):
            try:
                ch = self._spawn()
            except Exception as exc:
                log.warning("a compile child could not start: %s", exc)
                with self._lock:
                    self._start_failures += 1
                    self._retry_at = time.monotonic() + self.RESTART_S
                return
            with self._lock:
                if not self._closed:
                    self._children.append(ch)
                    continue
            ch.proc.kill()
            return


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
