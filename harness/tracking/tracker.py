"""MLflow runs of an experiment: the only module that talks to MLflow.

Run layout (one scheme, so that the UI's comparison views line up):
- a parent run per experiment invocation (tag ``harness.level=experiment``),
- a child run per study (``harness.level=study``; tags hardware, kernel, shape, dtype),
  holding the study's summary metrics and step-indexed trial history,
- a grandchild run per measured trial (``harness.level=trial``) with the config as
  params and the measurement as metrics, so trials of a study compare side by side.
"""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from harness.tracking.plots import study_plots, warm_imports

# MLflow is imported where it is used (2-3 s): the run imports this module before it
# starts Ray, and builds its Tracker on a thread while Ray starts.

DEFAULT_URI = "sqlite:///mlflow.db"

TRIAL_METRICS = ("latency_ms", "p20_ms", "p80_ms", "tflops", "gbps", "roofline",
                 "max_abs_err", "max_rel_err", "frac_within_1e3", "frac_within_1e2", "compile_s")
GPU_STATE_METRICS = ("sm_clock_mhz", "power_w")
#: The study run's step-indexed history of its trials' latencies.
HISTORY_METRIC = "trial_latency_ms"


def trial_metrics(result: Mapping[str, Any], status: str) -> dict[str, Any]:
    """A trial run's metrics: the measurement, the GPU's clock and power as its timing
    ended (``harness.measure.gpu_state``, where it could be read) and ``failed``."""
    extra = result.get("extra") or {}
    metrics = {k: result.get(k) for k in TRIAL_METRICS}
    metrics.update({k: extra[k] for k in GPU_STATE_METRICS if k in extra})
    metrics["failed"] = 1.0 if status == "failed" else 0.0
    return metrics


def tracking_uri(configured: str | None) -> str:
    """The URI to use, its credentials moved into the environment (``move_credentials``)."""
    from harness.tracking.redact import move_credentials

    uri = configured or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_URI
    return move_credentials(uri) or DEFAULT_URI


@functools.lru_cache(maxsize=1)
def git_sha() -> str:
    """The harness checkout's commit, for provenance; ``HARNESS_GIT_SHA`` overrides it
    where the code runs from a copy whose ``.git`` is absent or not the code's (a
    container image, a synced working tree)."""
    if os.environ.get("HARNESS_GIT_SHA"):
        return os.environ["HARNESS_GIT_SHA"]
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
        if self.uri.startswith("sqlite:"):
            _sqlite_fast_commits()  # before MLflow's engine opens its first connection
        # MLflow prints "View run ... at: <url>" to stdout as a run ends on a tracking
        # server: it would break `--json` and show the server's address; never wanted.
        os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
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
        from mlflow.entities import Metric, Param, RunTag

        now = int(time.time() * 1000)
        self.client.log_batch(
            run_id,
            metrics=[Metric(k, v, now, step) for k, v in _finite(metrics or {}).items()],
            params=[Param(k, str(v)) for k, v in (params or {}).items()],
            tags=[RunTag(k, str(v)) for k, v in (tags or {}).items()],
        )

    def log_history(self, run_id: str, key: str, points: list[tuple[int, Any]]) -> None:
        """Metric ``key`` at several steps, in one call."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, float(v), now, step) for step, v in points
                   if isinstance(v, (int, float)) and math.isfinite(v)]
        if metrics:
            self.client.log_batch(run_id, metrics=metrics)

    def log_trial(self, study_run: str, number: int, config: Mapping[str, Any],
                  result: Mapping[str, Any], status: str) -> str:
        """One grandchild run per measured trial, plus the study run's history
        (``log_trial_record`` without a trial-log file)."""
        return log_trial_record(self, None, {
            "study": "", "study_run": study_run, "number": number, "config": config,
            "result": result, "status": status, "run": None})

    def log_study_plots(self, run_id: str, study: Any, title: str) -> list[str]:
        """The study's optimisation history, parameter importances (where they can be
        computed) and roofline plot, as PNG artifacts under ``plots/``."""
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


def absolute_uri(uri: str) -> str:
    """``uri`` with a relative SQLite path made absolute (against this process's working
    directory), so that another process on this machine opens the same file."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri[len(prefix):].startswith("/"):
        return prefix + str(Path(uri[len(prefix):]).resolve())
    return uri


def log_trial_record(tracker: Tracker, trial_log: str | Path | None,
                     rec: Mapping[str, Any], history: bool = True) -> str:
    """One trial's MLflow run from a plain record (``study``, ``study_run``, ``number``,
    ``config``, ``result``, ``status``, ``tags``, ``run``: a run to complete, or None),
    noted in the ``trial_log`` file (where given) as soon as it exists and again once
    complete: a resumed experiment completes a half-logged trial in its own run instead
    of logging it twice. ``history``: also add the trial's latency to the study run's
    history (a caller that batches those points itself passes False). Returns the
    run's id."""
    key = {"study": rec["study"], "trial": rec["number"]}
    result, status, number = rec["result"], rec["status"], rec["number"]
    run_id = rec.get("run")
    if run_id is None:
        tags = {"harness.level": "trial", "harness.status": status, "harness.trial": str(number)}
        if result.get("reason"):
            tags["harness.failure_reason"] = str(result["reason"])[:5000]
        node = (result.get("extra") or {}).get("node_id")
        if node:
            tags["harness.node_id"] = str(node)
        tags.update(rec.get("tags") or {})
        run_id = tracker.start_run(f"trial-{number}", tags, parent=rec["study_run"])
        _append(trial_log, {**key, "run": run_id})
    else:
        tracker.start_run(f"trial-{number}", {}, resume=run_id)
    tracker.log(run_id, params=rec["config"], metrics=trial_metrics(result, status))
    tracker.finish(run_id, ok=status != "failed")
    if history and status == "measured":
        tracker.log_history(rec["study_run"], HISTORY_METRIC,
                            [(number, result.get("latency_ms"))])
    _append(trial_log, {**key, "run": run_id, "done": True})
    return run_id


