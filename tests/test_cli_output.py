"""The command line's output modes (--quiet, --json, the summary table within 100
columns), a re-run that must say --resume or --fresh, help without markup, and secrets
never printed: the redaction of log records and of the tracking URI."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import pytest
import yaml

from harness import cli
from harness.run.runner import Summary
from harness.tracking import redact

ROW = {"hardware": "cpu", "kernel": "grouped_gemm", "shape": "M=200,N=64,K=64,E=3",
       "dtype": "fp16", "counts": {"measured": 4, "failed": 1, "pruned": 2},
       "params": {"BLOCK_M": 64, "GROUP_M": 4}, "config": {"BLOCK_M": 64, "GROUP_M": 4},
       "latency_ms": 1.2345, "speedup_vs_eager": 2.5, "speedup_vs_compile": 1.25,
       "speedup_vs_default": 1.1, "roofline": 0.42, "mlflow_run_id": "abc",
       "winner_found": {"trial": 37, "trials": 120, "budget": 120, "gpu_s": 31.0,
                        "search_gpu_s": 100.0, "fraction": 0.31}}
URI = "postgresql://mlflow:hunter2-pw@db.internal:5432/mlflow"


@pytest.fixture
def fake_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # runs/ and packs/ are relative to the working directory
    exp = tmp_path / "exp.yaml"
    exp.write_text(yaml.safe_dump({"name": "cli", "kernel": "grouped_gemm",
                                   "shapes": [{"M": 200, "N": 64, "K": 64, "E": 3}],
                                   "dtypes": ["fp16"]}))
    secret = "AWSsecretVALUE1234567890"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    seen = {}

    def run(path, resume=False, console=None, progress=True, overrides=(), started_at=None,
            stop_own_ray=False, summary=None):
        seen["progress"], seen["overrides"], seen["resume"] = progress, list(overrides), resume
        seen["started_at"] = started_at
        logging.getLogger("harness.run.runner").warning("connecting with key %s to %s", secret, URI)
        # A speedup with no baseline is NaN in the summary (the table prints "-").
        return Summary(rows=[dict(ROW), {**ROW, "speedup_vs_compile": float("nan"),
                                         "search_ms": float("inf")}],
                       packs=["packs/cpu/grouped_gemm.json"],
                       interpreted=True, parent_run_id="p123", tracking_uri=URI,
                       events=[f"worker said {secret}"], wall_s=1.0, held_s=1.0,
                       timing_s=0.5, timing_fraction=0.5,
                       overhead={"timing": 0.5, "first_call": 0.3, "idle": 0.2},
                       timeline={"ray_connected": 7.2, "workers_ready": 12.0,
                                 "first_trial": 13.0, "last_result": 40.5, "done": 41.7})

    monkeypatch.setattr("harness.run.runner.run", run)
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
    # The config as its change from grouped_gemm's default (BLOCK_M=64 is the default's).
    assert "Tuning summary" in out and " 1 GROUP_M=4\n" in out and "1.234 ms" in out
    assert "BLOCK_M=64" not in out
    assert "2.50×" in out and "1.25×" in out and "42%" in out and "4/1/2" in out
    assert "pack: packs/cpu/grouped_gemm.json" in out
    assert "GPU-held time by phase: timing 0.5 s, first_call 0.3 s, idle 0.2 s" in out
    # How far into its search each winner was found, in one line for the run.
    assert ("winners found at a median 31% of each search's device time (latest: trial 37 "
            "of 120, 31%)") in out
    # Where the wall went: a slow start shows at a glance.
    assert "time: start 13.0 s (ray 7.2 s, workers 12.0 s), search 27.5 s, end 1.2 s" in out
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
    assert data["rows"][0]["config"] == {"BLOCK_M": 64, "GROUP_M": 4}  # whole, not a diff
    assert data["rows"][1]["speedup_vs_compile"] is None and data["rows"][1]["search_ms"] is None
    assert data["tracking_uri"] == "postgresql://mlflow:***@db.internal:5432/mlflow"
    assert data["mlflow_parent_run_id"] == "p123" and data["interpreted"] is True
    assert secret not in out and "hunter2-pw" not in out
    assert data["events"] == ["worker said ***"]
    assert data["rows"][0]["winner_found"] == ROW["winner_found"]


NOISY_RUN = """
import os, sys
import harness.run.runner as runner
from harness.run.results import Summary

def run(path, summary=None, **kwargs):
    # What Ray relays to the driver's stdout (its workers' prints, its daemons' errors),
    # through Python and straight to the descriptor.
    print("(raylet) NOISE through print")
    sys.stdout.flush()
    os.write(1, b"NOISE on fd 1\\n")
    return Summary(rows=[], packs=[], wall_s=1.0)

