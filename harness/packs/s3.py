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

import datetime as dt
import hashlib
import io
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from harness.packs import format as fmt

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
    for path in sorted(root.glob("*/*.json")):
        if path.parent.name.startswith(".") or path.name.startswith("."):
            continue  # staging and temp files
        raw = path.read_bytes()
        data = fmt.loads(raw, str(path))
        rel = path.relative_to(root).as_posix()
        if (data["hardware"], data["kernel"]) != (path.parent.name, path.stem):
            raise fmt.PackError(f"{path}: holds the {data['hardware']}/{data['kernel']} "
                                "pack under another name")
        out.append((rel, raw, data))
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
    for e in m["packs"]:
        if not (isinstance(e, dict) and isinstance(e.get("path"), str)
                and _REL.fullmatch(e["path"]) and isinstance(e.get("object"), str)
                and _OBJECT.fullmatch(e["object"]) and isinstance(e.get("sha256"), str)):
            raise S3Error(f"{where}: bad entry {e!r}")
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
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".pull-", dir=root))
    try:
        for e in m["packs"]:
            key = _key(prefix, e["object"])
            where = f"s3://{bucket}/{key}"
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
            except fmt.PackError as exc:
                raise S3Error(str(exc)) from None
            hw, _, kfile = e["path"].partition("/")
            if (data["hardware"], data["kernel"] + ".json") != (hw, kfile):
                raise S3Error(f"{where}: holds {data['hardware']}/{data['kernel']}, "
                              f"not {e['path']}")
            target = staging / e["path"]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(raw)
        written = []
        for e in m["packs"]:
            dest = root / e["path"]
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(staging / e["path"], dest)
            written.append(dest)
        return written
    finally:
        shutil.rmtree(staging, ignore_errors=True)
