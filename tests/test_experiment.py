"""Experiment YAML validation: every error names the file and the field, exits 2, and
writes nothing."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml

from harness import cli, experiment

GOOD = """
name: t
kernel: grouped_gemm
shapes:
  - {M: 320, N: 128, K: 128, E: 4}
dtypes: [fp16]
search: {trials: 3}
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "exp.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_good_file_loads_and_plans(tmp_path):
    exp = experiment.load(_write(tmp_path, GOOD))
    studies = experiment.plan(exp, ["H100", "H200"])
    assert [s.hardware for s in studies] == ["H100", "H200"]
    assert studies[0].name == "t/grouped_gemm/M=320,N=128,K=128,E=4/fp16/H100"


@pytest.mark.parametrize(
    ("patch", "field", "words"),
    [
        ({"kernel": "no_such_kernel"}, "kernel", "unknown kernel"),
        ({"kernel": "nowhere.mod:Thing"}, "kernel", "nowhere"),
        ({"shapes": [{"M": 1, "N": 2}]}, "shapes[0]", "missing"),
        ({"shapes": [{"M": 320, "N": 128, "K": 128, "E": 4, "Z": 1}]}, "shapes[0]", "unknown"),
        ({"shapes": [{"M": -5, "N": 128, "K": 128, "E": 4}]}, "shapes[0]", "positive"),
        ({"shapes": [{"M": "many", "N": 128, "K": 128, "E": 4}]}, "shapes[0].M", "integer"),
        ({"dtypes": ["fp8"]}, "dtypes[0]", "Input should be"),
        ({"search": {"trials": 0}}, "search.trials", "greater than"),
        ({"search": {"sampler": "annealing"}}, "search.sampler", "Input should be"),
        ({"search": {"trials": 3, "samplr": "tpe"}}, "search.samplr", "Extra inputs"),
        ({"hardware": ["auto", "H100"]}, "hardware", "auto"),
        ({"search_space": {"params": {"BLOCK_M": []}}}, "search_space", "BLOCK_M"),
        ({"search_space": {"knobs": {}}}, "search_space.knobs", "expected"),
        ({"name": "has space"}, "name", "letters"),
        ({"timing": {"rep_ms": -1}}, "timing.rep_ms", "greater than"),
    ],
)
def test_bad_field_is_named(tmp_path, patch, field, words):
    data = {**yaml.safe_load(GOOD), **patch}
    path = _write(tmp_path, yaml.safe_dump(data))
    with pytest.raises(experiment.ExperimentError) as info:
        experiment.load(path)
    msg = str(info.value)
    assert str(path) in msg
    assert info.value.field.startswith(field), msg
    assert words.lower() in msg.lower()


def test_not_yaml_and_missing_file(tmp_path):
    path = _write(tmp_path, "name: [unclosed\n")
    with pytest.raises(experiment.ExperimentError, match="not valid YAML"):
        experiment.load(path)
    with pytest.raises(experiment.ExperimentError, match="cannot read"):
        experiment.load(tmp_path / "nope.yaml")


def test_command_exits_2_through_its_fast_exit(tmp_path):
    """``python -m harness`` ends with os._exit (cli.entry): the exit code and the
    message still come out."""
    import subprocess
    import sys

    path = _write(tmp_path, GOOD.replace("trials: 3", "trials: -1"))
    proc = subprocess.run([sys.executable, "-m", "harness", "run", str(path)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == cli.EXIT_BAD_INPUT
    assert "search.trials" in proc.stderr and not (tmp_path / "runs").exists()


def test_cli_exit_code_2_and_nothing_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    path = _write(tmp_path, GOOD.replace("trials: 3", "trials: -1"))
    before = sorted(p.name for p in tmp_path.iterdir())
    assert cli.main(["run", str(path)]) == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert str(path) in err.replace("\n", "") and "search.trials" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no runs/, packs/, mlflow.db


def test_overrides_apply_over_the_file_before_validation(tmp_path) -> None:
    from harness.experiment import ExperimentError, load

    path = tmp_path / "exp.yaml"
    path.write_text("name: ov\nkernel: grouped_gemm\nshapes: [{M: 200, N: 64, K: 64, E: 3}]\n"
                    "dtypes: [fp16]\nsearch: {trials: 5}\n")
    exp = load(path, ["search.trials=9", "timing.rep_ms=12.5", "baselines.compile=false",
                      "hardware=[H100, H200]"])
    assert exp.search.trials == 9 and exp.timing.rep_ms == 12.5
    assert exp.baselines.compile is False and exp.hardware == ["H100", "H200"]
    for bad, field in (("search.trials=-1", "search.trials"), ("name.x=1", "name"),
                       ("nokey", "--set nokey"), ("search.sampler=annealing", "search.sampler")):
        with pytest.raises(ExperimentError) as err:
            load(path, [bad])
        assert str(path) in str(err.value) and field in str(err.value), (bad, err.value)
