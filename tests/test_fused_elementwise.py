"""Fused element-wise families (rmsnorm, silu, silu_mul, softplus_clamp): every tunable
value, every dtype, GPU runs at the seed shape."""

from __future__ import annotations

import pytest
import torch

from harness.measure.hardware import current_device, spec_for_key
from harness.measure.timing import compare
from kernels.fused_elementwise import RMSNorm, SiLU, SiLUMul, SoftplusClamp

FAMILIES = [RMSNorm(), SiLU(), SiLUMul(), SoftplusClamp()]
CPU = spec_for_key("cpu")
PARAMS = SiLU.search_space()["params"]
ids = lambda k: k.name  # noqa: E731


def _check(kernel, shape: dict, dtype: str, config: dict, device: str, seed: int = 0) -> None:
    assert kernel.check_config(config, shape, CPU) is None, kernel.check_config(config, shape, CPU)
    inputs = kernel.make_inputs(shape, dtype, seed, device)
    ref = kernel.reference(inputs, shape)
    out = kernel.launcher(inputs, shape, config)()
    res = compare(out, ref, kernel.tolerance(dtype, config))
    assert res["ok"], (kernel.name, config, res)


@pytest.mark.parametrize("kernel", FAMILIES, ids=ids)
@pytest.mark.parametrize("block", PARAMS["BLOCK_SIZE"])
def test_every_block_size(kernel, block, device):
    if kernel.name == "rmsnorm":
        # One pass (the whole row in a block) and two passes (the row in chunks).
        _check(kernel, {"rows": 3, "cols": block - 3}, "fp32", {"BLOCK_SIZE": block}, device)
        _check(kernel, {"rows": 3, "cols": block + 3}, "fp32", {"BLOCK_SIZE": block}, device)
    else:
        # The last block is partial.
        _check(kernel, {"rows": 3, "cols": block + 1}, "fp32", {"BLOCK_SIZE": block}, device)


@pytest.mark.parametrize("kernel", FAMILIES, ids=ids)
@pytest.mark.parametrize("warps", PARAMS["num_warps"])
def test_every_num_warps(kernel, warps, device):
    _check(kernel, {"rows": 4, "cols": 300}, "fp32", {"BLOCK_SIZE": 256, "num_warps": warps},
           device)


@pytest.mark.parametrize("kernel", FAMILIES, ids=ids)
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_dtypes_and_eager(kernel, dtype, device):
    shape = kernel.shapes["test"]
    _check(kernel, shape, dtype, {"BLOCK_SIZE": 256}, device, seed=4)
    inputs = kernel.make_inputs(shape, dtype, 4, device)
    res = compare(kernel.eager(inputs, shape), kernel.reference(inputs, shape),
                  kernel.tolerance(dtype, {}))
    assert res["ok"], res


def test_softplus_clamp_hits_both_bounds():
    k = SoftplusClamp()
    inputs = k.make_inputs(k.shapes["test"], "fp32", 0, "cpu")
    ref = k.reference(inputs, k.shapes["test"])
    assert (ref == inputs["lo"]).any() and (ref == inputs["hi"]).any()
    assert ((ref > inputs["lo"]) & (ref < inputs["hi"])).float().mean() > 0.3


def test_rmsnorm_accumulates_in_fp32(device):
    # Large row sums of squares overflow fp16 if accumulated in the input dtype.
    k = RMSNorm()
    shape = {"rows": 2, "cols": 1000}
    inputs = k.make_inputs(shape, "fp16", 0, device)
    inputs["x"] = inputs["x"] * 100
    ref = k.reference(inputs, shape)
    out = k.launcher(inputs, shape, {"BLOCK_SIZE": 256})()
    assert compare(out, ref, k.tolerance("fp16", {}))["ok"]


@pytest.mark.parametrize("kernel", FAMILIES, ids=ids)
@pytest.mark.parametrize("key", ["H100", "H200", "V710"])
def test_default_config_valid(kernel, key):
    assert kernel.check_config(kernel.default_config, kernel.shapes["r8192-c4096"],
                               spec_for_key(key)) is None


def test_check_config_prunes():
    k, h100 = RMSNorm(), spec_for_key("H100")
    assert k.check_config({"BLOCK_SIZE": 8192}, {"rows": 8, "cols": 1000}, h100)
    assert k.check_config({"BLOCK_SIZE": 8192, "num_warps": 1}, {"rows": 8, "cols": 8192}, h100)
    assert k.check_config({"BLOCK_SIZE": 1000}, {"rows": 8, "cols": 8192}, h100)
    assert SiLU().check_config({"BLOCK_SIZE": 8192}, {"rows": 8, "cols": 8192}, h100) is None


# -- GPU: seed shape -------------------------------------------------------------------

GPU_CONFIGS = [
    {},
    {"BLOCK_SIZE": 256, "num_warps": 2},
    {"BLOCK_SIZE": 1024, "num_warps": 4},
    {"BLOCK_SIZE": 2048, "num_warps": 8},
    {"BLOCK_SIZE": 8192, "num_warps": 16},
]


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", FAMILIES, ids=ids)
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_gpu_seed_shape(kernel, dtype):
    shape = kernel.shapes["r8192-c4096"]
    inputs = kernel.make_inputs(shape, dtype, 0, "cuda")
    ref = kernel.reference(inputs, shape)
    for config in GPU_CONFIGS:
        if kernel.check_config(config, shape, current_device()):
            continue
        res = compare(kernel.launcher(inputs, shape, config)(), ref,
                      kernel.tolerance(dtype, config))
        assert res["ok"], (kernel.name, config, res)
    eager = compare(kernel.eager(inputs, shape), ref, kernel.tolerance(dtype, {}))
    assert eager["ok"], eager
    torch.cuda.synchronize()
