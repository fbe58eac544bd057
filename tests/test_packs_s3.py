"""Pack distribution against a real S3 endpoint: moto's server over HTTP on loopback.

Nothing here mocks S3 itself: boto3 signs real requests and talks HTTP to the server.
"""

from __future__ import annotations

import json
import uuid

import pytest

pytest.importorskip("boto3")
moto_server = pytest.importorskip("moto.server")

from harness import packs  # noqa: E402
from harness.cli import main  # noqa: E402
from harness.packs import format as fmt  # noqa: E402
from harness.packs import s3  # noqa: E402

SECRET = "fake-secret-key-never-printed"


@pytest.fixture(scope="module")
def endpoint():
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def env(endpoint, monkeypatch, tmp_path):
    # Fake credentials through boto3's standard chain (the environment); no real config.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAFAKEFORTESTS0000")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(var, raising=False)
    return endpoint


@pytest.fixture
def bucket(env):
    name = f"packs-{uuid.uuid4().hex[:12]}"
    s3.make_client().create_bucket(Bucket=name)
    return name


def _entry(block_m: int, latency: float = 0.5) -> dict:
    return {"config": {"BLOCK_M": block_m, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8,
                       "num_warps": 8, "num_stages": 3, "PERSISTENT": 0},
            "metrics": {"latency_ms": latency}, "provenance": {"device_name": "NVIDIA H100"}}


def _make_packs(root, version: int):
    """Two packs whose content depends on ``version``."""
    packs.freeze(root, "H100", "grouped_gemm", "bf16",
                 {f"M={4096 * version},N=1408,K=2048,E=64": _entry(64)})
    packs.freeze(root, "H200", "grouped_gemm", "bf16",
                 {f"M={8192 * version},N=1408,K=2048,E=64": _entry(128)})
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.glob("*/*.json")}


def _files(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.glob("*/*.json")}


def _fail_on(client, nth_put: int | None = None, key_suffix: str | None = None):
    """Make the client's Nth PutObject (or the one for ``key_suffix``) fail mid-push."""
    count = {"put": 0}

    def hook(params, **_):
        count["put"] += 1
        if count["put"] == nth_put or (key_suffix and params["Key"].endswith(key_suffix)):
            raise ConnectionError("network dropped (injected)")

    client.meta.events.register("before-parameter-build.s3.PutObject", hook)
    return count


def test_push_then_pull_round_trip(bucket, tmp_path):
    src = _make_packs(tmp_path / "a", 1)
    m = s3.push(f"s3://{bucket}/team/packs", tmp_path / "a")
    assert [e["path"] for e in m["packs"]] == sorted(src)
    client = s3.make_client()
    keys = {o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]}
    assert "team/packs/manifest.json" in keys
    assert {f"team/packs/{e['object']}" for e in m["packs"]} <= keys  # content-addressed
    assert any(k.startswith("team/packs/manifests/") for k in keys)
    written = s3.pull(f"s3://{bucket}/team/packs", tmp_path / "b")
    assert len(written) == 2 and _files(tmp_path / "b") == src
    assert not [p for p in (tmp_path / "b").iterdir() if p.name.startswith(".")]


def test_large_packs_go_multipart(bucket, tmp_path):
    _make_packs(tmp_path / "a", 1)
    client = s3.make_client()
    multipart = []
    client.meta.events.register("before-parameter-build.s3.CreateMultipartUpload",
                                lambda **kw: multipart.append(kw["params"]["Key"]))
    # A low threshold stands in for a pack of many megabytes.
    s3.push(f"s3://{bucket}/p", tmp_path / "a", client=client,
            config=s3.transfer_config(multipart_threshold=256))
    assert len(multipart) == 2
    s3.pull(f"s3://{bucket}/p", tmp_path / "b", client=client,
            config=s3.transfer_config(multipart_threshold=256))
    assert _files(tmp_path / "b") == _files(tmp_path / "a")


@pytest.mark.parametrize("where", ["objects", "manifest"])
def test_interrupted_push_leaves_readers_on_the_previous_set(bucket, tmp_path, where):
    url = f"s3://{bucket}/packs"
    v1 = _make_packs(tmp_path / "v1", 1)
    s3.push(url, tmp_path / "v1")
    v2 = _make_packs(tmp_path / "v2", 2)
    assert v2 != v1
    client = s3.make_client()
    if where == "objects":  # the first new object lands, the second does not
        count = _fail_on(client, nth_put=2)
    else:  # every object and the history copy land; manifest.json does not
        count = _fail_on(client, key_suffix="packs/manifest.json")
    with pytest.raises(s3.S3Error, match="injected"):
        s3.push(url, tmp_path / "v2", client=client)
    assert count["put"] >= 2
    s3.pull(url, tmp_path / "reader")  # a fresh client, as another machine would
    assert _files(tmp_path / "reader") == v1
    s3.push(url, tmp_path / "v2")  # a retry publishes the whole new set
    s3.pull(url, tmp_path / "reader2")
    assert _files(tmp_path / "reader2") == v2


