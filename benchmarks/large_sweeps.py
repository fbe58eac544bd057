"""Sizes and cost of the large replay sweeps (``configs/sweeps/large/*.yaml``), on the CPU.

For each experiment file, shape and hardware key (H100, H200) it counts the configs the
run's grid will measure, exactly as the run finds them: the study's ``Search`` built as
``kharness run`` builds it (the family's space under the file's ``search_space``, the
kernel's ``check_config`` at the shape on the hardware key's static spec,
``harness.measure.hardware.spec_for_key``), walked to its end by the study's own grid
strategy. Each study must hold at least ``MIN_VALID`` valid configs.

Then it estimates the recording's cost on one GPU host from the recorded sweeps
(``benchmarks/replay/<HW>/*``): per measured config the recorded mean timing and first
launch (GPU seconds), per compiled config the mean compile-ahead time (CPU seconds on
the node's compile service); a family with no recorded sweep takes the mean of all.
Configs two shapes of one file share are compiled once (their binaries are the same).
Wall time is the start (the first trial ~45 s after the command on a 4-GPU host, 2026-11-28)
plus the larger of GPU seconds over the GPUs and compile seconds over the compile
processes, plus the end (re-measurement and export).

    python benchmarks/large_sweeps.py             # a Markdown table
    python benchmarks/large_sweeps.py --json      # the counts and the estimate as JSON

Exit 1 if a study of a file holds fewer than ``MIN_VALID`` valid configs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness import experiment  # noqa: E402
from harness.search.keys import config_key  # noqa: E402

LARGE = ROOT / "configs" / "sweeps" / "large"
CORPUS = ROOT / "benchmarks" / "replay"
HARDWARE = ("H100", "H200")
MIN_VALID = 2000
#: The recording host: 4 GPUs; its compile service's processes (59 on the 64-core 4x
#: H200 host of benchmarks/results/H200/2026-11-28-fleet-start).
GPUS, COMPILE_PROCS = 4, 59
#: Command to first trial on that host (same source), and the end: each study's
#: re-measurement (5 finalists x 5 rounds) and the export.
START_S, END_S = 45.0, 60.0


@dataclass
class Study:
    """One study of a large sweep: what its grid measures on one hardware key."""

    file: str
    experiment: str
    kernel: str
    shape: dict[str, int]
    dtype: str
    hardware: str
    grid: int  # the space's size
    valid: int  # the configs the grid measures
    configs: list[str] = field(default_factory=list, repr=False)  # their keys, in order


def grid_walk(path: str | Path, exp: experiment.Experiment, shape: dict[str, int], dtype: str,
              hardware: str) -> tuple[int, list[dict[str, Any]]]:
    """(the space's size, the configs the run's grid measures, in its order) of one study:
    its ``Search`` as the run builds it (``harness.run.members.study``), walked by its
    strategy (``Strategy.ahead``: the grid's order, each config checked as it is asked)."""
    import optuna

    from harness.kernel import api as kernel_api
    from harness.measure.hardware import spec_for_key
    from harness.search import Search, spaces

    if exp.search.strategy != "grid":
        raise ValueError(f"{path}: search.strategy is {exp.search.strategy!r}, not grid")
    fam = kernel_api.get(exp.kernel)
    device = spec_for_key(hardware)
    space = spaces.resolve([spaces.for_kernel(fam), exp.search_space], device.vendor,
                           hardware, where=str(path))
    spec = experiment.StudySpec(exp.name, exp.kernel, dict(shape), dtype, hardware)
    search = Search(spec, space, device, exp.search, optuna.storages.InMemoryStorage(),
                    exp.seed, n_parallel=1)
    size = spaces.grid_size(space)
    return size, [search.valid.config(p) for p in search.strategy.ahead(size)]


def studies(paths: Sequence[str | Path], hardware: Sequence[str] = HARDWARE) -> list[Study]:
    out = []
    for path in paths:
        exp = experiment.load(path)
        for shape in exp.shapes:
            for dtype in exp.dtypes:
                for hw in hardware:
                    size, configs = grid_walk(path, exp, shape, dtype, hw)
                    out.append(Study(Path(path).name, exp.name, exp.kernel, dict(shape), dtype,
                                     hw, size, len(configs), [config_key(c) for c in configs]))
    return out


def corpus_costs(root: str | Path = CORPUS) -> dict[str, dict[str, float]]:
    """Per kernel family of the recorded sweeps (and ``*`` for all of them): the mean per
    measured config of its timing, first launch and compile-ahead seconds."""
    from harness.search.tables import load_tables

    rows: dict[str, list[dict[str, Any]]] = {"*": []}
    for t in load_tables(root, complete_only=False):
        recs = [r for r in t.trials if r["status"] != "pruned"]
        rows.setdefault(t.data["kernel"], []).extend(recs)
        rows["*"].extend(recs)

    def mean(recs: list[dict[str, Any]], key: str) -> float:
        xs = [r[key] for r in recs if r.get(key) is not None]
        return float(statistics.fmean(xs)) if xs else 0.0

    return {k: {"timing_s": mean(v, "timing_s"), "first_launch_s": mean(v, "compile_s"),
                "compile_s": mean(v, "precompile_s") or mean(v, "compile_s"),
                "configs": len(v)} for k, v in rows.items() if v}


def estimate(found: list[Study], hardware: str, costs: dict[str, dict[str, float]],
             gpus: int = GPUS, compile_procs: int = COMPILE_PROCS) -> dict[str, Any]:
    """The recording's cost on one host of ``hardware`` GPUs (see the module docstring).

    ``gpu_s``: as the recorded sweeps paid it, a config's first launch in the worker
    costing what it cost there (the grouped GEMM's 2026-11-22 sweeps compiled there, 0.6 s
    a config) unless an earlier study compiled its binary; ``gpu_ahead_s``: every first
    launch a load of a binary compiled ahead (the matmul sweeps' recorded first launch).
    ``compile_s``: the compile service's seconds, each distinct config once."""
    load = costs["matmul"]["first_launch_s"] if "matmul" in costs else 0.0
    per_study, gpu_s, gpu_ahead_s, compile_s = [], 0.0, 0.0, 0.0
    compiled: dict[tuple[str, str], set[str]] = {}  # (file, dtype) -> configs compiled
    for s in (s for s in found if s.hardware == hardware):
        c = costs.get(s.kernel) or costs["*"]
        seen = compiled.setdefault((s.file, s.dtype), set())
        new = [k for k in s.configs if k not in seen]
        seen.update(new)
        g = len(new) * (c["timing_s"] + c["first_launch_s"]) + (s.valid - len(new)) * (
            c["timing_s"] + load)
        ga = s.valid * (c["timing_s"] + load)
        k = len(new) * c["compile_s"]
        gpu_s, gpu_ahead_s, compile_s = gpu_s + g, gpu_ahead_s + ga, compile_s + k
        per_study.append({"experiment": s.experiment, "shape": s.shape, "valid": s.valid,
                          "gpu_s": g, "gpu_ahead_s": ga, "compiles": len(new),
                          "compile_s": k,
                          "costs_from": s.kernel if s.kernel in costs else "all recorded sweeps"})

    def wall(gpu: float) -> float:
        return START_S + max(gpu / gpus, compile_s / compile_procs) + END_S

    return {"hardware": hardware, "gpus": gpus, "compile_procs": compile_procs,
            "gpu_s": gpu_s, "gpu_ahead_s": gpu_ahead_s, "compile_s": compile_s,
            "wall_s": wall(gpu_s), "wall_ahead_s": wall(gpu_ahead_s), "studies": per_study}


def render(found: list[Study], estimates: list[dict[str, Any]]) -> str:
    lines = ["| file | shape | dtype | grid | valid H100 | valid H200 | GPU s recorded / "
             "compiled ahead | compiles |", "|---|---|---|---|---|---|---|---|"]
    by = {(s.file, json.dumps(s.shape), s.dtype, s.hardware): s for s in found}
    est = {(e["hardware"], st["experiment"], json.dumps(st["shape"])): st
           for e in estimates for st in e["studies"]}
    for s in (s for s in found if s.hardware == HARDWARE[0]):
        key = (s.file, json.dumps(s.shape), s.dtype)
        other = by.get((*key, HARDWARE[1]))
        e = est.get((HARDWARE[0], s.experiment, json.dumps(s.shape)), {})
        shape = ",".join(f"{k}={v}" for k, v in s.shape.items())
        lines.append(f"| {s.file} | {shape} | {s.dtype} | {s.grid:,} | {s.valid:,} | "
                     f"{other.valid if other else 0:,} | {e.get('gpu_s', 0):.0f} / "
                     f"{e.get('gpu_ahead_s', 0):.0f} | {e.get('compiles', 0):,} |")
    lines.append("")
    for e in estimates:
        lines.append(f"{e['hardware']}: {e['gpu_s']:.0f} GPU s as recorded, {e['gpu_ahead_s']:.0f} "
                     f"compiled ahead; {e['compile_s']:.0f} s of compiles; on {e['gpus']} GPUs "
                     f"and {e['compile_procs']} compile processes about "
                     f"{e['wall_s'] / 60:.1f} min of wall time as recorded, "
                     f"{e['wall_ahead_s'] / 60:.1f} min compiled ahead")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="*", help="experiment files (default: configs/sweeps/large)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--gpus", type=int, default=GPUS)
    p.add_argument("--compile-procs", type=int, default=COMPILE_PROCS)
    args = p.parse_args(argv)
    paths = args.files or sorted(LARGE.glob("*.yaml"))
    found = studies(paths)
    costs = corpus_costs()
    estimates = [estimate(found, hw, costs, args.gpus, args.compile_procs) for hw in HARDWARE]
    small = [s for s in found if s.valid < MIN_VALID]
    if args.json:
        print(json.dumps({"studies": [{k: v for k, v in asdict(s).items() if k != "configs"}
                                      for s in found],
                          "costs": costs, "estimates": estimates}, indent=1))
    else:
        print(render(found, estimates))
    for s in small:
        print(f"{s.file} {s.shape} {s.dtype} on {s.hardware}: {s.valid} valid configs, fewer "
              f"than {MIN_VALID}", file=sys.stderr)
    return 1 if small else 0


if __name__ == "__main__":
    sys.exit(main())
