#!/usr/bin/env python3
"""Grouped GEMM configs timed beside a dense cuBLAS GEMM of the same FLOPs, on three routings.

The study program behind docs/kernels/grouped_gemm.md. A Hopper GPU runs these GEMMs at its
power cap, where the SM clock moves with the power draw, so a ratio means something only
between timings taken in the same moments: in each round every variant is timed (do_bench
median, L2 flushed) and immediately followed by the dense GEMM, and a variant's figure is
the median over rounds of those adjacent-pair ratios (dense / variant; 90 % = the grouped
GEMM takes 1/0.9 of the dense GEMM's time). Every variant's output is checked against the
reference first; one that fails is reported and left out.

Routings at the MoE shape (M = 49,152, N = 1,408, K = 2,048, E = 64, bf16):
``log-normal`` (the harness's own: expert popularity log-normal, most experts end on a
partial block), ``balanced`` (768 rows per expert: no partial block, a batched GEMM) and
``uniform`` (every row to an expert drawn uniformly: 768 +- 28 rows).

    python benchmarks/grouped_gemm_vs_dense.py --out study.json                # the pack's config
    python benchmarks/grouped_gemm_vs_dense.py --rounds 7 --out study.json \
        --configs benchmarks/results/H200/2026-11-25-grouped-gemm-tall-tiles/paired_with_dense.json

``--configs`` is a JSON object ``{"name": {config}, ...}``, or a file this program wrote
(its ``configs``: a committed study runs again as it ran); each config is laid over the
kernel's default config. The pack's entry for this GPU is always included, and
``torch._grouped_mm`` where this torch has it. Needs an NVIDIA GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from harness import packs  # noqa: E402
from kernels.grouped_gemm import GroupedGemm, make_grouped_inputs  # noqa: E402

SHAPE = GroupedGemm.shapes["deepseek-v3-16b"]
DENSE = "bound: dense cuBLAS GEMM of the same FLOPs (not the same result)"


def uniform_counts(M: int, E: int, seed: int) -> list[int]:
    """Every row routed to an expert drawn uniformly: about M/E rows each."""
    g = torch.Generator().manual_seed(seed)
    return torch.bincount(torch.randint(0, E, (M,), generator=g), minlength=E).tolist()


def routings(fam: GroupedGemm, device: str) -> dict[str, dict]:
    """The three routings' inputs, on ``device``."""
    M, N, K, E = (SHAPE[d] for d in ("M", "N", "K", "E"))
    return {
        "log-normal": fam.make_inputs(SHAPE, "bf16", seed=0, device=device),
        "balanced": make_grouped_inputs([M // E] * E, N, K, "bf16", seed=1, device=device),
        "uniform": make_grouped_inputs(uniform_counts(M, E, 2), N, K, "bf16", seed=2,
                                       device=device),
    }


def variants(fam: GroupedGemm, configs: dict[str, dict], inputs: dict,
             notes: dict[str, str], routing: str) -> dict[str, Callable[[], object]]:
    """Each config's launcher (and torch's grouped GEMM), kept only if its output matches
    the reference; a failure goes to ``notes``."""
    ref = fam.reference(inputs, SHAPE)
    makers = {name: (lambda c=cfg: fam.launcher(inputs, SHAPE, {**fam.default_config, **c}))
              for name, cfg in configs.items()}
    for name, make in fam.baselines().items():
        if name != DENSE:
            makers[name] = lambda m=make: m(inputs, SHAPE)
    out = {}
    for name, make in makers.items():
        try:
            fn = make()
            torch.testing.assert_close(fn().float(), ref, atol=2e-2, rtol=2e-2)
            out[name] = fn
        except Exception as exc:  # a config that fails is reported, never fatal
            notes[f"{routing} | {name}"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return out


def paired_rounds(fns: dict[tuple[str, str], Callable[[], object]],
                  dense: dict[str, Callable[[], object]], rounds: int, rep: int
                  ) -> tuple[dict, dict, dict]:
    """Each (routing, variant) timed, then its routing's dense GEMM right after, for
    ``rounds`` rounds: times, dense / variant ratios, and the dense times."""
    times: dict = {k: [] for k in fns}
    ratios: dict = {k: [] for k in fns}
    dense_ms: dict = {r: [] for r in dense}
    for i in range(rounds):
        for (routing, name), fn in fns.items():
            t = triton.testing.do_bench(fn, warmup=25, rep=rep)
            d = triton.testing.do_bench(dense[routing], warmup=25, rep=rep)
            times[(routing, name)].append(t)
            ratios[(routing, name)].append(d / t)
            dense_ms[routing].append(d)
        print(f"round {i + 1}/{rounds} done", file=sys.stderr, flush=True)
    return times, ratios, dense_ms


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", type=Path, help="JSON object: name -> config")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--rep", type=int, default=100, help="do_bench rep budget (ms)")
    ap.add_argument("--out", type=Path, help="write the raw times and ratios as JSON")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("grouped_gemm_vs_dense.py needs an NVIDIA GPU", file=sys.stderr)
        return 2
    configs: dict[str, dict] = json.loads(args.configs.read_text()) if args.configs else {}
    configs = configs.get("configs", configs)
    hit = packs.lookup_entry("grouped_gemm", "bf16", **SHAPE)
    configs = {f"this GPU's pack ({hit.source})": dict(hit.config), **configs}
    fam = GroupedGemm()
    fns: dict = {}
    dense: dict = {}
    notes: dict[str, str] = {}
    for routing, inputs in routings(fam, "cuda").items():
        for name, fn in variants(fam, configs, inputs, notes, routing).items():
            fns[(routing, name)] = fn
        dense[routing] = fam.baselines()[DENSE](inputs, SHAPE)
    times, ratios, dense_ms = paired_rounds(fns, dense, args.rounds, args.rep)
    print(f"\n{torch.cuda.get_device_name()}, {args.rounds} rounds, rep {args.rep} ms\n")
    print("| routing | variant | median ms | dense / variant |\n|---|---|---|---|")
    for (routing, name), xs in times.items():
        print(f"| {routing} | {name} | {statistics.median(xs):.4f} | "
              f"{statistics.median(ratios[(routing, name)]):.1%} |")
    for key, why in notes.items():
        print(f"failed: {key}: {why}")
    if args.out:
        args.out.write_text(json.dumps({
            "times": {f"{r} | {n}": v for (r, n), v in times.items()},
            "ratios": {f"{r} | {n}": v for (r, n), v in ratios.items()},
            "dense": dense_ms, "notes": notes, "configs": configs,
            "device": torch.cuda.get_device_name()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
