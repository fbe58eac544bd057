"""Which class a kernel name means.

A name resolves, in this order, to:

1. a built-in family: a class of the ``kernels`` package decorated with
   ``@register("name")`` (on a line of its own). The package's files are read, not
   imported, to learn which module registers which name, so that ``kernel: matmul``
   imports ``kernels.matmul`` and nothing else;
2. a family of another installed package, declared in its metadata under the entry-point
   group ``kernel_harness.kernels`` (``name = "package.module:Class"``): only the entry
   point of that name is loaded;
3. an import path, ``package.module:Class``.

An unknown name is refused with the known ones listed; a plug-in that fails to load is
named, with its package and the error, never as a traceback.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from harness.kernel.base import Kernel

if TYPE_CHECKING:
    from importlib.metadata import EntryPoint

#: The entry-point group other packages declare their kernel families in.
ENTRY_POINT_GROUP = "kernel_harness.kernels"
#: The package of the built-in families.
BUILTIN_PACKAGE = "kernels"

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_NAME = re.compile(_IDENT)
_IMPORT_PATH = re.compile(rf"{_IDENT}(\.{_IDENT})*:{_IDENT}")

K = TypeVar("K", bound=type[Kernel])

_registered: dict[str, type[Kernel]] = {}


class UnknownKernel(KeyError):
    """No built-in, installed plug-in or import path of that name."""

    def __str__(self) -> str:  # KeyError's own quotes its message
        return str(self.args[0])


class KernelLoadError(ImportError):
    """A kernel's module or plug-in failed to import, or is not a kernel family."""


def register(name: str) -> Callable[[K], K]:
    """Class decorator: the family ``cls`` is the built-in kernel ``name`` (its ``name``
    attribute is set to it where the class leaves it out)."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"kernel name {name!r}: letters, digits and '_' only")

    def deco(cls: K) -> K:
        if not (isinstance(cls, type) and issubclass(cls, Kernel)):
            raise TypeError(f"@register({name!r}): {cls!r} is not a Kernel subclass")
        if "name" not in cls.__dict__:
            cls.name = name
        elif cls.name != name:
            raise ValueError(f"@register({name!r}) on {cls.__qualname__}, whose name is "
                             f"{cls.name!r}")
        known = _registered.get(name)
        if known is not None and _qualname(known) != _qualname(cls):
            raise ValueError(f"kernel {name!r} is registered twice: {_qualname(known)} "
                             f"and {_qualname(cls)}")
        _registered[name] = cls
        return cls

    return deco


def _qualname(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


#: ``@register("name")`` at the start of a line: how a built-in's module names it.
_REGISTER_LINE = re.compile(r'^@(?:\w+\.)*register\(\s*["\']([A-Za-z_][A-Za-z0-9_]*)["\']\s*\)',
                            re.M)


@functools.cache
def builtin_index() -> dict[str, str]:
    """Built-in kernel name -> the module that registers it, read from the files of the
    ``kernels`` package without importing them."""
    spec = importlib.util.find_spec(BUILTIN_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return {}
    out: dict[str, str] = {}
    for root in map(Path, spec.submodule_search_locations):
        for path in sorted(root.rglob("*.py")):
            names = _REGISTER_LINE.findall(path.read_text(encoding="utf-8"))
            if not names:
                continue
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            module = ".".join((BUILTIN_PACKAGE, *parts))
            for name in names:
                out.setdefault(name, module)
    return dict(sorted(out.items()))


def builtin_names() -> list[str]:
    """The built-in kernel names, sorted."""
    return list(builtin_index())


def _entry_points(name: str | None = None) -> list[EntryPoint]:
    import importlib.metadata  # only where a name is no built-in: ~40 ms to import

    eps = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    return [ep for ep in eps if name is None or ep.name == name]


def installed_names() -> list[str]:
    """The kernel names other installed packages declare (their modules not imported)."""
    return sorted({ep.name for ep in _entry_points()})


def _checked(cls: object, what: str) -> type[Kernel]:
    if not (isinstance(cls, type) and issubclass(cls, Kernel)):
        raise KernelLoadError(f"{what} is not a harness.kernel.api.Kernel subclass")
    why = cls.declaration_error()
    if why:
        raise KernelLoadError(f"{what}: {why}")
    return cls


def _builtin(name: str, module: str) -> type[Kernel]:
    importlib.import_module(module)
    cls = _registered.get(name)
    if cls is None:
        raise KernelLoadError(f"built-in kernel {name!r}: {module} does not register it")
    return _checked(cls, f"built-in kernel {name!r} ({_qualname(cls)})")


def _plugin(ep: EntryPoint) -> type[Kernel]:
    dist = getattr(ep, "dist", None)
    where = f"kernel plug-in {ep.name!r} ({ep.value}" + (
        f", from the package {dist.name} {dist.version})" if dist is not None else ")")
    try:
        cls = ep.load()
    except Exception as exc:  # noqa: BLE001 - whatever the plug-in raises, it is named
        raise KernelLoadError(f"{where} failed to load: {type(exc).__name__}: {exc}") from None
    if isinstance(cls, type) and issubclass(cls, Kernel):
        if "name" not in cls.__dict__:
            cls.name = ep.name
        if cls.name != ep.name:
            raise KernelLoadError(f"{where}: the class's name is {cls.name!r}")
    return _checked(cls, where)


def _import_path(path: str) -> type[Kernel]:
    module_name, _, attr = path.partition(":")
    cls = getattr(importlib.import_module(module_name), attr)
    return _checked(cls, path)


def resolve(name_or_path: str) -> type[Kernel]:
    """The kernel family class a name or ``package.module:Class`` means (see the module's
    doc for the order)."""
    module = builtin_index().get(name_or_path)
    if module is not None:
        return _builtin(name_or_path, module)
    if _NAME.fullmatch(name_or_path):
        eps = _entry_points(name_or_path)
        if eps:
            return _plugin(eps[0])
    if _IMPORT_PATH.fullmatch(name_or_path):
        return _import_path(name_or_path)
    installed = installed_names()
    raise UnknownKernel(
        f"unknown kernel {name_or_path!r}: built-in are {builtin_names()}"
        + (f", installed plug-ins {installed}" if installed else "")
        + ", or give an import path 'package.module:Class'")


_instances: dict[str, Kernel] = {}


def get(name_or_path: str) -> Kernel:
    """A cached instance of the family (families are stateless)."""
    if name_or_path not in _instances:
        _instances[name_or_path] = resolve(name_or_path)()
    return _instances[name_or_path]
