"""What the block table's own launch adds to a grouped GEMM call (session 21). Every
BLOCK_TABLE config runs two launches per call: the table kernel, then the GEMM; the
studies and the bench time both. Here, on the harness's log-normal routing at the MoE
shape, the whole call, the GEMM launch alone (its table filled once beforehand, so the
result is the same) and the table launch alone are timed in interleaved rounds beside
dense cuBLAS of the same FLOPs (do_bench medians, L2 flushed before each run).

    python3 benchmarks/device/probe_table_share.py [--rounds 5] [--rep 100] [--json F]
"""

from __future__ import annotations

import json
import statistics

import torch
import triton.testing

from benchmarks.device.diag_grouped_pingpong import pingpong
from benchmarks.device.diag_grouped_steady import SHAPE, timing_args
from harness import packs
from kernels.grouped_gemm import GroupedGemm, _dense_baseline


def main() -> None:
    args = timing_args().parse_args()
    fam = GroupedGemm()
    inputs = fam.make_inputs(SHAPE, "bf16", seed=0, device="cuda")
    ref = fam.reference(inputs, SHAPE)
    cfgs = {"ping-pong s5 SWAP_AB": pingpong(num_stages=5, SWAP_AB=1),
            "this GPU's pack": dict(packs.lookup_entry("grouped_gemm", "bf16", **SHAPE).config)}
    fns = {"dense cuBLAS": _dense_baseline(inputs, SHAPE)}
    for name, cfg in cfgs.items():
        whole = fam.launcher(inputs, SHAPE, cfg)
        torch.testing.assert_close(whole().float(), ref, atol=0.05, rtol=0.02)
        launches, out = fam._launches(inputs, cfg)
        table, gemm = launches
        table()
        out.zero_()
        gemm()
        torch.testing.assert_close(out.float(), ref, atol=0.05, rtol=0.02)
        fns[f"{name}: whole call"] = whole
        fns[f"{name}: GEMM launch alone"] = gemm
        fns[f"{name}: table launch alone"] = table
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(args.rounds):
        for k, fn in fns.items():
            times[k].append(triton.testing.do_bench(fn, warmup=25, rep=args.rep,
                                                    return_mode="median"))
    dense = statistics.median(times["dense cuBLAS"])
    print(f"{torch.cuda.get_device_name()}, {args.rounds} rounds, rep {args.rep} ms")
    print("| launch | median us | dense / it |\n|---|---|---|")
    for k, xs in times.items():
        m = statistics.median(xs)
        print(f"| {k} | {m * 1000:.1f} | {dense / m:.1%} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"times_ms": times, "configs": cfgs,
                       "device": torch.cuda.get_device_name()}, f, indent=1)


if __name__ == "__main__":
    main()
