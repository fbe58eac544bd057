"""Measurement: the one place where a trial is measured.

Runs on the worker that owns the GPU (or the CPU under Triton's interpreter). The same
code serves the search, the benchmark command and the tests: build inputs from a seed,
run the reference once, run the variant, check accuracy, time with events.
"""

from __future__ import annotations

import json
import math
import os
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from harness.kernel.api import PRECISION_PEAK, Config, DeviceSpec, Kernel, Shape
from harness.measure import hardware
from harness.measure.accuracy import RefPrep, compare, prepare_reference

#: Substrings of errors after which the CUDA context cannot be trusted again.
_FATAL_MARKERS = (
    "illegal memory access",
    "illegal address",
    "unspecified launch failure",
    "misaligned address",
    "device-side assert",
    "an illegal instruction",
    "CUDA error: unknown error",
    "hipErrorIllegalAddress",
)


@dataclass
class TrialResult:
    """What one measurement produced. ``ok`` False means a failed trial with ``reason``."""

    ok: bool
    reason: str = ""
    fatal: bool = False  # the device context is poisoned: the worker must be replaced
    latency_ms: float = math.nan  # median
    p20_ms: float = math.nan
    p80_ms: float = math.nan
    tflops: float = math.nan
    gbps: float = math.nan
    roofline: float = math.nan  # bound time / measured time, 1.0 = at the roofline
    max_abs_err: float = math.nan
    max_rel_err: float = math.nan
    frac_within_1e3: float = math.nan
    frac_within_1e2: float = math.nan
    compile_s: float = math.nan
    timer: str = ""
    timing_s: float = 0.0  # wall seconds spent inside the timer (the device busy timing)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Timing:
    """How to time. ``warmup_ms``/``rep_ms`` are do_bench's budgets in milliseconds."""

    warmup_ms: float = 25.0
    rep_ms: float = 100.0
    cpu_reps: int = 2  # interpreter runs: wall-clock reps (they say nothing about GPUs)


# -- compiles -------------------------------------------------------------------------


class CompileWatch:
    """Counts the Triton kernels a block of code got through ``triton.compile``: loaded
    from the on-disk cache, or compiled in this process. On a worker that compiles ahead,
    a first launch that compiled is a miss of the compile-ahead. Counts nothing where
    Triton has no compilation listener (before 3.4) or runs interpreted."""

    def __init__(self) -> None:
        self.loaded = 0
        self.compiled = 0
        self.active = False
        self._knobs: Any = None
        self._prev: Any = None

    def _listen(self, **kw: Any) -> None:
        if kw.get("cache_hit"):
            self.loaded += 1
        else:
            self.compiled += 1
        if self._prev is not None:
            self._prev(**kw)

    def __enter__(self) -> CompileWatch:
        if not hardware.interpreted():
            try:
                from triton import knobs

                self._knobs, self._prev = knobs, knobs.compilation.listener
                knobs.compilation.listener = self._listen
                self.active = True
            except Exception:  # no knobs / no listener in this Triton
                self._knobs = None
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._knobs is not None:
            self._knobs.compilation.listener = self._prev


