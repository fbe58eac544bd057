"""Grouped GEMM on Hopper: which tile shape closes the gap to dense cuBLAS?

Times TMA configs of the grouped GEMM at the MoE shape (E=64, K=2048, N=1408, M=49,152
routed rows, bf16) on three problems: the harness's log-normal routing, a balanced one
(768 rows = 6 x 128 = 3 x 256 per expert: no padding for either tile height), and E=1
(one dense [49152, 2048] x [2048, 1408] GEMM through the same kernel: what this Triton
reaches on the dense problem cuBLAS is compared on). 128x256 tiles over N = 1,408 = 5.5 x
256 multiply 9 % padding unless TAIL_SPLIT runs the last n-tile half-width; 256-row
tiles pad experts' ends unless TAIL_SPLIT runs a last block of <= 128 rows half-height.

Every problem is timed against torch._grouped_mm and dense cuBLAS at the same FLOPs, in
interleaved rounds (the GPU's clock moves under its power cap: only same-round ratios
compare). Every variant goes through the harness's Measurer (NaN-filled output, checked
against the fp32 reference).

    python3 benchmarks/device/diag_grouped_tiles.py [--rounds 5] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from benchmarks.device.diag_grouped_routing import Balanced
from harness.measure import Measurer, Timing
from kernels.grouped_gemm import GroupedGemm

T = {"USE_TMA": 1, "PERSISTENT": 0, "FLATTEN": 0, "TMA_STORE": 0, "GROUP_M": 1,
     "BLOCK_K": 64, "num_stages": 3}
W = {**T, "BLOCK_M": 128, "BLOCK_N": 256, "num_warps": 8}
H = {**T, "BLOCK_M": 256, "BLOCK_N": 128, "num_warps": 8}
CONFIGS = {
    "pack: 128x128x64 w4 s3": {**T, "BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 4},
    "128x256 w8 s3": W,
    "128x256 w8 s3 half": {**W, "TAIL_SPLIT": 1},
    "128x256 w8 s4 half": {**W, "TAIL_SPLIT": 1, "num_stages": 4},
    "128x256 w8 s3 half G8": {**W, "TAIL_SPLIT": 1, "GROUP_M": 8},
    "128x256 w8 s3 half store": {**W, "TAIL_SPLIT": 1, "TMA_STORE": 1},
    "128x256x32 w8 s5 half": {**W, "TAIL_SPLIT": 1, "BLOCK_K": 32, "num_stages": 5},
    "128x256 w8 s3 half WS": {**W, "TAIL_SPLIT": 1, "WARP_SPEC": 1},
    "128x256 w8 s3 half persistent G8": {**W, "TAIL_SPLIT": 1, "PERSISTENT": 1, "GROUP_M": 8},
    "256x128 w8 s3": H,
    "256x128 w8 s3 half": {**H, "TAIL_SPLIT": 1},
    "256x128 w8 s4 half": {**H, "TAIL_SPLIT": 1, "num_stages": 4},
    "256x128x32 w8 s6 half": {**H, "TAIL_SPLIT": 1, "BLOCK_K": 32, "num_stages": 6},
    "256x128x32 w8 s7 half": {**H, "TAIL_SPLIT": 1, "BLOCK_K": 32, "num_stages": 7},
    "256x128 w8 s4 half G8": {**H, "TAIL_SPLIT": 1, "num_stages": 4, "GROUP_M": 8},
    "256x128 w8 s4 half WS": {**H, "TAIL_SPLIT": 1, "num_stages": 4, "WARP_SPEC": 1},
    "128x128 w4 s3 G8": {**T, "BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 4, "GROUP_M": 8},
    "128x128 w4 s4": {**T, "BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 4, "num_stages": 4},
    "pack + table": {**T, "BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 4, "BLOCK_TABLE": 1},
    "256x128 w8 s3 half table": {**H, "TAIL_SPLIT": 1, "BLOCK_TABLE": 1},
    "256x128 w8 s4 half table": {**H, "TAIL_SPLIT": 1, "num_stages": 4, "BLOCK_TABLE": 1},
    "256x128 w8 s4 half WS table": {**H, "TAIL_SPLIT": 1, "num_stages": 4, "WARP_SPEC": 1,
                                    "BLOCK_TABLE": 1},
    "128x256 w8 s4 half table": {**W, "TAIL_SPLIT": 1, "num_stages": 4, "BLOCK_TABLE": 1},
    "128x256 w8 s4 half WS table": {**W, "TAIL_SPLIT": 1, "num_stages": 4, "WARP_SPEC": 1,
                                    "BLOCK_TABLE": 1},
    "256x128 w8 s4 half persistent table": {**H, "TAIL_SPLIT": 1, "num_stages": 4,
                                            "PERSISTENT": 1, "BLOCK_TABLE": 1},
    "256x128 w8 s4 half G2": {**H, "TAIL_SPLIT": 1, "num_stages": 4, "GROUP_M": 2},
    "256x128 w8 s4 half G3": {**H, "TAIL_SPLIT": 1, "num_stages": 4, "GROUP_M": 3},
    "256x128 w8 s4 half G4": {**H, "TAIL_SPLIT": 1, "num_stages": 4, "GROUP_M": 4},
    "pointer 128x256x32 w8 s4 half": {**W, "USE_TMA": 0, "TAIL_SPLIT": 1, "BLOCK_K": 32,
                                      "num_stages": 4},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default="")
    ap.add_argument("--only", default="", help="comma-separated config names")
    ap.add_argument("--problems", default="log-normal,balanced,dense E=1")
    args = ap.parse_args()
    configs = ({k: v for k, v in CONFIGS.items() if k in args.only.split(",")}
               if args.only else CONFIGS)
    seed_shape = GroupedGemm.shapes["deepseek-v3-16b"]
    problems = {
        "log-normal": (GroupedGemm(), seed_shape),
        "balanced": (Balanced(), seed_shape),
        "dense E=1": (GroupedGemm(), {**seed_shape, "E": 1}),
    }
    problems = {k: v for k, v in problems.items() if k in args.problems.split(",")}
    m = Measurer(Timing(25, 100))
    results: dict[str, dict[str, list[float]]] = {p: {} for p in problems}
    notes: dict[str, str] = {}
    for r in range(args.rounds):
        for prob, (fam, shape) in problems.items():
            for name, cfg in configs.items():
                if f"{prob} {name}" in notes:
                    continue
                res = m.measure(fam, shape, "bf16", cfg, seed=0)
                if not res.ok:
                    notes[f"{prob} {name}"] = f"failed: {res.reason[:300]}"
                    print(f"round {r} {prob} {name}: FAILED {res.reason[:300]}", flush=True)
                    continue
                results[prob].setdefault(name, []).append(res.latency_ms)
                print(f"round {r} {prob} {name}: {res.latency_ms:.4f} ms "
                      f"err {res.max_abs_err:.3g}", flush=True)
            for name, make in fam.baselines().items():
                res = m.measure_fn(fam, shape, "bf16", 0, make)
                if res.ok:
                    results[prob].setdefault(name, []).append(res.latency_ms)
                    print(f"round {r} {prob} {name}: {res.latency_ms:.4f} ms", flush=True)
    dense_key = next(k for k in results[next(iter(problems))] if k.startswith("dense"))
    print("\n| problem | variant | median ms | dense cuBLAS / variant, median of same-round "
          "ratios | TFLOP/s |\n|---|---|---|---|---|")
    flops = 2.0 * seed_shape["M"] * seed_shape["N"] * seed_shape["K"]
    for prob in problems:
        dense = results[prob].get(dense_key, [])
        for name, xs in results[prob].items():
            # Only rounds where both ran pair up (a variant that failed has no samples).
            ratio = statistics.median(d / x for d, x in zip(dense, xs, strict=False))
            med = statistics.median(xs)
            print(f"| {prob} | {name} | {med:.4f} | {ratio:.1%} | {flops / med / 1e9:.0f} |")
    for k, v in notes.items():
        print("note:", k, v)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "notes": notes, "configs": configs,
                       "device": torch.cuda.get_device_name(), "shape": seed_shape}, f, indent=1)


if __name__ == "__main__":
    main()
