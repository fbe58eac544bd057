"""harness.search.replay: recorded sweeps, export from Optuna, sampler replay, the bench."""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import random
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from harness import experiment
from harness.kernel import api as kernel_api
from harness.measure.timing import TrialResult
from harness.search import replay as rp
from harness.search import spaces, tables
from harness.search.study import ATTR_REASON, ATTR_RESULT, ATTR_STATUS
from harness.tracking.tracker import git_sha

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "benchmarks" / "replay"


def synthetic(seed: int = 0) -> rp.Table:
    """A 48-config GEMM-like landscape: smooth in the tile sizes (best at 64 x 64, 4
    warps), 1 % noise, big tiles on few warps pruned, a few configs failed."""
    rng = random.Random(seed)
    space = {"BLOCK_M": [16, 32, 64, 128], "BLOCK_N": [16, 32, 64, 128], "num_warps": [2, 4, 8]}
    trials = []
    for bm, bn, w in itertools.product(*space.values()):
        cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w}
        if bm * bn // (32 * w) > 128:
            trials.append({"config": cfg, "status": "pruned", "cost_s": 0.0})
        elif rng.random() < 0.08:
            trials.append({"config": cfg, "status": "failed", "cost_s": 0.5, "reason": "boom"})
        else:
            ms = (1 + 0.4 * abs(math.log2(bm / 64)) + 0.3 * abs(math.log2(bn / 64))
                  + 0.1 * abs(math.log2(w / 4))) * (1 + rng.gauss(0, 0.01))
            trials.append({"config": cfg, "status": "ok", "median_ms": ms, "p20_ms": ms * 0.99,
                           "p80_ms": ms * 1.02, "cost_s": 0.1 + 0.05 * rng.random()})
    return rp.Table({"format": rp.FORMAT, "kernel": "synthetic", "shape": {"M": 64, "N": 64},
                     "dtype": "fp16", "hardware": "H200", "space": space, "trials": trials,
                     "default_config": {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4}})


def line_table() -> rp.Table:
    """One tunable, five choices; hand-checkable: X=3 is the optimum, X=4 within 2 %."""
    trials = [
        {"config": {"X": 0}, "status": "ok", "median_ms": 5.0, "cost_s": 1.0},
        {"config": {"X": 1}, "status": "failed", "cost_s": 2.0, "reason": "compile error"},
        {"config": {"X": 2}, "status": "ok", "median_ms": 3.0, "cost_s": 3.0},
        {"config": {"X": 3}, "status": "ok", "median_ms": 1.0, "cost_s": 4.0},
        {"config": {"X": 4}, "status": "ok", "median_ms": 1.01, "cost_s": 5.0},
        {"config": {"X": 5}, "status": "pruned", "cost_s": 0.0, "reason": "smem"},
    ]
    return rp.Table({"format": rp.FORMAT, "kernel": "line", "shape": {"n": 1}, "dtype": "fp32",
                     "hardware": "H100", "space": {"X": [0, 1, 2, 3, 4, 5]}, "trials": trials})


# -- tables and metrics ------------------------------------------------------------------


def test_table_properties() -> None:
    t = line_table()
    assert t.complete and t.grid_size == 6
    assert t.optimum_ms == 1.0 and t.optimum == {"X": 3}
    assert t.grid_cost_s == 15.0  # pruned configs cost nothing
    assert t.pruned_cost_s == 3.5  # what the median measured config cost (1, 3, 4, 5)
    assert t.unpruned_grid_cost_s == 18.5
    assert t.within(0.02) == 2
    s = rp.summary(t)
    assert s["random_expected_trials"] == pytest.approx((5 + 1) / (2 + 1))
    assert s["pruning_saving"] == pytest.approx(1 - 15 / 18.5)


