"""Experiment YAML validation: every error names the file and the field, exits 2, and
writes nothing."""

from __future__ import annotations

import os
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


# -- up-front checks: each bad file exits 2 naming the field, before anything is written --
BAD_FILES = [
    # search-space values against the kernel's declared tunables
    ({"search_space": {"params": {"BLOCK_M": ["abc"]}}}, "search_space.params.BLOCK_M[0]",
     "not of type int"),
    ({"search_space": {"params": {"BLOCK_M": [64, "128"]}}}, "search_space.params.BLOCK_M[1]",
     "not of type int"),
    ({"search_space": {"params": {"BLOCK_M": [True]}}}, "search_space.params.BLOCK_M[0]",
     "not of type int"),
    ({"search_space": {"params": {"BLOCK_M": [-64]}}}, "search_space.params.BLOCK_M[0]",
     "minimum"),
    ({"search_space": {"params": {"BLOCK_M": [[64]]}}}, "search_space.params.BLOCK_M[0]",
     "valid"),
    ({"search_space": {"params": "x"}}, "search_space.params", "dictionary"),
    ({"search_space": {"hardware": {"cpu": "x"}}}, "search_space.hardware.cpu", "SpaceSection"),
    ({"search_space": {"hardware": {"cpu": {"params": {"BLOCK_M": []}}}}},
     "search_space.hardware.cpu.params.BLOCK_M", "at least 1"),
    ({"search_space": {"hardware": {"H900": {"params": {"BLOCK_M": [64]}}}}},
     "search_space.hardware", "H900"),
    ({"search_space": {"vendors": {"intel": {}}}}, "search_space.vendors", "nvidia"),
    ({"search_space": {"params": {"BLOCK_Q": [1]}}}, "search_space.params.BLOCK_Q",
     "unknown tunable"),
    ({"search_space": {"params": {"BLOCK_Q": None}}}, "search_space.params.BLOCK_Q",
     "unknown tunable"),
    # every tunable removed: nothing to tune
    ({"hardware": ["cpu"], "search_space": {"params": dict.fromkeys(
        ["BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages", "PERSISTENT",
         "USE_TMA", "FLATTEN", "TMA_STORE", "BLOCK_TABLE", "TAIL_SPLIT", "TAIL_WINDOW", "GLUON",
         "SWAP_AB", "TAIL_FINE", "DIRECT_STORE", "TALL_TILE", "TAIL_DEAL", "waves_per_eu",
         "matrix_instr_nonkdim", "kpack"])}}, "search_space", "nothing to tune"),
    # kernel paths
    ({"kernel": ":Foo"}, "kernel", "unknown kernel"),
    ({"kernel": "os:"}, "kernel", "unknown kernel"),
    ({"kernel": "json:JSONDecoder"}, "kernel", "not a harness.kernel.api.Kernel"),
    # hardware names
    ({"hardware": ["H900"]}, "hardware", "known keys are"),
    ({"hardware": ["H100", "H900"]}, "hardware", "H900"),
    # user output never lands in the shipped packs
    ({"output": {"packs_dir": str(Path(experiment.__file__).parents[1] / "packs" / "shipped")}},
     "output.packs_dir", "inside the installed harness package"),
    # a shape whose inputs cannot fit the devices
    ({"shapes": [{"M": 100000000000000, "N": 128, "K": 128, "E": 4}]}, "shapes[0]",
     "shapes[0]"),  # the estimate, or the byte model failing at that size
    ({"kernel": "matmul", "shapes": [{"M": 10000000, "N": 10000000, "K": 128}]}, "shapes[0]",
     "GB of memory of"),
    ({"hardware": ["L4"], "shapes": [{"M": 400000000, "N": 4096, "K": 4096, "E": 8}]},
     "shapes[0]", "memory of L4"),
]