# -- timing ---------------------------------------------------------------------------


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_fn(fn: Callable[[], Any], timing: Timing) -> tuple[float, float, float, str]:
    """(p20, median, p80) in ms, and the name of the timer used."""
    if hardware.interpreted() or not _gpu():
        samples = []
        for _ in range(max(timing.cpu_reps, 1)):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
        samples.sort()
        # The lower median: of the two runs a CPU run times by default, the faster one, so
        # that one run slowed by the machine's other processes does not decide the order.
        mid = samples[(len(samples) - 1) // 2]
        return samples[0], mid, samples[-1], "wall-clock (CPU interpreter: not a GPU timing)"
    from triton.testing import do_bench

    # do_bench times with CUDA events and clears L2 before every repetition.
    p20, p50, p80 = do_bench(fn, warmup=timing.warmup_ms, rep=timing.rep_ms,
                             quantiles=[0.2, 0.5, 0.8])
    return float(p20), float(p50), float(p80), "triton.testing.do_bench (events, L2 flushed)"


def gpu_state() -> dict[str, float]:
    """The GPU's SM clock (MHz) and board power (W) now, through torch's NVML (or amdsmi)
    binding; {} where that cannot be asked (no GPU, no ``nvidia-ml-py``). Sampled as a
    timing ends: under a power cap the clock drops while a study runs, and a trial's
    latency is only comparable with others timed at a similar clock."""
    import torch

    if hardware.interpreted() or not torch.cuda.is_available():
        return {}
    try:
        return {"sm_clock_mhz": float(torch.cuda.clock_rate()),
                "power_w": float(torch.cuda.power_draw()) / 1000.0}
    except Exception:  # no NVML binding installed, or the driver refuses the query
        return {}


def _gpu() -> bool:
    import torch

    return torch.cuda.is_available()


# -- device peaks ---------------------------------------------------------------------


def _peaks_path(spec: DeviceSpec) -> Path:
    import torch

    root = Path(os.environ.get("HARNESS_CACHE", Path.home() / ".cache" / "kernel-harness"))
    name = f"peaks-{spec.key}-{spec.name.replace(' ', '_')}-torch{torch.__version__}.json"
    return root / name


def device_peaks(spec: DeviceSpec | None = None) -> dict[str, float]:
    """Measured ceilings of this device, cached on disk: copy bandwidth (GB/s, bytes read
    plus written) and dense matmul rates (TFLOP/s) for bf16, fp16, fp32 (TF32 off) and
    tf32 (fp32 operands on TF32 tensor cores).
    Medians of 50 ms of runs each: a fresh worker measures them while it starts (about
    half a second on an H200), and they only scale the roofline column."""
    spec = spec or hardware.current_device()
    if spec.key == "cpu" or not _gpu():
        return {}
    path = _peaks_path(spec)
    if path.is_file():
        cached = json.loads(path.read_text())
        if "tf32_tflops" in cached:  # caches from before the tf32 peak are measured again
            return cached
    import torch
    from triton.testing import do_bench

    peaks: dict[str, float] = {}
    n = 1 << 28  # 1 GiB of fp32: far larger than any L2
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=10, rep=50, return_mode="median")
    peaks["copy_gbps"] = 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9
    src = dst = None  # free the buffer before the matmuls
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        for name, dt, size in (("bf16", torch.bfloat16, 8192), ("fp16", torch.float16, 8192),
                               ("fp32", torch.float32, 4096), ("tf32", torch.float32, 8192)):
            torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
            a = torch.randn(size, size, device="cuda", dtype=dt)
            b = torch.randn(size, size, device="cuda", dtype=dt)
            ms = do_bench(lambda a=a, b=b: a @ b, warmup=10, rep=50, return_mode="median")
            peaks[f"{name}_tflops"] = 2 * size**3 / (ms * 1e-3) / 1e12
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev_tf32
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(peaks, indent=1))
    return peaks


def peak_tflops(kernel: Kernel, dtype: str, peaks: Mapping[str, float],
                precision: str | None = None) -> float | None:
    """The matmul rate that bounds ``kernel``: that of the precision its config computes
    in (``Kernel.precision``: tf32 configs by the tf32 peak, tf32x3 by a third of it), else
    of its ``compute_dtype``; None where it has no matrix work or the peak is unknown."""
    cdt = kernel.compute_dtype(dtype)
    if cdt is None:
        return None
    # "tf32x3, fp16 state": the inner products' precision sets the peak.
    name, work = PRECISION_PEAK.get((precision or "").split(",")[0], (cdt, 1))
    rate = peaks.get(f"{name}_tflops")
    return rate / work if rate else None


def roofline_ms(kernel: Kernel, shape: Shape, dtype: str, peaks: Mapping[str, float],
                precision: str | None = None) -> float:
    """The lower bound on latency from the measured ceilings (NaN where unknown), with the
    matmul peak of ``precision`` (see ``peak_tflops``)."""
    if not peaks:
        return math.nan
    t_bytes = kernel.bytes_moved(shape, dtype) / (peaks["copy_gbps"] * 1e9)
    rate = peak_tflops(kernel, dtype, peaks, precision)
    t_flops = kernel.flops(shape) / (rate * 1e12) if rate else 0.0
    return max(t_bytes, t_flops) * 1e3


