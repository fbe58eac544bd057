"""The fleet on a simulated mixed-GPU Ray cluster (``ray.cluster_utils.Cluster``).

Nodes advertise fake GPUs and ``accelerator_type`` resources (H100 x2, H200, A100-80G,
V710); the workers find no real GPU and run the kernels under Triton's interpreter. The
tests check where every trial ran, that each hardware key samples its vendor's space and
freezes its own pack, each fault of the issue's table, a node killed mid-trial, waiting
for an autoscaler, compiling ahead, and a campaign's experiments sharing the GPUs.
"""

from __future__ import annotations

import io
import json
import logging
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import optuna
import pytest
import ray
import yaml
from mlflow.tracking import MlflowClient
from ray.cluster_utils import Cluster
from rich.console import Console

from harness.fleet import Fleet, NoHardwareError, Task
from harness.fleet.cluster import NO_PRESTART
from harness.measure.timing import Timing
from harness.run.runner import run
from kernels.grouped_gemm import GroupedGemm
from tests.fault_kernels import Faulty, read_events

# Each run's MLflow store is a copy of one built once: a new store migrates (seconds of CPU).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("mlflow_db")]

ROOT = Path(__file__).resolve().parent.parent
FAULTY = "tests.fault_kernels:Faulty"
SIMULATED = ["H100", "H100", "H200", "A100-80G", "V710"]


@pytest.fixture(scope="module")
def cl(tmp_path_factory) -> Any:
    events = tmp_path_factory.mktemp("events")
    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 1, "include_dashboard": False,
                                      "_system_config": NO_PRESTART})
    for name in SIMULATED:
        cluster.add_node(num_cpus=1, num_gpus=1, resources={f"accelerator_type:{name}": 1})
    cluster.wait_for_nodes()
    # HARNESS_PRECOMPILE=force: the compile-ahead plumbing runs under the interpreter too
    # (experiments that do not test it set compile_workers: 0).
    ray.init(address=cluster.address, logging_level=logging.WARNING, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "FAULT_DIR": str(events),
                                       "HARNESS_PRECOMPILE": "force"}})
    try:
        yield SimpleNamespace(cluster=cluster, events=events)
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture
def events(cl) -> Path:
    (cl.events / "events.jsonl").unlink(missing_ok=True)
    return cl.events


def _nodes_by_key() -> dict[str, set[str]]:
    """Hardware key -> ids of the live nodes advertising it."""
    from harness.measure.hardware import hardware_key

    out: dict[str, set[str]] = {}
    for node in ray.nodes():
        if not node["Alive"]:
            continue
        for res in node["Resources"]:
            if res.startswith("accelerator_type:"):
                out.setdefault(hardware_key(res.split(":", 1)[1]), set()).add(node["NodeID"])
    return out


def _experiment(tmp_path: Path, **fields: Any) -> Path:
    exp = {
        "name": "fleet",
        "kernel": FAULTY,
        "shapes": [{"N": 256}],
        "dtypes": ["fp32"],
        "search": {"sampler": "grid", "trials": 20},
        "tracking": {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
        "output": {"packs_dir": str(tmp_path / "packs"), "runs_dir": str(tmp_path / "runs")},
        # Threads: the simulated GPUs run the interpreter; the placement test runs the
        # processes a GPU run starts.
        "fleet": {"compile_workers": 0, "bookkeeping": "threads"},
    }
    for key, value in fields.items():
        if isinstance(value, dict) and isinstance(exp.get(key), dict):
            exp[key] = {**exp[key], **value}
        else:
            exp[key] = value
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(exp))
    return path


def _run(path: Path) -> tuple[Any, str]:
    buf = io.StringIO()
    summary = run(path, console=Console(file=buf, width=300), progress=False)
    return summary, buf.getvalue()


def _trials(tmp_path: Path, name: str, study: str) -> list[optuna.trial.FrozenTrial]:
    storage = f"sqlite:///{tmp_path / 'runs' / name / 'optuna.db'}"
    return optuna.load_study(study_name=study, storage=storage).trials


def _by_status(trials: list, status: str) -> list:
    return [t for t in trials if t.user_attrs.get("status") == status]


# -- placement, per-vendor spaces, packs --------------------------------------------------

