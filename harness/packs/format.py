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

Reading is defensive: only a regular file is opened (a FIFO, a device or a directory at a
pack's place is refused unread), at most ``MAX_BYTES`` are read, and whatever the bytes
hold (numbers of any size, nesting of any depth) comes back as ``PackError``. Paths made
from names (``pack_path``, ``child``) stay inside their folder. A pack that is read,
changed and written again (``freeze``, ``kharness packs merge --dir``) is changed under
``locked``: writers in other processes wait rather than lose each other's entries.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import re
import stat
import tempfile
import threading
from collections.abc import Iterable, Iterator, Mapping
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
#: The most digits a JSON integer of a pack may have. Python's int() refuses more than
#: 4,300 (a ValueError of its own); no tunable, shape or metric needs more than 20.
MAX_INT_DIGITS = 100


class PackError(ValueError):
    """A pack that cannot be trusted. The message names the file."""


# -- names that become paths --------------------------------------------------------------
def _component_error(name: Any) -> str | None:
    """Why ``name`` cannot be one path component inside a folder (None if it can)."""
    if not isinstance(name, str):
        return f"{name!r} is not a string"
    if name in ("", ".", "..") or "/" in name or "\\" in name or "\x00" in name:
        return f"{name!r} is not a single file name"
    return None


def child(folder: str | Path, name: str) -> Path:
    """``folder / name``, where ``name`` is one file name: never a path that leaves
    ``folder`` ('..', '/', NUL refused with PackError). Names from data go through this
    (or ``safe_name`` first)."""
    why = _component_error(name)
    if why:
        raise PackError(f"{why}: refusing a path outside {folder}")
    return Path(folder) / name


_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def safe_name(name: Any, fallback: str = "unnamed", limit: int = 128) -> str:
    """``name`` as a file name: characters other than ``[A-Za-z0-9._-]`` become ``_``,
    leading dots go (no hidden files, no '..'), at most ``limit`` characters;
    ``fallback`` where only dots and underscores are left."""
    out = _UNSAFE.sub("_", str(name)).lstrip(".")[:limit]
    return out if out.strip("._") else fallback


def json_schema() -> dict[str, Any]:
    """The published JSON Schema of a pack (``pack.schema.json``)."""
    return json.loads(resources.files("harness.packs").joinpath(SCHEMA_FILE).read_text())


def canonical(data: Mapping[str, Any]) -> bytes:
    body = {k: v for k, v in data.items() if k != "checksum"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def checksum(data: Mapping[str, Any]) -> str:
    return "sha256:" + hashlib.sha256(canonical(data)).hexdigest()


def pack_path(packs_dir: str | Path, hardware: str, kernel: str) -> Path:
    """``<packs_dir>/<hardware>/<kernel>.json``; PackError where either name is not one
    file name (a name from a pack, a record or an experiment never leaves packs_dir)."""
    for what, name in (("hardware", hardware), ("kernel", kernel)):
        why = _component_error(name)
        if why:
            raise PackError(f"{what} {why}: no pack can be named by it")
    return Path(packs_dir) / hardware / f"{kernel}.json"


def empty(hardware: str, kernel: str) -> dict[str, Any]:
    return {"schema_version": SCHEMA_VERSION, "hardware": hardware, "kernel": kernel,
            "kernels": {kernel: {}}}


def schema_error(data: Any) -> str | None:
    """Why ``data`` does not follow the pack schema (None if it does). Checksum aside."""
    return schema.error(data)


def validate(data: Any, where: str) -> dict[str, Any]:
    """The schema (pack.schema.json), the checksum, and one kernel per pack; raises
    PackError naming ``where``."""
    if isinstance(data, dict) and "checksum" in data and "schema_version" in data \
            and data.get("schema_version") == SCHEMA_VERSION:
        # Checksum first: a tampered file says so rather than naming the field it broke.
        try:
            ok = data["checksum"] == checksum(data)
        except (TypeError, ValueError, RecursionError):  # NaN, unserialisable, too deep
            ok = False
        if not ok:
            raise PackError(f"{where}: checksum mismatch (the file was modified or corrupted)")
    try:
        why = schema_error(data)
    except RecursionError:
        why = "nested too deeply"
    if why:
        raise PackError(f"{where}: wrong schema: {why}")
    # The schema cannot relate two fields: entries of another kernel than the file's would
    # be merged, listed and pushed, yet never checked against any kernel's constraints.
    others = sorted(set(data["kernels"]) - {data["kernel"]})
    if others:
        raise PackError(f"{where}: kernels.{others[0]}: entries of kernel {others[0]!r} in "
                        f"the {data['kernel']} pack (a pack holds its own kernel only)")
    return data


class _TooManyDigits(ValueError):
    pass


def _bounded_int(digits: str) -> int:
    # Python's own limit (4,300 digits) raises a ValueError that names no file; this one
    # is lower and says what it is.
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise _TooManyDigits(f"an integer of {len(digits.lstrip('-')):,} digits (at most "
                             f"{MAX_INT_DIGITS} are allowed)")
    return int(digits)


def parse_json(text: str | bytes, where: str) -> Any:
    """JSON from a file's bytes, whatever they are: PackError naming ``where`` for bytes
    that are not UTF-8 JSON, integers of more than MAX_INT_DIGITS digits, or nesting
    deeper than the interpreter's recursion limit."""
    try:
        return json.loads(text, parse_int=_bounded_int)
    except RecursionError:
        raise PackError(f"{where}: not valid JSON (nested too deeply)") from None
    except _TooManyDigits as exc:
        raise PackError(f"{where}: {exc}") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise PackError(f"{where}: not valid JSON (truncated or corrupted?): {exc}") from None


def loads(text: str | bytes, where: str) -> dict[str, Any]:
    """Parse and validate a pack from its bytes; PackError names ``where``."""
    if len(text) > MAX_BYTES:
        raise _too_large(len(text), where)
    return validate(parse_json(text, where), where)


def _too_large(size: int, where: str) -> PackError:
    return PackError(f"{where}: {size:,} bytes, above the {MAX_BYTES // (1024 * 1024)} MB "
                     "a pack may have: refused unread")


def _not_regular(mode: int) -> str | None:
    if stat.S_ISREG(mode):
        return None
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
             (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"))
    return next((what for test, what in kinds if test(mode)), "not a regular file")


def read_bytes(path: str | Path, limit: int | None = MAX_BYTES) -> bytes:
    """A file's bytes, where it is a regular file (symlinks followed) of at most ``limit``
    bytes (None: any size); PackError naming it otherwise, never a block: a FIFO or a
    device is refused before it is opened, and the open itself does not wait."""
    path = Path(path)
    try:
        why = _not_regular(os.stat(path).st_mode)  # no open() of a FIFO or a device
        if why:
            raise PackError(f"{path}: {why}, not a pack file: refused unread")
        # O_NONBLOCK: should a FIFO take the file's place after the stat, the open still
        # returns at once, and fstat() below refuses it.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY
                     | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)
            why = _not_regular(st.st_mode)
            if why:
                raise PackError(f"{path}: {why}, not a pack file: refused unread")
            if limit is not None and st.st_size > limit:
                raise _too_large(st.st_size, str(path))
            raw = f.read() if limit is None else f.read(limit + 1)
    except OSError as exc:
        raise PackError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if limit is not None and len(raw) > limit:  # it grew while read
        raise _too_large(len(raw), str(path))
    return raw


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


def lock_path(path: str | Path) -> Path:
    """The lock file of ``path``: hidden, beside it (``.<name>.lock``), so that listings
    of packs (``*/*.json``, no dot files) never see it."""
    path = Path(path)
    return path.with_name(f".{path.name}.lock")


@contextlib.contextmanager
def locked(path: str | Path) -> Iterator[Path]:
    """Hold an exclusive ``flock`` on ``path``'s lock file while reading, changing and
    writing ``path``: another process (or thread) doing the same waits. The kernel drops
    the lock when its holder ends, however it ends. The lock file is left in place
    (removing it would let a waiter lock a file that no longer has the name)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Read-only is enough for flock, so that a lock file another user created still locks.
    fd = os.open(lock_path(path), os.O_RDONLY | os.O_CREAT | getattr(os, "O_CLOEXEC", 0),
                 file_mode())
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield path
    finally:
        os.close(fd)  # drops the flock


def exists(path: str | Path) -> bool:
    """Whether anything is at ``path`` (a dangling symlink, a FIFO, an unreadable file
    included): what must then be a valid pack before it is changed."""
    try:
        os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError:
        return True  # there may be something: read() says what
    return True


def freeze(packs_dir: str | Path, hardware: str, kernel: str, dtype: str,
           entries: Mapping[str, Mapping[str, Any]]) -> Path:
    """Merge winners (shape key -> entry) into the (hardware, kernel) pack on disk.

    Entries for other shapes and dtypes already in the pack are kept; the read, the
    change and the write happen under ``locked``, so that runs freezing into one pack at
    once keep each other's entries. A damaged pack there raises PackError (unchanged).
    """
    path = pack_path(packs_dir, hardware, kernel)
    with locked(path):
        data = read(path) if exists(path) else empty(hardware, kernel)
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