def test_push_adds_to_the_published_set_unless_replace(bucket, tmp_path):
    url = f"s3://{bucket}/packs"
    _make_packs(tmp_path / "a", 1)
    s3.push(url, tmp_path / "a")
    packs.freeze(tmp_path / "b", "A100", "grouped_gemm", "bf16",
                 {"M=1,N=1408,K=2048,E=64": _entry(16)})
    m = s3.push(url, tmp_path / "b")
    assert [e["path"] for e in m["packs"]] == ["A100/grouped_gemm.json",
                                               "H100/grouped_gemm.json",
                                               "H200/grouped_gemm.json"]
    m = s3.push(url, tmp_path / "b", replace=True)
    assert [e["path"] for e in m["packs"]] == ["A100/grouped_gemm.json"]
    # The older set stays reachable through its history manifest.
    s3.pull(url, tmp_path / "old", manifest=m["previous"])
    assert sorted(_files(tmp_path / "old")) == ["A100/grouped_gemm.json",
                                                "H100/grouped_gemm.json",
                                                "H200/grouped_gemm.json"]


def test_tampered_object_is_refused_and_nothing_changes(bucket, tmp_path):
    url = f"s3://{bucket}/packs"
    _make_packs(tmp_path / "a", 1)
    m = s3.push(url, tmp_path / "a")
    local = tmp_path / "local"
    old = _make_packs(local, 3)
    client = s3.make_client()
    obj = f"packs/{m['packs'][1]['object']}"
    body = json.loads(client.get_object(Bucket=bucket, Key=obj)["Body"].read())
    body["kernels"]["grouped_gemm"]["bf16"]["M=8192,N=1408,K=2048,E=64"]["config"][
        "BLOCK_M"] = 256
    client.put_object(Bucket=bucket, Key=obj, Body=fmt.dumps(body).encode())  # re-signed
    with pytest.raises(s3.S3Error, match="SHA-256"):
        s3.pull(url, local)
    assert _files(local) == old


def test_damaged_local_pack_is_not_pushed(bucket, tmp_path):
    _make_packs(tmp_path / "a", 1)
    (tmp_path / "a" / "H100" / "grouped_gemm.json").write_text("{ truncated")
    with pytest.raises(s3.S3Error, match="refusing to push") as exc:
        s3.push(f"s3://{bucket}/packs", tmp_path / "a")
    assert exc.value.bad_input


def test_cli_push_pull_and_no_credentials_in_output(bucket, tmp_path, capsys):
    _make_packs(tmp_path / "a", 1)
    url = f"s3://{bucket}/cli"
    assert main(["packs", "push", url, "--dir", str(tmp_path / "a")]) == 0
    assert main(["packs", "pull", url, "--dir", str(tmp_path / "b")]) == 0
    assert _files(tmp_path / "b") == _files(tmp_path / "a")
    assert main(["packs", "pull", f"s3://{bucket}/nothing-here", "--dir",
                 str(tmp_path / "c")]) == 2
    assert main(["packs", "push", f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/x", "--dir",
                 str(tmp_path / "a")]) == 2
    out = capsys.readouterr()
    assert "published 2 packs" in out.out and "no such manifest" in out.err
    assert "NoSuchBucket" in out.err
    assert SECRET not in out.out + out.err


def test_cli_endpoint_option(bucket, tmp_path, monkeypatch, env):
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    _make_packs(tmp_path / "a", 1)
    assert main(["packs", "push", f"s3://{bucket}/opt", "--dir", str(tmp_path / "a"),
                 "--endpoint-url", env]) == 0


@pytest.mark.parametrize("url", ["bucket/prefix", "s3://", "s3://Bad_Bucket/x",
                                 "https://bucket/x", "s3://bucket/a//b"])
def test_bad_url_exits_2(url, tmp_path, capsys):
    _make_packs(tmp_path, 1)
    assert main(["packs", "push", url, "--dir", str(tmp_path)]) == 2
    assert main(["packs", "pull", url, "--dir", str(tmp_path)]) == 2
    assert "error:" in capsys.readouterr().err


def test_debug_logging_never_shows_credentials(bucket, tmp_path, monkeypatch, caplog):
    import logging

    token = "fake-session-token-never-printed"
    monkeypatch.setenv("AWS_SESSION_TOKEN", token)
    caplog.set_level(logging.DEBUG)
    _make_packs(tmp_path / "a", 1)
    assert main(["--log-level", "DEBUG", "packs", "push", f"s3://{bucket}/dbg", "--dir",
                 str(tmp_path / "a")]) == 0
    assert main(["--log-level", "DEBUG", "packs", "pull", f"s3://{bucket}/dbg", "--dir",
                 str(tmp_path / "b")]) == 0
    assert caplog.records  # something was logged ...
    assert SECRET not in caplog.text and token not in caplog.text  # ... but no credential


