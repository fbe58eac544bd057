"""The driver's side of the fleet: tasks sent to the workers of their hardware key,
results collected, and where the GPU-held time went.

``Fleet.poll`` handles hangs (time-out, worker replaced), poisoned contexts (worker
replaced), lost workers (trial retried on another GPU of its type) and workers that
start or fail to. It never decides what to try: the scheduler (``harness.run.schedule``)
does.
"""

from __future__ import annotations

import logging
import math
import re
import time
from typing import Any

import ray
from ray.exceptions import RayTaskError

from harness.fleet.compile import COMPILE_TIMEOUT_RATIO, COMPILE_TIMEOUT_S
from harness.fleet.slots import _LOST, Task, Workers, _Slot
from harness.measure.timing import Timing, TrialResult

log = logging.getLogger(__name__)

#: How often a trial whose worker vanished (node lost) is retried elsewhere.
MAX_RETRIES = 2


def _finite(x: float | None) -> float:
    return x if isinstance(x, (int, float)) and x == x and abs(x) != float("inf") else 0.0


class Fleet(Workers):
    """Long-lived workers grouped by hardware key, and the work sent to them."""

    def __init__(self, timing: Timing, trial_timeout_s: float, *,
                 queue_depth: int | str = 2, compile_workers: int | str = 0,
                 max_retries: int = MAX_RETRIES,
                 start_timeout_s: float = 600.0, keep_s: float = 0.0, version: str = "",
                 run_id: str = "", compile_timeout_s: float = COMPILE_TIMEOUT_S,
                 compile_timeout_ratio: float = COMPILE_TIMEOUT_RATIO):
        """``queue_depth``: tasks each worker holds at once ("auto": its share of its
        node's compile processes + 2); the rest as ``Workers``."""
        super().__init__({"warmup_ms": timing.warmup_ms, "rep_ms": timing.rep_ms,
                          "cpu_reps": timing.cpu_reps},
                         compile_workers=compile_workers, start_timeout_s=start_timeout_s,
                         keep_s=keep_s, version=version, run_id=run_id,
                         compile_timeout_s=compile_timeout_s,
                         compile_timeout_ratio=compile_timeout_ratio)
        self.trial_timeout_s = trial_timeout_s
        self.queue_depth = queue_depth
        self.max_retries = max_retries
        self.retried = 0
        self.busy_s: dict[str, float] = {}  # worker-seconds spent on tasks, per hardware
        self.timing_s: dict[str, float] = {}  # seconds inside the kernel timer, per hardware
        self.phases: dict[str, float] = {}  # worker seconds by what they went to (overhead)
        # First launches of trials: how many compiled in the worker (compile-ahead missed
        # or not used) rather than loading a binary; see measure.CompileWatch.
        # compiled_here: first configs the worker compiled itself while its node's compile
        # service was still starting (by choice, not a miss).
        # in_worker_why: why those compiled in the worker did (the compile service's
        # outcome for them, numbers left out), so that a slow run says which path it took.
        self.first_calls: dict[str, Any] = {"watched": 0, "compiled_in_worker": 0,
                                            "ahead_missed": 0, "compiled_here": 0,
                                            "in_worker_why": {}}
        self._groups: dict[str, _Slot] = {}  # Task.group -> the slot its tasks run on
        self._beat = 0.0  # when the kept workers last heard from this run

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

    def prebuild(self, key: str, kernel: str, shape: dict, dtype: str, seed: int) -> None:
        """Have the compile services of the nodes hosting ``key`` build a problem's
        torch.compile baseline off the GPUs (``CompileService.prebuild``): a worker's own
        build then finds Inductor's graph and kernels in the node's caches, instead of
        holding its GPU for seconds. Nothing waits for it: a worker that comes first
        builds as before."""
        for node, svc in self.services.items():
            if self.nodes.get(node) == key:
                svc.prebuild.remote(kernel, dict(shape), dtype, seed)

    def hint(self, to: int, kernel: str, shape: dict, dtype: str, seed: int,
             configs: list[dict[str, Any]]) -> None:
        """Tell the worker of slot ``to`` the configs a coming study is known to measure
        (``Worker.hint``): its node's compile service compiles them while the studies
        before it are timed. Nothing waits for it."""
        slot = next((s for s in self.slots if s.id == to and s.ready_at is not None), None)
        if slot is not None and configs:
            slot.actor.hint.remote(kernel, dict(shape), dtype, seed, list(configs))

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

    def rooms(self, key: str) -> dict[int, int]:
        """Slot id -> how many more tasks that ready worker of ``key`` takes now (none
        while tasks of ``key`` wait to be sent again)."""
        if any(t.hardware == key for t in self._requeue):
            return {}
        return {s.id: self._depth(s) - len(s.queue) for s in self._ready(key)
                if len(s.queue) < self._depth(s)}

    def submit(self, task: Task, to: int | None = None) -> None:
        """Send ``task`` to the worker of slot ``to`` if it has room, else to its group's
        or the least loaded worker of its hardware, or queue it until one has room."""
        slot = next((s for s in self._ready(task.hardware)
                     if s.id == to and len(s.queue) < self._depth(s)), None)
        if slot is not None and task.group is not None:
            self._groups.setdefault(task.group, slot)
        if slot is None:
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
        self._book(task, result, slot)
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
            if slot.queue and now - max(slot.head_started, slot.hang_from) \
                    > self.trial_timeout_s:
                idx, busy_s = self._running(slot)
                if busy_s is None or busy_s < self.trial_timeout_s:
                    # No hang: the worker waits for its tasks' compiles (each bounded by
                    # the compile service's time-outs), or began the one it runs later.
                    slot.hang_from = now if busy_s is None else now - busy_s
                    if busy_s is None and not slot.waited_compiles:
                        slot.waited_compiles = True
                        self.events.append(
                            f"{slot.hardware}: worker on node "
                            f"{slot.info.get('node_id', '?')[:12]} waited over "
                            f"{self.trial_timeout_s:g} s for its tasks' compiles (the "
                            "node's compile service is behind); not a hang")
                        log.warning("%s", self.events[-1])
                    continue
                task = slot.queue.pop(idx)[0]
                self.busy_s[slot.hardware] = (self.busy_s.get(slot.hardware, 0.0)
                                              + now - slot.head_started)
                done.append((task, TrialResult(
                    ok=False, reason=f"timeout: no result after {self.trial_timeout_s:g} s "
                    "(hang); worker killed and replaced", extra={"tries": task.tries + 1})))
                self._replace(slot, f"{slot.hardware}: worker on node "
                                    f"{slot.info.get('node_id', '?')[:12]} killed after a "
                                    f"{self.trial_timeout_s:g} s time-out")

    def _running(self, slot: _Slot) -> tuple[int, float | None]:
        """Which of ``slot``'s queued tasks its worker is running and for how long (the
        oldest, for ever, where the worker does not answer, a hang may hold the whole
        process, or where it holds none of them: a result was lost); None: it runs none
        and holds some, waiting for their compiles."""
        try:
            state = ray.get(slot.actor.running.remote(), timeout=5)
        except Exception:
            return 0, math.inf
        idx = next((i for i, (t, _) in enumerate(slot.queue) if t.seq == state["seq"]), None)
        if state["busy_s"] is None:
            queued = set(state.get("queued", ()))
            if any(t.seq in queued for t, _ in slot.queue):
                return 0, None  # it holds tasks of ours, their compiles not done
            return 0, math.inf  # it holds none of those we wait for: a result was lost
        return idx or 0, state["busy_s"]

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
    def _book(self, task: Task, result: TrialResult, slot: _Slot | None = None) -> None:
        """Add a result's worker time to ``phases`` (and to its worker's own book):
        where the GPU-held time went."""
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
            if slot is not None:
                slot.book[k] = slot.book.get(k, 0.0) + max(0.0, float(v))
        if slot is not None:
            slot.book["tasks"] = slot.book.get("tasks", 0) + 1
            if extra.get("first_task") and not slot.first_task:
                slot.first_task = dict(extra["first_task"])
            if extra.get("compiled_baseline"):
                slot.compiled_baseline = dict(extra["compiled_baseline"])
        if not baseline and "first_call_compiled" in extra:
            self.first_calls["watched"] += 1
            if extra.get("compiled_here"):
                self.first_calls["compiled_here"] += 1
            elif extra["first_call_compiled"]:
                self.first_calls["compiled_in_worker"] += 1
                pre = extra.get("precompile")
                why = ("no outcome asked for" if pre is None else
                       re.sub(r"\d+(\.\d+)?", "N", str(pre.get("reason") or "ok"))[:120])
                tally = self.first_calls["in_worker_why"]
                tally[why] = tally.get(why, 0) + 1
                if (extra.get("precompile") or {}).get("ok"):
                    self.first_calls["ahead_missed"] += 1
