"""Every built-in family compiles ahead: what its forward launches is exactly the list of
launches it plans (``harness.kernel.launch``), which ``compile_only`` compiles in the
fleet's compile children on meta tensors. On the CPU: the plan matches the launches
under the interpreter, and builds on meta tensors. On a GPU: a small tuning of each
family, all in one campaign, leaves no first launch to compile in the worker.

(The minGPT block's plans are checked by its own tests, config by config.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from harness.fleet import materialise, skeleton
from harness.kernel import api as kernel_api
from harness.measure.hardware import spec_for_key

ROOT = Path(__file__).resolve().parent.parent

#: (family, config over its default): each path of each family that launches Triton.
PLANS = [
    ("matmul", {}),
    ("grouped_gemm", {}),
    ("grouped_gemm", {"PERSISTENT": 1, "TAIL_SPLIT": 1}),
    ("mamba2_ssd", {}),
    ("mamba2_ssd", {"IMPL": "five", "BLOCK_M": 32, "BLOCK_K": 32}),
    ("mamba2_ssd", {"CARRY": "lookback"}),
    ("mamba2_ssd", {"CARRY": "chained"}),
    ("selective_scan", {}),
    ("selective_scan", {"FUSE_PREAMBLE": 0, "CHUNK_L": 1}),
    ("selective_scan", {"FUSE_PREAMBLE": 1}),
    ("mulsum_bmm", {"IMPL": "triton", "BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 16}),
    ("mulsum_states", {"IMPL": "bmm"}),
    ("rmsnorm", {"BLOCK_SIZE": 256}),
    ("silu_mul", {}),
    ("softplus_clamp", {}),
]


def _signature(fn: Any, grid: Any, args: tuple, meta: dict) -> tuple:
    """What Triton keys a binary on, as far as a test can see: the function, the grid,
    the meta-parameters, and each argument's dtype and shape (a tensor) or value."""
    sig = tuple((str(a.dtype), tuple(a.shape)) if isinstance(a, torch.Tensor) else a
                for a in args)
    return (fn, tuple(grid), tuple(sorted(meta.items())), sig)


@pytest.mark.parametrize(("kernel", "over"), PLANS, ids=lambda v: str(v))
def test_the_plan_is_what_runs(kernel: str, over: dict, monkeypatch) -> None:
    if torch.cuda.is_available():
        pytest.skip("records launches under the interpreter")
    from triton.runtime.interpreter import InterpretedFunction

    fam = kernel_api.get(kernel)
    assert fam.compiles_ahead
    shape = fam.shapes["test"]
    dtype = "fp32" if "fp32" in fam.dtypes else fam.dtypes[0]
    config = {**fam.default_config, **over}
    assert fam.check_config(config, shape, spec_for_key("cpu")) is None
    inputs = fam.make_inputs(shape, dtype, 0, "cpu")
    run, planned = fam._plan(inputs, shape, config)
    launched: list[tuple] = []
    real_run = InterpretedFunction.run

    def record(self: Any, *args: Any, grid: Any, warmup: bool, **kw: Any) -> Any:
        if not warmup:
            launched.append(_signature(self, grid, args, kw))
        return real_run(self, *args, grid=grid, warmup=warmup, **kw)

    monkeypatch.setattr(InterpretedFunction, "run", record)
    out = run()
    assert out is not None
    want = [_signature(lc.fn, lc.grid, lc.args, lc.meta) for lc in planned]
    assert launched == want
    assert bool(planned) == (over.get("IMPL") != "bmm")
    # What a compile child gets: the same launches planned on meta tensors, which
    # compile_only and load_only go over (no-ops under the interpreter).
    meta = materialise(skeleton(inputs))
    _, meta_planned = fam._plan(meta, shape, config)
    assert [_signature(lc.fn, lc.grid, lc.args, lc.meta) for lc in meta_planned] == want
    fam.compile_only(meta, shape, config)
    fam.load_only(inputs, shape, config)


# -- on a GPU -----------------------------------------------------------------------------

