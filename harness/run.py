"""The ``run`` job: experiment -> plan -> search on the fleet -> track -> freeze packs.

This module only wires the homes together; each decision lives in its own module.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from harness import experiment, kernel_api, spaces
from harness.fleet import Fleet, NoHardwareError, Task
from harness.kernel_api import DeviceSpec
from harness.measure import Timing, TrialResult
from harness.packs import format as packfmt
from harness.search import Search, storage_url
from harness.track import Tracker, git_sha


@dataclass
class StudyState:
    spec: experiment.StudySpec
    search: Search
    run_id: str
    device: DeviceSpec
    worker: dict[str, Any]
    in_flight: int = 0
    eager: dict[str, Any] | None = None  # the PyTorch eager baseline's result
    default: dict[str, Any] | None = None  # the kernel's default config's result
    pending: set[str] = field(default_factory=set)  # baselines in flight
    failures: int = 0
    best_ms: float = math.inf


@dataclass
class Summary:
    rows: list[dict[str, Any]] = field(default_factory=list)
    packs: list[str] = field(default_factory=list)
    missing_hardware: list[str] = field(default_factory=list)
    interpreted: bool = False
    parent_run_id: str = ""
    tracking_uri: str = ""
    wall_s: float = 0.0
    busy_s: dict[str, float] = field(default_factory=dict)


def _device_from_info(info: dict[str, Any]) -> DeviceSpec:
    return DeviceSpec(key=info["worker_hardware"], vendor=info["vendor"],
                      name=info["device_name"], sm_count=info["sm_count"],
                      smem_per_block=info["smem_per_block"], has_tma=info["has_tma"],
                      interpreted=info["interpreted"])


def _state_file(exp: experiment.Experiment) -> Path:
    return Path(exp.output.runs_dir) / exp.name / "state.json"


def run(path: str | Path, resume: bool = False, console: Console | None = None,
        progress: bool = True) -> Summary:
    """Run an experiment file end to end. Raises ExperimentError for a bad file."""
    console = console or Console(stderr=True)
    exp = experiment.load(path)  # validates everything before anything is written
    t_start = time.monotonic()
    summary = Summary()

    Fleet.connect()
    fleet = Fleet(Timing(exp.timing.warmup_ms, exp.timing.rep_ms),
                  exp.timing.trial_timeout_s)
    available = fleet.discover()
    wanted = list(available) if exp.hardware == ["auto"] else list(exp.hardware)
    summary.missing_hardware = [k for k in wanted if k not in available]
    targets = [k for k in wanted if k in available]
    for key in summary.missing_hardware:
        console.print(f"[bold red]hardware {key}: no such GPUs in this cluster[/] "
                      f"(found: {', '.join(f'{k}×{n}' for k, n in available.items())}); "
                      "its studies are skipped")
    if not targets:
        raise NoHardwareError(f"none of {wanted} is present in the cluster")
    infos = fleet.start({k: available[k] for k in targets})
    summary.interpreted = any(i["interpreted"] for group in infos.values() for i in group)
    if summary.interpreted:
        console.print("[bold yellow]No GPU: kernels run under Triton's interpreter on the CPU. "
                      "These timings say NOTHING about GPU performance; this run checks the "
                      "pipeline and correctness only.[/]")

    state_path = _state_file(exp)
    prior = json.loads(state_path.read_text()) if (resume and state_path.is_file()) else {}
    storage = storage_url(exp.output.runs_dir, exp.name)
    tracker = Tracker(exp.tracking.uri, exp.tracking.experiment or exp.name)
    summary.tracking_uri = tracker.uri
    summary.parent_run_id = tracker.start_run(
        exp.name, {"harness.level": "experiment", "harness.git_sha": git_sha(),
                   "harness.config": str(path)}, resume=prior.get("parent_run_id"))
    state_path.parent.mkdir(parents=True, exist_ok=True)
    state_path.write_text(json.dumps({"parent_run_id": summary.parent_run_id}))
    tracker.log(summary.parent_run_id, params={"kernel": exp.kernel,
                                               "sampler": exp.search.sampler,
                                               "trials_per_study": exp.search.trials})

    studies: list[StudyState] = []
    for spec in experiment.plan(exp, targets):
        worker = infos[spec.hardware][0]
        device = _device_from_info(worker)
        space = spaces.resolve([spaces.for_kernel(kernel_api.get(spec.kernel)), exp.search_space],
                               device.vendor, spec.hardware, where=str(path))
        if not resume:
            _drop_study(storage, spec.name)
        search = Search(spec, space, device, exp.search, storage, exp.seed,
                        n_parallel=fleet.size(spec.hardware))
        run_id = tracker.start_run(
            f"{spec.kernel} {spec.shape_key} {spec.dtype} {spec.hardware}",
            {"harness.level": "study", "hardware": spec.hardware, "kernel": spec.kernel,
             "shape": spec.shape_key, "dtype": spec.dtype, "device_name": worker["device_name"],
             "triton": worker["triton"], "torch": worker["torch"], "cuda": worker["cuda"],
             "git_sha": git_sha()},
            parent=summary.parent_run_id, resume=search.attr("mlflow_run_id"))
        search.set_attr("mlflow_run_id", run_id)
        st = StudyState(spec, search, run_id, device, worker,
                        eager=search.attr("eager"), default=search.attr("default"))
        best = search.best()
        if best:
            st.best_ms = best[1].get("latency_ms") or math.inf
        studies.append(st)

    _search_loop(exp, fleet, studies, tracker, console, progress)
    summary.busy_s = dict(fleet.busy_s)
    summary.packs = _freeze(exp, studies, tracker, summary.parent_run_id)
    for st in studies:
        summary.rows.append(_row(st))
        tracker.finish(st.run_id)
    for p in summary.packs:
        tracker.log_artifact(summary.parent_run_id, p, "packs")
    tracker.finish(summary.parent_run_id)
    fleet.shutdown()
    summary.wall_s = time.monotonic() - t_start
    return summary


def _drop_study(storage: str, name: str) -> None:
    import optuna

    try:
        optuna.delete_study(study_name=name, storage=storage)
    except KeyError:
        pass


def _search_loop(exp, fleet: Fleet, studies: list[StudyState], tracker: Tracker,
                 console: Console, show: bool) -> None:
    deadline = (time.monotonic() + exp.search.timeout_s) if exp.search.timeout_s else math.inf
    by_hw: dict[str, list[StudyState]] = {}
    for st in studies:
        by_hw.setdefault(st.spec.hardware, []).append(st)
    rr = dict.fromkeys(by_hw, 0)

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TextColumn("{task.fields[status]}"),
                  console=console, disable=not show, transient=False) as prog:
        bars = {hw: prog.add_task(f"{hw:>6}", total=sum(min(s.search.settings.trials,
                                                             s.search.grid) for s in sts),
                                  completed=sum(s.search.measured for s in sts), status="")
                for hw, sts in by_hw.items()}

        def refresh(hw: str) -> None:
            sts = by_hw[hw]
            best = [f"{s.spec.shape_key}: {s.best_ms:.3g} ms" for s in sts if s.best_ms < math.inf]
            fails = sum(s.failures for s in sts)
            prog.update(bars[hw], completed=sum(s.search.measured - s.in_flight for s in sts),
                        status=f"best {'; '.join(best[-2:]) or '-'} | failed {fails}")

        while True:
            out_of_time = time.monotonic() > deadline
            for hw, sts in by_hw.items():
                while fleet.idle(hw) and not out_of_time:
                    task = _next_task(sts, rr, hw)
                    if task is None:
                        break
                    fleet.submit(task)
            if fleet.in_flight() == 0:
                break
            for task, result in fleet.poll(0.5):
                _handle(task, result, tracker)
                refresh(task.hardware)
        for hw in by_hw:
            refresh(hw)


def _next_task(sts: list[StudyState], rr: dict[str, int], hw: str) -> Task | None:
    """Round-robin over the hardware's studies: the baselines first (PyTorch eager and
    the kernel's default config, measured even where the default is outside the space),
    then trials."""
    n = len(sts)
    for i in range(n):
        st = sts[(rr[hw] + i) % n]
        spec = st.spec
        if st.eager is None and "eager" not in st.pending:
            st.pending.add("eager")
            rr[hw] = (rr[hw] + i + 1) % n
            return Task(hw, "eager", (spec.kernel, spec.shape, spec.dtype, 0, False),
                        ("eager", st))
        if st.default is None and "default" not in st.pending:
            st.pending.add("default")
            rr[hw] = (rr[hw] + i + 1) % n
            default = kernel_api.get(spec.kernel).default_config
            return Task(hw, "measure", (spec.kernel, spec.shape, spec.dtype, default, 0),
                        ("default", st))
        asked = st.search.ask(st.in_flight)
        if asked is None:
            continue
        trial, config = asked
        st.in_flight += 1
        rr[hw] = (rr[hw] + i + 1) % n
        return Task(hw, "measure", (spec.kernel, spec.shape, spec.dtype, config, 0),
                    ("trial", st, trial, config))
    return None


def _handle(task: Task, result: TrialResult, tracker: Tracker) -> None:
    kind, st = task.tag[0], task.tag[1]
    if kind in ("eager", "default"):
        st.pending.discard(kind)
        setattr(st, kind, result.to_dict())
        st.search.set_attr(kind, result.to_dict())
        tracker.log(st.run_id, metrics={f"{kind}_latency_ms": result.latency_ms},
                    params={f"{kind}_status": "ok" if result.ok else result.reason[:400]})
        return
    _, st, trial, config = task.tag
    st.in_flight -= 1
    st.search.tell(trial, config, result)
    status = "measured" if result.ok else "failed"
    if result.ok:
        st.best_ms = min(st.best_ms, result.latency_ms)
    else:
        st.failures += 1
    tracker.log_trial(st.run_id, trial.number, config, result.to_dict(), status)


def _speedup(base: Any, new: Any) -> float:
    if not base or not new or not (base == base) or not (new == new):
        return math.nan
    return float(base) / float(new)


def _outcome(st: StudyState) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The study's winner (full config) and its metrics against the baselines."""
    best = st.search.best()
    if best is None:
        return None
    config, res = best
    fam = kernel_api.get(st.spec.kernel)
    default_res = st.default or {}
    eager_ms = (st.eager or {}).get("latency_ms")
    metrics = {k: res.get(k) for k in ("latency_ms", "p20_ms", "p80_ms", "tflops", "gbps",
                                       "roofline", "max_abs_err", "max_rel_err")}
    metrics.update({
        "eager_latency_ms": eager_ms,
        "default_latency_ms": default_res.get("latency_ms"),
        "speedup_vs_eager": _speedup(eager_ms, res.get("latency_ms")),
        "speedup_vs_default": _speedup(default_res.get("latency_ms"), res.get("latency_ms")),
    })
    return {**fam.default_config, **config}, metrics


