"""The workers' life cycle on the driver's side: one slot per GPU, its worker started,
leased (kept workers of an earlier run), replaced in place after a fault, dropped, and
the node compile services the workers share.

Kept workers (``keep_s`` > 0) are detached actors named ``KEPT_PREFIX`` + key + a random
suffix in the ``KEPT_NS`` namespace, so that a later run on the cluster finds them.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayActorError, WorkerCrashedError

from harness.fleet.cluster import Cluster, NoHardwareError, check_placement, node_resources
from harness.fleet.compile import COMPILE_TIMEOUT_RATIO, COMPILE_TIMEOUT_S
from harness.fleet.compile_service import plan_processes, start_services
from harness.fleet.worker import Worker
from harness.run import faults
from harness.tracking import spares

log = logging.getLogger(__name__)

KEPT_NS = spares.NAMESPACE  # kept workers and spare loggers: one namespace
KEPT_PREFIX = "kharness-worker-"
#: How long a run's end waits for its kept workers to confirm their release.
RELEASE_S = 5.0

_LOST = (RayActorError, WorkerCrashedError)


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
    #: Where the hang clock starts: ``head_started``, or later where the worker said its
    #: loop ran no task (it waited for compiles) or since when it runs the one it does.
    hang_from: float = 0.0
    waited_compiles: bool = False  # told once: its tasks waited long for compiles
    kept: bool = False  # a detached worker that outlives the run
    id: int = field(default_factory=lambda: next(_SLOT_IDS))  # kept by its replacements
    held_s: float = 0.0  # GPU-held seconds of its workers already gone
    book: dict[str, float] = field(default_factory=dict)  # its seconds by phase (Fleet._book)
    #: Where its first trial's time went in the worker (inputs, the compile's outcome,
    #: the first launch): what a cold start waits for once the worker is up.
    first_task: dict[str, Any] = field(default_factory=dict)
    #: Its torch.compile baseline's process as last heard (``compiled_baseline``): when
    #: it was ready, its imports, how long baselines waited for it.
    compiled_baseline: dict[str, Any] = field(default_factory=dict)


_SLOT_IDS = itertools.count()


class Workers(Cluster):
    """Long-lived workers grouped by hardware key, one slot per GPU."""

    def __init__(self, timing: dict[str, float], *, compile_workers: int | str = 0,
                 start_timeout_s: float = 600.0, keep_s: float = 0.0, version: str = "",
                 run_id: str = "", compile_timeout_s: float = COMPILE_TIMEOUT_S,
                 compile_timeout_ratio: float = COMPILE_TIMEOUT_RATIO):
        """``keep_s`` > 0: workers outlive the run by that many idle seconds (Ray detached
        actors), and a run first leases kept workers of the same ``version`` (code).
        ``compile_workers``: compile processes per GPU, or "auto" (the node's spare
        cores), run by one compile service per node."""
        super().__init__()
        self.timing = timing
        self.compile_workers = compile_workers
        self.compile_timeout_s = compile_timeout_s
        self.compile_timeout_ratio = compile_timeout_ratio
        self.start_timeout_s = start_timeout_s
        self.slots: list[_Slot] = []
        self.replaced = 0
        self.events: list[str] = []  # what happened to workers, for the summary
        self._held_closed = 0.0  # GPU-held seconds of workers already gone
        self._requeue: list[Task] = []  # tasks to send again (worker lost or replaced)
        self.keep_s, self.version = keep_s, version
        self.run_id = run_id or f"run-{os.getpid()}-{time.time_ns()}"
        self.reused = 0  # kept workers this run leased
        self._to_lease: dict[str, int] = {}  # key -> kept workers to lease in wait_started
        self.first: dict[str, tuple] = {}  # key -> the first problem (see ``launch``)
        self.services: dict[str, Any] = {}  # node id -> its compile service
        self._shares: dict[str, int] = {}  # node id -> compile processes per GPU worker
        self.last_compile_stats: dict[str, dict[str, Any]] = {}  # as the services closed
        self._warned_nice = False
        self._gone: list[_Slot] = []  # slots closed (their books kept for the report)

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
            return {"num_cpus": 1, "num_gpus": 0, **faults.actor_env()}
        return {"num_cpus": 1, "num_gpus": 1,
                "resources": {f"accelerator_type:{name or key}": 0.001}, **faults.actor_env()}

    def _new_slot(self, key: str, replacing: bool = False) -> _Slot:
        name = self._pick_name(key)
        opts = self._options(key, name)
        if self.keep_s > 0:
            opts.update(name=f"{KEPT_PREFIX}{key}-{os.urandom(4).hex()}", namespace=KEPT_NS,
                        lifetime="detached")
        self._start_services([key])  # a node that joined since: its service first
        compilers = {node: (svc, self._shares[node]) for node, svc in self.services.items()}
        actor = Worker.options(**opts).remote(key, self.timing, compilers,
                                              self.keep_s, self.version,
                                              None if replacing else self.first.get(key))
        slot = _Slot(key, name, actor, time.monotonic(), kept=self.keep_s > 0)
        slot.ready_ref = actor.info.remote() if self.keep_s <= 0 else actor.lease.remote(
            self.run_id, self.timing, self.version)
        return slot

    def _start_services(self, keys: Iterable[str]) -> None:
        """A compile service on each node that hosts workers of ``keys`` and has none yet
        (for ``cpu``: the driver's node)."""
        if self.compile_workers in (0, "0"):
            return
        keys = set(keys)
        resources = node_resources()
        here = ray.get_runtime_context().get_node_id()
        hosts = {n for n, k in self.nodes.items() if k in keys}
        if "cpu" in keys:
            hosts.add(here)
        new = {n: resources[n] for n in hosts - set(self.services) if n in resources}
        if not new:
            return
        self.services.update(start_services(new, self.compile_workers,
                                            idle_exit_s=self.keep_s,
                                            compile_timeout_s=self.compile_timeout_s,
                                            compile_timeout_ratio=self.compile_timeout_ratio))
        for node, (cpus, gpus) in new.items():
            total = plan_processes(self.compile_workers, cpus, gpus)
            self._shares[node] = max(1, total // max(1, gpus)) if total else 0

    def compile_stats(self) -> dict[str, dict[str, Any]]:
        """Each node's compile service: its processes and how many configs it compiled,
        deduplicated (asked for again, by another GPU or a re-measurement) and failed."""
        refs = {node: svc.info.remote() for node, svc in self.services.items()}
        out = {}
        for node, ref in refs.items():
            try:
                out[node] = ray.get(ref, timeout=10)
            except Exception:  # gone: its figures with it
                continue
        return out

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
        # A lease prepares the run's first problem, as a new worker's start does: it is
        # given as long, and one that does not answer is released and said.
        ready, late = (ray.wait(list(refs), num_returns=len(refs), timeout=self.start_timeout_s)
                       if refs else ([], []))
        for ref in late:
            refs[ref].release.remote(self.run_id)
            self.events.append(f"{key}: a kept worker did not answer its lease within "
                               f"{self.start_timeout_s:g} s; a new one was started")
            log.warning("%s", self.events[-1])
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
                self._check_priority(slot)
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
        self._start_services(list(wanted))
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
        self._check_priority(slot)
        # The driver's view: from creating the actor (or asking a kept one) to its info;
        # what __init__ does not account for is Ray starting the process and loading it.
        steps = dict(info.get("startup_s", {}))
        steps["launch_to_ready"] = round(slot.ready_at - slot.created, 2)
        if "total_in_init" in steps and not slot.kept:
            steps["before_init"] = round(steps["launch_to_ready"] - steps["total_in_init"], 2)
        slot.info["startup_s"] = steps

    def _check_priority(self, slot: _Slot) -> None:
        """Say once where a worker runs below the default CPU priority."""
        nice = slot.info.get("nice", 0)
        if nice > 0 and not self._warned_nice:
            self._warned_nice = True
            self.events.append(
                f"{slot.hardware}: workers run at nice {nice} (Ray's worker_niceness) and "
                "could not lower it: other processes on the node can delay timings. Start "
                "Ray with RAY_worker_niceness=0 in its environment, or run as a user allowed "
                "to (CAP_SYS_NICE).")
            log.warning("%s", self.events[-1])

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
            slot.held_s += time.monotonic() - slot.ready_at
            slot.ready_at = None
        self._gone.append(slot)
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

    def worker_report(self) -> list[dict[str, Any]]:
        """Each GPU's worker (replacements included): where, how long it was held and
        where that time went (timing, idle waiting for the driver, setup waiting for
        compiles, ...)."""
        now = time.monotonic()
        out = []
        for slot in {id(s): s for s in [*self._gone, *self.slots]}.values():
            held = slot.held_s + (now - slot.ready_at if slot.ready_at is not None else 0.0)
            book = {k: round(v, 3) for k, v in slot.book.items()}
            timing = slot.book.get("timing_s", 0.0)
            out.append({"hardware": slot.hardware, "node_id": slot.info.get("node_id", ""),
                        "gpu_ids": slot.info.get("gpu_ids", []), "held_s": round(held, 3),
                        "timing_fraction": round(timing / held, 4) if held else None,
                        **book, **({"first_task": slot.first_task} if slot.first_task else {}),
                        **({"compiled_baseline": slot.compiled_baseline}
                           if slot.compiled_baseline else {})})
        return out

    def held_s(self) -> float:
        """GPU-held seconds: each worker from ready to gone, summed."""
        now = time.monotonic()
        return self._held_closed + sum(now - s.ready_at for s in self.slots
                                       if s.ready_at is not None)

    def shutdown(self) -> None:
        released = []
        for slot in self.slots:
            if slot.kept and slot.ready_at is not None and not slot.queue:
                self._held_closed += time.monotonic() - slot.ready_at
                slot.held_s += time.monotonic() - slot.ready_at
                slot.ready_at = None
                self._gone.append(slot)
                released.append(slot.actor.release.remote(self.run_id))  # for the next run
            else:
                self._close(slot)
        self.slots.clear()
        if released:
            # Delivered before this process ends (the command exits at once): a release
            # lost on the way left the worker "busy" to the next run for LEASE_S.
            done, _ = ray.wait(released, num_returns=len(released), timeout=RELEASE_S)
            if len(done) < len(released):
                self.events.append(f"{len(released) - len(done)} kept worker(s) did not "
                                   f"confirm their release within {RELEASE_S:g} s: free "
                                   "again after 30 s without a run")
                log.warning("%s", self.events[-1])
        self.last_compile_stats = self.compile_stats()
        if self.keep_s <= 0:  # a kept service leaves by itself once unused
            for svc in self.services.values():
                try:
                    ray.kill(svc, no_restart=True)
                except Exception:  # already gone
                    pass
            self.services.clear()
        self._release_request()
