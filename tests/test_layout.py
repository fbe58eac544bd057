"""The package's layout: no import cycle between the modules of ``harness`` (counting
imports inside functions too), so that each package can be read from the bottom up, and
MLflow talked to from ``harness.tracking`` only."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _modules() -> dict[str, Path]:
    out = {}
    for path in (ROOT / "harness").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """``(module, names)`` of each absolute import statement of the file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.extend((a.name, []) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, [a.name for a in node.names]))
    return out


def _import_graph() -> dict[str, set[str]]:
    """module -> the harness modules it imports."""
    mods = _modules()

    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        for module, names in _imports(path):
            # ``from harness.x import y``: y may be a module of package x.
            targets = [owner(f"{module}.{n}") for n in names] or [owner(module)]
            # A package's __init__ re-exporting its own modules is not a cycle of code.
            graph[mod].update(t for t in targets
                              if t and t != mod and not t.startswith(f"{mod}."))
    return graph


def test_no_import_cycle_between_harness_modules() -> None:
    graph = _import_graph()
    assert "harness.tracking.report" in graph and "harness.cli.main" in graph
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        raise AssertionError("modules that import each other: "
                             + " -> ".join(exc.args[1])) from None


def test_only_tracking_talks_to_mlflow() -> None:
    users = sorted(mod for mod, path in _modules().items()
                   if any(m == "mlflow" or m.startswith("mlflow.") for m, _ in _imports(path))
                   and not mod.startswith("harness.tracking."))
    assert users == [], f"modules importing MLflow outside harness.tracking: {users}"


def test_the_root_of_harness_holds_only_its_public_face() -> None:
    """Concepts live in folders (run, measure, search, fleet, ...): the root keeps the
    package's face only."""
    loose = sorted(p.name for p in (ROOT / "harness").glob("*.py"))
    assert loose == ["__init__.py", "__main__.py", "autotune.py"], loose
    data = [p.name for p in (ROOT / "harness").iterdir()
            if p.is_file() and p.suffix not in (".py", ".typed")]
    assert not data, f"data files belong to their package: {data}"


def test_no_submodule_shares_a_name_with_its_package_s_api() -> None:
    """Importing ``harness.packs.x`` sets the package's attribute ``x`` to the module: a
    function ``x`` that the package's ``__init__`` exports would be replaced by it."""
    clashes = []
    for init in (ROOT / "harness").rglob("__init__.py"):
        pkg = init.parent
        subs = {p.stem for p in pkg.glob("*.py")} | {p.name for p in pkg.iterdir()
                                                     if (p / "__init__.py").exists()}
        for module, names in _imports(init):
            for name in names:
                # ``from .x import x`` loads the module first: the function wins, and stays.
                if name in subs and module != ".".join((*pkg.relative_to(ROOT).parts, name)):
                    clashes.append(f"{pkg.relative_to(ROOT)}: {name} from {module}")
        for node in ast.parse(init.read_text()).body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name in subs:
                clashes.append(f"{pkg.relative_to(ROOT)}: {node.name} defined")
    assert not clashes, clashes
