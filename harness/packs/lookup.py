"""Runtime lookup: the frozen config for this device and these arguments.

No tuning happens here, and nothing heavier than torch is imported. The device is
detected once; each (hardware, kernel) pack is loaded lazily, validated, and cached; each
distinct (kernel, dtype, hardware, shape) is resolved once and then served from a plain
dict (the fast path of ``lookup``).

Order: this hardware key's pack (the exact shape, then the kernel's nearest shape,
``Kernel.shape_distance``), then the packs of its GPU family's siblings by the same rule
(``harness.measure.families``: same architecture, the closest sibling first; one warning
per kernel and sibling naming the GPU the pack was tuned on), then the kernel's default
config. A pack is rejected as a whole, with one warning naming the file, if it is
unreadable, fails the schema or its checksum, is filed under the wrong hardware or
kernel, or holds a config that fails the kernel's own ``check_config`` for its shape on
that hardware: lookup then goes on to the next pack in that order and never crashes. That
holds for any bytes and any file type at a pack's place (a directory, a FIFO, a device, a
symlink loop, a file or folder without read permission): whatever is found first is the
pack, and what is not a readable pack is a rejected one.

Bad *arguments* raise, as they always have: an unknown kernel (KeyError), a shape with a
missing or unknown dim, or a dim that is not an integer (ValueError: ``M=1.9`` is an
error, not ``M=1``), a hardware key that is not a name (ValueError).

Entries tuned under another Triton or torch release (provenance ``triton``/``torch``, local
build suffixes such as ``+cu130`` ignored) are used with one warning per file; strict mode
(``configure(strict=True)`` or ``HARNESS_PACKS_STRICT=1``) refuses them and uses the
default config instead, also with one warning per file.

A lookup that falls back to the default config is a *miss*; one served by the nearest
entry is a *near-miss*; one served by a sibling GPU's pack is a *family* hit, a miss for
this GPU. All are counted (``stats``) and recorded per distinct shape
(``misses()``); ``write_misses(path)`` turns them into experiment YAML for tuning those
shapes later, and ``HARNESS_PACKS_MISSES=path`` does that when the interpreter exits.
"""

from __future__ import annotations

import math
import numbers
import operator
import os
import sys
import threading
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Any

from harness.kernel import api as kernel_api
from harness.measure import families, hardware
from harness.packs import format as fmt
from harness.packs import verify
from harness.packs.versions import release, runtime_versions

#: The packs shipped with the harness: package data, read-only (a run never writes here).
SHIPPED = Path(str(resources.files("harness.packs").joinpath("shipped")))
_HERE = str(Path(__file__).resolve().parents[1])  # harness/: frames to skip in warnings


class PackWarning(UserWarning):
    """Lookup fell back (no pack, bad pack, no entry for the shape) or used an entry tuned
    under another Triton/torch version."""


@dataclass(frozen=True)
class Hit:
    config: dict[str, Any]
    #: "exact" or "nearest": this hardware's pack; "family": a sibling GPU's pack (its
    #: exact or nearest entry); "default": the kernel's default config.
    source: str
    shape_key: str | None  # the pack entry used, if any
    path: str | None
    hardware: str | None = None  # the hardware key of the pack used (a sibling's: family)


@dataclass
class _Entry:
    key: str
    shape: dict[str, int]
    config: dict[str, Any]
    version_note: str | None  # why it was tuned under "another version", else None
    device: str | None = None  # the device name it was tuned on (provenance)


@dataclass
class _Pack:
    data: dict[str, Any]
    where: str
    by_dtype: dict[str, list[_Entry]] = field(default_factory=dict)
    rejected: str | None = None  # why the file was rejected (then it has no entries)


_lock = threading.RLock()
_cache: dict[tuple[str, str], _Pack | None] = {}
# The fast path: (kernel, dtype, hardware_key, shape items) -> [config, source, miss record].
_fast: dict[tuple, list] = {}
_warned: set[tuple] = set()
_paths: list[Path] | None = None
_strict: bool | None = None
_UNSET: Any = object()

#: Lookups served, by source ("nearest" = near-misses, "default" = misses). Counted on
#: every call (without a lock: the counts are approximate under threads).
stats = {"exact": 0, "nearest": 0, "family": 0, "default": 0}
# (kernel, dtype, hardware, shape key) -> record; see misses().
_misses: dict[tuple[str, str, str, str], dict[str, Any]] = {}


