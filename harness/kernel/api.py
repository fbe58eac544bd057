"""The kernel plug-in interface and the registry of kernel families.

A kernel family is a class that knows how to build inputs for a shape, compute a
reference, launch one configuration of its Triton kernel, and model its own cost.
Built-in families live in the top-level ``kernels`` package; a user's family lives in
the user's own module and is named by import path (``package.module:Class``).
"""

from __future__ import annotations

import importlib
import math
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

Shape = Mapping[str, int]
Config = Mapping[str, Any]
Inputs = dict[str, Any]

# Built-in families: name -> import path. Imported lazily so that naming one family
# never imports (and JIT-decorates) the others.
BUILTIN: dict[str, str] = {
    "grouped_gemm": "kernels.grouped_gemm:GroupedGemm",
    "mamba2_ssd": "kernels.mamba2_ssd:Mamba2SSD",
    "matmul": "kernels.matmul:Matmul",
    "minigpt_block": "kernels.minigpt_block:MiniGPTBlock",
    "selective_scan": "kernels.selective_scan:SelectiveScan",
    "mulsum_bmm": "kernels.mulsum_bmm:MulSumBmm",
    "mulsum_ydiag": "kernels.mulsum_bmm:MulSumYDiag",
    "mulsum_states": "kernels.mulsum_bmm:MulSumStates",
    "mulsum_c_states": "kernels.mulsum_bmm:MulSumCStates",
    "rmsnorm": "kernels.fused_elementwise:RMSNorm",
    "silu": "kernels.fused_elementwise:SiLU",
    "silu_mul": "kernels.fused_elementwise:SiLUMul",
    "softplus_clamp": "kernels.fused_elementwise:SoftplusClamp",
}


@dataclass(frozen=True)
class Tolerance:
    """Accuracy bound: |out - ref| <= atol + rtol * |ref| element-wise."""

    atol: float
    rtol: float


#: The measured matmul peak (``device_peaks``' ``<name>_tflops``) and the work factor of
#: each precision label: tf32x3 runs three tf32 products for one.
PRECISION_PEAK: dict[str, tuple[str, int]] = {
    "ieee fp32": ("fp32", 1), "tf32": ("tf32", 1), "tf32x3": ("tf32", 3),
    "bf16": ("bf16", 1), "fp16": ("fp16", 1),
}

#: The value types a tunable may have (a config is JSON: no other types survive a pack).
TUNABLE_TYPES: dict[str, type] = {"int": int, "float": float, "str": str, "bool": bool}


@dataclass(frozen=True)
class Tunable:
    """One tunable of a kernel family: the type of its values and, where they form a
    closed set (an implementation name, a precision), the values themselves."""

    type: str  # one of TUNABLE_TYPES
    choices: tuple[Any, ...] | None = None  # the only values allowed (None: any of the type)
    minimum: float | None = None  # numbers: the smallest value allowed

    def why_not(self, value: Any) -> str | None:
        """Why ``value`` cannot be a value of this tunable (None if it can)."""
        want = TUNABLE_TYPES[self.type]
        # bool is an int to Python, never to a kernel; an int is a fine float.
        ok = (isinstance(value, want) and not (want is not bool and isinstance(value, bool))
              ) or (want is float and isinstance(value, int) and not isinstance(value, bool))
        if not ok:
            return f"{value!r} is not of type {self.type}"
        if want is float and not math.isfinite(value):
            return f"{value!r} is not a finite number"
        if self.choices is not None and value not in self.choices:
            return f"{value!r} is not one of {list(self.choices)}"
        if self.minimum is not None and value < self.minimum:
            return f"{value!r} is below the minimum {self.minimum:g}"
        return None


def infer_tunable(values: list[Any]) -> Tunable | None:
    """The declaration that the values of a search space imply: their common type; strings
    and booleans as the closed set seen, numbers non-negative where all seen are. None
    where the values share no type (then nothing is checked)."""
    if not values:
        return None
    if all(isinstance(v, bool) for v in values):
        return Tunable("bool", (False, True))
    if all(isinstance(v, str) for v in values):
        return Tunable("str", tuple(dict.fromkeys(values)))
    if any(isinstance(v, bool) for v in values):
        return None
    kind = "int" if all(isinstance(v, int) for v in values) else (
        "float" if all(isinstance(v, (int, float)) for v in values) else None)
    if kind is None:
        return None
    return Tunable(kind, minimum=0 if all(v >= 0 for v in values) else None)