runner.run = run
from harness.cli.main import main
sys.exit(main(["run", sys.argv[1], "--json"]))
"""


def test_json_is_alone_on_stdout_whatever_else_the_run_prints(tmp_path):
    """A run's own stdout (Ray's relayed messages among them) goes to stderr under
    --json: stdout parses as the object, in a real process with real descriptors."""
    import subprocess
    import sys

    exp = tmp_path / "exp.yaml"
    exp.write_text(yaml.safe_dump({"name": "cli", "kernel": "grouped_gemm",
                                   "shapes": [{"M": 200, "N": 64, "K": 64, "E": 3}],
                                   "dtypes": ["fp16"]}))
    proc = subprocess.run([sys.executable, "-c", NOISY_RUN, str(exp)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert "NOISE" not in proc.stdout, proc.stdout
    assert json.loads(proc.stdout)["rows"] == []
    assert "NOISE through print" in proc.stderr and "NOISE on fd 1" in proc.stderr


def test_the_winner_line_says_how_far_into_the_search_it_was_found():
    from harness.cli.summary import winner_line

    found = {"trial": 37, "trials": 120, "fraction": 0.31}
    assert winner_line([{"winner_found": found}]) == (
        "winner found at trial 37 of 120 (31% of the search's GPU time)")
    rows = [{"winner_found": {**found, "fraction": f, "trial": t}}
            for f, t in ((0.1, 3), (0.5, 40), (0.2, 9))] + [{"winner_found": None}, {}]
    assert winner_line(rows, interpreted=True) == (
        "winners found at a median 20% of each search's device time (latest: trial 40 of "
        "120, 50%)")
    assert winner_line([{"winner_found": None}]) == ""


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


def test_baselines_come_after_the_search_in_its_final_rounds(tmp_path):
    """The baselines (PyTorch eager, torch.compile where wanted: 'auto' is on GPUs, not
    under the interpreter, and the default config where the search did not measure it)
    are never handed out by the search: they are timed in the study's final phase, in
    the same interleaved rounds as its finalists, and their median rounds give the
    speed-ups."""
    import dataclasses
    from types import SimpleNamespace

    from harness import experiment
    from harness.measure.hardware import spec_for_key
    from harness.measure.timing import TrialResult
    from harness.run import freeze, schedule
    from harness.run import members as run

    exp = experiment.Experiment(name="x", kernel="matmul",
                                shapes=[{"M": 256, "N": 256, "K": 256}],
                                search={"remeasure_rounds": 2})
    gpu = spec_for_key("H100")
    from harness.kernel.registry import get as get_kernel

    mm, scan = get_kernel("matmul"), get_kernel("selective_scan")
    assert run.want_compile(exp, gpu, mm) is True
    assert run.want_compile(exp, dataclasses.replace(gpu, interpreted=True), mm) is False
    off = exp.model_copy(update={"baselines": experiment.BaselineSettings(compile=False)})
    assert run.want_compile(off, gpu, mm) is False
    # A family whose eager code torch.compile cannot build in minutes: left out unless
    # the experiment asks for it.
    assert scan.no_compile_baseline
    assert run.want_compile(exp, gpu, scan) is False
    on = exp.model_copy(update={"baselines": experiment.BaselineSettings(compile=True)})
    assert run.want_compile(on, gpu, scan) is True
    (study,) = experiment.ExperimentPlan.checked("x.yaml", exp).for_hardware(["H100"]).studies
    assert study.device == gpu
    attrs: dict = {}
    top = [({"BLOCK_M": 64}, {"latency_ms": 1.0}),
           ({"BLOCK_M": 128, "BLOCK_N": 64}, {"latency_ms": 1.1})]
    search = SimpleNamespace(ask=lambda: None, best=lambda: top[0], space={"BLOCK_M": [64, 128]},
                             top=lambda k: top[:k], set_attr=attrs.__setitem__)
    st = schedule.StudyState(study, search, "r", {}, want_compile=True)
    assert schedule.study_task(st, "H100") is None  # the search hands out trials only
    schedule.start_remeasure(exp, st)
    assert st.phase == "remeasure" and set(st.baselines) == {"eager", "compile"}
    tags = [(t.tag[0], t.tag[2], t.tag[3]) for t in st.remeasure_todo]
    n = len(st.candidates)  # the top two and the default config (not measured by the search)
    assert n == 3 and len(tags) == 2 * (n + 2)
    assert tags[n:n + 2] == [("baseline", "eager", 0), ("baseline", "compile", 0)]
    eager, compiled = st.remeasure_todo[n], st.remeasure_todo[n + 1]
    assert eager.method == compiled.method == "eager"
    assert eager.args[4] is False and compiled.args[4] is True
    assert len({t.group for t in st.remeasure_todo}) == 1  # one GPU times them all
    for t in st.remeasure_todo:
        kind, _, i, round_ = t.tag
        ms = {"eager": 4.0, "compile": 2.0}.get(i, 1.5 if kind == "remeasure" and i == 2 else 1.0)
        cand = st.candidates[i] if kind == "remeasure" else st.baselines[i]
        cand.add(ms, round_, TrialResult(ok=True, latency_ms=ms).to_dict())
    st.final = (st.candidates[0].config, "fastest")
    schedule.finish_baselines(st)
    assert st.eager["latency_ms"] == 4.0 and st.compiled["latency_ms"] == 2.0
    assert st.default["latency_ms"] == 1.5  # the default's re-measured median
    assert attrs["eager"]["latency_ms"] == 4.0  # in the Optuna study: what --resume reads
    _, metrics = freeze.outcome(st)
    assert metrics["speedup_vs_compile"] == 2.0 and metrics["compile_latency_ms"] == 2.0
    assert metrics["speedup_vs_eager"] == 4.0 and metrics["speedup_vs_default"] == 1.5


def _final_phase(rounds: int, top: list) -> tuple:
    """An experiment of ``rounds`` final rounds and a study of it on an H100 whose search
    found ``top`` (config, result), in its final phase with the torch.compile baseline."""
    from types import SimpleNamespace

    from harness import experiment
    from harness.run import schedule

    exp = experiment.Experiment(name="x", kernel="matmul",
                                shapes=[{"M": 256, "N": 256, "K": 256}],
                                search={"remeasure_rounds": rounds})
    (study,) = experiment.ExperimentPlan.checked("x.yaml", exp).for_hardware(["H100"]).studies
    search = SimpleNamespace(best=lambda: top[0], space={"BLOCK_M": [64, 128]},
                             top=lambda k: top[:k], set_attr=lambda *a: None,
                             require_accuracy=lambda r: r)
    st = schedule.StudyState(study, search, "r", {}, want_compile=True)
    schedule.start_remeasure(exp, st)
    return exp, st


def test_a_baseline_that_fails_a_round_is_not_timed_again():
    """A torch.compile that hangs costs a worker and a trial time-out: its later rounds
    are not sent, and the study's final phase still ends, the baseline a failure."""
    from harness.measure.timing import TrialResult
    from harness.run import schedule

    exp, st = _final_phase(3, [({"BLOCK_M": 64}, {"latency_ms": 1.0}),
                               ({"BLOCK_M": 128, "BLOCK_N": 64}, {"latency_ms": 1.1})])
    done: list = []
    sched = schedule.Scheduler([exp], None, [st], on_result=lambda t, r: None,
                               on_done=done.append)
    sent = 0
    while st.remeasure_todo:
        task = st.remeasure_todo.pop(0)
        sent += 1
        hang = task.tag[0] == "baseline" and task.tag[2] == "compile"
        sched._result(task, TrialResult(ok=False, reason="timeout: no result after 120 s")
                      if hang else TrialResult(ok=True, latency_ms=1.0))
    n = len(st.candidates)
    assert sent == 3 * (n + 2) - 2  # the compile baseline's rounds 1 and 2 never went
    assert done == [st] and st.phase == "done" and st.remeasure_left == 0
    assert st.compiled["ok"] is False and "timeout" in st.compiled["reason"]
    assert st.eager["rounds"] == 3