SMALL = {
    # The kernel's other tunables at their defaults: in the shipped space almost every
    # random draw is a config pruned on the interpreter (Gluon, TMA options, tails), and
    # walking past them cost this test minutes, not placement checks. Read from the
    # kernel, so that a tunable added later is pinned too.
    **{k: [v] for k, v in GroupedGemm.default_config.items()},
    "BLOCK_M": [64], "BLOCK_N": [64], "BLOCK_K": [64], "GROUP_M": [1, 4], "num_warps": [4],
    "num_stages": [2, 3], "PERSISTENT": [0, 1]}
AMD_KEYS = {"waves_per_eu", "kpack", "matrix_instr_nonkdim"}


def test_placement_vendor_spaces_and_packs(cl, tmp_path: Path) -> None:
    shape = {"M": 96, "N": 64, "K": 64, "E": 2}
    path = _experiment(
        tmp_path, name="place", kernel="grouped_gemm", shapes=[shape], dtypes=["fp16"],
        hardware=["H100", "H200", "A100", "V710", "MI300X"],
        search={"sampler": "random", "trials": 3}, fleet={"bookkeeping": "auto"},
        # Small tiles for the interpreter; the V710 keeps the shipped AMD-only knobs.
        search_space={"vendors": {"nvidia": {"params": SMALL},
                                  "amd": {"params": {**SMALL, "num_stages": [1, 2]}}}})
    summary, text = _run(path)

    # A listed key the cluster lacks is reported and skipped; the rest run.
    assert summary.missing_hardware == ["MI300X"]
    assert "hardware MI300X: no MI300X GPUs in this cluster" in text
    assert "wait_for_nodes_s" in text
    nodes = _nodes_by_key()
    assert {k: len(v) for k, v in nodes.items()} == {"H100": 2, "H200": 1, "A100": 1,
                                                      "V710": 1}

    for hw in ("H100", "H200", "A100", "V710"):
        trials = _trials(tmp_path, "place", f"place/grouped_gemm/M=96,N=64,K=64,E=2/fp16/{hw}")
        measured = _by_status(trials, "measured")
        assert len(measured) == 3, (hw, [t.user_attrs for t in trials])
        for t in measured:
            extra = t.user_attrs["result"]["extra"]
            # Every trial ran on a node of its own hardware key, nowhere else.
            assert extra["node_id"] in nodes[hw], (hw, extra)
            assert extra["worker_hardware"] == hw
            # Each study sampled its own vendor's space.
            if hw == "V710":
                assert AMD_KEYS <= set(t.params), t.params
                assert t.params["num_stages"] in (1, 2)
            else:
                assert not AMD_KEYS & set(t.params), t.params
        # Each hardware key froze its own pack, named by the hardware that measured.
        pack = json.loads((tmp_path / "packs" / hw / "grouped_gemm.json").read_text())
        assert pack["hardware"] == hw
        entry = pack["kernels"]["grouped_gemm"]["fp16"]["M=96,N=64,K=64,E=2"]
        assert (hw == "V710") == bool(AMD_KEYS & set(entry["config"]))
    assert not (tmp_path / "packs" / "cpu").exists()  # never the driver's device
    assert sorted(p.name for p in (tmp_path / "packs").iterdir()) == ["A100", "H100", "H200",
                                                                      "V710"]

    # MLflow: every trial run carries the node it ran on, a node of its study's hardware.
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("place")
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    studies = {r.info.run_id: r.data.tags["hardware"] for r in runs
               if r.data.tags.get("harness.level") == "study"}
    trial_runs = [r for r in runs if r.data.tags.get("harness.level") == "trial"]
    assert sorted(studies.values()) == ["A100", "H100", "H200", "V710"]
    assert len(trial_runs) == 12
    for r in trial_runs:
        hw = studies[r.data.tags["mlflow.parentRunId"]]
        assert r.data.tags["harness.node_id"] in nodes[hw]
    parent = next(r for r in runs if r.data.tags.get("harness.level") == "experiment")
    assert parent.data.tags["harness.missing_hardware"] == "MI300X"
    assert "timing_fraction" in parent.data.metrics and "gpu_held_s" in parent.data.metrics
    assert 0 < summary.timing_s <= summary.held_s


# -- faults -------------------------------------------------------------------------------

FAULTS = ["none", "compile", "oor", "illegal", "hang", "wrong", "nan"]


