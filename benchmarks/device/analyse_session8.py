"""The 216-config grid runs of device sessions (8 and later) as one table, from the
committed raw files.

    python3 benchmarks/device/analyse_session8.py \
        benchmarks/results/H200/2026-11-23-session8-call{1,2}

For each `kharness run --json` of the 216-config grid: the command's wall (from the
call's console.txt, measured by `date` around the command), the run's own wall and where
it went (timeline), GPU-held time and the timing fraction, the worker's start-up by step,
and the winner.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def _command_walls(folder: Path) -> dict[int, float]:
    text = (folder / "console.txt").read_text()
    return {int(m.group(1)): float(m.group(2))
            for m in re.finditer(r"^grid (\d+) \S+ rc=\d+ command wall ([\d.]+) s", text, re.M)}


def _winner(row: dict) -> str:
    p = row.get("params") or {}
    return (f"{p.get('BLOCK_M')}/{p.get('BLOCK_N')}/{p.get('BLOCK_K')} w{p.get('num_warps')} "
            f"s{p.get('num_stages')} G{p.get('GROUP_M')}")


def main(folders: list[str]) -> None:
    print("| call | run | timing (warmup/rep ms) | command wall s | imports + check s | Ray s "
          "| worker start s | search + re-measure s | tail s | GPU-held s | timing fraction "
          "| setup (compile waits) s | winner | why |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    starts = []
    for folder in map(Path, folders):
        walls = _command_walls(folder)
        for f in sorted((folder / "logs").glob("grid216_*.json")):
            if "fp16_first" in f.name:
                continue
            n, mode, wu, rep = f.stem.split("_")[1:5]
            d = json.loads(f.read_text())
            t = d["timeline_s"]
            row = d["rows"][0]
            print(f"| {folder.name.rsplit('-', 1)[-1]} | {n} {mode} | {wu}/{rep} "
                  f"| {walls.get(int(n), float('nan')):.1f} | {t['run_called']:.1f} "
                  f"| {t['ray_connected'] - t['run_called']:.1f} "
                  f"| {t['workers_ready'] - t['ray_connected']:.1f} "
                  f"| {t['search_done'] - t['search_started']:.1f} "
                  f"| {t['done'] - t['search_done']:.1f} | {d['gpu_held_s']:.1f} "
                  f"| {100 * d['timing_fraction']:.1f} % | {d['overhead_s'].get('setup', 0):.2f} "
                  f"| {_winner(row)} | {row.get('winner_reason', '')} |")
            for hw, steps in (d.get("worker_startup_s") or {}).items():
                starts.append((folder.name.rsplit("-", 1)[-1], n, mode, hw, steps))
    if starts:
        print("\nWorker start-up by step (s): " + "; ".join(
            f"{c} run {n} {m}: {s}" for c, n, m, _, s in starts))


if __name__ == "__main__":
    main(sys.argv[1:])
