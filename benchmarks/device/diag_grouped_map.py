"""Grouped GEMM: where do the grouped problem's extra ~12 % go?

diag_grouped_tiles.py (2026-11-24) found the same TMA 256x128 kernel at 96 % of dense
cuBLAS on one dense GEMM (E=1) and at 83 % on 64 balanced experts of the same FLOPs. Two
suspects: each tile's expert lookup (three block-wide reductions over the E offsets, on
the critical path of every tile) and the experts' weights streamed from DRAM (one
expert's W per 3-6 m-blocks instead of one W for all). This times, on balanced routing
(M / E rows per expert), for E = 1, 4, 16, 64:

- the harness kernel (reduction lookup), 256x128 and 128x128 tiles, and with
  BLOCK_TABLE (a first launch writes each block's expert and rows);
- the same tile code with a closed-form lookup (expert = m-block // blocks per expert,
  valid for balanced routing only: a diagnostic, not a kernel to ship), and that again
  with every expert reading expert 0's W (a wrong result with a dense GEMM's W traffic:
  what streaming 64 experts' weights costs);
- dense cuBLAS of the same FLOPs,

with triton.testing.do_bench (median) in interleaved rounds; every kernel's output is
checked against torch's per-expert product first.

    python3 benchmarks/device/diag_grouped_map.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.grouped_gemm import GroupedGemm, _gemm_tile_tma, make_grouped_inputs

M, N, K = 49152, 1408, 2048
TILES = {  # name: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
    "256x128 w8 s3": (256, 128, 64, 8, 3),
    "128x128 w4 s3": (128, 128, 64, 4, 3),
}


@triton.jit
def _closed_form_kernel(a_desc, w_desc, out_desc, out_ptr, N, K, ROWS_PER_E, stride_om,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        SHARED_W: tl.constexpr):
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_pid_n
    pid_n = pid % num_pid_n
    expert = pid_m // (ROWS_PER_E // BLOCK_M)
    # SHARED_W: every expert reads expert 0's weight (wrong result, dense W traffic).
    w_expert = 0 if SHARED_W else expert
    _gemm_tile_tma(pid_m * BLOCK_M, pid_n * BLOCK_N, w_expert, (expert + 1) * ROWS_PER_E,
                   a_desc, w_desc, out_desc, out_ptr, N, K, stride_om,
                   BLOCK_M, BLOCK_N, BLOCK_K, False, False, False, False)


def closed_form(inputs, E, tile, shared_w=False):
    bm, bn, bk, warps, stages = tile
    a, w = inputs["a"], inputs["w"]
    out = torch.empty(M, N, dtype=a.dtype, device=a.device)
    a_desc = TensorDescriptor.from_tensor(a, [bm, bk])
    w_desc = TensorDescriptor.from_tensor(w.view(E * N, K), [bn, bk])
    out_desc = TensorDescriptor.from_tensor(out, [bm, bn])
    grid = (M // bm * triton.cdiv(N, bn),)

    def run():
        _closed_form_kernel[grid](a_desc, w_desc, out_desc, out, N, K, M // E, out.stride(0),
                                  BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
                                  num_stages=stages, SHARED_W=shared_w)
        return out
    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    fam = GroupedGemm()
    fns: dict[tuple[int, str], object] = {}
    for E in (1, 4, 16, 64):
        inputs = make_grouped_inputs([M // E] * E, N, K, "bf16", seed=E, device="cuda")
        shape = {"M": M, "N": N, "K": K, "E": E}
        ref = fam.reference(inputs, shape)
        for name, (bm, bn, bk, warps, stages) in TILES.items():
            cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps,
                   "num_stages": stages, "USE_TMA": 1, "GROUP_M": 1}
            fns[(E, f"harness {name}")] = fam.launcher(inputs, shape, cfg)
            fns[(E, f"harness {name} BLOCK_TABLE")] = fam.launcher(
                inputs, shape, {**cfg, "BLOCK_TABLE": 1})
            fns[(E, f"closed-form {name}")] = closed_form(inputs, E, (bm, bn, bk, warps, stages))
            if E > 1:
                fns[(E, f"closed-form {name}, expert 0's W for all")] = closed_form(
                    inputs, E, (bm, bn, bk, warps, stages), shared_w=True)
        for (e, label), fn in fns.items():
            if e == E and "for all" not in label:
                torch.testing.assert_close(fn().float(), ref, atol=2e-2, rtol=2e-2)
        b = inputs["w"][0].t()
        dense_out = torch.empty(M, N, dtype=torch.bfloat16, device="cuda")
        fns[(E, "dense cuBLAS")] = (lambda a=inputs["a"], b=b, o=dense_out: torch.mm(a, b, out=o))
        del ref
    times: dict[tuple[int, str], list[float]] = {k: [] for k in fns}
    for r in range(args.rounds):
        for key, fn in fns.items():
            times[key].append(triton.testing.do_bench(fn, warmup=25, rep=100))
        print(f"round {r} done", flush=True)
    flops = 2.0 * M * N * K
    print(f"\n{torch.cuda.get_device_name()}, M={M} N={N} K={K} bf16, balanced routing\n")
    print("| E | variant | median ms | dense cuBLAS / variant (median of same-round ratios) "
          "| TFLOP/s |\n|---|---|---|---|---|")
    for (E, label), xs in times.items():
        dense = times[(E, "dense cuBLAS")]
        ratio = statistics.median(d / x for d, x in zip(dense, xs, strict=True))
        med = statistics.median(xs)
        print(f"| {E} | {label} | {med:.4f} | {ratio:.1%} | {flops / med / 1e9:.0f} |")


if __name__ == "__main__":
    main()
