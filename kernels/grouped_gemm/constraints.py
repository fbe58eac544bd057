"""Which grouped GEMM configs can run where: pure functions of the config (defaults filled
in), the shape and the device, so that the search prunes them before any GPU sees them.
"""

from __future__ import annotations

from typing import Any

from harness.kernel.api import DeviceSpec, Shape
from kernels._gemm_tiles import tile_reason

from .triton_path import next_pow2

# Tunables of earlier versions of the kernel, with the value they now always have (no
# shipped pack used another, no study found one winning). A config or an old pack entry
# may still carry one at that value; any other value is refused with its name.
RETIRED: dict[str, int] = {
    "BLOCK_TABLE": 0,
    "FLATTEN": 0,
    "WARP_SPEC": 0,
    "TAIL_WINDOW": 0,
    "TAIL_FINE": 0,
    "DIRECT_STORE": 0,
}

# The Gluon engine's values: 0 (the Triton kernels) and 3 (the warp-specialized Gluon
# kernel; 1, 2 and 4 named engines since retired, so shipped packs keep their value).
GLUON_ENGINES = (0, 3)


def _bits(cfg: dict[str, Any], *names: str) -> str | None:
    for name in names:
        if int(cfg[name]) not in (0, 1):
            return f"{name}={cfg[name]}: 0 or 1"
    return None


def check_gluon(cfg: dict[str, Any], shape: Shape, device: DeviceSpec,
                missing: str | None, consumer_regs: int) -> str | None:
    """GLUON=3's limits: Hopper's wgmma, TMA, persistent; num_warps=4, two consumers of
    one warp group each holding a whole tile; num_warps=8, one consumer of two warp
    groups. Tiles of >= 64 rows run as they are, tails below 64 rows (and every tile with
    SWAP_AB) transposed: W's BN rows on wgmma's M (16 a warp), the tile's rows on its N
    (half tiles are >= 16 rows, as everywhere).
    ``missing``: why this Triton cannot run the engine (None where it can)."""
    if missing:
        return f"GLUON=3: this Triton cannot run the Gluon kernel ({missing})"
    if not device.has_wgmma or device.interpreted:
        return f"GLUON=3: needs Hopper's wgmma (sm_90), not {device.key}"
    if not (int(cfg["USE_TMA"]) and int(cfg["PERSISTENT"])):
        return "GLUON=3 needs USE_TMA=1 and PERSISTENT=1"
    bm, bn = int(cfg["BLOCK_M"]), int(cfg["BLOCK_N"])
    split, swap, warps = int(cfg["TAIL_SPLIT"]), int(cfg["SWAP_AB"]), int(cfg["num_warps"])
    if warps not in (4, 8):
        return f"GLUON=3: num_warps={warps}: 4 (two consumers of one warp group) or 8 (one of two)"
    if int(cfg["num_stages"]) < 2:
        return "GLUON=3: the ring needs num_stages >= 2"
    if bm < 64 and not swap:
        return (f"GLUON=3: BLOCK_M={bm}, SWAP_AB=0: full tiles of >= 64 rows (a warp group's "
                "wgmma) unless transposed")
    smallest = bm >> split
    rows_on_m = 16 * warps
    if bn % 64 or ((swap or smallest < 64) and bn % rows_on_m):
        return (f"GLUON=3: BLOCK_N={bn}, num_warps={warps}: a multiple of 64, and of "
                f"{rows_on_m} where a tile runs transposed (W's rows on wgmma's M, 16 a warp)")
    per_thread = bm * bn // (32 * warps)
    if int(cfg["TALL_TILE"]):
        # One warp group holds a tall tile's two accumulators (BLOCK_M and half of it
        # routed rows, transposed): 192 fp32 a thread at 128 x 128, what ptxas fits in a
        # consumer's 232 registers without spilling (sm_90, Triton 3.6 and 3.9).
        if warps != 4 or not swap:
            return "GLUON=3: TALL_TILE=1 needs num_warps=4 and SWAP_AB=1 (ping-pong, transposed)"
        per_thread += per_thread // 2
        if per_thread > consumer_regs - 40:
            return (f"GLUON=3: TALL_TILE=1 at {bm}x{bn}: {per_thread} accumulator registers "
                    f"a thread, more than a consumer's {consumer_regs} leave room for")
    elif per_thread > consumer_regs - 64:
        return (f"GLUON=3: a {bm}x{bn} accumulator is {per_thread} registers a thread, more "
                f"than a consumer's {consumer_regs} leave room for")
    return None


