"""One run of an experiment at a time: a second ``kharness run`` of the same experiment
exits 2 naming the run that holds its directory, and writes nothing; a killed holder
leaves no stale lock."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from harness import cli, experiment

ROOT = Path(__file__).resolve().parents[1]
GOOD = {"name": "locked", "kernel": "grouped_gemm", "shapes": [{"M": 320, "N": 128, "K": 128,
                                                                 "E": 4}],
        "dtypes": ["fp16"], "search": {"trials": 3}}

HOLD = """
import sys, time
from harness.experiment import load, lock_run_dir
lock = lock_run_dir(sys.argv[1], load(sys.argv[1], semantics=False))
print("held", flush=True)
time.sleep(120)
"""


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.fixture
def holder(tmp_path):
    """Another process holding the experiment's run directory."""
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(GOOD))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        yield path, proc
    finally:
        proc.kill()
        proc.wait()


def test_second_run_exits_2_naming_the_holder(holder, monkeypatch, capsys):
    import ray

    path, proc = holder
    monkeypatch.chdir(path.parent)

    def no_ray(*args, **kwargs):
        raise AssertionError("the second run started Ray")

    monkeypatch.setattr(ray, "init", no_ray)
    before = _listing(path.parent)
    assert cli.main(["run", str(path)]) == cli.EXIT_BAD_INPUT
    err = " ".join(capsys.readouterr().err.split())
    assert str(path) in err and "output.runs_dir" in err
    assert "in use by another run of 'locked'" in err and f"process {proc.pid}" in err
    assert _listing(path.parent) == before  # no optuna.db, mlflow.db, state.json


def test_a_killed_holder_leaves_no_stale_lock(holder, monkeypatch):
    path, proc = holder
    monkeypatch.chdir(path.parent)
    exp = experiment.load(path, semantics=False)
    with pytest.raises(experiment.ExperimentError, match="in use"):
        experiment.lock_run_dir(path, exp)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with experiment.lock_run_dir(path, exp) as lock:
        assert lock.path == Path(exp.output.runs_dir) / "locked" / "run.lock"
        with pytest.raises(experiment.ExperimentError, match=f"process {os.getpid()}"):
            experiment.lock_run_dir(path, exp)  # held again, by this process now
    experiment.lock_run_dir(path, exp).release()  # released on leaving the block


@pytest.mark.slow
def test_a_file_that_fails_its_checks_leaves_no_run_directory(tmp_path, monkeypatch):
    """The API path locks after the file's form is checked; a file whose kernel checks
    fail then removes the directory it created for the lock."""
    from harness.run.runner import run

    monkeypatch.chdir(tmp_path)
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump({**GOOD, "search_space": {"params": {"BLOCK_M": ["x"]}}}))
    with pytest.raises(experiment.ExperimentError, match="BLOCK_M"):
        run(path)
    assert _listing(tmp_path) == ["exp.yaml"]
