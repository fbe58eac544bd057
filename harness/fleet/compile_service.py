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

Nobody waits silently. A compile runs at most ``compile_timeout_s`` (then its outcome is
a time-out that fails the trial: ``harness.fleet.compile``). A worker's client
(``NodeCompiler``) asks the service with a long poll that returns as soon as one of its
configs has an outcome, and says which of them are compiling since when; a config
unanswered ``ANSWER_GRACE_S`` past its time-out after it started, or a service that does
not answer the poll itself, gives the config a "did not answer" outcome (the worker
compiles it itself) and a warning.

Fault injection, for tests (``HARNESS_FAULTS``, ``harness.run.faults``; read when a compile is
submitted; the driver's setting reaches the services it starts; see
``harness.fleet.compile`` for ``compile_hang``): ``compile_lost`` makes the service record
no outcome for a compile, as if the message were lost; its starting is still reported.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError, WorkerCrashedError

from harness.fleet.compile import (
    AHEAD,
    ANSWER_GRACE_S,
    BACKGROUND,
    COMPILE_TIMEOUT_RATIO,
    COMPILE_TIMEOUT_S,
    Key,
    Precompiler,
    gpu_device_nodes,
    pin_triton_cache_dir,
    precompile_enabled,
    problem_key,
)
from harness.fleet.compile_child import PREBUILD
from harness.run import faults
from harness.search.keys import config_key

log = logging.getLogger(__name__)

#: The most compile processes one node's service runs (each holds torch and Triton).
MAX_PROCESSES = 64
#: Outcomes the service remembers (small dicts): later askers of a compiled config get
#: its outcome at once.
MAX_OUTCOMES = 100_000
#: Kept services (for kept workers) are detached actors named this + the node id + their
#: code's digest, in a namespace of their own (not the kept workers').
SERVICE_PREFIX = "kharness-compile-"
SERVICE_NS = "kharness-compile"
#: A client the service has not heard from for this long is forgotten (a worker gone).
CLIENT_FORGET_S = 600.0
#: An answer about outcomes waits this long for one more (a burst of short compiles goes
#: out whole), at most ``BATCH_MAX_S`` in all.
#: A twin compile (the same config at another shape) waits for its group's first compile;
#: where that one takes longer than this and a child is free, the twins compile beside it
#: instead of after it (a config whose binary differs at each shape). Where the first
#: times out, its twins still waiting fail as it did, without holding a child for the
#: time-out each (a config that spills registers at one shape does at the next).
PARK_MAX_S = 3.0
BATCH_S = 0.005
BATCH_MAX_S = 0.05


def plan_processes(setting: int | str, node_cpus: float, node_gpus: int) -> int:
    """A node's compile processes: ``setting`` per GPU (an int), or with ``auto`` the
    node's cores less one per GPU worker and one for the driver (at least one, at most
    ``MAX_PROCESSES``)."""
    gpus = max(1, int(node_gpus))
    if setting == "auto":
        return max(1, min(MAX_PROCESSES, int(node_cpus) - gpus - 1))
    return max(0, min(MAX_PROCESSES, int(setting) * gpus))


def _group(problem: str, config: Mapping[str, Any]) -> tuple:
    """Compiles that may build one binary: one kernel, dtype and config, any shape."""
    try:
        kernel, _shape, dtype, _seed = json.loads(problem)
    except (ValueError, TypeError):
        return (problem, config_key(config))
    return (kernel, dtype, config_key(config))


def _code_digest() -> str:
    """This service's code, so that a kept service of other code is not reused (its
    methods may differ)."""
    from harness.fleet import compile as compile_module

    h = hashlib.sha256()
    for path in (compile_module.__file__, __file__):
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:12]


@dataclass
class _Client:
    """What the service owes one worker's client."""

    keys: set[Key] = field(default_factory=set)  # asked for, outcome not acknowledged
    ready: dict[Key, dict[str, Any]] = field(default_factory=dict)  # outcomes to deliver
    greeted: bool = False  # its first poll is answered at once (node, time-out)
    seen: float = field(default_factory=time.monotonic)


