"""grouped_gemm: every tunable value against the reference (interpreter on CPU), empty
experts and ragged tails, static pruning, shape matching, and the seed shape on a GPU."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

from harness.kernel.api import DeviceSpec, get
from harness.search import spaces
from kernels import grouped_gemm
from kernels.grouped_gemm import GroupedGemm, constraints, make_grouped_inputs

H100 = DeviceSpec(key="H100", vendor="nvidia", sm_count=132, smem_per_block=227 * 1024,
                  has_tma=True)
A100 = DeviceSpec(key="A100", vendor="nvidia", sm_count=108, smem_per_block=163 * 1024)
MI300 = DeviceSpec(key="MI300X", vendor="amd", sm_count=304, smem_per_block=64 * 1024)
CPU = DeviceSpec(key="cpu", vendor="cpu", interpreted=True)

KERNEL = GroupedGemm()
ROOT = Path(__file__).resolve().parents[1]

# Every tile choice passes check_config at this shape (N, K pad to 256), while N, K and
# every expert's rows end off the tile grid; experts 0, 2 and 5 are empty (first, middle,
# last).
COUNTS = [0, 25, 0, 90, 37, 0]
N_, K_ = 160, 160


def _shape(counts: list[int], n: int, k: int) -> dict[str, int]:
    return {"M": sum(counts), "N": n, "K": k, "E": len(counts)}


def _check(inputs: dict, shape: dict, config: dict, dtype: str) -> torch.Tensor:
    assert KERNEL.check_config(config, shape, H100) is None, config
    out = KERNEL.launcher(inputs, shape, config)()
    ref = KERNEL.reference(inputs, shape)
    assert out.dtype == inputs["a"].dtype and out.shape == ref.shape
    tol = KERNEL.tolerance(dtype, config)
    torch.testing.assert_close(out.float(), ref, atol=tol.atol, rtol=tol.rtol)
    return out


def _space_values() -> list[tuple[str, object]]:
    """(tunable, value) for every value any section of the shipped space offers."""
    raw = GroupedGemm.search_space()
    sections = [raw.get("params") or {}]
    sections += [(v or {}).get("params") or {} for v in (raw.get("vendors") or {}).values()]
    sections += [(h or {}).get("params") or {} for h in (raw.get("hardware") or {}).values()]
    seen: dict[tuple[str, object], None] = {}
    for sec in sections:
        for name, choices in sec.items():
            for c in choices or []:
                seen[(name, c)] = None
    return list(seen)


@pytest.fixture(scope="module")
def fp16_inputs() -> dict:
    return make_grouped_inputs(COUNTS, N_, K_, "fp16", seed=11, device="cpu")


@pytest.mark.parametrize("name,value", _space_values(), ids=lambda x: str(x))
def test_each_tunable_value(name: str, value: object, fp16_inputs: dict) -> None:
    """Each value of each tunable, varied alone around the default config."""
    config = {**KERNEL.default_config, name: value}
    shape = _shape(COUNTS, N_, K_)
    if name in ("waves_per_eu", "matrix_instr_nonkdim", "kpack"):
        # AMD-only: pruned elsewhere, dropped by the launcher off ROCm, so it still runs.
        assert KERNEL.check_config(config, shape, H100) is not None
        assert KERNEL.check_config(config, shape, MI300) is None
        out = KERNEL.launcher(fp16_inputs, shape, config)()
        ref = KERNEL.reference(fp16_inputs, shape)
        torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)
        return
    if name in ("TMA_STORE", "SWAP_AB") and value:
        # Options of the TMA kernels: alone they are pruned (tested below).
        assert "USE_TMA=1" in KERNEL.check_config(config, shape, H100)
        config.update(USE_TMA=1)
    if name in ("TALL_TILE", "TAIL_DEAL") and value:
        # Options of the Gluon kernel only (compiled and run in
        # tests/test_grouped_gemm_gluon.py).
        assert "GLUON=3" in KERNEL.check_config(config, shape, H100)
        return
    if name == "GLUON" and value:
        # The Gluon kernel needs Hopper's wgmma: pruned here and on the interpreter; its
        # own tests compile it for sm_90 and run it on the GPU.
        assert "wgmma" in KERNEL.check_config({**config, "USE_TMA": 1, "PERSISTENT": 1},
                                              shape, CPU)
        return
    _check(fp16_inputs, shape, config, "fp16")


@pytest.mark.parametrize("persistent", [0, 1])
@pytest.mark.parametrize("group_m", [1, 4, 8, 16])
def test_persistent_x_group_m(persistent: int, group_m: int) -> None:
    # Small tiles -> many virtual m-blocks, so the swizzle groups cross expert borders
    # and each persistent program (4 on CPU) loops over many tiles.
    counts = [33, 0, 70, 5, 0, 50]
    shape = _shape(counts, 96, 64)
    seed = group_m + 100 * persistent
    inputs = make_grouped_inputs(counts, 96, 64, "fp16", seed=seed, device="cpu")
    config = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": group_m,
              "PERSISTENT": persistent}  # fmt: skip
    _check(inputs, shape, config, "fp16")


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("persistent", [0, 1])
def test_dtypes_on_seed_test_shape(dtype: str, persistent: int) -> None:
    """bf16 runs through the UPCAST path under the interpreter; fp32 through IEEE dot."""
    shape = KERNEL.shapes["test"]
    inputs = KERNEL.make_inputs(shape, dtype, seed=3, device="cpu")
    _check(inputs, shape, {"PERSISTENT": persistent}, dtype)


@pytest.mark.parametrize("persistent", [0, 1])
def test_ragged_tails(persistent: int) -> None:
    """N, K and every expert's row count off the tile grid (masked N, K and M tails)."""
    counts = [1, 63, 65, 0, 129]
    shape = _shape(counts, 96, 80)
    inputs = make_grouped_inputs(counts, 96, 80, "fp32", seed=5, device="cpu")
    config = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 4,
              "PERSISTENT": persistent}  # fmt: skip
    _check(inputs, shape, config, "fp32")


