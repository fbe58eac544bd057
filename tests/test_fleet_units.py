"""The fleet's and the search's logic without a Ray cluster: discovery by hardware key,
placement checks, missing-hardware messages, compile-ahead plumbing, study resume, the
grid sampler under ask/tell, and the fleet settings of experiment files."""

from __future__ import annotations

import itertools
import math
import os
import time
from pathlib import Path

import pytest
import ray
import torch
import yaml
from optuna.trial import TrialState

from harness import experiment
from harness.experiment import ExperimentError, SearchSettings, StudySpec
from harness.fleet import Fleet, NoHardwareError, check_placement, compile_child
from harness.fleet import compile as fleet
from harness.fleet.compile import Precompiler
from harness.measure.hardware import spec_for_key
from harness.measure.timing import Timing, TrialResult
from harness.run.members import device_from_info as _device_from_info
from harness.run.runner import _missing_message
from harness.search import Search, make_storage, storage_url
from tests.fault_kernels import read_events

FAULTY = "tests.fault_kernels:Faulty"


def _node(node_id: str, gpus: int, *names: str, alive: bool = True) -> dict:
    res = {"CPU": 8.0, "memory": 1e9}
    if gpus:
        res["GPU"] = float(gpus)
    for n in names:
        res[f"accelerator_type:{n}"] = 1.0
    return {"NodeID": node_id, "Alive": alive, "Resources": res}


def test_discover_groups_gpus_by_hardware_key(monkeypatch) -> None:
    nodes = [
        _node("h100a", 8, "H100"), _node("h100b", 8, "H100"),
        _node("a100-40", 4, "A100-40G"), _node("a100-80", 8, "A100-80G"),
        # A V710 node declared by hand, next to a name Ray might add of its own.
        _node("v710", 1, "V710", "AMD-Radeon-PRO-V710"),
        _node("head", 0), _node("dead", 8, "H200", alive=False),
        _node("mystery", 2),  # GPUs Ray could not name
    ]
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    f = Fleet(Timing(), 60)
    assert f.discover() == {"H100": 16, "A100": 12, "V710": 1}
    assert f.unlabelled == 2
    assert f.nodes["a100-40"] == "A100" and f.nodes["v710"] == "V710"
    # New A100 workers ask for the Ray name with the most GPUs still free.
    assert f._pick_name("A100") == "A100-80G"
    assert f._options("V710", f._pick_name("V710"))["resources"] == {
        "accelerator_type:V710": 0.001}
    assert f._options("cpu", None) == {"num_cpus": 1, "num_gpus": 0}

    monkeypatch.setattr(ray, "nodes", lambda: [_node("laptop", 0)])
    assert Fleet(Timing(), 60).discover() == {"cpu": 1}
    monkeypatch.setattr(ray, "nodes", lambda: [_node("mystery", 1)])
    f = Fleet(Timing(), 60)
    assert f.discover() == {} and f.unlabelled == 1


def test_check_placement_names_the_wrong_resource() -> None:
    info = {"interpreted": False, "device_key": "H100", "device_name": "NVIDIA H100 80GB HBM3"}
    check_placement("H100", "H100", info)  # right GPU
    check_placement("V710", "V710", {**info, "interpreted": True})  # simulated: no GPU seen
    with pytest.raises(NoHardwareError) as err:
        check_placement("V710", "V710", info)
    msg = str(err.value)
    assert "accelerator_type:V710" in msg and "'NVIDIA H100 80GB HBM3'" in msg
    assert "ray start" in msg and '"accelerator_type:V710": 1' in msg


def test_missing_hardware_messages() -> None:
    msg = _missing_message("V710", {"H100": 8}, 0, 0)
    assert msg.startswith("hardware V710: no V710 GPUs in this cluster (found: H100×8)")
    assert "fleet.wait_for_nodes_s" in msg and "accelerator_type:V710" in msg
    assert msg.endswith("its studies are skipped")
    msg = _missing_message("A100", {}, 2, 30)
    assert "found: no GPUs" in msg and "after waiting 30 s for the autoscaler" in msg
    assert "2 GPU(s) advertise no accelerator_type" in msg


