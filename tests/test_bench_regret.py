"""``kharness bench --regret``: a sibling GPU's pack entries timed against this GPU's own
and the default config, in the same rounds. On the CPU (Triton's interpreter) with real
packs in a tmp dir; on a GPU with the shipped H100 and H200 packs."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from harness import packs
from harness.measure import regret
from tests.fault_kernels import cli_env

ROOT = Path(__file__).resolve().parent.parent


def _entry(block: int, warps: int, device: str) -> dict[str, Any]:
    v = packs.runtime_versions()
    return {"config": {"BLOCK_SIZE": block, "num_warps": warps},
            "metrics": {"latency_ms": 0.01},
            "provenance": {"device_name": device, "triton": v["triton"], "torch": v["torch"]}}


def _run(tmp: Path, *args: str, env: dict[str, str] | None = None
         ) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness", "bench", "--regret", *args],
                          capture_output=True, text=True, timeout=600, cwd=tmp,
                          env={**cli_env(tmp / "events"), **(env or {})})


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU run")
def test_regret_on_the_interpreter(tmp_path: Path) -> None:
    """This device (cpu) has its own rmsnorm pack; H100's entry is another config (a
    nearest one), H200's is the own config again, A100 has no pack: the own, H100 and
    default configs are measured in each round, H200's regret is 1 without a measurement
    and A100 is reported as not measured."""
    root = tmp_path / "packs"
    packs.freeze(root, "cpu", "rmsnorm", "fp32", {"rows=5,cols=300": _entry(512, 4, "cpu")})
    packs.freeze(root, "H100", "rmsnorm", "fp32",
                 {"rows=8,cols=256": _entry(256, 2, "NVIDIA H100 80GB HBM3")})
    packs.freeze(root, "H200", "rmsnorm", "fp32",
                 {"rows=5,cols=300": _entry(512, 4, "NVIDIA H200")})
    cases = tmp_path / "cases.yaml"
    cases.write_text(yaml.safe_dump({"cases": [
        {"kernel": "rmsnorm", "shape": "test", "dtype": "fp32", "compile": False}]}))
    out = tmp_path / "results"
    proc = _run(tmp_path, "--sibling", "H100", "--sibling", "H200", "--sibling", "A100",
                "--cases", str(cases), "--out", str(out), "--rounds", "2",
                env={"TRITON_INTERPRET": "1", "HARNESS_PACKS": str(root)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rep = json.loads((out / "cpu" / "regret.json").read_text(),
                     parse_constant=lambda c: pytest.fail(f"{c} in regret.json"))
    assert rep["siblings"] == ["H100", "H200", "A100"]
    (case,) = rep["cases"]
    rows = {r["variant"]: r for r in case["rows"]}
    assert list(rows) == ["own (cpu)", "H100 pack", "default config"]
    for r in rows.values():
        assert r["ok"], r
        assert len(r["round_ms"]) == 2 and r["max_abs_err"] < 1e-4
    assert rows["own (cpu)"]["config"] == {"BLOCK_SIZE": 512, "num_warps": 4}
    assert (rows["H100 pack"]["source"], rows["H100 pack"]["shape_key"]) == \
        ("nearest", "rows=8,cols=256")
    assert rows["H100 pack"]["config"] == {"BLOCK_SIZE": 256, "num_warps": 2}
    own_ms = rows["own (cpu)"]["median_ms"]
    assert math.isclose(case["regret"]["H100"], rows["H100 pack"]["median_ms"] / own_ms)
    assert case["regret"]["H200"] == 1.0 and "A100" not in case["regret"]
    assert math.isclose(case["default_vs_own"], rows["default config"]["median_ms"] / own_ms)
    left = {x["hardware"]: x for x in case["left_out"]}
    assert left["H200"]["same_as_own"] and "no A100 pack entry" in left["A100"]["why"]
    (h100,) = [s for s in rep["summary"] if s["sibling"] == "H100"]
    assert h100["kernel"] == "rmsnorm" and math.isclose(h100["geomean"], case["regret"]["H100"])
    md = (out / "cpu" / "regret.md").read_text()
    assert "| rmsnorm | H100 | 1 |" in md and "= own" in md
    # A sibling with no pack for any case gets no columns, one line.
    assert "- no pack entry near any case's shape: A100" in md and "regret A100" not in md


def test_summary_is_a_geometric_mean_and_the_worst_case() -> None:
    cases = [{"kernel": "k", "regret": {"H100": 1.0}}, {"kernel": "k", "regret": {"H100": 4.0}},
             {"kernel": "k", "regret": {"H100": math.nan}}]
    (s,) = regret.summary(cases)
    assert s["cases"] == 2 and math.isclose(s["geomean"], 2.0) and s["worst"] == 4.0


def test_siblings_given_skip_this_gpu_and_repeats() -> None:
    assert regret.sibling_keys("H200", ["H100", "H200", "H100"]) == ["H100"]


@pytest.mark.gpu
def test_regret_on_this_gpu_against_its_shipped_sibling(tmp_path: Path) -> None:
    """On an H100 (H200) the shipped H200 (H100) pack is the first sibling with entries:
    both grouped GEMM cases measure own, sibling and default on the GPU."""
    import torch

    from harness.measure import hardware

    key = hardware.hardware_key(torch.cuda.get_device_name())
    if key not in ("H100", "H200"):
        pytest.skip(f"shipped packs exist for H100 and H200, not {key}")
    other = "H200" if key == "H100" else "H100"
    out = tmp_path / "results"
    proc = _run(tmp_path, "--kernel", "grouped_gemm", "--out", str(out), "--rounds", "3")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rep = json.loads((out / key / "regret.json").read_text())
    assert other in rep["siblings"] and len(rep["cases"]) == 2
    for case in rep["cases"]:
        hws = [r["hardware"] for r in case["rows"]]
        assert hws[0] == key and hws[-1] is None, hws
        assert all(r["ok"] for r in case["rows"]), case["rows"]
        assert case["regret"][other] > 0.5 and case["default_vs_own"] > 0.5, case
    md = (out / key / "regret.md").read_text()
    assert f"| grouped_gemm | {other} | 2 |" in md
