"""Publish packs to S3 and fetch them back (boto3, imported on use).

Layout under ``s3://BUCKET/PREFIX``::

    objects/<sha256>.json        every pack file ever pushed, content-addressed
    manifests/<UTC time>-<sha>.json   every published set, kept for history
    manifest.json                the published set: written last, read first

A push uploads the objects first (boto3's TransferConfig switches to multipart uploads
above ``multipart_threshold``), then the versioned manifest, then ``manifest.json``: one
PUT, atomic on S3. A reader goes through ``manifest.json`` only, so it sees the previous
complete set until that last PUT lands, never a half-published one; an interrupted push
leaves only unreferenced objects behind. A pull downloads every listed object into a
staging directory, checks each against the manifest's SHA-256 and the pack's own
checksum and schema, and only then moves the files into place.

Credentials come from boto3's standard chain (environment, SSO, instance profile, IRSA)
and are never printed; the endpoint from ``endpoint_url`` or ``$AWS_ENDPOINT_URL``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import io
import json
import logging
import os
import re
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from harness.packs import format as fmt
from harness.packs import verify

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "kharness-packs-manifest"
MANIFEST_VERSION = 1
MB = 1024 * 1024

_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_REL = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*\.json")
_OBJECT = re.compile(r"objects/[0-9a-f]{64}\.json")


class S3Error(Exception):
    """A push or pull that cannot proceed. ``bad_input``: the caller's fault (bad URL, no
    packs, nothing published), as opposed to the remote end or the network."""

    def __init__(self, message: str, bad_input: bool = False):
        super().__init__(message)
        self.bad_input = bad_input


def parse_url(url: str) -> tuple[str, str]:
    """``s3://bucket/prefix`` -> (bucket, prefix without surrounding slashes)."""
    if not isinstance(url, str) or not url.startswith("s3://"):
        raise S3Error(f"{url!r}: not an s3://bucket/prefix URL", bad_input=True)
    bucket, _, prefix = url[5:].partition("/")
    if not _BUCKET.fullmatch(bucket):
        raise S3Error(f"{url!r}: {bucket!r} is not a valid bucket name", bad_input=True)
    prefix = prefix.strip("/")
    if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
        raise S3Error(f"{url!r}: bad prefix {prefix!r}", bad_input=True)
    return bucket, prefix


def _key(prefix: str, name: str) -> str:
    return f"{prefix}/{name}" if prefix else name


def transfer_config(**overrides: Any) -> Any:
    from boto3.s3.transfer import TransferConfig

    opts = {"multipart_threshold": 8 * MB, "multipart_chunksize": 8 * MB, **overrides}
    return TransferConfig(**opts)


def _quiet_boto() -> None:
    """At DEBUG, botocore logs request headers, session tokens included: keep the AWS
    libraries at INFO or above whatever the application's log level."""
    for name in ("botocore", "boto3", "s3transfer", "urllib3"):
        log = logging.getLogger(name)
        if log.getEffectiveLevel() < logging.INFO:
            log.setLevel(logging.INFO)


def make_client(endpoint_url: str | None = None) -> Any:
    """An S3 client from boto3's standard credential chain."""
    import boto3
    from botocore.config import Config

    _quiet_boto()

    return boto3.session.Session().client(
        "s3", endpoint_url=endpoint_url or None,
        config=Config(retries={"max_attempts": 5, "mode": "standard"}))


def _remote_error(exc: Exception, where: str) -> S3Error:
    """A boto error as a message that names the object and never the credentials."""
    from botocore.exceptions import ClientError, NoCredentialsError

    if isinstance(exc, NoCredentialsError):
        return S3Error(f"{where}: no AWS credentials found (boto3's standard chain: "
                       "environment, ~/.aws, SSO, instance profile)")
    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        code = str(err.get("Code", "?"))
        return S3Error(f"{where}: {code}: {err.get('Message', '')}".rstrip(": "),
                       bad_input=code in ("NoSuchBucket", "InvalidBucketName"))
    return S3Error(f"{where}: {type(exc).__name__}: {exc}")


