"""Fleet: owns Ray. It finds GPUs by hardware key (``cluster``), keeps one long-lived
worker per GPU (``worker``, ``slots``), sends it work and collects results
(``driver``), replaces a worker when a kernel poisons its context or hangs, and retries a
trial whose node died. One compile service per node, shared by its GPUs, compiles the
configs ahead (``compile_service``, ``compile``). It never decides what to try.

``skeleton`` and ``materialise`` are what a kernel family's ``compile_only`` tests use:
its inputs as layouts without memory, as a compile process gets them.
"""

from harness.fleet.cluster import NoHardwareError, RayStartError, check_placement
from harness.fleet.compile_child import materialise, skeleton
from harness.fleet.driver import MAX_RETRIES, Fleet
from harness.fleet.slots import KEPT_NS, KEPT_PREFIX, Task, code_version

__all__ = ["KEPT_NS", "KEPT_PREFIX", "MAX_RETRIES", "Fleet", "NoHardwareError",
           "RayStartError", "Task", "check_placement", "code_version", "materialise",
           "skeleton"]
