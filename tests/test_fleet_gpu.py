"""The fleet on a real GPU (run on the device; skipped elsewhere): a real illegal memory
access poisons the CUDA context, the worker is replaced and the study goes on; a real
compile error; compiling ahead in child processes; and a campaign of two experiments."""

from __future__ import annotations

import io
import logging
import multiprocessing
import os
import time
from pathlib import Path

import optuna
import pytest
import ray
import torch
import yaml
from rich.console import Console

from harness.fleet import Fleet, Task, materialise, skeleton
from harness.measure.timing import Timing
from harness.run.runner import run
from kernels.grouped_gemm import GroupedGemm

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
FAULTY = "tests.fault_kernels:Faulty"


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    cache = tmp_path_factory.mktemp("triton-cache")  # cold: compiles really happen
    ray.init(logging_level=logging.WARNING, log_to_driver=False, include_dashboard=False,
             runtime_env={"env_vars": {
                 # Keep the caller's PYTHONPATH: on the device it carries ray/optuna/mlflow.
                 "PYTHONPATH": os.pathsep.join(
                     p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
                 "TRITON_CACHE_DIR": str(cache)}})
    try:
        yield
    finally:
        ray.shutdown()


def _wait(fleet: Fleet, n: int, timeout_s: float = 300) -> dict:
    out = {}
    deadline = time.monotonic() + timeout_s
    while len(out) < n:
        assert time.monotonic() < deadline, out
        for task, result in fleet.poll(1.0):
            out[task.tag] = result
    return out


def test_illegal_address_replaces_the_worker_and_queued_work_runs_elsewhere(local_ray) -> None:
    fleet = Fleet(Timing(warmup_ms=5, rep_ms=20), 120, queue_depth=2, compile_workers=0)
    try:
        key = next(iter(fleet.discover()))
        assert key != "cpu"
        fleet.start({key: 1})
        first_pid = fleet.slots[0].info["pid"]
        shape = {"N": 1 << 20}
        # The second task is queued on the same worker behind the faulting one: it must
        # not run on the poisoned context, but on the replacement.
        fleet.submit(Task(key, "measure", (FAULTY, shape, "fp32", {"FAULT": "illegal"}, 0),
                          "bad"))
        fleet.submit(Task(key, "measure", (FAULTY, shape, "fp32", {"FAULT": "none"}, 0),
                          "good"))
        res = _wait(fleet, 2)
        bad, good = res["bad"], res["good"]
        assert not bad.ok and bad.fatal, bad.reason
        assert bad.reason.startswith("device fault:") and "illegal" in bad.reason.lower()
        assert "worker replaced" in bad.reason
        assert good.ok, good.reason
        assert good.extra["pid"] != first_pid
        assert fleet.replaced == 1
    finally:
        fleet.shutdown()


def test_every_fault_through_the_harness(local_ray, tmp_path: Path) -> None:
    faults = ["none", "compile", "oor", "illegal", "hang", "wrong", "nan"]
    exp = {
        "name": "gpufaults", "kernel": FAULTY, "shapes": [{"N": 1 << 20}], "dtypes": ["fp32"],
        "search": {"sampler": "grid", "trials": 20},
        "search_space": {"params": {"FAULT": faults}},
        "timing": {"warmup_ms": 5, "rep_ms": 20, "trial_timeout_s": 30},
        "tracking": {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
        "output": {"packs_dir": str(tmp_path / "packs"), "runs_dir": str(tmp_path / "runs")},
        "fleet": {"compile_workers": 0},
    }
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(exp))
    summary = run(path, console=Console(file=io.StringIO()), progress=False)
    (row,) = summary.rows
    study = optuna.load_study(study_name=f"gpufaults/{FAULTY}/N=1048576/fp32/{row['hardware']}",
                              storage=f"sqlite:///{tmp_path / 'runs' / 'gpufaults' / 'optuna.db'}")
    final = {t.params["FAULT"]: t.user_attrs for t in study.trials
             if t.user_attrs.get("status") in ("measured", "failed")}
    assert sorted(final) == sorted(faults)
    assert final["none"]["status"] == "measured"
    # A real Triton compile error (arange of 3), with Triton's message.
    assert final["compile"]["reason"].startswith("compile error:")
    assert "power of 2" in final["compile"]["reason"]
    assert final["oor"]["reason"].startswith("out of resources")
    assert final["illegal"]["reason"].startswith("device fault:")
    assert final["hang"]["reason"].startswith("timeout:")
    assert final["wrong"]["reason"].startswith("wrong result:")
    assert "NaN/Inf" in final["nan"]["reason"]
    assert summary.replaced == 2
    assert row["config"]["FAULT"] == "none"


def test_a_campaign_of_two_zoo_experiments_on_the_gpu(local_ray, tmp_path: Path) -> None:
    """Two shipped experiments as one campaign on the GPU: one fleet, their Optuna
    writers and MLflow loggers in processes of their own (several at once), each
    experiment's own pack, run folder and MLflow parent run."""
    from harness.run.campaign import run_campaign

    paths = [ROOT / "configs" / "zoo" / "silu.yaml", ROOT / "configs" / "zoo" / "rmsnorm.yaml"]
    overrides = ["search.trials=6", "search.timeout_s=60",
                 f"output.packs_dir={tmp_path / 'packs'}", f"output.runs_dir={tmp_path / 'runs'}",
                 f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"]
    result = run_campaign(paths, console=Console(file=io.StringIO()), progress=False,
                          overrides=overrides)
    assert not result.fleet.interpreted and len(result.experiments) == 2
    hw = {w["hardware"] for w in result.fleet.fleet["workers"]}
    assert len(result.fleet.fleet["workers"]) == torch.cuda.device_count() and len(hw) == 1
    ids = set()
    for entry in result.experiments:
        s = entry.summary
        assert not entry.skipped and s.rows and all(r["counts"]["measured"] > 0 for r in s.rows)
        assert len(s.packs) == 1 and Path(s.packs[0]).is_file()
        assert (tmp_path / "runs" / entry.name / "optuna.db").is_file()
        ids.add(s.parent_run_id)
    assert len(ids) == 2


def test_compile_ahead_makes_first_launches_cheap(local_ray, tmp_path: Path) -> None:
    exp = {
        "name": "ahead", "kernel": "matmul", "shapes": [{"M": 4096, "N": 4096, "K": 4096}],
        "dtypes": ["bf16"], "search": {"sampler": "grid", "trials": 12, "warm_start": False},
        "search_space": {"params": {"BLOCK_M": [64, 128], "BLOCK_N": [128], "BLOCK_K": [64],
                                    "num_warps": [4, 8], "num_stages": [3, 4, 5],
                                    "GROUP_M": [8]}},
        "timing": {"warmup_ms": 10, "rep_ms": 40},
        "tracking": {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
        "output": {"packs_dir": str(tmp_path / "packs"), "runs_dir": str(tmp_path / "runs")},
        "fleet": {"queue_depth": 12, "compile_workers": 4},
    }
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(exp))
    summary = run(path, console=Console(file=io.StringIO()), progress=False)
    (row,) = summary.rows
    study = optuna.load_study(study_name=f"ahead/matmul/M=4096,N=4096,K=4096/bf16/"
                              f"{row['hardware']}",
                              storage=f"sqlite:///{tmp_path / 'runs' / 'ahead' / 'optuna.db'}")
    results = [t.user_attrs["result"] for t in study.trials
               if t.user_attrs.get("status") == "measured"]
    assert len(results) == 12
    ahead = [r for r in results if (r["extra"].get("precompile") or {}).get("ok")]
    assert len(ahead) >= 10, [r["extra"].get("precompile") for r in results]
    # The worker's first launch only loaded what a child compiled.
    cheap = [r for r in ahead if r["compile_s"] < 0.5 * r["extra"]["precompile"]["compile_s"]]
    assert len(cheap) >= 0.8 * len(ahead), [(r["compile_s"], r["extra"]["precompile"])
                                            for r in ahead]
    assert 0 < summary.timing_fraction <= 1


def _grouped_child(cache: str, shape: dict, config: dict) -> None:
    os.environ["TRITON_CACHE_DIR"] = cache
    from kernels.grouped_gemm import GroupedGemm

    k = GroupedGemm()
    k.compile_only(materialise(skeleton(k.make_inputs(shape, "bf16", 0, "cpu"))), shape, config)


@pytest.mark.parametrize("persistent", [0, 1])
def test_grouped_gemm_compile_only_fills_the_cache(tmp_path: Path, monkeypatch,
                                                   persistent: int) -> None:
    from kernels.grouped_gemm import GroupedGemm

    cache = tmp_path / "triton-cache"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    shape = {"M": 8192, "N": 1408, "K": 2048, "E": 64}
    config = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8,
              "num_stages": 4, "PERSISTENT": persistent}
    p = multiprocessing.get_context("spawn").Process(
        target=_grouped_child, args=(str(cache), shape, config))
    p.start()
    p.join(300)
    assert p.exitcode == 0
    before = sorted(x.name for x in cache.iterdir())
    assert before
    k = GroupedGemm()
    inputs = k.make_inputs(shape, "bf16", 0, "cuda")
    out = k.launcher(inputs, shape, config)()
    torch.testing.assert_close(out.float(), k.reference(inputs, shape), atol=2e-2, rtol=2e-2)
    # Loaded, not compiled again: the first launch may add Triton's C launcher stub for
    # the signature (a .so), never a kernel binary.
    added = [x for x in cache.iterdir() if x.name not in before]
    assert not [f.name for d in added for f in d.iterdir() if f.suffix in (".cubin", ".ptx")]


def test_compile_ahead_survives_a_torch_compile_baseline(tmp_path: Path) -> None:
    """torch.compile (Inductor) points TRITON_CACHE_DIR at a directory of its own when the
    variable is unset. The worker pins it before its compile children start, so the
    trials measured after the torch.compile baseline still load what the children built
    (before the fix every grouped-GEMM first launch compiled again: 0.3-1.5 s each)."""
    import json
    import subprocess
    import sys

    from tests.fault_kernels import cli_env

    exp = {
        "name": "ahead-compiled", "kernel": "grouped_gemm",
        "shapes": [{"M": 3072, "N": 1408, "K": 2048, "E": 64}], "dtypes": ["bf16"],
        "search": {"sampler": "grid", "trials": 8, "warm_start": False,
                   "remeasure_top_k": 0},
        # The 8 pointer-kernel configs and nothing else: every other tunable pinned at
        # the kernel's default.
        "search_space": {"params": {**{k: [v] for k, v in GroupedGemm.default_config.items()},
                                    "BLOCK_M": [64, 128], "BLOCK_N": [128], "BLOCK_K": [64],
                                    "GROUP_M": [1, 8], "num_warps": [4, 8], "num_stages": [3],
                                    "PERSISTENT": [0], "USE_TMA": [0]}},
        "timing": {"warmup_ms": 5, "rep_ms": 20},
        "baselines": {"compile": True},
        "tracking": {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
        "output": {"packs_dir": str(tmp_path / "packs"), "runs_dir": str(tmp_path / "runs")},
        "fleet": {"queue_depth": 8, "compile_workers": 4},
    }
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(exp))
    env = cli_env(tmp_path / "events")
    env.pop("TRITON_CACHE_DIR", None)  # Triton's default: under TRITON_HOME, fresh here
    env["TRITON_HOME"] = str(tmp_path / "home")
    proc = subprocess.run([sys.executable, "-m", "harness", "run", "exp.yaml", "--json"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout, parse_constant=lambda c: pytest.fail(f"{c} in --json output"))
    (row,) = out["rows"]
    assert row["compile_latency_ms"] is not None  # the torch.compile baseline did run
    # ... in the worker's own torch.compile process: the worker never imported Inductor.
    assert row["compile_timed_in"] == "compiled-baseline process", row
    assert all("inductor_import_s" not in (w.get("first_task") or {})
               for w in out["workers"]), out["workers"]
    assert all(w["compiled_baseline"]["measured"] >= 1 for w in out["workers"])
    assert out["first_calls"]["watched"] >= 8  # the trials and the default config
    assert out["first_calls"]["ahead_missed"] == 0, out["first_calls"]
    assert out["first_calls"]["compiled_in_worker"] == 0, out["first_calls"]
    assert (tmp_path / "home" / ".triton" / "cache").is_dir()


def test_compile_children_warm_up_with_a_real_compile(tmp_path: Path, monkeypatch) -> None:
    """A compile child's warm-up builds a small tl.dot kernel for this GPU (on meta
    tensors: nothing launched), so its first real config does not pay for loading
    Triton's backend."""
    from harness.measure import compile_warmup as _compile_warmup

    cache = tmp_path / "triton-cache"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    _compile_warmup.compile_once()
    assert [f for f in cache.rglob("*") if f.suffix in (".cubin", ".hsaco")]


def test_a_kernel_written_outside_the_package_tunes_on_the_gpu(tmp_path: Path) -> None:
    """A user's own kernel, the row-wise softmax of Triton's tutorial (BLOCK_R rows per
    program, the row in registers; benchmarks/outside/mymod.py), copied into an empty
    directory and tuned from there as a user runs it (`python -m harness run`, the
    module found in the working directory). Its 40-config grid holds configs that spill
    registers and compile for minutes: they fail their trials as compile time-outs, the
    others are measured and checked against the reference, the winner is frozen and
    served by the runtime lookup, and the run ends in bounded time: nothing waits until
    a time-out that no failure explains."""
    import json
    import shutil
    import subprocess
    import sys

    from harness import packs
    from tests.fault_kernels import cli_env

    shutil.copy(ROOT / "benchmarks" / "outside" / "mymod.py", tmp_path / "mymod.py")
    exp = yaml.safe_load((ROOT / "benchmarks" / "outside" / "softmax.yaml").read_text())
    exp["fleet"] = {"compile_timeout_s": 20}
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(exp))
    env = cli_env(tmp_path / "events")
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # cold: every config compiles
    env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "harness", "run", "exp.yaml", "--json"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    wall = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout, parse_constant=lambda c: pytest.fail(f"{c} in --json output"))
    assert len(out["rows"]) == 2
    import importlib.util

    spec = importlib.util.spec_from_file_location("mymod", tmp_path / "mymod.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    softmax = mod.Softmax()
    for row in out["rows"]:
        c = row["counts"]
        assert c["measured"] + c["failed"] + c["pruned"] == 40, c
        assert c["measured"] >= 20, row
        for reason in row["failures"]:
            assert reason.startswith("compile time-out"), reason
        tol = 1e-4 if row["dtype"] == "fp32" else 2e-2
        assert row["max_abs_err"] <= tol + tol, row
        assert row["latency_ms"] > 0 and row["speedup_vs_eager"] > 0
        shape = dict(part.split("=") for part in row["shape"].split(","))
        packs.configure([tmp_path / "packs"])
        try:
            got = packs.lookup(softmax, dtype=row["dtype"], hardware_key=row["hardware"],
                               **{k: int(v) for k, v in shape.items()})
        finally:
            packs.configure(None)
        assert {k: got[k] for k in row["params"]} == row["params"]
    assert out["workers_replaced"] == 0 and out["trials_retried"] == 0
    # 20 s of compile time-out bounds the slowest config; everything else is work.
    assert wall < 240, (wall, out["timeline_s"])
