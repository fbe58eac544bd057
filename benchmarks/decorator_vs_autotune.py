#!/usr/bin/env python3
"""First-call latency: ``harness.autotune`` (frozen pack) vs ``triton.autotune``.

    python benchmarks/decorator_vs_autotune.py --out FILE [--shape 4096,4096,4096] [--reps 2]

A plain bf16 matmul kernel and one list of 24 configs. Each measurement runs in a fresh
process, so nothing is cached in memory, with its own Triton cache directory: ``cold``
(empty: every config it needs is compiled) and then ``warm`` (the same directory again:
compiled kernels come from disk, as on a restarted server). Modes:

- ``triton.autotune``: compiles and benchmarks every config on the first call;
- ``harness.autotune``: looks the config up in a pack and compiles that one only (the pack
  holds the config ``triton.autotune`` chose in the first cold run, for the current device);
- ``harness.autotune online``: no pack entry, ``online=True`` with the same configs: it
  benchmarks them once with ``do_bench``, as triton.autotune does.

It reports the first call (launch + compile + any tuning, synchronised), the second call,
and the steady-state kernel time (do_bench), with the output checked against torch.
Needs a GPU; ``--smoke`` runs the plumbing on the CPU interpreter at toy sizes (one config
for triton.autotune, which cannot benchmark there): its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def configs(smoke: bool) -> list[dict]:
    if smoke:
        return [{"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 1, "num_warps": 1,
                 "num_stages": 1}]
    out = []
    for bm, bn in ((64, 64), (64, 128), (128, 64), (128, 128), (128, 256), (64, 256)):
        for bk in (32, 64):
            for stages in (3, 4):
                out.append({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8,
                            "num_warps": 8 if bm * bn >= 128 * 128 else 4,
                            "num_stages": stages})
    return out


# -- the child: one measurement in a fresh process ----------------------------------------
@triton.jit
def matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk,
                  stride_bn, stride_cm, stride_cn, UPCAST: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_pid_n
    first_m = (pid // group) * GROUP_M
    size_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + ((pid % group) % size_m)
    pid_n = (pid % group) // size_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rm[:, None] * stride_am + rk[None, :] * stride_ak
    b_ptrs = b_ptr + rk[:, None] * stride_bk + rn[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        kmask = rk < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=(rm[:, None] < M) & kmask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=kmask[:, None] & (rn[None, :] < N), other=0.0)
        if UPCAST:  # the interpreter's bf16 dot is wrong
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32))
        else:
            acc += tl.dot(a, b)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    c_ptrs = c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(tl.bfloat16), mask=(rm[:, None] < M) & (rn[None, :] < N))


def child(mode: str, shape: tuple[int, int, int], cfgs: list[dict], pack_dir: str,
          record: str) -> dict:
    import torch

    import harness
    from harness import packs

    M, N, K = shape
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(M, K, generator=g).to(torch.bfloat16).to(dev)
    b = torch.randn(K, N, generator=g).to(torch.bfloat16).to(dev)
    c = torch.empty(M, N, dtype=torch.bfloat16, device=dev)

    def grid(meta):
        return (triton.cdiv(meta["M"], meta["BLOCK_M"]) * triton.cdiv(meta["N"], meta["BLOCK_N"]),)

    if mode == "triton.autotune":
        tconfigs = [triton.Config({k: v for k, v in c_.items() if k.isupper()},
                                  num_warps=c_["num_warps"], num_stages=c_["num_stages"])
                    for c_ in cfgs]
        kern = triton.autotune(configs=tconfigs, key=["M", "N", "K"])(matmul_kernel)
    elif mode == "harness.autotune":
        packs.configure([pack_dir])
        kern = harness.autotune(kernel="bench_matmul", key=["M", "N", "K"],
                                default=cfgs[0])(matmul_kernel)
    else:
        packs.configure([pack_dir])  # no bench_matmul_online pack there: a miss
        kern = harness.autotune(kernel="bench_matmul_online", key=["M", "N", "K"],
                                default=cfgs[0], online=True, configs=cfgs,
                                record=record)(matmul_kernel)

    def launch():
        kern[grid](a, b, c, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                   c.stride(0), c.stride(1), UPCAST=dev == "cpu")

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    import warnings

    warnings.simplefilter("ignore", packs.PackWarning)
    sync()
    t0 = time.perf_counter()
    launch()
    sync()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    launch()
    sync()
    second = time.perf_counter() - t0
    ref = a.float() @ b.float()
    err = ((c.float() - ref).abs().max() / ref.abs().max()).item()
    steady = None
    if dev == "cuda":
        steady = triton.testing.do_bench(launch, return_mode="median")
    if mode == "triton.autotune":
        best = kern.best_config
        config = {**best.kwargs, "num_warps": best.num_warps, "num_stages": best.num_stages}
    else:
        (launch_kw,) = kern._cache.values()
        config = dict(launch_kw)
    return {"first_call_ms": first * 1e3, "second_call_ms": second * 1e3,
            "steady_ms": steady, "max_rel_err": err, "config": config,
            "ok": err < 2e-2}


# -- the parent ---------------------------------------------------------------------------
def run_child(mode: str, shape, cfgs, cache_dir: Path, pack_dir: Path, smoke: bool) -> dict:
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache_dir)}
    if smoke:
        env["TRITON_INTERPRET"] = "1"
    spec = json.dumps({"mode": mode, "shape": shape, "configs": cfgs, "pack_dir": str(pack_dir),
                       "record": str(cache_dir / "online.json")})
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--child", spec], env=env,
                          capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} child failed:\n{proc.stderr[-4000:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    res["process_wall_s"] = wall
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="JSON file to write")
    ap.add_argument("--shape", action="append", help="M,N,K (repeatable; default 4096^3)")
    ap.add_argument("--reps", type=int, default=2, help="cold+warm runs per mode and shape")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, toy sizes")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        spec = json.loads(args.child)
        print(json.dumps(child(spec["mode"], tuple(spec["shape"]), spec["configs"],
                               spec["pack_dir"], spec["record"])))
        return 0
    if not args.out:
        ap.error("--out is required")
    import torch

    if not torch.cuda.is_available() and not args.smoke:
        print("needs a GPU (or --smoke for a plumbing check on the CPU)", file=sys.stderr)
        return 2
    from harness import packs
    from harness.measure import hardware

    device = hardware.current_device()
    shapes = [tuple(int(x) for x in s.split(",")) for s in
              (args.shape or (["64,64,64"] if args.smoke else ["4096,4096,4096"]))]
    cfgs = configs(args.smoke)
    modes = ["triton.autotune", "harness.autotune", "harness.autotune online"]
    res = {"benchmark": "first call: harness.autotune (pack) vs triton.autotune",
           "device": device.name, "hardware_key": device.key,
           "versions": packs.runtime_versions(), "smoke": args.smoke,
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "n_configs": len(cfgs), "configs": cfgs, "runs": [], "summary": {}}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for shape in shapes:
            pack_dir = tmp / f"packs-{'x'.join(map(str, shape))}"
            for rep in range(args.reps):
                for mode in modes:
                    if mode == "harness.autotune" and not pack_dir.exists():
                        raise RuntimeError("no pack: triton.autotune did not run first")
                    tag = f"{mode.replace(' ', '-')}-{'x'.join(map(str, shape))}-{rep}"
                    cache = tmp / f"cache-{tag}"
                    for state in ("cold", "warm"):
                        if mode == "harness.autotune online":
                            (cache / "online.json").unlink(missing_ok=True)
                        r = run_child(mode, list(shape), cfgs, cache, pack_dir, args.smoke)
                        r.update(mode=mode, cache=state, rep=rep, shape=list(shape))
                        res["runs"].append(r)
                        print(f"{'x'.join(map(str, shape))} {mode:<24} {state:<4} rep {rep}: "
                              f"first call {r['first_call_ms']:9.1f} ms, second "
                              f"{r['second_call_ms']:7.3f} ms, kernel "
                              f"{r['steady_ms'] or float('nan'):.4f} ms, ok={r['ok']}",
                              flush=True)
                        if mode == "triton.autotune" and not pack_dir.exists():
                            # Freeze the config triton.autotune chose, for this device.
                            packs.freeze(pack_dir, device.key, "bench_matmul", "bf16", {
                                ",".join(f"{d}={v}" for d, v in zip("MNK", shape, strict=True)):
                                {"config": r["config"], "metrics": {"latency_ms": r["steady_ms"]},
                                 "provenance": {"device_name": device.name,
                                                **packs.runtime_versions()}}})
            for mode in modes:
                for state in ("cold", "warm"):
                    rs = [r for r in res["runs"] if r["mode"] == mode and r["cache"] == state
                          and r["shape"] == list(shape)]
                    steady = [r["steady_ms"] for r in rs if r["steady_ms"] is not None]
                    res["summary"][f"{'x'.join(map(str, shape))} {mode} {state}"] = {
                        "first_call_ms_median": statistics.median(r["first_call_ms"] for r in rs),
                        "steady_ms_median": statistics.median(steady) if steady else None,
                        "all_ok": all(r["ok"] for r in rs)}
    print("\nsummary (median first call):")
    for k, v in res["summary"].items():
        print(f"  {k:<50} {v['first_call_ms_median']:10.1f} ms  kernel "
              f"{v['steady_ms_median'] or float('nan'):.4f} ms  ok={v['all_ok']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
