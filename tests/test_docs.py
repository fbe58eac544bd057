"""The documentation builds without a broken link, and the README stays a product page."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def test_docs_build_strict(tmp_path: Path) -> None:
    """`mkdocs build --strict` fails on a broken link, a missing page or a bad anchor
    (not with --quiet: mkdocs then counts no warnings)."""
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict",
         "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
        capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "kernels" / "grouped_gemm" / "index.html").is_file()


def test_readme_is_at_most_350_lines() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 350, f"README.md has {len(lines)} lines; move detail to docs/"


def test_readme_links_point_to_files() -> None:
    """Every relative link of the README names a file of the repository (and an anchor
    into a docs page names one of its headings)."""
    text = README.read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links, "the README links to its docs"
    for link in links:
        if re.match(r"^[a-z]+://", link) or link.startswith("mailto:"):
            continue
        path, _, anchor = link.partition("#")
        target = ROOT / path if path else README
        assert target.exists(), f"README.md links to {link}, which does not exist"
        if anchor and target.suffix == ".md":
            slugs = {_slug(h) for h in re.findall(r"^#+ (.+)$", target.read_text(), re.M)}
            assert anchor in slugs, f"README.md links to {link}: no such heading"


def _slug(heading: str) -> str:
    """The anchor Python-Markdown's toc extension (and GitHub) give a heading."""
    text = re.sub(r"[`*_]", "", heading).strip().lower()
    text = re.sub(r"[^\w\s-]", "", text)
    return re.sub(r"[\s]+", "-", text)


def test_ci_runs_exactly_the_readmes_test_command() -> None:
    """CI runs the README's second command, word for word."""
    block = re.search(r"```bash\n(.*?)```", README.read_text(), re.S)
    assert block, "the README's two commands are in a bash block"
    commands = [ln.strip() for ln in block.group(1).splitlines()
                if ln.strip() and not ln.strip().startswith("#")]
    assert len(commands) == 2, commands
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert commands[1] in ci, f".ci/run does not run {commands[1]!r}"


def test_every_builtin_kernel_has_a_current_tunables_table() -> None:
    """The tables of tunables in docs/kernels/ are made from the families' declarations
    (``python -m harness.kernel.docs``); every built-in has one, and none is stale."""
    from harness.kernel import api, docs

    pages = docs.documented()
    missing = [n for n in api.builtin_names() if n not in pages]
    assert not missing, f"no '<!-- tunables: NAME -->' block in docs/kernels/ for {missing}"
    for page in sorted(docs.PAGES.glob("*.md")):
        text = page.read_text()
        assert docs.render(text) == text, f"{page} is stale: run python -m harness.kernel.docs"
    assert docs.main(["--check"]) == 0


def test_a_new_kernel_page_needs_no_nav_line(tmp_path: Path) -> None:
    """A family's docs page joins the "Kernel families" section by itself (infra/docs_hooks.py)."""
    import shutil

    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    (tmp_path / "infra").mkdir()
    shutil.copy(ROOT / "infra" / "docs_hooks.py", tmp_path / "infra")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path)
    (tmp_path / "docs" / "kernels" / "zz_new_family.md").write_text("# A new family\n\nText.\n")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
         str(tmp_path / "site")], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    page = tmp_path / "site" / "kernels" / "zz_new_family" / "index.html"
    assert page.is_file() and "A new family" in (tmp_path / "site" / "index.html").read_text()
