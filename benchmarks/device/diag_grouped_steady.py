"""Grouped GEMM vs dense cuBLAS, each variant timed right beside the dense GEMM.

The H200 runs these GEMMs at its 700 W cap (clocks 1.4-1.8 GHz move with the power
draw), so a ratio means something only between timings taken in the same moments. Every
variant's output is checked once up front; then, in each round, every variant is timed
(do_bench median, L2 flushed) immediately followed by the dense cuBLAS GEMM of the same
FLOPs, and the variant's figure is the median over rounds of those adjacent-pair ratios.
Problems: the harness's log-normal routing, a balanced one (768 rows per expert: no
expert has a partial last block) and a uniform random one (768 +- 28 rows), E=64,
K=2048, N=1408, M=49,152, bf16.

    python3 benchmarks/device/diag_grouped_steady.py [--rounds 7] [--rep 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable

import torch
import triton

from benchmarks.device.diag_grouped_map import closed_form
from kernels.grouped_gemm import (
    GroupedGemm,
    _dense_baseline,
    _grouped_mm_baseline,
    make_grouped_inputs,
)

SHAPE = GroupedGemm.shapes["deepseek-v3-16b"]
T = {"USE_TMA": 1, "PERSISTENT": 0, "FLATTEN": 0, "TMA_STORE": 0, "GROUP_M": 1,
     "BLOCK_K": 64, "num_stages": 3}
H = {**T, "BLOCK_M": 256, "BLOCK_N": 128, "num_warps": 8}
S2 = {**H, "num_stages": 4, "TAIL_SPLIT": 2, "BLOCK_TABLE": 1}
P2 = {**S2, "PERSISTENT": 1, "WARP_SPEC": 1}
CONFIGS = {
    "256x128 s4 split2 table WS": {**S2, "WARP_SPEC": 1},
    "256x128 s4 split2 table": dict(S2),
    "256x128 s4 split2 table window 8": {**S2, "TAIL_WINDOW": 8},
    "256x128 s4 split2 table WS window 8": {**S2, "WARP_SPEC": 1, "TAIL_WINDOW": 8},
    "persistent 256x128 s4 split2 table WS": dict(P2),
    "persistent 256x128 s3 split2 table WS": {**P2, "num_stages": 3},
    "persistent 256x128 s4 table WS": {**P2, "TAIL_SPLIT": 0},
    "persistent 256x128 s4 split2 table": {**P2, "WARP_SPEC": 0},
    "persistent 256x128 s4 split2 table WS G8": {**P2, "GROUP_M": 8},
    "persistent 128x256 s4 split1 table WS": {**P2, "BLOCK_M": 128, "BLOCK_N": 256,
                                              "TAIL_SPLIT": 1},
}


def uniform_counts(M: int, E: int, seed: int) -> list[int]:
    """Every row routed to an expert drawn uniformly: ~M/E rows each, +- sqrt(M/E)."""
    g = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, E, (M,), generator=g)
    return torch.bincount(picks, minlength=E).tolist()


def make_problems(fam: GroupedGemm) -> dict[str, dict]:
    """The three routings' inputs on the GPU: log-normal (the harness's), balanced,
    uniform."""
    M, N, K, E = (SHAPE[d] for d in ("M", "N", "K", "E"))
    return {
        "log-normal": fam.make_inputs(SHAPE, "bf16", seed=0, device="cuda"),
        "balanced": make_grouped_inputs([M // E] * E, N, K, "bf16", seed=1, device="cuda"),
        "uniform": make_grouped_inputs(uniform_counts(M, E, 2), N, K, "bf16", seed=2,
                                       device="cuda"),
    }


def equal_rows(rows: tuple[int, ...]) -> dict[str, tuple[dict, dict]]:
    """Problems with every expert the same r rows (M = E r), for each r: name -> (inputs
    on the GPU, shape)."""
    N, K, E = SHAPE["N"], SHAPE["K"], SHAPE["E"]
    return {f"{r} rows x {E}": (make_grouped_inputs([r] * E, N, K, "bf16", seed=r,
                                                    device="cuda"), {**SHAPE, "M": r * E})
            for r in rows}


def timing_args(rounds: int = 5, rep: int = 100,
                study: str | None = None) -> argparse.ArgumentParser:
    """The diagnostics' common options: --rounds, --rep (do_bench ms), --json (raw
    output), and --study where a script has several."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--rep", type=int, default=rep)
    ap.add_argument("--json", default="")
    if study is not None:
        ap.add_argument("--study", default=study)
    return ap


def paired_rounds(
    fns: dict[tuple[str, str], Callable[[], object]],
    dense: dict[str, Callable[[], object]],
    rounds: int,
    rep: int,
) -> tuple[dict, dict, dict]:
    """Each (problem, variant) timed, then its problem's dense GEMM right after, for
    ``rounds`` rounds: the variant's times, its dense / variant ratios, and every dense
    time per problem."""
    times: dict[tuple[str, str], list[float]] = {k: [] for k in fns}
    ratios: dict[tuple[str, str], list[float]] = {k: [] for k in fns}
    dense_ms: dict[str, list[float]] = {p: [] for p in dense}
    for r in range(rounds):
        for (prob, name), fn in fns.items():
            t = triton.testing.do_bench(fn, warmup=25, rep=rep)
            d = triton.testing.do_bench(dense[prob], warmup=25, rep=rep)
            times[(prob, name)].append(t)
            ratios[(prob, name)].append(d / t)
            dense_ms[prob].append(d)
        print(f"round {r} done", flush=True)
    return times, ratios, dense_ms


