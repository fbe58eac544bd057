"""harness.measure.timing on the CPU: the accuracy check against a float64 computation of the
same statistics, on fresh random data; the compile watch; the Triton cache pin."""

from __future__ import annotations

import math
import os
import re

import pytest
import torch

from harness.fleet import compile as fleet_compile
from harness.kernel.api import Tolerance
from harness.measure.timing import CompileWatch, compare, prepare_reference


def _expected(out: torch.Tensor, ref: torch.Tensor, tol: Tolerance) -> dict:
    o, r = out.double(), ref.double()
    diff, scale = (o - r).abs(), r.abs()
    denom = max(float(scale.max()), 1e-30)
    rel = diff / scale.clamp_min(1e-6 * denom)
    return {
        "max_abs_err": float(diff.max()),
        "max_rel_err": float(diff.max()) / denom,
        "frac_within_1e3": float(((diff <= 1e-3) | (rel <= 1e-3)).double().mean()),
        "frac_within_1e2": float(((diff <= 1e-2) | (rel <= 1e-2)).double().mean()),
        # An fp32 comparison may round an element lying on the bound (within a few ulp)
        # either way: the count is exact up to those.
        "bad": (int((diff > (tol.atol + tol.rtol * scale) * (1 + 1e-6)).sum()),
                int((diff > (tol.atol + tol.rtol * scale) * (1 - 1e-6)).sum())),
    }


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("prepared", [False, True])
def test_compare_matches_a_float64_computation(dtype: torch.dtype, prepared: bool) -> None:
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    ref = torch.randn(300, 257, generator=g)
    out = (ref + 3e-3 * torch.randn(300, 257, generator=g)).to(dtype)
    tol = Tolerance(5e-3, 1e-3)
    got = compare(out, ref, tol, prepare_reference(ref) if prepared else None)
    want = _expected(out, ref, tol)
    for k in ("max_abs_err", "max_rel_err", "frac_within_1e3", "frac_within_1e2"):
        assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-12), k
    lo, hi = want["bad"]
    found = re.search(rf"(\d+)/{out.numel()} elements", got["reason"])
    bad = int(found.group(1)) if found else 0
    assert got["ok"] == (bad == 0) and lo <= bad <= hi, (got["reason"], lo, hi)


def test_compare_counts_bad_elements_exactly_and_reports_nan() -> None:
    ref = torch.randn(64, 64, dtype=torch.float64)  # float64: compared in float64
    out = ref.clone()
    out[3, 4] += 1.0
    out[10, 11] -= 0.5
    res = compare(out, ref, Tolerance(1e-6, 1e-6), prepare_reference(ref))
    assert not res["ok"] and "2/4096 elements" in res["reason"]
    assert res["max_abs_err"] == pytest.approx(1.0)
    out[0, 0] = math.nan
    out[1, 1] = math.inf
    res = compare(out.float(), ref.float(), Tolerance(1, 1))
    assert not res["ok"] and "2 NaN/Inf" in res["reason"]


def test_compare_tuples_shapes_and_a_stale_preparation() -> None:
    a, b = torch.randn(8, 8), torch.randn(5)
    prep = prepare_reference((a, b))
    assert compare((a.clone(), b.clone()), (a, b), Tolerance(0, 0), prep)["ok"]
    res = compare((a, b[:4]), (a, b), Tolerance(0, 0), prep)
    assert not res["ok"] and "shape" in res["reason"]
    assert "output has 1 tensors" in compare(a, (a, b), Tolerance(0, 0))["reason"]
    # A preparation in another dtype is not used (float64 output against its float32 one).
    res = compare((a.double() + 1e-9, b.double()), (a.double(), b.double()),
                  Tolerance(0, 0), prep)
    assert not res["ok"] and res["max_abs_err"] == pytest.approx(1e-9, rel=1e-3)