def _freeze(exp, studies: list[StudyState], tracker: Tracker, parent: str) -> list[str]:
    """Write each study's winner into its (hardware, kernel) pack."""
    groups: dict[tuple[str, str, str], dict[str, dict[str, Any]]] = {}
    now = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    for st in studies:
        out = _outcome(st)
        if out is None:
            continue
        config, metrics = out
        w = st.worker
        groups.setdefault((st.spec.hardware, st.spec.kernel, st.spec.dtype), {})[
            st.spec.shape_key] = {
            "config": config,
            "metrics": metrics,
            "provenance": {
                "device_name": w["device_name"], "triton": w["triton"], "torch": w["torch"],
                "cuda": w["cuda"], "date": now, "mlflow_run_id": st.run_id,
                "experiment": exp.name, "git_sha": git_sha(),
                "interpreted": w["interpreted"], "trials": st.search.counts(),
            },
        }
        tracker.log(st.run_id, params={f"best.{k}": v for k, v in config.items()},
                    metrics={f"best_{k}": v for k, v in metrics.items()})
    paths = []
    for (hw, kernel, dtype), entries in groups.items():
        name = kernel_api.get(kernel).name
        paths.append(str(packfmt.freeze(exp.output.packs_dir, hw, name, dtype, entries)))
    return sorted(set(paths))


def _row(st: StudyState) -> dict[str, Any]:
    row: dict[str, Any] = {
        "hardware": st.spec.hardware, "kernel": st.spec.kernel, "shape": st.spec.shape_key,
        "dtype": st.spec.dtype, "counts": st.search.counts(), "mlflow_run_id": st.run_id,
        "failures": [r for _, r in st.search.failures()][:5],
    }
    out = _outcome(st)
    if out:
        row["config"], metrics = out
        row["params"] = st.search.best()[0]  # type: ignore[index]
        row.update(metrics)
    return row
