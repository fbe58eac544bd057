"""The wheel ships what the runtime reads: built from a copy of the sources, installed
non-editable into a fresh virtual environment outside the checkout, it serves a shipped
H200 pack entry exactly."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "harness", "kernels")


def _run(cmd: list[str], cwd: Path, env: dict[str, str]) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.slow
def test_installed_wheel_serves_the_shipped_packs(tmp_path):
    from harness.packs import format as fmt
    from harness.packs.lookup import SHIPPED

    pack = fmt.read(SHIPPED / "H200" / "grouped_gemm.json")
    (dtype, by_shape), = list(pack["kernels"]["grouped_gemm"].items())[:1]
    shape_key, entry = next(iter(by_shape.items()))
    shape = {k: int(v) for k, v in (part.split("=") for part in shape_key.split(","))}

    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["TRITON_INTERPRET"] = "1"
    # Build from a copy: building in the checkout would write build/ and *.egg-info there.
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        elif path.is_file():
            shutil.copy2(path, src / name)
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
          "--no-index", "-q", "-w", str(dist)], tmp_path, env)
    (wheel,) = dist.glob("kernel_harness-*.whl")

    # A fresh environment whose dependencies (torch, triton, pydantic, pip) are this
    # interpreter's, through a .pth file; the harness itself only from the wheel.
    env_dir = tmp_path / "env"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    purelib = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                        tmp_path, env).strip())
    (purelib / "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    _run([str(py), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)],
         tmp_path, env)

    probe = (
        "import json, harness, kernels\n"
        "from harness import packs\n"
        "from harness.kernel import api\n"
        f"hit = packs.lookup_entry('grouped_gemm', {dtype!r}, 'H200', **{shape!r})\n"
        "print(json.dumps({'file': harness.__file__, 'source': hit.source,\n"
        "                  'config': hit.config, 'path': hit.path,\n"
        "                  'kernels': kernels.__file__, 'names': api.builtin_names(),\n"
        "                  'space': api.get('matmul').search_space()}))\n")
    out = json.loads(_run([str(py), "-c", probe], tmp_path, env).strip().splitlines()[-1])
    assert Path(out["file"]).is_relative_to(env_dir), out  # the installed copy, not ROOT
    assert out["source"] == "exact" and out["config"] == entry["config"]
    assert Path(out["path"]).is_relative_to(env_dir)
    # The built-in families are found by name in the installed copy, with their spaces.
    assert Path(out["kernels"]).is_relative_to(env_dir)
    assert len(out["names"]) == 13 and out["space"]["params"]["BLOCK_K"] == [32, 64]
