"""One compile service per node, shared by the node's GPUs.

Every worker on a node sends the configs it will measure to its node's service; the
service compiles each distinct binary once (``Precompiler``'s process pool, into the
node's Triton cache) and answers each worker about the compiles it waits for. Two GPUs
that measure the same config of the same problem, or a re-measurement of a config the
search measured, cost one compile. Binaries that are identical across problems (same
kernel, constexprs and specialization at another shape) are compiled once too: the same
config of a kernel and dtype at another shape waits for the first one's compile, then
finds its binary in Triton's on-disk cache (where it differs, it compiles then).

The service holds the node's compile capacity: its processes (``plan_processes``) fill
the cores its GPUs' workers and the driver leave free, so that one GPU on a node gets
the whole node's compilers, not its share of them.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError, WorkerCrashedError

from harness.fleet.compile import (
    PRECOMPILE_WAIT_S,
    Precompiler,
    gpu_device_nodes,
    pin_triton_cache_dir,
    precompile_enabled,
)
from harness.search.keys import config_key

log = logging.getLogger(__name__)

#: The most compile processes one node's service runs (each holds torch and Triton).
MAX_PROCESSES = 64
#: Outcomes the service remembers (small dicts): later askers of a compiled config get
#: its outcome at once.
MAX_OUTCOMES = 100_000
#: Kept services (for kept workers) are detached actors named this + the node id, in
#: a namespace of their own (not the kept workers').
SERVICE_PREFIX = "kharness-compile-"
SERVICE_NS = "kharness-compile"


def plan_processes(setting: int | str, node_cpus: float, node_gpus: int) -> int:
    """A node's compile processes: ``setting`` per GPU (an int), or with ``auto`` the
    node's cores less one per GPU worker and one for the driver (at least one, at most
    ``MAX_PROCESSES``)."""
    gpus = max(1, int(node_gpus))
    if setting == "auto":
        return max(1, min(MAX_PROCESSES, int(node_cpus) - gpus - 1))
    return max(0, min(MAX_PROCESSES, int(setting) * gpus))


Key = tuple[str, str]  # (problem, config key)


def _group(problem: str, config: Mapping[str, Any]) -> tuple:
    """Compiles that may build one binary: one kernel, dtype and config, any shape."""
    try:
        kernel, _shape, dtype, _seed = json.loads(problem)
    except (ValueError, TypeError):
        return (problem, config_key(config))
    return (kernel, dtype, config_key(config))


class _Service:
    """The service's logic, a plain class so that it can be tested without Ray."""

    def __init__(self, processes: int, idle_exit_s: float = 0.0) -> None:
        pin_triton_cache_dir()  # the node's workers read the binaries from the same place
        if not precompile_enabled(gpu_device_nodes()):
            processes = 0  # no compiler here (the interpreter): configs compile on launch
        self.pre = Precompiler(processes)
        if processes:
            self.pre.start()
        self._cv = threading.Condition()
        self._last = time.monotonic()
        if idle_exit_s > 0:
            threading.Thread(target=self._reaper, args=(idle_exit_s,), daemon=True,
                             name="harness-compile-reaper").start()
        self._outcomes: dict[Key, dict[str, Any]] = {}
        self._watched: set[Key] = set()
        self.stats = {"requested": 0, "deduplicated": 0, "parked": 0, "compiled": 0,
                      "failed": 0}
        # The same config of a kernel and dtype at other shapes is often the same binary
        # (Triton specializes on alignment, not on sizes): only the first of such a group
        # compiles at once; the others wait for it, then mostly load it from the cache.
        self._first: dict[tuple, Key] = {}  # group -> its first compile
        self._warm: set[tuple] = set()  # groups whose first compile is done
        self._parked: dict[tuple, list[tuple]] = {}  # group -> compiles waiting for it

    def _reaper(self, idle_s: float) -> None:
        """A kept service leaves once no worker has used it for ``idle_s``."""
        while True:
            time.sleep(min(1.0, idle_s / 4))
            if time.monotonic() - self._last > idle_s:
                self.pre.close()
                os._exit(0)

    def submit(self, problem: str, kernel: str, shape: Mapping[str, int], skel: Any,
               configs: Sequence[Mapping[str, Any]]) -> None:
        now: list[tuple[Key, Mapping[str, Any]]] = []
        with self._cv:
            self._last = time.monotonic()
            for config in configs:
                key = (problem, config_key(config))
                self.stats["requested"] += 1
                if key in self._watched or key in self._outcomes:
                    self.stats["deduplicated"] += 1
                    continue
                self._watched.add(key)
                group = _group(problem, config)
                if group in self._warm or group not in self._first:
                    self._first.setdefault(group, key)
                    now.append((key, config))
                else:  # its twin at another shape is compiling: after it, from the cache
                    self._parked.setdefault(group, []).append((key, kernel, dict(shape), skel,
                                                               config))
                    self.stats["parked"] += 1
        for key, config in now:
            self._start(key, kernel, shape, skel, config)

    def _start(self, key: Key, kernel: str, shape: Mapping[str, int], skel: Any,
               config: Mapping[str, Any]) -> None:
        if not self.pre.processes:
            self._done(key, config, {"ok": False, "reason": "no compile processes here"})
            return
        problem = key[0]
        self.pre.submit(problem, kernel, shape, skel, [config])
        fut = self.pre.pending(problem, config)
        if fut is None:  # the pool is broken: the worker compiles on first launch
            self._done(key, config, {"ok": False, "reason": "compile service unavailable"})
        else:
            fut.add_done_callback(lambda f, k=key, c=dict(config): self._finished(k, c, f))

    def _finished(self, key: Key, config: Mapping[str, Any], fut: Future) -> None:
        try:
            out = fut.result()
        except Exception as exc:  # a child died (compiler crash)
            out = {"ok": False, "reason": f"compile child lost: {type(exc).__name__}"}
        self._done(key, config, out)

    def _done(self, key: Key, config: Mapping[str, Any], out: dict[str, Any]) -> None:
        """Record a compile's outcome; the first of its group lets the others start."""
        self._record(key, out)
        group = _group(key[0], config)
        with self._cv:
            if self._first.get(group) != key:
                return
            self._warm.add(group)
            parked = self._parked.pop(group, [])
        for p_key, kernel, shape, skel, p_config in parked:
            self._start(p_key, kernel, shape, skel, p_config)

    def _record(self, key: Key, out: dict[str, Any]) -> None:
        with self._cv:
            self._watched.discard(key)
            self._outcomes[key] = out
            self.stats["compiled" if out.get("ok") else "failed"] += 1
            while len(self._outcomes) > MAX_OUTCOMES:
                self._outcomes.pop(next(iter(self._outcomes)))
            self._cv.notify_all()

    def wait_any(self, keys: Sequence[Key], timeout_s: float) -> dict[Key, dict[str, Any]]:
        """The outcomes of those of ``keys`` that are done, once at least one is (or
        ``timeout_s`` passed)."""
        wanted = [tuple(k) for k in keys]
        with self._cv:
            self._last = time.monotonic()
            self._cv.wait_for(lambda: any(k in self._outcomes for k in wanted), timeout_s)
            return {k: self._outcomes[k] for k in wanted if k in self._outcomes}

    def info(self) -> dict[str, Any]:
        return {"processes": self.pre.processes, "pid": os.getpid(), **self.stats}

    def close(self) -> None:
        self.pre.close()


