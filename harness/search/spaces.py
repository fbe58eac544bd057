"""Search spaces: the tunables of a kernel family, as data.

A space file ``search_spaces/<kernel>.yaml`` looks like::

    params:                 # every tunable and its choices
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
then its hardware key's section. An experiment YAML may add a ``search_space`` of the
same structure, applied on top.
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

Space = dict[str, list[Any]]

REPO_SPACES = Path(__file__).resolve().parents[2] / "search_spaces"


def space_file(kernel: str) -> Path | None:
    """The space YAML shipped for ``kernel`` (repo checkout or installed package)."""
    local = REPO_SPACES / f"{kernel}.yaml"
    if local.is_file():
        return local
    try:
        res = resources.files("search_spaces") / f"{kernel}.yaml"
        if res.is_file():
            return Path(str(res))
    except ModuleNotFoundError:
        pass
    return None


def load_raw(kernel: str) -> dict[str, Any]:
    path = space_file(kernel)
    if path is None:
        return {}
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a search space must be a mapping")
    return data


def for_kernel(kernel: Any) -> dict[str, Any]:
    """The shipped space of a kernel family instance (file first, then its ``space``)."""
    raw = load_raw(kernel.space_name or kernel.name)
    return raw or dict(kernel.space)


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
    """The space one study samples from. Each layer (the shipped file, then the
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
