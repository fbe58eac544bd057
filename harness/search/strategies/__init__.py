"""Search strategies: what a study measures next, among the valid configs of its space.

    base.py           Strategy (ask / tell over valid points), Setup, Outcome
    registry.py       the one list: built-ins (``@register``) and plug-ins (the
                      ``kernel_harness.strategies`` entry-point group)
    basic.py          random, grid
    optuna_family.py  tpe, cmaes, gp: Optuna's samplers, proposals repaired into the valid set
    repair.py         the Optuna sampler that does the repair
    pattern.py        pattern: a walk over ordinal tile sizes from the default and the
                      warm-start configs
    auto.py           auto (the default): pattern on spaces of up to 1,000 valid configs,
                      tpe on larger ones, as the replay of recorded sweeps found best

Names are imported lazily: the experiment schema reads ``registry`` without Optuna.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "Strategy": "base", "Setup": "base", "Outcome": "base", "Point": "base",
    "register": "registry", "get": "registry", "names": "registry",
    "StrategyError": "registry", "ENTRY_POINT_GROUP": "registry",
    "OptunaStrategy": "optuna_family",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
