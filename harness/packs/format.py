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
never pickled or evaluated. The published JSON Schema is ``pack.schema.json`` next to this
file; ``validate`` checks the same rules by hand so that the runtime needs no jsonschema.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
SCHEMA_PATH = Path(__file__).with_name("pack.schema.json")

# The same patterns as pack.schema.json.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_DTYPE = re.compile(r"[A-Za-z0-9_]+")
_SHAPE_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=[0-9]+(,[A-Za-z_][A-Za-z0-9_]*=[0-9]+)*")
_PARAM = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_CHECKSUM = re.compile(r"sha256:[0-9a-f]{64}")
_SCALAR = (bool, int, float, str)

#: Merge policies: which entry wins when two packs hold the same (kernel, dtype, shape).
MERGE_POLICIES = ("fastest", "newest")


class PackError(ValueError):
    """A pack that cannot be trusted. The message names the file."""


def json_schema() -> dict[str, Any]:
    """The published JSON Schema of a pack (``pack.schema.json``)."""
    return json.loads(SCHEMA_PATH.read_text())


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


def _finite(v: Any) -> bool:
    return not isinstance(v, float) or math.isfinite(v)


def _check_entry(entry: Any, at: str) -> str | None:
    if not isinstance(entry, dict):
        return f"{at}: must be an object"
    for key in ("config", "metrics", "provenance"):
        if not isinstance(entry.get(key), dict):
            return f"{at}: has no '{key}' object"
    config = entry["config"]
    if not config:
        return f"{at}.config: is empty"
    for k, v in config.items():
        if not _PARAM.fullmatch(k):
            return f"{at}.config: bad parameter name {k!r}"
        if not isinstance(v, _SCALAR) or not _finite(v):
            return f"{at}.config.{k}: {v!r} is not a number, string or boolean"
    for k, v in entry["metrics"].items():
        if not (v is None or isinstance(v, _SCALAR)) or not _finite(v):
            return f"{at}.metrics.{k}: {v!r} is not a scalar"
    lat = entry["metrics"].get("latency_ms")
    if lat is not None and (isinstance(lat, (bool, str)) or lat < 0):
        return f"{at}.metrics.latency_ms: {lat!r} is not a latency"
    for k in ("triton", "torch", "device_name", "date"):
        if k in entry["provenance"] and not isinstance(entry["provenance"][k], str):
            return f"{at}.provenance.{k}: must be a string"
    return None


def schema_error(data: Any) -> str | None:
    """Why ``data`` does not follow pack.schema.json (None if it does). Checksum aside."""
    if not isinstance(data, dict):
        return "not a JSON object"
    if data.get("schema_version") != SCHEMA_VERSION:
        return f"schema_version {data.get('schema_version')!r} is not {SCHEMA_VERSION}"
    for key in ("hardware", "kernel", "kernels", "checksum"):
        if key not in data:
            return f"missing '{key}'"
    for key in ("hardware", "kernel"):
        if not isinstance(data[key], str) or not _NAME.fullmatch(data[key]):
            return f"{key}: {data[key]!r} is not a valid name"
    if not isinstance(data["checksum"], str) or not _CHECKSUM.fullmatch(data["checksum"]):
        return "checksum: not 'sha256:<64 hex digits>'"
    kernels = data["kernels"]
    if not isinstance(kernels, dict):
        return "'kernels' must be an object"
    for kname, by_dtype in kernels.items():
        if not _NAME.fullmatch(kname):
            return f"kernels: bad kernel name {kname!r}"
        if not isinstance(by_dtype, dict):
            return f"kernels.{kname}: must be an object"
        for dtype, entries in by_dtype.items():
            if not _DTYPE.fullmatch(dtype):
                return f"kernels.{kname}: bad dtype {dtype!r}"
            if not isinstance(entries, dict):
                return f"kernels.{kname}.{dtype}: must be an object"
            for skey, entry in entries.items():
                at = f"kernels.{kname}.{dtype}.{skey}"
                if not _SHAPE_KEY.fullmatch(skey):
                    return f"kernels.{kname}.{dtype}: bad shape key {skey!r}"
                why = _check_entry(entry, at)
                if why:
                    return why
    return None


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
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PackError(f"{where}: not valid JSON (truncated or corrupted?): {exc}") from None
    except RecursionError:
        raise PackError(f"{where}: not valid JSON (nested too deeply)") from None
    return validate(data, where)


def read(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise PackError(f"{path}: cannot read: {exc.strerror or exc}") from None
    return loads(raw, str(path))


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


def write_text(path: str | Path, text: str | bytes) -> Path:
    """Write atomically (temp file + rename): a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
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