@pytest.mark.parametrize("counts", [[0, 0, 77, 0], [40, 0, 0, 0], [0, 0, 0, 0]])
def test_empty_experts(counts: list[int]) -> None:
    shape = _shape(counts, 64, 64)
    inputs = make_grouped_inputs(counts, 64, 64, "fp16", seed=7, device="cpu")
    for p in (0, 1):
        out = _check(inputs, shape, {"BLOCK_N": 64, "PERSISTENT": p}, "fp16")
        assert out.shape == (sum(counts), 64)


def test_output_fully_written() -> None:
    """Every row is written: a NaN-poisoned output buffer comes back clean."""
    shape = KERNEL.shapes["test"]
    inputs = KERNEL.make_inputs(shape, "fp16", seed=9, device="cpu")
    for p in (0, 1):
        fn = KERNEL.launcher(inputs, shape, {"PERSISTENT": p})
        out = fn()
        out.fill_(float("nan"))
        assert fn() is out
        assert not torch.isnan(out).any()


def test_make_inputs() -> None:
    shape = KERNEL.shapes["test"]
    a = KERNEL.make_inputs(shape, "bf16", seed=1, device="cpu")
    b = KERNEL.make_inputs(shape, "bf16", seed=1, device="cpu")
    c = KERNEL.make_inputs(shape, "bf16", seed=2, device="cpu")
    assert torch.equal(a["a"], b["a"]) and torch.equal(a["w"], b["w"])
    assert a["offsets_host"] == b["offsets_host"]
    assert not torch.equal(a["a"], c["a"])
    offs = a["offsets"]
    assert offs.dtype == torch.int32 and offs.tolist() == a["offsets_host"]
    assert offs[0] == 0 and offs[-1] == shape["M"] and bool((offs[1:] >= offs[:-1]).all())
    assert a["a"].shape == (shape["M"], shape["K"]) and a["a"].dtype == torch.bfloat16
    assert a["w"].shape == (shape["E"], shape["N"], shape["K"])
    assert a["a"].abs().sum() > 0 and a["w"].abs().sum() > 0
    # Outputs are O(1) and routing is imbalanced.
    ref = KERNEL.reference(a, shape)
    assert 0.5 < ref.std().item() < 2.0
    big = KERNEL.make_inputs({"M": 4096, "N": 16, "K": 16, "E": 64}, "fp16", 0, "cpu")
    counts = torch.tensor(big["offsets_host"]).diff()
    assert counts.max() > 2 * counts.float().mean()


def test_eager_matches_reference() -> None:
    shape = _shape(COUNTS, 64, 64)
    inputs = make_grouped_inputs(COUNTS, 64, 64, "fp16", seed=2, device="cpu")
    out = KERNEL.eager(inputs, shape)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), KERNEL.reference(inputs, shape), atol=1e-2, rtol=1e-2)


@pytest.mark.slow
def test_cpu_space_all_configs_valid_and_correct() -> None:
    shape = KERNEL.shapes["test"]
    space = spaces.resolve([GroupedGemm.search_space()], "cpu", "cpu")
    inputs = KERNEL.make_inputs(shape, "fp16", seed=4, device="cpu")
    ref = KERNEL.reference(inputs, shape)
    names = list(space)
    ran = 0
    for values in itertools.product(*space.values()):
        config = dict(zip(names, values, strict=True))
        reason = KERNEL.check_config(config, shape, CPU)
        if reason is not None:
            # Only the TMA store without TMA prunes on the interpreter.
            assert "TMA_STORE" in reason, (config, reason)
            continue
        out = KERNEL.launcher(inputs, shape, config)()
        torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)
        ran += 1
    assert ran >= 16


