"""Energy per launch: does the grouped GEMM lose to cuBLAS by spending more energy?

Under the GPUs' 700 W cap a kernel's speed is its energy per FLOP (README, "where the gap
goes"). This times each variant in windows of back-to-back launches and reads the GPU's
energy counter (NVML's total energy, through the driver's own ``libnvidia-ml``) around
each window: time, energy and mean power per launch, and the SM clock in the middle of
the window. Variants: session 17's best config, this GPU's pack, the persistent Gluon
engine (fixed stride, ``diag_grouped_tailcost.gluon_config``), the warp-specialized
engine (ping-pong, 5 stages), torch._grouped_mm,
cuBLAS's batched GEMM (balanced routing only: every expert the same rows) and dense
cuBLAS of the same FLOPs, on the log-normal, balanced and uniform routings. Every output
is checked first; rounds interleave the variants.

    python3 benchmarks/device/diag_grouped_energy.py [--rounds 3] [--window 1.0] [--json F]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time

import torch

from benchmarks.device.diag_grouped_bound import bmm
from benchmarks.device.diag_grouped_pingpong import pingpong
from benchmarks.device.diag_grouped_steady import SHAPE, make_problems, verify
from benchmarks.device.diag_grouped_tailcost import best_config, gluon_config
from harness import packs
from kernels.grouped_gemm import GroupedGemm, _dense_baseline, _grouped_mm_baseline


class Nvml:
    """The few NVML calls this needs, on device 0 (the one torch uses here)."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        if self.lib.nvmlInit_v2():
            raise RuntimeError("nvmlInit failed")
        self.h = ctypes.c_void_p()
        if self.lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(self.h)):
            raise RuntimeError("nvmlDeviceGetHandleByIndex failed")

    def energy_mj(self) -> int:
        e = ctypes.c_ulonglong()
        if self.lib.nvmlDeviceGetTotalEnergyConsumption(self.h, ctypes.byref(e)):
            raise RuntimeError("nvmlDeviceGetTotalEnergyConsumption failed")
        return e.value

    def sm_mhz(self) -> int:
        c = ctypes.c_uint()
        self.lib.nvmlDeviceGetClockInfo(self.h, 1, ctypes.byref(c))  # NVML_CLOCK_SM
        return c.value


def window(fn, seconds: float, nvml: Nvml) -> dict:
    """Back-to-back launches of ``fn`` for about ``seconds``: us and mJ per launch, W,
    and the SM clock half-way."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < 0.2:  # warm-up at the window's own power
        fn()
        n += 1
    torch.cuda.synchronize()
    per = (time.perf_counter() - t0) / n
    count = max(10, int(seconds / per))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0 = nvml.energy_mj()
    start.record()
    for i in range(count):
        fn()
        if i == count // 2:
            torch.cuda.synchronize()
            mhz = nvml.sm_mhz()
    end.record()
    torch.cuda.synchronize()
    e1 = nvml.energy_mj()
    ms = start.elapsed_time(end)
    return {"us": 1e3 * ms / count, "mJ": (e1 - e0) / count, "W": (e1 - e0) / ms,
            "MHz": mhz}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--window", type=float, default=1.0)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if args.window < 1.0:
        # NVML's energy counter moves in steps: a 0.3 s window read 938 W for cuBLAS's
        # bmm on a 700 W H100 (session 18 call 15).
        ap.error(f"--window {args.window}: under 1 s the energy counter's steps show, "
                 "not the power")
    fam = GroupedGemm()
    nvml = Nvml()
    pack = dict(packs.lookup_entry("grouped_gemm", "bf16", **SHAPE).config)
    best = best_config()
    gluon = gluon_config()
    fns: dict = {}
    notes: dict[str, str] = {}
    for prob, inputs in make_problems(fam).items():
        ref = fam.reference(inputs, SHAPE)
        cands = {"best Triton config (SWAP_AB, TMA store, TAIL_FINE=2)":
                 lambda i=inputs: fam.launcher(i, SHAPE, best),
                 "pack": lambda i=inputs: fam.launcher(i, SHAPE, pack),
                 "Gluon engine, stride": lambda i=inputs: fam.launcher(i, SHAPE, gluon),
                 "warp-specialized, ping-pong s5":
                 lambda i=inputs: fam.launcher(i, SHAPE, pingpong(num_stages=5)),
                 "torch._grouped_mm": lambda i=inputs: _grouped_mm_baseline(i, SHAPE)}
        if prob == "balanced":
            cands["cuBLAS bmm"] = lambda i=inputs: bmm(i, False)[0]
        verify(cands, ref, prob, fns, notes)
        # Dense computes another product (one weight for every row): timed, not checked.
        fns[(prob, "dense cuBLAS, same FLOPs")] = _dense_baseline(inputs, SHAPE)
        del ref
    res: dict = {k: [] for k in fns}
    for r in range(args.rounds):
        for key, fn in fns.items():
            res[key].append(window(fn, args.window, nvml))
        print(f"round {r} done", flush=True)
    flops = fam.flops(SHAPE)
    print(f"\n{torch.cuda.get_device_name()}, {args.rounds} rounds of {args.window} s "
          "windows (medians)\n")
    print("| routing | variant | us | mJ per launch | W | SM MHz | TFLOP/s | GFLOP per J |")
    print("|---|---|---|---|---|---|---|---|")
    for (prob, name), xs in res.items():
        med = {k: statistics.median(x[k] for x in xs) for k in xs[0]}
        print(f"| {prob} | {name} | {med['us']:.1f} | {med['mJ']:.1f} | {med['W']:.0f} | "
              f"{med['MHz']:.0f} | {flops / med['us'] / 1e6:.0f} | "
              f"{flops / med['mJ'] / 1e6:.0f} |")
    for k, v in notes.items():
        print("note:", k, v)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": {f"{p} | {n}": v for (p, n), v in res.items()},
                       "notes": notes, "best": best, "pack": pack, "gluon": gluon,
                       "device": torch.cuda.get_device_name()}, f, indent=1)


if __name__ == "__main__":
    main()
