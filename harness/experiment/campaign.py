"""A campaign's files: the experiments one ``kharness run`` runs together on one fleet.

``kharness run A.yaml B.yaml configs/zoo/`` names them: files, and folders that stand for
every ``*.yaml`` in them (sorted). Every file is read and checked here (its form, its
surroundings) before anything starts; two files of the same ``name`` are refused, since
each experiment keeps its own ``runs/<name>/``, Optuna studies and MLflow experiment.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from harness.experiment.load import load
from harness.experiment.preflight import preflight
from harness.experiment.schema import Experiment, ExperimentError


def is_campaign(args: Sequence[str | Path]) -> bool:
    """Whether the command line names a campaign (several files, or a folder) rather than
    one file: a campaign's summary lists its experiments."""
    return len(args) > 1 or any(Path(a).is_dir() for a in args)


def expand(args: Sequence[str | Path]) -> list[Path]:
    """The experiment files ``args`` name, in order: a folder stands for every ``*.yaml``
    directly in it, sorted by name. A folder with none is an ExperimentError."""
    out: list[Path] = []
    for arg in args:
        path = Path(arg)
        if path.is_dir():
            files = sorted(p for p in path.glob("*.yaml") if p.is_file())
            if not files:
                raise ExperimentError(path, "", "a folder with no *.yaml experiment file in it")
            out += files
        else:
            out.append(path)
    return out


def load_all(paths: Sequence[Path], overrides: Sequence[str] = (),
             surroundings: bool = True) -> list[tuple[Path, Experiment]]:
    """Every file read and checked in its form (``overrides`` apply to each), names
    unique, then (``surroundings``) each file's folders and tracking store
    (``preflight``); the first problem is an ExperimentError naming its file and field.
    The checks that import the kernel families are ``check_semantics`` (seconds)."""
    items = [(path, load(path, overrides, semantics=False)) for path in paths]
    seen: dict[str, Path] = {}
    for path, exp in items:
        if exp.name in seen:
            same = Path(seen[exp.name]).resolve() == Path(path).resolve()
            raise ExperimentError(path, "name", (
                "this file is given twice" if same else
                f"{exp.name!r} is also the name of {seen[exp.name]}") + (
                ": each experiment of a campaign has its own name (its runs/<name>/, "
                "Optuna studies and MLflow experiment)"))
        seen[exp.name] = path
    if surroundings:
        for path, exp in items:
            preflight(path, exp)
    return items
