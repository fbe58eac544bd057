"""The grouped GEMM as a persistent Gluon kernel for Hopper (``ENGINE=gluon``).

Triton's compiler decides the pipeline of the Triton kernels; here it is written out, so
that what Triton cannot express here is possible: one program per SM walks its tiles
(the block table's m-blocks x n-tiles, stride = the grid) with a single ring of
``STAGES`` shared-memory buffers whose TMA loads run ahead *across* tile boundaries, so
the next tile's first loads are in flight while this tile's last wgmma runs and its
epilogue stores. Tails (the table's half / quarter-height blocks, ``TAIL_SPLIT``) load a
shorter A box into the same buffers and run a smaller wgmma; a whole tile that lies
inside its expert leaves through a TMA store that overlaps the next tile.

Gluon needs no interpreter support and no pre-Hopper path: the family prunes this engine
wherever wgmma is missing (``GroupedGemm.check_config``), and its tests compile it for
sm_90 without a GPU.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

__all__ = ["TensorDescriptor", "grouped_gemm_gluon_kernel", "shared_layout"]

# Triton 3.7 renamed the TMA copies (the old names raise from 3.9 on); 3.6 has only the
# old ones.
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global


def shared_layout(block: list[int], dtype: torch.dtype) -> gl.NVMMASharedLayout:
    """The swizzled shared layout TMA writes and wgmma reads, for a box of one shape and
    torch dtype (bf16 or fp16)."""
    gdt = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]
    return gl.NVMMASharedLayout.get_default_for(block, gdt)


@gluon.constexpr_function
def _mma_layout(BM, BN, num_warps):
    """wgmma's accumulator layout for a BM x BN tile: warps stacked along M while each
    still gets 16 rows, then along N; the widest instruction N that fits."""
    warps = [4, 1]
    while warps[0] * warps[1] != num_warps:
        if BM > 16 * warps[0]:
            warps[0] *= 2
        else:
            warps[1] *= 2
    m_reps = (BM + 15) // 16
    n_reps = (num_warps + m_reps - 1) // m_reps
    max_n = max(BN // n_reps, 8)
    n = 256
    while n > max_n or BN % n:
        n -= 8
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=warps, instr_shape=[16, n, 16])


@gluon.jit
def _grouped_order(tile, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
    """(m-block, n-tile) of ``tile`` in the Triton kernels' grouped order: GROUP_M
    m-blocks sweep the n-tiles together."""
    in_group = GROUP_M * num_pid_n
    first_m = (tile // in_group) * GROUP_M
    size_m = gl.minimum(num_pid_m - first_m, GROUP_M)
    size_m = gl.maximum(size_m, 1)
    pid_m = first_m + (tile % in_group) % size_m
    pid_n = (tile % in_group) // size_m
    return pid_m, pid_n


@gluon.jit
def _tile_info(tile, table_ptr, NB, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
    """(expert, first row, the expert's end row, n-tile, height class) of ``tile``: the
    grouped order over the block table's m-blocks. The m-block is kept inside the table,
    so a predicated-off look-ahead past the last tile reads nothing out of bounds."""
    pid_m, pid_n = _grouped_order(tile, num_pid_m, num_pid_n, GROUP_M)
    pid_m = gl.minimum(gl.maximum(pid_m, 0), NB - 1)
    expert = gl.load(table_ptr + pid_m)
    m0 = gl.load(table_ptr + NB + pid_m)
    row_end = gl.load(table_ptr + 2 * NB + pid_m)
    h = gl.load(table_ptr + 3 * NB + pid_m)
    return expert, m0, row_end, pid_n, h


@gluon.constexpr_function
def _store_layout(BN, num_warps):
    """A coalesced layout for the masked store: 16-byte vectors along a row."""
    tpw_n = min(32, max(BN // 8, 1))
    return gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[32 // tpw_n, tpw_n],
                            warps_per_cta=[num_warps, 1], order=[1, 0])


@gluon.jit
def _next_tile(tile, counter_ptr, P, DYNAMIC: gl.constexpr):
    """The tile a program takes after ``tile``: the next of its fixed stride, or, with
    DYNAMIC, the next one nobody has taken (the table launch zeroed the counter; each
    program's first tile is its id)."""
    if DYNAMIC:
        # Relaxed: the counter only hands out tile ids; it orders no other access.
        nxt = P + gl.atomic_add(counter_ptr, 1, sem="relaxed")
    else:
        nxt = tile + P
    return nxt


@gluon.jit
def _issue_load(p, pk, cur, nxt, sched, ring, BM: gl.constexpr, BN: gl.constexpr,
                BK: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                TAIL_SPLIT: gl.constexpr, DYNAMIC: gl.constexpr):
    """The producer's step ``p``: K step ``pk`` of its current tile ``cur`` (tile id,
    expert, first row, end row, n-tile, height), loaded into ring slot p % STAGES;
    predicated off once the tiles are used up. Crossing into the next tile, ``nxt`` (the
    following tile's id, taken a whole tile earlier, so its counter and table reads are
    long back) becomes current and the one after it is taken. ``sched`` and ``ring``:
    the kernel's tuples (tile bookkeeping; the A and W descriptors and buffers)."""
    total, k_tiles, P, counter_ptr, table_ptr, NB, N, num_pid_m, num_pid_n = sched
    a_desc, a_half, a_quarter, w_desc, bars, a_bufs, w_bufs = ring
    tile, expert, m0, row_end, pid_n, h = cur
    pred = tile < total
    k = pk * BK
    s = p % STAGES
    bar = bars.index(s)
    a_buf = a_bufs.index(s)
    if TAIL_SPLIT >= 2 and h == 2:
        mbarrier.expect(bar, a_quarter.block_type.nbytes + w_desc.block_type.nbytes, pred=pred)
        _tma_load(a_quarter, [m0, k], bar, a_buf.slice(0, BM // 4), pred)
    elif TAIL_SPLIT >= 1 and h == 1:
        mbarrier.expect(bar, a_half.block_type.nbytes + w_desc.block_type.nbytes, pred=pred)
        _tma_load(a_half, [m0, k], bar, a_buf.slice(0, BM // 2), pred)
    else:
        mbarrier.expect(bar, a_desc.block_type.nbytes + w_desc.block_type.nbytes, pred=pred)
        _tma_load(a_desc, [m0, k], bar, a_buf, pred)
    _tma_load(w_desc, [expert * N + pid_n * BN, k], bar, w_bufs.index(s), pred)
    pk += 1
    if pk == k_tiles:
        pk = 0
        cur = nxt
        t2 = _next_tile(nxt[0], counter_ptr, P, DYNAMIC)
        nxt = (t2,) + _tile_info(t2, table_ptr, NB, num_pid_m, num_pid_n, GROUP_M)
    return p + 1, pk, cur, nxt


@gluon.jit
def _tile(c, p, pk, cur, nxt, sched, ring, outs, m0, row_end, n0,
          BM_T: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
          STAGES: gl.constexpr, GROUP_M: gl.constexpr, TAIL_SPLIT: gl.constexpr,
          TMA_STORE: gl.constexpr, DYNAMIC: gl.constexpr, num_warps: gl.constexpr):
    """One BM_T x BN output tile at (m0, n0): its K steps from the ring (each step's
    wgmma left in flight while the producer loads the step STAGES - 1 ahead into the slot
    the previous wgmma has just released), then its store through ``c_smem``. Returns
    the consumer's count and the producer's state. (Two wgmma steps in flight, the
    producer one step less ahead, measured no faster on either GPU: session 15.)"""
    k_tiles = sched[1]
    N = sched[6]
    bars, a_bufs, w_bufs = ring[4], ring[5], ring[6]
    out_ptr, stride_om, out_desc, out_half, out_quarter, c_smem = outs
    layout: gl.constexpr = _mma_layout(BM_T, BN, num_warps)
    acc = gl.zeros([BM_T, BN], gl.float32, layout)
    for _ in range(k_tiles):
        s = c % STAGES
        mbarrier.wait(bars.index(s), (c // STAGES) & 1)
        a = a_bufs.index(s)
        if BM_T < BM:
            a = a.slice(0, BM_T)
        acc = warpgroup_mma(a, w_bufs.index(s).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(1, deps=(acc,))
        p, pk, cur, nxt = _issue_load(p, pk, cur, nxt, sched, ring, BM, BN, BK, STAGES,
                                      GROUP_M, TAIL_SPLIT, DYNAMIC)
        c += 1
    acc = warpgroup_mma_wait(0, deps=(acc,))
    # The previous tile's TMA store may still be reading the staging buffer.
    tma.store_wait(0)
    stage = c_smem
    if BM_T < BM:
        stage = c_smem.slice(0, BM_T)
    stage.store(acc.to(out_ptr.dtype.element_ty))
    _store_tile(stage, outs, m0, row_end, n0, N, BM_T, BM, BN, TMA_STORE, num_warps)
    return c, p, pk, cur, nxt


@gluon.jit
def _store_tile(stage, outs, m0, row_end, n0, N, BM_T: gl.constexpr, BM: gl.constexpr,
                BN: gl.constexpr, TMA_STORE: gl.constexpr, num_warps: gl.constexpr):
    """The BM_T x BN tile staged in ``stage`` to out at (m0, n0): a TMA store (boxes of
    BM, BM/2, BM/4 rows) when it lies inside its expert, else masked stores. ``outs``:
    (out_ptr, stride_om, out_desc, out_half, out_quarter, ...)."""
    out_ptr, stride_om = outs[0], outs[1]
    out_desc, out_half, out_quarter = outs[2], outs[3], outs[4]
    if TMA_STORE and BM_T >= BM // 4 and m0 + BM_T <= row_end:
        fence_async_shared()
        if BM_T == BM:
            _tma_store(out_desc, [m0, n0], stage)
        elif BM_T == BM // 2:
            _tma_store(out_half, [m0, n0], stage)
        else:
            _tma_store(out_quarter, [m0, n0], stage)
    else:
        # A box past the expert's end would write the next expert's rows (and finer
        # tiles have no box): masked stores, read back from shared memory in rows of
        # 16-byte vectors.
        st: gl.constexpr = _store_layout(BN, num_warps)
        vals = stage.load(st)
        rows = m0 + gl.arange(0, BM_T, layout=gl.SliceLayout(1, st))
        cols = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, st))
        ptrs = out_ptr + rows.to(gl.int64)[:, None] * stride_om + cols[None, :]
        gl.store(ptrs, vals, mask=(rows < row_end)[:, None] & (cols < N)[None, :])


@gluon.jit
def grouped_gemm_gluon_kernel(
    a_desc, a_half, a_quarter, w_desc, out_desc, out_half, out_quarter, out_ptr, table_ptr,
    N, K, NB, stride_om,
    BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
    GROUP_M: gl.constexpr, TAIL_SPLIT: gl.constexpr, TMA_STORE: gl.constexpr,
    DYNAMIC: gl.constexpr, num_warps: gl.constexpr,
):
    """out[rows of e] = A[rows of e] @ W[e]^T over the block table's tiles (see the
    module docstring). ``a_desc`` / ``a_half`` / ``a_quarter``: A [M, K] in boxes of BM,
    BM/2, BM/4 rows; ``w_desc``: W as [E*N, K] in [BN, BK] boxes; ``out_desc`` /
    ``out_half`` / ``out_quarter``: out [M, N] in boxes of BM, BM/2, BM/4 rows (used with
    TMA_STORE). The producer runs STAGES - 1 steps ahead of the consumer and, as K has
    at least STAGES steps (the launcher checks), is inside the consumer's next tile
    whenever the consumer starts one: the consumer takes its tiles from the producer."""
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    num_pid_m = gl.load(table_ptr + 4 * NB)
    counter_ptr = table_ptr + 4 * NB + 1
    num_pid_n = gl.cdiv(N, BN)
    total = num_pid_m * num_pid_n
    k_tiles = gl.cdiv(K, BK)

    dtype: gl.constexpr = a_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BM, BK], a_desc.layout)
    w_bufs = gl.allocate_shared_memory(dtype, [STAGES, BN, BK], w_desc.layout)
    c_smem = gl.allocate_shared_memory(dtype, [BM, BN], out_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)

    cur = (pid,) + _tile_info(pid, table_ptr, NB, num_pid_m, num_pid_n, GROUP_M)
    t1 = _next_tile(pid, counter_ptr, P, DYNAMIC)
    nxt = (t1,) + _tile_info(t1, table_ptr, NB, num_pid_m, num_pid_n, GROUP_M)
    sched = (total, k_tiles, P, counter_ptr, table_ptr, NB, N, num_pid_m, num_pid_n)
    ring = (a_desc, a_half, a_quarter, w_desc, bars, a_bufs, w_bufs)
    outs = (out_ptr, stride_om, out_desc, out_half, out_quarter, c_smem)
    p = 0
    pk = 0
    for _i in gl.static_range(STAGES - 1):
        p, pk, cur, nxt = _issue_load(p, pk, cur, nxt, sched, ring, BM, BN, BK, STAGES,
                                      GROUP_M, TAIL_SPLIT, DYNAMIC)
    c = 0
    tile = cur[0]
    while tile < total:
        m0, row_end, n0, h = cur[2], cur[3], cur[4] * BN, cur[5]
        # One call per tile height: a tile's height is a constexpr of its code.
        if TAIL_SPLIT >= 2 and h == 2:
            c, p, pk, cur, nxt = _tile(c, p, pk, cur, nxt, sched, ring, outs, m0, row_end, n0,
                                       BM // 4, BM, BN, BK, STAGES, GROUP_M, TAIL_SPLIT,
                                       TMA_STORE, DYNAMIC, num_warps)
        elif TAIL_SPLIT >= 1 and h == 1:
            c, p, pk, cur, nxt = _tile(c, p, pk, cur, nxt, sched, ring, outs, m0, row_end, n0,
                                       BM // 2, BM, BN, BK, STAGES, GROUP_M, TAIL_SPLIT,
                                       TMA_STORE, DYNAMIC, num_warps)
        else:
            c, p, pk, cur, nxt = _tile(c, p, pk, cur, nxt, sched, ring, outs, m0, row_end, n0,
                                       BM, BM, BN, BK, STAGES, GROUP_M, TAIL_SPLIT,
                                       TMA_STORE, DYNAMIC, num_warps)
        tile = cur[0]
    tma.store_wait(0)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
