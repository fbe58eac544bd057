"""A search run live on a GPU, judged against the exhaustive sweep recorded for its case.

The replay (``benchmarks/replay_bench.py``) judges strategies offline, paying each config's
recorded GPU time. This runs one strategy for real on the case of a recorded table
(``benchmarks/replay/<HW>/*.json[.gz]``), as a user's first tune would: the kernel's default
config first, no packs to start from, static pruning, a Ray of its own. It then reads the
run's study and says how much GPU time the search spent until its best config (by its own
measurements) was one the sweep measured within 2 % of the sweep's best, as a share of the
sweep's whole GPU time. A trial costs what the replay charges: its timing plus its first
launch (``harness.search.progress``). Judged by config, not by latency: a live latency of
another day is not comparable to the recorded optimum, the recorded latency of the same
config is. Where a kernel's latencies drift from day to day by more than 2 % (an 8192^3
bf16 matmul on an H200), the recorded one is no 2 % judge either: the sweep's optimum is
put in the run's pack, so that the run's final phase times it beside the search's
finalists in the same interleaved rounds (``side_by_side``), one day's GPU for both.

    python benchmarks/live_search.py \\
        benchmarks/replay/H200/matmul__M8192_N8192_K8192__bf16__g4800.json.gz \\
        --config configs/sweeps/large/matmul.yaml --trials 300 --out /tmp/live

Writes ``live.json`` and ``live.md`` to ``--out`` (the run's own files under it too) and
prints the verdict. Needs a GPU of the table's hardware key.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness.search import replay as rp  # noqa: E402
from harness.search.keys import config_key  # noqa: E402
from harness.search.progress import ATTR_STATUS, DEVICE_TRIALS, trial_cost_s  # noqa: E402

#: The share of the sweep's GPU time the live search may spend (#47's target).
GOAL = 0.05


def experiment_for(table: rp.Table, config: Path, strategy: str, trials: int,
                   out: Path) -> Path:
    """The experiment of ``config`` (the sweep's own file: its space, timing and fleet)
    narrowed to the table's case and searched by ``strategy`` for ``trials`` trials, with
    its runs, packs and MLflow store under ``out``."""
    exp = yaml.safe_load(config.read_text())
    d = table.data
    exp.update(
        name=f"live-{d['kernel']}-{'-'.join(f'{k}{v}' for k, v in d['shape'].items())}",
        shapes=[dict(d["shape"])], dtypes=[d["dtype"]], hardware=[d["hardware"]],
        search={"strategy": strategy, "trials": trials, "warm_start": True,
                "seed_from_packs": False},
        output={"packs_dir": str(out / "packs"), "runs_dir": str(out / "runs")},
        tracking={"uri": f"sqlite:///{out / 'mlflow.db'}"},
    )
    path = out / "live.yaml"
    path.write_text(yaml.safe_dump(exp, sort_keys=False))
    plant_optimum(table, out / "packs")
    return path


def plant_optimum(table: rp.Table, packs_dir: Path) -> None:
    """Put the sweep's optimum in the run's pack for the case's shape: the run's final
    phase re-measures the pack's entry (the incumbent) beside its own finalists, in the
    same interleaved rounds, so that the search's best and the recorded optimum are
    compared on one day's GPU. The search does not start from it
    (``seed_from_packs: false``)."""
    from harness.kernel import api as kernel_api
    from harness.packs import format as packfmt

    d = table.data
    fam = kernel_api.get(d["kernel"])
    packfmt.freeze(packs_dir, d["hardware"], d["kernel"], d["dtype"], {
        fam.shape_key(d["shape"]): {
            "config": {**fam.default_config, **table.optimum},
            "metrics": {"latency_ms": table.optimum_ms},
            "provenance": {"source": f"the recorded sweep {table.name}"}}})


def side_by_side(row: dict[str, Any], tol: float = rp.DEFAULT_TOL) -> dict[str, Any]:
    """The run's final re-measurement (a summary row's ``remeasured``): the recorded
    optimum (the planted incumbent) against the search's best finalist, both timed in
    the same interleaved rounds. No incumbent there: the search measured the optimum
    more than ``remeasure.INCUMBENT_BAND`` slower than its best, so it was not timed
    again."""
    cands = row.get("remeasured") or []
    inc = next((c for c in cands if c.get("incumbent")), None)
    own = [c for c in cands if not c.get("incumbent") and c.get("median_ms")]
    best = min(own, key=lambda c: c["median_ms"]) if own else None
    if inc is None or not inc.get("median_ms") or best is None:
        return {"optimum_ms": None, "best_ms": best and best["median_ms"],
                "ratio": None, "within": best is not None and inc is None}
    ratio = best["median_ms"] / inc["median_ms"]
    return {"optimum_ms": inc["median_ms"], "best_ms": best["median_ms"],
            "best": best["config"], "ratio": round(ratio, 4), "within": ratio <= 1 + tol}


def judge(table: rp.Table, trials: Iterable[Any], tol: float = rp.DEFAULT_TOL,
          goal: float = GOAL) -> dict[str, Any]:
    """Walk the live study's trials in the order they were asked: the device seconds spent,
    and the first trial after which the search's best config is within ``tol`` of the
    recorded optimum by its recorded latency. ``trials``: Optuna frozen trials (or
    anything with ``number``, ``value``, ``params`` and ``user_attrs``)."""
    target = table.optimum_ms * (1 + tol)
    grid_s = table.grid_cost_s
    spent, n, best, best_cfg, hit = 0.0, 0, math.inf, None, None
    for t in sorted(trials, key=lambda t: t.number):
        status = t.user_attrs.get(ATTR_STATUS)
        if status not in DEVICE_TRIALS:
            continue
        n += 1
        spent += trial_cost_s(t.user_attrs)
        if status == "measured" and t.value is not None and t.value < best:
            best, best_cfg = t.value, dict(t.params)
        rec = table.lookup(best_cfg) if best_cfg is not None else None
        if hit is None and rec is not None and rec["status"] == "ok" \
                and rec["median_ms"] <= target:
            hit = {"trial": n, "gpu_s": round(spent, 3),
                   "fraction": round(spent / grid_s, 5) if grid_s > 0 else None,
                   "config": best_cfg}
    final = table.lookup(best_cfg) if best_cfg is not None else None
    # The same run's own measure, where it measured the recorded optimum too: a large
    # kernel's latency drifts from day to day (an 8192^3 bf16 matmul on an H200: live /
    # recorded 0.92-1.03, p10-p90), more than the 2 % that the recorded one is judged by.
    opt_key = config_key(table.optimum) if table.optimum else None
    walked = [t for t in sorted(trials, key=lambda t: t.number)
              if t.user_attrs.get(ATTR_STATUS) in DEVICE_TRIALS]
    opt_live = next((t.value for t in walked if t.value is not None
                     and t.user_attrs.get(ATTR_STATUS) == "measured"
                     and config_key(dict(t.params)) == opt_key), None)
    same_run = None
    if opt_live is not None:
        spent2, best2 = 0.0, math.inf
        for n2, t in enumerate(walked, 1):
            spent2 += trial_cost_s(t.user_attrs)
            if t.user_attrs.get(ATTR_STATUS) == "measured" and t.value is not None:
                best2 = min(best2, t.value)
            if best2 <= opt_live * (1 + tol):
                same_run = {"trial": n2, "gpu_s": round(spent2, 3),
                            "fraction": round(spent2 / grid_s, 5) if grid_s > 0 else None}
                break
    return {
        "case": table.name, "device_recorded": table.data.get("device_name"),
        "recorded": {"date": table.data.get("date"), "commit": table.data.get("commit"),
                     "optimum_ms": table.optimum_ms, "optimum": table.optimum,
                     "grid_gpu_s": round(grid_s, 3)},
        "trials": n, "gpu_s": round(spent, 3),
        "fraction": round(spent / grid_s, 5) if grid_s > 0 else None,
        "best_live_ms": best if best < math.inf else None, "best": best_cfg,
        "best_recorded_ms": (final or {}).get("median_ms"),
        "best_vs_optimum": (round(final["median_ms"] / table.optimum_ms, 4)
                            if final and final.get("median_ms") else None),
        "reached": hit, "goal_fraction": goal,
        "optimum_live_ms": opt_live, "reached_same_run": same_run,
        "goal_met": bool(hit and hit["fraction"] is not None and hit["fraction"] <= goal),
    }


def _study_trials(runs: Path, name: str) -> list[Any]:
    import optuna

    storage = f"sqlite:///{runs / name / 'optuna.db'}"
    (summary,) = optuna.get_all_study_summaries(storage)
    return optuna.load_study(study_name=summary.study_name, storage=storage).get_trials(
        deepcopy=False)


def render(v: dict[str, Any], command: str) -> str:
    hit = v["reached"]
    reached = (f"trial {hit['trial']}, {hit['gpu_s']:.1f} GPU s = **{hit['fraction']:.1%}** of "
               f"the sweep's {v['recorded']['grid_gpu_s']:.0f} s" if hit else "**not reached**")
    return "\n".join([
        f"# Live search vs the recorded sweep: {v['case']}", "",
        f"Command: `{command}`", "",
        f"- recorded: {v['device_recorded']}, {v['recorded']['date']}, git "
        f"{v['recorded']['commit']}; optimum {v['recorded']['optimum_ms']:.4g} ms "
        f"{v['recorded']['optimum']}",
        f"- the search: {v['trials']} trials on the device, {v['gpu_s']:.1f} GPU s "
        f"({v['fraction']:.1%} of the sweep's)",
        f"- within 2 % of the recorded optimum (by the recorded latency of its best config): "
        f"{reached}",
        f"- within 2 % of the recorded optimum as this run measured it "
        f"({v['optimum_live_ms'] or math.nan:.4g} ms): "
        + (f"trial {same['trial']}, {same['gpu_s']:.1f} GPU s = {same['fraction']:.1%}"
           if (same := v.get("reached_same_run")) else
           "not reached" if v.get("optimum_live_ms") else "the run did not measure it"),
        _side(v.get("side_by_side"), v),
        f"- its final best: {v['best']} (live {v['best_live_ms']} ms; recorded "
        f"{v['best_recorded_ms']} ms, {v['best_vs_optimum']}x the optimum)",
        f"- goal (<= {v['goal_fraction']:.0%} of the sweep's GPU time): "
        f"**{'met' if v['goal_met'] else 'NOT met'}**", ""])


def _side(sbs: dict[str, Any] | None, v: dict[str, Any]) -> str:
    head = "- side by side at the end (the same interleaved rounds): "
    if not sbs:
        return head + "not measured"
    if sbs["optimum_ms"] is None:
        return head + ("the recorded optimum was not timed again: the search measured it "
                       "more than 15 % slower than its best" if sbs["within"] else
                       "nothing to compare")
    return head + (f"the search's best {sbs['best_ms']:.4g} ms, the recorded optimum "
                   f"{sbs['optimum_ms']:.4g} ms: **{sbs['ratio']:.3f}x** "
                   f"({'within' if sbs['within'] else 'not within'} 2 %, after "
                   f"{v['fraction']:.1%} of the sweep's GPU time)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("table", type=Path, help="a recorded table (benchmarks/replay/<HW>/...)")
    p.add_argument("--config", type=Path, required=True,
                   help="the sweep's experiment file (its space, timing and fleet)")
    p.add_argument("--strategy", default=None, help="default: the harness's default")
    p.add_argument("--trials", type=int, default=300)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)

    from harness.experiment import SearchSettings

    table = rp.Table.load(args.table)
    if not table.complete:
        print(f"{args.table}: the sweep was cut short; no ground truth", file=sys.stderr)
        return 2
    strategy = args.strategy or SearchSettings().strategy
    args.out.mkdir(parents=True, exist_ok=True)
    exp = experiment_for(table, args.config, strategy, args.trials, args.out)
    name = yaml.safe_load(exp.read_text())["name"]
    cmd = [sys.executable, "-m", "harness", "run", str(exp), "--json", "--fresh"]
    with open(args.out / "run.json", "w") as out:
        rc = subprocess.run(cmd, stdout=out, cwd=ROOT).returncode
    if rc != 0:
        print(f"the run failed (exit {rc}): {args.out / 'run.json'}", file=sys.stderr)
        return rc
    verdict = {**judge(table, _study_trials(args.out / "runs", name)), "strategy": strategy}
    rows = json.loads((args.out / "run.json").read_text()).get("rows") or [{}]
    verdict["side_by_side"] = side_by_side(rows[0])
    command = "python benchmarks/live_search.py " + " ".join(sys.argv[1:] if argv is None
                                                              else argv)
    (args.out / "live.json").write_text(json.dumps(verdict, indent=1) + "\n")
    md = render(verdict, command)
    (args.out / "live.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