def test_each_fault_fails_its_trial_and_the_study_goes_on(cl, events, tmp_path: Path) -> None:
    path = _experiment(tmp_path, name="faults", hardware=["H200"],
                       search_space={"params": {"FAULT": FAULTS}},
                       timing={"trial_timeout_s": 10})
    summary, _ = _run(path)
    trials = _trials(tmp_path, "faults", f"faults/{FAULTY}/N=256/fp32/H200")
    final = {t.params["FAULT"]: t for t in trials
             if t.user_attrs.get("status") in ("measured", "failed")}
    assert sorted(final) == sorted(FAULTS), "every config got a result: the study went on"

    def reason(fault: str) -> str:
        t = final[fault]
        assert t.user_attrs["status"] == "failed", fault
        return t.user_attrs["reason"]

    assert final["none"].user_attrs["status"] == "measured"
    assert reason("compile").startswith("compile error: CompilationError")
    assert "power of 2" in reason("compile")
    assert reason("oor").startswith("out of resources: OutOfResources")
    assert reason("illegal").startswith("device fault:")
    assert "illegal memory access" in reason("illegal") and "worker replaced" in reason("illegal")
    assert reason("hang").startswith("timeout: no result after 10 s")
    assert reason("wrong").startswith("wrong result:")
    assert "NaN/Inf" in reason("nan")

    # The illegal access and the hang each cost the worker: replaced, and later trials
    # ran in a new process.
    assert summary.replaced == 2
    assert any("device fault" in e for e in summary.events)
    assert any("time-out" in e for e in summary.events)
    launches = sorted((e for e in read_events(events) if e["event"] == "launch"),
                      key=lambda e: e["t"])
    for fault in ("illegal", "hang"):
        at = next(e for e in launches if e["config"].get("FAULT") == fault)
        later = [e for e in launches if e["t"] > at["t"]]
        assert all(e["pid"] != at["pid"] for e in later), fault  # never the old worker

    # Only the correct config is frozen; wrong and NaN results never are.
    pack = json.loads((tmp_path / "packs" / "H200" / "faulty.json").read_text())
    (entry,) = pack["kernels"]["faulty"]["fp32"].values()
    assert entry["config"]["FAULT"] == "none"


def test_lost_worker_fails_the_trial_after_its_retries(cl, events) -> None:
    """A trial whose worker dies under it is retried up to max_retries, then failed."""
    fleet = Fleet(Timing(), 120, queue_depth=1, max_retries=0)
    try:
        fleet.discover()
        infos = fleet.start({"H200": 1})
        assert len(infos["H200"]) == 1
        fleet.submit(Task("H200", "measure", (FAULTY, {"N": 64}, "fp32", {"FAULT": "hang"}, 0),
                          tag="t"))
        deadline = time.monotonic() + 60
        while not [e for e in read_events(events) if e["config"].get("FAULT") == "hang"]:
            assert time.monotonic() < deadline
            fleet.poll(0.2)
        ray.kill(fleet.slots[0].actor, no_restart=True)  # the worker process dies
        done = []
        while not done:
            assert time.monotonic() < deadline + 60
            done = fleet.poll(0.5)
        ((task, result),) = done
        assert task.tag == "t" and not result.ok
        assert result.reason.startswith("worker lost 1 times")
        assert fleet.retried == 0 and fleet.replaced == 1
    finally:
        fleet.shutdown()


# -- a node killed mid-trial ------------------------------------------------------------