@ray.remote(num_cpus=0, max_restarts=0, max_concurrency=256)
class CompileService(_Service):
    """The node's compile service as a Ray actor (threaded: workers wait on it at once)."""

    def __init__(self, processes: int, idle_exit_s: float = 0.0) -> None:
        # Its compile processes say which node they compile for (logs, tests).
        os.environ["HARNESS_NODE_ID"] = ray.get_runtime_context().get_node_id()
        super().__init__(processes, idle_exit_s)


def start_services(nodes: Mapping[str, tuple[float, int]], setting: int | str,
                   idle_exit_s: float = 0.0) -> dict[str, Any]:
    """A compile service on each of ``nodes`` (node id -> its CPUs and GPUs): node id ->
    actor handle. ``idle_exit_s`` > 0 (kept workers): named services that outlive the
    run, shared with later runs, and leave once unused that long."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    out: dict[str, Any] = {}
    for node, (cpus, gpus) in nodes.items():
        processes = plan_processes(setting, cpus, gpus)
        if processes <= 0:
            continue
        opts: dict[str, Any] = {
            "scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False),
            # The children compile for the node's GPUs: they must see them, which Ray
            # hides from an actor that holds none.
            "runtime_env": {"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}},
        }
        if idle_exit_s > 0:
            opts.update(name=f"{SERVICE_PREFIX}{node}", namespace=SERVICE_NS,
                        lifetime="detached", get_if_exists=True)
        out[node] = CompileService.options(**opts).remote(processes, idle_exit_s)
    return out


_LOST = (RayActorError, RayTaskError, WorkerCrashedError)


class NodeCompiler:
    """A worker's side of its node's compile service, with ``Precompiler``'s interface:
    ``submit`` sends configs, ``pending`` gives a local Future per config that a thread
    completes as the service reports outcomes, so that the worker waits only for the
    binaries it needs next."""

    #: How long one question to the service waits for an outcome.
    POLL_S = 0.1

    def __init__(self, service: Any, processes: int) -> None:
        self.service = service
        self.processes = processes  # this worker's share of the node's compilers
        self.submitted = 0
        self._lock = threading.Lock()
        self._futures: dict[Key, Future] = {}
        self._wake = threading.Event()
        self._lost = ""
        self._defaults: dict[str, dict[str, Any]] = {}  # problem -> its kernel's defaults
        threading.Thread(target=self._poll, name="harness-compile-client", daemon=True).start()

    def start(self) -> None:
        """The service started its processes itself."""

    def _full(self, problem: str, config: Mapping[str, Any]) -> dict[str, Any]:
        """``config`` with the kernel's defaults filled in: the default config sent whole
        and the same config of a grid (its tunables only) are one binary, one key."""
        defaults = self._defaults.get(problem)
        if defaults is None:
            from harness import kernel_api

            try:
                defaults = dict(kernel_api.get(json.loads(problem)[0]).default_config)
            except Exception:  # keyed as given
                defaults = {}
            self._defaults[problem] = defaults
        return {**defaults, **config}

    def submit(self, problem: str, kernel: str, shape: Mapping[str, int], skel: Any,
               configs: Sequence[Mapping[str, Any]]) -> None:
        fresh = []
        with self._lock:
            if self._lost:
                return
            for config in configs:
                full = self._full(problem, config)
                key = (problem, config_key(full))
                if key not in self._futures:
                    self._futures[key] = Future()
                    fresh.append(full)
        if fresh:
            self.submitted += len(fresh)
            self.service.submit.remote(problem, kernel, dict(shape), skel, fresh)
            self._wake.set()

    def pending(self, problem: str, config: Mapping[str, Any]) -> Future | None:
        key = (problem, config_key(self._full(problem, config)))
        with self._lock:
            return self._futures.get(key)

    def wait(self, problem: str, config: Mapping[str, Any],
             timeout_s: float = PRECOMPILE_WAIT_S) -> dict[str, Any] | None:
        key = (problem, config_key(self._full(problem, config)))
        with self._lock:
            fut = self._futures.get(key)
        if fut is None:
            return None
        # The future stays listed until it is done: the polling thread asks the service
        # only for listed keys, so a future taken out early would never be completed.
        try:
            return fut.result(timeout=timeout_s)
        except TimeoutError:
            return {"ok": False, "reason": f"still compiling after {timeout_s:g} s"}
        finally:
            with self._lock:
                if self._futures.get(key) is fut:
                    del self._futures[key]

    def _poll(self) -> None:
        while True:
            with self._lock:
                keys = [k for k, f in self._futures.items() if not f.done()]
            if not keys:
                self._wake.wait(1.0)
                self._wake.clear()
                continue
            try:
                got = ray.get(self.service.wait_any.remote(keys, self.POLL_S))
            except _LOST as exc:
                self._give_up(f"compile service lost: {type(exc).__name__}")
                return
            with self._lock:
                for key, out in got.items():
                    fut = self._futures.get(tuple(key))
                    if fut is not None and not fut.done():
                        fut.set_result(out)
            if not got:
                time.sleep(0.01)

    def _give_up(self, why: str) -> None:
        log.warning("%s: configs compile on their first launch", why)
        with self._lock:
            self._lost = why
            for fut in self._futures.values():
                if not fut.done():
                    fut.set_result({"ok": False, "reason": why})

    def close(self) -> None:
        """The service belongs to the node, not to this worker."""
