"""The config-pack file format: writing, reading and integrity.

A pack is one JSON file per (hardware, kernel) at ``<dir>/<hardware>/<kernel>.json``::

    {
      "schema_version": 1,
      "hardware": "H100",
      "kernel": "grouped_gemm",
      "kernels": {"grouped_gemm": {"bf16": {"M=49152,N=1408,K=2048,E=64": ENTRY}}},
      "checksum": "sha256:<hex of the canonical JSON of everything else>"
    }

ENTRY = {"config": {...}, "metrics": {...}, "provenance": {...}}. JSON only: a pack is
never pickled or evaluated.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1


class PackError(ValueError):
    """A pack that cannot be trusted. The message names the file."""


def canonical(data: Mapping[str, Any]) -> bytes:
    body = {k: v for k, v in data.items() if k != "checksum"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def checksum(data: Mapping[str, Any]) -> str:
    return "sha256:" + hashlib.sha256(canonical(data)).hexdigest()


def pack_path(packs_dir: str | Path, hardware: str, kernel: str) -> Path:
    return Path(packs_dir) / hardware / f"{kernel}.json"


def empty(hardware: str, kernel: str) -> dict[str, Any]:
    return {"schema_version": SCHEMA_VERSION, "hardware": hardware, "kernel": kernel,
            "kernels": {kernel: {}}}


def validate(data: Any, where: str) -> dict[str, Any]:
    """Structural checks and the checksum; raises PackError naming ``where``."""
    if not isinstance(data, dict):
        raise PackError(f"{where}: not a JSON object")
    if data.get("schema_version") != SCHEMA_VERSION:
        raise PackError(f"{where}: schema_version {data.get('schema_version')!r} is not "
                        f"{SCHEMA_VERSION}")
    for key in ("hardware", "kernel", "kernels", "checksum"):
        if key not in data:
            raise PackError(f"{where}: missing '{key}'")
    if data["checksum"] != checksum(data):
        raise PackError(f"{where}: checksum mismatch (the file was modified or corrupted)")
    kernels = data["kernels"]
    if not isinstance(kernels, dict):
        raise PackError(f"{where}: 'kernels' must be an object")
    for kname, by_dtype in kernels.items():
        if not isinstance(by_dtype, dict):
            raise PackError(f"{where}: kernels.{kname} must be an object")
        for dtype, entries in by_dtype.items():
            if not isinstance(entries, dict):
                raise PackError(f"{where}: kernels.{kname}.{dtype} must be an object")
            for skey, entry in entries.items():
                if not isinstance(entry, dict) or not isinstance(entry.get("config"), dict):
                    raise PackError(f"{where}: kernels.{kname}.{dtype}.{skey} has no config")
    return data


def read(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise PackError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PackError(f"{path}: not valid JSON (truncated or corrupted?): {exc}") from None
    return validate(data, str(path))


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def write(path: str | Path, data: dict[str, Any]) -> Path:
    """Write atomically (temp file + rename): a reader never sees half a pack."""
    path = Path(path)
    data = _clean({k: v for k, v in data.items() if k != "checksum"})
    data["checksum"] = checksum(data)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def freeze(packs_dir: str | Path, hardware: str, kernel: str, dtype: str,
           entries: Mapping[str, Mapping[str, Any]]) -> Path:
    """Merge winners (shape key -> entry) into the (hardware, kernel) pack on disk.

    Entries for other shapes and dtypes already in the pack are kept.
    """
    path = pack_path(packs_dir, hardware, kernel)
    data = read(path) if path.is_file() else empty(hardware, kernel)
    data["kernels"].setdefault(kernel, {}).setdefault(dtype, {}).update(
        {k: dict(v) for k, v in entries.items()})
    return write(path, data)


def entries(data: Mapping[str, Any], kernel: str, dtype: str) -> dict[str, dict[str, Any]]:
    return dict(data.get("kernels", {}).get(kernel, {}).get(dtype, {}))
