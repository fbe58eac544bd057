"""Bad input is found before Ray starts: the file's form (ranges, types, tags, repeats,
the tracking URI's scheme) and its surroundings (writable folders, the tracking store's
driver and server). Each exits 2 naming the file and the field, with no traceback, no
password, nothing written and no Ray started; a run that failed before its first trial
does not block the next."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from harness import cli, experiment
from harness.fleet import Fleet

SECRET = "Sup3rSecret"
GOOD: dict[str, Any] = {"name": "pre", "kernel": "grouped_gemm",
                        "shapes": [{"M": 320, "N": 128, "K": 128, "E": 4}],
                        "dtypes": ["fp16"], "search": {"trials": 3}}


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _flat(text: str) -> str:
    """``text`` without whitespace: the console folds long lines where it likes."""
    return "".join(text.split())


@pytest.fixture
def started(monkeypatch, tmp_path) -> list[int]:
    """Ray's start, recorded instead of done; the test runs in an empty directory."""
    import ray

    calls: list[int] = []
    monkeypatch.setattr(Fleet, "connect", staticmethod(lambda: calls.append(1) or "local"))
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.chdir(tmp_path)
    _clean_env(monkeypatch)
    return calls


def _clean_env(monkeypatch: Any) -> None:
    """MLflow's variables unset, and unset again after the test (a URI's credentials
    move into them, and a password left there would be masked as a known secret)."""
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)


def _refused(tmp_path: Path, capsys: Any, started: list[int], text: str, field: str,
             words: str) -> str:
    path = tmp_path / "exp.yaml"
    path.write_text(text)
    before = _listing(tmp_path)
    rc = cli.main(["run", str(path)])
    out = capsys.readouterr()
    err = _flat(out.err)
    assert rc == cli.EXIT_BAD_INPUT, out.err
    assert _flat(str(path)) in err and _flat(field) in err and _flat(words) in err, out.err
    assert "Traceback" not in out.err + out.out
    assert SECRET not in out.err + out.out
    assert not started, "found only after Ray had started"
    assert _listing(tmp_path) == before  # no runs/, packs/, mlflow.db
    return out.err


def _patched(**patch: Any) -> str:
    return yaml.safe_dump({**GOOD, **patch})


def _nested(section: str, **patch: Any) -> str:
    return _patched(**{section: {**GOOD.get(section, {}), **patch}})


FORM = [
    # case 4: out of the samplers' range, found at the first study
    (_patched(seed=-1), "seed", "greater than or equal to 0"),
    (_patched(seed=2**64), "seed", "less than or equal to 4294967295"),
    # case 9: booleans, infinities and absurd counts
    (_nested("search", trials=True), "search.trials", "valid integer"),
    (_nested("search", trials=1e30), "search.trials", "valid integer"),
    ("name: pre\nkernel: grouped_gemm\nshapes: [{M: 320, N: 128, K: 128, E: 4}]\n"
     "search: {trials: 1e30}\n", "search.trials", "valid integer"),
    (_nested("search", trials=10**30), "search.trials", "less than or equal to"),
    (_patched(timing={"rep_ms": float("inf")}), "timing.rep_ms", "finite"),
    (_patched(timing={"trial_timeout_s": float("nan")}), "timing.trial_timeout_s", "finite"),
    (_nested("search", timeout_s=float("inf")), "search.timeout_s", "finite"),
    (_patched(fleet={"wait_for_nodes_s": float("inf")}), "fleet.wait_for_nodes_s", "finite"),
    (_patched(baselines={"compile": 1}), "baselines.compile", "valid boolean"),
    (_patched(name="x" * 300), "name", "at most 100 characters"),
    ("name: !!binary cHJl\nkernel: grouped_gemm\nshapes: [{M: 320, N: 128, K: 128, E: 4}]\n",
     "line 1", "the tag '!!binary'"),
    (_patched(shapes=[GOOD["shapes"][0], {"E": 4, "K": 128, "N": 128, "M": 320}]), "shapes",
     "shapes[1] repeats shapes[0]"),
    (_patched(dtypes=["fp16", "bf16", "fp16"]), "dtypes", "dtypes[2] repeats dtypes[0]"),
    (_patched(hardware=["H100", "H100"]), "hardware", "hardware[1] repeats hardware[0]"),
    (_patched(search_space={"params": {}}), "search_space.params", "empty"),
    (_patched(search_space={"hardware": {"cpu": {"params": {}}}}),
     "search_space.hardware.cpu.params", "empty"),
    # case 1: a URI that MLflow cannot open, its password never shown
    (_patched(tracking={"uri": f"ftp://kh:{SECRET}@127.0.0.1/x"}), "tracking.uri",
     "the scheme 'ftp' is not a tracking store"),
    (_patched(tracking={"uri": f"http://kh:ab/{SECRET}@127.0.0.1:9"}), "tracking.uri",
     "percent-encoded"),
    (_patched(tracking={"uri": f"https://kh:a?{SECRET}@127.0.0.1:9"}), "tracking.uri",
     "percent-encoded"),
]


