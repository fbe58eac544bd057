"""Would a second launch for the experts' quarter tails pay? An emulation with the
shipped kernel: the best config on the routing without the rows that TAIL_SPLIT=2 puts
in quarter tiles (the main launch), plus small-tile configs that fit several programs
per SM on those rows alone (the tail launch), against the best config on the whole
routing; all back to back in each round, medians over rounds.

    python3 benchmarks/device/diag_grouped_tail_launch.py [--rounds 5] [--rep 100]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton

from benchmarks.device.diag_grouped_steady import CONFIGS, uniform_counts
from kernels.grouped_gemm import GroupedGemm, _dense_baseline, make_grouped_inputs

SHAPE = GroupedGemm.shapes["deepseek-v3-16b"]
BEST = CONFIGS["256x128 s4 split2 table WS"]
TAIL = {
    "64x128 w4 s3": {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4,
                     "num_stages": 3, "USE_TMA": 1, "GROUP_M": 1},
    "64x128 w4 s4": {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4,
                     "num_stages": 4, "USE_TMA": 1, "GROUP_M": 1},
    "64x64 w4 s4": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4,
                    "num_stages": 4, "USE_TMA": 1, "GROUP_M": 1},
    "64x128x128 w4 s2": {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4,
                         "num_stages": 2, "USE_TMA": 1, "GROUP_M": 1},
}


def quarter_rows(count: int, bm: int = 256) -> int:
    """Rows of ``count`` that the table with TAIL_SPLIT=2 puts in a quarter tile."""
    r = count % bm
    grain = bm // 4
    u = -(-r // grain)
    return r - (r // (2 * grain)) * 2 * grain if u % 2 == 1 and u != 4 else 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rep", type=int, default=100)
    args = ap.parse_args()
    fam = GroupedGemm()
    M, N, K, E = (SHAPE[d] for d in ("M", "N", "K", "E"))
    routings = {"log-normal": GroupedGemm.routing_counts(SHAPE, 0),
                "uniform": uniform_counts(M, E, 2)}
    fns: dict[tuple[str, str], object] = {}
    for name, counts in routings.items():
        q = [quarter_rows(c) for c in counts]
        main_counts = [c - x for c, x in zip(counts, q, strict=True)]
        print(f"{name}: {sum(1 for x in q if x)} quarter tails, {sum(q)} rows", flush=True)
        parts = {"whole": (counts, BEST), "main": (main_counts, BEST)}
        parts.update({f"tail {t}": (q, cfg) for t, cfg in TAIL.items()})
        for part, (cnts, cfg) in parts.items():
            inputs = make_grouped_inputs(cnts, N, K, "bf16", seed=3, device="cuda")
            shape = {"M": sum(cnts), "N": N, "K": K, "E": E}
            fn = fam.launcher(inputs, shape, cfg)
            torch.testing.assert_close(fn().float(), fam.reference(inputs, shape),
                                       atol=2e-2, rtol=2e-2)
            fns[(name, part)] = fn
            if part == "whole":
                fns[(name, "dense")] = _dense_baseline(inputs, shape)
    times: dict[tuple[str, str], list[float]] = {k: [] for k in fns}
    for _ in range(args.rounds):
        for k, fn in fns.items():
            times[k].append(triton.testing.do_bench(fn, warmup=25, rep=args.rep))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\n{torch.cuda.get_device_name()}, {args.rounds} rounds, rep {args.rep} ms\n")
    print("| routing | part | median ms | dense / it |\n|---|---|---|---|")
    for (name, part), t in med.items():
        print(f"| {name} | {part} | {t:.4f} | {med[(name, 'dense')] / t:.1%} |")
    for name in routings:
        tail = min(t for (n, p), t in med.items() if n == name and p.startswith("tail"))
        both = med[(name, "main")] + tail
        print(f"| {name} | main + fastest tail | {both:.4f} | "
              f"{med[(name, 'dense')] / both:.1%} |")


if __name__ == "__main__":
    main()
