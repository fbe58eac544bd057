"""grouped_gemm GLUON=1-4 (the persistent Gluon kernels for Hopper; 3-4 warp-specialized):
pruning, their compile for sm_90 without a GPU (what CI can check of them), and on a Hopper
GPU their outputs against the reference at the MoE shape, with empty experts, an empty
problem and in a CUDA graph."""

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

from harness.kernel_api import DeviceSpec
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

# The engine's fixed part: the table's tiles, TMA loads, persistent.
BASE = {"GLUON": 1, "USE_TMA": 1, "PERSISTENT": 1, "BLOCK_TABLE": 1, "BLOCK_K": 64}
# The warp-specialized engine's two shapes: ping-pong (two consumers on 128x128 tiles)
# and cooperative (one consumer of two warp groups on 256x128 tiles).
PP = {**BASE, "GLUON": 3, "BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 4}
COOP = {**BASE, "GLUON": 3, "BLOCK_M": 256, "BLOCK_N": 128, "num_warps": 8}
CONFIGS = [
    {**BASE, "BLOCK_M": 256, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3, "GROUP_M": 1,
     "TAIL_SPLIT": 2, "TMA_STORE": 1},
    {**BASE, "BLOCK_M": 256, "BLOCK_N": 128, "BLOCK_K": 32, "num_warps": 8, "num_stages": 6,
     "GROUP_M": 8, "TAIL_SPLIT": 2, "TAIL_WINDOW": 4},
    {**BASE, "BLOCK_M": 256, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3, "GROUP_M": 1,
     "TAIL_SPLIT": 0, "TMA_STORE": 1},
    {**BASE, "BLOCK_M": 128, "BLOCK_N": 256, "num_warps": 8, "num_stages": 3, "GROUP_M": 4,
     "TAIL_SPLIT": 1, "TMA_STORE": 1},
    {**BASE, "BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 4, "num_stages": 2, "GROUP_M": 8,
     "TAIL_SPLIT": 1},
    # Tiles taken from a counter as programs free up.
    {**BASE, "GLUON": 2, "BLOCK_M": 256, "BLOCK_N": 128, "BLOCK_K": 32, "num_warps": 8,
     "num_stages": 6, "GROUP_M": 1, "TAIL_SPLIT": 2, "TMA_STORE": 1},
    {**BASE, "GLUON": 2, "BLOCK_M": 128, "BLOCK_N": 256, "num_warps": 8, "num_stages": 3,
     "GROUP_M": 8, "TAIL_SPLIT": 1, "TAIL_WINDOW": 4},
    # Warp-specialized: a producer warp, two consumer warp groups on alternate tiles.
    {**PP, "num_stages": 4, "GROUP_M": 1, "TAIL_SPLIT": 1, "TMA_STORE": 1},
    {**PP, "num_stages": 5, "GROUP_M": 8, "TAIL_SPLIT": 0, "TAIL_WINDOW": 0},
    {**BASE, "GLUON": 3, "BLOCK_M": 64, "BLOCK_N": 256, "BLOCK_K": 32, "num_warps": 4,
     "num_stages": 6, "GROUP_M": 4, "TAIL_SPLIT": 0, "TMA_STORE": 1},
    # ... with the tiles from a counter, handed to the consumers by the producer.
    {**PP, "GLUON": 4, "num_stages": 5, "GROUP_M": 1, "TAIL_SPLIT": 1, "TMA_STORE": 1},
    {**PP, "GLUON": 4, "num_stages": 3, "GROUP_M": 8, "TAIL_SPLIT": 0},
    # Tails below 64 rows transposed: quarters (32 rows), and the table's fine pieces.
    {**PP, "num_stages": 4, "GROUP_M": 1, "TAIL_SPLIT": 2, "TAIL_FINE": 2, "TMA_STORE": 1},
    {**PP, "GLUON": 4, "num_stages": 5, "GROUP_M": 4, "TAIL_SPLIT": 2, "TAIL_FINE": 1},
    {**BASE, "GLUON": 3, "BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 4,
     "num_stages": 6, "GROUP_M": 1, "TAIL_SPLIT": 2, "TMA_STORE": 1},
    # Outputs stored from registers: no staging tiles, so more stages fit.
    {**PP, "num_stages": 6, "GROUP_M": 1, "TAIL_SPLIT": 2, "TAIL_FINE": 2, "DIRECT_STORE": 1},
    {**BASE, "GLUON": 3, "BLOCK_M": 128, "BLOCK_N": 256, "num_warps": 8, "num_stages": 4,
     "GROUP_M": 1, "TAIL_SPLIT": 1, "DIRECT_STORE": 1},
    # One consumer of two warp groups splitting each tile (cooperative), and its quarters.
    {**COOP, "num_stages": 3, "GROUP_M": 1, "TAIL_SPLIT": 2, "TMA_STORE": 1},
    {**BASE, "GLUON": 4, "BLOCK_M": 256, "BLOCK_N": 128, "BLOCK_K": 32, "num_warps": 8,
     "num_stages": 6, "GROUP_M": 4, "TAIL_SPLIT": 1},
    # Every tile transposed (SWAP_AB, cuBLAS's form here): cooperative 256-row tiles down
    # to 16-row tails, and ping-pong 128-row tiles.
    {**COOP, "num_stages": 3, "GROUP_M": 1, "TAIL_SPLIT": 2, "TAIL_FINE": 2, "TMA_STORE": 1,
     "SWAP_AB": 1},
    {**COOP, "GLUON": 4, "num_stages": 4, "GROUP_M": 1, "TAIL_SPLIT": 2, "TAIL_FINE": 1,
     "DIRECT_STORE": 1, "SWAP_AB": 1},
    {**PP, "num_stages": 5, "GROUP_M": 1, "TAIL_SPLIT": 1, "TMA_STORE": 1, "SWAP_AB": 1},
    # An expert's one tail piece at the least height that holds it (TAIL_SPLIT=1 with
    # TAIL_FINE): 128 rows down to 32, or 64 down to 16.
    {**COOP, "GLUON": 4, "num_stages": 3, "GROUP_M": 1, "TAIL_SPLIT": 1, "TAIL_FINE": 2,
     "TMA_STORE": 1, "SWAP_AB": 1},
    {**PP, "num_stages": 5, "GROUP_M": 1, "TAIL_SPLIT": 1, "TAIL_FINE": 2, "TMA_STORE": 1,
     "SWAP_AB": 1},
    # No block table (GLUON=3): every partition finds its tiles' experts from the
    # offsets; full tiles and half tails, transposed or not.
    {**PP, "num_stages": 5, "GROUP_M": 1, "TAIL_SPLIT": 1, "TMA_STORE": 1, "SWAP_AB": 1,
     "BLOCK_TABLE": 0},
    {**PP, "num_stages": 4, "GROUP_M": 4, "TAIL_SPLIT": 0, "BLOCK_TABLE": 0},
    # ... and each wave's half tiles dealt round-robin to the programs (TAIL_DEAL).
    {**PP, "num_stages": 5, "GROUP_M": 1, "TAIL_SPLIT": 1, "TMA_STORE": 1, "SWAP_AB": 1,
     "BLOCK_TABLE": 0, "TAIL_DEAL": 1},
    {**PP, "num_stages": 4, "GROUP_M": 1, "TAIL_SPLIT": 1, "BLOCK_TABLE": 0, "TAIL_DEAL": 1},
    # ... and an expert's short tail as one piece of the least height (TAIL_FINE).
    {**PP, "num_stages": 5, "GROUP_M": 1, "TAIL_SPLIT": 1, "TAIL_FINE": 2, "TMA_STORE": 1,
     "SWAP_AB": 1, "BLOCK_TABLE": 0, "TAIL_DEAL": 1},
    {**PP, "num_stages": 4, "GROUP_M": 4, "TAIL_SPLIT": 1, "TAIL_FINE": 1, "BLOCK_TABLE": 0},
    # ... and tall tiles without the table: an expert's rows in tiles of 1.5 blocks, then
    # one tile of at most a block (full, half or finer), dealt or not.
    {**PP, "num_stages": 4, "GROUP_M": 1, "TAIL_SPLIT": 1, "SWAP_AB": 1, "TALL_TILE": 1,
     "BLOCK_TABLE": 0, "TAIL_DEAL": 1},
    {**PP, "num_stages": 4, "GROUP_M": 4, "TAIL_SPLIT": 1, "TAIL_FINE": 2, "TMA_STORE": 1,
     "SWAP_AB": 1, "TALL_TILE": 1, "BLOCK_TABLE": 0},
    # Tall tiles (1.5 blocks, two accumulators a consumer), with TMA stores or from
    # registers, tiles from the counter.
    {**PP, "num_stages": 4, "GROUP_M": 1, "TAIL_SPLIT": 1, "TAIL_FINE": 2, "TMA_STORE": 1,
     "SWAP_AB": 1, "TALL_TILE": 1},
    {**PP, "GLUON": 4, "num_stages": 5, "GROUP_M": 4, "TAIL_SPLIT": 2, "DIRECT_STORE": 1,
     "SWAP_AB": 1, "TALL_TILE": 1},
]  # fmt: skip
WS = [i for i, c in enumerate(CONFIGS) if c["GLUON"] >= 3]
NO_TABLE = [i for i, c in enumerate(CONFIGS) if not c.get("BLOCK_TABLE", 1)]

needs_gluon = pytest.mark.skipif(grouped_gemm._gluon is None,
                                 reason=f"Triton {triton.__version__} has no Gluon Hopper API")


@needs_gluon
def test_pruning() -> None:
    cfg = CONFIGS[0]
    assert KERNEL.check_config(cfg, MOE, H100) is None
    for dev in (CPU, dataclasses.replace(H100, has_wgmma=False)):
        assert "wgmma" in KERNEL.check_config(cfg, MOE, dev)
    assert KERNEL.check_config(cfg, MOE, A100) is not None  # no TMA, no wgmma
    for key, bad in (("USE_TMA", 0), ("PERSISTENT", 0), ("BLOCK_TABLE", 0), ("FLATTEN", 1),
                     ("WARP_SPEC", 1)):
        assert f"{key}=" in KERNEL.check_config({**cfg, key: bad}, MOE, H100)
    # The quarter tile of a 128-row block is 32 rows: below a warp group's 64.
    assert "64 rows" in KERNEL.check_config({**cfg, "BLOCK_M": 128}, MOE, H100)
    assert "num_warps" in KERNEL.check_config({**cfg, "num_warps": 16}, MOE, H100)
    assert "num_stages" in KERNEL.check_config({**cfg, "num_stages": 1}, MOE, H100)
    assert "GLUON=5" in KERNEL.check_config({**cfg, "GLUON": 5}, MOE, H100)
    # The consumer takes its tiles from the producer, STAGES - 1 steps ahead: K must
    # have at least STAGES steps.
    assert "fewer than" in KERNEL.check_config(cfg, {**MOE, "K": 128}, H100)
    # The ring plus the staging tile must fit: 4 x 48 KB + 64 KB does not.
    assert "shared memory" in KERNEL.check_config({**cfg, "num_stages": 4}, MOE, H100)


@needs_gluon
def test_pruning_warp_specialized() -> None:
    """GLUON=3: one warp group per consumer (num_warps=4, two consumers), tiles of one
    or half a block of >= 64 rows, accumulators that fit a consumer's registers, two
    staging tiles in shared memory; or one consumer of two warp groups (num_warps=8);
    no K floor (its consumers find their slots without running ahead)."""
    cfg = CONFIGS[WS[0]]
    assert KERNEL.check_config(cfg, MOE, H100) is None
    assert KERNEL.check_config(cfg, {**MOE, "K": 128}, H100) is None
    assert "wgmma" in KERNEL.check_config(cfg, MOE, CPU)
    assert "num_warps=16" in KERNEL.check_config({**cfg, "num_warps": 16}, MOE, H100)
    # One consumer of two warp groups: quarter tiles of 64 rows, one staging tile.
    coop = {**cfg, "num_warps": 8, "BLOCK_M": 256, "TAIL_SPLIT": 2, "num_stages": 3}
    assert KERNEL.check_config(coop, MOE, H100) is None
    assert "shared memory" in KERNEL.check_config({**coop, "num_stages": 4}, MOE, H100)
    # Two consumers: tails below 64 rows run transposed, down to 8 rows, on BLOCK_N a
    # multiple of 64.
    fine = {**cfg, "TAIL_SPLIT": 2, "TAIL_FINE": 2}
    assert KERNEL.check_config(fine, MOE, H100) is None
    assert "8 rows" in KERNEL.check_config({**fine, "BLOCK_M": 64}, MOE, H100)
    assert "multiple of 64" in KERNEL.check_config({**cfg, "BLOCK_N": 32}, MOE, H100)
    # Outputs from registers: no staging tiles, 6 stages of 32 KB fit; not with TMA
    # stores or off the warp-specialized engine.
    direct = {**cfg, "DIRECT_STORE": 1, "TMA_STORE": 0, "num_stages": 6}
    assert KERNEL.check_config(direct, MOE, H100) is None
    assert "shared memory" in KERNEL.check_config({**direct, "DIRECT_STORE": 0}, MOE, H100)
    assert "TMA_STORE=0" in KERNEL.check_config({**direct, "TMA_STORE": 1}, MOE, H100)
    assert "GLUON=3 or 4" in KERNEL.check_config({**CONFIGS[0], "DIRECT_STORE": 1}, MOE, H100)
    # One consumer of two warp groups: transposed tails put BLOCK_N on two warp groups'
    # wgmma M, so a multiple of 128.
    assert KERNEL.check_config({**fine, "num_warps": 8}, MOE, H100) is None
    assert "of 128" in KERNEL.check_config({**fine, "num_warps": 8, "BLOCK_N": 64}, MOE, H100)
    # SWAP_AB: every tile transposed, then full tiles below 64 rows are fine too; not on
    # the single-consumer engine.
    swap = {**coop, "SWAP_AB": 1, "TAIL_FINE": 2}
    assert KERNEL.check_config(swap, MOE, H100) is None
    assert "8 rows" in KERNEL.check_config({**swap, "BLOCK_M": 64}, MOE, H100)
    assert "64 rows" in KERNEL.check_config({**cfg, "BLOCK_M": 32, "TAIL_SPLIT": 0}, MOE, H100)
    assert KERNEL.check_config({**cfg, "BLOCK_M": 32, "TAIL_SPLIT": 0, "SWAP_AB": 1}, MOE,
                               H100) is None
    assert "SWAP_AB=1 needs" in KERNEL.check_config({**CONFIGS[0], "SWAP_AB": 1}, MOE, H100)
    # Tall tiles: ping-pong, transposed, two accumulators within a consumer's registers,
    # half a block more of A in every slot (4 stages and two staging tiles fit).
    tall = {**cfg, "SWAP_AB": 1, "TALL_TILE": 1}
    assert KERNEL.check_config(tall, MOE, H100) is None
    assert "shared memory" in KERNEL.check_config({**tall, "num_stages": 5}, MOE, H100)
    assert KERNEL.check_config({**tall, "num_stages": 5, "TMA_STORE": 0, "DIRECT_STORE": 1},
                               MOE, H100) is None
    for bad in ({"num_warps": 8}, {"SWAP_AB": 0}):
        assert "needs num_warps=4 and SWAP_AB=1" in KERNEL.check_config({**tall, **bad}, MOE,
                                                                        H100)
    assert "accumulator registers" in KERNEL.check_config({**tall, "BLOCK_N": 256}, MOE, H100)
    assert "GLUON=3 or 4" in KERNEL.check_config({**CONFIGS[0], "TALL_TILE": 1}, MOE, H100)
    # No table: GLUON=3 with full tiles and half tails only.
    inline = {**cfg, "GLUON": 3, "TAIL_SPLIT": 1, "TAIL_FINE": 0, "BLOCK_TABLE": 0}
    assert KERNEL.check_config(inline, MOE, H100) is None
    assert "BLOCK_TABLE=1" in KERNEL.check_config({**inline, "GLUON": 4}, MOE, H100)
    assert "TAIL_SPLIT <= 1" in KERNEL.check_config({**inline, "TAIL_SPLIT": 2}, MOE, H100)
    # ... its tiles tall ones (ping-pong, transposed), dealt or not.
    for extra in ({}, {"GROUP_M": 1, "TAIL_DEAL": 1}, {"TAIL_FINE": 2}):
        assert KERNEL.check_config({**inline, **extra, "SWAP_AB": 1, "TALL_TILE": 1}, MOE,
                                   H100) is None
    assert "SWAP_AB=1" in KERNEL.check_config({**inline, "TALL_TILE": 1}, MOE, H100)
    # ... its short tails in one piece of the least height, dealt or not.
    for fine in (1, 2):
        assert KERNEL.check_config({**inline, "TAIL_FINE": fine}, MOE, H100) is None
        assert KERNEL.check_config({**inline, "TAIL_FINE": fine, "GROUP_M": 1,
                                    "TAIL_DEAL": 1}, MOE, H100) is None
    # Dealt half tiles: without the table, by stride, GROUP_M=1, half tails.
    deal = {**inline, "GROUP_M": 1, "TAIL_DEAL": 1}
    assert KERNEL.check_config(deal, MOE, H100) is None
    for wrong in ({"GROUP_M": 4}, {"TAIL_SPLIT": 0}, {"BLOCK_TABLE": 1},
                  {"GLUON": 4, "BLOCK_TABLE": 1}):
        assert "TAIL_DEAL=1 needs" in KERNEL.check_config({**deal, **wrong}, MOE, H100)
    assert "0 or 1" in KERNEL.check_config({**deal, "TAIL_DEAL": 2}, MOE, H100)
    assert "0 or 1" in KERNEL.check_config({**tall, "TALL_TILE": 2}, MOE, H100)
    assert "registers" in KERNEL.check_config({**cfg, "BLOCK_N": 256}, MOE, H100)
    assert "GLUON=4: num_warps" in KERNEL.check_config({**cfg, "GLUON": 4, "num_warps": 2},
                                                       MOE, H100)
    assert "num_stages" in KERNEL.check_config({**cfg, "num_stages": 1}, MOE, H100)
    # 5 stages of 32 KB and two 32 KB staging tiles fit in 227 KB; 6 do not.
    assert KERNEL.check_config({**cfg, "num_stages": 5}, MOE, H100) is None
    assert "shared memory" in KERNEL.check_config({**cfg, "num_stages": 6}, MOE, H100)


def test_pruned_without_gluon(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Triton without Gluon's Hopper API prunes the engine with its version, and the
    launcher says why instead of failing on an attribute."""
    monkeypatch.setattr(grouped_gemm, "_gluon", None)
    monkeypatch.setattr(grouped_gemm, "_GLUON_MISSING", "ImportError: no gluon", raising=False)
    assert "no Gluon" in KERNEL.check_config(CONFIGS[0], MOE, H100)
    inputs = make_grouped_inputs([70, 0, 60], 64, 64, "bf16", seed=0, device="cpu")
    with pytest.raises(RuntimeError, match="no Gluon"):
        KERNEL.launcher(inputs, {"M": 130, "N": 64, "K": 64, "E": 3}, CONFIGS[0])


@needs_gluon
def test_rejects_fp32() -> None:
    inputs = make_grouped_inputs([70, 0, 60], 64, 64, "fp32", seed=0, device="cpu")
    with pytest.raises(ValueError, match="bf16 or fp16"):
        KERNEL.launcher(inputs, {"M": 130, "N": 64, "K": 64, "E": 3}, CONFIGS[0])


@needs_gluon
def test_launch_meta_names_only_kernel_arguments() -> None:
    """The Gluon engines' launches (and their block table's) pass only arguments each
    kernel takes."""
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


@pytest.fixture(scope="module")
def compiled_sm90(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """``sm90_features(CONFIGS)`` from a fresh process and an empty Triton cache: the
    compile really runs (a cache hit would skip it), and no state of this process's
    earlier tests reaches it (after the interpreter-run tests of test_grouped_gemm.py,
    an in-process Gluon compile failed on Triton 3.9 with "'block_argument' object has
    no attribute 'dtype'"; alone it compiles)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton-cache"))
    code = ("import json; from tests.test_grouped_gemm_gluon import CONFIGS, sm90_features; "
            "print(json.dumps(sm90_features(CONFIGS)))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@needs_gluon
@pytest.mark.parametrize("i", range(len(CONFIGS)), ids=lambda i: str(sorted(CONFIGS[i].items())))
def test_compiles_for_sm90_without_a_gpu(i: int, compiled_sm90: list[dict]) -> None:
    """The launch the launcher would run at the MoE shape builds for sm_90 into TMA loads
    and wgmma; with TMA_STORE, TMA stores too."""
    config = CONFIGS[i]
    assert KERNEL.check_config(config, MOE, H100) is None
    got = compiled_sm90[i]
    kernel = "grouped_gemm_gluon_ws_kernel" if i in WS else "grouped_gemm_gluon_kernel"
    # BLOCK_TABLE=0 (GLUON=3): the kernel finds each tile's expert itself, one launch.
    table = ["_block_table_kernel"] if config.get("BLOCK_TABLE", 1) else []
    assert got["launches"] == [*table, kernel]
    assert got["grid"] == [4]  # one program per SM; the CPU stands in with 4
    assert got["wgmma"] and got["tma_load"]
    assert got["tma_store"] == bool(config.get("TMA_STORE"))
    if i in WS and config["num_warps"] == 4 and config["TAIL_SPLIT"] == 2:
        # Tails below 64 rows transposed: their rows on wgmma's N, down to the piece.
        rows = config["BLOCK_M"] >> (2 + config.get("TAIL_FINE", 0))
        assert f"m64n{rows}k16" in got["wgmma"] and f"m64n{config['BLOCK_N']}k16" in got["wgmma"]
    if config.get("SWAP_AB"):
        # Every tile transposed: each height's rows on wgmma's N, the full tile's too
        # (n256 for cooperative 256-row tiles, as cuBLAS's kernel here).
        heights = config["TAIL_SPLIT"] + config.get("TAIL_FINE", 0)
        want = {f"m64n{config['BLOCK_M'] >> h}k16" for h in range(heights + 1)}
        assert set(got["wgmma"]) == want
    if i in WS:
        # Three warp groups (two consumers or one of two, and the producer warp); the
        # producer gives its registers to the consumers.
        assert got["threads"] == 384
        assert 40 in got["setmaxnreg"]
        if config["num_warps"] == 4:
            assert 232 in got["setmaxnreg"]
    else:
        assert got["setmaxnreg"] == []


# -- on a Hopper GPU -----------------------------------------------------------------------


def _hopper() -> DeviceSpec:
    from harness import hardware

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
    for config in (CONFIGS[0], CONFIGS[3], *(CONFIGS[i] for i in WS)):
        fn = KERNEL.launcher(inputs, shape, config)
        if shape["M"]:
            _check_filled(fn, inputs, shape)
        else:
            assert fn().shape == (0, 1408)
    meta = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
    KERNEL.compile_only(meta, shape, CONFIGS[1])


@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize("i", [0, WS[0], WS[3], WS[5], NO_TABLE[0], NO_TABLE[2], NO_TABLE[4],
                               NO_TABLE[6], WS[-1]])
def test_gpu_in_a_cuda_graph(device: str, i: int) -> None:
    """Both launches (or the one, without a table) capture into a CUDA graph; a replay
    after the routing changed in the same offsets buffer gives the new answer."""
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
