"""``kharness bench --regret``: what this GPU loses running a sibling GPU's pack.

For each bench case, on the GPU at hand: this GPU's own pack entry, each sibling's pack
entry (``harness.measure.families``: H100's on an H200 and the other way round) and the
kernel's default config, measured in the same interleaved rounds as ``kharness bench``
(own, sibling, ..., default, then again), each figure its median round. The regret of a
sibling is its time over the own pack's: what a GPU nobody tuned for gives up by falling
back to that sibling's pack, estimated on a GPU that has both. A sibling entry with the
own entry's config is that config (regret 1, not measured twice); one that fails this
GPU's checks is reported, not run.

Writes ``<out>/<hardware>/regret.{json,md}`` after every case (a cut run keeps its part).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import packs
from harness.kernel import api as kernel_api
from harness.measure import bench, families, hardware
from harness.measure.timing import Measurer, Timing, TrialResult, device_peaks
from harness.tracking import jsonsafe

DEFAULT = "default config"


@dataclass(frozen=True)
class Variant:
    """One config of a case: whose pack it comes from and how it matched the shape."""

    label: str  # "own (H200)", "H100 pack", "default config"
    hardware: str | None  # the pack's hardware key; None for the default config
    source: str  # "exact", "nearest" or "default"
    shape_key: str | None
    config: dict[str, Any]


def sibling_keys(hw: str, given: list[str] | None = None) -> list[str]:
    """The siblings to compare: ``given``, else this GPU's family, the closest first."""
    if given:
        return [k for k in dict.fromkeys(given) if k != hw]
    spec = hardware.current_device()
    return list(families.siblings(hw, hardware.current_arch(), spec.name, spec.sm_count))


def variants(fam: kernel_api.Kernel, shape: dict[str, int], dtype: str, hw: str,
             siblings: list[str], spec: kernel_api.DeviceSpec
             ) -> tuple[list[Variant], list[dict[str, Any]]]:
    """The configs to measure (own, siblings, default) and the siblings left out, each
    with why (no entry for the shape, the own config again, fails this GPU's checks)."""
    out: list[Variant] = []
    left: list[dict[str, Any]] = []
    own = packs.pack_entry(hw, fam, dtype, shape)
    if own is not None:
        out.append(Variant(f"own ({hw})", hw, own.source, own.shape_key, own.config))
    for sib in siblings:
        hit = packs.pack_entry(sib, fam, dtype, shape)
        if hit is None:
            left.append({"hardware": sib, "why": f"no {sib} pack entry near the shape"})
            continue
        try:
            why = fam.check_config(hit.config, shape, spec)
        except Exception as exc:  # noqa: BLE001 - a kernel's check failing is a "no"
            why = f"check_config raised {type(exc).__name__}: {exc}"
        if why:
            left.append({"hardware": sib, "why": f"fails this GPU's checks: {why}",
                         "config": hit.config})
            continue
        v = Variant(f"{sib} pack", sib, hit.source, hit.shape_key, hit.config)
        if own is not None and hit.config == own.config:
            left.append({"hardware": sib, "why": "the own pack's config", "same_as_own": True,
                         "source": hit.source, "shape_key": hit.shape_key})
            continue
        out.append(v)
    out.append(Variant(DEFAULT, None, "default", None, dict(fam.default_config)))
    return out, left


def regret_case(case: bench.Case, measurer: Measurer, peaks: dict[str, float], hw: str,
                siblings: list[str], spec: kernel_api.DeviceSpec, seed: int = 0,
                rounds: int = 3) -> dict[str, Any]:
    """Own, sibling and default configs of one case, ``rounds`` times in turn."""
    fam = kernel_api.get(case.kernel)
    shape = fam.shapes[case.shape_name]
    chosen, left = variants(fam, shape, case.dtype, hw, siblings, spec)
    results: dict[str, list[TrialResult]] = {v.label: [] for v in chosen}
    for _ in range(max(1, rounds)):
        for v in chosen:
            results[v.label].append(measurer.measure(fam, shape, case.dtype, v.config, seed,
                                                     peaks))
    rows = []
    for v in chosen:
        res = bench._combine(results[v.label])
        row = bench._row(v.label, res, f"{v.source} {v.shape_key}" if v.shape_key else "")
        row.update(hardware=v.hardware, source=v.source, shape_key=v.shape_key,
                   config=v.config, round_ms=res.extra.get("round_ms", []))
        rows.append(row)
    by = {r["variant"]: r for r in rows}
    own = next((r for r in rows if r["variant"].startswith("own (")), None)
    own_ms = own["median_ms"] if own and own["ok"] else math.nan
    regret: dict[str, float] = {}
    for r in rows:
        if r["hardware"] not in (None, hw):
            regret[r["hardware"]] = (r["median_ms"] / own_ms if r["ok"] else math.nan)
    for s in left:
        if s.get("same_as_own"):
            regret[s["hardware"]] = 1.0
    d = by[DEFAULT]
    return {"kernel": fam.name, "shape_name": case.shape_name, "shape": fam.shape_key(shape),
            "dtype": case.dtype, "hardware": hw, "rounds": max(1, rounds), "rows": rows,
            "left_out": left, "regret": regret,
            "default_vs_own": d["median_ms"] / own_ms if d["ok"] else math.nan}


