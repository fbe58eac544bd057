"""Replay: run a tuning sampler against a recorded exhaustive sweep, without a GPU.

A *recorded table* is one study of a grid sweep (``configs/sweeps/*.yaml``, sampler
``grid``, trials = grid size) exported to a small JSON file, one per (hardware, kernel,
shape, dtype)::

    {"format": "kharness-replay/1", "kernel": ..., "shape": {...}, "dtype": ...,
     "hardware": "H200", "device_name": ..., "date": ..., "space": {param: [choices]},
     "grid_size": N, "complete": true, "default_config": {...},
     "trials": [{"config": {...}, "status": "ok" | "failed" | "pruned",
                 "median_ms", "p20_ms", "p80_ms", "cost_s", "reason", ...}, ...]}

**Cost of a trial** (``cost_s``, the GPU time the replay charges for it): the measuring
worker's ``timing_s`` (seconds inside the timer) plus its ``compile_s`` (the first launch:
compile, or with the workers' compile-ahead a load from Triton's cache), both from the
trial's stored result. Where ``compile_s`` is missing (a config that failed before its
first launch returned), the compile-ahead child's time (``precompile_s``) stands in, else
the median ``compile_s`` of the study's other trials. Pruned configs cost nothing: static
pruning rejects them on the driver. Not counted: the accuracy check and the worker's
waits, which every config pays alike.

**Replay** (:func:`replay`) runs a real Optuna study in memory with the harness's own
sampler construction (``harness.search.make_sampler``) and its ask/tell rules: every
config comes from the recorded space; a pruned config is told PRUNED at no cost; a config
already measured is answered from the study at no cost; a failed one is a FAIL that costs
its recorded time; a measured one returns its recorded median. The trace holds, per GPU
trial, the best latency so far and the GPU time spent. :func:`metrics` turns a trace into
the benchmark's numbers: trials and GPU time until the best is within ``tol`` (2 %) of
the grid optimum (the fastest recorded config), also as a fraction of the whole grid's
cost.

Command line::

    python -m harness.replay export --storage sqlite:///runs/EXP/optuna.db --out FILE_OR_DIR
    python -m harness.replay export-all --runs runs --out benchmarks/replay [--experiments ...]
    python -m harness.replay run TABLE.json --sampler tpe --seed 0
    python -m harness.replay summary benchmarks/replay
    python -m harness.replay check configs/sweeps/X.yaml   # exit 0: already recorded
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMAT = "kharness-replay/1"
STATUSES = ("ok", "failed", "pruned")
#: The harness's statuses -> the table's; duplicates and interrupted trials are skipped.
_FROM_HARNESS = {"measured": "ok", "failed": "failed", "pruned": "pruned"}
DEFAULT_TOL = 0.02


def config_key(config: Mapping[str, Any]) -> str:
    """The same key as ``harness.search.config_key`` (kept here so that reading tables
    needs no Optuna)."""
    return json.dumps(dict(config), sort_keys=True)


def _num(x: Any) -> float | None:
    """A finite float rounded to 6 significant digits, else None (keeps the files small)."""
    try:
        f = float(x)
    except (TypeError, ValueError):
        return None
    return float(f"{f:.6g}") if math.isfinite(f) else None


# -- recorded tables ------------------------------------------------------------------


@dataclass
class Table:
    """One recorded exhaustive sweep (a loaded table file)."""

    data: dict[str, Any]
    path: str = ""

    def __post_init__(self) -> None:
        self.space: dict[str, list[Any]] = {k: list(v) for k, v in self.data["space"].items()}
        self.trials: list[dict[str, Any]] = list(self.data["trials"])
        self.by_key = {config_key(t["config"]): t for t in self.trials}

    @classmethod
    def load(cls, path: str | Path) -> Table:
        with open(path) as f:
            data = json.load(f)
        if data.get("format") != FORMAT:
            raise ValueError(f"{path}: not a {FORMAT} table")
        return cls(data, str(path))

    # -- what it holds ------------------------------------------------------------------
    @property
    def name(self) -> str:
        d = self.data
        shape = ",".join(f"{k}={v}" for k, v in d["shape"].items())
        partial = "" if self.complete else f" (sub-grid: {len(self.by_key)} of {self.grid_size})"
        return f"{d['hardware']}/{d['kernel']}/{shape}/{d['dtype']}{partial}"

    @property
    def grid_size(self) -> int:
        n = 1
        for choices in self.space.values():
            n *= len(choices)
        return n

    @property
    def complete(self) -> bool:
        """Every grid point has a record (a sweep cut short leaves holes)."""
        return len(self.by_key) >= self.grid_size

    def of(self, status: str) -> list[dict[str, Any]]:
        return [t for t in self.trials if t["status"] == status]

    @property
    def optimum_ms(self) -> float:
        """The grid optimum: the fastest recorded median."""
        return min(t["median_ms"] for t in self.of("ok"))

    @property
    def optimum(self) -> dict[str, Any]:
        return min(self.of("ok"), key=lambda t: t["median_ms"])["config"]

    @property
    def grid_cost_s(self) -> float:
        """GPU time of the whole (statically pruned) grid: what our exhaustive sweep paid."""
        return sum(t["cost_s"] for t in self.trials if t["status"] != "pruned")

    @property
    def pruned_cost_s(self) -> float:
        """Estimated GPU time a pruned config would cost if it were launched anyway: that
        of a typical measured config (the median). Some would fail at their first launch
        (shared memory) and cost less, others (register spills) run and cost as much."""
        est = self.data.get("pruned_cost_estimate_s")
        return float(est) if est is not None else _pruned_estimate(self.trials)

    @property
    def unpruned_grid_cost_s(self) -> float:
        """GPU time of the grid without static pruning (every config launched)."""
        return self.grid_cost_s + len(self.of("pruned")) * self.pruned_cost_s

    def within(self, tol: float = DEFAULT_TOL) -> int:
        """How many configs are within ``tol`` of the optimum (how easy the case is)."""
        target = self.optimum_ms * (1 + tol)
        return sum(1 for t in self.of("ok") if t["median_ms"] <= target)

    def lookup(self, config: Mapping[str, Any]) -> dict[str, Any] | None:
        return self.by_key.get(config_key(config))


def _compile_estimate(trials: Sequence[Mapping[str, Any]]) -> float:
    """The median time to compile one config: the compile-ahead child's time where
    recorded (the real compile), else the worker's first launch."""
    xs = [t.get("precompile_s") for t in trials if t.get("precompile_s") is not None]
    if not xs:
        xs = [t.get("compile_s") for t in trials if t.get("compile_s") is not None]
    return float(statistics.median(xs)) if xs else 1.0


