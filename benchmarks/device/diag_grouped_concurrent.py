"""Quarter tails in a second, concurrent launch: can their weight streaming hide under the
full tiles' arithmetic? (Emulation, with outputs checked.)

In the pack's decomposition (256-row blocks, TAIL_SPLIT=2) an expert's last <= 64 rows are
a quarter tile that streams the expert's whole W again at a quarter of the full tile's
arithmetic intensity; those tiles take ~9 % of the time for ~1.4 % of the rows (session
12). Here the routing is split in two grouped GEMMs over the same A and W: "main" (every
expert without its quarter piece's rows: full and half tiles only) and "tails" (only those
rows, <= 64 per expert, as one small tile per expert and n-tile). They run one after the
other on one stream, or on two streams at once, the main kernel at 3 or 4 stages (3 leaves
the shared memory for a tails CTA beside it: 147 + 72 KB); each against dense cuBLAS of
the whole problem.

Study ``ceiling``: the pack (and with SWAP_AB and the TMA store) on each routing without
its quarter pieces' rows, and with full blocks only: what the rest runs at when the tails
cost nothing. Study ``order``: the same routings with their experts permuted (by size,
alternating largest and smallest, shuffled): whether the order in which the experts'
weights are met matters.

    python3 benchmarks/device/diag_grouped_concurrent.py [--study concurrent|ceiling|order] \
        [--rounds 5] [--rep 100]
"""

from __future__ import annotations

import torch

from benchmarks.device.diag_grouped_steady import (
    SHAPE,
    make_problems,
    time_and_report,
    timing_args,
    verify,
)
from harness import packs
from kernels.grouped_gemm import GroupedGemm, _dense_baseline, counts_to_offsets

TAILS = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 4,
         "num_stages": 3, "USE_TMA": 1, "BLOCK_TABLE": 1, "SWAP_AB": 1}