def summary(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per kernel and sibling: cases, geometric mean and worst regret (measured ones)."""
    groups: dict[tuple[str, str], list[float]] = {}
    for c in cases:
        for sib, r in c["regret"].items():
            if r == r and r > 0:
                groups.setdefault((c["kernel"], sib), []).append(r)
    return [{"kernel": k, "sibling": s, "cases": len(v),
             "geomean": math.exp(statistics.fmean(math.log(x) for x in v)), "worst": max(v)}
            for (k, s), v in sorted(groups.items())]


def _fmt(v: Any, spec: str) -> str:
    return bench._fmt(v, spec)


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    # Siblings with no pack entry for any case get no columns: one line names them.
    sibs = [s for s in report["siblings"] if any(
        r["hardware"] == s for c in report["cases"] for r in c["rows"]) or any(
        x["hardware"] == s and x.get("same_as_own") for c in report["cases"]
        for x in c["left_out"])]
    packless = [s for s in report["siblings"] if s not in sibs]
    lines = [
        f"# Sibling packs on {env['device_name']} ({env['hardware']})", "",
        f"- date: {env['date']}; driver {env.get('driver')}; torch {env['torch']}; "
        f"triton {env['triton']}; CUDA {env['cuda']}",
        f"- command: `{env['command']}`",
        f"- siblings: {', '.join(sibs) or 'none'} (their packs' entries for each shape, run "
        "here); regret = sibling ms / own pack ms, the time a GPU nobody tuned for gives up "
        "by falling back to that sibling's pack. Own, siblings and default config measured "
        "in turn, in rounds; each figure is its median round."]
    if packless:
        lines.append(f"- no pack entry near any case's shape: {', '.join(packless)}")
    lines.append("")
    if report["summary"]:
        lines += ["## Regret per kernel", "",
                  "| kernel | sibling | cases | geomean regret | worst |", "|---|---|---|---|---|"]
        lines += [f"| {s['kernel']} | {s['sibling']} | {s['cases']} | "
                  f"{s['geomean']:.3f}x | {s['worst']:.3f}x |" for s in report["summary"]]
        lines.append("")
    lines += ["## Cases", "",
              "| kernel | shape | dtype | own ms | " + " | ".join(f"{s} pack ms" for s in sibs)
              + " | default ms | " + " | ".join(f"regret {s}" for s in sibs)
              + " | default / own |",
              "|---" * (5 + 2 * len(sibs)) + "|---|"]
    for c in report["cases"]:
        by_hw = {r["hardware"]: r for r in c["rows"]}
        dflt = next(r for r in c["rows"] if r["variant"] == DEFAULT)

        def ms(r: dict[str, Any] | None) -> str:
            if r is None:
                return "-"
            return _fmt(r["median_ms"], ".4g") if r["ok"] else "failed"

        def sib_ms(s: str, c: dict = c, by_hw: dict = by_hw) -> str:
            if s in by_hw:
                return ms(by_hw[s])
            why = next((x for x in c["left_out"] if x["hardware"] == s), None)
            return "= own" if why and why.get("same_as_own") else "-"

        own = ms(by_hw.get(c["hardware"]))
        lines.append(
            f"| {c['kernel']} | `{c['shape_name']}` | {c['dtype']} | {own} | "
            + " | ".join(sib_ms(s) for s in sibs) + f" | {ms(dflt)} | "
            + " | ".join(_fmt(c["regret"].get(s), ".3f") for s in sibs)
            + f" | {_fmt(c['default_vs_own'], '.3f')} |")
    notes = [f"- {c['kernel']} `{c['shape_name']}` {c['dtype']}: {x['hardware']}: {x['why']}"
             for c in report["cases"] for x in c["left_out"]
             if not x.get("same_as_own") and x["hardware"] in sibs]
    if notes:
        lines += ["", "Not measured:", "", *notes]
    return "\n".join(lines) + "\n"


def run_regret(out_dir: str | Path, kernels: list[str] | None, command: str,
               cases_file: str | Path | None = None, siblings: list[str] | None = None,
               budget_s: float = 540.0, rounds: int = 3,
               log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every bench case's own, sibling and default configs on this GPU; writes
    ``<out_dir>/<hardware>/regret.{json,md}`` after each case."""
    t0 = time.monotonic()
    spec = hardware.current_device()
    sibs = sibling_keys(spec.key, siblings)
    measurer = Measurer(Timing())
    peaks = device_peaks(spec)
    report: dict[str, Any] = {"environment": bench.environment(command), "siblings": sibs,
                              "cases": [], "summary": []}
    if not sibs:
        log(f"regret: {spec.key} has no family sibling (name one with --sibling)")
    for case in bench.load_cases(cases_file, kernels):
        if budget_s - (time.monotonic() - t0) < 20:
            log(f"regret: out of time budget, skipping {case}")
            report.setdefault("skipped", []).append(case.__dict__)
            continue
        log(f"regret: {case.kernel} {case.shape_name} {case.dtype}")
        try:
            report["cases"].append(regret_case(case, measurer, peaks, spec.key, sibs, spec,
                                               rounds=rounds))
        except Exception as exc:  # one broken case must not lose the others' results
            report.setdefault("errors", []).append({**case.__dict__, "error": repr(exc)[:500]})
            log(f"regret: {case} failed: {exc!r}"[:500])
        report["summary"] = summary(report["cases"])
        _write(out_dir, spec.key, report)
    measurer.release()
    report["wall_s"] = time.monotonic() - t0
    _write(out_dir, spec.key, report)
    return report


def _write(out_dir: str | Path, hw: str, report: dict[str, Any]) -> None:
    d = Path(out_dir) / hw
    d.mkdir(parents=True, exist_ok=True)
    (d / "regret.json").write_text(jsonsafe.dumps(report, indent=1, default=str))
    (d / "regret.md").write_text(markdown(report))