@dataclass(frozen=True)
class DeviceSpec:
    """What static pruning may know about the target device (no GPU needed)."""

    key: str  # short hardware key: H100, H200, A100, V710, cpu
    vendor: str  # nvidia, amd, cpu
    name: str = ""
    sm_count: int = 1
    smem_per_block: int = 228 * 1024
    l2_bytes: int = 0
    has_tma: bool = False
    interpreted: bool = False  # Triton runs under TRITON_INTERPRET=1
    has_wgmma: bool = False  # Hopper's warpgroup MMA (sm_90 only: Blackwell has tcgen05)


class Kernel(ABC):
    """One kernel family. Subclasses set the class attributes and the abstract methods."""

    name: ClassVar[str]
    #: Shape dimensions, in the order used in shape keys.
    dims: ClassVar[tuple[str, ...]]
    #: Dimensions that must match exactly when a pack entry is reused for another shape;
    #: the others are matched by nearest distance in log space.
    exact_dims: ClassVar[tuple[str, ...]] = ()
    dtypes: ClassVar[tuple[str, ...]] = ("bf16", "fp16", "fp32")
    #: The config used when no pack entry exists; it must pass ``check_config``.
    default_config: ClassVar[dict[str, Any]]
    #: Named seed shapes (benchmarks and examples). ``test`` is the interpreter-sized one.
    shapes: ClassVar[dict[str, dict[str, int]]] = {}
    #: The search space: ``search_spaces/<space_name>.yaml`` if shipped (default: the
    #: family's name), else ``space`` (same structure; handy for a user's own kernel).
    space_name: ClassVar[str | None] = None
    space: ClassVar[dict[str, Any]] = {}
    #: The tunables, typed (name -> Tunable). Those not declared here are inferred from
    #: the search space and the default config (``declared_tunables``).
    tunables: ClassVar[dict[str, Tunable]] = {}

    # -- inputs and semantics ---------------------------------------------------------
    @abstractmethod
    def make_inputs(self, shape: Shape, dtype: str, seed: int, device: str) -> Inputs:
        """Fresh random inputs (never zeros) drawn from ``seed``."""

    @abstractmethod
    def reference(self, inputs: Inputs, shape: Shape) -> Any:
        """The ground truth, computed in higher precision where it matters."""

    def eager(self, inputs: Inputs, shape: Shape) -> Any:
        """The PyTorch implementation a user would write, in the inputs' own dtype. It is
        timed as the speed-up baseline, eager and under ``torch.compile``, so it must be
        traceable. Defaults to the reference."""
        return self.reference(inputs, shape)

    def baselines(self) -> dict[str, Callable[[Inputs, Shape], Callable[[], Any]]]:
        """Extra implementations users would pick instead (library calls), by name, for
        the benchmark: each maps (inputs, shape) to a zero-arg callable."""
        return {}

    @abstractmethod
    def launcher(self, inputs: Inputs, shape: Shape, config: Config) -> Callable[[], Any]:
        """Return a callable that launches ``config`` once and returns the output.

        Work that an application would do once (allocating outputs, building
        descriptors) belongs before the returned callable, not inside it. A callable
        that writes into an output allocated here may name it as ``fn.out``: the
        measurement then fills it with NaN before timing and needs no separate first call.
        """

    # -- cost model -------------------------------------------------------------------
    @abstractmethod
    def flops(self, shape: Shape) -> float:
        """Useful floating-point operations of one call."""

    @abstractmethod
    def bytes_moved(self, shape: Shape, dtype: str) -> float:
        """The fewest bytes one call must move through device memory."""

    def compute_dtype(self, dtype: str) -> str | None:
        """Which matmul peak bounds this kernel (``bf16``/``fp16``/``fp32``), or None
        when it has no matrix work and only the copy bandwidth applies."""
        return dtype

    def precision(self, config: Config, dtype: str) -> str:
        """What ``config`` computes in, for ``dtype`` inputs: the label packs record and
        tables show (``ieee fp32``, ``tf32x3``, ``tf32``, ``fp16 state``, ``bf16``, ...).
        Its matmul peak bounds the roofline where ``PRECISION_PEAK`` names one. A family
        whose tunables trade accuracy for speed says which configs do."""
        return "ieee fp32" if dtype == "fp32" else dtype

    # -- accuracy and validity --------------------------------------------------------
    def tolerance(self, dtype: str, config: Config) -> Tolerance:
        """The bound a config must meet to be a valid trial. ``config`` matters where a
        tunable trades accuracy for speed (fp16 states, tf32)."""
        return {"fp32": Tolerance(1e-4, 1e-4), "fp16": Tolerance(1e-2, 1e-2)}.get(
            dtype, Tolerance(2e-2, 2e-2)
        )

    def check_config(self, config: Config, shape: Shape, device: DeviceSpec) -> str | None:
        """Why ``config`` cannot run on ``device`` for ``shape`` (None if it can).

        This is static pruning: it runs on the driver, before any GPU time is spent.
        """
        return None

    def declared_tunables(self) -> dict[str, Tunable | None]:
        """Every tunable the family knows: ``tunables``, then each name of its search space
        (every vendor and hardware section) and of its default config, with the type its
        values there imply (None: no common type, any scalar goes)."""
        cached = self.__dict__.get("_declared")
        if cached is not None:
            return cached
        from harness.search import spaces  # data only (YAML): keeps this module light

        seen: dict[str, list[Any]] = {k: [v] for k, v in self.default_config.items()}
        raw = spaces.for_kernel(self)
        layers = [raw, *(raw.get("vendors") or {}).values(), *(raw.get("hardware") or {}).values()]
        for layer in layers:
            params = (layer or {}).get("params") or {}
            for k, choices in params.items():
                seen.setdefault(k, []).extend(choices if isinstance(choices, list) else [])
        out: dict[str, Tunable | None] = {k: infer_tunable(v) for k, v in seen.items()}
        out.update(self.tunables)
        self.__dict__["_declared"] = out
        return out

    def check_tunables(self, config: Config) -> str | None:
        """Why ``config`` names a tunable the family does not have, or gives one a value
        of the wrong type (None if neither). ``check_config`` then judges the values."""
        declared = self.declared_tunables()
        for name, value in config.items():
            if name not in declared:
                return (f"unknown tunable {name!r} (the tunables of {self.name}: "
                        f"{', '.join(sorted(declared))})")
            decl = declared[name]
            why = decl.why_not(value) if decl is not None else None
            if why:
                return f"{name}: {why}"
        return None

    # -- pack lookup ------------------------------------------------------------------
    def shape_key(self, shape: Shape) -> str:
        return ",".join(f"{d}={int(shape[d])}" for d in self.dims)

    def parse_shape_key(self, key: str) -> dict[str, int]:
        out = dict(part.split("=", 1) for part in key.split(","))
        return {d: int(out[d]) for d in self.dims}

    def shape_distance(self, a: Shape, b: Shape) -> float:
        """Distance between two shapes for nearest-entry lookup; ``inf`` means never
        reuse. Default: exact dims must match, the rest compare in log2 space."""
        if any(int(a[d]) != int(b[d]) for d in self.exact_dims):
            return math.inf
        return sum(
            abs(math.log2(max(int(a[d]), 1)) - math.log2(max(int(b[d]), 1)))
            for d in self.dims
            if d not in self.exact_dims
        )

    def validate_shape(self, shape: Shape) -> dict[str, int]:
        missing = [d for d in self.dims if d not in shape]
        extra = [d for d in shape if d not in self.dims]
        if missing or extra:
            raise ValueError(
                f"{self.name}: shape needs dims {list(self.dims)}"
                + (f", missing {missing}" if missing else "")
                + (f", unknown {extra}" if extra else "")
            )
        return {d: int(shape[d]) for d in self.dims}


