"""Kernel names: the built-ins register themselves (``@register``) and are found without
importing one another; another installed package declares its families as entry points
(``kernel_harness.kernels``) and is found by name; unknown names and broken plug-ins are
refused by name, never with a traceback. A family's tunables are declared once: the
space, the default config and the bench cases come from the class."""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, ClassVar

import pytest
import yaml

from harness import cli
from harness.kernel import api as kernel_api
from harness.kernel import registry

ROOT = Path(__file__).resolve().parent.parent


def test_the_index_names_exactly_what_the_builtin_modules_register() -> None:
    index = registry.builtin_index()
    assert len(index) == 13 and "matmul" in index and "rmsnorm" in index
    for module in set(index.values()):
        importlib.import_module(module)
    assert {n: c.__module__ for n, c in registry._registered.items()
            if c.__module__.startswith("kernels.")} == index
    for name in index:
        cls = kernel_api.resolve(name)
        assert cls.name == name and cls.declaration_error() is None
        assert cls.compiles_ahead, f"{name} compiles on the GPU's worker"


def test_a_builtin_name_imports_its_own_module_only() -> None:
    code = ("import sys; from harness.kernel import api; api.get('silu'); "
            "print(sorted(m for m in sys.modules if m.startswith('kernels')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=120, env=_env())
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["['kernels',", "'kernels._triton_common',",
                                  "'kernels.fused_elementwise']"]


def test_an_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(kernel_api.UnknownKernel) as err:
        kernel_api.get("matmull")
    msg = str(err.value)
    assert msg.startswith("unknown kernel 'matmull': built-in are [")
    assert "'matmul'" in msg and "'softplus_clamp'" in msg and "package.module:Class" in msg
    with pytest.raises(kernel_api.UnknownKernel):
        kernel_api.get("no such:thing")


def test_register_refuses_a_second_class_under_a_taken_name() -> None:
    from kernels.matmul import Matmul

    class Other(Matmul):
        pass

    with pytest.raises(ValueError, match="registered twice"):
        kernel_api.register("matmul")(Other)
    with pytest.raises(ValueError, match="whose name is 'matmul'"):
        kernel_api.register("matmul2")(Matmul)


def test_tunables_give_the_space_the_defaults_and_the_types() -> None:
    class Tiny(kernel_api.Kernel):
        name = "tiny"
        dims = ("N",)
        tunables: ClassVar[dict[str, kernel_api.Tunable]] = {
            "BLOCK": kernel_api.Tunable((64, 128), default=128, hardware={"cpu": (64,)}),
            "MODE": kernel_api.Tunable(("a", "b"), default="a", vendors={"amd": None}),
            "EXTRA": kernel_api.Tunable(vendors={"amd": (0, 1)}),
            "OLD": kernel_api.Tunable(allowed=(0,)),
        }
        shapes: ClassVar[dict[str, dict[str, int]]] = {"test": {"N": 8}}
        bench = (kernel_api.BenchCase("test", "fp32"),)

    assert Tiny.search_space() == {
        "params": {"BLOCK": [64, 128], "MODE": ["a", "b"]},
        "vendors": {"amd": {"params": {"MODE": None, "EXTRA": [0, 1]}}},
        "hardware": {"cpu": {"params": {"BLOCK": [64]}}}}
    assert Tiny.default_config == {"BLOCK": 128, "MODE": "a"}
    assert Tiny.declaration_error() is None
    t = Tiny.tunables
    assert (t["BLOCK"].type, t["BLOCK"].minimum) == ("int", 0)
    assert t["MODE"].allowed == ("a", "b") and t["OLD"].why_not(1) == "1 is not one of [0]"

    class Sibling(Tiny):
        default_config: ClassVar[dict[str, Any]] = {"BLOCK": 64, "MODE": "c"}

    assert Sibling.tunables["BLOCK"].default == 64 and Tiny.tunables["BLOCK"].default == 128
    assert Sibling.tunables["MODE"].allowed == ("c", "a", "b")
    assert Sibling.search_space() == Tiny.search_space()

    class BadBench(Tiny):
        bench = (kernel_api.BenchCase("huge", "fp32"),)

    assert "no shape 'huge'" in BadBench.declaration_error()

    class BadDefault(Tiny):
        tunables: ClassVar[dict[str, kernel_api.Tunable]] = {
            "GLUON": kernel_api.Tunable((0, 3), default=1, allowed=(0, 3))}

    assert BadDefault.declaration_error() == "default_config['GLUON']: 1 is not one of [0, 3]"
    with pytest.raises(TypeError, match="choices are a tuple"):
        kernel_api.Tunable("int")


def test_the_older_space_form_still_declares_tunables() -> None:
    class Legacy(kernel_api.Kernel):
        name = "legacy"
        dims = ("N",)
        default_config: ClassVar[dict[str, Any]] = {"BLOCK": 128, "num_warps": 4}
        space: ClassVar[dict[str, Any]] = {
            "params": {"BLOCK": [64, 128]},
            "vendors": {"amd": {"params": {"waves_per_eu": [0, 2]}}}}

    assert Legacy.search_space() == {"params": {"BLOCK": [64, 128]},
                                     "vendors": {"amd": {"params": {"waves_per_eu": [0, 2]}}}}
    assert Legacy.default_config == {"BLOCK": 128, "num_warps": 4}
    assert Legacy.tunables["num_warps"].why_not("4") == "'4' is not of type int"
    assert not Legacy.compiles_ahead

    class WithHook(Legacy):
        def compile_only(self, inputs: Any, shape: Any, config: Any) -> None:
            pass

    assert WithHook.compiles_ahead


# -- a plug-in from another installed package -----------------------------------------

PLUGIN = '''
"""A kernel family of another package: y = 2 x."""

from typing import Any, ClassVar

import torch
import triton
import triton.language as tl

from harness.kernel.api import BenchCase, Kernel, SingleLaunch, Tunable


@triton.jit
def _double(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, 2 * tl.load(x_ptr + offs, mask=mask), mask=mask)


class Double(SingleLaunch, Kernel):
    dims = ("N",)
    dtypes = ("fp32",)
    tunables: ClassVar[dict[str, Tunable]] = {
        "BLOCK": Tunable((64, 128, 256), default=128, hardware={"cpu": (64, 128)},
                         doc="elements per program"),
        "num_warps": Tunable((1, 2, 4), default=4, hardware={"cpu": (4,)}),
    }
    shapes: ClassVar[dict[str, dict[str, int]]] = {"test": {"N": 1000}}
    bench = (BenchCase("test", "fp32"),)

    def make_inputs(self, shape, dtype, seed, device) -> dict[str, Any]:
        g = torch.Generator().manual_seed(seed)
        return {"x": torch.randn(shape["N"], generator=g).to(device)}

    def reference(self, inputs, shape):
        return inputs["x"].double() * 2

    def _launch(self, inputs, config):
        x = inputs["x"]
        y = torch.empty_like(x)
        block = int(config.get("BLOCK", 128))
        return (_double, (triton.cdiv(x.numel(), block),), (x, y, x.numel()),
                {"BLOCK": block, "num_warps": int(config.get("num_warps", 4))}, y)

    def flops(self, shape):
        return float(shape["N"])

    def bytes_moved(self, shape, dtype):
        return 8.0 * shape["N"]
'''

PYPROJECT = '''
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "kh-tiny-plugin"
version = "1.2.3"

[project.entry-points."kernel_harness.kernels"]
kh_double = "kh_tiny_plugin.double:Double"
kh_broken = "kh_tiny_plugin.broken:Nope"

[tool.setuptools]
packages = ["kh_tiny_plugin"]
'''


@pytest.fixture(scope="module")
def plugin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny package with two entry points (one whose module fails to import), built
    and installed by pip into a folder of its own."""
    src = tmp_path_factory.mktemp("plugin-src")
    (src / "pyproject.toml").write_text(PYPROJECT)
    pkg = src / "kh_tiny_plugin"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "double.py").write_text(textwrap.dedent(PLUGIN))
    (pkg / "broken.py").write_text("import kh_no_such_module  # noqa\n")
    target = tmp_path_factory.mktemp("plugin-site")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
         "--no-build-isolation", "--no-index", "--target", str(target), str(src)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert list(target.glob("kh_tiny_plugin-1.2.3.dist-info"))
    return target


@pytest.fixture
def installed(plugin: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.syspath_prepend(str(plugin))
    for name in [m for m in sys.modules if m.startswith("kh_tiny_plugin")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(registry, "_instances", {})
    return plugin


def _experiment(tmp_path: Path, kernel: str) -> Path:
    path = tmp_path / f"{kernel}.yaml"
    path.write_text(yaml.safe_dump({
        "name": f"plug-{kernel}", "kernel": kernel, "shapes": [{"N": 1000}],
        "dtypes": ["fp32"], "hardware": ["cpu"], "search": {"trials": 2},
        "search_space": {"params": {"num_warps": [4]}},
        "tracking": {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
        "output": {"packs_dir": str(tmp_path / "packs"), "runs_dir": str(tmp_path / "runs")}}))
    return path


def test_an_installed_plugin_runs_by_name(installed: Path, tmp_path: Path) -> None:
    from harness import experiment
    from harness.measure.timing import Measurer, Timing
    from harness.search import spaces

    assert "kh_double" in kernel_api.installed_names()
    exp = experiment.load(_experiment(tmp_path, "kh_double"))  # the semantic checks too
    fam = kernel_api.get(exp.kernel)
    assert type(fam).__module__ == "kh_tiny_plugin.double" and fam.name == "kh_double"
    assert "kh_tiny_plugin.broken" not in sys.modules  # loaded by name only
    space = spaces.resolve([spaces.for_kernel(fam), exp.search_space], "cpu", "cpu")
    assert space == {"BLOCK": [64, 128], "num_warps": [4]}
    res = Measurer(Timing(1, 2), device="cpu").measure(
        fam, exp.shapes[0], "fp32", {"BLOCK": 64, "num_warps": 4}, seed=0)
    assert res.ok, res.reason
    from harness.measure import bench

    assert [c.shape_name for c in bench.load_cases(only=["kh_double"])] == ["test"]


def test_a_broken_plugin_is_named_without_a_traceback(installed: Path, tmp_path: Path,
                                                      monkeypatch, capsys) -> None:
    import ray

    from harness.fleet import Fleet

    with pytest.raises(kernel_api.KernelLoadError) as err:
        kernel_api.get("kh_broken")
    assert str(err.value).startswith(
        "kernel plug-in 'kh_broken' (kh_tiny_plugin.broken:Nope, from the package "
        "kh-tiny-plugin 1.2.3) failed to load: ModuleNotFoundError: No module named "
        "'kh_no_such_module'")
    monkeypatch.setattr(Fleet, "connect", staticmethod(lambda: "local"))
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.chdir(tmp_path)
    for kernel, words in (("kh_broken", "kernel plug-in 'kh_broken'"),
                          ("kh_nothing", "unknown kernel 'kh_nothing'")):
        path = _experiment(tmp_path, kernel)
        assert cli.main(["run", str(path)]) == cli.EXIT_BAD_INPUT
        err_text = capsys.readouterr().err.replace("\n", "")
        assert str(path) in err_text and words in err_text, err_text
        assert "Traceback" not in err_text
    assert "'kh_double'" in err_text  # the installed plug-ins are listed
    assert cli.main(["bench", "--kernel", "kh_broken", "--out", str(tmp_path)]) == \
        cli.EXIT_BAD_INPUT
    err_text = capsys.readouterr().err.replace("\n", "")
    assert "--kernel kh_broken: kernel plug-in 'kh_broken'" in err_text, err_text
    assert "Traceback" not in err_text and not (tmp_path / "cpu").exists()


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