# -- the runtime's checks before anything changes -----------------------------------------
def _publish_raw(client, bucket: str, prefix: str, files: dict[str, bytes],
                 listing: list[str] | None = None) -> None:
    """Publish a set as a push would, without push's own checks (a foreign publisher)."""
    entries = []
    for rel in listing or sorted(files):
        raw = files[rel]
        sha = s3._sha256(raw)
        client.put_object(Bucket=bucket, Key=f"{prefix}/objects/{sha}.json", Body=raw)
        entries.append({"path": rel, "object": f"objects/{sha}.json", "sha256": sha,
                        "size": len(raw)})
    manifest = {"format": s3.MANIFEST_FORMAT, "version": s3.MANIFEST_VERSION, "id": "x",
                "packs": entries}
    client.put_object(Bucket=bucket, Key=f"{prefix}/manifest.json",
                      Body=json.dumps(manifest).encode())


def _bad_pack(how: str) -> bytes:
    data = fmt.empty("H100", "grouped_gemm")
    entry = _entry(24 if how == "constraints" else 64)  # 24: not a power of two
    if how == "type":
        entry["config"]["BLOCK_N"] = "128"
    data["kernels"]["grouped_gemm"]["bf16"] = {"M=4096,N=1408,K=2048,E=64": entry}
    return fmt.dumps(data).encode()


@pytest.mark.parametrize("how", ["constraints", "type"])
def test_a_pack_the_runtime_refuses_is_not_pushed(bucket, tmp_path, capsys, how):
    path = tmp_path / "a" / "H100" / "grouped_gemm.json"
    fmt.write_text(path, _bad_pack(how))
    packs.read(path)  # schema and checksum are fine: only the kernel knows
    assert main(["packs", "push", f"s3://{bucket}/p", "--dir", str(tmp_path / "a")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "refusing to push" in err and "Traceback" not in err
    assert "constraints" in err if how == "constraints" else "not of type int" in err
    assert "Contents" not in s3.make_client().list_objects_v2(Bucket=bucket)  # nothing sent


@pytest.mark.parametrize("how", ["constraints", "type", "twice", "size"])
def test_pull_checks_everything_before_changing_anything(bucket, tmp_path, how):
    url = f"s3://{bucket}/bad"
    good = _make_packs(tmp_path / "a", 1)
    files = dict(good)
    listing = None
    if how in ("constraints", "type"):
        files["H100/grouped_gemm.json"] = _bad_pack(how)
    elif how == "twice":
        listing = sorted(files) + ["H100/grouped_gemm.json"]
    client = s3.make_client()
    _publish_raw(client, bucket, "bad", files, listing)
    if how == "size":
        m = json.loads(client.get_object(Bucket=bucket, Key="bad/manifest.json")["Body"].read())
        m["packs"][0]["size"] = fmt.MAX_BYTES + 1
        client.put_object(Bucket=bucket, Key="bad/manifest.json", Body=json.dumps(m).encode())
    local = tmp_path / "local"
    old = _make_packs(local, 3)
    words = {"constraints": "constraints", "type": "not of type int", "twice": "twice",
             "size": "above the"}[how]
    with pytest.raises(s3.S3Error, match=words):
        s3.pull(url, local)
    assert _files(local) == old
    assert not [p for p in local.iterdir() if p.name.startswith(".")]  # no staging left


def test_a_failed_swap_puts_every_replaced_pack_back(bucket, tmp_path, monkeypatch):
    url = f"s3://{bucket}/swap"
    _make_packs(tmp_path / "a", 1)
    s3.push(url, tmp_path / "a")
    local = tmp_path / "local"
    old = _make_packs(local, 3)
    real_replace = s3.os.replace
    calls = {"n": 0}

    def replace(src, dst):
        calls["n"] += 1
        if calls["n"] == 4:  # old H100 aside, new H100 in, old H200 aside: then the disk fails
            raise OSError(28, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(s3.os, "replace", replace)
    with pytest.raises(OSError, match="No space"):
        s3.pull(url, local)
    assert _files(local) == old
    assert not [p for p in local.iterdir() if p.name.startswith(".")]


def test_a_killed_pulls_staging_is_swept_by_the_next(bucket, tmp_path):
    import subprocess
    import sys

    url = f"s3://{bucket}/sweep"
    src = _make_packs(tmp_path / "a", 1)
    s3.push(url, tmp_path / "a")
    local = tmp_path / "local"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    stale = local / f".pull-{dead}-abc123"
    (stale / "new" / "H100").mkdir(parents=True)
    (stale / "new" / "H100" / "grouped_gemm.json").write_text("{}")
    s3.pull(url, local)
    assert _files(local) == src and not stale.exists()
