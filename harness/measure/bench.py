"""The ``bench`` job: every zoo kernel at its seed shapes against its baselines.

Each case is measured side by side in one process on one GPU, so every ratio comes from
the same run: the pack's config for this device (runtime lookup, as an application would
get it), the kernel's default config, PyTorch eager, ``torch.compile`` of eager, any
extra baselines the family names (library calls users would pick instead), and the
roofline bound from the device's measured ceilings. All timing goes through
``harness.measure.timing`` (CUDA events via ``triton.testing.do_bench``, median, L2 flushed).
"""

from __future__ import annotations

import datetime as dt
import json
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from harness import packs
from harness.kernel import api as kernel_api
from harness.measure.timing import (
    Measurer,
    Timing,
    TrialResult,
    device_peaks,
    hardware,
    roofline_ms,
)
from harness.tracking import jsonsafe

ROOT = Path(__file__).resolve().parents[2]
TUNING_EXPERIMENT = ROOT / "configs" / "matmul_grid216.yaml"
#: Seconds of the budget kept for the cost sections (tuning run, lookup, decorator).
COST_RESERVE_S = 170.0


@dataclass(frozen=True)
class Case:
    kernel: str
    shape_name: str
    dtype: str
    compile: bool = True  # time torch.compile of eager too
    # ... and torch.compile(mode="max-autotune-no-cudagraphs"), where it compiles in
    # reasonable time
    max_autotune: bool = False


def load_cases(path: str | Path | None = None, only: list[str] | None = None) -> list[Case]:
    """The cases to measure: those each kernel family declares (``Kernel.bench``), of
    every built-in or of the kernels named in ``only`` (an installed plug-in's too), in
    name order with the max-autotune rows last (the slowest, which a short budget cuts
    first); or those of a cases YAML (``cases: [{kernel, shape, dtype, compile,
    max_autotune}]``) where ``path`` names one."""
    if path is None:
        cases = [Case(name, c.shape, c.dtype, c.compile and _compiles(name), c.max_autotune)
                 for name in (only or kernel_api.builtin_names())
                 for c in kernel_api.get(name).bench]
        return sorted(cases, key=lambda c: c.max_autotune)
    data = yaml.safe_load(Path(path).read_text()) or {}
    cases = [Case(c["kernel"], c["shape"], c["dtype"],
                  bool(c.get("compile", _compiles(c["kernel"]))),
                  bool(c.get("max_autotune", False)))
             for c in data.get("cases", [])]
    if only:
        cases = [c for c in cases if c.kernel in only]
    return cases


def _row(name: str, res: TrialResult, note: str = "") -> dict[str, Any]:
    return {"variant": name, "ok": res.ok, "reason": res.reason, "note": note,
            "p20_ms": res.p20_ms, "median_ms": res.latency_ms, "p80_ms": res.p80_ms,
            "tflops": res.tflops, "gbps": res.gbps, "roofline": res.roofline,
            "max_abs_err": res.max_abs_err, "max_rel_err": res.max_rel_err,
            "sm_clock_mhz": res.extra.get("sm_clock_mhz"), "power_w": res.extra.get("power_w")}