def test_check_config() -> None:
    for shape in KERNEL.shapes.values():
        for dev in (H100, CPU, MI300):
            assert KERNEL.check_config(KERNEL.default_config, shape, dev) is None
    seed = KERNEL.shapes["deepseek-v3-16b"]
    big = {"BLOCK_M": 256, "BLOCK_N": 256, "BLOCK_K": 128, "num_stages": 5, "num_warps": 8}
    assert "shared memory" in KERNEL.check_config(big, seed, H100)
    # 256x256 fp32 accumulator over 4 warps = 512 values a thread.
    assert "per thread" in KERNEL.check_config(
        {"BLOCK_M": 256, "BLOCK_N": 256, "BLOCK_K": 32, "num_stages": 2, "num_warps": 4},
        seed,
        H100,
    )
    assert KERNEL.check_config({"BLOCK_K": 256}, KERNEL.shapes["test"], H100) is not None
    assert KERNEL.check_config({"BLOCK_N": 256}, KERNEL.shapes["test"], H100) is not None
    assert KERNEL.check_config({"BLOCK_M": 48}, seed, H100) is not None
    assert KERNEL.check_config({"kpack": 2}, seed, H100) is not None
    # Unknown keys are ignored, missing ones take the defaults.
    assert KERNEL.check_config({"SOMETHING_ELSE": 3}, seed, H100) is None


def test_shape_matching_and_cost_model() -> None:
    k = get("kernels.grouped_gemm:GroupedGemm")
    assert k.name == "grouped_gemm"
    base = {"M": 49152, "N": 1408, "K": 2048, "E": 64}
    assert k.shape_distance(base, {**base, "M": 49152}) == 0
    assert math.isclose(k.shape_distance(base, {**base, "M": 24576}), 1.0)
    assert k.shape_distance(base, {**base, "N": 2816}) == math.inf
    assert k.shape_distance(base, {**base, "E": 32}) == math.inf
    near = min([{**base, "M": 4096}, {**base, "M": 65536}], key=lambda s: k.shape_distance(base, s))
    assert near["M"] == 65536
    assert k.parse_shape_key(k.shape_key(base)) == base
    assert k.flops(base) == 2 * 49152 * 1408 * 2048
    # Only the experts that get rows are read (seed 0's routing, as the benchmark's).
    used = sum(1 for c in k.routing_counts(base, 0) if c)
    assert 48 < used < 64
    elems = 49152 * 2048 + used * 1408 * 2048 + 49152 * 1408
    assert k.bytes_moved(base, "bf16") == elems * 2 + 65 * 4
    decode = {**base, "M": 128}
    assert sum(1 for c in k.routing_counts(decode, 0) if c) < used


def test_tma_pruning() -> None:
    seed = KERNEL.shapes["deepseek-v3-16b"]
    tma = {"USE_TMA": 1}
    assert KERNEL.check_config(tma, seed, H100) is None
    assert KERNEL.check_config(tma, seed, CPU) is None  # the interpreter emulates it
    assert "TMA" in KERNEL.check_config(tma, seed, A100)
    assert "TMA" in KERNEL.check_config(tma, seed, MI300)
    assert "16-byte" in KERNEL.check_config(tma, {**seed, "K": 2052}, H100)
    assert KERNEL.check_config({"USE_TMA": 0}, seed, A100) is None


@pytest.mark.parametrize("persistent", [0, 1])
@pytest.mark.parametrize("block_k", [64, 128])
def test_tma_matches_pointer_path(persistent: int, block_k: int, fp16_inputs: dict) -> None:
    """Same tiles, same products in the same order: the TMA variant gives the same bits
    (K = 160 ends off the tile grid, so the zero-filled K tail is exercised too)."""
    shape = _shape(COUNTS, N_, K_)
    base = {**KERNEL.default_config, "PERSISTENT": persistent, "BLOCK_K": block_k}
    out_tma = _check(fp16_inputs, shape, {**base, "USE_TMA": 1}, "fp16").clone()
    out_ptr = KERNEL.launcher(fp16_inputs, shape, base)()
    assert torch.equal(out_tma, out_ptr)