class _Service:
    """The service's logic, a plain class so that it can be tested without Ray."""

    def __init__(self, processes: int, idle_exit_s: float = 0.0,
                 compile_timeout_s: float = COMPILE_TIMEOUT_S, node: str = "",
                 compile_timeout_ratio: float = COMPILE_TIMEOUT_RATIO) -> None:
        pin_triton_cache_dir()  # the node's workers read the binaries from the same place
        if not precompile_enabled(gpu_device_nodes()):
            processes = 0  # no compiler here (the interpreter): configs compile on launch
        self.node = node or os.environ.get("HARNESS_NODE_ID") or socket.gethostname()
        self.timeout_s = compile_timeout_s
        self._cv = threading.Condition()
        self._last = time.monotonic()
        self._outcomes: dict[Key, dict[str, Any]] = {}
        self._watched: set[Key] = set()
        self._started: dict[Key, float] = {}  # compiling in a child since (monotonic)
        self._clients: dict[str, _Client] = {}
        self._interest: dict[Key, set[str]] = {}  # key compiling -> clients waiting for it
        self.stats = {"requested": 0, "deduplicated": 0, "parked": 0, "compiled": 0,
                      "failed": 0, "timed_out": 0}
        # The same config of a kernel and dtype at other shapes is often the same binary
        # (Triton specializes on alignment, not on sizes): only the first of such a group
        # compiles at once; the others wait for it, then mostly load it from the cache.
        self._first: dict[tuple, Key] = {}  # group -> its first compile
        self._warm: set[tuple] = set()  # groups whose first compile is done
        self._parked: dict[tuple, list[tuple]] = {}  # group -> compiles waiting for it
        self.pre = Precompiler(processes, compile_timeout_s, on_start=self._began,
                               ratio=compile_timeout_ratio)
        if processes:
            self.pre.start()
        if idle_exit_s > 0:
            threading.Thread(target=self._reaper, args=(idle_exit_s,), daemon=True,
                             name="harness-compile-reaper").start()

    def _reaper(self, idle_s: float) -> None:
        """A kept service leaves once no worker has used it for ``idle_s``."""
        while True:
            time.sleep(min(1.0, idle_s / 4))
            if time.monotonic() - self._last > idle_s:
                self.pre.close()
                os._exit(0)

    def set_timeout(self, compile_timeout_s: float,
                    compile_timeout_ratio: float = COMPILE_TIMEOUT_RATIO) -> None:
        """A kept service serving a run of another ``fleet.compile_timeout_s`` (or
        ``compile_timeout_ratio``)."""
        with self._cv:
            self.timeout_s = self.pre.timeout_s = compile_timeout_s
            self.pre.ratio = compile_timeout_ratio

    def _client(self, client_id: str) -> _Client:
        """The client's record (under the lock); clients long silent are forgotten."""
        now = time.monotonic()
        client = self._clients.get(client_id)
        if client is None:
            for cid, c in list(self._clients.items()):
                if now - c.seen > CLIENT_FORGET_S:
                    del self._clients[cid]
            client = self._clients[client_id] = _Client()
        client.seen = now
        return client

    def submit(self, problem: str, kernel: str, shape: Mapping[str, int], skel: Any,
               configs: Sequence[Mapping[str, Any]], client_id: str | None = None,
               priority: int = AHEAD) -> None:
        """Compile ``configs`` of ``problem`` (each once per node) at ``priority``
        (``harness.fleet.compile.URGENT``: a worker has queued them); ``client_id``: the
        worker's client that ``outcomes`` answers about them."""
        now: list[tuple[Key, Mapping[str, Any]]] = []
        again: list[tuple[Key, Mapping[str, Any]]] = []
        with self._cv:
            self._last = time.monotonic()
            cid = client_id or ""
            client = self._client(cid) if cid else None
            for config in configs:
                key = (problem, config_key(config))
                self.stats["requested"] += 1
                if client is not None:
                    client.keys.add(key)
                    if key in self._outcomes:
                        client.ready[key] = self._outcomes[key]
                    else:
                        self._interest.setdefault(key, set()).add(cid)
                if key in self._watched or key in self._outcomes:
                    self.stats["deduplicated"] += 1
                    if key in self._watched:
                        again.append((key, config))  # queued: maybe more urgent now
                    continue
                self._watched.add(key)
                group = _group(problem, config)
                if group in self._warm or group not in self._first:
                    self._first.setdefault(group, key)
                    now.append((key, config))
                else:  # its twin at another shape is compiling: after it, from the cache
                    self._parked.setdefault(group, []).append((key, kernel, dict(shape), skel,
                                                               config, priority))
                    self.stats["parked"] += 1
            if client is not None and client.ready:
                self._cv.notify_all()
        for key, config in now:
            self._start(key, kernel, shape, skel, config, priority)
        # Queued in the pool (not parked behind a twin): moved up where more urgent now.
        again = [c for _, c in again if self.pre.pending(problem, c) is not None]
        if again and priority < AHEAD and self.pre.processes:
            self.pre.submit(problem, kernel, shape, skel, again, priority)

    def _start(self, key: Key, kernel: str, shape: Mapping[str, int], skel: Any,
               config: Mapping[str, Any], priority: int = AHEAD) -> None:
        if not self.pre.processes:
            self._done(key, config, {"ok": False, "reason": "no compile processes here"})
            return
        problem = key[0]
        lost = faults.active("compile_lost")
        self.pre.submit(problem, kernel, shape, skel, [config], priority)
        fut = self.pre.pending(problem, config)
        if fut is None:  # the pool is broken: the worker compiles on first launch
            self._done(key, config, {"ok": False, "reason": "compile service unavailable"})
        else:
            fut.add_done_callback(
                lambda f, k=key, c=dict(config), lost=lost: self._finished(k, c, f, lost))

    def _began(self, key: Key) -> None:
        """A child took ``key``: its time-out counts from now (clients are told with their
        next answer). Where it is its group's first, its twins start ``PARK_MAX_S``
        later if it is not done by then."""
        with self._cv:
            if key in self._watched:
                self._started[key] = time.monotonic()
            first = key in self._first.values() and any(
                self._first.get(g) == key for g in self._parked)
        if first:
            timer = threading.Timer(PARK_MAX_S, self._unpark, args=(key,))
            timer.daemon = True
            timer.start()

    def _unpark(self, key: Key) -> None:
        """Start the twins still waiting for ``key``, their group's first compile, where a
        child is free; else look again later (the queue's own work goes first)."""
        if self.pre.backlog():
            with self._cv:
                waiting = key in self._watched
            if waiting:
                timer = threading.Timer(PARK_MAX_S, self._unpark, args=(key,))
                timer.daemon = True
                timer.start()
            return
        with self._cv:
            groups = [g for g, k in self._first.items() if k == key and g in self._parked]
            parked = [p for g in groups for p in self._parked.pop(g)]
        for p_key, kernel, shape, skel, p_config, priority in parked:
            self._start(p_key, kernel, shape, skel, p_config, priority)

    def prebuild(self, kernel: str, shape: Mapping[str, int], dtype: str, seed: int) -> None:
        """Build a problem's torch.compile baseline in a compile child (``PREBUILD``):
        the node's workers then find Inductor's graph and kernels in the node's caches.
        Once per problem; its outcome is only counted."""
        problem = problem_key(kernel, shape, dtype, seed)
        config = {PREBUILD: "torch.compile", "dtype": dtype, "seed": seed}
        key = (problem, config_key(config))
        with self._cv:
            self._last = time.monotonic()
            if key in self._watched or key in self._outcomes or not self.pre.processes:
                return
            self._watched.add(key)
            self.stats["prebuilds"] = self.stats.get("prebuilds", 0) + 1
        self._start(key, kernel, shape, None, config, BACKGROUND)

    def _finished(self, key: Key, config: Mapping[str, Any], fut: Future,
                  lost: bool = False) -> None:
        try:
            out = fut.result()
        except Exception as exc:  # not expected: the pool gives every compile an outcome
            out = {"ok": False, "reason": f"compile child lost: {type(exc).__name__}"}
        self._done(key, config, out, record=not lost)

    def _done(self, key: Key, config: Mapping[str, Any], out: dict[str, Any],
              record: bool = True) -> None:
        """Record a compile's outcome; the first of its group lets the others start."""
        if record:
            self._record(key, out)
        else:
            log.warning("fault compile_lost: no outcome recorded for %s", key[1])
        group = _group(key[0], config)
        with self._cv:
            if self._first.get(group) != key:
                return
            self._warm.add(group)
            parked = self._parked.pop(group, [])
        for p_key, kernel, shape, skel, p_config, priority in parked:
            if out.get("timeout"):
                self._done(p_key, p_config, {**out, "reason": out["reason"] + (
                    "; the same config at another shape, not compiled again")})
            else:
                self._start(p_key, kernel, shape, skel, p_config, priority)

    def _record(self, key: Key, out: dict[str, Any]) -> None:
        with self._cv:
            self._watched.discard(key)
            self._started.pop(key, None)
            self._outcomes[key] = out
            self.stats["compiled" if out.get("ok") else "failed"] += 1
            if out.get("timeout"):
                self.stats["timed_out"] += 1
            while len(self._outcomes) > MAX_OUTCOMES:
                self._outcomes.pop(next(iter(self._outcomes)))
            for cid in self._interest.pop(key, ()):
                client = self._clients.get(cid)
                if client is not None and key in client.keys:
                    client.ready[key] = out
            self._cv.notify_all()

    def outcomes(self, client_id: str, timeout_s: float,
                 received: Sequence[Key] = ()) -> dict[str, Any]:
        """A long poll: once ``client_id`` has news (an outcome, with those that follow
        within ``BATCH_S``; or this is its first poll), or after ``timeout_s``:
        ``outcomes`` (key -> outcome, again until acknowledged in ``received`` by the next
        call), ``started`` (key -> seconds it has compiled, for its keys still compiling),
        ``timeout_s``, ``node``, and ``stalled_s`` (how long queued configs have waited
        with no compile starting or ending)."""
        with self._cv:
            self._last = time.monotonic()
            client = self._client(client_id)
            for key in received:
                key = tuple(key)
                client.ready.pop(key, None)
                client.keys.discard(key)
            # A compile's start wakes nobody: the client learns it with the next answer
            # (it asks at least every half time-out), where waking it for each start
            # doubled the round trips that a burst of short compiles costs.
            self._cv.wait_for(lambda: not client.greeted or bool(client.ready), timeout_s)
            # Compiles that end within milliseconds of each other (cache hits, a node's
            # first configs) go out in one answer, so that the worker sees them together
            # (which task is compiled, which to load ahead), not one per round trip.
            end = time.monotonic() + BATCH_MAX_S
            while timeout_s > 0 and client.greeted and client.ready and time.monotonic() < end:
                n = len(client.ready)
                if not self._cv.wait_for(lambda n=n: len(client.ready) > n,
                                         min(BATCH_S, max(0.0, end - time.monotonic()))):
                    break
            now = time.monotonic()
            started = {k: now - self._started[k] for k in client.keys
                       if k in self._started and k not in client.ready}
            client.seen, client.greeted = now, True
            reply = {"outcomes": dict(client.ready), "started": started, "node": self.node,
                     "timeout_s": self.timeout_s}
        reply["stalled_s"] = self.pre.stalled_s()
        return reply

    def wait_any(self, keys: Sequence[Key], timeout_s: float) -> dict[Key, dict[str, Any]]:
        """The outcomes of those of ``keys`` that are done, once at least one is (or
        ``timeout_s`` passed)."""
        wanted = [tuple(k) for k in keys]
        with self._cv:
            self._last = time.monotonic()
            self._cv.wait_for(lambda: any(k in self._outcomes for k in wanted), timeout_s)
            return {k: self._outcomes[k] for k in wanted if k in self._outcomes}

    def info(self) -> dict[str, Any]:
        return {"processes": self.pre.processes, "pid": os.getpid(), "node": self.node,
                "compile_timeout_s": self.timeout_s,
                "compile_timeout_ratio": self.pre.ratio, **self.stats,
                # of the time-outs: cut at the ratio times the problem's median compile
                "timed_out_relative": self.pre.stats["relative"],
                "children_killed": self.pre.stats["killed"],
                "children_lost": self.pre.stats["lost"], **self.pre.timeline()}

    def close(self) -> None:
        self.pre.close()