def _combine(results: list[TrialResult]) -> TrialResult:
    """One result from a variant's rounds: the median round's, with the median p20/p80 of
    the rounds and every round's median kept (``round_ms``). A failure in any round is the
    variant's result: a baseline that breaks once is not reported as working."""
    failed = [r for r in results if not r.ok]
    if failed or len(results) == 1:
        best = failed[0] if failed else results[0]
        best.extra["round_ms"] = [r.latency_ms for r in results if r.ok]
        return best
    by_median = sorted(results, key=lambda r: r.latency_ms)
    mid = by_median[(len(results) - 1) // 2]  # the lower median: an actual round
    mid.p20_ms = statistics.median(r.p20_ms for r in results)
    mid.p80_ms = statistics.median(r.p80_ms for r in results)
    mid.extra["round_ms"] = [r.latency_ms for r in results]
    return mid


def _compiles(kernel: str) -> bool:
    """Whether the family's torch.compile baseline is practical (``no_compile_baseline``)."""
    return not kernel_api.get(kernel).no_compile_baseline


def bench_case(case: Case, measurer: Measurer, peaks: dict[str, float], hw: str,
               seed: int = 0, rounds: int = 1) -> dict[str, Any]:
    """Every variant of the case, ``rounds`` times in turn (tuned, default, eager, ...,
    then again): a GPU whose clock drifts during the case (power and heat) slows every
    variant alike, so the ratios stay fair; each variant's figure is its median round."""
    fam = kernel_api.get(case.kernel)
    shape = fam.shapes[case.shape_name]
    hit = packs.lookup_entry(fam.name, case.dtype, hw, **shape)
    full = _full_precision(case.dtype)
    precision = {"tuned": fam.precision(hit.config, case.dtype),
                 "default config": fam.precision(fam.default_config, case.dtype),
                 "eager": full, "torch.compile": full}
    variants: list[tuple[str, str, Callable[[], TrialResult]]] = [
        ("tuned", f"pack {hit.source}" + (f" ({hit.shape_key})" if hit.source == "nearest"
                                          else ""),
         lambda: measurer.measure(fam, shape, case.dtype, hit.config, seed, peaks)),
        ("default config", "",
         lambda: measurer.measure(fam, shape, case.dtype, fam.default_config, seed, peaks)),
        ("eager", "", lambda: measurer.measure_eager(fam, shape, case.dtype, seed)),
    ]
    if case.compile:
        modes = [("torch.compile", None)]
        if case.max_autotune:
            modes.append(("torch.compile max-autotune", "max-autotune-no-cudagraphs"))
        for name, mode in modes:
            precision[name] = full
            variants.append(_compiled_variant(name, mode, fam, shape, case.dtype, seed,
                                              measurer))
    for name, make in _extra_baselines(fam).items():
        precision[name] = _baseline_precision(name, case.dtype)
        variants.append((name, "", lambda make=make: measurer.measure_fn(
            fam, shape, case.dtype, seed, make, peaks)))
    results: dict[str, list[TrialResult]] = {name: [] for name, _, _ in variants}
    for _ in range(max(1, rounds)):
        for name, _, run in variants:
            results[name].append(run())
    combined = {name: _combine(res) for name, res in results.items()}
    rows = []
    for name, note, _ in variants:
        row = _row(name, combined[name], note)
        row["round_ms"] = combined[name].extra.get("round_ms", [])
        row["precision"] = precision[name]
        # Each row's roofline from the matmul peak of its own precision; a bound row
        # computes another problem, so it has none.
        row["roofline_ms"] = (math.nan if name.startswith(BOUND) else
                              roofline_ms(fam, shape, case.dtype, peaks, precision[name]))
        rows.append(row)
    bound = roofline_ms(fam, shape, case.dtype, peaks, precision["tuned"])
    tuned = combined["tuned"]
    tuned_ms = tuned.latency_ms if tuned.ok else math.nan
    for r in rows:
        r["tuned_speedup"] = (r["median_ms"] / tuned_ms
                              if r["ok"] and tuned_ms == tuned_ms else math.nan)
    return {"kernel": fam.name, "shape_name": case.shape_name, "shape": fam.shape_key(shape),
            "dtype": case.dtype, "pack_config": hit.config, "pack_source": hit.source,
            "roofline_ms": bound, "flops": fam.flops(shape), "rounds": max(1, rounds),
            "bytes": fam.bytes_moved(shape, case.dtype), "rows": rows,
            "vs_default": vs_default(rows, fam.is_default(hit.config))}


def vs_default(rows: list[dict[str, Any]], same_config: bool) -> str:
    """The pack's entry against the kernel's default config, measured in the same rounds,
    by the rule that froze it (``harness.run.remeasure``): ``faster``, ``tie`` (within
    noise of each other and not slower in every round), ``slower``; ``same config``
    where the pack holds the default; ``-`` where either failed."""
    from harness.run.remeasure import Candidate, consistently_slower, within_noise

    by = {r["variant"]: r for r in rows}
    tuned, default = by.get("tuned"), by.get("default config")
    if not (tuned and default and tuned["ok"] and default["ok"]):
        return "-"
    if same_config:
        return "same config"
    def cand(row: dict[str, Any]) -> Candidate:
        samples = list(row.get("round_ms") or [row["median_ms"]])
        return Candidate({}, math.nan, samples=samples, rounds=list(range(len(samples))))

    t, d = cand(tuned), cand(default)
    if t.median <= d.median:
        return "faster" if not within_noise(d, t) else "tie"
    return "tie" if within_noise(t, d) and not consistently_slower(t, d) else "slower"


def _compiled_variant(name: str, mode: str | None, fam: kernel_api.Kernel, shape: dict,
                      dtype: str, seed: int, measurer: Measurer
                      ) -> tuple[str, str, Callable[[], TrialResult]]:
    """``torch.compile`` of the family's eager code (in ``mode``) as a bench variant:
    compiled once, before the rounds (its compile time is the note); a compile that failed
    is that failure in every round, not a new attempt per round."""
    import torch

    compiled = torch.compile(fam.eager, mode=mode)

    def make_compiled(i: dict, s: dict) -> Callable[[], Any]:
        return lambda: compiled(i, s)

    t0 = time.perf_counter()
    warm = measurer.measure_fn(fam, shape, dtype, seed, make_compiled)
    note = f"compiled in {time.perf_counter() - t0:.0f} s"
    return name, note, ((lambda: measurer.measure_fn(fam, shape, dtype, seed, make_compiled))
                        if warm.ok else (lambda: warm))


#: A baseline named so is a bound (another problem of the same size), not a library a
#: user could call instead: no roofline, and the tables say so.
BOUND = "bound: "


def _full_precision(dtype: str) -> str:
    """What the case's dtype computes in at full precision (fp32: IEEE, TF32 off)."""
    return "ieee fp32" if dtype == "fp32" else dtype


def _baseline_precision(name: str, dtype: str) -> str:
    """A library baseline's precision, as its name states it (``torch.bmm tf32``)."""
    for label in ("tf32x3", "tf32", "fp16", "bf16"):
        if label in name.split():
            return label
    return _full_precision(dtype)


def _extra_baselines(fam: kernel_api.Kernel) -> dict[str, Callable[[dict, dict], Callable]]:
    """The family's ``baselines()``: name -> (inputs, shape) -> zero-arg callable."""
    return dict(fam.baselines())


def environment(command: str) -> dict[str, Any]:
    import torch
    import triton

    env: dict[str, Any] = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda or getattr(torch.version, "hip", None),
        "python": sys.version.split()[0],
    }
    spec = hardware.current_device()
    env.update({"device_name": spec.name, "hardware": spec.key, "sm_count": spec.sm_count})
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        env["driver"] = out.stdout.strip().splitlines()[0] if out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        env["driver"] = None
    return env


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, spec)


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [
        f"# Benchmarks on {env['device_name']} ({env['hardware']})",
        "",
        f"- date: {env['date']}; driver {env.get('driver')}; torch {env['torch']}; "
        f"triton {env['triton']}; CUDA {env['cuda']}",
        f"- command: `{env['command']}`",
        *[f"- continued by ({r['date']}): `{r['command']}`: "
          + (r.get("note") or f"the cases the table lacked ({r['cases_before']} there before)")
          for r in report.get("continued_by", [])],
        "- timing: `triton.testing.do_bench`, CUDA events, median of the repetitions (p20-p80 "
        "shown), warm-up first, L2 cleared before every repetition, fresh random inputs; "
        "the variants of a case are measured in turn, in rounds, and each shows its median "
        "round (the spread of the round medians in the note).",
        f"- measured ceilings: {json.dumps(report['peaks'])}",
        "",
    ]
    for c in report["cases"]:
        lines += [
            f"## {c['kernel']} `{c['shape_name']}` ({c['shape']}, {c['dtype']})",
            "",
            f"roofline bound {_fmt(c['roofline_ms'], '.4g')} ms; pack config ({c['pack_source']}): "
            f"`{json.dumps(c['pack_config'], sort_keys=True)}`; against the default config "
            f"in the same rounds: **{c.get('vs_default', '-')}**",
            "",
            "| variant | precision | median ms | p20-p80 ms | tuned is faster by | % roofline "
            "| max abs err | note |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in c["rows"]:
            prec = r.get("precision", "-")
            # A row computing in less than the case's dtype says so in its name too, so that
            # an fp32 row is never a tf32 (or fp16-state) one in disguise.
            label = r["variant"] if prec in ("-", _full_precision(c["dtype"])) \
                or r["variant"].startswith(BOUND) else f"{r['variant']} ({prec})"
            if not r["ok"]:
                lines.append(f"| {label} | {prec} | failed | | | | | "
                             f"{r['reason'][:120]} |")
                continue
            bound = r.get("roofline_ms", c["roofline_ms"])
            # NaN in memory, null once written (a bench.json read back renders alike).
            roof = (bound / r["median_ms"] * 100 if bound is not None and bound == bound
                    else math.nan)
            rms = r.get("round_ms") or []
            note = "; ".join(x for x in (
                r["note"],
                f"{len(rms)} rounds {min(rms):.4g}-{max(rms):.4g}" if len(rms) > 1 else "",
                f"SM {r['sm_clock_mhz']:.0f} MHz" if r.get("sm_clock_mhz") else "")
                if x)
            lines.append(
                f"| {label} | {prec} | {_fmt(r['median_ms'], '.4g')} | "
                f"{_fmt(r['p20_ms'], '.4g')}-{_fmt(r['p80_ms'], '.4g')} | "
                f"{_fmt(r['tuned_speedup'], '.2f')}x | {_fmt(roof, '.0f')} | "
                f"{_fmt(r['max_abs_err'], '.2g')} | {note} |")
        lines.append("")
    lines += cost_markdown(report)
    return "\n".join(lines)


def cost_markdown(report: dict[str, Any]) -> list[str]:
    """The tuning, lookup and decorator sections (empty where they were not run)."""
    lines: list[str] = []
    t = report.get("tuning")
    if t:
        parts = ", ".join(f"{k} {v:.1f} s" for k, v in (t.get("overhead_s") or {}).items())
        lines += [
            "## Tuning cost", "",
            f"`kharness run {t['experiment']}` (exhaustive, {t['trials']} configs measured, "
            f"{t['pruned']} pruned statically, empty Triton cache):", "",
            "| wall s | GPU-held s | timing s | timing fraction | trials/hour (wall) "
            "| trials per GPU-hour | winner ms |",
            "|---|---|---|---|---|---|---|",
            f"| {_fmt(t['wall_s'], '.1f')} | {_fmt(t['gpu_held_s'], '.1f')} | "
            f"{_fmt(t['timing_s'], '.1f')} | {_fmt(t['timing_fraction'] * 100, '.0f')} % | "
            f"{_fmt(t['trials_per_hour'], '.0f')} | {_fmt(t['trials_per_gpu_hour'], '.0f')} | "
            f"{_fmt(t['winner_ms'], '.4g')} |", "",
            f"GPU-held time by phase: {parts}.", f"Winner: `{json.dumps(t['winner'])}`.", ""]
    lk = report.get("lookup")
    if lk:
        cached = ", ".join(f"{k} {v:.2f} µs" for k, v in lk["cached_us"].items())
        load, tgt = lk["load_ms"], lk["targets"]
        lines += ["## Runtime lookup", "",
                  f"Cached lookup (median): {cached} (target <= {tgt['cached_lookup_us']} µs). "
                  f"Loading every shipped pack {_fmt(load.get('all_shipped'), '.2f')} ms, a "
                  f"256-entry pack {_fmt(load.get('synthetic'), '.2f')} ms (target <= "
                  f"{tgt['load_ms']} ms). Raw: `{lk['file']}`.", ""]
    dec = report.get("decorator")
    if dec:
        lines += ["## Drop-in decorator: first call", "",
                  f"A bf16 matmul, {dec['n_configs']} configs; first call of a fresh process "
                  f"(cold or warm Triton cache). Raw: `{dec['file']}`.", "",
                  "| case | first call ms | kernel ms |", "|---|---|---|"]
        for k, v in dec["first_call_ms"].items():
            lines.append(f"| {k} | {_fmt(v, '.1f')} | {_fmt(dec['steady_ms'].get(k), '.4f')} |")
        lines.append("")
    return lines


@dataclass(frozen=True)
class CostSettings:
    """What the cost sections run: the tuning experiment, and how long the lookup
    benchmark repeats (``quick`` for smoke runs)."""

    tuning_experiment: Path = TUNING_EXPERIMENT
    quick: bool = False
    enabled: bool = True


class ResumeError(ValueError):
    """A bench.json that a ``--resume`` run cannot continue (another GPU or stack)."""


#: What a continued bench must share with the one it continues: one table, one stack.
SAME_STACK = ("hardware", "device_name", "torch", "triton", "cuda")


def _case_key(c: Case | dict[str, Any]) -> tuple[str, str, str]:
    d = c.__dict__ if isinstance(c, Case) else c
    return d["kernel"], d["shape_name"], d["dtype"]


def continued(out_dir: str | Path, hw: str, env: dict[str, Any]) -> dict[str, Any] | None:
    """The bench.json under ``out_dir`` for ``hw`` that a ``--resume`` run continues (None:
    there is none), with the run ``env`` recorded in its ``continued_by``; its skipped
    and failed cases are dropped (this run measures them again). ResumeError where it
    was measured on another device or stack: one table is one GPU and one stack."""
    path = Path(out_dir) / hw / "bench.json"
    if not path.is_file():
        return None
    try:
        prev = json.loads(path.read_text())
        first = prev["environment"]
        cases = prev["cases"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ResumeError(f"{path}: not a bench.json that --resume can continue ({exc})") from None
    differ = [f"{k} {first.get(k)!r} there, {env.get(k)!r} here" for k in SAME_STACK
              if first.get(k) != env.get(k)]
    if differ:
        raise ResumeError(f"{path} was measured on another device or stack ("
                          + "; ".join(differ) + "): run without --resume, or with another --out")
    prev["skipped"] = [s for s in prev.get("skipped", []) if "section" in s]
    prev["errors"] = [e for e in prev.get("errors", []) if "section" in e]
    prev.setdefault("continued_by", []).append(
        {"date": env["date"], "command": env["command"],
         "cases_before": len(cases)})
    return prev


def run_bench(out_dir: str | Path, kernels: list[str] | None, command: str,
              cases_file: str | Path | None = None, budget_s: float = 540.0,
              log: Callable[[str], None] = print,
              cost: CostSettings | None = None, rounds: int = 3,
              resume: bool = False) -> dict[str, Any]:
    """Benchmark every case, then the cost sections; write
    ``<out_dir>/<hardware>/bench.{json,md}`` (after each step: a cut run keeps its part).
    ``resume``: keep the cases and cost sections of the bench.json there (same device and
    stack) and measure only the ones it lacks: those a budget skipped, that failed, or
    that were added since."""
    cost = cost or CostSettings()
    t0 = time.monotonic()
    spec = hardware.current_device()
    env = environment(command)
    prev = continued(out_dir, spec.key, env) if resume else None
    measurer = Measurer(Timing())
    peaks = device_peaks(spec)
    report: dict[str, Any] = prev or {"environment": env, "peaks": peaks, "cases": []}
    done = {_case_key(c) for c in report["cases"]}
    wanted = load_cases(cases_file, kernels)
    for case in wanted:
        if _case_key(case) in done:
            continue
        left = budget_s - (COST_RESERVE_S if cost.enabled else 0) - (time.monotonic() - t0)
        if left < 20:
            log(f"bench: out of time budget, skipping {case}")
            report.setdefault("skipped", []).append(case.__dict__)
            continue
        if left < 120 and case.compile:
            case = Case(case.kernel, case.shape_name, case.dtype, compile=False)
        log(f"bench: {case.kernel} {case.shape_name} {case.dtype}")
        try:
            report["cases"].append(bench_case(case, measurer, peaks, spec.key, rounds=rounds))
        except Exception as exc:  # one broken case must not lose the others' results
            report.setdefault("errors", []).append({**case.__dict__, "error": repr(exc)[:500]})
            log(f"bench: {case} failed: {exc!r}"[:500])
        _write(out_dir, spec.key, report)
    # A continued table keeps the cases' order of a run of all of them, whichever
    # kernels this run measured.
    order = {_case_key(c): i for i, c in enumerate(load_cases(cases_file, None))}
    report["cases"].sort(key=lambda c: order.get(_case_key(c), len(order)))
    measurer.release()  # the cost runs below need the GPU's memory
    for name, fn in (("tuning", _tuning_cost), ("lookup", _lookup_cost),
                     ("decorator", _decorator_cost)):
        if not cost.enabled:
            break
        if name in report:  # measured by the run this one continues
            continue
        if name == "decorator" and spec.key == "cpu":
            report.setdefault("skipped", []).append(
                {"section": name, "why": "needs a GPU (triton.autotune's timing)"})
            continue
        left = budget_s - (time.monotonic() - t0)
        if left < 30:
            report.setdefault("skipped", []).append({"section": name, "why": "time budget"})
            continue
        log(f"bench: {name} cost")
        try:
            report[name] = fn(Path(out_dir) / spec.key, left, cost)
        except Exception as exc:  # a failed section is reported, the tables are kept
            report.setdefault("errors", []).append({"section": name, "error": repr(exc)[:500]})
            log(f"bench: {name} failed: {exc!r}"[:500])
        _write(out_dir, spec.key, report)
    if prev is not None:
        report["continued_by"][-1]["wall_s"] = time.monotonic() - t0
    else:
        report["wall_s"] = time.monotonic() - t0
    _write(out_dir, spec.key, report)
    return report


# -- cost: tuning, lookup, the decorator's first call -------------------------------------



def _child(args: list[str], timeout_s: float, env: dict[str, str] | None = None) -> str:
    """Run a benchmark step in its own process (its own CUDA context and Ray); raise with
    the tail of its output when it fails."""
    import os

    out = subprocess.run([sys.executable, *args], capture_output=True, text=True,
                         timeout=timeout_s, cwd=ROOT, env={**os.environ, **(env or {})})
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:3])} exited {out.returncode}: "
                           f"{(out.stderr or out.stdout)[-800:]}")
    return out.stdout


