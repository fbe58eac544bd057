"""A driver killed mid-study (SIGKILL) or stopped (SIGTERM: ``timeout``, a scheduler;
it stops as Ctrl-C does, says how to go on, exit code 143, no traceback), then ``kharness
run --resume``: the same Optuna study and MLflow runs continue, no finished trial is lost
or measured again, and the trials the driver left running are finished from their stored
result or re-queued."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import yaml
from mlflow.tracking import MlflowClient

from tests.fault_kernels import cli_env

# Each run's MLflow store is a copy of one built once: a new store migrates (seconds of CPU).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("mlflow_db")]

FAULTY = "tests.fault_kernels:Faulty"
STUDY = f"resume/{FAULTY}/N=256/fp32/cpu"
SLEEPS = list(range(300, 310))  # ten configs, ~1 s each (three launches per trial)


def _snapshot(storage: str) -> dict[int, dict]:
    study = optuna.load_study(study_name=STUDY, storage=storage)
    return {t.number: {"state": t.state.name, "status": t.user_attrs.get("status"),
                       "value": t.value, "params": t.params,
                       "has_result": "result" in t.user_attrs} for t in study.trials}


def _finished(db: Path) -> int:
    """Measured trials so far, read-only (opening the study through Optuna would create
    its tables, racing the driver that is creating them)."""
    if not db.is_file():
        return 0
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
        try:
            (n,) = con.execute(
                "SELECT count(*) FROM trials t JOIN trial_user_attributes a "
                "ON a.trial_id = t.trial_id WHERE t.state = 'COMPLETE' "
                "AND a.key = 'status' AND a.value_json = '\"measured\"'").fetchone()
        finally:
            con.close()
        return n
    except sqlite3.Error:  # tables not there yet
        return 0


def _measured(snap: dict[int, dict]) -> list[int]:
    return [n for n, t in snap.items() if t["status"] == "measured" and t["state"] == "COMPLETE"]


def _stop(proc: subprocess.Popen, sig: int) -> int:
    """Send ``sig`` to the driver; its exit code."""
    os.kill(proc.pid, sig)
    return proc.wait(60)


def _sweep(proc: subprocess.Popen) -> None:
    """The driver's own local Ray dies with it; sweep its process group anyway."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.mark.parametrize("stop", [signal.SIGKILL, signal.SIGTERM], ids=["kill", "term"])