def test_set_overrides_reach_the_run(fake_run, capsys):
    exp, _, seen = fake_run
    rc, _, _ = _main(capsys, "run", str(exp), "--quiet", "--set", "search.trials=7",
                     "--set", "timing.rep_ms=20")
    assert rc == 0 and seen["overrides"] == ["search.trials=7", "timing.rep_ms=20"]


def test_a_bad_override_names_the_field_and_exits_2(fake_run, capsys):
    exp, _, seen = fake_run
    rc, out, err = _main(capsys, "run", str(exp), "--set", "search.trials=many")
    assert rc == 2 and "search.trials" in err and "integer" in err and not seen


def _grouped_gemm_row(shape: str, **config) -> dict:
    from harness.kernel import api as kernel_api

    full = {**kernel_api.get("grouped_gemm").default_config, **config}
    return {**ROW, "hardware": "H200", "shape": shape, "dtype": "bf16", "config": full,
            "params": config, "counts": {"measured": 180, "failed": 12, "pruned": 40}}


def test_the_summary_fits_100_columns():
    """Long shapes, a winner far from the default and every figure: each study takes two
    lines of the table, no line is wider than 100 columns, and a config shows as its
    change from the kernel's default (the default's own values are not repeated)."""
    from rich.console import Console

    from harness.cli.summary import WIDTH, print_summary
    from harness.kernel import api as kernel_api

    default = kernel_api.get("grouped_gemm").default_config
    # A winner that differs from the default in every tunable but BLOCK_K and GROUP_M.
    far = {k: (v * 2 if k.isupper() and v else v + 1) for k, v in default.items()
           if k not in ("BLOCK_K", "GROUP_M")}
    rows = [_grouped_gemm_row("M=49152,N=1408,K=2048,E=64", **far),
            _grouped_gemm_row("M=12288,N=4096,K=4096,E=8"),
            {**ROW, "hardware": "H200", "kernel": "fused_elementwise", "shape": "N=16777216",
             "config": None, "params": None, "latency_ms": 12345.678}]
    summary = Summary(rows=rows, packs=["packs/H200/grouped_gemm.json"], interpreted=True,
                      parent_run_id="0" * 32, tracking_uri="sqlite:///mlflow.db",
                      events=["worker 3 on node 10.0.0.7 replaced after a CUDA error"],
                      wall_s=1234.5, held_s=4321.0, timing_s=2000.0, timing_fraction=0.46,
                      overhead={"timing": 2000.0, "first_call": 300.0, "idle": 20.0},
                      first_calls={"watched": 8, "compiled_in_worker": 1, "ahead_missed": 0,
                                   "compiled_here": 2, "in_worker_why": {
                                       "the compile service on node n did not answer for "
                                       "this config within N s": 1}},
                      replaced=1, retried=2, reused=1, mlflow_logger={"spare": 1},
                      fleet={"compile_services": {"f" * 56: {
                          "processes": 14, "first_ready_s": 2.5, "all_ready_s": 9.25,
                          "ready": 14, "first_compile_done_s": 4.0}}},
                      head_start={"hardware": "H200", "submitted": 11, "compiled": 10,
                                  "first_ready_s": 3.0, "all_ready_s": 3.5, "ready": 2,
                                  "first_compile_done_s": 5.0})
    buf = io.StringIO()
    print_summary(Console(file=buf, width=WIDTH, force_terminal=False), summary, quiet=False)
    lines = buf.getvalue().splitlines()
    assert max(map(len, lines)) <= WIDTH, "\n".join(lines)
    table = lines[lines.index(next(x for x in lines if x.lstrip().startswith("─"))) + 1:
                  lines.index(next(x for x in lines if x.startswith("wall ")))]
    first = [x for x in table if x.lstrip().startswith(("1 ", "2 ", "3 "))]
    assert len(first) == 6  # the three rows of the table, then their three configs
    # Two lines per study: kernel and dtype, then the shape, folded nowhere.
    assert "grouped_gemm bf16" in table[0] and "M=49152,N=1408,K=2048,E=64" in table[1]
    assert "1.234 ms" in table[0] and "180/12/40" in table[0] and "42%" in table[0]
    text = " ".join(" ".join(lines).split())
    assert len(far) > 8 and " ".join(f"{k}={v}" for k, v in far.items()) in text
    assert "BLOCK_K=" not in text and "GROUP_M=" not in text  # the default's values
    assert "2 the default config" in text and "3 none" in text
    assert f"MLflow: sqlite:///mlflow.db (parent run {'0' * 32})" in text
    assert ("2 trials retried, 1 kept workers reused, a spare MLflow logger taken"
            in text)  # a warm fleet shows what it reused
    assert ("first launches: 5 of 8 loaded a compiled binary, 1 compiled in the worker "
            "(0 despite compile-ahead), 2 compiled there while the compile service "
            "started") in text
    assert ("most often because: the compile service on node n did not answer for this "
            "config within N s (1)") in text
    assert ("compile service ffffffff: 14 processes, first ready 2.5 s, all 9.2 s, first "
            "compile done 4.0 s after it started") in text
    assert ("head start: 10 of 11 builds done; 2 processes, first ready 3.0 s, all 3.5 s, "
            "first compile done 5.0 s after it started") in text
    config = next(i for i, x in enumerate(lines) if x.startswith(" 1 BLOCK_M="))
    assert lines[config + 1].startswith("   ") and "=" in lines[config + 1]  # wrapped
    # The table's own width, unfolded, is within the 100 columns.
    from harness.cli.summary import summary_table

    assert Console(width=300).measure(summary_table(rows, True)).maximum <= WIDTH


