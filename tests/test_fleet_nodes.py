"""The fleet on a simulated multi-node cluster: placement by hardware key, one compile
service per node whose binaries are compiled once per node, and studies spread over every
worker.

Two nodes advertise two H100 each and two one H200 each (``accelerator_type``
resources, fake ``num_gpus``); the workers find no real GPU and run Triton's interpreter,
and compiling ahead is forced (``HARNESS_PRECOMPILE=force``) so that the compile services
run as on GPUs.
"""

from __future__ import annotations

import io
import logging
from collections import Counter
from pathlib import Path
from typing import Any

import optuna
import pytest
import ray
import yaml
from ray.cluster_utils import Cluster
from rich.console import Console

from harness.fleet.cluster import NO_PRESTART
from harness.run.runner import run
from tests.fault_kernels import Faulty, read_events

# Each run's MLflow store is a copy of one built once: a new store migrates (seconds of CPU).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("mlflow_db")]

ROOT = Path(__file__).resolve().parent.parent
FAULTY = "tests.fault_kernels:Faulty"
SLEEPS = [0, 10, 20, 30, 40, 50, 60, 70]


@pytest.fixture(scope="module")
def nodes(tmp_path_factory) -> Any:
    events = tmp_path_factory.mktemp("events")
    # The head is one of the four nodes.
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "num_gpus": 2, "resources": {"accelerator_type:H100": 2},
        "include_dashboard": False, "_system_config": NO_PRESTART})
    for i in range(3):
        h100 = i < 1
        cluster.add_node(num_cpus=2 if h100 else 1, num_gpus=2 if h100 else 1,
                         resources={f"accelerator_type:{'H100' if h100 else 'H200'}": 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level=logging.WARNING, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "FAULT_DIR": str(events),
                                       "HARNESS_PRECOMPILE": "force"}})
    try:
        yield events
    finally:
        ray.shutdown()
        cluster.shutdown()


def _nodes(key: str) -> set[str]:
    return {n["NodeID"] for n in ray.nodes()
            if n["Alive"] and f"accelerator_type:{key}" in n["Resources"]}


def test_nodes_place_by_key_compile_once_per_node_and_spread(nodes, tmp_path: Path) -> None:
    exp = {
        "name": "multi", "kernel": FAULTY, "shapes": [{"N": 256}, {"N": 512}],
        "dtypes": ["fp32"], "hardware": ["H100"],
        "search": {"sampler": "grid", "trials": 20, "warm_start": False,
                   "remeasure_top_k": 2, "remeasure_rounds": 1},
        "search_space": {"params": {"FAULT": ["none"], "SLEEP_MS": SLEEPS}},
        "tracking": {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
        "output": {"packs_dir": str(tmp_path / "packs"), "runs_dir": str(tmp_path / "runs")},
        # Threads: the MLflow logger and the Optuna writer as processes are the placement
        # test's (test_fleet_cluster.py); here each would start a Ray worker for nothing.
        "fleet": {"queue_depth": 1, "compile_workers": 1, "bookkeeping": "threads"},
    }
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(exp))
    summary = run(path, console=Console(file=io.StringIO(), width=300), progress=False)
    h100, h200 = _nodes("H100"), _nodes("H200")
    assert len(h100) == 2 and len(h200) == 2

    # Placement: four H100 workers, on the H100 nodes only; nothing on the H200 nodes.
    workers = summary.fleet["workers"]
    assert len(workers) == 4 and {w["node_id"] for w in workers} == h100
    storage = f"sqlite:///{tmp_path / 'runs' / 'multi' / 'optuna.db'}"
    trials = [t for n in (256, 512)
              for t in optuna.load_study(study_name=f"multi/{FAULTY}/N={n}/fp32/H100",
                                         storage=storage).trials
              if t.user_attrs.get("status") == "measured"]
    assert len(trials) == 2 * len(SLEEPS)
    assert {t.user_attrs["result"]["extra"]["node_id"] for t in trials} <= h100

    # Spread: every worker measured something (one task at a time: the first four go to
    # four workers), and each study ran on several of them.
    assert all(w.get("tasks", 0) >= 1 for w in workers), workers
    # Each worker's first trial says where its time went (inputs, compile, launch).
    assert all({"setup_s", "measure_s"} <= set(w.get("first_task", {})) for w in workers), \
        workers
    pids = {}
    for n in (256, 512):
        study = optuna.load_study(study_name=f"multi/{FAULTY}/N={n}/fp32/H100",
                                  storage=storage)
        pids[n] = {t.user_attrs["result"]["extra"]["pid"] for t in study.trials
                   if t.user_attrs.get("status") == "measured"}
    assert all(len(p) >= 2 for p in pids.values()), pids

    # One compile service per H100 node, none elsewhere; each binary (shape, config)
    # compiled once per node, though both GPUs of a node were given the first study's
    # grid to compile while they started.
    services = summary.fleet["compile_services"]
    assert set(services) == h100
    compiles = [e for e in read_events(nodes) if e["event"] == "compile"]
    assert {e["node"] for e in compiles} <= h100 and compiles
    per_node = Counter((e["node"], e["N"],
                        tuple(sorted({**Faulty.default_config, **e["config"]}.items())))
                       for e in compiles)
    assert max(per_node.values()) == 1, [k for k, v in per_node.items() if v > 1]
    assert all(s["deduplicated"] >= len(SLEEPS) for s in services.values()), services
    # The known configs reached every node: the first study's grid compiled on each.
    first = {tuple(sorted({**Faulty.default_config, "FAULT": "none", "SLEEP_MS": s}.items()))
             for s in SLEEPS}
    for node in h100:
        got = {tuple(sorted({**Faulty.default_config, **e["config"]}.items()))
               for e in compiles if e["node"] == node}
        assert first & got, node
    assert len(summary.packs) == 1 and all(r.get("params") for r in summary.rows)
