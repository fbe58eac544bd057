"""Would an expert's last rows cost less riding on its last full tile (swap-AB)?

Session 12 found the quarter tiles of TAIL_SPLIT=2 (1.4 % of the rows on uniform routing)
costing ~9 % of the time: each re-reads a whole W tile from L2 for a quarter of the work.
Here an expert's last ``r % (BLOCK_M / 4)`` rows are instead computed by the CTA of its
last full BLOCK_M block, in the same K loop, from the same W tile in shared memory:
``acc_c[BN, CB] += W_tile[BN, BK] @ A_carry[CB, BK]^T`` (the rows become wgmma's N, in a
box CB of 16, 32 or 64 rows), so they cost their MMA and their A bytes but no W reads and
no tile of their own. What is left of the remainder is an exact multiple of BLOCK_M / 4
and runs as half and quarter tiles without padding. An expert with no full block keeps
the padded pieces.

This is an emulation (the block table is built on the host from the known routing; the
shipped kernel builds it on the GPU): timed back to back with dense cuBLAS and with the
shipped kernel's best config on the same routing, as in ``diag_grouped_steady.py``.

    python3 benchmarks/device/diag_grouped_carry.py [--rounds 5] [--rep 100] \\
        [--study carry|prefetch|dynamic|branches|branches2]

``--study dynamic`` asks whether persistent programs that take their tiles from an atomic
counter and load each tile's table entry a tile ahead recover what the closed-form lookup
is ahead of the table by. ``--study prefetch`` asks another question with the same kernel
(no carry): does each expert's first block bulk-prefetching a W tile into L2
(``cp.async.bulk.prefetch``, whole 4 KB rows, its own expert's or 1-4 experts ahead) make
streaming 64 experts' weights cheaper than the TMA loads' 128-byte pieces do?
"""

from __future__ import annotations

import argparse
import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.grouped_gemm import GroupedGemm, _dense_baseline, make_grouped_inputs