@ray.remote(num_cpus=0, max_restarts=0, max_concurrency=256)
class CompileService(_Service):
    """The node's compile service as a Ray actor (threaded: workers wait on it at once)."""

    def __init__(self, processes: int, idle_exit_s: float = 0.0,
                 compile_timeout_s: float = COMPILE_TIMEOUT_S,
                 compile_timeout_ratio: float = COMPILE_TIMEOUT_RATIO) -> None:
        # Its compile processes say which node they compile for (logs, tests).
        node = ray.get_runtime_context().get_node_id()
        os.environ["HARNESS_NODE_ID"] = node
        super().__init__(processes, idle_exit_s, compile_timeout_s, node,
                         compile_timeout_ratio)


def start_services(nodes: Mapping[str, tuple[float, int]], setting: int | str,
                   idle_exit_s: float = 0.0,
                   compile_timeout_s: float = COMPILE_TIMEOUT_S,
                   compile_timeout_ratio: float = COMPILE_TIMEOUT_RATIO) -> dict[str, Any]:
    """A compile service on each of ``nodes`` (node id -> its CPUs and GPUs): node id ->
    actor handle. ``idle_exit_s`` > 0 (kept workers): named services that outlive the
    run, shared with later runs of the same code, and leave once unused that long.
    ``compile_timeout_s``, ``compile_timeout_ratio``: the experiment's ``fleet`` settings."""
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
            "runtime_env": {"env_vars": {
                "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
                **faults.actor_env().get("runtime_env", {}).get("env_vars", {})}},
        }
        if idle_exit_s > 0:
            opts.update(name=f"{SERVICE_PREFIX}{node}-{_code_digest()}", namespace=SERVICE_NS,
                        lifetime="detached", get_if_exists=True)
        out[node] = CompileService.options(**opts).remote(processes, idle_exit_s,
                                                          compile_timeout_s,
                                                          compile_timeout_ratio)
        if idle_exit_s > 0:  # a kept one keeps the time-out it was started with otherwise
            out[node].set_timeout.remote(compile_timeout_s, compile_timeout_ratio)
    return out


