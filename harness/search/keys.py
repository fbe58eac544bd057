"""Config keys: the one way a config is named wherever configs are compared or stored
(the search's seen set, the fleet's compile-ahead, re-measurement, replay tables).

Imports nothing heavy: workers and table readers use it without Optuna.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def config_key(config: Mapping[str, Any]) -> str:
    """A config as canonical JSON (sorted names; values JSON cannot hold, as text)."""
    return json.dumps(dict(config), sort_keys=True, default=str)
