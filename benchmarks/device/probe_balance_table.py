"""How long the block table launch takes with and without BALANCE (session 21): BALANCE
was measured 4-6 points slower than the plain table order (H200 call 7) although it
evens the fixed-stride programs' work; its plan is a sequential loop over the experts in
the table kernel. This times that launch alone, from a kernels/grouped_gemm.py that still
has BALANCE (commit 4eaf225, given as a file), at the MoE shape.

    git show 4eaf225:kernels/grouped_gemm.py > /tmp/gg.py
    python3 benchmarks/device/probe_balance_table.py /tmp/gg.py
"""

from __future__ import annotations

import importlib.util
import sys

import triton.testing

SHAPE = {"M": 49152, "N": 1408, "K": 2048, "E": 64}


def main() -> None:
    spec = importlib.util.spec_from_file_location("gg_balance", sys.argv[1])
    gg = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gg)
    fam = gg.GroupedGemm()
    inputs = fam.make_inputs(SHAPE, "bf16", seed=0, device="cuda")
    base = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "BLOCK_TABLE": 1, "PERSISTENT": 1,
            "TAIL_SPLIT": 1, "GROUP_M": 1, "USE_TMA": 1}
    for bal in (0, 1):
        table = fam._launches(inputs, {**base, "BALANCE": bal})[0][0]
        ms = triton.testing.do_bench(table, warmup=25, rep=200, return_mode="median")
        print(f"BALANCE={bal}: block table launch {ms * 1000:.1f} us (median), meta "
              f"{ {k: v for k, v in table.meta.items() if k in ('P', 'NN', 'CHUNK')} }")


if __name__ == "__main__":
    main()
