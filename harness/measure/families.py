"""GPU families: which hardware keys share an architecture, so that a GPU nobody tuned for
can use a sibling's pack (``harness.packs`` lookup) instead of the kernel's defaults.

The registry is keyed by architecture: the compute capability (``sm_90``) or gfx target
(``gfx942``) that the device reports. Each family lists its members (hardware keys, in
a fixed order) with two datasheet figures, and name patterns for parts of that
architecture that have no key of their own (a device name or key such as
``NVIDIA-A800-SXM4-80GB``). A key belongs to at most one family.

Which sibling first (``siblings``): the one whose SM count and peak memory bandwidth are
closest to this GPU's, as the sum of ``|ln(mine / theirs)|`` over the figures known on
both sides (this GPU's SM count as detected where the device is at hand, else the
table's); equal distances, or nothing known, keep the table's order. SM count decides
how a grid fills the GPU and bandwidth where a kernel turns memory-bound: the two
figures that move a tile choice between parts of one architecture, whose shared memory,
registers and instructions are the same.

Imported by the runtime: torch-free, no Ray/Optuna/MLflow.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from harness.kernel.api import DeviceSpec


@dataclass(frozen=True)
class Member:
    """A hardware key of a family, with the figures that order its siblings."""

    key: str
    sm_count: int
    bandwidth_gbs: float  # peak memory bandwidth of the datasheet, GB/s
    name: str = ""  # the device name it reports (for static specs)


@dataclass(frozen=True)
class Family:
    """One architecture: what its members share, and who they are."""

    arch: str  # the registry key: "sm_90", "gfx942"
    name: str  # "Hopper"
    vendor: str  # "nvidia", "amd"
    smem_per_block: int  # bytes a block may use, the same on every member
    members: tuple[Member, ...]  # the fixed order breaks ties
    #: Regexes (case-insensitive) for device names or keys of this architecture that
    #: are not members, matched where the device's architecture is not known.
    patterns: tuple[str, ...] = ()
    has_tma: bool = False
    has_wgmma: bool = False

    def member(self, key: str) -> Member | None:
        return next((m for m in self.members if m.key == key), None)


_REGISTRY: dict[str, Family] = {}
#: Architecture -> family (read-only; ``register`` adds to it).
FAMILIES: Mapping[str, Family] = MappingProxyType(_REGISTRY)
_lock = threading.Lock()
_order_cache: dict[tuple, tuple[str, ...]] = {}


def register(family: Family) -> Family:
    """Add (or replace, for the same ``arch``) a family. ValueError where a member key
    already belongs to another architecture's family, or a pattern is not a regex."""
    for p in family.patterns:
        try:
            re.compile(p)
        except re.error as exc:
            raise ValueError(f"family {family.arch}: pattern {p!r}: {exc}") from None
    with _lock:
        for other in _REGISTRY.values():
            if other.arch == family.arch:
                continue
            taken = {m.key for m in other.members} & {m.key for m in family.members}
            if taken:
                raise ValueError(f"family {family.arch}: {sorted(taken)} already belong to "
                                 f"{other.arch} ({other.name})")
        _REGISTRY[family.arch] = family
        _order_cache.clear()
    return family


def family_of(key: str, arch: str | None = None, device_name: str = "") -> Family | None:
    """The family of a GPU: by its architecture where known and registered, else the
    family that has ``key`` as a member, else the first whose pattern matches the device
    name or the key. None: no family (the CPU, an architecture not in the table)."""
    if arch:
        fam = _REGISTRY.get(arch)
        if fam is not None:
            return fam
    for fam in _REGISTRY.values():
        if fam.member(key) is not None:
            return fam
    for fam in _REGISTRY.values():
        for p in fam.patterns:
            if any(re.search(p, text, re.IGNORECASE) for text in (device_name, key) if text):
                return fam
    return None


def _distance(mine: tuple[float | None, float | None], other: Member) -> float:
    total = 0.0
    for a, b in zip(mine, (other.sm_count, other.bandwidth_gbs), strict=True):
        if a and b and a > 0 and b > 0:
            total += abs(math.log(a / b))
    return total


