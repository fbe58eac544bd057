"""The config-pack file format: writing, reading, integrity and merging.

A pack is one JSON file per (hardware, kernel) at ``<dir>/<hardware>/<kernel>.json``::

    {
      "schema_version": 1,
      "hardware": "H100",
      "kernel": "grouped_gemm",
      "kernels": {"grouped_gemm": {"bf16": {"M=49152,N=1408,K=2048,E=64": ENTRY}}},
      "checksum": "sha256:<hex of the canonical JSON of everything else>"
    }

ENTRY = {"config": {...}, "metrics": {...}, "provenance": {...}}. JSON only: a pack is
never pickled or evaluated. The schema is the pydantic models of ``schema``; the published
JSON Schema (``pack.schema.json``, package data) is generated from them.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
import threading
from collections.abc import Iterable, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from harness.packs import schema

SCHEMA_VERSION = schema.SCHEMA_VERSION
#: The published JSON Schema, package data next to this module.
SCHEMA_FILE = "pack.schema.json"
#: A pack holds a few hundred entries at most (tens of KB); a larger file is refused
#: before it is read, so that a hostile one costs neither time nor memory.
MAX_BYTES = 8 * 1024 * 1024

#: Merge policies: which entry wins when two packs hold the same (kernel, dtype, shape).
MERGE_POLICIES = ("fastest", "newest")


class PackError(ValueError):
    """A pack that cannot be trusted. The message names the file."""


def json_schema() -> dict[str, Any]:
    """The published JSON Schema of a pack (``pack.schema.json``)."""
    return json.loads(resources.files("harness.packs").joinpath(SCHEMA_FILE).read_text())


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


def schema_error(data: Any) -> str | None:
    """Why ``data`` does not follow the pack schema (None if it does). Checksum aside."""
    return schema.error(data)


def validate(data: Any, where: str) -> dict[str, Any]:
    """The schema (pack.schema.json) and the checksum; raises PackError naming ``where``."""
    if isinstance(data, dict) and "checksum" in data and "schema_version" in data \
            and data.get("schema_version") == SCHEMA_VERSION:
        # Checksum first: a tampered file says so rather than naming the field it broke.
        try:
            ok = data["checksum"] == checksum(data)
        except (TypeError, ValueError):  # NaN or an unserialisable value
            ok = False
        if not ok:
            raise PackError(f"{where}: checksum mismatch (the file was modified or corrupted)")
    why = schema_error(data)
    if why:
        raise PackError(f"{where}: wrong schema: {why}")
    return data


def loads(text: str | bytes, where: str) -> dict[str, Any]:
    """Parse and validate a pack from its bytes; PackError names ``where``."""
    if len(text) > MAX_BYTES:
        raise _too_large(len(text), where)
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PackError(f"{where}: not valid JSON (truncated or corrupted?): {exc}") from None
    except RecursionError:
        raise PackError(f"{where}: not valid JSON (nested too deeply)") from None
    return validate(data, where)


def _too_large(size: int, where: str) -> PackError:
    return PackError(f"{where}: {size:,} bytes, above the {MAX_BYTES // (1024 * 1024)} MB "
                     "a pack may have: refused unread")


def read_bytes(path: str | Path) -> bytes:
    """A pack file's bytes, refusing one above MAX_BYTES before reading it."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_BYTES:
                raise _too_large(size, str(path))
            return f.read(MAX_BYTES + 1)
    except OSError as exc:
        raise PackError(f"{path}: cannot read: {exc.strerror or exc}") from None


def read(path: str | Path) -> dict[str, Any]:
    """Read and validate a pack file (size, JSON, checksum, schema)."""
    return loads(read_bytes(path), str(path))


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def dumps(data: Mapping[str, Any]) -> str:
    """The file text of a pack, with a fresh checksum (NaN/Inf become null)."""
    data = _clean({k: v for k, v in data.items() if k != "checksum"})
    data["checksum"] = checksum(data)
    return json.dumps(data, indent=1, sort_keys=True) + "\n"


_umask_lock = threading.Lock()


def file_mode() -> int:
    """The mode a new file gets from ``open`` here: 0666 less the process's umask (0644
    under the usual 022), so that an application running as another user can read it."""
    with _umask_lock:  # reading the umask means setting it: not thread-safe on its own
        mask = os.umask(0o022)
        os.umask(mask)
    return 0o666 & ~mask


