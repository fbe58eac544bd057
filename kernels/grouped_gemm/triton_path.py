"""The grouped GEMM's Triton kernels: pointer loads (``USE_TMA=0``, any GPU and the
interpreter) and TMA tensor descriptors (``USE_TMA=1``, Hopper and later).

Each program reads the offsets vector itself, turns the per-expert row counts into
per-expert m-block counts and their prefix sum, and maps its virtual m-block to (expert,
local block) from that: no host sync, no per-call host preparation, one launch (CUDA
graphs capture it). ``PERSISTENT`` runs one program per SM over the tiles; otherwise the
grid is an upper bound on the tiles and the programs past the real count idle.
``TAIL_SPLIT=1`` runs an expert's last block of at most BLOCK_M/2 rows, and a last
n-tile of at most BLOCK_N/2 columns, at half size, so the tails multiply less padding.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from harness.kernel.api import Config, Launch
from kernels._gemm_tiles import amd_meta

# Programs of the persistent variant when there is no GPU to ask (the interpreter): small,
# so that each program still loops over several tiles.
_CPU_PROGRAMS = 4


@triton.jit
def _expert_blocks(offs_ptr, E, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """Per expert (padded to E_PAD, the padding empty): index, start row, end row, its
    m-block count and the inclusive prefix sum of those (expert e owns virtual blocks
    [cum - nblk, cum))."""
    e_idx = tl.arange(0, E_PAD)
    e_mask = e_idx < E
    starts = tl.load(offs_ptr + e_idx, mask=e_mask, other=0)
    ends = tl.load(offs_ptr + e_idx + 1, mask=e_mask, other=0)
    nblk = (ends - starts + BLOCK_M - 1) // BLOCK_M
    return e_idx, starts, ends, nblk, tl.cumsum(nblk, 0)


@triton.jit
def _tile_map(
    tile, e_idx, starts, ends, nblk, cum, num_pid_m, num_pid_n,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
    TAIL_SPLIT: tl.constexpr,
):
    """(expert, first row, the expert's end row, first column, half) of ``tile`` in the
    (virtual m-block, n-tile) grid, whose m-blocks run over the experts' blocks back to
    back; ``half``: the block is its expert's last and holds at most BLOCK_M/2 rows."""
    # Grouped ordering: GROUP_M consecutive m-blocks sweep the n-tiles together, so the
    # W tiles they share stay in L2 (GROUP_M = 1 is plain row-major order).
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = tile // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((tile % num_pid_in_group) % group_size_m)
    pid_n = (tile % num_pid_in_group) // group_size_m
    # Empty experts add nothing to cum, so counting cum <= pid_m skips them.
    expert = tl.sum((cum <= pid_m).to(tl.int32), 0)
    sel = e_idx == expert
    blk0 = tl.sum(tl.where(sel, cum - nblk, 0), 0)
    row0 = tl.sum(tl.where(sel, starts, 0), 0)
    row_end = tl.sum(tl.where(sel, ends, 0), 0)
    m0 = row0 + (pid_m - blk0) * BLOCK_M
    half = row_end - m0 <= BLOCK_M // 2
    return expert, m0, row_end, pid_n * BLOCK_N, half


@triton.jit
def _gemm_tile(
    m0, n0, expert, row_end, a_ptr, w_ptr, out_ptr, N, K,
    stride_am, stride_we, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
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
    e_idx, starts, ends, nblk, cum, num_pid_m, num_pid_n,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, TAIL_SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    """Tile ``tile`` of the pointer kernel, at half height or half width where
    TAIL_SPLIT finds a short tail."""
    expert, m0, row_end, n0, half = _tile_map(
        tile, e_idx, starts, ends, nblk, cum, num_pid_m, num_pid_n,
        BLOCK_M, BLOCK_N, GROUP_M, TAIL_SPLIT,
    )
    if TAIL_SPLIT >= 1 and half:
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
def grouped_gemm_kernel(
    a_ptr, w_ptr, out_ptr, offs_ptr, N, K, E,
    stride_am, stride_we, stride_wn, stride_om, NUM_PROGS,
    E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PERSISTENT: tl.constexpr,
    TAIL_SPLIT: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    """USE_TMA=0: pointer loads, masked at the experts' ends."""
    pid = tl.program_id(0)
    e_idx, starts, ends, nblk, cum = _expert_blocks(offs_ptr, E, E_PAD, BLOCK_M)
    num_pid_m = tl.sum(nblk, 0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    total_tiles = num_pid_m * num_pid_n
    if PERSISTENT:
        # Grid = number of SMs; each program strides over the exact tile count.
        for tile in tl.range(pid, total_tiles, NUM_PROGS):
            _gemm_tile_any(
                tile, a_ptr, w_ptr, out_ptr, N, K, stride_am, stride_we, stride_wn,
                stride_om, e_idx, starts, ends, nblk, cum, num_pid_m, num_pid_n,
                BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, TAIL_SPLIT, EVEN_K, UPCAST, IEEE,
            )  # fmt: skip
    elif pid < total_tiles:
        _gemm_tile_any(
            pid, a_ptr, w_ptr, out_ptr, N, K, stride_am, stride_we, stride_wn,
            stride_om, e_idx, starts, ends, nblk, cum, num_pid_m, num_pid_n,
            BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, TAIL_SPLIT, EVEN_K, UPCAST, IEEE,
        )  # fmt: skip


@triton.jit
def _gemm_tile_tma(
    m0, n0, expert, row_end, a_desc, w_desc, out_desc, out_ptr, N, K, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    TMA_STORE: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    SWAP_AB: tl.constexpr,
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
    accumulator is transposed back before the store."""
    # TMA coordinates are int32: E*N and M stay far below 2**31 rows.
    w_row = expert * N + n0
    if SWAP_AB:
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, tl.cdiv(K, BLOCK_K)):
        a = a_desc.load([m0, k * BLOCK_K])
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
    tile, a_desc, a_half, w_desc, w_half, out_desc, out_ptr, N, K, stride_om,
    e_idx, starts, ends, nblk, cum, num_pid_m, num_pid_n,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, TAIL_SPLIT: tl.constexpr, TMA_STORE: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, SWAP_AB: tl.constexpr,
):
    """Tile ``tile`` of the TMA kernel; TAIL_SPLIT as in ``_gemm_tile_any``, with the
    half-height A boxes of ``a_half`` and the half-width W boxes of ``w_half`` (the
    smaller tiles keep the masked store: ``out_desc``'s box is the full tile's)."""
    expert, m0, row_end, n0, half = _tile_map(
        tile, e_idx, starts, ends, nblk, cum, num_pid_m, num_pid_n,
        BLOCK_M, BLOCK_N, GROUP_M, TAIL_SPLIT,
    )
    if TAIL_SPLIT >= 1 and half:
        _gemm_tile_tma(m0, n0, expert, row_end, a_half, w_desc, out_desc, out_ptr, N, K,
                       stride_om, BLOCK_M // 2, BLOCK_N, BLOCK_K, False, UPCAST, IEEE,
                       SWAP_AB)  # fmt: skip
    elif TAIL_SPLIT >= 1 and N - n0 <= BLOCK_N // 2:
        _gemm_tile_tma(m0, n0, expert, row_end, a_desc, w_half, out_desc, out_ptr, N, K,
                       stride_om, BLOCK_M, BLOCK_N // 2, BLOCK_K, False, UPCAST, IEEE,
                       SWAP_AB)  # fmt: skip
    else:
        _gemm_tile_tma(m0, n0, expert, row_end, a_desc, w_desc, out_desc, out_ptr, N, K,
                       stride_om, BLOCK_M, BLOCK_N, BLOCK_K, TMA_STORE, UPCAST, IEEE,
                       SWAP_AB)  # fmt: skip


@triton.jit
def grouped_gemm_tma_kernel(
    a_desc, a_half, w_desc, w_half, out_desc, out_ptr, offs_ptr, N, K, E, stride_om,
    NUM_PROGS,
    E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PERSISTENT: tl.constexpr,
    TAIL_SPLIT: tl.constexpr, TMA_STORE: tl.constexpr, UPCAST: tl.constexpr,
    IEEE: tl.constexpr, SWAP_AB: tl.constexpr,
):
    """USE_TMA=1: the same tile mapping as ``grouped_gemm_kernel``, host-built tensor
    descriptors (``triton.tools.tensor_descriptor.TensorDescriptor``) for A, W and out."""
    pid = tl.program_id(0)
    e_idx, starts, ends, nblk, cum = _expert_blocks(offs_ptr, E, E_PAD, BLOCK_M)
    num_pid_m = tl.sum(nblk, 0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    total_tiles = num_pid_m * num_pid_n
    if PERSISTENT:
        for tile in tl.range(pid, total_tiles, NUM_PROGS):
            _gemm_tile_tma_any(
                tile, a_desc, a_half, w_desc, w_half, out_desc, out_ptr, N, K, stride_om,
                e_idx, starts, ends, nblk, cum, num_pid_m, num_pid_n,
                BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, TAIL_SPLIT, TMA_STORE, UPCAST, IEEE,
                SWAP_AB,
            )  # fmt: skip
    elif pid < total_tiles:
        _gemm_tile_tma_any(
            pid, a_desc, a_half, w_desc, w_half, out_desc, out_ptr, N, K, stride_om,
            e_idx, starts, ends, nblk, cum, num_pid_m, num_pid_n,
            BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, TAIL_SPLIT, TMA_STORE, UPCAST, IEEE,
            SWAP_AB,
        )  # fmt: skip


def next_pow2(x: int) -> int:
    return 1 << max(int(x) - 1, 0).bit_length()


_sm_cache: dict[int, int] = {}


def num_sms(device: torch.device) -> int:
    """Programs of a persistent grid: one per SM (CU on AMD), or a few on the CPU.
    "meta" inputs (compile_only's stand-ins) count as the current GPU's."""
    if device.type == "cpu" or not torch.cuda.is_available():
        return _CPU_PROGRAMS
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _sm_cache:
        _sm_cache[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _sm_cache[idx]


def check_tma_layout(a: torch.Tensor, w: torch.Tensor) -> None:
    """TMA wants 16-byte aligned bases and row strides, and W's [E, N] rows must
    flatten to one [E*N, K] matrix."""
    for name, t in (("A", a), ("W", w)):
        # Meta tensors (compile_only) have no address to check.
        base = 0 if t.device.type == "meta" else t.data_ptr()
        if base % 16 or (t.stride(-2) * t.element_size()) % 16:
            raise ValueError(f"grouped_gemm USE_TMA: {name} is not 16-byte aligned")
    if w.stride(0) != w.shape[1] * w.stride(1):
        raise ValueError("grouped_gemm USE_TMA: W's experts are not contiguous")


def triton_launch(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor,
                  out: torch.Tensor, cfg: Config) -> Launch:
    """The Triton kernel's one launch of ``cfg`` (defaults filled in) into ``out``."""
    M, K = a.shape
    E, N, _ = w.shape
    bm, bn, bk = int(cfg["BLOCK_M"]), int(cfg["BLOCK_N"]), int(cfg["BLOCK_K"])
    persistent = int(cfg["PERSISTENT"])
    tail_split = int(cfg["TAIL_SPLIT"])
    # Virtual m-blocks, known without a sync: sum_e ceil(cnt_e / BM) <= M // BM + E.
    tiles_bound = (M // bm + E) * triton.cdiv(N, bn)
    num_progs = max(1, min(num_sms(a.device), tiles_bound)) if persistent else 1
    grid = (num_progs if persistent else max(1, tiles_bound),)
    meta: dict[str, Any] = {
        "E_PAD": max(2, next_pow2(E)),
        "BLOCK_M": bm,
        "BLOCK_N": bn,
        "BLOCK_K": bk,
        "GROUP_M": int(cfg["GROUP_M"]),
        "PERSISTENT": persistent,
        "TAIL_SPLIT": tail_split,
        "UPCAST": os.environ.get("TRITON_INTERPRET") == "1" and a.dtype != torch.float32,
        # fp32 inputs get true fp32 products, not TF32, so fp32 results stay fp32-exact.
        "IEEE": a.dtype == torch.float32,
        "num_warps": int(cfg["num_warps"]),
        "num_stages": int(cfg["num_stages"]),
    }
    if a.device.type != "cpu" and torch.version.hip is not None:
        meta.update(amd_meta(cfg))
    if not int(cfg["USE_TMA"]):
        args = (a, w, out, offsets, N, K, E, a.stride(0), w.stride(0), w.stride(1),
                out.stride(0), num_progs)
        return Launch(grouped_gemm_kernel, grid, args, {**meta, "EVEN_K": K % bk == 0})
    check_tma_layout(a, w)
    # The descriptors are built once, here, not per launch.
    w_rows = w.view(E * N, K)
    a_desc = TensorDescriptor.from_tensor(a, [bm, bk])
    w_desc = TensorDescriptor.from_tensor(w_rows, [bn, bk])
    out_desc = TensorDescriptor.from_tensor(out, [bm, bn])
    # The half tiles' boxes; where a config has none, the full ones stand in.
    a_half, w_half = a_desc, w_desc
    if tail_split:
        a_half = TensorDescriptor.from_tensor(a, [bm // 2, bk])
        w_half = TensorDescriptor.from_tensor(w_rows, [bn // 2, bk])
    args = (a_desc, a_half, w_desc, w_half, out_desc, out, offsets, N, K, E, out.stride(0),
            num_progs)
    meta.update(TMA_STORE=bool(int(cfg["TMA_STORE"])), SWAP_AB=bool(int(cfg["SWAP_AB"])))
    return Launch(grouped_gemm_tma_kernel, grid, args, meta)