def test_compile_watch_is_inactive_under_the_interpreter(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with CompileWatch() as w:
        pass
    assert not w.active and w.compiled == 0 and w.loaded == 0


def test_compile_watch_counts_and_chains_the_listener(monkeypatch) -> None:
    """Outside the interpreter the watch installs itself as Triton's compilation
    listener, counts hits and compiles, hands each event to the listener it replaced,
    and puts that one back."""
    from triton import knobs

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    seen = []
    prev = lambda **kw: seen.append(kw["cache_hit"])
    monkeypatch.setattr(knobs.compilation, "listener", prev)
    with CompileWatch() as w:
        assert w.active and knobs.compilation.listener is not prev
        for hit in (True, False, True):
            knobs.compilation.listener(src=None, metadata={}, metadata_group={}, times=None,
                                       cache_hit=hit)
    assert (w.loaded, w.compiled) == (2, 1) and seen == [True, False, True]
    assert knobs.compilation.listener is prev


def test_pin_triton_cache_dir(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRITON_HOME", str(tmp_path))
    path = fleet_compile.pin_triton_cache_dir()
    assert path == os.environ["TRITON_CACHE_DIR"] == str(tmp_path / ".triton" / "cache")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    assert fleet_compile.pin_triton_cache_dir() == str(tmp_path / "mine")


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="the interpreter's test (CPU tensors); the GPU test covers a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fused_check_kernel_agrees_with_the_torch_statistics(dtype: torch.dtype) -> None:
    """The GPU path's one-pass kernel (run here by Triton's interpreter) against the
    PyTorch statistics, with NaN, Inf, bad elements and a ragged last block."""
    from harness.measure import accuracy

    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    n = 2 * accuracy._BLOCK + 517
    ref = torch.randn(n, generator=g) * 3
    out = (ref + 2e-3 * torch.randn(n, generator=g)).to(dtype)
    out[7] = ref[7] + 0.5
    out[n - 1] = ref[n - 1] - 0.25
    out[100] = math.nan
    out[n - 3] = -math.inf
    prep = accuracy.prepare_reference(ref)[0]
    tol = Tolerance(5e-3, 1e-3)
    want = accuracy.stats_torch(out, prep, tol).tolist()
    got = accuracy.stats_fused(out, prep, tol).tolist()
    assert got[0] == want[0] == 2  # NaN and -Inf
    assert got[1] == pytest.approx(want[1], rel=1e-6)  # largest finite difference
    assert got[2:] == want[2:]
    assert got[4] >= 2


@pytest.mark.gpu
def test_fused_check_on_the_gpu_matches_torch_and_is_faster() -> None:
    """On a GPU: an 8192^2 bf16 output with injected errors, the fused kernel's statistics
    against PyTorch's, and both timed (the fused one is the trial's check)."""
    from triton.testing import do_bench

    from harness.measure import accuracy

    g = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31, ())))
    ref = torch.randn(8192, 8192, device="cuda", generator=g)
    out = (ref + 1e-2 * torch.randn(8192, 8192, device="cuda", generator=g)).bfloat16()
    out[5, 7] = math.nan
    out[8000, 3] += 4.0
    prep = accuracy.prepare_reference(ref)[0]
    tol = Tolerance(3e-2, 1e-2)
    want = accuracy.stats_torch(out, prep, tol).tolist()
    got = accuracy.stats_fused(out, prep, tol).tolist()
    assert got[0] == want[0] == 1
    assert got[1] == pytest.approx(want[1], rel=1e-6) and got[1] >= 3.9
    assert got[2:] == want[2:] and got[4] >= 1
    res = compare(out, ref, tol, [prep])
    assert not res["ok"] and "1 NaN/Inf" in res["reason"]
    t_fused = do_bench(lambda: accuracy.stats_fused(out, prep, tol).tolist(), rep=200)
    t_torch = do_bench(lambda: accuracy.stats_torch(out, prep, tol).tolist(), rep=200)
    print(f"check of an 8192^2 bf16 output: fused {t_fused:.3f} ms, torch {t_torch:.3f} ms")
    assert t_fused < t_torch


def test_gpu_state_is_empty_without_a_gpu_and_trials_log_it(mlflow_db) -> None:
    """No GPU (or the interpreter): nothing to sample. A trial result that carries the
    GPU state has it logged as MLflow metrics of the trial's run (real sqlite store)."""
    from harness.measure.timing import gpu_state
    from harness.tracking.tracker import Tracker

    if not torch.cuda.is_available():
        assert gpu_state() == {}
    tracker = Tracker(f"sqlite:///{mlflow_db}", "gpu-state")
    study = tracker.start_run("study", {"harness.level": "study"})
    result = {"latency_ms": 1.25, "extra": {"sm_clock_mhz": 1515.0, "power_w": 665.4,
                                            "check_s": 0.1}}
    run_id = tracker.log_trial(study, 3, {"BLOCK_M": 64}, result, "measured")
    metrics = tracker.client.get_run(run_id).data.metrics
    assert metrics["sm_clock_mhz"] == 1515.0 and metrics["power_w"] == 665.4
    assert "check_s" not in metrics and metrics["latency_ms"] == 1.25
    # The run's own trial logging (harness.run.runner) builds its metrics the same way.
    from harness.tracking.tracker import trial_metrics

    assert trial_metrics(result, "measured")["sm_clock_mhz"] == 1515.0
    assert trial_metrics({"reason": "x"}, "failed") == {
        **{k: None for k in trial_metrics({}, "measured") if k != "failed"}, "failed": 1.0}


@pytest.mark.gpu
def test_gpu_state_reads_the_clock_and_power() -> None:
    from harness.measure.timing import gpu_state

    try:
        import pynvml  # noqa: F401  (nvidia-ml-py, of the tune extra)
    except ImportError:
        pytest.skip("nvidia-ml-py is not installed here")
    torch.cuda.init()
    state = gpu_state()
    assert 100 <= state["sm_clock_mhz"] <= 5000, state
    assert 5 <= state["power_w"] <= 2000, state


