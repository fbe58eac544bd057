"""Granite-4 multiply-then-sum families: every IMPL and tunable value, the bmm rewrite of
each pattern against its as-written broadcast form, GPU runs at the Granite-4 shape."""

from __future__ import annotations

import pytest
import torch

from harness.measure.hardware import current_device, spec_for_key
from harness.measure.timing import compare
from kernels.mulsum_bmm import MulSumBmm, MulSumCStates, MulSumStates, MulSumYDiag

FAMILIES = [MulSumBmm(), MulSumYDiag(), MulSumStates(), MulSumCStates()]
G = FAMILIES[0]
CPU = spec_for_key("cpu")
PARAMS = MulSumBmm.search_space()["params"]
SMALL_TRITON = {"IMPL": "triton", "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16, "num_warps": 4,
                "num_stages": 2, "INPUT_PRECISION": "ieee"}
IMPL_CONFIGS = [
    {"IMPL": "broadcast_chunked", "CHUNK": 5},
    {"IMPL": "bmm", "ALLOW_TF32": 0},
    {"IMPL": "triton", "BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "INPUT_PRECISION": "tf32x3"},
]


def _check(kernel, shape: dict, config: dict, device: str, seed: int = 0) -> dict:
    assert kernel.check_config(config, shape, CPU) is None, kernel.check_config(config, shape, CPU)
    inputs = kernel.make_inputs(shape, "fp32", seed, device)
    ref = kernel.reference(inputs, shape)
    out = kernel.launcher(inputs, shape, config)()
    res = compare(out, ref, kernel.tolerance("fp32", config))
    assert res["ok"], (kernel.name, config, res)
    return res


@pytest.mark.parametrize("kernel", FAMILIES, ids=lambda k: k.name)
@pytest.mark.parametrize("config", IMPL_CONFIGS, ids=lambda c: c["IMPL"])
def test_each_impl_each_pattern(kernel, config, device):
    _check(kernel, kernel.shapes["test"], config, device, seed=1)


@pytest.mark.parametrize("kernel", FAMILIES, ids=lambda k: k.name)
def test_bmm_rewrite_matches_broadcast_form(kernel, device):
    """The rewrite (torch and Triton) against the pattern exactly as HF writes it."""
    shape = kernel.shapes["test"]
    inputs = kernel.make_inputs(shape, "fp32", 2, device)
    broadcast = kernel.eager(inputs, shape)
    assert broadcast.shape == kernel.reference(inputs, shape).shape
    for config in ({"IMPL": "bmm"}, {**SMALL_TRITON, "BLOCK_N": 16}):
        out = kernel.launcher(inputs, shape, config)()
        torch.testing.assert_close(out, broadcast, atol=1e-5, rtol=1e-5)


def _case(name: str, value) -> tuple[dict, dict]:
    """(config, shape) that exercises ``name=value`` with that value not pruned."""
    shape = {"b": 1, "c": 2, "l": 20, "s": 19, "h": 2, "n": 13}
    if name == "IMPL":
        return (dict(SMALL_TRITON) if value == "triton" else {"IMPL": value}), shape
    if name == "CHUNK":
        return {"IMPL": "broadcast_chunked", "CHUNK": value}, {**shape, "l": value + 3, "s": 5}
    if name == "ALLOW_TF32":
        return {"IMPL": "bmm", "ALLOW_TF32": value}, shape
    config = {**SMALL_TRITON, name: value}
    dim = {"BLOCK_M": "l", "BLOCK_N": "s", "BLOCK_K": "n"}.get(name)
    if dim:
        shape[dim] = max(value - 3, 13)
    return config, shape


@pytest.mark.parametrize(
    "name,value", [(k, v) for k, vals in PARAMS.items() for v in vals], ids=lambda x: str(x))
def test_every_tunable_value(name, value, device):
    config, shape = _case(name, value)
    _check(G, shape, config, device)


@pytest.mark.parametrize("start", [False, True])
@pytest.mark.parametrize("allow", [0, 1])
def test_allow_tf32_restored(start, allow, device):
    shape = G.shapes["test"]
    inputs = G.make_inputs(shape, "fp32", 0, device)
    prev = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = start
        G.launcher(inputs, shape, {"IMPL": "bmm", "ALLOW_TF32": allow})()
        assert torch.backends.cuda.matmul.allow_tf32 is start
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def test_tolerance_follows_precision():
    assert G.tolerance("fp32", {"IMPL": "triton", "INPUT_PRECISION": "tf32"}).atol > 1e-3
    assert G.tolerance("fp32", {"IMPL": "bmm", "ALLOW_TF32": 1}).atol > 1e-3
    for cfg in ({"IMPL": "triton", "INPUT_PRECISION": "tf32x3"},
                {"IMPL": "triton", "INPUT_PRECISION": "ieee"}, {"IMPL": "bmm", "ALLOW_TF32": 0},
                {"IMPL": "broadcast_chunked"}, {"IMPL": "broadcast_chunked", "ALLOW_TF32": 1}):
        assert G.tolerance("fp32", cfg).atol <= 1e-5


def test_seed_shape_is_granite4():
    s = G.shapes["granite4"]
    sx, sy = G._operand_shapes(G.validate_shape(s))
    # C [32,1,256,1,48,128] and B [32,1,1,256,48,128] without their broadcast axes.
    assert sx == (32, 1, 256, 48, 128) and sy == (32, 1, 256, 48, 128)
    assert G._intermediate_bytes(G.validate_shape(s), 256) == 32 * 256 * 256 * 48 * 128 * 4


@pytest.mark.parametrize("kernel", FAMILIES, ids=lambda k: k.name)
@pytest.mark.parametrize("key", ["H100", "H200", "V710", "cpu"])
def test_default_config_valid(kernel, key):
    assert kernel.check_config(kernel.default_config, kernel.shapes["granite4"],
                               spec_for_key(key)) is None


def test_check_config_prunes():
    seed, h100, v710 = G.shapes["granite4"], spec_for_key("H100"), spec_for_key("V710")
    assert G.check_config({"IMPL": "nope"}, seed, h100)
    assert G.check_config({"IMPL": "triton", "INPUT_PRECISION": "tf32x3"}, seed, v710)
    assert G.check_config({"IMPL": "triton", "INPUT_PRECISION": "ieee", "BLOCK_M": 128,
                           "BLOCK_N": 128, "BLOCK_K": 64, "num_stages": 2}, seed, v710)
    assert G.check_config({"IMPL": "triton", "BLOCK_K": 256}, seed, h100)
    assert G.check_config({"IMPL": "broadcast_chunked", "CHUNK": 512}, seed, h100)
    assert G.check_config({"IMPL": "triton", "BLOCK_M": 256, "BLOCK_N": 256, "num_warps": 4},
                          seed, h100)


# -- GPU: the Granite-4 shape -----------------------------------------------------------

GPU_CONFIGS = [
    {"IMPL": "bmm", "ALLOW_TF32": 0},
    {"IMPL": "bmm", "ALLOW_TF32": 1},
    {"IMPL": "triton", "INPUT_PRECISION": "tf32x3"},
    {"IMPL": "triton", "INPUT_PRECISION": "tf32x3", "BLOCK_M": 64, "BLOCK_N": 128,
     "BLOCK_K": 32, "num_warps": 4, "num_stages": 4},
    {"IMPL": "triton", "INPUT_PRECISION": "ieee", "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32,
     "num_warps": 4, "num_stages": 3},
    {"IMPL": "triton", "INPUT_PRECISION": "tf32"},
    {"IMPL": "broadcast_chunked", "CHUNK": 16},
]


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", FAMILIES, ids=lambda k: k.name)
def test_gpu_granite4(kernel):
    shape = kernel.shapes["granite4"]
    inputs = kernel.make_inputs(shape, "fp32", 0, "cuda")
    ref = kernel.reference(inputs, shape)
    failures = []
    for config in GPU_CONFIGS:
        reason = kernel.check_config(config, shape, current_device())
        if reason:
            continue
        res = compare(kernel.launcher(inputs, shape, config)(), ref,
                      kernel.tolerance("fp32", config))
        if not res["ok"]:
            failures.append((config, res))
        if config.get("INPUT_PRECISION") == "tf32x3" or config.get("ALLOW_TF32") == 0:
            # The target: fp32-level accuracy (max error / max |ref|).
            assert res["max_rel_err"] <= 1e-5, (config, res)
    assert not failures, failures
