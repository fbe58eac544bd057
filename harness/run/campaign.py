"""Campaigns: several experiment files in one run, on one Ray and one fleet.

``kharness run A.yaml B.yaml configs/zoo/`` starts Ray, the GPU workers and each node's
compile service once, and spreads the studies of every file over every GPU of their
hardware key (the scheduler is fed their union), where one run per file paid each
start again and left the GPUs idle between runs. Each experiment still writes its own
packs, MLflow experiment, ``runs/<name>/`` (state, Optuna storage, lock) and summary.
Every file is read and checked before anything starts; one bad file stops the whole
command with nothing written.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from harness import experiment
from harness.run.members import Member
from harness.run.results import Summary
from harness.run.runner import execute


@dataclass
class Entry:
    """One experiment of a campaign: its file, its name and its own summary."""

    config: str
    name: str
    summary: Summary
    skipped: bool = False  # none of its hardware was in the cluster: nothing ran


@dataclass
class CampaignSummary:
    """Each experiment's summary, and the fleet's figures (``fleet``: wall time, GPU-held
    time and where it went, the timeline of the one Ray and fleet they shared)."""

    experiments: list[Entry] = field(default_factory=list)
    fleet: Summary = field(default_factory=Summary)

    @property
    def studies(self) -> int:
        return sum(len(e.summary.rows) for e in self.experiments)


def run_campaign(paths: Sequence[str | Path], resume: bool = False,
                 console: Console | None = None, progress: bool = True,
                 overrides: Sequence[str] = (), started_at: float | None = None,
                 stop_own_ray: bool = False,
                 result: CampaignSummary | None = None) -> CampaignSummary:
    """Run the experiments of ``paths`` (files, and folders: their ``*.yaml``) as one
    campaign; the arguments as ``harness.run.runner.run``'s, ``resume`` and
    ``overrides`` applying to each file. Raises ExperimentError, before anything is
    written or started, for the first bad file or a name two files share, and
    NoHardwareError where none of the experiments' hardware is in the cluster (one
    whose hardware is missing is skipped: ``Entry.skipped``). ``result``: filled as the
    campaign goes, so that a caller stopped by a signal can say how far it got."""
    console = console or Console(stderr=True)
    items = experiment.load_all(experiment.expand(paths), overrides)
    t0 = time.monotonic() if started_at is None else started_at
    members: list[Member] = []
    try:
        for path, exp in items:  # each experiment's run directory, or none at all
            lock = experiment.lock_run_dir(path, exp)
            members.append(Member(path, exp, resume, Summary(t0=t0), lock))
    except BaseException:
        for m in reversed(members):
            m.lock.release(undo=True)
        raise
    result = result if result is not None else CampaignSummary()
    result.fleet = Summary(t0=t0)
    result.experiments = [Entry(str(m.path), m.name, m.summary) for m in members]
    try:
        execute(members, result.fleet, console, progress, stop_own_ray)
    finally:
        for entry, m in zip(result.experiments, members, strict=True):
            entry.skipped = m.skipped
    return result