def _launches(events_dir) -> int:
    from tests.fault_kernels import read_events

    return sum(e["event"] == "launch" for e in read_events(events_dir))


def test_an_unwritten_output_fails_even_where_the_buffer_held_the_answer(
        monkeypatch, tmp_path, device) -> None:
    """``stale``: the output block already holds the right answer (as the allocator's
    block of an earlier config would) and the kernel writes half of it. The NaN fill
    before timing makes the unwritten half show; without it the check passes."""
    from harness.measure import timing as measure
    from tests.fault_kernels import Faulty

    fam, shape = Faulty(), {"N": 4096}
    m = measure.Measurer(measure.Timing(1, 5), device=device)
    res = m.measure(fam, shape, "fp32", {"FAULT": "stale"}, seed=int(torch.randint(0, 99, ())))
    assert not res.ok and "NaN" in res.reason, res.reason
    assert m.measure(fam, shape, "fp32", {"FAULT": "none"}, seed=1).ok
    monkeypatch.setattr(measure, "poison", lambda out, inputs: 0)
    assert m.measure(fam, shape, "fp32", {"FAULT": "stale"}, seed=2).ok  # the hole it closes


def test_a_named_output_is_launched_first_by_the_timer(monkeypatch, tmp_path, device) -> None:
    """A launcher naming ``fn.out`` gets no separate first call: the timer's first call is
    its first launch, whose host time is ``compile_s``, not timing. Without ``out`` the
    first call comes before the timer, as before."""
    from harness.measure import timing as measure
    from tests.fault_kernels import Faulty

    monkeypatch.setenv("FAULT_DIR", str(tmp_path))
    fam, shape, timing = Faulty(), {"N": 2048}, measure.Timing(1, 5, cpu_reps=3)
    m = measure.Measurer(timing, device=device)
    res = m.measure(fam, shape, "fp32", {"FAULT": "none"}, seed=3)
    assert res.ok and res.compile_s > 0 and res.timing_s > 0
    named = _launches(tmp_path)
    plain = fam.launcher

    def unnamed(inputs, shape, config):
        run = plain(inputs, shape, config)
        return lambda: run()

    monkeypatch.setattr(fam, "launcher", unnamed)
    assert m.measure(fam, shape, "fp32", {"FAULT": "none"}, seed=3).ok
    if device == "cpu":  # on a GPU the timer's count of runs depends on their speed
        assert named == timing.cpu_reps
        assert _launches(tmp_path) - named == named + 1


def test_poison_fills_outputs_but_not_inputs() -> None:
    from harness.measure.timing import poison

    x = torch.randn(8)
    out = (torch.empty(4), torch.zeros(3, dtype=torch.int32), torch.zeros(2, dtype=torch.bool))
    assert poison((out, x), {"x": x}) == 2
    assert torch.isnan(out[0]).all() and (out[1] == torch.iinfo(torch.int32).min).all()
    assert not out[2].any() and torch.isfinite(x).all()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's wall-clock timer")
def test_cpu_timing_takes_the_lower_median() -> None:
    """Two CPU runs, one slowed (as by another process on a loaded machine): the faster
    one is the latency, so the slowed run does not reorder configs."""
    import time

    from harness.measure import timing as measure

    delays = iter([0.04, 0.0])
    p20, mid, p80, _ = measure.time_fn(lambda: time.sleep(next(delays)),
                                       measure.Timing(cpu_reps=2))
    assert mid == p20 < 20 <= p80


def test_a_subclass_with_the_same_name_gets_its_own_inputs() -> None:
    """The held problem is keyed by the family's class too: a subclass that keeps the
    name but routes rows differently (a diagnostic's balanced routing) is measured on its
    own inputs and reference, not on the ones its parent left (which made two routings
    time alike in an earlier diagnostic)."""
    from harness.measure import timing as measure
    from kernels.grouped_gemm import GroupedGemm, counts_to_offsets

    class Balanced(GroupedGemm):
        @staticmethod
        def routing_counts(shape, seed):
            return [int(shape["M"]) // int(shape["E"])] * int(shape["E"])

    shape = GroupedGemm.shapes["test"]
    m = measure.Measurer(measure.Timing(1, 2), device="cpu")
    assert m.measure(GroupedGemm(), shape, "fp32", {}, seed=3).ok
    skewed = m._inputs["offsets_host"]
    assert m.measure(Balanced(), shape, "fp32", {}, seed=3).ok
    assert m._inputs["offsets_host"] == counts_to_offsets(Balanced.routing_counts(shape, 3))
    assert skewed != m._inputs["offsets_host"]