def test_device_of_a_study() -> None:
    base = {"vendor": "cpu", "device_name": "cpu", "sm_count": 4, "smem_per_block": 1 << 30,
            "has_tma": False, "interpreted": True}
    # A simulated V710 node: the worker runs the interpreter, the study prunes and picks
    # its space as for a V710 (AMD).
    dev = _device_from_info({**base, "worker_hardware": "V710"}, spec_for_key("V710"))
    assert dev.vendor == "amd" and dev.key == "V710" and dev.interpreted
    assert dev.smem_per_block == spec_for_key("V710").smem_per_block
    assert _device_from_info({**base, "worker_hardware": "H100"},
                             spec_for_key("H100")).vendor == "nvidia"
    assert _device_from_info({**base, "worker_hardware": "cpu"},
                             spec_for_key("cpu")).vendor == "cpu"
    real = {**base, "worker_hardware": "H200", "vendor": "nvidia", "device_name": "NVIDIA H200",
            "sm_count": 132, "smem_per_block": 232448, "has_tma": True, "interpreted": False}
    dev = _device_from_info(real, spec_for_key("H200"))
    assert (dev.name, dev.sm_count, dev.interpreted) == ("NVIDIA H200", 132, False)


def test_grouped_gemm_drops_amd_launch_options_off_rocm() -> None:
    import kernels.grouped_gemm as gg

    k = gg.GroupedGemm()
    shape = {"M": 64, "N": 64, "K": 64, "E": 2}
    inputs = k.make_inputs(shape, "fp16", 0, "cpu")
    amd = {"waves_per_eu": 2, "kpack": 2, "matrix_instr_nonkdim": 16}
    (launch,), _ = k._launches(inputs, {**k.default_config, **amd})
    assert not set(amd) & set(launch.meta)  # CPU (and CUDA): never passed
    assert launch.meta["num_warps"] == k.default_config["num_warps"]


def test_skeleton_round_trip() -> None:
    inputs = {"a": torch.randn(4, 6)[:, :3], "meta": [1, 2], "pair": (torch.ones(2), 5)}
    skel = compile_child.skeleton(inputs)
    assert isinstance(skel["a"], compile_child.TensorSpec) and skel["meta"] == [1, 2]
    again = compile_child.materialise(skel)  # meta: the layout without memory
    assert again["a"].device.type == "meta" and again["a"].dtype == torch.float32
    assert again["a"].shape == (4, 3) and again["a"].stride() == (6, 1)
    assert again["pair"][0].dtype == torch.float32 and again["pair"][1] == 5
    assert compile_child.materialise(skel, "cpu")["a"].device.type == "cpu"


