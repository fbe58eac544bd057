"""Mamba-2 chunked SSD: the reference against an fp64 recurrence, both IMPLs and every
tunable choice against the reference (CPU interpreter, tiny shapes), GPU checks at 4K."""

from __future__ import annotations

import math

import pytest
import torch

from harness.kernel.api import DeviceSpec
from kernels.mamba2_ssd import Mamba2SSD, ssd_minimal, ssd_recurrent

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
