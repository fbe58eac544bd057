"""The scaling benchmark (benchmarks/fleet_scaling.py) on simulated GPUs: each count is a
command of its own, and the table says what each GPU did."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def test_the_scaling_benchmark_writes_its_table_on_simulated_gpus(tmp_path: Path) -> None:
    exp = yaml.safe_load((ROOT / "configs" / "scaling" / "tiny_cpu.yaml").read_text())
    exp["shapes"] = exp["shapes"][:2]
    exp["search_space"]["params"]["SLEEP_MS"] = [20, 40]
    exp.setdefault("fleet", {})["bookkeeping"] = "threads"  # interpreted: no helper processes
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(exp))
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fleet_scaling.py"),
                           "--cpu", "--gpus", "1,2", "--experiment", str(path),
                           "--out", str(out), "--work", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = json.loads((out / "scaling.json").read_text())
    one, two = table["rows"]
    assert (one["gpus"], two["gpus"]) == (1, 2)
    assert one["trials"] == two["trials"] == 4 and one["studies"] == 2
    assert one["speedup"] == 1.0 and two["speedup"] > 0
    # One worker, then two: each with its own held time and timing fraction.
    assert len(one["per_gpu_timing_fraction"]) == 1
    assert len(two["per_gpu_timing_fraction"]) == 2
    assert all(0 < f <= 1 for f in two["per_gpu_timing_fraction"])
    assert one["first_trial_s"] < one["wall_s"] and one["after_last_trial_s"] >= 0
    md = (out / "scaling.md").read_text()
    assert "| GPUs |" in md and "simulated H100" in md