@pytest.mark.parametrize("persistent", [0, 1])
@pytest.mark.parametrize("block_m", [16, 64])
def test_tma_store_matches_pointer_path(persistent: int, block_m: int,
                                        fp16_inputs: dict) -> None:
    """The TMA store of full tiles gives the pointer kernel's bits: BLOCK_M 16 makes
    most tiles full (TMA-stored) and leaves a partial last tile per expert, 64 makes
    expert 3's first tile full and its second partial; N = 160 ends inside the second
    n-tile, so the store box is clipped at N."""
    shape = _shape(COUNTS, N_, K_)
    base = {**KERNEL.default_config, "PERSISTENT": persistent, "BLOCK_M": block_m}
    cfg = {**base, "USE_TMA": 1, "TMA_STORE": 1}
    out_new = _check(fp16_inputs, shape, cfg, "fp16").clone()
    assert torch.equal(out_new, KERNEL.launcher(fp16_inputs, shape, base)())


@pytest.mark.parametrize("extra", [
    {}, {"PERSISTENT": 1}, {"TMA_STORE": 1},
    {"BLOCK_M": 128, "TAIL_SPLIT": 1},
    {"BLOCK_M": 128, "TAIL_SPLIT": 1, "PERSISTENT": 1, "TMA_STORE": 1},
], ids=str)
def test_swap_ab(extra: dict, fp16_inputs: dict) -> None:
    """SWAP_AB computes every tile height transposed (W_tile @ A_tile^T) and transposes
    it back before the store: the reference's result on ragged experts, empty ones and
    N, K off the tile grid, with the full and half tiles and the TMA store."""
    shape = _shape(COUNTS, N_, K_)
    base = {**KERNEL.default_config, "USE_TMA": 1, "BLOCK_N": 64, **extra}
    swapped = _check(fp16_inputs, shape, {**base, "SWAP_AB": 1}, "fp16")
    plain = KERNEL.launcher(fp16_inputs, shape, base)()
    # The same products summed in the same K order: only fp32 rounding may differ.
    torch.testing.assert_close(swapped, plain, atol=2e-3, rtol=2e-3)


def test_swap_ab_pruning() -> None:
    seed = KERNEL.shapes["deepseek-v3-16b"]
    assert KERNEL.check_config({"USE_TMA": 1, "SWAP_AB": 1}, seed, H100) is None
    assert "USE_TMA" in KERNEL.check_config({"SWAP_AB": 1}, seed, H100)


# A Triton TMA config of 256-row tiles (where SWAP_AB's n256 wgmma shows).
TALL_TMA = {"BLOCK_M": 256, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 8,
            "num_stages": 4, "PERSISTENT": 0, "USE_TMA": 1, "TAIL_SPLIT": 1}


def moe_cpu_inputs() -> dict:
    """Inputs of the MoE shape's routing on the CPU, uninitialised: stand-ins whose types
    and the descriptors' boxes are all a compile for sm_90 reads (nothing runs)."""
    shape = KERNEL.shapes["deepseek-v3-16b"]
    counts = KERNEL.routing_counts(shape, seed=0)
    return {"a": torch.empty(shape["M"], shape["K"], dtype=torch.bfloat16),
            "w": torch.empty(shape["E"], shape["N"], shape["K"], dtype=torch.bfloat16),
            "offsets": torch.tensor(grouped_gemm.counts_to_offsets(counts), dtype=torch.int32)}


# What a launch's meta may hold besides the kernel's own arguments: Triton's launch
# options (and the AMD ones the launcher passes on ROCm).
LAUNCH_OPTIONS = {"num_warps", "num_stages", "num_ctas", "maxnreg", *grouped_gemm.AMD_KWARGS}


def unknown_meta(configs: list[dict]) -> list[tuple[str, str]]:
    """(kernel, name) of every meta entry of the configs' launches at the MoE shape that
    is neither the kernel's argument nor a launch option: the GPU launch raises on them
    ("Keyword argument ... was specified but unrecognised"), the interpreter does not."""
    inputs = moe_cpu_inputs()
    return [(lc.fn.__name__, k) for config in configs
            for lc in KERNEL._launches(inputs, config)[0]
            for k in lc.meta if k not in lc.fn.arg_names and k not in LAUNCH_OPTIONS]


def test_launch_meta_names_only_kernel_arguments() -> None:
    """Every option a config sets reaches only kernels that take it (an option of the
    Gluon kernel that leaks into the Triton TMA kernel's launch fails it on the GPU while
    every interpreter test passes)."""
    configs = [{}, {"PERSISTENT": 1, "TAIL_SPLIT": 1, "TALL_TILE": 0},
               {**TALL_TMA, "SWAP_AB": 1, "TMA_STORE": 1},
               {**TALL_TMA, "PERSISTENT": 1, "TAIL_DEAL": 0}]
    assert unknown_meta(configs) == []