def quarter_rows(count: int, bm: int = 256) -> int:
    """The rows of an expert's quarter piece in the TAIL_SPLIT=2 table (0 if none)."""
    grain = bm // 4
    rem = count % bm
    u = -(-rem // grain)
    return 0 if u == 4 or not u & 1 else rem - (u >> 1) * 2 * grain


def split_problem(inputs: dict, full_only: bool = False) -> tuple[dict, dict, dict, dict]:
    """(main inputs, main shape, tails inputs, tails shape): every expert's rows without,
    and only, its quarter piece's rows, as two contiguous grouped problems; with
    ``full_only``, without / only everything past its last full 256-row block."""
    a, w, offs = inputs["a"], inputs["w"], inputs["offsets_host"]
    counts = [offs[e + 1] - offs[e] for e in range(len(offs) - 1)]
    q = [c % 256 if full_only else quarter_rows(c) for c in counts]
    main_rows = torch.cat([torch.arange(offs[e], offs[e + 1] - q[e]) for e in range(len(q))])
    tail_rows = torch.cat([torch.arange(offs[e + 1] - q[e], offs[e + 1]) for e in range(len(q))])

    def part(rows: torch.Tensor, cnt: list[int]) -> tuple[dict, dict]:
        o = counts_to_offsets(cnt)
        return ({"a": a[rows.to(a.device)].contiguous(), "w": w, "offsets_host": o,
                 "offsets": torch.tensor(o, dtype=torch.int32, device=a.device)},
                {**SHAPE, "M": o[-1]})

    mi, ms = part(main_rows, [c - t for c, t in zip(counts, q, strict=True)])
    ti, ts = part(tail_rows, q)
    return mi, ms, ti, ts


def both(fam: GroupedGemm, parts: tuple, main_cfg: dict, concurrent: bool,
         tails_first: bool):
    """A runner of the two launches (one stream, or the tails on a second one) whose
    outputs are checked against the two parts' references by ``check``."""
    mi, ms, ti, ts = parts
    run_main = fam.launcher(mi, ms, main_cfg)
    run_tails = fam.launcher(ti, ts, TAILS)
    side = torch.cuda.Stream()

    def run() -> tuple:
        if not concurrent:
            return run_main(), run_tails()
        cur = torch.cuda.current_stream()
        side.wait_stream(cur)
        if tails_first:
            with torch.cuda.stream(side):
                t = run_tails()
            m = run_main()
        else:
            m = run_main()
            with torch.cuda.stream(side):
                t = run_tails()
        cur.wait_stream(side)
        return m, t

    return run


def _time_variants(fam: GroupedGemm, cfgs: dict[str, dict], variants, rounds: int,
                   rep: int, json_path: str) -> None:
    """Every config on each realistic routing's variants (``variants(inputs)`` yields
    (label, inputs, shape)), outputs checked, each timed beside dense cuBLAS of the
    whole routing."""
    fns: dict = {}
    dense: dict = {}
    notes: dict = {}
    for prob, inputs in make_problems(fam).items():
        if prob == "balanced":
            continue
        for what, pi, ps in variants(inputs):
            ref = fam.reference(pi, ps)
            verify({f"{name}, {what}": (lambda c=c, i=pi, s=ps: fam.launcher(i, s, c))
                    for name, c in cfgs.items()}, ref, prob, fns, notes)
            del ref
        dense[prob] = _dense_baseline(inputs, SHAPE)
    time_and_report(fns, dense, notes, rounds, rep, json_path, configs=cfgs)


def ceiling(fam: GroupedGemm, pack: dict, rounds: int, rep: int, json_path: str) -> None:
    """What the realistic routings' rows would run at with tails that cost nothing: the
    pack and its SWAP_AB + TMA-store neighbour on each routing without its quarter
    pieces' rows (full and half tiles left) and without any rows past the experts' last
    full block (full tiles only), against dense cuBLAS of the whole problem."""
    cfgs = {"pack": pack,
            "pack, SWAP_AB, TMA store": {**pack, "SWAP_AB": 1, "TMA_STORE": 1},
            "pack, SWAP_AB, TMA store, 3 stages": {**pack, "SWAP_AB": 1, "TMA_STORE": 1,
                                                    "num_stages": 3}}

    def variants(inputs: dict):
        yield f"whole routing ({SHAPE['M']} rows)", inputs, SHAPE
        for what, full_only in (("no quarter pieces", False), ("full blocks only", True)):
            pi, ps, _, _ = split_problem(inputs, full_only)
            yield f"{what} ({ps['M']} rows)", pi, ps

    _time_variants(fam, cfgs, variants, rounds, rep, json_path)


def reordered(inputs: dict, order: list[int]) -> dict:
    """The same grouped problem with its experts in ``order`` (A's row groups and W's
    experts permuted together): the same work, the experts met in another order."""
    a, w, offs = inputs["a"], inputs["w"], inputs["offsets_host"]
    rows = torch.cat([torch.arange(offs[e], offs[e + 1]) for e in order]).to(a.device)
    o = counts_to_offsets([offs[e + 1] - offs[e] for e in order])
    return {"a": a[rows].contiguous(), "w": w[order].contiguous(), "offsets_host": o,
            "offsets": torch.tensor(o, dtype=torch.int32, device=a.device)}


def orders(counts: list[int]) -> dict[str, list[int]]:
    """Expert orders to try: as routed, by size (descending, ascending), largest and
    smallest alternating, and a random shuffle."""
    by_size = sorted(range(len(counts)), key=lambda e: -counts[e])
    alt = [by_size[(i // 2) if i % 2 == 0 else -(i // 2) - 1] for i in range(len(counts))]
    g = torch.Generator().manual_seed(0)
    return {"as routed": list(range(len(counts))), "largest first": by_size,
            "smallest first": by_size[::-1], "largest and smallest alternating": alt,
            "shuffled": torch.randperm(len(counts), generator=g).tolist()}


def expert_order(fam: GroupedGemm, pack: dict, rounds: int, rep: int, json_path: str) -> None:
    """The pack (and with SWAP_AB + TMA store) on each realistic routing with its experts
    in other orders, against dense cuBLAS: does the order in which the experts' weights
    are met matter?"""
    cfgs = {"pack": pack, "pack, SWAP_AB, TMA store": {**pack, "SWAP_AB": 1, "TMA_STORE": 1}}

    def variants(inputs: dict):
        offs = inputs["offsets_host"]
        for oname, order in orders([offs[e + 1] - offs[e] for e in range(len(offs) - 1)]).items():
            yield f"experts {oname}", reordered(inputs, order), SHAPE

    _time_variants(fam, cfgs, variants, rounds, rep, json_path)


def main() -> None:
    args = timing_args(study="concurrent").parse_args()  # concurrent, ceiling or order
    fam = GroupedGemm()
    pack = dict(packs.lookup_entry("grouped_gemm", "bf16", **SHAPE).config)
    if args.study == "ceiling":
        ceiling(fam, pack, args.rounds, args.rep, args.json)
        return
    if args.study == "order":
        expert_order(fam, pack, args.rounds, args.rep, args.json)
        return
    fns: dict = {}
    dense: dict = {}
    notes: dict = {}
    for prob, inputs in make_problems(fam).items():
        if prob == "balanced":
            continue  # no quarter pieces there
        verify({"pack": lambda i=inputs: fam.launcher(i, SHAPE, pack)},
               fam.reference(inputs, SHAPE), prob, fns, notes)
        parts = split_problem(inputs)
        mi, ms, ti, ts = parts
        print(f"{prob}: main {ms['M']} rows, tails {ts['M']} rows "
              f"({sum(1 for c in ti['offsets_host'][1:] if c)} experts)")
        ref_m, ref_t = fam.reference(mi, ms), fam.reference(ti, ts)
        for stages in (4, 3):
            cfg = {**pack, "num_stages": stages}
            for name, conc, first in (("sequential", False, False),
                                      ("concurrent, tails first", True, True),
                                      ("concurrent, main first", True, False)):
                run = both(fam, parts, cfg, conc, first)
                label = f"main s{stages} + tails, {name}"
                try:
                    m, t = run()
                    torch.cuda.synchronize()
                    torch.testing.assert_close(m.float(), ref_m, atol=2e-2, rtol=2e-2)
                    torch.testing.assert_close(t.float(), ref_t, atol=2e-2, rtol=2e-2)
                    fns[(prob, label)] = run
                except Exception as exc:  # a failing variant is reported, not fatal
                    notes[f"{prob} {label}"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            verify({f"main s{stages} alone": lambda c=cfg, i=mi, s=ms: fam.launcher(i, s, c)},
                   ref_m, prob, fns, notes)
        verify({"tails alone": lambda i=ti, s=ts: fam.launcher(i, s, TAILS)}, ref_t, prob, fns,
               notes)
        dense[prob] = _dense_baseline(inputs, SHAPE)
    time_and_report(fns, dense, notes, args.rounds, args.rep, args.json, pack=pack,
                    tails=TAILS)
    print(f"pack: {pack}\ntails: {TAILS}")


if __name__ == "__main__":
    main()