def carry_table(counts: list[int], bm: int, boxes: int,
                ahead: int | None = None) -> list[tuple[int, ...]]:
    """Per m-block (expert, first row, the expert's end row, height class h, carried
    rows, expert whose W tile to prefetch or -1): full blocks, the last one carrying
    ``r % (bm // 4)`` rows (``boxes`` = 0 carries none: the shipped TAIL_SPLIT=2
    decomposition), then half / quarter pieces. With ``ahead`` set, an expert's first
    block prefetches the W tile of the ``ahead``-th next non-empty expert (0: its own)."""
    grain = bm // 4
    live = [e for e, c in enumerate(counts) if c]
    out: list[tuple[int, ...]] = []
    start = 0
    for e, c in enumerate(counts):
        end = start + c
        full, r = divmod(c, bm)
        carry = r % grain if (boxes and full) else 0
        rest = r - carry
        u = -(-rest // grain)
        pf = -1
        if ahead is not None and c:
            i = live.index(e) + ahead
            pf = live[i] if i < len(live) else -1
        blocks = [(start + j * bm, 0, carry if j == full - 1 else 0) for j in range(full)]
        row = start + full * bm
        if u == 4:
            blocks.append((row, 0, 0))
        else:
            if u & 2:
                blocks.append((row, 1, 0))
                row += 2 * grain
            if u & 1:
                blocks.append((row, 2, 0))
        out += [(e, m0, end, h, cn, pf if i == 0 else -1)
                for i, (m0, h, cn) in enumerate(blocks)]
        start = end
    return out


@triton.jit
def _prefetch_w(w_ptr, expert, n0, N, K, BLOCK_N: tl.constexpr):
    """Bulk-prefetch ``expert``'s W rows n0 .. n0 + BLOCK_N (K contiguous elements each)
    into L2: one sequential 2*K-byte read per row, issued ahead of the TMA loads."""
    rows = (expert * N + n0 + tl.arange(0, BLOCK_N)).to(tl.int64)
    ptrs = w_ptr + rows * K
    nbytes = tl.full((BLOCK_N,), 0, tl.int32) + K * 2
    tl.inline_asm_elementwise(
        "mov.u32 $0, 0; cp.async.bulk.prefetch.L2.global [$1], $2;", "=r,l,r",
        [ptrs, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _tile(m0, n0, expert, row_end, cn, a_desc, w_desc, c_desc, out_ptr, N, K, stride_om,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          CB: tl.constexpr, UPCAST: tl.constexpr, WS: tl.constexpr):
    """A BLOCK_M x BLOCK_N tile at (m0, n0); with CB > 0 also the expert's last ``cn``
    rows (<= CB) from the same W boxes, as W @ A_carry^T."""
    w_row = expert * N + n0
    c0 = row_end - cn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_c = tl.zeros((BLOCK_N, CB if CB > 0 else 16), dtype=tl.float32)
    for k in tl.range(0, tl.cdiv(K, BLOCK_K), warp_specialize=WS):
        a = a_desc.load([m0, k * BLOCK_K])
        b = w_desc.load([w_row, k * BLOCK_K])
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, tl.trans(b), acc)
        if CB > 0:
            c = c_desc.load([c0, k * BLOCK_K])
            if UPCAST:
                c = c.to(tl.float32)
            acc_c = tl.dot(b, tl.trans(c), acc_c)
    rows = m0 + tl.arange(0, BLOCK_M)
    cols = n0 + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=(rows < row_end)[:, None])
    if CB > 0:
        crow = c0 + tl.arange(0, CB)
        tl.store(out_ptr + crow.to(tl.int64)[None, :] * stride_om + cols[:, None],
                 acc_c.to(out_ptr.dtype.element_ty), mask=(crow < row_end)[None, :])


@triton.jit
def _carry_kernel(a_desc, a_half, a_quarter, c1, c2, c3, w_desc, w_ptr, out_ptr, table_ptr,
                  N, K, NB, stride_om,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  BOXES: tl.constexpr, PREFETCH: tl.constexpr, UPCAST: tl.constexpr,
                  WS: tl.constexpr):
    pid = tl.program_id(0)
    num_pid_n = N // BLOCK_N
    pid_m = pid // num_pid_n
    n0 = (pid % num_pid_n) * BLOCK_N
    expert = tl.load(table_ptr + pid_m)
    m0 = tl.load(table_ptr + NB + pid_m)
    row_end = tl.load(table_ptr + 2 * NB + pid_m)
    h = tl.load(table_ptr + 3 * NB + pid_m)
    cn = tl.load(table_ptr + 4 * NB + pid_m)
    if PREFETCH:
        pfe = tl.load(table_ptr + 5 * NB + pid_m)
        if pfe >= 0:
            _prefetch_w(w_ptr, pfe, n0, N, K, BLOCK_N)
    G: tl.constexpr = BLOCK_M // 4
    # The constexpr leads each condition, so a box a config lacks is never compiled.
    if BOXES == -1:  # full tiles only (right for balanced routing alone): no tail branches
        _tile(m0, n0, expert, row_end, 0, a_desc, w_desc, a_desc, out_ptr, N, K,
              stride_om, BLOCK_M, BLOCK_N, BLOCK_K, 0, UPCAST, WS)
    elif BOXES == -2:  # the same three tile heights, the full tile's branch first
        if h == 0:
            _tile(m0, n0, expert, row_end, 0, a_desc, w_desc, a_desc, out_ptr, N, K,
                  stride_om, BLOCK_M, BLOCK_N, BLOCK_K, 0, UPCAST, WS)
        elif h == 1:
            _tile(m0, n0, expert, row_end, 0, a_half, w_desc, a_half, out_ptr, N, K,
                  stride_om, 2 * G, BLOCK_N, BLOCK_K, 0, UPCAST, WS)
        else:
            _tile(m0, n0, expert, row_end, 0, a_quarter, w_desc, a_quarter, out_ptr, N, K,
                  stride_om, G, BLOCK_N, BLOCK_K, 0, UPCAST, WS)
    elif BOXES == -3:  # full and half tiles only (one tail branch; balanced routing alone)
        if h == 0:
            _tile(m0, n0, expert, row_end, 0, a_desc, w_desc, a_desc, out_ptr, N, K,
                  stride_om, BLOCK_M, BLOCK_N, BLOCK_K, 0, UPCAST, WS)
        else:
            _tile(m0, n0, expert, row_end, 0, a_half, w_desc, a_half, out_ptr, N, K,
                  stride_om, 2 * G, BLOCK_N, BLOCK_K, 0, UPCAST, WS)
    elif h == 2:
        _tile(m0, n0, expert, row_end, 0, a_quarter, w_desc, a_quarter, out_ptr, N, K,
              stride_om, G, BLOCK_N, BLOCK_K, 0, UPCAST, WS)
    elif h == 1:
        _tile(m0, n0, expert, row_end, 0, a_half, w_desc, a_half, out_ptr, N, K,
              stride_om, 2 * G, BLOCK_N, BLOCK_K, 0, UPCAST, WS)
    elif BOXES == 0 or cn == 0:
        _tile(m0, n0, expert, row_end, 0, a_desc, w_desc, a_desc, out_ptr, N, K,
              stride_om, BLOCK_M, BLOCK_N, BLOCK_K, 0, UPCAST, WS)
    elif BOXES >= 3 and cn <= G // 4:
        _tile(m0, n0, expert, row_end, cn, a_desc, w_desc, c3, out_ptr, N, K,
              stride_om, BLOCK_M, BLOCK_N, BLOCK_K, G // 4, UPCAST, WS)
    elif BOXES >= 2 and cn <= G // 2:
        _tile(m0, n0, expert, row_end, cn, a_desc, w_desc, c2, out_ptr, N, K,
              stride_om, BLOCK_M, BLOCK_N, BLOCK_K, G // 2, UPCAST, WS)
    else:
        _tile(m0, n0, expert, row_end, cn, a_desc, w_desc, c1, out_ptr, N, K,
              stride_om, BLOCK_M, BLOCK_N, BLOCK_K, G, UPCAST, WS)


def _table(counts: list[int], bm: int, boxes: int, ahead: int | None,
           device: torch.device) -> tuple[torch.Tensor, int]:
    """``carry_table``'s rows as the kernels read them (one int32 row per column, back to
    back) and the block count."""
    rows = carry_table(counts, bm, boxes, ahead)
    table = torch.tensor([list(col) for col in zip(*rows, strict=True)], dtype=torch.int32)
    return table.reshape(-1).to(device), len(rows)


def carry_launcher(inputs: dict, counts: list[int], tile: tuple[int, ...], boxes: int,
                   ws: bool = True, ahead: int | None = None):
    """A no-argument callable running the carry kernel on ``inputs`` (routing ``counts``);
    ``tile`` = (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); ``boxes`` = how many
    carry boxes (G, G/2, G/4 rows; 0: no carry, the shipped decomposition; -1: full tiles
    only, no tail branches compiled, balanced routing alone); ``ahead``
    as in ``carry_table`` (None: no prefetch)."""
    bm, bn, bk, warps, stages = tile
    a, w = inputs["a"], inputs["w"]
    M, K = a.shape
    E, N, _ = w.shape
    assert N % bn == 0 and K % bk == 0
    table, nb = _table(counts, bm, boxes, ahead, a.device)
    out = torch.empty(M, N, dtype=a.dtype, device=a.device)
    g = bm // 4
    descs = [TensorDescriptor.from_tensor(a, [x, bk]) for x in (bm, bm // 2, g, g, g // 2,
                                                                g // 4)]
    w_desc = TensorDescriptor.from_tensor(w.view(E * N, K), [bn, bk])
    upcast = os.environ.get("TRITON_INTERPRET") == "1"

    def run() -> torch.Tensor:
        run.compiled = _carry_kernel[(nb * (N // bn),)](
            *descs, w_desc, w, out, table, N, K, nb, out.stride(0),
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, BOXES=boxes, PREFETCH=ahead is not None,
            UPCAST=upcast, WS=ws,
            num_warps=warps, num_stages=stages)
        return out

    return run


@triton.jit
def _entry(table_ptr, NB, tile, total_tiles, num_pid_n):
    """The table's (expert, first row, end row, height class) of ``tile``'s m-block (a
    clamped index past the last tile: the values are not used then)."""
    pid_m = tl.minimum(tile, total_tiles - 1) // num_pid_n
    return (tl.load(table_ptr + pid_m), tl.load(table_ptr + NB + pid_m),
            tl.load(table_ptr + 2 * NB + pid_m), tl.load(table_ptr + 3 * NB + pid_m))


@triton.jit
def _dynamic_kernel(a_desc, a_half, a_quarter, w_desc, out_ptr, table_ptr, counter_ptr,
                    N, K, NB, total_tiles, stride_om, NUM_PROGS,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    UPCAST: tl.constexpr):
    """Persistent, tiles handed out by an atomic counter (a program that finishes early
    takes the next one), the tile ids two ahead: at the start of a tile the program
    claims the tile after next and loads the table entry of the next, whose id it
    claimed a tile earlier, so neither the atomic's nor the table's latency sits
    between two tiles."""
    num_pid_n = N // BLOCK_N
    tile = tl.program_id(0)
    expert, m0, row_end, h = _entry(table_ptr, NB, tile, total_tiles, num_pid_n)
    nxt = tl.atomic_add(counter_ptr, 1) + NUM_PROGS
    G: tl.constexpr = BLOCK_M // 4
    while tile < total_tiles:
        after = tl.atomic_add(counter_ptr, 1) + NUM_PROGS
        n_expert, n_m0, n_end, n_h = _entry(table_ptr, NB, nxt, total_tiles, num_pid_n)
        n0 = (tile % num_pid_n) * BLOCK_N
        if h == 2:
            _tile(m0, n0, expert, row_end, 0, a_quarter, w_desc, a_quarter, out_ptr, N, K,
                  stride_om, G, BLOCK_N, BLOCK_K, 0, UPCAST, False)
        elif h == 1:
            _tile(m0, n0, expert, row_end, 0, a_half, w_desc, a_half, out_ptr, N, K,
                  stride_om, 2 * G, BLOCK_N, BLOCK_K, 0, UPCAST, False)
        else:
            _tile(m0, n0, expert, row_end, 0, a_desc, w_desc, a_desc, out_ptr, N, K,
                  stride_om, BLOCK_M, BLOCK_N, BLOCK_K, 0, UPCAST, False)
        tile = nxt
        nxt = after
        expert = n_expert
        m0 = n_m0
        row_end = n_end
        h = n_h


def dynamic_launcher(inputs: dict, counts: list[int], tile: tuple[int, ...],
                     programs: int | None = None):
    """A no-argument callable running ``_dynamic_kernel`` (the shipped decomposition:
    full, half and quarter tiles) with ``programs`` persistent programs (one per SM by
    default)."""
    bm, bn, bk, warps, stages = tile
    a, w = inputs["a"], inputs["w"]
    M, K = a.shape
    E, N, _ = w.shape
    assert N % bn == 0 and K % bk == 0
    table, nb = _table(counts, bm, 0, None, a.device)
    counter = torch.zeros(1, dtype=torch.int32, device=a.device)
    out = torch.empty(M, N, dtype=a.dtype, device=a.device)
    descs = [TensorDescriptor.from_tensor(a, [x, bk]) for x in (bm, bm // 2, bm // 4)]
    w_desc = TensorDescriptor.from_tensor(w.view(E * N, K), [bn, bk])
    upcast = os.environ.get("TRITON_INTERPRET") == "1"
    total = nb * (N // bn)
    if programs is None:
        programs = (torch.cuda.get_device_properties(a.device).multi_processor_count
                    if a.device.type == "cuda" else 4)
    programs = min(programs, total)

    def run() -> torch.Tensor:
        counter.zero_()
        run.compiled = _dynamic_kernel[(programs,)](
            *descs, w_desc, out, table, counter, N, K, nb, total, out.stride(0), programs,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, UPCAST=upcast,
            num_warps=warps, num_stages=stages)
        return out

    return run


T4 = (256, 128, 64, 8, 4)


def _carry(tile: tuple[int, ...], boxes: int, ahead: int | None = None, ws: bool = True):
    return lambda inputs, counts: carry_launcher(inputs, counts, tile, boxes, ws, ahead)


def _dynamic(tile: tuple[int, ...]):
    return lambda inputs, counts: dynamic_launcher(inputs, counts, tile)


# name: launcher factory (inputs, counts) -> callable
STUDIES = {
    "carry": {"carry 64 s4": _carry(T4, 1),
              "carry 32/64 s4": _carry(T4, 2),
              "carry 16/32/64 s4": _carry(T4, 3),
              "carry 16/32/64 s3": _carry((256, 128, 64, 8, 3), 3),
              "no carry s4 (emulation of shipped)": _carry(T4, 0)},
    # Is streaming the experts' weights (~6 % at E=64, README) DRAM access order? Each
    # expert's first block bulk-prefetches a W tile, whole 4 KB rows at a time.
    "prefetch": {"no prefetch": _carry(T4, 0),
                 "prefetch own W tile": _carry(T4, 0, 0),
                 "prefetch 1 expert ahead": _carry(T4, 0, 1),
                 "prefetch 2 experts ahead": _carry(T4, 0, 2),
                 "prefetch 4 experts ahead": _carry(T4, 0, 4)},
    # Balanced routing only: does the table kernel's full-tile path lose to the closed-form
    # lookup because of the tail branches compiled beside it (code size, registers)?
    "branches": {"table, full tiles only": _carry(T4, -1, ws=False),
                 "table, full tiles only, WS": _carry(T4, -1),
                 "table, with tail branches": _carry(T4, 0, ws=False),
                 "table, with tail branches, WS": _carry(T4, 0)},
    "branches2": {"table, full tiles only": _carry(T4, -1, ws=False),
                  "table, tail branches (quarter, half, full)": _carry(T4, 0, ws=False),
                  "table, tail branches (full, half, quarter)": _carry(T4, -2, ws=False),
                  "table, one tail branch (full, half)": _carry(T4, -3, ws=False),
                  "table, tail branches (full, half, quarter), WS": _carry(T4, -2)},
    # Is the table's per-tile latency (each one-tile program loads its entry before its
    # first TMA load) what the closed-form lookup is ahead by? Persistent programs that
    # take tiles from an atomic counter and load the next tile's entry a tile ahead.
    "dynamic": {"dynamic persistent s4": _dynamic(T4),
                "dynamic persistent s3": _dynamic((256, 128, 64, 8, 3)),
                "one tile per program s4 (emulation of shipped)": _carry(T4, 0, ws=False),
                "one tile per program s4 WS": _carry(T4, 0)},
}


def main() -> None:
    from benchmarks.device.diag_grouped_codegen import serialized
    from benchmarks.device.diag_grouped_map import closed_form
    from benchmarks.device.diag_grouped_steady import (
        CONFIGS,
        paired_rounds,
        print_pairs,
        uniform_counts,
        verify,
    )

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--study", choices=sorted(STUDIES), default="carry")
    args = ap.parse_args()
    shape = GroupedGemm.shapes["deepseek-v3-16b"]
    fam = GroupedGemm()
    M, N, K, E = (shape[d] for d in ("M", "N", "K", "E"))
    routings = {"log-normal": GroupedGemm.routing_counts(shape, 0),
                "uniform": uniform_counts(M, E, 2), "balanced": [M // E] * E}
    keep = {"carry": ("log-normal", "uniform"), "branches": ("balanced",),
            "branches2": ("balanced",)}.get(args.study, tuple(routings))
    routings = {k: v for k, v in routings.items() if k in keep}
    variants = STUDIES[args.study]
    fns, dense, notes = {}, {}, {}
    for prob, counts in routings.items():
        inputs = make_grouped_inputs(counts, N, K, "bf16", seed=3, device="cuda")
        ref = fam.reference(inputs, shape)
        tab = carry_table(counts, 256, 1)
        print(f"{prob} ({args.study}): {len(tab)} blocks, {sum(1 for t in tab if t[4])} carrying "
              f"{sum(t[4] for t in tab)} rows; shipped: {len(carry_table(counts, 256, 0))} "
              "blocks", flush=True)
        cands = {name: (lambda f=f, i=inputs, c=counts: f(i, c))
                 for name, f in variants.items()}
        cands["shipped best"] = (lambda i=inputs: fam.launcher(
            i, shape, CONFIGS["256x128 s4 split2 table WS"]))
        if prob == "balanced" and args.study != "prefetch":
            cands["closed-form lookup s4 (diagnostic)"] = (
                lambda i=inputs: closed_form(i, E, (256, 128, 64, 8, 4)))
        verify(cands, ref, prob, fns, notes)
        for name in cands:
            k = getattr(fns.get((prob, name)), "compiled", None)
            if k is not None and prob == ("uniform" if "uniform" in routings else "balanced"):
                print(f"{name}: regs {k.n_regs} spills {k.n_spills} shared "
                      f"{k.metadata.shared}, {serialized(k)}", flush=True)
            if f"{prob} {name}" in notes:
                print("note:", prob, name, notes[f"{prob} {name}"], flush=True)
        dense[prob] = _dense_baseline(inputs, shape)
        del ref
    times, ratios, _ = paired_rounds(fns, dense, args.rounds, args.rep)
    print_pairs(times, ratios, args.rounds, args.rep)


if __name__ == "__main__":
    main()