# -- configuration ------------------------------------------------------------------------
def search_path() -> list[Path]:
    """Where packs are looked for, first match wins: ``configure()``, then
    ``$HARNESS_PACKS`` (os.pathsep-separated), then ./packs (the user's: where a run
    writes by default), then the shipped packs (package data)."""
    if _paths is not None:
        return list(_paths)
    env = os.environ.get("HARNESS_PACKS")
    if env:
        return [Path(p) for p in env.split(os.pathsep) if p]
    try:
        cwd = Path.cwd()
    except OSError:  # the working directory was removed: it has no packs
        return [SHIPPED]
    return [cwd / "packs", SHIPPED]


def strict() -> bool:
    """Whether entries tuned under another Triton/torch version are refused."""
    if _strict is not None:
        return _strict
    return os.environ.get("HARNESS_PACKS_STRICT", "").strip().lower() in ("1", "true", "yes")


def _directories(paths: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """``paths`` as a list of Paths; TypeError for a single path (a string would
    otherwise be taken one character at a time) or an item that is not a path."""
    if isinstance(paths, (str, bytes, os.PathLike)):
        raise TypeError(f"packs.configure() takes a list of directories, not one "
                        f"{type(paths).__name__}: configure([{str(paths)!r}])")
    try:
        items = list(paths)
    except TypeError:
        raise TypeError(f"packs.configure() takes a list of directories, not "
                        f"{type(paths).__name__}") from None
    bad = [p for p in items if not isinstance(p, (str, os.PathLike))]
    if bad:
        raise TypeError(f"packs.configure() takes a list of directories: {bad[0]!r} is not "
                        "a path")
    return [Path(p) for p in items]


def configure(paths: Iterable[str | os.PathLike[str]] | None = _UNSET, *,
              strict: bool | None = _UNSET) -> None:
    """Set the pack search path (a list of directories, first match wins; None: back to
    the default) and/or strict mode (None: back to ``$HARNESS_PACKS_STRICT``). Arguments
    not given stay as they are. Drops cached packs and resolved lookups (not the stats or
    the recorded misses). A single path (``configure("packs")``) is a TypeError: pass
    ``["packs"]``. A refused call changes nothing."""
    global _paths, _strict
    new_paths = _directories(paths) if paths is not _UNSET and paths is not None else None
    if strict is not _UNSET and strict is not None and not isinstance(strict, bool):
        raise TypeError(f"packs.configure(strict=...) takes True, False or None, not "
                        f"{strict!r}")
    with _lock:
        if paths is not _UNSET:
            _paths = new_paths
        if strict is not _UNSET:
            _strict = strict
        _cache.clear()
        _fast.clear()
        _warned.clear()


def reset_stats() -> None:
    """Zero ``stats`` and forget the recorded misses."""
    with _lock:
        for k in stats:
            stats[k] = 0
        _misses.clear()
        _fast.clear()  # its slots point at the forgotten miss records


# -- warnings -----------------------------------------------------------------------------
def _stacklevel() -> int:
    """Point a warning at the first frame outside harness/ (the application's call)."""
    level, f = 1, sys._getframe(1)
    while f is not None and f.f_code.co_filename.startswith(_HERE):
        f = f.f_back
        level += 1
    return level


def _warn_once(key: tuple, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, PackWarning, stacklevel=_stacklevel())


# -- versions -----------------------------------------------------------------------------
def _version_note(provenance: dict[str, Any]) -> str | None:
    notes = []
    for name, now in runtime_versions().items():
        tuned = provenance.get(name)
        if not tuned:
            notes.append(f"{name} unrecorded")
        elif now and release(str(tuned)) != release(now):
            notes.append(f"{name} {tuned} (this process: {now})")
    if notes and all(n.endswith("unrecorded") for n in notes) and not strict():
        return None  # nothing to compare against: only strict mode cares
    return ", ".join(notes) or None


# -- loading ------------------------------------------------------------------------------
def _check_pack(data: dict[str, Any], where: str, hw: str, fam: kernel_api.Kernel) -> _Pack:
    """What lookup needs from a pack that passed the schema and checksum: it is for this
    hardware and kernel, and every entry passes ``verify`` (a shape of the kernel, its
    tunables with values of their types, the kernel's own check_config)."""
    if data["hardware"] != hw:
        raise fmt.PackError(f"{where}: the pack is for hardware {data['hardware']!r}, "
                            f"not {hw!r} (copied into the wrong directory?)")
    if data["kernel"] != fam.name:
        raise fmt.PackError(f"{where}: the pack is for kernel {data['kernel']!r}, "
                            f"not {fam.name!r}")
    pack = _Pack(data, where)
    for dtype in data["kernels"].get(fam.name, {}):
        pack.by_dtype.setdefault(dtype, [])
    for dtype, skey, shape, entry in verify.entries(data, where, fam):
        prov = entry.get("provenance") or {}
        device = prov.get("device_name")
        pack.by_dtype[dtype].append(_Entry(skey, shape, dict(entry["config"]),
                                           _version_note(prov),
                                           device if isinstance(device, str) else None))
    return pack


def _load(hw: str, fam: kernel_api.Kernel) -> _Pack | None:
    ck = (hw, fam.name)
    with _lock:
        if ck in _cache:
            return _cache[ck]
        pack = None
        for root in search_path():
            try:
                path = fmt.pack_path(root, hw, fam.name)
            except fmt.PackError as exc:  # a family whose name no file can have
                _warn_once(("name", fam.name), f"no pack: {exc}; using defaults")
                break
            if not fmt.exists(path):
                continue
            # Anything at the pack's place is the pack: read() refuses what is not a
            # regular file, unreadable or too large without blocking. Any other exception
            # (a kernel's own check, bytes no check foresaw) also makes it a rejected
            # pack: the application never crashes on a pack.
            try:
                pack = _check_pack(fmt.read(path), str(path), hw, fam)
            except fmt.PackError as exc:
                why = str(exc)
            except Exception as exc:  # noqa: BLE001 - see above
                why = f"{path}: could not be checked ({type(exc).__name__}: {exc})"
            else:
                break
            _warn_once(("bad", str(path)), f"ignoring pack: {why}; using a sibling GPU's "
                       "pack, else the default config")
            pack = _Pack({}, str(path), rejected=why)
            break  # the first pack found is the one used, good or bad
        _cache[ck] = pack
        return pack


def load(hardware_key: str, kernel: str | kernel_api.Kernel
         ) -> tuple[dict[str, Any] | None, str | None]:
    """The validated pack for (hardware, kernel) and its path, or (None, None). Cached."""
    fam = kernel if isinstance(kernel, kernel_api.Kernel) else kernel_api.get(kernel)
    pack = _load(hardware_key, fam)
    return (pack.data, pack.where) if pack and not pack.rejected else (None, None)


# -- lookup -------------------------------------------------------------------------------
def _record_miss(label: str, fam: kernel_api.Kernel, dtype: str, hw: str, shape: dict,
                 skey: str, source: str, entry: str | None, why: str) -> dict[str, Any]:
    rec = _misses.get((label, dtype, hw, skey))
    if rec is None:
        rec = _misses[(label, dtype, hw, skey)] = {
            "kernel": label, "family": fam.name, "dtype": dtype, "hardware": hw,
            "shape": dict(shape), "shape_key": skey, "calls": 0}
    rec.update(source=source, entry=entry, why=why)
    return rec


def _dim(name: str, value: Any) -> int:
    """A shape dim as an int: ints (numpy's too) and floats of integer value; ValueError
    otherwise. Truncating would serve ``M=1.9`` the entry of ``M=1``. (A value equal to an
    int, 4096.0, is that int everywhere: the cached fast path finds it as such.)"""
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real) and math.isfinite(value) and float(value).is_integer():
        return int(value)
    if not isinstance(value, numbers.Real):
        try:
            return operator.index(value)  # torch.SymInt, 0-d integer tensors
        except TypeError:
            pass
    raise ValueError(f"packs.lookup: {name}={value!r} is not an integer (shape dims are "
                     "integers)")


