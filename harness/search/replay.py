"""Replay: run a search strategy against a recorded exhaustive sweep, without a GPU.

:func:`replay` tunes a recorded case (``tables.Table``) through the search's own
``Search``: the same strategies, drawing from the same valid set (here: the configs the
sweep measured, less those it pruned), the same ask / tell, duplicate and multi-fidelity
rules, on an in-memory study. Each measurement is answered from the record: a failed
config costs its recorded time, a measured one returns its recorded median. The trace
holds, per GPU trial, the best latency so far and the GPU time spent. :func:`metrics`
turns a trace into the benchmark's numbers: trials and GPU time until the best is within
``tol`` (2 %) of the grid optimum (the fastest recorded config), also as a fraction of
the whole grid's cost.

Command line::

    python -m harness.search.replay export --storage sqlite:///runs/EXP/optuna.db --out DIR
    python -m harness.search.replay export-all --runs runs --out benchmarks/replay [--commit SHA]
    python -m harness.search.replay run TABLE.json --strategy tpe --seed 0
    python -m harness.search.replay summary benchmarks/replay
    python -m harness.search.replay check configs/sweeps/X.yaml   # exit 0: already recorded
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from harness.search.keys import config_key
from harness.search.tables import (
    DEFAULT_TOL,
    FORMAT,
    Table,
    dumps,
    export,
    export_all,
    load_tables,
    recorded,
)

__all__ = ["DEFAULT_TOL", "FORMAT", "Step", "Table", "Trace", "cheap_pass", "config_key", "dumps",
           "export", "export_all", "load_tables", "main", "metrics", "recorded", "replay",
           "summary"]

#: The reason a replay's check gives for a config the (cut-short) sweep never reached.
UNRECORDED = "not recorded by the sweep"


@dataclass
class Step:
    """One GPU trial of a replay (a config measured or failed; pruned and repeated
    configs cost nothing and are not steps)."""

    trial: int  # 1-based count of GPU trials
    ask: int  # how many configs the sampler had been asked for by then
    config: dict[str, Any]
    status: str
    value_ms: float | None
    cost_s: float
    total_cost_s: float
    best_ms: float


@dataclass
class Trace:
    case: str
    sampler: str
    seed: int
    prune: bool
    steps: list[Step] = field(default_factory=list)
    asks: int = 0
    duplicates: int = 0
    pruned_asks: int = 0
    unrecorded_asks: int = 0  # configs outside a cut sweep's measured sub-grid
    cut: int = 0  # configs stopped after their cheap pass (multi-fidelity)
    fidelity: float | None = None
    stopped: str = ""

    @property
    def best_ms(self) -> float:
        return self.steps[-1].best_ms if self.steps else math.inf


def cheap_pass(rec: Mapping[str, Any], fidelity: float, seed: int) -> tuple[float, float]:
    """(latency, GPU seconds) of a simulated cheap measurement of a recorded config: timed
    with ``fidelity`` x the full pass's repetitions, so it costs the first launch (compile)
    plus that share of the recorded timing; its latency is the recorded median perturbed
    within the recorded p20-p80 spread (uniformly, seeded by ``seed`` and the config)."""
    import random

    compile_s, timing_s = rec.get("compile_s"), rec.get("timing_s")
    if compile_s is None or timing_s is None:
        cost = rec["cost_s"] * fidelity
    else:
        cost = compile_s + timing_s * fidelity
    med = rec["median_ms"]
    lo, hi = rec.get("p20_ms") or med, rec.get("p80_ms") or med
    rng = random.Random(f"{seed}:{config_key(rec['config'])}")
    return rng.uniform(min(lo, hi), max(lo, hi)), cost


def _case_spec(table: Table) -> Any:
    """The study's spec, named without importing the recorded kernel's family."""
    from harness.experiment import StudySpec

    class _Case(StudySpec):
        @property
        def name(self) -> str:
            return f"replay/{table.name}"

    d = table.data
    return _Case("replay", d["kernel"], dict(d["shape"]), d["dtype"], d["hardware"])


def _check(table: Table, prune: bool) -> Any:
    """Static pruning as the sweep recorded it: a pruned config is rejected with its
    reason (without ``prune``: launched, it fails), one the sweep never reached too."""
    def check(config: Mapping[str, Any]) -> str | None:
        rec = table.by_key.get(config_key(config))
        if rec is None:
            return UNRECORDED
        if prune and rec["status"] == "pruned":
            return rec.get("reason") or "pruned"
        return None
    return check


def _result(rec: Mapping[str, Any], cost_s: float, value_ms: float | None = None,
            compile_s: float = 0.0) -> Any:
    """The recorded measurement as a worker returns it, costing ``cost_s`` device seconds
    (``compile_s`` of them its first launch)."""
    from harness.measure.timing import TrialResult

    split = {"compile_s": compile_s, "timing_s": cost_s - compile_s}
    if rec["status"] != "ok":
        return TrialResult(ok=False, reason=rec.get("reason") or rec["status"], **split)
    ms = rec["median_ms"] if value_ms is None else value_ms
    return TrialResult(ok=True, latency_ms=ms, max_abs_err=0.0, max_rel_err=0.0, **split)


def replay(table: Table, sampler: str | Any | None = None, seed: int = 0, *,
           budget_trials: int | None = None, prune: bool = True, warm_start: bool = True,
           in_flight: int = 1, stop_at_target: bool = True, tol: float = DEFAULT_TOL,
           enqueue: Sequence[Mapping[str, Any]] = (),
           seeds: Sequence[Mapping[str, Any]] = (), max_asks: int | None = None,
           max_stall: int | None = 200, fidelity: float | None = None,
           pruner: str = "threshold", prune_margin: float = 0.10,
           prune_startup: int = 4) -> Trace:
    """Tune ``table``'s case with ``sampler``: a strategy's name (as ``search.strategy``;
    None: its default), a Strategy class, or an Optuna sampler object (its proposals
    repaired into the valid set, as TPE's are), answering every config from the record.

    ``prune``: static pruning as in the harness (pruned configs are never asked for);
    without it a pruned config is launched, fails, and costs ``table.pruned_cost_s``.
    ``warm_start``: the harness's default: the kernel's default config goes first.
    ``in_flight``: configs asked before the oldest one's result is told (the harness keeps
    ``queue_depth`` per GPU in flight; TPE then runs with a constant liar).
    ``stop_at_target``: stop once the best is within ``tol`` of the grid optimum.
    ``enqueue``: configs to try first, in order (after the default config), whatever they
    are (pruned, repeated).
    ``seeds``: what the warm start from packs gives a study (``search.seed_from_packs``):
    the valid ones tried first (after the default config) and given to the strategy as
    its ``starts``.
    ``max_asks``: the harness's own limit (20 asks per budgeted trial plus the grid).
    ``max_stall``: stop after this many asks in a row that brought no new config (None:
    no such stop).
    ``fidelity``: multi-fidelity, as ``search.pruner`` does live: each runnable config is
    first timed cheaply (``cheap_pass``: this fraction of the full repetitions), reported
    to Optuna as step 0, and ``pruner`` decides whether it is timed in full (then it costs
    the recorded cost plus the cheap timing, and its value is the recorded median) or
    stops there (told PRUNED, a GPU trial at the cheap cost).
    """
    import optuna

    from harness.experiment import SearchSettings
    from harness.search.strategies import registry
    from harness.search.strategies.base import Strategy
    from harness.search.strategies.optuna_family import OptunaStrategy
    from harness.search.study import ATTR_REASON, ATTR_STATUS, Search

    n_pruned = len(table.of("pruned"))
    runnable = len(table.by_key) - (n_pruned if prune else 0)
    limit = max(1, min(budget_trials or runnable, runnable))
    if sampler is None:
        sampler = SearchSettings().strategy
    if isinstance(sampler, str):
        name, strategy = sampler, registry.get(sampler)
    elif isinstance(sampler, type) and issubclass(sampler, Strategy):
        name, strategy = sampler.name or sampler.__name__, sampler
    else:  # an Optuna sampler object
        name = type(sampler).__name__

        def strategy(setup: Any, base: Any = sampler) -> Any:
            return OptunaStrategy.wrapping(base, setup)
    settings = SearchSettings(
        trials=limit, warm_start=warm_start, seed_from_packs=False,
        pruner=pruner if fidelity else "none", prune_margin=prune_margin,
        prune_startup_trials=prune_startup,
        max_stalled_asks=max_stall if max_stall is not None else 10**9)
    search = Search(_case_spec(table), table.space, None, settings,  # type: ignore[arg-type]
                    optuna.storages.InMemoryStorage(), seed, n_parallel=in_flight,
                    seeds=[(dict(c), "replay") for c in seeds],
                    check=_check(table, prune),
                    default_config=table.data.get("default_config") or {},
                    strategy=strategy, max_asks=max_asks)
    for cfg in enqueue:
        search.enqueue(cfg)
    target = table.optimum_ms * (1 + tol)

    trace = Trace(table.name, name, seed, prune, fidelity=fidelity)
    pending: deque[tuple[Any, dict[str, Any], dict[str, Any]]] = deque()
    total, best = 0.0, math.inf
    while True:
        if stop_at_target and best <= target:
            trace.stopped = "target"
            break
        asked = search.ask() if len(pending) < in_flight else None
        if asked is not None:
            trial, config = asked
            pending.append((trial, config, table.by_key[config_key(config)]))
            continue
        if not pending:
            trace.stopped = ("stalled" if search.stalled else
                             "budget" if search.measured >= limit else "asks")
            break
        trial, config, rec = pending.popleft()
        ok = rec["status"] == "ok"
        cost = rec["cost_s"] if rec["status"] != "pruned" else table.pruned_cost_s
        first = min(rec.get("compile_s") or 0.0, cost)  # the first launch's share
        if ok and fidelity:
            cheap_ms, cheap_s = cheap_pass(rec, fidelity, seed)
            if search.cheap(trial, config, _result(rec, cheap_s, cheap_ms,
                                                   min(first, cheap_s))):
                total += cheap_s
                trace.cut += 1
                trace.steps.append(Step(len(trace.steps) + 1, search.asks, config, "cut",
                                        cheap_ms, cheap_s, total, best))
                continue
            # Timed in full after the cheap pass (compiled already): the cheap timing is
            # what multi-fidelity adds to the recorded cost.
            cost += cheap_s - (rec.get("compile_s") or 0.0)
            first = 0.0
        total += cost
        search.tell(trial, config, _result(rec, cost - (cheap_s if ok and fidelity else 0.0),
                                           compile_s=first))
        value = rec["median_ms"] if ok else None
        if ok:
            best = min(best, value)
        trace.steps.append(Step(len(trace.steps) + 1, search.asks, config,
                                "ok" if ok else "failed", value, cost, total, best))
    trace.asks = search.asks
    for t in search.study.get_trials(deepcopy=False):
        status = t.user_attrs.get(ATTR_STATUS)
        if status == "duplicate":
            trace.duplicates += 1
        elif status == "pruned" and t.user_attrs.get(ATTR_REASON) == UNRECORDED:
            trace.unrecorded_asks += 1
        elif status == "pruned":
            trace.pruned_asks += 1
    return trace


def metrics(trace: Trace, table: Table, tol: float = DEFAULT_TOL) -> dict[str, Any]:
    """Trials and GPU time until the best is within ``tol`` of the grid optimum.
    Unreached: ``trials_to_target`` and the costs are None."""
    target = table.optimum_ms * (1 + tol)
    grid_cost = table.grid_cost_s if trace.prune else table.unpruned_grid_cost_s
    hit = next((s for s in trace.steps if s.best_ms <= target), None)
    return {
        "case": table.name,
        "sampler": trace.sampler,
        "seed": trace.seed,
        "prune": trace.prune,
        "optimum_ms": table.optimum_ms,
        "best_ms": trace.best_ms,
        "reached": hit is not None,
        "trials_to_target": hit.trial if hit else None,
        "cost_to_target_s": hit.total_cost_s if hit else None,
        "grid_cost_s": grid_cost,
        "cost_fraction": hit.total_cost_s / grid_cost if hit and grid_cost > 0 else None,
        "trials": len(trace.steps),
        "cost_s": trace.steps[-1].total_cost_s if trace.steps else 0.0,
        "asks": trace.asks,
        "duplicates": trace.duplicates,
        "pruned_asks": trace.pruned_asks,
        "cut": trace.cut,
        "fidelity": trace.fidelity,
        "stopped": trace.stopped,
    }


def summary(table: Table, tol: float = DEFAULT_TOL) -> dict[str, Any]:
    """What a case is like: size, optimum, cost, and how many configs are near the top."""
    runnable = len(table.by_key) - len(table.of("pruned"))
    k = table.within(tol)
    return {
        "case": table.name,
        "device_name": table.data.get("device_name", ""),
        "date": table.data.get("date", ""),
        "commit": table.data.get("commit", ""),
        "grid": table.grid_size,
        "complete": table.complete,
        "ok": len(table.of("ok")),
        "failed": len(table.of("failed")),
        "pruned": len(table.of("pruned")),
        "optimum_ms": table.optimum_ms,
        "optimum": table.optimum,
        "within_tol": k,
        # Uniform sampling without replacement needs (n+1)/(k+1) trials on average to
        # draw one of k good configs among n: the bar any sampler has to beat.
        "random_expected_trials": (runnable + 1) / (k + 1),
        "grid_cost_s": table.grid_cost_s,
        "unpruned_grid_cost_s": table.unpruned_grid_cost_s,
        "pruning_saving": (1 - table.grid_cost_s / table.unpruned_grid_cost_s
                           if table.unpruned_grid_cost_s else 0.0),
    }


# -- command line -----------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.search.replay", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export", help="export the studies of one Optuna storage")
    e.add_argument("--storage", required=True, help="e.g. sqlite:///runs/EXP/optuna.db")
    e.add_argument("--out", required=True, help="a .json file (one study) or a directory")
    e.add_argument("--study", help="the study to export (default: all)")
    a = sub.add_parser("export-all", help="export every study under a runs directory")
    a.add_argument("--runs", default="runs")
    a.add_argument("--out", required=True)
    a.add_argument("--experiments", nargs="*", help="experiment names (default: all)")
    for x in (e, a):
        x.add_argument("--commit", help="the commit that ran the sweeps (default: this "
                       "checkout's, or $HARNESS_GIT_SHA)")
    r = sub.add_parser("run", help="replay one strategy against a table")
    r.add_argument("table")
    r.add_argument("--strategy", "--sampler", dest="sampler", default=None,
                   help="a registered strategy (search.strategy; default: its default)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--budget", type=int, default=None, help="GPU trials at most")
    r.add_argument("--no-prune", action="store_true")
    r.add_argument("--in-flight", type=int, default=1)
    r.add_argument("--tol", type=float, default=DEFAULT_TOL)
    c = sub.add_parser("check", help="exit 0 if an experiment's sweep is recorded completely")
    c.add_argument("config")
    s = sub.add_parser("summary", help="describe the tables under a directory")
    s.add_argument("root")
    s.add_argument("--tol", type=float, default=DEFAULT_TOL)
    args = p.parse_args(argv)

    if args.cmd in ("export", "export-all"):
        paths = (export(args.storage, args.out, args.study, args.commit)
                 if args.cmd == "export"
                 else export_all(args.runs, args.out, args.experiments, args.commit))
        for path in paths:
            t = Table.load(path)
            c = t.data["counts"]
            print(f"{path}: {c['ok']} ok / {c['failed']} failed / {c['pruned']} pruned of "
                  f"{t.grid_size}{'' if t.complete else ' (INCOMPLETE)'}")
        return 0 if paths else 1
    if args.cmd == "check":
        done, why = recorded(args.config)
        print(why)
        return 0 if done else 1
    if args.cmd == "run":
        from harness.experiment import SearchSettings
        from harness.search.strategies import registry

        table = Table.load(args.table)
        try:
            registry.get(args.sampler or SearchSettings().strategy)
        except registry.StrategyError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        trace = replay(table, args.sampler, args.seed, budget_trials=args.budget,
                       prune=not args.no_prune, in_flight=args.in_flight, tol=args.tol)
        print(json.dumps(metrics(trace, table, args.tol), indent=1))
        return 0
    tables = load_tables(args.root, complete_only=False)
    for t in tables:
        print(json.dumps(summary(t, args.tol)))
    return 0 if tables else 1


if __name__ == "__main__":
    sys.exit(main())