# -- the checked output ----------------------------------------------------------------


class _Calls:
    """The timed callable: keeps what its last call returned (the output the check
    reads) and the host time of its first call (a first launch: compile or load)."""

    def __init__(self, fn: Callable[[], Any] | None):
        self.fn = fn
        self.last: Any = None
        self.first_s = 0.0
        self.n = 0

    def __call__(self) -> Any:
        if self.n == 0:
            t0 = time.perf_counter()
            self.last = self.fn()  # type: ignore[misc]
            self.first_s = time.perf_counter() - t0
        else:
            self.last = self.fn()  # type: ignore[misc]
        self.n += 1
        return self.last


def _tensors(x: Any) -> list[Any]:
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in _tensors(item)]
    if isinstance(x, dict):
        return [t for item in x.values() for t in _tensors(item)]
    return [x] if hasattr(x, "untyped_storage") else []


def poison(out: Any, inputs: Mapping[str, Any]) -> int:
    """Fill the output tensors with a value no kernel computes (NaN; the most negative
    integer) before the calls that are checked; the number of tensors filled. An output
    that shares memory with an input (an in-place kernel) is left alone."""
    import torch

    held = {t.untyped_storage().data_ptr() for t in _tensors(dict(inputs))
            if t.device.type != "meta"}
    n = 0
    for t in _tensors(out):
        if t.device.type == "meta" or t.untyped_storage().data_ptr() in held:
            continue
        if t.is_floating_point() or t.is_complex():
            t.fill_(float("nan"))
        elif t.dtype != torch.bool:
            t.fill_(torch.iinfo(t.dtype).min)
        else:
            continue
        n += 1
    return n


# -- the measurer ---------------------------------------------------------------------


def _problem_id(kernel: Kernel, shape: Shape, dtype: str, seed: int) -> tuple:
    # The class, not only the family's name: a subclass that keeps the name but makes
    # other inputs (a different routing, say) must not be handed the held ones.
    return (type(kernel), kernel.name, tuple(sorted(shape.items())), dtype, seed)


