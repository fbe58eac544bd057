#!/usr/bin/env python3
"""The run's bookkeeping under a many-GPU pace: the Optuna writer and the MLflow logger.

    .venv/bin/python benchmarks/bookkeeping_bench.py --trials 1440 --studies 8
        [--mode threads|processes|both] [--rate TRIALS_PER_S] [--tick N]

Feeds synthetic trials through ``WriteBehindStorage`` and ``Logs`` as ``harness/run/runner.py``
and ``harness/run/schedule.py`` do: each trial asked and told in memory (eight categorical
parameters, the ``status`` and ``result`` attributes a real trial carries), its MLflow
record held (``Logs.hold``) and, every ``--tick`` trials (one pass of the scheduler's
loop), ``logs.release(storage.poll_stored())``. At the end, as a run does:
``storage.close()``, ``logs.release(storage.stored)``, ``logs.flush()``. No GPU, no
kernel: only the bookkeeping. ``threads`` runs the writer and the logger as threads of
this process (a run without GPUs); ``processes`` as Ray actors on a local Ray
(``ray.init(address="local", num_cpus=2)``), as beside GPUs.

``--rate 0`` (the default) feeds as fast as this process can ask and tell, so that each
side's trials/s is what it can sustain; ``--rate 95`` feeds at the pace of the 4×H100
run that motivated it (1,440 trials in 15.2 s).

Prints, per mode: the feed's trials/s; the writer's and the logger's trials/s (trials
over the seconds from the first trial fed to the moment each had its last trial
stored/logged: the logger can go no faster than the writer, whose stored trials it is
sent); the logger's own trials/s while busy (``TrialLogger.stats``: trials over the
seconds it spent logging them); and the seconds ``close`` and ``release``+``flush``
took at the end (what the run waits for once the search is over). Then checks that the
Optuna storage and MLflow hold every trial once.
"""

from __future__ import annotations

import argparse
import logging
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere without installing

import optuna  # noqa: E402
from optuna.distributions import CategoricalDistribution  # noqa: E402

from harness.search.write_behind import WriteBehindStorage  # noqa: E402
from harness.tracking.run_logging import Logs, trial_record  # noqa: E402
from harness.tracking.tracker import Tracker  # noqa: E402

#: A grouped GEMM's space, roughly: eight parameters a trial's config holds.
SPACE = {"BLOCK_M": [64, 128, 256], "BLOCK_N": [64, 128, 256], "BLOCK_K": [32, 64, 128],
         "GROUP_M": [1, 4, 8], "num_warps": [4, 8], "num_stages": [2, 3, 4],
         "PERSISTENT": [0, 1], "TMA": [0, 1]}
DISTS = {k: CategoricalDistribution(v) for k, v in SPACE.items()}


def _result(rng: Any, node: str) -> dict[str, Any]:
    """A measured trial's result, as ``TrialResult.to_dict`` gives it."""
    ms = rng.uniform(0.05, 2.0)
    return {"ok": True, "reason": "", "fatal": False, "latency_ms": ms, "p20_ms": ms * 0.98,
            "p80_ms": ms * 1.02, "tflops": 300.0 / ms, "gbps": 900.0 / ms, "roofline": 0.5,
            "max_abs_err": 1e-3, "max_rel_err": 1e-3, "frac_within_1e3": 1.0,
            "frac_within_1e2": 1.0, "compile_s": 0.4, "timer": "do_bench",
            "timing_s": 0.03, "extra": {"node_id": node, "sm_clock_mhz": 1980.0,
                                        "power_w": 520.0}}