def write_text(path: str | Path, text: str | bytes) -> Path:
    """Write atomically (temp file + rename): a reader never sees half a file. The file
    gets the mode of a plain ``open`` (``file_mode``), not mkstemp's 0600."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, file_mode())
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode() if isinstance(text, str) else text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write(path: str | Path, data: dict[str, Any]) -> Path:
    """Write a pack atomically, with a fresh checksum."""
    return write_text(path, dumps(data))


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


def iter_entries(data: Mapping[str, Any]) -> Iterable[tuple[str, str, str, dict[str, Any]]]:
    """(kernel, dtype, shape key, entry) for every entry of a pack."""
    for kname, by_dtype in data.get("kernels", {}).items():
        for dtype, by_shape in by_dtype.items():
            for skey, entry in by_shape.items():
                yield kname, dtype, skey, entry


# -- merging ------------------------------------------------------------------------------
def _latency(entry: Mapping[str, Any]) -> float:
    lat = (entry.get("metrics") or {}).get("latency_ms")
    return float(lat) if isinstance(lat, (int, float)) and not isinstance(lat, bool) \
        and math.isfinite(lat) else math.inf


def _date(entry: Mapping[str, Any]) -> str:
    return str((entry.get("provenance") or {}).get("date") or "")


def better(a: Mapping[str, Any], b: Mapping[str, Any], policy: str = "fastest") -> bool:
    """Whether entry ``b`` should replace entry ``a`` for the same shape.

    ``fastest``: the lower measured latency wins (an entry with no latency loses to one
    with); on a tie, the newer provenance date. ``newest``: the newer date wins; on a tie,
    the lower latency. A full tie keeps ``a``.
    """
    if policy not in MERGE_POLICIES:
        raise ValueError(f"merge policy must be one of {MERGE_POLICIES}, not {policy!r}")
    la, lb, da, db = _latency(a), _latency(b), _date(a), _date(b)
    if policy == "fastest":
        return lb < la or (lb == la and db > da)
    return db > da or (db == da and lb < la)


def merge(packs: list[Mapping[str, Any]], policy: str = "fastest",
          where: list[str] | None = None) -> dict[str, Any]:
    """Combine packs of one (hardware, kernel) into a new pack (unsigned: write() signs).

    Raises PackError if they are for different hardware keys or kernels: a pack holds
    configs for one hardware type only.
    """
    if not packs:
        raise PackError("nothing to merge")
    names = where or [f"input {i + 1}" for i in range(len(packs))]
    hw, kernel = packs[0]["hardware"], packs[0]["kernel"]
    for p, name in zip(packs, names, strict=True):
        if p["hardware"] != hw:
            raise PackError(f"{name}: hardware {p['hardware']!r} differs from {hw!r} "
                            f"({names[0]}): refusing to merge packs of different hardware")
        if p["kernel"] != kernel:
            raise PackError(f"{name}: kernel {p['kernel']!r} differs from {kernel!r} "
                            f"({names[0]}): one pack holds one kernel")
    out = empty(hw, kernel)
    out["kernels"] = {}
    for p in packs:
        for kname, dtype, skey, entry in iter_entries(p):
            slot = out["kernels"].setdefault(kname, {}).setdefault(dtype, {})
            if skey not in slot or better(slot[skey], entry, policy):
                slot[skey] = json.loads(json.dumps(entry))
    out["kernels"].setdefault(kernel, {})
    return out


def diff(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Entries that differ between two packs: added, removed, or with another config.

    Each row: kernel, dtype, shape, change ("added"/"removed"/"config"/"metrics"), the
    configs, the keys whose values differ, and both latencies with the ratio b/a.
    """
    ea = {(k, d, s): e for k, d, s, e in iter_entries(a)}
    eb = {(k, d, s): e for k, d, s, e in iter_entries(b)}
    rows = []
    for key in sorted(set(ea) | set(eb)):
        x, y = ea.get(key), eb.get(key)
        row: dict[str, Any] = {"kernel": key[0], "dtype": key[1], "shape": key[2],
                               "config_a": x and x["config"], "config_b": y and y["config"]}
        la = _latency(x) if x else math.inf
        lb = _latency(y) if y else math.inf
        row["latency_ms_a"] = la if math.isfinite(la) else None
        row["latency_ms_b"] = lb if math.isfinite(lb) else None
        row["latency_ratio"] = lb / la if math.isfinite(la) and math.isfinite(lb) and la else None
        if x is None:
            row["change"] = "added"
        elif y is None:
            row["change"] = "removed"
        elif x["config"] != y["config"]:
            row["change"] = "config"
            row["changed_keys"] = sorted(
                k for k in set(x["config"]) | set(y["config"])
                if x["config"].get(k) != y["config"].get(k))
        elif la != lb:
            row["change"] = "metrics"
        else:
            continue
        rows.append(row)
    return rows
