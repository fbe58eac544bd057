"""The plan of an experiment: one study per (shape, dtype, hardware key)."""

from __future__ import annotations

from dataclasses import dataclass

from harness.experiment.schema import Experiment
from harness.kernel import api as kernel_api


@dataclass(frozen=True)
class StudySpec:
    """One study: a kernel at one shape and dtype on one hardware key."""

    experiment: str
    kernel: str
    shape: dict[str, int]
    dtype: str
    hardware: str

    @property
    def shape_key(self) -> str:
        return kernel_api.get(self.kernel).shape_key(self.shape)

    @property
    def name(self) -> str:
        return f"{self.experiment}/{self.kernel}/{self.shape_key}/{self.dtype}/{self.hardware}"


def plan(exp: Experiment, hardware_keys: list[str]) -> list[StudySpec]:
    """One study per (shape, dtype, hardware). ``hardware_keys`` replaces ``auto``."""
    return [
        StudySpec(exp.name, exp.kernel, dict(shape), dtype, hw)
        for hw in hardware_keys
        for shape in exp.shapes
        for dtype in exp.dtypes
    ]
