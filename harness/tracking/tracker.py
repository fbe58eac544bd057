"""MLflow runs of an experiment: the only module that talks to MLflow.

Run layout (one scheme, so that the UI's comparison views line up):
- a parent run per experiment invocation (tag ``harness.level=experiment``),
- a child run per study (``harness.level=study``; tags hardware, kernel, shape, dtype),
  holding the study's summary metrics and step-indexed trial history,
- a grandchild run per measured trial (``harness.level=trial``) with the config as
  params and the measurement as metrics, so trials of a study compare side by side.

A search logs its trials in batches (``log_trial_records``): on a database store (the
default SQLite one) a batch goes into MLflow's tables in one transaction, through the
store's own ORM models, at hundreds of trials a second; on a tracking server, through the
client, several requests in flight at once.

Fault injection (``harness.run.faults``): ``logger_hang``, ``TrialLogger.apply`` never
answers (until ``stop``), as a logger stuck on its store would.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from harness.run import faults
from harness.tracking.plots import study_plots, warm_imports

# MLflow is imported where it is used (2-3 s): the run imports this module before it
# starts Ray, and builds its Tracker on a thread while Ray starts.

DEFAULT_URI = "sqlite:///mlflow.db"
#: How an SQLite store's URI begins (the file's path follows).
SQLITE_PREFIX = "sqlite:///"

TRIAL_METRICS = ("latency_ms", "p20_ms", "p80_ms", "tflops", "gbps", "roofline",
                 "max_abs_err", "max_rel_err", "frac_within_1e3", "frac_within_1e2", "compile_s")
GPU_STATE_METRICS = ("sm_clock_mhz", "power_w")
#: The study run's step-indexed history of its trials' latencies.
HISTORY_METRIC = "trial_latency_ms"
#: Batches in a row that failed to go in one transaction before the client's path
#: serves every batch.
BULK_FAILURES = 3
#: Requests kept in flight to a tracking server (each a round trip of its own).
REST_IN_FLIGHT = 4

log = logging.getLogger(__name__)


def trial_metrics(result: Mapping[str, Any], status: str) -> dict[str, Any]:
    """A trial run's metrics: the measurement, the GPU's clock and power as its timing
    ended (``harness.measure.timing.gpu_state``, where it could be read) and ``failed``."""
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


class TrackingError(RuntimeError):
    """MLflow's store could not be opened as the run started. The message is redacted
    and carries no cause: MLflow's own errors print the whole URI, password included."""


class Tracker:
    """MLflow runs for one experiment invocation."""

    def __init__(self, uri: str | None, experiment: str):
        from harness.tracking.redact import redact

        self.uri = tracking_uri(uri)
        self._sql: Any = None  # MLflow's SQL store (``sql_store``); False: none
        self._bulk_failures = 0
        self._pool: ThreadPoolExecutor | None = None
        self._artifact_root: str | None = None
        try:
            self._open(experiment)
        except Exception as exc:
            raise TrackingError(redact(
                f"MLflow tracking at {self.uri} could not start: {type(exc).__name__}: "
                f"{str(exc)[:500]}")) from None

    def _open(self, experiment: str) -> None:
        import mlflow
        from mlflow.tracking import MlflowClient

        if self.uri.startswith("sqlite:"):
            _sqlite_fast_commits()  # before MLflow's engine opens its first connection
        # MLflow prints "View run ... at: <url>" to stdout as a run ends on a tracking
        # server: it would break `--json` and show the server's address; never wanted.
        os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
        mlflow.set_tracking_uri(self.uri)
        self.client = MlflowClient(self.uri)
        self.experiment_id = _experiment_id(self.client, experiment)

    def sql_store(self) -> Any:
        """MLflow's SQL store behind this tracker (a database URI), which
        ``log_trial_records`` writes a batch of trials to in one transaction; None for
        any other store (a tracking server), or once that failed ``BULK_FAILURES`` times
        in a row (the client's path then serves)."""
        if self._sql is None:
            self._sql = False
            try:
                from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

                store = self.client._tracking_client.store
                if isinstance(store, SqlAlchemyStore):
                    self._sql = store
            except Exception:  # no SQLAlchemy here, or a client laid out otherwise
                pass
        return self._sql or None

    def bulk_failed(self, exc: Exception) -> None:
        """A batch could not be written in one transaction (it is written through the
        client instead); after ``BULK_FAILURES`` in a row, every batch is."""
        self._bulk_failures += 1
        log.warning("MLflow: a batch of trial runs could not be written in one transaction "
                    "(%s: %s); written one by one", type(exc).__name__, str(exc)[:300])
        if self._bulk_failures >= BULK_FAILURES:
            self._sql = False

    def bulk_ok(self) -> None:
        """A batch went in one transaction: the failures in a row start over."""
        self._bulk_failures = 0

    def artifact_root(self) -> str:
        """The experiment's artifact location, under which each run's artifacts go."""
        if self._artifact_root is None:
            self._artifact_root = self.client.get_experiment(self.experiment_id) \
                .artifact_location
        return self._artifact_root

    def pool(self) -> ThreadPoolExecutor:
        """Threads that keep ``REST_IN_FLIGHT`` requests to a tracking server in flight."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(REST_IN_FLIGHT, thread_name_prefix="harness-rest")
        return self._pool

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

        now = _now_ms()
        self.client.log_batch(
            run_id,
            metrics=[Metric(k, v, now, step) for k, v in _finite(metrics or {}).items()],
            params=[Param(k, str(v)) for k, v in (params or {}).items()],
            tags=[RunTag(k, str(v)) for k, v in (tags or {}).items()],
        )

    def log_history(self, run_id: str, key: str, points: list[tuple[int, Any]]) -> None:
        """Metric ``key`` at several steps, in one call."""
        from mlflow.entities import Metric

        now = _now_ms()
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


def import_mlflow() -> None:
    """Import MLflow's client (seconds): a run does it on a thread while Ray starts."""
    import mlflow  # noqa: F401
    from mlflow.tracking import MlflowClient  # noqa: F401


