"""A study's plots, drawn from its Optuna storage: the optimisation history, the best
found against the device time spent, the parameter importances and the roofline. The
MLflow study runs carry them as PNG artifacts (``tracker``) and the HTML report embeds
them (``report``).

matplotlib and Optuna's plotting code are imported on first use (1-2 s).
"""

from __future__ import annotations

import io
import math
from typing import Any

from harness.search import progress

ATTR_STATUS, ATTR_RESULT = progress.ATTR_STATUS, progress.ATTR_RESULT


def _pyplot():
    import warnings

    import matplotlib
    import optuna

    # Optuna's matplotlib plots are marked experimental; the warning is noise here.
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)

    matplotlib.use("Agg")  # no display; must precede pyplot's first import
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:
    plt = _pyplot()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def measured(study) -> list:
    from optuna.trial import TrialState

    return [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if t.user_attrs.get(ATTR_STATUS) == "measured"]


def num(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan


def history_png(study, title: str) -> bytes | None:
    """Optuna's optimisation history (latency per trial and best so far)."""
    if not measured(study):
        return None
    _pyplot()
    from optuna.visualization.matplotlib import plot_optimization_history

    ax = plot_optimization_history(study, target_name="latency (ms)")
    ax.set_title(f"history: {title}", fontsize=9)
    return _png(ax.figure)


def search_curve(study) -> list[list[float]]:
    """[device seconds spent, best latency (ms) by then] per device trial from the first
    measured one: the study's regret curve (its strategy: the study's ``strategy``)."""
    return [[spent, best] for _, spent, best in progress.curve(study.get_trials(deepcopy=False))
            if best < math.inf]


def progress_png(study, title: str) -> bytes | None:
    """The best latency found against the device seconds spent."""
    points = search_curve(study)
    if not points:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.4))
    ax.step([p[0] for p in points], [p[1] for p in points], where="post", color="#4878d0")
    ax.set_xlabel("device seconds spent by the search")
    ax.set_ylabel("best latency (ms)")
    strategy = study.user_attrs.get("strategy")
    ax.set_title(f"best found: {title}" + (f" ({strategy})" if strategy else ""), fontsize=9)
    return _png(fig)


def importance_png(study, title: str) -> bytes | None:
    """Optuna's parameter importances; None with fewer than two measured trials or no
    parameter that varied among them (importances are undefined there)."""
    trials = measured(study)
    if len(trials) < 2:
        return None
    varied = [k for k in trials[0].params if len({str(t.params.get(k)) for t in trials}) > 1]
    if not varied:
        return None
    _pyplot()
    from optuna.visualization.matplotlib import plot_param_importances

    try:
        ax = plot_param_importances(study, params=varied)
    except (ValueError, RuntimeError, ZeroDivisionError):
        return None
    ax.set_title(f"importance: {title}", fontsize=9)
    return _png(ax.figure)


def roofline_png(study, title: str) -> bytes | None:
    """Achieved TFLOP/s and GB/s per measured trial against the roofline bound.

    The bound rate follows from the trial's own numbers: ``roofline`` is bound time /
    measured time, so the rate at the bound is the achieved rate / ``roofline``."""
    trials = measured(study)
    if not trials:
        return None
    plt = _pyplot()
    xs = [t.number for t in trials]
    res = [t.user_attrs.get(ATTR_RESULT) or {} for t in trials]
    frac = [num(r.get("roofline")) for r in res]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    for ax, key, unit in ((axes[0], "tflops", "TFLOP/s"), (axes[1], "gbps", "GB/s")):
        achieved = [num(r.get(key)) for r in res]
        bound = [a / f if f and f == f else math.nan for a, f in zip(achieved, frac, strict=True)]
        ax.bar(xs, achieved, color="#4878d0", label="achieved")
        if any(b == b for b in bound):
            ax.plot(xs, bound, "r_", markersize=14, mew=2, label="roofline bound")
        else:
            ax.text(0.5, 0.9, "bound unknown (no measured ceilings)", transform=ax.transAxes,
                    ha="center", fontsize=8, color="gray")
        ax.set_xlabel("trial")
        ax.set_ylabel(unit)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"roofline: {title}", fontsize=9)
    return _png(fig)


def warm_imports() -> None:
    """Import what the plots need (matplotlib, Optuna's plotting and importance code):
    1-2 s at a run's end, nothing when done in a thread while Ray starts."""
    _pyplot()
    import optuna.importance  # noqa: F401
    import optuna.visualization.matplotlib  # noqa: F401


def study_plots(study, title: str) -> dict[str, bytes]:
    """name -> PNG for the plots that can be drawn for this study."""
    out = {}
    for name, fn in (("history", history_png), ("progress", progress_png),
                     ("importance", importance_png), ("roofline", roofline_png)):
        png = fn(study, title)
        if png:
            out[name] = png
    return out
