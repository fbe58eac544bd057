"""The derived figures of the session-7 notes, recomputed from the committed raw results
(no GPU needed): clock logs, the gzipped Optuna stores of the grids, the routing.

    python benchmarks/device/analyse_session7.py \
        > benchmarks/results/H200/2026-11-23-session7-analysis.txt
"""

from __future__ import annotations

import csv
import gzip
import json
import math
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import optuna

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from kernels.grouped_gemm import GroupedGemm  # noqa: E402

RES = ROOT / "benchmarks" / "results" / "H200"
optuna.logging.set_verbosity(optuna.logging.WARNING)


def clocks(call: str) -> None:
    rows = list(csv.reader(open(RES / f"2026-11-23-session7-{call}" / "logs" / "gpu_clocks.csv")))
    samples = [(int(r[1].split()[0]), float(r[3].split()[0]), int(r[5], 16))
               for r in rows[1:] if len(r) > 5 and r[1].strip()[0].isdigit()]
    capped = [s for s in samples if s[2] & 0x4]  # clocks_event_reasons: SW power cap
    busy = [s for s in samples if s[1] > 300]
    print(f"{call} clock log: {len(samples)} samples, {len(capped)} with SW power cap "
          f"(SM {min(s[0] for s in capped)}-{max(s[0] for s in capped)} MHz, median "
          f"{statistics.median(s[0] for s in capped):.0f}); "
          f"max power {max(s[1] for s in samples):.0f} W; busy (>300 W) SM MHz "
          f"{min(s[0] for s in busy)}-{max(s[0] for s in busy)}, median "
          f"{statistics.median(s[0] for s in busy):.0f}")


def studies(store: Path) -> list[optuna.Study]:
    with tempfile.NamedTemporaryFile(suffix=".db", delete=False) as tmp:
        with gzip.open(store) as src:
            shutil.copyfileobj(src, tmp)
    url = f"sqlite:///{tmp.name}"
    return [optuna.load_study(study_name=s.study_name, storage=url)
            for s in optuna.get_all_study_summaries(url)]


def complete(st: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return [t for t in st.trials if t.state == optuna.trial.TrialState.COMPLETE]


def grouped_gemm_grid() -> None:
    (st,) = studies(RES / "2026-11-23-session7-call1" / "logs" / "gg_grid.optuna.db.gz")
    best: dict[tuple, float] = {}
    for t in complete(st):
        p = t.params
        for key in (("tile", p["BLOCK_M"], p["BLOCK_N"]),
                    ("variant P/FLATTEN/TMA_STORE", p["PERSISTENT"], p["FLATTEN"],
                     p["TMA_STORE"])):
            best[key] = min(best.get(key, math.inf), t.value)
    failed = [t.params for t in st.trials if t.state == optuna.trial.TrialState.FAIL]
    both = sum(1 for p in failed if p["FLATTEN"] and p["TMA_STORE"])
    print(f"call 1 TMA grid: {len(complete(st))} measured, {len(failed)} failed "
          f"({both} of them FLATTEN+TMA_STORE); best search-time ms by group:")
    for key, v in sorted(best.items()):
        print(f"  {key}: {v:.4f}")


def paired_ratios(store: Path, knob: str, old: object, new: object) -> None:
    for st in studies(store):
        by = {tuple(sorted(t.params.items())): t.value for t in complete(st)}
        ratios = []
        for k, v in by.items():
            p = dict(k)
            if p[knob] == old:
                other = tuple(sorted({**p, knob: new}.items()))
                if other in by:
                    ratios.append(by[other] / v)
        shape = st.study_name.split("/")[2]
        print(f"  {shape} {knob} {new} over {old}: median {statistics.median(ratios):.3f}, "
              f"range {min(ratios):.2f}-{max(ratios):.2f} ({len(ratios)} pairs)")


def minigpt_grids() -> None:
    store = RES / "2026-11-23-session7-call4" / "logs" / "mg_minigpt_flash_grid.optuna.db.gz"
    print("call 4 flash grid, configs that differ in one tunable only:")
    paired_ratios(store, "FUSE_RESIDUAL", 1, 2)
    paired_ratios(store, "FLASH_SPLIT_D", 0, 1)
    summary = json.load(open(RES / "2026-11-23-session7-call4" / "logs"
                             / "mg_minigpt_flash_grid.json"))
    for st, row in zip(studies(store), summary["rows"], strict=False):
        first = min(complete(st), key=lambda t: t.value)
        same = "the same config" if first.params == row["params"] else "another config"
        print(f"  {row['shape']}: fastest search measurement {first.value:.4f} ms (trial "
              f"{first.number}); the winner ({same}) re-measured {row['remeasured_ms']:.4f} ms")
    store = RES / "2026-11-23-session7-call6" / "logs" / "mg_minigpt_attn_grid.optuna.db.gz"
    print("call 6 attention grid, search-time ms (min, median) by ATTN:")
    for st in studies(store):
        by: dict[str, list[float]] = {}
        for t in complete(st):
            by.setdefault(t.params["ATTN"], []).append(t.value)
        print(f"  {st.study_name.split('/')[2]}: " + ", ".join(
            f"{a} {min(v):.4f} / {statistics.median(v):.4f} (n={len(v)})" for a, v in by.items()))


def padding() -> None:
    fam = GroupedGemm()
    shape = fam.shapes["deepseek-v3-16b"]
    counts = fam.routing_counts(shape, 0)
    for bm in (64, 128):
        rows = sum(math.ceil(c / bm) * bm for c in counts)
        print(f"routing of seed 0: {sum(c == 0 for c in counts)} empty experts; BLOCK_M {bm}: "
              f"{(rows / shape['M'] - 1) * 100:.1f} % of the MMA rows are padding")


if __name__ == "__main__":
    for call in ("call2", "call4"):
        clocks(call)
    grouped_gemm_grid()
    minigpt_grids()
    padding()
