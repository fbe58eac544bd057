"""Search features that need no GPU: distinct pruned configs, the stall stop,
the multi-fidelity cut, and (through local Ray and the Triton interpreter) the live
cheap-then-full measurement."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest
import yaml
from optuna.trial import TrialState

from harness.experiment import SearchSettings, StudySpec
from harness.measure.hardware import spec_for_key
from harness.measure.timing import TrialResult
from harness.search import ATTR_STATUS, Search, ThresholdPruner
from tests.fault_kernels import read_events, run_quietly

ROOT = Path(__file__).resolve().parent.parent

SHAPE = {"M": 4096, "N": 1408, "K": 2048, "E": 64}
SPACE = {"BLOCK_M": [64, 128], "BLOCK_N": [128], "BLOCK_K": [64], "num_stages": [3, 9]}


def _search(sampler: optuna.samplers.BaseSampler | None = None, **settings) -> Search:
    spec = StudySpec("t", "grouped_gemm", SHAPE, "bf16", "H100")
    s = Search(spec, SPACE, spec_for_key("H100"),
               SearchSettings(trials=4, warm_start=False, seed_from_packs=False, **settings),
               optuna.storages.InMemoryStorage(), seed=0, n_parallel=1)
    if sampler is not None:
        s.study.sampler = sampler
    return s


def _ok(ms: float) -> TrialResult:
    return TrialResult(ok=True, latency_ms=ms, max_abs_err=0, max_rel_err=0)


class _Stuck(optuna.samplers.BaseSampler):
    """Always proposes the same (statically pruned) config, as GP can."""

    def infer_relative_search_space(self, study, trial):
        return {}

    def sample_relative(self, study, trial, search_space):
        return {}

    def sample_independent(self, study, trial, name, distribution):
        return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_stages": 9}[name]


def test_pruned_counts_distinct_configs_and_a_stuck_sampler_stops() -> None:
    s = _search(_Stuck(), max_stalled_asks=5)
    assert s.ask() is None
    # The same pruned config asked again and again: one distinct pruned config (finding
    # it is progress), then five repeats, and a stop.
    assert s.pruned == 1 and s.stalled and s.done()
    assert sum(t.state == TrialState.PRUNED for t in s.study.trials) == 6
    assert "stalled" in s.attr("stopped")


def test_a_mostly_invalid_grid_is_walked_to_its_valid_configs() -> None:
    """40 of 42 grid points are statically pruned (a narrow experiment over a space with
    many tunables is like this): the grid walks its valid set, so the two valid ones are
    measured with two asks, none spent on the 40 others."""
    spec = StudySpec("t", "grouped_gemm", SHAPE, "bf16", "H100")
    space = {"BLOCK_M": [64, 128], "BLOCK_N": [128], "BLOCK_K": [64], "num_stages": [3],
             "TAIL_WINDOW": list(range(-20, 1))}  # < 0 is invalid
    s = Search(spec, space, spec_for_key("H100"),
               SearchSettings(sampler="grid", trials=4, warm_start=False,
                              seed_from_packs=False, max_stalled_asks=5),
               optuna.storages.InMemoryStorage(), seed=0, n_parallel=1)
    measured = []
    while (asked := s.ask()) is not None:
        trial, config = asked
        measured.append((config["BLOCK_M"], config["TAIL_WINDOW"]))
        s.tell(trial, config, _ok(1.0))
    assert sorted(measured) == [(64, 0), (128, 0)]
    assert s.pruned == 0 and s.asks == 2 and not s.stalled


def test_a_duplicate_of_a_config_in_flight_is_told_without_a_nan(recwarn) -> None:
    """A sampler that asks again for a config still being measured gets a duplicate,
    told FAIL (it has no value yet), not NaN, which Optuna warns about."""
    s = _search(_Stuck(), max_stalled_asks=3)
    s.space = {**SPACE, "num_stages": [3]}  # the stuck config, now valid

    class _Valid(_Stuck):
        def sample_independent(self, study, trial, name, distribution):
            return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_stages": 3}[name]

    s.study.sampler = _Valid()
    first = s.ask()
    assert first is not None  # claimed, in flight
    assert s.ask() is None  # only duplicates of it, then a stall
    dups = [t for t in s.study.trials if t.user_attrs.get(ATTR_STATUS) == "duplicate"]
    assert dups and all(t.state == TrialState.FAIL for t in dups)
    assert not [w for w in recwarn if "nan is not acceptable" in str(w.message)]


def test_cheap_pass_cuts_a_clearly_slow_config() -> None:
    s = _search(pruner="threshold", prune_startup_trials=1, prune_margin=0.1)
    trial, config = s.ask()
    assert not s.cheap(trial, config, _ok(1.0))  # nothing to compare with: goes on
    s.tell(trial, config, _ok(1.0))
    trial, config = s.ask()
    assert s.cheap(trial, config, _ok(1.5))  # 50 % slower than the best: cut
    t = s.study.trials[trial.number]
    assert t.state == TrialState.PRUNED and t.user_attrs[ATTR_STATUS] == "cut"
    assert s.counts()["cut"] == 1 and s.measured == 2
    assert s.best()[1]["latency_ms"] == 1.0  # a cut trial never wins


def test_threshold_pruner_waits_for_startup_trials() -> None:
    study = optuna.create_study(pruner=ThresholdPruner(0.1, n_startup_trials=2))
    t = study.ask()
    study.tell(t, 1.0)
    t = study.ask()
    t.report(5.0, 0)
    assert not t.should_prune()  # one complete trial < 2
    study.tell(t, 5.0)
    t = study.ask()
    t.report(1.05, 0)
    assert not t.should_prune()  # within 10 % of the best
    t = study.ask()
    t.report(1.2, 0)
    assert t.should_prune()


@pytest.mark.slow
def test_a_run_cuts_slow_configs_after_a_cheap_pass(tmp_path: Path, faulty_events: Path,
                                                   mlflow_db: Path) -> None:
    """Live multi-fidelity: the default config (no sleep) is measured in full first;
    every config that sleeps 100 ms or more (gaps a loaded 2-core machine's jitter does not
    bridge) is then stopped after its cheap pass."""
    events = faulty_events
    exp = {
        "name": "fidelity", "kernel": "tests.fault_kernels:Faulty", "shapes": [{"N": 256}],
        "dtypes": ["fp32"],
        "search": {"sampler": "grid", "trials": 4, "warm_start": True, "seed_from_packs": False,
                   "remeasure_top_k": 0, "pruner": "threshold", "prune_startup_trials": 1,
                   "prune_margin": 0.5, "cheap_rep_ms": 5},
        "search_space": {"params": {"FAULT": ["none"], "SLEEP_MS": [0, 100, 200, 300]}},
        "tracking": {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
        "output": {"packs_dir": str(tmp_path / "packs"), "runs_dir": str(tmp_path / "runs")},
        "fleet": {"compile_workers": 0, "queue_depth": 1},
    }
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(exp))
    rows = run_quietly(tmp_path / "exp.yaml").rows
    assert len(rows) == 1, [(r["hardware"], r["shape"]) for r in rows]
    row = rows[0]
    assert row["params"]["SLEEP_MS"] == 0
    assert row["counts"]["measured"] == 1 and row["counts"]["cut"] == 3, row["counts"]
    launches: dict[int, int] = {}
    for e in read_events(events):
        if e["event"] == "launch":
            launches[e["config"]["SLEEP_MS"]] = launches.get(e["config"]["SLEEP_MS"], 0) + 1
    # One measurement each for the cut configs; the winner (the default config, which the
    # search measured first: no separate baseline of it): cheap and full.
    assert launches[100] == launches[200] == launches[300]
    assert launches[0] == 2 * launches[100], launches
