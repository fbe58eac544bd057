"""Triton kernels of the Mamba-2 chunked SSD forward (see ``kernels.mamba2_ssd``).

Notation: ``x`` (b, L, h, p), ``dt`` (b, L, h), ``A`` (h), ``B``/``C`` (b, L, g, n), ``D`` (h);
head ``i`` reads group ``i // (h // g)``. Sequence positions are split into chunks of
``CHUNK`` rows; ``dAcs`` is the within-chunk inclusive cumsum of ``dt * A``.

Two implementations:

* the five-stage pipeline (``chunk_cumsum`` -> ``bmm_chunk`` -> ``chunk_state`` ->
  ``state_passing`` -> ``chunk_scan``), one launch each, with intermediates in global memory;
* the fused pair: ``ssd_chunk`` (one program per chunk and head: the whole intra-chunk
  output plus ``D x``, and the state the chunk alone leaves at its end), then ``ssd_carry`` (one
  program per head and p-block walks the chunks in order, carries the state in registers,
  and adds ``exp(dAcs) C . state_in`` to ``y``). All the matrix work is in the chunk-parallel
  launch except one ``C . state`` product per chunk; the sequential one is memory-bound.

Rows at or past ``L`` load as zero (``dt = 0`` keeps ``dAcs`` flat there), so any ``L``
works, not just multiples of ``CHUNK``. Every ``exp`` of a decay difference is clamped at 0
first: lanes above the diagonal would overflow to inf, and inf * 0 is NaN.

``DOT`` is the operand dtype of ``tl.dot`` (the input dtype; fp32 runs with
``input_precision="ieee"``). ``UPCAST`` re-widens the rounded operands to fp32 before the dot:
the interpreter's bf16 dot is wrong (bf16 is stored as uint16 there), and rounding first keeps
the CPU numerics those of the GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _op(a, DOT: tl.constexpr, UPCAST: tl.constexpr):
    """A dot operand rounded to the dot dtype. Under ``UPCAST`` (interpreter, bf16) it is
    rounded to bf16 by hand, round-to-nearest-even as on the GPU (the interpreter's own
    downcast truncates), and kept in fp32."""
    if UPCAST:
        bits = a.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        a = bits.to(tl.float32, bitcast=True)
    else:
        a = a.to(DOT)
    return a


@triton.jit
def _chunk_decay(A_ptr, D_ptr, dt_ptr, head, pid_b, row0, offs_l, mask_l, s_dt_b, s_dt_h,
                 s_dt_l):
    """A chunk's per-head scalars in fp32: D, dt (0 past the end), the within-chunk
    cumulative dt * A and its total (the chunk's decay)."""
    a = tl.load(A_ptr + head).to(tl.float32)
    d = tl.load(D_ptr + head).to(tl.float32)
    dt = tl.load(
        dt_ptr + pid_b * s_dt_b + head * s_dt_h + (row0 + offs_l) * s_dt_l,
        mask=mask_l,
        other=0.0,
    ).to(tl.float32)
    dA = dt * a
    return d, dt, tl.cumsum(dA, axis=0), tl.sum(dA, axis=0)


# ---------------------------------------------------------------------------------------
# Five-stage pipeline
# ---------------------------------------------------------------------------------------


@triton.jit
def chunk_cumsum_kernel(
    dt_ptr, A_ptr, dacs_ptr,
    L, H, nchunks,
    s_dt_b, s_dt_l, s_dt_h,
    CHUNK: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """Stage 1: dacs[b, h, c, :] = cumsum(dt * A) within chunk c (fp32)."""
    pid_b = tl.program_id(0).to(tl.int64)
    pid_c = tl.program_id(1)
    pid_h = tl.program_id(2)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_l = tl.arange(0, CHUNK)
    # The chunk base carries the int64 part (row * stride can pass 2**31); offsets within
    # a chunk stay int32 (the same in every kernel here).
    dt_c = dt_ptr + pid_b * s_dt_b + pid_c.to(tl.int64) * CHUNK * s_dt_l
    mask_h = offs_h < H
    mask = mask_h[:, None] & (offs_l[None, :] < L - pid_c * CHUNK)
    dt = tl.load(
        dt_c + offs_l[None, :] * s_dt_l + offs_h[:, None] * s_dt_h, mask=mask, other=0.0
    ).to(tl.float32)
    a = tl.load(A_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)
    dacs = tl.cumsum(dt * a[:, None], axis=1)
    out = dacs_ptr + ((pid_b * H + offs_h[:, None]) * nchunks + pid_c) * CHUNK + offs_l[None, :]
    tl.store(out, dacs, mask=mask_h[:, None])


@triton.jit
def bmm_chunk_kernel(
    C_ptr, B_ptr, cb_ptr,
    L, G, N, nchunks,
    s_c_b, s_c_l, s_c_g, s_c_n,
    s_b_b, s_b_l, s_b_g, s_b_n,
    CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Stage 2: cb[b, c, g, l, s] = C[l] . B[s] within each chunk (fp32); only the tiles
    on or below the diagonal, which are the only ones stage 5 reads."""
    pid_t = tl.program_id(0)
    pid_bc = tl.program_id(1)
    pid_g = tl.program_id(2).to(tl.int64)
    mi = pid_t // (CHUNK // BLOCK_K)
    ki = pid_t % (CHUNK // BLOCK_K)
    if ki * BLOCK_K >= (mi + 1) * BLOCK_M:
        return
    pid_b = (pid_bc // nchunks).to(tl.int64)
    pid_c = pid_bc % nchunks
    offs_m = mi * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = ki * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = tl.arange(0, BLOCK_N)
    row0 = pid_c.to(tl.int64) * CHUNK
    rem = L - pid_c * CHUNK
    mask_n = offs_n < N
    c_blk = tl.load(
        C_ptr + pid_b * s_c_b + pid_g * s_c_g + row0 * s_c_l
        + offs_m[:, None] * s_c_l + offs_n[None, :] * s_c_n,
        mask=(offs_m[:, None] < rem) & mask_n[None, :],
        other=0.0,
    )  # fmt: skip
    bt_blk = tl.load(
        B_ptr + pid_b * s_b_b + pid_g * s_b_g + row0 * s_b_l
        + offs_k[None, :] * s_b_l + offs_n[:, None] * s_b_n,
        mask=(offs_k[None, :] < rem) & mask_n[:, None],
        other=0.0,
    )  # fmt: skip
    cb = tl.dot(_op(c_blk, DOT, UPCAST), _op(bt_blk, DOT, UPCAST), input_precision=PREC)
    base = ((pid_b * nchunks + pid_c) * G + pid_g) * CHUNK * CHUNK
    tl.store(cb_ptr + base + offs_m[:, None] * CHUNK + offs_k[None, :], cb)


@triton.jit
def chunk_state_kernel(
    x_ptr, B_ptr, dt_ptr, dacs_ptr, st_ptr,
    L, H, HPG, P, N, nchunks,
    s_x_b, s_x_l, s_x_h, s_x_p,
    s_b_b, s_b_l, s_b_g, s_b_n,
    s_dt_b, s_dt_l, s_dt_h,
    CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, STATE: tl.constexpr,
):  # fmt: skip
    """Stage 3: the state each chunk alone leaves at its end,
    st[b, c, h, p, n] = sum_l x[l, p] * exp(dacs[last] - dacs[l]) * dt[l] * B[l, n]."""
    pid_p = tl.program_id(0)
    pid_bc = tl.program_id(1)
    pid_h = tl.program_id(2).to(tl.int64)
    pid_b = (pid_bc // nchunks).to(tl.int64)
    pid_c = pid_bc % nchunks
    pid_g = pid_h // HPG
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p = offs_p < P
    mask_n = offs_n < N
    dacs_base = dacs_ptr + ((pid_b * H + pid_h) * nchunks + pid_c) * CHUNK
    # dt is 0 past L, so the last entry is the total of the (possibly short) chunk.
    total = tl.load(dacs_base + CHUNK - 1)
    row0 = pid_c.to(tl.int64) * CHUNK
    x_base = x_ptr + pid_b * s_x_b + pid_h * s_x_h + row0 * s_x_l
    b_base = B_ptr + pid_b * s_b_b + pid_g * s_b_g + row0 * s_b_l
    dt_base = dt_ptr + pid_b * s_dt_b + pid_h * s_dt_h + row0 * s_dt_l
    chunk_len = tl.minimum(CHUNK, L - pid_c * CHUNK)
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, chunk_len, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < chunk_len
        xt = tl.load(
            x_base + offs_k[None, :] * s_x_l + offs_p[:, None] * s_x_p,
            mask=mask_k[None, :] & mask_p[:, None],
            other=0.0,
        )
        b_blk = tl.load(
            b_base + offs_k[:, None] * s_b_l + offs_n[None, :] * s_b_n,
            mask=mask_k[:, None] & mask_n[None, :],
            other=0.0,
        ).to(tl.float32)
        dt = tl.load(dt_base + offs_k * s_dt_l, mask=mask_k, other=0.0).to(tl.float32)
        dacs = tl.load(dacs_base + offs_k)
        w = tl.exp(tl.minimum(total - dacs, 0.0)) * dt
        acc = tl.dot(
            _op(xt, DOT, UPCAST), _op(b_blk * w[:, None], DOT, UPCAST), acc, input_precision=PREC
        )
    st_base = st_ptr + ((pid_b * nchunks + pid_c) * H + pid_h) * P * N
    tl.store(
        st_base + offs_p[:, None] * N + offs_n[None, :],
        acc.to(STATE),
        mask=mask_p[:, None] & mask_n[None, :],
    )


@triton.jit
def state_passing_kernel(
    st_ptr, dacs_ptr,
    H, PN, nchunks,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, STATE: tl.constexpr,
):  # fmt: skip
    """Stage 4, in place: st[b, c] becomes the state entering chunk c,
    carried across chunks in fp32 (only the stored copy is rounded to ``STATE``)."""
    pid = tl.program_id(0)
    pid_b = tl.program_id(1).to(tl.int64)
    pid_h = tl.program_id(2).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < PN
    carried = tl.zeros((BLOCK,), dtype=tl.float32)
    for c in range(nchunks):
        ptrs = st_ptr + ((pid_b * nchunks + c) * H + pid_h) * PN + offs
        local = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(ptrs, carried.to(STATE), mask=mask)
        total = tl.load(dacs_ptr + ((pid_b * H + pid_h) * nchunks + c) * CHUNK + CHUNK - 1)
        carried = tl.exp(total) * carried + local


@triton.jit
def chunk_scan_kernel(
    cb_ptr, x_ptr, dt_ptr, dacs_ptr, C_ptr, st_ptr, D_ptr, y_ptr,
    L, H, HPG, G, P, N, nchunks,
    s_x_b, s_x_l, s_x_h, s_x_p,
    s_dt_b, s_dt_l, s_dt_h,
    s_c_b, s_c_l, s_c_g, s_c_n,
    s_y_b, s_y_l, s_y_h, s_y_p,
    CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Stage 5: y = exp(dacs[l]) * C[l] . state_in  +  sum_{s<=l} cb[l,s] exp(dacs[l]-dacs[s])
    dt[s] x[s]  +  D x[l], for one (BLOCK_M, BLOCK_P) tile of one chunk and head."""
    n_ptiles = tl.cdiv(P, BLOCK_P)
    mi = tl.program_id(0) // n_ptiles
    pid_p = tl.program_id(0) % n_ptiles
    pid_bc = tl.program_id(1)
    pid_h = tl.program_id(2).to(tl.int64)
    pid_b = (pid_bc // nchunks).to(tl.int64)
    pid_c = pid_bc % nchunks
    pid_g = pid_h // HPG
    chunk_len = tl.minimum(CHUNK, L - pid_c * CHUNK)
    if mi * BLOCK_M >= chunk_len:
        return
    offs_m = mi * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    row0 = pid_c.to(tl.int64) * CHUNK
    mask_m = offs_m < chunk_len
    mask_p = offs_p < P
    mask_n = offs_n < N
    dacs_base = dacs_ptr + ((pid_b * H + pid_h) * nchunks + pid_c) * CHUNK
    x_base = x_ptr + pid_b * s_x_b + pid_h * s_x_h + row0 * s_x_l
    dt_base = dt_ptr + pid_b * s_dt_b + pid_h * s_dt_h + row0 * s_dt_l
    dacs_m = tl.load(dacs_base + offs_m)

    # Inter-chunk part: the state entering the chunk, decayed to each row.
    c_blk = tl.load(
        C_ptr
        + pid_b * s_c_b
        + pid_g * s_c_g
        + row0 * s_c_l
        + offs_m[:, None] * s_c_l
        + offs_n[None, :] * s_c_n,
        mask=mask_m[:, None] & mask_n[None, :],
        other=0.0,
    )
    st_base = st_ptr + ((pid_b * nchunks + pid_c) * H + pid_h) * P * N
    st = tl.load(
        st_base + offs_p[None, :] * N + offs_n[:, None],
        mask=mask_p[None, :] & mask_n[:, None],
        other=0.0,
    )
    acc = tl.dot(_op(c_blk, DOT, UPCAST), _op(st, DOT, UPCAST), input_precision=PREC)
    acc = acc * tl.exp(dacs_m)[:, None]

    # Intra-chunk part: causal (cb * decay * dt) @ x up to the tile's last row.
    cb_base = cb_ptr + ((pid_b * nchunks + pid_c) * G + pid_g) * CHUNK * CHUNK
    k_end = tl.minimum((mi + 1) * BLOCK_M, chunk_len)
    for k0 in range(0, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < chunk_len
        cb = tl.load(cb_base + offs_m[:, None] * CHUNK + offs_k[None, :])
        dt = tl.load(dt_base + offs_k * s_dt_l, mask=mask_k, other=0.0)
        dacs_k = tl.load(dacs_base + offs_k)
        decay = tl.exp(tl.minimum(dacs_m[:, None] - dacs_k[None, :], 0.0))
        cb = tl.where(
            offs_m[:, None] >= offs_k[None, :], cb * decay * dt.to(tl.float32)[None, :], 0.0
        )
        x_blk = tl.load(
            x_base + offs_k[:, None] * s_x_l + offs_p[None, :] * s_x_p,
            mask=mask_k[:, None] & mask_p[None, :],
            other=0.0,
        )
        acc = tl.dot(_op(cb, DOT, UPCAST), _op(x_blk, DOT, UPCAST), acc, input_precision=PREC)

    x_m = tl.load(
        x_base + offs_m[:, None] * s_x_l + offs_p[None, :] * s_x_p,
        mask=mask_m[:, None] & mask_p[None, :],
        other=0.0,
    ).to(tl.float32)
    d = tl.load(D_ptr + pid_h).to(tl.float32)
    acc += d * x_m
    tl.store(
        y_ptr
        + pid_b * s_y_b
        + pid_h * s_y_h
        + row0 * s_y_l
        + offs_m[:, None] * s_y_l
        + offs_p[None, :] * s_y_p,
        acc.to(y_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_p[None, :],
    )


# ---------------------------------------------------------------------------------------
# Fused: a chunk-parallel launch and a light sequential carry
# ---------------------------------------------------------------------------------------


@triton.jit
def ssd_chunk_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, y_ptr, st_ptr,
    L, H, HPG, P, N, nchunks,
    s_x_b, s_x_l, s_x_h, s_x_p,
    s_dt_b, s_dt_l, s_dt_h,
    s_b_b, s_b_l, s_b_g, s_b_n,
    s_c_b, s_c_l, s_c_g, s_c_n,
    s_y_b, s_y_l, s_y_h, s_y_p,
    CHUNK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, STATE: tl.constexpr,
):  # fmt: skip
    """One chunk of one head: ``y = (C B^T o decay o dt) x + D x`` (the intra-chunk
    output; the carry adds the inter-chunk part) and the chunk's own end state
    ``st[b, c, h] = B^T (x * exp(total - dAcs) * dt)`` as (n, p), rounded to ``STATE``.
    (Sharing one ``C B^T`` among several heads of a group per program measured slower at
    n=128 on an H200: fewer programs, and the tile held across heads costs registers.)"""
    pid_c = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    pid_b = tl.program_id(2).to(tl.int64)
    pid_g = head // HPG
    offs_l = tl.arange(0, CHUNK)
    offs_n = tl.arange(0, BLOCK_N)
    offs_p = tl.arange(0, BLOCK_P)
    rem = L - pid_c * CHUNK  # rows of this chunk that exist
    mask_l = offs_l < rem
    mask_n = offs_n < N
    mask_p = offs_p < P
    # The chunk base carries the int64 part; offsets within a chunk stay int32.
    row0 = pid_c.to(tl.int64) * CHUNK
    c_blk = tl.load(
        C_ptr + pid_b * s_c_b + pid_g * s_c_g + row0 * s_c_l
        + offs_l[:, None] * s_c_l + offs_n[None, :] * s_c_n,
        mask=mask_l[:, None] & mask_n[None, :],
        other=0.0,
    )  # fmt: skip
    bt_op = _op(
        tl.load(
            B_ptr + pid_b * s_b_b + pid_g * s_b_g + row0 * s_b_l
            + offs_l[None, :] * s_b_l + offs_n[:, None] * s_b_n,
            mask=mask_l[None, :] & mask_n[:, None],
            other=0.0,
        ),
        DOT, UPCAST,
    )  # fmt: skip
    cb = tl.dot(_op(c_blk, DOT, UPCAST), bt_op, input_precision=PREC)
    causal = offs_l[:, None] >= offs_l[None, :]
    d, dt, dacs, total = _chunk_decay(A_ptr, D_ptr, dt_ptr, head, pid_b, row0, offs_l,
                                      mask_l, s_dt_b, s_dt_h, s_dt_l)
    x_blk = tl.load(
        x_ptr + pid_b * s_x_b + head * s_x_h + row0 * s_x_l
        + offs_l[:, None] * s_x_l + offs_p[None, :] * s_x_p,
        mask=mask_l[:, None] & mask_p[None, :],
        other=0.0,
    )  # fmt: skip
    x32 = x_blk.to(tl.float32)
    decay = tl.exp(tl.minimum(dacs[:, None] - dacs[None, :], 0.0))
    w_cb = tl.where(causal, cb * decay * dt[None, :], 0.0)
    acc = tl.dot(_op(w_cb, DOT, UPCAST), _op(x_blk, DOT, UPCAST), d * x32,
                 input_precision=PREC)  # fmt: skip
    tl.store(
        y_ptr + pid_b * s_y_b + head * s_y_h + row0 * s_y_l
        + offs_l[:, None] * s_y_l + offs_p[None, :] * s_y_p,
        acc.to(y_ptr.dtype.element_ty),
        mask=mask_l[:, None] & mask_p[None, :],
    )  # fmt: skip
    if pid_c + 1 < nchunks:  # the last chunk's end state is never read
        w = tl.exp(tl.minimum(total - dacs, 0.0)) * dt
        st = tl.dot(bt_op, _op(x32 * w[:, None], DOT, UPCAST), input_precision=PREC)
        st_base = st_ptr + ((pid_b * nchunks + pid_c) * H + head) * N * P
        tl.store(
            st_base + offs_n[:, None] * P + offs_p[None, :],
            st.to(STATE),
            mask=mask_n[:, None] & mask_p[None, :],
        )


@triton.jit
def ssd_carry_kernel(
    dt_ptr, A_ptr, C_ptr, y_ptr, st_ptr,
    L, H, HPG, P, N, nchunks,
    s_dt_b, s_dt_l, s_dt_h,
    s_c_b, s_c_l, s_c_g, s_c_n,
    s_y_b, s_y_l, s_y_h, s_y_p,
    CHUNK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, PREFETCH_C: tl.constexpr,
):  # fmt: skip
    """One (p-block, head, batch): walk the chunks in order with the state (n, p-block) in
    fp32 registers; for chunk ``c >= 1`` add ``exp(dAcs) C . state_in`` to ``y`` after
    ``state = exp(total_{c-1}) state + st[c-1]``.

    The loads of chunk ``c + 1`` are issued by hand before chunk ``c``'s product and store:
    the y stores would otherwise keep the next chunk's loads (of addresses the compiler cannot
    prove distinct) behind them, and every chunk would pay the memory latency in sequence.
    ``PREFETCH_C`` prefetches the C tile the same way (fewer stalls, more registers: it wins
    for 16-bit inputs); otherwise C is loaded in the loop, where the pipeliner stages it."""
    pid_p = tl.program_id(0)
    pid_h = tl.program_id(1).to(tl.int64)
    pid_b = tl.program_id(2).to(tl.int64)
    pid_g = pid_h // HPG
    offs_l = tl.arange(0, CHUNK)
    offs_n = tl.arange(0, BLOCK_N)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    mask_n = offs_n < N
    mask_p = offs_p < P
    a = tl.load(A_ptr + pid_h).to(tl.float32)
    dt_base = dt_ptr + pid_b * s_dt_b + pid_h * s_dt_h
    c_base = C_ptr + pid_b * s_c_b + pid_g * s_c_g
    y_base = y_ptr + pid_b * s_y_b + pid_h * s_y_h
    st_base = st_ptr + (pid_b * nchunks * H + pid_h) * N * P
    state = tl.zeros((BLOCK_N, BLOCK_P), dtype=tl.float32)
    # Total decay of chunk 0 (the chunk before the first one that reads a state).
    dt0 = tl.load(dt_base + offs_l * s_dt_l, mask=offs_l < L, other=0.0).to(tl.float32)
    total = tl.sum(dt0 * a, axis=0)
    st_n, dt_n, y_n = _carry_loads(
        st_base, dt_base, y_base, pid_b * 0 + 1, L, H, N, P,
        offs_l, offs_n, offs_p, mask_n, mask_p, s_dt_l, s_y_l, s_y_p, CHUNK,
    )  # fmt: skip
    if PREFETCH_C:
        c_n = _c_load(c_base, pid_b * 0 + 1, L, offs_l, offs_n, mask_n, s_c_l, s_c_n, CHUNK)
    for c in range(1, nchunks):
        st, dt, y_in = st_n, dt_n, y_n
        if PREFETCH_C:
            c_blk = c_n
            c_n = _c_load(c_base, pid_b * 0 + c + 1, L, offs_l, offs_n, mask_n, s_c_l, s_c_n,
                          CHUNK)  # fmt: skip
        else:
            c_blk = _c_load(c_base, pid_b * 0 + c, L, offs_l, offs_n, mask_n, s_c_l, s_c_n, CHUNK)
        st_n, dt_n, y_n = _carry_loads(
            st_base, dt_base, y_base, pid_b * 0 + c + 1, L, H, N, P,
            offs_l, offs_n, offs_p, mask_n, mask_p, s_dt_l, s_y_l, s_y_p, CHUNK,
        )  # fmt: skip
        state = state * tl.exp(total) + st.to(tl.float32)
        dA = dt * a
        dacs = tl.cumsum(dA, axis=0)
        total = tl.sum(dA, axis=0)
        acc = tl.dot(_op(c_blk, DOT, UPCAST), _op(state, DOT, UPCAST), input_precision=PREC)
        row0 = (pid_b * 0 + c) * CHUNK  # int64 (a loop index has no .to in the interpreter)
        mask_l = offs_l < L - c * CHUNK
        tl.store(
            y_base + row0 * s_y_l + offs_l[:, None] * s_y_l + offs_p[None, :] * s_y_p,
            (acc * tl.exp(dacs)[:, None] + y_in).to(y_ptr.dtype.element_ty),
            mask=mask_l[:, None] & mask_p[None, :],
        )


@triton.jit
def _c_load(c_base, c, L, offs_l, offs_n, mask_n, s_c_l, s_c_n, CHUNK: tl.constexpr):
    """C rows of chunk ``c`` (int64); rows past ``L`` (or past the last chunk) masked off."""
    row0 = c * CHUNK
    mask_l = offs_l < L - row0
    return tl.load(
        c_base + row0 * s_c_l + offs_l[:, None] * s_c_l + offs_n[None, :] * s_c_n,
        mask=mask_l[:, None] & mask_n[None, :],
        other=0.0,
    )


@triton.jit
def _carry_loads(
    st_base, dt_base, y_base, c, L, H, N, P,
    offs_l, offs_n, offs_p, mask_n, mask_p, s_dt_l, s_y_l, s_y_p, CHUNK: tl.constexpr,
):  # fmt: skip
    """What the carry reads for chunk ``c`` (int64) besides C: the previous chunk's own end
    state, dt and the intra-chunk y. Past the last chunk the rows are masked off and the
    state read is the (allocated, unused) last one."""
    row0 = c * CHUNK
    mask_l = offs_l < L - row0
    st = tl.load(
        st_base + (c - 1) * H * N * P + offs_n[:, None] * P + offs_p[None, :],
        mask=mask_n[:, None] & mask_p[None, :],
        other=0.0,
    )
    dt = tl.load(dt_base + (row0 + offs_l) * s_dt_l, mask=mask_l, other=0.0).to(tl.float32)
    y_in = tl.load(
        y_base + row0 * s_y_l + offs_l[:, None] * s_y_l + offs_p[None, :] * s_y_p,
        mask=mask_l[:, None] & mask_p[None, :],
        other=0.0,
    ).to(tl.float32)
    return st, dt, y_in
