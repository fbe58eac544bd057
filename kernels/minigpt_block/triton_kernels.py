"""Triton kernels of the minGPT block (the ``minigpt_block`` family).

Arithmetic is fp32 everywhere; loads and stores use the pointers' dtypes, so the same
kernel serves the fp32 and the fp16 (PRECISION) paths and the cast to the next GEMM's
dtype is part of the store.
"""

from __future__ import annotations

import triton
import triton.language as tl

# sqrt(2 / pi): NewGELU's constant (a constexpr: jitted code reads no other globals).
_GELU_C = tl.constexpr(0.7978845608028654)


@triton.jit
def _layernorm_kernel(x_ptr, a_ptr, bias_ptr, xo_ptr, xo_bias_ptr, w_ptr, b_ptr, y_ptr, M,
                      N, eps, FUSED_RES: tl.constexpr, XO_BIAS: tl.constexpr,
                      ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
    """ROWS rows of N per program: ``y = LN(x)``, or with FUSED_RES ``x' = x + a + bias``
    (stored fp32) then ``y = LN(x')``: the attention's c_proj bias, the first residual and
    ln_2 in one pass. XO_BIAS stores ``x' + xo_bias`` instead of ``x'`` (the MLP's c_proj
    bias folded into the residual that its GEMM then adds as C)."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_C)
    col_ok = cols < N
    mask = (rows < M)[:, None] & col_ok[None, :]
    offs = rows[:, None] * N + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if FUSED_RES:
        a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        x = x + (a + bias[None, :])
        if XO_BIAS:
            xb = tl.load(xo_bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            tl.store(xo_ptr + offs, x + xb[None, :], mask=mask)
        else:
            tl.store(xo_ptr + offs, x, mask=mask)
    mean = tl.sum(x, axis=1) / N
    xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / N + eps)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0)
    b = tl.load(b_ptr + cols, mask=col_ok, other=0.0)
    y = xc * rstd[:, None] * w[None, :] + b[None, :]
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _qkv_split_kernel(qkv_ptr, q_ptr, kt_ptr, v_ptr, T, H, C, HD: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """The c_attn output [B*T, 3C] -> q [B, H, T, hd], k^T [B, H, hd, T], v [B, H, T, hd]
    in one read of each element. Grid: (T blocks, B*H)."""
    pid_t = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_t < T)[:, None] & (offs_d < HD)[None, :]
    src = (qkv_ptr + (b * T + offs_t).to(tl.int64)[:, None] * (3 * C) + h * HD
           + offs_d[None, :])
    head = bh.to(tl.int64) * T * HD
    dst = head + offs_t[:, None] * HD + offs_d[None, :]
    tl.store(q_ptr + dst, tl.load(src, mask=mask), mask=mask)
    tl.store(v_ptr + dst, tl.load(src + 2 * C, mask=mask), mask=mask)
    # k^T: the store is transposed (contiguous along t); Triton routes it through shared
    # memory so that both the load and the store stay coalesced.
    tl.store(kt_ptr + head + offs_d[None, :] * T + offs_t[:, None],
             tl.load(src + C, mask=mask), mask=mask)


@triton.jit
def _causal_softmax_kernel(s_ptr, n_rows, T, qk_scale,
                           ROWS: tl.constexpr, BLOCK_T: tl.constexpr):
    """In place on the [B*H*T, T] scores: ``softmax(masked_fill(s * scale, future, -inf))``.
    ``qk_scale`` carries log2(e) for exp2. Only the causal part of a row is read; the
    future entries are written as exact zeros (what masked_fill + softmax gives)."""
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_T)
    t = rows % T  # the query position of each row
    row_ok = rows < n_rows
    keep = row_ok[:, None] & (cols[None, :] <= t[:, None])
    ptrs = s_ptr + rows.to(tl.int64)[:, None] * T + cols[None, :]
    s = tl.load(ptrs, mask=keep, other=float("-inf")).to(tl.float32) * qk_scale
    m = tl.max(s, axis=1)
    e = tl.exp2(s - m[:, None])
    p = e / tl.sum(e, axis=1)[:, None]
    tl.store(ptrs, p.to(s_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols < T)[None, :])


@triton.jit
def _mm(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b; IEEE: true fp32 products (the fp32 path), else the operands' own."""
    if IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _flash_inner(acc, m_i, l_i, q, k_base, v_base, skt, skd, svt, offs_m, offs_n0, offs_d,
                 d_ok, lo, hi, T, qk_scale,
                 BLOCK_N: tl.constexpr, MASKED: tl.constexpr, IEEE: tl.constexpr):
    """Online-softmax update over the key blocks [lo, hi)."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        if MASKED:
            n_ok = offs_n < T
            k = tl.load(k_base + offs_d[:, None] * skd + offs_n[None, :] * skt,
                        mask=d_ok[:, None] & n_ok[None, :], other=0.0)
            v = tl.load(v_base + offs_n[:, None] * svt + offs_d[None, :],
                        mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        else:
            k = tl.load(k_base + offs_d[:, None] * skd + offs_n[None, :] * skt,
                        mask=d_ok[:, None], other=0.0)
            v = tl.load(v_base + offs_n[:, None] * svt + offs_d[None, :],
                        mask=d_ok[None, :], other=0.0)
        s = _mm(q, k, tl.zeros([q.shape[0], BLOCK_N], dtype=tl.float32), IEEE) * qk_scale
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, offs_m, offs_n, MASKED)
        acc = _mm(p.to(v.dtype), v, acc * alpha[:, None], IEEE)
    return acc, m_i, l_i


@triton.jit
def _softmax_step(s, m_i, l_i, offs_m, offs_n, MASKED: tl.constexpr):
    """One online-softmax update with the scaled scores ``s`` of a key block: the block's
    probabilities, the factor that rescales what was accumulated, the new row max and
    row sum."""
    if MASKED:
        # Key 0 is in every row's first block, so no row max stays -inf.
        s = tl.where(offs_n[None, :] <= offs_m[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _flash_program(H, T, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's (batch, head, query rows) and the key range [0, n_free) that needs
    no causal mask, then [n_free, n_end) that does. Grid: (T blocks, B*H); the heaviest
    query blocks (the most keys under the causal mask) run first: less tail."""
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q_lo = pid_m * BLOCK_M
    n_free = (q_lo // BLOCK_N) * BLOCK_N
    n_end = tl.minimum(q_lo + BLOCK_M, T)
    return b, h, offs_m, n_free, n_end


@triton.jit
def _flash_attn_kernel(q_ptr, k_ptr, v_ptr, y_ptr,
                       sqb, sqh, sqt, skb, skh, skt, skd, svb, svh, svt,
                       T, H, stride_y, qk_scale, HD: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                       IEEE: tl.constexpr):
    """Causal attention with online softmax; the T x T scores never reach memory.
    (HD is a compile-time constant so that the head-dim masks are too.)

    q, v are read as [t, d] with unit d stride; k as [d, t] through (skt, skd), so both
    a k^T buffer and the c_attn output read in place work. The head dim is padded to
    BLOCK_D (a power of two, >= 16 for tl.dot) with masked loads: the zero columns add
    nothing to q.k and the padded output columns are not stored. y is [B*T, C] row-major
    with head h at columns h*HD, the layout c_proj consumes. Grid: (T blocks, B*H).
    """
    b, h, offs_m, n_free, n_end = _flash_program(H, T, BLOCK_M, BLOCK_N)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HD
    k_base = k_ptr + b * skb + h * skh
    v_base = v_ptr + b * svb + h * svh

    q = tl.load(q_ptr + b * sqb + h * sqh + offs_m[:, None] * sqt + offs_d[None, :],
                mask=(offs_m < T)[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Key blocks wholly before this query block need neither the causal mask nor the
    # T bound; the rest, up to the block's last query, are masked.
    acc, m_i, l_i = _flash_inner(acc, m_i, l_i, q, k_base, v_base, skt, skd, svt, offs_m,
                                 offs_n0, offs_d, d_ok, 0, n_free, T, qk_scale,
                                 BLOCK_N, False, IEEE)
    acc, m_i, l_i = _flash_inner(acc, m_i, l_i, q, k_base, v_base, skt, skd, svt, offs_m,
                                 offs_n0, offs_d, d_ok, n_free, n_end, T, qk_scale,
                                 BLOCK_N, True, IEEE)

    acc = acc / l_i[:, None]
    y_ptrs = y_ptr + (b * T + offs_m).to(tl.int64)[:, None] * stride_y + h * HD + offs_d[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty),
             mask=(offs_m < T)[:, None] & d_ok[None, :])


@triton.jit
def _flash_inner_split(acc_a, acc_b, m_i, l_i, q_a, q_b, k_base, v_base, skt, skd, svt,
                       offs_m, offs_n0, offs_da, offs_db, lo, hi, T, qk_scale,
                       BLOCK_N: tl.constexpr, MASKED: tl.constexpr, IEEE: tl.constexpr):
    """``_flash_inner`` with the head dim in two power-of-two parts (a, b): no padding."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        ka_ptrs = k_base + offs_da[:, None] * skd + offs_n[None, :] * skt
        kb_ptrs = k_base + offs_db[:, None] * skd + offs_n[None, :] * skt
        va_ptrs = v_base + offs_n[:, None] * svt + offs_da[None, :]
        vb_ptrs = v_base + offs_n[:, None] * svt + offs_db[None, :]
        if MASKED:
            n_ok = offs_n < T
            k_a = tl.load(ka_ptrs, mask=n_ok[None, :], other=0.0)
            k_b = tl.load(kb_ptrs, mask=n_ok[None, :], other=0.0)
            v_a = tl.load(va_ptrs, mask=n_ok[:, None], other=0.0)
            v_b = tl.load(vb_ptrs, mask=n_ok[:, None], other=0.0)
        else:
            k_a = tl.load(ka_ptrs)
            k_b = tl.load(kb_ptrs)
            v_a = tl.load(va_ptrs)
            v_b = tl.load(vb_ptrs)
        s = _mm(q_a, k_a, tl.zeros([q_a.shape[0], BLOCK_N], dtype=tl.float32), IEEE)
        s = _mm(q_b, k_b, s, IEEE) * qk_scale
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, offs_m, offs_n, MASKED)
        p = p.to(v_a.dtype)
        acc_a = _mm(p, v_a, acc_a * alpha[:, None], IEEE)
        acc_b = _mm(p, v_b, acc_b * alpha[:, None], IEEE)
    return acc_a, acc_b, m_i, l_i


@triton.jit
def _flash_attn_split_kernel(q_ptr, k_ptr, v_ptr, y_ptr,
                             sqb, sqh, sqt, skb, skh, skt, skd, svb, svh, svt,
                             T, H, stride_y, qk_scale, HD: tl.constexpr, D_A: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             IEEE: tl.constexpr):
    """``_flash_attn_kernel`` for a head dim that is the sum of two powers of two
    (HD = D_A + D_B, both >= 16; 96 = 64 + 32): q, k, v and the accumulator in two column
    parts, so no dot multiplies padding (padding 96 to 128 costs a third more work)."""
    D_B: tl.constexpr = HD - D_A
    b, h, offs_m, n_free, n_end = _flash_program(H, T, BLOCK_M, BLOCK_N)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_da = tl.arange(0, D_A)
    offs_db = D_A + tl.arange(0, D_B)
    m_ok = (offs_m < T)[:, None]
    q_rows = q_ptr + b * sqb + h * sqh + offs_m[:, None] * sqt
    q_a = tl.load(q_rows + offs_da[None, :], mask=m_ok, other=0.0)
    q_b = tl.load(q_rows + offs_db[None, :], mask=m_ok, other=0.0)
    k_base = k_ptr + b * skb + h * skh
    v_base = v_ptr + b * svb + h * svh
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc_a = tl.zeros([BLOCK_M, D_A], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_M, D_B], dtype=tl.float32)

    acc_a, acc_b, m_i, l_i = _flash_inner_split(
        acc_a, acc_b, m_i, l_i, q_a, q_b, k_base, v_base, skt, skd, svt, offs_m, offs_n0,
        offs_da, offs_db, 0, n_free, T, qk_scale, BLOCK_N, False, IEEE)
    acc_a, acc_b, m_i, l_i = _flash_inner_split(
        acc_a, acc_b, m_i, l_i, q_a, q_b, k_base, v_base, skt, skd, svt, offs_m, offs_n0,
        offs_da, offs_db, n_free, n_end, T, qk_scale, BLOCK_N, True, IEEE)

    y_rows = y_ptr + (b * T + offs_m).to(tl.int64)[:, None] * stride_y + h * HD
    tl.store(y_rows + offs_da[None, :], (acc_a / l_i[:, None]).to(y_ptr.dtype.element_ty),
             mask=m_ok)
    tl.store(y_rows + offs_db[None, :], (acc_b / l_i[:, None]).to(y_ptr.dtype.element_ty),
             mask=m_ok)


@triton.jit
def _bias_gelu_kernel(a_ptr, bias_ptr, y_ptr, NUMEL, N_COLS, BLOCK: tl.constexpr):
    """y = NewGELU(a + bias[col]) over a flat [rows, N_COLS] tensor (y may alias a)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < NUMEL
    x = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x = x + tl.load(bias_ptr + offs % N_COLS, mask=mask, other=0.0).to(tl.float32)
    # 0.5 * (1 + tanh(u)) == sigmoid(2u): one exp instead of a tanh.
    u = _GELU_C * (x + 0.044715 * x * x * x)
    tl.store(y_ptr + offs, (x * tl.sigmoid(2.0 * u)).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bias_residual_kernel(a_ptr, bias_ptr, r_ptr, y_ptr, NUMEL, N_COLS, BLOCK: tl.constexpr):
    """y = r + (a + bias[col]) in fp32: the MLP's c_proj bias and the second residual."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < NUMEL
    a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    a = a + tl.load(bias_ptr + offs % N_COLS, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, (r + a).to(y_ptr.dtype.element_ty), mask=mask)
