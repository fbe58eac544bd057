"""The driver's head start (``harness.fleet.head_start``): when it runs, and a run whose
first configs it compiles before the fleet exists."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from harness.fleet import head_start
from harness.fleet.head_start import HeadStart
from tests.fault_kernels import cli_env

FAULTY_NAME = "tests.fault_kernels:Faulty"


@pytest.mark.parametrize(("env", "workers", "why"), [
    ({"HARNESS_HEAD_START": "off", "HARNESS_PRECOMPILE": "force"}, "auto", "turned off"),
    ({"HARNESS_HEAD_START": "on", "HARNESS_PRECOMPILE": "force"}, 0, "compile_workers: 0"),
    ({"HARNESS_HEAD_START": "on", "HARNESS_PRECOMPILE": "off"}, "auto", "no compile-ahead"),
    ({"HARNESS_HEAD_START": "on", "HARNESS_PRECOMPILE": "force",
      "RAY_ADDRESS": "127.0.0.1:1"}, "auto", "joins a cluster"),
])
def test_no_head_start(env: dict, workers: int | str, why: str, monkeypatch) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert HeadStart.maybe(workers, 30.0) is None, why


def test_few_cores_no_head_start_unless_asked(monkeypatch) -> None:
    monkeypatch.setenv("HARNESS_PRECOMPILE", "force")
    monkeypatch.delenv("HARNESS_HEAD_START", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(head_start.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(head_start, "starts_own_ray", lambda: True)
    monkeypatch.setattr(head_start, "gpu_device_nodes", lambda: False)
    assert HeadStart.maybe("auto", 30.0) is None
    monkeypatch.setenv("HARNESS_HEAD_START", "on")
    head = HeadStart.maybe("auto", 30.0)
    assert head is not None and head.key == "cpu"
    assert head.pool.children() == []  # started off the caller's thread (``start``)
    head.close()


@pytest.mark.slow
def test_a_run_compiles_its_first_configs_before_the_fleet(tmp_path: Path) -> None:
    """A run on its own Ray (the interpreter, compile-ahead forced): the head start
    compiles the first study's known configs (its default and its strategy's first asks)
    and measures them as they compile, before the fleet is up; the search takes those
    results as its first trials, and the run goes on as usual."""
    exp = {
        "name": "head", "kernel": "rmsnorm", "shapes": [{"rows": 5, "cols": 300}],
        "dtypes": ["fp32"],
        "search": {"sampler": "grid", "trials": 3, "warm_start": False, "remeasure_top_k": 0},
        "search_space": {"params": {"BLOCK_SIZE": [512, 1024], "num_warps": [1, 2]}},
        "baselines": {"compile": False},
        "tracking": {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
        "output": {"packs_dir": str(tmp_path / "packs"), "runs_dir": str(tmp_path / "runs")},
    }
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(exp))
    env = cli_env(tmp_path / "events")
    env.update(TRITON_INTERPRET="1", HARNESS_PRECOMPILE="force", HARNESS_HEAD_START="on",
               TRITON_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-m", "harness", "run", "exp.yaml", "--json"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout)
    head = out["head_start"]
    # The default config, then the grid's first asks (3 trials), compiled without error.
    assert head["hardware"] == "cpu" and head["submitted"] >= 3, head
    assert head["compiled"] == head["submitted"], head
    assert head["all_ready_s"] is not None and head["first_compile_done_s"] is not None
    # Where the node's compile service spent its start (seconds from its pool's start).
    (service,) = out["compile_services"].values()
    assert service["ready"] == service["processes"] >= 1, service
    assert 0 < service["first_ready_s"] <= service["all_ready_s"], service
    # ... and each child's own steps: when it was forked, its imports (no device here).
    steps = service["child_start"]
    assert {"forked_s", "imports_s"} <= set(steps) and "cuda_init_s" not in steps, steps
    assert 0 <= steps["forked_s"]["median"] <= steps["forked_s"]["max"], steps
    assert service["spawn_s"] >= 0, service
    (row,) = out["rows"]
    assert row["counts"]["measured"] >= 2 and row["counts"]["failed"] == 0, row["counts"]
    # It measured the first asks too, before the fleet: the search took them as trials.
    first = head["first_trials"]
    assert first["measured"] >= 1 and first["used"] >= 1, first
    assert first["used"] <= first["measured"] <= first["asked"], first
    # The run's first trial: the first of them the search took, before its workers.
    timeline = out["timeline_s"]
    assert 0 < first["first_result_s"] <= timeline["first_trial"], (first, timeline)
    assert timeline["first_trial"] <= timeline["workers_ready"], timeline
    import optuna

    study = optuna.load_study(study_name=None,
                              storage=f"sqlite:///{tmp_path}/runs/head/optuna.db")
    ahead = [t for t in study.trials if (t.user_attrs.get("result") or {}).get(
        "extra", {}).get("measured_by") == "head start"]
    assert len(ahead) == first["used"], [t.user_attrs for t in study.trials]
    assert all(t.user_attrs.get("status") == "measured" for t in ahead)


@pytest.mark.slow
def test_a_prebuild_that_fails_is_counted_not_raised(tmp_path: Path, monkeypatch) -> None:
    """The torch.compile prebuild needs a GPU (Inductor runs what it builds): on the CPU
    it fails in its process, is counted as not compiled, and the configs still compile."""
    from harness import experiment

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("HARNESS_PRECOMPILE", "force")
    monkeypatch.setenv("HARNESS_HEAD_START", "on")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(head_start, "starts_own_ray", lambda: True)
    monkeypatch.setattr(head_start, "gpu_device_nodes", lambda: False)
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump({
        "name": "pre", "kernel": "rmsnorm", "shapes": [{"rows": 5, "cols": 300}],
        "dtypes": ["fp32"], "search": {"sampler": "grid", "trials": 2}}))
    exp = experiment.load(path)
    study = experiment.ExperimentPlan.checked(path, exp).for_hardware(["cpu"]).studies[0]
    head = HeadStart.maybe("auto", 60.0)
    assert head is not None
    assert head.start()
    configs = [study.default_config, {**study.default_config, "BLOCK_SIZE": 1024}]
    head.submit(study, configs, prebuild=True)
    head.wait_done(120)
    report = head.report()
    assert {k: report[k] for k in ("hardware", "submitted", "compiled")} == {
        "hardware": "cpu", "submitted": 3, "compiled": 2}, report


def test_no_gpu_type_no_head_start() -> None:
    """Where NVML names no GPU (this CPU machine: no driver), ``start`` says there is no
    head start and starts no process."""
    head = HeadStart(None, 30.0)
    if head_start.local_hardware_key() is not None:
        pytest.skip("NVML sees a GPU here")
    assert head.start() is False and head.pool.children() == []
    head.close()


def test_first_trials_stop_after_the_measurement_in_hand(monkeypatch) -> None:
    """The head start's measuring process (``first_trials``), on the interpreter: it
    measures each config once its compile is done, in order; ``stop`` lets the
    measurement in hand finish and returns what was measured, with the process gone."""
    import threading
    import time
    from concurrent.futures import Future

    from harness.fleet.compile import _pool_context
    from harness.fleet.first_trials import FirstTrials
    from harness.search.keys import config_key

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    configs = [{"FAULT": "none", "SLEEP_MS": ms, "BLOCK": block, "COMPILE_MS": 0}
               for ms, block in ((0, 128), (0, 256), (400, 128), (0, 64))]
    gate: Future = Future()  # the last config's compile: never done before ``stop``
    compiles = {config_key(configs[-1]): gate}
    first = FirstTrials(_pool_context(), "s", FAULTY_NAME, {"N": 256}, "fp32", 0,
                        {"warmup_ms": 1, "rep_ms": 1, "cpu_reps": 1}, configs,
                        lambda c: compiles.get(config_key(c)))
    first.start()
    deadline = time.monotonic() + 120
    while len(first.results) < 2:  # the first two are measured as soon as it is up
        assert time.monotonic() < deadline, first.report()
        time.sleep(0.1)
    while not first.results.get(config_key(configs[2])) and time.monotonic() < deadline:
        time.sleep(0.05)  # the slow one: measured while the last waits for its compile
    got = first.stop(timeout_s=60)
    assert set(got) == {config_key(c) for c in configs[:3]}, got
    res, at = got[config_key(configs[0])]
    assert res["ok"] and res["extra"]["measured_by"] == "head start"
    assert at <= time.monotonic()
    assert first._proc is not None and not first._proc.is_alive()
    assert first.report()["why_stopped"] == "stopped"
    assert not any(t.name == "harness-first-trials" and t.is_alive()
                   for t in threading.enumerate())


def test_first_trials_stopped_while_building_end_at_once(monkeypatch) -> None:
    from harness.fleet.compile import _pool_context
    from harness.fleet.first_trials import FirstTrials

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    first = FirstTrials(_pool_context(), "s", FAULTY_NAME, {"N": 256}, "fp32", 0,
                        {"warmup_ms": 1, "rep_ms": 1}, [{"FAULT": "none"}], lambda c: None)
    first.start()
    assert first.stop(timeout_s=30) == {}
    assert first.report()["why_stopped"] in ("stopped while it built its inputs", "stopped",
                                            "all measured")


def test_first_trials_end_at_a_poisoned_device_context(monkeypatch) -> None:
    """A config that poisons the device context (an illegal address: on the CPU its
    error text) fails its own trial; the configs after it are left to the fleet, not
    failed with its error."""
    from harness.fleet.compile import _pool_context
    from harness.fleet.first_trials import FirstTrials
    from harness.search.keys import config_key

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    configs = [{"FAULT": fault, "SLEEP_MS": 0, "BLOCK": block, "COMPILE_MS": 0}
               for fault, block in (("none", 128), ("illegal", 128), ("none", 256))]
    first = FirstTrials(_pool_context(), "s", FAULTY_NAME, {"N": 256}, "fp32", 0,
                        {"warmup_ms": 1, "rep_ms": 1, "cpu_reps": 1}, configs, lambda c: None)
    first.start()
    first._thread.join(120)
    got = first.stop(timeout_s=30)
    assert set(got) == {config_key(c) for c in configs[:2]}, got
    bad = got[config_key(configs[1])][0]
    assert not bad["ok"] and bad["fatal"], bad
    assert first.report()["why_stopped"].startswith("the device context was poisoned"), \
        first.report()
    assert not first._proc.is_alive()
