"""The Gluon engine (GLUON=1/2: persistent, a TMA ring pipelined across tiles, tiles at a
fixed stride or from a counter; TMA stores) against the
Triton kernel of this GPU's pack, each timed right beside dense cuBLAS
(``diag_grouped_steady``'s pairing, median of adjacent-pair ratios), on the log-normal,
balanced and uniform routings at the MoE shape; every output checked first.

Study ``rows``: every expert the same r rows (r = 64: quarter tiles only, 128: half
tiles, 256: one full tile, 768: three, 800 and 832: three and a quarter), so that each
tile height's cost shows on its own.

    python3 benchmarks/device/diag_grouped_gluon.py [--study main,rows] [--rounds 5] [--rep 100]
"""

from __future__ import annotations

import argparse

from benchmarks.device.diag_grouped_steady import SHAPE, equal_rows, make_problems
from benchmarks.device.diag_grouped_waves import pairs
from harness import packs
from kernels.grouped_gemm import GroupedGemm

ROWS = (64, 128, 256, 768, 800, 832)

G = {"GLUON": 1, "USE_TMA": 1, "PERSISTENT": 1, "BLOCK_TABLE": 1, "BLOCK_K": 64,
     "BLOCK_M": 256, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3, "GROUP_M": 1,
     "TAIL_SPLIT": 2, "TMA_STORE": 1}
K32 = {**G, "BLOCK_K": 32, "num_stages": 6}
CONFIGS = {
    "gluon=1 256x128 k32 s6 split2": dict(K32),
    "gluon=2 256x128 k32 s6 split2": {**K32, "GLUON": 2},
    "gluon=2 256x128 k32 s6 split2 window4": {**K32, "GLUON": 2, "TAIL_WINDOW": 4},
    "gluon=2 256x128 k32 s6 split2 G8": {**K32, "GLUON": 2, "GROUP_M": 8},
    "gluon=2 256x128 k32 s6 no split": {**K32, "GLUON": 2, "TAIL_SPLIT": 0},
    "gluon=2 256x128 k64 s3 split2": {**G, "GLUON": 2},
    "gluon=2 128x256 s3 split1": {**G, "GLUON": 2, "BLOCK_M": 128, "BLOCK_N": 256,
                                  "TAIL_SPLIT": 1},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--only", default="", help="comma-separated config names to keep")
    ap.add_argument("--study", default="main")
    args = ap.parse_args()
    fam = GroupedGemm()
    configs = {"pack (Triton)": dict(packs.lookup_entry("grouped_gemm", "bf16", **SHAPE).config),
               **CONFIGS}
    if args.only:
        keep = set(args.only.split(","))
        configs = {k: v for k, v in configs.items() if k in keep or k == "pack (Triton)"}
    studies = args.study.split(",")
    if "rows" in studies:
        pairs(fam, equal_rows(ROWS), configs, args.rounds, args.rep)
    if "main" in studies:
        problems = {name: (inputs, SHAPE) for name, inputs in make_problems(fam).items()}
        pairs(fam, problems, configs, args.rounds, args.rep)
    for name, cfg in configs.items():
        print(f"{name}: {cfg}")


if __name__ == "__main__":
    main()
