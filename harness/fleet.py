"""Fleet: owns Ray. Finds GPUs by hardware key, keeps one long-lived worker per GPU,
sends it work, replaces it when a kernel poisons its context or hangs. It never decides
what to try.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayActorError, WorkerCrashedError

from harness import hardware
from harness.measure import Measurer, Timing, TrialResult

log = logging.getLogger(__name__)

#: How often a trial whose worker vanished (node lost) is retried elsewhere.
MAX_RETRIES = 2


@ray.remote(max_restarts=0, max_task_retries=0)
class Worker:
    """One per GPU (or one CPU worker running Triton's interpreter)."""

    def __init__(self, hardware_key: str, timing: dict[str, float]):
        import torch

        if not torch.cuda.is_available():
            # Before any kernel module is imported, so its @triton.jit is interpreted.
            os.environ["TRITON_INTERPRET"] = "1"
        self.expected = hardware_key
        self.spec = hardware.current_device()
        self.measurer = Measurer(Timing(**timing))
        self._peaks: dict[str, float] | None = None
        ctx = ray.get_runtime_context()
        self.where = {
            "node_id": ctx.get_node_id(),
            "worker_hardware": hardware_key,
            "gpu_ids": [str(g) for g in ctx.get_accelerator_ids().get("GPU", [])],
            "device_name": self.spec.name,
            "pid": os.getpid(),
        }

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
            "interpreted": self.spec.interpreted,
            "torch": torch.__version__,
            "triton": triton.__version__,
            "cuda": torch.version.cuda or getattr(torch.version, "hip", None) or "none",
        }

    def peaks(self) -> dict[str, float]:
        from harness.measure import device_peaks

        if self._peaks is None:
            self._peaks = device_peaks(self.spec)
        return self._peaks

    def measure(self, kernel: str, shape: dict, dtype: str, config: dict, seed: int) -> dict:
        from harness import kernel_api

        res = self.measurer.measure(kernel_api.get(kernel), shape, dtype, config, seed,
                                    peaks=self.peaks())
        res.extra.update(self.where)
        return res.to_dict()

    def eager(self, kernel: str, shape: dict, dtype: str, seed: int, compiled: bool) -> dict:
        from harness import kernel_api

        res = self.measurer.measure_eager(kernel_api.get(kernel), shape, dtype, seed, compiled)
        res.extra.update(self.where)
        res.extra["peaks"] = self.peaks()
        return res.to_dict()


@dataclass
class Task:
    """A unit of work: ``method`` on a worker of ``hardware`` with ``args``; ``tag`` is the
    caller's and comes back with the result."""

    hardware: str
    method: str  # "measure" or "eager"
    args: tuple
    tag: Any
    tries: int = 0


@dataclass
class _Slot:
    hardware: str
    actor: Any
    info: dict[str, Any] = field(default_factory=dict)
    task: Task | None = None
    ref: Any = None
    started: float = 0.0


class NoHardwareError(RuntimeError):
    pass


