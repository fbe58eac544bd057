"""Search decisions that need no Ray: accuracy requirements and static pruning."""

from __future__ import annotations

import optuna
import pytest

from harness.experiment import SearchSettings, StudySpec
from harness.measure.hardware import spec_for_key
from harness.measure.timing import TrialResult
from harness.search import Search

SHAPE = {"M": 4096, "N": 1408, "K": 2048, "E": 64}


def _search(**settings) -> Search:
    spec = StudySpec("t", "grouped_gemm", SHAPE, "bf16", "H100")
    space = {"BLOCK_M": [64, 128], "BLOCK_N": [128], "BLOCK_K": [64], "num_stages": [3, 9]}
    return Search(spec, space, spec_for_key("H100"),
                  SearchSettings(trials=4, warm_start=False, **settings),
                  optuna.storages.InMemoryStorage(), seed=0, n_parallel=1)


def test_accuracy_requirement_fails_fast_but_inaccurate_configs():
    s = _search(max_abs_err=1e-3)
    trial, config = s.ask()
    s.tell(trial, config, TrialResult(ok=True, latency_ms=0.1, max_abs_err=5e-3, max_rel_err=1e-3))
    trial2, config2 = s.ask()
    s.tell(trial2, config2, TrialResult(ok=True, latency_ms=0.2, max_abs_err=1e-4,
                                        max_rel_err=1e-5))
    (failed_config, reason), = s.failures()
    assert failed_config == config and "accuracy requirement: max_abs_err" in reason
    best_config, best = s.best()
    assert best_config == config2 and best["latency_ms"] == 0.2


def test_static_pruning_never_hands_out_invalid_configs():
    s = _search()
    handed = []
    while (asked := s.ask()) is not None:
        trial, config = asked
        handed.append(config)
        s.tell(trial, config, TrialResult(ok=True, latency_ms=1.0, max_abs_err=0, max_rel_err=0))
    # num_stages=9 with BLOCK_M=128 needs more shared memory than an H100 has; the three
    # other configs all run, and the sampler never proposes the fourth (no ask is spent).
    assert sorted((c["BLOCK_M"], c["num_stages"]) for c in handed) == [(64, 3), (64, 9),
                                                                        (128, 3)]
    assert s.pruned == 0 and s.asks == 3


def test_the_whole_budget_is_handed_out_before_any_result_comes_back():
    """A worker's queue holds several trials: the scheduler asks for the budget's last
    configs while the first ones are still in flight, so the GPU never waits on the
    driver at the end of a study (in-flight configs count once against the budget)."""
    from harness import experiment
    from harness.measure.hardware import spec_for_key as hw
    from harness.run import schedule

    exp = experiment.Experiment(name="t", kernel="grouped_gemm", shapes=[SHAPE],
                                dtypes=["bf16"])
    planned = experiment.ExperimentPlan.checked("t.yaml", exp).for_hardware(["H100"])
    (study,) = planned.studies
    spec = study.spec
    space = {"BLOCK_M": [64, 128], "BLOCK_N": [128], "BLOCK_K": [64], "num_stages": [3, 4]}
    search = Search(spec, space, hw("H100"),
                    SearchSettings(sampler="grid", trials=4, warm_start=False),
                    optuna.storages.InMemoryStorage(), seed=0, n_parallel=4)
    st = schedule.StudyState(study, search, "r", {}, eager={"latency_ms": 1.0},
                             default={"latency_ms": 1.0})
    tasks = [schedule.study_task(st, "H100") for _ in range(4)]
    assert all(t is not None and t.tag[0] == "trial" for t in tasks), tasks
    assert st.in_flight == 4 and search.measured == 4
    assert sorted((t.tag[3]["BLOCK_M"], t.tag[3]["num_stages"]) for t in tasks) == [
        (64, 3), (64, 4), (128, 3), (128, 4)]
    assert schedule.study_task(st, "H100") is None and search.done()