def _pruned_estimate(trials: Sequence[Mapping[str, Any]]) -> float:
    xs = [t["cost_s"] for t in trials if t["status"] == "ok" and t.get("cost_s") is not None]
    return float(statistics.median(xs)) if xs else 0.0


def load_tables(root: str | Path, complete_only: bool = True) -> list[Table]:
    """Every table under ``root`` (``<root>/<HW>/*.json``, or ``root`` itself a file)."""
    root = Path(root)
    paths = [root] if root.is_file() else sorted(root.glob("*/*.json"))
    tables = []
    for p in paths:
        try:
            t = Table.load(p)
        except (ValueError, KeyError, json.JSONDecodeError):
            continue  # report files and anything else that is not a table
        if t.of("ok") and (t.complete or not complete_only):
            tables.append(t)
    return tables


def dumps(table: Mapping[str, Any]) -> str:
    """JSON with one trial per line: small, and diffs of a re-recorded sweep stay legible."""
    head = [f" {json.dumps(k)}: {json.dumps(v)}" for k, v in table.items() if k != "trials"]
    rows = ",\n".join("  " + json.dumps(t) for t in table["trials"])
    return "{\n" + ",\n".join(head) + ',\n "trials": [\n' + rows + "\n ]\n}\n"


# -- export from an Optuna study --------------------------------------------------------


def _split_study_name(name: str) -> dict[str, Any]:
    """``experiment/kernel/shape_key/dtype/hardware`` (``StudySpec.name``)."""
    parts = name.split("/")
    if len(parts) != 5:
        raise ValueError(f"study {name!r} is not named experiment/kernel/shape/dtype/hardware")
    experiment, kernel, shape_key, dtype, hardware = parts
    shape = {}
    for item in shape_key.split(","):
        k, _, v = item.partition("=")
        shape[k] = int(v)
    return {"experiment": experiment, "kernel": kernel, "shape": shape, "shape_key": shape_key,
            "dtype": dtype, "hardware": hardware}


def case_filename(kernel: str, shape: Mapping[str, int], dtype: str) -> str:
    shape_part = "_".join(f"{k}{v}" for k, v in shape.items())
    safe_kernel = "".join(c if c.isalnum() or c in "-_" else "-" for c in kernel)
    return f"{safe_kernel}__{shape_part}__{dtype}.json"


