"""A row-wise softmax written as a user writes one from Triton's tutorial, outside the
harness: one program per ``BLOCK_R`` rows, each row held in registers, ``BLOCK_C`` the
next power of two of the row length. The fleet's GPU test and benchmark copy this file
into an empty directory and tune it from there (``kernel: mymod:Softmax``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from harness.kernel.api import Kernel, SingleLaunch, Tunable

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@triton.jit
def softmax_kernel(out_ptr, in_ptr, n_rows, n_cols, in_stride, out_stride,
                   BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    x = tl.load(in_ptr + rows[:, None] * in_stride + cols[None, :], mask=mask,
                other=-float("inf")).to(tl.float32)
    x = x - tl.max(x, axis=1)[:, None]
    num = tl.exp(x)
    y = num / tl.sum(num, axis=1)[:, None]
    tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :],
             y.to(out_ptr.dtype.element_ty), mask=mask)


class Softmax(SingleLaunch, Kernel):
    name = "softmax"
    dims = ("R", "C")
    tunables = {
        "BLOCK_R": Tunable((1, 2, 4, 8), default=1, doc="rows per program"),
        "num_warps": Tunable((1, 2, 4, 8, 16), default=4),
        "num_stages": Tunable((1, 2), default=1),
    }
    shapes = {"test": {"R": 64, "C": 256}}

    def make_inputs(self, shape, dtype, seed, device):
        g = torch.Generator(device=device).manual_seed(seed)
        x = torch.randn(shape["R"], shape["C"], generator=g, device=device)
        return {"x": x.to(DTYPES[dtype])}

    def reference(self, inputs, shape):
        return torch.softmax(inputs["x"].float(), dim=-1)

    def eager(self, inputs, shape):
        return torch.softmax(inputs["x"], dim=-1)

    def _launch(self, inputs, config):
        x = inputs["x"]
        out = torch.empty_like(x)
        R, C = x.shape
        block_r = int(config["BLOCK_R"])
        meta = {"BLOCK_R": block_r, "BLOCK_C": triton.next_power_of_2(C),
                "num_warps": int(config["num_warps"]), "num_stages": int(config["num_stages"])}
        return (softmax_kernel, (triton.cdiv(R, block_r),),
                (out, x, R, C, x.stride(0), out.stride(0)), meta, out)

    def flops(self, shape):
        return 5.0 * shape["R"] * shape["C"]

    def bytes_moved(self, shape, dtype):
        return 2.0 * shape["R"] * shape["C"] * DTYPES[dtype].itemsize

    def compute_dtype(self, dtype):
        return None
