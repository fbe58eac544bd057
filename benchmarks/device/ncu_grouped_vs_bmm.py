"""One launch each, for Nsight Compute, of what the balanced routing's gap is made of: the
grouped GEMM's best config, its persistent Gluon engine (fixed stride), the
warp-specialized engine (ping-pong, session 19), cuBLAS's batched GEMM and dense cuBLAS,
on the balanced routing (every expert 768 rows) at the MoE shape. Session 18's energy
study found cuBLAS's bmm doing the same work in 15-24 % fewer SM cycles; the sections
below say where the grouped kernel's cycles go (tensor pipe activity, warp stalls,
memory).

    ncu --nvtx --nvtx-include "profile/" --section SpeedOfLight \\
        --section ComputeWorkloadAnalysis --section WarpStateStats \\
        --section MemoryWorkloadAnalysis python3 benchmarks/device/ncu_grouped_vs_bmm.py

Every output is checked first, outside the NVTX range "profile"; inside it each runs once
(each grouped GEMM's launches: its block table, then the GEMM).
"""

from __future__ import annotations

import torch

from benchmarks.device.diag_grouped_bound import bmm
from benchmarks.device.diag_grouped_pingpong import pingpong
from benchmarks.device.diag_grouped_steady import SHAPE, make_problems
from benchmarks.device.diag_grouped_tailcost import best_config, gluon_config
from kernels.grouped_gemm import GroupedGemm, _dense_baseline


def main() -> None:
    fam = GroupedGemm()
    inputs = make_problems(fam)["balanced"]
    ref = fam.reference(inputs, SHAPE)
    runs = {"grouped GEMM, best config": fam.launcher(inputs, SHAPE, best_config()),
            "Gluon engine, stride": fam.launcher(inputs, SHAPE, gluon_config()),
            "warp-specialized engine, ping-pong s5": fam.launcher(inputs, SHAPE, pingpong(
                num_stages=5)),
            "cuBLAS bmm": bmm(inputs, False)[0]}
    for name, fn in runs.items():
        torch.testing.assert_close(fn().float(), ref, atol=2e-2, rtol=2e-2)
        print("checked:", name, flush=True)
    runs["dense cuBLAS, same FLOPs"] = _dense_baseline(inputs, SHAPE)
    runs["dense cuBLAS, same FLOPs"]()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("profile")
    for name, fn in runs.items():
        fn()
        torch.cuda.synchronize()
        print("profiled:", name, flush=True)
    torch.cuda.nvtx.range_pop()


if __name__ == "__main__":
    main()
