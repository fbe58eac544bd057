"""MoE grouped GEMM (contiguous grouped layout), as used by the expert FFNs of an MoE layer.

``A`` [M, K] holds the routed rows sorted by expert, ``offsets`` int32 [E + 1] marks where
each expert's rows start (``offsets[0] = 0``, ``offsets[E] = M``), ``W`` [E, N, K] holds one
``nn.Linear``-layout weight per expert, and ``out[rows of e] = A[rows of e] @ W[e]^T``.

One launch, no host sync, no per-call host preparation: each program reads the offsets
itself. Two engines (the ``GLUON`` tunable):

- ``GLUON=0``: the Triton kernels of ``triton_path`` (pointer loads, or with ``USE_TMA``
  tensor descriptors; one tile per program or ``PERSISTENT``; ``SWAP_AB`` computes the
  tiles transposed, ``TMA_STORE`` stores full tiles by descriptor).
- ``GLUON=3``: the warp-specialized persistent Gluon kernel of ``gluon`` (Hopper only: a
  TMA producer warp, two ping-pong consumer warp groups or one cooperative pair),
  with ``TALL_TILE`` and ``TAIL_DEAL`` of its own.

``TAIL_SPLIT=1`` runs an expert's short tail at half height in both. ``constraints``
says which configs can run where.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from harness.kernel.api import (
    BenchCase,
    Config,
    DeviceSpec,
    Inputs,
    Kernel,
    Launch,
    Launches,
    Shape,
    Tolerance,
    Tunable,
    register,
)
from kernels._gemm_tiles import AMD_KWARGS

from . import constraints
from .triton_path import check_tma_layout, num_sms, triton_launch

try:
    from . import gluon as _gluon
except (ImportError, AttributeError) as _exc:  # a Triton without Gluon's Hopper API
    _gluon = None
    _GLUON_MISSING: str | None = f"{type(_exc).__name__}: {_exc}"
else:
    _GLUON_MISSING = None if _gluon.WS_API else "this Triton's gl.warp_specialize is the old form"

__all__ = ["AMD_KWARGS", "GroupedGemm", "Launch", "counts_to_offsets", "make_grouped_inputs"]

_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_ITEM_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
#: Up to this many experts the byte model counts those seed 0's routing gives rows
#: (drawn: milliseconds); past it, their expected number (closed form).
EXACT_EXPERTS = 1 << 16
# A bound, not a library choice: the benchmark gives rows named "bound: ..." no roofline.
DENSE_BOUND = "bound: dense cuBLAS GEMM of the same FLOPs (not the same result)"


def counts_to_offsets(counts: list[int]) -> list[int]:
    """Per-expert row counts -> the [E + 1] offsets list."""
    offs = [0]
    for c in counts:
        offs.append(offs[-1] + int(c))
    return offs


def make_grouped_inputs(
    counts: list[int], N: int, K: int, dtype: str, seed: int, device: str
) -> Inputs:
    """Inputs for explicit per-expert row counts (tests use it to force empty experts)."""
    # Drawn on the device itself: a CPU generator takes seconds for the 0.3 G values of
    # the MoE shape, and a GPU's stream is as seeded and repeatable.
    g = torch.Generator(device=device).manual_seed(seed)
    E = len(counts)
    offs = counts_to_offsets(counts)
    M = offs[-1]
    tdt = _TORCH_DTYPES[dtype]
    a = torch.randn(M, K, generator=g, dtype=torch.float32, device=device)
    # 1/sqrt(K) keeps every output element ~N(0, 1) whatever K is.
    w = torch.randn(E, N, K, generator=g, dtype=torch.float32, device=device) / math.sqrt(K)
    return {
        "a": a.to(tdt).to(device),
        "w": w.to(tdt).to(device),
        "offsets": torch.tensor(offs, dtype=torch.int32).to(device),
        # The eager loop slices on the host; a CPU copy spares it a device sync.
        "offsets_host": offs,
    }


def _torch_grouped_mm() -> Callable[..., torch.Tensor] | None:
    """torch.nn.functional.grouped_mm (public since torch 2.9) or torch._grouped_mm."""
    fn = getattr(torch.nn.functional, "grouped_mm", None)
    return fn if fn is not None else getattr(torch, "_grouped_mm", None)


def _grouped_mm_baseline(inputs: Inputs, shape: Shape) -> Callable[[], torch.Tensor]:
    """torch's grouped GEMM: 2D A [M, K] x 3D B [E, K, N] with int32 ``offs`` = the
    experts' end rows. W.transpose(1, 2) is the column-major B it takes without a copy.
    Its kernels want 16-byte aligned rows (K and N multiples of 8 in bf16) and, on CUDA,
    bf16 on sm90+ for the fast path; where this torch refuses the problem, the raise
    reaches the bench, which reports the baseline as failed."""
    fn = _torch_grouped_mm()
    if fn is None:
        raise RuntimeError("this torch has no grouped_mm")
    a, w = inputs["a"], inputs["w"]
    b = w.transpose(1, 2)
    ends = inputs["offsets"][1:].to(torch.int32).contiguous()
    return lambda: fn(a, b, offs=ends, out_dtype=a.dtype)


def _dense_baseline(inputs: Inputs, shape: Shape) -> Callable[[], torch.Tensor]:
    """One dense [M, K] x [K, N] GEMM (expert 0's weight for every row): the same
    2*M*N*K FLOPs and output shape, not the same result."""
    a, w = inputs["a"], inputs["w"]
    b = w[0].t()
    out = torch.empty(a.shape[0], w.shape[1], dtype=a.dtype, device=a.device)
    return lambda: torch.mm(a, b, out=out)


@register("grouped_gemm")
class GroupedGemm(Launches, Kernel):
    """Contiguous grouped GEMM: ``out[M, N] = A[rows of e] @ W[e]^T`` for each expert e."""

    dims: ClassVar[tuple[str, ...]] = ("M", "N", "K", "E")
    # M (routed rows) varies per batch and is matched by nearest; the layer fixes the rest.
    exact_dims: ClassVar[tuple[str, ...]] = ("N", "K", "E")
    # AMD: its own launch options (passed on ROCm only), and 1-2 stages (the stream
    # pipeliner's; LDS is smaller than on Hopper). The interpreter (cpu): a small space of
    # tiles that stay fast under numpy; it emulates tensor descriptors (USE_TMA), not the
    # wgmma shape choice (SWAP_AB: tests/ run it) nor Gluon (compiled for sm_90 in tests/).
    tunables: ClassVar[dict[str, Tunable]] = {
        "BLOCK_M": Tunable((16, 64, 128), default=64, hardware={"cpu": (64,)},
                           doc="rows of one expert per tile (16: few rows an expert)"),
        "BLOCK_N": Tunable((128,), default=128, hardware={"cpu": (64, 128)},
                           doc="columns per tile (256 is valid; no study found it winning)"),
        "BLOCK_K": Tunable((64, 128), default=64, hardware={"cpu": (64,)},
                           doc="reduction step"),
        "GROUP_M": Tunable((1,), default=8, hardware={"cpu": (1, 4)},
                           doc="m-blocks that sweep the n-tiles together (any >= 1 runs)"),
        "num_warps": Tunable((4, 8), default=4, hardware={"cpu": (4,)}),
        "num_stages": Tunable((4, 5), default=3, vendors={"amd": (1, 2)},
                              hardware={"cpu": (2,)}),
        "PERSISTENT": Tunable((0, 1), default=0, hardware={"cpu": (0, 1)},
                              doc="1: one program per SM looping over the tiles"),
        "USE_TMA": Tunable((0, 1), default=0, hardware={"cpu": (0, 1)},
                           doc="1: TMA tensor-descriptor loads (pruned without TMA)"),
        "TMA_STORE": Tunable((0, 1), default=0,
                             doc="1: TMA only: full tiles stored by a descriptor"),
        "TAIL_SPLIT": Tunable((0, 1), default=0, hardware={"cpu": (0, 1)},
                              doc="1: an expert's last block of <= BLOCK_M/2 rows at half "
                                  "height"),
        "SWAP_AB": Tunable((0, 1), default=0, hardware={"cpu": (0,)},
                           doc="1: TMA only: tiles computed transposed (rows on wgmma's N)"),
        "GLUON": Tunable((0, 3), default=0, hardware={"cpu": (0,)},
                         allowed=constraints.GLUON_ENGINES,
                         doc="0: the Triton kernels; 3: the warp-specialized persistent "
                             "Gluon kernel (Hopper)"),
        "TALL_TILE": Tunable((0, 1), default=0, hardware={"cpu": (0,)},
                             doc="GLUON=3: tiles of 1.5 blocks (W streamed less often)"),
        "TAIL_DEAL": Tunable((0, 1), default=0, hardware={"cpu": (0,)},
                             doc="GLUON=3: each wave's half tiles dealt round-robin"),
        "waves_per_eu": Tunable(vendors={"amd": (0, 1, 2)}, doc="AMD-only launch option"),
        "matrix_instr_nonkdim": Tunable(vendors={"amd": (16,)}, doc="AMD-only launch option"),
        "kpack": Tunable(vendors={"amd": (1, 2)}, doc="AMD-only launch option"),
        # Retired tunables, at the one value they still take (an old pack entry or
        # experiment file may name them): never searched.
        **{name: Tunable(allowed=(value,), doc="retired: accepted at this value only")
           for name, value in constraints.RETIRED.items()},
    }
    bench: ClassVar[tuple[BenchCase, ...]] = (
        BenchCase("deepseek-v3-16b", "bf16"),
        BenchCase("deepseek-v3-16b-m128", "bf16"),
    )
    shapes: ClassVar[dict[str, dict[str, int]]] = {
        # DeepSeek-V2-Lite / MoE-16B expert up-projection shape: 64 experts, hidden 2048,
        # expert FFN 1408, 8192 tokens routed to top-6.
        "deepseek-v3-16b": {"M": 8192 * 6, "N": 1408, "K": 2048, "E": 64},
        # The same layer at decode: 128 routed rows, two an expert on average.
        "deepseek-v3-16b-m128": {"M": 128, "N": 1408, "K": 2048, "E": 64},
        "test": {"M": 320, "N": 128, "K": 128, "E": 4},
    }

    # -- inputs and semantics ---------------------------------------------------------
    def make_inputs(self, shape: Shape, dtype: str, seed: int, device: str) -> Inputs:
        """Random routing with realistic imbalance: expert popularity is log-normal
        (sigma 0.5: the hottest of 64 experts gets ~3x the mean load, as with a trained
        router), and each expert is unused with probability 1/16, so empty experts occur;
        then the M rows are drawn from that distribution."""
        s = self.validate_shape(shape)
        counts = self.routing_counts(s, seed)
        # A different seed stream for the data, so the data does not depend on routing.
        return make_grouped_inputs(counts, s["N"], s["K"], dtype, seed + 7919, device)

    @classmethod
    def _experts_used(cls, shape: Shape) -> int:
        """Experts with rows in seed 0's routing. Past a million rows every expert the
        routing does not leave unused gets rows, so the draw of the rows is skipped.
        Past ``EXACT_EXPERTS`` experts the routing is not drawn at all (it takes 9 bytes
        and ~90 ns an expert: 26 s and 3 GB at 3e8): the expected count of a uniform
        draw over the experts the routing keeps, at most one an expert and one a row."""
        M, E = int(shape["M"]), int(shape["E"])
        if E > EXACT_EXPERTS:
            kept = E * (1 - 1 / 16)  # each expert is unused with probability 1/16
            expected = kept * -math.expm1(-M / kept)
            return max(1, min(M, E, round(expected)))
        if M <= 1 << 20:
            return sum(1 for c in cls.routing_counts(shape, 0) if c)
        g = torch.Generator(device="cpu").manual_seed(0)
        torch.randn(E, generator=g)  # the popularity draw routing_counts makes first
        unused = torch.rand(E, generator=g) < 1 / 16
        return max(1, E - int(unused.sum()))

    @staticmethod
    def routing_counts(shape: Shape, seed: int) -> list[int]:
        """The rows each expert gets in ``make_inputs`` (see there), without the data."""
        M, E = int(shape["M"]), int(shape["E"])
        g = torch.Generator(device="cpu").manual_seed(seed)
        probs = torch.exp(0.5 * torch.randn(E, generator=g))
        unused = torch.rand(E, generator=g) < 1 / 16
        if bool(unused.all()):
            unused[0] = False
        probs = torch.where(unused, torch.zeros_like(probs), probs)
        if M > 0:
            picks = torch.multinomial(probs, M, replacement=True, generator=g)
            counts = torch.bincount(picks, minlength=E).tolist()
        else:
            counts = [0] * E
        return counts

    def reference(self, inputs: Inputs, shape: Shape) -> torch.Tensor:
        a, w, offs = inputs["a"], inputs["w"], inputs["offsets_host"]
        out = torch.zeros(a.shape[0], w.shape[1], dtype=torch.float32, device=a.device)
        for e in range(w.shape[0]):
            lo, hi = offs[e], offs[e + 1]
            if hi > lo:
                out[lo:hi] = a[lo:hi].float() @ w[e].float().t()
        return out

    def eager(self, inputs: Inputs, shape: Shape) -> torch.Tensor:
        """The loop users write: one torch.mm per expert into a preallocated output.
        The loop runs over the host offsets, so it is static under torch.compile."""
        a, w, offs = inputs["a"], inputs["w"], inputs["offsets_host"]
        out = torch.empty(a.shape[0], w.shape[1], dtype=a.dtype, device=a.device)
        for e in range(w.shape[0]):
            lo, hi = offs[e], offs[e + 1]
            if hi > lo:
                torch.mm(a[lo:hi], w[e].t(), out=out[lo:hi])
        return out

    def _launches(self, inputs: Inputs, config: Config) -> tuple[list[Launch], torch.Tensor]:
        """The config's one launch and the output: what the launcher runs and
        compile_only compiles."""
        cfg = {**self.default_config, **config}
        a, w, offsets = inputs["a"], inputs["w"], inputs["offsets"]
        M, K = a.shape
        E, N, _ = w.shape
        if a.stride(1) != 1 or w.stride(2) != 1:
            raise ValueError("grouped_gemm: A and W need a contiguous K dimension")
        out = torch.empty(M, N, dtype=a.dtype, device=a.device)
        if not int(cfg["GLUON"]):
            return [triton_launch(a, w, offsets, out, cfg)], out
        if _gluon is None or _GLUON_MISSING:
            raise RuntimeError(f"GLUON=3: this Triton cannot run the Gluon kernel "
                               f"({_GLUON_MISSING})")
        if a.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"grouped_gemm GLUON=3 takes bf16 or fp16, not {a.dtype}")
        check_tma_layout(a, w)
        # One program per SM, no more than the tiles there can be (M // BM + E m-blocks).
        bm, bn = int(cfg["BLOCK_M"]), int(cfg["BLOCK_N"])
        tiles_bound = (M // bm + E) * -(-N // bn)
        num_progs = max(1, min(num_sms(a.device), tiles_bound))
        return [_gluon.gluon_launch(a, w, offsets, out, cfg, num_progs)], out

    # -- baselines --------------------------------------------------------------------
    def baselines(self) -> dict[str, Callable[[Inputs, Shape], Callable[[], Any]]]:
        """torch's grouped GEMM where this torch has it, and a dense cuBLAS GEMM of the
        same FLOPs (a speed yardstick only: it multiplies every row by expert 0's W, so
        its accuracy reads as a mismatch)."""
        out: dict[str, Callable[[Inputs, Shape], Callable[[], Any]]] = {}
        if _torch_grouped_mm() is not None:
            out["torch._grouped_mm"] = _grouped_mm_baseline
        out[DENSE_BOUND] = _dense_baseline
        return out

    # -- cost model -------------------------------------------------------------------
    def flops(self, shape: Shape) -> float:
        return 2.0 * shape["M"] * shape["N"] * shape["K"]

    def bytes_moved(self, shape: Shape, dtype: str) -> float:
        """A, the output, the offsets, and the weights of the experts that get rows: an
        expert without rows is never read. Which experts those are is the routing's
        (``routing_counts``); this counts ``make_inputs``' routing of seed 0, the one the
        benchmark measures (another seed's differs by an expert or two at small M), or
        past ``EXACT_EXPERTS`` experts their expected number (``_experts_used``)."""
        M, N, K, E = (int(shape[d]) for d in self.dims)
        item = _ITEM_BYTES[dtype]
        used = self._experts_used(shape)
        return float((M * K + used * N * K + M * N) * item + (E + 1) * 4)

    def footprint_bytes(self, shape: Shape, dtype: str) -> float:
        """The device memory ``make_inputs`` allocates and a call writes: A, W of every
        expert (those without rows too), the offsets and the output. What must fit the
        device, where ``bytes_moved`` is what a call must read; a closed form."""
        M, N, K, E = (int(shape[d]) for d in self.dims)
        item = _ITEM_BYTES[dtype]
        return float((M * K + E * N * K + M * N) * item + (E + 1) * 4)

    # -- accuracy and validity --------------------------------------------------------
    def tolerance(self, dtype: str, config: Config) -> Tolerance:
        # Outputs are O(1); the error is the final rounding to the input dtype plus fp32
        # summation order. fp32 runs with IEEE products (no TF32), hence the tight bound.
        return {
            "fp32": Tolerance(1e-4, 1e-4),
            "fp16": Tolerance(1e-2, 1e-2),
        }.get(dtype, Tolerance(2e-2, 2e-2))

    def check_config(self, config: Config, shape: Shape, device: DeviceSpec) -> str | None:
        regs = _gluon.CONSUMER_REGS if _gluon is not None else 232
        return constraints.check_config({**self.default_config, **config}, shape, device,
                                        _GLUON_MISSING, regs)
