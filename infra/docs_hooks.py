"""MkDocs hook: every page of ``docs/kernels/`` is in the nav's "Kernel families" section,
so that a new kernel family's docs page needs no line in ``mkdocs.yml``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

SECTION = "Kernel families"


def _title(page: Path) -> str:
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return page.stem.replace("_", " ")


def on_config(config: Any) -> Any:
    docs = Path(config["docs_dir"])
    for item in config["nav"] or []:
        if isinstance(item, dict) and SECTION in item:
            entries = item[SECTION]
            listed = {v for e in entries for v in (e.values() if isinstance(e, dict) else [e])}
            for page in sorted((docs / "kernels").glob("*.md")):
                rel = f"kernels/{page.name}"
                if rel not in listed:
                    entries.append({_title(page): rel})
    return config
