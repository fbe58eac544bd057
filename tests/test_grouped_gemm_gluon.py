"""grouped_gemm GLUON=3 (the warp-specialized persistent Gluon kernel for Hopper): pruning,
its compile for sm_90 without a GPU (what CI can check of it), and on a Hopper GPU its
outputs against the reference at the MoE shape, with empty experts, an empty problem and
in a CUDA graph."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

from harness.kernel.api import DeviceSpec
from kernels import grouped_gemm
from kernels.grouped_gemm import GroupedGemm, make_grouped_inputs
from tests.test_grouped_gemm import compile_sm90, moe_cpu_inputs, unknown_meta

ROOT = Path(__file__).resolve().parent.parent
KERNEL = GroupedGemm()
H100 = DeviceSpec(key="H100", vendor="nvidia", sm_count=132, smem_per_block=227 * 1024,
                  has_tma=True, has_wgmma=True)
A100 = DeviceSpec(key="A100", vendor="nvidia", sm_count=108, smem_per_block=163 * 1024)
CPU = DeviceSpec(key="cpu", vendor="cpu", interpreted=True)
MOE = KERNEL.shapes["deepseek-v3-16b"]

# The engine's fixed part: TMA loads, persistent.
BASE = {"GLUON": 3, "USE_TMA": 1, "PERSISTENT": 1, "BLOCK_K": 64}
# Its two shapes: ping-pong (two consumers on 128x128 tiles) and cooperative (one
# consumer of two warp groups on 256x128 tiles).
PP = {**BASE, "BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 4}
COOP = {**BASE, "BLOCK_M": 256, "BLOCK_N": 128, "num_warps": 8}
CONFIGS = [
    {**PP, "num_stages": 4, "GROUP_M": 1, "TAIL_SPLIT": 1, "TMA_STORE": 1},
    {**PP, "num_stages": 5, "GROUP_M": 8, "TAIL_SPLIT": 0},
    {**BASE, "BLOCK_M": 64, "BLOCK_N": 256, "BLOCK_K": 32, "num_warps": 4,
     "num_stages": 6, "GROUP_M": 4, "TAIL_SPLIT": 0, "TMA_STORE": 1},
    {**COOP, "num_stages": 3, "GROUP_M": 1, "TAIL_SPLIT": 1, "TMA_STORE": 1},
    {**BASE, "BLOCK_M": 128, "BLOCK_N": 256, "num_warps": 8, "num_stages": 3,
     "GROUP_M": 1, "TAIL_SPLIT": 1},
    # Every tile transposed (SWAP_AB, cuBLAS's form here): cooperative 256-row tiles and
    # ping-pong 128-row tiles (the H200 pack's config at M=12,288).
    {**COOP, "num_stages": 3, "GROUP_M": 1, "TAIL_SPLIT": 1, "TMA_STORE": 1, "SWAP_AB": 1},
    {**PP, "num_stages": 5, "GROUP_M": 1, "TAIL_SPLIT": 1, "SWAP_AB": 1},
    # Each wave's half tiles dealt round-robin to the programs (TAIL_DEAL).
    {**PP, "num_stages": 5, "GROUP_M": 1, "TAIL_SPLIT": 1, "TMA_STORE": 1, "SWAP_AB": 1,
     "TAIL_DEAL": 1},
    {**PP, "num_stages": 4, "GROUP_M": 1, "TAIL_SPLIT": 1, "TAIL_DEAL": 1},
    # Tall tiles (1.5 blocks, two accumulators a consumer), dealt (the packs' config at
    # M >= 32,768) or not.
    {**PP, "num_stages": 4, "GROUP_M": 1, "TAIL_SPLIT": 1, "TMA_STORE": 1, "SWAP_AB": 1,
     "TALL_TILE": 1, "TAIL_DEAL": 1},
    {**PP, "num_stages": 4, "GROUP_M": 4, "TAIL_SPLIT": 0, "SWAP_AB": 1, "TALL_TILE": 1},
]  # fmt: skip

needs_gluon = pytest.mark.skipif(grouped_gemm._gluon is None,
                                 reason=f"Triton {triton.__version__} has no Gluon Hopper API")


@needs_gluon
def test_pruning() -> None:
    """GLUON=3: Hopper's wgmma, TMA, persistent; one warp group per consumer
    (num_warps=4, two consumers) or one consumer of two (num_warps=8); accumulators that
    fit a consumer's registers, the ring and the staging tiles in shared memory."""
    cfg = CONFIGS[0]
    assert KERNEL.check_config(cfg, MOE, H100) is None
    assert KERNEL.check_config(cfg, {**MOE, "K": 128}, H100) is None
    for dev in (CPU, dataclasses.replace(H100, has_wgmma=False)):
        assert "wgmma" in KERNEL.check_config(cfg, MOE, dev)
    assert KERNEL.check_config(cfg, MOE, A100) is not None  # no TMA, no wgmma
    for key in ("USE_TMA", "PERSISTENT"):
        assert "needs USE_TMA=1 and PERSISTENT=1" in KERNEL.check_config(
            {**cfg, "TMA_STORE": 0, key: 0}, MOE, H100)
    for engine in (1, 2, 4, 5):
        assert f"GLUON={engine}" in KERNEL.check_config({**cfg, "GLUON": engine}, MOE, H100)
    assert "num_warps=16" in KERNEL.check_config({**cfg, "num_warps": 16}, MOE, H100)
    assert "num_stages" in KERNEL.check_config({**cfg, "num_stages": 1}, MOE, H100)
    assert "registers" in KERNEL.check_config({**cfg, "BLOCK_N": 256}, MOE, H100)
    assert "multiple of 64" in KERNEL.check_config({**cfg, "BLOCK_N": 32}, MOE, H100)
    # 5 stages of 32 KB and two 32 KB staging tiles fit in 227 KB; 6 do not.
    assert KERNEL.check_config({**cfg, "num_stages": 5}, MOE, H100) is None
    assert "shared memory" in KERNEL.check_config({**cfg, "num_stages": 6}, MOE, H100)
    # One consumer of two warp groups: one staging tile.
    coop = CONFIGS[3]
    assert KERNEL.check_config(coop, MOE, H100) is None
    assert "shared memory" in KERNEL.check_config({**coop, "num_stages": 4}, MOE, H100)
    # Full tiles below 64 rows only transposed (SWAP_AB), and no half tile below 16 rows.
    assert "64 rows" in KERNEL.check_config({**cfg, "BLOCK_M": 32, "TAIL_SPLIT": 0}, MOE, H100)
    assert KERNEL.check_config({**cfg, "BLOCK_M": 32, "TAIL_SPLIT": 0, "SWAP_AB": 1}, MOE,
                               H100) is None
    assert "below 16" in KERNEL.check_config({**cfg, "BLOCK_M": 16, "SWAP_AB": 1}, MOE, H100)
    # Transposed tiles put BLOCK_N on wgmma's M: with two warp groups, a multiple of 128.
    swap8 = {**coop, "SWAP_AB": 1}
    assert KERNEL.check_config(swap8, MOE, H100) is None
    assert "of 128" in KERNEL.check_config({**swap8, "BLOCK_N": 64}, MOE, H100)
    # Tall tiles: ping-pong, transposed, two accumulators within a consumer's registers,
    # half a block more of A in every slot (4 stages and two staging tiles fit).
    tall = {**cfg, "SWAP_AB": 1, "TALL_TILE": 1}
    assert KERNEL.check_config(tall, MOE, H100) is None
    assert "shared memory" in KERNEL.check_config({**tall, "num_stages": 5}, MOE, H100)
    for bad in ({"num_warps": 8}, {"SWAP_AB": 0}):
        assert "needs num_warps=4 and SWAP_AB=1" in KERNEL.check_config({**tall, **bad}, MOE,
                                                                        H100)
    assert "accumulator registers" in KERNEL.check_config({**tall, "BLOCK_N": 256}, MOE, H100)
    assert "TALL_TILE=1 needs GLUON=3" in KERNEL.check_config({**tall, "GLUON": 0}, MOE, H100)
    # Dealt half tiles: by stride, GROUP_M=1, half tails; tall tiles or not.
    deal = {**cfg, "GROUP_M": 1, "TAIL_DEAL": 1}
    assert KERNEL.check_config(deal, MOE, H100) is None
    assert KERNEL.check_config({**deal, **tall}, MOE, H100) is None
    for wrong in ({"GROUP_M": 4}, {"TAIL_SPLIT": 0}, {"GLUON": 0}):
        assert "TAIL_DEAL=1 needs" in KERNEL.check_config({**deal, **wrong}, MOE, H100)
    assert "0 or 1" in KERNEL.check_config({**deal, "TAIL_DEAL": 2}, MOE, H100)
    assert "0 or 1" in KERNEL.check_config({**tall, "TALL_TILE": 2}, MOE, H100)
    assert "0 or 1" in KERNEL.check_config({**cfg, "TAIL_SPLIT": 2}, MOE, H100)


