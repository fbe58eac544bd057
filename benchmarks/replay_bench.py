"""Replay benchmark: which search strategy finds the grid's winner for the least GPU time?

Every registered strategy (``harness.search.strategies``: tpe, random, grid, cmaes, gp,
pattern, and any plug-in) tunes every recorded case (``benchmarks/replay/<HW>/*.json``,
exhaustive sweeps exported by ``harness.search.replay``) with several seeds, offline,
paying each config's recorded GPU time (see ``harness/search/replay.py``). Per strategy it
reports the median over cases (each case's median over seeds) of:

- the trials needed to come within 2 % of the grid optimum;
- the GPU time needed for it, in seconds and as a fraction of the whole grid's GPU time;

the worst case (the case whose median is highest) and the worst single run, and the
regret curve: how far the best found is from the optimum after each share of the grid's
GPU time (median over seeds, then over cases).

Two variants: ``static-pruning`` is the harness (configs that cannot run are rejected on
the driver at no GPU cost; the grid's cost is that of the pruned grid); ``no-pruning``
launches them too (each costs a typical measured config) and compares with the unpruned
grid. The saving of pruning itself is reported per case.

    python benchmarks/replay_bench.py                      # all cases, 10 seeds
    python benchmarks/replay_bench.py --strategies tpe pattern --seeds 2 --out /tmp/r

Writes ``report.json`` and ``report.md`` to ``--out`` (default: the data directory) and
prints the table. Goal: within 2 % in <= 10 % of the grid's GPU time, median over cases.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

# One BLAS / OpenMP thread per process, set before numpy and torch load: the strategies'
# models solve matrices of a few hundred rows, where a pool of threads per process only
# spins against the bench's other processes (on two busy cores, 35 times slower).
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness.search import replay as rp  # noqa: E402
from harness.search.strategies import registry  # noqa: E402

#: Replay variants: static pruning is the harness; the others change one thing each.
VARIANTS: dict[str, dict[str, Any]] = {
    "static-pruning": {},
    "no-pruning": {"prune": False},
    "multi-fidelity": {"fidelity": True},
    "warm-start": {"seeded": True},
    "warm-start+multi-fidelity": {"seeded": True, "fidelity": True},
    "warm-start-other-gpu": {"seeded": "other-gpu"},
}
#: Shares of the grid's GPU time at which the regret curve is read.
CURVE_AT = (0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0)
#: Cheap pass of multi-fidelity: do_bench at 10 ms warm-up + 10 ms rep (search.cheap_rep_ms)
#: against the full 25 + 100 ms: 16 % of the timing; the first launch is paid once.
FIDELITY = 20 / 125
#: GP is ~100x slower per ask than the others: fewer seeds, fewer variants (--slow-*).
SLOW = ("gp",)
#: no-pruning runs on cases of up to this many configs: in a larger space most configs
#: are invalid (the large grouped GEMM sweep: 94 %), nobody would launch them all, and a
#: replay that does takes tens of thousands of trials a run.
NO_PRUNING_MAX_GRID = 5000
GOAL_FRACTION = 0.10


#: Tables this process has loaded (a large one takes a second to read).
_TABLES: dict[str, rp.Table] = {}


def _table(path: str) -> rp.Table:
    if path not in _TABLES:
        _TABLES[path] = rp.Table.load(path)
    return _TABLES[path]


def _one(path: str, sampler: str, seed: int, variant: str, in_flight: int, tol: float,
         warm_start: bool, seeds: list[dict[str, Any]], max_stall: int) -> dict[str, Any]:
    table = _table(path)
    v = VARIANTS[variant]
    t0 = time.perf_counter()
    trace = rp.replay(table, sampler, seed, prune=v.get("prune", True), in_flight=in_flight,
                      tol=tol, warm_start=warm_start, seeds=seeds,
                      fidelity=FIDELITY if v.get("fidelity") else None, max_stall=max_stall)
    out = rp.metrics(trace, table, tol)
    out["variant"] = variant
    out["wall_s"] = time.perf_counter() - t0
    out["regret"] = regret_at(trace, out["grid_cost_s"], table.optimum_ms)
    return out


def regret_at(trace: rp.Trace, grid_cost_s: float, optimum_ms: float) -> list[float]:
    """best / optimum - 1 once each share of ``CURVE_AT`` of the grid's GPU time is spent
    (inf: nothing measured yet). A run stops at the target: later shares keep its last
    best (within the target)."""
    out = []
    for share in CURVE_AT:
        best = math.inf
        for step in trace.steps:
            if step.total_cost_s > share * grid_cost_s + 1e-12:
                break
            best = step.best_ms
        out.append(best / optimum_ms - 1 if best < math.inf else math.inf)
    return out


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else math.nan


def _val(x: Any) -> float:
    return math.inf if x is None else float(x)


def aggregate(runs: list[dict[str, Any]], cases: list[str],
              headline: list[str]) -> dict[str, Any] | None:
    """Per case the median over seeds, then the median over the ``headline`` cases
    (unreached = inf); ``per_case`` holds every case."""
    if not runs:
        return None
    per_case = {}
    for case in cases:
        rs = [r for r in runs if r["case"] == case]
        if not rs:
            continue
        per_case[case] = {
            "trials": _median([_val(r["trials_to_target"]) for r in rs]),
            "cost_s": _median([_val(r["cost_to_target_s"]) for r in rs]),
            "fraction": _median([_val(r["cost_fraction"]) for r in rs]),
            "worst_fraction": max(_val(r["cost_fraction"]) for r in rs),
            "reached": sum(r["reached"] for r in rs),
            "runs": len(rs),
            "cut": _median([r["cut"] for r in rs]),
            "regret": [_median([r["regret"][i] for r in rs]) for i in range(len(CURVE_AT))],
        }
    pc = [per_case[c] for c in headline if c in per_case]
    return {
        "median_trials": _median([c["trials"] for c in pc]),
        "median_cost_s": _median([c["cost_s"] for c in pc]),
        "median_fraction": _median([c["fraction"] for c in pc]),
        # The case the strategy does worst on (its median over seeds), and its worst run.
        "worst_case_fraction": max((c["fraction"] for c in pc), default=math.nan),
        "worst_run_fraction": max((c["worst_fraction"] for c in pc), default=math.nan),
        "regret_curve": [[share, _median([c["regret"][i] for c in pc])]
                         for i, share in enumerate(CURVE_AT)],
        "median_fraction_all": _median([c["fraction"] for c in per_case.values()]),
        "reached": sum(c["reached"] for c in pc),
        "runs": sum(c["runs"] for c in pc),
        "seeds": max(c["runs"] for c in per_case.values()),
        # A sampler that keeps proposing configs it cannot learn from (GP ignores pruned
        # and failed trials) measures nothing new; the harness ends its study there too
        # (search.max_stalled_asks).
        "stalled": sum(r["stopped"] == "stalled" for r in runs),
        "wall_s": sum(r["wall_s"] for r in runs),
        "per_case": per_case,
    }


def donor_seeds(table: rp.Table, others: list[rp.Table],
                other_gpu: bool = False) -> list[tuple[dict[str, Any], str]]:
    """What the harness's warm start (``search.seed_from_packs``) would enqueue for
    ``table`` if the other recorded cases of the same kernel and dtype (other shapes,
    other hardware) were in the packs: their winners, where they are runnable points of
    this case's grid; same hardware first, then the same shape first. ``other_gpu``: only
    the other GPU type's (a first tune on a new GPU from another GPU's pack)."""
    out = []
    hw, shape = table.data["hardware"], table.data["shape"]
    for o in sorted(others, key=lambda o: (o.data["hardware"] != hw, o.data["shape"] != shape)):
        if o is table or (o.data["kernel"], o.data["dtype"]) != (table.data["kernel"],
                                                                  table.data["dtype"]):
            continue
        if (o.data["hardware"], o.data["shape"]) == (hw, shape):
            continue  # the same case swept over another space: its winner is no pack's
        if other_gpu and o.data["hardware"] == hw:
            continue
        point = {k: o.optimum.get(k) for k in table.space}
        rec = table.lookup(point)
        if rec is not None and rec["status"] != "pruned":
            out.append((point, o.name))
    return out


def run_bench(paths: list[str], samplers: list[str], seeds: int, variants: list[str],
              in_flight: int = 2, tol: float = rp.DEFAULT_TOL, warm_start: bool = True,
              jobs: int = 1, slow_seeds: int = 2,
              slow_variants: tuple[str, ...] = ("static-pruning",),
              no_pruning_max_grid: int = NO_PRUNING_MAX_GRID) -> dict[str, Any]:
    from harness.experiment import SearchSettings

    max_stall = SearchSettings().max_stalled_asks
    tables = {p: _table(p) for p in paths}
    cases = [t.name for t in tables.values()]
    headline = [t.name for t in tables.values() if t.complete]
    donors = {p: donor_seeds(t, list(tables.values())) for p, t in tables.items()}
    other = {p: donor_seeds(t, list(tables.values()), other_gpu=True)
             for p, t in tables.items()}

    def seeded(p: str, v: str) -> list[dict[str, Any]]:
        kind = VARIANTS[v].get("seeded")
        return [c for c, _ in (other[p] if kind == "other-gpu" else donors[p] if kind else [])]

    jobs_list = [(p, s, seed, v, in_flight, tol, warm_start, seeded(p, v), max_stall)
                 for v in variants for s in samplers
                 if s not in SLOW or v in slow_variants
                 for p in paths
                 if v != "no-pruning" or tables[p].grid_size <= no_pruning_max_grid
                 for seed in range(min(seeds, slow_seeds) if s in SLOW else seeds)]
    if jobs > 1:
        with ProcessPoolExecutor(jobs) as ex:
            results = list(ex.map(_one, *zip(*jobs_list, strict=True)))
    else:
        results = [_one(*j) for j in jobs_list]
    out: dict[str, Any] = {
        "settings": {"samplers": samplers, "seeds": seeds, "slow_seeds": slow_seeds,
                     "slow_samplers": list(SLOW), "slow_variants": list(slow_variants),
                     "variants": variants, "in_flight": in_flight, "tol": tol,
                     "warm_start": warm_start, "fidelity": FIDELITY,
                     "max_stalled_asks": max_stall, "curve_at": list(CURVE_AT),
                     "no_pruning_max_grid": no_pruning_max_grid,
                     "default_strategy": SearchSettings().strategy},
        "cases": [{**rp.summary(t, tol), "donors": [w for _, w in donors[p]],
                   "donors_other_gpu": [w for _, w in other[p]]}
                  for p, t in tables.items()],
        "headline_cases": headline,
        "results": {},
    }
    for v in variants:
        out["results"][v] = {
            s: agg for s in samplers
            if (agg := aggregate([r for r in results if r["sampler"] == s
                                  and r["variant"] == v], cases, headline)) is not None}
    main_v = "static-pruning" if "static-pruning" in variants else variants[0]
    res = out["results"][main_v]
    ranked = sorted(res, key=lambda s: (res[s]["median_fraction"],
                                        res[s]["worst_case_fraction"], res[s]["median_trials"]))
    out["ranking"] = ranked
    out["best"] = _best(res, ranked[0], main_v)
    # The best of those that reached the target in every run: the safer default where
    # the overall best sometimes never gets there.
    always = [s for s in ranked if res[s]["reached"] == res[s]["runs"]]
    out["best_always_reached"] = _best(res, always[0], main_v) if always else None
    out.update(verdicts(out["results"]))
    return out


#: What the harness can run: static pruning always on (no-pruning is the comparison, and
#: its fraction is of a bigger, unpruned grid), with or without warm start/multi-fidelity.
HARNESS_VARIANTS = ("static-pruning", "multi-fidelity", "warm-start",
                    "warm-start+multi-fidelity", "warm-start-other-gpu")
#: Without packs to seed from (a kernel's first tune): no warm start.
COLD_VARIANTS = ("static-pruning", "multi-fidelity")


def verdicts(results: dict[str, Any]) -> dict[str, Any]:
    """The best harness combination overall and without warm start."""
    out = {}
    for key, allowed in (("best_overall", HARNESS_VARIANTS), ("best_cold", COLD_VARIANTS)):
        combos = [(v, s) for v, r in results.items() if v in allowed for s in r]
        if combos:
            v, s = min(combos, key=lambda vs: (
                _val(results[vs[0]][vs[1]]["median_fraction"]),
                _val(results[vs[0]][vs[1]].get("worst_case_fraction")),
                _val(results[vs[0]][vs[1]]["median_trials"])))
            out[key] = _best(results[v], s, v)
    return out


def _best(res: dict[str, Any], sampler: str, variant: str) -> dict[str, Any]:
    a = res[sampler]
    frac = _val(a["median_fraction"])
    return {"sampler": sampler, "variant": variant, "median_fraction": frac,
            "worst_case_fraction": a.get("worst_case_fraction"),
            "median_trials": a["median_trials"], "reached": a["reached"], "runs": a["runs"],
            "goal_fraction": GOAL_FRACTION, "goal_met": frac <= GOAL_FRACTION,
            "miss": frac - GOAL_FRACTION}


# -- rendering ----------------------------------------------------------------------------


def _cases_over_goal(report: dict, sampler: str, variant: str, goal: float) -> list[str]:
    """The complete cases where ``sampler`` + ``variant`` needs more than ``goal`` of the
    grid's GPU time: what makes the median miss."""
    per = report["results"].get(variant, {}).get(sampler, {}).get("per_case", {})
    out = []
    for case in report["cases"]:
        r = per.get(case["case"])
        if not case["complete"] or not r or not r["fraction"] > goal:
            continue
        out.append(f"{case['case']} ({case['within_tol']}/{case['ok']}): "
                   f"{_f(r['trials'], '.0f')} trials, {_f(r['fraction'], '.1%')}")
    return out