@dataclass(frozen=True)
class Launch:
    """One Triton launch of a config, built once: run it, or only compile it (inputs may
    be meta tensors: the fleet's compile-ahead), or only load its binary into this
    process. A family that launches several kernels per config keeps a list of these, so
    that what is compiled ahead is exactly what its forward runs."""

    fn: Any  # the @triton.jit function
    grid: tuple[int, ...]
    args: tuple
    meta: dict[str, Any]

    def __call__(self) -> None:
        self.fn[self.grid](*self.args, **self.meta)

    def warmup(self) -> Any:
        """Compile without running (``JITFunction.warmup``); the compiled kernel."""
        return self.fn.warmup(*self.args, grid=self.grid, **self.meta)

    def load(self) -> None:
        """Bring the binary into this process as its first launch would (Triton's
        in-memory cache, the GPU module and the launcher), without launching: on the real
        inputs, so that the launch finds it under the same key."""
        init = getattr(self.warmup(), "_init_handles", None)  # lazy until the first launch
        if callable(init):
            init()


class Launches:
    """Mix-in for a family whose config is a fixed sequence of Triton launches. The
    family defines ``_launches(inputs, config) -> (list[Launch], out)`` once; the
    launcher runs them in order and ``compile_only`` / ``load_only`` (the fleet's
    compile-ahead hooks) go over the same list, so what is compiled ahead is exactly what
    later runs."""

    def _launches(self, inputs: Inputs, config: Config) -> tuple[list[Launch], Any]:
        raise NotImplementedError

    def launcher(self, inputs: Inputs, shape: Shape, config: Config) -> Callable[[], Any]:
        launches, out = self._launches(inputs, config)
        # Bound once: indexing a JITFunction by its grid costs host time on every call.
        bound = [(lc.fn[lc.grid], lc.args, lc.meta) for lc in launches]

        def run() -> Any:
            for kernel, args, meta in bound:
                kernel(*args, **meta)
            return out

        run.out = out  # type: ignore[attr-defined]
        return run

    def compile_only(self, inputs: Inputs, shape: Shape, config: Config) -> None:
        """Compile ``config``'s launches as the launcher would launch them, without
        running them. The inputs may be meta tensors: nothing is allocated or launched."""
        for lc in self._launches(inputs, config)[0]:
            lc.warmup()

    def load_only(self, inputs: Inputs, shape: Shape, config: Config) -> None:
        """Bring ``config``'s binaries into this process without launching (``Launch.load``)."""
        for lc in self._launches(inputs, config)[0]:
            lc.load()


