"""The one list of strategies: the built-in ones (registered by ``@register`` in the
family modules named here) and those of other packages (the ``kernel_harness.strategies``
entry-point group: ``name = "package.module:Class"``, a ``Strategy`` subclass).

The experiment schema checks ``search.strategy`` against ``names()``; a study builds its
strategy with ``get(name)``. A plug-in is imported only when it is chosen.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from typing import TypeVar

from harness.search.strategies.base import Strategy

#: The entry-point group under which other packages register strategies.
ENTRY_POINT_GROUP = "kernel_harness.strategies"
#: The modules of the built-in families: importing one registers its strategies.
BUILTIN_MODULES = (
    "harness.search.strategies.basic",  # random, grid
    "harness.search.strategies.optuna_family",  # tpe, cmaes, gp
    "harness.search.strategies.pattern",  # pattern
    "harness.search.strategies.auto",  # auto: pattern or tpe by the space's size
)

S = TypeVar("S", bound=type[Strategy])

_builtin: dict[str, type[Strategy]] = {}
_loaded: dict[str, type[Strategy]] = {}  # plug-ins loaded so far
_scanned: dict[tuple[str, ...], dict[str, EntryPoint]] = {}  # sys.path -> entry points
_imported = False


class StrategyError(LookupError):
    """An unknown strategy name, or a plug-in that cannot be loaded."""


def register(name: str) -> Callable[[S], S]:
    """Class decorator: register a built-in strategy under ``name``."""
    def deco(cls: S) -> S:
        if not (isinstance(cls, type) and issubclass(cls, Strategy)):
            raise TypeError(f"strategy {name!r}: {cls!r} is not a Strategy subclass")
        if name in _builtin and _builtin[name] is not cls:
            raise ValueError(f"strategy {name!r} is registered twice "
                             f"({_builtin[name].__module__} and {cls.__module__})")
        cls.name = name
        _builtin[name] = cls
        return cls
    return deco


def _builtins() -> dict[str, type[Strategy]]:
    global _imported
    if not _imported:
        for module in BUILTIN_MODULES:
            importlib.import_module(module)
        _imported = True
    return _builtin


def _plugins() -> dict[str, EntryPoint]:
    """The group's entry points, read once per ``sys.path`` (scanning every installed
    distribution takes tens of milliseconds; an experiment file is checked often)."""
    key = tuple(sys.path)
    if key not in _scanned:
        _scanned[key] = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    return _scanned[key]


def names() -> list[str]:
    """Every strategy that can be chosen, sorted; a built-in name wins over a plug-in's."""
    return sorted(set(_builtins()) | set(_plugins()))


def unknown_message(name: object) -> str:
    return (f"unknown strategy {name!r}: known strategies are {', '.join(names())} "
            f"(other packages add theirs under the entry-point group {ENTRY_POINT_GROUP})")


def get(name: str) -> type[Strategy]:
    """The strategy class registered as ``name``; StrategyError if there is none or its
    plug-in cannot be loaded."""
    builtin = _builtins()
    if name in builtin:
        return builtin[name]
    if name in _loaded:
        return _loaded[name]
    ep = _plugins().get(name)
    if ep is None:
        raise StrategyError(unknown_message(name))
    try:
        cls = ep.load()
    except Exception as exc:  # a broken plug-in names itself, not a traceback
        raise StrategyError(f"strategy {name!r} ({ep.value}, entry-point group "
                            f"{ENTRY_POINT_GROUP}) cannot be loaded: "
                            f"{type(exc).__name__}: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        raise StrategyError(f"strategy {name!r} ({ep.value}) is not a subclass of "
                            "harness.search.strategies.Strategy")
    cls.name = name
    _loaded[name] = cls
    return cls
