"""The steady diag's grouped GEMM configs compiled by this checkout's kernel and,
with --old, by another copy of kernels/grouped_gemm.py (say ``git show
<commit>:kernels/grouped_gemm.py``): each compiled kernel's registers, spills, shared
memory and whether ptxas serialized its wgmma, then its time back to back with dense
cuBLAS (median of adjacent-pair ratios). For kernel changes that should not move the
code a config compiles to, or its speed: session 12's first wide-tail kernel added a
64x256 dot that ptxas answered by serializing every wgmma of the kernel, the full
tiles' included (10 points slower on routings where no tile took the new branch).

    python3 benchmarks/device/diag_grouped_codegen.py [--old /path/to/grouped_gemm.py]
        [--match REGEX]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import tempfile
import traceback

import torch

from benchmarks.device.diag_grouped_steady import (
    CONFIGS,
    make_problems,
    paired_rounds,
    print_pairs,
)
from kernels.grouped_gemm import GroupedGemm, _dense_baseline

SHAPE = GroupedGemm.shapes["deepseek-v3-16b"]
CUOBJDUMP = "/usr/local/cuda/bin/cuobjdump"


def serialized(kernel: object) -> str:
    """How many of the kernel's wgmma ptxas made wait for the one before (a wait for zero
    groups in flight after each): what ptxas does, function-wide, when it cannot keep
    the wgmma pipeline's registers apart."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        try:
            sass = subprocess.run([CUOBJDUMP, "-sass", path], capture_output=True,
                                  text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError) as exc:
            return f"no SASS ({exc})"
    return (f"{sass.count('HGMMA.')} wgmma, "
            f"{sass.count('WARPGROUP.DEPBAR.LE gsb0, 0x0')} waits for none in flight")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", default="")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--match", default="", help="only the configs whose name matches this regex")
    args = ap.parse_args()
    configs = {n: c for n, c in CONFIGS.items() if re.search(args.match, n)}
    fams = {"new": GroupedGemm()}
    if args.old:
        spec = importlib.util.spec_from_file_location("old_grouped_gemm", args.old)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        fams["old"] = mod.GroupedGemm()
    problems = make_problems(fams["new"])
    fns, dense = {}, {}
    for prob, inputs in problems.items():
        ref = fams["new"].reference(inputs, SHAPE)
        for which, fam in fams.items():
            for name, cfg in configs.items():
                key = (prob, f"{which}: {name}")
                try:
                    launches, _ = fam._launches(inputs, cfg)
                    k = launches[-1].warmup()
                    getattr(k, "_init_handles", lambda: None)()
                    if prob == "log-normal":
                        print(f"{key[1]}: regs {k.n_regs} spills {k.n_spills} "
                              f"shared {k.metadata.shared}, {serialized(k)}", flush=True)
                    fn = fam.launcher(inputs, SHAPE, cfg)
                    torch.testing.assert_close(fn().float(), ref, atol=2e-2, rtol=2e-2)
                    fns[key] = fn
                except Exception:
                    print(f"FAILED {key}:\n{traceback.format_exc()[-3000:]}", flush=True)
        dense[prob] = _dense_baseline(inputs, SHAPE)
        del ref
    times, ratios, _ = paired_rounds(fns, dense, args.rounds, args.rep)
    print_pairs(times, ratios, args.rounds, args.rep)


if __name__ == "__main__":
    main()