def test_hand_computed_trials_and_gpu_time_to_target() -> None:
    t = line_table()
    # X=0, X=1 (fails), X=5 (pruned: free), X=0 again (answered: free), X=2, then X=3.
    order = [{"X": x} for x in (0, 1, 5, 0, 2, 3, 4)]
    trace = rp.replay(t, "random", 0, warm_start=False, enqueue=order)
    m = rp.metrics(trace, t)
    assert [s.config["X"] for s in trace.steps] == [0, 1, 2, 3]
    assert m["reached"] and m["trials_to_target"] == 4
    assert m["cost_to_target_s"] == 1 + 2 + 3 + 4
    assert m["cost_fraction"] == pytest.approx(10 / 15)
    assert trace.duplicates == 1 and trace.pruned_asks == 1 and m["stopped"] == "target"
    assert [s.best_ms for s in trace.steps] == [5.0, 5.0, 3.0, 1.0]

    # Without static pruning X=5 is launched, fails, and costs a typical config (3.5 s).
    trace = rp.replay(t, "random", 0, warm_start=False, enqueue=order, prune=False)
    m = rp.metrics(trace, t)
    assert [s.config["X"] for s in trace.steps] == [0, 1, 5, 2, 3]
    assert m["trials_to_target"] == 5 and m["cost_to_target_s"] == 1 + 2 + 3.5 + 3 + 4
    assert m["cost_fraction"] == pytest.approx(13.5 / 18.5)

    # Two configs in flight: results are told in order, so the numbers stay the same.
    trace = rp.replay(t, "random", 0, warm_start=False, enqueue=order, in_flight=2)
    assert rp.metrics(trace, t)["trials_to_target"] == 4

    # The 1.01 ms config is within 2 % too: it alone is enough.
    trace = rp.replay(t, "random", 0, warm_start=False, enqueue=[{"X": 4}])
    assert rp.metrics(trace, t)["trials_to_target"] == 1


def test_unreached_within_budget() -> None:
    t = line_table()
    trace = rp.replay(t, "random", 0, warm_start=False, enqueue=[{"X": 0}, {"X": 2}],
                      budget_trials=2)
    m = rp.metrics(trace, t)
    assert not m["reached"] and m["trials_to_target"] is None and m["cost_fraction"] is None
    assert m["trials"] == 2 and m["stopped"] == "budget" and m["best_ms"] == 3.0


def test_grid_replay_measures_every_runnable_config_once() -> None:
    t = synthetic()
    trace = rp.replay(t, "grid", 3, stop_at_target=False, warm_start=True)
    runnable = len(t.of("ok")) + len(t.of("failed"))
    assert len(trace.steps) == runnable
    assert len({rp.config_key(s.config) for s in trace.steps}) == runnable
    assert trace.steps[-1].total_cost_s == pytest.approx(t.grid_cost_s)
    assert trace.steps[-1].best_ms == t.optimum_ms
    assert trace.steps[0].config == {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4}  # warm start


@pytest.mark.parametrize("sampler", ["tpe", "random"])
def test_samplers_reach_the_optimum(sampler: str) -> None:
    t = synthetic()
    for seed in range(2):
        trace = rp.replay(t, sampler, seed, in_flight=2)
        m = rp.metrics(trace, t)
        assert m["reached"], m
        assert m["best_ms"] <= t.optimum_ms * 1.02
        costs = [s.total_cost_s for s in trace.steps]
        bests = [s.best_ms for s in trace.steps]
        assert costs == sorted(costs) and bests == sorted(bests, reverse=True)
        assert 0 < m["cost_fraction"] <= 1
        assert m["trials_to_target"] == len(trace.steps)


def test_load_tables_leaves_cut_sweeps_out_unless_asked(tmp_path) -> None:
    t = synthetic()
    (tmp_path / "H200").mkdir()
    (tmp_path / "H200" / "full.json").write_text(rp.dumps(t.data))
    (tmp_path / "H200" / "cut.json").write_text(rp.dumps(dict(t.data, trials=t.trials[:-5])))
    assert [x.complete for x in rp.load_tables(tmp_path)] == [True]
    assert sorted(x.complete for x in rp.load_tables(tmp_path, complete_only=False)) == [
        False, True]


def test_dumps_is_json_with_one_trial_per_line() -> None:
    t = synthetic()
    text = rp.dumps(t.data)
    assert json.loads(text) == json.loads(json.dumps(t.data))
    assert len(text.splitlines()) == len(t.trials) + len(t.data) + 3


# -- export from a study as the harness writes it -----------------------------------------


def _jsonable(d: dict) -> dict:
    """As the harness stores a result: NaN becomes None."""
    return json.loads(json.dumps(d).replace("NaN", "null"))