def siblings(key: str, arch: str | None = None, device_name: str = "",
             sm_count: int | None = None) -> tuple[str, ...]:
    """The other members of ``key``'s family, the closest first (see the module doc);
    () without a family. Cached per arguments."""
    ck = (key, arch, device_name, sm_count)
    got = _order_cache.get(ck)
    if got is not None:
        return got
    fam = family_of(key, arch, device_name)
    order: tuple[str, ...] = ()
    if fam is not None:
        me = fam.member(key)
        mine = (sm_count or (me.sm_count if me else None), me.bandwidth_gbs if me else None)
        others = [(i, m) for i, m in enumerate(fam.members) if m.key != key]
        others.sort(key=lambda im: (round(_distance(mine, im[1]), 9), im[0]))
        order = tuple(m.key for _, m in others)
    with _lock:
        _order_cache[ck] = order
    return order


def static_spec(key: str) -> DeviceSpec | None:
    """A DeviceSpec from the family table for a key (a member, or a name its family's
    patterns match): the architecture's shared memory and instructions, the member's SM
    count. None without a family."""
    fam = family_of(key)
    if fam is None:
        return None
    me = fam.member(key)
    return DeviceSpec(key=key, vendor=fam.vendor, name=(me.name if me else "") or key,
                      sm_count=me.sm_count if me else 1, smem_per_block=fam.smem_per_block,
                      has_tma=fam.has_tma, has_wgmma=fam.has_wgmma)


# -- the table ----------------------------------------------------------------------------
# Datasheet figures: SMs (CUs on AMD) and peak memory bandwidth. A part with the same SMs
# and memory as a tuned one shares its key (H200 NVL is H200); one that differs in either
# has its own (H100 PCIe: 114 SMs and HBM2e; H100 NVL: 94 GB at 3.9 TB/s).
_HOPPER_SMEM = 227 * 1024
register(Family(
    "sm_90", "Hopper", "nvidia", _HOPPER_SMEM, (
        Member("H100", 132, 3350, "NVIDIA H100 80GB HBM3"),
        Member("H200", 132, 4800, "NVIDIA H200"),
        Member("H800", 132, 3350, "NVIDIA H800"),
        Member("H100-NVL", 132, 3900, "NVIDIA H100 NVL"),
        Member("H100-PCIe", 114, 2000, "NVIDIA H100 PCIe"),
        Member("GH200", 132, 4000, "NVIDIA GH200 480GB"),  # the 96 GB HBM3 part
        Member("H20", 78, 4000, "NVIDIA H20"),
    ), has_tma=True, has_wgmma=True))
register(Family(
    "sm_80", "Ampere (GA100)", "nvidia", 163 * 1024, (
        Member("A100", 108, 2039, "NVIDIA A100-SXM4-80GB"),
    ), patterns=(r"\bA800\b", r"\bA30\b")))
register(Family(
    "sm_86", "Ampere (GA10x)", "nvidia", 99 * 1024, (
        Member("A10", 72, 600, "NVIDIA A10"),
    ), patterns=(r"\bA40\b", r"\bA6000\b", r"RTX[- ]30[5-9]0")))
register(Family(
    "sm_89", "Ada", "nvidia", 99 * 1024, (
        Member("L40S", 142, 864, "NVIDIA L40S"),
        Member("L4", 58, 300, "NVIDIA L4"),
    ), patterns=(r"\bL40\b", r"RTX[- ]40[5-9]0")))
register(Family(
    "sm_100", "Blackwell", "nvidia", 227 * 1024, (
        Member("B200", 148, 8000, "NVIDIA B200"),
    ), patterns=(r"\bGB200\b",), has_tma=True))
register(Family(
    "gfx942", "CDNA3", "amd", 64 * 1024, (
        Member("MI300X", 304, 5300, "AMD Instinct MI300X"),
        Member("MI325X", 304, 6000, "AMD Instinct MI325X"),
    )))
register(Family(
    "gfx90a", "CDNA2", "amd", 64 * 1024, (
        Member("MI250", 208, 3277, "AMD Instinct MI250X"),
    ), patterns=(r"\bMI210\b",)))
register(Family(
    "gfx1101", "RDNA3 (Navi 32)", "amd", 64 * 1024, (
        Member("V710", 54, 448, "AMD Radeon PRO V710"),
    )))
