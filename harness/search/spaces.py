"""Search spaces: the tunables of a kernel family and their choices, as data.

A family's space comes from its declared tunables (``Kernel.search_space``); an
experiment's ``search_space`` has the same structure and applies on top::

    params:                 # tunables and their choices
      BLOCK_M: [64, 128, 256]
      num_warps: [4, 8]
    vendors:                # optional: per-vendor overrides (nvidia, amd, cpu)
      amd:
        params:
          waves_per_eu: [0, 2]
          USE_TMA: null     # null removes a tunable for this vendor
    hardware:               # optional: per-hardware-key overrides, applied last
      cpu:
        params:
          BLOCK_M: [64]

Each study resolves the space for its own hardware: base, then its vendor's section,
then its hardware key's section; the family's layer first, then the experiment's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

Space = dict[str, list[Any]]


def for_kernel(kernel: Any) -> dict[str, Any]:
    """The space a kernel family declares (``Kernel.search_space``)."""
    return kernel.search_space()


def _apply(space: Space, overrides: Mapping[str, Any] | None, where: str) -> None:
    for name, choices in (overrides or {}).items():
        if choices is None:
            space.pop(name, None)
            continue
        if not isinstance(choices, list) or not choices:
            raise ValueError(f"{where}: '{name}' must be a non-empty list of choices")
        space[name] = list(choices)


def resolve(
    layers: list[Mapping[str, Any]],
    vendor: str,
    hardware: str,
    where: str = "search space",
) -> Space:
    """The space one study samples from. Each layer (the family's, then the
    experiment's inline ``search_space``) applies its base, vendor and hardware
    sections in that order, so later layers override earlier ones."""
    space: Space = {}
    for raw in layers:
        _apply(space, raw.get("params"), f"{where}: params")
        vendor_sec = (raw.get("vendors") or {}).get(vendor) or {}
        _apply(space, vendor_sec.get("params"), f"{where}: vendors.{vendor}.params")
        hw_sec = (raw.get("hardware") or {}).get(hardware) or {}
        _apply(space, hw_sec.get("params"), f"{where}: hardware.{hardware}.params")
    return space


def grid_size(space: Space) -> int:
    n = 1
    for choices in space.values():
        n *= len(choices)
    return n
