"""The command line's output modes (--quiet, --json, the summary table) and secrets
never printed: the redaction of log records and of the tracking URI."""

from __future__ import annotations

import io
import json
import logging

import pytest
import yaml

from harness import cli
from harness.run import Summary
from harness.tracking import redact

ROW = {"hardware": "cpu", "kernel": "grouped_gemm", "shape": "M=200,N=64,K=64,E=3",
       "dtype": "fp16", "counts": {"measured": 4, "failed": 1, "pruned": 2},
       "params": {"BLOCK_M": 64, "GROUP_M": 4}, "config": {"BLOCK_M": 64, "GROUP_M": 4},
       "latency_ms": 1.2345, "speedup_vs_eager": 2.5, "speedup_vs_compile": 1.25,
       "speedup_vs_default": 1.1, "roofline": 0.42, "mlflow_run_id": "abc"}
URI = "postgresql://mlflow:hunter2-pw@db.internal:5432/mlflow"


@pytest.fixture
def fake_run(tmp_path, monkeypatch):
    exp = tmp_path / "exp.yaml"
    exp.write_text(yaml.safe_dump({"name": "cli", "kernel": "grouped_gemm",
                                   "shapes": [{"M": 200, "N": 64, "K": 64, "E": 3}],
                                   "dtypes": ["fp16"]}))
    secret = "AWSsecretVALUE1234567890"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    seen = {}

    def run(path, resume=False, console=None, progress=True, overrides=(), started_at=None,
            stop_own_ray=False):
        seen["progress"], seen["overrides"] = progress, list(overrides)
        seen["started_at"] = started_at
        logging.getLogger("harness.run").warning("connecting with key %s to %s", secret, URI)
        # A speedup with no baseline is NaN in the summary (the table prints "-").
        return Summary(rows=[dict(ROW), {**ROW, "speedup_vs_compile": float("nan"),
                                         "search_ms": float("inf")}],
                       packs=["packs/cpu/grouped_gemm.json"],
                       interpreted=True, parent_run_id="p123", tracking_uri=URI,
                       events=[f"worker said {secret}"], wall_s=1.0, held_s=1.0,
                       timing_s=0.5, timing_fraction=0.5,
                       overhead={"timing": 0.5, "first_call": 0.3, "idle": 0.2})

    monkeypatch.setattr("harness.run.run", run)
    return exp, secret, seen


def _main(capsys, *argv) -> tuple[int, str, str]:
    root = logging.getLogger()
    saved = root.handlers[:], root.filters[:], root.level
    stream = io.StringIO()
    root.handlers = [logging.StreamHandler(stream)]  # basicConfig is a no-op under pytest
    try:
        rc = cli.main(list(argv))
    finally:
        root.handlers, root.filters, _ = saved
        root.setLevel(saved[2])
    out, err = capsys.readouterr()
    return rc, out, err + stream.getvalue()


def test_default_output(fake_run, capsys):
    exp, secret, seen = fake_run
    rc, out, err = _main(capsys, "run", str(exp))
    assert rc == 0 and seen["progress"] is True
    import harness

    assert seen["started_at"] == harness.IMPORTED_AT  # the wall counts the imports too
    assert "Tuning summary" in out and "BLOCK_M=64 GROUP_M=4" in out and "1.234 ms" in out
    assert "2.50×" in out and "1.25×" in out and "42%" in out and "4/1/2" in out
    assert "pack: packs/cpu/grouped_gemm.json" in out
    assert "GPU-held time by phase: timing 0.5 s, first_call 0.3 s, idle 0.2 s" in out
    assert "postgresql://mlflow:***@db.internal:5432/mlflow" in out
    for text in (out, err):
        assert secret not in text and "hunter2-pw" not in text
    assert "connecting with key ***" in err  # the record is there, its secret is not


def test_quiet(fake_run, capsys):
    exp, secret, seen = fake_run
    rc, out, err = _main(capsys, "run", str(exp), "--quiet")
    assert rc == 0 and seen["progress"] is False
    assert out.strip().splitlines() == ["pack: packs/cpu/grouped_gemm.json"]
    assert secret not in err


def test_json(fake_run, capsys):
    exp, secret, seen = fake_run
    rc, out, err = _main(capsys, "run", str(exp), "--json")
    assert rc == 0 and seen["progress"] is False
    # stdout is strict JSON only: a value the run lacks is null, never NaN
    data = json.loads(out, parse_constant=lambda c: pytest.fail(f"{c} in --json output"))
    assert data["rows"][0]["speedup_vs_compile"] == 1.25
    assert data["rows"][1]["speedup_vs_compile"] is None and data["rows"][1]["search_ms"] is None
    assert data["tracking_uri"] == "postgresql://mlflow:***@db.internal:5432/mlflow"
    assert data["mlflow_parent_run_id"] == "p123" and data["interpreted"] is True
    assert secret not in out and "hunter2-pw" not in out
    assert data["events"] == ["worker said ***"]


