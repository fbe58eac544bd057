"""Memory-bound fused element-wise ops of the Mamba / Granite-4 layers.

The op is part of the problem, not a tunable, so each op is its own small family on a
shared base (:class:`FusedElementwise`), all over a ``(rows, cols)`` input:

* ``rmsnorm``: ``x * rsqrt(mean(x^2, -1) + eps) * weight``, fp32 accumulation, one
  program per row (one pass when ``BLOCK_SIZE >= cols``, else two loops over the row);
* ``silu``: ``x * sigmoid(x)``;
* ``silu_mul``: ``x * silu(gate)``;
* ``softplus_clamp``: ``clamp(softplus(x + bias[col]), lo, hi)`` (Mamba-2's dt with
  ``dt_bias`` and ``time_step_limit``).

The three point-wise ops run one flat kernel over ``rows * cols`` elements. The four
share their tunables (``FusedElementwise.tunables``). Arithmetic is fp32, loads and
stores in the input dtype. References are fp64.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from harness.kernel.api import (
    BenchCase,
    Config,
    DeviceSpec,
    Inputs,
    Kernel,
    Shape,
    SingleLaunch,
    Tunable,
    register,
)
from kernels._triton_common import softplus as _softplus

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_MAX_ELEMS_PER_THREAD = 64

OP_SILU, OP_SILU_MUL, OP_SOFTPLUS_CLAMP = 0, 1, 2


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, y_ptr, N_COLS, eps, BLOCK_SIZE: tl.constexpr,
                    ONE_PASS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * N_COLS
    y_row = y_ptr + row * N_COLS
    offs = tl.arange(0, BLOCK_SIZE)
    if ONE_PASS:
        mask = offs < N_COLS
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / N_COLS + eps)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_row + offs, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([BLOCK_SIZE], dtype=tl.float32)
        for c0 in range(0, N_COLS, BLOCK_SIZE):
            mask = c0 + offs < N_COLS
            x = tl.load(x_row + c0 + offs, mask=mask, other=0.0).to(tl.float32)
            acc += x * x
        rstd = tl.rsqrt(tl.sum(acc, axis=0) / N_COLS + eps)
        # The second read of the row mostly hits L2 (one row is at most a few 10 kB).
        for c0 in range(0, N_COLS, BLOCK_SIZE):
            mask = c0 + offs < N_COLS
            x = tl.load(x_row + c0 + offs, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + c0 + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_row + c0 + offs, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _pointwise_kernel(x_ptr, g_ptr, y_ptr, NUMEL, N_COLS, lo, hi,
                      OP: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < NUMEL
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if OP == 0:
        y = x * tl.sigmoid(x)
    elif OP == 1:
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = x * (g * tl.sigmoid(g))
    else:
        bias = tl.load(g_ptr + offs % N_COLS, mask=mask, other=0.0).to(tl.float32)
        y = tl.minimum(tl.maximum(_softplus(x + bias), lo), hi)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


class FusedElementwise(SingleLaunch, Kernel):
    """Shared base: a (rows, cols) input, BLOCK_SIZE and num_warps, no matrix work."""

    dims = ("rows", "cols")
    dtypes = ("bf16", "fp16", "fp32")
    tunables: ClassVar[dict[str, Tunable]] = {
        "BLOCK_SIZE": Tunable((256, 512, 1024, 2048, 4096, 8192), default=1024,
                              hardware={"cpu": (256, 1024)},
                              doc="elements per program: of a row for rmsnorm (one pass "
                                  "when BLOCK_SIZE >= cols), of the flat tensor otherwise"),
        "num_warps": Tunable((1, 2, 4, 8, 16), default=4, hardware={"cpu": (4,)}),
    }
    shapes: ClassVar[dict[str, dict[str, int]]] = {
        "r8192-c4096": {"rows": 8192, "cols": 4096},
        "test": {"rows": 5, "cols": 300},
    }
    bench: ClassVar[tuple[BenchCase, ...]] = (BenchCase("r8192-c4096", "bf16"),)
    #: flops per element and how many (rows, cols) tensors move (inputs + output).
    flops_per_elem: ClassVar[float]
    full_tensors: ClassVar[int]
    #: whether a (cols,) vector in the input dtype is read too.
    col_vector: ClassVar[bool] = False

    def flops(self, shape: Shape) -> float:
        s = self.validate_shape(shape)
        return float(self.flops_per_elem * s["rows"] * s["cols"])

    def bytes_moved(self, shape: Shape, dtype: str) -> float:
        s = self.validate_shape(shape)
        es = torch.finfo(_DTYPES[dtype]).bits // 8
        return float(es * (self.full_tensors * s["rows"] * s["cols"]
                           + (s["cols"] if self.col_vector else 0)))

    def compute_dtype(self, dtype: str) -> str | None:
        return None

    def _block_extent(self, s: dict[str, int]) -> int:
        """The extent BLOCK_SIZE tiles: the flat tensor (a row for rmsnorm)."""
        return s["rows"] * s["cols"]

    def check_config(self, config: Config, shape: Shape, device: DeviceSpec) -> str | None:
        cfg = {**self.default_config, **config}
        s = self.validate_shape(shape)
        bs, nw = int(cfg["BLOCK_SIZE"]), int(cfg["num_warps"])
        for name, v in (("BLOCK_SIZE", bs), ("num_warps", nw)):
            if v < 1 or v & (v - 1):
                return f"{name}={v} is not a power of two"
        extent = self._block_extent(s)
        if bs > max(triton.next_power_of_2(extent), 32):
            return f"BLOCK_SIZE={bs} exceeds the {extent} elements it tiles"
        if not device.interpreted and bs / (32 * nw) > _MAX_ELEMS_PER_THREAD:
            return f"BLOCK_SIZE={bs} over {nw} warps is {bs // (32 * nw)} elements per thread"
        return None

    def _new_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device="cpu").manual_seed(seed)


class _Pointwise(FusedElementwise):
    op: ClassVar[int]

    def _second(self, inputs: Inputs) -> torch.Tensor | None:
        return None

    def _launch(self, inputs: Inputs, config: Config) -> tuple[Any, tuple, tuple, dict, Any]:
        cfg = {**self.default_config, **config}
        x = inputs["x"].contiguous()
        second = self._second(inputs)
        g = x if second is None else second.contiguous()
        y = torch.empty_like(x)
        numel, bs = x.numel(), int(cfg["BLOCK_SIZE"])
        lo, hi = float(inputs.get("lo", 0.0)), float(inputs.get("hi", 0.0))
        return (_pointwise_kernel, (triton.cdiv(numel, bs),),
                (x, g, y, numel, x.shape[1], lo, hi),
                {"OP": self.op, "BLOCK_SIZE": bs, "num_warps": int(cfg["num_warps"])}, y)


@register("rmsnorm")
class RMSNorm(FusedElementwise):
    """y = x * rsqrt(mean(x^2) + eps) * weight, fp32 accumulation, eps = 1e-6."""

    default_config: ClassVar[dict[str, Any]] = {"BLOCK_SIZE": 4096, "num_warps": 8}
    flops_per_elem, full_tensors, col_vector = 4.0, 2, True

    def _block_extent(self, s: dict[str, int]) -> int:
        return s["cols"]

    def make_inputs(self, shape: Shape, dtype: str, seed: int, device: str) -> Inputs:
        s = self.validate_shape(shape)
        g = self._new_generator(seed)
        x = torch.randn(s["rows"], s["cols"], generator=g)
        w = 1.0 + 0.1 * torch.randn(s["cols"], generator=g)
        return {"x": x.to(_DTYPES[dtype]).to(device), "weight": w.to(_DTYPES[dtype]).to(device),
                "eps": 1e-6}

    def reference(self, inputs: Inputs, shape: Shape) -> torch.Tensor:
        x, w = inputs["x"].double(), inputs["weight"].double()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + inputs["eps"]) * w

    def eager(self, inputs: Inputs, shape: Shape) -> torch.Tensor:
        # The HF (Llama/Granite) RMSNorm.
        x, w = inputs["x"], inputs["weight"]
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + inputs["eps"])
        return w * xf.to(x.dtype)

    def _launch(self, inputs: Inputs, config: Config) -> tuple[Any, tuple, tuple, dict, Any]:
        cfg = {**self.default_config, **config}
        x, w = inputs["x"].contiguous(), inputs["weight"].contiguous()
        rows, cols = x.shape
        y = torch.empty_like(x)
        bs, nw = int(cfg["BLOCK_SIZE"]), int(cfg["num_warps"])
        return (_rmsnorm_kernel, (rows,), (x, w, y, cols, float(inputs["eps"])),
                {"BLOCK_SIZE": bs, "ONE_PASS": bs >= cols, "num_warps": nw}, y)


@register("silu")
class SiLU(_Pointwise):
    """y = x * sigmoid(x)."""

    op = OP_SILU
    flops_per_elem, full_tensors = 4.0, 2

    def make_inputs(self, shape: Shape, dtype: str, seed: int, device: str) -> Inputs:
        s = self.validate_shape(shape)
        x = 2.0 * torch.randn(s["rows"], s["cols"], generator=self._new_generator(seed))
        return {"x": x.to(_DTYPES[dtype]).to(device)}

    def reference(self, inputs: Inputs, shape: Shape) -> torch.Tensor:
        return F.silu(inputs["x"].double())

    def eager(self, inputs: Inputs, shape: Shape) -> torch.Tensor:
        return F.silu(inputs["x"])


@register("silu_mul")
class SiLUMul(_Pointwise):
    """y = x * silu(gate) (the gate of Mamba's output / a SwiGLU MLP)."""

    op = OP_SILU_MUL
    flops_per_elem, full_tensors = 5.0, 3

    def make_inputs(self, shape: Shape, dtype: str, seed: int, device: str) -> Inputs:
        s = self.validate_shape(shape)
        g = self._new_generator(seed)
        x = torch.randn(s["rows"], s["cols"], generator=g)
        gate = 2.0 * torch.randn(s["rows"], s["cols"], generator=g)
        return {"x": x.to(_DTYPES[dtype]).to(device), "gate": gate.to(_DTYPES[dtype]).to(device)}

    def _second(self, inputs: Inputs) -> torch.Tensor | None:
        return inputs["gate"]

    def reference(self, inputs: Inputs, shape: Shape) -> torch.Tensor:
        return inputs["x"].double() * F.silu(inputs["gate"].double())

    def eager(self, inputs: Inputs, shape: Shape) -> torch.Tensor:
        return inputs["x"] * F.silu(inputs["gate"])


@register("softplus_clamp")
class SoftplusClamp(_Pointwise):
    """y = clamp(softplus(x + bias), lo, hi) with a per-column bias (Mamba-2 dt)."""

    op = OP_SOFTPLUS_CLAMP
    flops_per_elem, full_tensors, col_vector = 7.0, 2, True

    def make_inputs(self, shape: Shape, dtype: str, seed: int, device: str) -> Inputs:
        s = self.validate_shape(shape)
        g = self._new_generator(seed)
        x = torch.randn(s["rows"], s["cols"], generator=g)
        # softplus(x - 2 +- 1) spans ~0.01 .. 2: both clamp bounds are active.
        bias = -2.0 + torch.randn(s["cols"], generator=g)
        return {"x": x.to(_DTYPES[dtype]).to(device), "bias": bias.to(_DTYPES[dtype]).to(device),
                "lo": 0.05, "hi": 1.0}

    def _second(self, inputs: Inputs) -> torch.Tensor | None:
        return inputs["bias"]

    def reference(self, inputs: Inputs, shape: Shape) -> torch.Tensor:
        z = inputs["x"].double() + inputs["bias"].double()
        return F.softplus(z).clamp(inputs["lo"], inputs["hi"])

    def eager(self, inputs: Inputs, shape: Shape) -> torch.Tensor:
        return F.softplus(inputs["x"] + inputs["bias"]).clamp(inputs["lo"], inputs["hi"])