def _tell(study: optuna.Study, config: dict, status: str, result: TrialResult | None = None,
          reason: str = "", space: dict | None = None) -> None:
    study.enqueue_trial(config)  # the harness's sampler chose it
    trial = study.ask()
    for k in config:
        trial.suggest_categorical(k, (space or SPACE)[k])
    if reason:
        trial.set_user_attr(ATTR_REASON, reason)
    trial.set_user_attr(ATTR_STATUS, status)
    if result is not None:
        trial.set_user_attr(ATTR_RESULT, _jsonable(result.to_dict()))
    if status == "measured":
        study.tell(trial, result.latency_ms)
    elif status == "pruned":
        study.tell(trial, state=TrialState.PRUNED)
    elif status == "duplicate":
        study.tell(trial, 9.0)
    else:
        study.tell(trial, state=TrialState.FAIL)


SPACE = {"BLOCK_M": [32, 64], "BLOCK_N": [32, 64], "num_warps": [4]}
STUDY = "sweep-test/matmul/M=64,N=64,K=64/bf16/H200"


def _make_sweep_db(path: Path) -> str:
    url = f"sqlite:///{path}"
    study = optuna.create_study(study_name=STUDY, storage=url, direction="minimize")
    ok = TrialResult(ok=True, latency_ms=1.5, p20_ms=1.4, p80_ms=1.7, compile_s=0.25,
                     timing_s=0.1, extra={"device_name": "NVIDIA H200",
                                          "precompile": {"ok": True, "compile_s": 2.0}})
    best = TrialResult(ok=True, latency_ms=1.0, p20_ms=0.98, p80_ms=1.1, compile_s=0.05,
                       timing_s=0.2)
    broken = TrialResult(ok=False, reason="OutOfResources: shared memory",
                         extra={"precompile": {"ok": False, "compile_s": 1.5}})
    _tell(study, {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4}, "measured", ok)
    _tell(study, {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4}, "duplicate")
    _tell(study, {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4}, "pruned", reason="smem")
    _tell(study, {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 4}, "failed", broken,
          reason=broken.reason)
    _tell(study, {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4}, "interrupted")
    _tell(study, {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4}, "measured", best)
    study.set_user_attr("eager", _jsonable(TrialResult(ok=True, latency_ms=2.0).to_dict()))
    return url


