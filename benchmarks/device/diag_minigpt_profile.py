"""Where the MiniGPT block's time goes: the CUDA kernels of the pack's config and of the
``torch.compile`` fp16 + SDPA baseline, per launch, from ``torch.profiler``; with the
``do_bench`` median of each around it, so the split and the total come from one run.

    python3 benchmarks/device/diag_minigpt_profile.py [--B 32] [--config '{"ATTN": ...}']
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton.testing
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from harness import hardware  # noqa: E402
from harness.packs.lookup import lookup_entry  # noqa: E402
from kernels.minigpt_block import MiniGPTBlock, sdpa_fp16_block  # noqa: E402


def kernel_table(fn, iters: int = 20) -> list[dict]:
    """Per CUDA kernel: calls per forward and mean microseconds per call."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t <= 0 or ev.count < iters:
            continue
        rows.append({"kernel": ev.key[:110], "per_fwd": ev.count / iters,
                     "us_per_fwd": round(t / iters, 2)})
    return sorted(rows, key=lambda r: -r["us_per_fwd"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=32)
    ap.add_argument("--config", default=None, help="JSON config (default: the pack's)")
    args = ap.parse_args()
    k = MiniGPTBlock()
    shape = {"B": args.B, "T": 512, "C": 768, "H": 8}
    inputs = k.make_inputs(shape, "fp32", seed=0, device="cuda")
    if args.config:
        cfg = json.loads(args.config)
    else:
        hit = lookup_entry("minigpt_block", "fp32", hardware.current_device().key, **shape)
        cfg = hit.config
    ours = k.launcher(inputs, shape, cfg)
    compiled = torch.compile(sdpa_fp16_block)
    theirs = lambda: compiled(inputs, shape)  # noqa: E731
    ref = k.reference(inputs, shape)
    out = {"shape": shape, "config": cfg}
    for name, fn in (("ours", ours), ("torch.compile sdpa fp16", theirs)):
        y = fn()
        err = (y.double() - ref).abs().max().item()
        ms = triton.testing.do_bench(fn, warmup=100, rep=500, return_mode="median")
        table = kernel_table(fn)
        out[name] = {"median_ms": ms, "max_abs_err": err,
                     "kernel_us_sum": round(sum(r["us_per_fwd"] for r in table), 1),
                     "kernels": table}
        print(f"== {name}: {ms:.4f} ms median, max abs err {err:.2e}, "
              f"kernels sum {out[name]['kernel_us_sum']} us")
        for r in table:
            print(f"  {r['us_per_fwd']:8.1f} us  x{r['per_fwd']:.0f}  {r['kernel']}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
