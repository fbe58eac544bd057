"""Grouped GEMM: how much of the gap to dense cuBLAS is the routing's padding?

The harness's MoE inputs route the M rows with log-normal expert popularity (some
experts empty), so each expert's last 128-row tile is partly padding. This times the
same configs on that routing and on a balanced one (every expert gets M / E rows: at
M=49,152, E=64 that is 768 = 6 x 128, no padding at all), each against torch._grouped_mm
and dense cuBLAS at the same FLOPs, in interleaved rounds (the GPU's clock moves under
its power cap: only same-round ratios compare). Every variant goes through the
harness's Measurer (NaN-filled output, checked against the fp32 reference).

    python3 benchmarks/device/diag_grouped_routing.py [--rounds 5] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from harness.measure import Measurer, Timing
from kernels.grouped_gemm import GroupedGemm

PACK = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 4,
        "num_stages": 3, "PERSISTENT": 0, "USE_TMA": 1, "FLATTEN": 0, "TMA_STORE": 0}
CONFIGS = {
    "H200 pack (TMA 128x128x64 w4 s3)": PACK,
    "TMA 128x256x64 w8 s3": {**PACK, "BLOCK_N": 256, "num_warps": 8},
    "TMA 64x256x64 w4 s4": {**PACK, "BLOCK_M": 64, "BLOCK_N": 256, "num_stages": 4},
    "TMA persistent 128x128x64 G8": {**PACK, "PERSISTENT": 1, "GROUP_M": 8},
}


class Balanced(GroupedGemm):
    """The same family with every expert given M / E rows (the remainder to the first)."""

    @staticmethod
    def routing_counts(shape, seed):
        M, E = int(shape["M"]), int(shape["E"])
        counts = [M // E] * E
        counts[0] += M - sum(counts)
        return counts


def padding(counts: list[int], block_m: int) -> float:
    """The fraction of MMA rows that are padding with ``block_m``-row tiles."""
    rows = sum(-(-c // block_m) * block_m for c in counts)
    return 1 - sum(counts) / rows if rows else 0.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    fams = {"log-normal (harness)": GroupedGemm(), "balanced": Balanced()}
    shape = GroupedGemm.shapes["deepseek-v3-16b"]
    m = Measurer(Timing(25, 100))
    results: dict[str, dict[str, list[float]]] = {r: {} for r in fams}
    notes: dict[str, str] = {}
    for r in range(args.rounds):
        for routing, fam in fams.items():
            for name, cfg in CONFIGS.items():
                res = m.measure(fam, shape, "bf16", cfg, seed=0)
                if not res.ok:
                    notes[f"{routing} {name}"] = f"failed: {res.reason[:200]}"
                    continue
                results[routing].setdefault(name, []).append(res.latency_ms)
                print(f"round {r} {routing} {name}: {res.latency_ms:.4f} ms "
                      f"err {res.max_abs_err:.3g}", flush=True)
            for name, make in fam.baselines().items():
                res = m.measure_fn(fam, shape, "bf16", 0, make)  # timed, error reported
                if res.ok:
                    results[routing].setdefault(name, []).append(res.latency_ms)
    dense_key = next(k for k in results["balanced"] if k.startswith("dense"))
    print("\n| routing | BLOCK_M=128 padding | variant | median ms | dense / variant "
          "(same rounds) |\n|---|---|---|---|---|")
    for routing, fam in fams.items():
        pad = padding(fam.routing_counts(shape, 0), 128)
        dense = results[routing].get(dense_key, [])
        for name, xs in results[routing].items():
            ratio = (statistics.median(d / x for d, x in zip(dense, xs, strict=False))
                     if dense else float("nan"))
            print(f"| {routing} | {pad:.1%} | {name} | {statistics.median(xs):.4f} | "
                  f"{ratio:.1%} |")
    for k, v in notes.items():
        print("note:", k, v)
    if args.json:
        json.dump({"results": results, "notes": notes, "device": torch.cuda.get_device_name(),
                   "shape": shape, "configs": CONFIGS}, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
