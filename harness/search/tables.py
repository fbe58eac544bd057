"""Recorded tables: exhaustive sweeps exported from their Optuna studies, for replay.

A *recorded table* is one study of a grid sweep (``configs/sweeps/*.yaml``, sampler
``grid``, trials = grid size) exported to a JSON file, one per (hardware, kernel, shape,
dtype); a table of more than ``GZIP_ROWS`` rows (a large space, mostly its statically
pruned configs) is written gzipped, ``.json.gz``, and read the same way::

    {"format": "kharness-replay/1", "kernel": ..., "shape": {...}, "dtype": ...,
     "hardware": "H200", "device_name": ..., "date": ..., "commit": ...,
     "space": {param: [choices]},
     "grid_size": N, "complete": true, "default_config": {...},
     "trials": [{"config": {...}, "status": "ok" | "failed" | "pruned",
                 "median_ms", "p20_ms", "p80_ms", "cost_s", "reason", ...}, ...]}

**Cost of a trial** (``cost_s``, the GPU time the replay charges for it): the measuring
worker's ``timing_s`` (seconds inside the timer) plus its ``compile_s`` (the first launch:
compile, or with the workers' compile-ahead a load from Triton's cache), both from the
trial's stored result. Where ``compile_s`` is missing (a config that failed before its
first launch returned), the compile-ahead child's time (``precompile_s``) stands in, else
the median ``compile_s`` of the study's other trials. Pruned configs cost nothing: static
pruning rejects them on the driver. Not counted: the accuracy check and the worker's
waits, which every config pays alike.

Reading tables needs no Optuna; exporting them does.
"""

from __future__ import annotations

import functools
import gzip
import json
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.search.keys import config_key

FORMAT = "kharness-replay/1"
STATUSES = ("ok", "failed", "pruned")
#: The harness's statuses -> the table's; duplicates and interrupted trials are skipped.
_FROM_HARNESS = {"measured": "ok", "failed": "failed", "pruned": "pruned"}
DEFAULT_TOL = 0.02
#: Tables of more rows than this are written gzipped (``.json.gz``): a large space's
#: pruned configs are most of its rows and compress about 30-fold.
GZIP_ROWS = 1000
#: The file names a table may have.
SUFFIXES = (".json", ".json.gz")


def _num(x: Any) -> float | None:
    """A finite float rounded to 6 significant digits, else None (keeps the files small)."""
    try:
        f = float(x)
    except (TypeError, ValueError):
        return None
    return float(f"{f:.6g}") if math.isfinite(f) else None


# -- recorded tables ------------------------------------------------------------------


@dataclass
class Table:
    """One recorded exhaustive sweep (a loaded table file)."""

    data: dict[str, Any]
    path: str = ""

    def __post_init__(self) -> None:
        self.space: dict[str, list[Any]] = {k: list(v) for k, v in self.data["space"].items()}
        self.trials: list[dict[str, Any]] = list(self.data["trials"])
        self.by_key = {config_key(t["config"]): t for t in self.trials}
        # A table does not change once loaded: its rows by status are sorted out once
        # (a replay reads them at every pruned config it launches).
        self._of: dict[str, list[dict[str, Any]]] = {s: [] for s in STATUSES}
        for t in self.trials:
            self._of.setdefault(t["status"], []).append(t)

    @classmethod
    def load(cls, path: str | Path) -> Table:
        """A table file: ``.json``, or gzipped ``.json.gz``."""
        opener = gzip.open if str(path).endswith(".gz") else open
        with opener(path, "rt") as f:
            data = json.load(f)
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"{path}: not a {FORMAT} table")
        return cls(data, str(path))

    # -- what it holds ------------------------------------------------------------------
    @property
    def name(self) -> str:
        d = self.data
        shape = ",".join(f"{k}={v}" for k, v in d["shape"].items())
        # The grid is part of a case's name: one shape is swept over spaces of different
        # sizes (a family's declared grid, a user's widened one).
        grid = (f" (grid {self.grid_size})" if self.complete
                else f" (sub-grid: {len(self.by_key)} of {self.grid_size})")
        return f"{d['hardware']}/{d['kernel']}/{shape}/{d['dtype']}{grid}"

    @property
    def grid_size(self) -> int:
        n = 1
        for choices in self.space.values():
            n *= len(choices)
        return n

    @property
    def complete(self) -> bool:
        """Every grid point has a record (a sweep cut short leaves holes)."""
        return len(self.by_key) >= self.grid_size

    def of(self, status: str) -> list[dict[str, Any]]:
        return list(self._of.get(status, ()))

    @functools.cached_property
    def optimum_ms(self) -> float:
        """The grid optimum: the fastest recorded median."""
        return min(t["median_ms"] for t in self._of["ok"])

    @property
    def optimum(self) -> dict[str, Any]:
        return min(self._of["ok"], key=lambda t: t["median_ms"])["config"]

    @functools.cached_property
    def grid_cost_s(self) -> float:
        """GPU time of the whole (statically pruned) grid: what our exhaustive sweep paid."""
        return sum(t["cost_s"] for t in self.trials if t["status"] != "pruned")

    @functools.cached_property
    def pruned_cost_s(self) -> float:
        """Estimated GPU time a pruned config would cost if it were launched anyway: that
        of a typical measured config (the median). Some would fail at their first launch
        (shared memory) and cost less, others (register spills) run and cost as much."""
        est = self.data.get("pruned_cost_estimate_s")
        return float(est) if est is not None else _pruned_estimate(self.trials)

    @property
    def unpruned_grid_cost_s(self) -> float:
        """GPU time of the grid without static pruning (every config launched)."""
        return self.grid_cost_s + len(self._of["pruned"]) * self.pruned_cost_s

    def within(self, tol: float = DEFAULT_TOL) -> int:
        """How many configs are within ``tol`` of the optimum (how easy the case is)."""
        target = self.optimum_ms * (1 + tol)
        return sum(1 for t in self._of["ok"] if t["median_ms"] <= target)

    def lookup(self, config: Mapping[str, Any]) -> dict[str, Any] | None:
        return self.by_key.get(config_key(config))


