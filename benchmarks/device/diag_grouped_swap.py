"""SWAP_AB: the grouped GEMM's tiles computed transposed (W_tile @ A_tile^T), beside the
same configs untransposed and dense cuBLAS.

With A's rows on wgmma's N side, the 256-row tile is one m64n256k16 per warp group and
K step instead of two m64n128k16, so each W slice is read from shared memory once for
all 256 rows (cuBLAS's batched kernels put the tokens on that side too:
``nvjet_sm90_tst_128x256_...``). The price is a transposed accumulator at the store.
Problems: the three routings of ``diag_grouped_steady`` and, with ``--study rows``,
every expert at 768 / 776 / 800 / 832 rows. ``--study fine`` (with main and / or rows):
the TAIL_FINE configs instead. Each variant timed right before dense cuBLAS;
every output checked first.

    python3 benchmarks/device/diag_grouped_swap.py [--study main,rows[,fine]] [--rounds 5] \
        [--rep 100]
"""

from __future__ import annotations

from benchmarks.device.diag_grouped_steady import (
    SHAPE,
    dump_pairs,
    equal_rows,
    make_problems,
    timing_args,
)
from benchmarks.device.diag_grouped_waves import pairs
from harness import packs
from kernels.grouped_gemm import GroupedGemm

ROWS = (768, 776, 800, 832)


def fine_configs() -> dict[str, dict]:
    """TAIL_FINE (each expert's last quarter piece as 32 or 16 rows where they fit),
    with and without SWAP_AB, beside the pack."""
    pack = dict(packs.lookup_entry("grouped_gemm", "bf16", **SHAPE).config)
    swap = {**pack, "SWAP_AB": 1}
    return {
        "pack": pack,
        "pack, SWAP_AB": swap,
        "pack, SWAP_AB, TAIL_FINE=1": {**swap, "TAIL_FINE": 1},
        "pack, SWAP_AB, TAIL_FINE=2": {**swap, "TAIL_FINE": 2},
        "pack, TAIL_FINE=2": {**pack, "TAIL_FINE": 2},
        "pack, TMA store, SWAP_AB, TAIL_FINE=2": {**swap, "TMA_STORE": 1, "TAIL_FINE": 2},
    }


def configs() -> dict[str, dict]:
    """This GPU's pack and its neighbours, each with and without SWAP_AB."""
    pack = dict(packs.lookup_entry("grouped_gemm", "bf16", **SHAPE).config)
    base = {
        "pack": pack,
        "pack + WARP_SPEC": {**pack, "WARP_SPEC": 1},
        "pack, TMA store": {**pack, "TMA_STORE": 1},
        "pack, 3 stages": {**pack, "num_stages": 3},
    }
    out = {}
    for name, cfg in base.items():
        out[name] = cfg
        out[name + ", SWAP_AB"] = {**cfg, "SWAP_AB": 1}
    return out


def main() -> None:
    ap = timing_args(study="main")
    ap.add_argument("--only", default="", help="comma-separated config names to keep")
    args = ap.parse_args()
    fam = GroupedGemm()
    cfgs = fine_configs() if "fine" in args.study.split(",") else configs()
    if args.only:
        keep = set(args.only.split(","))
        cfgs = {k: v for k, v in cfgs.items() if k in keep}
    problems: dict = {}
    if "main" in args.study.split(","):
        problems.update({name: (inputs, SHAPE) for name, inputs in make_problems(fam).items()})
    if "rows" in args.study.split(","):
        problems.update(equal_rows(ROWS))
    times, ratios, dense_ms = pairs(fam, problems, cfgs, args.rounds, args.rep)
    for name, cfg in cfgs.items():
        print(f"{name}: {cfg}")
    if args.json:
        dump_pairs(args.json, times, ratios, dense_ms, {}, configs=cfgs)


if __name__ == "__main__":
    main()
