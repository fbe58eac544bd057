"""The runtime's checks of a pack, beyond its schema and checksum: every entry is a shape
of the pack's kernel, its config names only the kernel's tunables with values of their
types, its launch options (``num_warps``, ``num_stages``, ``num_ctas``, ``maxnreg``) are
within what the hardware launches, and it passes the kernel's own constraints
(``check_config``) on the pack's hardware.

Lookup applies them before serving a pack; ``kharness packs`` applies the same before
listing a pack as ok, pushing, pulling or merging it, so a pack the runtime would reject
is refused before anything changes.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from harness.kernel import api as kernel_api
from harness.measure import hardware
from harness.packs.format import PackError, iter_entries

#: Threads per block top out at 1,024 on every GPU: 32 warps of 32 lanes on NVIDIA, 16
#: wavefronts of 64 on AMD (the interpreter takes what NVIDIA takes).
_MAX_WARPS = {"nvidia": 32, "amd": 16}
#: The launch options Triton takes beside a kernel's own meta-parameters: (smallest,
#: largest or None for the hardware's warp limit, power of two). A family's tunables type
#: them at most (an ad-hoc kernel not even that), and a family's check_config may not look
#: at them: ``num_warps: 1024`` would reach the compiler.
LAUNCH_RANGES: dict[str, tuple[int, int | None, bool]] = {
    "num_warps": (1, None, True),
    "num_stages": (0, 16, False),
    "num_ctas": (1, 16, True),  # thread-block clusters: 8 portable, 16 at most
    "maxnreg": (1, 255, False),  # registers per thread
}


def launch_options_error(config: Mapping[str, Any], spec: kernel_api.DeviceSpec
                         ) -> str | None:
    """Why a config's launch options cannot be launched on ``spec`` (None if they can)."""
    for name, (lo, hi, pow2) in LAUNCH_RANGES.items():
        if name not in config:
            continue
        v = config[name]
        if isinstance(v, bool) or not isinstance(v, int):
            return f"{name}={v!r}: not an integer"
        top = hi if hi is not None else _MAX_WARPS.get(spec.vendor, 32)
        if not lo <= v <= top or (pow2 and v & (v - 1)):
            return (f"{name}={v}: must be {'a power of two ' if pow2 else ''}from {lo} to "
                    f"{top} on {spec.key}")
    return None


def family(name: str) -> kernel_api.Kernel | None:
    """The kernel family a pack names, or None where no registered family or import path
    has that name (an ad-hoc ``harness.autotune`` kernel: only its application knows its
    tunables)."""
    try:
        return kernel_api.get(name)
    except Exception:  # noqa: BLE001 - an unknown or broken family is "not known" here
        return None


def entries(data: Mapping[str, Any], where: str, fam: kernel_api.Kernel
            ) -> Iterator[tuple[str, str, dict[str, int], dict[str, Any]]]:
    """(dtype, shape key, shape, entry) of every entry of ``fam`` in a pack that passed its
    schema, each checked; PackError naming ``where`` and the entry at the first failure."""
    hw = data["hardware"]
    spec = hardware.spec_for_key(hw)
    for dtype, by_shape in data["kernels"].get(fam.name, {}).items():
        for skey, entry in by_shape.items():
            at = f"{where}: kernels.{fam.name}.{dtype}.{skey}"
            try:
                shape = fam.validate_shape(fam.parse_shape_key(skey))
            except (KeyError, ValueError) as exc:
                raise PackError(f"{at}: not a {fam.name} shape key ({exc})") from None
            why = fam.check_tunables(entry["config"]) or launch_options_error(
                entry["config"], spec)
            if why:
                raise PackError(f"{at}: config: {why}")
            try:
                why = fam.check_config(entry["config"], shape, spec)
            except Exception as exc:  # noqa: BLE001 - a kernel's own check must not crash
                why = f"check_config raised {type(exc).__name__}: {exc}"
            if why:
                raise PackError(f"{at}: config fails {fam.name}'s constraints on {hw}: {why}")
            yield dtype, skey, shape, entry


def check(data: Mapping[str, Any], where: str, fam: kernel_api.Kernel | None = None) -> None:
    """Every check lookup applies to a pack of a known family (see the module doc); a pack
    whose kernel no family describes is checked by its schema and launch options only.
    PackError on failure."""
    fam = fam or family(data["kernel"])
    if fam is None:  # no tunables or constraints known: the launch options still apply
        spec = hardware.spec_for_key(data["hardware"])
        for kname, dtype, skey, entry in iter_entries(data):
            why = launch_options_error(entry["config"], spec)
            if why:
                raise PackError(f"{where}: kernels.{kname}.{dtype}.{skey}: config: {why}")
        return
    if data["kernel"] != fam.name:
        raise PackError(f"{where}: the pack is for kernel {data['kernel']!r}, not {fam.name!r}")
    for _ in entries(data, where, fam):
        pass
