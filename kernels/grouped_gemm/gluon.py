"""The grouped GEMM as a warp-specialized, persistent Gluon kernel for Hopper (``GLUON=3``):
a producer warp and the consumer warp groups per SM, the shapes of cuBLAS's and CUTLASS's
own Hopper GEMMs.

Every partition finds each tile's expert itself from the offsets vector (no host sync, no
extra launch). The producer walks this program's tiles (m-blocks x n-tiles, stride = the
grid) and keeps a ring of ``STAGES`` A / W boxes filled by TMA, each slot guarded by a
ready and an empty barrier. With ``num_warps=4`` two consumer warp groups take alternate
tiles of that sequence ("ping-pong"), each with its own BM x BN accumulator: while one
stores a finished tile, the other's wgmmas keep the tensor cores busy. With
``num_warps=8`` one consumer of two warp groups splits each tile ("cooperative"): a
taller tile shares each W box between both groups, at the price of a store the tensor
cores wait for.

Every tile has the same ``k_tiles`` K steps whatever its height, so a consumer finds its
j-th tile's slots in the ring at ``j * k_tiles`` without asking the producer. It starts
waiting on them only once the other consumer has taken all of tile j - 1's (the ``turn``
barriers): an mbarrier wait names a phase by its parity only, so a consumer that waited
two fills ahead of the ring would pass on the fill before its own. That also keeps the
two mainloops in turn, the other's epilogue under each. An expert's short tail
(``TAIL_SPLIT=1``: at most half a block) loads a shorter A box into the same slots and
runs a shorter wgmma; tiles below a warp group's 64 rows (and every tile with
``SWAP_AB``) run transposed, their rows on wgmma's N side, W's on its M side.
``TALL_TILE`` makes an expert's tiles one and a half blocks high (W streamed less often);
``TAIL_DEAL`` deals each wave's short tiles round-robin over the programs.

Gluon has no interpreter support and no pre-Hopper path: ``constraints`` prunes this
engine wherever wgmma is missing, and its tests compile it for sm_90 without a GPU.
"""

from __future__ import annotations

import inspect

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

from harness.kernel.api import Config, Launch

__all__ = ["CONSUMER_REGS", "PRODUCER_REGS", "WS_API", "gluon_launch",
           "grouped_gemm_gluon_ws_kernel"]

# Registers per thread of the worker partitions (setmaxnreg): the producer only issues
# TMA copies; a ping-pong consumer holds a 128 x 128 fp32 accumulator (128 a thread) and
# its addresses. The split cuBLAS and CUTLASS use on Hopper (40 / 232).
PRODUCER_REGS = 40
CONSUMER_REGS = 232
# Older Gluon's gl.warp_specialize took (default_args, default_fn, worker_args, ...); 3.6
# and 3.9 (checked) take a list of (function, args) pairs: only that form is written here.
WS_API = "functions_and_args" in inspect.signature(gl.warp_specialize).parameters
# The height class of TALL_TILE's tiles (one and a half blocks), past the short tail's 1.
TALL_CLASS = 2

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