class Measurer:
    """Holds one problem's inputs and reference, and measures configs against them.

    Keyed by (kernel class and name, shape, dtype, seed): a worker keeps the last
    ``keep`` problems' inputs, so the trials of one study share inputs and the reference
    is computed once, also where a worker times another study's compiled configs while
    its own study's last ones compile.
    """

    def __init__(self, timing: Timing | None = None, device: str | None = None,
                 keep: int = 1):
        import torch

        self.timing = timing or Timing()
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.keep = max(1, keep)
        self._key: tuple | None = None
        self._inputs: dict[str, Any] = {}
        self._ref: Any = None
        self._ref_prep: list[RefPrep] | None = None
        self._held: tuple[tuple, dict[str, Any]] | None = None  # (key, inputs), for held()
        self._others: dict[tuple, tuple] = {}  # key -> (inputs, ref, prep), oldest first

    def release(self) -> None:
        """Drop the held inputs and reference (and the allocator's cached blocks)."""
        self._key, self._inputs, self._ref, self._ref_prep = None, {}, None, None
        self._held = None
        self._others.clear()
        if self.device == "cuda":
            import torch

            torch.cuda.empty_cache()

    def held(self, kernel: Kernel, shape: Shape, dtype: str, seed: int) -> dict[str, Any] | None:
        """The problem's inputs if they are the ones held now (never builds them); safe to
        call from another thread than the measuring one."""
        held = self._held
        if held is not None and held[0] == _problem_id(kernel, shape, dtype, seed):
            return held[1]
        return None

    def prepare(self, kernel: Kernel, shape: Shape, dtype: str, seed: int) -> dict[str, Any]:
        """The problem's inputs (built once per problem); raises where they cannot be."""
        self._problem(kernel, shape, dtype, seed)
        return self._inputs

    def _problem(self, kernel: Kernel, shape: Shape, dtype: str, seed: int) -> None:
        key = _problem_id(kernel, shape, dtype, seed)
        if key == self._key:
            return
        if self._key is not None and self.keep > 1:
            self._others[self._key] = (self._inputs, self._ref, self._ref_prep)
            while len(self._others) > self.keep - 1:
                self._others.pop(next(iter(self._others)))
        self._key, self._inputs, self._ref, self._ref_prep = None, {}, None, None
        self._held = None
        kept = self._others.pop(key, None)
        if kept is not None:
            self._key, (self._inputs, self._ref, self._ref_prep) = key, kept
            self._held = (key, self._inputs)
            return
        inputs = kernel.make_inputs(shape, dtype, seed, self.device)
        ref = kernel.reference(inputs, shape)
        prep = prepare_reference(ref)
        _sync()
        self._key, self._inputs, self._ref, self._ref_prep = key, inputs, ref, prep
        self._held = (key, inputs)

    def measure(self, kernel: Kernel, shape: Shape, dtype: str, config: Config, seed: int,
                peaks: Mapping[str, float] | None = None) -> TrialResult:
        """Measure one config. Never raises for a bad config: it returns a failed result.

        The output is filled with NaN before the timed calls and checked after them, on
        what the last call wrote: an element the kernel never writes shows as NaN, not as
        a value a previous config left in the allocator's block. Where the launcher names
        its output (``fn.out``, as ``SingleLaunch`` does), the timer's own first call is
        the first launch (compile or load): one kernel run less per config than a
        separate first call. Its host time is booked as ``compile_s``, not as timing."""
        try:
            self._problem(kernel, shape, dtype, seed)
        except Exception as exc:  # inputs/reference failing is a harness-level problem
            return _failure("input/reference error", exc)
        watch = CompileWatch()
        calls = _Calls(None)
        first_s = 0.0
        t_timing = time.perf_counter()
        try:
            with watch:
                fn = kernel.launcher(self._inputs, shape, config)
                out = getattr(fn, "out", None)
                if out is None:  # the launcher does not name its output: a first call does
                    t0 = time.perf_counter()
                    out = fn()  # first call compiles, or loads a binary compiled ahead
                    _sync()
                    first_s = time.perf_counter() - t0
                poison(out, self._inputs)
                calls = _Calls(fn)
                t_timing = time.perf_counter()
                p20, p50, p80, timer = time_fn(calls, self.timing)
                timing_s = time.perf_counter() - t_timing - calls.first_s
                state = gpu_state()
        except Exception as exc:
            res = _failure(_classify(exc), exc)
            if watch.active:
                res.extra["first_call_compiled"] = watch.compiled
            if calls.n > 1:  # it failed while being timed, not at its first launch
                res.timing_s = time.perf_counter() - t_timing - calls.first_s
            return res
        compile_s = first_s + calls.first_s
        t_check = time.perf_counter()
        acc = compare(calls.last, self._ref, kernel.tolerance(dtype, config), self._ref_prep)
        check_s = time.perf_counter() - t_check
        calls.last = out = None
        first = {"first_call_compiled": watch.compiled} if watch.active else {}
        if not acc["ok"]:
            res = TrialResult(ok=False, reason=acc["reason"], compile_s=compile_s,
                              timing_s=timing_s, extra={"check_s": check_s, **first})
            for k in ("max_abs_err", "max_rel_err", "frac_within_1e3", "frac_within_1e2"):
                setattr(res, k, acc.get(k, math.nan))
            return res
        res = self._result(kernel, shape, dtype, p20, p50, p80, timer, acc, compile_s, peaks,
                           kernel.precision(config, dtype))
        res.timing_s = timing_s
        res.extra.update(check_s=check_s, **first, **state)
        return res

    def measure_eager(self, kernel: Kernel, shape: Shape, dtype: str, seed: int,
                      compiled: bool = False) -> TrialResult:
        """Time the family's PyTorch implementation (the speed-up baseline)."""
        if compiled:
            eager = compiled_eager(kernel)
            return self.measure_fn(kernel, shape, dtype, seed, lambda i, s: lambda: eager(i, s))
        return self.measure_fn(kernel, shape, dtype, seed,
                               lambda i, s: lambda: kernel.eager(i, s))

    def measure_fn(self, kernel: Kernel, shape: Shape, dtype: str, seed: int,
                   make: Callable[[dict, Shape], Callable[[], Any]],
                   peaks: Mapping[str, float] | None = None) -> TrialResult:
        """Time any implementation of the problem (baselines): ``make(inputs, shape)``
        returns a zero-arg callable. Its error is reported, never a reason to skip it."""
        try:
            self._problem(kernel, shape, dtype, seed)
            fn = make(self._inputs, shape)
            out = fn()
            _sync()
            acc = compare(out, self._ref, kernel.tolerance(dtype, kernel.default_config),
                          self._ref_prep)
            del out
            t_timing = time.perf_counter()
            p20, p50, p80, timer = time_fn(fn, self.timing)
            timing_s = time.perf_counter() - t_timing
            state = gpu_state()
        except Exception as exc:
            return _failure(_classify(exc), exc)
        if "max_abs_err" not in acc:  # shape mismatch or NaN: still timed, error unknown
            acc.update(max_abs_err=math.nan, max_rel_err=math.nan, frac_within_1e3=math.nan,
                       frac_within_1e2=math.nan)
        res = self._result(kernel, shape, dtype, p20, p50, p80, timer, acc, math.nan, peaks)
        res.extra["accuracy"] = acc.get("reason") or "within tolerance"
        res.extra.update(state)
        res.timing_s = timing_s
        return res

    def _result(self, kernel, shape, dtype, p20, p50, p80, timer, acc, compile_s, peaks,
                precision=None):
        bound = roofline_ms(kernel, shape, dtype, peaks or {}, precision)
        return TrialResult(
            ok=True,
            latency_ms=p50,
            p20_ms=p20,
            p80_ms=p80,
            tflops=kernel.flops(shape) / (p50 * 1e-3) / 1e12,
            gbps=kernel.bytes_moved(shape, dtype) / (p50 * 1e-3) / 1e9,
            roofline=bound / p50 if bound == bound else math.nan,
            max_abs_err=acc["max_abs_err"],
            max_rel_err=acc["max_rel_err"],
            frac_within_1e3=acc["frac_within_1e3"],
            frac_within_1e2=acc["frac_within_1e2"],
            compile_s=compile_s,
            timer=timer,
        )


