"""One experiment's part of a run: its file, its lock and summary, and what the run keeps
of it (its MLflow tracker and logger, its Optuna storage, its studies). A run of one file
has one member; a campaign (``harness.run.campaign``) has one per file, all on one fleet,
each writing its own packs, MLflow experiment and ``runs/<name>/``.

The fleet-wide settings of several files (``shared_fleet``) are here too: one set of
workers serves them all.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from harness import experiment
from harness.fleet import Fleet, Task
from harness.kernel.api import DeviceSpec, Kernel
from harness.measure.timing import TrialResult
from harness.run import freeze, schedule
from harness.run.results import Summary, fleet_metrics
from harness.search import Search, warmstart
from harness.search.write_behind import WriteBehindStorage
from harness.tracking import run_logging
from harness.tracking.redact import redact
from harness.tracking.run_logging import Logs, trial_record
from harness.tracking.tracker import Tracker, git_sha

#: A campaign's experiment names as one tag of each parent run, cut to MLflow's limit.
MAX_TAG = 5000


@dataclass
class Member:
    """One experiment of a run and the state the run keeps of it. Its plan, tracker,
    logger, storage and files are set as the run reaches them (``execute``): the plan
    once its file is checked, and again with its studies once its hardware is known."""

    path: str | Path
    exp: experiment.Experiment
    resume: bool
    summary: Summary
    lock: experiment.RunLock
    targets: list[str] = field(default_factory=list)  # its hardware keys in the cluster
    plan: experiment.ExperimentPlan | None = None
    skipped: bool = False  # none of its hardware is in the cluster (or started)
    studies: list[schedule.StudyState] = field(default_factory=list)
    run_state: dict[str, Any] = field(default_factory=dict)
    logged: dict | None = None  # on --resume: what the previous run logged to MLflow
    plotted: set[str] = field(default_factory=set)
    frozen: bool = False  # its packs are written (``freeze_packs``)
    tracker: Tracker = field(init=False, repr=False)
    logs: Logs = field(init=False, repr=False)
    storage: WriteBehindStorage = field(init=False, repr=False)
    state_path: Path = field(init=False, repr=False)
    trial_log: Path = field(init=False, repr=False)

    @property
    def name(self) -> str:
        return self.exp.name

    @property
    def mlflow_experiment(self) -> str:
        return self.exp.tracking.experiment or self.exp.name

    @property
    def planned(self) -> list[experiment.StudySpec]:
        """Its planned studies (none before its hardware is known, or without any)."""
        return self.plan.specs if self.plan is not None else []


def shared_fleet(exps: Sequence[experiment.Experiment]) -> experiment.FleetSettings:
    """The fleet settings of one fleet serving ``exps``: where the files agree, theirs;
    where they differ, the most any of them allows (time-outs, retries, waits, how long
    workers are kept) and, for how the fleet is sized and kept, ``auto``."""
    settings = [e.fleet for e in exps]
    out: dict[str, Any] = {}
    for name in experiment.FleetSettings.model_fields:
        values = [getattr(s, name) for s in settings]
        if all(v == values[0] for v in values):
            out[name] = values[0]
        elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            out[name] = max(values) if name not in ("queue_depth", "compile_workers") else "auto"
        else:
            out[name] = "auto"
    return experiment.FleetSettings.model_validate(out)


def trial_timeout_s(exps: Sequence[experiment.Experiment]) -> float:
    """The fleet's hang time-out: the longest any experiment allows its trials."""
    return max(e.timing.trial_timeout_s for e in exps)


def own_timing(exp: experiment.Experiment, fleet_timing: Mapping[str, float]) -> dict[str, float]:
    """The do_bench budgets where ``exp``'s differ from the fleet's defaults (those of a
    campaign's first file): sent with each of its tasks; {} where they agree."""
    mine = {"warmup_ms": exp.timing.warmup_ms, "rep_ms": exp.timing.rep_ms}
    return {k: v for k, v in mine.items() if fleet_timing.get(k) != v}


def overlaps(members: Sequence[Member]) -> list[str]:
    """Studies of different experiments that freeze into the same pack entry (packs
    folder, kernel, shape, dtype, hardware): the one frozen last is what the pack keeps,
    and neither saw the other's winner as its incumbent. In words, one line each."""
    first: dict[tuple, str] = {}
    out = []
    for m in members:
        packs = Path(m.exp.output.packs_dir).resolve()
        for spec in m.planned:
            key = (packs, spec.kernel, spec.shape_key, spec.dtype, spec.hardware)
            other = first.setdefault(key, m.name)
            if other != m.name:
                out.append(f"experiments {other} and {m.name} both tune {spec.kernel} "
                           f"{spec.shape_key} {spec.dtype} on {spec.hardware} into {packs}: "
                           "the winner of the one that finishes last is the one the pack "
                           "keeps")
    return out