def _earlier_run(tmp_path, trials: int) -> None:
    import optuna

    run_dir = tmp_path / "runs" / "cli"
    run_dir.mkdir(parents=True)
    study = optuna.create_study(storage=f"sqlite:///{run_dir / 'optuna.db'}")
    for x in range(trials):
        study.add_trial(optuna.trial.create_trial(
            params={"x": x}, distributions={"x": optuna.distributions.IntDistribution(0, 9)},
            value=float(x)))
    (run_dir / "state.json").write_text("{}")


def test_a_rerun_must_say_resume_or_fresh(fake_run, tmp_path, capsys):
    """An experiment whose runs directory holds an earlier run: a plain re-run refuses
    (exit 2, nothing run) naming --resume and --fresh; --fresh says what it replaces;
    --resume continues; both at once is an argument error."""
    exp, _, seen = fake_run
    _earlier_run(tmp_path, trials=3)
    rc, out, err = _main(capsys, "run", str(exp))
    assert rc == 2 and not seen and not out
    assert "--resume" in err and "--fresh" in err and str(Path("runs") / "cli") in err
    rc, out, err = _main(capsys, "run", str(exp), "--quiet", "--fresh")
    assert rc == 0 and seen["resume"] is False
    assert "--fresh: starting over" in err and "(3 trials)" in err and "previous_packs" in err
    seen.clear()
    rc, out, err = _main(capsys, "run", str(exp), "--quiet", "--resume")
    assert rc == 0 and seen["resume"] is True and "--fresh" not in err
    seen.clear()
    rc, out, err = _main(capsys, "run", str(exp), "--resume", "--fresh")
    assert rc == 2 and not seen and "not allowed with" in err