def _experiment_id(client: Any, name: str) -> str:
    """The MLflow experiment ``name``'s id, created where missing. The run's driver and
    its logger processes start at once: where another created it first, it is read."""
    from mlflow.exceptions import MlflowException

    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    try:
        return client.create_experiment(name)
    except MlflowException:
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def absolute_uri(uri: str) -> str:
    """``uri`` with a relative SQLite path made absolute (against this process's working
    directory), so that another process on this machine opens the same file."""
    prefix = SQLITE_PREFIX
    if uri.startswith(prefix) and not uri[len(prefix):].startswith("/"):
        return prefix + str(Path(uri[len(prefix):]).resolve())
    return uri


def _now_ms() -> int:
    """Now in milliseconds since the epoch, as MLflow stamps runs and metrics."""
    return int(time.time() * 1000)


def trial_run(rec: Mapping[str, Any]) -> dict[str, Any]:
    """What a trial's grandchild run holds, from its plain record: name, tags (its study
    run as parent), params (the config), metrics (the measurement) and final status.
    Both ways of writing it (``log_trial_records``) write exactly this."""
    result, status, number = rec["result"], rec["status"], rec["number"]
    tags = {"harness.level": "trial", "harness.status": status, "harness.trial": str(number)}
    if result.get("reason"):
        tags["harness.failure_reason"] = str(result["reason"])[:5000]
    node = (result.get("extra") or {}).get("node_id")
    if node:
        tags["harness.node_id"] = str(node)
    tags.update({k: str(v) for k, v in (rec.get("tags") or {}).items()})
    tags["mlflow.parentRunId"] = rec["study_run"]
    return {"name": f"trial-{number}", "tags": tags,
            "params": {k: str(v) for k, v in rec["config"].items()},
            "metrics": _finite(trial_metrics(result, status)),
            "status": "FAILED" if status == "failed" else "FINISHED"}


