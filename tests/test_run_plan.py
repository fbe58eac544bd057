"""The run's plan: each experiment's kernel family, its studies' device specs and search
spaces resolved once, before the search, and handed down to every step of the run."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.fault_kernels import run_quietly

FAULTY = "tests.fault_kernels:Faulty"


def _count(monkeypatch: pytest.MonkeyPatch, func: Callable[..., Any],
           key: Callable[..., Any]) -> Counter:
    """Calls to ``func`` in this process, by ``key(*args)``, wherever a module of the
    harness holds it (its home module or a name imported from it)."""
    calls: Counter = Counter()

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[key(*args, **kwargs)] += 1
        return func(*args, **kwargs)

    for name, module in list(sys.modules.items()):
        if name.startswith("harness") and getattr(module, func.__name__, None) is func:
            monkeypatch.setattr(module, func.__name__, counted)
    return calls


@pytest.mark.slow
def test_a_run_resolves_the_family_once_and_each_study_s_space_and_device_once(
        tmp_path: Path, faulty_events: Path, mlflow_db: Path, monkeypatch) -> None:
    import harness.run.runner  # noqa: F401 - every module of the run imported, then counted
    from harness.kernel import api as kernel_api
    from harness.measure import hardware
    from harness.search import spaces

    exp = {
        "name": "planned", "kernel": FAULTY, "shapes": [{"N": 256}, {"N": 512}],
        "dtypes": ["fp32"], "hardware": ["cpu"], "search": {"sampler": "grid", "trials": 2},
        "search_space": {"params": {"FAULT": ["none"], "SLEEP_MS": [0, 1]}},
        "tracking": {"uri": f"sqlite:///{mlflow_db}"},
        "output": {"packs_dir": str(tmp_path / "packs"), "runs_dir": str(tmp_path / "runs")},
        "fleet": {"compile_workers": 0, "queue_depth": 1},
    }
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(exp))
    families = _count(monkeypatch, kernel_api.get, lambda name: name)
    resolved = _count(monkeypatch, spaces.resolve,
                      lambda layers, vendor, hw, **_: (vendor, hw))
    devices = _count(monkeypatch, hardware.spec_for_key, lambda key: key)
    rows = run_quietly(tmp_path / "exp.yaml").rows
    assert len(rows) == 2 and all(r.get("config") for r in rows)
    print(f"kernel_api.get {dict(families)}; spaces.resolve {dict(resolved)}; "
          f"spec_for_key {dict(devices)}")
    assert families == {FAULTY: 1}
    # Two studies on one hardware key: one space and one device spec, shared by both.
    assert resolved == {("cpu", "cpu"): 1}
    assert devices == {"cpu": 1}


def test_the_plan_resolves_the_family_once_and_each_key_s_device_and_space_once(
        monkeypatch) -> None:
    import dataclasses

    from harness import experiment
    from harness.kernel import api as kernel_api
    from harness.measure import hardware
    from harness.search import spaces

    exp = experiment.Experiment(name="p", kernel="matmul", hardware=["H100", "H200"],
                                shapes=[{"M": 256, "N": 256, "K": 256},
                                        {"M": 512, "N": 256, "K": 256}],
                                dtypes=["bf16", "fp16"])
    families = _count(monkeypatch, kernel_api.get, lambda name: name)
    resolved = _count(monkeypatch, spaces.resolve,
                      lambda layers, vendor, hw, **_: (vendor, hw))
    devices = _count(monkeypatch, hardware.spec_for_key, lambda key: key)
    found: dict = {}
    checked = experiment.ExperimentPlan.checked("p.yaml", exp, found)
    again = experiment.ExperimentPlan.checked("q.yaml", exp.model_copy(update={"name": "q"}),
                                              found)  # a campaign's second file
    planned = checked.for_hardware(exp.hardware)
    assert again.family is checked.family is planned.family
    assert families == {"matmul": 1}
    # The checks' spaces are the studies': each key's resolved once per file, not per study.
    assert resolved == {("nvidia", "H100"): 2, ("nvidia", "H200"): 2}
    assert devices == {"H100": 1, "H200": 1}
    assert [s.spec for s in planned.studies] == experiment.plan(exp, exp.hardware)
    assert [s.spec.name for s in planned.studies] == [
        s.name for s in experiment.plan(exp, exp.hardware)]
    study = planned.studies[0]
    assert study.device == hardware.spec_for_key("H100")
    assert study.space == spaces.resolve([spaces.for_kernel(study.family), exp.search_space],
                                         "nvidia", "H100")
    study.space["BLOCK_M"] = []  # a copy: the plan stays as planned
    assert study.space["BLOCK_M"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        study.device = hardware.spec_for_key("cpu")  # type: ignore[misc]
    assert study.check({"BLOCK_M": 64}) == study.family.check_config(
        {**study.family.default_config, "BLOCK_M": 64}, study.spec.shape, study.device)


def test_a_worker_of_another_vendor_than_its_key_suggests_gets_that_vendor_s_space() -> None:
    """A GPU the harness does not know: its key's static spec guesses NVIDIA; where its
    workers report AMD, its studies take the AMD sections of the space."""
    import dataclasses

    from harness import experiment

    key = "AMD-Instinct-MI999"
    exp = experiment.Experiment(name="p", kernel="matmul", hardware=[key],
                                shapes=[{"M": 256, "N": 256, "K": 256}], dtypes=["bf16"],
                                search_space={"vendors": {"amd": {"params": {
                                    "num_warps": [4]}}}})
    planned = experiment.ExperimentPlan.checked("p.yaml", exp).for_hardware([key])
    (study,) = planned.studies
    assert study.device.vendor == "nvidia" and study.space["num_warps"] != [4]
    amd = dataclasses.replace(study.device, vendor="amd", name="AMD Instinct MI999")
    seen = planned.on(study, amd)
    assert seen.device == amd and seen.space["num_warps"] == [4]
    same = planned.on(study, dataclasses.replace(study.device, sm_count=200))
    assert same.choices is study.choices and same.device.sm_count == 200