#: One small tuning per family: its shape, dtype and a space of a few configs.
TUNINGS: dict[str, tuple[dict, str, dict]] = {
    "matmul": ({"M": 1024, "N": 1024, "K": 1024}, "bf16",
               {"BLOCK_M": [64, 128], "BLOCK_N": [128], "BLOCK_K": [64], "num_warps": [4],
                "num_stages": [3], "GROUP_M": [8]}),
    "grouped_gemm": ({"M": 3072, "N": 1408, "K": 2048, "E": 64}, "bf16",
                     {"BLOCK_M": [64, 128], "BLOCK_N": [128], "BLOCK_K": [64],
                      "GROUP_M": [8], "num_warps": [4], "num_stages": [3],
                      "PERSISTENT": [0, 1], "USE_TMA": [0], "TMA_STORE": [0],
                      "TAIL_SPLIT": [0], "SWAP_AB": [0], "GLUON": [0], "TALL_TILE": [0],
                      "TAIL_DEAL": [0]}),
    "mamba2_ssd": ({"b": 1, "L": 1024, "h": 8, "p": 64, "g": 1, "n": 64}, "bf16",
                   {"IMPL": ["fused", "five"], "CHUNK_SIZE": [64], "STATE_DTYPE": ["fp32"],
                    "PREFETCH_C": [0], "BLOCK_M": [64], "BLOCK_K": [64], "BLOCK_P": [16],
                    "num_warps": [4], "num_stages": [2]}),
    "selective_scan": ({"b": 1, "L": 512, "d": 256, "n": 16}, "fp32",
                       {"BLOCK_D": [16], "CHUNK_L": [1, 8], "STATE_DTYPE": ["fp32"],
                        "FUSE_PREAMBLE": [0, 2], "num_warps": [4]}),
    "mulsum_bmm": ({"b": 2, "c": 1, "l": 64, "s": 64, "h": 4, "n": 64}, "fp32",
                   {"IMPL": ["triton"], "INPUT_PRECISION": ["ieee", "tf32x3"],
                    "BLOCK_M": [64], "BLOCK_N": [64], "BLOCK_K": [32], "num_warps": [4],
                    "num_stages": [2], "CHUNK": [8], "ALLOW_TF32": [0]}),
    "rmsnorm": ({"rows": 1024, "cols": 1024}, "bf16",
                {"BLOCK_SIZE": [512, 1024], "num_warps": [4, 8]}),
    "minigpt_block": ({"B": 2, "T": 512, "C": 768, "H": 8}, "fp32",
                      {"ATTN": ["flash", "fused_softmax"], "QKV_SPLIT": ["fused"],
                       "PRECISION": ["fp32"], "FUSE_GELU": [1], "FUSE_RESIDUAL": [1],
                       "FLASH_SPLIT_D": [0]}),
}


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_a_tuning_of_every_family_compiles_nothing_in_the_worker(tmp_path: Path) -> None:
    """``kharness run`` of a few configs of each family, all in one campaign (one Ray,
    one worker, one compile service: one start-up instead of seven), cold Triton cache:
    every first launch in the worker loads a binary its node's compile service built,
    but the ones the worker may compile itself while the service starts (counted apart)."""
    from tests.fault_kernels import cli_env

    files = []
    for kernel, (shape, dtype, space) in sorted(TUNINGS.items()):
        exp = {
            "name": f"ahead-{kernel}", "kernel": kernel, "shapes": [shape], "dtypes": [dtype],
            "search": {"sampler": "grid", "trials": 8, "warm_start": False,
                       "remeasure_top_k": 0},
            "search_space": {"params": space},
            "timing": {"warmup_ms": 5, "rep_ms": 20},
            "baselines": {"compile": False},
            "tracking": {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
            "output": {"packs_dir": str(tmp_path / "packs"),
                       "runs_dir": str(tmp_path / "runs")},
            "fleet": {"queue_depth": 8, "compile_workers": 2},
        }
        (tmp_path / f"{kernel}.yaml").write_text(yaml.safe_dump(exp))
        files.append(f"{kernel}.yaml")
    env = cli_env(tmp_path / "events")
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # cold: compiles happen
    proc = subprocess.run([sys.executable, "-m", "harness", "run", *files, "--json"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout)
    measured = {e["name"]: sum(r["counts"]["measured"] for r in e["rows"])
                for e in out["experiments"]}
    assert all(n >= 1 for n in measured.values()) and len(measured) == len(TUNINGS), measured
    first = out["first_calls"]
    assert first["watched"] >= 2 * len(TUNINGS), first
    assert first["ahead_missed"] == 0, (first, out["events"])
    assert first["compiled_in_worker"] == 0, (first, out["events"])
    # What the one worker may compile itself while the service starts: its first configs.
    assert first["compiled_here"] <= 3, first


@pytest.mark.gpu
@pytest.mark.parametrize(("kernel", "over"), PLANS, ids=lambda v: str(v))
def test_gpu_compile_only_leaves_the_first_launch_nothing_to_compile(
        kernel: str, over: dict, tmp_path: Path, monkeypatch) -> None:
    """compile_only on meta tensors compiles each planned launch; the first launch on
    real inputs then compiles nothing (a specialisation that differs between meta and
    real inputs would)."""
    from harness.measure.hardware import current_device
    from harness.measure.timing import CompileWatch

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    fam = kernel_api.get(kernel)
    if kernel in TUNINGS:
        shape, dtype, _ = TUNINGS[kernel]
    else:
        shape = next(v for k, v in fam.shapes.items() if k != "test")
        dtype = "bf16" if "bf16" in fam.dtypes else fam.dtypes[0]
    config = {**fam.default_config, **over}
    assert fam.check_config(config, shape, current_device()) is None
    inputs = fam.make_inputs(shape, dtype, 0, "cuda")
    ahead = CompileWatch()
    with ahead:
        fam.compile_only(materialise(skeleton(inputs)), shape, config)
    assert ahead.active
    first = CompileWatch()
    with first:
        fam.launcher(inputs, shape, config)()
        torch.cuda.synchronize()
    assert first.compiled == 0, (config, first.__dict__)
