"""Precision is part of the result: what each config computes in (``Kernel.precision``),
the roofline from that precision's peak, the benchmark's rows labelled by it, and no row of
the committed benchmarks above its roofline."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from harness.kernel import api as kernel_api
from harness.measure import bench
from harness.measure.timing import roofline_ms

ROOT = Path(__file__).resolve().parent.parent
PEAKS = {"copy_gbps": 4000.0, "bf16_tflops": 800.0, "fp16_tflops": 780.0,
         "fp32_tflops": 50.0, "tf32_tflops": 400.0}
REPORTS = sorted((ROOT / "benchmarks" / "results").glob("*/bench.json"))


@pytest.mark.parametrize("kernel,config,dtype,want", [
    ("grouped_gemm", {}, "bf16", "bf16"),
    ("grouped_gemm", {}, "fp32", "ieee fp32"),
    ("mulsum_states", {"IMPL": "triton", "INPUT_PRECISION": "tf32"}, "fp32", "tf32"),
    ("mulsum_states", {"IMPL": "triton", "INPUT_PRECISION": "tf32x3"}, "fp32", "tf32x3"),
    ("mulsum_states", {"IMPL": "triton", "INPUT_PRECISION": "ieee"}, "fp32", "ieee fp32"),
    ("mulsum_states", {"IMPL": "bmm", "ALLOW_TF32": 1}, "fp32", "tf32"),
    ("mulsum_states", {"IMPL": "bmm", "ALLOW_TF32": 0}, "fp32", "ieee fp32"),
    ("selective_scan", {"STATE_DTYPE": "fp16"}, "fp32", "ieee fp32, fp16 state"),
    ("selective_scan", {"STATE_DTYPE": "fp32"}, "fp32", "ieee fp32"),
    ("minigpt_block", {"PRECISION": "fp16"}, "fp32", "fp16"),
    ("minigpt_block", {"PRECISION": "fp32"}, "fp32", "ieee fp32"),
    ("rmsnorm", {}, "bf16", "bf16"),
    ("mamba2_ssd", {}, "bf16", "bf16"),
    ("mamba2_ssd", {"STATE_DTYPE": "fp16"}, "bf16", "bf16, fp16 state"),
])
def test_each_family_says_what_a_config_computes_in(kernel, config, dtype, want) -> None:
    assert kernel_api.get(kernel).precision(config, dtype) == want


def test_the_ssd_says_its_fp32_inner_products_are_3xtf32_on_nvidia(monkeypatch) -> None:
    """The SSD's fp32 dots run 3xTF32 on NVIDIA GPUs (its launcher's PREC), IEEE fp32
    under the interpreter; the roofline then takes a third of the tf32 peak."""
    fam = kernel_api.get("mamba2_ssd")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert fam.precision({}, "fp32") == "ieee fp32"
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr("torch.version.hip", None)
    assert fam.precision({}, "fp32") == "tf32x3"
    assert fam.precision({"STATE_DTYPE": "fp16"}, "fp32") == "tf32x3, fp16 state"
    shape = next(iter(fam.shapes.values()))
    assert math.isclose(roofline_ms(fam, shape, "fp32", PEAKS, "tf32x3, fp16 state"),
                        roofline_ms(fam, shape, "fp32", PEAKS, "tf32x3"))


def test_roofline_takes_the_peak_of_the_precision_used() -> None:
    """A tf32 config is bounded by the tf32 peak (not the fp32 SGEMM's, which it can
    pass), tf32x3 by a third of it; without a tf32 peak only the bytes bound it."""
    fam = kernel_api.get("mulsum_states")
    shape = next(iter(fam.shapes.values()))
    flops_ms = fam.flops(shape) / 1e12 * 1e3
    bytes_ms = fam.bytes_moved(shape, "fp32") / (PEAKS["copy_gbps"] * 1e9) * 1e3
    for precision, rate in (("ieee fp32", 50.0), ("tf32", 400.0), ("tf32x3", 400.0 / 3)):
        want = max(bytes_ms, flops_ms / rate)
        assert math.isclose(roofline_ms(fam, shape, "fp32", PEAKS, precision), want)
    no_tf32 = {k: v for k, v in PEAKS.items() if k != "tf32_tflops"}
    assert math.isclose(roofline_ms(fam, shape, "fp32", no_tf32, "tf32"), bytes_ms)
    # No matrix work: the bytes alone, whatever the precision.
    scan = kernel_api.get("selective_scan")
    s = next(iter(scan.shapes.values()))
    assert math.isclose(roofline_ms(scan, s, "fp32", PEAKS, "ieee fp32, fp16 state"),
                        scan.bytes_moved(s, "fp32") / (PEAKS["copy_gbps"] * 1e9) * 1e3)


def _report(rows: list[dict], dtype: str = "fp32") -> dict:
    return {"environment": {"device_name": "X", "hardware": "X", "date": "d", "driver": "v",
                            "torch": "t", "triton": "t", "cuda": "c", "command": "kharness bench"},
            "peaks": PEAKS,
            "cases": [{"kernel": "mulsum_states", "shape_name": "s", "shape": "k", "dtype": dtype,
                       "roofline_ms": 1.0, "pack_source": "exact", "pack_config": {},
                       "rows": rows}]}


def _row(variant: str, precision: str, ms: float = 2.0) -> dict:
    return {"variant": variant, "precision": precision, "ok": True, "reason": "", "note": "",
            "median_ms": ms, "p20_ms": ms, "p80_ms": ms, "tuned_speedup": 1.0,
            "max_abs_err": 1e-6, "roofline_ms": 1.0, "round_ms": []}


def test_an_fp32_row_of_lower_precision_says_so() -> None:
    """The tuned row of an fp32 case whose config runs tf32 reads "tuned (tf32)"; the
    full-precision rows keep their names; a bound row is marked as one, without roofline."""
    md = bench.markdown(_report([
        _row("tuned", "tf32"), _row("default config", "tf32x3"), _row("eager", "ieee fp32"),
        _row("torch.bmm tf32", "tf32"),
        {**_row("bound: dense GEMM", "bf16"), "roofline_ms": math.nan}]))
    assert "| tuned (tf32) | tf32 |" in md
    assert "| default config (tf32x3) | tf32x3 |" in md
    assert "| eager | ieee fp32 |" in md
    assert "| torch.bmm tf32 (tf32) | tf32 |" in md
    bound_line = next(x for x in md.splitlines() if x.startswith("| bound: dense GEMM |"))
    assert "| - |" in bound_line  # no % roofline
    assert "\n| tuned |" not in md
    assert bench._baseline_precision("torch.bmm tf32", "fp32") == "tf32"
    assert bench._baseline_precision("torch._grouped_mm", "bf16") == "bf16"
    assert bench._baseline_precision("torch.bmm fp32", "fp32") == "ieee fp32"


@pytest.mark.skipif(not REPORTS, reason="no benchmark results committed")
@pytest.mark.parametrize("path", REPORTS, ids=lambda p: p.parent.name)
def test_no_committed_row_is_above_its_roofline(path: Path) -> None:
    """Every row of the committed benchmarks against the roofline of the precision it
    computes in, from that run's own measured peaks: none runs faster than its bound.
    Rows a report saved without their precision take it from the config (tuned, default)
    or the case's dtype; bound rows (another problem) have no roofline."""
    rep = json.loads(path.read_text())
    peaks = rep["peaks"]
    over = []
    for case in rep["cases"]:
        fam = kernel_api.get(case["kernel"])
        shape = fam.shapes[case["shape_name"]]
        by_row = {"tuned": fam.precision(case["pack_config"], case["dtype"]),
                  "default config": fam.precision(fam.default_config, case["dtype"])}
        for r in case["rows"]:
            if not r["ok"] or r["variant"].startswith(bench.BOUND) \
                    or "not the same result" in r["variant"]:
                continue
            prec = r.get("precision") or by_row.get(r["variant"]) or \
                bench._baseline_precision(r["variant"], case["dtype"])
            bound = roofline_ms(fam, shape, case["dtype"], peaks, prec)
            if bound > r["median_ms"]:
                over.append(f"{case['kernel']} {case['shape_name']} {case['dtype']} "
                            f"{r['variant']} ({prec}): {bound / r['median_ms']:.0%}")
    assert not over, over