def test_node_killed_mid_trial_retries_on_another_gpu_of_its_type(cl, events,
                                                                  tmp_path: Path) -> None:
    l4 = [cl.cluster.add_node(num_cpus=1, num_gpus=1, resources={"accelerator_type:L4": 1})
          for _ in range(2)]
    cl.cluster.wait_for_nodes()
    sleeps = [1000, 1100, 1200]
    path = _experiment(tmp_path, name="nodekill", hardware=["L4"],
                       search_space={"params": {"FAULT": ["none"], "SLEEP_MS": sleeps}},
                       fleet={"queue_depth": 1, "max_retries": 2, "compile_workers": 0})
    out: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: out.update(summary=_run(path)[0]), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 120
        victim = None
        while victim is None:
            assert time.monotonic() < deadline, "no slow trial started"
            started = [e for e in read_events(events)
                       if e["event"] == "launch" and e["config"].get("SLEEP_MS", 0) >= 1000]
            if started:
                victim = started[0]
            time.sleep(0.1)
        node = next(n for n in l4 if n.node_id == victim["node"])
        cl.cluster.remove_node(node)  # the node dies while its trial sleeps
        thread.join(180)
        assert not thread.is_alive()
    finally:
        for n in l4:
            if n.node_id != (victim or {}).get("node"):
                cl.cluster.remove_node(n)
    summary = out["summary"]
    trials = _trials(tmp_path, "nodekill", f"nodekill/{FAULTY}/N=256/fp32/L4")
    measured = {t.params["SLEEP_MS"]: t for t in _by_status(trials, "measured")}
    assert sorted(measured) == sleeps and not _by_status(trials, "failed")
    retried = measured[victim["config"]["SLEEP_MS"]].user_attrs["result"]["extra"]
    assert retried["tries"] == 2
    assert retried["node_id"] != victim["node"]  # another GPU of the same type
    assert retried["worker_hardware"] == "L4"
    assert summary.retried >= 1 and summary.replaced >= 1


# -- waiting for an autoscaler ------------------------------------------------------------


def test_wait_for_nodes_asks_the_autoscaler_and_waits(cl, tmp_path: Path, monkeypatch) -> None:
    from ray.autoscaler import sdk

    calls: list[Any] = []
    real = sdk.request_resources
    monkeypatch.setattr(sdk, "request_resources",
                        lambda **kw: (calls.append(kw.get("bundles")), real(**kw)))
    path = _experiment(tmp_path, name="wait", hardware=["A10"],
                       search_space={"params": {"FAULT": ["none"], "SLEEP_MS": [0, 1]}},
                       fleet={"wait_for_nodes_s": 90, "compile_workers": 0})
    out: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: out.update(result=_run(path)), daemon=True)
    thread.start()
    # The test stands in for the autoscaler: the node joins after the run began waiting.
    deadline = time.monotonic() + 60
    while not calls:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    time.sleep(1)
    node = cl.cluster.add_node(num_cpus=1, num_gpus=1, resources={"accelerator_type:A10G": 1})
    try:
        thread.join(180)
        assert not thread.is_alive()
    finally:
        cl.cluster.remove_node(node)
    summary, text = out["result"]
    assert "waiting up to 90 s for nodes with A10 GPUs" in text
    assert summary.missing_hardware == []
    assert calls[0] == [{"GPU": 1, "accelerator_type:A10": 1}]
    assert calls[-1] == []  # withdrawn at the end: the nodes may scale down again
    trials = _trials(tmp_path, "wait", f"wait/{FAULTY}/N=256/fp32/A10")
    assert len(_by_status(trials, "measured")) == 2
    assert (tmp_path / "packs" / "A10" / "faulty.json").is_file()


def test_wait_for_nodes_gives_up_clearly(cl, tmp_path: Path) -> None:
    path = _experiment(tmp_path, name="nowait", hardware=["L40S"],
                       fleet={"wait_for_nodes_s": 2, "compile_workers": 0})
    buf = io.StringIO()
    with pytest.raises(NoHardwareError, match=r"none of \['L40S'\] is present"):
        run(path, console=Console(file=buf, width=300), progress=False)
    text = buf.getvalue()
    assert "hardware L40S: no L40S GPUs in this cluster" in text
    assert "after waiting 2 s for the autoscaler" in text
    assert "H100×2" in text  # what the cluster does have


# -- compiling ahead ----------------------------------------------------------------------