def test_pruned_without_gluon(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Triton without Gluon's Hopper API prunes the engine with its version, and the
    launcher says why instead of failing on an attribute."""
    monkeypatch.setattr(grouped_gemm, "_gluon", None)
    monkeypatch.setattr(grouped_gemm, "_GLUON_MISSING", "ImportError: no gluon")
    assert "cannot run the Gluon kernel" in KERNEL.check_config(CONFIGS[0], MOE, H100)
    inputs = make_grouped_inputs([70, 0, 60], 64, 64, "bf16", seed=0, device="cpu")
    with pytest.raises(RuntimeError, match="cannot run the Gluon kernel"):
        KERNEL.launcher(inputs, {"M": 130, "N": 64, "K": 64, "E": 3}, CONFIGS[0])


@needs_gluon
def test_rejects_fp32() -> None:
    inputs = make_grouped_inputs([70, 0, 60], 64, 64, "fp32", seed=0, device="cpu")
    with pytest.raises(ValueError, match="bf16 or fp16"):
        KERNEL.launcher(inputs, {"M": 130, "N": 64, "K": 64, "E": 3}, CONFIGS[0])


@needs_gluon
def test_launch_meta_names_only_kernel_arguments() -> None:
    """The Gluon kernel's launches pass only arguments it takes."""
    assert unknown_meta(CONFIGS) == []


def sm90_features(configs: list[dict]) -> list[dict]:
    """Each config's GEMM launch at the MoE shape, as the launcher builds it (CPU tensors
    stand in: only their types and the descriptors' boxes reach the compiler), compiled
    for sm_90: its launch names and grid, and what its PTX holds."""
    from triton.experimental.gluon._runtime import GluonASTSource

    inputs = moe_cpu_inputs()
    out = []
    for config in configs:
        launches, _ = KERNEL._launches(inputs, config)
        ptx = compile_sm90(launches[-1], GluonASTSource).asm["ptx"]
        out.append({
            "launches": [lc.fn.__name__ for lc in launches], "grid": list(launches[-1].grid),
            "wgmma": sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)",
                                           ptx))),
            "tma_load": bool(re.search(r"cp\.async\.bulk\.tensor\.2d\.shared::\w+\.global", ptx)),
            "tma_store": bool(re.search(r"cp\.async\.bulk\.tensor\.2d\.global\.shared", ptx)),
            "setmaxnreg": sorted({int(n) for n in re.findall(r"setmaxnreg\.\w+\.sync\.aligned"
                                                              r"\.u32\s+(\d+)", ptx)}),
            "threads": int(re.search(r"\.reqntid (\d+)", ptx).group(1))
            if ".reqntid" in ptx else None,
        })
    return out


