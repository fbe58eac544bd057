"""Do unequal experts slow the full tiles? Routings of whole 256-row blocks only, at the
real M.

Session 16's ceiling study took the realistic routings' tails out and found their full
blocks alone at ~89 % of dense per row, below the balanced routing's 91-94 %; but its
per-row figure charges the whole problem's weight reads to fewer rows. Here every routing
has exactly M = 49,152 rows in whole 256-row blocks (192 blocks: no tail, no padding, the
same FLOPs as dense), the blocks spread over the experts unequally or not: balanced (3
each), 2 or 4, 1 or 5, and the log-normal routing's shape (its counts rounded to blocks,
its 5 empty experts kept). The whole log-normal and uniform routings run beside them for
reference, and session 16's "full blocks only" cut of each (every expert's rows past its
last full block taken out), here against dense cuBLAS at that cut's own M. Each variant
is timed right beside dense cuBLAS of the same FLOPs.

    python3 benchmarks/device/diag_grouped_skew.py [--rounds 5] [--rep 100] [--json F] \
        [--study pack|coop]

Study ``coop`` (session 21): the transposed cooperative 256x128 kernel, at cuBLAS's
batched GEMM on the balanced routing and 11 points under it on the realistic ones
(session 20), beside transposed ping-pong, on the same routings plus whole-block
routings of 16.25 and 16.5 waves of its tiles: whether its loss is the tails or a last
wave that the balanced routing (exactly 16 waves) never has.
"""

from __future__ import annotations

from benchmarks.device.diag_grouped_concurrent import split_problem
from benchmarks.device.diag_grouped_pingpong import pingpong
from benchmarks.device.diag_grouped_steady import SHAPE, dump_pairs, make_problems, timing_args
from benchmarks.device.diag_grouped_waves import pairs
from harness import packs
from kernels.grouped_gemm import GroupedGemm, make_grouped_inputs


def lognormal_blocks(bm: int = 256) -> list[int]:
    """The harness's log-normal routing rounded to whole blocks (largest remainder), so
    that the blocks still sum to M / bm."""
    counts = GroupedGemm.routing_counts(SHAPE, 0)
    total = SHAPE["M"] // bm
    q = [c / bm for c in counts]
    blocks = [int(v) for v in q]
    for e in sorted(range(len(q)), key=lambda e: blocks[e] - q[e])[: total - sum(blocks)]:
        blocks[e] += 1
    return blocks


def block_routings(bm: int = 256) -> dict[str, list[int]]:
    """Rows per expert, whole blocks only, all summing to M."""
    E = SHAPE["E"]
    half = E // 2
    return {
        "blocks 3 each (balanced)": [3 * bm] * E,
        "blocks 2 or 4": [2 * bm, 4 * bm] * half,
        "blocks 1 or 5": [bm, 5 * bm] * half,
        "blocks as log-normal (0-15)": [b * bm for b in lognormal_blocks(bm)],
    }


def coop_configs() -> dict[str, dict]:
    """Session 20's best transposed cooperative config (256x128, 3 stages, one-piece
    tails, tiles from the counter) and stride, beside transposed ping-pong s5."""
    coop = pingpong(num_warps=8, BLOCK_M=256, num_stages=3, TAIL_SPLIT=1, SWAP_AB=1,
                    TAIL_FINE=2, GLUON=4)
    return {"coop 256x128 s3 SWAP_AB one tail, counter": coop,
            "coop 256x128 s3 SWAP_AB one tail, stride": {**coop, "GLUON": 3},
            "ping-pong s5 SWAP_AB": pingpong(num_stages=5, SWAP_AB=1)}


def wave_routings(bm: int = 256) -> dict[str, list[int]]:
    """The log-normal routing's block shape with 3 or 6 blocks more (the largest experts
    take them): 195 / 198 blocks of 11 tiles, 16.25 / 16.5 waves on 132 SMs."""
    base = lognormal_blocks(bm)
    out = {}
    for extra in (3, 6):
        blocks = list(base)
        for e in sorted(range(len(blocks)), key=lambda e: -blocks[e])[:extra]:
            blocks[e] += 1
        out[f"blocks as log-normal + {extra} ({sum(blocks)} blocks)"] = [
            b * bm for b in blocks]
    return out


def main() -> None:
    args = timing_args(study="pack").parse_args()
    fam = GroupedGemm()
    pack = dict(packs.lookup_entry("grouped_gemm", "bf16", **SHAPE).config)
    swap = {**pack, "SWAP_AB": 1, "TMA_STORE": 1}
    cfgs = {"pack": pack, "pack, SWAP_AB, TMA store": swap,
            "pack, SWAP_AB, TMA store, TAIL_FINE 2": {**swap, "TAIL_FINE": 2}}
    routings = block_routings()
    if args.study == "coop":
        cfgs = coop_configs()
        keep = ("blocks 3 each (balanced)", "blocks as log-normal (0-15)")
        routings = {k: routings[k] for k in keep} | wave_routings()
    N, K = SHAPE["N"], SHAPE["K"]
    problems = {name: (make_grouped_inputs(counts, N, K, "bf16", seed=i, device="cuda"),
                       {**SHAPE, "M": sum(counts)})
                for i, (name, counts) in enumerate(routings.items())}
    whole = make_problems(fam)
    for k in ("log-normal", "uniform"):
        problems[f"whole {k}"] = (whole[k], SHAPE)
        # Session 16's "full blocks only" problem, here against dense cuBLAS at its own M.
        pi, ps, _, _ = split_problem(whole[k], full_only=True)
        problems[f"{k}, full blocks only ({ps['M']} rows), dense at that M"] = (pi, ps)
    times, ratios, dense_ms = pairs(fam, problems, cfgs, args.rounds, args.rep)
    if args.json:
        dump_pairs(args.json, times, ratios, dense_ms, {}, configs=cfgs)
    print(f"pack: {pack}")


if __name__ == "__main__":
    main()