def _record(t: Any, status: str) -> dict[str, Any]:
    from harness.search import ATTR_REASON, ATTR_RESULT

    res = t.user_attrs.get(ATTR_RESULT) or {}
    extra = res.get("extra") or {}
    pre = extra.get("precompile") or {}
    rec: dict[str, Any] = {"config": dict(t.params), "status": status}
    if status == "ok":
        rec.update(median_ms=_num(res.get("latency_ms", t.value)), p20_ms=_num(res.get("p20_ms")),
                   p80_ms=_num(res.get("p80_ms")))
    if status != "pruned":
        rec.update(timing_s=_num(res.get("timing_s")) or 0.0, compile_s=_num(res.get("compile_s")),
                   precompile_s=_num(pre.get("compile_s")))
    reason = t.user_attrs.get(ATTR_REASON) or res.get("reason")
    if status != "ok" and reason:
        rec["reason"] = str(reason).splitlines()[0][:200]
    return rec


def export_study(storage: Any, study_name: str) -> dict[str, Any]:
    """One study of a sweep as a recorded table (see the module docstring)."""
    import optuna

    from harness.search import ATTR_RESULT, ATTR_STATUS

    meta = _split_study_name(study_name)
    study = optuna.load_study(study_name=study_name, storage=storage)
    trials = study.get_trials(deepcopy=False)
    space: dict[str, list[Any]] = {}
    records: dict[str, dict[str, Any]] = {}
    device_name, started = "", None
    for t in trials:
        for name, dist in t.distributions.items():
            if name not in space and hasattr(dist, "choices"):
                space[name] = list(dist.choices)
        if t.datetime_start and (started is None or t.datetime_start < started):
            started = t.datetime_start
        status = _FROM_HARNESS.get(t.user_attrs.get(ATTR_STATUS, ""))
        if status is None or not t.params:
            continue  # duplicates (answered from the study), interrupted, unfinished
        ok_state = {"ok": optuna.trial.TrialState.COMPLETE, "failed": optuna.trial.TrialState.FAIL,
                    "pruned": optuna.trial.TrialState.PRUNED}[status]
        if t.state != ok_state:
            continue
        key = config_key(t.params)
        if key in records and records[key]["status"] != "pruned":
            continue  # the first measurement of a config counts
        records[key] = _record(t, status)
        device_name = device_name or ((t.user_attrs.get(ATTR_RESULT) or {}).get("extra")
                                      or {}).get("device_name", "")
    recs = list(records.values())
    fallback = _compile_estimate(recs)
    for r in recs:
        if r["status"] == "pruned":
            r["cost_s"] = 0.0
            continue
        compile_s = r.get("compile_s")
        if compile_s is None:
            compile_s = r.get("precompile_s") if r.get("precompile_s") is not None else fallback
        r["cost_s"] = _num(r["timing_s"] + compile_s)
        for k in [k for k, v in r.items() if v is None]:
            del r[k]
    attrs = study.user_attrs
    eager = (attrs.get("eager") or {}).get("latency_ms")
    default = (attrs.get("default") or {}).get("latency_ms")
    if not device_name:
        device_name = ((attrs.get("eager") or {}).get("extra") or {}).get("device_name", "")
    grid = 1
    for choices in space.values():
        grid *= len(choices)
    try:
        from harness import kernel_api

        default_config = dict(kernel_api.get(meta["kernel"]).default_config)
    except Exception:  # a family that cannot be imported here: the replay skips warm start
        default_config = None
    return {
        "format": FORMAT,
        "kernel": meta["kernel"],
        "shape": meta["shape"],
        "dtype": meta["dtype"],
        "hardware": meta["hardware"],
        "device_name": device_name,
        "date": started.date().isoformat() if started else "",
        "experiment": meta["experiment"],
        "study": study_name,
        "space": space,
        "grid_size": grid,
        "complete": len(recs) >= grid,
        "counts": {s: sum(1 for r in recs if r["status"] == s) for s in STATUSES},
        "default_config": default_config,
        "baselines_ms": {"eager": _num(eager), "default": _num(default)},
        "pruned_cost_estimate_s": _num(_pruned_estimate(recs)),
        "cost_model": "cost_s = timing_s + compile_s of the measuring worker (see "
                      "harness/replay.py); pruned configs cost 0",
        "trials": recs,
    }


def _storage(url: str) -> Any:
    from harness.search import make_storage

    return make_storage(url)