def run_mode(mode: str, trials: int, studies: int, rate: float, tick: int,
             tmp: Path) -> dict[str, float]:
    """One pass of ``trials`` trials through the bookkeeping in ``mode``; its figures."""
    import random

    procs = mode == "processes"
    tracker = Tracker(f"sqlite:///{tmp / 'mlflow.db'}", f"bench-{mode}")
    parent = tracker.start_run("bench", {"harness.level": "experiment"})
    url = f"sqlite:///{tmp / f'optuna-{mode}.db'}"
    storage = WriteBehindStorage(url, process=procs)
    logs = Logs(tracker, f"bench-{mode}", processes=procs)
    trial_log = tmp / f"mlflow_trials-{mode}.jsonl"
    trial_log.write_text("")
    sts, sampler = [], optuna.samplers.RandomSampler(seed=0)
    for i in range(studies):
        name = f"bench/{mode}/{i}"
        run_id = tracker.start_run(f"study {i}", {"harness.level": "study"}, parent=parent)
        study = optuna.create_study(study_name=name, storage=storage, sampler=sampler)
        spec = SimpleNamespace(name=name, hardware="H100", kernel="grouped_gemm",
                               shape_key=f"M={1024 * (i + 1)}")
        sts.append((study, SimpleNamespace(spec=spec, run_id=run_id,
                                           worker={"triton": "3.5", "torch": "2.9",
                                                   "cuda": "12.8"})))
    # Both sides started and warm before the clock starts (a run starts them while its
    # workers start).
    storage.poll_stored(timeout_s=120)
    logs.flush()

    rng = random.Random(0)
    stored: dict[tuple[str, int], float] = {}
    t0 = time.monotonic()
    for i in range(trials):
        if rate > 0:
            time.sleep(max(0.0, t0 + i / rate - time.monotonic()))
        study, st = sts[i % studies]
        trial = study.ask(DISTS)
        result = _result(rng, f"node{i % 4}")
        trial.set_user_attr("status", "measured")
        trial.set_user_attr("result", result)
        study.tell(trial, result["latency_ms"])
        logs.hold((study.study_name, trial.number), trial_log,
                  trial_record(st, trial.number, dict(trial.params), result, "measured"))
        if (i + 1) % tick == 0:
            new = storage.poll_stored()
            now = time.monotonic()
            stored.update(dict.fromkeys(new, now))
            logs.release(new)
    t_fed = time.monotonic()
    storage.close()
    t_closed = time.monotonic()
    stored.update(dict.fromkeys(set(storage.stored) - set(stored), t_closed))
    logs.release(storage.stored)
    errors = logs.flush()
    t_flushed = time.monotonic()
    stats = dict(logs.stats)
    logs.close()
    if errors:
        print(f"  {mode}: logger errors: {errors[:3]}")
    logged_at = stats.get("caught_up_at", t_flushed)
    out = {"feed_per_s": trials / (t_fed - t0),
           "writer_per_s": len(stored) / (max(stored.values()) - t0),
           "logger_per_s": stats.get("trials", 0) / (logged_at - t0),
           "logger_busy_per_s": stats.get("trials", 0) / max(stats.get("trials_s", 0), 1e-9),
           "close_s": t_closed - t_fed, "flush_s": t_flushed - t_closed,
           "end_s": t_flushed - t_fed}
    _check(tmp / "mlflow.db", url, tracker.experiment_id, trials, studies)
    return out


def _check(mlflow_db: Path, url: str, experiment_id: str, trials: int, studies: int) -> None:
    """Every trial once in the Optuna storage and once (FINISHED) in MLflow."""
    con = sqlite3.connect(url.removeprefix("sqlite:///"))
    (n,) = con.execute("SELECT count(*) FROM trials").fetchone()
    con.close()
    con = sqlite3.connect(mlflow_db)
    (m,) = con.execute(
        "SELECT count(*) FROM runs r JOIN tags t ON t.run_uuid = r.run_uuid "
        "WHERE r.experiment_id = ? AND t.key = 'harness.level' AND t.value = 'trial' "
        "AND r.status = 'FINISHED'", (int(experiment_id),)).fetchone()
    con.close()
    if n != trials or m != trials:
        print(f"  MISMATCH: {n} trials stored in Optuna, {m} trial runs in MLflow, "
              f"{trials} fed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=1440)
    ap.add_argument("--studies", type=int, default=8)
    ap.add_argument("--mode", choices=["threads", "processes", "both"], default="both")
    ap.add_argument("--rate", type=float, default=0.0,
                    help="trials fed per second (0: as fast as possible)")
    ap.add_argument("--tick", type=int, default=4,
                    help="trials between two polls of the writer (one scheduler pass)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    modes = ["threads", "processes"] if args.mode == "both" else [args.mode]
    with tempfile.TemporaryDirectory(prefix="bookkeeping-") as d:
        tmp = Path(d)
        if "processes" in modes:
            import ray

            ray.init(address="local", num_cpus=2, include_dashboard=False,
                     logging_level="ERROR", log_to_driver=False,
                     runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
        # The store's schema is built before any timing (a new store migrates: seconds).
        Tracker(f"sqlite:///{tmp / 'mlflow.db'}", "bench-setup")
        print(f"{args.trials} trials, {args.studies} studies, rate "
              f"{args.rate or 'unbounded'}/s, a poll every {args.tick} trials")
        print(f"{'mode':<10} {'feed/s':>8} {'writer/s':>9} {'logger/s':>9} {'busy/s':>7} "
              f"{'close s':>8} {'flush s':>8} {'end s':>7}")
        for mode in modes:
            r = run_mode(mode, args.trials, args.studies, args.rate, args.tick, tmp)
            print(f"{mode:<10} {r['feed_per_s']:>8.0f} {r['writer_per_s']:>9.0f} "
                  f"{r['logger_per_s']:>9.0f} {r['logger_busy_per_s']:>7.0f} "
                  f"{r['close_s']:>8.2f} {r['flush_s']:>8.2f} "
                  f"{r['end_s']:>7.2f}", flush=True)
        if "processes" in modes:
            ray.shutdown()


if __name__ == "__main__":
    main()