def compile_sm90(launch: grouped_gemm.Launch, source: type,
                 **options: int) -> triton.compiler.CompiledKernel:
    """``launch`` compiled for sm_90 as the launcher would run it, with no GPU: the
    signature from the arguments' own types, the constexprs from its meta; ``source``:
    triton's ASTSource, or Gluon's for a Gluon kernel."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import mangle_type

    fn = launch.fn
    sig = {name: mangle_type(v) for name, v in zip(fn.arg_names, launch.args, strict=False)}
    consts = {k: v for k, v in launch.meta.items() if k in fn.arg_names}
    sig.update({k: "constexpr" for k in consts})
    return triton.compile(source(fn, signature=sig, constexprs=consts),
                          target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": launch.meta["num_warps"], **options})


def wgmma_shapes(configs: list[dict]) -> list[list[str]]:
    """The wgmma instruction shapes (e.g. "m64n256k16") in the PTX of each config's GEMM
    launch at the MoE shape, compiled for sm_90 without a GPU (CPU tensors stand in)."""
    import re

    from triton.compiler import ASTSource

    inputs = moe_cpu_inputs()
    out = []
    for config in configs:
        launch = KERNEL._launches(inputs, config)[0][-1]
        ptx = compile_sm90(launch, ASTSource, num_stages=launch.meta["num_stages"]).asm["ptx"]
        out.append(sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)",
                                          ptx))))
    return out


@pytest.mark.slow
def test_swap_ab_puts_the_rows_on_wgmmas_n(tmp_path: Path) -> None:
    """Compiled for sm_90 (no GPU needed; a fresh process and Triton cache, so the compile
    runs and no interpreter state reaches it): with SWAP_AB a 256-row tile is
    m64n256k16, without it two m64n128k16 per warp group; its half tail n128."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    code = ("import json; from tests.test_grouped_gemm import TALL_TMA, wgmma_shapes; "
            "print(json.dumps(wgmma_shapes([TALL_TMA, {**TALL_TMA, 'SWAP_AB': 1}])))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    plain, swapped = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "m64n256k16" in swapped and "m64n256k16" not in plain
    assert "m64n128k16" in plain and "m64n128k16" in swapped


@pytest.mark.parametrize("use_tma,persistent,tma_store",
                         [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0), (1, 0, 1)])
@pytest.mark.parametrize("n", [160, 224])
def test_tail_split_halves(use_tma: int, persistent: int, tma_store: int, n: int) -> None:
    """TAIL_SPLIT=1: with 64x128 tiles, experts whose last block holds <= 32
    rows (1, 32, 97 rows) take the half-height path, 33 and 64 the full one; N = 160
    leaves a 32-wide last n-tile (the half-width path), N = 224 a 96-wide one (full,
    masked). An empty expert sits between them."""
    counts = [1, 32, 33, 0, 97, 64]
    shape = _shape(counts, n, 96)
    inputs = make_grouped_inputs(counts, n, 96, "fp32", seed=n + use_tma, device="cpu")
    config = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 32, "GROUP_M": 4, "TAIL_SPLIT": 1,
              "PERSISTENT": persistent, "USE_TMA": use_tma, "TMA_STORE": tma_store}
    out = _check(inputs, shape, config, "fp32")
    # Every row and column is written by some path (NaN-filled buffer comes back clean).
    fn = KERNEL.launcher(inputs, shape, config)
    fn().fill_(float("nan"))
    assert not torch.isnan(fn()).any()
    assert out.shape == (sum(counts), n)


@pytest.mark.parametrize("use_tma,persistent,split", [
    (0, 0, 0), (0, 1, 1), (1, 0, 1), (1, 1, 0), (1, 1, 1)])
def test_new_routing_in_the_same_offsets_buffer(use_tma: int, persistent: int,
                                                split: int) -> None:
    """Every call reads the offsets anew: the same launcher, new routing written into the
    same offsets buffer (as a CUDA graph replays it), gives the new answer; empty experts
    first, in the middle and last, tails off the grid."""
    counts = [0, 1, 70, 0, 33, 129, 0]
    shape = _shape(counts, 96, 64)
    inputs = make_grouped_inputs(counts, 96, 64, "fp32", seed=use_tma + 2 * persistent,
                                 device="cpu")
    config = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 4,
              "PERSISTENT": persistent, "USE_TMA": use_tma, "TAIL_SPLIT": split}
    _check(inputs, shape, config, "fp32")
    fn = KERNEL.launcher(inputs, shape, config)
    moved = [17, 0, 100, 33, 0, 83, 0]  # same M, rows moved between experts
    inputs["offsets"].copy_(torch.tensor(grouped_gemm.counts_to_offsets(moved)))
    inputs["offsets_host"] = grouped_gemm.counts_to_offsets(moved)
    torch.testing.assert_close(fn(), KERNEL.reference(inputs, shape), atol=1e-4, rtol=1e-4)


