"""The fused Mamba-2 SSD in one launch: the chunk programs pass the state to each other
through global memory with a look-back (see ``kernels.mamba2_ssd`` and
``docs/kernels/mamba2_ssd.md``).

Each program computes one chunk of one head. It takes a ticket from a global counter as it
starts and maps it to its (chunk, batch, head) chunk-major, so every chunk it may wait for
belongs to a program that started before it, is resident, and never waits for a later one:
the protocol cannot deadlock however the hardware schedules programs.

Per (batch, chunk, head) slot the workspace holds a flag, the chunk's total decay, and up to
two states (n, p): the *aggregate* (the state the chunk alone leaves at its end, ``st_c``)
and the *inclusive prefix* (the true state at the chunk's end,
``incl_c = exp(total_c) excl_c + st_c``, ``excl_c`` being the state entering it). Flags:
0 nothing yet, 1 aggregate published, 2 inclusive prefix published. A program

1. computes ``st_c``; unless its predecessor's inclusive prefix is already out, publishes
   ``st_c`` and ``total_c`` as the aggregate (``DECOUPLED`` only);
2. looks back from chunk c-1, adding ``exp(decay) * aggregate_j`` and accumulating the
   decay, until a chunk with its inclusive prefix, which it adds and stops: ``excl_c``;
3. publishes ``incl_c``;
4. writes ``y = exp(dAcs) C excl_c + (C B^T o decay o dt) x + D x``, once.

Without ``DECOUPLED`` (the chained scan) no aggregates are written and each program waits
for its predecessor's inclusive prefix.

Publication: the state tile is stored by all threads, a CTA barrier orders those stores
before one thread's release exchange of the flag (gpu scope); a reader polls the flag with
an acquire, passes a CTA barrier, then loads the tile with ``.cg`` (from L2). The states are
stored as ``STATE`` and combined in fp32.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from kernels.mamba2_ssd.triton_kernels import _chunk_decay, _op

#: Flag values of a slot.
AGGREGATE: tl.constexpr = tl.constexpr(1)
INCLUSIVE: tl.constexpr = tl.constexpr(2)
#: Polls before the interpreter gives up on a flag. It runs programs one after another in
#: ticket order, so a predecessor's flag is always set; an unset one is a protocol error,
#: counted (the launch then raises) rather than spun on forever.
INTERPRETER_SPIN_BOUND = 4
_SYNC_HEAD = 2  # sync[0]: ticket counter, sync[1]: count of unset flags given up on
_TL_STATE = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _poll(flag_ptr):
    return tl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")


@triton.jit
def _wait(flag_ptr, f, err_ptr, SPIN_BOUND: tl.constexpr):
    """The flag once set (``f``: its last polled value). ``SPIN_BOUND`` 0 waits as long as
    it takes; otherwise after that many polls an unset flag is counted at ``err_ptr`` and
    read as an inclusive prefix, which ends the look-back."""
    if SPIN_BOUND == 0:
        while f == 0:
            f = _poll(flag_ptr)
    else:
        spins = 0
        while (f == 0) & (spins < SPIN_BOUND):
            f = _poll(flag_ptr)
            spins += 1
        unset = (f == 0).to(tl.int32)
        tl.atomic_add(err_ptr, unset, sem="relaxed", scope="gpu")
        f = tl.where(unset != 0, INCLUSIVE, f)
    # The flag was read by one thread: the barrier orders every thread's loads after it.
    tl.debug_barrier()
    return f


@triton.jit
def _publish(dst_ptr, tile_off, tile_mask, value, flag_ptr, status):
    tl.store(dst_ptr + tile_off, value, mask=tile_mask)
    # Every thread's part of the tile is stored before the one release of the flag.
    tl.debug_barrier()
    tl.atomic_xchg(flag_ptr, status, sem="release", scope="gpu")


@triton.jit
def ssd_lookback_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, y_ptr, st_ptr, tot_ptr, sync_ptr,
    L, H, HPG, P, N, nchunks, NB,
    s_x_b, s_x_l, s_x_h, s_x_p,
    s_dt_b, s_dt_l, s_dt_h,
    s_b_b, s_b_l, s_b_g, s_b_n,
    s_c_b, s_c_l, s_c_g, s_c_n,
    s_y_b, s_y_l, s_y_h, s_y_p,
    CHUNK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, STATE: tl.constexpr,
    DECOUPLED: tl.constexpr, INCL_EVERY: tl.constexpr, SPIN_BOUND: tl.constexpr,
):  # fmt: skip
    """One chunk of one head, the whole output (see the module docstring). ``st_ptr``:
    (NB, nchunks, H, PLANES, N, P) in ``STATE``, plane 0 the inclusive prefix, plane 1 the
    aggregate; ``tot_ptr``: (NB, nchunks, H) fp32; ``sync_ptr``: the ticket counter, the
    given-up count, then a flag per slot, all zero at launch. ``INCL_EVERY`` k > 1 (decoupled
    only) publishes inclusive prefixes only for every k-th chunk, so that look-backs walk
    aggregates even when programs run one after another (the interpreter)."""
    PLANES: tl.constexpr = 2 if DECOUPLED else 1
    ticket = tl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")
    per_chunk = NB * H
    c = ticket // per_chunk
    if c >= nchunks:  # only if the counter was not zeroed before the launch
        return
    bh = ticket % per_chunk
    pid_b = (bh // H).to(tl.int64)
    head = (bh % H).to(tl.int64)
    pid_g = head // HPG
    slot = (pid_b * nchunks + c) * H + head
    flags = sync_ptr + 2
    offs_l = tl.arange(0, CHUNK)
    offs_n = tl.arange(0, BLOCK_N)
    offs_p = tl.arange(0, BLOCK_P)
    mask_l = offs_l < L - c * CHUNK  # rows of this chunk that exist
    mask_n = offs_n < N
    mask_p = offs_p < P
    tile_off = offs_n[:, None] * P + offs_p[None, :]
    tile_mask = mask_n[:, None] & mask_p[None, :]
    # The chunk base carries the int64 part; offsets within a chunk stay int32.
    row0 = c.to(tl.int64) * CHUNK
    d, dt, dacs, total = _chunk_decay(A_ptr, D_ptr, dt_ptr, head, pid_b, row0, offs_l,
                                      mask_l, s_dt_b, s_dt_h, s_dt_l)
    bt_ptrs = (B_ptr + pid_b * s_b_b + pid_g * s_b_g + row0 * s_b_l
               + offs_l[None, :] * s_b_l + offs_n[:, None] * s_b_n)  # fmt: skip
    bt_mask = mask_l[None, :] & mask_n[:, None]
    x_ptrs = (x_ptr + pid_b * s_x_b + head * s_x_h + row0 * s_x_l
              + offs_l[:, None] * s_x_l + offs_p[None, :] * s_x_p)  # fmt: skip
    x_mask = mask_l[:, None] & mask_p[None, :]

    y_ptrs = (y_ptr + pid_b * s_y_b + head * s_y_h + row0 * s_y_l
              + offs_l[:, None] * s_y_l + offs_p[None, :] * s_y_p)  # fmt: skip
    c_ptrs = (C_ptr + pid_b * s_c_b + pid_g * s_c_g + row0 * s_c_l
              + offs_l[:, None] * s_c_l + offs_n[None, :] * s_c_n)  # fmt: skip
    c_mask = mask_l[:, None] & mask_n[None, :]

    # 1. The intra-chunk output, y = (C B^T o decay o dt) x + D x, stored now: holding it
    #    in registers across the look-back spills more (sm_90 compiles); the tile is read
    #    back from L2 at the end.
    c_op = _op(tl.load(c_ptrs, mask=c_mask, other=0.0), DOT, UPCAST)
    bt_op = _op(tl.load(bt_ptrs, mask=bt_mask, other=0.0), DOT, UPCAST)
    cb = tl.dot(c_op, bt_op, input_precision=PREC)
    decay_ls = tl.exp(tl.minimum(dacs[:, None] - dacs[None, :], 0.0))
    w_cb = tl.where(offs_l[:, None] >= offs_l[None, :], cb * decay_ls * dt[None, :], 0.0)
    x_blk = tl.load(x_ptrs, mask=x_mask, other=0.0)
    x32 = x_blk.to(tl.float32)
    y_intra = tl.dot(_op(w_cb, DOT, UPCAST), _op(x_blk, DOT, UPCAST), d * x32,
                     input_precision=PREC)  # fmt: skip
    tl.store(y_ptrs, y_intra.to(y_ptr.dtype.element_ty), mask=x_mask)

    # 2. The chunk's own end state, st = B^T (x * exp(total - dAcs) * dt), as (n, p).
    w = tl.exp(tl.minimum(total - dacs, 0.0)) * dt
    st = tl.dot(bt_op, _op(x32 * w[:, None], DOT, UPCAST), input_precision=PREC)
    # ... published as the aggregate unless the predecessor's inclusive prefix is out
    # already (chunk 0 polls its own, unset, flag: it waits for nothing).
    has_pred = c > 0
    f = _poll(flags + tl.where(has_pred, slot - H, slot))
    publishes = c + 1 < nchunks  # the last chunk has no successor
    publishes_incl = publishes & (c % INCL_EVERY == 0)
    if DECOUPLED:
        if has_pred & publishes & ((f != INCLUSIVE) | (c % INCL_EVERY != 0)):
            tl.store(tot_ptr + slot, total)
            _publish(st_ptr + (slot * PLANES + 1) * N * P, tile_off, tile_mask,
                     st.to(STATE), flags + slot, AGGREGATE)  # fmt: skip

    # 3. Look back: excl = sum_j exp(total_{j+1} + ... + total_{c-1}) st_j, the walk
    #    ending on the first inclusive prefix (chunk 0 always publishes one).
    excl = tl.zeros((BLOCK_N, BLOCK_P), dtype=tl.float32)
    decay = total * 0.0  # log of the decay from the end of chunk j to the start of c
    j = c - 1
    done = (c == 0).to(tl.int32)
    # An inclusive prefix seen above is final; anything else is polled afresh, since the
    # predecessor may have moved on while this program published.
    f = tl.where(f == INCLUSIVE, f, 0)
    while done == 0:
        pslot = (pid_b * nchunks + j) * H + head
        f = _wait(flags + pslot, f, sync_ptr + 1, SPIN_BOUND)
        is_incl = f == INCLUSIVE
        plane = 1 - is_incl.to(tl.int32)
        tile = tl.load(st_ptr + (pslot * PLANES + plane) * N * P + tile_off, mask=tile_mask,
                       other=0.0, cache_modifier=".cg")  # fmt: skip
        excl += tl.exp(decay) * tile.to(tl.float32)
        decay += tl.load(tot_ptr + pslot, mask=f == AGGREGATE, other=0.0, cache_modifier=".cg")
        done = is_incl.to(tl.int32)
        j -= 1
        f = f * 0  # the next slot is polled afresh

    # 4. The state at the chunk's end, for the chunks after it.
    if publishes_incl:
        _publish(st_ptr + slot * PLANES * N * P, tile_off, tile_mask,
                 (tl.exp(total) * excl + st).to(STATE), flags + slot, INCLUSIVE)  # fmt: skip

    # 5. y += exp(dAcs) C excl (nothing enters chunk 0).
    if has_pred:
        c_op = _op(tl.load(c_ptrs, mask=c_mask, other=0.0), DOT, UPCAST)
        inter = tl.dot(c_op, _op(excl, DOT, UPCAST), input_precision=PREC)
        y_in = tl.load(y_ptrs, mask=x_mask, other=0.0).to(tl.float32)
        tl.store(y_ptrs, (inter * tl.exp(dacs)[:, None] + y_in).to(y_ptr.dtype.element_ty),
                 mask=x_mask)  # fmt: skip


class LookbackLaunch:
    """The one-launch fused SSD over fixed tensors: its workspace, allocated once, and
    the launch, which zeroes the flags and counter first (one memset)."""

    def __init__(
        self,
        inputs: tuple[torch.Tensor, ...],
        y: torch.Tensor,
        *,
        chunk: int,
        state: torch.dtype,
        decoupled: bool,
        dot_meta: dict[str, Any],
        num_warps: int,
        num_stages: int,
        incl_every: int = 1,
    ) -> None:
        x, dt, A, B, C, D = inputs
        if incl_every != 1 and not decoupled:
            raise ValueError("incl_every > 1 needs the decoupled look-back (aggregates)")
        b, L, h, p = x.shape
        n = B.shape[3]
        self.inputs, self.y = inputs, y
        self.nchunks = triton.cdiv(L, chunk)
        slots = b * self.nchunks * h
        planes = 2 if decoupled else 1
        self.states = torch.empty(slots * planes, n, p, dtype=state, device=x.device)
        self.totals = torch.empty(slots, dtype=torch.float32, device=x.device)
        self.sync = torch.zeros(_SYNC_HEAD + slots, dtype=torch.int32, device=x.device)
        self.interpreted = os.environ.get("TRITON_INTERPRET") == "1" or x.device.type == "cpu"
        self.grid = (slots,)
        self.meta = {
            "CHUNK": chunk,
            "BLOCK_P": max(16, triton.next_power_of_2(p)),
            "BLOCK_N": max(16, triton.next_power_of_2(n)),
            "STATE": _TL_STATE[state],
            **dot_meta,
            "DECOUPLED": decoupled,
            "INCL_EVERY": incl_every,
            "SPIN_BOUND": INTERPRETER_SPIN_BOUND if self.interpreted else 0,
            "num_warps": num_warps,
            "num_stages": num_stages,
        }

    def args(self) -> tuple:
        """The kernel's positional arguments (its meta-parameters are ``meta``)."""
        x, dt, A, B, C, D = self.inputs
        b, L, h, p = x.shape
        g, n = B.shape[2], B.shape[3]
        y = self.y
        return (x, dt, A, B, C, D, y, self.states, self.totals, self.sync,
                L, h, h // g, p, n, self.nchunks, b,
                *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *y.stride())

    def launch(self) -> None:
        """The kernel alone, on the workspace as it is (``__call__`` zeroes it first)."""
        ssd_lookback_kernel[self.grid](*self.args(), **self.meta)

    def given_up(self) -> int:
        """Flags the interpreter found unset and stopped polling (a protocol error)."""
        return int(self.sync[1])

    def __call__(self) -> torch.Tensor:
        self.sync.zero_()
        self.launch()
        if self.interpreted and self.given_up():
            raise RuntimeError(
                f"mamba2_ssd look-back: {self.given_up()} predecessor flag(s) never set"
            )
        return self.y


def make_run(launch: LookbackLaunch) -> Callable[[], torch.Tensor]:
    """The family's callable for one launch, with its one stage named for the benchmark."""

    def run_lookback() -> torch.Tensor:
        return launch()

    run_lookback.stages = {"lookback": launch}  # type: ignore[attr-defined]
    return run_lookback