def device_from_info(info: dict[str, Any], static: DeviceSpec) -> DeviceSpec:
    """The study's device: what the worker sees, or, for a worker that runs the
    interpreter on a node standing in for a GPU type (a simulated cluster), that type's
    static spec (``static``: the plan's), so that the study prunes and picks its
    vendor's space as on the GPU."""
    key = info["worker_hardware"]
    if info["interpreted"] and key != "cpu":
        return dataclasses.replace(static, interpreted=True)
    return DeviceSpec(key=key, vendor=info["vendor"],
                      name=info["device_name"], sm_count=info["sm_count"],
                      smem_per_block=info["smem_per_block"], has_tma=info["has_tma"],
                      interpreted=info["interpreted"],
                      has_wgmma=bool(info.get("has_wgmma", False)))


def state_file(exp: experiment.Experiment) -> Path:
    return Path(exp.output.runs_dir) / exp.name / "state.json"


def trial_log_file(exp: experiment.Experiment) -> Path:
    """Which trials have their MLflow run: one JSON line per trial, written after the run
    is logged, so that a resumed run logs exactly the trials a killed driver had not."""
    return Path(exp.output.runs_dir) / exp.name / "mlflow_trials.jsonl"


def start_tracking(m: Member, campaign: Sequence[str] = ()) -> None:
    """The experiment's parent MLflow run, runs/<name>/state.json and the trial record
    (on resume: what the previous run logged, None without a record). ``campaign``: the
    names of the experiments run with it on one fleet (none: it ran alone)."""
    exp, tracker, summary = m.exp, m.tracker, m.summary
    m.state_path = state_file(exp)
    m.trial_log = trial_log_file(exp)
    prior = json.loads(m.state_path.read_text()) if (m.resume and m.state_path.is_file()) else {}
    tags = {"harness.level": "experiment", "harness.git_sha": git_sha(),
            "harness.config": str(m.path)}
    if campaign:
        tags["harness.campaign"] = ",".join(campaign)[:MAX_TAG]
    summary.parent_run_id = tracker.start_run(exp.name, tags,
                                              resume=prior.get("parent_run_id"))
    m.state_path.parent.mkdir(parents=True, exist_ok=True)
    m.run_state = {"parent_run_id": summary.parent_run_id, "tracking_uri": redact(tracker.uri),
                   "mlflow_experiment": m.mlflow_experiment,
                   "config": str(Path(m.path).resolve()),
                   "packs_dir": str(Path(exp.output.packs_dir).resolve())}
    m.state_path.write_text(json.dumps(m.run_state))
    # A resume reconciles MLflow with Optuna only where the previous run kept a record.
    m.logged = run_logging.logged(m.trial_log) if m.resume else None
    if m.logged is None:
        m.trial_log.write_text("")
    tracker.log(summary.parent_run_id, params={"kernel": exp.kernel,
                                               "strategy": exp.search.strategy,
                                               "trials_per_study": exp.search.trials},
                tags={"harness.missing_hardware": ",".join(summary.missing_hardware) or "-"})


def study(m: Member, planned: experiment.StudyPlan, worker: dict[str, Any],
          fleet: Fleet) -> schedule.StudyState:
    """One study set up from its plan on the device its workers see: its Optuna study
    (seeded from the packs), its MLflow run, its baselines from an earlier run."""
    exp, tracker = m.exp, m.tracker
    spec, device, fam, space = planned.spec, planned.device, planned.family, planned.space
    seeds = (warmstart.seeds_from_packs(planned.packs_dir, fam, spec.dtype,
                                        spec.hardware, spec.shape, space, device)
             if planned.search.seed_from_packs and not m.resume else [])
    search = Search(spec, space, device, planned.search, m.storage, planned.seed,
                    n_parallel=fleet.depth(spec.hardware), seeds=seeds,
                    check=planned.check, default_config=planned.default_config)
    run_id = tracker.start_run(
        f"{spec.kernel} {spec.shape_key} {spec.dtype} {spec.hardware}",
        {"harness.level": "study", "hardware": spec.hardware, "kernel": spec.kernel,
         "shape": spec.shape_key, "dtype": spec.dtype, "device_name": worker["device_name"],
         "triton": worker["triton"], "torch": worker["torch"], "cuda": worker["cuda"],
         "git_sha": git_sha()},
        parent=m.summary.parent_run_id, resume=search.attr("mlflow_run_id"))
    search.set_attr("mlflow_run_id", run_id)
    st = schedule.StudyState(planned, search, run_id, worker,
                             eager=search.attr("eager"), default=search.attr("default"),
                             compiled=search.attr("compile"),
                             want_compile=want_compile(exp, device, fam),
                             timing=own_timing(exp, fleet.timing))
    best = search.best()
    if best:
        st.best_ms = best[1].get("latency_ms") or math.inf
    return st


