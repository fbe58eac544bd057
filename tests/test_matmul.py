"""matmul: every tunable value against the reference (interpreter on CPU), ragged shapes,
dtypes, static pruning, the 216-config grid, and on a GPU the seed shape and compiling
ahead in another process (the worker's compile-ahead path)."""

from __future__ import annotations

import itertools
import multiprocessing
import os
import random
from pathlib import Path

import pytest
import torch

from harness.kernel.api import get
from harness.measure.hardware import spec_for_key
from harness.search import spaces
from kernels.matmul import Matmul

KERNEL = Matmul()
H100, H200, V710 = spec_for_key("H100"), spec_for_key("H200"), spec_for_key("V710")
# Every tile choice (up to 256) passes check_config here; M, N and K end off the tile grid.
RAGGED = {"M": 200, "N": 136, "K": 80}


def _check(shape: dict, config: dict, dtype: str, device: str = "cpu", seed: int = 3) -> None:
    inputs = KERNEL.make_inputs(shape, dtype, seed, device)
    out = KERNEL.launcher(inputs, shape, config)()
    ref = KERNEL.reference(inputs, shape)
    assert out.dtype == inputs["a"].dtype and out.shape == ref.shape
    tol = KERNEL.tolerance(dtype, config)
    torch.testing.assert_close(out.float(), ref, atol=tol.atol, rtol=tol.rtol)


def _space_values() -> list[tuple[str, object]]:
    raw = Matmul.search_space()
    sections = [raw.get("params") or {}]
    sections += [(v or {}).get("params") or {} for v in (raw.get("vendors") or {}).values()]
    sections += [(h or {}).get("params") or {} for h in (raw.get("hardware") or {}).values()]
    return list(dict.fromkeys((n, c) for sec in sections for n, cs in sec.items() for c in cs))


def _valid(space: dict, shape: dict, device) -> list[dict]:
    configs = [dict(zip(space, v, strict=True)) for v in itertools.product(*space.values())]
    return [c for c in configs if KERNEL.check_config(c, shape, device) is None]


def test_registered_and_a_large_m_has_216_configs() -> None:
    assert isinstance(get("matmul"), Matmul)
    space = spaces.resolve([spaces.for_kernel(KERNEL)], "nvidia", "H200")
    assert spaces.grid_size(space) == 360
    # Decode tiles (BLOCK_M 16, 32) are pruned for a large M: what is left is the grid of
    # the 216 others.
    big = KERNEL.shapes["square-8192"]
    grid216 = {**space, "BLOCK_M": [64, 128, 256]}
    assert spaces.grid_size(grid216) == 216
    assert _valid(space, big, H200) == _valid(grid216, big, H200)
    cpu = spaces.resolve([spaces.for_kernel(KERNEL)], "cpu", "cpu")
    assert spaces.grid_size(cpu) == 4


@pytest.mark.parametrize(("m", "tiles"), [(16, {16}), (32, {16, 32}), (48, {16, 32, 64}),
                                          (4096, {64, 128, 256})])
def test_decode_shapes_have_tiles_that_fit(m: int, tiles: set) -> None:
    """M=16 (16 tokens) had no tile before BLOCK_M 16 and 32: every config was pruned."""
    space = spaces.resolve([spaces.for_kernel(KERNEL)], "nvidia", "H200")
    ok = _valid(space, {"M": m, "N": 4096, "K": 4096}, H200)
    assert {c["BLOCK_M"] for c in ok} == tiles


@pytest.mark.parametrize(("shape", "block_m"), [({"M": 16, "N": 64, "K": 64}, 16),
                                                ({"M": 11, "N": 40, "K": 48}, 16),
                                                ({"M": 32, "N": 64, "K": 32}, 32),
                                                ({"M": 27, "N": 72, "K": 40}, 32)])