def test_known_and_queued_configs_compile_ahead_in_child_processes(cl, events,
                                                                    tmp_path: Path) -> None:
    """The first study's default config, and every config of its exhaustive grid, are
    known before the search: a new worker builds that problem's inputs and sends them to
    its compile child in its start-up, so the GPU does not wait for those compiles once
    the worker is ready. Each is compiled once, in the child, before its launch, and
    loaded into the worker while the config before it is measured."""
    sleeps = [100, 200, 300, 400]
    path = _experiment(tmp_path, name="ahead", hardware=["H200"],
                       search_space={"params": {"FAULT": ["none"], "SLEEP_MS": sleeps}},
                       fleet={"queue_depth": 4, "compile_workers": 1})
    summary, _ = _run(path)
    trials = _by_status(_trials(tmp_path, "ahead", f"ahead/{FAULTY}/N=256/fp32/H200"),
                        "measured")
    assert sorted(t.params["SLEEP_MS"] for t in trials) == sleeps
    start = summary.worker_startup["H200"]
    # The default and the grid's four, sent before "ready".
    assert "first_problem" in start and start["compiles_sent"] == 1 + len(sleeps), start
    (row,) = summary.rows
    assert row["default_latency_ms"] > 0 and row["counts"]["measured"] == len(sleeps)
    log = read_events(events)
    grid = [{**Faulty.default_config, "FAULT": "none", "SLEEP_MS": ms} for ms in sleeps]
    for config in [Faulty.default_config, *grid]:
        compiled = [e for e in log if e["event"] == "compile"
                    and {**Faulty.default_config, **e["config"]} == config]
        launched = [e for e in log if e["event"] == "launch"
                    and {**Faulty.default_config, **e["config"]} == config]
        assert len(compiled) == 1 and launched, (config, log)  # compiled once, ahead
        assert compiled[0]["pid"] != launched[0]["pid"]
        assert compiled[0]["t"] <= launched[0]["t"]
    for t in trials:
        extra = t.user_attrs["result"]["extra"]
        compiled = [e for e in log if e["event"] == "compile" and e["config"] == t.params]
        launched = [e for e in log if e["event"] == "launch" and e["config"] == t.params]
        assert launched[0]["pid"] == extra["pid"]  # launched by the worker that measured
        assert extra["precompile"]["ok"] is True
        assert extra["precompile"]["pid"] == compiled[0]["pid"]
    # While one config is measured, the worker loads the next queued one's binary into
    # its own process, after the child compiled it and before its first launch. (The
    # first trial may come after a task of the search's baselines, which loads nothing.)
    loaded = 0
    for t in trials:
        loads = [e for e in log if e["event"] == "load" and e["config"] == t.params]
        launched = [e for e in log if e["event"] == "launch" and e["config"] == t.params]
        compiled = [e for e in log if e["event"] == "compile" and e["config"] == t.params]
        if loads:
            loaded += 1
            assert len(loads) == 1 and loads[0]["pid"] == launched[0]["pid"]
            assert compiled[0]["t"] <= loads[0]["t"] <= launched[0]["t"]
    # On loaded cores a compile may end only after the config before it was measured:
    # then the launch loads it. At least one load must have overlapped a measurement.
    assert loaded >= 1, log


def test_remeasurement_of_a_study_runs_on_one_gpu(cl, events, tmp_path: Path) -> None:
    """With two H100 workers the trials spread over both, but a study's interleaved
    re-measurement of its top configs runs on one of them: candidates are compared on
    the same device."""
    # ms: the two 50 ms configs stay within the finalist band of each other whatever a
    # loaded machine's jitter (a few ms); the others are far behind them
    sleeps = [50, 300, 400]
    path = _experiment(tmp_path, name="pinned", hardware=["H100"],
                       search={"sampler": "grid", "trials": 6, "warm_start": False,
                               "remeasure_top_k": 2, "remeasure_rounds": 3},
                       search_space={"params": {"FAULT": ["none"], "SLEEP_MS": sleeps,
                                                "BLOCK": [128, 256]}},
                       fleet={"queue_depth": 2, "compile_workers": 0})
    summary, _ = _run(path)
    (row,) = summary.rows
    # The finalists: the search's top 2 (the 50 ms configs; the others are over 50 %
    # behind: ``remeasure.FINALIST_BAND``) and the kernel's default (no sleep), which the
    # search did not measure and which wins.
    n = row["remeasure_candidates"]
    assert row["params"]["SLEEP_MS"] == 0 and n == 3, row["remeasured"]
    launches = [e for e in read_events(events) if e["event"] == "launch"]
    # Each measurement is 2 timed runs on the CPU (the checked output is the last timed
    # run's: no separate first call): the search's 6 trials, then the final rounds.
    search, tail = launches[:12], launches[12:]
    assert len({e["pid"] for e in search}) == 2  # the search used both workers
    assert len({e["pid"] for e in tail}) == 1, [(e["pid"], e["config"]["SLEEP_MS"]) for e in tail]
    order = [(e["config"]["SLEEP_MS"], e["config"]["BLOCK"]) for e in tail[::2]]
    # Every finalist in the first two rounds, in one order; in the third, those not 6 %
    # behind the best in both (the 50 ms configs are far behind the default's no sleep).
    assert order[:2 * n] == order[:n] * 2, order
    assert sorted(order[:n]) == [(0, 128), (50, 128), (50, 256)], order
    assert order[2 * n:] == [(0, 128)], order


