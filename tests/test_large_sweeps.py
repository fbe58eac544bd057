"""The large replay sweeps (configs/sweeps/large/): every study's grid holds at least 2,000
valid configs on the H100 and on the H200, counted as the run finds them, and the docs
give those counts; the replay reads, writes and replays tables of that size in seconds."""

from __future__ import annotations

import gzip
import importlib.util
import itertools
import json
import math
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from harness import experiment
from harness.experiment import SearchSettings
from harness.kernel import api as kernel_api
from harness.measure.hardware import spec_for_key
from harness.search import ValidSpace, spaces, tables
from harness.search import replay as rp

ROOT = Path(__file__).resolve().parent.parent
LARGE = sorted((ROOT / "configs" / "sweeps" / "large").glob("*.yaml"))


def _script(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def found() -> list[Any]:
    """Every study of every large sweep on the H100 and the H200 (about 10 s)."""
    return _script("large_sweeps").studies(LARGE)


@pytest.mark.parametrize("path", LARGE, ids=[p.stem for p in LARGE])
def test_a_large_sweep_measures_its_whole_grid_on_both_hopper_gpus(path: Path) -> None:
    exp = experiment.load(path)
    assert exp.search.strategy == "grid" and not exp.search.warm_start
    assert not exp.search.seed_from_packs
    assert exp.hardware == ["H100", "H200"]
    assert exp.output.packs_dir != "packs", "sweeps must not overwrite the shipped packs"
    fam = kernel_api.get(exp.kernel)
    for hw in exp.hardware:
        space = spaces.resolve([spaces.for_kernel(fam), exp.search_space], "nvidia", hw)
        # Every tunable is pinned by the file: a choice the family adds later does not
        # change what a re-recorded sweep measures.
        assert set(space) == set(exp.search_space["params"]), path
        assert exp.search.trials >= spaces.grid_size(space), "the budget must cover the grid"


def test_each_study_holds_2000_valid_configs_on_the_h100_and_the_h200(found: list[Any]) -> None:
    assert len(LARGE) >= 4
    assert {s.hardware for s in found} == {"H100", "H200"}
    for s in found:
        print(f"{s.file} {s.shape} {s.dtype} {s.hardware}: {s.valid} valid of {s.grid}")
        assert s.valid >= 2000, s
        assert len(set(s.configs)) == s.valid  # the grid never asks for a config twice


def test_the_grid_walk_finds_exactly_the_configs_that_pass_the_checks(found: list[Any]) -> None:
    """The run's grid (a lazy walk of a seeded permutation) against every config of the
    space checked one by one, on the H100's static spec."""
    by_file = {p.name: experiment.load(p) for p in LARGE}
    for s in (s for s in found if s.hardware == "H100"):
        exp = by_file[s.file]
        fam = kernel_api.get(exp.kernel)
        device = spec_for_key("H100")
        space = spaces.resolve([spaces.for_kernel(fam), exp.search_space], "nvidia", "H100")
        exact = ValidSpace(space, lambda c, s=s, fam=fam, device=device: fam.check_config(
            {**fam.default_config, **c}, s.shape, device), exact_limit=s.grid)
        assert exact.count == s.valid, s.file


def test_the_docs_give_the_counts(found: list[Any]) -> None:
    """docs/search.md's table of the large sweeps says what the script counts."""
    text = (ROOT / "docs" / "search.md").read_text()
    for s in found:
        shape = ",".join(f"{k}={v}" for k, v in s.shape.items())
        row = next((line for line in text.splitlines()
                    if line.startswith(f"| `{s.file}` | {shape} |")), None)
        assert row is not None, f"docs/search.md has no row for {s.file} {shape}"
        assert f"| {s.valid:,} |" in row and f"| {s.grid:,} |" in row, row


def test_the_record_script_runs_the_large_sweeps_as_one_campaign() -> None:
    script = (ROOT / "benchmarks" / "record_sweeps.sh").read_text()
    assert '"--large"' in script and "configs/sweeps/large/*.yaml" in script
    assert 'python3 -m harness run "${files[@]}"' in script
    assert "search.timeout_s=" in script and "--commit" in script
    assert subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "record_sweeps.sh")]
                          ).returncode == 0


# -- tables of 2,000+ configs ---------------------------------------------------------------


SPACE = {"BLOCK_M": [16, 64, 128, 256], "BLOCK_N": [64, 128, 256], "BLOCK_K": [32, 64, 128],
         "GROUP_M": [1, 8], "num_warps": [4, 8], "num_stages": [3, 4, 5],
         "PERSISTENT": [0, 1], "USE_TMA": [0, 1], "TMA_STORE": [0, 1], "SWAP_AB": [0, 1]}


def _why(c: dict[str, int]) -> str | None:
    if (c["TMA_STORE"] or c["SWAP_AB"]) and not c["USE_TMA"]:
        return "needs USE_TMA=1"
    if c["num_stages"] * (c["BLOCK_M"] + c["BLOCK_N"]) * c["BLOCK_K"] * 2 > 232448:
        return "shared memory"
    if c["BLOCK_M"] * c["BLOCK_N"] // (32 * c["num_warps"]) > 256:
        return "registers"
    return None


