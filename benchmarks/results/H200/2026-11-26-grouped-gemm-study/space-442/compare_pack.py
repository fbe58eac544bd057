"""The shipped H200 pack's grouped_gemm config at the MoE shape against the config a study
froze (argv[1]: that study's pack), in 7 interleaved rounds of 200 ms windows."""
import json
import statistics
import sys

from harness import hardware
from harness.kernel_api import get
from harness.measure import Measurer, Timing, device_peaks

fam = get("grouped_gemm")
shape = fam.shapes["deepseek-v3-16b"]
key = fam.shape_key(shape)
peaks = device_peaks(hardware.current_device())


def config(path):
    return json.load(open(path))["kernels"]["grouped_gemm"]["bf16"][key]["config"]


cands = {"pack": config("packs/H200/grouped_gemm.json"), "study": config(sys.argv[1])}
m = Measurer(Timing(rep_ms=200))
res = {k: [] for k in cands}
for _ in range(7):
    for k, c in cands.items():
        res[k].append(m.measure(fam, shape, "bf16", {**fam.default_config, **c}, 0,
                                peaks).latency_ms)
print(json.dumps({k: {"median_ms": statistics.median(v), "rounds_ms": v, "config": cands[k]}
                  for k, v in res.items()}, indent=1))
