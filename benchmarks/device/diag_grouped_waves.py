"""Does the grouped GEMM lose time to a partly filled last wave, and does ending the grid
on small tiles (TAIL_WINDOW) win it back?

Study ``waves``: routings with every expert a multiple of 256 rows (no tails), so that a
256x128 tile grid holds exactly 15, 15.25, 15.5, 15.75 or 16 waves of 132 tiles; the
kernel's TFLOP/s at each, beside dense cuBLAS at the same M. A last wave that is only
partly filled costs the kernel up to a tile's time where it is a quarter or half full.

Study ``window2``: window 0, 4 and 8 only, window 0 twice (the noise floor), tailed
routings only.

Study ``window``: TAIL_WINDOW 0 / 4 / 8 / 16 / 64 (the last experts' blocks by height,
the small tail tiles last) on the log-normal, uniform and balanced routings, each variant
timed right beside dense cuBLAS (``diag_grouped_steady``'s pairing).

    python3 benchmarks/device/diag_grouped_waves.py [--study waves,window] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics

from benchmarks.device.diag_grouped_steady import (
    S2,
    SHAPE,
    make_problems,
    paired_rounds,
    print_pairs,
    uniform_counts,
    verify,
)
from kernels.grouped_gemm import GroupedGemm, _dense_baseline, make_grouped_inputs

WS = {**S2, "WARP_SPEC": 1}
WIDE = {**WS, "BLOCK_M": 128, "BLOCK_N": 256, "TAIL_SPLIT": 1}


def wave_counts(blocks: int, E: int) -> list[int]:
    """``blocks`` 256-row blocks over E experts, as evenly as they go."""
    return [256 * (blocks // E + (e < blocks % E)) for e in range(E)]


def pairs(fam: GroupedGemm, problems: dict[str, tuple[dict, dict]], configs: dict[str, dict],
          rounds: int, rep: int) -> tuple[dict, dict, dict]:
    """Every config checked on every problem (name -> (inputs, shape)), then timed beside
    dense cuBLAS (``paired_rounds``); the table printed, failures as notes."""
    fns: dict = {}
    dense: dict = {}
    notes: dict = {}
    for prob, (inputs, shape) in problems.items():
        ref = fam.reference(inputs, shape)
        verify({name: (lambda c=cfg, i=inputs, s=shape: fam.launcher(i, s, c))
                for name, cfg in configs.items()}, ref, prob, fns, notes)
        dense[prob] = _dense_baseline(inputs, shape)
        del ref
    times, ratios, dense_ms = paired_rounds(fns, dense, rounds, rep)
    print_pairs(times, ratios, rounds, rep)
    for k, v in notes.items():
        print("note:", k, v)
    return times, ratios, dense_ms


def waves(fam: GroupedGemm, rounds: int, rep: int) -> None:
    N, K, E = (SHAPE[d] for d in ("N", "K", "E"))
    problems = {}
    for blocks in (180, 183, 186, 189, 192):
        counts = wave_counts(blocks, E)
        shape = {**SHAPE, "M": sum(counts)}
        problems[f"{blocks * 11 / 132:.2f} waves (M={shape['M']})"] = (
            make_grouped_inputs(counts, N, K, "bf16", seed=blocks, device="cuda"), shape)
    times, _, dense_ms = pairs(fam, problems, {"256x128 s4 split2 table": S2,
                                               "256x128 s4 split2 table WS": WS},
                               rounds, rep)
    print("\n| problem | variant | TFLOP/s | dense TFLOP/s |\n|---|---|---|---|")
    for (prob, name), xs in times.items():
        flops = fam.flops(problems[prob][1])
        print(f"| {prob} | {name} | {flops / statistics.median(xs) / 1e9:.0f} | "
              f"{flops / statistics.median(dense_ms[prob]) / 1e9:.0f} |")


def window(fam: GroupedGemm, rounds: int, rep: int, focused: bool = False) -> None:
    M, N, K, E = (SHAPE[d] for d in ("M", "N", "K", "E"))
    problems = make_problems(fam)
    problems["uniform seed 3"] = make_grouped_inputs(uniform_counts(M, E, 3), N, K, "bf16",
                                                     seed=3, device="cuda")
    if focused:
        # The window against itself off, twice: the two window-0 rows' difference is the
        # run's noise floor for the same kernel.
        configs = {"256x128 s4 split2 table window 0": dict(S2),
                   "256x128 s4 split2 table window 8": {**S2, "TAIL_WINDOW": 8},
                   "256x128 s4 split2 table window 0 (again)": dict(S2),
                   "256x128 s4 split2 table window 4": {**S2, "TAIL_WINDOW": 4},
                   "256x128 s4 split2 table WS window 0": dict(WS),
                   "256x128 s4 split2 table WS window 8": {**WS, "TAIL_WINDOW": 8}}
        del problems["balanced"]
    else:
        configs = {f"256x128 s4 split2 table window {w}": {**S2, "TAIL_WINDOW": w}
                   for w in (0, 4, 8, 16, 64)}
        configs |= {f"256x128 s4 split2 table WS window {w}": {**WS, "TAIL_WINDOW": w}
                    for w in (0, 8, 16)}
        configs |= {f"128x256 s4 split1 table WS window {w}": {**WIDE, "TAIL_WINDOW": w}
                    for w in (0, 8)}
    pairs(fam, {p: (i, SHAPE) for p, i in problems.items()}, configs, rounds, rep)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--study", default="waves,window")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rep", type=int, default=100)
    args = ap.parse_args()
    fam = GroupedGemm()
    studies = {"waves": waves, "window": window,
               "window2": lambda f, r, p: window(f, r, p, focused=True)}
    for name in args.study.split(","):
        print(f"\n## {name}\n", flush=True)
        studies[name](fam, args.rounds, args.rep)


if __name__ == "__main__":
    main()
