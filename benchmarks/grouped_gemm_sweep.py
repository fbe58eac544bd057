"""Grouped GEMM across token counts: our kernel vs torch's grouped GEMM, a dense cuBLAS
GEMM of the same FLOPs, and the PyTorch per-expert loop, side by side on one GPU.

M (routed rows) runs from a decode-sized M = 128 up to 64K tokens x top-6; N, K, E stay
at the DeepSeek-V2-Lite expert shape. Our kernel runs the pack's config, and where the pack
has no exact entry for the shape, also a small hand-picked list (TMA, small BLOCK_M for few
rows), keeping the fastest. Writes ``grouped_gemm_sweep.json`` and ``.md`` to ``--out``.

    python benchmarks/grouped_gemm_sweep.py --out benchmarks/results/H200
    python benchmarks/grouped_gemm_sweep.py --smoke --out /tmp/sweep   # CPU, tiny, interpreter
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

if not torch.cuda.is_available():  # Triton only runs interpreted on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import packs  # noqa: E402
from harness.measure.timing import Measurer, Timing, TrialResult, hardware  # noqa: E402
from kernels.grouped_gemm import GroupedGemm  # noqa: E402

TOP_K = 6
# 128 is a decode-sized case taken as M itself; the rest are token counts routed to top-6.
M_VALUES = [128] + [t * TOP_K for t in (512, 2048, 8192, 32768, 65536)]
BASE = {"N": 1408, "K": 2048, "E": 64}

# Hand-picked for shapes without a pack entry: large and mid tiles with and without TMA,
# BLOCK_M 16/32 for a few rows per expert, and the Gluon kernel (pruned off Hopper).
MINI: list[dict[str, Any]] = [
    {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 32, "GROUP_M": 1, "num_warps": 8,
     "num_stages": 4, "PERSISTENT": 1, "USE_TMA": 0},
    {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 32, "GROUP_M": 1, "num_warps": 8,
     "num_stages": 4, "PERSISTENT": 1, "USE_TMA": 1},
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4,
     "num_stages": 4, "PERSISTENT": 1, "USE_TMA": 1},
    {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8,
     "num_stages": 3, "PERSISTENT": 0, "USE_TMA": 1},
    {"BLOCK_M": 64, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 4, "num_warps": 8,
     "num_stages": 3, "PERSISTENT": 1, "USE_TMA": 1},
    {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4,
     "num_stages": 4, "PERSISTENT": 0, "USE_TMA": 0},
    {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4,
     "num_stages": 4, "PERSISTENT": 1, "USE_TMA": 1},
    {"BLOCK_M": 32, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4,
     "num_stages": 4, "PERSISTENT": 0, "USE_TMA": 0},
    {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4,
     "num_stages": 4, "PERSISTENT": 0, "USE_TMA": 1},
    {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4,
     "num_stages": 4, "PERSISTENT": 0, "USE_TMA": 0},
    {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4,
     "num_stages": 5, "PERSISTENT": 0, "USE_TMA": 1},
    {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4,
     "num_stages": 4, "PERSISTENT": 1, "USE_TMA": 1},
    # Split expert tails, and the TMA store of full tiles.
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 4,
     "num_stages": 4, "PERSISTENT": 0, "USE_TMA": 1, "TAIL_SPLIT": 1},
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4,
     "num_stages": 4, "PERSISTENT": 1, "USE_TMA": 1, "TMA_STORE": 1},
    # The Gluon kernel (Hopper): ping-pong, transposed, tall tiles, dealt tails.
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 4,
     "num_stages": 4, "PERSISTENT": 1, "USE_TMA": 1, "GLUON": 3, "SWAP_AB": 1,
     "TAIL_SPLIT": 1, "TALL_TILE": 1, "TAIL_DEAL": 1, "TMA_STORE": 1},
]  # fmt: skip

DENSE = "bound: dense cuBLAS GEMM of the same FLOPs (not the same result)"


def _row(name: str, res: TrialResult, config: dict | None = None) -> dict[str, Any]:
    return {"variant": name, "ok": res.ok, "reason": res.reason,
            "median_ms": res.latency_ms, "p20_ms": res.p20_ms, "p80_ms": res.p80_ms,
            "tflops": res.tflops, "max_abs_err": res.max_abs_err,
            "accuracy": res.extra.get("accuracy", ""), "config": config}  # fmt: skip


def sweep_shape(fam: GroupedGemm, meas: Measurer, shape: dict[str, int], spec: Any,
                seed: int, deadline: float) -> dict[str, Any]:
    """Every variant at one shape; our rows keep the fastest config found."""
    hit = packs.lookup_entry(fam, "bf16", spec.key, **shape)
    cands = [dict(hit.config)]
    if hit.source != "exact":
        cands += [c for c in MINI if c not in cands]
    ours: list[tuple[dict, TrialResult]] = []
    for i, cfg in enumerate(cands):
        if i > 0 and time.monotonic() > deadline:  # the pack's config always runs
            break
        if fam.check_config(cfg, shape, spec) is not None:
            continue
        ours.append((cfg, meas.measure(fam, shape, "bf16", cfg, seed)))
    rows = [_row(f"ours: pack ({hit.source})", ours[0][1], ours[0][0])] if ours else []
    good = [(c, r) for c, r in ours if r.ok]
    if len(ours) > 1 and good:
        best_c, best_r = min(good, key=lambda cr: cr[1].latency_ms)
        rows.append(_row(f"ours: best of {len(ours)}", best_r, best_c))
        tma = [(c, r) for c, r in good if int(c.get("USE_TMA", 0))]
        if tma:
            tc, tr = min(tma, key=lambda cr: cr[1].latency_ms)
            rows.append(_row("ours: best TMA", tr, tc))
    for name, make in fam.baselines().items():
        rows.append(_row(name, meas.measure_fn(fam, shape, "bf16", seed, make)))
    rows.append(_row("PyTorch loop", meas.measure_eager(fam, shape, "bf16", seed)))
    # The winner among implementations that give this result (dense is a yardstick).
    real = [r for r in rows if r["ok"] and r["variant"] != DENSE
            and r["accuracy"] in ("", "within tolerance")]
    winner = min(real, key=lambda r: r["median_ms"])["variant"] if real else None
    return {"shape": shape, "pack_source": hit.source, "winner": winner, "rows": rows}


def _ms(r: dict | None) -> str:
    if r is None:
        return "-"
    if not r["ok"]:
        return "fail"
    return f"{r['median_ms']:.4g}"


def to_markdown(report: dict[str, Any]) -> str:
    results = report["results"]
    names: list[str] = []
    for res in results:
        for r in res["rows"]:
            if r["variant"].startswith("ours: pack"):
                key = "ours: pack"
            elif r["variant"].startswith("ours: best of"):
                key = "ours: best"
            else:
                key = r["variant"]
            r["_col"] = key
            if key not in names:
                names.append(key)
    lines = [
        f"# grouped_gemm sweep over M ({report['device']})",
        "",
        f"- N={BASE['N']}, K={BASE['K']}, E={BASE['E']}, bf16; M = tokens x top-{TOP_K} "
        "(M=128 is taken as M itself); median ms, timed by harness.measure.timing "
        f"(warmup {report['timing']['warmup_ms']} ms, rep {report['timing']['rep_ms']} ms).",
        f"- `{DENSE}`: one [M,K]x[K,N] GEMM, a speed yardstick; never a winner.",
        "",
        "| M | tokens | " + " | ".join(names) + " | wins | our best config |",
        "|---" * (len(names) + 4) + "|",
    ]
    for res in results:
        by = {r["_col"]: r for r in res["rows"]}
        m = res["shape"]["M"]
        tokens = str(m // TOP_K) if m % TOP_K == 0 and m != 128 else "-"
        best = by.get("ours: best") or by.get("ours: pack")
        cfg = json.dumps(best["config"], sort_keys=True) if best else ""
        cells = " | ".join(_ms(by.get(n)) for n in names)
        lines.append(f"| {m} | {tokens} | {cells} | {res['winner']} | `{cfg}` |")
    failed = [(res["shape"]["M"], r) for res in results for r in res["rows"] if not r["ok"]]
    if failed:
        lines += ["", "Failures:", ""]
        lines += [f"- M={m} {r['variant']}: {r['reason']}" for m, r in failed]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory for the JSON and markdown")
    ap.add_argument("--m", type=int, nargs="*",
                    help="M values (default: 128, then 512 to 65,536 tokens x top-6)")
    ap.add_argument("--budget-s", type=float, default=120.0,
                    help="after this, shapes run only the pack's config")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true",
                    help="tiny N/K/E and M, for a CPU check of the script itself")
    args = ap.parse_args(argv)

    global BASE, MINI
    m_values = args.m or M_VALUES
    if args.smoke:
        BASE = {"N": 64, "K": 64, "E": 4}
        m_values = args.m or [48, 96]
        MINI = [{"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2,
                 "PERSISTENT": p, "USE_TMA": t} for p in (0, 1) for t in (0, 1)]
    timing = Timing(warmup_ms=10, rep_ms=40, cpu_reps=1)
    meas = Measurer(timing)
    spec = hardware.current_device()
    fam = GroupedGemm()
    deadline = time.monotonic() + args.budget_s
    t0 = time.perf_counter()
    results = []
    for m in m_values:
        shape = {"M": int(m), **BASE}
        res = sweep_shape(fam, meas, shape, spec, args.seed, deadline)
        results.append(res)
        print(f"M={m}: winner {res['winner']} ({time.perf_counter() - t0:.0f} s)", flush=True)
        if meas.device == "cuda":
            torch.cuda.empty_cache()
    report = {
        "device": spec.key, "timing": {"warmup_ms": timing.warmup_ms, "rep_ms": timing.rep_ms},
        "torch": torch.__version__, "elapsed_s": time.perf_counter() - t0, "results": results,
    }  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for res in results:
        for r in res["rows"]:
            for k in ("median_ms", "p20_ms", "p80_ms", "tflops", "max_abs_err"):
                if isinstance(r[k], float) and not math.isfinite(r[k]):
                    r[k] = None
    (out / "grouped_gemm_sweep.md").write_text(to_markdown(report))
    for res in results:
        for r in res["rows"]:
            r.pop("_col", None)
    (out / "grouped_gemm_sweep.json").write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {out}/grouped_gemm_sweep.{{json,md}} in {report['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
