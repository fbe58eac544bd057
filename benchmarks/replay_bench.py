"""Replay benchmark: which sampler finds the grid's winner for the least GPU time?

Every sampler of the harness (tpe, random, cmaes, gp, grid) tunes every recorded case
(``benchmarks/replay/<HW>/*.json``, exhaustive sweeps exported by ``harness.replay``)
with several seeds, offline, paying each config's recorded GPU time (see
``harness/replay.py``). Per sampler it reports the median over cases (each case's median
over seeds) of:

- the trials needed to come within 2 % of the grid optimum;
- the GPU time needed for it, in seconds and as a fraction of the whole grid's GPU time.

Two variants: ``static-pruning`` is the harness (configs that cannot run are rejected on
the driver at no GPU cost; the grid's cost is that of the pruned grid); ``no-pruning``
launches them too (each costs a typical measured config) and compares with the unpruned
grid. The saving of pruning itself is reported per case.

    python benchmarks/replay_bench.py                      # all cases, 5 seeds
    python benchmarks/replay_bench.py --samplers tpe random --seeds 2 --out /tmp/r

Writes ``report.json`` and ``report.md`` to ``--out`` (default: the data directory) and
prints the table. Goal (issue 7): within 2 % in <= 10 % of the grid's GPU time.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness import replay as rp  # noqa: E402

SAMPLERS = ("tpe", "random", "cmaes", "gp", "grid")
VARIANTS = {"static-pruning": True, "no-pruning": False}
GOAL_FRACTION = 0.10


def _one(path: str, sampler: str, seed: int, prune: bool, in_flight: int, tol: float,
         warm_start: bool) -> dict[str, Any]:
    table = rp.Table.load(path)
    t0 = time.perf_counter()
    trace = rp.replay(table, sampler, seed, prune=prune, in_flight=in_flight, tol=tol,
                      warm_start=warm_start)
    out = rp.metrics(trace, table, tol)
    out["wall_s"] = time.perf_counter() - t0
    return out


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else math.nan


def _val(x: Any) -> float:
    return math.inf if x is None else float(x)


def aggregate(runs: list[dict[str, Any]], cases: list[str]) -> dict[str, Any]:
    """Per case the median over seeds, then the median over cases (unreached = inf)."""
    per_case = {}
    for case in cases:
        rs = [r for r in runs if r["case"] == case]
        if not rs:
            continue
        per_case[case] = {
            "trials": _median([_val(r["trials_to_target"]) for r in rs]),
            "cost_s": _median([_val(r["cost_to_target_s"]) for r in rs]),
            "fraction": _median([_val(r["cost_fraction"]) for r in rs]),
            "reached": sum(r["reached"] for r in rs),
            "runs": len(rs),
        }
    pc = list(per_case.values())
    return {
        "median_trials": _median([c["trials"] for c in pc]),
        "median_cost_s": _median([c["cost_s"] for c in pc]),
        "median_fraction": _median([c["fraction"] for c in pc]),
        "reached": sum(c["reached"] for c in pc),
        "runs": sum(c["runs"] for c in pc),
        # A sampler that keeps proposing configs it cannot learn from (GP ignores pruned
        # and failed trials) measures nothing new; the harness would end its study there.
        "stalled": sum(r["stopped"] == "stalled" for r in runs),
        "wall_s": sum(r["wall_s"] for r in runs),
        "per_case": per_case,
    }


def run_bench(paths: list[str], samplers: list[str], seeds: int, variants: list[str],
              in_flight: int = 2, tol: float = rp.DEFAULT_TOL, warm_start: bool = True,
              jobs: int = 1) -> dict[str, Any]:
    tables = {p: rp.Table.load(p) for p in paths}
    cases = [t.name for t in tables.values()]
    jobs_list = [(p, s, seed, VARIANTS[v], in_flight, tol, warm_start)
                 for v in variants for s in samplers for p in paths for seed in range(seeds)]
    if jobs > 1:
        with ProcessPoolExecutor(jobs) as ex:
            results = list(ex.map(_one, *zip(*jobs_list, strict=True)))
    else:
        results = [_one(*j) for j in jobs_list]
    out: dict[str, Any] = {
        "settings": {"samplers": samplers, "seeds": seeds, "variants": variants,
                     "in_flight": in_flight, "tol": tol, "warm_start": warm_start},
        "cases": [rp.summary(t, tol) for t in tables.values()],
        "results": {},
    }
    for v in variants:
        out["results"][v] = {
            s: aggregate([r for r in results if r["sampler"] == s and r["prune"] == VARIANTS[v]],
                         cases)
            for s in samplers}
    main_v = "static-pruning" if "static-pruning" in variants else variants[0]
    ranked = sorted(samplers, key=lambda s: (out["results"][main_v][s]["median_fraction"],
                                             out["results"][main_v][s]["median_trials"]))
    res = out["results"][main_v]
    best = ranked[0]
    frac = res[best]["median_fraction"]
    out["best"] = {"sampler": best, "variant": main_v, "median_fraction": frac,
                   "median_trials": res[best]["median_trials"],
                   "reached": res[best]["reached"], "runs": res[best]["runs"],
                   "goal_fraction": GOAL_FRACTION, "goal_met": frac <= GOAL_FRACTION}
    # The best of those that reached the target in every run: the safer default where
    # the overall best sometimes never gets there.
    always = [s for s in ranked if res[s]["reached"] == res[s]["runs"]]
    out["best_always_reached"] = (
        {"sampler": always[0], "median_fraction": res[always[0]]["median_fraction"],
         "median_trials": res[always[0]]["median_trials"]} if always else None)
    return out


# -- rendering ----------------------------------------------------------------------------


def _f(x: Any, spec: str) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "not reached"
    return format(x, spec)


def render(report: dict[str, Any]) -> str:
    st = report["settings"]
    tol = st["tol"]
    lines = [
        "# Replay benchmark",
        "",
        f"Samplers replayed against recorded exhaustive sweeps (`python "
        f"benchmarks/replay_bench.py`): {st['seeds']} seeds per case, {st['in_flight']} "
        f"config(s) in flight, warm start {'on' if st['warm_start'] else 'off'}. Target: "
        f"within {tol:.0%} of the grid optimum. Medians over cases of each case's median "
        "over seeds; GPU time as recorded per trial (timing + first launch).",
        "",
        "## Cases",
        "",
        "| case | device | grid | ok / failed / pruned | optimum ms | configs within "
        f"{tol:.0%} | random needs (expected) | grid GPU s | pruning saves |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in report["cases"]:
        lines.append(
            f"| {c['case']} | {c['device_name'] or '-'} | {c['grid']} | {c['ok']} / {c['failed']}"
            f" / {c['pruned']} | {c['optimum_ms']:.4g} | {c['within_tol']} | "
            f"{c['random_expected_trials']:.1f} | {c['grid_cost_s']:.1f} | "
            f"{c['pruning_saving']:.0%} |")
    for v, res in report["results"].items():
        lines += ["", f"## {v}", "",
                  f"| sampler | trials to {tol:.0%} | GPU s to {tol:.0%} | fraction of the grid's "
                  "GPU time | reached (runs) | stalled |", "|---|---|---|---|---|---|"]
        for s, a in res.items():
            lines.append(f"| {s} | {_f(a['median_trials'], '.1f')} | "
                         f"{_f(a['median_cost_s'], '.3g')} | {_f(a['median_fraction'], '.1%')} |"
                         f" {a['reached']}/{a['runs']} | {a['stalled']} |")
        lines += ["", "Per case (median over seeds: trials / fraction):", "",
                  "| case | " + " | ".join(res) + " |", "|---|" + "---|" * len(res)]
        for case in (c["case"] for c in report["cases"]):
            cells = []
            for a in res.values():
                pc = a["per_case"].get(case)
                cells.append(f"{_f(pc['trials'], '.0f')} / {_f(pc['fraction'], '.1%')}"
                             if pc else "-")
            lines.append(f"| {case} | " + " | ".join(cells) + " |")
    b = report["best"]
    lines += ["", f"**Best ({b['variant']}): {b['sampler']}**, median "
              f"{_f(b['median_trials'], '.1f')} trials and {_f(b['median_fraction'], '.1%')} "
              "of the grid's GPU time to come "
              f"within {tol:.0%} of the grid optimum; goal <= {b['goal_fraction']:.0%}: "
              f"{'met' if b['goal_met'] else 'NOT met'}. It reached the target in "
              f"{b['reached']}/{b['runs']} runs."]
    safe = report.get("best_always_reached")
    if safe and safe["sampler"] != b["sampler"]:
        lines += ["", f"Best of the samplers that reached the target in every run: "
                  f"**{safe['sampler']}**, median {_f(safe['median_trials'], '.1f')} trials and "
                  f"{_f(safe['median_fraction'], '.1%')} of the grid's GPU time."]
    if "cmaes" in st["samplers"]:
        lines += ["", "cmaes samples categorical tunables (all of the harness's) with its "
                  "independent sampler, i.e. at random: it matches random seed for seed."]
    lines.append("")
    return "\n".join(lines)


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_jsonable(v) for v in x]
    return x


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=str(ROOT / "benchmarks" / "replay"),
                   help="recorded tables: <data>/<HW>/*.json")
    p.add_argument("--out", default=None, help="where report.json/.md go (default: --data)")
    p.add_argument("--samplers", nargs="+", default=list(SAMPLERS), choices=SAMPLERS)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--in-flight", type=int, default=2,
                   help="configs in flight (the harness's default queue_depth on one GPU)")
    p.add_argument("--tol", type=float, default=rp.DEFAULT_TOL)
    p.add_argument("--no-warm-start", action="store_true")
    p.add_argument("--jobs", type=int, default=1)
    args = p.parse_args(argv)

    tables = rp.load_tables(args.data)
    if not tables:
        print(f"no complete recorded tables under {args.data}", file=sys.stderr)
        return 1
    report = run_bench([t.path for t in tables], args.samplers, args.seeds, args.variants,
                       args.in_flight, args.tol, not args.no_warm_start, args.jobs)
    out = Path(args.out or args.data)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(_jsonable(report), indent=1) + "\n")
    md = render(report)
    (out / "report.md").write_text(md)
    print(md)
    b = report["best"]
    print(f"the default the replay shows to be best: {b['sampler']} "
          f"({_f(b['median_fraction'], '.1%')} of the grid's GPU time, median over cases)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
