"""Spare MLflow logger processes on a kept fleet (``fleet.keep_workers_s`` on a cluster
that outlives the run): a logger process takes seconds to start and import MLflow (the
second run on a warm 4x H200 fleet waited 6.7 s for it after its kept worker was
leased), so a run that keeps its workers also leaves a logger started, MLflow imported,
for the next run on the same machine. That run takes it (``take``) instead of starting
one, and leaves another (``leave``).

A spare is a detached Ray actor named ``PREFIX`` + the harness's code version + its
kind (``trials`` or ``plots``) + its node + a random suffix, in the kept workers'
namespace, on the node of the driver that left it. Taken, it logs for that run only and
leaves with the driver's process; never taken, it leaves after ``keep_s`` seconds.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from harness.run import faults
from harness.tracking.tracker import TrialLogger, absolute_uri

log = logging.getLogger(__name__)

PREFIX = "kharness-logger-"
#: The namespace of what a fleet keeps between runs: its workers (``harness.fleet``)
#: and spare loggers.
NAMESPACE = "kharness"


class SpareLogger(TrialLogger):
    """A ``TrialLogger`` not bound to a store yet: MLflow (and, for ``plots``, the
    plotting code) imported, waiting for a run to ``claim`` it."""

    def __init__(self, plots: bool, keep_s: float) -> None:
        super().__init__("", "", warm_plots=plots, open_now=False)
        self._claim_lock = threading.Lock()
        self._driver: int | None = None  # the claiming driver's process id
        self._born = time.monotonic()
        self._keep_s = keep_s
        threading.Thread(target=self._watch, name="harness-spare", daemon=True).start()

    def claim(self, uri: str, experiment: str, driver_pid: int, before: float) -> bool:
        """Bind this spare to a run's store and experiment; False where another run took
        it first (two runs may find the same spare), or where the claim comes after
        ``before`` (time.monotonic(), which the node's processes share): its caller
        stopped waiting for the answer (the spare was still starting) and went on
        without it. It answers at once: an existing SQLite store is opened on a thread
        (``warm_store``), any other on first use or by ``open``."""
        with self._claim_lock:
            if self._driver is not None or time.monotonic() > before:
                return False
            self._driver = driver_pid
        ahead = self._where[0] == uri and self._warming is not None
        self._where = (uri, experiment)
        if not ahead:  # not the store the run that left it set up (``open_store``)
            self.warm_store()
        self._stats["ready_at"] = time.monotonic()  # as a logger of this run
        self._stats["spare"] = 1  # the summary shows it was ready before the run
        self._stats["store_ahead"] = int(ahead)
        return True

    def open_store(self, uri: str) -> None:
        """The store of the run that left it, now that the run has set it up (opened
        before, a store being created would have been migrated by two processes at
        once): opened ahead for the next run, which most often logs to the same one."""
        with self._claim_lock:
            if self._driver is not None or self._warming is not None:
                return
            self._where = (uri, "")
            self.warm_store()

    def _watch(self) -> None:
        """Leave once unclaimed for ``keep_s``, or once the claiming driver is gone (a
        driver killed outright cannot kill its loggers)."""
        while True:
            time.sleep(1.0)
            driver = self._driver
            if driver is None:
                if time.monotonic() - self._born > self._keep_s:
                    os._exit(0)
            elif not _alive(driver):
                os._exit(0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process of that id: alive
        return True
    return True


def _prefix(version: str, plots: bool) -> str:
    """Spares of this code version (a spare has imported its code once) and kind on this
    (the driver's) node."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    return f"{PREFIX}{version}-{'plots' if plots else 'trials'}-{node[:12]}-"


def take(uri: str, experiment: str, plots: bool, version: str) -> Any | None:
    """A spare of the harness's code ``version`` and this kind on this node, claimed for
    the run's store (``uri``) and ``experiment``; None where there is none to take."""
    import ray
    from ray.util import list_named_actors

    prefix = _prefix(version, plots)
    try:
        names = [e["name"] for e in list_named_actors(all_namespaces=True)
                 if e.get("namespace") == NAMESPACE and e.get("name", "").startswith(prefix)]
    except Exception as exc:  # the state API is unavailable: start one as usual
        log.debug("no spare loggers listed: %s", exc)
        return None
    for name in names:
        try:
            actor = ray.get_actor(name, namespace=NAMESPACE)
            wait_s = 2.0  # a spare that is up answers in milliseconds
            claim = actor.claim.remote(absolute_uri(uri), experiment, os.getpid(),
                                       time.monotonic() + wait_s)
            if ray.get(claim, timeout=wait_s):
                return actor
        except Exception:  # gone since listed (left after keep_s), or busy starting
            continue
    return None


#: The spares this process left, told once its run's store is set up (``store_ready``).
_LEFT: list[Any] = []


def store_ready(uri: str) -> None:
    """The run's MLflow store is set up: the spares it left open it for the next run."""
    for actor in _LEFT:
        try:
            actor.open_store.remote(absolute_uri(uri))
        except Exception as exc:  # gone: only a head start for the next run
            log.debug("spare logger not told of the store: %s", exc)
    _LEFT.clear()


def leave(keep_s: float, plots: bool, version: str) -> None:
    """Start a spare of this kind for the next run (in the background: nothing waits
    for it); it opens the run's store once told it is set up (``store_ready``)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    try:
        _LEFT.append(ray.remote(SpareLogger).options(
            name=_prefix(version, plots) + os.urandom(4).hex(), namespace=NAMESPACE,
            lifetime="detached", num_cpus=0, max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
            **faults.actor_env()).remote(plots, keep_s))
    except Exception as exc:  # only a head start for the next run
        log.warning("no spare MLflow logger left for the next run: %s", exc)