@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
def test_decode_tiles_match_the_reference(shape: dict, block_m: int, dtype: str) -> None:
    """Decode tiles against the reference on fresh random inputs, full and ragged."""
    config = {"BLOCK_M": block_m, "BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 8}
    assert KERNEL.check_config({**KERNEL.default_config, **config}, shape, H200) is None
    _check(shape, config, dtype, seed=int.from_bytes(os.urandom(2), "little"))


@pytest.mark.parametrize(("name", "value"), _space_values())
def test_each_tunable_value(name: str, value: object) -> None:
    config = {**KERNEL.default_config, name: value}
    device = V710 if name in ("waves_per_eu",) or (name == "num_stages" and value < 3) else H100
    # Decode tiles are kept for decode shapes only.
    shape = {**RAGGED, "M": 40} if name == "BLOCK_M" and value < 64 else RAGGED
    assert KERNEL.check_config(config, shape, device) is None, config
    # AMD launch options are dropped off ROCm: the config still runs (and is right).
    _check(shape, config, "fp16")


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("group_m", [1, 8])
def test_dtypes_and_group_order(dtype: str, group_m: int) -> None:
    # 4 x 3 tiles of 64: GROUP_M=8 groups span more rows than exist (the last group is short).
    _check({"M": 256, "N": 192, "K": 96},
           {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": group_m}, dtype)


def test_odd_k_tail_and_default() -> None:
    _check({"M": 64, "N": 64, "K": 40}, {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32}, "fp32")
    _check(KERNEL.shapes["test"], KERNEL.default_config, "fp16")


def test_inputs_and_eager() -> None:
    shape = {"M": 32, "N": 48, "K": 16}
    a = KERNEL.make_inputs(shape, "fp16", 5, "cpu")
    b = KERNEL.make_inputs(shape, "fp16", 5, "cpu")
    c = KERNEL.make_inputs(shape, "fp16", 6, "cpu")
    assert torch.equal(a["a"], b["a"]) and not torch.equal(a["a"], c["a"])
    assert a["a"].shape == (32, 16) and a["b"].shape == (16, 48)
    assert float(a["a"].abs().min()) > 0 or float(a["a"].abs().sum()) > 0  # never zeros
    ref = KERNEL.reference(a, shape)
    torch.testing.assert_close(KERNEL.eager(a, shape).float(), ref, atol=1e-2, rtol=1e-2)


def test_check_config() -> None:
    big = KERNEL.shapes["square-8192"]
    for key in ("H100", "H200", "A100", "V710"):
        assert KERNEL.check_config(KERNEL.default_config, big, spec_for_key(key)) is None, key
    base = KERNEL.default_config
    # Too much shared memory on Hopper: 5 stages of 256x64 + 64x256 tiles.
    assert "shared memory" in KERNEL.check_config(
        {**base, "BLOCK_M": 256, "BLOCK_N": 256, "BLOCK_K": 64, "num_stages": 5,
         "num_warps": 8}, big, H200)
    # The accumulator would spill: 256x256 fp32 values over 4 warps.
    assert "per thread" in KERNEL.check_config(
        {**base, "BLOCK_M": 256, "BLOCK_N": 256, "num_warps": 4}, big, H200)
    assert "AMD-only" in KERNEL.check_config({**base, "waves_per_eu": 2}, big, H200)
    assert KERNEL.check_config({**base, "waves_per_eu": 2}, big, V710) is None
    assert "power of two" in KERNEL.check_config({**base, "BLOCK_K": 48}, big, H200)
    assert "next_pow2" in KERNEL.check_config({**base, "BLOCK_M": 256}, {**big, "M": 100}, H200)
    # The grid: some configs are pruned on an H200, most run.
    space = spaces.resolve([spaces.for_kernel(KERNEL)], "nvidia", "H200")
    ok = _valid(space, big, H200)
    assert spaces.grid_size(space) == 360 and 150 <= len(ok) < 216
    assert "decode tile" in KERNEL.check_config({**base, "BLOCK_M": 32}, big, H200)


def test_cost_model() -> None:
    s = KERNEL.shapes["square-8192"]
    assert KERNEL.flops(s) == 2 * 8192**3
    assert KERNEL.bytes_moved(s, "bf16") == 3 * 8192 * 8192 * 2


# -- GPU ----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("config", [
    {},
    {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 256, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3,
     "GROUP_M": 1},
    {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 4, "num_stages": 5},
])
def test_gpu_seed_shape_bf16(device: str, config: dict) -> None:
    _check(KERNEL.shapes["square-8192"], {**KERNEL.default_config, **config}, "bf16", device)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [16, 32, 13])
def test_gpu_decode_shape_valid_configs(device: str, m: int) -> None:
    """A decode shape (m tokens through a 4096 x 4096 layer) on the GPU: configs of the
    shipped space that pass check_config there (decode tiles only: one of each tile
    shape, and eight more drawn) are right on fresh random inputs."""
    from harness.measure.hardware import current_device

    shape = {"M": m, "N": 4096, "K": 4096}
    dev = current_device()
    space = spaces.resolve([spaces.for_kernel(KERNEL)], dev.vendor, dev.key)
    ok = _valid(space, shape, dev)
    assert ok and {c["BLOCK_M"] for c in ok} <= {16, 32}
    rng = random.Random(m)
    tiles = {(c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]): c for c in rng.sample(ok, len(ok))}
    drawn = list(tiles.values())
    drawn += rng.sample([c for c in ok if c not in drawn], min(8, len(ok) - len(drawn)))
    for config in drawn:
        _check(shape, {**KERNEL.default_config, **config}, "bf16", device,
               seed=int.from_bytes(os.urandom(2), "little"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
def test_gpu_ragged_other_dtypes(device: str, dtype: str) -> None:
    _check({"M": 1000, "N": 1800, "K": 700}, KERNEL.default_config, dtype, device)


def _compile_child(cache: str, shape: dict, config: dict) -> None:
    """What a worker's compile child does: compile_only on meta tensors rebuilt from the
    inputs' skeleton (no device memory)."""
    os.environ["TRITON_CACHE_DIR"] = cache
    from harness.fleet import materialise, skeleton

    k = Matmul()
    inputs = materialise(skeleton(k.make_inputs(shape, "bf16", 0, "cpu")))
    assert inputs["a"].device.type == "meta"
    k.compile_only(inputs, shape, config)


@pytest.mark.gpu
def test_gpu_compile_only_in_another_process_fills_the_cache(tmp_path: Path,
                                                            monkeypatch) -> None:
    """What the worker's compile-ahead relies on: a child's compile_only (on meta tensors)
    writes Triton's on-disk cache, and this process's first launch of the config on real
    tensors loads it, compiling nothing (no new cache entry)."""
    cache = tmp_path / "triton-cache"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    shape = {"M": 2048, "N": 2048, "K": 2048}
    config = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4}
    ctx = multiprocessing.get_context("spawn")
    p = ctx.Process(target=_compile_child, args=(str(cache), shape, config))
    p.start()
    p.join(300)
    assert p.exitcode == 0
    before = sorted(x.name for x in cache.iterdir())
    assert before, "the child compiled nothing"
    _check(shape, config, "bf16", "cuda")
    # The first launch may add Triton's C launcher stub for the signature (a .so), never
    # a kernel binary: that would be the parent compiling again.
    added = [x for x in cache.iterdir() if x.name not in before]
    assert not [f.name for d in added for f in d.iterdir() if f.suffix in (".cubin", ".ptx")], \
        "the parent compiled again instead of loading the child's binary"