@pytest.mark.parametrize(("text", "field", "words"), FORM)
def test_the_form_refuses_before_anything_starts(tmp_path, capsys, started, text, field,
                                                 words):
    _refused(tmp_path, capsys, started, text, field, words)
    # A URI read wrongly moves no part of a password into MLflow's variables.
    assert "MLFLOW_TRACKING_PASSWORD" not in os.environ


def _under_a_file(tmp_path: Path) -> str:
    (tmp_path / "a-file").write_text("")
    return str(tmp_path / "a-file" / "sub")


SURROUNDINGS = [
    # case 4: a database driver that is not installed, a server that does not answer
    (lambda t: {"tracking": {"uri": f"postgresql://kh:{SECRET}@127.0.0.1:9/db"}},
     "tracking.uri", "is not installed"),
    (lambda t: {"tracking": {"uri": f"mysql+pymysql://kh:{SECRET}@127.0.0.1:9/db"}},
     "tracking.uri", "'pymysql' is not installed"),
    (lambda t: {"tracking": {"uri": "http://127.0.0.1:9"}}, "tracking.uri",
     "no tracking server answers at 127.0.0.1:9"),
    (lambda t: {"tracking": {"uri": f"http://kh:{SECRET}@127.0.0.1:9/"}}, "tracking.uri",
     "no tracking server answers at 127.0.0.1:9"),
    # folders that cannot be written: found at freeze time, after the whole search
    (lambda t: {"output": {"packs_dir": _under_a_file(t)}}, "output.packs_dir",
     "is not a folder"),
    (lambda t: {"output": {"runs_dir": _under_a_file(t)}}, "output.runs_dir",
     "is not a folder"),
    (lambda t: {"tracking": {"uri": f"sqlite:///{_under_a_file(t)}/mlflow.db"}},
     "tracking.uri", "is not a folder"),
    (lambda t: {"tracking": {"uri": _under_a_file(t)}}, "tracking.uri", "is not a folder"),
]


@pytest.mark.parametrize(("patch", "field", "words"), SURROUNDINGS)
def test_the_surroundings_are_checked_before_ray_starts(tmp_path, capsys, started, patch,
                                                        field, words):
    _refused(tmp_path, capsys, started, _patched(**patch(tmp_path)), field, words)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to any folder")
def test_a_read_only_packs_folder_is_refused(tmp_path, capsys, started):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    _refused(tmp_path, capsys, started, _patched(output={"packs_dir": str(ro / "packs")}),
             "output.packs_dir", "is not writable")


