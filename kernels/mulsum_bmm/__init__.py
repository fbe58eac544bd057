"""Granite-4 (Mamba-2 minimal SSD, HF ``torch_forward``) multiply-then-sum patterns.

The HF implementation writes four contractions as a broadcast product followed by a
sum. Each is a batched matmul over the batch ``(b, c, h)`` (batch, chunk, head):

* ``mulsum_bmm`` (G): ``(C[:, :, :, None, :, :] * B[:, :, None, :, :, :]).sum(-1)``,
  einsum ``bclhn,bcshn->bclsh``;
* ``mulsum_ydiag`` (Y_diag): ``(M[..., None] * X[:, :, None]).sum(3)``,
  einsum ``bclsh,bcshp->bclhp``;
* ``mulsum_states`` (states): ``(B_decay[..., None, :] * X[..., None]).sum(2)``,
  einsum ``bclhn,bclhp->bchpn``;
* ``mulsum_c_states`` (C_times_states): ``(C[..., None, :] * states[:, :, None]).sum(-1)``,
  einsum ``bclhn,bchpn->bclhp``,

with ``C, B, B_decay (b, c, l, h, n)`` (``s`` is the second ``l`` index of the same
chunk), ``X (b, c, l, h, p)`` the dt-scaled inputs, ``M (b, c, l, s, h)`` the masked G
and ``states (b, c, h, p, n)``. The seed shape of ``mulsum_bmm`` is the
Granite-4 one: C ``[32, 1, 256, 1, 48, 128]`` times B ``[32, 1, 1, 256, 48, 128]`` fp32,
whose broadcast intermediate is 51.5 GB. The siblings use the same layer (head dim p = 64).

Three implementations (``IMPL``; the tunables are ``_BmmPattern.tunables``, and those of
the IMPLs not chosen are ignored):

* ``broadcast_chunked``: the as-written product and sum, ``CHUNK`` rows of the chunked
  dimension (``l``, or ``p`` for states) at a time so the intermediate fits.
* ``bmm``: ``torch.matmul`` on permuted views; ``ALLOW_TF32`` sets
  ``torch.backends.cuda.matmul.allow_tf32`` around the call only (restored after).
* ``triton``: a strided batched ``tl.dot`` kernel (``INPUT_PRECISION``, tiles, warps,
  stages).

The ``bmm`` and ``triton`` outputs are written batch-major ``(b, c, h, M, N)`` and
returned as a permuted view with the eager shape: writing ``(b, c, l, s, h)`` directly
would scatter 4-byte stores at stride h. The values and shape match the eager output;
the strides do not (the consumer in the model, ``G * L.permute(...)``, is h-major anyway).

Eager is the broadcast form as written where its intermediate is below 64 GiB (so the
51.5 GB seed is the real thing: it needs an 80 GB GPU), else the chunked form. The
reference is an fp64 matmul.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
import triton
import triton.language as tl

from harness.kernel.api import (
    BenchCase,
    Config,
    DeviceSpec,
    Inputs,
    Kernel,
    Launch,
    Planned,
    Shape,
    Tolerance,
    Tunable,
    register,
)

IMPLS = ("broadcast_chunked", "bmm", "triton")
PRECISIONS = ("ieee", "tf32", "tf32x3")

#: Eager falls back to the chunked form above this intermediate size.
EAGER_MAX_BYTES = 64 << 30
#: broadcast_chunked configs whose per-chunk intermediate exceeds this are pruned.
CHUNK_MAX_BYTES = 16 << 30
#: fp32 accumulator elements per thread above which a triton config is pruned.
_MAX_ACC_PER_THREAD = 256

_TF32_TOL = Tolerance(1e-2, 2e-3)  # measured (emulated truncation) max abs err ~5e-3
_FP32_TOL = Tolerance(1e-5, 1e-5)  # measured fp32 / tf32x3 max abs err ~3e-6 (|ref| ~ 1)


@triton.jit
def _bmm_kernel(
    a_ptr, b_ptr, o_ptr, M, N, K, H,
    s_a_bc, s_a_h, s_am, s_ak,
    s_b_bc, s_b_h, s_bk, s_bn,
    s_o_bc, s_o_h, s_om, s_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    # One flat grid axis (tiles of one matrix fastest, then head, then b*c): the batch
    # can exceed the 65535 limit of grid axes 1 and 2.
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles = tl.cdiv(M, BLOCK_M) * tiles_n
    batch = pid // tiles
    tile = pid % tiles
    pid_m = tile // tiles_n
    pid_n = tile % tiles_n
    bc = (batch // H).to(tl.int64)
    hh = (batch % H).to(tl.int64)
    a_base = a_ptr + bc * s_a_bc + hh * s_a_h
    b_base = b_ptr + bc * s_b_bc + hh * s_b_h
    o_base = o_ptr + bc * s_o_bc + hh * s_o_h
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        mask_k = kk < K
        a = tl.load(a_base + offs_m[:, None] * s_am + kk[None, :] * s_ak,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_base + kk[:, None] * s_bk + offs_n[None, :] * s_bn,
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc = tl.dot(a, b, acc=acc, input_precision=INPUT_PRECISION)
    tl.store(o_base + offs_m[:, None] * s_om + offs_n[None, :] * s_on, acc,
             mask=mask_m[:, None] & mask_n[None, :])


def _is_tf32(cfg: Config) -> bool:
    impl = cfg.get("IMPL")
    return (impl == "triton" and cfg.get("INPUT_PRECISION") == "tf32") or (
        impl == "bmm" and bool(int(cfg.get("ALLOW_TF32", 0))))


class _BmmPattern(Planned, Kernel):
    """A broadcast multiply-sum that is a batched matmul over (b, c, h).

    Subclasses name two operands and say how to view them as ``[b*c, h, M, K]`` and
    ``[b*c, h, K, N]``, how the ``[b*c, h, M, N]`` result maps to the eager output, and
    how to write the as-written broadcast form for a slice of the chunked dimension.
    The four families share the tunables below.
    """

    dtypes = ("fp32",)
    #: The two operand names, in make_inputs order.
    operands: ClassVar[tuple[str, str]]
    #: The dimension broadcast_chunked slices, and its axis in the eager output.
    chunk_dim: ClassVar[str]
    chunk_axis: ClassVar[int]
    # No tf32x3 on AMD; tf32 on CDNA3 only (check_config prunes it elsewhere): the V710
    # keeps ieee. The interpreter (cpu) gets the smallest tiles.
    tunables: ClassVar[dict[str, Tunable]] = {
        "IMPL": Tunable(IMPLS, default="bmm",
                        doc="broadcast_chunked: the product and sum as written, in chunks; "
                            "bmm: torch.matmul; triton: a batched tl.dot kernel"),
        "CHUNK": Tunable((4, 16, 64), default=8,
                         doc="broadcast_chunked: rows of the chunked dimension at a time"),
        "ALLOW_TF32": Tunable((0, 1), default=0, doc="bmm: cuBLAS may use TF32"),
        "INPUT_PRECISION": Tunable(PRECISIONS, default="tf32x3",
                                   vendors={"amd": ("ieee", "tf32")},
                                   hardware={"V710": ("ieee",)},
                                   doc="triton: tl.dot's input precision (tf32x3: three tf32 "
                                       "products, fp32-level accuracy)"),
        "BLOCK_M": Tunable((32, 64, 128), default=128, hardware={"cpu": (32,)},
                           doc="triton: tile rows"),
        "BLOCK_N": Tunable((32, 64, 128, 256), default=128,
                           hardware={"V710": (32, 64, 128), "cpu": (32,)},
                           doc="triton: tile columns"),
        "BLOCK_K": Tunable((16, 32, 64), default=32, hardware={"cpu": (16,)},
                           doc="triton: reduction step"),
        "num_warps": Tunable((4, 8), default=8, doc="triton"),
        "num_stages": Tunable((2, 3, 4), default=3, vendors={"amd": (1, 2)}, doc="triton"),
    }
    bench: ClassVar[tuple[BenchCase, ...]] = (BenchCase("granite4", "fp32"),)

    # -- the pattern (subclasses) -------------------------------------------------------
    def _operand_shapes(self, s: dict[str, int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        raise NotImplementedError

    def _mnk(self, s: dict[str, int]) -> tuple[int, int, int]:
        raise NotImplementedError

    def _views(self, x: torch.Tensor, y: torch.Tensor, s: dict[str, int]
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The operands as [b*c, h, M, K] and [b*c, h, K, N] views."""
        raise NotImplementedError

    def _out_view(self, o4: torch.Tensor, s: dict[str, int]) -> torch.Tensor:
        """The [b*c, h, M, N] result as a view in the eager output's shape."""
        raise NotImplementedError

    def _broadcast(self, x: torch.Tensor, y: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """The as-written product and sum for rows lo:hi of the chunked dimension."""
        raise NotImplementedError

    # -- shared -------------------------------------------------------------------------
    def _out_shape(self, s: dict[str, int]) -> tuple[int, ...]:
        b, c = s["b"], s["c"]
        m, n, _ = self._mnk(s)
        return tuple(self._out_view(torch.empty(b * c, s["h"], m, n, device="meta"), s).shape)

    def _intermediate_bytes(self, s: dict[str, int], rows: int) -> int:
        m, n, k = self._mnk(s)
        full = s["b"] * s["c"] * s["h"] * m * n * k * 4
        return full * rows // s[self.chunk_dim]

    def make_inputs(self, shape: Shape, dtype: str, seed: int, device: str) -> Inputs:
        s = self.validate_shape(shape)
        if dtype != "fp32":
            raise ValueError(f"{self.name} is an fp32 problem, not {dtype}")
        g = torch.Generator(device="cpu").manual_seed(seed)
        _, _, k = self._mnk(s)
        # K^-1/4 per operand keeps the output at unit scale, so atol is a relative bound.
        scale = k ** -0.25
        sx, sy = self._operand_shapes(s)
        return {
            self.operands[0]: (scale * torch.randn(sx, generator=g)).to(device),
            self.operands[1]: (scale * torch.randn(sy, generator=g)).to(device),
        }

    def _xy(self, inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
        return inputs[self.operands[0]], inputs[self.operands[1]]

    def reference(self, inputs: Inputs, shape: Shape) -> torch.Tensor:
        s = self.validate_shape(shape)
        x, y = self._xy(inputs)
        a4, b4 = self._views(x.double(), y.double(), s)
        return self._out_view(torch.matmul(a4, b4).contiguous(), s)

    def eager(self, inputs: Inputs, shape: Shape) -> torch.Tensor:
        s = self.validate_shape(shape)
        x, y = self._xy(inputs)
        extent = s[self.chunk_dim]
        if self._intermediate_bytes(s, extent) <= EAGER_MAX_BYTES:
            return self._broadcast(x, y, 0, extent)
        rows = max(1, extent * (EAGER_MAX_BYTES // 8) // self._intermediate_bytes(s, extent))
        return torch.cat([self._broadcast(x, y, lo, min(lo + rows, extent))
                          for lo in range(0, extent, rows)], dim=self.chunk_axis)

    def baselines(self) -> dict[str, Callable[[Inputs, Shape], Callable[[], Any]]]:
        """The library rewrite users would reach for: torch.bmm, fp32 and tf32."""
        return {
            "torch.bmm fp32": lambda i, s: self.launcher(i, s, {"IMPL": "bmm", "ALLOW_TF32": 0}),
            "torch.bmm tf32": lambda i, s: self.launcher(i, s, {"IMPL": "bmm", "ALLOW_TF32": 1}),
        }

    def _plan(self, inputs: Inputs, shape: Shape,
              config: Config) -> tuple[Callable[[], Any], list[Launch]]:
        """The config's forward, and its Triton launch where IMPL is triton (the other
        IMPLs are torch calls: nothing to compile ahead)."""
        cfg = {**self.default_config, **config}
        s = self.validate_shape(shape)
        x, y = self._xy(inputs)
        impl = cfg["IMPL"]
        if impl == "broadcast_chunked":
            out = torch.empty(self._out_shape(s), device=x.device, dtype=x.dtype)
            extent, rows = s[self.chunk_dim], max(1, int(cfg["CHUNK"]))
            axis = self.chunk_axis

            def run_chunked() -> torch.Tensor:
                for lo in range(0, extent, rows):
                    hi = min(lo + rows, extent)
                    out.narrow(axis, lo, hi - lo).copy_(self._broadcast(x, y, lo, hi))
                return out

            return run_chunked, []

        m, n, k = self._mnk(s)
        bc, h = s["b"] * s["c"], s["h"]
        o4 = torch.empty(bc, h, m, n, device=x.device, dtype=x.dtype)
        a4, b4 = self._views(x, y, s)
        result = self._out_view(o4, s)
        if impl == "bmm":
            tf32 = bool(int(cfg["ALLOW_TF32"]))

            def run_bmm() -> torch.Tensor:
                prev = torch.backends.cuda.matmul.allow_tf32
                torch.backends.cuda.matmul.allow_tf32 = tf32
                try:
                    torch.matmul(a4, b4, out=o4)
                finally:
                    torch.backends.cuda.matmul.allow_tf32 = prev
                return result

            return run_bmm, []
        if impl != "triton":
            raise ValueError(f"IMPL must be one of {IMPLS}, got {impl!r}")
        prec = cfg["INPUT_PRECISION"]
        if prec not in PRECISIONS:
            raise ValueError(f"INPUT_PRECISION must be one of {PRECISIONS}, got {prec!r}")
        bm, bn, bk = int(cfg["BLOCK_M"]), int(cfg["BLOCK_N"]), int(cfg["BLOCK_K"])
        grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn) * h * bc,)
        args = (a4, b4, o4, m, n, k, h, *a4.stride(), *b4.stride(), *o4.stride())
        meta = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "INPUT_PRECISION": prec,
                "num_warps": int(cfg["num_warps"]), "num_stages": int(cfg["num_stages"])}

        launch = Launch(_bmm_kernel, grid, args, meta)
        kernel = _bmm_kernel[grid]

        def run_triton() -> torch.Tensor:
            kernel(*args, **meta)
            return result

        return run_triton, [launch]

    def flops(self, shape: Shape) -> float:
        s = self.validate_shape(shape)
        m, n, k = self._mnk(s)
        return 2.0 * s["b"] * s["c"] * s["h"] * m * n * k

    def bytes_moved(self, shape: Shape, dtype: str) -> float:
        s = self.validate_shape(shape)
        m, n, k = self._mnk(s)
        return 4.0 * s["b"] * s["c"] * s["h"] * (m * k + k * n + m * n)

    def compute_dtype(self, dtype: str) -> str | None:
        return "fp32"

    def tolerance(self, dtype: str, config: Config) -> Tolerance:
        return _TF32_TOL if _is_tf32({**self.default_config, **config}) else _FP32_TOL

    def precision(self, config: Config, dtype: str) -> str:
        """The Triton kernel's INPUT_PRECISION (ieee, tf32, tf32x3), torch.bmm's tf32 or
        ieee fp32, and the broadcast sums' ieee fp32."""
        cfg = {**self.default_config, **config}
        if _is_tf32(cfg):
            return "tf32"
        if cfg["IMPL"] == "triton" and cfg["INPUT_PRECISION"] == "tf32x3":
            return "tf32x3"
        return "ieee fp32"

    def check_config(self, config: Config, shape: Shape, device: DeviceSpec) -> str | None:
        cfg = {**self.default_config, **config}
        s = self.validate_shape(shape)
        impl = cfg["IMPL"]
        if impl not in IMPLS:
            return f"IMPL={impl!r} is not one of {IMPLS}"
        if impl == "broadcast_chunked":
            rows = int(cfg["CHUNK"])
            extent = s[self.chunk_dim]
            if rows < 1:
                return f"CHUNK={rows} < 1"
            if rows > extent:
                return f"CHUNK={rows} exceeds {self.chunk_dim}={extent}"
            inter = self._intermediate_bytes(s, rows)
            if inter > CHUNK_MAX_BYTES:
                return f"CHUNK={rows} needs a {inter / 2**30:.1f} GiB intermediate"
            return None
        if impl == "bmm":
            return None
        prec = cfg["INPUT_PRECISION"]
        if prec not in PRECISIONS:
            return f"INPUT_PRECISION={prec!r} is not one of {PRECISIONS}"
        if device.vendor == "amd" and (prec == "tf32x3" or (prec == "tf32"
                                                            and device.key != "MI300X")):
            return f"INPUT_PRECISION={prec} is not supported by Triton on {device.key}"
        m, n, k = self._mnk(s)
        bm, bn, bk = int(cfg["BLOCK_M"]), int(cfg["BLOCK_N"]), int(cfg["BLOCK_K"])
        for name, v, dim in (("BLOCK_M", bm, m), ("BLOCK_N", bn, n), ("BLOCK_K", bk, k)):
            if v < 16 or v & (v - 1):
                return f"{name}={v} must be a power of two >= 16 (tl.dot)"
            if v > max(16, triton.next_power_of_2(dim)):
                return f"{name}={v} exceeds the matrix extent {dim}"
        if device.interpreted:
            return None
        nw, stages = int(cfg["num_warps"]), int(cfg["num_stages"])
        smem = max(stages, 1) * (bm * bk + bk * bn) * 4
        if smem > device.smem_per_block:
            return f"shared memory {smem} B > {device.smem_per_block} B"
        if bm * bn / (32 * nw) > _MAX_ACC_PER_THREAD:
            return f"{bm}x{bn} accumulator over {nw} warps would spill"
        return None


@register("mulsum_bmm")
class MulSumBmm(_BmmPattern):
    """G = (C[:, :, :, None] * B[:, :, None]).sum(-1): bclhn,bcshn->bclsh."""

    dims = ("b", "c", "l", "s", "h", "n")
    operands = ("C", "B")
    chunk_dim, chunk_axis = "l", 2
    shapes: ClassVar[dict[str, dict[str, int]]] = {
        "granite4": {"b": 32, "c": 1, "l": 256, "s": 256, "h": 48, "n": 128},
        "test": {"b": 2, "c": 2, "l": 24, "s": 20, "h": 3, "n": 12},
    }

    def _operand_shapes(self, s):
        return (s["b"], s["c"], s["l"], s["h"], s["n"]), (s["b"], s["c"], s["s"], s["h"], s["n"])

    def _mnk(self, s):
        return s["l"], s["s"], s["n"]

    def _views(self, x, y, s):
        bc, h, n = s["b"] * s["c"], s["h"], s["n"]
        return (x.reshape(bc, s["l"], h, n).permute(0, 2, 1, 3),
                y.reshape(bc, s["s"], h, n).permute(0, 2, 3, 1))

    def _out_view(self, o4, s):
        return o4.view(s["b"], s["c"], s["h"], s["l"], s["s"]).permute(0, 1, 3, 4, 2)

    def _broadcast(self, x, y, lo, hi):
        return (x[:, :, lo:hi, None, :, :] * y[:, :, None, :, :, :]).sum(dim=-1)


@register("mulsum_ydiag")
class MulSumYDiag(_BmmPattern):
    """Y_diag = (M[..., None] * X[:, :, None]).sum(3): bclsh,bcshp->bclhp."""

    dims = ("b", "c", "l", "s", "h", "p")
    operands = ("M", "X")
    chunk_dim, chunk_axis = "l", 2
    shapes: ClassVar[dict[str, dict[str, int]]] = {
        "granite4": {"b": 32, "c": 1, "l": 256, "s": 256, "h": 48, "p": 64},
        "test": {"b": 2, "c": 2, "l": 24, "s": 20, "h": 3, "p": 12},
    }

    def _operand_shapes(self, s):
        return (s["b"], s["c"], s["l"], s["s"], s["h"]), (s["b"], s["c"], s["s"], s["h"], s["p"])

    def _mnk(self, s):
        return s["l"], s["p"], s["s"]

    def _views(self, x, y, s):
        bc, h = s["b"] * s["c"], s["h"]
        return (x.reshape(bc, s["l"], s["s"], h).permute(0, 3, 1, 2),
                y.reshape(bc, s["s"], h, s["p"]).permute(0, 2, 1, 3))

    def _out_view(self, o4, s):
        return o4.view(s["b"], s["c"], s["h"], s["l"], s["p"]).permute(0, 1, 3, 2, 4)

    def _broadcast(self, x, y, lo, hi):
        return (x[:, :, lo:hi, ..., None] * y[:, :, None]).sum(dim=3)


@register("mulsum_states")
class MulSumStates(_BmmPattern):
    """states = (Bd[..., None, :] * X[..., None]).sum(2): bclhn,bclhp->bchpn."""

    dims = ("b", "c", "l", "h", "p", "n")
    operands = ("B_decay", "X")
    chunk_dim, chunk_axis = "p", 3
    shapes: ClassVar[dict[str, dict[str, int]]] = {
        "granite4": {"b": 32, "c": 1, "l": 256, "h": 48, "p": 64, "n": 128},
        "test": {"b": 2, "c": 2, "l": 24, "h": 3, "p": 12, "n": 20},
    }

    def _operand_shapes(self, s):
        return (s["b"], s["c"], s["l"], s["h"], s["n"]), (s["b"], s["c"], s["l"], s["h"], s["p"])

    def _mnk(self, s):
        return s["p"], s["n"], s["l"]

    def _views(self, x, y, s):
        bc, h = s["b"] * s["c"], s["h"]
        return (y.reshape(bc, s["l"], h, s["p"]).permute(0, 2, 3, 1),
                x.reshape(bc, s["l"], h, s["n"]).permute(0, 2, 1, 3))

    def _out_view(self, o4, s):
        return o4.view(s["b"], s["c"], s["h"], s["p"], s["n"])

    def _broadcast(self, x, y, lo, hi):
        return (x[..., None, :] * y[..., lo:hi, None]).sum(dim=2)


@register("mulsum_c_states")
class MulSumCStates(_BmmPattern):
    """C_times_states = (C[..., None, :] * S[:, :, None]).sum(-1): bclhn,bchpn->bclhp."""

    dims = ("b", "c", "l", "h", "p", "n")
    operands = ("C", "states")
    chunk_dim, chunk_axis = "l", 2
    shapes: ClassVar[dict[str, dict[str, int]]] = {
        "granite4": {"b": 32, "c": 1, "l": 256, "h": 48, "p": 64, "n": 128},
        "test": {"b": 2, "c": 2, "l": 24, "h": 3, "p": 12, "n": 20},
    }

    def _operand_shapes(self, s):
        return (s["b"], s["c"], s["l"], s["h"], s["n"]), (s["b"], s["c"], s["h"], s["p"], s["n"])

    def _mnk(self, s):
        return s["l"], s["p"], s["n"]

    def _views(self, x, y, s):
        bc, h = s["b"] * s["c"], s["h"]
        return (x.reshape(bc, s["l"], h, s["n"]).permute(0, 2, 1, 3),
                y.reshape(bc, h, s["p"], s["n"]).permute(0, 1, 3, 2))

    def _out_view(self, o4, s):
        return o4.view(s["b"], s["c"], s["h"], s["l"], s["p"]).permute(0, 1, 3, 2, 4)

    def _broadcast(self, x, y, lo, hi):
        return (x[:, :, lo:hi, :, None, :] * y[:, :, None]).sum(dim=-1)