_KILLED_DRIVER = """
import json, os, signal, sys
import optuna
from harness.experiment import SearchSettings, StudySpec
from harness.measure.hardware import spec_for_key
from harness.search import Search, make_storage
spec = StudySpec("t", "matmul", {"M": 256, "N": 256, "K": 256}, "bf16", "H100")
space = {"BLOCK_M": [64, 128], "BLOCK_N": [64, 128], "BLOCK_K": [32, 64]}
s = Search(spec, space, spec_for_key("H100"), SearchSettings(sampler="grid", trials=6,
           warm_start=False, seed_from_packs=False), make_storage(sys.argv[1]), seed=0,
           n_parallel=2)
asked = [s.ask(), s.ask()]
print(json.dumps([c for _, c in asked]), flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # the driver dies with two configs in flight
"""


@pytest.mark.slow
def test_resume_measures_the_configs_a_killed_driver_left_in_flight(tmp_path) -> None:
    import json
    import subprocess
    import sys
    from pathlib import Path

    from harness.search import make_storage

    root = Path(__file__).resolve().parent.parent
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    proc = subprocess.run([sys.executable, "-c", _KILLED_DRIVER, url], capture_output=True,
                          text=True, cwd=root, env={**__import__("os").environ,
                                                    "PYTHONPATH": str(root)}, timeout=600)
    assert proc.returncode == -9, proc.stderr
    in_flight = json.loads(proc.stdout)
    spec = StudySpec("t", "matmul", {"M": 256, "N": 256, "K": 256}, "bf16", "H100")
    space = {"BLOCK_M": [64, 128], "BLOCK_N": [64, 128], "BLOCK_K": [32, 64]}
    s = Search(spec, space, spec_for_key("H100"),
               SearchSettings(sampler="grid", trials=6, warm_start=False,
                              seed_from_packs=False), make_storage(url), seed=0, n_parallel=2)
    assert s.interrupted == in_flight
    measured = []
    while (asked := s.ask()) is not None:
        trial, config = asked
        measured.append(config)
        s.tell(trial, config, TrialResult(ok=True, latency_ms=1.0, max_abs_err=0,
                                          max_rel_err=0))
    assert measured[:2] == in_flight and len(measured) == 6
    assert s.counts()["measured"] == 6
    # A second resume queues nothing again: the interrupted configs were measured.
    again = Search(spec, space, spec_for_key("H100"),
                   SearchSettings(sampler="grid", trials=6, warm_start=False,
                                  seed_from_packs=False), make_storage(url), seed=0,
                   n_parallel=2)
    assert again.interrupted == [] and again.measured == 6


def test_drop_studies_deletes_only_the_named_ones_and_creates_nothing(tmp_path) -> None:
    from harness.search import drop_studies, make_storage

    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    assert drop_studies(url, ["a"]) == [] and not (tmp_path / "optuna.db").exists()
    storage = make_storage(url)
    for name in ("a", "b", "c"):
        optuna.create_study(study_name=name, storage=storage)
    assert drop_studies(url, ["a", "c", "x"]) == ["a", "c"]
    assert [s.study_name for s in optuna.get_all_study_summaries(make_storage(url))] == ["b"]


def test_drop_studies_removes_a_file_that_holds_only_them(tmp_path) -> None:
    """Every study in the file dropped: the file goes (fast), and a new storage at the
    same place starts empty and works; a study of another name keeps the file."""
    from harness.search import drop_studies, make_storage

    db = tmp_path / "optuna.db"
    url = f"sqlite:///{db}"
    storage = make_storage(url)
    for name in ("a", "b"):
        optuna.create_study(study_name=name, storage=storage).optimize(
            lambda t: t.suggest_int("x", 0, 9), n_trials=3)
    storage.engine.dispose()
    assert drop_studies(url, ["b", "a", "x"]) == ["b", "a"]
    assert not db.exists() and not list(tmp_path.glob("optuna.db-*"))
    again = make_storage(url)
    assert optuna.get_all_study_summaries(again) == []
    optuna.create_study(study_name="a", storage=again).optimize(
        lambda t: t.suggest_int("x", 0, 9), n_trials=2)
    optuna.create_study(study_name="keep", storage=again)
    again.engine.dispose()
    assert drop_studies(url, ["a"]) == ["a"] and db.exists()
    assert [s.study_name for s in optuna.get_all_study_summaries(make_storage(url))] == ["keep"]