def _default_ranks(res: dict, default: str) -> dict[str, tuple[int, float]]:
    """The default strategy's rank (1 = best, ties share) and median fraction in each
    harness variant."""
    out = {}
    for v in HARNESS_VARIANTS:
        fr = {smp: r["median_fraction"] for smp, r in res.get(v, {}).items()}
        if default in fr and fr[default] == fr[default]:
            out[v] = (1 + sum(x < fr[default] - 1e-12 for x in fr.values()), fr[default])
    return out


def _f(x: Any, spec: str) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "not reached"
    return format(x, spec)


def _cell(a: dict[str, Any] | None) -> str:
    if a is None:
        return "not run"
    return (f"{_f(a['median_trials'], '.0f')} / {_f(a['median_fraction'], '.1%')} "
            f"({a['reached']}/{a['runs']})")


def _worst(a: dict[str, Any] | None) -> str:
    if a is None or "worst_case_fraction" not in a:
        return "not run"
    return (f"{_f(a['worst_case_fraction'], '.1%')} / "
            f"{_f(a['worst_run_fraction'], '.1%')}")


def render(report: dict[str, Any]) -> str:
    st = report["settings"]
    tol = st["tol"]
    res = report["results"]
    variants = list(res)
    samplers = st["samplers"]
    head = report["headline_cases"]
    lines = [
        "# Replay benchmark",
        "",
        f"Search strategies replayed against recorded exhaustive sweeps (`python "
        f"benchmarks/replay_bench.py`): {st['seeds']} seeds per case ({st['slow_seeds']} for "
        f"{', '.join(st['slow_samplers'])}, run in {', '.join(st['slow_variants'])} only), "
        f"{st['in_flight']} config(s) in flight, the kernel's default config first "
        f"{'on' if st['warm_start'] else 'off'}. Target: within {tol:.0%} of the grid "
        "optimum. Medians over the complete cases of each case's median over seeds; GPU time "
        "as recorded per trial (timing + first launch). Sweeps cut short are replayed over "
        "the sub-grid they measured, listed as such and left out of the medians.",
        "",
        "Variants: **static-pruning** is the harness (configs that cannot run are rejected "
        "on the driver at no GPU cost); **no-pruning** launches them too (each costs a typical "
        "config; compared with the unpruned grid; cases of up to "
        f"{st.get('no_pruning_max_grid', NO_PRUNING_MAX_GRID):,} configs); **multi-fidelity** "
        "times each config "
        f"cheaply first ({st['fidelity']:.0%} of the full timing plus its first launch; "
        "latency drawn within the recorded p20-p80) and in full only if the threshold pruner "
        "(cheap > best x 1.1, after 4 complete trials) lets it through; **warm-start** first "
        "tries the winners of the other recorded cases of the same kernel (other shape, other "
        "hardware: what `search.seed_from_packs` enqueues from the packs); "
        "**warm-start-other-gpu** only those of the other GPU type (a first tune on a new "
        "GPU from another GPU's pack).",
        "",
        "## Cases",
        "",
        "| case | device, date | grid | ok / failed / pruned | optimum ms | configs within "
        f"{tol:.0%} | random needs (expected) | grid GPU s | pruning saves | warm start from |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in report["cases"]:
        lines.append(
            f"| {c['case']} | {c.get('device_name', '')}, {c.get('date', '')} | {c['grid']} | "
            f"{c['ok']} / {c['failed']} / {c['pruned']} | "
            f"{c['optimum_ms']:.4g} | {c['within_tol']} | {c['random_expected_trials']:.1f} | "
            f"{c['grid_cost_s']:.1f} | {c['pruning_saving']:.0%} | "
            f"{'; '.join(c['donors']) or '-'} |")
    lines += ["", f"## Summary: trials / fraction of the grid's GPU time to {tol:.0%} "
              f"(runs that reached it), median over the {len(head)} complete cases", "",
              "| strategy | " + " | ".join(variants) + " |", "|---|" + "---|" * len(variants)]
    for s in samplers:
        lines.append(f"| {s} | " + " | ".join(_cell(res[v].get(s)) for v in variants) + " |")
    lines += ["", "Worst case over the same cases: the case's median over seeds / the worst "
              "single run:", "",
              "| strategy | " + " | ".join(variants) + " |", "|---|" + "---|" * len(variants)]
    for s in samplers:
        lines.append(f"| {s} | " + " | ".join(_worst(res[v].get(s)) for v in variants) + " |")
    at = st.get("curve_at")
    if at:
        lines += ["", f"Regret curve ({variants[0]}): the best found / the optimum - 1 after "
                  "each share of the grid's GPU time, median over seeds, then over the "
                  "complete cases (a run stops within the target: later shares keep its "
                  "best). Per case in `report.json` (`regret`); plotted, with the large "
                  "cases apart, in `regret.svg`.", "", "![regret curves](regret.svg)", "",
                  "| strategy | " + " | ".join(f"{x:.0%}" for x in at) + " |",
                  "|---|" + "---|" * len(at)]
        for s in samplers:
            a = res[variants[0]].get(s)
            if a and a.get("regret_curve"):
                lines.append(f"| {s} | " + " | ".join(
                    _f(r, ".1%") if r != math.inf else "-" for _, r in a["regret_curve"])
                    + " |")
    lines += ["", "Median fraction including the sub-grids of the cut sweeps:", "",
              "| strategy | " + " | ".join(variants) + " |", "|---|" + "---|" * len(variants)]
    for s in samplers:
        lines.append(f"| {s} | " + " | ".join(
            _f(res[v][s]["median_fraction_all"], ".1%") if s in res[v] else "not run"
            for v in variants) + " |")
    stalled = {s: sum(res[v][s]["stalled"] for v in variants if s in res[v]) for s in samplers}
    if any(stalled.values()):
        lines += ["", "Runs ended by the stall stop (`search.max_stalled_asks` = "
                  f"{st['max_stalled_asks']} asks in a row without a new config): " + ", ".join(
                      f"{s} {n}" for s, n in stalled.items() if n) + "."]
    for v in variants:
        lines += ["", f"### {v}, per case (median over seeds: trials / fraction)", "",
                  "| case | " + " | ".join(s for s in samplers if s in res[v]) + " |",
                  "|---|" + "---|" * sum(s in res[v] for s in samplers)]
        for c in report["cases"]:
            cells = []
            for s in samplers:
                if s not in res[v]:
                    continue
                pc = res[v][s]["per_case"].get(c["case"])
                cells.append(f"{_f(pc['trials'], '.0f')} / {_f(pc['fraction'], '.1%')}"
                             if pc else "-")
            lines.append(f"| {c['case']} | " + " | ".join(cells) + " |")
    b, o = report["best"], report["best_overall"]
    lines += ["", "## Verdict", "",
              f"Best strategy with the harness as it was (static pruning): **{b['sampler']}**, "
              f"median {_f(b['median_trials'], '.1f')} trials and "
              f"{_f(b['median_fraction'], '.1%')} of the grid's GPU time "
              f"({b['reached']}/{b['runs']} runs reached the target).",
              "",
              f"Best combination (ties broken by the worst case): **{o['sampler']} with "
              f"{o['variant']}**, median {_f(o['median_trials'], '.1f')} trials and "
              f"{_f(o['median_fraction'], '.1%')} of the grid's GPU time, worst case "
              f"{_f(o.get('worst_case_fraction'), '.1%')} ({o['reached']}/{o['runs']} runs)."]
    goal = (f"Goal (within {tol:.0%} of the grid optimum in <= {o['goal_fraction']:.0%} of "
            "the grid's GPU time, median over cases, static pruning on): ")
    if o["goal_met"]:
        lines += ["", goal + f"**met** by {o['sampler']} with {o['variant']} "
                  f"({-o['miss']:.1%} to spare)."]
    else:
        lines += ["", goal + f"**NOT met**: the best combination misses by "
                  f"{o['miss']:.1%} of the grid's GPU time."]
    c = report.get("best_cold")
    if c:
        state = (f"met ({-c['miss']:.1%} to spare)" if c["goal_met"]
                 else f"NOT met, missed by {c['miss']:.1%}")
        lines += ["", f"Without packs to warm-start from (a kernel's first tune), the best is "
                  f"**{c['sampler']} with {c['variant']}**: median "
                  f"{_f(c['median_trials'], '.1f')} trials and "
                  f"{_f(c['median_fraction'], '.1%')} (worst case "
                  f"{_f(c.get('worst_case_fraction'), '.1%')}): {state}."]
        over = _cases_over_goal(report, c["sampler"], c["variant"], c["goal_fraction"])
        if over:
            lines += ["", "Where it spends more than the goal (complete cases; median over "
                      "seeds; configs within 2 % of the optimum / runnable configs): " +
                      "; ".join(over) + ". A small grid makes each trial a large share of "
                      "its cost, and a grid with one or two configs within 2 % needs tens "
                      "of trials from any strategy; multi-fidelity cuts the cost of the bad "
                      "configs, not the trials; warm start is what removes the trials."]
    default = st.get("default_strategy", "tpe")
    ranks = _default_ranks(res, default)
    if ranks:
        lines += ["", f"Default strategy (`search.strategy`): **{default}**. Its rank among "
                  "the strategies by median fraction, per variant (1 = best, ties share a "
                  "rank): " +
                  ", ".join(f"{v} {r} ({_f(x, '.1%')})" for v, (r, x) in ranks.items()) + "."]
    safe = report.get("best_always_reached")
    if safe and safe["sampler"] != b["sampler"]:
        lines += ["", f"Best of the strategies that reached the target in every run (static "
                  f"pruning): **{safe['sampler']}**, median "
                  f"{_f(safe['median_trials'], '.1f')} trials and "
                  f"{_f(safe['median_fraction'], '.1%')}."]
    if "cmaes" in samplers:
        lines += ["", "cmaes samples categorical tunables (all of the harness's) with its "
                  "independent sampler, i.e. at random: it matches random seed for seed. "
                  "grid is the grid in a seeded random order, i.e. random without "
                  "replacement."]
    lines.append("")
    return "\n".join(lines)


#: Valid configs from which a case counts as a large space in the plot's second panel.
LARGE_CASE = 2000


def plot_regret(report: dict[str, Any], path: Path) -> bool:
    """``path`` (SVG): each strategy's regret curve in the first variant (the best found
    / the optimum - 1 after each share of the grid's GPU time, median over seeds, then
    over cases), over the complete cases and over the large ones; False without
    matplotlib or a curve."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    st = report["settings"]
    at, variant = st.get("curve_at"), st["variants"][0]
    res = report["results"][variant]
    if not at or not res:
        return False
    headline = set(report["headline_cases"])
    large = [c["case"] for c in report["cases"]
             if c["case"] in headline and c["ok"] >= LARGE_CASE]
    panels = [(f"{len(headline)} complete cases", sorted(headline))]
    if large:
        panels.append((f"the {len(large)} cases of {LARGE_CASE:,}+ valid configs", large))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), sharey=True,
                             squeeze=False)
    for ax, (title, cases) in zip(axes[0], panels, strict=True):
        for s in st["samplers"]:
            per = res.get(s, {}).get("per_case", {})
            curves = [per[c]["regret"] for c in cases if per.get(c, {}).get("regret")]
            if not curves:
                continue
            # None: nothing measured yet at that share (no best to compare).
            ys = [_median([_val(cv[i]) for cv in curves]) * 100 for i in range(len(at))]
            ys = [y if math.isfinite(y) else math.nan for y in ys]
            ax.plot([x * 100 for x in at], ys, marker="o", ms=3,
                    lw=2.5 if s == st.get("default_strategy") else 1.2,
                    label=s + (" (default)" if s == st.get("default_strategy") else ""))
        ax.axhline(report["settings"]["tol"] * 100, color="grey", ls=":", lw=1)
        ax.set_xscale("log")
        ax.set_xticks([x * 100 for x in at],
                      [f"{x:.0%}" if x in (0.02, 0.05, 0.1, 0.2, 0.5, 1.0) else "" for x in at])
        ax.set_xlabel("share of the grid's GPU time spent")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("best found / optimum - 1 (%, median)")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(f"Regret curves, {variant}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, format="svg", metadata={"Date": None})
    plt.close(fig)
    return True


def _dumps(report: dict[str, Any]) -> str:
    """report.json's text: indented, with each list of numbers on one line (the regret
    curves would take a line per number)."""
    import re

    text = json.dumps(_jsonable(report), indent=1)
    number = r"(?:-?[0-9.eE+-]+|null)"
    return re.sub(rf"\[\s*{number}(?:,\s*{number})*\s*\]",
                  lambda m: re.sub(r"\s+", " ", m.group(0)).replace("[ ", "[").replace(" ]", "]"),
                  text) + "\n"


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
                   help="recorded tables: <data>/<HW>/*.json and *.json.gz")
    p.add_argument("--out", default=None, help="where report.json/.md go (default: --data)")
    p.add_argument("--strategies", "--samplers", dest="samplers", nargs="+",
                   default=registry.names(), choices=registry.names(),
                   help="registered strategies (default: all)")
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--in-flight", type=int, default=2,
                   help="configs in flight (the harness's default queue_depth on one GPU)")
    p.add_argument("--tol", type=float, default=rp.DEFAULT_TOL)
    p.add_argument("--no-warm-start", action="store_true")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--slow-seeds", type=int, default=2, help="seeds for gp (slow)")
    p.add_argument("--slow-variants", nargs="+", default=["static-pruning"],
                   choices=list(VARIANTS), help="the variants gp runs in")
    p.add_argument("--no-pruning-max-grid", type=int, default=NO_PRUNING_MAX_GRID,
                   help="the largest case no-pruning runs on (configs)")
    p.add_argument("--render-only", action="store_true",
                   help="re-render report.md from the report.json in --out (or --data)")
    p.add_argument("--complete-only", action="store_true",
                   help="leave out the sweeps that were cut short")
    args = p.parse_args(argv)

    if args.render_only:
        path = Path(args.out or args.data) / "report.json"
        report = json.loads(path.read_text())
        report.update(verdicts(report["results"]))
        path.write_text(_dumps(report))
        md = render(report)
        (path.parent / "report.md").write_text(md)
        plot_regret(report, path.parent / "regret.svg")
        print(md)
        return 0
    # Sweeps cut short are replayed over the sub-grid they measured (named so).
    tables = rp.load_tables(args.data, complete_only=args.complete_only)
    if not tables:
        print(f"no recorded tables under {args.data}", file=sys.stderr)
        return 1
    report = run_bench([t.path for t in tables], args.samplers, args.seeds, args.variants,
                       args.in_flight, args.tol, not args.no_warm_start, args.jobs,
                       args.slow_seeds, tuple(args.slow_variants), args.no_pruning_max_grid)
    out = Path(args.out or args.data)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(_dumps(report))
    md = render(report)
    (out / "report.md").write_text(md)
    plot_regret(report, out / "regret.svg")
    print(md)
    b = report["best"]
    print(f"the default the replay shows to be best: {b['sampler']} "
          f"({_f(b['median_fraction'], '.1%')} of the grid's GPU time, median over cases)",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
