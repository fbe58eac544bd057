# The shipped H200 pack's config against the configs a 100-trial study of the shipped space found, interleaved rounds.
import json, statistics
from harness import hardware
from harness.kernel_api import get
from harness.measure import Measurer, Timing, device_peaks
fam = get("grouped_gemm"); shape = fam.shapes["deepseek-v3-16b"]
spec = hardware.current_device(); peaks = device_peaks(spec)
g = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "PERSISTENT": 1, "USE_TMA": 1, "GLUON": 3, "num_warps": 4}
cands = {
 "pack": {**g, "GROUP_M": 1, "num_stages": 4, "TMA_STORE": 1, "TAIL_SPLIT": 1, "SWAP_AB": 1, "TALL_TILE": 1, "TAIL_DEAL": 1},
 "study frozen": {**g, "GROUP_M": 8, "num_stages": 4, "TMA_STORE": 1, "TAIL_SPLIT": 1},
 "study search best": {**g, "GROUP_M": 1, "num_stages": 5},
 "study search 2nd": {**g, "GROUP_M": 8, "num_stages": 5, "SWAP_AB": 1},
}
m = Measurer(Timing(rep_ms=200))
res = {k: [] for k in cands}
for r in range(7):
    for k, c in cands.items():
        res[k].append(m.measure(fam, shape, "bf16", {**fam.default_config, **c}, 0, peaks).latency_ms)
out = {k: {"median_ms": statistics.median(v), "rounds_ms": v, "config": cands[k]} for k, v in res.items()}
print(json.dumps(out, indent=1))