class Fleet:
    """Long-lived workers grouped by hardware key."""

    def __init__(self, timing: Timing, trial_timeout_s: float):
        self.timing = {"warmup_ms": timing.warmup_ms, "rep_ms": timing.rep_ms,
                       "cpu_reps": timing.cpu_reps}
        self.trial_timeout_s = trial_timeout_s
        self.slots: list[_Slot] = []
        self._ray_names: dict[str, str] = {}  # hardware key -> Ray accelerator name
        self.replaced = 0
        self.busy_s: dict[str, float] = {}  # worker-seconds spent on tasks, per hardware
        self._requeue: list[Task] = []  # tasks whose worker was lost, to retry elsewhere

    # -- connecting and discovering ---------------------------------------------------
    @staticmethod
    def connect() -> str:
        """Join RAY_ADDRESS / the job's cluster if there is one, else start a local Ray."""
        if ray.is_initialized():
            return "existing"
        if os.environ.get("RAY_ADDRESS"):
            ray.init(logging_level=logging.WARNING)
            return os.environ["RAY_ADDRESS"]
        # Local: workers must import a user's kernel module from the working directory.
        # Only the cwd and the caller's PYTHONPATH: the driver's whole sys.path would put
        # the base interpreter's site-packages ahead of the venv's (crashing workers).
        path = os.pathsep.join(p for p in [os.getcwd(), os.environ.get("PYTHONPATH", "")] if p)
        ray.init(logging_level=logging.WARNING, log_to_driver=False, include_dashboard=False,
                 runtime_env={"env_vars": {"PYTHONPATH": path}})
        return "local"

    def discover(self) -> dict[str, int]:
        """GPUs in the cluster per hardware key; ``{"cpu": 1}`` where there are none."""
        counts: dict[str, int] = {}
        for node in ray.nodes():
            if not node.get("Alive"):
                continue
            res = node.get("Resources", {})
            gpus = int(res.get("GPU", 0))
            if gpus <= 0:
                continue
            names = [k.split(":", 1)[1] for k in res if k.startswith("accelerator_type:")]
            name = names[0] if names else "GPU"
            key = hardware.hardware_key(name)
            self._ray_names[key] = name
            counts[key] = counts.get(key, 0) + gpus
        return counts or {"cpu": 1}

    # -- workers --------------------------------------------------------------------
    def _options(self, key: str) -> dict[str, Any]:
        if key == "cpu":
            return {"num_cpus": 1, "num_gpus": 0}
        return {"num_cpus": 1, "num_gpus": 1,
                "resources": {f"accelerator_type:{self._ray_names.get(key, key)}": 0.001}}

    def _new_actor(self, key: str):
        return Worker.options(**self._options(key)).remote(key, self.timing)

    def start(self, wanted: Mapping[str, int]) -> dict[str, list[dict[str, Any]]]:
        """Start ``wanted[key]`` workers per hardware key; return each worker's info."""
        for key, n in wanted.items():
            for _ in range(n):
                self.slots.append(_Slot(key, self._new_actor(key)))
        infos = ray.get([s.actor.info.remote() for s in self.slots])
        out: dict[str, list[dict[str, Any]]] = {}
        for slot, info in zip(self.slots, infos, strict=True):
            slot.info = info
            out.setdefault(slot.hardware, []).append(info)
            if not info["interpreted"] and info["device_key"] != slot.hardware:
                raise NoHardwareError(
                    f"a worker placed as {slot.hardware} sees a {info['device_name']!r} "
                    f"({info['device_key']}): check the node's accelerator_type resource")
        return out

    def peaks(self, key: str) -> dict[str, float]:
        slot = next(s for s in self.slots if s.hardware == key)
        return ray.get(slot.actor.peaks.remote())

    def idle(self, key: str) -> int:
        return sum(1 for s in self.slots if s.hardware == key and s.task is None)

    def size(self, key: str) -> int:
        return sum(1 for s in self.slots if s.hardware == key)

    def in_flight(self) -> int:
        return sum(1 for s in self.slots if s.task is not None) + len(self._requeue)

    def submit(self, task: Task) -> None:
        slot = next(s for s in self.slots if s.hardware == task.hardware and s.task is None)
        slot.task, slot.started = task, time.monotonic()
        slot.ref = getattr(slot.actor, task.method).remote(*task.args)

    def _replace(self, slot: _Slot) -> None:
        try:
            ray.kill(slot.actor, no_restart=True)
        except Exception:  # already dead
            pass
        slot.actor = self._new_actor(slot.hardware)
        self.replaced += 1

    def poll(self, timeout_s: float = 1.0) -> list[tuple[Task, TrialResult]]:
        """Results that finished within ``timeout_s``; handles hangs and lost workers."""
        busy = {s.ref: s for s in self.slots if s.task is not None}
        done: list[tuple[Task, TrialResult]] = []
        if busy:
            ready, _ = ray.wait(list(busy), num_returns=1, timeout=timeout_s)
            if ready:  # collect everything else that is ready too, without waiting
                ready, _ = ray.wait(list(busy), num_returns=len(busy), timeout=0)
            for ref in ready:
                slot = busy[ref]
                task, slot.task = slot.task, None
                self.busy_s[slot.hardware] = (self.busy_s.get(slot.hardware, 0.0)
                                              + time.monotonic() - slot.started)
                try:
                    result = TrialResult(**ray.get(ref))
                except (RayActorError, WorkerCrashedError) as exc:
                    self._replace(slot)
                    if task.tries < MAX_RETRIES:
                        task.tries += 1
                        self._requeue.append(task)
                        continue
                    result = TrialResult(ok=False, reason=f"worker lost {task.tries + 1} times: "
                                         f"{type(exc).__name__}")
                if result.fatal:
                    self._replace(slot)
                done.append((task, result))
        else:
            time.sleep(min(timeout_s, 0.05))
        now = time.monotonic()
        for slot in self.slots:
            if slot.task is not None and now - slot.started > self.trial_timeout_s:
                task, slot.task = slot.task, None
                self._replace(slot)
                done.append((task, TrialResult(
                    ok=False, reason=f"timeout: no result after {self.trial_timeout_s:g} s "
                    "(hang); worker replaced")))
        # Retried tasks go back out on the first idle worker of their hardware.
        while self._requeue and any(self.idle(t.hardware) for t in self._requeue):
            task = next(t for t in self._requeue if self.idle(t.hardware))
            self._requeue.remove(task)
            self.submit(task)
        return done

    def shutdown(self) -> None:
        for slot in self.slots:
            try:
                ray.kill(slot.actor, no_restart=True)
            except Exception:
                pass
        self.slots.clear()
