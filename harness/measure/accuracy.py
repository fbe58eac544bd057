"""Accuracy: a trial's output against the reference, element by element.

Every trial's check reads its whole output and the reference. On a GPU that is one
fused Triton pass (``_stats_kernel()``: a few tenths of a millisecond for an 8192^2
output) instead of a dozen PyTorch passes over temporaries as large as the output (4 ms
on an H200), since the check runs once per config and its time is GPU-held overhead.
Elsewhere (CPU, float64, non-contiguous layouts) PyTorch computes the same statistics.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

from harness.kernel.api import Tolerance

#: Statistics of one comparison, in the order of a row of the fused kernel's partials.
_STATS = ("nonfinite", "max_abs", "within_1e3", "within_1e2", "bad")
_BLOCK = 4096


@cache
def _stats_kernel() -> Any:
    """The fused kernel, defined on first use: a worker decides whether Triton runs
    interpreted only after this module is imported, and ``triton.jit`` fixes that
    choice when it runs."""
    import triton
    import triton.language as tl

    @triton.jit
    def stats_kernel(out_ptr, ref_ptr, part_ptr, n, floor_min, atol, rtol,
                      BLOCK: tl.constexpr):
        """One program's partial statistics of ``|out - ref|`` over BLOCK elements: the
        non-finite outputs, the largest difference, the elements within 1e-3 and 1e-2
        (absolute or relative to max(|ref|, floor_min)), and those outside the tolerance.
        Counts are exact in float32 (at most BLOCK per program)."""
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        o = tl.load(out_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(ref_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        finite = (o == o) & (tl.abs(o) < float("inf"))
        d = tl.where(finite, tl.abs(o - r), 0.0)
        scale = tl.abs(r)
        floor = tl.maximum(scale, floor_min)
        one = tl.where(mask, 1.0, 0.0)
        base = part_ptr + pid * 5
        tl.store(base + 0, tl.sum(tl.where(finite, 0.0, one), axis=0))
        tl.store(base + 1, tl.max(d, axis=0))
        tl.store(base + 2, tl.sum(tl.where((d <= 1e-3) | (d <= 1e-3 * floor), one, 0.0), axis=0))
        tl.store(base + 3, tl.sum(tl.where((d <= 1e-2) | (d <= 1e-2 * floor), one, 0.0), axis=0))
        tl.store(base + 4, tl.sum(tl.where(d > atol + rtol * scale, one, 0.0), axis=0))

    return stats_kernel


def _as_tuple(x: Any) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


@dataclass
class RefPrep:
    """What comparing against one reference tensor needs, computed once per problem."""

    ref: Any  # the reference in the comparison dtype
    denom: float  # max |ref| (at least 1e-30): the relative error's denominator


def _cmp_dtype(*tensors: Any) -> Any:
    """float64 where a side is float64, else float32: a difference of two float32 values
    within a factor two of each other is exact, so float32 loses nothing an fp16, bf16 or
    fp32 output could show."""
    import torch

    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _prep(r: Any, dtype: Any, device: Any) -> RefPrep:
    rw = r.detach().to(device=device, dtype=dtype)
    denom = max(float(rw.abs().max()) if rw.numel() else 0.0, 1e-30)
    return RefPrep(rw, denom)


def prepare_reference(ref: Any) -> list[RefPrep]:
    """The per-problem part of ``compare``, so that each trial's check reads only its
    own output and the reference once."""
    return [_prep(r, _cmp_dtype(r), r.device) for r in _as_tuple(ref)]


def _fused(o: Any, p: RefPrep) -> bool:
    """Whether the fused kernel can compare ``o``: a GPU tensor of a float type with
    the reference in float32, both laid out contiguously."""
    import torch

    from harness.measure import hardware

    return (o.is_cuda and not hardware.interpreted() and p.ref.dtype == torch.float32
            and o.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and o.is_contiguous() and p.ref.is_contiguous() and o.numel() > 0)


def stats_fused(o: Any, p: RefPrep, tol: Tolerance) -> Any:
    """The five statistics of ``_STATS`` as a float64 tensor on ``o``'s device (no host
    sync), from one pass of ``_stats_kernel``."""
    import torch

    n = o.numel()
    progs = -(-n // _BLOCK)
    part = torch.empty(progs, 5, device=o.device, dtype=torch.float32)
    _stats_kernel()[(progs,)](o, p.ref, part, n, 1e-6 * p.denom, float(tol.atol),
                            float(tol.rtol), BLOCK=_BLOCK, num_warps=8)
    sums = part.to(torch.float64).sum(0)
    return torch.stack([sums[0], part[:, 1].max().to(torch.float64), sums[2], sums[3],
                        sums[4]])


def stats_torch(o: Any, p: RefPrep, tol: Tolerance) -> Any:
    """The same statistics as ``stats_fused``, in PyTorch, in the comparison dtype."""
    import torch

    ow = o.detach().to(p.ref.dtype)
    finite = torch.isfinite(ow)
    diff = torch.where(finite, ow - p.ref, 0).abs_()
    scale = p.ref.abs()
    floor = scale.clamp_min(1e-6 * p.denom)
    zero = diff.new_zeros(())
    return torch.stack([x.to(torch.float64) for x in (
        (~finite).sum(),
        diff.max() if diff.numel() else zero,
        ((diff <= 1e-3) | (diff <= 1e-3 * floor)).sum(),
        ((diff <= 1e-2) | (diff <= 1e-2 * floor)).sum(),
        (diff > tol.atol + tol.rtol * scale).sum(),
    )])


def warm_up(device: str = "cuda") -> None:
    """Compile (or load) the fused kernel for the usual output dtypes and build its
    launcher, so that no trial's check pays for that."""
    import torch

    ref = torch.randn(_BLOCK + 1, device=device)
    p = RefPrep(ref, 1.0)
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        out = ref.to(dt)
        if _fused(out, p):
            stats_fused(out, p, Tolerance(1e-3, 1e-3)).tolist()


