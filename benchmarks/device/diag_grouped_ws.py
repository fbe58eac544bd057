"""Grouped GEMM on Hopper: does Triton's warp specialization (``WARP_SPEC=1``) pay?

Times the H200 pack's config (TMA, 128x128x64, 3 stages, 4 warps, non-persistent) and
warp-specialized variants of it at the MoE shape (E=64, K=2048, N=1408, M=49,152 routed
rows, bf16), against torch._grouped_mm and dense cuBLAS at the same FLOPs, in
interleaved rounds (the GPU's clock moves under its power cap, so only same-round
ratios compare). Every variant goes through the harness's Measurer: NaN-filled output,
checked against the fp32 reference after timing.

    python3 benchmarks/device/diag_grouped_ws.py [--rounds 5] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from harness.kernel_api import get
from harness.measure import Measurer, Timing

BASE = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 4,
        "num_stages": 3, "PERSISTENT": 0, "USE_TMA": 1, "FLATTEN": 0, "TMA_STORE": 0}
VARIANTS = {
    "pack (no WS)": {},
    "WS k-loop w4 s3": {"WARP_SPEC": 1},
    "WS k-loop w8 s3": {"WARP_SPEC": 1, "num_warps": 8},
    "WS k-loop w4 s4": {"WARP_SPEC": 1, "num_stages": 4},
    "WS k-loop 128x256 w8 s3": {"WARP_SPEC": 1, "BLOCK_N": 256, "num_warps": 8},
    "persistent (no WS)": {"PERSISTENT": 1, "GROUP_M": 8},
    "WS persistent w4 s3": {"PERSISTENT": 1, "GROUP_M": 8, "WARP_SPEC": 1},
    "WS persistent flat w4 s3": {"PERSISTENT": 1, "GROUP_M": 8, "WARP_SPEC": 1, "FLATTEN": 1},
    "WS persistent w8 s3": {"PERSISTENT": 1, "GROUP_M": 8, "WARP_SPEC": 1, "num_warps": 8},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    fam = get("grouped_gemm")
    shape = fam.shapes["deepseek-v3-16b"]
    m = Measurer(Timing(25, 100))
    results: dict[str, list[float]] = {k: [] for k in VARIANTS}
    notes: dict[str, str] = {}
    base = {name: fn for name, fn in fam.baselines().items()}
    for name in base:
        results[name] = []
    for r in range(args.rounds):
        for name, extra in VARIANTS.items():
            if name in notes and notes[name].startswith("failed"):
                continue
            t0 = time.perf_counter()
            res = m.measure(fam, shape, "bf16", {**BASE, **extra}, seed=0)
            if not res.ok:
                notes[name] = f"failed: {res.reason[:300]}"
                print(name, notes[name], flush=True)
                continue
            results[name].append(res.latency_ms)
            notes[name] = (f"err {res.max_abs_err:.3g} compile/first {res.compile_s:.2f}s "
                           f"clock {res.extra.get('sm_clock_mhz')}")
            print(f"round {r} {name}: {res.latency_ms:.4f} ms ({time.perf_counter() - t0:.1f} s)",
                  flush=True)
        for name, make in base.items():
            res = m.measure_fn(fam, shape, "bf16", 0, make)
            if res.ok:
                results[name].append(res.latency_ms)
    print("\n| variant | median ms | rounds | vs pack | note |\n|---|---|---|---|---|")
    ref = results["pack (no WS)"]
    for name, xs in results.items():
        if not xs:
            print(f"| {name} | - | 0 | - | {notes.get(name, '')} |")
            continue
        ratio = statistics.median(a / b for a, b in zip(ref, xs, strict=False)) if ref else 0
        print(f"| {name} | {statistics.median(xs):.4f} | {len(xs)} | {ratio:.3f}x "
              f"| {notes.get(name, '')} |")
    if args.json:
        json.dump({"results": results, "notes": notes, "device": torch.cuda.get_device_name(),
                   "shape": shape, "base": BASE, "variants": VARIANTS}, open(args.json, "w"),
                  indent=1)


if __name__ == "__main__":
    main()
