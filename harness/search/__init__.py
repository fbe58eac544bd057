"""The search: Optuna studies and their storage, strategies over the valid set of a
space, config keys, and the replay of strategies against recorded sweeps. It decides
what to try next and never touches a GPU.

    keys.py      config_key: the one name of a config (no Optuna: workers import it)
    storage.py   the studies' storage (SQLite in WAL mode)
    valid.py     the configs of a space that pass the kernel's static constraints
    strategies/  search strategies (ask / tell over valid, untried configs) and their
                 registry: random, grid, Optuna's TPE / CMA-ES / GP, pattern
    samplers.py  the Optuna sampler that hands out a strategy's asks; the pruners
    study.py     Search: one study's ask / tell, resume, results
    tables.py    recorded exhaustive sweeps (export from a study, load)
    replay.py    a strategy replayed against a recorded sweep, through Search's ask / tell

Names are imported lazily, so that ``harness.search.keys`` stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "config_key": "keys",
    "storage_url": "storage", "make_storage": "storage", "drop_studies": "storage",
    "ValidSpace": "valid", "grid_order": "valid",
    "StrategySampler": "samplers", "make_pruner": "samplers", "ThresholdPruner": "samplers",
    "Search": "study", "ATTR_STATUS": "study", "ATTR_REASON": "study", "ATTR_RESULT": "study",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(f"harness.search.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'harness.search' has no attribute {name!r}")
