"""The kernel family base class and what a family declares, each once: its typed tunables
(from which the search space, the default config and the docs table are derived), its
shapes and dtypes, the cases ``kharness bench`` measures, and its optional hooks.

A family is a class that knows how to build inputs for a shape, compute a reference,
launch one configuration of its Triton kernel, and model its own cost. How a name finds
the class is ``harness.kernel.registry``'s job; how a config's Triton launches are built
once for running, compiling ahead and loading is ``harness.kernel.launch``'s.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

Shape = Mapping[str, int]
Config = Mapping[str, Any]
Inputs = dict[str, Any]


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

Choices = tuple[Any, ...]


def _choices(value: Any, where: str) -> Choices:
    if isinstance(value, (list, tuple)):
        return tuple(value)
    raise TypeError(f"{where}: choices are a tuple or list of values, not {value!r}")


@dataclass(frozen=True)
class Tunable:
    """One tunable of a kernel family, declared once.

    ``choices``: the values the search tries (empty: searched only where a ``vendors`` or
    ``hardware`` section gives values). ``vendors`` / ``hardware``: per vendor (nvidia,
    amd, cpu) and per hardware key (H100, V710, cpu, ...) the values there instead, or
    None to leave the tunable out there; applied in that order, as an experiment's
    ``search_space`` sections are. ``default``: its value in the default config (None:
    not in it). ``doc``: one line for the docs table.

    What a config may hold: ``type`` (int, float, str, bool), ``allowed`` (a closed set)
    and ``minimum``. Left out, they follow from the values above: their common type;
    strings and booleans as the closed set seen; numbers non-negative where all seen are.
    """

    choices: Choices = ()
    default: Any = None
    doc: str = ""
    vendors: Mapping[str, Choices | None] = field(default_factory=dict)
    hardware: Mapping[str, Choices | None] = field(default_factory=dict)
    type: str | None = None
    allowed: Choices | None = None
    minimum: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "choices", _choices(self.choices, "Tunable"))
        for group in ("vendors", "hardware"):
            sections = {k: None if v is None else _choices(v, f"Tunable {group}.{k}")
                        for k, v in dict(getattr(self, group)).items()}
            object.__setattr__(self, group, sections)
        if self.allowed is not None:
            object.__setattr__(self, "allowed", _choices(self.allowed, "Tunable allowed"))
        if self.type is not None and self.type not in TUNABLE_TYPES:
            raise TypeError(f"Tunable type {self.type!r}: one of {sorted(TUNABLE_TYPES)}")

    def values(self) -> list[Any]:
        """Every value the declaration names: default, choices, sections, allowed."""
        out = [] if self.default is None else [self.default]
        out.extend(self.choices)
        for sections in (self.vendors, self.hardware):
            for choices in sections.values():
                out.extend(choices or ())
        out.extend(self.allowed or ())
        return out

    def resolved(self) -> Tunable:
        """This declaration with ``type``, ``allowed`` and ``minimum`` filled in from its
        values where it leaves them out."""
        seen = self.values()
        inferred = infer_tunable(seen)
        if inferred is None:
            return self
        kind = self.type or inferred.type
        allowed = self.allowed
        if allowed is None and kind == inferred.type:
            allowed = inferred.allowed
        minimum = self.minimum
        if minimum is None and kind == inferred.type:
            minimum = inferred.minimum
        return replace(self, type=kind, allowed=allowed, minimum=minimum)

    def why_not(self, value: Any) -> str | None:
        """Why ``value`` cannot be a value of this tunable (None if it can)."""
        if self.type is None:
            return None  # no common type: any scalar goes
        want = TUNABLE_TYPES[self.type]
        # bool is an int to Python, never to a kernel; an int is a fine float.
        ok = (isinstance(value, want) and not (want is not bool and isinstance(value, bool))
              ) or (want is float and isinstance(value, int) and not isinstance(value, bool))
        if not ok:
            return f"{value!r} is not of type {self.type}"
        if want is float and not math.isfinite(value):
            return f"{value!r} is not a finite number"
        if self.allowed is not None and value not in self.allowed:
            return f"{value!r} is not one of {list(self.allowed)}"
        if self.minimum is not None and value < self.minimum:
            return f"{value!r} is below the minimum {self.minimum:g}"
        return None


def infer_tunable(values: list[Any]) -> Tunable | None:
    """The declaration that a tunable's values imply: their common type; strings and
    booleans as the closed set seen, numbers non-negative where all seen are. None where
    the values share no type (then nothing is checked)."""
    if not values:
        return None
    if all(isinstance(v, bool) for v in values):
        return Tunable(type="bool", allowed=(False, True))
    if all(isinstance(v, str) for v in values):
        return Tunable(type="str", allowed=tuple(dict.fromkeys(values)))
    if any(isinstance(v, bool) for v in values):
        return None
    kind = "int" if all(isinstance(v, int) for v in values) else (
        "float" if all(isinstance(v, (int, float)) for v in values) else None)
    if kind is None:
        return None
    return Tunable(type=kind, minimum=0 if all(v >= 0 for v in values) else None)


def tunables_from_space(space: Mapping[str, Any], default_config: Mapping[str, Any]
                        ) -> dict[str, Tunable]:
    """Tunables from a space in the structure of an experiment's ``search_space``
    (``params`` / ``vendors`` / ``hardware``) and a default config: the form a family
    may still give instead of ``tunables``."""
    names: dict[str, dict[str, Any]] = {}
    for name, choices in (space.get("params") or {}).items():
        names.setdefault(name, {"vendors": {}, "hardware": {}})["choices"] = choices or ()
    for group in ("vendors", "hardware"):
        for key, section in (space.get(group) or {}).items():
            for name, choices in ((section or {}).get("params") or {}).items():
                names.setdefault(name, {"vendors": {}, "hardware": {}})[group][key] = choices
    for name in default_config:
        names.setdefault(name, {"vendors": {}, "hardware": {}})
    return {name: Tunable(decl.get("choices", ()), default=default_config.get(name),
                          vendors=decl["vendors"], hardware=decl["hardware"])
            for name, decl in names.items()}


@dataclass(frozen=True)
class BenchCase:
    """One case ``kharness bench`` measures: a named seed shape of the family in one of
    its dtypes. ``compile=False`` leaves out the torch.compile baseline where compiling it
    is impractical, and says why (``why``); ``max_autotune`` adds torch.compile with
    ``mode="max-autotune-no-cudagraphs"`` as its own row."""

    shape: str
    dtype: str
    compile: bool = True
    max_autotune: bool = False
    why: str = ""


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
    """One kernel family. Subclasses set the class attributes and the abstract methods;
    the other methods are hooks with documented defaults."""

    name: ClassVar[str]
    #: Shape dimensions, in the order used in shape keys.
    dims: ClassVar[tuple[str, ...]]
    #: Dimensions that must match exactly when a pack entry is reused for another shape;
    #: the others are matched by nearest distance in log space.
    exact_dims: ClassVar[tuple[str, ...]] = ()
    dtypes: ClassVar[tuple[str, ...]] = ("bf16", "fp16", "fp32")
    #: The tunables, typed, by name: the search space (``search_space``), the default
    #: config and the docs table all come from here.
    tunables: ClassVar[Mapping[str, Tunable]] = {}
    #: The config used when no pack entry exists: the tunables' defaults. A class sets it
    #: only to give inherited tunables other defaults (a sibling family). It must pass
    #: ``check_config``.
    default_config: ClassVar[dict[str, Any]] = {}
    #: Named seed shapes (benchmarks and examples). ``test`` is the interpreter-sized one.
    shapes: ClassVar[dict[str, dict[str, int]]] = {}
    #: The cases ``kharness bench`` measures, on named shapes of ``shapes``.
    bench: ClassVar[tuple[BenchCase, ...]] = ()
    #: Why torch.compile of ``eager`` is impractical for this family (it does not finish
    #: compiling in minutes, say); empty: it is timed. Where set, runs leave out the
    #: torch.compile baseline unless an experiment asks for it (``baselines.compile``),
    #: and ``kharness bench`` leaves it out of every case.
    no_compile_baseline: ClassVar[str] = ""
    #: Whether ``compile_only`` compiles this family's configs (the fleet then compiles
    #: them ahead, in child processes). True where a class defines ``compile_only``.
    compiles_ahead: ClassVar[bool] = False
    #: Older form of ``tunables``: a space in the structure of an experiment's
    #: ``search_space``, read once, with ``default_config``, into ``tunables``.
    space: ClassVar[dict[str, Any]] = {}
    _declared: ClassVar[dict[str, Tunable]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.__dict__
        # Declarations as written (types inferred afresh below): a subclass that gives
        # other defaults is judged by its own values, not by types its parent inferred.
        decls = dict(own["tunables"]) if "tunables" in own else dict(cls._declared)
        if own.get("space"):
            typed = own.get("tunables") or {}
            decls = {**tunables_from_space(cls.space, cls.default_config), **typed}
        if "default_config" in own:  # other defaults for the (inherited) tunables
            given = own["default_config"]
            decls = {name: replace(t, default=given.get(name)) for name, t in decls.items()}
            decls.update({name: Tunable(default=v) for name, v in given.items()
                          if name not in decls})
        cls._declared = decls
        cls.tunables = {name: t.resolved() for name, t in decls.items()}
        if "default_config" not in own:
            cls.default_config = {name: t.default for name, t in cls.tunables.items()
                                  if t.default is not None}
        if "compile_only" in own and "compiles_ahead" not in own:
            cls.compiles_ahead = True

    @classmethod
    def declaration_error(cls) -> str | None:
        """What is wrong with the class's declarations (None if nothing): checked once,
        when a name resolves to it."""
        if not isinstance(getattr(cls, "name", None), str) or not cls.name:
            return "sets no name"
        if not getattr(cls, "dims", None):
            return "sets no dims"
        for name, tunable in cls.tunables.items():
            if name in cls.default_config:
                why = tunable.why_not(cls.default_config[name])
                if why:
                    return f"default_config[{name!r}]: {why}"
        for case in cls.bench:
            if case.shape not in cls.shapes:
                return f"bench case {case}: no shape {case.shape!r} in shapes"
            if case.dtype not in cls.dtypes:
                return f"bench case {case}: {case.dtype} is not one of dtypes {cls.dtypes}"
            if case.max_autotune and not case.compile:
                return f"bench case {case}: max_autotune needs compile"
            if not case.compile and not (case.why or cls.no_compile_baseline):
                return f"bench case {case}: compile=False says why"
        return None

    @classmethod
    def search_space(cls) -> dict[str, Any]:
        """The family's search space, from its tunables, in the structure of an
        experiment's ``search_space``: ``params`` (the base choices), then ``vendors``
        and ``hardware`` sections (a null removes the tunable there)."""
        out: dict[str, Any] = {"params": {n: list(t.choices)
                                          for n, t in cls.tunables.items() if t.choices}}
        for group in ("vendors", "hardware"):
            sections: dict[str, Any] = {}
            for name, t in cls.tunables.items():
                for key, choices in getattr(t, group).items():
                    params = sections.setdefault(key, {"params": {}})["params"]
                    params[name] = None if choices is None else list(choices)
            if sections:
                out[group] = sections
        return out

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
        the benchmark: each maps (inputs, shape) to a zero-arg callable. Default: none."""
        return {}

    @abstractmethod
    def launcher(self, inputs: Inputs, shape: Shape, config: Config) -> Callable[[], Any]:
        """Return a callable that launches ``config`` once and returns the output.

        Work that an application would do once (allocating outputs, building
        descriptors) belongs before the returned callable, not inside it. A callable
        that writes into an output allocated here may name it as ``fn.out``: the
        measurement then fills it with NaN before timing and needs no separate first call.
        """

    # -- compiling ahead (the fleet's hooks) ------------------------------------------
    def compile_only(self, inputs: Inputs, shape: Shape, config: Config) -> None:
        """Compile ``config``'s Triton kernels as the launcher would launch them, without
        running them; ``inputs`` are meta tensors (layout and dtype, no memory). The
        fleet calls it in child processes, ahead of the GPU, where ``compiles_ahead``.
        Default: nothing (the first launch compiles, on the GPU's worker). The mix-ins of
        ``harness.kernel.launch`` define it from the launches the launcher makes."""
        return None

    def load_only(self, inputs: Inputs, shape: Shape, config: Config) -> None:
        """Bring ``config``'s compiled binaries into this process without launching (the
        worker does it for the next config while the current one is timed). Default:
        nothing (the first launch loads them)."""
        return None

    # -- cost model -------------------------------------------------------------------
    @abstractmethod
    def flops(self, shape: Shape) -> float:
        """Useful floating-point operations of one call."""

    @abstractmethod
    def bytes_moved(self, shape: Shape, dtype: str) -> float:
        """The fewest bytes one call must move through device memory."""

    def footprint_bytes(self, shape: Shape, dtype: str) -> float:
        """The device memory the inputs and output of one call occupy: what must fit the
        device (checked before a run starts). Default: ``bytes_moved``; a family whose
        inputs hold more than one call reads says so. A closed form: a shape costs the
        same to check at any size."""
        return self.bytes_moved(shape, dtype)

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

    def is_default(self, config: Config) -> bool:
        """Whether ``config``, over the family's defaults, is its default config."""
        return {**self.default_config, **config} == dict(self.default_config)

    def check_dtype(self, config: Config, dtype: str) -> str | None:
        """Why ``config`` can never meet the accuracy of ``dtype`` inputs by construction
        (None if it may): a state stored in fp16 for fp32 inputs, say. Static pruning as
        ``check_config``: such a config costs no trial (a Mamba-2 SSD fp32 study on an
        H200 spent 12 of its 24 trials on configs that failed so)."""
        return None

    def check(self, config: Config, shape: Shape, dtype: str,
              device: DeviceSpec) -> str | None:
        """``check_config``, then ``check_dtype``: why a study of ``shape`` and ``dtype``
        on ``device`` prunes ``config`` statically (None: it runs)."""
        return self.check_config(config, shape, device) or self.check_dtype(config, dtype)

    def declared_tunables(self) -> Mapping[str, Tunable]:
        """Every tunable the family knows, typed (``tunables``)."""
        return self.tunables

    def check_tunables(self, config: Config) -> str | None:
        """Why ``config`` names a tunable the family does not have, or gives one a value
        of the wrong type (None if neither). ``check_config`` then judges the values."""
        declared = self.declared_tunables()
        for name, value in config.items():
            if name not in declared:
                return (f"unknown tunable {name!r} (the tunables of {self.name}: "
                        f"{', '.join(sorted(declared))})")
            why = declared[name].why_not(value)
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
