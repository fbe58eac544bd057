"""How fast can one process log the search's trial runs into a SQLite MLflow store?

Logs N trial records (``track.log_trial_record``: a run per trial, its params and
metrics, its end, the study run's history point) into a fresh ``mlflow.db`` in the
current directory's file system, as the harness's MLflow logger does, and prints the
milliseconds per trial: one ``log_trial_record`` per trial with SQLite's defaults
(rollback journal, synchronous=FULL), and the ``TrialLogger``'s way (WAL with
synchronous=NORMAL, the study run's history points written 32 at a time). A grid run's
search measures a config every ~50 ms, so the logger must stay well under that.

    python3 benchmarks/device/diag_mlflow_logging.py [--trials 200] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

from harness import track
from harness.sqlite_commits import fast_commits


def _record(study: str, n: int) -> dict:
    return {"study": "s", "study_run": study, "number": n, "status": "measured",
            "config": {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 32, "num_warps": 8,
                       "num_stages": 4, "GROUP_M": n % 16},
            "result": {"latency_ms": 1.6 + n * 1e-3, "p20_ms": 1.59, "p80_ms": 1.61,
                       "tflops": 600.0, "gbps": 200.0, "roofline": 0.8,
                       "max_abs_err": 2e-3, "max_rel_err": 3e-4, "frac_within_1e3": 1.0,
                       "frac_within_1e2": 1.0, "compile_s": 0.0,
                       "extra": {"node_id": "n", "sm_clock_mhz": 1500, "power_w": 600}},
            "run": None, "tags": {"hardware": "H200", "kernel": "matmul"}}


def run(trials: int, how: str) -> dict[str, float]:
    """``plain``: log_trial_record per trial with SQLite's defaults (the harness before
    2026-11-24); ``logger``: the TrialLogger (WAL, synchronous=NORMAL, the history
    points batched)."""
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    root = tempfile.mkdtemp(dir=os.getcwd(), prefix="mlflow-diag-")
    uri, log = f"sqlite:///{root}/mlflow.db", os.path.join(root, "trials.jsonl")
    try:
        t0 = time.perf_counter()
        if how == "logger":
            logger = track.TrialLogger(uri, f"diag-{how}")
            tracker = logger.tracker
        else:
            tracker = track.Tracker(uri, f"diag-{how}")
        init_s = time.perf_counter() - t0
        study = tracker.start_run("study", {"harness.level": "study"})
        t0 = time.perf_counter()
        for n in range(trials):
            if how == "logger":
                logger.trial(log, _record(study, n))
            else:
                track.log_trial_record(tracker, log, _record(study, n))
        if how == "logger":
            assert logger.flush() == []
        per = (time.perf_counter() - t0) / trials
        points = tracker.client.get_metric_history(study, track.HISTORY_METRIC)
        assert len(points) == trials, len(points)
        return {"how": how, "init_s": round(init_s, 3), "ms_per_trial": round(per * 1e3, 2)}
    finally:
        if event.contains(Engine, "connect", fast_commits):
            event.remove(Engine, "connect", fast_commits)
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    out = [run(args.trials, how) for how in ("plain", "logger", "plain", "logger")]
    for r in out:
        print(r, flush=True)
    if args.json:
        json.dump(out, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