def export(storage_url: str, out: str | Path, study: str | None = None) -> list[Path]:
    """Export the studies of one Optuna storage. ``out`` ending in ``.json`` is the file
    for a single study; otherwise it is a directory and each study goes to
    ``<out>/<hardware>/<kernel>__<shape>__<dtype>.json``."""
    import optuna

    storage = _storage(storage_url)
    names = [study] if study else [s.study_name for s in optuna.get_all_study_summaries(storage)]
    out = Path(out)
    if out.suffix == ".json" and len(names) != 1:
        raise ValueError(f"{storage_url} holds {len(names)} studies: name one with --study, "
                         "or give a directory as --out")
    written = []
    for name in names:
        table = export_study(storage, name)
        path = out if out.suffix == ".json" else (out / table["hardware"] / case_filename(
            table["kernel"], table["shape"], table["dtype"]))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(dumps(table))
        written.append(path)
    return written


def export_all(runs_dir: str | Path, out_dir: str | Path,
               experiments: Iterable[str] | None = None) -> list[Path]:
    """Export every study of every experiment under ``runs_dir`` (or of the named ones)."""
    runs_dir = Path(runs_dir)
    names = list(dict.fromkeys(experiments)) if experiments is not None else sorted(
        p.parent.name for p in runs_dir.glob("*/optuna.db"))
    written = []
    for name in names:
        db = runs_dir / name / "optuna.db"
        if db.is_file():
            written += export(f"sqlite:///{db.resolve()}", out_dir)
    return written


def recorded(config_path: str | Path) -> tuple[bool, str]:
    """Whether an experiment's sweep is already recorded completely in its runs dir:
    every (shape, dtype) has a study there and every study holds the whole grid."""
    import optuna

    from harness import experiment

    exp = experiment.load(config_path)
    db = Path(exp.output.runs_dir) / exp.name / "optuna.db"
    if not db.is_file():
        return False, f"no {db}"
    storage = _storage(f"sqlite:///{db.resolve()}")
    names = [s.study_name for s in optuna.get_all_study_summaries(storage)]
    if len(names) < len(exp.shapes) * len(exp.dtypes):
        return False, f"{len(names)} of {len(exp.shapes) * len(exp.dtypes)} studies in {db}"
    for name in names:
        table = export_study(storage, name)
        if not table["complete"]:
            return False, f"{name}: {len(table['trials'])} of {table['grid_size']} configs"
    return True, f"{len(names)} complete studies in {db}"


# -- replay -----------------------------------------------------------------------------


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


def _settings(name: str, trials: int, warm_start: bool, **kw: Any) -> Any:
    from harness.experiment import SearchSettings

    return SearchSettings(sampler=name, trials=trials, warm_start=warm_start, **kw)


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


