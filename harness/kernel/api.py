"""The kernel plug-in interface, in one import: the ``Kernel`` base class and what a
family declares (``harness.kernel.base``), the launch mix-ins that give a family its
compile-ahead hooks (``harness.kernel.launch``), and how a name finds a family
(``harness.kernel.registry``: ``register`` for the built-ins in ``kernels/``, the
``kernel_harness.kernels`` entry-point group for other installed packages, or an import
path ``package.module:Class``).
"""

from __future__ import annotations

from harness.kernel.base import (
    PRECISION_PEAK,
    TUNABLE_TYPES,
    BenchCase,
    Config,
    DeviceSpec,
    Inputs,
    Kernel,
    Shape,
    Tolerance,
    Tunable,
    infer_tunable,
    tunables_from_space,
)
from harness.kernel.launch import Launch, Launches, Planned, SingleLaunch
from harness.kernel.registry import (
    ENTRY_POINT_GROUP,
    KernelLoadError,
    UnknownKernel,
    builtin_names,
    get,
    installed_names,
    register,
    resolve,
)

__all__ = [
    "ENTRY_POINT_GROUP", "PRECISION_PEAK", "TUNABLE_TYPES", "BenchCase", "Config",
    "DeviceSpec", "Inputs", "Kernel", "KernelLoadError", "Launch", "Launches", "Planned",
    "Shape", "SingleLaunch", "Tolerance", "Tunable", "UnknownKernel", "builtin_names", "get",
    "infer_tunable", "installed_names", "register", "resolve", "tunables_from_space",
]
