"""Does the grouped GEMM's full tile get faster when each tile shape is its own function
call instead of inlined beside the tail tiles?

Session 13 measured that the tail branches, taken by no tile on the balanced routing,
cost the full tile 2-3 points of dense cuBLAS (their code shares one register allocation
and schedule with it). Here the kernel module is loaded a second time with the tile
functions (``_gemm_tile_tma``, ``_gemm_tile``) marked ``noinline``, so ptxas compiles each
tile shape as a callee of its own; both builds of the same configs run in one process,
each timed right before dense cuBLAS (``diag_grouped_steady``'s pairing, median of the
adjacent-pair ratios), outputs checked against the fp32 reference first.

    python3 benchmarks/device/diag_grouped_noinline.py [--rounds 7] [--rep 200]
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys
import tempfile

from benchmarks.device.diag_grouped_steady import (
    S2,
    SHAPE,
    make_problems,
    paired_rounds,
    print_pairs,
    verify,
)
from harness import packs
from kernels import grouped_gemm
from kernels.grouped_gemm import _dense_baseline

TILE_FUNCS = ("_gemm_tile_tma", "_gemm_tile")


def noinline_module():
    """kernels/grouped_gemm.py loaded again under another name, its tile functions
    ``noinline`` (Triton reads the source from a file, so the copy is written to one)."""
    src = pathlib.Path(grouped_gemm.__file__).read_text()
    for fn in TILE_FUNCS:
        head = f"@triton.jit\ndef {fn}(\n"
        if head not in src:
            raise SystemExit(f"{fn}'s decorator not found")
        src = src.replace(head, f"@triton.jit(noinline=True)\ndef {fn}(\n")
    path = pathlib.Path(tempfile.mkdtemp()) / "grouped_gemm_noinline.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("grouped_gemm_noinline", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--rep", type=int, default=200)
    args = ap.parse_args()
    fams = {"inline": grouped_gemm.GroupedGemm(), "noinline": noinline_module().GroupedGemm()}
    configs = {
        "pack": dict(packs.lookup_entry("grouped_gemm", "bf16", **SHAPE).config),
        "256x128 s4 split2 table": dict(S2),
        "256x128 s4 table, no tails": {**S2, "TAIL_SPLIT": 0},
    }
    problems = make_problems(fams["inline"])
    fns: dict = {}
    dense: dict = {}
    notes: dict = {}
    for prob, inputs in problems.items():
        ref = fams["inline"].reference(inputs, SHAPE)
        cands = {f"{cname} {build}": (lambda f=fam, c=cfg, i=inputs: f.launcher(i, SHAPE, c))
                 for build, fam in fams.items() for cname, cfg in configs.items()}
        verify(cands, ref, prob, fns, notes)
        dense[prob] = _dense_baseline(inputs, SHAPE)
        del ref
    times, ratios, _ = paired_rounds(fns, dense, args.rounds, args.rep)
    print_pairs(times, ratios, args.rounds, args.rep)
    print("\nconfigs:", configs)
    for k, v in notes.items():
        print("note:", k, v)


if __name__ == "__main__":
    main()
