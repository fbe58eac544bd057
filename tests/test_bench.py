"""`kharness bench` on the CPU (Triton's interpreter): one small case measured against its
baselines, then the cost sections for real (a tiny tuning run through local Ray, the pack
lookup benchmark), the JSON/markdown it writes, and the README section rendered from it."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from harness.measure import bench

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory) -> tuple[Path, dict]:
    tmp = tmp_path_factory.mktemp("bench")
    cases = tmp / "cases.yaml"
    cases.write_text(yaml.safe_dump({"cases": [
        {"kernel": "rmsnorm", "shape": "test", "dtype": "fp32", "compile": False}]}))
    tuning = tmp / "tiny.yaml"
    tuning.write_text(yaml.safe_dump({
        "name": "bench-tiny", "kernel": "rmsnorm", "shapes": [{"rows": 5, "cols": 300}],
        "dtypes": ["fp32"], "search": {"sampler": "grid", "trials": 4},
        "fleet": {"compile_workers": 0}}))
    out = tmp / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "harness", "bench", "--out", str(out), "--cases", str(cases),
         "--tuning-experiment", str(tuning), "--quick", "--budget-s", "400"],
        capture_output=True, text=True, timeout=600, cwd=tmp,
        env={**__import__("os").environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # Strict JSON: a figure the run lacks is null, not NaN (jq and browsers refuse NaN).
    text = (out / "cpu" / "bench.json").read_text()
    return out / "cpu", json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in bench.json"))


def test_bench_measures_the_case_against_its_baselines(bench_run) -> None:
    where, rep = bench_run
    env = rep["environment"]
    assert env["hardware"] == "cpu" and env["command"].startswith("kharness bench")
    (case,) = rep["cases"]
    rows = {r["variant"]: r for r in case["rows"]}
    assert set(rows) >= {"tuned", "default config", "eager"}
    for r in rows.values():
        assert r["ok"], r
        assert r["median_ms"] > 0 and r["p20_ms"] <= r["median_ms"] <= r["p80_ms"]
        assert r["max_abs_err"] < 1e-3  # fp32 rmsnorm against its reference
        # Three interleaved rounds (the default); the figure is the median round's.
        assert len(r["round_ms"]) == 3 and r["median_ms"] == sorted(r["round_ms"])[1]
    assert case["rounds"] == 3
    assert case["pack_source"] in ("exact", "nearest", "default")
    assert "3 rounds" in (where / "bench.md").read_text()
    assert math.isclose(rows["tuned"]["tuned_speedup"], 1.0)
    assert case["vs_default"] in ("faster", "tie", "slower", "same config")
    assert f"in the same rounds: **{case['vs_default']}**" in (where / "bench.md").read_text()


def test_bench_cost_sections_are_measured(bench_run) -> None:
    where, rep = bench_run
    t = rep["tuning"]
    assert t["trials"] >= 1 and t["wall_s"] > 0 and t["gpu_held_s"] > 0
    assert 0 < t["timing_fraction"] <= 1
    assert math.isclose(t["trials_per_hour"], t["trials"] / t["wall_s"] * 3600)
    assert t["overhead_s"]["timing"] == pytest.approx(t["timing_s"], abs=0.01)
    assert t["timeline_s"]["search_done"] >= t["timeline_s"]["workers_ready"]
    lk = rep["lookup"]
    assert (where / "lookup.json").is_file() and lk["cached_us"]["exact"] > 0
    assert lk["load_ms"]["all_shipped"] > 0
    # No GPU: the decorator's comparison with triton.autotune is skipped, and says why.
    assert "decorator" not in rep
    assert any(s.get("section") == "decorator" and "GPU" in s["why"] for s in rep["skipped"])
    md = (where / "bench.md").read_text()
    assert "## Tuning cost" in md and "## Runtime lookup" in md and "| tuned |" in md


def test_readme_section_renders_every_results_file(bench_run, tmp_path) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import render_readme

    where, rep = bench_run
    text = render_readme.section(where.parent)
    assert "### cpu" in text and "#### Tuning cost" in text and "rmsnorm" in text
    # The committed README is generated from the committed results.
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "render_readme.py"),
                           "--check"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout


def test_cost_markdown_without_sections_is_empty() -> None:
    assert bench.cost_markdown({}) == []


def test_combine_takes_the_median_round_and_keeps_failures() -> None:
    from harness.measure.timing import TrialResult

    def ok(ms: float) -> TrialResult:
        return TrialResult(ok=True, latency_ms=ms, p20_ms=ms - 0.1, p80_ms=ms + 0.1)

    got = bench._combine([ok(3.0), ok(1.0), ok(2.0)])
    assert got.latency_ms == 2.0 and got.extra["round_ms"] == [3.0, 1.0, 2.0]
    assert got.p20_ms == pytest.approx(1.9) and got.p80_ms == pytest.approx(2.1)
    # Even rounds: the lower median, an actual round's figure.
    assert bench._combine([ok(4.0), ok(1.0), ok(2.0), ok(3.0)]).latency_ms == 2.0
    bad = TrialResult(ok=False, reason="runtime error: boom")
    got = bench._combine([ok(1.0), bad, ok(2.0)])
    assert not got.ok and got.reason == "runtime error: boom"
    assert got.extra["round_ms"] == [1.0, 2.0]


def test_torch_compile_baseline_is_compiled_once_and_timed_every_round() -> None:
    """The torch.compile row on the CPU (inductor's C++ backend): compiled before the
    rounds, then timed in each round like the others, with its compile time noted."""
    from harness.measure.timing import Measurer, Timing

    case = bench.Case("rmsnorm", "test", "fp32", compile=True)
    got = bench.bench_case(case, Measurer(Timing()), {}, "cpu", rounds=2)
    rows = {r["variant"]: r for r in got["rows"]}
    tc = rows["torch.compile"]
    assert tc["ok"], tc
    assert tc["note"].startswith("compiled in ") and len(tc["round_ms"]) == 2
    assert tc["max_abs_err"] < 1e-4
    assert [len(r["round_ms"]) for r in got["rows"]] == [2] * len(got["rows"])


def test_the_pack_against_the_default_config_by_the_rule_that_froze_it() -> None:
    """Faster, slower, or a tie that the same-round ratios cannot order (the default's
    median a hair lower in rounds that overlap is no loss); the default itself is the
    same config, and a failed row decides nothing."""
    from harness.measure.bench import vs_default

    def rows(tuned: list[float], default: list[float], ok: bool = True) -> list[dict]:
        return [{"variant": "tuned", "ok": True, "round_ms": tuned,
                 "median_ms": sorted(tuned)[len(tuned) // 2]},
                {"variant": "default config", "ok": ok, "round_ms": default,
                 "median_ms": sorted(default)[len(default) // 2]}]

    assert vs_default(rows([1.0, 1.01, 0.99], [1.3, 1.31, 1.29]), False) == "faster"
    assert vs_default(rows([1.3, 1.31, 1.29], [1.0, 1.01, 0.99]), False) == "slower"
    assert vs_default(rows([3.3235, 3.32, 3.324], [3.3212, 3.32, 3.33]), False) == "tie"
    # Slower by 1 % in each of five rounds: measured, not noise.
    assert vs_default(rows([1.01] * 5, [1.0] * 5), False) == "slower"
    assert vs_default(rows([1.0] * 3, [1.0] * 3), True) == "same config"
    assert vs_default(rows([1.0] * 3, [1.0] * 3, ok=False), False) == "-"


def test_resume_measures_only_the_cases_the_table_lacks(bench_run, tmp_path) -> None:
    """``kharness bench --resume`` keeps the cases and cost sections of the bench.json it
    continues and measures only the cases it lacks (of the kernels asked), in the cases'
    own order; a table of
    another stack is refused before anything is measured or written."""
    import shutil

    where, rep = bench_run
    out = tmp_path / "results"
    shutil.copytree(where.parent, out)
    cases = tmp_path / "cases.yaml"
    cases.write_text(yaml.safe_dump({"cases": [
        {"kernel": "rmsnorm", "shape": "test", "dtype": "fp32", "compile": False},
        {"kernel": "silu", "shape": "test", "dtype": "fp32", "compile": False}]}))
    logs: list[str] = []
    got = bench.run_bench(out, ["silu"], "kharness bench --resume", cases_file=cases,
                          log=logs.append, cost=bench.CostSettings(enabled=False),
                          resume=True)
    assert [c["kernel"] for c in got["cases"]] == ["rmsnorm", "silu"]
    assert got["cases"][0] == rep["cases"][0]  # kept as it was measured
    assert [m for m in logs if " test " in m] == ["bench: silu test fp32"]
    assert got["tuning"] == rep["tuning"] and got["environment"] == rep["environment"]
    (cont,) = got["continued_by"]
    assert cont["command"] == "kharness bench --resume" and cont["cases_before"] == 1
    assert cont["wall_s"] > 0 and got["wall_s"] == rep["wall_s"]
    written = out / "cpu" / "bench.json"
    assert json.loads(written.read_text())["continued_by"] == got["continued_by"]
    assert "continued by" in (out / "cpu" / "bench.md").read_text()
    # Another Triton: one table is one stack.
    data = json.loads(written.read_text())
    data["environment"]["triton"] = "0.0"
    written.write_text(json.dumps(data))
    before = written.read_text()
    with pytest.raises(bench.ResumeError, match=r"triton '0.0' there, '.+' here"):
        bench.run_bench(out, None, "kharness bench --resume", cases_file=cases,
                        log=logs.append, cost=bench.CostSettings(enabled=False), resume=True)
    assert written.read_text() == before
    proc = subprocess.run(
        [sys.executable, "-m", "harness", "bench", "--out", str(out), "--cases", str(cases),
         "--no-cost", "--resume"], capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**__import__("os").environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    said = " ".join((proc.stdout + proc.stderr).split())  # the console wraps long lines
    assert "--resume:" in said and "another device or stack" in said
    assert "Traceback" not in proc.stdout + proc.stderr and written.read_text() == before