class SingleLaunch(Launches):
    """``Launches`` for a family whose config is one Triton launch: it defines
    ``_launch(inputs, config) -> (jit_fn, grid, args, meta, out)``."""

    def _launch(self, inputs: Inputs, config: Config) -> tuple[Any, tuple, tuple, dict, Any]:
        raise NotImplementedError

    def _launches(self, inputs: Inputs, config: Config) -> tuple[list[Launch], Any]:
        jit_fn, grid, args, meta, out = self._launch(inputs, config)
        return [Launch(jit_fn, grid, args, meta)], out


_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_IMPORT_PATH = re.compile(rf"{_IDENT}(\.{_IDENT})*:{_IDENT}")


def resolve(name_or_path: str) -> type[Kernel]:
    """Find a kernel family class by registered name or ``package.module:Class``."""
    path = BUILTIN.get(name_or_path, name_or_path)
    if not _IMPORT_PATH.fullmatch(path):
        raise KeyError(
            f"unknown kernel {name_or_path!r}: registered are {sorted(BUILTIN)}, "
            "or give an import path 'package.module:Class'"
        )
    module_name, _, attr = path.partition(":")
    cls = getattr(importlib.import_module(module_name), attr)
    if not (isinstance(cls, type) and issubclass(cls, Kernel)):
        raise TypeError(f"{path} is not a harness.kernel.api.Kernel subclass")
    return cls


_instances: dict[str, Kernel] = {}


def get(name_or_path: str) -> Kernel:
    """A cached instance of the family (families are stateless)."""
    if name_or_path not in _instances:
        _instances[name_or_path] = resolve(name_or_path)()
    return _instances[name_or_path]