def compare(out: Any, ref: Any, tol: Tolerance,
            prepared: list[RefPrep] | None = None) -> dict[str, Any]:
    """Element-wise comparison of (possibly tuple) outputs against the reference.
    ``prepared``: ``prepare_reference(ref)``, where the caller compares many outputs
    against one reference."""
    import torch

    outs, refs = _as_tuple(out), _as_tuple(ref)
    if len(outs) != len(refs):
        return {"ok": False, "reason": f"output has {len(outs)} tensors, reference {len(refs)}"}
    for i, (o, r) in enumerate(zip(outs, refs, strict=True)):
        if tuple(o.shape) != tuple(r.shape):
            return {"ok": False, "reason": f"output {i} shape {tuple(o.shape)} != {tuple(r.shape)}"}
    preps, rows = [], []
    for i, (o, r) in enumerate(zip(outs, refs, strict=True)):
        dt = _cmp_dtype(o, r)
        p = prepared[i] if prepared and i < len(prepared) else None
        if p is None or p.ref.dtype != dt or p.ref.device != o.device:
            p = _prep(r, dt, o.device)
        preps.append(p)
        rows.append(stats_fused(o, p, tol) if _fused(o, p) else stats_torch(o, p, tol))
    # One host sync for every output's statistics.
    table = torch.stack([x.to(rows[0].device) for x in rows]).tolist()
    worst_abs = worst_rel = 0.0
    n_total = n_1e3 = n_1e2 = 0
    ok, reason = True, ""
    for i, (o, p, row) in enumerate(zip(outs, preps, table, strict=True)):
        s = dict(zip(_STATS, row, strict=True))
        if s["nonfinite"]:
            return {"ok": False, "reason": f"output {i} has {int(s['nonfinite'])} NaN/Inf values"}
        worst_abs = max(worst_abs, s["max_abs"])
        # Relative error against the tensor's own magnitude, so near-zero elements of a
        # well-scaled output do not dominate.
        worst_rel = max(worst_rel, s["max_abs"] / p.denom)
        n_total += o.numel()
        n_1e3 += int(s["within_1e3"])
        n_1e2 += int(s["within_1e2"])
        if ok and s["bad"]:
            ok = False
            reason = (f"wrong result: output {i}: {int(s['bad'])}/{o.numel()} elements "
                      f"outside atol={tol.atol:g} rtol={tol.rtol:g} "
                      f"(max abs err {s['max_abs']:.3g})")
    return {
        "ok": ok,
        "reason": reason,
        "max_abs_err": worst_abs,
        "max_rel_err": worst_rel,
        "frac_within_1e3": n_1e3 / max(n_total, 1),
        "frac_within_1e2": n_1e2 / max(n_total, 1),
    }
