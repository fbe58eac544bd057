"""The Triton and torch versions a pack is compared against."""

from __future__ import annotations

import sys
from functools import cache


def release(version: str) -> str:
    """'2.11.0+cu130' -> '2.11.0': local build suffixes do not change generated code."""
    return version.split("+", 1)[0].strip()


@cache
def runtime_versions() -> dict[str, str | None]:
    """The Triton and torch versions of this process (without importing them)."""
    out: dict[str, str | None] = {}
    for name in ("triton", "torch"):
        mod = sys.modules.get(name)
        v = getattr(mod, "__version__", None) if mod is not None else None
        if v is None:
            import importlib.metadata  # ~20 ms: only when the module is not loaded yet

            try:
                v = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                v = None
        out[name] = str(v) if v else None
    return out
