"""Campaigns: several experiment files (or a folder of them) in one ``kharness run``, on one
Ray and one fleet, each experiment keeping its own packs, MLflow experiment, run folder,
Optuna storage and summary; every file checked before anything starts; ``--resume``
continuing each experiment."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml

from harness import cli, experiment
from harness.fleet import Fleet

ROOT = Path(__file__).resolve().parent.parent
FAULTY = "tests.fault_kernels:Faulty"


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _flat(text: str) -> str:
    """``text`` without whitespace: the console folds long lines where it likes."""
    return "".join(text.split())


def _exp(name: str, **fields: Any) -> dict[str, Any]:
    exp = {"name": name, "kernel": FAULTY, "shapes": [{"N": 256}], "dtypes": ["fp32"],
           "search": {"sampler": "grid", "trials": 3},
           "search_space": {"params": {"FAULT": ["none"], "SLEEP_MS": [0, 1, 2, 3]}},
           "tracking": {"uri": "sqlite:///mlflow.db"},
           "output": {"packs_dir": f"packs_{name}", "runs_dir": "runs"},
           "fleet": {"compile_workers": 0, "bookkeeping": "threads"}}
    exp.update(fields)
    return exp


def _write(folder: Path, name: str, **fields: Any) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(_exp(name, **fields)))
    return path


@pytest.fixture
def started(monkeypatch, tmp_path) -> list[int]:
    """Ray's start, recorded instead of done; the test runs in an empty directory."""
    import ray

    calls: list[int] = []
    monkeypatch.setattr(Fleet, "connect", staticmethod(lambda: calls.append(1) or "local"))
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.chdir(tmp_path)
    return calls


# -- the command line reads the campaign's files before anything starts --------------------
def test_a_folder_stands_for_its_yaml_files_sorted(tmp_path):
    for name in ("b", "a", "c"):
        _write(tmp_path / "exps", name)
    (tmp_path / "exps" / "notes.txt").write_text("not an experiment")
    (tmp_path / "exps" / "sub").mkdir()
    _write(tmp_path / "exps" / "sub", "deeper")  # not recursive
    single = _write(tmp_path, "z")
    assert experiment.expand([tmp_path / "exps", single]) == [
        tmp_path / "exps" / "a.yaml", tmp_path / "exps" / "b.yaml",
        tmp_path / "exps" / "c.yaml", single]
    assert experiment.is_campaign([tmp_path / "exps"]) and experiment.is_campaign([single] * 2)
    assert not experiment.is_campaign([single])
    (tmp_path / "empty").mkdir()
    with pytest.raises(experiment.ExperimentError, match="no \\*.yaml"):
        experiment.expand([tmp_path / "empty"])


@pytest.mark.parametrize(("patch", "field", "words"), [
    ({"search": {"sampler": "grid", "trials": 0}}, "search.trials", "greater than or equal"),
    ({"tracking": {"uri": "http://127.0.0.1:9"}}, "tracking.uri",
     "no tracking server answers"),
    ({"output": {"packs_dir": "a-file/packs", "runs_dir": "runs"}}, "output.packs_dir",
     "is not a folder"),
])
def test_one_bad_file_stops_the_campaign_before_anything_starts(tmp_path, capsys, started,
                                                                patch, field, words):
    (tmp_path / "a-file").write_text("")
    paths = [_write(tmp_path, "one"), _write(tmp_path, "two", **patch),
             _write(tmp_path, "three")]
    before = _listing(tmp_path)
    rc = cli.main(["run", *map(str, paths)])
    err = _flat(capsys.readouterr().err)
    assert rc == cli.EXIT_BAD_INPUT, err
    assert _flat(str(paths[1])) in err and _flat(field) in err and _flat(words) in err, err
    assert str(paths[0]) not in err and "Traceback" not in err
    assert not started, "found only after Ray had started"
    assert _listing(tmp_path) == before  # no runs/, packs/, mlflow.db


def test_a_file_failing_its_kernel_checks_leaves_nothing(tmp_path, capsys, started,
                                                        monkeypatch):
    """The checks that import the kernel families run while Ray starts, as for one file:
    a file that fails them stops that Ray and leaves nothing behind."""
    import ray

    stopped: list[int] = []
    paths = [_write(tmp_path, "one"),
             _write(tmp_path, "two", search_space={"params": {"BLOCK": ["x"]}})]
    monkeypatch.setattr(ray, "shutdown", lambda: stopped.append(1))
    before = _listing(tmp_path)
    rc = cli.main(["run", *map(str, paths)])
    err = _flat(capsys.readouterr().err)
    assert rc == cli.EXIT_BAD_INPUT and _flat(str(paths[1])) in err and "BLOCK" in err, err
    assert stopped and _listing(tmp_path) == before