def test_driver_killed_and_resumed(tmp_path: Path, stop: int) -> None:
    events = tmp_path / "events"
    events.mkdir()
    exp = {
        "name": "resume",
        "kernel": FAULTY,
        "shapes": [{"N": 256}],
        "dtypes": ["fp32"],
        "search": {"sampler": "grid", "trials": 50},
        "search_space": {"params": {"FAULT": ["none"], "SLEEP_MS": SLEEPS}},
        "tracking": {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
        "output": {"packs_dir": str(tmp_path / "packs"), "runs_dir": str(tmp_path / "runs")},
        "fleet": {"compile_workers": 0},
    }
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(exp))
    storage = f"sqlite:///{tmp_path / 'runs' / 'resume' / 'optuna.db'}"
    cmd = [sys.executable, "-m", "harness", "run", str(path)]

    # 1. Run, and SIGKILL the driver once a few trials have finished.
    term = stop == signal.SIGTERM  # stopped: its --json says how far it got
    with open(tmp_path / "first.log", "w") as log, open(tmp_path / "first.json", "w") as js:
        proc = subprocess.Popen(cmd + ["--json" if term else "--quiet"], cwd=tmp_path,
                                env=cli_env(events), stdout=js if term else log,
                                stderr=log if term else subprocess.STDOUT,
                                start_new_session=True)
        try:
            deadline = time.monotonic() + 240
            while True:
                assert proc.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "no trials finished in time"
                if _finished(tmp_path / "runs" / "resume" / "optuna.db") >= 3:
                    break
                time.sleep(0.2)
            rc = _stop(proc, stop)
        finally:
            _sweep(proc)
    if stop == signal.SIGTERM:
        text = (tmp_path / "first.log").read_text()
        said = " ".join(text.split())  # the console wraps long lines
        assert rc == 128 + signal.SIGTERM, text[-3000:]
        assert "stopped (SIGTERM)" in said and "--resume` goes on" in said, text[-3000:]
        assert "Traceback" not in text, text[-3000:]
        partial = json.loads((tmp_path / "first.json").read_text())
        (prow,) = partial["rows"]
        assert partial["stopped"] == "SIGTERM" and prow["counts"]["measured"] >= 3, partial
        assert partial["timeline_s"]["first_trial"] < partial["wall_s"], partial
    before = _snapshot(storage)
    finished = {n: t for n, t in before.items() if t["state"] != "RUNNING"}
    left_running = {n: t for n, t in before.items() if t["state"] == "RUNNING"}
    assert len(_measured(before)) >= 3 and len(_measured(before)) < len(SLEEPS)

    # 2. Resume.
    proc = subprocess.run(cmd + ["--resume", "--json"], cwd=tmp_path, env=cli_env(events),
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    after = _snapshot(storage)

    # No finished trial lost or changed.
    for n, t in finished.items():
        assert after[n] == t, n
    # Every config measured exactly once over both runs: nothing re-run, nothing missing.
    measured = [after[n]["params"]["SLEEP_MS"] for n in _measured(after)]
    assert sorted(measured) == SLEEPS
    # What the killed driver left running: finished from its stored result where the
    # result had arrived, else closed as interrupted and its config queued again.
    requeued = []
    for n, t in left_running.items():
        if t["has_result"] and t["status"] in ("measured", "failed"):
            assert after[n]["state"] in ("COMPLETE", "FAIL") and after[n]["status"] == t["status"]
        else:
            assert after[n]["status"] == "interrupted" and after[n]["state"] == "FAIL"
            if t["params"]:
                requeued.append(t["params"])
            if set(t["params"]) != set(after[_measured(after)[0]]["params"]):
                # Killed while its config was still being drawn (mid-ask): nothing reached
                # a worker; "every config measured once" above covers it.
                continue
            again = [m for m in _measured(after) if after[m]["params"] == t["params"]]
            assert again and min(again) > max(before), n
    (row,) = out["rows"]
    assert row["counts"]["measured"] == len(SLEEPS)
    assert sorted(out["resumed"][STUDY]["requeued"], key=str) == sorted(requeued, key=str)

    # MLflow: the same parent and study runs continued; one trial run per finished trial.
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    mexp = client.get_experiment_by_name("resume")
    runs = client.search_runs([mexp.experiment_id], max_results=1000)
    levels: dict[str, list] = {}
    for r in runs:
        levels.setdefault(r.data.tags.get("harness.level"), []).append(r)
    assert len(levels["experiment"]) == 1 and len(levels["study"]) == 1
    assert levels["experiment"][0].info.run_id == out["mlflow_parent_run_id"]
    assert levels["study"][0].info.run_id == row["mlflow_run_id"]
    numbers = sorted(int(r.data.tags["harness.trial"]) for r in levels["trial"])
    expected = sorted(n for n, t in after.items() if t["status"] in ("measured", "failed"))
    assert numbers == expected  # each exactly once: none lost, none logged twice
    assert (tmp_path / "packs" / "cpu" / "faulty.json").is_file()


def test_a_stopped_campaign_keeps_the_packs_of_its_finished_experiments(
        tmp_path: Path) -> None:
    """A campaign stopped (SIGTERM: a time limit) after one of its experiments finished
    keeps that experiment's packs, written as its last study ended; the experiment still
    searching writes none."""
    events = tmp_path / "events"
    events.mkdir()

    def exp(name: str, sleeps: list[int], trials: int) -> Path:
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump({
            "name": name, "kernel": FAULTY, "shapes": [{"N": 256}], "dtypes": ["fp32"],
            "search": {"sampler": "grid", "trials": trials, "remeasure_top_k": 1},
            "search_space": {"params": {"FAULT": ["none"], "SLEEP_MS": sleeps}},
            "tracking": {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
            "output": {"packs_dir": str(tmp_path / f"packs_{name}"),
                       "runs_dir": str(tmp_path / "runs")},
            "fleet": {"compile_workers": 0}}))
        return path

    quick, slow = exp("quick", [0, 1], 2), exp("slow", SLEEPS, len(SLEEPS))
    cmd = [sys.executable, "-m", "harness", "run", str(quick), str(slow), "--json"]
    with open(tmp_path / "run.log", "w") as log, open(tmp_path / "run.json", "w") as js:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=cli_env(events), stdout=js,
                                stderr=log, start_new_session=True)
        try:
            deadline = time.monotonic() + 240
            while not list((tmp_path / "packs_quick").rglob("*.json")):
                assert proc.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "the quick experiment wrote no pack"
                time.sleep(0.2)
            assert _finished(tmp_path / "runs" / "slow" / "optuna.db") < len(SLEEPS)
            rc = _stop(proc, signal.SIGTERM)
        finally:
            _sweep(proc)
    text = (tmp_path / "run.log").read_text()
    assert rc == 128 + signal.SIGTERM, text[-3000:]
    (pack,) = list((tmp_path / "packs_quick").rglob("*.json"))
    kernels = json.loads(pack.read_text())["kernels"]
    (entry,) = [e for dtypes in kernels.values() for shapes in dtypes.values()
                for e in shapes.values()]
    assert entry["config"]["SLEEP_MS"] in (0, 1) and entry["provenance"]["experiment"] == "quick"
    assert not list((tmp_path / "packs_slow").rglob("*.json")), "a stopped experiment's pack"
    partial = json.loads((tmp_path / "run.json").read_text())
    assert partial["stopped"] == "SIGTERM"
    quick_summary = next(e for e in partial["experiments"] if e["name"] == "quick")
    assert quick_summary["packs"] == [str(pack)]
    assert quick_summary["timeline_s"]["packs_frozen"] < partial["wall_s"]
