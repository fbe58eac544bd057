"""Remote tracking: ``kharness run`` against a real ``mlflow server`` (sqlite backend,
artifacts proxied to S3, here moto's S3 server), then the runs, metrics and artifacts
(the pack, the plots) read back through the server and found in the bucket."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow

moto_server = pytest.importorskip("moto.server")
boto3 = pytest.importorskip("boto3")

BUCKET = "harness-mlflow"
CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing-secret-key",
         "AWS_DEFAULT_REGION": "us-east-1"}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"mlflow server exited: {proc.stdout.read()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer in {timeout} s")


@pytest.fixture(scope="module")
def servers(tmp_path_factory, empty_mlflow_db):
    """One S3 (moto) and one MLflow server for the module's runs (each experiment has a
    name of its own): a tracking server takes many seconds to start on two cores."""
    tmp_path = tmp_path_factory.mktemp("tracking-server")
    empty_mlflow_db(tmp_path / "server.db")  # the server's store, its schema already built
    with pytest.MonkeyPatch.context() as monkeypatch:
        yield from _servers(tmp_path, monkeypatch)


def _servers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    s3_port = _port()
    s3 = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=s3_port)
    s3.start()
    endpoint = f"http://127.0.0.1:{s3_port}"
    for k, v in {**CREDS, "MLFLOW_S3_ENDPOINT_URL": endpoint}.items():
        monkeypatch.setenv(k, v)
    bucket = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    bucket.create_bucket(Bucket=BUCKET)
    port = _port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
         "--artifacts-destination", f"s3://{BUCKET}/mlartifacts", "--serve-artifacts",
         "--workers", "1"],
        # No job runner: it starts eight processes (about 40 CPU-s) for MLflow features
        # that a run never uses.
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        cwd=tmp_path)
    try:
        _wait_http(f"http://127.0.0.1:{port}/health", proc)
        yield f"http://127.0.0.1:{port}", bucket
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        s3.stop()


def test_run_against_tracking_server(tmp_path, servers):
    """``kharness run --json`` against the server, with ``user:password@`` in
    ``tracking.uri``: the runs, metrics and artifacts read back through the server and
    found in the bucket; MLflow sends the credentials from the environment, ``--json``
    prints JSON only (no MLflow "View run" links), and the password is in no output,
    state file, Ray log or MLflow run."""
    import json
    import shutil
    import tempfile

    uri, bucket = servers
    password = "pw-never-stored-4711"
    host = uri.removeprefix("http://")
    exp = {
        "name": "remote", "kernel": "grouped_gemm",
        "shapes": [{"M": 200, "N": 64, "K": 64, "E": 3}], "dtypes": ["fp16"],
        "search": {"sampler": "random", "trials": 3},
        "search_space": {"hardware": {"cpu": {"params": {
            "BLOCK_N": [64], "BLOCK_K": [64], "GROUP_M": [1, 4], "PERSISTENT": [0, 1]}}}},
        "tracking": {"uri": f"http://alice:{password}@{host}"},
        "output": {"packs_dir": str(tmp_path / "packs"), "runs_dir": str(tmp_path / "runs")},
    }
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(exp))
    ray_tmp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_TMPDIR": ray_tmp}
    for var in ("TRITON_INTERPRET", "RAY_ADDRESS", "MLFLOW_TRACKING_PASSWORD"):
        env.pop(var, None)
    try:
        proc = subprocess.run([sys.executable, "-m", "harness", "run", str(path), "--json"],
                              cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        summary = json.loads(proc.stdout)  # JSON only on stdout
        assert summary["tracking_uri"] == uri
        out = proc.stdout + proc.stderr
        assert password not in out and CREDS["AWS_SECRET_ACCESS_KEY"] not in out
        stored = [p for root in (tmp_path / "runs", Path(ray_tmp)) for p in root.rglob("*")
                  if p.is_file() and not p.is_symlink()]
        assert any(p.name == "state.json" for p in stored)
        leaks = [str(p) for p in stored if password.encode() in p.read_bytes()]
        assert not leaks, leaks
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)

    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("remote")
    assert experiment.artifact_location.startswith("mlflow-artifacts:")
    runs = client.search_runs([experiment.experiment_id], max_results=100)
    assert runs and all(password not in json.dumps(r.to_dictionary()) for r in runs)
    by_level: dict[str, list] = {}
    for r in runs:
        by_level.setdefault(r.data.tags.get("harness.level"), []).append(r)
    (parent,) = by_level["experiment"]
    (study,) = by_level["study"]
    assert len(by_level["trial"]) == 3
    for tag in ("hardware", "kernel", "shape", "git_sha", "triton", "torch", "cuda"):
        assert study.data.tags.get(tag), tag
        assert all(t.data.tags.get(tag) for t in by_level["trial"]), tag
    for metric in ("best_latency_ms", "best_p20_ms", "best_p80_ms", "best_tflops",
                   "best_gbps", "best_speedup_vs_eager", "best_speedup_vs_default",
                   "best_max_abs_err", "eager_latency_ms", "default_latency_ms"):
        assert metric in study.data.metrics, metric
    packs = [a.path for a in client.list_artifacts(parent.info.run_id, "packs")]
    plots = [a.path for a in client.list_artifacts(study.info.run_id, "plots")]
    assert packs == ["packs/grouped_gemm.json"]
    # (importance needs two measured trials with varied params: not asserted here)
    assert {"plots/history.png", "plots/roofline.png"} <= set(plots)
    # Downloaded back through the server: the pack as frozen on disk.
    local = client.download_artifacts(parent.info.run_id, "packs/grouped_gemm.json",
                                      str(tmp_path / "dl"))
    assert Path(local).read_bytes() == (tmp_path / "packs" / "cpu" / "grouped_gemm.json") \
        .read_bytes()
    # And in the bucket itself, under the artifacts destination.
    keys = [o["Key"] for o in bucket.list_objects_v2(Bucket=BUCKET,
                                                      Prefix="mlartifacts/")["Contents"]]
    assert any(k.endswith(f"{parent.info.run_id}/artifacts/packs/grouped_gemm.json")
               for k in keys), keys
    assert any(k.endswith(f"{study.info.run_id}/artifacts/plots/roofline.png") for k in keys)