def replay(table: Table, sampler: str | Any = "tpe", seed: int = 0, *,
           budget_trials: int | None = None, prune: bool = True, warm_start: bool = True,
           in_flight: int = 1, stop_at_target: bool = True, tol: float = DEFAULT_TOL,
           enqueue: Sequence[Mapping[str, Any]] = (), max_asks: int | None = None,
           max_stall: int | None = 200, fidelity: float | None = None,
           pruner: str = "threshold", prune_margin: float = 0.10,
           prune_startup: int = 4) -> Trace:
    """Tune ``table``'s case with ``sampler`` (a name for ``harness.search.make_sampler``
    or an Optuna sampler), answering every config from the record.

    ``prune``: static pruning as in the harness (pruned configs cost nothing); without it
    a pruned config is launched, fails, and costs ``table.pruned_cost_s``.
    ``warm_start``: the harness's default: the kernel's default config goes first.
    ``in_flight``: configs asked before the oldest one's result is told (the harness keeps
    ``queue_depth`` per GPU in flight; TPE then runs with a constant liar).
    ``stop_at_target``: stop once the best is within ``tol`` of the grid optimum.
    ``enqueue``: configs to try first, in order (after the default config).
    ``max_asks``: the harness's own limit (20 asks per budgeted trial plus the grid).
    ``max_stall``: stop after this many asks in a row that brought no new config (a
    sampler that keeps proposing pruned, failed or measured configs; the harness would go
    on until ``max_asks`` without measuring anything more). None: no such stop.
    ``fidelity``: multi-fidelity, as ``search.pruner`` does live: each runnable config is
    first timed cheaply (``cheap_pass``: this fraction of the full repetitions), reported
    to Optuna as step 0, and ``pruner`` (``harness.search.make_pruner``) decides whether it
    is timed in full (then it costs the recorded cost plus the cheap timing, and its value
    is the recorded median) or stops there (told PRUNED, a GPU trial at the cheap cost).
    """
    import optuna
    from optuna.trial import TrialState

    from harness.search import make_pruner, make_sampler

    space = table.space
    n_pruned = len(table.of("pruned"))
    runnable = len(table.by_key) - (n_pruned if prune else 0)
    limit = min(budget_trials or runnable, runnable)
    name = sampler if isinstance(sampler, str) else type(sampler).__name__
    settings = _settings(name if isinstance(sampler, str) else "tpe", limit, warm_start,
                         pruner=pruner if fidelity else "none", prune_margin=prune_margin,
                         prune_startup_trials=prune_startup)
    if isinstance(sampler, str):
        sampler = make_sampler(settings, space, seed, n_parallel=in_flight)
    study = optuna.create_study(direction="minimize", sampler=sampler,
                                pruner=make_pruner(settings))
    first = []
    default = table.data.get("default_config")
    if warm_start and default:
        cfg = {k: default.get(k) for k in space}
        if all(cfg[k] in space[k] for k in space):
            first.append(cfg)
    for cfg in [*first, *enqueue]:
        study.enqueue_trial(dict(cfg))
    max_asks = max_asks if max_asks is not None else 20 * limit + table.grid_size
    target = table.optimum_ms * (1 + tol)

    trace = Trace(table.name, name, seed, prune, fidelity=fidelity)
    seen: dict[str, float | None] = {}  # config -> latency; None failed; NaN in flight
    cut: set[str] = set()  # configs stopped after their cheap pass
    pending: deque[tuple[Any, dict[str, Any], dict[str, Any], str]] = deque()
    total, best = 0.0, math.inf
    stall = 0
    while True:
        if stop_at_target and best <= target:
            trace.stopped = "target"
            break
        stalled = max_stall is not None and stall >= max_stall
        if stalled:
            trace.stopped = "stalled"
        if (len(pending) < in_flight and len(seen) < limit and trace.asks < max_asks
                and not stalled):
            trace.asks += 1
            stall += 1
            trial = study.ask()
            config = {k: trial.suggest_categorical(k, choices) for k, choices in space.items()}
            key = config_key(config)
            rec = table.by_key.get(key)
            if rec is None:
                if table.complete:
                    raise KeyError(f"{table.name}: no record of {key}")
                # A sweep cut short: replay over the sub-grid it measured. A config it
                # never reached is outside that sub-grid, like a pruned one: no cost.
                trace.unrecorded_asks += 1
                study.tell(trial, state=TrialState.PRUNED)
                continue
            if rec["status"] == "pruned" and prune:
                trace.pruned_asks += 1
                study.tell(trial, state=TrialState.PRUNED)
                continue
            if key in seen:
                # The harness answers a repeated config from the study, at no GPU cost.
                trace.duplicates += 1
                value = seen[key]
                if key in cut:
                    study.tell(trial, state=TrialState.PRUNED)
                elif value is None or math.isnan(value):
                    study.tell(trial, state=TrialState.FAIL)
                else:
                    study.tell(trial, value)
                continue
            seen[key] = math.nan
            stall = 0
            pending.append((trial, config, rec, key))
            continue
        if not pending:
            trace.stopped = trace.stopped or ("budget" if len(seen) >= limit else "asks")
            break
        trial, config, rec, key = pending.popleft()
        ok = rec["status"] == "ok"
        cost = rec["cost_s"] if rec["status"] != "pruned" else table.pruned_cost_s
        if ok and fidelity:
            cheap_ms, cheap_s = cheap_pass(rec, fidelity, seed)
            trial.report(cheap_ms, 0)
            if trial.should_prune():
                total += cheap_s
                cut.add(key)
                seen[key] = cheap_ms
                trace.cut += 1
                study.tell(trial, state=TrialState.PRUNED)
                trace.steps.append(Step(len(trace.steps) + 1, trace.asks, config, "cut",
                                        cheap_ms, cheap_s, total, best))
                continue
            # Timed in full after the cheap pass (compiled already): the cheap timing is
            # what multi-fidelity adds to the recorded cost.
            cost += cheap_s - (rec.get("compile_s") or 0.0)
        total += cost
        if ok:
            value = rec["median_ms"]
            seen[key] = value
            best = min(best, value)
            study.tell(trial, value)
        else:
            value = None
            seen[key] = None
            study.tell(trial, state=TrialState.FAIL)
        trace.steps.append(Step(len(trace.steps) + 1, trace.asks, config,
                                "ok" if ok else "failed", value, cost, total, best))
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
    p = argparse.ArgumentParser(prog="python -m harness.replay", description=__doc__.split(
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
    r = sub.add_parser("run", help="replay one sampler against a table")
    r.add_argument("table")
    r.add_argument("--sampler", default="tpe")
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
        paths = (export(args.storage, args.out, args.study) if args.cmd == "export"
                 else export_all(args.runs, args.out, args.experiments))
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
        table = Table.load(args.table)
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