def test_a_config_compiled_ahead_runs_before_an_older_one_still_compiling(
        cl, events, tmp_path: Path, monkeypatch) -> None:
    """The GPU times whatever is compiled: queued configs whose compile child is done run
    ahead of an older one whose compile takes seconds, and the wait that is left is
    booked as setup, not as the driver's idle time."""
    import harness.run.schedule as hschedule

    # Only the default is compiled while the worker starts: the grid's configs compile
    # as they are queued, so that the slow ones are still compiling when the fast run.
    monkeypatch.setattr(hschedule, "MAX_KNOWN", 1)
    path = _experiment(tmp_path, name="order", hardware=["H200"], seed=3,
                       search={"sampler": "grid", "trials": 4, "warm_start": False,
                               "remeasure_top_k": 0},
                       search_space={"params": {"FAULT": ["none"], "SLEEP_MS": [0, 10],
                                                "COMPILE_MS": [0, 3000]}},
                       fleet={"queue_depth": 4, "compile_workers": 4})
    summary, _ = _run(path)
    trials = _by_status(_trials(tmp_path, "order", f"order/{FAULTY}/N=256/fp32/H200"),
                        "measured")
    assert len(trials) == 4
    slow = sorted(t.number for t in trials if t.params["COMPILE_MS"])
    fast = sorted(t.number for t in trials if not t.params["COMPILE_MS"])
    assert min(slow) < max(fast)  # a slow config was handed out before a fast one
    log = read_events(events)

    def first_launch(params: dict) -> float:
        return min(e["t"] for e in log if e["event"] == "launch" and e["config"] == params)

    by_number = {t.number: t.params for t in trials}
    assert max(first_launch(by_number[n]) for n in fast) < min(
        first_launch(by_number[n]) for n in slow), log
    assert summary.overhead["setup"] >= 2.0  # waiting for the slow compiles
    assert summary.overhead["idle"] < 2.0


def test_a_coming_study_s_configs_compile_while_the_one_before_it_is_timed(
        cl, events, tmp_path: Path) -> None:
    """The worker is told every study's known configs as it becomes ready: the second
    study's grid compiles in the compile children while the first study's slow configs
    are timed, so that none of its configs is compiled only once its task is queued
    (one task at a time here)."""
    sleeps = [500, 600]
    path = _experiment(tmp_path, name="coming", hardware=["H200"],
                       shapes=[{"N": 256}, {"N": 512}],
                       search={"sampler": "grid", "trials": 2, "warm_start": False,
                               "remeasure_top_k": 0},
                       search_space={"params": {"FAULT": ["none"], "SLEEP_MS": sleeps,
                                                "COMPILE_MS": [600]}},
                       fleet={"queue_depth": 1, "compile_workers": 2})
    summary, _ = _run(path)
    for n in (256, 512):
        trials = _trials(tmp_path, "coming", f"coming/{FAULTY}/N={n}/fp32/H200")
        assert len(_by_status(trials, "measured")) == 2
    log = read_events(events)
    launched = {n: min(e["t"] for e in log if e["event"] == "launch" and e["N"] == n)
                for n in (256, 512)}
    first, second = sorted(launched, key=launched.get)
    compiled = [e for e in log if e["event"] == "compile" and e["N"] == second
                and e["config"].get("SLEEP_MS") in sleeps]
    assert len(compiled) == len(sleeps), log
    # Both compiled (600 ms each) before the second study's first launch: without the
    # hint, its second config would start compiling only once its first was timed.
    assert max(e["t"] for e in compiled) < launched[second], (launched, compiled)