def test_tail_split_pruning() -> None:
    seed = KERNEL.shapes["deepseek-v3-16b"]
    half = {"USE_TMA": 1, "TAIL_SPLIT": 1, "BLOCK_N": 256, "num_warps": 8}
    assert KERNEL.check_config(half, seed, H100) is None
    assert KERNEL.check_config({**half, "USE_TMA": 0}, seed, A100) is None
    assert "below 16" in KERNEL.check_config({**half, "BLOCK_M": 16}, seed, H100)
    assert "0 or 1" in KERNEL.check_config({**half, "TAIL_SPLIT": 2}, seed, H100)


def test_tma_store_pruning() -> None:
    seed = KERNEL.shapes["deepseek-v3-16b"]
    tma = {"USE_TMA": 1, "PERSISTENT": 1}
    assert KERNEL.check_config({**tma, "TMA_STORE": 1}, seed, H100) is None
    assert "USE_TMA" in KERNEL.check_config({"TMA_STORE": 1}, seed, H100)
    assert "16-byte" in KERNEL.check_config({**tma, "TMA_STORE": 1}, {**seed, "N": 1412}, H100)
    # 128x256 tiles, 64-deep K, 4 stages: 192 KiB of pipeline fits alone, not with the
    # 64 KiB tile a TMA store keeps beside it.
    big = {**tma, "BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "num_stages": 4,
           "num_warps": 8}
    assert KERNEL.check_config(big, seed, H100) is None
    assert "shared memory" in KERNEL.check_config({**big, "TMA_STORE": 1}, seed, H100)


@pytest.mark.parametrize("name", sorted(constraints.RETIRED))
def test_retired_tunables_only_at_their_value(name: str) -> None:
    """A tunable of an earlier version of the kernel (an old pack entry or experiment
    may hold it) is accepted at the value the kernel always runs now, and refused by
    name at any other; neither the default config nor the shipped space has it."""
    seed = KERNEL.shapes["deepseek-v3-16b"]
    value = constraints.RETIRED[name]
    assert KERNEL.check_config({name: value}, seed, H100) is None
    assert f"{name} is retired" in KERNEL.check_config({name: value + 1}, seed, H100)
    assert name not in KERNEL.default_config
    assert name not in spaces.resolve([GroupedGemm.search_space()], "nvidia", "H200")


def test_tma_rejects_unaligned_layout() -> None:
    counts = [3, 5]
    inputs = make_grouped_inputs(counts, 32, 36, "fp16", seed=2, device="cpu")  # 72-byte rows
    with pytest.raises(ValueError, match="16-byte"):
        KERNEL.launcher(inputs, _shape(counts, 32, 36), {"USE_TMA": 1})


def test_baselines_cpu(fp16_inputs: dict) -> None:
    shape = _shape(COUNTS, N_, K_)
    ref = KERNEL.reference(fp16_inputs, shape)
    bl = KERNEL.baselines()
    dense = bl[grouped_gemm.DENSE_BOUND](fp16_inputs, shape)()
    assert dense.shape == ref.shape  # same shape and FLOPs, different numbers
    if "torch._grouped_mm" in bl:
        try:
            out = bl["torch._grouped_mm"](fp16_inputs, shape)()
        except (RuntimeError, NotImplementedError) as exc:  # no CPU kernel in this torch
            pytest.skip(f"grouped_mm has no CPU path here: {exc}")
        torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)


# -- GPU ---------------------------------------------------------------------------------