def _runs_on(fam: kernel_api.Kernel, row: _Entry, spec: kernel_api.DeviceSpec) -> bool:
    """Whether a sibling's entry passes the checks of this GPU (its pack passed them on
    the sibling's): launch options and the kernel's own constraints, at the entry's shape."""
    try:
        return not (verify.launch_options_error(row.config, spec)
                    or fam.check_config(row.config, row.shape, spec))
    except Exception:  # noqa: BLE001 - a kernel's check that fails is a "no"
        return False


def _pick(pack: _Pack | None, fam: kernel_api.Kernel, dtype: str, norm: dict[str, int],
          skey: str, spec: kernel_api.DeviceSpec | None = None
          ) -> tuple[_Entry | None, str, bool]:
    """A pack's entry for the shape: the exact one, else the nearest (entries that fail
    ``spec``'s checks skipped, where given), else None; with why not, and whether that is
    a miss of a usable pack. Strict mode's refusal and the version note warn once per
    file."""
    rows = pack.by_dtype.get(dtype, []) if pack is not None and not pack.rejected else []
    ranked: list[tuple[float, int, _Entry]] = []
    for i, row in enumerate(rows):
        if row.key == skey:
            ranked.append((-1.0, i, row))
            continue
        try:
            d = fam.shape_distance(norm, row.shape)
        except Exception:  # noqa: BLE001 - a kernel's rule on a pack's shape: not near
            continue
        if d < math.inf:
            ranked.append((d, i, row))
    if spec is None:
        best = min(ranked, key=operator.itemgetter(0, 1), default=(0, 0, None))[2]
    else:
        ranked.sort(key=operator.itemgetter(0, 1))
        best = next((row for _, _, row in ranked if _runs_on(fam, row, spec)), None)
    if best is None:
        if pack is None:
            return None, "no pack", False
        if pack.rejected:  # and said so once, naming the file
            return None, f"{pack.where} was rejected", False
        return None, f"{pack.where} has no {dtype} entry near {skey}", True
    if best.version_note and strict():
        _warn_once(("strict", pack.where),
                   f"{pack.where}: strict mode refuses entries tuned under another version "
                   f"({best.key}: {best.version_note}); using a sibling GPU's pack, else "
                   f"{fam.name}'s default config for them")
        return None, f"strict mode refused {best.key} ({best.version_note})", False
    if best.version_note:
        _warn_once(("version", pack.where),
                   f"{pack.where}: using entries tuned under another version ({best.key}: "
                   f"{best.version_note}); set HARNESS_PACKS_STRICT=1 to refuse them")
    return best, "", False


