"""A trivial Triton kernel that each compile child builds once at start-up.

A process's first compile loads Triton's backend, its MLIR and LLVM pipelines and ptxas:
about a second on an H200 box, measured as the extra time of each child's first config.
Compiling this first, while the worker itself is still starting, keeps that second off
the first configs the GPU waits for.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _mma_tile(a_ptr, b_ptr, c_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    idx = offs[:, None] * BLOCK + offs[None, :]
    c = tl.dot(tl.load(a_ptr + idx), tl.load(b_ptr + idx))
    tl.store(c_ptr + idx, c)


def compile_once() -> None:
    """Compile ``_mma_tile`` for this process's GPU, on meta tensors (nothing launched,
    nothing allocated)."""
    import torch

    a = torch.empty(32, 32, dtype=torch.float16, device="meta")
    c = torch.empty(32, 32, dtype=torch.float32, device="meta")
    _mma_tile.warmup(a, a, c, BLOCK=32, grid=(1,))