def test_bad_file_exit_code(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nkernel: grouped_gemm\nshapes: []\n")
    rc, out, err = _main(capsys, "run", str(bad))
    assert rc == 2 and "shapes" in err


def test_redact_values(monkeypatch, tmp_path):
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "tok-abcdef123")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "sess+token/with==")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("rayTOKEN0123456789\n")
    text = ("t=tok-abcdef123 s=sess+token/with== ray=rayTOKEN0123456789 "
            "id=AKIAABCDEFGHIJKLMNOP uri=https://bob:pa%40ss@mlflow.example.com/x "
            "plain=http://127.0.0.1:5000 s3://bucket/key")
    clean = redact.redact(text)
    for s in ("tok-abcdef123", "sess+token/with==", "rayTOKEN0123456789",
              "AKIAABCDEFGHIJKLMNOP", "pa%40ss"):
        assert s not in clean
    assert "https://bob:***@mlflow.example.com/x" in clean
    assert "http://127.0.0.1:5000" in clean and "s3://bucket/key" in clean
    assert redact.redact("") == "" and redact.redact("nothing secret") == "nothing secret"


def test_log_filter_covers_args_and_tracebacks(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "tok-zyxwvu987")
    stream = io.StringIO()
    logger = logging.getLogger("test_cli_output.redact")
    logger.propagate = False
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    redact.install(logger)
    try:
        logger.warning("token %s, %d%%", "tok-zyxwvu987", 5)
        try:
            raise RuntimeError("bad token tok-zyxwvu987")
        except RuntimeError:
            logger.exception("failed at %s", "https://u:tok-zyxwvu987@h/")
    finally:
        logger.removeHandler(handler)
        logger.filters.clear()
    text = stream.getvalue()
    assert "tok-zyxwvu987" not in text
    assert "token ***, 5%" in text and "RuntimeError: bad token ***" in text


def test_compile_baseline_task_and_speedup(tmp_path):
    """The torch.compile baseline: queued after eager and default where wanted ('auto':
    on GPUs, not under the interpreter), and its speed-up in the study's outcome."""
    import dataclasses
    from types import SimpleNamespace

    from harness import experiment, run
    from harness.hardware import spec_for_key

    exp = experiment.Experiment(name="x", kernel="grouped_gemm",
                                shapes=[{"M": 200, "N": 64, "K": 64, "E": 3}])
    gpu = spec_for_key("H100")
    assert run._want_compile(exp, gpu) is True
    assert run._want_compile(exp, dataclasses.replace(gpu, interpreted=True)) is False
    off = exp.model_copy(update={"baselines": experiment.BaselineSettings(compile=False)})
    assert run._want_compile(off, gpu) is False
    spec = experiment.plan(exp, ["H100"])[0]
    search = SimpleNamespace(ask=lambda in_flight: None, best=lambda: (
        {"BLOCK_M": 64}, {"latency_ms": 1.0}))
    st = run.StudyState(spec, search, "r", gpu, {}, want_compile=True)
    tasks = [run._study_task(st, "H100") for _ in range(3)]
    assert [t.tag[0] for t in tasks] == ["eager", "default", "compile"]
    assert run._study_task(st, "H100") is None  # search exhausted, nothing queued twice
    assert tasks[2].method == "eager" and tasks[2].args[-1] is True  # compiled=True
    assert tasks[0].args[-1] is False
    st.eager, st.compiled, st.default = ({"latency_ms": 4.0}, {"latency_ms": 2.0},
                                         {"latency_ms": 1.5})
    _, metrics = run._outcome(st)
    assert metrics["speedup_vs_compile"] == 2.0 and metrics["compile_latency_ms"] == 2.0
    assert metrics["speedup_vs_eager"] == 4.0


def test_set_overrides_reach_the_run(fake_run, capsys):
    exp, _, seen = fake_run
    rc, _, _ = _main(capsys, "run", str(exp), "--quiet", "--set", "search.trials=7",
                     "--set", "timing.rep_ms=20")
    assert rc == 0 and seen["overrides"] == ["search.trials=7", "timing.rep_ms=20"]


def test_a_bad_override_names_the_field_and_exits_2(fake_run, capsys):
    exp, _, seen = fake_run
    rc, out, err = _main(capsys, "run", str(exp), "--set", "search.trials=many")
    assert rc == 2 and "search.trials" in err and "integer" in err and not seen