def check_config(cfg: dict[str, Any], shape: Shape, device: DeviceSpec,
                 gluon_missing: str | None = None, consumer_regs: int = 232) -> str | None:
    """Why ``cfg`` (every tunable present) cannot run at ``shape`` on ``device``, or None.
    ``gluon_missing``: why this Triton cannot run the Gluon engine (None where it can)."""
    for name, value in RETIRED.items():
        if name in cfg and int(cfg[name]) != value:
            return f"{name} is retired: only {value} (the kernel always runs that way)"
    bm, bn, bk = int(cfg["BLOCK_M"]), int(cfg["BLOCK_N"]), int(cfg["BLOCK_K"])
    N, K = int(shape["N"]), int(shape["K"])
    engine, use_tma = int(cfg["GLUON"]), int(cfg["USE_TMA"])
    tma_store, split = int(cfg["TMA_STORE"]), int(cfg["TAIL_SPLIT"])

    why = _bits(cfg, "PERSISTENT", "USE_TMA", "TMA_STORE", "TAIL_SPLIT", "SWAP_AB",
                "TALL_TILE", "TAIL_DEAL")
    if why:
        return why
    if engine not in GLUON_ENGINES:
        return f"GLUON={cfg['GLUON']}: 0 (the Triton kernels) or 3 (the Gluon kernel)"
    why = tile_reason(cfg, cfg, device)
    if why:
        return why
    if use_tma:
        # Interpreted Triton emulates descriptors (checked on 3.9), so CPU runs test it.
        if not (device.has_tma or device.interpreted):
            return f"USE_TMA=1: {device.key} has no TMA"
        # Row strides must be 16-byte multiples (2-byte dtypes assumed, as below).
        if K % 8:
            return f"USE_TMA=1: K={K} rows are not 16-byte aligned"
        if max(bm, bn, bk) > 256:
            return "USE_TMA=1: TMA boxes are at most 256 elements a side"
    # Options of the TMA kernels only: elsewhere they would repeat another config.
    if tma_store and not use_tma:
        return "TMA_STORE=1 needs USE_TMA=1"
    if tma_store and N % 8:
        return f"TMA_STORE=1: N={N} output rows are not 16-byte aligned"
    if int(cfg["SWAP_AB"]) and not use_tma:
        return "SWAP_AB=1 needs USE_TMA=1"
    if split and (bm >> split < 16 or bn < 32):
        # The half tiles are still tl.dot tiles (>= 16 a side).
        return f"TAIL_SPLIT=1: half of BLOCK_M={bm} or of BLOCK_N={bn} is below 16"
    # Options of the Gluon kernel only.
    if int(cfg["TALL_TILE"]) and engine != 3:
        return "TALL_TILE=1 needs GLUON=3"
    # Dealing needs a fixed stride and the half tiles of an expert as one run of n-tiles.
    if int(cfg["TAIL_DEAL"]) and (engine, int(cfg["GROUP_M"]), split) != (3, 1, 1):
        return "TAIL_DEAL=1 needs GLUON=3, GROUP_M=1 and TAIL_SPLIT=1"
    if engine:
        why = check_gluon(cfg, shape, device, gluon_missing, consumer_regs)
        if why:
            return why
    # A tile more than twice the padded dimension is mostly masked-out work.
    if bn > max(16, next_pow2(N)):
        return f"BLOCK_N={bn} > next_pow2(N)={next_pow2(N)}"
    if bk > max(16, next_pow2(K)):
        return f"BLOCK_K={bk} > next_pow2(K)={next_pow2(K)}"
    return _check_resources(cfg, device)


def _check_resources(cfg: dict[str, Any], device: DeviceSpec) -> str | None:
    """Shared memory and accumulator registers. The software pipeline keeps num_stages A
    and W tiles resident; the epilogue's layout conversion reuses that space, so it only
    counts when larger, unless a TMA store or the Gluon kernel stages the tile in a
    buffer of its own. The dtype is not seen here: 2 bytes (bf16/fp16, the tuned dtypes)
    is assumed; an fp32 config that does not fit fails at compile time instead."""
    bm, bn, bk = int(cfg["BLOCK_M"]), int(cfg["BLOCK_N"]), int(cfg["BLOCK_K"])
    warps, stages = int(cfg["num_warps"]), int(cfg["num_stages"])
    gluon = int(cfg["GLUON"])
    item = 2
    # AMD's stream pipeliner holds one stage in registers: one LDS buffer fewer.
    buffers = max(1, stages - 1) if device.vendor == "amd" else stages
    # TALL_TILE's slots hold half a block more of A.
    a_rows = bm + (bm // 2 if int(cfg["TALL_TILE"]) else 0)
    pipeline, epilogue = buffers * (a_rows * bk + bn * bk) * item, bm * bn * item
    # The Gluon kernel's two ping-pong consumers (num_warps=4) each stage their own tile.
    epilogue *= 2 if gluon and warps == 4 else 1
    staged = int(cfg["TMA_STORE"]) or gluon
    smem = pipeline + epilogue if staged else max(pipeline, epilogue)
    if smem > device.smem_per_block:
        return f"shared memory ~{smem} B > {device.smem_per_block} B per block"
    # Registers: beyond 256 fp32 accumulator values a thread (half the 255-register file
    # is already the operands' fragments and addresses) it spills for certain.
    if bm * bn > 256 * 256:
        return f"accumulator {bm}x{bn} is larger than 256x256"
    lanes = 64 if device.vendor == "amd" else 32
    per_thread = bm * bn // (warps * lanes)
    if per_thread > 256:
        return f"{per_thread} accumulator values per thread > 256 (num_warps={warps})"
    # AMD: more than 8 wavefronts of 64 lanes per workgroup leaves too few VGPRs each.
    if device.vendor == "amd" and warps > 8:
        return f"num_warps={warps} > 8 on AMD"
    return None
