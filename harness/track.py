"""Tracking: the only module that talks to MLflow.

Run layout (one scheme, so that the UI's comparison views line up):
- a parent run per experiment invocation (tag ``harness.level=experiment``),
- a child run per study (``harness.level=study``; tags hardware, kernel, shape, dtype),
  holding the study's summary metrics and step-indexed trial history,
- a grandchild run per measured trial (``harness.level=trial``) with the config as
  params and the measurement as metrics, so trials of a study compare side by side.
"""

from __future__ import annotations

import functools
import math
import os
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# MLflow is imported where it is used (2-3 s): the run imports this module before it
# starts Ray, and builds its Tracker on a thread while Ray starts.

DEFAULT_URI = "sqlite:///mlflow.db"

TRIAL_METRICS = ("latency_ms", "p20_ms", "p80_ms", "tflops", "gbps", "roofline",
                 "max_abs_err", "max_rel_err", "frac_within_1e3", "frac_within_1e2", "compile_s")
GPU_STATE_METRICS = ("sm_clock_mhz", "power_w")


def trial_metrics(result: Mapping[str, Any], status: str) -> dict[str, Any]:
    """A trial run's metrics: the measurement, the GPU's clock and power as its timing
    ended (``harness.measure.gpu_state``, where it could be read) and ``failed``."""
    extra = result.get("extra") or {}
    metrics = {k: result.get(k) for k in TRIAL_METRICS}
    metrics.update({k: extra[k] for k in GPU_STATE_METRICS if k in extra})
    metrics["failed"] = 1.0 if status == "failed" else 0.0
    return metrics


def tracking_uri(configured: str | None) -> str:
    return configured or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_URI


@functools.lru_cache(maxsize=1)
def git_sha() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5, cwd=Path(__file__).parent)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _finite(metrics: Mapping[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class Tracker:
    """MLflow runs for one experiment invocation."""

    def __init__(self, uri: str | None, experiment: str):
        import mlflow
        from mlflow.tracking import MlflowClient

        self.uri = tracking_uri(uri)
        mlflow.set_tracking_uri(self.uri)
        self.client = MlflowClient(self.uri)
        exp = self.client.get_experiment_by_name(experiment)
        self.experiment_id = (exp.experiment_id if exp is not None
                              else self.client.create_experiment(experiment))

    def _alive(self, run_id: str | None) -> bool:
        if not run_id:
            return False
        from mlflow.exceptions import MlflowException

        try:
            return self.client.get_run(run_id).info.lifecycle_stage == "active"
        except MlflowException:
            return False

    def start_run(self, name: str, tags: Mapping[str, str], parent: str | None = None,
                  resume: str | None = None) -> str:
        """Create a run, or reopen ``resume`` (a resumed experiment continues its runs)."""
        if self._alive(resume):
            self.client.update_run(resume, status="RUNNING")
            return resume  # type: ignore[return-value]
        all_tags = dict(tags)
        if parent:
            all_tags["mlflow.parentRunId"] = parent
        run = self.client.create_run(self.experiment_id, run_name=name, tags=all_tags)
        return run.info.run_id

    def log(self, run_id: str, params: Mapping[str, Any] | None = None,
            metrics: Mapping[str, Any] | None = None, tags: Mapping[str, Any] | None = None,
            step: int = 0) -> None:
        import time

        from mlflow.entities import Metric, Param, RunTag

        now = int(time.time() * 1000)
        self.client.log_batch(
            run_id,
            metrics=[Metric(k, v, now, step) for k, v in _finite(metrics or {}).items()],
            params=[Param(k, str(v)) for k, v in (params or {}).items()],
            tags=[RunTag(k, str(v)) for k, v in (tags or {}).items()],
        )

    def log_trial(self, study_run: str, number: int, config: Mapping[str, Any],
                  result: Mapping[str, Any], status: str) -> str:
        """One grandchild run per measured trial, plus the study run's history."""
        tags = {"harness.level": "trial", "harness.status": status,
                "harness.trial": str(number)}
        if result.get("reason"):
            tags["harness.failure_reason"] = str(result["reason"])[:5000]
        extra = result.get("extra") or {}
        if extra.get("node_id"):
            tags["harness.node_id"] = str(extra["node_id"])
        run_id = self.start_run(f"trial-{number}", tags, parent=study_run)
        self.log(run_id, params=config, metrics=trial_metrics(result, status))
        self.client.set_terminated(run_id, "FINISHED" if status == "measured" else "FAILED")
        if status == "measured":
            self.log(study_run, metrics={"trial_latency_ms": result.get("latency_ms")},
                     step=number)
        return run_id

    def log_study_plots(self, run_id: str, study: Any, title: str) -> list[str]:
        """The study's optimisation history, parameter importances (where they can be
        computed) and roofline plot, as PNG artifacts under ``plots/``."""
        from harness.report import study_plots

        names = []
        with tempfile.TemporaryDirectory() as tmp:
            for name, png in study_plots(study, title).items():
                path = Path(tmp) / f"{name}.png"
                path.write_bytes(png)
                self.client.log_artifact(run_id, str(path), "plots")
                names.append(f"plots/{name}.png")
        return names

    def log_artifact(self, run_id: str, path: str | Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(run_id, str(path), artifact_path)

    def finish(self, run_id: str, ok: bool = True) -> None:
        self.client.set_terminated(run_id, "FINISHED" if ok else "FAILED")


def read_runs(uri: str, parent_run_id: str) -> dict[str, Any]:
    """What the report shows from MLflow: the parent run and its study runs (metrics,
    tags, artifact paths). Raises MlflowException (or OSError) where it cannot be read."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    parent = client.get_run(parent_run_id)
    studies = client.search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}'", max_results=1000)
    out: dict[str, Any] = {"parent": {"run_id": parent_run_id, "name": parent.info.run_name,
                                      "status": parent.info.status,
                                      "experiment_id": parent.info.experiment_id,
                                      "tags": dict(parent.data.tags)}, "studies": []}
    for r in studies:
        try:
            plots = [a.path for a in client.list_artifacts(r.info.run_id, "plots")]
        except Exception:  # an unreachable artifact store: the run data still shows
            plots = []
        out["studies"].append({"run_id": r.info.run_id, "name": r.info.run_name,
                               "tags": dict(r.data.tags), "metrics": dict(r.data.metrics),
                               "plots": plots})
    return out


def find_parent(uri: str, run_id: str) -> dict[str, str]:
    """The run's name and tags (to find the experiment of a parent run id)."""
    from mlflow.tracking import MlflowClient

    run = MlflowClient(uri).get_run(run_id)
    return {"name": run.info.run_name or "", **dict(run.data.tags)}