def compiled_eager(kernel: Kernel) -> Callable[..., Any]:
    """``kernel.eager`` under torch.compile, specialized to each shape it sees (as a
    served model's fixed shapes are), with room for a recompile per problem a worker
    measures: past Dynamo's default limit (8) it would run the eager code instead,
    silently. The same in a worker and in a compile child prebuilding it, so that the
    child's build is the worker's cache hit."""
    import torch
    import torch._dynamo

    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # its name in newer and older torch
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), 1024))
    return torch.compile(kernel.eager, dynamic=False)


def _classify(exc: BaseException) -> str:
    name = type(exc).__name__
    text = str(exc)
    if name == "OutOfResources" or "out of resource" in text.lower():
        return "out of resources"
    if "Compilation" in name or "compil" in text.lower()[:200]:
        return "compile error"
    if any(m.lower() in text.lower() for m in _FATAL_MARKERS):
        return "device fault"
    return "runtime error"


def _failure(kind: str, exc: BaseException) -> TrialResult:
    text = f"{type(exc).__name__}: {exc}".strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    first = lines[0] if lines else type(exc).__name__
    if kind == "compile error" and len(lines) > 1:
        # Triton's message comes last, after the "at L:C:" line and the source excerpt.
        first = f"{first} {lines[-1]}"
    first = first[:300]
    return TrialResult(
        ok=False,
        reason=f"{kind}: {first}",
        fatal=kind == "device fault",
        extra={"traceback": traceback.format_exc(limit=6)[-2000:]},
    )