def _sha256(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def local_packs(packs_dir: str | Path) -> list[tuple[str, bytes, dict[str, Any]]]:
    """(relative path, bytes, parsed pack) of every pack under ``packs_dir``; a damaged
    pack raises PackError: it must not be published."""
    root = Path(packs_dir)
    out = []
    for path in _pack_files(root):
        raw = fmt.read_bytes(path)  # PackError for a FIFO, a directory, no permission, ...
        data = fmt.loads(raw, str(path))
        rel = path.relative_to(root).as_posix()
        if (data["hardware"], data["kernel"]) != (path.parent.name, path.stem):
            raise fmt.PackError(f"{path}: holds the {data['hardware']}/{data['kernel']} "
                                "pack under another name")
        verify.check(data, str(path))  # what lookup would refuse is not published
        out.append((rel, raw, data))
    return out


def _pack_files(root: Path) -> list[Path]:
    """Every ``<hardware>/<kernel>.json`` under ``root`` whatever its file type, skipping
    hidden names (staging, temporary and lock files); PackError for a folder that cannot
    be listed: a push must not leave out what it cannot see."""
    def listing(folder: Path) -> list[Path]:
        try:
            return sorted(p for p in folder.iterdir() if not p.name.startswith("."))
        except OSError as exc:
            raise fmt.PackError(f"{folder}: cannot list: {exc.strerror or exc}") from None

    if not fmt.exists(root):
        return []
    out = []
    for hw_dir in listing(root):
        try:
            if not hw_dir.is_dir():
                continue
        except OSError:
            continue  # not a folder of packs (a symlink loop, ...): no pack there
        out += [p for p in listing(hw_dir) if p.name.endswith(".json")]
    return out


def _get_manifest(s3: Any, bucket: str, prefix: str, name: str = MANIFEST
                  ) -> dict[str, Any] | None:
    from botocore.exceptions import ClientError

    key = _key(prefix, name)
    where = f"s3://{bucket}/{key}"
    try:
        raw = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
            return None
        raise _remote_error(exc, where) from None
    except Exception as exc:
        raise _remote_error(exc, where) from None
    try:
        m = json.loads(raw)
    except ValueError as exc:
        raise S3Error(f"{where}: not valid JSON: {exc}") from None
    if not isinstance(m, dict) or m.get("format") != MANIFEST_FORMAT \
            or m.get("version") != MANIFEST_VERSION or not isinstance(m.get("packs"), list):
        raise S3Error(f"{where}: not a {MANIFEST_FORMAT} v{MANIFEST_VERSION} manifest")
    seen: set[str] = set()
    for e in m["packs"]:
        if not (isinstance(e, dict) and isinstance(e.get("path"), str)
                and _REL.fullmatch(e["path"]) and isinstance(e.get("object"), str)
                and _OBJECT.fullmatch(e["object"]) and isinstance(e.get("sha256"), str)):
            raise S3Error(f"{where}: bad entry {str(e)[:200]}")
        if e["path"] in seen:
            raise S3Error(f"{where}: lists {e['path']} twice: refusing the set")
        seen.add(e["path"])
        size = e.get("size")
        if isinstance(size, int) and size > fmt.MAX_BYTES:
            raise S3Error(f"{where}: {e['path']} is {size:,} bytes, above the "
                          f"{fmt.MAX_BYTES // MB} MB a pack may have: refusing the set")
    return m


def _exists(s3: Any, bucket: str, key: str) -> bool:
    from botocore.exceptions import ClientError

    try:
        s3.head_object(Bucket=bucket, Key=key)
        return True
    except ClientError as exc:
        # 403: without s3:ListBucket, S3 answers a missing key with 403; upload anyway.
        if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound",
                                                         "403", "Forbidden", "AccessDenied"):
            return False
        raise