def test_export_round_trip(tmp_path: Path, sqlite_copy) -> None:
    url = _make_sweep_db(tmp_path / "optuna.db")
    out = tmp_path / "one.json"
    assert rp.export(url, out) == [out]
    t = rp.Table.load(out)
    d = t.data
    assert d["kernel"] == "matmul" and d["shape"] == {"M": 64, "N": 64, "K": 64}
    assert d["dtype"] == "bf16" and d["hardware"] == "H200"
    assert d["device_name"] == "NVIDIA H200" and d["date"]
    assert d["commit"] == git_sha()  # the checkout that ran the sweep (exported right after)
    assert d["space"] == SPACE and d["grid_size"] == 4 and d["complete"] and t.complete
    assert d["counts"] == {"ok": 2, "failed": 1, "pruned": 1}
    assert d["baselines_ms"]["eager"] == 2.0
    assert d["default_config"] == kernel_api.get("matmul").default_config
    by = {(c["config"]["BLOCK_M"], c["config"]["BLOCK_N"]): c for c in d["trials"]}
    assert len(d["trials"]) == 4  # the duplicate and the interrupted trial are skipped
    first = by[(32, 32)]
    assert first["status"] == "ok" and first["median_ms"] == 1.5
    assert first["p20_ms"] == 1.4 and first["p80_ms"] == 1.7
    assert first["cost_s"] == pytest.approx(0.1 + 0.25)
    assert by[(64, 32)]["cost_s"] == pytest.approx(0.2 + 0.05)
    failed = by[(32, 64)]
    assert failed["status"] == "failed" and "shared memory" in failed["reason"]
    assert failed["cost_s"] == pytest.approx(1.5)  # no first launch: the child's compile
    assert by[(64, 64)] == {"config": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4},
                            "status": "pruned", "reason": "smem", "cost_s": 0.0}
    assert t.optimum_ms == 1.0 and t.grid_cost_s == pytest.approx(0.35 + 0.25 + 1.5)

    # A config the grid never asked for (static pruning rejects it on the H200) is
    # recorded pruned with the kernel's reason: the table is still complete.
    url2 = f"sqlite:///{tmp_path / 'skipped.db'}"
    study = optuna.create_study(study_name="sweep/matmul/M=16,N=64,K=64/bf16/H200",
                                storage=url2, direction="minimize")
    for bm in (16, 32):
        ok = TrialResult(ok=True, latency_ms=1.0 + bm / 100, compile_s=0.1, timing_s=0.1)
        _tell(study, {"BLOCK_M": bm, "BLOCK_N": 32, "num_warps": 4}, "measured", ok,
              space={"BLOCK_M": [16, 32, 64], "BLOCK_N": [32], "num_warps": [4]})
    rp.export(url2, tmp_path / "skipped.json")
    skipped = rp.Table.load(tmp_path / "skipped.json")
    assert skipped.complete and skipped.data["counts"] == {"ok": 2, "failed": 0, "pruned": 1}
    assert "next_pow2(M)=16" in skipped.lookup({"BLOCK_M": 64, "BLOCK_N": 32,
                                                "num_warps": 4})["reason"]

    # A replay of the exported table runs (the default config is outside this space).
    m = rp.metrics(rp.replay(t, "tpe", 0), t)
    assert m["reached"]

    # export-all: every study of every experiment under a runs directory.
    runs = tmp_path / "runs"
    (runs / "sweep-test").mkdir(parents=True)
    # Copied through SQLite's backup API, not renamed: the export opened it in WAL mode,
    # and a connection this process may still hold would then read a file whose -wal and
    # -shm were left under the old name ("disk I/O error", seen once).
    sqlite_copy(tmp_path / "optuna.db", runs / "sweep-test" / "optuna.db")
    assert rp.main(["export-all", "--runs", str(runs), "--out", str(tmp_path / "tables")]) == 0
    files = list((tmp_path / "tables" / "H200").glob("*.json"))
    assert [f.name for f in files] == ["matmul__M64_N64_K64__bf16__g4.json"]
    assert json.loads(files[0].read_text()) == d
    assert [x.path for x in rp.load_tables(tmp_path / "tables")] == [str(files[0])]


def test_export_names_the_commit_and_gzips_a_large_table(tmp_path: Path, monkeypatch) -> None:
    url = _make_sweep_db(tmp_path / "optuna.db")
    assert rp.main(["export", "--storage", url, "--out", str(tmp_path / "t"),
                    "--commit", "abc1234"]) == 0
    small = tmp_path / "t" / "H200" / "matmul__M64_N64_K64__bf16__g4.json"
    assert rp.Table.load(small).data["commit"] == "abc1234"
    # Past GZIP_ROWS rows the table is written gzipped, and replaces the plain one.
    monkeypatch.setattr(tables, "GZIP_ROWS", 3)
    [big] = rp.export(url, tmp_path / "t", commit="abc1234")
    assert big.name == small.name + ".gz" and not small.exists()
    assert big.read_bytes()[:2] == b"\x1f\x8b"
    assert rp.Table.load(big).data["commit"] == "abc1234"
    assert rp.summary(rp.Table.load(big))["commit"] == "abc1234"
    assert [t.path for t in rp.load_tables(tmp_path / "t")] == [str(big)]
    monkeypatch.setattr(tables, "GZIP_ROWS", 5000)
    assert rp.export(url, tmp_path / "t") == [small] and not big.exists()


# -- the sweep experiments and the committed data ------------------------------------------


SWEEPS = sorted((ROOT / "configs" / "sweeps").glob("*.yaml"))


def _valid_grid(exp: experiment.Experiment) -> int:
    """The most configs that pass static pruning on an H200 at any of the experiment's
    shapes: what its grid measures (the raw size, for a space too large to check)."""
    from harness.measure.hardware import spec_for_key
    from harness.search import ValidSpace

    kernel = kernel_api.get(exp.kernel)
    space = spaces.resolve([spaces.for_kernel(kernel), exp.search_space], "nvidia", "H200")
    device = spec_for_key("H200")
    most = 0
    for shape in exp.shapes:
        valid = ValidSpace(space, lambda c, shape=shape: kernel.check_config(
            {**kernel.default_config, **c}, shape, device))
        most = max(most, valid.count if valid.count is not None else valid.size)
    return most


