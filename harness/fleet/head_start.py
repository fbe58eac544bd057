"""Compiling before the fleet exists: a run that starts its own Ray on this machine
compiles its first study's first configs in compile children of the driver, started at
the command's first step, while Ray, the GPU workers and the node's compile service start.

On a cold start the GPU's first trial waited for a chain: Ray up, the compile service's
actor up, its children importing torch and Triton and opening the GPU, then the first
config's compile (7.3 s of GPU-held set-up on an H200 quickstart, after Ray's 8 s). The
children started here import while Ray starts and compile the configs the first study is
known to measure (``schedule.known_configs``) into Triton's on-disk cache, which the
node's workers and compile service share: their own compiles of those configs then load
binaries. Only a cache is warmed; a failure here loses the head start, nothing else.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import wait
from typing import Any

from harness.fleet.compile import (
    COMPILE_TIMEOUT_RATIO,
    Precompiler,
    _pool_context,
    gpu_device_nodes,
    pin_triton_cache_dir,
    precompile_enabled,
    problem_key,
)
from harness.fleet.compile_child import PREBUILD, skeleton
from harness.fleet.first_trials import FirstTrials
from harness.measure import hardware

log = logging.getLogger(__name__)

#: Compile children of the head start: the first study's first configs, not a search.
PROCESSES = 2
#: Cores below which the head start is left out: its imports would slow Ray's own start.
MIN_CORES = 8


def local_hardware_key() -> str | None:
    """The hardware key of this machine's first visible GPU, from NVML (no CUDA context,
    no torch import); None where NVML is missing or sees no GPU."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
            index = int(first) if first.isdigit() else 0
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(index))
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no driver, no such device, a UUID in CUDA_VISIBLE_DEVICES
        return None
    return hardware.hardware_key(name.decode() if isinstance(name, bytes) else name)


def starts_own_ray() -> bool:
    """Whether this run will start a Ray of its own on this machine (``Fleet.connect``'s
    "local"): no Ray in this process, no RAY_ADDRESS, no `ray start` address left here."""
    import ray

    if ray.is_initialized() or os.environ.get("RAY_ADDRESS"):
        return False
    try:
        from ray._private.services import find_bootstrap_address

        return find_bootstrap_address(None) is None
    except (ImportError, AttributeError):
        return False