def verify(cands: dict[str, Callable[[], Callable[[], object]]], ref: torch.Tensor, prob: str,
           fns: dict, notes: dict[str, str]) -> None:
    """Build each candidate and check its output against ``ref``: the ones that pass go
    to ``fns[(prob, name)]``, a failure to ``notes`` (reported, not fatal)."""
    for name, make in cands.items():
        try:
            fn = make()
            torch.testing.assert_close(fn().float(), ref, atol=2e-2, rtol=2e-2)
            fns[(prob, name)] = fn
        except Exception as exc:  # a config that fails is reported, not fatal
            notes[f"{prob} {name}"] = f"{type(exc).__name__}: {str(exc)[:300]}"


def dump_pairs(path: str, times: dict, ratios: dict, dense_ms: dict, notes: dict,
               **extra: object) -> None:
    """``paired_rounds``' raw results (and ``extra``) as JSON, keys "routing | variant"."""
    with open(path, "w") as f:
        json.dump({"times": {f"{p} | {n}": v for (p, n), v in times.items()},
                   "ratios": {f"{p} | {n}": v for (p, n), v in ratios.items()},
                   "dense": dense_ms, "notes": notes, **extra,
                   "device": torch.cuda.get_device_name()}, f, indent=1)


def print_pairs(times: dict, ratios: dict, rounds: int, rep: int) -> None:
    """``paired_rounds``' results as a markdown table: median time and median ratio."""
    print(f"\n{torch.cuda.get_device_name()}, {rounds} rounds, rep {rep} ms\n")
    print("| routing | variant | median ms | dense / variant |\n|---|---|---|---|")
    for (prob, name), xs in times.items():
        print(f"| {prob} | {name} | {statistics.median(xs):.4f} | "
              f"{statistics.median(ratios[(prob, name)]):.1%} |")


def time_and_report(fns: dict, dense: dict, notes: dict[str, str], rounds: int, rep: int,
                    json_path: str = "", **extra: object) -> tuple[dict, dict, dict]:
    """``paired_rounds`` of the checked variants, printed as a table with the failures'
    notes, and written as JSON to ``json_path`` (with ``extra``) when it is given."""
    times, ratios, dense_ms = paired_rounds(fns, dense, rounds, rep)
    print_pairs(times, ratios, rounds, rep)
    for k, v in notes.items():
        print("note:", k, v)
    if json_path:
        dump_pairs(json_path, times, ratios, dense_ms, notes, **extra)
    return times, ratios, dense_ms


def main() -> None:
    args = timing_args(rounds=7, rep=200).parse_args()
    fam = GroupedGemm()
    M, N, K, E = (SHAPE[d] for d in ("M", "N", "K", "E"))
    # The pack this checkout ships for this GPU, beside the fixed variants.
    from harness import packs
    hit = packs.lookup_entry("grouped_gemm", "bf16", **SHAPE)
    CONFIGS[f"this GPU's pack ({hit.source})"] = dict(hit.config)
    problems = make_problems(fam)
    fns: dict[tuple[str, str], object] = {}
    dense: dict[str, object] = {}
    notes: dict[str, str] = {}
    for prob, inputs in problems.items():
        ref = fam.reference(inputs, SHAPE)
        cands = {name: (lambda c=cfg, i=inputs: fam.launcher(i, SHAPE, c))
                 for name, cfg in CONFIGS.items()}
        cands["torch._grouped_mm"] = lambda i=inputs: _grouped_mm_baseline(i, SHAPE)
        if prob == "balanced":
            cands["closed-form lookup 256x128 w8 s4 (diagnostic)"] = (
                lambda i=inputs: closed_form(i, E, (256, 128, 64, 8, 4)))
        verify(cands, ref, prob, fns, notes)
        dense[prob] = _dense_baseline(inputs, SHAPE)
        del ref
    times, ratios, dense_ms = paired_rounds(fns, dense, args.rounds, args.rep)
    flops = 2.0 * M * N * K
    print(f"\n{torch.cuda.get_device_name()}, M={M} N={N} K={K} E={E} bf16, "
          f"{args.rounds} rounds, do_bench rep {args.rep} ms\n")
    print("| routing | variant | median ms | dense / variant (median of adjacent pairs) | "
          "TFLOP/s |\n|---|---|---|---|---|")
    for (prob, name), xs in times.items():
        med = statistics.median(xs)
        print(f"| {prob} | {name} | {med:.4f} | {statistics.median(ratios[(prob, name)]):.1%} "
              f"| {flops / med / 1e9:.0f} |")
    for prob, xs in dense_ms.items():
        print(f"| {prob} | dense cuBLAS (all pairs) | {statistics.median(xs):.4f} | 100% | "
              f"{flops / statistics.median(xs) / 1e9:.0f} |")
    for k, v in notes.items():
        print("note:", k, v)
    if args.json:
        dump_pairs(args.json, times, ratios, dense_ms, notes, configs=CONFIGS)


if __name__ == "__main__":
    main()