def _compile_estimate(trials: Sequence[Mapping[str, Any]]) -> float:
    """The median time to compile one config: the compile-ahead child's time where
    recorded (the real compile), else the worker's first launch."""
    xs = [t.get("precompile_s") for t in trials if t.get("precompile_s") is not None]
    if not xs:
        xs = [t.get("compile_s") for t in trials if t.get("compile_s") is not None]
    return float(statistics.median(xs)) if xs else 1.0


def _pruned_estimate(trials: Sequence[Mapping[str, Any]]) -> float:
    xs = [t["cost_s"] for t in trials if t["status"] == "ok" and t.get("cost_s") is not None]
    return float(statistics.median(xs)) if xs else 0.0


def table_paths(root: str | Path) -> list[Path]:
    """The table files under ``root``: ``<root>/<HW>/*.json`` and ``*.json.gz``."""
    root = Path(root)
    return sorted(p for suffix in SUFFIXES for p in root.glob(f"*/*{suffix}"))


def load_tables(root: str | Path, complete_only: bool = True) -> list[Table]:
    """Every table under ``root`` (``<root>/<HW>/*.json[.gz]``, or ``root`` itself a
    file)."""
    root = Path(root)
    paths = [root] if root.is_file() else table_paths(root)
    tables = []
    for p in paths:
        try:
            t = Table.load(p)
        except (ValueError, KeyError, OSError, json.JSONDecodeError):
            continue  # report files and anything else that is not a table
        if t.of("ok") and (t.complete or not complete_only):
            tables.append(t)
    return tables


def dumps(table: Mapping[str, Any]) -> str:
    """JSON with one trial per line: small, and diffs of a re-recorded sweep stay legible."""
    head = [f" {json.dumps(k)}: {json.dumps(v)}" for k, v in table.items() if k != "trials"]
    rows = ",\n".join("  " + json.dumps(t) for t in table["trials"])
    return "{\n" + ",\n".join(head) + ',\n "trials": [\n' + rows + "\n ]\n}\n"


# -- export from an Optuna study --------------------------------------------------------


def _split_study_name(name: str) -> dict[str, Any]:
    """``experiment/kernel/shape_key/dtype/hardware`` (``StudySpec.name``)."""
    parts = name.split("/")
    if len(parts) != 5:
        raise ValueError(f"study {name!r} is not named experiment/kernel/shape/dtype/hardware")
    experiment, kernel, shape_key, dtype, hardware = parts
    shape = {}
    for item in shape_key.split(","):
        k, _, v = item.partition("=")
        shape[k] = int(v)
    return {"experiment": experiment, "kernel": kernel, "shape": shape, "shape_key": shape_key,
            "dtype": dtype, "hardware": hardware}


def case_filename(kernel: str, shape: Mapping[str, int], dtype: str, grid: int) -> str:
    """``<kernel>__<shape>__<dtype>__g<grid size>.json``: a shape swept over two spaces
    is two files."""
    shape_part = "_".join(f"{k}{v}" for k, v in shape.items())
    safe_kernel = "".join(c if c.isalnum() or c in "-_" else "-" for c in kernel)
    return f"{safe_kernel}__{shape_part}__{dtype}__g{grid}.json"