class HeadStart:
    """The driver's compile children for the first study of this machine's GPU type."""

    def __init__(self, key: str | None, timeout_s: float,
                 ratio: float = COMPILE_TIMEOUT_RATIO) -> None:
        self.key = key  # None: this machine's GPU type, read by ``start`` (NVML)
        self._closer: threading.Thread | None = None
        self.submitted = 0
        self.done = 0
        #: The first study's first trials, measured here (``submit``'s ``measure``).
        self.first: FirstTrials | None = None
        #: Set once the head start has decided what it does (``submit`` or not at all).
        self.decided = threading.Event()
        self._cancelled = False  # no first trials from here any more (``cancel``)
        self._lock = threading.Lock()
        pin_triton_cache_dir()  # the workers' and the compile service's cache
        self.pool = Precompiler(PROCESSES, timeout_s=timeout_s, ratio=ratio)

    def start(self) -> bool:
        """Read this machine's GPU type and start the compile processes; whether there is
        a head start. It returns once their forkserver has imported torch and Triton
        (seconds): call it off the thread that starts Ray (on it, Ray started seconds
        later on a 4x H200 host)."""
        if self.key is None:
            self.key = local_hardware_key()
            if self.key is None:
                return False
        self.pool.start()
        return True

    @classmethod
    def maybe(cls, compile_workers: int | str, timeout_s: float,
              ratio: float = COMPILE_TIMEOUT_RATIO) -> HeadStart | None:
        """A head start where it pays: a run starting its own Ray, with compile-ahead on,
        on a GPU machine with cores to spare. ``HARNESS_HEAD_START``: ``off`` never,
        ``on`` whatever the cores (still only with compile-ahead and a Ray of its own)."""
        mode = os.environ.get("HARNESS_HEAD_START", "")
        if mode == "off" or compile_workers == 0:
            return None
        if mode != "on" and (os.cpu_count() or 1) < MIN_CORES:
            return None
        has_gpu = gpu_device_nodes()
        if not precompile_enabled(has_gpu) or not starts_own_ray():
            return None
        try:
            return cls(None if has_gpu else "cpu", timeout_s, ratio)  # started: ``start``
        except Exception as exc:
            log.warning("no head start for the first compiles: %s", exc)
            return None

    def submit(self, study: Any, configs: Sequence[dict[str, Any]], prebuild: bool,
               seed: int = 0, measure: dict[str, float] | None = None) -> None:
        """Compile ``configs`` of ``study`` (a ``StudyPlan`` on this machine's key), on
        its inputs' layout built on the CPU (a layout, not data: a data-dependent
        specialisation that differs from the GPU's only costs a compile in vain); then,
        where ``prebuild``, build its torch.compile baseline as the node's compile
        service would (``PREBUILD``: Inductor's output into this machine's caches, which
        the worker's own build of the final rounds then finds). The processes end once
        all of it is done: each holds a CUDA context. ``measure``: do_bench's budgets to
        measure those configs with, here, as they compile (``first_trials``); the
        prebuild is then left to the node's compile service (it runs on the GPU)."""
        try:
            spec, fam = study.spec, study.family
            problem = problem_key(spec.kernel, spec.shape, spec.dtype, seed)
            jobs: list[tuple[Any, list[dict[str, Any]]]] = []
            if fam.compiles_ahead and configs:
                inputs = fam.make_inputs(spec.shape, spec.dtype, seed, "cpu")
                jobs.append((skeleton(inputs), list(configs)))
            futures = []
            for skel, batch in jobs:
                self.pool.submit(problem, spec.kernel, spec.shape, skel, batch)
                self.submitted += len(batch)
                futures += [f for c in batch
                            if (f := self.pool.pending(problem, c)) is not None]
            build = [{PREBUILD: "torch.compile", "dtype": spec.dtype, "seed": seed}]
            with self._lock:
                if measure is not None and configs and not self._cancelled:
                    self.first = FirstTrials(_pool_context(), spec.name, spec.kernel,
                                             spec.shape, spec.dtype, seed, measure, configs,
                                             lambda c: self.pool.pending(problem, c))
                    self.first.start()
            # The prebuild runs what Inductor generates on the GPU: not beside the first
            # trials. Where they are measured here, the node's compile service builds it
            # once the study starts, as for every other study.
            if self.first is None and prebuild:
                self.pool.submit(problem, spec.kernel, spec.shape, None, build)
                self.submitted += 1
                futures += [f for c in build if (f := self.pool.pending(problem, c))]
            self._closer = threading.Thread(target=self._close_when_done, args=(futures,),
                                            name="harness-head-start", daemon=True)
            self._closer.start()
        finally:
            self.decided.set()

    def _close_when_done(self, futures: list) -> None:
        wait(futures)  # every compile resolves: done, failed or timed out by the pool
        if self.first is not None:
            self.first._thread.join()  # until all are measured or the fleet stops it
        self.done = sum(1 for f in futures if not f.cancelled() and f.exception() is None
                        and (f.result() or {}).get("ok"))
        self.close()

    def measuring(self, key: str, timeout_s: float = 5.0) -> bool:
        """Whether the head start measures the first trials of ``key``'s first study.
        It decides seconds before the fleet starts; one undecided after ``timeout_s``
        is told not to measure, so that it never times beside a worker."""
        if not self.decided.wait(timeout_s):
            log.warning("the head start had not decided after %g s: its first trials are "
                        "left to the fleet", timeout_s)
            self.decided.set()
            self.cancel()
            return False
        return self.first is not None and str(self.key) == key

    def cancel(self) -> None:
        """No first trials from here (those measured are kept for ``take``)."""
        with self._lock:
            self._cancelled = True
        if self.first is not None:
            self.first.stop()

    def take(self) -> tuple[str, dict[str, tuple[dict[str, Any], float]]] | None:
        """Stop the measuring (the measurement in hand finishes, the process ends: the
        GPU is the fleet's) and return (study name, config key -> (result, when))."""
        if self.first is None:
            return None
        return self.first.study, self.first.stop()

    def wait_done(self, timeout_s: float) -> None:
        """Wait until the submitted compiles are done and the processes gone."""
        closer = self._closer
        if closer is not None:
            closer.join(timeout=timeout_s)
            if closer.is_alive():
                raise TimeoutError(f"the head start's {self.submitted} compiles were not "
                                   f"done after {timeout_s:g} s")

    def close(self) -> None:
        self.decided.set()
        self.cancel()
        self.pool.close()

    def report(self) -> dict[str, Any]:
        first = {"first_trials": self.first.report()} if self.first is not None else {}
        return {"hardware": self.key, "submitted": self.submitted, "compiled": self.done,
                **self.pool.timeline(), **first}
