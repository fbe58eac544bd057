"""One measurement of each GPU family's pack config (or default) through the Measurer, on
its named shape: the NaN-filled output checked after timing, on launchers that name their
output (one Triton launch) and on those that do not (several launches, library calls).

    python3 benchmarks/device/diag_measure_families.py
"""

from __future__ import annotations

import torch

from harness.kernel_api import get
from harness.measure import Measurer, Timing
from harness.packs.lookup import lookup

CASES = [("matmul", "bf16", None), ("grouped_gemm", "bf16", "deepseek-v3-16b"),
         ("minigpt_block", "fp32", None), ("mamba2_ssd", "bf16", None),
         ("selective_scan", "bf16", None), ("rmsnorm", "bf16", None)]


def main() -> None:
    m = Measurer(Timing(10, 40))
    for name, dtype, shape_name in CASES:
        fam = get(name)
        shapes = {k: v for k, v in fam.shapes.items() if k != "test"}
        shape = shapes[shape_name] if shape_name else next(iter(shapes.values()))
        config = dict(lookup(name, dtype, **shape))  # the pack's, else the default
        fn = fam.launcher(fam.make_inputs(shape, dtype, 0, "cuda"), shape, config)
        res = m.measure(fam, shape, dtype, config, seed=0)
        print(f"{name:15s} {dtype} named_out={hasattr(fn, 'out')} ok={res.ok} "
              f"{res.latency_ms:.4f} ms err={res.max_abs_err:.3g} {res.reason[:200]}", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
