"""The whole ``run`` job on a real local Ray, real MLflow (sqlite) and real Optuna storage.

Kernels run under Triton's interpreter on a CPU worker; the test checks the pipeline:
the search, the measurements, the MLflow run tree, the frozen pack and its lookup.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import yaml
from mlflow.tracking import MlflowClient

from harness import packs
from harness.kernel import api as kernel_api
from harness.measure.hardware import spec_for_key
from tests.fault_kernels import may_renice

pytestmark = pytest.mark.slow

SHAPE = {"M": 200, "N": 64, "K": 64, "E": 3}


def _experiment(tmp_path: Path, trials: int = 5) -> Path:
    exp = {
        "name": "pipe",
        "kernel": "grouped_gemm",
        "shapes": [SHAPE],
        "dtypes": ["fp16"],
        "search": {"sampler": "tpe", "trials": trials},
        "search_space": {"hardware": {"cpu": {"params": {
            "BLOCK_N": [64], "BLOCK_K": [64], "GROUP_M": [1, 4], "PERSISTENT": [0, 1],
            "num_stages": [2, 3]}}}},
        "tracking": {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
        "output": {"packs_dir": str(tmp_path / "packs"), "runs_dir": str(tmp_path / "runs")},
    }
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(exp))
    return path


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("TRITON_INTERPRET", None)  # the worker decides for itself
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def test_run_end_to_end(tmp_path):
    path = _experiment(tmp_path)
    proc = _cli("run", str(path), "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "say NOTHING about GPU performance" in proc.stderr
    out = json.loads(proc.stdout)
    assert out["interpreted"] is True
    (row,) = out["rows"]
    assert row["hardware"] == "cpu" and row["counts"]["measured"] == 5
    assert row["latency_ms"] > 0 and row["eager_latency_ms"] > 0
    assert row["default_latency_ms"] > 0 and row["speedup_vs_default"] > 0
    # The wall counts the process's imports; the worker's start-up is broken down by step.
    line = out["timeline_s"]
    assert 0 < line["run_called"] < line["ray_connected"] < line["done"] <= out["wall_s"] + 0.01
    assert line["run_called"] < line["validated"] < line["workers_ready"]
    start = out["worker_startup_s"]["cpu"]
    assert {"import_torch", "device", "total_in_init", "launch_to_ready"} <= set(start)
    assert start["launch_to_ready"] >= start["total_in_init"] > 0
    # Ray starts its workers at nice 15; a worker takes nice 0 back where the OS lets it.
    assert out["worker_nice"]["cpu"] == (0 if may_renice() else 15)

    # The pack: valid, checksummed, a config the kernel accepts, provenance filled in.
    pack_file = tmp_path / "packs" / "cpu" / "grouped_gemm.json"
    assert out["packs"] == [str(pack_file)]
    data = packs.read(pack_file)
    entry = data["kernels"]["grouped_gemm"]["fp16"]["M=200,N=64,K=64,E=3"]
    fam = kernel_api.get("grouped_gemm")
    assert fam.check_config(entry["config"], SHAPE, spec_for_key("cpu")) is None
    assert entry["metrics"]["latency_ms"] == pytest.approx(row["latency_ms"])
    prov = entry["provenance"]
    assert prov["interpreted"] is True and prov["mlflow_run_id"] == row["mlflow_run_id"]
    assert prov["triton"] and prov["torch"] and prov["date"]
    # What the config computes in, and the bound it met (the family's fp16 tolerance).
    assert prov["precision"] == "fp16"
    assert prov["accuracy_bound"] == {"atol": 1e-2, "rtol": 1e-2}

    # The application's view: lookup returns the frozen config with no tuning.
    packs.configure([tmp_path / "packs"])
    try:
        hit = packs.lookup_entry("grouped_gemm", "fp16", "cpu", **SHAPE)
    finally:
        packs.configure(None)
    assert hit.source == "exact" and hit.config == entry["config"]

    # Optuna: the study persisted with the measured trials, the default among them.
    storage = f"sqlite:///{tmp_path / 'runs' / 'pipe' / 'optuna.db'}"
    study = optuna.load_study(study_name="pipe/grouped_gemm/M=200,N=64,K=64,E=3/fp16/cpu",
                              storage=storage)
    measured = [t for t in study.trials if t.user_attrs.get("status") == "measured"]
    assert len(measured) == 5 and study.best_value == pytest.approx(row["latency_ms"])

    # MLflow: experiment -> study -> trial runs, tags and the pack artifact.
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("pipe")
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    by_level: dict[str, list] = {}
    for r in runs:
        by_level.setdefault(r.data.tags.get("harness.level"), []).append(r)
    (parent,) = by_level["experiment"]
    (study_run,) = by_level["study"]
    assert study_run.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert study_run.data.tags["hardware"] == "cpu"
    assert study_run.data.tags["kernel"] == "grouped_gemm"
    assert study_run.info.run_id == row["mlflow_run_id"]
    assert study_run.data.metrics["best_latency_ms"] == pytest.approx(row["latency_ms"])
    trials = by_level["trial"]
    assert len(trials) == 5
    assert all(t.data.tags["mlflow.parentRunId"] == study_run.info.run_id for t in trials)
    assert all("BLOCK_M" in t.data.params and "latency_ms" in t.data.metrics for t in trials)
    artifacts = [a.path for a in client.list_artifacts(parent.info.run_id, "packs")]
    assert artifacts == ["packs/grouped_gemm.json"]


def test_a_file_that_fails_its_kernel_checks_while_ray_starts_writes_nothing(tmp_path):
    """The checks that import the kernel run while Ray starts: a file that fails them
    (here a shape without the family's dims) exits 2 naming the field, with no MLflow
    store, runs folder or pack written and no Ray left behind."""
    path = _experiment(tmp_path)
    data = yaml.safe_load(path.read_text())
    data["shapes"] = [{"M": 64, "N": 64}]
    path.write_text(yaml.safe_dump(data))
    before = _gcs_pids()
    proc = _cli("run", str(path), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "shapes[0]" in proc.stderr and "missing ['K', 'E']" in proc.stderr
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "runs").exists()
    assert not (tmp_path / "packs").exists()
    assert _gcs_pids() <= before, "a Ray started for the failed run is still running"


def _gcs_pids() -> set[str]:
    """Ray GCS servers under this test process's Ray temp dir (which the CLI inherits):
    not those another test process starts meanwhile."""
    ps = subprocess.run(["pgrep", "-af", "gcs_server"], capture_output=True, text=True)
    mine = os.environ["RAY_TMPDIR"]
    return {line.split()[0] for line in ps.stdout.splitlines() if mine in line}
