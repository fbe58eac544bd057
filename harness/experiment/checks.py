"""The checks of an experiment that need its kernel family: the kernel resolves, each
shape is one of the family's and fits the target devices' memory, the dtypes are the
family's, and the search space names only the family's tunables, with values of their
types, and leaves something to tune. What they resolve (the family, the spaces of the
target hardware keys) is returned, for the run's plan (``harness.experiment.plan``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.experiment.schema import Experiment, ExperimentError
from harness.kernel import api as kernel_api
from harness.measure import hardware
from harness.search import spaces

#: Where the studies of ``hardware: [auto]`` may run: the vendors' spaces are checked.
_AUTO_TARGETS = (("nvidia", "?"), ("amd", "?"), ("cpu", "cpu"))


@dataclass(frozen=True)
class Checked:
    """What the checks resolved: the kernel family, and the search space of each
    (vendor, hardware key) they checked (the plan takes them instead of resolving
    them again)."""

    family: kernel_api.Kernel
    resolved: dict[tuple[str, str], spaces.Space] = field(default_factory=dict)


def _gb(n: float) -> str:
    return f"{n / 1e9:,.3g} GB" if n < 1e15 else f"{n:.3g} bytes"


def _kernel(path: Path, name: str) -> kernel_api.Kernel:
    try:
        return kernel_api.get(name)
    except (KeyError, ImportError, AttributeError, TypeError) as exc:
        raise ExperimentError(path, "kernel", str(exc).strip("'\"")) from None
    except Exception as exc:  # the user's module failed as it was imported
        raise ExperimentError(path, "kernel", f"importing {name!r} failed: "
                              f"{type(exc).__name__}: {exc}") from None


def _check_memory(path: Path, exp: Experiment, kernel: kernel_api.Kernel, i: int,
                  shape: dict[str, int]) -> None:
    """A shape whose inputs and outputs cannot fit the smallest target device would fail
    every trial at allocation: refused here, with the kernel's own byte count: the
    memory its inputs and output occupy (``footprint_bytes``: by default what one call
    moves, more where a family's inputs hold more than one call reads, as the grouped
    GEMM's weights of experts without rows). Both are closed forms, so that a shape
    costs the same to check at any size."""
    keys = [k for k in exp.hardware if k != "auto"]
    budgets = [(k, hardware.memory_bytes(k)) for k in keys]
    if not keys:  # auto: whatever the cluster has, at most the largest device known
        known = [(k, hardware.memory_bytes(k)) for k in hardware.known_keys()]
        budgets = [max(((k, m) for k, m in known if m), key=lambda km: km[1])]
    for dtype in exp.dtypes:
        try:
            need = float(kernel.footprint_bytes(shape, dtype))
        except Exception as exc:  # noqa: BLE001 - a family's model failing is bad input too
            # The run reports the model's figures (roofline) for every trial: a shape the
            # model cannot take (out of memory for a routing of 10^14 rows) cannot run.
            raise ExperimentError(path, f"shapes[{i}]", f"{kernel.name}'s byte model fails "
                                  f"at {kernel.shape_key(shape)} in {dtype}: "
                                  f"{type(exc).__name__}: {str(exc)[:200]}") from None
        for key, mem in budgets:
            if mem and not (need <= mem):  # also catches inf and NaN
                raise ExperimentError(
                    path, f"shapes[{i}]",
                    f"{kernel.name} at {kernel.shape_key(shape)} in {dtype} moves about "
                    f"{_gb(need)} of inputs and outputs, more than the {_gb(mem)} of memory "
                    f"of {key}" + ("" if keys else " (the largest device known, for 'auto')"))


def _check_space(path: Path, exp: Experiment, kernel: kernel_api.Kernel
                 ) -> dict[tuple[str, str], spaces.Space]:
    raw = exp.search_space
    sections: list[tuple[str, dict[str, Any]]] = [("search_space.params", raw.get("params") or {})]
    for group in ("vendors", "hardware"):
        for name, sec in (raw.get(group) or {}).items():
            sections.append((f"search_space.{group}.{name}.params",
                             (sec or {}).get("params") or {}))
    for where, params in sections:
        for name, choices in params.items():
            if choices is None and name not in kernel.declared_tunables():
                raise ExperimentError(path, f"{where}.{name}",
                                      kernel.check_tunables({name: 0}) or "unknown tunable")
            for j, value in enumerate(choices or []):
                why = kernel.check_tunables({name: value})
                if why:
                    raise ExperimentError(path, f"{where}.{name}[{j}]", why)
    keys = [k for k in exp.hardware if k != "auto"]
    targets = [(hardware.vendor_of(k), k) for k in keys] or list(_AUTO_TARGETS)
    out: dict[tuple[str, str], spaces.Space] = {}
    for vendor, key in targets:
        try:
            space = spaces.resolve([spaces.for_kernel(kernel), raw], vendor, key,
                                   where="search_space")
        except ValueError as exc:
            raise ExperimentError(path, "search_space", str(exc)) from None
        if not space:
            on = f"on {key}" if key != "?" else f"on {vendor} GPUs"
            raise ExperimentError(path, "search_space", f"nothing to tune {on}: every tunable "
                                  f"of {kernel.name} was removed (null) or none is declared")
        out[(vendor, key)] = space
    return out


def check_semantics(path: str | Path, exp: Experiment,
                    family: kernel_api.Kernel | None = None) -> Checked:
    """Checks that need the kernel family: it resolves, shapes fit, dtypes and space.
    ``family``: the one ``exp.kernel`` names, where the caller resolved it already."""
    path = Path(path)
    kernel = family if family is not None else _kernel(path, exp.kernel)
    for i, shape in enumerate(exp.shapes):
        try:
            kernel.validate_shape(shape)
        except ValueError as exc:
            raise ExperimentError(path, f"shapes[{i}]", str(exc)) from None
        if any(v <= 0 for v in shape.values()):
            raise ExperimentError(path, f"shapes[{i}]", "dimensions must be positive")
        _check_memory(path, exp, kernel, i, shape)
    for i, dt in enumerate(exp.dtypes):
        if dt not in kernel.dtypes:
            raise ExperimentError(path, f"dtypes[{i}]",
                                  f"{kernel.name} supports {list(kernel.dtypes)}")
    return Checked(kernel, _check_space(path, exp, kernel))