@pytest.mark.parametrize("path", SWEEPS, ids=[p.stem for p in SWEEPS])
def test_sweep_configs_measure_their_whole_grid(path: Path) -> None:
    exp = experiment.load(path)
    assert exp.search.sampler == "grid" and not exp.search.warm_start
    assert exp.search.trials >= _valid_grid(exp), "the budget must cover the grid"
    assert exp.output.packs_dir != "packs", "sweeps must not overwrite the shipped packs"


GRIDS = sorted(p for p in (ROOT / "configs").rglob("*.yaml")
               if experiment.load(p).search.sampler == "grid")


@pytest.mark.parametrize("path", GRIDS, ids=[p.stem for p in GRIDS])
def test_every_grid_experiment_covers_its_grid(path: Path) -> None:
    """A grid run with fewer trials than valid points measures part of it in an order
    nobody chose: a tunable added to a kernel's space (TAIL_WINDOW) once grew three grids
    past their budgets until they pinned it."""
    assert experiment.load(path).search.trials >= _valid_grid(experiment.load(path)), \
        "the budget must cover the grid"


def test_record_script_runs_the_sweeps() -> None:
    script = (ROOT / "benchmarks" / "record_sweeps.sh").read_text()
    for p in SWEEPS:
        assert f"configs/sweeps/{p.name}" in script
    assert "configs/matmul_grid216.yaml" in script and "export-all" in script


RECORDED = tables.table_paths(DATA)


@pytest.mark.skipif(not RECORDED, reason="no recorded sweeps committed yet")
@pytest.mark.parametrize("path", RECORDED, ids=[f"{p.parent.name}/{p.stem}" for p in RECORDED])
def test_committed_tables_replay(path: Path) -> None:
    t = rp.Table.load(path)
    # A sweep cut short is replayed over the sub-grid it measured, and says so.
    assert t.complete or "sub-grid" in t.name, path
    assert t.of("ok") and all(r["cost_s"] >= 0 for r in t.trials)
    for sampler in ("random", "tpe"):
        m = rp.metrics(rp.replay(t, sampler, 0, in_flight=2), t)
        assert m["best_ms"] >= t.optimum_ms
        if m["reached"]:
            assert 0 < m["cost_fraction"] <= 1


