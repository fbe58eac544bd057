"""Strict JSON for what the harness prints or writes for other programs to read.

A value the run does not have is NaN inside the harness (a speedup without its baseline,
the search's time for a pack entry it never measured); Python's ``json`` writes that as a
bare ``NaN``, which strict parsers (jq, JavaScript, most JSON libraries) refuse. Here it
becomes ``null``, as in the packs.
"""

from __future__ import annotations

import json
import math
from typing import Any


def json_safe(v: Any) -> Any:
    """``v`` with every non-finite float, at any depth of dicts, lists and tuples, as None."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_safe(x) for x in v]
    return v


def dumps(v: Any, **kwargs: Any) -> str:
    """``json.dumps`` of ``json_safe(v)``; refuses to write NaN or infinity."""
    return json.dumps(json_safe(v), allow_nan=False, **kwargs)
