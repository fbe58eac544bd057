"""One timed-free launch each of the grouped GEMM (E=64 balanced, then E=1) for Nsight
Compute to count DRAM and L2 bytes: is each expert's W read from DRAM once?

    ncu --metrics dram__bytes_read.sum,lts__t_bytes.sum -k regex:grouped \\
        python3 benchmarks/device/ncu_grouped_bytes.py [GROUP_M]
"""

import sys

import torch

from kernels.grouped_gemm import GroupedGemm, make_grouped_inputs

M, N, K = 49152, 1408, 2048
fam = GroupedGemm()
cfg = {"BLOCK_M": 256, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4,
       "USE_TMA": 1, "GROUP_M": int(sys.argv[1]) if len(sys.argv) > 1 else 1}
for E in (64, 1):
    inputs = make_grouped_inputs([M // E] * E, N, K, "bf16", seed=E, device="cuda")
    fn = fam.launcher(inputs, {"M": M, "N": N, "K": K, "E": E}, cfg)
    fn()
    torch.cuda.synchronize()