def push(url: str, packs_dir: str | Path = "packs", *, client: Any = None,
         endpoint_url: str | None = None, config: Any = None,
         replace: bool = False) -> dict[str, Any]:
    """Publish the packs under ``packs_dir``; returns the new manifest.

    The new set is the previous published set with these packs added or replaced (by
    hardware/kernel path); ``replace=True`` publishes exactly the local packs. Two pushes
    racing each other: the later manifest wins and may drop the other's new packs.
    """
    bucket, prefix = parse_url(url)
    try:
        packs = local_packs(packs_dir)
    except fmt.PackError as exc:
        raise S3Error(f"refusing to push: {exc}", bad_input=True) from None
    if not packs:
        raise S3Error(f"no packs under {packs_dir} (expected <hardware>/<kernel>.json)",
                      bad_input=True)
    s3 = client or make_client(endpoint_url)
    config = config or transfer_config()
    prev = _get_manifest(s3, bucket, prefix)
    listed = {} if replace or prev is None else {e["path"]: e for e in prev["packs"]}
    for rel, raw, data in packs:
        sha = _sha256(raw)
        obj = f"objects/{sha}.json"
        key = _key(prefix, obj)
        try:
            if not _exists(s3, bucket, key):
                s3.upload_fileobj(io.BytesIO(raw), bucket, key, Config=config,
                                  ExtraArgs={"ContentType": "application/json"})
        except Exception as exc:
            raise _remote_error(exc, f"s3://{bucket}/{key} ({rel})") from None
        listed[rel] = {"path": rel, "object": obj, "sha256": sha, "size": len(raw),
                       "hardware": data["hardware"], "kernel": data["kernel"],
                       "checksum": data["checksum"]}
    now = dt.datetime.now(dt.timezone.utc)
    manifest = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION,
                "created": now.isoformat(timespec="seconds"),
                "previous": prev.get("id") if prev else None,
                "packs": [listed[k] for k in sorted(listed)]}
    manifest["id"] = now.strftime("%Y%m%dT%H%M%S%fZ") + "-" + _sha256(
        json.dumps(manifest["packs"], sort_keys=True).encode())[:12]
    body = (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()
    for name in (f"manifests/{manifest['id']}.json", MANIFEST):  # manifest.json LAST
        key = _key(prefix, name)
        try:
            s3.put_object(Bucket=bucket, Key=key, Body=body, ContentType="application/json")
        except Exception as exc:
            raise _remote_error(exc, f"s3://{bucket}/{key}") from None
    return manifest


def pull(url: str, packs_dir: str | Path = "packs", *, client: Any = None,
         endpoint_url: str | None = None, config: Any = None,
         manifest: str | None = None) -> list[Path]:
    """Fetch the published set (or the one in ``manifests/<id>.json``) into ``packs_dir``.

    Nothing under ``packs_dir`` changes unless every object verifies. Local packs that the
    set does not list are left alone. Returns the paths written.
    """
    bucket, prefix = parse_url(url)
    s3 = client or make_client(endpoint_url)
    config = config or transfer_config()
    name = MANIFEST if manifest is None else f"manifests/{manifest.removesuffix('.json')}.json"
    m = _get_manifest(s3, bucket, prefix, name)
    if m is None:
        raise S3Error(f"s3://{bucket}/{_key(prefix, name)}: no such manifest "
                      "(nothing published there?)", bad_input=True)
    root = Path(packs_dir)
    created = not root.exists()
    root.mkdir(parents=True, exist_ok=True)
    _sweep_staging(root)
    staging = Path(tempfile.mkdtemp(prefix=f".pull-{os.getpid()}-", dir=root))
    done = False
    try:
        with _terminate_as_exit():
            fetched = [_fetch(s3, bucket, prefix, e, staging, config) for e in m["packs"]]
            written = _swap(root, staging, fetched)
            done = True
            return written
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if created and not done:
            with contextlib.suppress(OSError):
                root.rmdir()  # created for this pull, and empty again


def _fetch(s3: Any, bucket: str, prefix: str, e: dict[str, Any], staging: Path,
           config: Any) -> str:
    """Download one listed pack into ``staging`` and check it as lookup would: its
    size, the manifest's SHA-256, the pack's own checksum and schema, its place, and
    every entry against its kernel (``verify``). Returns its relative path."""
    key = _key(prefix, e["object"])
    where = f"s3://{bucket}/{key}"
    try:
        size = int(s3.head_object(Bucket=bucket, Key=key).get("ContentLength", 0))
    except Exception as exc:
        raise _remote_error(exc, where) from None
    if size > fmt.MAX_BYTES:
        raise S3Error(f"{where}: {size:,} bytes, above the {fmt.MAX_BYTES // MB} MB a pack "
                      f"may have ({e['path']}): refusing the set")
    buf = io.BytesIO()
    try:
        s3.download_fileobj(bucket, key, buf, Config=config)
    except Exception as exc:
        raise _remote_error(exc, where) from None
    raw = buf.getvalue()
    if _sha256(raw) != e["sha256"]:
        raise S3Error(f"{where}: SHA-256 {_sha256(raw)} is not the manifest's "
                      f"{e['sha256']} for {e['path']}: refusing the set")
    try:
        data = fmt.loads(raw, f"{where} ({e['path']})")
        hw, _, kfile = e["path"].partition("/")
        if (data["hardware"], data["kernel"] + ".json") != (hw, kfile):
            raise fmt.PackError(f"{where}: holds {data['hardware']}/{data['kernel']}, "
                                f"not {e['path']}")
        verify.check(data, f"{where} ({e['path']})")
    except fmt.PackError as exc:
        raise S3Error(f"{exc}: refusing the set") from None
    target = staging / "new" / e["path"]
    target.parent.mkdir(parents=True, exist_ok=True)
    fmt.write_text(target, raw)
    return e["path"]


def _swap(root: Path, staging: Path, rels: list[str]) -> list[Path]:
    """Move the checked packs into place. The packs they replace go aside first; if a
    move fails, every replaced pack comes back, so the live set is the old one or the
    new one, never a mix."""
    moved: list[tuple[Path, Path | None]] = []  # (destination, its old pack set aside)
    with contextlib.ExitStack() as held:
        # Under each pack's lock (in the order of their paths as strings, as a merge takes
        # them: no deadlock): a merge or a run freezing into one of them waits, and then
        # reads the pulled pack rather than overwriting it.
        for rel in sorted(rels):
            held.enter_context(fmt.locked(root / rel))
        _move(root, staging, rels, moved)
    return [dest for dest, _ in moved]


def _move(root: Path, staging: Path, rels: list[str],
          moved: list[tuple[Path, Path | None]]) -> None:
    """``_swap``'s moves, each recorded in ``moved``; undone on any failure."""
    try:
        for rel in rels:
            dest = root / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            old = None
            if dest.exists():
                old = staging / "old" / rel
                old.parent.mkdir(parents=True, exist_ok=True)
                os.replace(dest, old)
            moved.append((dest, old))
            os.replace(staging / "new" / rel, dest)
    except BaseException:
        for dest, old in reversed(moved):
            if old is not None and old.exists():
                os.replace(old, dest)
            elif old is None:
                dest.unlink(missing_ok=True)
        raise


def _sweep_staging(root: Path) -> None:
    """Remove the staging directories of pulls whose process is gone (killed)."""
    for path in root.glob(".pull-*"):
        pid = path.name.split("-")[1] if path.name.count("-") >= 2 else ""
        if pid.isdigit() and _alive(int(pid)):
            continue
        shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def _terminate_as_exit() -> Iterator[None]:
    """SIGTERM (a job killed politely) raises SystemExit during a pull, so that its
    ``finally`` removes the staging directory; elsewhere the handler is left alone."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
