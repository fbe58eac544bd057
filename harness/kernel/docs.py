"""The docs table of a family's tunables, derived from its declarations, and the pages
that hold one: a block of a docs page between ``<!-- tunables: NAME [NAME ...] -->`` and
``<!-- /tunables -->`` is the table of the named families (siblings that share their
tunables; the default column names each one's default where they differ).

``python -m harness.kernel.docs`` rewrites the blocks of ``docs/kernels/*.md``;
``--check`` only says which are out of date (exit 1).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.kernel.registry import resolve

BLOCK = re.compile(r"(<!-- tunables: ([\w ]+?) -->\n)(.*?)(<!-- /tunables -->)", re.S)
PAGES = Path(__file__).resolve().parents[2] / "docs" / "kernels"


def _values(choices: Sequence[Any] | None) -> str:
    if choices is None:
        return "not searched"
    return ", ".join(f"`{v}`" for v in choices)


def _default(names: Sequence[str], tunable: str) -> str:
    by_value: dict[str, list[str]] = {}
    for name in names:
        value = resolve(name).default_config.get(tunable)
        by_value.setdefault("—" if value is None else f"`{value}`", []).append(name)
    if len(by_value) == 1:
        return next(iter(by_value))
    return "; ".join(f"{v} ({', '.join(n)})" for v, n in by_value.items())


def tunables_table(names: Sequence[str]) -> str:
    """The markdown table of the tunables of ``names[0]`` (its siblings share them)."""
    cls = resolve(names[0])
    for other in names[1:]:
        if resolve(other).search_space() != cls.search_space():
            raise ValueError(f"{other}'s tunables differ from {names[0]}'s: a table each")
    rows = ["| tunable | type | searched | per vendor / hardware | default | meaning |",
            "|---|---|---|---|---|---|"]
    for name, t in cls.tunables.items():
        searched = _values(t.choices) if t.choices else (
            f"only {_values(t.allowed)}" if t.allowed and not t.vendors and not t.hardware
            else "—")
        sections = "; ".join(f"{key}: {_values(choices)}"
                             for group in (t.vendors, t.hardware)
                             for key, choices in group.items()) or "—"
        rows.append(f"| `{name}` | {t.type or 'any'} | {searched} | {sections} | "
                    f"{_default(names, name)} | {t.doc} |")
    return "\n".join(rows) + "\n"


def render(text: str) -> str:
    """``text`` with each tunables block rewritten from the declarations."""
    return BLOCK.sub(lambda m: m.group(1) + tunables_table(m.group(2).split()) + m.group(4),
                     text)


def documented(pages: Path = PAGES) -> dict[str, Path]:
    """Kernel name -> the docs page whose tunables block names it."""
    out: dict[str, Path] = {}
    for page in sorted(pages.glob("*.md")):
        for match in BLOCK.finditer(page.read_text()):
            out.update(dict.fromkeys(match.group(2).split(), page))
    return out


def main(argv: list[str] | None = None) -> int:
    check = "--check" in (argv if argv is not None else sys.argv[1:])
    stale = []
    for page in sorted(PAGES.glob("*.md")):
        text = page.read_text()
        new = render(text)
        if new != text:
            stale.append(page)
            if not check:
                page.write_text(new)
    for page in stale:
        print(f"{page}: {'out of date' if check else 'rewritten'}")
    return 1 if check and stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
