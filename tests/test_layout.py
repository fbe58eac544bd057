"""The package's layout: no import cycle between the modules of ``harness`` (counting
imports inside functions too), so that each package can be read from the bottom up."""

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


def _import_graph() -> dict[str, set[str]]:
    """module -> the harness modules it imports."""
    mods = _modules()

    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [owner(a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # ``from harness.x import y``: y may be a module of package x.
                targets = [owner(f"{node.module}.{a.name}") for a in node.names]
            else:
                continue
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