# The configs compiled for sm_90 on the CPU, one per code path: ping-pong and cooperative
# tiles, 64x256 tiles, SWAP_AB (cooperative), TAIL_DEAL without SWAP_AB, tall tiles with
# and without TMA stores. (A compile takes seconds; the GPU tests run all of CONFIGS.)
SM90_CHECKED = [0, 2, 3, 5, 8, 9, 10]


@pytest.fixture(scope="module")
def compiled_sm90(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """``sm90_features`` of the SM90_CHECKED configs, from a fresh process and an empty
    Triton cache: the compile really runs (a cache hit would skip it), and no state of
    this process's earlier tests reaches it (after the interpreter-run tests of
    test_grouped_gemm.py, an in-process Gluon compile failed on Triton 3.9 with
    "'block_argument' object has no attribute 'dtype'"; alone it compiles)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton-cache"))
    code = ("import json; from tests.test_grouped_gemm_gluon import CONFIGS, SM90_CHECKED, "
            "sm90_features; print(json.dumps(sm90_features([CONFIGS[i] for i in SM90_CHECKED])))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@needs_gluon
@pytest.mark.parametrize("i", SM90_CHECKED, ids=lambda i: str(sorted(CONFIGS[i].items())))
def test_compiles_for_sm90_without_a_gpu(i: int, compiled_sm90: list[dict]) -> None:
    """The launch the launcher would run at the MoE shape builds for sm_90 into TMA loads
    and wgmma; with TMA_STORE, TMA stores too."""
    config = CONFIGS[i]
    assert KERNEL.check_config(config, MOE, H100) is None
    got = compiled_sm90[SM90_CHECKED.index(i)]
    assert got["launches"] == ["grouped_gemm_gluon_ws_kernel"]
    assert got["grid"] == [4]  # one program per SM; the CPU stands in with 4
    assert got["wgmma"] and got["tma_load"]
    assert got["tma_store"] == bool(config.get("TMA_STORE"))
    if config.get("SWAP_AB"):
        # Every tile transposed: each height's rows on wgmma's N, the full tile's too
        # (n256 for cooperative 256-row tiles, as cuBLAS's kernel here).
        want = {f"m64n{config['BLOCK_M'] >> h}k16" for h in range(config["TAIL_SPLIT"] + 1)}
        if config.get("TALL_TILE"):
            want.add(f"m64n{config['BLOCK_M'] // 2}k16")  # a tall tile's second half
        assert set(got["wgmma"]) == want
    else:
        assert f"m64n{config['BLOCK_N']}k16" in got["wgmma"]
    # Three warp groups (two consumers or one of two, and the producer warp); the
    # producer gives its registers to the consumers.
    assert got["threads"] == 384
    assert 40 in got["setmaxnreg"]
    if config["num_warps"] == 4:
        assert 232 in got["setmaxnreg"]


# -- on a Hopper GPU -----------------------------------------------------------------------


def _hopper() -> DeviceSpec:
    from harness.measure import hardware

    spec = hardware.current_device()
    if not spec.has_wgmma:
        pytest.skip(f"GLUON needs Hopper's wgmma, not {spec.key}")
    return spec


def _check_filled(fn, inputs: dict, shape: dict) -> None:
    """Every element written (NaN-filled before the launch) and within bf16 tolerance."""
    out = fn()
    out.fill_(float("nan"))
    assert fn() is out
    torch.cuda.synchronize()
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), KERNEL.reference(inputs, shape), atol=2e-2,
                               rtol=2e-2)


@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: str(sorted(c.items())))
def test_gpu_moe_shape(device: str, config: dict) -> None:
    assert KERNEL.check_config(config, MOE, _hopper()) is None
    inputs = KERNEL.make_inputs(MOE, "bf16", seed=0, device=device)
    _check_filled(KERNEL.launcher(inputs, MOE, config), inputs, MOE)


@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize("counts", [
    [0, 3000, 1, 0, 777, 12000, 0, 129] * 8,  # empty, one-row and 12k-row experts
    [64, 128, 192, 256, 320, 65, 63, 255],  # on and off every tile height
    [0] * 8,  # no rows at all
], ids=["ragged", "edges", "empty"])
def test_gpu_empty_experts_and_compile_only(device: str, counts: list[int]) -> None:
    _hopper()
    shape = {"M": sum(counts), "N": 1408, "K": 2048, "E": len(counts)}
    inputs = make_grouped_inputs(counts, 1408, 2048, "bf16", seed=1, device=device)
    for config in CONFIGS:
        fn = KERNEL.launcher(inputs, shape, config)
        if shape["M"]:
            _check_filled(fn, inputs, shape)
        else:
            assert fn().shape == (0, 1408)
    meta = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
    KERNEL.compile_only(meta, shape, CONFIGS[1])


@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize("i", [0, 3, 6, 7, 9, 10])
def test_gpu_in_a_cuda_graph(device: str, i: int) -> None:
    """The launch captures into a CUDA graph; a replay after the routing changed in the
    same offsets buffer gives the new answer."""
    _hopper()
    counts = [0, 3000, 1, 0, 777, 12000, 0, 129] * 8
    moved = counts[1:] + counts[:1]
    shape = {"M": sum(counts), "N": 1408, "K": 2048, "E": len(counts)}
    inputs = make_grouped_inputs(counts, 1408, 2048, "bf16", seed=5, device=device)
    fn = KERNEL.launcher(inputs, shape, CONFIGS[i])
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    inputs["offsets"].copy_(torch.tensor(grouped_gemm.counts_to_offsets(moved),
                                         dtype=torch.int32))
    inputs["offsets_host"] = grouped_gemm.counts_to_offsets(moved)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), KERNEL.reference(inputs, shape), atol=2e-2,
                               rtol=2e-2)