@pytest.mark.slow
def test_precompiler_compiles_in_a_child_process(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("FAULT_DIR", str(tmp_path))
    from tests.fault_kernels import Faulty

    shape = {"N": 64}
    skel = compile_child.skeleton(Faulty().make_inputs(shape, "fp32", 0, "cpu"))
    pre = Precompiler(1)
    try:
        configs = [{"FAULT": "none", "SLEEP_MS": s} for s in (1, 2)]
        pre.submit("p", FAULTY, shape, skel, configs)
        pre.submit("p", FAULTY, shape, skel, configs)  # already under way: not again
        for c in configs:
            out = pre.wait("p", c, timeout_s=120)
            assert out["ok"] and out["pid"] != os.getpid()
        assert pre.wait("p", configs[0]) is None  # collected once
        assert pre.wait("q", configs[0]) is None  # never submitted
        # A compile that raises is reported, not fatal (the trial compiles for itself).
        pre.submit("p", "no.such.module:Kernel", shape, skel, [configs[0]])
        out = pre.wait("p", configs[0], timeout_s=120)
        assert not out["ok"] and "ModuleNotFoundError" in out["reason"]
        # The children run below this process's priority (each reports os.nice(0)).
        children = pre.children()
        assert len(children) == 1 and children[0]["pid"] == out["pid"]
        assert children[0]["nice"] == min(19, os.nice(0) + compile_child.COMPILE_NICE)
    finally:
        pre.close()
    compiled = [e for e in read_events(tmp_path) if e["event"] == "compile"]
    assert sorted(e["config"]["SLEEP_MS"] for e in compiled) == [1, 2]


# -- the search ---------------------------------------------------------------------------


def _search(tmp_path: Path, sampler: str = "grid", trials: int = 50) -> Search:
    spec = StudySpec("exp", FAULTY, {"N": 64}, "fp32", "cpu")
    space = {"FAULT": ["none"], "SLEEP_MS": [1, 2, 3], "BLOCK": [128]}
    settings = SearchSettings(sampler=sampler, trials=trials, warm_start=False)
    storage = make_storage(storage_url(tmp_path, "exp"))
    return Search(spec, space, spec_for_key("cpu"), settings, storage, 0, n_parallel=1)


def _ok(ms: float) -> TrialResult:
    return TrialResult(ok=True, latency_ms=ms)


def test_storage_is_sqlite_in_wal_mode(tmp_path: Path) -> None:
    storage = make_storage(storage_url(tmp_path, "exp"))
    with storage.engine.connect() as con:
        assert con.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"


def test_grid_sampler_runs_out_without_raising(tmp_path: Path) -> None:
    s = _search(tmp_path)
    seen = []
    while (asked := s.ask()) is not None:
        trial, config = asked
        seen.append(config["SLEEP_MS"])
        s.tell(trial, config, _ok(float(config["SLEEP_MS"])))  # the last tell used to raise
    assert sorted(seen) == [1, 2, 3] and s.counts()["measured"] == 3


def test_resume_finishes_or_requeues_what_a_killed_driver_left(tmp_path: Path) -> None:
    s = _search(tmp_path)
    t0, c0 = s.ask()
    s.tell(t0, c0, _ok(5.0))
    # Left running with its result stored (killed just before the tell) ...
    t1, c1 = s.ask()
    t1.set_user_attr("status", "measured")
    t1.set_user_attr("result", _ok(4.0).to_dict() | {"latency_ms": 4.0})
    # ... and left running with no result (killed mid-measurement).
    t2, c2 = s.ask()
    s2 = _search(tmp_path)  # the resumed driver
    assert s2.recovered == [t1.number]
    assert s2.interrupted == [c2]
    trials = {t.number: t for t in s2.study.trials}
    assert trials[t1.number].state == TrialState.COMPLETE and trials[t1.number].value == 4.0
    assert trials[t2.number].state == TrialState.FAIL
    assert trials[t2.number].user_attrs["status"] == "interrupted"
    assert s2.measured == 2 and s2.counts()["measured"] == 2
    # The interrupted config comes back first, and nothing finished is asked again.
    t3, c3 = s2.ask()
    assert c3 == c2
    s2.tell(t3, c3, _ok(3.0))
    assert s2.ask() is None
    assert s2.best()[0] == c3


def test_fleet_settings_in_experiment_files(tmp_path: Path) -> None:
    base = {"name": "x", "kernel": "matmul", "shapes": [{"M": 64, "N": 64, "K": 64}]}
    path = tmp_path / "e.yaml"
    path.write_text(yaml.safe_dump(base))
    fs = experiment.load(path).fleet
    assert (fs.wait_for_nodes_s, fs.queue_depth, fs.compile_workers, fs.max_retries) == (
        0.0, "auto", "auto", 2)
    path.write_text(yaml.safe_dump({**base, "fleet": {"wait_for_nodes_s": 600,
                                                      "queue_depth": 8}}))
    fs = experiment.load(path).fleet
    assert fs.wait_for_nodes_s == 600 and fs.queue_depth == 8
    for bad, field in (({"queue_depth": 0}, "fleet.queue_depth"),
                       ({"compile_workers": "many"}, "fleet.compile_workers"),
                       ({"wait_for_nodes_s": -1}, "fleet.wait_for_nodes_s"),
                       ({"wait_for_node": 5}, "fleet.wait_for_node")):
        path.write_text(yaml.safe_dump({**base, "fleet": bad}))
        with pytest.raises(ExperimentError) as err:
            experiment.load(path)
        assert err.value.field == field


def test_shipped_grid_config_is_valid() -> None:
    root = Path(__file__).resolve().parent.parent
    exp = experiment.load(root / "configs" / "matmul_grid216.yaml")
    assert exp.kernel == "matmul" and exp.search.sampler == "grid"
    assert exp.search.trials >= 216 and exp.shapes == [{"M": 8192, "N": 8192, "K": 8192}]
    assert exp.fleet.compile_workers > 0 and exp.fleet.queue_depth > 2
    assert not math.isnan(exp.timing.rep_ms)


def test_tasks_of_a_group_stay_on_one_worker() -> None:
    """A study's re-measurements form a group: they all go to the worker the group first
    got (even when another is emptier), wait while it is full, follow it when it is
    replaced in place, and move only if it leaves the fleet."""
    from harness.fleet.slots import Task, _Slot

    fl = Fleet(Timing(), 10, queue_depth=2)
    a, b = (_Slot("H100", None, None, 0.0, ready_at=1.0) for _ in range(2))
    fl.slots = [a, b]
    b.queue.append((Task("H100", "measure", (), "x"), None))  # b busier: the group takes a
    g = [Task("H100", "measure", (), i, group="remeasure s") for i in range(4)]
    assert fl._pick(g[0]) is a
    a.queue.append((g[0], None))
    b.queue.clear()  # b is now empty, yet the group stays on a
    assert fl._pick(g[1]) is a
    a.queue.append((g[1], None))
    assert fl._pick(g[2]) is None  # a is full: wait for it
    assert fl._pick(Task("H100", "measure", (), "free")) is b  # others go anywhere
    a.ready_at = None  # a's worker is being replaced in place: wait for it too
    a.queue.clear()
    assert fl._pick(g[2]) is None
    a.ready_at = 2.0
    assert fl._pick(g[2]) is a
    fl.slots = [b]  # a dropped from the fleet: the group moves
    assert fl._pick(g[3]) is b and fl._pick(g[3]) is b


def test_a_new_worker_is_given_an_exhaustive_grid_to_compile(tmp_path: Path,
                                                            monkeypatch) -> None:
    """An exhaustive grid's configs are known before its search: the first study hands
    every one that passes static pruning (on the key's static spec) to a new worker to
    compile while it starts, after the default; a sampled space gives the default only."""
    from harness.kernel import api as kernel_api
    from harness.run.schedule import known_configs as _known_configs
    from harness.search import spaces

    path = Path(__file__).resolve().parents[1] / "configs" / "matmul_grid216.yaml"
    packs = tmp_path / "packs"
    exp = experiment.load(path, [f"output.packs_dir={packs}"])
    def study(exp: experiment.Experiment) -> experiment.StudyPlan:
        return experiment.ExperimentPlan.checked(path, exp).for_hardware(["H200"]).studies[0]

    spec = study(exp).spec
    fam = kernel_api.get("matmul")
    known = _known_configs(study(exp))
    assert known[0] == fam.default_config
    space = spaces.resolve([spaces.for_kernel(fam), exp.search_space], "nvidia", "H200")
    grid = [dict(zip(space, values, strict=True))
            for values in itertools.product(*space.values())]
    assert len(grid) == spaces.grid_size(space) == 360  # with decode tiles (M <= 64 only)
    ok = [c for c in grid if fam.check_config({**fam.default_config, **c}, spec.shape,
                                               spec_for_key("H200")) is None]
    # The same configs, in the order the study asks for them:
    def keys(configs: list) -> list:
        return sorted(str(sorted(c.items())) for c in configs)

    assert keys(known[1:]) == keys(ok) and 0 < len(ok) < 216
    storage = make_storage(storage_url(tmp_path, "order"))
    search = Search(spec, space, spec_for_key("H200"), exp.search, storage, exp.seed, 1)
    asked = []
    while len(asked) < 20:
        trial, config = search.ask()
        asked.append(config)
        search.tell(trial, config, TrialResult(ok=True, latency_ms=1.0))
    assert asked == known[1:21]
    # TPE: the default, then its 8 random start-up draws, as a TPE study asks them.
    exp2 = experiment.load(path, [f"output.packs_dir={packs}", "search.sampler=tpe"])
    tpe_known = _known_configs(study(exp2))
    assert tpe_known[0] == known[0] and len(tpe_known) == 9
    search = Search(spec, space, spec_for_key("H200"), exp2.search,
                    make_storage(storage_url(tmp_path, "tpe")), exp2.seed, 1)
    asked = []
    for _ in range(8):
        trial, config = search.ask()
        asked.append(config)
        search.tell(trial, config, TrialResult(ok=True, latency_ms=1.0 + len(asked)))
    assert asked == tpe_known[1:]
    # A grid's budget below its size: its first configs in the grid's order.
    exp2 = experiment.load(path, [f"output.packs_dir={packs}", "search.trials=100"])
    assert _known_configs(study(exp2)) == known[:101]
    # A pack's winner for this shape is enqueued first by the search: compiled first too.
    from harness.packs import format as packfmt

    seed = {**known[7]}
    packfmt.freeze(packs, "H200", "matmul", "bf16", {fam.shape_key(spec.shape): {
        "config": {**fam.default_config, **seed}, "metrics": {"latency_ms": 1.0},
        "provenance": {}}})
    with_seed = _known_configs(study(exp))
    assert with_seed[1] == {k: seed[k] for k in space} and len(with_seed) == len(known) + 1
    # A large grid: its first configs in the order they will be asked, up to the cap.
    import harness.run.schedule as hschedule

    monkeypatch.setattr(hschedule, "MAX_KNOWN", 12)
    capped = _known_configs(study(exp))
    assert len(capped) == 12 and capped[2:] == known[1:11]


@pytest.mark.slow
def test_the_node_compile_service_compiles_a_config_once_and_its_twins_after_it(
        tmp_path: Path, monkeypatch) -> None:
    """One service per node: a config asked for twice (two GPUs) compiles once; the same
    config at another shape (often the same binary) starts only once the first is done."""
    from harness.fleet.compile import problem_key
    from harness.fleet.compile_child import skeleton
    from harness.fleet.compile_service import _Service
    from tests.fault_kernels import Faulty

    monkeypatch.setenv("FAULT_DIR", str(tmp_path))
    monkeypatch.setenv("HARNESS_PRECOMPILE", "force")
    svc = _Service(2)
    try:
        cfg = {**Faulty.default_config, "COMPILE_MS": 300}
        keys = []
        for n in (256, 512):
            shape = {"N": n}
            problem = problem_key(FAULTY, shape, "fp32", 0)
            skel = skeleton(Faulty().make_inputs(shape, "fp32", 0, "cpu"))
            for _ in range(2):  # two workers of the node ask for it
                svc.submit(problem, FAULTY, shape, skel, [cfg])
            keys.append((problem, fleet.config_key(cfg)))
        got: dict = {}
        deadline = time.monotonic() + 120
        while len(got) < 2 and time.monotonic() < deadline:
            got.update(svc.wait_any(keys, 5.0))
        assert all(got[k]["ok"] for k in keys), got
        info = svc.info()
        assert info["requested"] == 4 and info["deduplicated"] == 2 and info["parked"] == 1
    finally:
        svc.close()
    compiles = [e for e in read_events(tmp_path) if e["event"] == "compile"]
    assert sorted(e["N"] for e in compiles) == [256, 512]  # once per shape, not per ask
    first, second = sorted(compiles, key=lambda e: e["t"])
    assert first["N"] == 256 and second["t"] - first["t"] >= 0.3  # after the first's


def test_a_pattern_study_hands_its_first_asks_to_compile(tmp_path: Path) -> None:
    """The pattern walk's first asks depend on its seed alone until a result arrives: a
    new worker is given the default and those asks to compile, and a study on four GPUs
    (asks ahead of results) asks exactly them."""
    from harness.kernel import api as kernel_api
    from harness.run.schedule import known_configs as _known_configs
    from harness.search import spaces

    path = Path(__file__).resolve().parents[1] / "configs" / "matmul_grid216.yaml"
    exp = experiment.load(path, [f"output.packs_dir={tmp_path / 'packs'}",
                                 "search.sampler=pattern", "search.trials=10",
                                 "search.warm_start=true"])
    study = experiment.ExperimentPlan.checked(path, exp).for_hardware(["H200"]).studies[0]
    fam = kernel_api.get("matmul")
    known = _known_configs(study)
    assert known[0] == fam.default_config and len(known) == 11
    space = spaces.resolve([spaces.for_kernel(fam), exp.search_space], "nvidia", "H200")
    search = Search(study.spec, space, spec_for_key("H200"), exp.search,
                    make_storage(storage_url(tmp_path, "pattern")), exp.seed, 4)
    asked = []
    while (got := search.ask()) is not None:  # nothing told yet: the study's 10 trials
        asked.append(got[1])
    assert len(asked) == 10
    assert asked[0] == {k: fam.default_config[k] for k in space}  # enqueued, not asked
    assert asked[1:] == known[1:10]


def test_a_ready_worker_is_told_the_coming_studies_first_configs() -> None:
    """Each study not begun yet: a grid's whole order (what it measures whatever the
    results), a pattern walk's default and first asks only (past them it follows the
    measurements); a begun study, none (its configs go as it asks)."""
    from types import SimpleNamespace

    from harness.run import schedule

    def studies(strategy: str) -> list:
        exp = experiment.Experiment(
            name=strategy, kernel="matmul", hardware=["H100"],
            shapes=[{"M": 256, "N": 256, "K": 256}, {"M": 512, "N": 256, "K": 256}],
            search={"strategy": strategy, "trials": 30})
        plans = experiment.ExperimentPlan.checked("x.yaml", exp).for_hardware(["H100"]).studies
        return exp, [schedule.StudyState(p, SimpleNamespace(measured=0), "r", {})
                     for p in plans]

    told: list = []
    fleet = SimpleNamespace(depth=lambda hw: 2,
                            hint=lambda to, kernel, shape, dtype, seed, configs:
                            told.append((to, shape["M"], len(configs))))
    (grid, (g1, g2)), (pattern, (p1, p2)) = studies("grid"), studies("pattern")
    g1.search.measured = 3  # begun
    sched = schedule.Scheduler([grid, pattern], fleet, [g1, g2, p1, p2],
                               on_result=lambda t, r: None)
    sched._hint(7, "H100")
    assert told == [(7, 512, 31), (7, 256, 3), (7, 512, 3)], told
    assert len(schedule.known_configs(p1.plan)) == 31  # the walk's guesses, not sent
