"""Warm start: seed a new study with configs that won elsewhere.

Where a shape's winner is usually close to its neighbours' (the M of a grouped GEMM, the
L of a scan) and a GPU's to another GPU's of the same architecture, the first trials of a
study are best spent on those winners: this hardware's pack entries for the same shape (a
re-tune, after a Triton upgrade say) and the nearest other shapes first, then other
hardware's entries for the same (or nearest) shape. Only configs
that are points of the study's space and pass the kernel's constraints for the target
device are used; the study's sampler then goes on from there.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from harness.kernel.api import DeviceSpec, Kernel, Shape
from harness.packs import format as packfmt

log = logging.getLogger(__name__)


def _entries(packs_dir: Path, hardware: str, kernel: Kernel, dtype: str
             ) -> list[tuple[dict[str, int], dict[str, Any]]]:
    path = packfmt.pack_path(packs_dir, hardware, kernel.name)
    if not path.is_file():
        return []
    try:
        data = packfmt.read(path)
    except packfmt.PackError as exc:  # a broken pack seeds nothing; lookup reports it
        log.warning("warm start: %s", exc)
        return []
    # Packs frozen before a tunable was added lack its key: the kernel's default fills it
    # in, as it does when the pack's config runs.
    return [(kernel.parse_shape_key(k), {**kernel.default_config, **e["config"]})
            for k, e in packfmt.entries(data, kernel.name, dtype).items()]


def seeds_from_packs(packs_dir: str | Path, kernel: Kernel, dtype: str, hardware: str,
                     shape: Shape, space: Mapping[str, list[Any]], device: DeviceSpec,
                     limit: int = 4) -> list[tuple[dict[str, Any], str]]:
    """Up to ``limit`` (config, where it comes from), best first."""
    root = Path(packs_dir)
    ranked: list[tuple[tuple[int, float], dict[str, Any], str]] = []
    for d in sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []:
        same_hw = d.name == hardware
        for other, config in _entries(root, d.name, kernel, dtype):
            dist = kernel.shape_distance(shape, other)
            if dist == float("inf"):
                continue
            where = f"{d.name} {kernel.shape_key(other)}"
            ranked.append(((0 if same_hw else 1, dist), config, where))
    out: list[tuple[dict[str, Any], str]] = []
    seen: set[str] = set()
    for _, config, where in sorted(ranked, key=lambda r: r[0]):
        point = {k: config.get(k) for k in space}
        if any(point[k] not in space[k] for k in space):
            continue  # outside this study's space
        if kernel.check({**kernel.default_config, **point}, shape, dtype, device):
            continue  # cannot run here (shared memory, TMA, ...) or meet dtype's accuracy
        key = repr(sorted(point.items()))
        if key not in seen:
            seen.add(key)
            out.append((point, where))
        if len(out) >= limit:
            break
    return out


def incumbent(packs_dir: str | Path, kernel: Kernel, dtype: str, hardware: str,
              shape: Shape) -> dict[str, Any] | None:
    """The config this hardware's pack holds now for exactly ``shape`` (full config, with
    the kernel's defaults for keys it was frozen without), or None."""
    for other, config in _entries(Path(packs_dir), hardware, kernel, dtype):
        if kernel.shape_key(other) == kernel.shape_key(shape):
            return dict(config)
    return None
