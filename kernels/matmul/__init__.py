"""Dense matmul ``C[M, N] = A[M, K] @ B[K, N]``: the classic tiled Triton GEMM with a
grouped launch order.

A small, well-known family. It is the harness's throughput benchmark (the 216-config grid
at 8192^3 in bf16, ``configs/matmul_grid216.yaml``) and a template for a user's own
kernel, including ``compile_only``, which lets the workers compile queued configs ahead.
"""

from __future__ import annotations

import math
import os
from typing import Any, ClassVar

import torch
import triton
import triton.language as tl

from harness.kernel.api import (
    Config,
    DeviceSpec,
    Inputs,
    Kernel,
    Shape,
    SingleLaunch,
    Tolerance,
    Tunable,
    register,
)
from kernels._gemm_tiles import amd_meta, tile_reason

_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}



@triton.jit
def _matmul_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # Grouped ordering: GROUP_M consecutive row blocks sweep the column blocks together,
    # so the B tiles they share stay in L2 (GROUP_M = 1 is plain row-major order).
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows and columns past the edge wrap around: their loads stay in bounds without a
    # mask (the tail tile reads valid data), and the store below drops them.
    rows = (offs_m % M).to(tl.int64)  # 64-bit: M*K may pass 2**31 elements
    cols = (offs_n % N).to(tl.int64)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + cols[None, :] * stride_bn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if UPCAST:
            # The interpreter's bf16 dot is wrong; fp32 tiles give the exact answer.
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    c_ptrs = (c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm
              + offs_n.to(tl.int64)[None, :] * stride_cn)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


#: The largest M (tokens) for which row tiles below it (16, 32) are tried.
DECODE_M = 64


def _next_pow2(x: int) -> int:
    return 1 << max(int(x) - 1, 0).bit_length()


