"""Fault injection, a testing aid: ``HARNESS_FAULTS`` (comma-separated names) makes one
part of a run lose or withhold a message, so that a test can show the run notices
within seconds and says what it waited for, never waiting silently.

- ``result_lost``: a worker drops the result of its first measurement;
- ``compile_lost``: a node's compile service records no outcome for a compile;
- ``compile_hang``: a compile child hangs inside its compile;
- ``logger_hang``: the MLflow logger stops answering;
- ``writer_hang``: the Optuna study writer stops answering;
- ``baseline_hang``: a worker's torch.compile baseline process never answers a task.

The driver's setting reaches the actors it starts (``actor_env``).
"""

from __future__ import annotations

import os
from typing import Any

VARIABLE = "HARNESS_FAULTS"


def active(name: str) -> bool:
    """Whether the fault ``name`` is injected in this process."""
    return name in os.environ.get(VARIABLE, "").split(",")


def actor_env() -> dict[str, Any]:
    """Ray actor options that carry this process's faults to the actor ({} without)."""
    faults = os.environ.get(VARIABLE)
    return {"runtime_env": {"env_vars": {VARIABLE: faults}}} if faults else {}
