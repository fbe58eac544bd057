"""How a search progressed, from its stored trials: what each trial cost the device, the
best latency found against the device seconds spent (the data of a regret curve), and how
far into the search its winner was found. Imports no Optuna: the report's plots use it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from harness.search.keys import config_key

#: The trial attributes the study writes (``harness.search.study``).
ATTR_STATUS, ATTR_RESULT = "status", "result"
ATTR_CHEAP_S = "cheap_s"  # device seconds of a multi-fidelity trial's cheap pass
#: The statuses of trials that ran on the device (pruned and repeated ones cost nothing).
DEVICE_TRIALS = ("measured", "failed", "cut")


def result_cost_s(result: Mapping[str, Any]) -> float:
    """Device seconds a measurement took: its first launch (compile, or a load of what
    the compile-ahead built) and its timing; 0 where neither was recorded."""
    total = 0.0
    for key in ("compile_s", "timing_s"):
        v = result.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            total += v
    return total


def trial_cost_s(user_attrs: Mapping[str, Any]) -> float:
    """Device seconds a stored trial took: its measurement and, under multi-fidelity,
    its cheap pass."""
    cheap = user_attrs.get(ATTR_CHEAP_S)
    return (result_cost_s(user_attrs.get(ATTR_RESULT) or {})
            + (cheap if isinstance(cheap, int | float) and math.isfinite(cheap) else 0.0))


def curve(trials: Iterable[Any]) -> list[tuple[int, float, float]]:
    """Per device trial, in the order they were asked: (its 1-based count, the device
    seconds spent up to and including it, the best latency measured by then; inf before
    the first)."""
    out, spent, best = [], 0.0, math.inf
    for t in sorted(trials, key=lambda t: t.number):
        status = t.user_attrs.get(ATTR_STATUS)
        if status not in DEVICE_TRIALS:
            continue
        spent += trial_cost_s(t.user_attrs)
        if status == "measured" and t.value is not None:
            best = min(best, t.value)
        out.append((len(out) + 1, spent, best))
    return out


def found_at(trials: Iterable[Any], config: Mapping[str, Any] | None,
             budget: int) -> dict[str, Any] | None:
    """How far into the search ``config`` (its winner) was first measured: the device
    trial that did, the device seconds spent up to and including it, and the search's
    totals; None where the search never measured it (the pack's winner re-measured beside
    the search's best, say). ``config``'s keys outside the trials' parameters are
    ignored."""
    trials = sorted(trials, key=lambda t: t.number)
    if not config or not trials:
        return None
    found = None
    points = curve(trials)
    device = [t for t in trials if t.user_attrs.get(ATTR_STATUS) in DEVICE_TRIALS]
    for (n, spent, _), t in zip(points, device, strict=True):
        if t.user_attrs.get(ATTR_STATUS) == "measured":
            key = config_key({k: v for k, v in config.items() if k in t.params})
            if config_key(t.params) == key:
                found = (n, spent)
                break
    if found is None:
        return None
    n_all, total = points[-1][0], points[-1][1]
    return {"trial": found[0], "trials": n_all, "budget": budget, "gpu_s": found[1],
            "search_gpu_s": total,
            "fraction": found[1] / total if total > 0 else found[0] / n_all}
