"""Experiment files: the schema (``schema``), reading them (``load``), the checks of the
run's surroundings before Ray starts (``preflight``), the checks that need the kernel
family (``checks``), the plan of the run: its studies with their family, device and
space resolved once (``plan``), the lock that keeps one run of an
experiment at a time (``lock``) and the files of a campaign (``campaign``).

Nothing else in the harness reads experiment YAML. A bad file raises ``ExperimentError``
naming the file and the field, before anything is written.
"""

from harness.experiment.campaign import expand, is_campaign, load_all
from harness.experiment.checks import Checked, check_semantics
from harness.experiment.load import MAX_BYTES, load
from harness.experiment.lock import RunLock, lock_run_dir
from harness.experiment.plan import ExperimentPlan, StudyPlan, StudySpec, plan
from harness.experiment.preflight import preflight
from harness.experiment.schema import (
    BaselineSettings,
    Experiment,
    ExperimentError,
    FleetSettings,
    OutputSettings,
    SearchSettings,
    SearchSpace,
    TimingSettings,
    TrackingSettings,
)
from harness.experiment.uris import uri_problem

__all__ = [
    "MAX_BYTES", "BaselineSettings", "Checked", "Experiment", "ExperimentError",
    "ExperimentPlan", "FleetSettings", "OutputSettings", "RunLock", "SearchSettings",
    "SearchSpace", "StudyPlan", "StudySpec", "TimingSettings", "TrackingSettings",
    "check_semantics", "expand", "is_campaign", "load", "load_all", "lock_run_dir", "plan",
    "preflight", "uri_problem",
]
