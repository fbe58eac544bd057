"""Does Triton split a tile over a CTA cluster (``num_ctas=2``) on this GPU, and does it
multicast the shared operand's TMA loads? A plain TMA matmul at the MoE shape's dense
equivalent (M=49,152, N=1,408, K=2,048, bf16, W in nn.Linear layout), compiled with
num_ctas 1 and 2 (the 2-CTA tile twice as tall, so each CTA keeps a 256x128 tile and the
W box could be shared): PTX checked for ``.multicast::cluster``, output checked against
torch, then timed (do_bench median, interleaved rounds) beside cuBLAS.

    python3 benchmarks/device/probe_num_ctas.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import traceback

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def _mm(a_desc, w_desc, out_ptr, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, WS: tl.constexpr):
    pid = tl.program_id(0)
    num_pid_n = N // BLOCK_N
    m0 = (pid // num_pid_n) * BLOCK_M
    n0 = (pid % num_pid_n) * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, K // BLOCK_K, warp_specialize=WS):
        a = a_desc.load([m0, k * BLOCK_K])
        b = w_desc.load([n0, k * BLOCK_K])
        acc = tl.dot(a, tl.trans(b), acc)
    rows = m0 + tl.arange(0, BLOCK_M)
    cols = n0 + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :],
             acc.to(out_ptr.dtype.element_ty))


VARIANTS = {  # name: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, num_ctas, WS)
    "256x128 w8 s4 1 CTA": (256, 128, 64, 8, 4, 1, False),
    "256x128 w8 s4 1 CTA WS": (256, 128, 64, 8, 4, 1, True),
    "512x128 w8 s4 2 CTAs": (512, 128, 64, 8, 4, 2, False),
    "512x128 w8 s4 2 CTAs WS": (512, 128, 64, 8, 4, 2, True),
    "256x256 w8 s4 2 CTAs": (256, 256, 64, 8, 4, 2, False),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rep", type=int, default=100)
    args = ap.parse_args()
    M, N, K = 49152, 1408, 2048
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(M, K, generator=g, device="cuda").bfloat16()
    w = (torch.randn(N, K, generator=g, device="cuda") / K ** 0.5).bfloat16()
    ref = (a.float() @ w.float().T)
    fns = {"cuBLAS": lambda: a @ w.T}
    for name, (bm, bn, bk, warps, stages, ctas, ws) in VARIANTS.items():
        try:
            out = torch.empty(M, N, dtype=torch.bfloat16, device="cuda")
            a_d = TensorDescriptor.from_tensor(a, [bm, bk])
            w_d = TensorDescriptor.from_tensor(w, [bn, bk])
            if N % bn:
                raise ValueError("N not a multiple of BLOCK_N")
            grid = ((M // bm) * (N // bn),)

            def run(a_d=a_d, w_d=w_d, out=out, grid=grid, bm=bm, bn=bn, bk=bk, warps=warps,
                    stages=stages, ctas=ctas, ws=ws):
                return _mm[grid](a_d, w_d, out, N, K, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                 WS=ws, num_warps=warps, num_stages=stages, num_ctas=ctas)

            k = run()
            ptx = k.asm.get("ptx", "")
            print(f"{name}: regs {k.n_regs} spills {k.n_spills} shared {k.metadata.shared} "
                  f"cluster {getattr(k.metadata, 'cluster_dims', '?')} "
                  f"multicast in PTX: {ptx.count('multicast::cluster')}, "
                  f"cp.async.bulk.tensor: {ptx.count('cp.async.bulk.tensor')}", flush=True)
            torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
            fns[name] = lambda run=run, out=out: (run(), out)[1]
        except Exception:
            print(f"FAILED {name}:\n{traceback.format_exc()[-2500:]}", flush=True)
    times: dict[str, list[float]] = {n: [] for n in fns}
    for _ in range(args.rounds):
        for n, fn in fns.items():
            times[n].append(triton.testing.do_bench(fn, warmup=25, rep=args.rep))
    base = statistics.median(times["cuBLAS"])
    print(f"\n{torch.cuda.get_device_name()}, M={M} N={N} K={K} bf16, {args.rounds} rounds\n")
    print("| variant | median ms | cuBLAS / it |\n|---|---|---|")
    for n, xs in times.items():
        print(f"| {n} | {statistics.median(xs):.4f} | {base / statistics.median(xs):.1%} |")


if __name__ == "__main__":
    main()
