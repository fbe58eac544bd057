"""Runtime lookup: the frozen config for this device and these arguments.

No tuning happens here, and nothing heavier than torch is imported. The device is
detected once; each (hardware, kernel) pack is loaded lazily, validated, and cached.
"""

from __future__ import annotations

import math
import os
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import hardware, kernel_api
from harness.packs import format as fmt

SHIPPED = Path(__file__).resolve().parents[2] / "packs"


class PackWarning(UserWarning):
    """Lookup fell back (no pack, bad pack, or no entry for the shape)."""


@dataclass(frozen=True)
class Hit:
    config: dict[str, Any]
    source: str  # "exact", "nearest" or "default"
    shape_key: str | None  # the pack entry used, if any
    path: str | None


_lock = threading.Lock()
_cache: dict[tuple[str, str], tuple[dict[str, Any] | None, str | None]] = {}
_warned: set[tuple] = set()
_paths: list[Path] | None = None
stats = {"exact": 0, "nearest": 0, "default": 0}


def search_path() -> list[Path]:
    """Where packs are looked for, first match wins: ``configure()``, then
    ``$HARNESS_PACKS`` (os.pathsep-separated), then ./packs, then the shipped packs."""
    if _paths is not None:
        return list(_paths)
    env = os.environ.get("HARNESS_PACKS")
    if env:
        return [Path(p) for p in env.split(os.pathsep) if p]
    return [Path.cwd() / "packs", SHIPPED]


def configure(paths: list[str | Path] | None) -> None:
    """Set the pack search path (None: back to the default) and drop cached packs."""
    global _paths
    with _lock:
        _paths = [Path(p) for p in paths] if paths is not None else None
        _cache.clear()
        _warned.clear()


def _warn_once(key: tuple, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, PackWarning, stacklevel=4)


def load(hardware_key: str, kernel: str) -> tuple[dict[str, Any] | None, str | None]:
    """The validated pack for (hardware, kernel), or (None, None). Cached."""
    ck = (hardware_key, kernel)
    with _lock:
        if ck in _cache:
            return _cache[ck]
    data: dict[str, Any] | None = None
    where: str | None = None
    for root in search_path():
        path = fmt.pack_path(root, hardware_key, kernel)
        if not path.is_file():
            continue
        try:
            data = fmt.read(path)
            where = str(path)
        except fmt.PackError as exc:
            _warn_once(("bad", str(path)), f"ignoring pack: {exc}; using defaults")
        break
    with _lock:
        _cache[ck] = (data, where)
    return data, where


def lookup_entry(kernel: str, dtype: str = "bf16", hardware_key: str | None = None,
                 **shape: int) -> Hit:
    """Exact shape, then the kernel's nearest shape, then its default config."""
    fam = kernel_api.get(kernel)
    hw = hardware_key or hardware.current_device().key
    shape = fam.validate_shape(shape)
    skey = fam.shape_key(shape)
    data, where = load(hw, fam.name)
    entries = fmt.entries(data, fam.name, dtype) if data else {}
    if skey in entries:
        stats["exact"] += 1
        return Hit(dict(entries[skey]["config"]), "exact", skey, where)
    best, best_d = None, math.inf
    for key in entries:
        try:
            d = fam.shape_distance(shape, fam.parse_shape_key(key))
        except (KeyError, ValueError):
            continue
        if d < best_d:
            best, best_d = key, d
    if best is not None:
        stats["nearest"] += 1
        return Hit(dict(entries[best]["config"]), "nearest", best, where)
    stats["default"] += 1
    why = (f"no {hw} pack for {fam.name}" if data is None
           else f"{where} has no {dtype} entry near {skey}")
    _warn_once(("miss", hw, fam.name, dtype, skey),
               f"{why}: using {fam.name}'s default config")
    return Hit(dict(fam.default_config), "default", None, None)


def lookup(kernel: str, dtype: str = "bf16", hardware_key: str | None = None,
           **shape: int) -> dict[str, Any]:
    """The frozen config for ``kernel`` at ``shape`` on this device (see lookup_entry)."""
    return lookup_entry(kernel, dtype, hardware_key, **shape).config
