"""kernel-harness: tune Triton kernels across a GPU fleet, ship frozen config packs.

The runtime side (``harness.packs``, ``harness.autotune``) imports no Ray, Optuna or
MLflow, and ``import harness`` imports nothing at all: both load on first use.
"""

import importlib
import time
from typing import Any

__version__ = "0.1.0"

#: When this package was first imported (time.monotonic()): for the command line, the
#: process's start less the interpreter's own start-up, the origin of a run's wall time.
IMPORTED_AT = time.monotonic()


def __getattr__(name: str) -> Any:
    # ``harness.autotune`` is the submodule, made callable: ``harness.autotune(kernel=...)``
    # is the decorator and ``harness.autotune.PackedKernel`` still resolves.
    if name in ("autotune", "packs"):
        return importlib.import_module(f"harness.{name}")
    raise AttributeError(f"module 'harness' has no attribute {name!r}")
