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
    gpu_device_nodes,
    pin_triton_cache_dir,
    precompile_enabled,
    problem_key,
)
from harness.fleet.compile_child import PREBUILD, skeleton
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
               seed: int = 0) -> None:
        """Compile ``configs`` of ``study`` (a ``StudyPlan`` on this machine's key), on
        its inputs' layout built on the CPU (a layout, not data: a data-dependent
        specialisation that differs from the GPU's only costs a compile in vain); then,
        where ``prebuild``, build its torch.compile baseline as the node's compile
        service would (``PREBUILD``: Inductor's output into this machine's caches, which
        the worker's own build of the final rounds then finds). The processes end once
        all of it is done: each holds a CUDA context."""
        spec, fam = study.spec, study.family
        problem = problem_key(spec.kernel, spec.shape, spec.dtype, seed)
        jobs: list[tuple[Any, list[dict[str, Any]]]] = []
        if fam.compiles_ahead and configs:
            inputs = fam.make_inputs(spec.shape, spec.dtype, seed, "cpu")
            jobs.append((skeleton(inputs), list(configs)))
        if prebuild:
            jobs.append((None, [{PREBUILD: "torch.compile", "dtype": spec.dtype,
                                 "seed": seed}]))
        futures = []
        for skel, batch in jobs:
            self.pool.submit(problem, spec.kernel, spec.shape, skel, batch)
            self.submitted += len(batch)
            futures += [f for c in batch if (f := self.pool.pending(problem, c)) is not None]
        self._closer = threading.Thread(target=self._close_when_done, args=(futures,),
                                        name="harness-head-start", daemon=True)
        self._closer.start()

    def _close_when_done(self, futures: list) -> None:
        wait(futures)  # every compile resolves: done, failed or timed out by the pool
        self.done = sum(1 for f in futures if not f.cancelled() and f.exception() is None
                        and (f.result() or {}).get("ok"))
        self.close()

    def wait_done(self, timeout_s: float) -> None:
        """Wait until the submitted compiles are done and the processes gone."""
        closer = self._closer
        if closer is not None:
            closer.join(timeout=timeout_s)
            if closer.is_alive():
                raise TimeoutError(f"the head start's {self.submitted} compiles were not "
                                   f"done after {timeout_s:g} s")

    def close(self) -> None:
        self.pool.close()

    def report(self) -> dict[str, Any]:
        return {"hardware": self.key, "submitted": self.submitted, "compiled": self.done,
                **self.pool.timeline()}