def test_two_files_of_one_name_are_refused(tmp_path, capsys, started):
    first = _write(tmp_path / "x", "same")
    second = _write(tmp_path / "y", "same")
    before = _listing(tmp_path)
    rc = cli.main(["run", str(first), str(second)])
    err = _flat(capsys.readouterr().err)
    assert rc == cli.EXIT_BAD_INPUT and _flat(str(first)) in err and _flat(str(second)) in err
    assert "name" in err and not started and _listing(tmp_path) == before
    # One file given twice (a folder and a file in it) is named as such.
    assert cli.main(["run", str(tmp_path / "x"), str(first)]) == cli.EXIT_BAD_INPUT
    assert "giventwice" in _flat(capsys.readouterr().err)


def test_a_held_experiment_stops_the_campaign_and_undoes_the_other_locks(tmp_path, capsys,
                                                                        started):
    one, two = _write(tmp_path, "one"), _write(tmp_path, "two")
    held = experiment.lock_run_dir(two, experiment.load(two, semantics=False))
    try:
        rc = cli.main(["run", str(one), str(two)])
    finally:
        held.release()
    err = " ".join(capsys.readouterr().err.split())
    assert rc == cli.EXIT_BAD_INPUT and "in use by another run of 'two'" in err
    assert not started and not (tmp_path / "runs" / "one").exists()


# -- the summary --------------------------------------------------------------------------
def test_the_summary_shows_each_experiment_then_the_campaign(tmp_path, capsys, monkeypatch):
    from harness.run.campaign import CampaignSummary, Entry
    from harness.run.results import Summary

    monkeypatch.chdir(tmp_path)
    paths = [_write(tmp_path, "one"), _write(tmp_path, "two", hardware=["H100"])]
    row = {"hardware": "cpu", "kernel": FAULTY, "shape": "N=256", "dtype": "fp32",
           "counts": {"measured": 3, "failed": 0, "pruned": 0}, "config": {"SLEEP_MS": 1},
           "latency_ms": 0.5, "mlflow_run_id": "r1"}
    seen: dict[str, Any] = {}

    def stand_in(paths: list[str], **kwargs: Any) -> CampaignSummary:
        seen.update(kwargs, paths=paths)
        one = Summary(rows=[row], packs=["packs_one/cpu/faulty.json"], parent_run_id="p1",
                      tracking_uri="sqlite:///mlflow.db", timeline={"search_done": 3.0})
        two = Summary(missing_hardware=["H100"])
        fleet = Summary(wall_s=9.0, held_s=4.0, timing_s=2.0, timing_fraction=0.5,
                        timeline={"ray_connected": 1.0, "workers_ready": 2.0,
                                  "first_trial": 3.0, "last_result": 8.0, "done": 9.0})
        return CampaignSummary([Entry(str(paths[0]), "one", one),
                                Entry(str(paths[1]), "two", two, skipped=True)], fleet)

    monkeypatch.setattr("harness.run.campaign.run_campaign", stand_in)
    rc = cli.main(["run", *map(str, paths), "--set", "search.trials=2"])
    out, err = capsys.readouterr()
    # An experiment whose hardware was missing is not run: exit 3, as for one file.
    assert rc == cli.EXIT_NO_HARDWARE and "not run: experiment two" in " ".join(err.split())
    assert seen["paths"] == [str(p) for p in paths] and seen["overrides"] == ["search.trials=2"]
    assert out.index("experiment one:") < out.index("pack: packs_one/cpu/faulty.json") \
        < out.index("experiment two:") < out.index("not run: none of its hardware (H100)") \
        < out.index("the campaign's fleet:")
    assert "parent run p1" in out and "SLEEP_MS=1" in out
    assert "time: start 3.0 s (ray 1.0 s, workers 2.0 s), search 5.0 s, end 1.0 s" in out
    assert "campaign: 2 experiments (1 not run), 1 studies, 1 packs, one fleet, wall 9.0 s" \
        in out
    rc = cli.main(["run", *map(str, paths), "--json"])
    data = json.loads(capsys.readouterr().out)
    assert [e["name"] for e in data["experiments"]] == ["one", "two"]
    assert data["experiments"][0]["rows"][0]["latency_ms"] == 0.5
    assert data["experiments"][1]["skipped"] is True
    assert data["packs"] == ["packs_one/cpu/faulty.json"] and data["wall_s"] == 9.0
    assert data["timeline_s"]["ray_connected"] == 1.0 and data["studies"] == 1