def _record(t: Any, status: str) -> dict[str, Any]:
    from harness.search.study import ATTR_REASON, ATTR_RESULT

    res = t.user_attrs.get(ATTR_RESULT) or {}
    extra = res.get("extra") or {}
    pre = extra.get("precompile") or {}
    rec: dict[str, Any] = {"config": dict(t.params), "status": status}
    if status == "ok":
        rec.update(median_ms=_num(res.get("latency_ms", t.value)), p20_ms=_num(res.get("p20_ms")),
                   p80_ms=_num(res.get("p80_ms")))
    if status != "pruned":
        rec.update(timing_s=_num(res.get("timing_s")) or 0.0, compile_s=_num(res.get("compile_s")),
                   precompile_s=_num(pre.get("compile_s")))
    reason = t.user_attrs.get(ATTR_REASON) or res.get("reason")
    if status != "ok" and reason:
        rec["reason"] = str(reason).splitlines()[0][:200]
    return rec


#: The largest grid whose never-asked configs an export checks one by one.
MAX_EXPORT_GRID = 200_000


def _never_asked(meta: Mapping[str, Any], space: Mapping[str, Sequence[Any]],
                 records: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The configs of a sweep's grid that its sampler never asked for because static
    pruning rejects them (the samplers draw valid configs only), recorded ``pruned`` with
    the kernel's reason on the hardware key's static spec."""
    import itertools

    grid = math.prod(len(c) for c in space.values())
    if not space or grid > MAX_EXPORT_GRID or len(records) >= grid:
        return []
    try:
        from harness.kernel import api as kernel_api
        from harness.measure.hardware import spec_for_key

        fam = kernel_api.get(meta["kernel"])
        device = spec_for_key(meta["hardware"])
    except Exception:  # a family that cannot be imported here: the holes stay
        return []
    out = []
    for values in itertools.product(*space.values()):
        config = dict(zip(space, values, strict=True))
        if config_key(config) in records:
            continue
        reason = fam.check({**fam.default_config, **config}, meta["shape"], meta["dtype"],
                           device)
        if reason:
            out.append({"config": config, "status": "pruned",
                        "reason": str(reason).splitlines()[0][:200]})
    return out


def export_study(storage: Any, study_name: str, commit: str | None = None) -> dict[str, Any]:
    """One study of a sweep as a recorded table (see the module docstring). ``commit``:
    the code's commit that ran the sweep (default: this checkout's, ``HARNESS_GIT_SHA``
    where it runs from a copy without ``.git``; export right after the run)."""
    import optuna

    from harness.search.study import ATTR_RESULT, ATTR_STATUS

    meta = _split_study_name(study_name)
    study = optuna.load_study(study_name=study_name, storage=storage)
    trials = study.get_trials(deepcopy=False)
    space: dict[str, list[Any]] = {}
    records: dict[str, dict[str, Any]] = {}
    device_name, started = "", None
    for t in trials:
        for name, dist in t.distributions.items():
            if name not in space and hasattr(dist, "choices"):
                space[name] = list(dist.choices)
        if t.datetime_start and (started is None or t.datetime_start < started):
            started = t.datetime_start
        status = _FROM_HARNESS.get(t.user_attrs.get(ATTR_STATUS, ""))
        if status is None or not t.params:
            continue  # duplicates (answered from the study), interrupted, unfinished
        ok_state = {"ok": optuna.trial.TrialState.COMPLETE, "failed": optuna.trial.TrialState.FAIL,
                    "pruned": optuna.trial.TrialState.PRUNED}[status]
        if t.state != ok_state:
            continue
        key = config_key(t.params)
        if key in records and records[key]["status"] != "pruned":
            continue  # the first measurement of a config counts
        records[key] = _record(t, status)
        device_name = device_name or ((t.user_attrs.get(ATTR_RESULT) or {}).get("extra")
                                      or {}).get("device_name", "")
    recs = [*records.values(), *_never_asked(meta, space, records)]
    fallback = _compile_estimate(recs)
    for r in recs:
        if r["status"] == "pruned":
            r["cost_s"] = 0.0
            continue
        compile_s = r.get("compile_s")
        if compile_s is None:
            compile_s = r.get("precompile_s") if r.get("precompile_s") is not None else fallback
        r["cost_s"] = _num(r["timing_s"] + compile_s)
        for k in [k for k, v in r.items() if v is None]:
            del r[k]
    attrs = study.user_attrs
    eager = (attrs.get("eager") or {}).get("latency_ms")
    default = (attrs.get("default") or {}).get("latency_ms")
    if not device_name:
        device_name = ((attrs.get("eager") or {}).get("extra") or {}).get("device_name", "")
    grid = 1
    for choices in space.values():
        grid *= len(choices)
    try:
        from harness.kernel import api as kernel_api

        default_config = dict(kernel_api.get(meta["kernel"]).default_config)
    except Exception:  # a family that cannot be imported here: the replay skips warm start
        default_config = None
    return {
        "format": FORMAT,
        "kernel": meta["kernel"],
        "shape": meta["shape"],
        "dtype": meta["dtype"],
        "hardware": meta["hardware"],
        "device_name": device_name,
        "date": started.date().isoformat() if started else "",
        "commit": commit or _git_sha(),
        "experiment": meta["experiment"],
        "study": study_name,
        "space": space,
        "grid_size": grid,
        "complete": len(recs) >= grid,
        "counts": {s: sum(1 for r in recs if r["status"] == s) for s in STATUSES},
        "default_config": default_config,
        "baselines_ms": {"eager": _num(eager), "default": _num(default)},
        "pruned_cost_estimate_s": _num(_pruned_estimate(recs)),
        "cost_model": "cost_s = timing_s + compile_s of the measuring worker (see "
                      "harness/search/tables.py); pruned configs cost 0",
        "trials": recs,
    }


def _git_sha() -> str:
    from harness.tracking.tracker import git_sha

    return git_sha()


def _storage(url: str) -> Any:
    from harness.search.storage import make_storage

    return make_storage(url)


def write(table: Mapping[str, Any], path: str | Path) -> Path:
    """Write a table: ``.json.gz`` gzipped (``dumps``' text), any other name as is."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = dumps(table)
    if path.name.endswith(".gz"):
        # mtime 0: the same table gives the same bytes (a re-export leaves git clean).
        path.write_bytes(gzip.compress(text.encode(), mtime=0))
    else:
        path.write_text(text)
    return path


def export(storage_url: str, out: str | Path, study: str | None = None,
           commit: str | None = None) -> list[Path]:
    """Export the studies of one Optuna storage. ``out`` ending in ``.json`` (or
    ``.json.gz``) is the file for a single study; otherwise it is a directory and each
    study goes to ``<out>/<hardware>/<kernel>__<shape>__<dtype>.json``, ``.json.gz`` for
    a table of more than ``GZIP_ROWS`` rows."""
    import optuna

    storage = _storage(storage_url)
    names = [study] if study else [s.study_name for s in optuna.get_all_study_summaries(storage)]
    out = Path(out)
    single = out.name.endswith(SUFFIXES)
    if single and len(names) != 1:
        raise ValueError(f"{storage_url} holds {len(names)} studies: name one with --study, "
                         "or give a directory as --out")
    written = []
    for name in names:
        table = export_study(storage, name, commit)
        if single:
            path = out
        else:
            path = out / table["hardware"] / case_filename(
                table["kernel"], table["shape"], table["dtype"], table["grid_size"])
            if len(table["trials"]) > GZIP_ROWS:
                path = path.with_name(path.name + ".gz")
            # A re-export in the other form replaces the first.
            other = (path.with_name(path.name[:-3]) if path.name.endswith(".gz")
                     else path.with_name(path.name + ".gz"))
            other.unlink(missing_ok=True)
        written.append(write(table, path))
    return written


def export_all(runs_dir: str | Path, out_dir: str | Path,
               experiments: Iterable[str] | None = None,
               commit: str | None = None) -> list[Path]:
    """Export every study of every experiment under ``runs_dir`` (or of the named ones)."""
    runs_dir = Path(runs_dir)
    names = list(dict.fromkeys(experiments)) if experiments is not None else sorted(
        p.parent.name for p in runs_dir.glob("*/optuna.db"))
    written = []
    for name in names:
        db = runs_dir / name / "optuna.db"
        if db.is_file():
            written += export(f"sqlite:///{db.resolve()}", out_dir, commit=commit)
    return written


def recorded(config_path: str | Path) -> tuple[bool, str]:
    """Whether an experiment's sweep is already recorded completely in its runs dir:
    every (shape, dtype) has a study there and every study holds the whole grid."""
    import optuna

    from harness import experiment

    exp = experiment.load(config_path)
    db = Path(exp.output.runs_dir) / exp.name / "optuna.db"
    if not db.is_file():
        return False, f"no {db}"
    storage = _storage(f"sqlite:///{db.resolve()}")
    names = [s.study_name for s in optuna.get_all_study_summaries(storage)]
    if len(names) < len(exp.shapes) * len(exp.dtypes):
        return False, f"{len(names)} of {len(exp.shapes) * len(exp.dtypes)} studies in {db}"
    for name in names:
        table = export_study(storage, name)
        if not table["complete"]:
            return False, f"{name}: {len(table['trials'])} of {table['grid_size']} configs"
    return True, f"{len(names)} complete studies in {db}"
