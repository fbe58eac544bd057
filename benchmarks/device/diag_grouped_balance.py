"""Does the persistent engine's static tile assignment cost time on realistic routings?

With a fixed stride (GLUON=3), program p runs tiles p, p + P, p + 2P, ... of the block
table's (m-block, n-tile) order. At the MoE shape (11 n-tiles, P = 132 = 12 x 11, GROUP_M
1) that gives program p one n-tile and the m-blocks of one residue mod 12, so a program
whose residue holds more half-height tails than another has more work: on the harness's
log-normal routing the busiest program has 2.8 % more than the mean (half tiles counted
at 0.71 of a full one, session 21's calibration). The counter (GLUON=4) balances the work
but measured 1-2 points slower. Here the log-normal routing's experts are permuted (same
rows per expert, other orders): permutations whose busiest program has the least and the
most excess over the mean, timed beside dense cuBLAS with transposed ping-pong, by stride
and from the counter. If the stride's times follow the excess, a balanced static order
is worth building; if not, the power cap evens it out (idle SMs let the others clock
up, as session 14 found for part-filled waves).

    python3 benchmarks/device/diag_grouped_balance.py [--rounds 5] [--rep 100] [--json F]
"""

from __future__ import annotations

import random

from benchmarks.device.diag_grouped_pingpong import pingpong
from benchmarks.device.diag_grouped_steady import SHAPE, dump_pairs, timing_args
from benchmarks.device.diag_grouped_waves import pairs
from kernels.grouped_gemm import GroupedGemm, make_grouped_inputs

#: Cost of a half-height (64-row) ping-pong tile relative to a full one (session 21).
HALF = 0.71
SMS = 132


def tile_costs(counts: list[int], bm: int = 128, n_tiles: int = 11) -> list[float]:
    """Each tile's work, for TAIL_SPLIT=1 tiles in table order (each expert's full
    blocks, then one piece for its remainder: a full block above half a block, else a
    half one), GROUP_M=1."""
    costs = []
    for c in counts:
        full, r = divmod(c, bm)
        blocks = [1.0] * full + ([1.0] if r > bm // 2 else [HALF] if r else [])
        costs += [b for b in blocks for _ in range(n_tiles)]
    return costs


def excess(counts: list[int], bm: int = 128, n_tiles: int = 11, programs: int = SMS,
           dealt: bool = False) -> float:
    """The busiest program's work over the mean with a fixed stride of ``programs``, or
    with ``dealt`` as TAIL_DEAL gives the tiles: each wave's half tiles to the places
    after those the waves before gave theirs, its full tiles to the rest."""
    costs = tile_costs(counts, bm, n_tiles)
    if not dealt:
        loads = [sum(costs[p::programs]) for p in range(programs)]
        return max(loads) / (sum(loads) / programs) - 1
    loads = [0.0] * programs
    given = 0  # half tiles dealt by the waves so far
    for w0 in range(0, len(costs), programs):
        wave = costs[w0:w0 + programs]
        halves = [c for c in wave if c < 1]
        fulls = [c for c in wave if c == 1]
        for place in range(len(wave)):
            d = (place - given) % len(wave)
            loads[place] += halves[d] if d < len(halves) else fulls[d - len(halves)]
        given += len(halves)
    return max(loads) / (sum(loads) / programs) - 1


def permutations(counts: list[int], tries: int = 4000, keep: int = 3,
                 seed: int = 0) -> dict[str, list[int]]:
    """The ``keep`` expert orders with the least and the most excess among ``tries``
    random ones, and the harness's own order; name -> rows per expert."""
    rng = random.Random(seed)
    scored = []
    for _ in range(tries):
        perm = counts[:]
        rng.shuffle(perm)
        scored.append((excess(perm), perm))
    scored.sort(key=lambda t: t[0])
    out = {f"harness order (excess {excess(counts):.1%})": counts}
    for i, (x, perm) in enumerate(scored[:keep] + scored[-keep:]):
        out[f"permutation {i} (excess {x:.1%})"] = perm
    return out


def main() -> None:
    args = timing_args().parse_args()
    fam = GroupedGemm()
    N, K = SHAPE["N"], SHAPE["K"]
    routings = permutations(GroupedGemm.routing_counts(SHAPE, 0))
    problems = {name: (make_grouped_inputs(counts, N, K, "bf16", seed=i, device="cuda"),
                       SHAPE) for i, (name, counts) in enumerate(routings.items())}
    swap = pingpong(num_stages=5, SWAP_AB=1)
    cfgs = {"ping-pong s5 SWAP_AB, stride": swap,
            "ping-pong s5 SWAP_AB, counter": {**swap, "GLUON": 4}}
    times, ratios, dense_ms = pairs(fam, problems, cfgs, args.rounds, args.rep)
    if args.json:
        dump_pairs(args.json, times, ratios, dense_ms, {}, configs=cfgs)


if __name__ == "__main__":
    main()