@pytest.mark.parametrize(
    ("patch", "field", "words"),
    BAD_FILES + [
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
        ({"search_space": {"knobs": {}}}, "search_space.knobs", "Extra inputs"),
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


def test_the_declared_tunables_are_typed():
    from harness.kernel import api as kernel_api

    gg = kernel_api.get("grouped_gemm").declared_tunables()
    assert gg["BLOCK_M"].type == "int" and gg["BLOCK_M"].why_not(16) is None
    assert gg["waves_per_eu"].type == "int"  # from the AMD section of the space
    ssd = kernel_api.get("mamba2_ssd").declared_tunables()
    assert ssd["IMPL"].type == "str" and ssd["IMPL"].why_not("four") is not None
    assert kernel_api.get("matmul").check_tunables({"BLOCK_M": "128"}) == \
        "BLOCK_M: '128' is not of type int"


def test_a_duplicate_key_is_refused(tmp_path):
    path = _write(tmp_path, GOOD + "search: {trials: 5}\n")
    with pytest.raises(experiment.ExperimentError, match="'search' is given twice"):
        experiment.load(path)
    path = _write(tmp_path, GOOD.replace("{trials: 3}", "{trials: 3, trials: 4}"))
    with pytest.raises(experiment.ExperimentError, match="'trials' is given twice"):
        experiment.load(path)
    # A YAML merge key may still be overridden by the mapping's own keys.
    path = _write(tmp_path, "base: &b {trials: 3}\n" + GOOD.replace(
        "search: {trials: 3}", "search: {<<: *b, trials: 4}"))
    with pytest.raises(experiment.ExperimentError, match="base"):  # only 'base' is wrong
        experiment.load(path)


def test_a_large_file_is_refused_before_it_is_parsed(tmp_path):
    import time

    path = tmp_path / "big.yaml"
    path.write_text(GOOD + "#" + "x" * (50 << 20) + "\n")
    t0 = time.monotonic()
    with pytest.raises(experiment.ExperimentError, match="larger than 256 KB"):
        experiment.load(path)
    assert time.monotonic() - t0 < 1.0
    (tmp_path / "bin.yaml").write_bytes(b"name: \xff\xfe\n")
    with pytest.raises(experiment.ExperimentError, match="not UTF-8"):
        experiment.load(tmp_path / "bin.yaml")


def test_every_shipped_experiment_passes(tmp_path):
    """The checks refuse bad files, not the repository's own."""
    root = Path(__file__).resolve().parents[1] / "configs"
    for path in sorted(root.rglob("*.yaml")):
        experiment.load(path)


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize(("patch", "field", "words"), [
    next(case for case in BAD_FILES if case[2] == words)
    for words in ("not of type int", "known keys are", "memory of L4")])
def test_command_refuses_and_stops_the_ray_it_started(tmp_path, monkeypatch, capsys, patch,
                                                     field, words):
    """Semantic errors (tunables, hardware, memory) exit 2 with nothing written. They
    are checked while Ray starts (the kernel family's import takes seconds that a good
    file should not wait for): a Ray the run started for a bad file is stopped, and no
    MLflow store or Optuna storage is created."""
    import ray

    from harness.fleet import Fleet

    started, stopped = [], []
    monkeypatch.setattr(Fleet, "connect", staticmethod(lambda: started.append(1) or "local"))
    monkeypatch.setattr(ray, "shutdown", lambda: stopped.append(1))
    monkeypatch.chdir(tmp_path)
    data = {**yaml.safe_load(GOOD), **patch}
    path = _write(tmp_path, yaml.safe_dump(data))
    before = _listing(tmp_path)
    assert cli.main(["run", str(path)]) == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err.replace("\n", "")
    assert str(path) in err and field in err and words in err
    assert len(started) == len(stopped) <= 1, "a Ray the run started must be stopped"
    assert _listing(tmp_path) == before  # no runs/, packs/, mlflow.db, optuna.db


@pytest.mark.parametrize(("hardware", "accepted"), [(["auto"], True), (["H100"], False)])
def test_a_shape_costs_the_same_to_check_at_any_size(tmp_path, hardware, accepted):
    """The grouped GEMM's byte model drew the routing of every expert: 3e8 experts took
    26 s and 2.95 GB to check. Its memory need is a closed form now, which counts the
    weights of every expert (155 GB here: more than an H100 has, less than an MI325X)."""
    import resource
    import time

    from harness.kernel import api as kernel_api

    kernel_api.get("grouped_gemm")  # its import (torch) is not the check
    path = _write(tmp_path, yaml.safe_dump({
        **yaml.safe_load(GOOD), "hardware": hardware,
        "shapes": [{"M": 1048577, "N": 16, "K": 16, "E": 300000000}]}))
    exp = experiment.load(path, semantics=False)
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.monotonic()
    if accepted:
        experiment.check_semantics(path, exp)
    else:
        with pytest.raises(experiment.ExperimentError, match="155 GB .* memory of H100"):
            experiment.check_semantics(path, exp)
    assert time.monotonic() - t0 < 1.0
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_kb < 100_000


def test_the_byte_model_is_exact_where_the_benchmark_measures():
    """Past EXACT_EXPERTS the routing is not drawn; below it, the count is seed 0's."""
    from kernels.grouped_gemm import EXACT_EXPERTS, GroupedGemm

    k = GroupedGemm()
    for shape in ({"M": 49152, "N": 1408, "K": 2048, "E": 64},
                  {"M": 1000, "N": 16, "K": 16, "E": EXACT_EXPERTS}):
        used = sum(1 for c in k.routing_counts(shape, 0) if c)
        assert k._experts_used(shape) == used
    big = {"M": 1000, "N": 16, "K": 16, "E": EXACT_EXPERTS + 1}
    assert 950 <= k._experts_used(big) <= 1000  # nearly every row its own expert
    assert k.footprint_bytes(big, "fp16") > k.bytes_moved(big, "fp16")


def test_the_console_script_imports_a_kernel_from_the_working_directory(tmp_path,
                                                                        monkeypatch):
    """``kernel: mymod:Cls`` with mymod.py where the command runs: ``python -m harness``
    has the working directory on sys.path, the console script (whose sys.path[0] is the
    venv's bin/) puts it there too."""
    import importlib
    import sys

    from harness.kernel import api as kernel_api

    cli_main = importlib.import_module("harness.cli.main")
    (tmp_path / "kh_cwd_kernel.py").write_text(
        "from kernels.matmul import Matmul\n\nclass Mine(Matmul):\n    name = 'mine'\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path
                                      if p not in ("", str(tmp_path), os.getcwd())])
    monkeypatch.delitem(sys.modules, "kh_cwd_kernel", raising=False)
    resolved: list[str] = []

    def main() -> int:
        resolved.append(kernel_api.resolve("kh_cwd_kernel:Mine").name)
        return 0

    monkeypatch.setattr(cli_main, "main", main)
    monkeypatch.setattr(cli_main.os, "_exit", lambda rc: resolved.append(rc))
    cli_main.entry()
    assert resolved == ["mine", 0]
    assert sys.path[0] == str(tmp_path)