@register("matmul")
class Matmul(SingleLaunch, Kernel):
    """``C = A @ B`` for row-major A [M, K] and B [K, N]."""

    dims: ClassVar[tuple[str, ...]] = ("M", "N", "K")
    exact_dims: ClassVar[tuple[str, ...]] = ()
    # BLOCK_M 16 and 32 are decode tiles: check_config keeps them for M <= 64 only, so a
    # larger M has exactly 216 valid configs (3 x 3 x 2 x 2 x 3 x 2), which
    # configs/matmul_grid216.yaml tunes exhaustively. The defaults pass check_config on
    # H100/H200/A100 and on the V710 (AMD keeps one stage fewer in LDS), for every seed
    # shape. The interpreter (cpu) gets small tiles that stay fast under numpy.
    tunables: ClassVar[dict[str, Tunable]] = {
        "BLOCK_M": Tunable((16, 32, 64, 128, 256), default=128, hardware={"cpu": (64,)},
                           doc="rows of a tile; 16 and 32 are decode tiles (M <= 64 only)"),
        "BLOCK_N": Tunable((64, 128, 256), default=128, hardware={"cpu": (64,)},
                           doc="columns of a tile"),
        "BLOCK_K": Tunable((32, 64), default=32, hardware={"cpu": (32, 64)},
                           doc="reduction step"),
        "num_warps": Tunable((4, 8), default=4, hardware={"cpu": (4,)}),
        "num_stages": Tunable((3, 4, 5), default=3, vendors={"amd": (1, 2)},
                              hardware={"cpu": (3,)},
                              doc="pipeline depth (AMD's stream pipeliner wants 1-2; its "
                                  "LDS is smaller than Hopper's)"),
        "GROUP_M": Tunable((1, 8), default=8,
                           doc="1: row-major launch order; 8: L2-friendly groups of rows"),
        "waves_per_eu": Tunable(vendors={"amd": (0, 2)},
                                doc="AMD-only launch option, passed on ROCm only"),
    }
    shapes: ClassVar[dict[str, dict[str, int]]] = {
        "square-8192": {"M": 8192, "N": 8192, "K": 8192},
        "square-4096": {"M": 4096, "N": 4096, "K": 4096},
        "test": {"M": 256, "N": 256, "K": 256},
    }

    # -- inputs and semantics ---------------------------------------------------------
    def make_inputs(self, shape: Shape, dtype: str, seed: int, device: str) -> Inputs:
        s = self.validate_shape(shape)
        # Drawn on the device itself (seeded as well; a CPU generator takes seconds at 8192^2).
        g = torch.Generator(device=device).manual_seed(seed)
        tdt = _TORCH_DTYPES[dtype]
        a = torch.randn(s["M"], s["K"], generator=g, dtype=torch.float32, device=device)
        # 1/sqrt(K) keeps every output element ~N(0, 1) whatever K is.
        b = torch.randn(s["K"], s["N"], generator=g, dtype=torch.float32,
                        device=device) / math.sqrt(s["K"])
        return {"a": a.to(tdt).to(device), "b": b.to(tdt).to(device)}

    def reference(self, inputs: Inputs, shape: Shape) -> torch.Tensor:
        a, b = inputs["a"], inputs["b"]
        if a.device.type == "cpu":
            return (a.double() @ b.double()).float()
        # fp32 on the GPU (no TF32: torch's default for matmul), far tighter than bf16.
        return a.float() @ b.float()

    def eager(self, inputs: Inputs, shape: Shape) -> torch.Tensor:
        return inputs["a"] @ inputs["b"]

    def _launch(self, inputs: Inputs, config: Config
                ) -> tuple[Any, tuple, tuple, dict, torch.Tensor]:
        """(kernel, grid, args, meta, out): what the launcher and compile_only hand Triton."""
        cfg = {**self.default_config, **config}
        a, b = inputs["a"], inputs["b"]
        M, K = a.shape
        _, N = b.shape
        out = torch.empty(M, N, dtype=a.dtype, device=a.device)
        bm, bn, bk = int(cfg["BLOCK_M"]), int(cfg["BLOCK_N"]), int(cfg["BLOCK_K"])
        grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
        args = (a, b, out, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                out.stride(0), out.stride(1))
        meta: dict[str, Any] = {
            "BLOCK_M": bm,
            "BLOCK_N": bn,
            "BLOCK_K": bk,
            "GROUP_M": int(cfg["GROUP_M"]),
            "EVEN_K": K % bk == 0,
            "UPCAST": os.environ.get("TRITON_INTERPRET") == "1" and a.dtype != torch.float32,
            # fp32 inputs get true fp32 products, not TF32.
            "IEEE": a.dtype == torch.float32,
            "num_warps": int(cfg["num_warps"]),
            "num_stages": int(cfg["num_stages"]),
        }
        # Not on the CPU; "meta" inputs are compile_only's stand-ins for GPU ones.
        if a.device.type != "cpu" and torch.version.hip is not None:
            meta.update(amd_meta(cfg))
        return _matmul_kernel, grid, args, meta, out

    # -- cost model -------------------------------------------------------------------
    def flops(self, shape: Shape) -> float:
        return 2.0 * shape["M"] * shape["N"] * shape["K"]

    def bytes_moved(self, shape: Shape, dtype: str) -> float:
        item = torch.tensor([], dtype=_TORCH_DTYPES[dtype]).element_size()
        M, N, K = (int(shape[d]) for d in self.dims)
        return float((M * K + K * N + M * N) * item)

    # -- accuracy and validity --------------------------------------------------------
    def tolerance(self, dtype: str, config: Config) -> Tolerance:
        # Outputs are O(1); the error is the final rounding to the dtype plus fp32
        # summation order (fp32 runs with IEEE products, hence the tight bound).
        return {"fp32": Tolerance(1e-4, 1e-4), "fp16": Tolerance(1e-2, 1e-2)}.get(
            dtype, Tolerance(2e-2, 2e-2))

    def check_config(self, config: Config, shape: Shape, device: DeviceSpec) -> str | None:
        cfg = {**self.default_config, **config}
        bm, bn, bk = int(cfg["BLOCK_M"]), int(cfg["BLOCK_N"]), int(cfg["BLOCK_K"])
        warps, stages = int(cfg["num_warps"]), int(cfg["num_stages"])
        why = tile_reason(config, cfg, device)
        if why:
            return why
        # A tile larger than the padded dimension is mostly masked-out work.
        for name, v, dim in (("BLOCK_M", bm, "M"), ("BLOCK_N", bn, "N"), ("BLOCK_K", bk, "K")):
            if v > max(16, _next_pow2(int(shape[dim]))):
                return f"{name}={v} > next_pow2({dim})={_next_pow2(int(shape[dim]))}"
        # Row tiles below 64 are for decode shapes (a few tokens), where a 64-row tile
        # would be mostly padding; a larger M fills 64-row tiles, which keep the tensor
        # cores busier per loaded B tile.
        if bm < DECODE_M and _next_pow2(int(shape["M"])) > DECODE_M:
            return f"BLOCK_M={bm} < {DECODE_M} is a decode tile: M={shape['M']} > {DECODE_M}"
        # Shared memory: num_stages A and B tiles resident (2 bytes assumed: the tuned
        # dtypes; an fp32 config that does not fit fails at compile time instead). AMD's
        # stream pipeliner holds one stage in registers.
        buffers = max(1, stages - 1) if device.vendor == "amd" else stages
        smem = max(buffers * (bm * bk + bk * bn) * 2, bm * bn * 2)
        if smem > device.smem_per_block:
            return f"shared memory ~{smem} B > {device.smem_per_block} B per block"
        # Registers: beyond 256 fp32 accumulator values a thread spills for certain.
        lanes = 64 if device.vendor == "amd" else 32
        per_thread = bm * bn // (warps * lanes)
        if per_thread > 256:
            return f"{per_thread} accumulator values per thread > 256 (num_warps={warps})"
        if device.vendor == "amd" and warps > 8:
            return f"num_warps={warps} > 8 on AMD"
        return None
