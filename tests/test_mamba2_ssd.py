"""Mamba-2 chunked SSD: the reference against an fp64 recurrence, both IMPLs, every carry
of the fused one and every tunable choice against the reference (CPU interpreter, tiny
shapes), the look-back protocol's aggregates and its bounded wait, GPU checks at 4K and 16K."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.kernel.api import DeviceSpec
from kernels.mamba2_ssd import _TL_DTYPES, Mamba2SSD, ssd_minimal, ssd_recurrent
from kernels.mamba2_ssd.lookback import LookbackLaunch

KERNEL = Mamba2SSD()
CPU = DeviceSpec(key="cpu", vendor="cpu", interpreted=True)
H100 = DeviceSpec(
    key="H100", vendor="nvidia", sm_count=132, smem_per_block=227 * 1024, has_tma=True
)

SMALL = {"b": 1, "L": 128, "h": 2, "p": 16, "g": 1, "n": 16}
# L not a multiple of any chunk, p and n not powers of two, two p tiles at BLOCK_P=16,
# two groups.
RAGGED = {"b": 2, "L": 150, "h": 4, "p": 24, "g": 2, "n": 20}
L256 = {"b": 1, "L": 256, "h": 2, "p": 16, "g": 1, "n": 16}
NAMES = ("x", "dt", "A", "B", "C", "D")


def _run(shape, dtype, config, device, seed=0, inputs=None):
    inputs = inputs or KERNEL.make_inputs(shape, dtype, seed, device)
    assert KERNEL.check_config(config, shape, CPU if device == "cpu" else H100) is None
    ref = KERNEL.reference(inputs, shape)
    out = KERNEL.launcher(inputs, shape, config)()
    assert out.shape == ref.shape and out.dtype == inputs["x"].dtype
    assert torch.isfinite(out).all()
    tol = KERNEL.tolerance(dtype, config)
    torch.testing.assert_close(out.float(), ref, atol=tol.atol, rtol=tol.rtol)
    return out, ref


def test_reference_matches_fp64_recurrence():
    shape = {"b": 2, "L": 100, "h": 4, "p": 8, "g": 2, "n": 8}
    inp = KERNEL.make_inputs(shape, "fp32", 0, "cpu")
    rec = ssd_recurrent(*(inp[k] for k in NAMES))
    ref = KERNEL.reference(inp, shape)
    assert rec.abs().max() > 1.0  # a real signal, not decayed to nothing
    torch.testing.assert_close(ref.double(), rec, atol=1e-5, rtol=1e-5)
    # The chunk length of the minimal SSD is immaterial, and eager (fp32) is the same.
    for chunk in (16, 32):
        y = ssd_minimal(*(inp[k].double() for k in NAMES), chunk=chunk)
        torch.testing.assert_close(y, rec, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(KERNEL.eager(inp, shape), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("state", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("impl", ["fused", "five"])
def test_impl_state_dtype(impl, state, device):
    # fp16 inputs: fp32 inputs require fp32 accuracy, which a 16-bit state does not give.
    _run(SMALL, "fp16", {"IMPL": impl, "STATE_DTYPE": state, "BLOCK_P": 16}, device)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["fused", "five"])
def test_ragged_length_and_odd_dims(impl, device):
    cfg = {"IMPL": impl, "CHUNK_SIZE": 64, "BLOCK_M": 64, "BLOCK_K": 64, "BLOCK_P": 16}
    _run(RAGGED, "fp32", cfg, device, seed=1)


@pytest.mark.parametrize("prefetch", [0, 1])
def test_fused_carry_prefetch(prefetch, device):
    # Both ways the carry reads C; ragged L, two groups, two p tiles, odd n.
    cfg = {"IMPL": "fused", "CHUNK_SIZE": 64, "BLOCK_P": 16, "PREFETCH_C": prefetch}
    _run({**RAGGED, "b": 1, "h": 2}, "fp32", cfg, device, seed=7)


# Two batches, two groups, p and n not powers of two; L gives 1, 2 and 5 (ragged) chunks.
CARRY_SHAPE = {"b": 2, "L": 16, "h": 4, "p": 24, "g": 2, "n": 20}
CHUNK_COUNTS = {"1-chunk": (16, 16), "2-chunks": (32, 16), "5-ragged": (150, 32)}


@pytest.mark.slow
@pytest.mark.parametrize("chunks", list(CHUNK_COUNTS))
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("carry", ["sequential", "lookback", "chained"])
def test_fused_carries(carry, dtype, chunks, device):
    L, chunk = CHUNK_COUNTS[chunks]
    shape = {**CARRY_SHAPE, "L": L}
    seed = 100 + 10 * list(CHUNK_COUNTS).index(chunks) + (dtype == "bf16")
    cfg = {"IMPL": "fused", "CARRY": carry, "CHUNK_SIZE": chunk}
    out, ref = _run(shape, dtype, cfg, device, seed=seed)
    if dtype == "fp32":  # the family's fp32 bound, not just a loose pass
        assert (out - ref).abs().max() <= 1e-4


def _lookback(shape, dtype, device, seed, **kw):
    inputs = KERNEL.make_inputs(shape, dtype, seed, device)
    x = inputs["x"]
    interpreted = device == "cpu"
    meta = {"DOT": _TL_DTYPES[x.dtype], "UPCAST": interpreted and x.dtype == torch.bfloat16,
            "PREC": "ieee" if interpreted else "tf32x3"}  # fmt: skip
    launch = LookbackLaunch(
        tuple(inputs[k] for k in NAMES), torch.empty_like(x), chunk=16, state=torch.float32,
        dot_meta=meta, num_warps=4, num_stages=1, **kw,
    )  # fmt: skip
    return inputs, launch


@pytest.mark.parametrize("incl_every", [2, 3])
def test_lookback_walks_aggregates(incl_every, device):
    # Programs run one after another in the interpreter, so a predecessor has always
    # published its inclusive prefix; publishing it only every k-th chunk makes the
    # look-back combine up to k - 1 aggregates, as concurrent programs do on a GPU.
    shape = {"b": 2, "L": 112, "h": 2, "p": 16, "g": 1, "n": 16}  # 7 chunks
    inputs, launch = _lookback(shape, "fp32", device, 20 + incl_every, decoupled=True,
                               incl_every=incl_every)  # fmt: skip
    out = launch()
    ref = KERNEL.reference(inputs, shape)
    assert (out - ref).abs().max() <= 1e-4
    flags = launch.sync[2:].view(shape["b"], launch.nchunks, shape["h"]).cpu()
    for c in range(launch.nchunks - 1):  # the last chunk publishes nothing
        want = 2 if c % incl_every == 0 else 1
        assert (flags[:, c] == want).all(), (c, flags[:, c])
    assert (flags[:, -1] == 0).all()


def test_lookback_refuses_aggregates_off_the_decoupled_carry(device):
    with pytest.raises(ValueError, match="decoupled"):
        _lookback(SMALL, "fp32", device, 0, decoupled=False, incl_every=2)


@pytest.mark.parametrize("decoupled", [True, False])
def test_lookback_reports_an_unset_flag_instead_of_spinning(decoupled, device):
    # Tickets start past chunk 0, so its programs never run and its flags stay unset: the
    # interpreter stops polling after a bound and counts the flags it gave up on.
    if device != "cpu":
        pytest.skip("the bounded wait is the interpreter's; a GPU waits for the flag")
    _, launch = _lookback(SMALL, "fp32", device, 0, decoupled=decoupled)
    launch.sync.zero_()
    launch.sync[0] = SMALL["b"] * SMALL["h"]
    launch.launch()
    assert launch.given_up() == SMALL["b"] * SMALL["h"]  # one per chunk-1 program
    # A call zeroes the workspace first, and then nothing is given up on.
    launch()
    assert launch.given_up() == 0


@pytest.mark.parametrize("state", ["fp16", "bf16"])
def test_lookback_state_dtype(state, device):
    # The published states round to STATE_DTYPE; fp16 inputs (fp32 ones demand fp32 states).
    cfg = {"IMPL": "fused", "CARRY": "lookback", "STATE_DTYPE": state}
    _run(SMALL, "fp16", cfg, device, seed=9)


@pytest.mark.slow
def test_carry_benchmark_runs_every_carry(tmp_path, device):
    # benchmarks/ssd_bench.py --carries at an interpreter-sized shape: every carry is timed
    # and checked, and the target lines are written.
    if device != "cpu":
        pytest.skip("the GPU run is the benchmark itself")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, str(root / "benchmarks/ssd_bench.py"), "--carries", "--device",
           "cpu", "--sweep-L", "48", "--shape", "2,16,16", "--dtypes", "fp32",
           "--out", str(tmp_path)]  # fmt: skip
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=600)
    out = json.loads((tmp_path / "ssd_carries.json").read_text())
    timed = {r["impl"] for r in out["rows"] if r["ms"] and r["passed"] and r["err"] < 1e-4}
    for carry in ("lookback", "chained"):
        assert f"fused {carry} c64 w4 fp32" in timed
    assert "fused sequential (default)" in timed and "five (default)" in timed
    assert out["targets"] and out["targets"][0].startswith("target fp32: fused ")


@pytest.mark.slow
@pytest.mark.parametrize("state", ["fp32", "bf16"])
@pytest.mark.parametrize("impl", ["five"])
def test_tiled_chunk(impl, state, device):
    # BLOCK_K > BLOCK_M: reduction tiles reach past the row tile (masked causally); BLOCK_M
    # and BLOCK_K tile the five-kernel path only.
    cfg = {"IMPL": impl, "CHUNK_SIZE": 64, "BLOCK_M": 32, "BLOCK_K": 64, "BLOCK_P": 16}
    _run(RAGGED, "fp16" if state != "fp32" else "fp32", {**cfg, "STATE_DTYPE": state}, device,
         seed=2)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["five"])
def test_tiled_chunk_bf16_inputs(impl, device):
    # BLOCK_M > BLOCK_K, bf16 operands (rounded as on the GPU under the interpreter).
    cfg = {"IMPL": impl, "CHUNK_SIZE": 128, "BLOCK_M": 64, "BLOCK_K": 32, "BLOCK_P": 16}
    _run(L256, "bf16", {**cfg, "STATE_DTYPE": "fp16"}, device, seed=6)


@pytest.mark.slow
@pytest.mark.parametrize(
    "impl,chunk,bm,bk",
    [("fused", 128, 128, 128), ("five", 128, 128, 128), ("five", 256, 64, 32)],
    ids=["fused-c128", "five-c128-single", "five-c256-tiled"],
)
def test_chunk_sizes(impl, chunk, bm, bk, device):
    cfg = {"IMPL": impl, "CHUNK_SIZE": chunk, "BLOCK_P": 16}
    if impl == "five":
        cfg |= {"BLOCK_M": bm, "BLOCK_K": bk}
    cfg["num_warps"] = 8  # a 128x128 fp32 C B^T tile is pruned at 4 warps
    _run(L256, "fp32", cfg, device, seed=3)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("impl", ["fused", "five"])
def test_input_dtypes(impl, dtype, device):
    _run(SMALL, dtype, {"IMPL": impl, "BLOCK_P": 16}, device, seed=4)


@pytest.mark.parametrize("impl", ["fused", "five"])
def test_large_negative_decay_no_nan(impl, device):
    # dt*A down to ~ -270 per step: cumsums reach ~ -1e4, so unclamped exp of the masked
    # (upper-triangle) decay differences would be inf, and inf * 0 = NaN.
    shape = {"b": 1, "L": 150, "h": 2, "p": 16, "g": 1, "n": 16}
    inp = KERNEL.make_inputs(shape, "fp32", 5, device)
    gen = torch.Generator(device="cpu").manual_seed(5)
    inp["A"] = (-100.0 * torch.exp(torch.rand(2, generator=gen))).to(device)
    inp["dt"] = (0.5 + 0.5 * torch.rand(1, 150, 2, generator=gen)).to(device)
    cfg = {"IMPL": impl, "BLOCK_P": 16}
    if impl == "five":
        cfg |= {"BLOCK_M": 32, "BLOCK_K": 32}
    out, ref = _run(shape, "fp32", cfg, device, inputs=inp)
    assert torch.isfinite(ref).all()


@pytest.mark.slow
def test_eager_is_traceable():
    shape = KERNEL.shapes["test"]
    inp = KERNEL.make_inputs(shape, "bf16", 0, "cpu")
    traced = torch.compile(lambda i: KERNEL.eager(i, shape), backend="eager", fullgraph=True)
    y = traced(inp)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, KERNEL.eager(inp, shape))
    # In bf16 it is only roughly the reference (its decays and einsums round to bf16).
    ref = KERNEL.reference(inp, shape)
    assert (y.float() - ref).abs().max() < 0.2 * ref.abs().max()


def test_default_config_passes_everywhere():
    for shape in KERNEL.shapes.values():
        for dev in (CPU, H100):
            assert KERNEL.check_config(KERNEL.default_config, shape, dev) is None, shape


def test_check_config_prunes():
    shape = KERNEL.shapes["test"]  # L=160, p=32, n=32
    big = KERNEL.shapes["mamba2-2.7b-4k"]
    assert KERNEL.check_config({"CHUNK_SIZE": 256}, {**shape, "L": 100}, CPU)
    five256 = {"IMPL": "five", "CHUNK_SIZE": 256, "BLOCK_M": 64}
    assert KERNEL.check_config(five256, shape, CPU) is None
    assert KERNEL.check_config({"IMPL": "five", "BLOCK_M": 128}, shape, CPU)  # > CHUNK 64
    assert "unused" in KERNEL.check_config({"IMPL": "fused", "BLOCK_M": 32}, shape, CPU)
    assert "unused" in KERNEL.check_config({"IMPL": "five", "PREFETCH_C": 1}, shape, CPU)
    # CARRY: a fused choice; BLOCK_P and PREFETCH_C tune the sequential carry only.
    assert "unknown CARRY" in KERNEL.check_config({"CARRY": "parallel"}, shape, CPU)
    assert "unused" in KERNEL.check_config({"IMPL": "five", "CARRY": "lookback"}, shape, CPU)
    for carry in ("lookback", "chained"):
        assert KERNEL.check_config({"CARRY": carry}, shape, CPU) is None
        assert KERNEL.check_config({"CARRY": carry}, big, H100) is None
        for key, v in (("BLOCK_P", 32), ("PREFETCH_C", 1)):
            why = KERNEL.check_config({"CARRY": carry, key: v}, shape, CPU)
            assert why and "unused" in why and f"CARRY={carry}" in why
    assert KERNEL.check_config({"CARRY": "sequential", "BLOCK_P": 32}, shape, CPU) is None
    assert KERNEL.check_config({"BLOCK_P": 64}, shape, CPU)  # > p
    assert KERNEL.check_config({"BLOCK_K": 8}, shape, CPU)  # below tl.dot's 16
    assert KERNEL.check_config({"IMPL": "nope"}, shape, CPU)
    assert KERNEL.check_config({"STATE_DTYPE": "fp8"}, shape, CPU)
    assert KERNEL.check_config({}, {**shape, "g": 3}, CPU)  # h % g
    # Too many registers (a 128x128 fp32 C B^T tile on 4 warps), too much shared memory.
    wide = {"IMPL": "five", "CHUNK_SIZE": 128, "BLOCK_M": 128, "BLOCK_K": 128, "BLOCK_P": 64,
            "num_warps": 4}  # fmt: skip
    assert "registers" in KERNEL.check_config(wide, big, H100)
    deep = {**wide, "num_warps": 8, "num_stages": 3}
    assert "shared memory" in KERNEL.check_config(deep, big, H100)
    assert KERNEL.check_config({**deep, "num_stages": 2}, big, H100) is None
    # Fused: the chunk launch holds a CHUNK_SIZE^2 fp32 tile.
    assert "registers" in KERNEL.check_config({"CHUNK_SIZE": 256, "num_warps": 8}, big, H100)
    assert KERNEL.check_config({"CHUNK_SIZE": 128, "num_warps": 4}, big, H100) is None
    # Unknown keys are ignored.
    assert KERNEL.check_config({"FOO": 1}, shape, CPU) is None


def test_tolerance_loosens_with_state_dtype():
    t32 = KERNEL.tolerance("fp16", {"STATE_DTYPE": "fp32"})
    tb16 = KERNEL.tolerance("fp16", {"STATE_DTYPE": "bf16"})
    assert t32.atol < tb16.atol
    # fp32 inputs keep fp32 accuracy whatever the state dtype.
    for state in ("fp32", "fp16", "bf16"):
        assert KERNEL.tolerance("fp32", {"STATE_DTYPE": state}).atol == 1e-4


def test_inputs_and_cost_model():
    shape = KERNEL.shapes["test"]
    a = KERNEL.make_inputs(shape, "bf16", 7, "cpu")
    b = KERNEL.make_inputs(shape, "bf16", 7, "cpu")
    c = KERNEL.make_inputs(shape, "bf16", 8, "cpu")
    for k in NAMES:
        assert torch.equal(a[k], b[k]) and not torch.equal(a[k], c[k])
    assert a["x"].dtype == torch.bfloat16 and a["dt"].dtype == torch.float32
    assert (a["dt"] > 0).all() and (a["A"] < 0).all()
    big = KERNEL.shapes["mamba2-2.7b-16k"]
    assert KERNEL.flops(big) > 4 * 16384 * 80 * 64 * 128  # states + outputs alone
    assert KERNEL.bytes_moved(big, "bf16") > 2 * 16384 * 80 * 64 * 2
    assert KERNEL.compute_dtype("fp32") == "fp32" and KERNEL.compute_dtype("bf16") == "bf16"
    assert math.isinf(KERNEL.shape_distance(big, {**big, "h": 128}))
    assert KERNEL.shape_distance(big, {**big, "L": 4096}) == 2.0


# -- GPU: the real 4K shape -------------------------------------------------------------

GPU_CONFIGS = [
    {},
    {"IMPL": "fused", "CHUNK_SIZE": 128, "BLOCK_P": 64, "num_warps": 8, "PREFETCH_C": 1},
    {"IMPL": "fused", "CHUNK_SIZE": 64, "BLOCK_P": 32, "STATE_DTYPE": "bf16", "PREFETCH_C": 1},
    {"IMPL": "fused", "CHUNK_SIZE": 64, "BLOCK_P": 16, "STATE_DTYPE": "fp16", "num_stages": 3},
    {"IMPL": "fused", "CARRY": "lookback"},
    {"IMPL": "fused", "CARRY": "lookback", "CHUNK_SIZE": 128, "num_warps": 8,
     "STATE_DTYPE": "fp16"},
    {"IMPL": "fused", "CARRY": "chained", "num_warps": 8, "STATE_DTYPE": "bf16"},
    {"IMPL": "five"},
    {"IMPL": "five", "CHUNK_SIZE": 128, "BLOCK_M": 64, "BLOCK_K": 64, "BLOCK_P": 64,
     "STATE_DTYPE": "fp16", "num_stages": 3},
    {"IMPL": "five", "CHUNK_SIZE": 256, "BLOCK_M": 128, "BLOCK_K": 64, "BLOCK_P": 64,
     "STATE_DTYPE": "bf16", "num_warps": 8},
]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("config", GPU_CONFIGS, ids=lambda c: "-".join(map(str, c.values())))
def test_gpu_4k_bf16(config, device):
    _run(KERNEL.shapes["mamba2-2.7b-4k"], "bf16", config, device, seed=11)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
@pytest.mark.parametrize("impl", ["fused", "five"])
def test_gpu_4k_dtypes(impl, dtype, device):
    _run(KERNEL.shapes["mamba2-2.7b-4k"], dtype, {"IMPL": impl}, device, seed=12)


@pytest.mark.gpu
@pytest.mark.parametrize("carry", ["lookback", "chained"])
def test_gpu_4k_fp32_carries(carry, device):
    _run(KERNEL.shapes["mamba2-2.7b-4k"], "fp32", {"CARRY": carry}, device, seed=12)


# -- GPU: the look-back at 16K in fp32, and under repetition ------------------------------

LOOKBACK_16K = [
    {"CARRY": carry, "CHUNK_SIZE": chunk, "num_warps": warps}
    for carry in ("lookback", "chained") for chunk, warps in ((64, 4), (64, 8), (128, 8))
]


@pytest.mark.gpu
@pytest.mark.parametrize("config", LOOKBACK_16K, ids=lambda c: "-".join(map(str, c.values())))
def test_gpu_16k_fp32_lookback(config, device):
    out, ref = _run(KERNEL.shapes["mamba2-2.7b-16k"], "fp32", config, device, seed=13)
    assert (out - ref).abs().max() <= 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("carry", ["lookback", "chained"])
def test_gpu_lookback_repeats_on_a_poisoned_workspace(carry, device):
    # The workspace and output are NaN before every call: a state read before it was
    # published, or a flag seen before its state, shows as NaN or a wrong output.
    shape = KERNEL.shapes["mamba2-2.7b-4k"]
    inputs = KERNEL.make_inputs(shape, "fp32", 14, device)
    ref = KERNEL.reference(inputs, shape)
    fn = KERNEL.launcher(inputs, shape, {"CARRY": carry})
    launch = fn.stages["lookback"]
    for _ in range(30):
        for t in (launch.states, launch.totals, launch.y):
            t.fill_(float("nan"))
        out = fn()
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()
        assert (out - ref).abs().max() <= 1e-4


def test_fp32_studies_prune_16_bit_states_statically():
    """A 16-bit state can never meet fp32 inputs' accuracy: an fp32 study's valid set
    holds no such config (they cost no trial), a bf16 study's keeps them."""
    from harness import experiment

    exp = experiment.Experiment(
        name="ssd", kernel="mamba2_ssd", shapes=[{"b": 1, "L": 256, "h": 2, "p": 16, "g": 1,
                                                  "n": 16}],
        dtypes=["fp32", "bf16"],
        search_space={"params": {"IMPL": ["fused"], "STATE_DTYPE": ["fp32", "fp16", "bf16"],
                                 "CHUNK_SIZE": [64], "num_warps": [4], "num_stages": [1]}})
    fp32, bf16 = experiment.ExperimentPlan.checked("ssd.yaml", exp).for_hardware(
        ["H100"]).studies
    assert fp32.spec.dtype == "fp32" and bf16.spec.dtype == "bf16"

    def states(study) -> set:
        valid = study.valid()
        return {c["STATE_DTYPE"] for c in valid.grid_configs()
                if valid.index(c) is not None and valid.reason(valid.index(c)) is None}

    assert states(fp32) == {"fp32"}
    assert states(bf16) == {"fp32", "fp16", "bf16"}
    assert "fp32 accuracy" in fp32.check({"STATE_DTYPE": "fp16"})