def _siblings(hw: str, explicit: bool) -> tuple[str, ...]:
    """The sibling hardware keys to try after ``hw``'s own pack, closest first. For this
    device (no key given) its architecture, name and SM count are known too."""
    try:
        if explicit:
            return families.siblings(hw)
        dev = hardware.current_device()
        return families.siblings(hw, hardware.current_arch(), dev.name, dev.sm_count)
    except Exception:  # noqa: BLE001 - no family is known, never a failed lookup
        return ()


def _resolve(kernel: str | kernel_api.Kernel, dtype: str, hardware_key: str | None,
             shape: dict[str, Any]) -> tuple[Hit, list]:
    """The slow path: find the entry, count it, warn, and fill the fast path."""
    fam = kernel if isinstance(kernel, kernel_api.Kernel) else kernel_api.get(kernel)
    label = kernel if isinstance(kernel, str) else fam.name
    hw = hardware_key or hardware.current_device().key
    if not isinstance(hw, str) or not fmt.safe_name(hw) == hw:
        raise ValueError(f"packs.lookup: hardware key {hw!r} is not a hardware key (H100, "
                         "H200, cpu, ...)")
    norm = fam.validate_shape({k: _dim(k, v) for k, v in shape.items()})
    skey = fam.shape_key(norm)
    with _lock:
        pack = _load(hw, fam)
        best, why, missed = _pick(pack, fam, dtype, norm, skey)
        used, via = pack, None
        if best is None:
            spec = None
            for sib in _siblings(hw, hardware_key is not None):
                spack = _load(sib, fam)
                if spack is None or spack.rejected:
                    continue
                if spec is None:  # this GPU's: a sibling's entry must run here too
                    spec = (hardware.current_device() if hardware_key is None
                            else hardware.spec_for_key(hw))
                best, _, _ = _pick(spack, fam, dtype, norm, skey, spec)
                if best is not None:
                    used, via = spack, sib
                    break
        if best is None:
            source = "default"
            if pack is None:
                why = f"no {hw} pack for {fam.name}"
                _warn_once(("nopack", hw, fam.name),
                           f"{why} (looked in {', '.join(map(str, search_path()))}): using "
                           f"{fam.name}'s default config")
            elif missed:
                # Once per dims that must match: a new batch size is not a new warning.
                _warn_once(("miss", hw, fam.name, dtype,
                            tuple(norm[d] for d in fam.exact_dims)),
                           f"{why}: using {fam.name}'s default config")
            hit = Hit(dict(fam.default_config), "default", None, None)
        elif via is None:
            source = "exact" if best.key == skey else "nearest"
            hit = Hit(dict(best.config), source, best.key, pack.where, hw)
            why = f"nearest entry {best.key}" if source == "nearest" else ""
        else:
            source = "family"
            group = families.family_of(via)
            kind = "exact" if best.key == skey else "nearest"
            mine = f"no {hw} pack" if pack is None else why
            arch = f"{group.name}, {group.arch}" if group else "same family"
            _warn_once(("family", hw, fam.name, via),
                       f"{fam.name} on {hw}: {mine}; using the {via} pack, tuned on "
                       f"{best.device or via} ({arch}): {used.where}. Tuning this GPU "
                       "replaces it (packs.write_misses lists the shapes)")
            why = f"{via} pack ({kind} entry {best.key}): {mine}"
            hit = Hit(dict(best.config), source, best.key, used.where, via)
        rec = None
        if source != "exact":
            rec = _record_miss(label, fam, dtype, hw, norm, skey, source, hit.shape_key, why)
            rec["calls"] += 1
        stats[source] += 1
        slot = [MappingProxyType(dict(hit.config)), source, rec]
        _fast[(kernel, dtype, hardware_key, tuple(shape.items()))] = slot
    return hit, slot