GPU_CONFIGS = [
    {},
    {"PERSISTENT": 1},
    {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8,
     "num_stages": 3, "PERSISTENT": 0},
    {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 16, "num_warps": 8,
     "num_stages": 3, "PERSISTENT": 1},
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 4,
     "num_stages": 4, "PERSISTENT": 0},
    {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 4, "num_warps": 4,
     "num_stages": 2, "PERSISTENT": 1},
    {"BLOCK_M": 256, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8,
     "num_stages": 3, "PERSISTENT": 0},
    {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 8,
     "num_stages": 4, "PERSISTENT": 1, "TAIL_SPLIT": 1},
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 4,
     "num_stages": 3, "PERSISTENT": 0, "TAIL_SPLIT": 1},
]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("config", GPU_CONFIGS, ids=lambda c: str(sorted(c.items())))
def test_gpu_seed_shape_bf16(device: str, config: dict) -> None:
    shape = KERNEL.shapes["deepseek-v3-16b"]
    inputs = KERNEL.make_inputs(shape, "bf16", seed=0, device=device)
    ref = KERNEL.reference(inputs, shape)
    fn = KERNEL.launcher(inputs, shape, config)
    out = fn()
    out.fill_(float("nan"))  # every element must be written by the next launch
    assert fn() is out
    torch.cuda.synchronize()
    assert not torch.isnan(out).any()
    tol = KERNEL.tolerance("bf16", config)
    torch.testing.assert_close(out.float(), ref, atol=tol.atol, rtol=tol.rtol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
@pytest.mark.parametrize("persistent", [0, 1])
def test_gpu_other_dtypes_and_empty_experts(device: str, dtype: str, persistent: int) -> None:
    counts = [0, 3000, 1, 0, 777, 12000, 0, 129] * 8  # E = 64, empty and tiny experts
    shape = _shape(counts, 1408, 2048)
    inputs = make_grouped_inputs(counts, 1408, 2048, dtype, seed=1, device=device)
    config = {"PERSISTENT": persistent, "BLOCK_N": 256, "num_warps": 8}  # N tail at 1408
    if dtype == "fp32":
        config.update(BLOCK_K=32, num_stages=2)
    out = _check(inputs, shape, config, dtype)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(
        KERNEL.eager(inputs, shape).float(), KERNEL.reference(inputs, shape), atol=2e-2, rtol=2e-2
    )


TMA_CONFIGS = [
    {"USE_TMA": 1, "PERSISTENT": 0},
    {"USE_TMA": 1, "PERSISTENT": 1},
    {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 32, "GROUP_M": 1, "num_warps": 8,
     "num_stages": 4, "PERSISTENT": 1, "USE_TMA": 1},
    {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8,
     "num_stages": 3, "PERSISTENT": 0, "USE_TMA": 1},
    {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 4, "num_warps": 4,
     "num_stages": 3, "PERSISTENT": 1, "USE_TMA": 1},
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4,
     "num_stages": 5, "PERSISTENT": 1, "USE_TMA": 1, "TMA_STORE": 1},
    {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 32, "GROUP_M": 1, "num_warps": 8,
     "num_stages": 3, "PERSISTENT": 0, "USE_TMA": 1, "TMA_STORE": 1},
    # Half tiles: 1408 = 5 x 256 + 128 (the last n-tile half-width); 256-row blocks leave
    # many experts' last block at <= 128 rows (half-height).
    {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8,
     "num_stages": 3, "PERSISTENT": 0, "USE_TMA": 1, "TAIL_SPLIT": 1, "TMA_STORE": 1},
    {"BLOCK_M": 256, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 8,
     "num_stages": 3, "PERSISTENT": 0, "USE_TMA": 1, "TAIL_SPLIT": 1},
    {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8,
     "num_stages": 3, "PERSISTENT": 1, "USE_TMA": 1, "TAIL_SPLIT": 1},
    # Tiles computed transposed, with the TMA store and 3 stages, and persistent.
    {**TALL_TMA, "SWAP_AB": 1},
    {**TALL_TMA, "SWAP_AB": 1, "TMA_STORE": 1, "num_stages": 3},
    {**TALL_TMA, "PERSISTENT": 1, "GROUP_M": 8, "SWAP_AB": 1},
    # The H200 pack's small-M configs (M = 128 and 3,072).
    {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4,
     "num_stages": 4, "USE_TMA": 1},
    {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 4,
     "num_stages": 4, "USE_TMA": 1},
]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("config", TMA_CONFIGS, ids=lambda c: str(sorted(c.items())))
def test_gpu_tma_seed_shape_bf16(device: str, config: dict) -> None:
    from harness.measure import hardware

    spec = hardware.current_device()
    if not spec.has_tma:
        pytest.skip("no TMA on this GPU")
    shape = KERNEL.shapes["deepseek-v3-16b"]
    assert KERNEL.check_config(config, shape, spec) is None
    inputs = KERNEL.make_inputs(shape, "bf16", seed=0, device=device)
    ref = KERNEL.reference(inputs, shape)
    fn = KERNEL.launcher(inputs, shape, config)
    out = fn()
    out.fill_(float("nan"))  # every element must be written by the next launch
    assert fn() is out
    torch.cuda.synchronize()
    assert not torch.isnan(out).any()
    tol = KERNEL.tolerance("bf16", config)
    torch.testing.assert_close(out.float(), ref, atol=tol.atol, rtol=tol.rtol)


@pytest.mark.gpu
@pytest.mark.parametrize("extra", [{}, {"TMA_STORE": 1}, {"TAIL_SPLIT": 1, "PERSISTENT": 0},
                                   {"TAIL_SPLIT": 1, "SWAP_AB": 1},
                                   {"TAIL_SPLIT": 1, "BLOCK_M": 256, "SWAP_AB": 1,
                                    "PERSISTENT": 0}],
                         ids=str)
