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
import functools
import json
import math
import os
from pathlib import Path
from typing import Any

import jinja2

from harness.tracking.plots import (
    ATTR_RESULT,
    ATTR_STATUS,
    measured,
    num,
    search_curve,
    study_plots,
)
from harness.tracking.redact import redact
from harness.tracking.tracker import find_parent, read_runs
from harness.tracking.tracker import tracking_uri as default_uri


class ReportError(Exception):
    """The report's source cannot be found or read."""


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
        err = num(res.get("max_abs_err"))
        if err != err:  # never checked (compile failure, time-out, pruned)
            continue
        row = next(r for r in rows if err <= r["bound"])
        row["configs"] += 1
        if str(res.get("reason", "")).startswith("accuracy requirement"):
            row["failed_requirement"] += 1
        ms = num(res.get("latency_ms"))
        if ms == ms and not ms >= row["best_ms"]:
            row.update(best_ms=ms, best_err=err, config=dict(t.params))
    return rows


# -- data ------------------------------------------------------------------------------


def _split_study(name: str) -> dict[str, str]:
    # experiment/kernel/shape/dtype/hardware; a kernel import path may hold '/'? no, but
    # take the outer fields from both ends so that nothing depends on it.
    parts = name.split("/")
    return {"experiment": parts[0], "kernel": "/".join(parts[1:-3]), "shape": parts[-3],
            "dtype": parts[-2], "hardware": parts[-1]}


def _speedup(base: Any, new: Any) -> float:
    b, n = num(base), num(new)
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
        ok = measured(study)
        best = min(ok, key=lambda t: t.value) if ok else None
        res = dict(best.user_attrs.get(ATTR_RESULT) or {}) if best else {}
        attrs = study.user_attrs
        base = {k: (attrs.get(k) or {}).get("latency_ms") for k in ("eager", "compile",
                                                                     "default")}
        row = {**info, "study": s.study_name, "counts": counts, "failures": reasons[:5],
               "config": dict(best.params) if best else None, "result": res,
               "baselines": base, "mlflow_run_id": attrs.get("mlflow_run_id"),
               "accuracy": accuracy_bands(study.get_trials(deepcopy=False)),
               # The regret curve's data: [device seconds spent, best ms] per trial.
               "strategy": attrs.get("strategy"), "search_curve": search_curve(study)}
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
    saved = {k: os.environ.get(k) for k in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES",
                                            "MLFLOW_HTTP_REQUEST_TIMEOUT")}
    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"  # offline: fail fast, do not hang
    os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = "10"
    try:
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


def _fmt_num(v: Any, spec: str = ".4g", suffix: str = "") -> str:
    x = num(v)
    return "-" if x != x or math.isinf(x) else f"{x:{spec}}{suffix}"


@functools.lru_cache(maxsize=1)
def _template() -> jinja2.Template:
    # A key a study lacks (no result, no plots) renders as "-" or nothing.
    env = jinja2.Environment(loader=jinja2.PackageLoader("harness.tracking", "templates"),
                             autoescape=True)
    env.filters["num"] = _fmt_num
    env.filters["b64"] = lambda png: base64.b64encode(png).decode()
    return env.get_template("report.html.j2")


def render(data: dict[str, Any]) -> str:
    """The report as one HTML string (``templates/report.html.j2``)."""
    studies = data["studies"]
    problems: dict[tuple[str, str, str], dict[str, dict]] = {}
    for s in studies:
        problems.setdefault((s["kernel"], s["shape"], s["dtype"]), {})[s["hardware"]] = s
    return _template().render(
        name=data["name"], run_dir=data["run_dir"], state=data["state"],
        generated=dt.datetime.now().isoformat(timespec="seconds"),
        interpreted=any((s["result"].get("timer") or "").startswith("wall")
                        or s["hardware"] == "cpu" for s in studies),
        studies=studies,
        failures=[(s["study"], redact(f)[:300]) for s in studies for f in s["failures"]],
        accuracy=[(s, b) for s in studies for b in s["accuracy"] if b["configs"]],
        hardware=sorted({s["hardware"] for s in studies}),
        problems=sorted(problems.items()),
        packs=data["packs"], mlflow=data["mlflow"], mlflow_error=data["mlflow_error"],
        tracking_uri=redact(data["state"].get("tracking_uri") or ""),
        optuna_db=Path(data["run_dir"]).resolve() / "optuna.db")


def write_report(source: str, out: str | Path = "report.html", runs_dir: str | Path = "runs",
                 tracking_uri: str | None = None) -> Path:
    """Resolve ``source``, collect and render; returns the file written."""
    run_dir = _resolve(source, runs_dir, tracking_uri)
    text = render(collect(run_dir, tracking_uri))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    return out
