"""Print a short summary of `kharness run --json` outputs (device scripts' logs).

    python3 benchmarks/device/summ.py run1.json [run2.json ...]
"""

from __future__ import annotations

import json
import os
import sys


def main(paths: list[str]) -> None:
    for f in paths:
        try:
            d = json.load(open(f))
        except Exception as e:  # a run that died prints nothing parseable
            print(os.path.basename(f), "no summary:", e)
            continue
        print(os.path.basename(f), "wall", round(d.get("wall_s", 0), 1), "held",
              round(d.get("gpu_held_s", 0), 1), "timing_fraction",
              round(d.get("timing_fraction") or 0, 3), "overhead", d.get("overhead_s"))
        print("   timeline", d.get("timeline_s"))
        if d.get("mlflow_logger"):
            print("   mlflow logger", d["mlflow_logger"])
        for r in d["rows"]:
            print("   ", r["shape"], r["dtype"], r["hardware"], "best", r.get("latency_ms"),
                  r.get("params"), "default", r.get("default_latency_ms"), r["counts"],
                  (r.get("failures") or [""])[:1])


if __name__ == "__main__":
    main(sys.argv[1:])