def test_gpu_tma_empty_experts_and_compile_only(device: str, extra: dict) -> None:
    counts = [0, 3000, 1, 0, 777, 12000, 0, 129] * 8
    shape = _shape(counts, 1408, 2048)
    inputs = make_grouped_inputs(counts, 1408, 2048, "bf16", seed=1, device=device)
    config = {"USE_TMA": 1, "PERSISTENT": 1, "BLOCK_N": 256, "num_warps": 8, **extra}
    out = KERNEL.launcher(inputs, shape, config)()
    torch.testing.assert_close(out.float(), KERNEL.reference(inputs, shape), atol=2e-2, rtol=2e-2)
    meta = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
    KERNEL.compile_only(meta, shape, {**config, "PERSISTENT": 0})


@pytest.mark.gpu
@pytest.mark.parametrize("counts", [None, [0, 3000, 1, 0, 777, 12000, 0, 129] * 8],
                         ids=["moe-shape", "ragged"])
def test_gpu_this_gpus_pack(device: str, counts: list[int] | None) -> None:
    """Every grouped_gemm config this GPU's shipped pack holds, at the MoE shape's
    routing and on ragged experts (empty, one-row, 12k-row): each element written, within
    the kernel's tolerance. A pack entry is what applications run without tuning, and a
    grid can freeze a config no listed GPU test has run."""
    from harness import packs
    from harness.measure import hardware

    spec = hardware.current_device()
    pack, _ = packs.load(spec.key, "grouped_gemm")
    if pack is None:
        pytest.skip(f"no grouped_gemm pack for {spec.key}")
    configs = [e["config"] for by_dtype in pack["kernels"].values()
               for by_shape in by_dtype.values() for e in by_shape.values()]
    shape = KERNEL.shapes["deepseek-v3-16b"]
    if counts is None:
        inputs = KERNEL.make_inputs(shape, "bf16", seed=3, device=device)
    else:
        shape = _shape(counts, shape["N"], shape["K"])
        inputs = make_grouped_inputs(counts, shape["N"], shape["K"], "bf16", seed=4,
                                     device=device)
    ref = KERNEL.reference(inputs, shape)
    for config in configs:
        full = {**KERNEL.default_config, **config}
        assert KERNEL.check_config(full, shape, spec) is None, config
        fn = KERNEL.launcher(inputs, shape, full)
        out = fn()
        out.fill_(float("nan"))
        assert fn() is out
        torch.cuda.synchronize()
        assert not torch.isnan(out).any(), config
        tol = KERNEL.tolerance("bf16", full)
        torch.testing.assert_close(out.float(), ref, atol=tol.atol, rtol=tol.rtol)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [128, 49152])
def test_gpu_baselines(device: str, m: int) -> None:
    shape = {**KERNEL.shapes["deepseek-v3-16b"], "M": m}
    inputs = KERNEL.make_inputs(shape, "bf16", seed=3, device=device)
    ref = KERNEL.reference(inputs, shape)
    bl = KERNEL.baselines()
    dense = bl[grouped_gemm.DENSE_BOUND](inputs, shape)()
    assert dense.shape == ref.shape
    if "torch._grouped_mm" not in bl:
        pytest.skip("this torch has no grouped_mm")
    out = bl["torch._grouped_mm"](inputs, shape)()
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("use_tma", [0, 1])
def test_gpu_in_a_cuda_graph(device: str, use_tma: int) -> None:
    """The launch captures into a CUDA graph (what MoE serving does); a replay after the
    routing changed in the same offsets buffer gives the new answer."""
    from harness.measure import hardware

    if use_tma and not hardware.current_device().has_tma:
        pytest.skip("no TMA on this GPU")
    counts = [0, 3000, 1, 0, 777, 12000, 0, 129] * 8
    moved = counts[1:] + counts[:1]  # same M, the rows moved between experts
    shape = _shape(counts, 1408, 2048)
    inputs = make_grouped_inputs(counts, 1408, 2048, "bf16", seed=5, device=device)
    config = {"BLOCK_M": 256, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3,
              "USE_TMA": use_tma, "TAIL_SPLIT": 1}
    fn = KERNEL.launcher(inputs, shape, config)
    fn()  # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    for cnts in (counts, moved):
        offs = grouped_gemm.counts_to_offsets(cnts)
        inputs["offsets"].copy_(torch.tensor(offs, dtype=torch.int32))
        inputs["offsets_host"] = offs
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), KERNEL.reference(inputs, shape),
                                   atol=2e-2, rtol=2e-2)