def _append(trial_log: str | Path | None, record: Mapping[str, Any]) -> None:
    if trial_log is None:
        return
    with open(trial_log, "a") as f:
        f.write(json.dumps(record) + "\n")


class TrialLogger:
    """The search's MLflow logging (a run per trial, the baselines' metrics), done in
    order by a process of its own: ``start_trial_logger`` runs it as a Ray actor on the
    driver's machine. A study logs hundreds of trials, each several SQLite commits of
    Python work; on a thread of the driver they held its GIL while it fed the GPUs
    (the driver fell behind a GPU timing a config every ~45 ms). A failed call is noted,
    never raised: tracking must not stop the tuning."""

    #: History points (the study runs' trial latencies) kept before one batched write.
    HISTORY_BATCH = 32

    def __init__(self, uri: str, experiment: str, warm_plots: bool = False):
        self.tracker = Tracker(uri, experiment)
        self._init()
        if warm_plots:
            self.warm_plots()
        self._stats["ready_at"] = time.monotonic()

    @classmethod
    def sharing(cls, tracker: Tracker) -> TrialLogger:
        """One that logs through an existing Tracker (in the driver's process)."""
        self = cls.__new__(cls)
        self.tracker = tracker
        self._init()
        return self

    def _init(self) -> None:
        self.errors: list[str] = []
        self._history: dict[str, list[tuple[int, Any]]] = {}  # study run -> points
        # Where its time went; the *_at are time.monotonic(), which on Linux every
        # process of the machine shares, so the driver places them on its timeline.
        self._stats: dict[str, float] = {"ready_at": time.monotonic(), "trials": 0,
                                         "trials_s": 0.0, "plots_s": 0.0}

    def trial(self, trial_log: str, rec: Mapping[str, Any]) -> None:
        """The trial's run; its point of the study run's history is written with the
        next ``HISTORY_BATCH`` - 1 (each write costs as much as a trial's other three)."""
        t0 = time.perf_counter()
        self._do(log_trial_record, self.tracker, trial_log, rec, history=False)
        if rec["status"] == "measured":
            self._history.setdefault(rec["study_run"], []).append(
                (rec["number"], rec["result"].get("latency_ms")))
            if sum(map(len, self._history.values())) >= self.HISTORY_BATCH:
                self._write_history()
        self._stats["trials"] += 1
        self._stats["trials_s"] += time.perf_counter() - t0
        self._stats["caught_up_at"] = time.monotonic()

    def log(self, run_id: str, params: Mapping[str, Any] | None = None,
            metrics: Mapping[str, Any] | None = None) -> None:
        self._do(self.tracker.log, run_id, params=params, metrics=metrics)

    def warm_plots(self) -> None:
        """Import the plotting stack now (1-2 s), ahead of ``plots``: in a process of
        its own, as the search starts, it takes no GIL from the driver (on a thread
        there it did) nor from the process logging the trials (it fell behind)."""
        self._do(warm_imports)

    def trial_plots(self, run_id: str, trials: list[Any], direction: str, title: str) -> None:
        """The plots of a study whose search just ended, drawn from its trials as the
        driver holds them: nothing waits for them to reach the Optuna storage, so each
        study's plots are drawn while the others still search, not after the last."""
        def draw() -> None:
            import optuna

            study = optuna.create_study(direction=direction)
            study.add_trials(trials)
            self.tracker.log_study_plots(run_id, study, title)

        t0 = time.perf_counter()
        self._do(draw)
        self._stats["plots_s"] += time.perf_counter() - t0

    def _do(self, fn: Any, *args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, **kwargs)
        except Exception as exc:
            self.errors.append(f"{type(exc).__name__}: {exc}"[:300])

    def _write_history(self) -> None:
        pending, self._history = self._history, {}
        for run_id, points in pending.items():
            self._do(self.tracker.log_history, run_id, HISTORY_METRIC, points)

    def flush(self) -> list[str]:
        """Write what is pending; the errors so far (called after every earlier call
        has run)."""
        self._write_history()
        return list(self.errors)

    def stats(self) -> dict[str, float]:
        """When it was ready and last caught up with the trials (time.monotonic()),
        trials logged, seconds spent logging them and drawing plots."""
        return dict(self._stats)


def _sqlite_fast_commits() -> None:
    """SQLite connections of this process commit as the Optuna storage's do
    (``harness.sqlite_commits``). MLflow builds its engine itself, so the listener goes
    on every engine of the process."""
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    from harness.sqlite_commits import fast_commits

    if not event.contains(Engine, "connect", fast_commits):
        event.listen(Engine, "connect", fast_commits)


def start_trial_logger(uri: str, experiment: str, plots: bool = False) -> Any:
    """A ``TrialLogger`` as a Ray actor on this (the driver's) node: it opens the same
    store (a relative SQLite path made absolute) and, like the GPU workers, sees the
    node's environment (MLflow credentials are not passed in its arguments, which Ray
    records). Its calls run in the order they are made. ``plots``: one that imports the
    plotting code as it starts, to draw the studies' plots at the end."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    return ray.remote(TrialLogger).options(
        num_cpus=0, max_restarts=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
    ).remote(absolute_uri(uri), experiment, warm_plots=plots)


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