# -- fleet-wide settings ------------------------------------------------------------------
def test_one_fleet_takes_the_most_any_file_allows():
    from harness.run.members import own_timing, shared_fleet, trial_timeout_s

    a = experiment.Experiment.model_validate(_exp(
        "a", timing={"rep_ms": 60, "trial_timeout_s": 90},
        fleet={"queue_depth": 12, "compile_workers": 12, "max_retries": 1}))
    b = experiment.Experiment.model_validate(_exp(
        "b", fleet={"queue_depth": 32, "compile_workers": 12, "compile_timeout_s": 60,
                    "bookkeeping": "processes"}))
    fs = shared_fleet([a, b])
    assert (fs.queue_depth, fs.compile_workers, fs.max_retries) == ("auto", 12, 2)
    assert fs.compile_timeout_s == 60 and fs.bookkeeping == "auto"
    assert shared_fleet([a]) == a.fleet and trial_timeout_s([a, b]) == 300
    # An experiment whose budgets differ from the fleet's (the first file's) sends its own.
    fleet_timing = {"warmup_ms": 25.0, "rep_ms": 60.0, "cpu_reps": 2}
    assert own_timing(a, fleet_timing) == {} and own_timing(b, fleet_timing) == {"rep_ms": 100}


def test_two_experiments_tuning_one_pack_entry_are_named():
    from harness.run.members import Member, overlaps
    from harness.run.results import Summary

    def member(name: str, **fields: Any) -> Member:
        exp = experiment.Experiment.model_validate(_exp(name, **fields))
        m = Member(f"{name}.yaml", exp, False, Summary(), None)  # type: ignore[arg-type]
        m.plan = experiment.ExperimentPlan.checked(m.path, exp).for_hardware(["cpu"])
        return m

    shared = {"packs_dir": "packs", "runs_dir": "runs"}
    a, b = member("a", output=shared), member("b", output=shared)
    (line,) = overlaps([a, b, member("c", shapes=[{"N": 512}], output=shared),
                        member("d")])  # another shape; another packs folder
    assert line.startswith("experiments a and b both tune") and "N=256 fp32 on cpu" in line
    assert "the one that finishes last is the one the pack keeps" in line


def test_a_study_s_tasks_carry_its_experiment_s_budgets():
    from harness.measure.hardware import spec_for_key
    from harness.run import schedule
    from harness.search import Search

    exp = experiment.Experiment.model_validate(_exp("b"))
    (study,) = experiment.ExperimentPlan.checked("b.yaml", exp).for_hardware(["cpu"]).studies
    spec = study.spec
    search = Search(spec, {"SLEEP_MS": [0, 1]}, spec_for_key("H100"), exp.search,
                    optuna.storages.InMemoryStorage(), seed=0, n_parallel=1)
    st = schedule.StudyState(study, search, "r", {}, timing={"rep_ms": 100.0})
    task = schedule.study_task(st, "cpu")
    assert task is not None and task.args[5] == {"rep_ms": 100.0}
    tasks = schedule.remeasure_tasks(exp, SimpleStudy(spec), st.timing)
    # The final rounds' own warm-up (``search.remeasure_warmup_ms``) beside it.
    assert tasks and all(t.args[-1] == {"rep_ms": 100.0, "warmup_ms": 5.0} for t in tasks)


class SimpleStudy:
    """A study in its final phase with one finalist and the eager baseline."""

    def __init__(self, spec: Any) -> None:
        from harness.run.remeasure import Candidate

        self.spec = spec
        self.candidates = [Candidate({"SLEEP_MS": 0}, 1.0)]
        self.baselines = {"eager": Candidate({"baseline": "eager"}, 1.0)}


# -- real campaigns: a local Ray, MLflow on SQLite, Optuna storages -----------------------
@pytest.fixture
def own_ray(monkeypatch, tmp_path, mlflow_db) -> list[int]:
    """The campaign starts its own local Ray (counted), whose workers import the tests'
    kernels; the test runs in ``tmp_path`` with an empty MLflow store there."""
    import ray

    if ray.is_initialized():  # an earlier module's, which this test must not join
        ray.shutdown()
    calls: list[int] = []
    connect = Fleet.connect
    monkeypatch.setattr(Fleet, "connect", staticmethod(lambda: calls.append(1) or connect()))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.chdir(tmp_path)
    return calls


