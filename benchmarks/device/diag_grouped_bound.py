"""How close to dense cuBLAS can any grouped GEMM of the MoE shape get? cuBLAS's own
batched GEMM on the tail-free problem, beside dense cuBLAS.

The balanced routing (768 rows per expert, E=64, K=2048, N=1408, bf16) is the grouped
problem with no tails at all: it is exactly a batched GEMM, [64, 768, 2048] x
[64, 2048, 1408], which ``torch.bmm`` hands to cuBLAS's strided-batched kernels. Timed
beside dense cuBLAS (one [49152, 2048] x [2048, 1408] GEMM, the same FLOPs), it gives
what the vendor library reaches once the 64 experts' weights must be read instead of one.
The same bmm with one weight shared by every batch (stride 0) separates the weights'
bytes from the batching. The harness's kernel (this GPU's pack) and torch._grouped_mm run
on the same problem and on the two realistic routings (log-normal, uniform), for
reference. Each variant is timed right before dense cuBLAS, median of adjacent-pair ratios
(``diag_grouped_steady``'s pairing); every output is checked against an fp32 reference
first.

Study ``kernels``: which cuBLAS kernel the batched GEMM runs for each row count of
``rows`` (torch.profiler), its time per launch and its time per row against 768 rows:
whether cuBLAS pays for its tails as whole tiles or picks a tile that fits.

Study ``rows``: every expert the same r rows, r from 704 to 832 (M = 64 r), so that cuBLAS's
batched GEMM runs problems with tails too (r not a multiple of its tile): what tails cost
the vendor's kernel, beside what they cost the harness's (this GPU's pack) and
torch._grouped_mm; dense cuBLAS at each M.

    python3 benchmarks/device/diag_grouped_bound.py [--study bound,rows,kernels] \
        [--rounds 7] [--rep 200]
"""

from __future__ import annotations

import torch
import triton

from benchmarks.device.diag_grouped_steady import (
    SHAPE,
    dump_pairs,
    equal_rows,
    make_problems,
    paired_rounds,
    print_pairs,
    timing_args,
    verify,
)
from harness import packs
from kernels.grouped_gemm import GroupedGemm, _dense_baseline, _grouped_mm_baseline

ROWS = (704, 736, 760, 768, 776, 800, 832)


def bmm(inputs: dict, shared: bool) -> tuple[object, torch.Tensor]:
    """cuBLAS batched GEMM on a balanced problem (every expert the same row count): the
    runner and its fp32 reference. ``shared``: expert 0's weight for every batch, as a
    stride-0 batch dimension."""
    a, w = inputs["a"], inputs["w"]
    E, N, K = w.shape
    a3 = a.view(E, a.shape[0] // E, K)
    b = (w[:1].expand(E, N, K) if shared else w).transpose(1, 2)
    out = torch.empty(E, a3.shape[1], N, dtype=a.dtype, device=a.device)
    ref = torch.bmm(a3.float(), b.float()).view(-1, N)
    return (lambda: torch.bmm(a3, b, out=out).view(-1, N)), ref


def study_rows(fam: GroupedGemm, pack: dict, rounds: int, rep: int) -> None:
    """Every expert r rows, for each r in ROWS: bmm, the pack and torch._grouped_mm beside
    dense cuBLAS of the same M."""
    fns: dict = {}
    dense: dict = {}
    notes: dict = {}
    for prob, (inputs, shape) in equal_rows(ROWS).items():
        ref = fam.reference(inputs, shape)
        verify({"pack": lambda i=inputs, s=shape: fam.launcher(i, s, pack),
                "torch._grouped_mm": lambda i=inputs, s=shape: _grouped_mm_baseline(i, s)},
               ref, prob, fns, notes)
        del ref
        fn, bref = bmm(inputs, False)
        verify({"cuBLAS bmm": lambda f=fn: f}, bref, prob, fns, notes)
        del bref
        dense[prob] = _dense_baseline(inputs, shape)
    times, ratios, _ = paired_rounds(fns, dense, rounds, rep)
    print_pairs(times, ratios, rounds, rep)
    for k, v in notes.items():
        print("note:", k, v)


def study_kernels() -> None:
    """cuBLAS's batched-GEMM kernel for every row count of ROWS, from the profiler, with
    its time per launch and per row (768 rows = 1)."""
    from torch.profiler import ProfilerActivity, profile

    seen = []
    for prob, (inputs, _shape) in equal_rows(ROWS).items():
        fn, _ = bmm(inputs, False)
        r = inputs["a"].shape[0] // inputs["w"].shape[0]
        ms = triton.testing.do_bench(fn, warmup=25, rep=100)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        names = sorted({e.key for e in prof.key_averages() if e.device_type.name == "CUDA"})
        seen.append((prob, r, ms, names))
    base = next((ms / r for _, r, ms, _ in seen if r == 768), seen[0][2] / seen[0][1])
    for prob, r, ms, names in seen:
        print(f"{prob}: {ms:.4f} ms, time per row / 768 rows' {ms / r / base:.3f}; "
              f"kernels: {names}")


def main() -> None:
    args = timing_args(rounds=7, rep=200, study="bound").parse_args()
    fam = GroupedGemm()
    hit = packs.lookup_entry("grouped_gemm", "bf16", **SHAPE)
    pack = dict(hit.config)
    studies = args.study.split(",")
    if "kernels" in studies:
        study_kernels()
    if "rows" in studies:
        print(f"pack config: {pack}")
        study_rows(fam, pack, args.rounds, args.rep)
    if "bound" not in studies:
        return
    problems = make_problems(fam)
    fns: dict = {}
    dense: dict = {}
    notes: dict = {}
    for prob, inputs in problems.items():
        ref = fam.reference(inputs, SHAPE)
        verify({f"pack ({hit.source})": lambda i=inputs: fam.launcher(i, SHAPE, pack),
                "torch._grouped_mm": lambda i=inputs: _grouped_mm_baseline(i, SHAPE)},
               ref, prob, fns, notes)
        del ref
        if prob == "balanced":
            for name, shared in (("cuBLAS bmm (64 weights)", False),
                                 ("cuBLAS bmm (one weight, stride 0)", True)):
                fn, bref = bmm(inputs, shared)
                verify({name: lambda f=fn: f}, bref, prob, fns, notes)
                del bref
        dense[prob] = _dense_baseline(inputs, SHAPE)
    times, ratios, dense_ms = paired_rounds(fns, dense, args.rounds, args.rep)
    print_pairs(times, ratios, args.rounds, args.rep)
    print(f"\npack config: {pack}")
    for prob, xs in dense_ms.items():
        print(f"dense cuBLAS beside {prob}: median {sorted(xs)[len(xs) // 2]:.4f} ms")
    for k, v in notes.items():
        print("note:", k, v)
    if args.json:
        dump_pairs(args.json, times, ratios, dense_ms, notes, pack=pack)


if __name__ == "__main__":
    main()
