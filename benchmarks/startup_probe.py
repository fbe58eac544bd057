#!/usr/bin/env python3
"""What a run's start is bounded by on this machine, each in a fresh process:

- ``ray_init_s``: a bare ``ray.init()`` (Ray's own start, the reference the fleet's
  first-trial target is set against), and ``ray.shutdown()``;
- ``harness_ray_s``: the harness's own Ray start (``start_local_ray``, as ``kharness run``);
- ``actor_s``: a GPU actor from ``.remote()`` to its first answer, and inside it the
  import of torch and the CUDA context;
- ``import_s``: the driver's imports on the way to ``run()``.

    python benchmarks/startup_probe.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

PROBES = {
    "ray_init_s": """
import time; t0 = time.monotonic()
import ray; t1 = time.monotonic()
ray.init(); t2 = time.monotonic()
ray.shutdown(); t3 = time.monotonic()
print({"import_ray": t1 - t0, "init": t2 - t1, "shutdown": t3 - t2})
""",
    "harness_ray_s": """
import time; t0 = time.monotonic()
import logging, ray
from harness.fleet.cluster import start_local_ray
t1 = time.monotonic()
start_local_ray(logging_level=logging.WARNING, log_to_driver=False)
t2 = time.monotonic()
@ray.remote(num_gpus=1)
class A:
    def __init__(self):
        t = time.monotonic(); import torch; self.imp = time.monotonic() - t
        t = time.monotonic(); torch.zeros(1, device="cuda"); self.ctx = time.monotonic() - t
    def info(self):
        return self.imp, self.ctx
t3 = time.monotonic()
imp, ctx = ray.get(A.remote().info.remote())
t4 = time.monotonic()
ray.shutdown(); t5 = time.monotonic()
print({"import": t1 - t0, "start": t2 - t1, "actor_ready": t4 - t3, "actor_import_torch": imp,
       "actor_cuda_context": ctx, "shutdown": t5 - t4})
""",
    "import_s": """
import time; t0 = time.monotonic()
import harness.cli.run_command; t1 = time.monotonic()
import harness.run.runner; t2 = time.monotonic()
import torch; t3 = time.monotonic()
import triton; t4 = time.monotonic()
print({"cli": t1 - t0, "harness.run.runner": t2 - t1, "torch": t3 - t2, "triton": t4 - t3})
""",
}


def probe(code: str) -> dict:
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=180, env=os.environ)
    wall = time.monotonic() - t0
    if out.returncode != 0:
        return {"error": out.stderr[-2000:], "wall": wall}
    res = eval(out.stdout.strip().splitlines()[-1])  # noqa: S307 - our own child's dict
    return {**{k: round(v, 3) for k, v in res.items()}, "process_wall": round(wall, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out")
    p.add_argument("--repeat", type=int, default=2)
    args = p.parse_args()
    res = {name: [probe(code) for _ in range(args.repeat)] for name, code in PROBES.items()}
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