def test_a_first_run_needs_neither_flag(fake_run, tmp_path, capsys):
    exp, _, seen = fake_run
    (tmp_path / "runs" / "cli").mkdir(parents=True)  # a directory without a run's state
    rc, out, err = _main(capsys, "run", str(exp), "--quiet")
    assert rc == 0 and seen["resume"] is False and "--fresh" not in err


def test_help_is_plain_text():
    """Every command's --help, subcommands included: no reStructuredText markup."""
    import argparse

    parsers = [cli.build_parser()]
    for p in parsers:  # grows as subcommands are found
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers.extend(action.choices.values())
    assert len(parsers) > 8  # run, bench, report, packs and its subcommands
    for p in parsers:
        text = p.format_help() + p.format_usage()
        assert "``" not in text and ":func:" not in text, p.prog
    assert "The kharness command" not in parsers[0].format_help()


def test_final_rounds_stop_timing_a_finalist_far_behind_and_baselines_after_three():
    """Five rounds: a finalist 10 % behind the best in each of its first two is not sent
    again (its two samples stay, and it is no tie); one 1 % behind is timed in all five;
    the baselines in the first three; the phase ends with every sent task counted."""
    from harness.measure.timing import TrialResult
    from harness.run import remeasure, schedule

    exp, st = _final_phase(5, [({"BLOCK_M": 64}, {"latency_ms": 1.0}),
                               ({"BLOCK_M": 128, "BLOCK_N": 64}, {"latency_ms": 1.01}),
                               ({"BLOCK_M": 128, "BLOCK_N": 128}, {"latency_ms": 1.1})])
    keys = [c.config for c in st.candidates]
    far = keys.index({"BLOCK_M": 128, "BLOCK_N": 128})
    near = keys.index({"BLOCK_M": 128, "BLOCK_N": 64})
    done: list = []
    sched = schedule.Scheduler([exp], None, [st], on_result=lambda t, r: None,
                               on_done=done.append)
    sent: dict = {}
    while st.remeasure_todo:
        task = st.remeasure_todo.pop(0)
        kind, _, i, _round = task.tag
        sent[(kind, i)] = sent.get((kind, i), 0) + 1
        ms = {far: 1.1, near: 1.01}.get(i, 1.0) if kind == "remeasure" else 3.0
        sched._result(task, TrialResult(ok=True, latency_ms=ms))
    assert sent[("remeasure", far)] == remeasure.PRUNE_ROUNDS
    assert sent[("remeasure", near)] == 5 and sent[("remeasure", 0)] == 5
    assert sent[("baseline", "eager")] == sent[("baseline", "compile")] == 3
    assert done == [st] and st.phase == "done" and st.remeasure_left == 0
    assert st.eager["rounds"] == 3
    win, _ = remeasure.pick(st.candidates)
    assert win.config == {"BLOCK_M": 64} or win.config == keys[near]
    assert remeasure.outclassed(st.candidates) == [far]
