"""Experiment files mutated at random (types, keys, values, nesting, sizes, repeats, tags,
raw text): ``kharness run`` exits 0, 2 or 3, never with a traceback or a password, and a
file it refuses (2) leaves nothing behind. The command runs in-process up to the run
itself, which is replaced by a stand-in doing what a run does before Ray starts (the
form, the surroundings, the kernel family's checks): nothing slower is needed."""

from __future__ import annotations

import copy
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.configuration import set_hypothesis_home_dir  # noqa: E402

# Hypothesis keeps caches in ./.hypothesis by default: tests write to temporary
# directories only.
set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "kernel-harness-hypothesis")

from harness import cli  # noqa: E402
from tests.fuzz_edits import edit, paths  # noqa: E402

#: A password in the URIs drawn: never in the command's output.
SECRET = "Sup3rSecret"

BASES = [
    {"name": "fuzz", "kernel": "grouped_gemm", "shapes": [{"M": 320, "N": 128, "K": 128, "E": 4}],
     "dtypes": ["fp16"], "hardware": ["auto"],
     "search": {"sampler": "tpe", "trials": 10, "remeasure_top_k": "auto"},
     "search_space": {"params": {"BLOCK_M": [64, 128]},
                      "vendors": {"amd": {"params": {"kpack": [1, 2]}}},
                      "hardware": {"cpu": {"params": {"BLOCK_N": [64], "USE_TMA": None}}}},
     "timing": {"trial_timeout_s": 300}, "tracking": {"uri": "sqlite:///mlflow.db"},
     "output": {"packs_dir": "packs", "runs_dir": "runs"},
     "fleet": {"queue_depth": "auto", "compile_workers": 2}, "baselines": {"compile": False},
     "seed": 0},
    {"name": "mm", "kernel": "matmul", "shapes": [{"M": 256, "N": 256, "K": 256}],
     "dtypes": ["fp32", "bf16"], "hardware": ["H100", "H200"], "search": {"trials": 5}},
    {"name": "ssd", "kernel": "mamba2_ssd", "dtypes": ["fp32"],
     "shapes": [{"b": 1, "L": 160, "h": 4, "p": 32, "g": 2, "n": 32}],
     "search_space": {"params": {"IMPL": ["fused"], "STATE_DTYPE": ["fp32"]}}},
]

SCALARS = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(2 ** 70), max_value=2 ** 70),
    st.sampled_from([0, 1, -1, 2 ** 31, 2 ** 32, 2 ** 64, 10 ** 14, 10 ** 30, 1e30,
                     float("inf"), float("nan"), True]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(["auto", "H900", "H100", "cpu", "fp8", ":Foo", "os:path", "matmul",
                     "BLOCK_M", "../../etc", "x" * 5000, "tpe", "none", "128", "é\x00",
                     "[/]", "[bold]x", "http://u:p@h:1", "NVIDIA-RTX", "x" * 300,
                     # tracking URIs: each holds the password, which is never printed
                     f"http://kh:ab/{SECRET}@127.0.0.1:9", f"ftp://kh:{SECRET}@127.0.0.1/x",
                     f"postgresql://kh:{SECRET}@127.0.0.1:9/db", "http://127.0.0.1:9",
                     f"https://kh:{SECRET}@127.0.0.1:9", "sqlite:///sub/m.db"]),
)
NAMES = st.one_of(st.sampled_from(["name", "kernel", "shapes", "dtypes", "hardware",
                                   "search_space", "search", "timing", "tracking", "output",
                                   "fleet", "baselines", "seed", "params", "vendors", "M",
                                   "BLOCK_M", "BLOCK_Q", "trials", "uri", "packs_dir",
                                   "runs_dir", "amd", "cpu", "H900", "<<"]),
                  st.text(max_size=12), st.integers(-3, 3))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(NAMES, inner, max_size=4)), max_leaves=12)