def test_the_environment_s_tracking_uri_is_checked_too(tmp_path, capsys, started,
                                                       monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://kh:ab/{SECRET}@127.0.0.1:9")
    _refused(tmp_path, capsys, started, _patched(), "$MLFLOW_TRACKING_URI",
             "percent-encoded")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    _refused(tmp_path, capsys, started, _patched(), "$MLFLOW_TRACKING_URI",
             "no tracking server answers")


def test_a_server_that_answers_passes(tmp_path):
    """The probe opens a connection and nothing more: a listening socket passes, as do
    stores with no server (SQLite, a folder)."""
    import socket

    from harness.experiment.preflight import _tracking_store

    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        assert _tracking_store(f"http://127.0.0.1:{port}/prefix") is None
    assert _tracking_store(f"sqlite:///{tmp_path}/new/m.db") is None
    assert _tracking_store("sqlite:///:memory:") is None
    assert _tracking_store(str(tmp_path / "mlruns")) is None
    assert _tracking_store("databricks") is None


def test_uris_mlflow_opens_pass_the_form():
    from harness.experiment import uri_problem

    for uri in ("sqlite:///mlflow.db", "sqlite:////abs/m.db", "postgresql://u:p@h:5432/db",
                "postgresql+psycopg2://u:p%2Fq@h/db", "mysql://h/db", "mssql+pyodbc://h/db",
                "http://127.0.0.1:5000", "https://u:p%40q@h/prefix", "file:///tmp/mlruns",
                "mlruns", "/abs/mlruns", "databricks", "databricks://profile", "uc"):
        assert uri_problem(uri) is None, uri
    for uri in ("ftp://h/x", "s3://bucket/x", "http://h:port", "http://[::1"):
        assert uri_problem(uri), uri


def test_a_tracker_that_cannot_start_says_so_redacted():
    """Errors raised while MLflow opens its store reach the user as one redacted
    message, without MLflow's own (which prints the whole URI) as its cause."""
    from harness.tracking.tracker import Tracker, TrackingError

    with pytest.raises(TrackingError) as info:
        Tracker(f"ftp://kh:{SECRET}@127.0.0.1/x", "e")
    assert SECRET not in str(info.value) and "could not start" in str(info.value)
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_the_command_reports_an_unexpected_error_redacted(monkeypatch, capsys):
    """The console script: an error ``main`` did not expect still exits 1 with Python's
    traceback, its passwords masked."""
    import importlib

    cli_main = importlib.import_module("harness.cli.main")

    def fail() -> int:
        raise RuntimeError(f"cannot reach http://kh:ab/{SECRET}@127.0.0.1:9")

    codes: list[int] = []
    monkeypatch.setattr(cli_main, "main", fail)
    monkeypatch.setattr(cli_main.os, "_exit", codes.append)
    cli_main.entry()
    err = capsys.readouterr().err
    assert codes == [1] and "Traceback" in err and "RuntimeError" in err
    assert SECRET not in err and "kh:***@127.0.0.1:9" in err


@pytest.mark.parametrize("text", [
    f"http://kh:ab/{SECRET}@127.0.0.1:9", f"ftp://kh:{SECRET}@127.0.0.1/x",
    f"'https://kh:a@b?{SECRET}@h:1/x'", f'{{"uri": "postgresql://kh:{SECRET}#x@h/db"}}'])
def test_redaction_masks_a_password_holding_a_delimiter(text, monkeypatch):
    from harness.tracking.redact import redact

    _clean_env(monkeypatch)

    assert SECRET not in redact(text) and "kh:***@" in redact(text)


# -- a run that failed before its first trial does not block the next --------------------
def _studies(run_dir: Path, trials: int) -> None:
    import optuna

    run_dir.mkdir(parents=True)
    study = optuna.create_study(storage=f"sqlite:///{run_dir / 'optuna.db'}",
                                study_name="pre/one")
    for x in range(trials):
        study.add_trial(optuna.trial.create_trial(
            params={"x": x}, distributions={"x": optuna.distributions.IntDistribution(0, 9)},
            value=float(x)))
    (run_dir / "state.json").write_text('{"parent_run_id": "abc"}')


@pytest.mark.parametrize(("trials", "blocks"), [(0, False), (1, True)])
def test_only_a_run_that_measured_blocks_a_plain_rerun(tmp_path, monkeypatch, capsys, trials,
                                                       blocks):
    import harness.run.runner

    monkeypatch.chdir(tmp_path)
    _studies(tmp_path / "runs" / "pre", trials)
    ran: list[bool] = []

    class _Ran(Exception):
        pass

    def stand_in(*args: Any, resume: bool = False, **kwargs: Any) -> Any:
        ran.append(resume)
        raise _Ran

    monkeypatch.setattr(harness.run.runner, "run", stand_in)
    (tmp_path / "exp.yaml").write_text(_patched())
    try:
        rc = cli.main(["run", "exp.yaml"])
    except _Ran:
        rc = 0
    err = _flat(capsys.readouterr().err)
    assert (rc, ran) == ((cli.EXIT_BAD_INPUT, []) if blocks else (0, [False])), err
    assert ("--resume" in err) is blocks


def test_the_lock_leaves_no_folder_when_the_name_cannot_be_made(tmp_path, monkeypatch):
    """A name the file system refuses (longer than its 255 bytes) left an empty runs/."""
    monkeypatch.chdir(tmp_path)
    exp = experiment.Experiment.model_validate(GOOD)
    exp = exp.model_copy(update={"name": "x" * 300})
    with pytest.raises(experiment.ExperimentError, match="cannot lock"):
        experiment.lock_run_dir(tmp_path / "exp.yaml", exp)
    assert _listing(tmp_path) == []


def test_yaml_1_2_floats_are_floats(tmp_path):
    """``1e-3`` is a float as YAML 1.2 reads it (1.1 made it a string, which the strict
    float fields refuse)."""
    path = tmp_path / "exp.yaml"
    path.write_text(_patched() + textwrap.dedent("""
        timing: {rep_ms: 2e2, warmup_ms: 25}
    """))
    exp = experiment.load(path, ["search.max_abs_err=1e-3"], semantics=False)
    assert exp.timing.rep_ms == 200.0 and exp.search.max_abs_err == 1e-3
