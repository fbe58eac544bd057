"""What the GEMM-shaped families (``matmul``, ``grouped_gemm``) share: the launch options
only the AMD backend knows, and the static rules every tile config of a ``tl.dot`` kernel
must follow."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from harness.kernel.api import DeviceSpec

#: Launch options that only the AMD backend knows: the NVIDIA backend raises on them, so
#: they are passed only where the config has them and the GPU is a ROCm one.
AMD_KWARGS = ("waves_per_eu", "matrix_instr_nonkdim", "kpack")


def amd_meta(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The config's AMD-only launch options (for a ROCm GPU's launch)."""
    return {k: cfg[k] for k in AMD_KWARGS if k in cfg}


def tile_reason(given: Mapping[str, Any], cfg: Mapping[str, Any],
                device: DeviceSpec) -> str | None:
    """Why a tile config cannot run, or None: AMD launch options in ``given`` (the config
    as asked) on another vendor's GPU (the launcher drops them there, so such a config
    would only repeat the one without them), tiles that are not powers of two >= 16
    (``tl.dot``, ``tl.arange``), a GROUP_M below 1. ``cfg``: the config over the default."""
    amd_keys = [k for k in AMD_KWARGS if k in given]
    if amd_keys and device.vendor != "amd":
        return f"{', '.join(amd_keys)}: AMD-only launch options on a {device.vendor} device"
    for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
        v = int(cfg[name])
        if v < 16 or v & (v - 1):
            return f"{name}={v}: must be a power of two >= 16"
    if int(cfg["GROUP_M"]) < 1:
        return f"GROUP_M={cfg['GROUP_M']}: must be >= 1"
    return None
