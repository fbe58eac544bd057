"""Mamba-1 selective scan: every tunable value, the exp(delta*A) discretisation, GPU seeds."""

from __future__ import annotations

import math

import pytest
import torch

from harness.measure.hardware import current_device, spec_for_key
from harness.measure.timing import compare
from kernels.selective_scan import SelectiveScan

K = SelectiveScan()
CPU = spec_for_key("cpu")
PARAMS = SelectiveScan.search_space()["params"]
BASE = {"b": 2, "L": 11, "d": 20, "n": 3}  # n = 3: the state axis is masked (BLOCK_N = 4)


def _check(shape: dict, dtype: str, config: dict, device: str, seed: int = 0) -> dict:
    assert K.check_config(config, shape, CPU) is None
    inputs = K.make_inputs(shape, dtype, seed, device)
    ref = K.reference(inputs, shape)
    out = K.launcher(inputs, shape, config)()
    res = compare(out, ref, K.tolerance(dtype, config))
    assert res["ok"], (config, res)
    return res


def _shape_for(name: str, value) -> dict:
    shape = dict(BASE)
    if name == "BLOCK_D" and value >= 32:
        # Enough channels that the block is not pruned; one batch keeps it quick.
        shape.update(b=1, d=value * 3 // 4 + 1)
    if name == "CHUNK_L" and value > 8:
        shape["L"] = value - 5  # one partial chunk
    return shape


@pytest.mark.parametrize(
    "name,value", [(k, v) for k, vals in PARAMS.items() for v in vals],
    ids=lambda x: str(x))
def test_every_tunable_value(name, value, device):
    config = {name: value}
    if name == "BLOCK_D" and value >= 64:
        config["CHUNK_L"] = 4  # the interpreter's scan is element by element
    _check(_shape_for(name, value), "fp32", config, device)


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("chunk_l", [1, 4])
def test_dtypes(dtype, chunk_l, device):
    _check(BASE, dtype, {"CHUNK_L": chunk_l, "FUSE_PREAMBLE": 2}, device, seed=3)


def test_chunk_and_sequential_agree(device):
    shape = {"b": 1, "L": 13, "d": 8, "n": 4}
    inputs = K.make_inputs(shape, "fp32", 7, device)
    seq = K.launcher(inputs, shape, {"CHUNK_L": 1, "BLOCK_D": 8})().clone()
    chunked = K.launcher(inputs, shape, {"CHUNK_L": 4, "BLOCK_D": 8})()
    torch.testing.assert_close(chunked, seq, atol=1e-5, rtol=1e-5)


def test_eager_matches_reference(device):
    shape = dict(BASE)
    inputs = K.make_inputs(shape, "fp32", 1, device)
    res = compare(K.eager(inputs, shape), K.reference(inputs, shape), K.tolerance("fp32", {}))
    assert res["ok"], res


def _scalar_scan(x, delta, A, B, C, D, buggy: bool):
    """Plain-Python recurrence (b = 1). ``buggy`` uses exp(A) * delta, the known mistake."""
    L, d = len(x), len(x[0])
    n = len(A[0])
    h = [[0.0] * n for _ in range(d)]
    y = [[0.0] * d for _ in range(L)]
    for t in range(L):
        for i in range(d):
            acc = 0.0
            for j in range(n):
                if buggy:
                    decay = math.exp(A[i][j]) * delta[t][i]
                else:
                    decay = math.exp(delta[t][i] * A[i][j])
                h[i][j] = decay * h[i][j] + delta[t][i] * B[t][j] * x[t][i]
                acc += h[i][j] * C[t][j]
            y[t][i] = acc + D[i] * x[t][i]
    return torch.tensor(y, dtype=torch.float64)


@pytest.mark.parametrize("fuse", [0, 1, 2])
@pytest.mark.parametrize("chunk_l", [1, 4])
def test_discretisation_is_exp_of_delta_times_A(fuse, chunk_l, device):
    """exp(delta*A), not exp(A)*delta: the two differ by O(1) here, so this fails loudly
    for a kernel (or reference) that multiplies after the exp."""
    g = torch.Generator().manual_seed(11)
    L, d, n = 6, 3, 2
    x = torch.randn(1, L, d, generator=g)
    dt = torch.randn(1, L, d, generator=g)
    dt_bias = torch.tensor([-1.0, 0.0, 0.5])  # delta = softplus(dt + bias) ~ 0.1 .. 2
    A = -torch.tensor([[0.5, 3.0], [1.0, 2.0], [4.0, 0.7]])
    B = torch.randn(1, L, n, generator=g)
    C = torch.randn(1, L, n, generator=g)
    D = torch.tensor([0.3, -0.2, 0.1])
    delta = torch.nn.functional.softplus(dt.double() + dt_bias.double())[0]
    args = (x[0].double().tolist(), delta.tolist(), A.double().tolist(), B[0].double().tolist(),
            C[0].double().tolist(), D.double().tolist())
    right = _scalar_scan(*args, buggy=False)[None]
    wrong = _scalar_scan(*args, buggy=True)[None]
    assert (right - wrong).abs().max() > 0.1  # the test can tell the two apart

    inputs = {k: v.to(device) for k, v in
              dict(x=x, dt=dt, A=A, B=B, C=C, D=D, dt_bias=dt_bias).items()}
    shape = {"b": 1, "L": L, "d": d, "n": n}
    ref = K.reference(inputs, shape).cpu()
    torch.testing.assert_close(ref, right, atol=1e-9, rtol=1e-9)
    out = K.launcher(inputs, shape, {"FUSE_PREAMBLE": fuse, "CHUNK_L": chunk_l})().cpu()
    torch.testing.assert_close(out.double(), right, atol=1e-5, rtol=1e-5)


def test_inputs_reproducible_and_nonzero():
    a = K.make_inputs(BASE, "bf16", 5, "cpu")
    b = K.make_inputs(BASE, "bf16", 5, "cpu")
    for k in a:
        assert torch.equal(a[k], b[k])
        assert a[k].count_nonzero() > 0.9 * a[k].numel()
    assert (a["A"] < 0).all()
    assert a["x"].shape == (2, 11, 20) and a["B"].shape == (2, 11, 3)


@pytest.mark.parametrize("key", ["H100", "H200", "V710"])
def test_default_config_valid_on_seeds(key):
    for name, shape in K.shapes.items():
        if name != "test":
            assert K.check_config(K.default_config, shape, spec_for_key(key)) is None


def test_check_config_prunes():
    seed = K.shapes["b1-L2048-n32"]
    h100 = spec_for_key("H100")
    assert K.check_config({"BLOCK_D": 128, "CHUNK_L": 32, "num_warps": 4}, seed, h100)
    assert K.check_config({"BLOCK_D": 12}, seed, h100)
    assert K.check_config({"FUSE_PREAMBLE": 3}, seed, h100)
    assert K.check_config({"BLOCK_D": 64}, {"b": 1, "L": 8, "d": 8, "n": 4}, h100)


# -- GPU: seed shapes -----------------------------------------------------------------

GPU_CONFIGS = [
    {},
    {"CHUNK_L": 1, "BLOCK_D": 32, "num_warps": 4},
    {"CHUNK_L": 1, "BLOCK_D": 8, "num_warps": 1},
    {"FUSE_PREAMBLE": 0},
    {"FUSE_PREAMBLE": 1, "CHUNK_L": 16, "BLOCK_D": 8},
    {"STATE_DTYPE": "fp16"},
    {"STATE_DTYPE": "fp16", "CHUNK_L": 1, "BLOCK_D": 16, "num_warps": 2},
    {"BLOCK_D": 4, "CHUNK_L": 32, "num_warps": 2},
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("shape_name", ["b1-L512-n16", "b16-L2048-n16", "b1-L2048-n32",
                                        "b16-L512-n32"])
def test_gpu_seed_shapes(shape_name, dtype):
    shape = K.shapes[shape_name]
    inputs = K.make_inputs(shape, dtype, 0, "cuda")
    ref = K.reference(inputs, shape)
    failures, ran = [], 0
    for config in GPU_CONFIGS:
        if K.check_config(config, shape, current_device()):
            continue
        ran += 1
        res = compare(K.launcher(inputs, shape, config)(), ref, K.tolerance(dtype, config))
        if not res["ok"]:
            failures.append((config, res))
    assert ran >= 4
    assert not failures, failures


def test_associative_scan_baseline_is_the_recurrence() -> None:
    """The PyTorch baseline users would pick (an associative scan over L) computes the
    same y as the fp64 reference (run eagerly here, generic mode on the CPU; the
    benchmark runs it under torch.compile, pointwise on CUDA)."""
    from kernels import selective_scan as ss

    if not ss._has_associative_scan():
        pytest.skip("this torch has no associative_scan")
    fam = ss.SelectiveScan()
    shape = fam.shapes["test"]
    inputs = fam.make_inputs(shape, "fp32", seed=5, device="cpu")
    out = ss._scan_associative(*fam._operands(inputs))
    torch.testing.assert_close(out.double(), fam.reference(inputs, shape), atol=1e-4, rtol=1e-4)
    assert "torch.compile associative_scan" in fam.baselines()
