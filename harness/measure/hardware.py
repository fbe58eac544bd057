"""Hardware identity: device name -> short key, and the device's static properties.

Imported by the runtime, so it must stay light: torch only, no Ray/Optuna/MLflow.
"""

from __future__ import annotations

import os
import re
from functools import cache

from harness.kernel.api import DeviceSpec
from harness.measure import families

# Ordered: the first pattern that matches the device name wins.
_KEYS: list[tuple[str, str, str]] = [
    (r"\bH200\b", "H200", "nvidia"),
    # H100 parts whose SMs or memory differ from the SXM part's have keys of their own
    # (harness.measure.families: their lookups fall back to the H100 pack).
    (r"\bH100\b.*\bPCIe\b", "H100-PCIe", "nvidia"),
    (r"\bH100\b.*\bNVL\b", "H100-NVL", "nvidia"),
    (r"\bH100\b", "H100", "nvidia"),
    (r"\bH20\b", "H20", "nvidia"),
    (r"\bH800\b", "H800", "nvidia"),
    (r"\bGH200\b", "GH200", "nvidia"),
    (r"\bB200\b", "B200", "nvidia"),
    (r"\bA100\b", "A100", "nvidia"),
    (r"\bA10G?\b", "A10", "nvidia"),
    (r"\bL40S\b", "L40S", "nvidia"),
    (r"\bL4\b", "L4", "nvidia"),
    (r"\bV710\b", "V710", "amd"),
    (r"\bMI325X\b", "MI325X", "amd"),
    (r"\bMI300X\b", "MI300X", "amd"),
    (r"\bMI250X?\b", "MI250", "amd"),
]

#: Shared memory per block where a backend cannot report it (bytes).
_SMEM_FALLBACK = {"H100": 227 * 1024, "H200": 227 * 1024, "A100": 163 * 1024, "V710": 64 * 1024}

KNOWN_KEYS = ("H100", "H200", "A100", "V710", "cpu")

#: Device memory of the largest variant of each known GPU (bytes): what a shape's inputs
#: must fit in. The CPU's is this host's.
_MEMORY = {"H100": 94e9, "H200": 141e9, "H800": 80e9, "GH200": 144e9, "B200": 192e9,
           "H100-PCIe": 80e9, "H100-NVL": 94e9, "H20": 96e9,
           "A100": 80e9, "A10": 24e9, "L40S": 48e9, "L4": 24e9, "V710": 28e9,
           "MI300X": 192e9, "MI325X": 256e9, "MI250": 128e9}
#: Keys derived from the name of a GPU the table does not know (``hardware_key``).
_DERIVED = re.compile(r"(NVIDIA|AMD|Intel|Radeon)-[A-Za-z0-9-]+", re.IGNORECASE)


def known_keys() -> list[str]:
    """The hardware keys an experiment may name (a GPU the table does not know goes by
    its device name, e.g. ``NVIDIA-GeForce-RTX-4090``)."""
    return sorted({k for _, k, _ in _KEYS} | {"cpu"})


def is_known_key(key: str) -> bool:
    return key in known_keys() or bool(_DERIVED.fullmatch(key))


def memory_bytes(key: str) -> float | None:
    """The device memory of a hardware key (the largest variant; the host's for ``cpu``),
    or None where it is not known."""
    if key == "cpu":
        try:
            return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        except (ValueError, OSError, AttributeError):
            return None
    return _MEMORY.get(key)


def hardware_key(device_name: str) -> str:
    """Normalise a device name ("NVIDIA H100 80GB HBM3", "AMD Radeon PRO V710") to a key."""
    for pattern, key, _ in _KEYS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return key
    if not device_name or device_name.lower() == "cpu":
        return "cpu"
    # Unknown GPUs still get a stable, file-name-safe key of their own.
    return re.sub(r"[^A-Za-z0-9]+", "-", device_name).strip("-")


def vendor_of(key: str) -> str:
    for _, k, vendor in _KEYS:
        if k == key:
            return vendor
    return "cpu" if key == "cpu" else "nvidia"


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@cache
def current_device(index: int | None = None) -> DeviceSpec:
    """The spec of the GPU this process uses (or the CPU under the interpreter).

    Cached: the device is detected once per process.
    """
    import torch

    if not torch.cuda.is_available():
        return DeviceSpec(key="cpu", vendor="cpu", name="cpu", sm_count=4,
                          smem_per_block=1 << 30, interpreted=True)
    idx = torch.cuda.current_device() if index is None else index
    props = torch.cuda.get_device_properties(idx)
    key = hardware_key(props.name)
    vendor = "amd" if getattr(torch.version, "hip", None) else "nvidia"
    smem = getattr(props, "shared_memory_per_block_optin", 0) or _SMEM_FALLBACK.get(key, 48 * 1024)
    # TMA (tensor descriptors) is a Hopper-and-later feature on NVIDIA only.
    has_tma = vendor == "nvidia" and props.major >= 9
    return DeviceSpec(
        key=key,
        vendor=vendor,
        name=props.name,
        sm_count=props.multi_processor_count,
        smem_per_block=int(smem),
        l2_bytes=int(getattr(props, "L2_cache_size", 0)),
        has_tma=has_tma,
        interpreted=interpreted(),
        has_wgmma=vendor == "nvidia" and props.major == 9,
    )


@cache
def current_arch(index: int | None = None) -> str | None:
    """The architecture of this process's GPU: ``sm_90`` (NVIDIA compute capability) or
    ``gfx942`` (AMD gfx target); None on the CPU or where the device cannot tell."""
    import torch

    if not torch.cuda.is_available():
        return None
    try:
        idx = torch.cuda.current_device() if index is None else index
        props = torch.cuda.get_device_properties(idx)
    except Exception:  # noqa: BLE001 - a device that cannot be asked has no known arch
        return None
    gcn = getattr(props, "gcnArchName", "") or ""
    if getattr(torch.version, "hip", None) and gcn:
        return gcn.split(":", 1)[0]  # "gfx942:sramecc+:xnack-" -> "gfx942"
    return f"sm_{props.major}{props.minor}"


def spec_for_key(key: str) -> DeviceSpec:
    """A static spec for a hardware key the driver has no device for (pruning only)."""
    table = {
        "H100": DeviceSpec("H100", "nvidia", "NVIDIA H100", 132, 227 * 1024, 50 << 20, True,
                           has_wgmma=True),
        "H200": DeviceSpec("H200", "nvidia", "NVIDIA H200", 132, 227 * 1024, 60 << 20, True,
                           has_wgmma=True),
        "A100": DeviceSpec("A100", "nvidia", "NVIDIA A100", 108, 163 * 1024, 40 << 20, False),
        "V710": DeviceSpec("V710", "amd", "AMD Radeon PRO V710", 54, 64 * 1024, 4 << 20, False),
        "cpu": DeviceSpec("cpu", "cpu", "cpu", 4, 1 << 30, 0, False, True),
    }
    if key in table:
        return table[key]
    # A GPU of a known architecture: its family's shared memory and instructions.
    return families.static_spec(key) or DeviceSpec(key=key, vendor=vendor_of(key), name=key)