_LOST = (RayActorError, RayTaskError, WorkerCrashedError)


def _settle(fut: Future, out: dict[str, Any]) -> None:
    """Complete ``fut`` unless another thread did first."""
    try:
        fut.set_result(out)
    except InvalidStateError:
        pass


def _get(ref: Any, timeout_s: float) -> Any:
    """``ray.get`` with a time-out; a concurrent Future stands for a reply too (a service
    called in this process)."""
    if isinstance(ref, Future):
        try:
            return ref.result(timeout=timeout_s)
        except FutureTimeout:
            raise GetTimeoutError(f"no reply within {timeout_s:g} s") from None
    return ray.get(ref, timeout=timeout_s)


class NodeCompiler:
    """A worker's side of its node's compile service, with ``Precompiler``'s interface:
    ``submit`` sends configs, ``pending`` gives a local Future per config that a thread
    completes as the service reports outcomes, so that the worker waits only for the
    binaries it needs next.

    Every Future is completed. The thread asks the service with a long poll (``outcomes``)
    that returns as soon as one of this client's configs has an outcome, and lasts at
    most half the time-out and grace, so that the starts it reports are timely. A config
    still unanswered ``grace_s`` past the service's time-out after its compile started, or
    every config while the service does not answer a poll within its length plus
    ``grace_s`` (``START_S`` until it first answered), gets ``{"ok": False, "reason": "the
    compile service on node <id> did not answer ..."}`` and a warning: the worker compiles
    it itself. A compile time-out comes from the service as ``{"ok": False, "timeout":
    True, "reason": ...}``: the trial fails with it. ``service`` is a ``CompileService``
    handle (or an object whose methods' ``remote`` returns a concurrent Future: a service
    in this process).
    """

    #: The longest one poll of the service waits for news (it returns at once on news).
    LONG_POLL_S = 10.0
    #: How long a service that has never answered may take to: its start imports torch
    #: and Triton for its compile processes, on a node whose workers start beside it.
    START_S = 120.0

    def __init__(self, service: Any, processes: int, compile_timeout_s: float | None = None,
                 grace_s: float | None = None, node: str | None = None) -> None:
        self.service = service
        self.processes = processes  # this worker's share of the node's compilers
        self.submitted = 0
        # The service's own time-out replaces this once it answers.
        self.timeout_s = COMPILE_TIMEOUT_S if compile_timeout_s is None else compile_timeout_s
        self.grace_s = ANSWER_GRACE_S if grace_s is None else grace_s
        self.node = node or "?"  # the service says which
        self._id = uuid.uuid4().hex
        self._lock = threading.Lock()
        self._futures: dict[Key, Future] = {}
        self._sent: dict[Key, float] = {}  # key -> when it was submitted (monotonic)
        self._began: dict[Key, float] = {}  # key -> when its compile started (monotonic)
        self._wake = threading.Event()
        self._lost = ""
        self._silent = 0.0  # since when the service has not answered (0: it answers)
        self._heard = False  # whether the service has answered a poll yet
        self._warm = False  # whether it has started or finished a compile of ours (``warm``)
        self._closed = False
        self._defaults: dict[str, dict[str, Any]] = {}  # problem -> its kernel's defaults
        threading.Thread(target=self._poll, name="harness-compile-client", daemon=True).start()

    def start(self) -> None:
        """The service started its processes itself."""

    def _full(self, problem: str, config: Mapping[str, Any]) -> dict[str, Any]:
        """``config`` with the kernel's defaults filled in: the default config sent whole
        and the same config of a grid (its tunables only) are one binary, one key."""
        defaults = self._defaults.get(problem)
        if defaults is None:
            from harness.kernel import api as kernel_api

            try:
                defaults = dict(kernel_api.get(json.loads(problem)[0]).default_config)
            except Exception:  # keyed as given
                defaults = {}
            self._defaults[problem] = defaults
        return {**defaults, **config}

    def warm(self) -> bool:
        """Whether the service has started or finished a compile of this worker's: until
        then its compile processes may still be starting (seconds after the worker).
        Once true, always: late in a run every config left may be queued or started
        unreported (and those answered are forgotten once waited on), and a worker that
        took that for a service still starting compiled a register-spilling config
        itself, for minutes (the outside softmax on an H200)."""
        with self._lock:
            return self._warm

    def _unanswered(self, key: Key, now: float, overdue: bool = False) -> dict[str, Any]:
        """A config the service did not answer for. ``overdue``: its compile started more
        than the time-out and the grace ago, and the service answers other polls: a
        compile time-out (it fails its trial), since the service answers every compile
        within its time-out, so this is one that compiles for minutes or one whose answer
        was lost, and either way the worker must not compile it on its own thread, where
        nothing bounds it. Otherwise (never started, or a service that answers nothing)
        it compiles in the worker."""
        waited = now - self._sent.get(key, now)
        if overdue and key in self._began:
            return {"ok": False, "timeout": True,
                    "reason": f"compile time-out: the compile service on node {self.node} "
                    f"did not answer for this config within {now - self._began[key]:.0f} s "
                    f"of its compile's start (its limit: {self.timeout_s:g} s)"}
        return {"ok": False, "reason": f"the compile service on node {self.node} did not "
                f"answer for this config within {waited:.0f} s"}

    def submit(self, problem: str, kernel: str, shape: Mapping[str, int], skel: Any,
               configs: Sequence[Mapping[str, Any]], priority: int = AHEAD) -> None:
        fresh, now, again = [], time.monotonic(), []
        with self._lock:
            if self._lost:
                return
            silent = self._silent
            for config in configs:
                full = self._full(problem, config)
                key = (problem, config_key(full))
                if key not in self._futures:
                    self._futures[key] = Future()
                    self._sent[key] = now
                    fresh.append((key, full))
                elif priority < AHEAD and not self._futures[key].done() \
                        and key not in self._began:
                    again.append((key, full))  # known before, queued for a trial now
        if not fresh and not (again and not silent):
            return
        self.submitted += len(fresh)
        if silent:  # not sent: compiled in the worker until the service answers again
            why = {"ok": False, "reason": f"the compile service on node {self.node} did not "
                   f"answer for {now - silent:.0f} s: this config compiles in the worker"}
            with self._lock:
                futures = [self._futures.get(key) for key, _ in fresh]
            for fut in futures:
                if fut is not None:
                    _settle(fut, why)
            self._wake.set()  # the thread keeps asking whether it answers again
            return
        try:  # ``again``: known before, the service moves them up its queue
            self.service.submit.remote(problem, kernel, dict(shape), skel,
                                       [full for _, full in fresh + again], self._id,
                                       priority)
        except Exception as exc:  # an actor handle that cannot call any more
            self._give_up(f"compile service lost: {type(exc).__name__}")
            return
        self._wake.set()

    def pending(self, problem: str, config: Mapping[str, Any]) -> Future | None:
        key = (problem, config_key(self._full(problem, config)))
        with self._lock:
            return self._futures.get(key)

    def wait(self, problem: str, config: Mapping[str, Any],
             timeout_s: float | None = None) -> dict[str, Any] | None:
        """The compile's outcome (None: none was submitted). ``timeout_s`` bounds the
        wait; by default the service's time-out plus the grace from now, or from the
        compile's start where it started later (a compile is never left to the worker
        while it runs in the service)."""
        key = (problem, config_key(self._full(problem, config)))
        with self._lock:
            fut = self._futures.get(key)
        if fut is None:
            return None
        t0 = time.monotonic()
        # The future stays listed until it is done: the polling thread asks the service
        # only for listed keys, so a future taken out early would never be completed.
        try:
            if timeout_s is not None:
                try:
                    return fut.result(timeout=timeout_s)
                except FutureTimeout:
                    return {"ok": False, "reason": f"still compiling after {timeout_s:g} s"}
            while True:
                limit = self.timeout_s + self.grace_s
                with self._lock:
                    began = self._began.get(key)
                end = t0 + limit if began is None else max(t0, began) + limit + 1.0
                remaining = end - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    return fut.result(timeout=remaining)
                except FutureTimeout:  # it may have started meanwhile: wait for that
                    continue
            waited = time.monotonic() - t0
            if began is None:
                return {"ok": False, "reason": f"not compiled after {waited:.0f} s: queued "
                        f"behind other compiles on node {self.node}"}
            return {"ok": False, "timeout": True,
                    "reason": f"compile time-out: still compiling after {waited:.0f} s in the "
                    f"compile service on node {self.node} (its limit: {self.timeout_s:g} s)"}
        finally:
            with self._lock:
                if self._futures.get(key) is fut:
                    del self._futures[key]
                    self._sent.pop(key, None)
                    self._began.pop(key, None)

    # -- the polling thread -------------------------------------------------------------
    def _poll(self) -> None:
        acks: list[Key] = []
        while True:
            try:
                with self._lock:
                    if self._closed or self._lost:
                        return
                    waiting = any(not f.done() for f in self._futures.values())
                    silent = self._silent
                if not (waiting or acks or silent):
                    self._wake.wait()  # a submit or close sets it: no polling while idle
                    self._wake.clear()
                    continue
                length = min(self.LONG_POLL_S, (self.timeout_s + self.grace_s) / 2)
                reply = self._ask(acks, length if waiting and not silent else 0.0)
                if reply is not None:
                    acks = list(reply["outcomes"])
                    self._apply(reply)
            except Exception as exc:  # never a silent stop: every future gets an outcome
                self._give_up(f"compile service unusable: {type(exc).__name__}: {exc}")
                return

    def _ask(self, acks: list[Key], timeout_s: float) -> dict[str, Any] | None:
        """One poll; None where the service did not answer in time (or is gone). While it
        is outstanding, configs whose compile is overdue are given up one by one."""
        sent = time.monotonic()
        try:
            ref = self.service.outcomes.remote(self._id, timeout_s, acks)
        except _LOST as exc:
            self._give_up(f"compile service lost: {type(exc).__name__}")
            return None
        limit = sent + timeout_s + (self.grace_s if self._heard
                                    else max(self.grace_s, self.START_S))
        while True:
            step = min(limit, self._next_deadline()) - time.monotonic()
            try:
                return _get(ref, max(0.0, step))
            except GetTimeoutError:
                now = time.monotonic()
                self._expire(now)
                if now >= limit:
                    self._went_silent(now, now - sent)
                    return None
            except _LOST as exc:
                self._give_up(f"compile service lost: {type(exc).__name__}")
                return None

    def _next_deadline(self) -> float:
        """When the next started compile is overdue (inf: none has started)."""
        limit = self.timeout_s + self.grace_s
        with self._lock:
            return min((self._began[k] + limit for k, f in self._futures.items()
                        if k in self._began and not f.done()), default=float("inf"))

    def _apply(self, reply: dict[str, Any]) -> None:
        now = time.monotonic()
        done: list[tuple[Future, dict[str, Any]]] = []
        with self._lock:
            self._heard = True
            self.node = reply.get("node") or self.node
            self.timeout_s = reply.get("timeout_s", self.timeout_s)
            if self._silent:
                log.warning("the compile service on node %s answers again", self.node)
                self._silent = 0.0
            for key, out in reply["outcomes"].items():
                fut = self._futures.get(tuple(key))
                if fut is not None and not fut.done():
                    done.append((fut, out))
            for key, age in reply["started"].items():
                if tuple(key) in self._futures:
                    self._began.setdefault(tuple(key), now - age)
            self._warm = self._warm or bool(done) or bool(self._began)
            stalled = reply.get("stalled_s", 0.0) > self.timeout_s + self.grace_s
        for fut, out in done:
            _settle(fut, out)
        self._expire(now, queued=stalled)

    def _expire(self, now: float, queued: bool = False) -> None:
        """Give up on the configs whose compile started more than the time-out and the
        grace ago, and (``queued``: the service's queue has not moved for that long) on
        those not started."""
        limit = self.timeout_s + self.grace_s
        with self._lock:
            overdue = [(k, f) for k, f in self._futures.items() if not f.done() and (
                self._began[k] + limit <= now if k in self._began else queued)]
            outs = [(f, self._unanswered(k, now, overdue=True)) for k, f in overdue]
            started = sum(k in self._began for k, _ in overdue)
        if started:  # said before the worker acts on it
            log.warning("the compile service on node %s did not answer for %d config(s) "
                        "within %g s of their compile's start: their trials fail as compile "
                        "time-outs", self.node, started, limit)
        if len(outs) > started:
            log.warning("the compile service on node %s started no compile for %g s while "
                        "%d config(s) of this worker waited in its queue: they compile in "
                        "the worker", self.node, limit, len(outs) - started)
        for fut, out in outs:
            _settle(fut, out)

    def _went_silent(self, now: float, waited: float) -> None:
        """The service did not answer a poll: every open config is given up, and later
        ones compile in the worker until it answers again."""
        with self._lock:
            first = not self._silent
            self._silent = self._silent or now
            open_ = [(k, f) for k, f in self._futures.items() if not f.done()]
            outs = [(f, self._unanswered(k, now)) for k, f in open_]
        if first or outs:
            log.warning("the compile service on node %s did not answer for %.0f s: %d "
                        "config(s) compile in the worker, and the next ones until it "
                        "answers again", self.node, waited, len(outs))
        for fut, out in outs:
            _settle(fut, out)

    def _give_up(self, why: str) -> None:
        log.warning("%s: configs compile on their first launch", why)
        with self._lock:
            self._lost = why
            futures = [f for f in self._futures.values() if not f.done()]
        for fut in futures:
            _settle(fut, {"ok": False, "reason": why})

    def close(self) -> None:
        """Stop asking; the service belongs to the node, not to this worker."""
        with self._lock:
            self._closed = True
        self._wake.set()