def test_tasks_waiting_on_a_busy_compile_service_are_no_hang(
        cl, events, tmp_path: Path, monkeypatch) -> None:
    """A worker whose queued configs wait for the node's compile service longer than
    the trial time-out (a campaign's backlog of slow compiles) is not taken for hung:
    its loop runs no task meanwhile. It is told once, and every trial is measured by
    the one worker."""
    import harness.run.schedule as hschedule

    monkeypatch.setattr(hschedule, "MAX_KNOWN", 1)
    path = _experiment(tmp_path, name="backlog", hardware=["H200"], seed=4,
                       search={"sampler": "grid", "trials": 3, "warm_start": False,
                               "remeasure_top_k": 0},
                       search_space={"params": {"FAULT": ["none"], "SLEEP_MS": [0, 10, 20],
                                                "COMPILE_MS": [5000]}},
                       timing={"trial_timeout_s": 3.5},
                       fleet={"queue_depth": 4, "compile_workers": 1,
                              "compile_timeout_s": 12, "compile_timeout_ratio": 0})
    summary, _ = _run(path)
    trials = _trials(tmp_path, "backlog", f"backlog/{FAULTY}/N=256/fp32/H200")
    assert len(_by_status(trials, "measured")) == 3, [t.user_attrs for t in trials]
    events_text = "\n".join(summary.events)
    assert "killed" not in events_text and summary.replaced == 0, events_text
    assert "waited over 3.5 s for its tasks' compiles" in events_text


def _kept() -> list[str]:
    """Names of the kept workers (and kept compile services) alive in the cluster."""
    from ray.util import list_named_actors

    from harness.fleet import KEPT_NS

    return [a["name"] for a in list_named_actors(all_namespaces=True)
            if a["namespace"] == KEPT_NS]


def _drop_kept() -> None:
    """End the kept actors a test leased, so that their simulated GPUs are free for the
    next test (their leaving once idle is tested on its own)."""
    from harness.fleet import KEPT_NS

    for name in _kept():
        try:
            ray.kill(ray.get_actor(name, namespace=KEPT_NS))
        except ValueError:  # it left by itself meanwhile
            pass
    deadline = time.monotonic() + 30
    while _kept() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _kept() == []


def test_kept_workers_serve_the_next_run(cl, events, tmp_path: Path, monkeypatch) -> None:
    """fleet.keep_workers_s on a cluster that outlives the run: the second run leases the
    first run's worker (same process, no start-up), which builds the new run's first
    problem and sends its known configs to compile before the lease returns, as a new
    worker does at start; a run with other code does not lease it."""
    def pids(name: str, n: int) -> set[int]:
        trials = _by_status(_trials(tmp_path, name, f"{name}/{FAULTY}/N={n}/fp32/H200"),
                            "measured")
        assert trials
        return {t.user_attrs["result"]["extra"]["pid"] for t in trials}

    # keep_workers_s leaves room for the first run's end (its MLflow loggers catch up)
    # and the second run's start on a loaded 2-core machine.
    fields = dict(hardware=["H200"], search={"sampler": "grid", "trials": 2,
                                             "remeasure_top_k": 0},
                  search_space={"params": {"FAULT": ["none"], "SLEEP_MS": [0, 10]}},
                  fleet={"compile_workers": 1, "keep_workers_s": 45, "queue_depth": 2})
    assert _kept() == []
    try:
        first, _ = _run(_experiment(tmp_path, name="keep1", **fields))
        assert first.reused == 0 and _kept()
        time.sleep(2)  # the kept worker idles between runs: not this run's GPU-held time
        second, _ = _run(_experiment(tmp_path, name="keep2", shapes=[{"N": 512}], **fields))
        assert second.reused == 1
        assert second.overhead["idle"] < 3.0, second.overhead
        assert pids("keep1", 256) == pids("keep2", 512)
        start = second.worker_startup["H200"]
        # It describes this lease, not the worker's start-up in the first run.
        assert "import_torch" not in start and "first_problem" in start, start
        # The default (SLEEP_MS 0, one of the grid's two configs) and the grid's other one.
        assert start["compiles_sent"] == 2
        assert second.rows[0]["default_latency_ms"] > 0
        # Other code (here: another kernel file digest) must not run on the kept worker.
        import harness.run.runner as hrun

        monkeypatch.setattr(hrun, "_code_version", lambda exp: "other-code")
        third, _ = _run(_experiment(tmp_path, name="keep3", **fields))
        assert third.reused == 0 and pids("keep3", 256).isdisjoint(pids("keep1", 256))
    finally:
        _drop_kept()