@gluon.constexpr_function
def _store_layout(BN, num_warps):
    """A coalesced layout for the masked store: 16-byte vectors along a row."""
    tpw_n = min(32, max(BN // 8, 1))
    return gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[32 // tpw_n, tpw_n],
                            warps_per_cta=[num_warps, 1], order=[1, 0])


@gluon.jit
def _add(a, b):
    return a + b


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
def _expert_blocks(offs_ptr, E, BM: gl.constexpr, TAIL_SPLIT: gl.constexpr,
                   E_PAD: gl.constexpr, CW: gl.constexpr, TALL: gl.constexpr = False):
    """The per-expert view of the routing: each expert's (index, first row, end row,
    first m-block, m-blocks, 1 where its last block is a short tail of at most half a
    block (TAIL_SPLIT=1), else 0), as E_PAD-long vectors (the padding empty), whole in
    every warp of the CW that hold them (so that their reductions stay within a warp).

    With TALL: an expert's rows are tall tiles of one and a half blocks, the last of them
    taking a remainder of over one block; what is left (at most a block) is one more
    tile, whose class plus one is the last entry (0 where the last tile is a tall one): a
    full block, or a short tail as above."""
    lay: gl.constexpr = gl.BlockedLayout([E_PAD // 32], [32], [CW], [0])
    e = gl.arange(0, E_PAD, layout=lay)
    starts = gl.load(offs_ptr + e, mask=e < E, other=0)
    ends = gl.load(offs_ptr + e + 1, mask=e < E, other=0)
    STEP: gl.constexpr = BM + (BM // 2) * TALL
    full = (ends - starts) // STEP
    rem = ends - starts - full * STEP
    if TALL:
        over = rem > BM
        full += over.to(gl.int32)
        rem = gl.where(over, 0, rem)
    nblk = full + (rem > 0).to(gl.int32)
    if TAIL_SPLIT == 1:
        short = ((rem > 0) & (rem <= BM // 2)).to(gl.int32)
    else:
        short = gl.zeros_like(rem)
    if TALL:
        short = gl.where(rem > 0, short + 1, 0)
    first = gl.associative_scan(nblk, 0, _add) - nblk
    return e, starts, ends, first, nblk, short


@gluon.jit
def _tile_info(tile, blocks, num_pid_m, num_pid_n, GROUP_M: gl.constexpr,
               BM: gl.constexpr, TALL: gl.constexpr, TALL_CLASS: gl.constexpr):
    """(expert, first row, the expert's end row, n-tile, height class) of ``tile``: its
    m-block in the grouped order, its expert the last non-empty one whose first m-block is
    at or before it. The height class is 0 (a block), 1 (a short tail: half a block) or
    TALL_CLASS (one and a half blocks)."""
    e, starts, ends, first, nblk, short = blocks
    pid_m, pid_n = _grouped_order(tile, num_pid_m, num_pid_n, GROUP_M)
    pid_m = gl.maximum(gl.minimum(pid_m, num_pid_m - 1), 0)
    expert = gl.max(gl.where((first <= pid_m) & (nblk > 0), e, -1), 0)
    mine = e == expert
    j = pid_m - gl.sum(gl.where(mine, first, 0), 0)
    STEP: gl.constexpr = BM + (BM // 2) * TALL
    m0 = gl.sum(gl.where(mine, starts, 0), 0) + j * STEP
    row_end = gl.sum(gl.where(mine, ends, 0), 0)
    # The expert's last block runs at its short class (0 where it is a full one; with
    # TALL, its class plus one, 0 where it is a tall one).
    nb = gl.sum(gl.where(mine, nblk, 0), 0)
    last = (j + 1 == nb).to(gl.int32) * gl.sum(gl.where(mine, short, 0), 0)
    if TALL:
        h = last - 1 + (last == 0).to(gl.int32) * (TALL_CLASS + 1)
    else:
        h = last
    return expert, m0, row_end, pid_n, h


@gluon.jit
def _dealt(slot, blocks, total, P, num_pid_n):
    """DEAL's tile for a program's ``slot`` (wave ``slot // P``, place ``slot % P``): the
    same P tiles each wave as the fixed stride, the wave's half tiles given to the places
    after those the waves before gave theirs, round-robin, and its full tiles to the rest.
    Every program then gets as many half tiles as any other, give or take one, where the
    stride gives a place the half tiles of its one residue (GROUP_M=1: the tiles of an
    expert's half block are one run of num_pid_n)."""
    e, starts, ends, first, nblk, short = blocks
    half = short > 0  # the short tiles, whatever their height
    w0 = (slot // P) * P
    size = gl.minimum(P, total - w0)
    seg = (first + nblk - 1) * num_pid_n  # each half block's first tile
    dealt_before = gl.sum(gl.where(half, gl.minimum(gl.maximum(w0 - seg, 0), num_pid_n), 0), 0)
    lo = gl.maximum(seg, w0)
    run = gl.where(half, gl.maximum(gl.minimum(seg + num_pid_n, w0 + size) - lo, 0), 0)
    halves = gl.sum(run, 0)
    pre = gl.associative_scan(run, 0, _add) - run  # the wave's half tiles before each run
    d = (slot - w0 - dealt_before % size + size) % size
    in_run = (run > 0) & (pre <= d) & (d < pre + run)
    t_half = gl.sum(gl.where(in_run, lo + d - pre, 0), 0)
    # The f-th of the wave's full tiles: skip every run of half tiles before it.
    f = d - halves
    t_full = w0 + f + gl.sum(gl.where((run > 0) & (lo - w0 - pre <= f), run, 0), 0)
    return t_full + (d < halves).to(gl.int32) * (t_half - t_full)


@gluon.jit
def _tile_of(tile, sched, blocks, GROUP_M: gl.constexpr, BM: gl.constexpr,
             DEAL: gl.constexpr, TALL: gl.constexpr, TALL_CLASS: gl.constexpr):
    """``_tile_info`` of ``tile`` (with DEAL, ``tile`` is a program's slot, see
    ``_dealt``)."""
    total, k_tiles, P, N, num_pid_m, num_pid_n = sched
    if DEAL:
        tile = _dealt(tile, blocks, total, P, num_pid_n)
    return _tile_info(tile, blocks, num_pid_m, num_pid_n, GROUP_M, BM, TALL, TALL_CLASS)


@gluon.jit
def _producer(pid, sched, ring, offs_ptr, E, BM: gl.constexpr, BN: gl.constexpr,
              BK: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
              TAIL_SPLIT: gl.constexpr, TALL: gl.constexpr, TALL_CLASS: gl.constexpr,
              E_PAD: gl.constexpr, DEAL: gl.constexpr):
    """TMA loads of every K step of this program's tiles into the ring, in tile order;
    a slot is refilled once its consumer's wgmma has released it. A tall tile's slot
    takes a block of A and the half block after it."""
    total, k_tiles, P, N, num_pid_m, num_pid_n = sched
    a_boxes, w_desc, ready, empty, a_bufs, w_bufs, a2_bufs = ring
    blocks = _expert_blocks(offs_ptr, E, BM, TAIL_SPLIT, E_PAD, 1, TALL)
    p = 0
    tile = pid
    while tile < total:
        expert, m0, row_end, pid_n, h = _tile_of(tile, sched, blocks, GROUP_M, BM, DEAL,
                                                  TALL, TALL_CLASS)
        w_row = expert * N + pid_n * BN
        for kk in range(k_tiles):
            s = p % STAGES
            # Empty barriers start in phase 0: the first pass over the ring does not wait.
            mbarrier.wait(empty.index(s), ((p // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            for f in gl.static_range(2):
                if f <= TAIL_SPLIT:
                    if h == f:
                        mbarrier.expect(bar, a_boxes[f].block_type.nbytes
                                        + w_desc.block_type.nbytes)
                        _tma_load(a_boxes[f], [m0, kk * BK], bar,
                                  a_bufs.index(s).slice(0, BM >> f))
            if TALL:
                if h == TALL_CLASS:
                    mbarrier.expect(bar, a_boxes[0].block_type.nbytes
                                    + a_boxes[1].block_type.nbytes + w_desc.block_type.nbytes)
                    _tma_load(a_boxes[0], [m0, kk * BK], bar, a_bufs.index(s))
                    _tma_load(a_boxes[1], [m0 + BM, kk * BK], bar, a2_bufs.index(s))
            _tma_load(w_desc, [w_row, kk * BK], bar, w_bufs.index(s))
            p += 1
        tile += P


@gluon.jit
def _landed_slot(ready, q, STAGES: gl.constexpr):
    """The ring slot of the q-th K step this program loads, once its boxes have landed
    (the slot's (q // STAGES)-th fill)."""
    s = q % STAGES
    mbarrier.wait(ready.index(s), (q // STAGES) & 1)
    return s


@gluon.jit
def _mainloop_and_store(base, k_tiles, ring, my_turn, c_buf, outs, m0, row_end, n0, N,
                        BM_T: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
                        TMA_STORE: gl.constexpr, NC: gl.constexpr, CW: gl.constexpr,
                        SWAP_AB: gl.constexpr):
    """One BM_T x BN tile whose K steps sit at ring positions ``base ...``: each wgmma
    left in flight while the next is issued, each slot released as soon as the wgmma
    that read it is done; ``my_turn`` passes to the other consumer (NC = 2) once the
    last slot is taken; then the tile leaves through ``c_buf`` (a TMA store when it lies
    inside its expert, masked stores when it straddles the expert's end). CW: the
    consumer's warps. SWAP_AB: every tile transposed, not only those below 64 rows."""
    ready, empty, a_bufs, w_bufs = ring[2], ring[3], ring[4], ring[5]
    BM: gl.constexpr = ring[4].type.shape[1]
    # Below a warp group's 64 rows the tile runs transposed: W's BN rows on wgmma's M,
    # the tile's rows on its N (8 to 32), so a short tail pads to 8 rows, not 64. With
    # SWAP_AB every tile does, the form of cuBLAS's batched GEMM here (W's rows on M, 256
    # routed rows on N, an n256 wgmma a warp group).
    SWAP: gl.constexpr = (BM_T < 64) or SWAP_AB
    if SWAP:
        acc = gl.zeros([BN, BM_T], gl.float32, _mma_layout(BN, BM_T, CW))
    else:
        acc = gl.zeros([BM_T, BN], gl.float32, _mma_layout(BM_T, BN, CW))
    for kk in range(k_tiles):
        q = base + kk
        s = _landed_slot(ready, q, STAGES)
        a = a_bufs.index(s)
        if BM_T < BM:
            a = a.slice(0, BM_T)
        if SWAP:
            acc = warpgroup_mma(w_bufs.index(s), a.permute((1, 0)), acc, is_async=True)
        else:
            acc = warpgroup_mma(a, w_bufs.index(s).permute((1, 0)), acc, is_async=True)
        # The wgmma before this one is done: its slot goes back to the producer.
        acc = warpgroup_mma_wait(1, deps=(acc,))
        mbarrier.arrive(empty.index((q + STAGES - 1) % STAGES), pred=kk > 0)
    if NC == 2:
        mbarrier.arrive(my_turn)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    mbarrier.arrive(empty.index((base + k_tiles - 1) % STAGES))
    _epilogue(acc, SWAP, c_buf, outs, m0, row_end, n0, N, BM_T, BM, BN, TMA_STORE, CW)


@gluon.jit
def _tall_mainloop_and_store(base, k_tiles, ring, my_turn, c_buf, outs, m0, row_end, n0,
                             N, BN: gl.constexpr, STAGES: gl.constexpr,
                             TMA_STORE: gl.constexpr, NC: gl.constexpr, CW: gl.constexpr):
    """A tall tile (TALL_TILE): BM + BM/2 rows, transposed, in two accumulators (a
    tensor's sides are powers of two), both fed by each slot's W box, so W streams once
    per one and a half blocks; then the two parts leave as a full tile and a half one."""
    ready, empty, a_bufs, w_bufs, a2_bufs = ring[2], ring[3], ring[4], ring[5], ring[6]
    BM: gl.constexpr = a_bufs.type.shape[1]
    BH: gl.constexpr = BM // 2
    acc = gl.zeros([BN, BM], gl.float32, _mma_layout(BN, BM, CW))
    acc2 = gl.zeros([BN, BH], gl.float32, _mma_layout(BN, BH, CW))
    for kk in range(k_tiles):
        q = base + kk
        s = _landed_slot(ready, q, STAGES)
        w = w_bufs.index(s)
        acc = warpgroup_mma(w, a_bufs.index(s).permute((1, 0)), acc, is_async=True)
        acc2 = warpgroup_mma(w, a2_bufs.index(s).permute((1, 0)), acc2, is_async=True)
        # This step's two wgmmas left in flight: the step before is done.
        acc, acc2 = warpgroup_mma_wait(2, deps=(acc, acc2))
        mbarrier.arrive(empty.index((q + STAGES - 1) % STAGES), pred=kk > 0)
    if NC == 2:
        mbarrier.arrive(my_turn)
    acc, acc2 = warpgroup_mma_wait(0, deps=(acc, acc2))
    mbarrier.arrive(empty.index((base + k_tiles - 1) % STAGES))
    _epilogue(acc, True, c_buf, outs, m0, row_end, n0, N, BM, BM, BN, TMA_STORE, CW)
    _epilogue(acc2, True, c_buf, outs, m0 + BM, row_end, n0, N, BH, BM, BN, TMA_STORE, CW)


@gluon.jit
def _epilogue(acc, SWAP: gl.constexpr, c_buf, outs, m0, row_end, n0, N, BM_T: gl.constexpr,
              BM: gl.constexpr, BN: gl.constexpr, TMA_STORE: gl.constexpr, CW: gl.constexpr):
    """A finished BM_T x BN accumulator (BN x BM_T with SWAP) to out at (m0, n0) through
    the staging tile ``c_buf``: a TMA store (boxes of BM and BM/2 rows) when it lies
    inside its expert, else masked stores. ``outs``: (out_ptr, stride_om, out_desc,
    out_half)."""
    out_ptr, stride_om, out_desc, out_half = outs
    # This consumer's previous TMA store may still be reading its staging buffer.
    tma.store_wait(0)
    stage = c_buf
    if BM_T < BM:
        stage = c_buf.slice(0, BM_T)
    if SWAP:
        stage.store(gl.permute(acc.to(out_ptr.dtype.element_ty), (1, 0)))
    else:
        stage.store(acc.to(out_ptr.dtype.element_ty))
    if TMA_STORE and BM_T >= BM // 2 and m0 + BM_T <= row_end:
        fence_async_shared()
        if BM_T == BM:
            _tma_store(out_desc, [m0, n0], stage)
        else:
            _tma_store(out_half, [m0, n0], stage)
    else:
        # A box past the expert's end would write the next expert's rows: masked
        # stores, read back from shared memory in rows of 16-byte vectors.
        st: gl.constexpr = _store_layout(BN, CW)
        vals = stage.load(st)
        rows = m0 + gl.arange(0, BM_T, layout=gl.SliceLayout(1, st))
        cols = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, st))
        ptrs = out_ptr + rows.to(gl.int64)[:, None] * stride_om + cols[None, :]
        gl.store(ptrs, vals, mask=(rows < row_end)[:, None] & (cols < N)[None, :])


@gluon.jit
def _consumer(pid, cid: gl.constexpr, sched, ring, turn, c_bufs, outs, offs_ptr, E,
              BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
              GROUP_M: gl.constexpr, TAIL_SPLIT: gl.constexpr, TMA_STORE: gl.constexpr,
              NC: gl.constexpr, CW: gl.constexpr, SWAP_AB: gl.constexpr,
              TALL: gl.constexpr, TALL_CLASS: gl.constexpr, E_PAD: gl.constexpr,
              DEAL: gl.constexpr):
    """Consumer ``cid`` of NC: this program's tiles number cid, cid + NC, ... With two,
    its i-th tile starts once the other consumer has taken its tile before (consumer 0's
    first waits on a fresh barrier's completed phase 1, so not at all)."""
    total, k_tiles, P, N, num_pid_m, num_pid_n = sched
    c_buf = c_bufs.index(cid)
    my_turn = turn.index(cid)
    blocks = _expert_blocks(offs_ptr, E, BM, TAIL_SPLIT, E_PAD, CW, TALL)
    i = 0
    tile = pid + cid * P
    while tile < total:
        expert, m0, row_end, pid_n, h = _tile_of(tile, sched, blocks, GROUP_M, BM, DEAL,
                                                  TALL, TALL_CLASS)
        if NC == 2:
            mbarrier.wait(turn.index(1 - cid), (i + cid + 1) & 1)
        base = (NC * i + cid) * k_tiles
        # A tile's height is a constexpr of its code: one call per height class the
        # config has (BM >> h rows).
        for f in gl.static_range(2):
            if f <= TAIL_SPLIT:
                if h == f:
                    _mainloop_and_store(base, k_tiles, ring, my_turn, c_buf, outs, m0,
                                        row_end, pid_n * BN, N, BM >> f, BN, STAGES,
                                        TMA_STORE, NC, CW, SWAP_AB)
        if TALL:
            if h == TALL_CLASS:
                _tall_mainloop_and_store(base, k_tiles, ring, my_turn, c_buf, outs, m0,
                                         row_end, pid_n * BN, N, BN, STAGES, TMA_STORE, NC,
                                         CW)
        i += 1
        tile += NC * P
    tma.store_wait(0)


@gluon.jit
def grouped_gemm_gluon_ws_kernel(
    a_desc, a_half, w_desc, out_desc, out_half, out_ptr, offs_ptr, N, K, E, stride_om,
    BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
    GROUP_M: gl.constexpr, TAIL_SPLIT: gl.constexpr, TMA_STORE: gl.constexpr,
    SWAP_AB: gl.constexpr, TALL: gl.constexpr, TALL_CLASS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr,
    E_PAD: gl.constexpr = 64, DEAL: gl.constexpr = False,
):
    """out[rows of e] = A[rows of e] @ W[e]^T (see the module docstring). ``a_desc`` /
    ``a_half``: A [M, K] in boxes of BM, BM/2 rows; ``w_desc``: W as [E*N, K] in
    [BN, BK] boxes; ``out_desc`` / ``out_half``: out [M, N] in the same heights (used
    with TMA_STORE); ``offs_ptr``: the E + 1 expert row offsets. num_warps=4: two
    consumers of one warp group each on alternate tiles (the kernel's own warps and a
    worker partition), "ping-pong"; num_warps=8: one consumer of two warp groups
    splitting each tile ("cooperative"). The producer is a one-warp worker. SWAP_AB:
    every tile computed transposed (W's rows on wgmma's M side). TALL: an expert's tiles
    are BM + BM/2 rows (class TALL_CLASS) and one last tile of at most a block
    (ping-pong, transposed). DEAL (GROUP_M=1, TAIL_SPLIT=1): each wave's short tiles
    dealt round-robin across the programs (``_dealt``)."""
    NC: gl.constexpr = 2 if num_warps == 4 else 1
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    num_pid_m = gl.sum(_expert_blocks(offs_ptr, E, BM, TAIL_SPLIT, E_PAD, num_warps,
                                      TALL)[4], 0)
    num_pid_n = gl.cdiv(N, BN)
    total = num_pid_m * num_pid_n
    k_tiles = gl.cdiv(K, BK)

    dtype: gl.constexpr = a_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BM, BK], a_desc.layout)
    w_bufs = gl.allocate_shared_memory(dtype, [STAGES, BN, BK], w_desc.layout)
    if TALL:
        # A tall tile's half block after the full one, in every slot.
        a2_bufs = gl.allocate_shared_memory(dtype, [STAGES, BM // 2, BK], a_desc.layout)
    else:
        # Unused.
        a2_bufs = gl.allocate_shared_memory(dtype, [1, 8, BK], a_desc.layout)
    c_bufs = gl.allocate_shared_memory(dtype, [NC, BM, BN], out_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    # The consumers' turns.
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)

    sched = (total, k_tiles, P, N, num_pid_m, num_pid_n)
    # A's boxes by height class h: BM >> h rows.
    ring = ((a_desc, a_half), w_desc, ready, empty, a_bufs, w_bufs, a2_bufs)
    outs = (out_ptr, stride_om, out_desc, out_half)
    # The partitions' constexprs go in each argument tuple as written: a tuple built
    # beforehand carries them as runtime values.
    if NC == 2:
        gl.warp_specialize([
            (_consumer, (pid, 0, sched, ring, turn, c_bufs, outs, offs_ptr, E, BM, BN,
                         STAGES, GROUP_M, TAIL_SPLIT, TMA_STORE, NC, 4, SWAP_AB, TALL,
                         TALL_CLASS, E_PAD, DEAL)),
            (_consumer, (pid, 1, sched, ring, turn, c_bufs, outs, offs_ptr, E, BM, BN,
                         STAGES, GROUP_M, TAIL_SPLIT, TMA_STORE, NC, 4, SWAP_AB, TALL,
                         TALL_CLASS, E_PAD, DEAL)),
            (_producer, (pid, sched, ring, offs_ptr, E, BM, BN, BK, STAGES, GROUP_M,
                         TAIL_SPLIT, TALL, TALL_CLASS, E_PAD, DEAL)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (pid, 0, sched, ring, turn, c_bufs, outs, offs_ptr, E, BM, BN,
                         STAGES, GROUP_M, TAIL_SPLIT, TMA_STORE, NC, num_warps, SWAP_AB,
                         TALL, TALL_CLASS, E_PAD, DEAL)),
            (_producer, (pid, sched, ring, offs_ptr, E, BM, BN, BK, STAGES, GROUP_M,
                         TAIL_SPLIT, TALL, TALL_CLASS, E_PAD, DEAL)),
        ], [1], [PRODUCER_REGS])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))
    for i in gl.static_range(2):
        mbarrier.invalidate(turn.index(i))


def gluon_launch(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor,
                 out: torch.Tensor, cfg: Config, num_progs: int) -> Launch:
    """GLUON=3's launch: the persistent warp-specialized kernel, ``num_progs`` programs
    (one per SM)."""
    M, K = a.shape
    E, N, _ = w.shape
    bm, bn, bk = int(cfg["BLOCK_M"]), int(cfg["BLOCK_N"]), int(cfg["BLOCK_K"])
    # The two A boxes share the full box's layout: a shorter box fills a prefix of the
    # same ring buffer.
    a_layout = shared_layout([bm, bk], a.dtype)
    out_layout = shared_layout([bm, bn], a.dtype)
    desc = TensorDescriptor.from_tensor
    # A descriptor's shape must be positive: an empty A (M = 0) still gets one, of a row
    # that no tile reads.
    a_rows = a if M else torch.empty(1, K, dtype=a.dtype, device=a.device)
    out_rows = out if M else torch.empty(1, N, dtype=a.dtype, device=a.device)
    args = (
        desc(a_rows, [bm, bk], a_layout),
        desc(a_rows, [bm // 2, bk], a_layout),
        desc(w.view(E * N, K), [bn, bk], shared_layout([bn, bk], a.dtype)),
        desc(out_rows, [bm, bn], out_layout),
        desc(out_rows, [bm // 2, bn], out_layout),
        out, offsets, N, K, E, out.stride(0),
    )
    meta = {
        "BM": bm, "BN": bn, "BK": bk, "STAGES": int(cfg["num_stages"]),
        "GROUP_M": int(cfg["GROUP_M"]), "TAIL_SPLIT": int(cfg["TAIL_SPLIT"]),
        "TMA_STORE": bool(int(cfg["TMA_STORE"])), "SWAP_AB": bool(int(cfg["SWAP_AB"])),
        "TALL": bool(int(cfg["TALL_TILE"])), "TALL_CLASS": TALL_CLASS,
        "DEAL": bool(int(cfg["TAIL_DEAL"])),
        # The experts' vector: two a lane at least.
        "E_PAD": max(64, 1 << max(E - 1, 0).bit_length()),
        "PRODUCER_REGS": PRODUCER_REGS, "CONSUMER_REGS": CONSUMER_REGS,
        "num_warps": int(cfg["num_warps"]),
    }
    return Launch(grouped_gemm_gluon_ws_kernel, (num_progs,), args, meta)