def _tuning_cost(where: Path, budget_s: float, cost: CostSettings) -> dict[str, Any]:
    """The 216-config matmul grid through the whole harness (local Ray, compile-ahead,
    MLflow, packs written to a scratch directory): wall time, trials per hour and where
    the GPU-held time went."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        text = _child(["-m", "harness", "run", str(cost.tuning_experiment), "--json",
                       "--set", f"output.packs_dir={tmp}/packs",
                       "--set", f"output.runs_dir={tmp}/runs",
                       "--set", f"tracking.uri=sqlite:///{tmp}/mlflow.db"], budget_s,
                      env={"TRITON_CACHE_DIR": f"{tmp}/triton-cache"})  # compiles for real
    summ = json.loads(text)
    rows = summ["rows"]
    trials = sum(sum(r["counts"].get(k, 0) for k in ("measured", "failed")) for r in rows)
    return {
        "experiment": _rel(cost.tuning_experiment), "trials": trials,
        "pruned": sum(r["counts"].get("pruned", 0) for r in rows),
        "wall_s": summ["wall_s"], "gpu_held_s": summ["gpu_held_s"],
        "timing_s": summ["kernel_timing_s"], "timing_fraction": summ["timing_fraction"],
        "trials_per_hour": trials / summ["wall_s"] * 3600 if summ["wall_s"] else math.nan,
        "trials_per_gpu_hour": (trials / summ["gpu_held_s"] * 3600 if summ["gpu_held_s"]
                                else math.nan),
        "overhead_s": summ.get("overhead_s", {}), "timeline_s": summ.get("timeline_s", {}),
        "winner": rows[0].get("params") if rows else None,
        "winner_ms": rows[0].get("latency_ms") if rows else None,
    }


def _rel(path: Path) -> str:
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _lookup_cost(where: Path, budget_s: float, cost: CostSettings) -> dict[str, Any]:
    path = where / "lookup.json"
    quick = ["--reps", "5", "--number", "20000", "--synthetic-entries", "64"] if cost.quick else []
    _child([str(ROOT / "benchmarks" / "lookup_bench.py"), "--out", str(path), *quick], budget_s)
    data = json.loads(path.read_text())
    return {"file": path.name, "cached_us": {k: v["median_us"] for k, v in
                                              data["cached"]["cases"].items()},
            "load_ms": {k: v["median_ms"] for k, v in data["load"].items() if k != "per_pack"},
            "first_lookup_ms": data["first_lookup"]["median_ms"],
            "targets": data["targets"], "pass": data.get("pass")}


def _decorator_cost(where: Path, budget_s: float, cost: CostSettings) -> dict[str, Any]:
    path = where / "decorator.json"
    _child([str(ROOT / "benchmarks" / "decorator_vs_autotune.py"), "--out", str(path),
            "--reps", "1"], budget_s)
    data = json.loads(path.read_text())
    return {"file": path.name, "n_configs": data["n_configs"],
            "first_call_ms": {k: v["first_call_ms_median"] for k, v in data["summary"].items()},
            "steady_ms": {k: v["steady_ms_median"] for k, v in data["summary"].items()}}


def _write(out_dir: str | Path, hw: str, report: dict[str, Any]) -> None:
    d = Path(out_dir) / hw
    d.mkdir(parents=True, exist_ok=True)
    (d / "bench.json").write_text(jsonsafe.dumps(report, indent=1, default=str))
    (d / "bench.md").write_text(markdown(report))