def test_a_kept_worker_leaves_once_idle(cl, events, tmp_path: Path) -> None:
    """A kept worker gives its GPU back once no run has used it for keep_workers_s."""
    seen: list[str] = []
    stop = threading.Event()

    def watch() -> None:  # the kept worker exists while the run holds it
        while not stop.is_set():
            seen.extend(n for n in _kept() if n not in seen)
            time.sleep(0.3)

    fields = dict(hardware=["H200"], search={"sampler": "grid", "trials": 1},
                  search_space={"params": {"FAULT": ["none"], "SLEEP_MS": [0]}},
                  fleet={"compile_workers": 0, "keep_workers_s": 3})
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        summary, _ = _run(_experiment(tmp_path, name="idle", **fields))
    finally:
        stop.set()
        watcher.join()
    assert summary.rows[0]["counts"]["measured"] >= 1 and seen, seen
    deadline = time.monotonic() + 45
    while _kept() and time.monotonic() < deadline:
        time.sleep(0.3)
    assert _kept() == []  # idle for keep_workers_s: gone, its GPU free again


def test_a_study_remeasures_while_another_still_searches(cl, events, tmp_path: Path) -> None:
    """No barrier between search and re-measurement: on one GPU, the first study's
    finalists are re-measured as soon as its own search is over, before the second
    study's search ends, and both studies freeze a re-measured winner."""
    path = _experiment(tmp_path, name="nobarrier", hardware=["H200"],
                       shapes=[{"N": 256}, {"N": 512}],
                       search={"sampler": "grid", "trials": 4, "warm_start": False,
                               "remeasure_top_k": 2, "remeasure_rounds": 2},
                       search_space={"params": {"FAULT": ["none"],
                                                "SLEEP_MS": [0, 50, 100, 150]}},
                       fleet={"queue_depth": 2, "compile_workers": 0})
    summary, _ = _run(path)
    studies = summary.fleet["studies"]
    first, second = sorted(studies.values(), key=lambda t: t["search_done"])
    assert first["remeasure_started"] < second["search_done"], studies
    assert first["done"] <= second["done"]
    assert all(r["remeasure_rounds"] == 2 and r["params"]["SLEEP_MS"] == 0
               for r in summary.rows), summary.rows


def test_a_campaign_spreads_its_experiments_over_the_gpus_of_their_key(cl, events,
                                                                       tmp_path: Path) -> None:
    """Two experiments as one campaign on the two H100s: one worker per GPU serves both
    (not a fleet per experiment), their studies search at the same time, each on its
    own GPU, and each experiment freezes its own pack and keeps its own run folder."""
    from harness.run.campaign import run_campaign

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    space = {"A": [100, 101, 102], "B": [150, 151, 152]}
    paths = []
    for name in ("A", "B"):
        path = _experiment(tmp_path / name.lower(), name=f"camp{name}", hardware=["H100"],
                           search={"sampler": "grid", "trials": 3, "warm_start": False},
                           search_space={"params": {"FAULT": ["none"],
                                                    "SLEEP_MS": space[name]}},
                           output={"packs_dir": str(tmp_path / f"packs{name}"),
                                   "runs_dir": str(tmp_path / "runs")},
                           tracking={"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"})
        paths.append(path)
    result = run_campaign(paths, console=Console(file=io.StringIO(), width=300),
                          progress=False)
    workers = result.fleet.fleet["workers"]
    assert [w["hardware"] for w in workers] == ["H100", "H100"], workers
    launches = {name: [e for e in read_events(events) if e["event"] == "launch"
                       and e["config"].get("SLEEP_MS") in space[name]] for name in space}
    # Each experiment's study on its own GPU, at the same time as the other's.
    nodes = {name: {e["node"] for e in launches[name]} for name in space}
    assert len(nodes["A"] | nodes["B"]) == 2 and nodes["A"] != nodes["B"], nodes
    spans = {name: (min(e["t"] for e in ls), max(e["t"] for e in ls))
             for name, ls in launches.items()}
    assert spans["A"][0] < spans["B"][1] and spans["B"][0] < spans["A"][1], spans
    for entry, name in zip(result.experiments, space, strict=True):
        assert entry.name == f"camp{name}" and entry.summary.rows[0]["counts"]["measured"] == 3
        (pack,) = entry.summary.packs
        assert Path(pack).is_relative_to(tmp_path / f"packs{name}")
        assert (tmp_path / "runs" / f"camp{name}" / "optuna.db").is_file()
