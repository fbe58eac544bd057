"""What a run reports: its ``Summary`` (per experiment, and the fleet's figures) and where
the GPU-held time went, from the fleet's books."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console

from harness.fleet import Fleet


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
    held_s: float = 0.0  # GPU-held seconds: every worker from ready to released, summed
    timing_s: float = 0.0  # of which inside the kernel timer (do_bench)
    timing_fraction: float = math.nan  # timing_s / held_s: 1 - the harness's overhead
    overhead: dict[str, float] = field(default_factory=dict)  # held seconds by phase
    first_calls: dict[str, Any] = field(default_factory=dict)  # Fleet.first_calls
    timeline: dict[str, float] = field(default_factory=dict)  # wall seconds at each step
    #: hardware key -> its first worker's start-up by step, seconds (Worker.startup_s)
    worker_startup: dict[str, dict[str, float]] = field(default_factory=dict)
    worker_nice: dict[str, int] = field(default_factory=dict)  # CPU priority, by hardware
    #: The search's MLflow logger: when it was ready and last caught up (wall seconds),
    #: trials logged, seconds spent on them and on the plots
    mlflow_logger: dict[str, float] = field(default_factory=dict)
    t0: float = field(default_factory=time.monotonic, repr=False)

    def mark(self, step: str) -> None:
        """Note the wall time (seconds since the run started) at which ``step`` ended."""
        self.timeline.setdefault(step, round(time.monotonic() - self.t0, 2))
    replaced: int = 0  # workers replaced (device fault, hang, lost)
    reused: int = 0  # kept workers of an earlier run this run leased (fleet.keep_workers_s)
    #: The kept driver that ran this command (harness.cli.kept_driver.SERVED); {} if none
    kept_driver: dict[str, Any] = field(default_factory=dict)
    retried: int = 0  # trials sent again after their worker was lost
    events: list[str] = field(default_factory=list)
    resumed: dict[str, Any] = field(default_factory=dict)  # what --resume found
    #: The fleet's figures: ``workers`` (each GPU's held seconds and where they went),
    #: ``driver_s`` (the driver's own seconds choosing and sending tasks and handling
    #: results, and the tasks), ``studies`` (wall seconds at which each study's search
    #: ended and its re-measurement began and ended), ``compile_services`` (per node)
    fleet: dict[str, Any] = field(default_factory=dict)
    #: The driver's compiles before the fleet existed (``harness.fleet.head_start``):
    #: hardware key, configs submitted and compiled; empty where there was none
    head_start: dict[str, Any] = field(default_factory=dict)


def account(fleet: Fleet, summary: Summary, console: Console) -> None:
    """Where the GPU-held time went, from the fleet's books."""
    summary.busy_s = dict(fleet.busy_s)
    summary.held_s = fleet.held_s()
    summary.timing_s = sum(fleet.timing_s.values())
    summary.timing_fraction = summary.timing_s / summary.held_s if summary.held_s else math.nan
    summary.overhead = overhead(fleet.phases, summary.held_s)
    summary.first_calls = dict(fleet.first_calls)
    summary.fleet["compile_services"] = fleet.last_compile_stats
    if fleet.first_calls["ahead_missed"]:
        console.print(f"[yellow]compile-ahead: {fleet.first_calls['ahead_missed']} first "
                      "launches compiled again in the worker although a compile child had "
                      "built them: the worker and its children use different Triton caches[/]")
    summary.replaced, summary.retried = fleet.replaced, fleet.retried
    summary.reused = fleet.reused
    summary.events = list(fleet.events)


def fleet_metrics(summary: Summary) -> dict[str, float]:
    """The fleet's figures as MLflow metrics of an experiment's parent run."""
    return {
        "gpu_held_s": summary.held_s, "kernel_timing_s": summary.timing_s,
        "timing_fraction": summary.timing_fraction, "workers_replaced": summary.replaced,
        "workers_reused": summary.reused, "trials_retried": summary.retried,
        **{f"held_{k}_s": v for k, v in summary.overhead.items()},
        **{f"first_calls_{k}": v for k, v in summary.first_calls.items()
           if isinstance(v, (int, float))}}


def logger_stats(stats: dict[str, float], t0: float) -> dict[str, float]:
    """The MLflow logger's figures, its clock readings as wall seconds of this run."""
    out = {}
    for k, v in stats.items():
        name = k.removesuffix("_at") + "_s" if k.endswith("_at") else k
        out[name] = round(v - t0 if k.endswith("_at") else v, 3)
    return out


def overhead(phases: dict[str, float], held_s: float) -> dict[str, float]:
    """Where the GPU-held seconds went: timing, and each kind of overhead. ``other`` is
    what no worker accounted for (starting, result transport, the tail after the last
    task)."""
    out = {k.removesuffix("_s"): round(v, 3) for k, v in phases.items()}
    out["other"] = round(max(0.0, held_s - sum(phases.values())), 3)
    return out