def large_table(seed: int, hardware: str) -> dict[str, Any]:
    """A grouped-GEMM-like sweep of 6,912 configs, 3,000+ of them valid: smooth in the
    tiles around a seeded optimum, each option a few percent faster or slower, 2 % noise,
    1 % failed, the rest pruned with a reason."""
    rng = random.Random(seed)
    opt = {"BLOCK_M": rng.choice([64, 128]), "BLOCK_N": rng.choice([128, 256]),
           "BLOCK_K": rng.choice([64, 128]), "num_warps": rng.choice([4, 8]),
           "num_stages": rng.choice([3, 4, 5]), "GROUP_M": rng.choice([1, 8])}
    gain = {k: rng.uniform(-0.05, 0.12) for k in ("PERSISTENT", "USE_TMA", "TMA_STORE",
                                                  "SWAP_AB")}
    trials = []
    for values in itertools.product(*SPACE.values()):
        c = dict(zip(SPACE, values, strict=True))
        why = _why(c)
        if why:
            trials.append({"config": c, "status": "pruned", "reason": why, "cost_s": 0.0})
        elif rng.random() < 0.01:
            trials.append({"config": c, "status": "failed", "reason": "launch failed",
                           "timing_s": 0.0, "compile_s": 0.6, "cost_s": 0.6})
        else:
            d = {k: abs(math.log2(c[k] / v)) for k, v in opt.items()}
            ms = (1 + 0.3 * d["BLOCK_M"] + 0.25 * d["BLOCK_N"] + 0.1 * d["BLOCK_K"]
                  + 0.1 * d["num_warps"] + 0.05 * d["num_stages"] + 0.04 * d["GROUP_M"]
                  + 0.08 * d["BLOCK_M"] * d["num_warps"])
            ms *= math.prod(1 - g for k, g in gain.items() if c[k])
            ms = round(ms * (1 + rng.gauss(0, 0.02)), 6)
            trials.append({"config": c, "status": "ok", "median_ms": ms,
                           "p20_ms": round(ms * 0.99, 6), "p80_ms": round(ms * 1.02, 6),
                           "timing_s": 0.08, "compile_s": 0.006,
                           "cost_s": round(0.086 + 0.02 * rng.random(), 6)})
    grid = math.prod(len(v) for v in SPACE.values())
    return {"format": rp.FORMAT, "kernel": "grouped_like", "shape": {"M": 4096 * (seed + 1)},
            "dtype": "bf16", "hardware": hardware, "device_name": f"NVIDIA {hardware}",
            "date": "2026-11-28", "commit": "0000000", "space": SPACE, "grid_size": grid,
            "complete": True, "default_config": {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64,
                                                  "GROUP_M": 8, "num_warps": 4, "num_stages": 3,
                                                  "PERSISTENT": 0, "USE_TMA": 0,
                                                  "TMA_STORE": 0, "SWAP_AB": 0},
            "trials": trials}


def test_a_large_table_is_written_gzipped_and_read_back(tmp_path: Path) -> None:
    data = large_table(0, "H100")
    assert len(data["trials"]) > tables.GZIP_ROWS
    path = tables.write(data, tmp_path / "H100" / "grouped_like__M4096__bf16.json.gz")
    assert path.read_bytes()[:2] == b"\x1f\x8b"
    assert path.stat().st_size * 10 < len(rp.dumps(data))
    t = rp.Table.load(path)
    assert t.data == json.loads(json.dumps(data)) and t.complete and t.grid_size == 6912
    assert len(t.of("ok")) + len(t.of("failed")) >= 2000
    assert [x.path for x in rp.load_tables(tmp_path)] == [str(path)]
    # The same table gives the same bytes: a re-export leaves git clean.
    again = tables.write(data, tmp_path / "again.json.gz")
    assert again.read_bytes() == path.read_bytes()
    (tmp_path / "H100" / "broken.json.gz").write_bytes(gzip.compress(b"not json"))
    assert len(rp.load_tables(tmp_path)) == 1


def test_the_replay_of_large_tables_takes_seconds(tmp_path: Path) -> None:
    """The replay benchmark with the default strategy and TPE, 3 seeds each, on two cases
    of 3,000+ valid configs: seconds, not minutes (its own process: one BLAS thread)."""
    for i, hw in enumerate(("H100", "H200")):
        tables.write(large_table(i, hw), tmp_path / hw / f"case{i}.json.gz")
    default = SearchSettings().strategy
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "replay_bench.py"),
                           "--data", str(tmp_path), "--strategies", default, "tpe",
                           "--seeds", "3", "--variants", "static-pruning", "--jobs", "1"],
                          capture_output=True, text=True, timeout=600)
    wall = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-2000:]
    print(f"replay of 2 cases x 2 strategies x 3 seeds: {wall:.1f} s")
    report = json.loads((tmp_path / "report.json").read_text())
    res = report["results"]["static-pruning"]
    assert {default, "tpe"} <= set(res)
    assert all(r["reached"] == r["runs"] == 6 for r in res.values())
    assert wall < 90, f"the replay took {wall:.0f} s"