def pack_entry(hardware_key: str, kernel: str | kernel_api.Kernel, dtype: str,
               shape: dict[str, Any]) -> Hit | None:
    """The entry of one hardware key's pack for ``shape`` (exact, else nearest), without
    the family or default steps: None where that pack has none (missing, rejected,
    refused by strict mode). For comparing packs (``kharness bench --regret``): not
    counted in ``stats`` nor recorded as a miss."""
    fam = kernel if isinstance(kernel, kernel_api.Kernel) else kernel_api.get(kernel)
    if not isinstance(hardware_key, str) or fmt.safe_name(hardware_key) != hardware_key:
        raise ValueError(f"packs.pack_entry: {hardware_key!r} is not a hardware key")
    norm = fam.validate_shape({k: _dim(k, v) for k, v in shape.items()})
    skey = fam.shape_key(norm)
    with _lock:
        pack = _load(hardware_key, fam)
        best, _, _ = _pick(pack, fam, dtype, norm, skey)
    if best is None or pack is None:
        return None
    return Hit(dict(best.config), "exact" if best.key == skey else "nearest", best.key,
               pack.where, hardware_key)


def lookup_entry(kernel: str | kernel_api.Kernel, dtype: str = "bf16",
                 hardware_key: str | None = None, **shape: int) -> Hit:
    """Exact shape, then the kernel's nearest shape, then its default config, with where
    the config came from. ``kernel``: a registered name, an import path, or an instance."""
    return _resolve(kernel, dtype, hardware_key, shape)[0]


def lookup(kernel: str | kernel_api.Kernel, dtype: str = "bf16",
           hardware_key: str | None = None, **shape: int) -> MappingProxyType:
    """The frozen config for ``kernel`` at ``shape`` on this device (see lookup_entry).

    Returns a read-only mapping, shared by every call with the same arguments: copy it
    (``dict(cfg)``) to change it. After the first call for a given set of arguments this
    is a single dict probe.
    """
    slot = _fast.get((kernel, dtype, hardware_key, tuple(shape.items())))
    if slot is None:
        return _resolve(kernel, dtype, hardware_key, shape)[1][0]
    stats[slot[1]] += 1
    if slot[2] is not None:
        slot[2]["calls"] += 1
    return slot[0]


# -- misses -------------------------------------------------------------------------------
def misses() -> list[dict[str, Any]]:
    """One record per distinct (kernel, dtype, hardware, shape) that was not an exact hit:
    kernel, family, dtype, hardware, shape, shape_key, source ("default" = miss, "nearest"
    = near-miss), entry (the pack entry used), why, calls."""
    with _lock:
        return [dict(r, shape=dict(r["shape"])) for r in _misses.values()]
