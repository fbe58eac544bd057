"""The plan of an experiment: one study per (shape, dtype, hardware key), each with what
its run needs resolved once.

A run resolves each experiment's kernel family once, as its file is checked
(``ExperimentPlan.checked``), and each study's device spec and search space once its
hardware keys are known (``ExperimentPlan.for_hardware``): the scheduler, the studies'
set-up, the re-measurement and the freezing of packs take them from the plan
(``StudyPlan``) and look nothing up again. Where the workers of a key report their own
device, the runner hands each study the plan on that device (``ExperimentPlan.on``).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.experiment.checks import Checked, check_semantics
from harness.experiment.schema import Experiment, SearchSettings, TimingSettings
from harness.kernel import api as kernel_api
from harness.kernel.api import DeviceSpec
from harness.measure import hardware
from harness.search import spaces
from harness.search.valid import EXACT_LIMIT, ValidSpace

#: A search space, frozen: (tunable, its choices) in the space's order.
FrozenSpace = tuple[tuple[str, tuple[Any, ...]], ...]


def _frozen(space: Mapping[str, Sequence[Any]]) -> FrozenSpace:
    return tuple((name, tuple(choices)) for name, choices in space.items())


@dataclass(frozen=True)
class StudySpec:
    """One study: a kernel at one shape and dtype on one hardware key. ``key``: the
    shape's key, where the plan computed it (otherwise the family gives it on demand)."""

    experiment: str
    kernel: str
    shape: dict[str, int]
    dtype: str
    hardware: str
    key: str = field(default="", compare=False, repr=False)

    @property
    def shape_key(self) -> str:
        return self.key or kernel_api.get(self.kernel).shape_key(self.shape)

    @property
    def name(self) -> str:
        return f"{self.experiment}/{self.kernel}/{self.shape_key}/{self.dtype}/{self.hardware}"


def plan(exp: Experiment, hardware_keys: list[str],
         family: kernel_api.Kernel | None = None) -> list[StudySpec]:
    """One study per (shape, dtype, hardware). ``hardware_keys`` replaces ``auto``;
    ``family`` (the one ``exp.kernel`` names) names each study's shape."""
    return [
        StudySpec(exp.name, exp.kernel, dict(shape), dtype, hw,
                  family.shape_key(shape) if family is not None else "")
        for hw in hardware_keys
        for shape in exp.shapes
        for dtype in exp.dtypes
    ]


@dataclass(frozen=True)
class StudyPlan:
    """One study and what its run needs: its kernel family, the device it is planned
    for (the hardware key's static spec; the workers' own once they report it), its
    search space resolved for that device's vendor and hardware key, its experiment's
    search and timing settings and seed, and the packs folder it warm-starts from
    (where ``search.seed_from_packs``) and freezes into."""

    spec: StudySpec
    family: kernel_api.Kernel
    device: DeviceSpec
    choices: FrozenSpace
    search: SearchSettings
    timing: TimingSettings
    packs_dir: str
    seed: int

    @property
    def space(self) -> spaces.Space:
        """The study's search space (a copy: the plan's own stays as planned)."""
        return {name: list(values) for name, values in self.choices}

    @property
    def default_config(self) -> dict[str, Any]:
        return dict(self.family.default_config)

    def check(self, config: Mapping[str, Any]) -> str | None:
        """Why ``config`` (over the family's defaults) cannot run at the study's shape
        on its device (static pruning), or None."""
        return self.family.check({**self.family.default_config, **config},
                                 self.spec.shape, self.spec.dtype, self.device)

    def valid(self, exact_limit: int = EXACT_LIMIT) -> ValidSpace:
        """The configs of the space that pass ``check``, numbered in the seed's order."""
        return ValidSpace(self.space, self.check, self.seed, exact_limit=exact_limit)


@dataclass(frozen=True)
class ExperimentPlan:
    """An experiment as its run plans it: its file, its settings, its kernel family and
    (``for_hardware``) its studies."""

    path: Path
    exp: Experiment
    family: kernel_api.Kernel
    #: Search spaces already resolved, by (vendor, hardware key): the checks'
    known: Mapping[tuple[str, str], FrozenSpace] = field(
        default_factory=lambda: types.MappingProxyType({}))
    studies: tuple[StudyPlan, ...] = ()

    @classmethod
    def checked(cls, path: str | Path, exp: Experiment,
                families: dict[str, kernel_api.Kernel] | None = None) -> ExperimentPlan:
        """The experiment checked (``check_semantics``: raises ExperimentError) and
        planned, its hardware keys still to come. ``families``: kernel name -> family,
        shared by the experiments of a campaign so that each name resolves once."""
        families = {} if families is None else families
        found: Checked = check_semantics(path, exp, families.get(exp.kernel))
        families[exp.kernel] = found.family
        return cls(Path(path), exp, found.family, types.MappingProxyType(
            {k: _frozen(v) for k, v in found.resolved.items()}))

    @property
    def specs(self) -> list[StudySpec]:
        return [st.spec for st in self.studies]

    def _choices(self, vendor: str, key: str) -> FrozenSpace:
        known = self.known.get((vendor, key))
        if known is not None:
            return known
        return _frozen(spaces.resolve([spaces.for_kernel(self.family), self.exp.search_space],
                                      vendor, key, where=str(self.path)))

    def for_hardware(self, keys: Sequence[str]) -> ExperimentPlan:
        """The plan with one study per (hardware key of ``keys``, shape, dtype), in that
        order; each key's static device spec and space resolved once, shared by its
        studies."""
        exp, studies = self.exp, []
        specs = plan(exp, list(keys), self.family)
        per_key: dict[str, tuple[DeviceSpec, FrozenSpace]] = {}
        for spec in specs:
            if spec.hardware not in per_key:
                device = hardware.spec_for_key(spec.hardware)
                per_key[spec.hardware] = device, self._choices(device.vendor, spec.hardware)
            device, choices = per_key[spec.hardware]
            studies.append(StudyPlan(spec, self.family, device, choices, exp.search,
                                     exp.timing, exp.output.packs_dir, exp.seed))
        return dataclasses.replace(self, studies=tuple(studies))

    def on(self, study: StudyPlan, device: DeviceSpec) -> StudyPlan:
        """``study`` on the device its workers report: the same space, unless that
        device's vendor is not the one its key's static spec assumed (a GPU the harness
        does not know), whose space is resolved for the vendor it is."""
        if device.vendor == study.device.vendor:
            return dataclasses.replace(study, device=device)
        return dataclasses.replace(study, device=device,
                                   choices=self._choices(device.vendor, study.spec.hardware))
