"""MoE grouped GEMM (contiguous grouped layout), as used by the expert FFNs of an MoE layer.

``A`` [M, K] holds the routed rows sorted by expert, ``offsets`` int32 [E + 1] marks where
each expert's rows start (``offsets[0] = 0``, ``offsets[E] = M``), ``W`` [E, N, K] holds one
``nn.Linear``-layout weight per expert, and ``out[rows of e] = A[rows of e] @ W[e]^T``.

The kernel needs no host sync and no per-call host preparation: each program reads the
offsets vector itself, turns the per-expert row counts into per-expert m-block counts and
their prefix sum, and maps its virtual m-block to (expert, local block) from that. With
BLOCK_TABLE a first, small launch does that mapping once for every m-block and writes it
to a table the GEMM reads (and may split each expert's last rows into half and quarter
tiles, TAIL_SPLIT, and the last quarter piece further into eighths or sixteenths where
its rows fit, TAIL_FINE); the launch count stays fixed, so CUDA graphs capture it as well.
In the TMA kernel, SWAP_AB computes each tile transposed so that the routed rows are
wgmma's N side (m64n256k16 for a 256-row tile, n32 / n16 for fine pieces). GLUON runs
the table's tiles with the persistent Gluon kernel of ``kernels/_grouped_gemm_gluon.py``
instead (Hopper only): each program takes its tiles at a fixed stride (GLUON=1) or from
a counter, as it frees up (GLUON=2); GLUON=3 / 4 run them warp-specialized
(``kernels/_grouped_gemm_gluon_ws.py``: a TMA producer warp and two consumer warp groups
taking alternate tiles, so one stores while the other computes; the tiles at a fixed
stride, or from the counter).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

try:
    from kernels import _grouped_gemm_gluon as _gluon
except (ImportError, AttributeError) as _exc:  # a Triton without Gluon's Hopper API
    _gluon = None
    _GLUON_MISSING = f"{type(_exc).__name__}: {_exc}"
try:
    from kernels import _grouped_gemm_gluon_ws as _gluon_ws
except (ImportError, AttributeError) as _exc:
    _gluon_ws = None
    _GLUON_WS_MISSING = f"{type(_exc).__name__}: {_exc}"

from harness.kernel_api import (
    Config,
    DeviceSpec,
    Inputs,
    Kernel,
    Launch,
    Launches,
    Shape,
    Tolerance,
)

_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# Launch options that only the AMD backend knows: the NVIDIA backend raises on them, so
# they are passed only where the config has them and the GPU is a ROCm one.
_AMD_KWARGS = ("waves_per_eu", "matrix_instr_nonkdim", "kpack")

# Triton 3.6's loop fusion (TritonGPUFuseNestedLoops) fails on the TMA kernel's
# conditional store inside a flattened loop ("PassManager::run failed", H200, 2026-11-23);
# newer releases are let through, where a failure would fail only that trial.
_FLATTEN_STORE_BROKEN = tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 7)

# The block table's class of TALL_TILE's tiles (one and a half blocks): past the split
# classes' 0-4 (a class h tile is otherwise BLOCK_M >> h rows).
TALL_CLASS = tl.constexpr(5)

# Programs of the persistent variant when there is no GPU to ask (the interpreter): small,
# so that each program still loops over several tiles.
_CPU_PROGRAMS = 4


@triton.jit
def _expert_rows(offs_ptr, E, E_PAD: tl.constexpr):
    """Per expert (padded to E_PAD, the padding empty): index, start row, end row."""
    e_idx = tl.arange(0, E_PAD)
    e_mask = e_idx < E
    starts = tl.load(offs_ptr + e_idx, mask=e_mask, other=0)
    ends = tl.load(offs_ptr + e_idx + 1, mask=e_mask, other=0)
    return e_idx, starts, ends


@triton.jit
def _block_table_kernel(
    offs_ptr, table_ptr, E, NB,
    E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, TAIL_SPLIT: tl.constexpr,
    TAIL_WINDOW: tl.constexpr, CHUNK: tl.constexpr, TAIL_FINE: tl.constexpr = 0,
    TALL: tl.constexpr = 0,
):
    """BLOCK_TABLE=1's first launch: for each of the NB virtual m-blocks (an upper bound),
    its expert (-1 past the real blocks), first row, the expert's end row and its height
    class h (the tile is BLOCK_M >> h rows), as four int32 rows of ``table``; then the
    real block count at ``table[4 * NB]``, and a zeroed tile counter after it (GLUON=2).
    The GEMM kernel reads four numbers per tile instead of reducing over the experts.

    An expert's rows become full BLOCK_M blocks (class 0), then its remainder r is covered
    by pieces of BLOCK_M/2, BLOCK_M/4, ... (classes 1, 2, ..., down to BLOCK_M >>
    TAIL_SPLIT rows): the set bits of u = ceil(r / (BLOCK_M >> TAIL_SPLIT)), largest
    first; a remainder that needs every piece is one full block instead. The padding is
    then under BLOCK_M >> TAIL_SPLIT rows per expert. With TAIL_FINE = f, an expert's
    smallest piece shrinks to BLOCK_M >> (TAIL_SPLIT + 1) or ... >> (TAIL_SPLIT + f) rows
    (with TAIL_SPLIT=1, its only piece: one W stream per tail, of the least height)
    where its real rows fit (classes TAIL_SPLIT + 1 ...; it keeps its place in the
    order): the padding is then under BLOCK_M >> (TAIL_SPLIT + f) rows, with no more
    pieces than before.

    Blocks run expert by expert, each expert's largest first; the last TAIL_WINDOW
    experts' blocks run class by class instead (all their full blocks, then their halves,
    ...), so that the grid ends on its smallest tiles. Measured at the MoE shape: 0 to 2
    points of dense cuBLAS (session 14), though a partly idle last wave costs nothing
    under the power cap; every expert in the window costs 4 points, as the small tiles
    then read their weights from HBM again: the window is a few experts, whose weights
    are still in L2.

    With TALL (the warp-specialized engine's TALL_TILE), an expert's rows first become
    tiles of one and a half blocks (class TALL_CLASS), the last of them taking a remainder
    of over one block; what is left (at most one block) is split as above."""
    e_idx, starts, ends = _expert_rows(offs_ptr, E, E_PAD)
    GRAIN: tl.constexpr = BLOCK_M >> TAIL_SPLIT
    STEP: tl.constexpr = BLOCK_M + (BLOCK_M >> 1) * TALL
    n_tall = tl.zeros_like(starts)
    base = starts  # where the blocks of one block and less start
    if TALL:
        n_tall = (ends - starts) // STEP
        n_tall += (ends - starts - n_tall * STEP > BLOCK_M).to(tl.int32)
        base = tl.minimum(starts + n_tall * STEP, ends)
    full = (ends - base) // BLOCK_M
    u = (ends - base - full * BLOCK_M + GRAIN - 1) // GRAIN  # 0 .. 2**TAIL_SPLIT
    whole = u == (1 << TAIL_SPLIT)
    pieces = tl.where(whole, 0, u)  # bit TAIL_SPLIT - c: a piece of class c
    n_full = full + whole.to(tl.int32)
    nblk = n_tall + n_full
    for c in tl.static_range(1, TAIL_SPLIT + 1):
        nblk += (pieces >> (TAIL_SPLIT - c)) & 1
    # The class the smallest piece (class TAIL_SPLIT) runs at: its real rows are what the
    # larger pieces leave of the remainder.
    h_last = tl.zeros_like(starts) + TAIL_SPLIT
    if TAIL_FINE:
        left = ends - base - full * BLOCK_M - (pieces >> 1) * (2 * GRAIN)
        for f in tl.static_range(1, TAIL_FINE + 1):
            h_last += (left <= (GRAIN >> f)).to(tl.int32)

    in_win = e_idx >= E - TAIL_WINDOW
    out_blk = tl.where(in_win, 0, nblk)
    # Outside the window, expert e's blocks start after all earlier experts' (the window
    # experts are the last ones, so they add nothing before any outside expert).
    nxt = tl.cumsum(out_blk, 0) - out_blk
    w_pos = tl.sum(out_blk, 0)  # where the window's next class starts

    b = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    # Each real block lies in exactly one (expert, class) segment: summing every
    # segment's contribution picks that one's values.
    found = tl.zeros_like(b)
    expert = tl.zeros_like(b)
    m0 = tl.zeros_like(b)
    row_end = tl.zeros_like(b)
    h = tl.zeros_like(b)
    off = tl.zeros_like(starts)  # a class's row offset within its expert's remainder
    # Class -1 stands for the tall tiles (their table class is TALL_CLASS).
    for c in tl.static_range(-TALL, TAIL_SPLIT + 1):
        if c < 0:
            n_c = n_tall
        elif c == 0:
            n_c = n_full
        else:
            n_c = (pieces >> (TAIL_SPLIT - c)) & 1
        w_n = tl.where(in_win, n_c, 0)
        seg = tl.where(in_win, w_pos + tl.cumsum(w_n, 0) - w_n, nxt)
        j = b[:, None] - seg[None, :]  # the block's index within the segment
        hit = (j >= 0) & (j < n_c[None, :])
        if c < 0:
            first = starts[None, :] + j * STEP
        elif c == 0:
            first = base[None, :] + j * BLOCK_M
        else:
            first = (base + full * BLOCK_M + off)[None, :]
        n_hit = tl.sum(hit.to(tl.int32), 1)  # 0 or 1 per block
        found += n_hit
        expert += tl.sum(tl.where(hit, e_idx[None, :], 0), 1)
        m0 += tl.sum(tl.where(hit, first, 0), 1)
        row_end += tl.sum(tl.where(hit, ends[None, :], 0), 1)
        if TAIL_FINE and c == TAIL_SPLIT and c > 0:
            h += tl.sum(tl.where(hit, h_last[None, :], 0), 1)
        elif c < 0:
            h += n_hit * TALL_CLASS
        else:
            h += n_hit * c
        nxt += n_c
        w_pos += tl.sum(w_n, 0)
        if c > 0:
            off += n_c * (BLOCK_M >> c)
    live = b < NB
    tl.store(table_ptr + b, tl.where(found > 0, expert, -1), mask=live)
    tl.store(table_ptr + NB + b, m0, mask=live)
    tl.store(table_ptr + 2 * NB + b, row_end, mask=live)
    tl.store(table_ptr + 3 * NB + b, h, mask=live)
    if tl.program_id(0) == 0:
        tl.store(table_ptr + 4 * NB, tl.sum(nblk, 0))
        # The tile counter GLUON=2's programs take their tiles from, zeroed every call.
        tl.store(table_ptr + 4 * NB + 1, 0)


@triton.jit
def _tile_map(
    tile, e_idx, starts, ends, nblk, cum, table_ptr, NB, num_pid_m, num_pid_n,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCK_TABLE: tl.constexpr, TAIL_SPLIT: tl.constexpr,
):
    """(expert, first row, the expert's end row, first column, height class h) of
    ``tile`` in the (virtual m-block, n-tile) grid, whose m-blocks run over the experts'
    blocks back to back; the tile is BLOCK_M >> h rows high; expert -1 for a tile past
    the real blocks (BLOCK_TABLE's bound grid). Shared by the pointer and the TMA
    kernels."""
    # Grouped ordering: GROUP_M consecutive m-blocks sweep the n-tiles together, so the
    # W tiles they share stay in L2 (GROUP_M = 1 is plain row-major order).
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = tile // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((tile % num_pid_in_group) % group_size_m)
    pid_n = (tile % num_pid_in_group) // group_size_m

    if BLOCK_TABLE:
        expert = tl.load(table_ptr + pid_m)
        m0 = tl.load(table_ptr + NB + pid_m)
        row_end = tl.load(table_ptr + 2 * NB + pid_m)
        h = tl.load(table_ptr + 3 * NB + pid_m)
    else:
        # Block-wide reductions on every tile's critical path (BLOCK_TABLE's reason).
        # Empty experts add nothing to cum, so counting cum <= pid_m skips them.
        expert = tl.sum((cum <= pid_m).to(tl.int32), 0)
        sel = e_idx == expert
        blk0 = tl.sum(tl.where(sel, cum - nblk, 0), 0)
        row0 = tl.sum(tl.where(sel, starts, 0), 0)
        row_end = tl.sum(tl.where(sel, ends, 0), 0)
        m0 = row0 + (pid_m - blk0) * BLOCK_M
        # One tile per block here: a last block of <= BLOCK_M / 2 rows runs half-height.
        h = ((TAIL_SPLIT > 0) & (row_end - m0 <= BLOCK_M // 2)).to(tl.int32)
    return expert, m0, row_end, pid_n * BLOCK_N, h


@triton.jit
def _prologue(
    offs_ptr, table_ptr, E, NB, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    PERSISTENT: tl.constexpr, BLOCK_TABLE: tl.constexpr,
):
    """A program's start: the per-expert vectors ``_tile_map`` reduces over and the
    m-block count. With BLOCK_TABLE the vectors are not needed (stand-ins, never read);
    a persistent program reads the real count from the table, a one-tile program takes
    the bound NB (its tile says expert -1 when past the real blocks)."""
    if BLOCK_TABLE:
        e_idx = tl.arange(0, E_PAD)
        if PERSISTENT:
            num_pid_m = tl.load(table_ptr + 4 * NB)
        else:
            num_pid_m = NB
        return e_idx, e_idx, e_idx, e_idx, e_idx, num_pid_m
    e_idx, starts, ends = _expert_rows(offs_ptr, E, E_PAD)
    nblk = (ends - starts + BLOCK_M - 1) // BLOCK_M
    cum = tl.cumsum(nblk, 0)  # inclusive: expert e owns virtual blocks [cum-nblk, cum)
    return e_idx, starts, ends, nblk, cum, tl.sum(nblk, 0)


@triton.jit
def _gemm_tile(
    m0,
    n0,
    expert,
    row_end,
    a_ptr,
    w_ptr,
    out_ptr,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    """The BLOCK_M x BLOCK_N output tile at (m0, n0) of ``expert`` (pointer loads)."""
    rows = m0 + tl.arange(0, BLOCK_M)
    row_mask = rows < row_end
    cols = n0 + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    offs_k = tl.arange(0, BLOCK_K)

    # 64-bit row and expert offsets: M*K and E*N*K may pass 2**31 elements. The last
    # dimensions are contiguous by contract (the launcher checks), so the K offsets carry
    # no stride and the compiler sees unit stride: vector loads and cp.async pipelining.
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    w_ptrs = (
        w_ptr
        + expert.to(tl.int64) * stride_we
        + cols.to(tl.int64)[:, None] * stride_wn
        + offs_k[None, :]
    )

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_mask[:, None], other=0.0)
            b = tl.load(w_ptrs, mask=col_mask[:, None], other=0.0)
        else:
            k_mask = offs_k < K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        if UPCAST:
            # The interpreter's bf16 dot is wrong; fp32 tiles give the exact answer.
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if IEEE:
            acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(b), acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(
        out_ptrs,
        acc.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


@triton.jit
def _gemm_tile_any(
    tile, a_ptr, w_ptr, out_ptr, N, K, stride_am, stride_we, stride_wn, stride_om,
    e_idx, starts, ends, nblk, cum, table_ptr, NB, num_pid_m, num_pid_n,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, BLOCK_TABLE: tl.constexpr, TAIL_SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    """Tile ``tile`` of the pointer kernel. With TAIL_SPLIT, an expert's last rows run
    as tiles of BLOCK_M >> h rows (``_tile_map``'s h), and a last n-tile of at most
    BLOCK_N / 2 columns runs half-width, so the tails multiply less padding."""
    expert, m0, row_end, n0, h = _tile_map(
        tile, e_idx, starts, ends, nblk, cum, table_ptr, NB, num_pid_m, num_pid_n,
        BLOCK_M, BLOCK_N, GROUP_M, BLOCK_TABLE, TAIL_SPLIT,
    )
    if expert < 0:
        pass
    elif TAIL_SPLIT >= 2 and h == 2:
        _gemm_tile(m0, n0, expert, row_end, a_ptr, w_ptr, out_ptr, N, K,
                   stride_am, stride_we, stride_wn, stride_om,
                   BLOCK_M // 4, BLOCK_N, BLOCK_K, EVEN_K, UPCAST, IEEE)  # fmt: skip
    elif TAIL_SPLIT >= 1 and h == 1:
        _gemm_tile(m0, n0, expert, row_end, a_ptr, w_ptr, out_ptr, N, K,
                   stride_am, stride_we, stride_wn, stride_om,
                   BLOCK_M // 2, BLOCK_N, BLOCK_K, EVEN_K, UPCAST, IEEE)  # fmt: skip
    elif TAIL_SPLIT >= 1 and N - n0 <= BLOCK_N // 2:
        _gemm_tile(m0, n0, expert, row_end, a_ptr, w_ptr, out_ptr, N, K,
                   stride_am, stride_we, stride_wn, stride_om,
                   BLOCK_M, BLOCK_N // 2, BLOCK_K, EVEN_K, UPCAST, IEEE)  # fmt: skip
    else:
        _gemm_tile(m0, n0, expert, row_end, a_ptr, w_ptr, out_ptr, N, K,
                   stride_am, stride_we, stride_wn, stride_om,
                   BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, UPCAST, IEEE)  # fmt: skip


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    offs_ptr,
    table_ptr,
    N,
    K,
    E,
    NB,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    NUM_PROGS,
    E_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PERSISTENT: tl.constexpr,
    BLOCK_TABLE: tl.constexpr,
    TAIL_SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid = tl.program_id(0)
    e_idx, starts, ends, nblk, cum, num_pid_m = _prologue(
        offs_ptr, table_ptr, E, NB, E_PAD, BLOCK_M, PERSISTENT, BLOCK_TABLE
    )
    num_pid_n = tl.cdiv(N, BLOCK_N)
    total_tiles = num_pid_m * num_pid_n

    if PERSISTENT:
        # Grid = number of SMs; each program strides over the exact tile count.
        for tile in tl.range(pid, total_tiles, NUM_PROGS):
            _gemm_tile_any(
                tile, a_ptr, w_ptr, out_ptr, N, K,
                stride_am, stride_we, stride_wn, stride_om,
                e_idx, starts, ends, nblk, cum, table_ptr, NB, num_pid_m, num_pid_n,
                BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, BLOCK_TABLE, TAIL_SPLIT, EVEN_K,
                UPCAST, IEEE,
            )  # fmt: skip
    else:
        # The grid is an upper bound on the tiles; the programs past the real count idle.
        if pid < total_tiles:
            _gemm_tile_any(
                pid, a_ptr, w_ptr, out_ptr, N, K,
                stride_am, stride_we, stride_wn, stride_om,
                e_idx, starts, ends, nblk, cum, table_ptr, NB, num_pid_m, num_pid_n,
                BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, BLOCK_TABLE, TAIL_SPLIT, EVEN_K,
                UPCAST, IEEE,
            )  # fmt: skip


@triton.jit
def _gemm_tile_tma(
    m0,
    n0,
    expert,
    row_end,
    a_desc,
    w_desc,
    out_desc,
    out_ptr,
    N,
    K,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TMA_STORE: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    WARP_SPEC_K: tl.constexpr,
    SWAP_AB: tl.constexpr,
    EMU: tl.constexpr = 0,
):
    """The output tile at (m0, n0) of ``expert`` with TMA loads: ``a_desc`` covers
    A [M, K] in [BLOCK_M, BLOCK_K] boxes, ``w_desc`` covers W viewed as [E*N, K] in
    [BLOCK_N, BLOCK_K] boxes. A box does not stop at an expert's end: rows past it (the
    next expert's A rows, or the next expert's W rows past N) are multiplied but masked
    at the store; rows and K columns past the tensors' ends are zero-filled by the
    hardware. With TMA_STORE, a tile whose rows all belong to its expert is written by
    ``out_desc`` (columns past N are clipped by the hardware); an expert's last, partial
    tile keeps the masked store.

    SWAP_AB computes the tile transposed, W_tile @ A_tile^T, so that the rows of A are
    wgmma's N (up to 256 wide in one instruction) and W's rows its M: each wgmma then
    reads its W slice once for all BLOCK_M rows instead of once per 64 of them. The
    accumulator is transposed back before the store.

    EMU (a diagnostic for the tail tiles, wrong results on purpose): 1 loads the W box
    once and multiplies it at every K step (the tile streams no W), 2 does the same for
    the A box too (it streams nothing), 3 returns at once (the tile costs nothing).
    ``_gemm_tile_tma_any``'s TAIL_EMU=4 returns at once from every tile but the first
    (which keeps the kernel's shared memory, so one CTA per SM as in the real launch)."""
    # TMA coordinates are int32: E*N and M stay far below 2**31 rows.
    w_row = expert * N + n0
    if EMU == 3:
        return
    if EMU >= 1:
        b0 = w_desc.load([w_row, 0])
    if EMU >= 2:
        a0 = a_desc.load([m0, 0])

    if SWAP_AB:
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, tl.cdiv(K, BLOCK_K), warp_specialize=WARP_SPEC_K):
        if EMU >= 2:
            a = a0
        else:
            a = a_desc.load([m0, k * BLOCK_K])
        if EMU >= 1:
            b = b0
        else:
            b = w_desc.load([w_row, k * BLOCK_K])
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if SWAP_AB:
            if IEEE:
                acc_t = tl.dot(b, tl.trans(a), acc_t, input_precision="ieee")
            else:
                acc_t = tl.dot(b, tl.trans(a), acc_t)
        elif IEEE:
            acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(b), acc)
    if SWAP_AB:
        acc = tl.trans(acc_t)

    c = acc.to(out_ptr.dtype.element_ty)
    if TMA_STORE and m0 + BLOCK_M <= row_end:
        out_desc.store([m0, n0], c)
    else:
        # A TMA store of this box would write past the expert's end, into the next
        # expert's rows.
        rows = m0 + tl.arange(0, BLOCK_M)
        cols = n0 + tl.arange(0, BLOCK_N)
        out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
        tl.store(out_ptrs, c, mask=(rows < row_end)[:, None] & (cols < N)[None, :])


@triton.jit
def _gemm_tile_tma_any(
    tile, a_desc, a_half, a_quarter, a_fine, w_desc, w_half, out_desc, out_ptr, N, K,
    stride_om, e_idx, starts, ends, nblk, cum, table_ptr, NB, num_pid_m, num_pid_n,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, BLOCK_TABLE: tl.constexpr, TAIL_SPLIT: tl.constexpr,
    TMA_STORE: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, WARP_SPEC_K: tl.constexpr,
    SWAP_AB: tl.constexpr, TAIL_FINE: tl.constexpr, TAIL_EMU: tl.constexpr = 0,
):
    """Tile ``tile`` of the TMA kernel; TAIL_SPLIT as in ``_gemm_tile_any``, with the
    A boxes of ``a_half`` / ``a_quarter`` and the half-width W boxes of ``w_half`` (the
    smaller tiles keep the masked store: ``out_desc``'s box is the full tile's). With
    TAIL_FINE (TAIL_SPLIT=2), an expert's last quarter piece runs BLOCK_M/8 or /16 rows
    high where its rows fit (the table's classes 3 and 4; ``a_fine`` = the two boxes)."""
    expert, m0, row_end, n0, h = _tile_map(
        tile, e_idx, starts, ends, nblk, cum, table_ptr, NB, num_pid_m, num_pid_n,
        BLOCK_M, BLOCK_N, GROUP_M, BLOCK_TABLE, TAIL_SPLIT,
    )
    if expert < 0:
        pass
    elif TAIL_EMU == 4 and tile > 0:
        pass
    elif TAIL_FINE >= 2 and h == 4:
        _gemm_tile_tma(m0, n0, expert, row_end, a_fine[1], w_desc, out_desc, out_ptr, N, K,
                       stride_om, BLOCK_M // 16, BLOCK_N, BLOCK_K, False, UPCAST, IEEE,
                       WARP_SPEC_K, SWAP_AB, TAIL_EMU)  # fmt: skip
    elif TAIL_FINE >= 1 and h == 3:
        _gemm_tile_tma(m0, n0, expert, row_end, a_fine[0], w_desc, out_desc, out_ptr, N, K,
                       stride_om, BLOCK_M // 8, BLOCK_N, BLOCK_K, False, UPCAST, IEEE,
                       WARP_SPEC_K, SWAP_AB, TAIL_EMU)  # fmt: skip
    elif TAIL_SPLIT >= 2 and h == 2:
        _gemm_tile_tma(m0, n0, expert, row_end, a_quarter, w_desc, out_desc, out_ptr, N, K,
                       stride_om, BLOCK_M // 4, BLOCK_N, BLOCK_K, False, UPCAST, IEEE,
                       WARP_SPEC_K, SWAP_AB, TAIL_EMU)  # fmt: skip
    elif TAIL_SPLIT >= 1 and h == 1:
        _gemm_tile_tma(m0, n0, expert, row_end, a_half, w_desc, out_desc, out_ptr, N, K,
                       stride_om, BLOCK_M // 2, BLOCK_N, BLOCK_K, False, UPCAST, IEEE,
                       WARP_SPEC_K, SWAP_AB, TAIL_EMU)  # fmt: skip
    elif TAIL_SPLIT >= 1 and N - n0 <= BLOCK_N // 2:
        _gemm_tile_tma(m0, n0, expert, row_end, a_desc, w_half, out_desc, out_ptr, N, K,
                       stride_om, BLOCK_M, BLOCK_N // 2, BLOCK_K, False, UPCAST, IEEE,
                       WARP_SPEC_K, SWAP_AB)  # fmt: skip
    else:
        _gemm_tile_tma(m0, n0, expert, row_end, a_desc, w_desc, out_desc, out_ptr, N, K,
                       stride_om, BLOCK_M, BLOCK_N, BLOCK_K, TMA_STORE, UPCAST, IEEE,
                       WARP_SPEC_K, SWAP_AB)  # fmt: skip


@triton.jit
def _grouped_gemm_tma_kernel(
    a_desc,
    a_half,
    a_quarter,
    a_eighth,
    a_sixteenth,
    w_desc,
    w_half,
    out_desc,
    out_ptr,
    offs_ptr,
    table_ptr,
    N,
    K,
    E,
    NB,
    stride_om,
    NUM_PROGS,
    E_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PERSISTENT: tl.constexpr,
    FLATTEN: tl.constexpr,
    BLOCK_TABLE: tl.constexpr,
    TAIL_SPLIT: tl.constexpr,
    TMA_STORE: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    WARP_SPEC: tl.constexpr,
    SWAP_AB: tl.constexpr,
    TAIL_FINE: tl.constexpr,
    TAIL_EMU: tl.constexpr = 0,
):
    """USE_TMA=1: the same tile mapping as ``_grouped_gemm_kernel``, host-built tensor
    descriptors (``triton.tools.tensor_descriptor.TensorDescriptor``) for A, W and out.
    FLATTEN (persistent only) fuses the tile loop with the K loop into one software
    pipeline, so the next tile's loads are in flight during this tile's store.
    WARP_SPEC hands the pipelined loop to Triton's warp specialization (loads issued by a
    producer warp group, MMAs by the others): the tile loop of the persistent kernel, the
    K loop of the other."""
    pid = tl.program_id(0)
    e_idx, starts, ends, nblk, cum, num_pid_m = _prologue(
        offs_ptr, table_ptr, E, NB, E_PAD, BLOCK_M, PERSISTENT, BLOCK_TABLE
    )
    num_pid_n = tl.cdiv(N, BLOCK_N)
    total_tiles = num_pid_m * num_pid_n

    if PERSISTENT:
        for tile in tl.range(pid, total_tiles, NUM_PROGS, flatten=FLATTEN,
                             warp_specialize=WARP_SPEC):
            _gemm_tile_tma_any(
                tile, a_desc, a_half, a_quarter, (a_eighth, a_sixteenth), w_desc, w_half,
                out_desc, out_ptr, N, K, stride_om,
                e_idx, starts, ends, nblk, cum, table_ptr, NB, num_pid_m, num_pid_n,
                BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, BLOCK_TABLE, TAIL_SPLIT, TMA_STORE,
                UPCAST, IEEE,
                False, SWAP_AB, TAIL_FINE, TAIL_EMU,
            )  # fmt: skip
    else:
        if pid < total_tiles:
            _gemm_tile_tma_any(
                pid, a_desc, a_half, a_quarter, (a_eighth, a_sixteenth), w_desc, w_half,
                out_desc, out_ptr, N, K, stride_om,
                e_idx, starts, ends, nblk, cum, table_ptr, NB, num_pid_m, num_pid_n,
                BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, BLOCK_TABLE, TAIL_SPLIT, TMA_STORE,
                UPCAST, IEEE,
                WARP_SPEC, SWAP_AB, TAIL_FINE, TAIL_EMU,
            )  # fmt: skip


def _next_pow2(x: int) -> int:
    return 1 << max(int(x) - 1, 0).bit_length()


_sm_cache: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    """Programs of the persistent grid: one per SM (CU on AMD), or a few on the CPU.
    "meta" inputs (compile_only's stand-ins) count as the current GPU's."""
    if device.type == "cpu" or not torch.cuda.is_available():
        return _CPU_PROGRAMS
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _sm_cache:
        _sm_cache[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _sm_cache[idx]


def counts_to_offsets(counts: list[int]) -> list[int]:
    """Per-expert row counts -> the [E + 1] offsets list."""
    offs = [0]
    for c in counts:
        offs.append(offs[-1] + int(c))
    return offs


def make_grouped_inputs(
    counts: list[int], N: int, K: int, dtype: str, seed: int, device: str
) -> Inputs:
    """Inputs for explicit per-expert row counts (tests use it to force empty experts)."""
    # Drawn on the device itself: a CPU generator takes seconds for the 0.3 G values of
    # the MoE shape, and a GPU's stream is as seeded and repeatable.
    g = torch.Generator(device=device).manual_seed(seed)
    E = len(counts)
    offs = counts_to_offsets(counts)
    M = offs[-1]
    tdt = _TORCH_DTYPES[dtype]
    a = torch.randn(M, K, generator=g, dtype=torch.float32, device=device)
    # 1/sqrt(K) keeps every output element ~N(0, 1) whatever K is.
    w = torch.randn(E, N, K, generator=g, dtype=torch.float32, device=device) / math.sqrt(K)
    return {
        "a": a.to(tdt).to(device),
        "w": w.to(tdt).to(device),
        "offsets": torch.tensor(offs, dtype=torch.int32).to(device),
        # The eager loop slices on the host; a CPU copy spares it a device sync.
        "offsets_host": offs,
    }


def _torch_grouped_mm() -> Callable[..., torch.Tensor] | None:
    """torch.nn.functional.grouped_mm (public since torch 2.9) or torch._grouped_mm."""
    fn = getattr(torch.nn.functional, "grouped_mm", None)
    return fn if fn is not None else getattr(torch, "_grouped_mm", None)


def _grouped_mm_baseline(inputs: Inputs, shape: Shape) -> Callable[[], torch.Tensor]:
    """torch's grouped GEMM: 2D A [M, K] x 3D B [E, K, N] with int32 ``offs`` = the
    experts' end rows. W.transpose(1, 2) is the column-major B it takes without a copy.
    Its kernels want 16-byte aligned rows (K and N multiples of 8 in bf16) and, on CUDA,
    bf16 on sm90+ for the fast path; where this torch refuses the problem, the raise
    reaches the bench, which reports the baseline as failed."""
    fn = _torch_grouped_mm()
    if fn is None:
        raise RuntimeError("this torch has no grouped_mm")
    a, w = inputs["a"], inputs["w"]
    b = w.transpose(1, 2)
    ends = inputs["offsets"][1:].to(torch.int32).contiguous()
    return lambda: fn(a, b, offs=ends, out_dtype=a.dtype)


def _dense_baseline(inputs: Inputs, shape: Shape) -> Callable[[], torch.Tensor]:
    """One dense [M, K] x [K, N] GEMM (expert 0's weight for every row): the same
    2*M*N*K FLOPs and output shape, not the same result."""
    a, w = inputs["a"], inputs["w"]
    b = w[0].t()
    out = torch.empty(a.shape[0], w.shape[1], dtype=a.dtype, device=a.device)
    return lambda: torch.mm(a, b, out=out)


class GroupedGemm(Launches, Kernel):
    """Contiguous grouped GEMM: ``out[M, N] = A[rows of e] @ W[e]^T`` for each expert e."""

    name: ClassVar[str] = "grouped_gemm"
    dims: ClassVar[tuple[str, ...]] = ("M", "N", "K", "E")
    # M (routed rows) varies per batch and is matched by nearest; the layer fixes the rest.
    exact_dims: ClassVar[tuple[str, ...]] = ("N", "K", "E")
    default_config: ClassVar[dict[str, Any]] = {
        "BLOCK_M": 64,
        "BLOCK_N": 128,
        "BLOCK_K": 64,
        "GROUP_M": 8,
        "num_warps": 4,
        "num_stages": 3,
        "PERSISTENT": 0,
        "USE_TMA": 0,
        "FLATTEN": 0,
        "TMA_STORE": 0,
        "WARP_SPEC": 0,
        "TAIL_SPLIT": 0,
        "BLOCK_TABLE": 0,
        "TAIL_WINDOW": 0,
        "GLUON": 0,
        "SWAP_AB": 0,
        "TAIL_FINE": 0,
        "DIRECT_STORE": 0,
        "TALL_TILE": 0,
        "TAIL_DEAL": 0,
    }
    shapes: ClassVar[dict[str, dict[str, int]]] = {
        # DeepSeek-V2-Lite / MoE-16B expert up-projection shape: 64 experts, hidden 2048,
        # expert FFN 1408, 8192 tokens routed to top-6.
        "deepseek-v3-16b": {"M": 8192 * 6, "N": 1408, "K": 2048, "E": 64},
        "test": {"M": 320, "N": 128, "K": 128, "E": 4},
    }

    # -- inputs and semantics ---------------------------------------------------------
    def make_inputs(self, shape: Shape, dtype: str, seed: int, device: str) -> Inputs:
        """Random routing with realistic imbalance: expert popularity is log-normal
        (sigma 0.5: the hottest of 64 experts gets ~3x the mean load, as with a trained
        router), and each expert is unused with probability 1/16, so empty experts occur;
        then the M rows are drawn from that distribution."""
        s = self.validate_shape(shape)
        counts = self.routing_counts(s, seed)
        # A different seed stream for the data, so the data does not depend on routing.
        return make_grouped_inputs(counts, s["N"], s["K"], dtype, seed + 7919, device)

    @staticmethod
    def routing_counts(shape: Shape, seed: int) -> list[int]:
        """The rows each expert gets in ``make_inputs`` (see there), without the data."""
        M, E = int(shape["M"]), int(shape["E"])
        g = torch.Generator(device="cpu").manual_seed(seed)
        probs = torch.exp(0.5 * torch.randn(E, generator=g))
        unused = torch.rand(E, generator=g) < 1 / 16
        if bool(unused.all()):
            unused[0] = False
        probs = torch.where(unused, torch.zeros_like(probs), probs)
        if M > 0:
            picks = torch.multinomial(probs, M, replacement=True, generator=g)
            counts = torch.bincount(picks, minlength=E).tolist()
        else:
            counts = [0] * E
        return counts

    def reference(self, inputs: Inputs, shape: Shape) -> torch.Tensor:
        a, w, offs = inputs["a"], inputs["w"], inputs["offsets_host"]
        out = torch.zeros(a.shape[0], w.shape[1], dtype=torch.float32, device=a.device)
        for e in range(w.shape[0]):
            lo, hi = offs[e], offs[e + 1]
            if hi > lo:
                out[lo:hi] = a[lo:hi].float() @ w[e].float().t()
        return out

    def eager(self, inputs: Inputs, shape: Shape) -> torch.Tensor:
        """The loop users write: one torch.mm per expert into a preallocated output.
        The loop runs over the host offsets, so it is static under torch.compile."""
        a, w, offs = inputs["a"], inputs["w"], inputs["offsets_host"]
        out = torch.empty(a.shape[0], w.shape[1], dtype=a.dtype, device=a.device)
        for e in range(w.shape[0]):
            lo, hi = offs[e], offs[e + 1]
            if hi > lo:
                torch.mm(a[lo:hi], w[e].t(), out=out[lo:hi])
        return out

    def _launches(self, inputs: Inputs, config: Config) -> tuple[list[Launch], torch.Tensor]:
        """The config's launches (the block table's first with BLOCK_TABLE, then the
        GEMM) and the output: what the launcher runs and compile_only compiles."""
        cfg = {**self.default_config, **config}
        a, w, offsets = inputs["a"], inputs["w"], inputs["offsets"]
        M, K = a.shape
        E, N, _ = w.shape
        if a.stride(1) != 1 or w.stride(2) != 1:
            raise ValueError("grouped_gemm: A and W need a contiguous K dimension")
        out = torch.empty(M, N, dtype=a.dtype, device=a.device)
        bm, bn, bk = int(cfg["BLOCK_M"]), int(cfg["BLOCK_N"]), int(cfg["BLOCK_K"])
        persistent = int(cfg["PERSISTENT"])
        tail_split = int(cfg["TAIL_SPLIT"])
        tail_fine = int(cfg["TAIL_FINE"])
        block_table = bool(int(cfg["BLOCK_TABLE"]))
        e_pad = max(2, _next_pow2(E))

        # Virtual m-blocks, known without a sync: sum_e ceil(cnt_e / BM) <= M // BM + E,
        # and with the table's split tails each expert adds at most TAIL_SPLIT pieces.
        nb = M // bm + E * (max(1, tail_split) if block_table else 1)
        tiles_bound = nb * triton.cdiv(N, bn)
        num_progs = max(1, min(_num_sms(a.device), tiles_bound)) if persistent else 1
        grid = (num_progs if persistent else max(1, tiles_bound),)
        launches: list[Launch] = []
        # Unused without BLOCK_TABLE: the offsets stand in for the pointer.
        table = offsets
        if block_table:
            # Allocated once per launcher, refilled by every call (the routing may change
            # between calls on the same buffers).
            table = torch.empty(4 * nb + 2, dtype=torch.int32, device=a.device)
            chunk = max(16, min(256, 4096 // e_pad))
            launches.append(Launch(
                _block_table_kernel, (triton.cdiv(nb, chunk),), (offsets, table, E, nb),
                {"E_PAD": e_pad, "BLOCK_M": bm, "TAIL_SPLIT": tail_split,
                 "TAIL_WINDOW": int(cfg["TAIL_WINDOW"]), "CHUNK": chunk,
                 "TAIL_FINE": tail_fine, "TALL": int(cfg["TALL_TILE"]),
                 "num_warps": 4},
            ))  # fmt: skip

        launch_kw: dict[str, Any] = {
            "num_warps": int(cfg["num_warps"]),
            "num_stages": int(cfg["num_stages"]),
        }
        if a.device.type != "cpu" and torch.version.hip is not None:
            launch_kw.update({k: cfg[k] for k in _AMD_KWARGS if k in cfg})

        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        common = {
            "E_PAD": e_pad,
            "BLOCK_M": bm,
            "BLOCK_N": bn,
            "BLOCK_K": bk,
            "GROUP_M": int(cfg["GROUP_M"]),
            "PERSISTENT": persistent,
            "BLOCK_TABLE": block_table,
            "TAIL_SPLIT": tail_split,
            "UPCAST": interpreted and a.dtype != torch.float32,
            # fp32 inputs get true fp32 products, not TF32, so fp32 results stay fp32-exact.
            "IEEE": a.dtype == torch.float32,
            **launch_kw,
        }
        if int(cfg["GLUON"]):
            launches.append(self._gluon_launch(a, w, out, table, nb, num_progs, cfg))
            return launches, out
        if int(cfg.get("USE_TMA", 0)):
            self._check_tma_layout(a, w)
            # The descriptors are built once, here, not per launch.
            a_desc = TensorDescriptor.from_tensor(a, [bm, bk])
            w_desc = TensorDescriptor.from_tensor(w.view(E * N, K), [bn, bk])
            out_desc = TensorDescriptor.from_tensor(out, [bm, bn])
            # The smaller tiles' boxes; where a config has none, the full ones stand in.
            a_half = a_quarter = a_desc
            w_half = w_desc
            if tail_split >= 1:
                a_half = TensorDescriptor.from_tensor(a, [bm // 2, bk])
                w_half = TensorDescriptor.from_tensor(w.view(E * N, K), [bn // 2, bk])
            if tail_split >= 2:
                a_quarter = TensorDescriptor.from_tensor(a, [bm // 4, bk])
            a_fine = [a_quarter, a_quarter]
            for f in range(tail_fine):
                a_fine[f] = TensorDescriptor.from_tensor(a, [bm >> (3 + f), bk])
            args = (a_desc, a_half, a_quarter, *a_fine, w_desc, w_half, out_desc, out,
                    offsets, table, N, K, E, nb, out.stride(0), num_progs)
            meta = {
                **common,
                "FLATTEN": bool(int(cfg["FLATTEN"])),
                "TMA_STORE": bool(int(cfg["TMA_STORE"])),
                "WARP_SPEC": bool(int(cfg["WARP_SPEC"])),
                "SWAP_AB": bool(int(cfg["SWAP_AB"])),
                "TAIL_FINE": tail_fine,
                # A diagnostic only (diag_grouped_tailcost.py), in no search space.
                "TAIL_EMU": int(cfg.get("TAIL_EMU", 0)),
            }
            launches.append(Launch(_grouped_gemm_tma_kernel, grid, args, meta))
            return launches, out
        args = (
            a, w, out, offsets, table, N, K, E, nb,
            a.stride(0), w.stride(0), w.stride(1), out.stride(0),
            num_progs,
        )  # fmt: skip
        meta = {**common, "EVEN_K": K % bk == 0}
        launches.append(Launch(_grouped_gemm_kernel, grid, args, meta))
        return launches, out

    def _gluon_launch(self, a: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
                      table: torch.Tensor, nb: int, num_progs: int, cfg: Config) -> Launch:
        """GLUON's GEMM launch: the persistent Gluon kernel over the block table, one
        program per SM (the table's launch comes first), or for GLUON=3 without the table
        over the experts' offsets (``table`` is then ``offsets``)."""
        if _gluon is None:
            raise RuntimeError(f"GLUON: this Triton has no Gluon Hopper API ({_GLUON_MISSING})")
        if a.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"grouped_gemm GLUON takes bf16 or fp16, not {a.dtype}")
        self._check_tma_layout(a, w)
        M, K = a.shape
        E, N, _ = w.shape
        bm, bn, bk = int(cfg["BLOCK_M"]), int(cfg["BLOCK_N"]), int(cfg["BLOCK_K"])
        # The three A boxes share the full box's layout: a shorter box fills a prefix of
        # the same ring buffer.
        a_layout = _gluon.shared_layout([bm, bk], a.dtype)
        desc = _gluon.TensorDescriptor.from_tensor
        # A descriptor's shape must be positive: an empty A (M = 0) still gets one, of a
        # row that no tile reads.
        a_rows = a if M else torch.empty(1, K, dtype=a.dtype, device=a.device)
        out_rows = out if M else torch.empty(1, N, dtype=a.dtype, device=a.device)
        out_layout = _gluon.shared_layout([bm, bn], a.dtype)
        args = (
            desc(a_rows, [bm, bk], a_layout),
            desc(a_rows, [bm // 2, bk], a_layout),
            desc(a_rows, [bm // 4, bk], a_layout),
            desc(w.view(E * N, K), [bn, bk], _gluon.shared_layout([bn, bk], a.dtype)),
            desc(out_rows, [bm, bn], out_layout),
            desc(out_rows, [bm // 2, bn], out_layout),
            desc(out_rows, [bm // 4, bn], out_layout),
            # Without the table (GLUON=3, BLOCK_TABLE=0) the kernel reads the offsets and
            # finds each tile's expert itself: the expert count instead of the table's.
            out, table, N, K, nb if int(cfg["BLOCK_TABLE"]) else E, out.stride(0),
        )
        stages = int(cfg["num_stages"])
        if int(cfg["GLUON"]) >= 3:
            # The table's fine pieces (TAIL_FINE): boxes of an eighth and a sixteenth.
            fine = tuple(desc(a_rows, [max(bm >> f, 1), bk], a_layout) for f in (3, 4))
            return self._gluon_ws_launch(args + fine, num_progs, cfg, E)
        if triton.cdiv(K, bk) < stages:
            # The consumer takes each tile from the producer, STAGES - 1 steps ahead.
            raise ValueError(f"grouped_gemm GLUON: K={K} has fewer than num_stages={stages} "
                             f"steps of BLOCK_K={bk}")
        meta = {
            "BM": bm, "BN": bn, "BK": bk, "STAGES": stages,
            "GROUP_M": int(cfg["GROUP_M"]), "TAIL_SPLIT": int(cfg["TAIL_SPLIT"]),
            "TMA_STORE": bool(int(cfg["TMA_STORE"])), "DYNAMIC": int(cfg["GLUON"]) == 2,
            "num_warps": int(cfg["num_warps"]),
        }
        return Launch(_gluon.grouped_gemm_gluon_kernel, (num_progs,), args, meta)

    @staticmethod
    def _gluon_ws_launch(args: tuple, num_progs: int, cfg: Config, experts: int) -> Launch:
        """GLUON=3 / 4's launch, with the Gluon engine's arguments."""
        if _gluon_ws is None:
            raise RuntimeError(f"GLUON={cfg['GLUON']}: this Triton cannot warp-specialize "
                               f"Gluon ({_GLUON_WS_MISSING})")
        meta = {
            "BM": int(cfg["BLOCK_M"]), "BN": int(cfg["BLOCK_N"]), "BK": int(cfg["BLOCK_K"]),
            "STAGES": int(cfg["num_stages"]), "GROUP_M": int(cfg["GROUP_M"]),
            "TAIL_SPLIT": int(cfg["TAIL_SPLIT"]), "TAIL_FINE": int(cfg["TAIL_FINE"]),
            "TMA_STORE": bool(int(cfg["TMA_STORE"])),
            "DYNAMIC": int(cfg["GLUON"]) == 4, "DIRECT": bool(int(cfg["DIRECT_STORE"])),
            "SWAP_AB": bool(int(cfg["SWAP_AB"])), "TALL": bool(int(cfg["TALL_TILE"])),
            "TALL_CLASS": TALL_CLASS, "INLINE": not int(cfg["BLOCK_TABLE"]),
            "DEAL": bool(int(cfg["TAIL_DEAL"])),
            # The experts' vector of the in-kernel lookup: two a lane at least.
            "E_PAD": max(64, _next_pow2(experts)),
            "PRODUCER_REGS": _gluon_ws.PRODUCER_REGS,
            "CONSUMER_REGS": _gluon_ws.CONSUMER_REGS, "num_warps": int(cfg["num_warps"]),
        }
        return Launch(_gluon_ws.grouped_gemm_gluon_ws_kernel, (num_progs,), args, meta)

    @staticmethod
    def _check_gluon(cfg: Config, shape: Shape, device: DeviceSpec) -> str | None:
        """GLUON's own limits: Hopper's wgmma, and the one shape of kernel it is (the
        table's tiles, TMA loads, persistent; its cross-tile pipeline is its own, so
        FLATTEN and WARP_SPEC would repeat a config)."""
        engine = int(cfg["GLUON"])
        if engine not in (1, 2, 3, 4):
            return (f"GLUON={cfg['GLUON']}: 0 (Triton), 1 (fixed stride), 2 (counter), "
                    "3 / 4 (warp-specialized; fixed stride / counter)")
        if _gluon is None:
            return f"GLUON: Triton {triton.__version__} has no Gluon Hopper API"
        if not device.has_wgmma or device.interpreted:
            return f"GLUON: needs Hopper's wgmma (sm_90), not {device.key}"
        needs = {"USE_TMA": 1, "PERSISTENT": 1, "BLOCK_TABLE": 1, "FLATTEN": 0, "WARP_SPEC": 0}
        if engine == 3 and not int(cfg["BLOCK_TABLE"]):
            # The warp-specialized engine by stride can find each tile's expert itself
            # (no table launch) where an expert's blocks are full ones and one short tail
            # (half a block, or with TAIL_FINE the least piece that holds it).
            # With TALL_TILE its tiles are tall ones and one last tile of at most a block.
            del needs["BLOCK_TABLE"]
            if int(cfg["TAIL_SPLIT"]) > 1 or int(cfg["TAIL_WINDOW"]):
                return "GLUON=3 with BLOCK_TABLE=0 needs TAIL_SPLIT <= 1 and TAIL_WINDOW=0"
        wrong = [f"{k}={v}" for k, v in needs.items() if int(cfg[k]) != v]
        if wrong:
            return f"GLUON needs {', '.join(wrong)}"
        bm, split = int(cfg["BLOCK_M"]), int(cfg["TAIL_SPLIT"])
        if engine >= 3:
            return GroupedGemm._check_gluon_ws(cfg)
        # A warp group's wgmma covers 64 rows at least: the smallest tile too.
        if bm >> split < 64:
            return f"GLUON: BLOCK_M={bm} >> TAIL_SPLIT={split} is below wgmma's 64 rows"
        if int(cfg["num_warps"]) not in (4, 8):
            return f"GLUON: num_warps={cfg['num_warps']}: one or two warp groups"
        if int(cfg["num_stages"]) < 2:
            return "GLUON: the ring needs num_stages >= 2"
        if triton.cdiv(int(shape["K"]), int(cfg["BLOCK_K"])) < int(cfg["num_stages"]):
            return (f"GLUON: K={shape['K']} has fewer than num_stages={cfg['num_stages']} "
                    f"steps of BLOCK_K={cfg['BLOCK_K']}")
        return None

    @staticmethod
    def _check_gluon_ws(cfg: Config) -> str | None:
        """GLUON=3 / 4's limits: num_warps=4, two consumers of one warp group each, each
        holding a whole tile; num_warps=8, one consumer of two warp groups. Tiles of >= 64
        rows run as they are, tails below 64 rows (and every tile with SWAP_AB) transposed:
        W's BN rows on wgmma's M (16 a warp), the tile's rows on its N (>= 8)."""
        ws = f"GLUON={cfg['GLUON']}"
        if _gluon_ws is None:
            return f"{ws}: Triton {triton.__version__} cannot load it ({_GLUON_WS_MISSING})"
        if not _gluon_ws.WS_API:
            return f"{ws}: Triton {triton.__version__}'s gl.warp_specialize is the old form"
        bm, bn, split = int(cfg["BLOCK_M"]), int(cfg["BLOCK_N"]), int(cfg["TAIL_SPLIT"])
        warps = int(cfg["num_warps"])
        if warps not in (4, 8):
            return (f"{ws}: num_warps={warps}: 4 (two consumers of one warp group) or 8 "
                    "(one of two)")
        if int(cfg["num_stages"]) < 2:
            return f"{ws}: the ring needs num_stages >= 2"
        fine, swap = int(cfg["TAIL_FINE"]), int(cfg["SWAP_AB"])
        smallest = bm >> (split + fine)
        if (bm < 64 and not swap) or smallest < 8:
            return (f"{ws}: BLOCK_M={bm}, TAIL_SPLIT={split}, TAIL_FINE={fine}, SWAP_AB={swap}: "
                    "full tiles of >= 64 rows (a warp group's wgmma) unless transposed, "
                    "every tile >= 8 rows")
        rows_on_m = 16 * warps
        if bn % 64 or ((swap or smallest < 64) and bn % rows_on_m):
            return (f"{ws}: BLOCK_N={bn}, num_warps={warps}: a multiple of 64, and of "
                    f"{rows_on_m} where a tile runs transposed (W's rows on wgmma's M, 16 a "
                    "warp)")
        per_thread = bm * bn // (32 * warps)
        if int(cfg["TALL_TILE"]):
            # One warp group holds a tall tile's two accumulators (BLOCK_M and half of it
            # routed rows, transposed): 192 fp32 a thread at 128 x 128, what ptxas fits
            # in a consumer's 232 registers without spilling with staged stores (sm_90,
            # Triton 3.6 and 3.9); with DIRECT_STORE Triton 3.6's ptxas spills 160 bytes.
            if warps != 4 or not swap:
                return f"{ws}: TALL_TILE=1 needs num_warps=4 and SWAP_AB=1 (ping-pong, transposed)"
            per_thread += per_thread // 2
            if per_thread > _gluon_ws.CONSUMER_REGS - 40:
                return (f"{ws}: TALL_TILE=1 at {bm}x{bn}: {per_thread} accumulator registers "
                        f"a thread, more than a consumer's {_gluon_ws.CONSUMER_REGS} leave "
                        "room for")
        elif per_thread > _gluon_ws.CONSUMER_REGS - 64:
            return (f"{ws}: a {bm}x{bn} accumulator is {per_thread} registers a thread, "
                    f"more than a consumer's {_gluon_ws.CONSUMER_REGS} leave room for")
        return None

    @staticmethod
    def _check_tma_layout(a: torch.Tensor, w: torch.Tensor) -> None:
        """TMA wants 16-byte aligned bases and row strides, and W's [E, N] rows must
        flatten to one [E*N, K] matrix."""
        for name, t in (("A", a), ("W", w)):
            # Meta tensors (compile_only) have no address to check.
            base = 0 if t.device.type == "meta" else t.data_ptr()
            if base % 16 or (t.stride(-2) * t.element_size()) % 16:
                raise ValueError(f"grouped_gemm USE_TMA: {name} is not 16-byte aligned")
        if w.stride(0) != w.shape[1] * w.stride(1):
            raise ValueError("grouped_gemm USE_TMA: W's experts are not contiguous")

    # -- baselines --------------------------------------------------------------------
    def baselines(self) -> dict[str, Callable[[Inputs, Shape], Callable[[], Any]]]:
        """torch's grouped GEMM where this torch has it, and a dense cuBLAS GEMM of the
        same FLOPs (a speed yardstick only: it multiplies every row by expert 0's W, so
        its accuracy reads as a mismatch)."""
        out: dict[str, Callable[[Inputs, Shape], Callable[[], Any]]] = {}
        if _torch_grouped_mm() is not None:
            out["torch._grouped_mm"] = _grouped_mm_baseline
        out["dense cuBLAS (same FLOPs, not the same result)"] = _dense_baseline
        return out

    # -- cost model -------------------------------------------------------------------
    def flops(self, shape: Shape) -> float:
        return 2.0 * shape["M"] * shape["N"] * shape["K"]

    def bytes_moved(self, shape: Shape, dtype: str) -> float:
        M, N, K, E = (int(shape[d]) for d in self.dims)
        item = torch.tensor([], dtype=_TORCH_DTYPES[dtype]).element_size()
        return float((M * K + E * N * K + M * N) * item + (E + 1) * 4)

    # -- accuracy and validity --------------------------------------------------------
    def tolerance(self, dtype: str, config: Config) -> Tolerance:
        # Outputs are O(1); the error is the final rounding to the input dtype plus fp32
        # summation order. fp32 runs with IEEE products (no TF32), hence the tight bound.
        return {
            "fp32": Tolerance(1e-4, 1e-4),
            "fp16": Tolerance(1e-2, 1e-2),
        }.get(dtype, Tolerance(2e-2, 2e-2))

    def check_config(self, config: Config, shape: Shape, device: DeviceSpec) -> str | None:
        cfg = {**self.default_config, **config}
        bm, bn, bk = int(cfg["BLOCK_M"]), int(cfg["BLOCK_N"]), int(cfg["BLOCK_K"])
        warps, stages = int(cfg["num_warps"]), int(cfg["num_stages"])
        N, K = int(shape["N"]), int(shape["K"])

        if int(cfg.get("TAIL_EMU", 0)):
            return "TAIL_EMU is a diagnostic (wrong tail rows on purpose), not a tunable"
        # AMD launch knobs are refused by the NVIDIA backend; the launcher drops them
        # there, so such a config would only repeat the one without them.
        amd_keys = [k for k in _AMD_KWARGS if k in config]
        if amd_keys and device.vendor != "amd":
            return f"{', '.join(amd_keys)}: AMD-only launch options on a {device.vendor} device"
        # tl.dot needs every tile dimension >= 16 and arange needs powers of two.
        for name, v in (("BLOCK_M", bm), ("BLOCK_N", bn), ("BLOCK_K", bk)):
            if v < 16 or v & (v - 1):
                return f"{name}={v}: must be a power of two >= 16"
        if int(cfg.get("USE_TMA", 0)):
            # Interpreted Triton emulates descriptors (checked on 3.9), so CPU runs test it.
            if not (device.has_tma or device.interpreted):
                return f"USE_TMA=1: {device.key} has no TMA"
            # Row strides must be 16-byte multiples (2-byte dtypes assumed, as below).
            if K % 8:
                return f"USE_TMA=1: K={K} rows are not 16-byte aligned"
            # A TMA box is at most 256 elements a side.
            if max(bm, bn, bk) > 256:
                return "USE_TMA=1: TMA boxes are at most 256 elements a side"
        flatten, tma_store = int(cfg["FLATTEN"]), int(cfg["TMA_STORE"])
        # Both only exist in the TMA kernel; elsewhere they would repeat another config.
        if flatten and not (int(cfg.get("USE_TMA", 0)) and int(cfg["PERSISTENT"])):
            return "FLATTEN=1 needs USE_TMA=1 and PERSISTENT=1"
        if tma_store and not int(cfg.get("USE_TMA", 0)):
            return "TMA_STORE=1 needs USE_TMA=1"
        if int(cfg["SWAP_AB"]) and (not int(cfg.get("USE_TMA", 0))
                                    or int(cfg["GLUON"]) in (1, 2)):
            return ("SWAP_AB=1 needs USE_TMA=1 with GLUON=0 (the Triton TMA kernel) or 3 / 4 "
                    "(the warp-specialized one)")
        if flatten and tma_store and _FLATTEN_STORE_BROKEN and not device.interpreted:
            return (f"FLATTEN=1 with TMA_STORE=1: Triton {triton.__version__} cannot fuse the "
                    "loops around the conditional store")
        if int(cfg["WARP_SPEC"]):
            if not int(cfg.get("USE_TMA", 0)):
                return "WARP_SPEC=1 needs USE_TMA=1"
            if device.vendor != "nvidia" and not device.interpreted:
                return f"WARP_SPEC=1: Triton warp-specializes on NVIDIA GPUs only, not {device.key}"
        split = int(cfg["TAIL_SPLIT"])
        if int(cfg["GLUON"]):
            why = self._check_gluon(cfg, shape, device)
            if why:
                return why
        if split:
            # The smaller tiles are still tl.dot tiles (>= 16 a side); a flattened loop is
            # one software pipeline of one tile shape.
            if split not in (1, 2):
                return f"TAIL_SPLIT={split}: 0, 1 (halves) or 2 (halves and quarters)"
            if bm >> split < 16 or bn < 32:
                return (f"TAIL_SPLIT={split}: BLOCK_M={bm} >> {split} or half of "
                        f"BLOCK_N={bn} is below 16")
            if split == 2 and not int(cfg["BLOCK_TABLE"]):
                return "TAIL_SPLIT=2 needs BLOCK_TABLE=1 (a tail of several pieces)"
            if flatten:
                return "TAIL_SPLIT with FLATTEN=1: the flattened pipeline has one tile shape"
        fine = int(cfg["TAIL_FINE"])
        if fine:
            # The quarter piece shrinks: the table's classes 3 and 4, TMA boxes of the
            # Triton kernel.
            if fine not in (1, 2):
                return f"TAIL_FINE={fine}: 0, 1 (eighths) or 2 (eighths and sixteenths)"
            # The warp-specialized engine runs any class the table makes; the Triton
            # kernel's fine classes are a quarter piece's (TAIL_SPLIT=2). With TAIL_SPLIT=1
            # an expert's one tail piece shrinks from half a block to the smallest class
            # that holds its rows.
            ws = int(cfg["GLUON"]) in (3, 4)
            splits = {0: (2,), 3: (1, 2), 4: (1, 2)}.get(int(cfg["GLUON"]), ())
            if split not in splits or not int(cfg.get("USE_TMA", 0)):
                return ("TAIL_FINE needs USE_TMA=1 and TAIL_SPLIT=2 with GLUON=0, or "
                        "TAIL_SPLIT=1 or 2 with GLUON=3 or 4")
            # tl.dot's 16; the warp-specialized Gluon engine's wgmma N goes down to 8.
            least = 8 if ws else 16
            if bm >> (split + fine) < least:
                return f"TAIL_FINE={fine}: BLOCK_M={bm} >> {split + fine} is below {least}"
        window = int(cfg["TAIL_WINDOW"])
        if window < 0:
            return f"TAIL_WINDOW={window}: must be >= 0"
        # Only the table orders blocks, and only split tails give it smaller ones to order.
        if window and not (split and int(cfg["BLOCK_TABLE"])):
            return "TAIL_WINDOW > 0 needs BLOCK_TABLE=1 and TAIL_SPLIT >= 1"
        if int(cfg["DIRECT_STORE"]) and (int(cfg["GLUON"]) < 3 or tma_store):
            return "DIRECT_STORE=1 needs GLUON=3 or 4 and TMA_STORE=0"
        if int(cfg["TALL_TILE"]) not in (0, 1):
            return f"TALL_TILE={cfg['TALL_TILE']}: 0 or 1"
        if int(cfg["TALL_TILE"]) and int(cfg["GLUON"]) < 3:
            return "TALL_TILE=1 needs GLUON=3 or 4 (the warp-specialized engine)"
        deal = int(cfg["TAIL_DEAL"])
        if deal not in (0, 1):
            return f"TAIL_DEAL={cfg['TAIL_DEAL']}: 0 or 1"
        # Dealing needs the experts' vectors (no table), a fixed stride, and the half
        # tiles of an expert as one run of n-tiles (GROUP_M=1).
        if deal and (int(cfg["GLUON"]), int(cfg["BLOCK_TABLE"]), int(cfg["GROUP_M"]),
                     split) != (3, 0, 1, 1):
            return "TAIL_DEAL=1 needs GLUON=3, BLOCK_TABLE=0, GROUP_M=1 and TAIL_SPLIT=1"
        if tma_store and N % 8:
            return f"TMA_STORE=1: N={N} output rows are not 16-byte aligned"
        if int(cfg["GROUP_M"]) < 1:
            return f"GROUP_M={cfg['GROUP_M']}: must be >= 1"
        # A tile more than twice the padded dimension is mostly masked-out work.
        if bn > max(16, _next_pow2(N)):
            return f"BLOCK_N={bn} > next_pow2(N)={_next_pow2(N)}"
        if bk > max(16, _next_pow2(K)):
            return f"BLOCK_K={bk} > next_pow2(K)={_next_pow2(K)}"
        # Shared memory: the software pipeline keeps num_stages A and W tiles resident;
        # the epilogue's layout conversion reuses that space, so it only counts when larger.
        # check_config does not see the dtype: 2 bytes (bf16/fp16, the tuned dtypes) is
        # assumed; an fp32 config that does not fit fails at compile time instead.
        # AMD's stream pipeliner holds one stage in registers, so it needs one LDS buffer
        # fewer than it has stages.
        item = 2
        buffers = max(1, stages - 1) if device.vendor == "amd" else stages
        # TALL_TILE's slots hold half a block more of A.
        a_rows = bm + (bm // 2 if int(cfg["TALL_TILE"]) else 0)
        pipeline, epilogue = buffers * (a_rows * bk + bn * bk) * item, bm * bn * item
        # A flattened loop keeps loading the next tile while this one is stored, and a
        # TMA store stages the tile in a buffer of its own: then both are live at once.
        # So does the Gluon kernel's staging tile, which every store goes through.
        staged = flatten or tma_store or int(cfg["GLUON"])
        # GLUON=3 / 4's two consumers (num_warps=4) each stage their own tile, unless
        # they store from registers.
        epilogue *= 2 if int(cfg["GLUON"]) >= 3 and warps == 4 else 1
        epilogue *= 0 if int(cfg["DIRECT_STORE"]) else 1
        smem = pipeline + epilogue if staged else max(pipeline, epilogue)
        if smem > device.smem_per_block:
            return f"shared memory ~{smem} B > {device.smem_per_block} B per block"
        # Registers: the fp32 accumulator is spread over the threads; beyond 256 fp32
        # values a thread (half the 255-register file is already the operands'
        # fragments and addresses) it spills for certain.
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