def _trials(name: str) -> list[tuple[int, dict, float | None]]:
    storage = f"sqlite:///runs/{name}/optuna.db"
    (study,) = optuna.get_all_study_summaries(storage)
    trials = optuna.load_study(study_name=study.study_name, storage=storage).trials
    return [(t.number, t.params, t.value) for t in trials
            if t.user_attrs.get("status") == "measured"]


def _killed_mid_trial(name: str) -> dict:
    """The experiment's last trial as a driver killed while it ran leaves it: running,
    with no value or result stored. Returns its config."""
    import sqlite3

    con = sqlite3.connect(f"runs/{name}/optuna.db")
    try:
        (tid,) = con.execute("SELECT max(trial_id) FROM trials").fetchone()
        params = dict(con.execute("SELECT param_name, param_value FROM trial_params "
                                  "WHERE trial_id = ?", (tid,)).fetchall())
        con.execute("UPDATE trials SET state = 'RUNNING', datetime_complete = NULL "
                    "WHERE trial_id = ?", (tid,))
        con.execute("DELETE FROM trial_values WHERE trial_id = ?", (tid,))
        con.execute("DELETE FROM trial_user_attributes WHERE trial_id = ? "
                    "AND key IN ('result', 'status')", (tid,))
        con.commit()
    finally:
        con.close()
    return params


@pytest.mark.slow
def test_a_campaign_runs_on_one_fleet_and_resumes_each_experiment(tmp_path, capsys, own_ray):
    from mlflow.tracking import MlflowClient

    folder = tmp_path / "exps"
    paths = [_write(folder, "alpha"), _write(folder, "beta", timing={"rep_ms": 50})]
    # (1) two files, one command: --set applies to each (3 trials in the files, 2 run).
    rc = cli.main(["run", *map(str, paths), "--json", "--set", "search.trials=2"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    data = json.loads(out)
    assert own_ray == [1], "one Ray for the whole campaign"
    assert [e["name"] for e in data["experiments"]] == ["alpha", "beta"]
    assert data["studies"] == 2 and data["timeline_s"]["first_trial"] > 0
    client = MlflowClient("sqlite:///mlflow.db")
    first: dict[str, str] = {}
    for e in data["experiments"]:
        name = e["name"]
        (pack,) = e["packs"]
        assert Path(pack).resolve().is_relative_to((tmp_path / f"packs_{name}").resolve())
        assert e["rows"][0]["counts"]["measured"] == 2 and len(_trials(name)) == 2
        assert e["timeline_s"]["packs_frozen"] >= e["timeline_s"]["studies_done"]
        state = json.loads(Path(f"runs/{name}/state.json").read_text())
        assert state["parent_run_id"] == e["mlflow_parent_run_id"]
        parent = client.get_run(e["mlflow_parent_run_id"])
        assert client.get_experiment(parent.info.experiment_id).name == name
        assert parent.data.tags["harness.campaign"] == "alpha,beta"
        assert "campaign_gpu_held_s" in parent.data.metrics
        first[name] = e["mlflow_parent_run_id"]
    # Without --resume or --fresh, each experiment with an earlier run is named; no Ray.
    assert cli.main(["run", str(folder), "--set", "search.trials=2"]) == cli.EXIT_BAD_INPUT
    err = " ".join(capsys.readouterr().err.split())
    assert "'alpha' has an earlier run" in err and "'beta' has an earlier run" in err
    assert own_ray == [1]
    # (2) the folder, (5) --resume: each experiment continues its studies and MLflow run,
    # the trial its killed driver left running measured again.
    kept = {name: _trials(name)[:1] for name in first}
    cut = {name: _killed_mid_trial(name) for name in first}
    rc = cli.main(["run", str(folder), "--resume", "--json", "--set", "search.trials=2"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    data = json.loads(out)
    assert own_ray == [1, 1]
    for e in data["experiments"]:
        name = e["name"]
        assert e["mlflow_parent_run_id"] == first[name]
        (resumed,) = e["resumed"].values()
        assert len(resumed["requeued"]) == 1, resumed
        now = _trials(name)
        assert len(now) == 2 and now[:1] == kept[name], (now, kept[name])
        assert now[1][0] == 2 and len(now[1][1]) == len(cut[name])  # a new trial: #2
        assert e["rows"][0]["counts"]["measured"] == 2
