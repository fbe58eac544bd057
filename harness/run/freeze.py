"""Freezing: each study's winner, with its metrics against the baselines, written into
its (hardware, kernel) pack (``harness.packs``), and the summary's row of each study.
"""

from __future__ import annotations

import datetime as dt
import math
import shutil
from pathlib import Path
from typing import Any

from harness import experiment
from harness.packs import format as packfmt
from harness.tracking.tracker import git_sha


def _speedup(base: Any, new: Any) -> float:
    if not base or not new or not (base == base) or not (new == new):
        return math.nan
    return float(base) / float(new)


#: What a re-measurement replaces in the winner's metrics: its timing and the rates
#: derived from it.
_TIMED = ("latency_ms", "p20_ms", "p80_ms", "tflops", "gbps", "roofline")


def outcome(st: Any) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The study's winner (full config) and its metrics against the baselines."""
    best = st.search.best()
    if best is None:
        return None
    config, res = best
    extra: dict[str, Any] = {}
    if st.final is not None:
        winner = next(c for c in st.candidates if c.config == st.final[0])
        # The incumbent may rank below the top k by its search measurement, or, outside
        # the search's space, have none: then its re-measurement (accuracy included)
        # stands in.
        config, res = winner.config, next((r for c, r in st.search.top(10**9)
                                           if c == winner.config), winner.median_result)
        # Latency, p20/p80 and rates of one re-measurement (the median one), not the
        # search's rates beside a re-measured latency; the accuracy stays the search's.
        timed = {k: v for k, v in winner.median_result.items() if k in _TIMED}
        res = {**res, **timed} if timed else {**res, "latency_ms": winner.median}
        extra = {"search_latency_ms": winner.search_ms, "remeasured_ms": winner.median,
                 "remeasure_min_ms": winner.lo, "remeasure_max_ms": winner.hi,
                 "remeasure_spread": winner.spread, "remeasure_rounds": len(winner.samples),
                 "remeasure_candidates": len(st.candidates)}
    fam = st.family
    default_res = st.default or {}
    eager_ms = (st.eager or {}).get("latency_ms")
    compile_ms = (st.compiled or {}).get("latency_ms")
    metrics = {k: res.get(k) for k in ("latency_ms", "p20_ms", "p80_ms", "tflops", "gbps",
                                       "roofline", "max_abs_err", "max_rel_err")}
    metrics.update({
        "eager_latency_ms": eager_ms,
        "default_latency_ms": default_res.get("latency_ms"),
        "compile_latency_ms": compile_ms,
        "speedup_vs_eager": _speedup(eager_ms, res.get("latency_ms")),
        "speedup_vs_compile": _speedup(compile_ms, res.get("latency_ms")),
        "speedup_vs_default": _speedup(default_res.get("latency_ms"), res.get("latency_ms")),
        **extra,
    })
    return {**fam.default_config, **config}, metrics


def freeze(exp: experiment.Experiment, studies: list[Any], tracker: Any,
           parent: str) -> list[str]:
    """Write each study's winner into its (hardware, kernel) pack; its best config and
    metrics go to its MLflow run through ``tracker`` (``Tracker.log``'s signature: the
    run's logger, so that freezing never waits on MLflow)."""
    groups: dict[tuple[str, str, str], dict[str, dict[str, Any]]] = {}
    now = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    for st in studies:
        out = outcome(st)
        if out is None:
            continue
        config, metrics = out
        w = st.worker
        fam = st.family
        tol = fam.tolerance(st.spec.dtype, config)
        # The bound the entry met: the family's tolerance, and the experiment's own where set.
        bound = {"atol": tol.atol, "rtol": tol.rtol, **{
            k: getattr(exp.search, k) for k in ("max_abs_err", "max_rel_err")
            if getattr(exp.search, k) is not None}}
        groups.setdefault((st.spec.hardware, fam.name, st.spec.dtype), {})[
            st.spec.shape_key] = {
            "config": config,
            "metrics": metrics,
            "provenance": {
                "device_name": w["device_name"], "triton": w["triton"], "torch": w["torch"],
                "cuda": w["cuda"], "date": now, "mlflow_run_id": st.run_id,
                "experiment": exp.name, "git_sha": git_sha(),
                "interpreted": w["interpreted"], "trials": st.search.counts(),
                "precision": fam.precision(config, st.spec.dtype), "accuracy_bound": bound,
            },
        }
        why = {"winner_reason": st.final[1]} if st.final else {}
        tracker.log(st.run_id, params={**{f"best.{k}": v for k, v in config.items()}, **why},
                    metrics={f"best_{k}": v for k, v in metrics.items()})
    paths = []
    for (hw, name, dtype), entries in groups.items():
        paths.append(str(packfmt.freeze(exp.output.packs_dir, hw, name, dtype, entries)))
    return sorted(set(paths))


def row(st: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "hardware": st.spec.hardware, "kernel": st.spec.kernel, "shape": st.spec.shape_key,
        "dtype": st.spec.dtype, "counts": st.search.counts(), "mlflow_run_id": st.run_id,
        "failures": [r for _, r in st.search.failures()][:5],
    }
    out = outcome(st)
    if out is None:  # nothing frozen for this study: the summary says why
        row["not_tuned"] = st.search.not_tuned()
    if out:
        row["config"], metrics = out
        row["params"] = st.final[0] if st.final else st.search.best()[0]  # type: ignore[index]
        row.update(metrics)
        row["winner_found"] = st.search.found_at(row["params"])
        timed_in = ((st.compiled or {}).get("extra") or {}).get("timed_in")
        if timed_in:  # the worker's own torch.compile process (``compiled_baseline``)
            row["compile_timed_in"] = timed_in
        if st.final:
            row["winner_reason"] = st.final[1]
            # Every candidate's re-measurements, in round order: why this one won.
            row["remeasured"] = [
                {"config": c.config, "search_ms": c.search_ms,
                 "samples_ms": [x for _, x in sorted(zip(c.rounds, c.samples, strict=True))],
                 "median_ms": c.median, "incumbent": bool(st.incumbent)
                 and c.config == st.incumbent[0]} for c in st.candidates]
    return row


def previous_packs_dir(exp: experiment.Experiment) -> Path:
    return Path(exp.output.runs_dir) / exp.name / "previous_packs"


def keep_previous_packs(exp: experiment.Experiment, studies: list[Any]) -> None:
    """Copy the packs this run is about to change into runs/<name>/previous_packs/, so
    that the report can show what the run changed (a pack not there before has none)."""
    dest_root = previous_packs_dir(exp)
    if dest_root.exists():
        shutil.rmtree(dest_root)
    for hw, name in {(st.spec.hardware, st.family.name) for st in studies}:
        src = packfmt.pack_path(exp.output.packs_dir, hw, name)
        if src.is_file():
            dest = dest_root / hw / src.name
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest)