def test_bench_smoke(tmp_path: Path) -> None:
    """The benchmark end to end on two synthetic cases (what CI runs of it)."""
    for i in range(2):
        t = synthetic(seed=i)
        d = dict(t.data, shape={"M": 64 * (i + 1), "N": 64})
        (tmp_path / "H200").mkdir(exist_ok=True)
        (tmp_path / "H200" / f"case{i}.json").write_text(rp.dumps(d))
    spec = importlib.util.spec_from_file_location("replay_bench",
                                                  ROOT / "benchmarks" / "replay_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    # One process: the module is loaded from its file here, which a pool cannot pickle.
    assert bench.main(["--data", str(tmp_path), "--samplers", "tpe", "random", "grid",
                       "--seeds", "2", "--jobs", "1"]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["best"]["sampler"] in ("tpe", "random", "grid")
    assert {"static-pruning", "no-pruning", "multi-fidelity", "warm-start"} <= set(
        report["results"])
    assert len(report["cases"]) == 2
    md = (tmp_path / "report.md").read_text()
    assert "## Verdict" in md and "static pruning" in md
    # The regret curves, plotted: one line per strategy (a lone panel: no large case).
    svg = (tmp_path / "regret.svg").read_text()
    assert "![regret curves](regret.svg)" in md and svg.startswith("<?xml")
    assert all(s in svg for s in ("tpe", "random", "grid")) and "2,000+" not in svg


def test_a_cut_sweep_replays_over_its_measured_sub_grid() -> None:
    t = synthetic(seed=3)
    keep = t.trials[: len(t.trials) // 2]
    assert any(r["status"] == "ok" for r in keep)
    cut = rp.Table({**t.data, "trials": keep, "complete": False})
    assert not cut.complete and "sub-grid" in cut.name
    trace = rp.replay(cut, "grid", 0, stop_at_target=False)
    measured = {rp.config_key(s.config) for s in trace.steps}
    assert measured <= set(cut.by_key) and trace.unrecorded_asks == 0  # never asked for
    assert trace.best_ms == cut.optimum_ms  # every runnable recorded config was reached
    assert trace.steps[-1].total_cost_s == pytest.approx(
        sum(r["cost_s"] for r in keep if r["status"] != "pruned"))


# -- multi-fidelity ---------------------------------------------------------------------


def _mf_table() -> rp.Table:
    """Four configs, each 1 s to compile and 10 s to time in full, no noise."""
    trials = [{"config": {"X": x}, "status": "ok", "median_ms": ms, "p20_ms": ms, "p80_ms": ms,
               "compile_s": 1.0, "timing_s": 10.0, "cost_s": 11.0}
              for x, ms in enumerate((2.0, 1.5, 5.0, 1.0))]
    return rp.Table({"format": rp.FORMAT, "kernel": "mf", "shape": {"n": 1}, "dtype": "fp32",
                     "hardware": "H100", "space": {"X": [0, 1, 2, 3]}, "trials": trials})


def test_multi_fidelity_cuts_clearly_bad_configs_after_the_cheap_pass() -> None:
    t = _mf_table()
    order = [{"X": x} for x in range(4)]
    full = rp.metrics(rp.replay(t, "random", 0, warm_start=False, enqueue=order), t)
    assert full["cost_to_target_s"] == 44.0 and full["cut"] == 0
    trace = rp.replay(t, "random", 0, warm_start=False, enqueue=order, fidelity=0.1,
                      prune_startup=1)
    m = rp.metrics(trace, t)
    # X=0 and X=1: cheap (1 + 1 s) then full (10 s more); X=2: 5.0 ms > 1.5 x 1.1, cut
    # after its cheap pass (2 s); X=3: cheap then full, the optimum.
    assert [s.status for s in trace.steps] == ["ok", "ok", "cut", "ok"]
    assert [s.cost_s for s in trace.steps] == [12.0, 12.0, 2.0, 12.0]
    assert m["trials_to_target"] == 4 and m["cost_to_target_s"] == 38.0 and m["cut"] == 1
    # A pruner that never fires only adds the cheap timings.
    never = rp.replay(t, "random", 0, warm_start=False, enqueue=order, fidelity=0.1,
                      prune_margin=100.0, prune_startup=1)
    assert rp.metrics(never, t)["cost_to_target_s"] == 48.0


def test_cheap_pass_is_seeded_and_within_the_recorded_spread() -> None:
    rec = {"config": {"X": 1}, "median_ms": 1.0, "p20_ms": 0.9, "p80_ms": 1.2,
           "compile_s": 2.0, "timing_s": 4.0, "cost_s": 6.0}
    values = {rp.cheap_pass(rec, 0.25, seed)[0] for seed in range(20)}
    assert len(values) > 1 and all(0.9 <= v <= 1.2 for v in values)
    assert rp.cheap_pass(rec, 0.25, 3) == rp.cheap_pass(rec, 0.25, 3)
    assert rp.cheap_pass(rec, 0.25, 3)[1] == 2.0 + 1.0


@pytest.mark.skipif(not (DATA / "H200" / "matmul__M8192_N8192_K8192__bf16__g216.json").is_file(),
                    reason="no recorded matmul sweep")
def test_multi_fidelity_saves_gpu_time_on_the_recorded_matmul() -> None:
    t = rp.Table.load(DATA / "H200" / "matmul__M8192_N8192_K8192__bf16__g216.json")

    def frac(**kw) -> float:
        fr = [rp.metrics(rp.replay(t, "tpe", seed, in_flight=2, **kw), t)["cost_fraction"]
              for seed in range(5)]
        return sorted(math.inf if f is None else f for f in fr)[2]

    assert frac(fidelity=0.1) < 0.8 * frac()


# -- a live search judged against a recorded sweep (benchmarks/live_search.py) ----------------


def _live_search():
    spec = importlib.util.spec_from_file_location("live_search",
                                                  ROOT / "benchmarks" / "live_search.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_live_search_is_judged_by_the_recorded_latency_of_its_best_config() -> None:
    from types import SimpleNamespace

    t = synthetic(seed=0)
    live = _live_search()
    opt = t.optimum_ms
    ok = sorted(t.of("ok"), key=lambda r: r["median_ms"])
    best, slow = ok[0], next(r for r in ok if r["median_ms"] > 1.1 * opt)

    def trial(n: int, rec: dict, value: float | None, status: str = "measured"):
        return SimpleNamespace(number=n, value=value, params=dict(rec["config"]),
                               user_attrs={ATTR_STATUS: status,
                                           ATTR_RESULT: {"timing_s": 1.0, "compile_s": 0.5}})

    # Live latencies of another day: the search's own best decides, judged by its record.
    trials = [trial(0, slow, 1.0), trial(1, best, 2.0),  # best config, measured slower
              trial(2, slow, None, "duplicate"),  # answered from the study: no device time
              trial(3, best, 0.5)]
    v = live.judge(t, trials)
    assert v["trials"] == 3 and v["gpu_s"] == 4.5
    assert v["reached"]["trial"] == 3 and v["reached"]["gpu_s"] == 4.5
    assert v["reached"]["fraction"] == round(4.5 / t.grid_cost_s, 5)
    assert v["best"] == best["config"] and v["best_vs_optimum"] == 1.0
    assert v["goal_met"] == (4.5 / t.grid_cost_s <= live.GOAL)
    # By the run's own measure of the recorded optimum (2.0 ms that day), its first trial
    # (1.0 ms) was already as fast.
    assert v["optimum_live_ms"] == 2.0 and v["reached_same_run"]["trial"] == 1
    assert "as this run measured it (2 ms): trial 1" in live.render(v, "cmd")
    # Never better than a slow config: not reached, and said so.
    v = live.judge(t, trials[:1])
    assert v["reached"] is None and not v["goal_met"]
    assert v["best_vs_optimum"] == round(slow["median_ms"] / opt, 4)
    assert "not reached" in live.render(v, "cmd")
    assert v["reached_same_run"] is None and "did not measure it" in live.render(v, "cmd")


def test_a_live_search_runs_the_sweep_s_case_as_a_first_tune(tmp_path: Path) -> None:
    live = _live_search()
    table = rp.Table.load(DATA / "H200" / "matmul__M64_N8192_K8192__bf16__g4800.json.gz")
    path = live.experiment_for(table, ROOT / "configs" / "sweeps" / "large" / "matmul.yaml",
                               "pattern", 300, tmp_path)
    exp = experiment.load(path)
    assert [dict(s) for s in exp.shapes] == [{"M": 64, "N": 8192, "K": 8192}]
    assert exp.dtypes == ["bf16"] and exp.hardware == ["H200"]
    assert exp.search.strategy == "pattern" and exp.search.trials == 300
    assert exp.search.warm_start and not exp.search.seed_from_packs
    # The sweep's optimum waits in the run's pack, to be timed beside the finalists.
    from harness.packs import format as packfmt

    pack = packfmt.read(packfmt.pack_path(tmp_path / "packs", "H200", "matmul"))
    (entry,) = pack["kernels"]["matmul"]["bf16"].values()
    assert {k: entry["config"][k] for k in table.optimum} == table.optimum
    assert Path(exp.output.runs_dir) == tmp_path / "runs"
    assert exp.search_space["params"]["BLOCK_M"] == table.space["BLOCK_M"]


def test_a_live_search_is_judged_side_by_side_with_the_recorded_optimum() -> None:
    """The run's final re-measurement times the planted optimum (the incumbent) beside the
    search's finalists: their ratio, same rounds, decides; an optimum the search measured
    far slower than its best is not timed again, and the search's best counts as within."""
    live = _live_search()
    opt = {"config": {"X": 1}, "median_ms": 1.00, "incumbent": True}
    rows = [{"config": {"X": 2}, "median_ms": 1.015, "incumbent": False},
            {"config": {"X": 3}, "median_ms": 1.2, "incumbent": False}]
    got = live.side_by_side({"remeasured": [*rows, opt]})
    assert got["ratio"] == 1.015 and got["within"] and got["best"] == {"X": 2}
    slower = live.side_by_side({"remeasured": [rows[1], opt]})
    assert slower["ratio"] == 1.2 and not slower["within"]
    gone = live.side_by_side({"remeasured": rows})
    assert gone["optimum_ms"] is None and gone["within"]
    assert not live.side_by_side({})["within"]
    text = live._side(got, {"fraction": 0.03})
    assert "**1.015x**" in text and "within 2 %" in text and "3.0%" in text