def _history_points(recs: list[Mapping[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """The study runs' history points of these records: each measured trial's latency at
    its number."""
    out: dict[str, list[tuple[int, float]]] = {}
    for rec in recs:
        v = rec["result"].get("latency_ms")
        if rec["status"] == "measured" and isinstance(v, (int, float)) and math.isfinite(v):
            out.setdefault(rec["study_run"], []).append((rec["number"], float(v)))
    return out


def _create_public(tracker: Tracker, run: Mapping[str, Any], now: int) -> str:
    """The run created through the client (``create_run``): its id, the store's."""
    return tracker.client.create_run(tracker.experiment_id, start_time=now,
                                     tags=run["tags"], run_name=run["name"]).info.run_id


def _complete_public(tracker: Tracker, run_id: str, run: Mapping[str, Any], now: int) -> None:
    """The run's params and metrics and its end through the client."""
    from mlflow.entities import Metric, Param

    tracker.client.log_batch(
        run_id, metrics=[Metric(k, v, now, 0) for k, v in run["metrics"].items()],
        params=[Param(k, v) for k, v in run["params"].items()])
    tracker.client.set_terminated(run_id, run["status"], end_time=now)


def log_trial_record(tracker: Tracker, trial_log: str | Path | None,
                     rec: Mapping[str, Any], history: bool = True) -> str:
    """One trial's MLflow run from a plain record (``study``, ``study_run``, ``number``,
    ``config``, ``result``, ``status``, ``tags``, ``run``: a run to complete, or None),
    through the client, noted in the ``trial_log`` file (where given) as soon as it exists
    and again once complete: a resumed experiment completes a half-logged trial in its own
    run instead of logging it twice (and logs anew one whose noted run was never
    committed). ``history``: also add the trial's latency to the study run's history.
    Returns the run's id."""
    key = {"study": rec["study"], "trial": rec["number"]}
    run, now = trial_run(rec), _now_ms()
    run_id = rec.get("run")
    if run_id is None or not tracker._alive(run_id):
        run_id = _create_public(tracker, run, now)
        _append(trial_log, [{**key, "run": run_id}])
    _complete_public(tracker, run_id, run, now)
    if history:
        for study_run, points in _history_points([rec]).items():
            tracker.log_history(study_run, HISTORY_METRIC, points)
    _append(trial_log, [{**key, "run": run_id, "done": True}])
    return run_id


def log_trial_records(tracker: Tracker, trial_log: str | Path | None,
                      recs: list[Mapping[str, Any]], history: bool = True) -> list[str]:
    """A batch of new trials' records (``run`` None) logged as ``log_trial_record`` logs
    one. On a database store, in ONE transaction (``_insert_trial_runs``): the run ids are
    made here as MLflow makes them (``uuid4().hex``) and noted in ``trial_log`` before the
    transaction commits, done after, so that a killed logger's trials are neither lost nor
    logged twice on resume. Elsewhere (a tracking server), or where that transaction
    fails, through the client, ``REST_IN_FLIGHT`` records in flight at once on a server.
    ``history``: the measured trials' latencies also go into their study runs' history
    (one write per study run). Returns the errors met."""
    if not recs:
        return []
    now = _now_ms()
    runs = [trial_run(r) for r in recs]
    keys = [{"study": r["study"], "trial": r["number"]} for r in recs]
    store = tracker.sql_store()
    if store is not None:
        ids = [uuid.uuid4().hex for _ in recs]
        noted = [{**k, "run": i} for k, i in zip(keys, ids, strict=True)]
        _append(trial_log, noted)
        try:
            _insert_trial_runs(store, tracker.experiment_id, tracker.artifact_root(),
                               list(zip(ids, runs, strict=True)),
                               _history_points(recs) if history else {}, now)
        except Exception as exc:  # written one by one below; the noted ids never existed
            tracker.bulk_failed(exc)
        else:
            tracker.bulk_ok()
            _append(trial_log, [{**n, "done": True} for n in noted])
            return []

    def one(key: dict[str, Any], run: dict[str, Any]) -> str | None:
        try:
            run_id = _create_public(tracker, run, now)
            _append(trial_log, [{**key, "run": run_id}])
            _complete_public(tracker, run_id, run, now)
            _append(trial_log, [{**key, "run": run_id, "done": True}])
            return None
        except Exception as exc:
            return f"trial {key['trial']} of {key['study'] or 'its study'}: " \
                   f"{type(exc).__name__}: {exc}"[:300]

    if store is None and len(recs) > 1:  # a server: several requests in flight
        results = list(tracker.pool().map(one, keys, runs))
    else:
        results = [one(k, r) for k, r in zip(keys, runs, strict=True)]
    errors = [e for e in results if e is not None]
    if history:
        logged = [r for r, e in zip(recs, results, strict=True) if e is None]
        for study_run, points in _history_points(logged).items():
            try:
                tracker.log_history(study_run, HISTORY_METRIC, points)
            except Exception as exc:
                errors.append(f"history of {study_run}: {type(exc).__name__}: {exc}"[:300])
    return errors


def _insert_trial_runs(store: Any, experiment_id: str, artifact_root: str,
                       runs: list[tuple[str, dict[str, Any]]],
                       history: Mapping[str, list[tuple[int, float]]], now: int) -> None:
    """Trial runs (id, ``trial_run``) and study-run history points written in ONE session
    of MLflow's SQL store through its ORM models: the rows that ``create_run``,
    ``log_batch`` and ``set_terminated`` write for each run (and ``log_batch`` for the
    history), in one transaction instead of a dozen. MLflow has no public bulk API for
    runs; ``test_trial_logger.py::test_bulk_runs_read_back_as_the_clients`` holds these
    rows to what the client writes. Raises where this MLflow's store differs."""
    from mlflow.entities import LifecycleStage, Metric, Param, RunStatus, SourceType
    from mlflow.store.tracking.dbmodels.models import (
        SqlLatestMetric,
        SqlMetric,
        SqlParam,
        SqlRun,
        SqlTag,
    )
    from mlflow.utils.mlflow_tags import MLFLOW_RUN_NAME, MLFLOW_USER
    from mlflow.utils.uri import append_to_uri_path
    from mlflow.utils.validation import _validate_batch_log_data

    run_rows, tag_rows, param_rows, metric_rows = [], [], [], []
    for run_id, run in runs:
        # log_batch's own checks: a bad key is refused, a long param value truncated.
        metrics, params, _ = _validate_batch_log_data(
            [Metric(k, v, now, 0) for k, v in run["metrics"].items()],
            [Param(k, v) for k, v in run["params"].items()], [])
        tags = dict(run["tags"])
        tags.setdefault(MLFLOW_RUN_NAME, run["name"])
        run_rows.append({
            "run_uuid": run_id, "name": run["name"], "experiment_id": int(experiment_id),
            "artifact_uri": append_to_uri_path(artifact_root, run_id,
                                               store.ARTIFACTS_FOLDER_NAME),
            "source_type": SourceType.to_string(SourceType.UNKNOWN), "source_name": "",
            "entry_point_name": "", "user_id": tags.get(MLFLOW_USER, "unknown"),
            "status": RunStatus.to_string(RunStatus.from_string(run["status"])),
            "start_time": now, "end_time": now, "deleted_time": None, "source_version": "",
            "lifecycle_stage": LifecycleStage.ACTIVE})
        tag_rows += [{"run_uuid": run_id, "key": k, "value": v} for k, v in tags.items()]
        param_rows += [{"run_uuid": run_id, "key": p.key, "value": p.value} for p in params]
        for m in metrics:
            is_nan, value = store.sanitize_metric_value(m.value)
            metric_rows.append({"run_uuid": run_id, "key": m.key, "value": value,
                                "timestamp": now, "step": 0, "is_nan": is_nan})
    try:
        session_scope = store.ManagedSessionMaker(read_only=False)
    except TypeError:  # an MLflow whose sessions take no read_only flag
        session_scope = store.ManagedSessionMaker()
    with session_scope as session:
        for model, rows in ((SqlRun, run_rows), (SqlTag, tag_rows), (SqlParam, param_rows),
                            (SqlMetric, metric_rows), (SqlLatestMetric, metric_rows)):
            if rows:
                session.execute(model.__table__.insert(), rows)
        for study_run, points in history.items():
            unique = sorted(set(points))  # log_batch drops a batch's duplicates too
            session.execute(SqlMetric.__table__.insert(), [
                {"run_uuid": study_run, "key": HISTORY_METRIC, "value": v, "timestamp": now,
                 "step": step, "is_nan": False} for step, v in unique])
            # The latest value: the point of the highest (step, timestamp, value).
            step, value = max(unique)
            latest = session.query(SqlLatestMetric).filter(
                SqlLatestMetric.run_uuid == study_run,
                SqlLatestMetric.key == HISTORY_METRIC).one_or_none()
            if latest is None:
                session.add(SqlLatestMetric(run_uuid=study_run, key=HISTORY_METRIC, value=value,
                                            timestamp=now, step=step, is_nan=False))
            elif (step, now, value) > (latest.step, latest.timestamp, latest.value):
                latest.step, latest.timestamp, latest.value, latest.is_nan = (
                    step, now, value, False)


_append_lock = threading.Lock()  # records of several requests in flight (a server)


def _append(trial_log: str | Path | None, records: list[Mapping[str, Any]]) -> None:
    if trial_log is None or not records:
        return
    text = "".join(json.dumps(r) + "\n" for r in records)
    with _append_lock, open(trial_log, "a") as f:
        f.write(text)


class TrialLogger:
    """The search's MLflow logging (a run per trial, the baselines' metrics), done in
    order by a process of its own: ``start_trial_logger`` runs it as a Ray actor on the
    driver's machine, and ``run_logging.Logs`` sends it batches (``apply``): whatever the
    driver gathered while the previous batch was written, its trials written together
    (``log_trial_records``: one transaction on a database store). On a thread of the
    driver, a run's trials held its GIL while it fed the GPUs. A failed call is noted,
    never raised: tracking must not stop the tuning."""

    #: History points (the study runs' trial latencies) kept before one batched write,
    #: where the trials are logged through the client (a tracking server).
    HISTORY_BATCH = 32

    def __init__(self, uri: str, experiment: str, warm_plots: bool = False,
                 open_now: bool = True):
        """``open_now`` False: MLflow is imported now, the store opened (and the
        experiment created) on first use: a logger started before the run's files are
        validated writes nothing until then."""
        self._where = (uri, experiment)
        self._tracker = Tracker(uri, experiment) if open_now else None
        self._init()
        if not open_now:
            import_mlflow()
            self.warm_store()
        if warm_plots:
            self.warm_plots()
        self._stats["ready_at"] = time.monotonic()

    def warm_store(self) -> None:
        """Open an SQLite store that exists already, on a thread: MLflow's engine and
        schema check (1-1.5 s) are then done by the first call, which only finds or
        creates the experiment. Opening an existing store writes nothing."""
        uri = self._where[0]
        prefix = SQLITE_PREFIX
        if not uri.startswith(prefix) or not Path(uri[len(prefix):]).is_file():
            return

        def warm() -> None:
            try:
                from mlflow.tracking import MlflowClient

                _sqlite_fast_commits()
                _ = MlflowClient(uri)._tracking_client.store  # MLflow caches it per URI
            except Exception as exc:  # the first call opens it and reports what fails
                log.debug("MLflow store not opened ahead: %s", exc)

        self._warming = threading.Thread(target=warm, name="harness-mlflow-warm", daemon=True)
        self._warming.start()

    @classmethod
    def sharing(cls, tracker: Tracker) -> TrialLogger:
        """One that logs through an existing Tracker (in the driver's process)."""
        self = cls.__new__(cls)
        self._tracker = tracker
        self._init()
        return self

    @property
    def tracker(self) -> Tracker:
        if self._tracker is None:
            if self._warming is not None:
                self._warming.join()  # one engine per store: the warm one
            self._tracker = Tracker(*self._where)
        return self._tracker

    def _init(self) -> None:
        self._warming: threading.Thread | None = None  # see ``warm_store``
        self.errors: list[str] = []
        self._history: dict[str, list[tuple[int, Any]]] = {}  # study run -> points
        self._stop = threading.Event()  # set by ``stop``: what a hung call waits for
        # Where its time went; the *_at are time.monotonic(), which on Linux every
        # process of the machine shares, so the driver places them on its timeline.
        self._stats: dict[str, float] = {"ready_at": time.monotonic(), "trials": 0,
                                         "trials_s": 0.0, "plots_s": 0.0}

    def apply(self, ops: list[tuple]) -> dict[str, Any]:
        """One batch, in order: ``("trial", trial_log, rec)`` (consecutive ones logged
        together), ``("log", run_id, params, metrics)``, ``("call", method, args)`` (a
        ``FORWARDED`` Tracker call), ``("flush",)``. Answers the
        trials it logged, the errors it met and ``stats``."""
        if faults.active("logger_hang"):  # testing aid: a reply that never comes
            self._stop.wait()
            raise RuntimeError("logger_hang: given up on")
        n_errors, n = len(self.errors), 0
        i = 0
        while i < len(ops):
            kind = ops[i][0]
            if kind == "trial":
                j = i
                while j < len(ops) and ops[j][0] == "trial" and ops[j][1] == ops[i][1]:
                    j += 1
                self.trials(ops[i][1], [op[2] for op in ops[i:j]])
                n += j - i
                i = j
                continue
            if kind == "log":
                self.log(ops[i][1], params=ops[i][2], metrics=ops[i][3])
            elif kind == "call":
                self._do(self.tracker_call, ops[i][1], *ops[i][2])
            elif kind == "flush":
                self.flush()
            i += 1
        return {"trials": n, "errors": self.errors[n_errors:], "stats": self.stats()}

    def trials(self, trial_log: str | None, recs: list[Mapping[str, Any]]) -> None:
        """Trial runs; their points of the study runs' history are written with them
        (a database store), else with the next ``HISTORY_BATCH`` - 1 (through the client
        each write costs as much as a trial's other three)."""
        t0 = time.perf_counter()
        bulk = self.tracker.sql_store() is not None
        try:
            self.errors += log_trial_records(self.tracker, trial_log, list(recs), history=bulk)
        except Exception as exc:  # the trial log itself could not be written
            self.errors.append(f"{type(exc).__name__}: {exc}"[:300])
        if not bulk:
            for study_run, points in _history_points(list(recs)).items():
                self._history.setdefault(study_run, []).extend(points)
            if sum(map(len, self._history.values())) >= self.HISTORY_BATCH:
                self._write_history()
        self._stats["trials"] += len(recs)
        self._stats["trials_s"] += time.perf_counter() - t0
        self._stats["caught_up_at"] = time.monotonic()

    def trial(self, trial_log: str | None, rec: Mapping[str, Any]) -> None:
        """One trial's run (``trials``)."""
        self.trials(trial_log, [rec])

    def log(self, run_id: str, params: Mapping[str, Any] | None = None,
            metrics: Mapping[str, Any] | None = None) -> None:
        self._do(self.tracker.log, run_id, params=params, metrics=metrics)

    def open(self) -> str | None:
        """Open the store now (``open_now`` False); the error, if it could not be, which
        the next call that needs the store raises."""
        try:
            _ = self.tracker  # after ``warm_store``'s thread, whose store it then uses
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"[:300]
        return None

    #: The Tracker methods the driver calls through this process (``RemoteTracker``).
    FORWARDED = frozenset({"start_run", "log", "finish", "log_artifact"})

    def tracker_call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """The driver's own MLflow calls (the experiment's and studies' runs), made with
        this process's Tracker: raised, not noted, since the driver waits for them."""
        if method not in self.FORWARDED:
            raise ValueError(f"not a forwarded Tracker method: {method}")
        return getattr(self.tracker, method)(*args, **kwargs)

    def warm_plots(self) -> None:
        """Import the plotting stack now (1-2 s), ahead of ``plots``: in a process of
        its own, as the search starts, it takes no GIL from the driver (on a thread
        there it did) nor from the process logging the trials (it fell behind)."""
        self._do(warm_imports)

    def trial_plots(self, run_id: str, trials: list[Any], direction: str,
                    title: str) -> dict[str, Any]:
        """The plots of a study whose search just ended, drawn from its trials as the
        driver holds them: nothing waits for them to reach the Optuna storage, so each
        study's plots are drawn while the others still search, not after the last.
        Answers as ``apply`` does."""
        def draw() -> None:
            import optuna

            study = optuna.create_study(direction=direction)
            study.add_trials(trials)
            self.tracker.log_study_plots(run_id, study, title)

        n_errors = len(self.errors)
        t0 = time.perf_counter()
        self._do(draw)
        self._stats["plots_s"] += time.perf_counter() - t0
        return {"trials": 0, "errors": self.errors[n_errors:], "stats": self.stats()}

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

    def stop(self) -> None:
        """Wake a call that hangs (an injected ``logger_hang``): the driver gave up on it."""
        self._stop.set()


def _sqlite_fast_commits() -> None:
    """SQLite connections of this process commit as the Optuna storage's do
    (``harness.search.sqlite_commits``). MLflow builds its engine itself, so the listener goes
    on every engine of the process."""
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    from harness.search.sqlite_commits import fast_commits

    if not event.contains(Engine, "connect", fast_commits):
        event.listen(Engine, "connect", fast_commits)


def start_trial_logger(uri: str, experiment: str, plots: bool = False,
                       open_now: bool = True) -> Any:
    """A ``TrialLogger`` as a Ray actor on this (the driver's) node: it opens the same
    store (a relative SQLite path made absolute) and, like the GPU workers, sees the
    node's environment (MLflow credentials are not passed in its arguments, which Ray
    records). Its calls run in the order they are made. ``plots``: one that imports the
    plotting code as it starts, to draw the studies' plots at the end. ``open_now``: see
    ``TrialLogger``."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    return ray.remote(TrialLogger).options(
        num_cpus=0, max_restarts=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
        **faults.actor_env(),
    ).remote(absolute_uri(uri), experiment, warm_plots=plots, open_now=open_now)


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
