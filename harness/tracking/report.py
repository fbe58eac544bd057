"""``kharness report``: one self-contained HTML file per experiment.

Everything comes from the experiment's own state, so it works offline: the Optuna
storage (``runs/<name>/optuna.db``: trials, baselines), the packs listed in
``runs/<name>/state.json`` and the copies of the packs as they were before the last run
(``runs/<name>/previous_packs/``). MLflow (the tracking URI in the state) adds the run
ids where it can be reached; where it cannot, the report says so and carries on.

The HTML has inline CSS and its plots embedded as base64 PNG: it can be mailed or
attached to a CI run as one file.
"""

from __future__ import annotations

import base64
import datetime as dt
import html
import io
import json
import math
import os
from pathlib import Path
from typing import Any

ATTR_STATUS, ATTR_RESULT = "status", "result"  # as in harness.search (not imported: no Ray)


class ReportError(Exception):
    """The report's source cannot be found or read."""


# -- plots ------------------------------------------------------------------------------


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


def _measured(study) -> list:
    from optuna.trial import TrialState

    return [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if t.user_attrs.get(ATTR_STATUS) == "measured"]


def _num(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan


# The accuracy bands a report sorts configs into: the MiniGPT write-up's atol (1e-3), and
# the looser bound that reduced-precision configs are usually held to (1e-2).
ACCURACY_BANDS = (1e-3, 1e-2)


def accuracy_bands(trials: list, bands: tuple[float, ...] = ACCURACY_BANDS
                   ) -> list[dict[str, Any]]:
    """Each trial whose accuracy was checked, in the tightest band its max abs error meets
    (the last band: above every bound), with the band's fastest config. A trial that the
    experiment's own ``max_abs_err`` failed is counted in its band as well: it is the
    config that "only meets a looser bound"."""
    pairs = zip(bands, bands[1:], strict=False)
    labels = [f"<= {bands[0]:g}", *(f"{lo:g} .. {hi:g}" for lo, hi in pairs),
              f"> {bands[-1]:g}"]
    rows: list[dict[str, Any]] = [
        {"bound": bound, "label": label, "configs": 0, "failed_requirement": 0,
         "best_ms": math.nan, "best_err": math.nan, "config": None}
        for bound, label in zip((*bands, math.inf), labels, strict=True)]
    for t in trials:
        res = t.user_attrs.get(ATTR_RESULT) or {}
        err = _num(res.get("max_abs_err"))
        if err != err:  # never checked (compile failure, time-out, pruned)
            continue
        row = next(r for r in rows if err <= r["bound"])
        row["configs"] += 1
        if str(res.get("reason", "")).startswith("accuracy requirement"):
            row["failed_requirement"] += 1
        ms = _num(res.get("latency_ms"))
        if ms == ms and not ms >= row["best_ms"]:
            row.update(best_ms=ms, best_err=err, config=dict(t.params))
    return rows


def history_png(study, title: str) -> bytes | None:
    """Optuna's optimisation history (latency per trial and best so far)."""
    if not _measured(study):
        return None
    _pyplot()
    from optuna.visualization.matplotlib import plot_optimization_history

    ax = plot_optimization_history(study, target_name="latency (ms)")
    ax.set_title(f"history: {title}", fontsize=9)
    return _png(ax.figure)


def importance_png(study, title: str) -> bytes | None:
    """Optuna's parameter importances; None with fewer than two measured trials or no
    parameter that varied among them (importances are undefined there)."""
    trials = _measured(study)
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
    trials = _measured(study)
    if not trials:
        return None
    plt = _pyplot()
    xs = [t.number for t in trials]
    res = [t.user_attrs.get(ATTR_RESULT) or {} for t in trials]
    frac = [_num(r.get("roofline")) for r in res]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    for ax, key, unit in ((axes[0], "tflops", "TFLOP/s"), (axes[1], "gbps", "GB/s")):
        achieved = [_num(r.get(key)) for r in res]
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
    for name, fn in (("history", history_png), ("importance", importance_png),
                     ("roofline", roofline_png)):
        png = fn(study, title)
        if png:
            out[name] = png
    return out


# -- data ------------------------------------------------------------------------------


def _split_study(name: str) -> dict[str, str]:
    # experiment/kernel/shape/dtype/hardware; a kernel import path may hold '/'? no, but
    # take the outer fields from both ends so that nothing depends on it.
    parts = name.split("/")
    return {"experiment": parts[0], "kernel": "/".join(parts[1:-3]), "shape": parts[-3],
            "dtype": parts[-2], "hardware": parts[-1]}


def _speedup(base: Any, new: Any) -> float:
    b, n = _num(base), _num(new)
    return b / n if b == b and n == n and n > 0 else math.nan


def _resolve(source: str, runs_dir: str | Path, tracking_uri: str | None) -> Path:
    """The experiment's runs directory from a name, a directory, a YAML or a run id."""
    p = Path(source)
    if p.is_file() and p.suffix in (".yaml", ".yml"):
        from harness.experiment import ExperimentError, load

        try:
            exp = load(p)
        except ExperimentError as exc:
            raise ReportError(str(exc)) from None
        return Path(exp.output.runs_dir) / exp.name
    if p.is_dir() and ((p / "optuna.db").is_file() or (p / "state.json").is_file()):
        return p
    named = Path(runs_dir) / source
    if named.is_dir():
        return named
    if all(c in "0123456789abcdef" for c in source) and len(source) >= 16:
        from harness.tracking.tracker import find_parent
        from harness.tracking.tracker import tracking_uri as default_uri

        try:
            run = find_parent(default_uri(tracking_uri), source)
        except Exception as exc:
            raise ReportError(f"MLflow run {source}: {exc}") from None
        config = run.get("harness.config")
        if config and Path(config).is_file():
            return _resolve(config, runs_dir, tracking_uri)
        if (Path(runs_dir) / run["name"]).is_dir():
            return Path(runs_dir) / run["name"]
        raise ReportError(f"MLflow run {source} is experiment {run['name']!r}, whose state "
                          f"is not under {runs_dir}/ (pass --runs-dir)")
    raise ReportError(f"{source}: not an experiment name under {runs_dir}/, a runs "
                      "directory, an experiment YAML or an MLflow run id")


def collect(run_dir: Path, tracking_uri: str | None = None,
            with_plots: bool = True) -> dict[str, Any]:
    """Everything the report shows, as plain data (plots as PNG bytes)."""
    import optuna

    db = run_dir / "optuna.db"
    if not db.is_file():
        raise ReportError(f"{run_dir}: no optuna.db (has the experiment run?)")
    state: dict[str, Any] = {}
    if (run_dir / "state.json").is_file():
        state = json.loads((run_dir / "state.json").read_text())
    storage = f"sqlite:///{db.resolve()}"
    studies = []
    for s in optuna.get_all_study_summaries(storage, include_best_trial=False):
        study = optuna.load_study(study_name=s.study_name, storage=storage)
        info = _split_study(s.study_name)
        counts = {"measured": 0, "failed": 0, "pruned": 0, "duplicate": 0}
        reasons = []
        for t in study.get_trials(deepcopy=False):
            st = t.user_attrs.get(ATTR_STATUS)
            if st in counts:
                counts[st] += 1
            if st == "failed":
                reasons.append(t.user_attrs.get("reason", ""))
        measured = _measured(study)
        best = min(measured, key=lambda t: t.value) if measured else None
        res = dict(best.user_attrs.get(ATTR_RESULT) or {}) if best else {}
        attrs = study.user_attrs
        base = {k: (attrs.get(k) or {}).get("latency_ms") for k in ("eager", "compile",
                                                                     "default")}
        row = {**info, "study": s.study_name, "counts": counts, "failures": reasons[:5],
               "config": dict(best.params) if best else None, "result": res,
               "baselines": base, "mlflow_run_id": attrs.get("mlflow_run_id"),
               "accuracy": accuracy_bands(study.get_trials(deepcopy=False))}
        row.update({f"speedup_vs_{k}": _speedup(v, res.get("latency_ms"))
                    for k, v in base.items()})
        if with_plots:
            row["plots"] = study_plots(study, f"{info['kernel']} {info['shape']} "
                                              f"{info['dtype']} {info['hardware']}")
        studies.append(row)
    data: dict[str, Any] = {"name": run_dir.name, "run_dir": str(run_dir), "state": state,
                            "studies": studies, "mlflow": None, "mlflow_error": None}
    uri = tracking_uri or state.get("tracking_uri")
    if uri and state.get("parent_run_id"):
        data["mlflow"], data["mlflow_error"] = _mlflow(uri, state["parent_run_id"])
    data["packs"] = _pack_diff(run_dir, state)
    return data


def _mlflow(uri: str, parent: str) -> tuple[dict | None, str | None]:
    """The MLflow side, or the reason it could not be read (the report goes on)."""
    from harness.tracking.redact import redact

    saved = {k: os.environ.get(k) for k in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES",
                                            "MLFLOW_HTTP_REQUEST_TIMEOUT")}
    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"  # offline: fail fast, do not hang
    os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = "10"
    try:
        from harness.tracking.tracker import read_runs

        return read_runs(uri, parent), None
    except Exception as exc:
        return None, redact(f"{type(exc).__name__}: {exc}")[:300]
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _read_pack(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _entries(pack: dict[str, Any] | None) -> dict[tuple[str, str, str], dict[str, Any]]:
    out = {}
    for kname, by_dtype in ((pack or {}).get("kernels") or {}).items():
        for dtype, by_shape in by_dtype.items():
            for skey, entry in by_shape.items():
                out[(kname, dtype, skey)] = entry
    return out


def _pack_diff(run_dir: Path, state: dict[str, Any]) -> list[dict[str, Any]]:
    """Per pack entry: the previous and the current config and latency, and what changed."""
    rows = []
    for p in state.get("packs") or []:
        cur_path = Path(p)
        hw = cur_path.parent.name
        prev_path = run_dir / "previous_packs" / hw / cur_path.name
        cur, prev = _entries(_read_pack(cur_path)), _entries(_read_pack(prev_path))
        for key in sorted(set(cur) | set(prev)):
            c, o = cur.get(key), prev.get(key)
            if o is None:
                change = "new"
            elif c is None:
                change = "removed"
            elif c.get("config") == o.get("config"):
                change = "same config"
            else:
                change = "config changed"
            rows.append({"pack": str(cur_path), "hardware": hw, "kernel": key[0],
                         "dtype": key[1], "shape": key[2], "change": change,
                         "old_config": (o or {}).get("config"),
                         "new_config": (c or {}).get("config"),
                         "old_ms": ((o or {}).get("metrics") or {}).get("latency_ms"),
                         "new_ms": ((c or {}).get("metrics") or {}).get("latency_ms")})
    return rows


# -- HTML ------------------------------------------------------------------------------

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px;
color:#1d1d1f;background:#fff}
h1{font-size:22px;margin-bottom:4px}h2{font-size:18px;margin-top:28px;
border-bottom:1px solid #ddd;padding-bottom:4px}h3{font-size:14px;margin:16px 0 6px}
table{border-collapse:collapse;margin:8px 0;font-size:13px}
th,td{border:1px solid #ccc;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#eef2f8}td.num{text-align:right;font-variant-numeric:tabular-nums}
tr:nth-child(even) td{background:#fafafa}.muted{color:#777;font-size:12px}
.warn{background:#fff4d6;border:1px solid #e6c35c;padding:8px;margin:8px 0}
.new{color:#0a7d32;font-weight:600}.changed{color:#b35c00;font-weight:600}
img{max-width:100%;border:1px solid #eee;margin:4px 0}code{font-size:12px}
.plots{display:flex;flex-wrap:wrap;gap:8px}.plots img{max-width:48%}
"""


def _e(v: Any) -> str:
    return html.escape(str(v))


def _f(v: Any, spec: str = ".4g", suffix: str = "") -> str:
    x = _num(v)
    return "-" if x != x or math.isinf(x) else f"{x:{spec}}{suffix}"


def _cfg(config: dict[str, Any] | None) -> str:
    if not config:
        return "<span class='muted'>none</span>"
    return "<code>" + _e(" ".join(f"{k}={v}" for k, v in config.items())) + "</code>"


def _table(head: list[str], rows: list[list[str]], cls: str = "") -> str:
    th = "".join(f"<th>{_e(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(rows_cell(c) for c in r) + "</tr>" for r in rows)
    return f"<table class='{cls}'><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def rows_cell(cell: str) -> str:
    # Cells are pre-rendered HTML; numbers get the right alignment.
    num = cell[:1].isdigit() or cell == "-"
    return f"<td class='num'>{cell}</td>" if num else f"<td>{cell}</td>"


def _img(png: bytes, alt: str) -> str:
    return (f"<img alt='{_e(alt)}' src='data:image/png;base64,"
            f"{base64.b64encode(png).decode()}'>")


def render(data: dict[str, Any]) -> str:
    """The report as one HTML string."""
    from harness.tracking.redact import redact

    st = data["state"]
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>kharness report: "
             f"{_e(data['name'])}</title><style>{_CSS}</style></head><body>",
             f"<h1>Experiment <code>{_e(data['name'])}</code></h1>",
             f"<p class='muted'>generated {dt.datetime.now().isoformat(timespec='seconds')}"
             f" from {_e(data['run_dir'])}"
             + (f"; config {_e(st['config'])}" if st.get("config") else "") + "</p>"]
    studies = data["studies"]
    if any((s["result"].get("timer") or "").startswith("wall") or s["hardware"] == "cpu"
           for s in studies):
        parts.append("<div class='warn'>Some studies ran under Triton's interpreter on the "
                     "CPU: their timings say nothing about GPU performance.</div>")

    parts.append("<h2>Summary</h2>")
    rows = []
    for s in studies:
        r, c = s["result"], s["counts"]
        rows.append([_e(s["hardware"]), _e(s["kernel"]), _e(s["shape"]), _e(s["dtype"]),
                     _cfg(s["config"]), _f(r.get("latency_ms"), ".4g", " ms"),
                     _f(r.get("p20_ms"), ".4g") + " / " + _f(r.get("p80_ms"), ".4g"),
                     _f(r.get("tflops"), ".3g"), _f(r.get("gbps"), ".3g"),
                     _f(_num(r.get("roofline")) * 100, ".0f", "%"),
                     _f(s["speedup_vs_eager"], ".2f", "×"),
                     _f(s["speedup_vs_compile"], ".2f", "×"),
                     _f(s["speedup_vs_default"], ".2f", "×"),
                     _f(r.get("max_abs_err"), ".2g"),
                     f"{c['measured']}/{c['failed']}/{c['pruned']}"])
    parts.append(_table(["hardware", "kernel", "shape", "dtype", "best config", "latency",
                         "p20 / p80 ms", "TFLOP/s", "GB/s", "roofline", "vs eager",
                         "vs compile", "vs default", "max abs err", "ok/fail/pruned"],
                        rows, "summary"))

    failures = [(s, f) for s in studies for f in s["failures"]]
    if failures:
        parts.append("<h3>Failures (first per study)</h3>")
        parts.append(_table(["study", "reason"],
                            [[_e(s["study"]), _e(redact(f)[:300])] for s, f in failures]))

    parts.append("<h2>Accuracy</h2>")
    parts.append("<p class='muted'>Every config whose output was checked, by the tightest "
                 "bound its max abs error meets, and the fastest in each band (a config "
                 "the experiment's <code>max_abs_err</code> failed is counted in its band "
                 "and in the last column).</p>")
    rows = []
    for s in studies:
        for b in s["accuracy"]:
            if not b["configs"]:
                continue
            rows.append([_e(s["hardware"]), _e(s["kernel"]), _e(s["shape"]), _e(s["dtype"]),
                         _e(b["label"]), str(b["configs"]), _f(b["best_ms"], ".4g", " ms"),
                         _f(b["best_err"], ".3g"), _cfg(b["config"]),
                         str(b["failed_requirement"])])
    if rows:
        parts.append(_table(["hardware", "kernel", "shape", "dtype", "max abs err",
                             "configs", "fastest", "its max abs err", "its config",
                             "failed the required bound"], rows, "accuracy"))
    else:
        parts.append("<p class='muted'>no config's accuracy was checked</p>")

    parts.append("<h2>Across hardware</h2>")
    hws = sorted({s["hardware"] for s in studies})
    problems: dict[tuple, dict[str, dict]] = {}
    for s in studies:
        problems.setdefault((s["kernel"], s["shape"], s["dtype"]), {})[s["hardware"]] = s
    rows = []
    for (kernel, shape, dtype), by_hw in sorted(problems.items()):
        row = [_e(kernel), _e(shape), _e(dtype)]
        for hw in hws:
            s = by_hw.get(hw)
            row.append("-" if s is None else
                       f"{_f(s['result'].get('latency_ms'), '.4g', ' ms')} "
                       f"({_f(s['speedup_vs_eager'], '.2f', '×')} vs eager)<br>"
                       f"{_cfg(s['config'])}")
        rows.append(row)
    parts.append(_table(["kernel", "shape", "dtype", *hws], rows, "hardware"))

    parts.append("<h2>Pack changes</h2>")
    if data["packs"]:
        rows = []
        for p in data["packs"]:
            cls = {"new": "new", "config changed": "changed"}.get(p["change"], "")
            rows.append([_e(p["hardware"]), _e(p["kernel"]), _e(p["shape"]), _e(p["dtype"]),
                         f"<span class='{cls}'>{_e(p['change'])}</span>",
                         _cfg(p["old_config"]), _cfg(p["new_config"]),
                         _f(p["old_ms"], ".4g"), _f(p["new_ms"], ".4g")])
        parts.append(_table(["hardware", "kernel", "shape", "dtype", "change",
                             "previous config", "new config", "previous ms", "new ms"],
                            rows, "packs"))
        parts.append("<p class='muted'>previous = the pack before the last run of this "
                     "experiment (runs/&lt;name&gt;/previous_packs/)</p>")
    else:
        parts.append("<p class='muted'>no pack written by the last run</p>")

    parts.append("<h2>Plots</h2>")
    for s in studies:
        plots = s.get("plots") or {}
        if not plots:
            continue
        parts.append(f"<h3>{_e(s['kernel'])} {_e(s['shape'])} {_e(s['dtype'])} "
                     f"{_e(s['hardware'])}</h3><div class='plots'>")
        parts.extend(_img(png, f"{name} {s['study']}") for name, png in plots.items())
        parts.append("</div>")

    parts.append("<h2>MLflow</h2>")
    uri = redact(st.get("tracking_uri") or "")
    if data["mlflow"]:
        m = data["mlflow"]
        parts.append(f"<p>tracking URI <code>{_e(uri)}</code>, parent run "
                     f"<code>{_e(m['parent']['run_id'])}</code> ({_e(m['parent']['status'])})"
                     "</p>")
        parts.append(_table(["study run", "run id", "plots"],
                            [[_e(r["name"]), f"<code>{_e(r['run_id'])}</code>",
                              _e(", ".join(r["plots"]) or "-")] for r in m["studies"]]))
    else:
        parts.append(f"<p class='muted'>MLflow not read ({_e(uri or 'no tracking URI')}"
                     f"{': ' + _e(data['mlflow_error']) if data['mlflow_error'] else ''})</p>")
    parts.append("<p class='muted'>Optuna dashboard: <code>optuna-dashboard sqlite:///"
                 f"{_e(Path(data['run_dir']).resolve() / 'optuna.db')}</code></p>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(source: str, out: str | Path = "report.html", runs_dir: str | Path = "runs",
                 tracking_uri: str | None = None) -> Path:
    """Resolve ``source``, collect and render; returns the file written."""
    run_dir = _resolve(source, runs_dir, tracking_uri)
    text = render(collect(run_dir, tracking_uri))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    return out