def report_resume(m: Member, console: Console) -> None:
    """What ``--resume`` found of each study, and the trials MLflow lacked, logged now."""
    for st in m.studies:
        search = st.search
        relogged = (run_logging.reconcile(st, m.tracker, m.trial_log, m.logged)
                    if m.logged is not None else 0)
        m.summary.resumed[st.spec.name] = {
            "finished": search.measured, "requeued": search.interrupted,
            "recovered": search.recovered, "mlflow_relogged": relogged}
        if search.interrupted or relogged:
            console.print(f"resume {st.spec.name}: {search.measured} trials kept, "
                          f"{len(search.interrupted)} interrupted configs queued again, "
                          f"{relogged} trial runs logged to MLflow")


def record(task: Task, result: TrialResult, m: Member) -> None:
    """A search task's result: told to its study (Optuna first: it is what --resume
    trusts), then held for the experiment's MLflow logger until Optuna has stored it."""
    kind, st, trial, config = task.tag
    key = (st.search.study.study_name, trial.number)
    if kind == "cheap":
        if not st.search.cheap(trial, config, result):
            st.full.append((trial, config))  # may win: measured in full next
            return
        if result.ok:  # cut by the pruner after its cheap pass
            st.in_flight -= 1
            m.logs.hold(key, m.trial_log, trial_record(st, trial.number, dict(config),
                                                       result.to_dict(), "cut"))
            return
    else:
        st.search.tell(trial, config, result)
    st.in_flight -= 1
    if result.ok:
        st.best_ms = min(st.best_ms, result.latency_ms)
    else:
        st.failures += 1
    m.logs.hold(key, m.trial_log, trial_record(st, trial.number, dict(config),
                                               result.to_dict(),
                                               "measured" if result.ok else "failed"))


def log_baselines(st: schedule.StudyState, m: Member) -> None:
    """The study's baselines, as its final phase timed them, into its MLflow run."""
    for name in st.baselines:
        res = getattr(st, "compiled" if name == "compile" else name) or {}
        ok = res.get("ok", True)
        m.logs.log(st.run_id, metrics={f"{name}_latency_ms": res.get("latency_ms")},
                   params={f"{name}_status": "ok" if ok else str(res.get("reason"))[:400]})


def freeze_packs(m: Member) -> None:
    """The experiment's packs written from its studies, once: in a campaign as soon as
    its last study is done (a campaign stopped later keeps them), else after the search."""
    if m.frozen:
        return
    m.frozen = True
    freeze.keep_previous_packs(m.exp, m.studies)
    m.summary.packs = freeze.freeze(m.exp, m.studies, m.logs, m.summary.parent_run_id)
    m.summary.mark("packs_frozen")
    m.state_path.write_text(json.dumps({**m.run_state, "packs": m.summary.packs}))


def plots(m: Member, st: schedule.StudyState) -> None:
    """A study's plots, drawn by the experiment's logger once its search has ended."""
    if st.spec.name not in m.plotted:
        m.plotted.add(st.spec.name)
        study = st.search.study
        m.logs.trial_plots(st.run_id, study.get_trials(deepcopy=False),
                           study.direction.name.lower(), st.spec.name)


def log_summary(m: Member, figures: Summary, campaign: bool) -> None:
    """The run's figures and packs into the experiment's parent MLflow run, once all else
    is done. ``campaign``: the fleet served other experiments too: its figures are the
    campaign's, logged as ``campaign_*``. Sent to the experiment's MLflow logger after
    everything before it, as the run's last words there."""
    metrics = fleet_metrics(figures)
    if campaign:
        metrics = {f"campaign_{k}": v for k, v in metrics.items()}
    m.logs.log(m.summary.parent_run_id, metrics=metrics)
    for st in m.studies:
        m.logs.call("finish", st.run_id)
    for p in m.summary.packs:
        m.logs.call("log_artifact", m.summary.parent_run_id, str(p), "packs")
    m.logs.call("finish", m.summary.parent_run_id)


def want_compile(exp: experiment.Experiment, device: DeviceSpec,
                 fam: Kernel) -> bool:
    """The torch.compile baseline: on by default on GPUs, unless the family says why it
    is impractical (``Kernel.no_compile_baseline``); under the interpreter it times CPU
    code generated by Inductor, which says nothing and costs a C++ build."""
    setting = exp.baselines.compile
    if setting == "auto":
        return not device.interpreted and not fam.no_compile_baseline
    return bool(setting)