#: Fields whose checks need the kernel family: drawn more often, since a broken name or
#: shape (checked first) would hide what is wrong in them.
_DEEP = ("search_space", "kernel", "hardware", "tracking", "output")


def _mutate(data: st.DataObject, doc: dict) -> dict:
    doc = copy.deepcopy(doc)
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        where = paths(doc, limit=10**9)
        where += [p for p in where if p and p[0] in _DEEP] * 3
        path = data.draw(st.sampled_from(where), label="where")
        how = data.draw(st.sampled_from(["replace", "delete", "add", "nest", "grow",
                                         "repeat"]), label="how")
        edit(data, doc, path, how, NAMES, VALUES)
    return doc


def _text(data: st.DataObject, doc: dict) -> str:
    text = yaml.safe_dump(doc, sort_keys=False, allow_unicode=True)
    edit = data.draw(st.sampled_from(["none", "none", "truncate", "duplicate", "insert"]),
                     label="text")
    if edit == "truncate":
        text = text[: data.draw(st.integers(0, len(text)), label="cut")]
    elif edit == "duplicate":
        lines = text.splitlines(keepends=True)
        text += data.draw(st.sampled_from(lines), label="line") if lines else ""
    elif edit == "insert":
        at = data.draw(st.integers(0, len(text)), label="at")
        text = text[:at] + data.draw(st.sampled_from(
            ["!!python/object:os.system ", "&a ", "*a", "{", "- ", "\t", ": :", "\x00",
             "%YAML 9.9\n", "<<: *b\n", "!!binary ", "!!str ", "! ", "!!set "]),
            label="insert") + text[at:]
    return text


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


class _Validated(Exception):
    """The stand-in run: the file passed every check."""


@pytest.mark.slow
def test_mutated_experiment_files_never_crash_and_write_nothing(monkeypatch, capsys):
    import harness.run.runner
    from harness import experiment

    def stand_in(path: Any, *args: Any, overrides: Any = (), **kwargs: Any) -> Any:
        """What a run does before it starts Ray: the file's form and its surroundings,
        then the checks that need its kernel family."""
        exp = experiment.load(path, overrides, semantics=False)
        experiment.preflight(path, exp)
        experiment.check_semantics(path, exp)
        raise _Validated

    monkeypatch.setattr(harness.run.runner, "run", stand_in)
    # A URI's credentials move into MLflow's variables as it is read: gone after the test.
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    here = os.getcwd()

    @settings(max_examples=150, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(data=st.data())
    def check(data: st.DataObject) -> None:
        doc = _mutate(data, data.draw(st.sampled_from(BASES), label="base"))
        text = _text(data, doc)
        with tempfile.TemporaryDirectory(prefix="fuzz-") as tmp:
            root = Path(tmp)
            (root / "exp.yaml").write_text(text, errors="surrogateescape")
            os.chdir(root)
            try:
                code = cli.main(["run", "exp.yaml"])
            except _Validated:
                code = 0
            finally:
                os.chdir(here)
            out = capsys.readouterr()
            assert code in (0, 2, 3), (code, text[:500])
            assert "Traceback" not in out.err + out.out, out.err[-2000:]
            assert SECRET not in out.err + out.out, out.err[-2000:]
            if code == 2:
                assert "exp.yaml" in " ".join(out.err.split()), out.err
            # Nothing is written by the checks, whatever they decide.
            assert _listing(root) == ["exp.yaml"], (_listing(root), text[:500])

    check()


def test_the_bases_are_valid():
    """The fuzzer mutates valid files: each base alone passes every check."""
    from harness import experiment

    with tempfile.TemporaryDirectory() as tmp:
        for i, base in enumerate(BASES):
            path = Path(tmp) / f"{i}.yaml"
            path.write_text(yaml.safe_dump(base))
            exp = experiment.load(path)
            experiment.preflight(path, exp.model_copy(update={"output": exp.output.model_copy(
                update={"packs_dir": f"{tmp}/packs", "runs_dir": f"{tmp}/runs"})}))
