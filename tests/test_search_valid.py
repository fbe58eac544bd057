"""Asks that are valid: the samplers draw from the configs that pass the kernel's static
constraints, so that a study spends at most two asks per config it measures, on every
shipped space (per vendor and hardware key), the grouped GEMM's included."""

from __future__ import annotations

import random
import zlib
from pathlib import Path

import optuna
import pytest

from harness.experiment import SearchSettings, StudySpec
from harness.kernel import api as kernel_api
from harness.measure.hardware import spec_for_key
from harness.measure.timing import TrialResult
from harness.search import Search, ValidSpace, config_key, grid_order, spaces

ROOT = Path(__file__).resolve().parent.parent
#: Hardware every space is resolved for: NVIDIA with and without TMA, AMD, the interpreter.
HARDWARE = ("H200", "H100", "A100", "V710", "cpu")
MAX_ASKS_PER_CONFIG = 2.0
#: Shapes tried besides each family's named ones: a decode step through a matmul.
EXTRA_SHAPES = {"matmul": {"decode-16": {"M": 16, "N": 4096, "K": 4096}}}


def _ok(config: dict) -> TrialResult:
    """A made-up, deterministic latency: something for TPE to model."""
    ms = 1.0 + zlib.crc32(config_key(config).encode()) % 1000 / 1000
    return TrialResult(ok=True, latency_ms=ms, max_abs_err=0.0, max_rel_err=0.0)


def _study(kernel: str, hw: str, shape: dict, sampler: str, trials: int) -> Search:
    fam = kernel_api.get(kernel)
    device = spec_for_key(hw)
    space = spaces.resolve([spaces.for_kernel(fam)], device.vendor, hw)
    spec = StudySpec("asks", kernel, dict(shape), "bf16", hw)
    return Search(spec, space, device,
                  SearchSettings(sampler=sampler, trials=trials, seed_from_packs=False),
                  optuna.storages.InMemoryStorage(), seed=0, n_parallel=2)


def _tune(search: Search, in_flight: int = 2) -> tuple[int, int]:
    """Run the study to its end, two configs in flight: (asks, configs measured)."""
    pending = []
    while True:
        asked = search.ask() if len(pending) < in_flight else None
        if asked is not None:
            pending.append(asked)
            continue
        if not pending:
            return search.asks, search.measured
        trial, config = pending.pop(0)
        search.tell(trial, config, _ok(config))


def _shapes(kernel: str, hw: str) -> dict[str, dict]:
    shapes = {**kernel_api.get(kernel).shapes, **EXTRA_SHAPES.get(kernel, {})}
    if hw == "cpu":
        return {k: v for k, v in shapes.items() if k == "test"} or shapes
    return {k: v for k, v in shapes.items() if k != "test"} or shapes


def _space_hardware(kernel: str) -> list[str]:
    """The hardware keys a kernel's shipped space is resolved for: the common ones and
    any its file names."""
    raw = spaces.for_kernel(kernel_api.get(kernel))
    return list(dict.fromkeys([*HARDWARE, *(raw.get("hardware") or {})]))


@pytest.mark.parametrize("sampler", ["tpe", "random", "grid", "pattern"])
@pytest.mark.parametrize("hw", ["H200", "cpu"])
def test_grouped_gemm_space_yields_at_most_two_asks_per_valid_config(hw: str,
                                                                      sampler: str) -> None:
    """The shipped grouped GEMM space (tens of millions of configs on Hopper, a fraction
    of a percent of them valid): every ask is a config to measure."""
    shape = next(iter(_shapes("grouped_gemm", hw).values()))
    search = _study("grouped_gemm", hw, shape, sampler, trials=12)
    asks, measured = _tune(search)
    assert measured == min(12, search.grid), (asks, measured)
    assert asks / measured <= MAX_ASKS_PER_CONFIG
    assert search.counts()["pruned"] == 0 and search.counts()["duplicate"] == 0


@pytest.mark.slow
def test_every_shipped_space_yields_at_most_two_asks_per_measured_config(capsys) -> None:
    """Every kernel family, its shipped space for each hardware key, at its named shapes,
    tuned by TPE, random search, the grid and pattern: the asks per measured config
    (printed)."""
    rows, worst = [], 0.0
    for kernel in kernel_api.builtin_names():
        for hw in _space_hardware(kernel):
            for shape_name, shape in _shapes(kernel, hw).items():
                for sampler in ("tpe", "random", "grid", "pattern"):
                    search = _study(kernel, hw, shape, sampler, trials=10)
                    asks, measured = _tune(search)
                    ratio = asks / measured if measured else float("nan")
                    rows.append((kernel, hw, shape_name, sampler, search.valid.size,
                                 search.valid.count, asks, measured, ratio, search.no_valid))
                    if measured:
                        worst = max(worst, ratio)
                    else:
                        # Nothing to measure: the study says why, and spent no ask.
                        assert search.no_valid and asks == 0, (kernel, hw, shape_name)
    with capsys.disabled():
        print("\nkernel hardware shape sampler space valid asks measured asks/measured")
        for r in rows:
            valid = "?" if r[5] is None else r[5]
            print(f"{r[0]} {r[1]} {r[2]} {r[3]} {r[4]} {valid} {r[6]} {r[7]} {r[8]:.2f}"
                  + (f"  [{r[9]}]" if r[9] else ""))
        print(f"worst asks per measured config: {worst:.2f}")
    assert worst <= MAX_ASKS_PER_CONFIG


# -- the valid set ------------------------------------------------------------------------


def _toy_check(config: dict) -> str | None:
    if config["A"] * config["B"] > 512:
        return f"A*B={config['A'] * config['B']} > 512"
    if config["C"] == "x" and config["A"] < 32:
        return "C=x needs A >= 32"
    return None


TOY = {"A": [16, 32, 64, 128], "B": [1, 2, 4, 8, 16], "C": ["x", "y"]}


@pytest.mark.parametrize("exact_limit", [0, 4096])
def test_valid_space_draws_only_valid_configs_and_walks_them_all(exact_limit: int) -> None:
    """Checked in full (a small space) or lazily (a large one), the same valid set: the
    grid walks every valid config once, in ``grid_order``'s order, random draws only
    valid ones, and a repair lands on the nearest valid config."""
    truth = [c for c in grid_order(TOY, 7) if _toy_check(c) is None]
    vs = ValidSpace(TOY, _toy_check, seed=7, exact_limit=exact_limit)
    assert vs.exact == (exact_limit > 0) and vs.size == 40
    seen: set = set()
    walked = []
    while (idx := vs.next_in_grid(seen)) is not None:
        seen.add(idx)
        walked.append(vs.config(idx))
    assert walked == truth and len(truth) == sum(
        _toy_check(dict(zip(TOY, v, strict=True))) is None
        for v in __import__("itertools").product(*TOY.values()))
    rng = random.Random(0)
    drawn: set = set()
    for _ in range(len(truth)):
        idx = vs.sample(rng, drawn)
        assert idx is not None and _toy_check(vs.config(idx)) is None
        drawn.add(idx)
    assert vs.sample(rng, drawn) is None or not vs.exact  # a lazy space may walk on
    near = vs.nearest({"A": 128, "B": 16, "C": "y"}, rng, set())
    assert near is not None and _toy_check(vs.config(near)) is None
    assert sum(a != b for a, b in zip(near, vs.index({"A": 128, "B": 16, "C": "y"}),
                                      strict=True)) == 1


def test_grid_order_is_a_seeded_permutation_of_the_space() -> None:
    a = [config_key(c) for c in grid_order(TOY, 1)]
    assert len(set(a)) == 40 and a == [config_key(c) for c in grid_order(TOY, 1)]
    assert a != [config_key(c) for c in grid_order(TOY, 2)]


def test_a_space_without_a_valid_config_says_why_and_asks_nothing() -> None:
    spec = StudySpec("t", "matmul", {"M": 16, "N": 4096, "K": 4096}, "bf16", "H200")
    space = {"BLOCK_M": [64, 128], "BLOCK_N": [64, 128], "BLOCK_K": [32]}
    s = Search(spec, space, spec_for_key("H200"), SearchSettings(trials=8),
               optuna.storages.InMemoryStorage(), seed=0, n_parallel=1)
    assert s.ask() is None and s.asks == 0
    assert s.no_valid and "no config of the 4 passes" in s.no_valid
    assert "BLOCK_M=64 > next_pow2(M)=16" in s.no_valid
    assert s.attr("stopped") == s.no_valid


@pytest.mark.parametrize("sampler", ["random", "grid", "tpe", "pattern"])
def test_a_large_sparse_space_is_used_up_and_one_without_valid_configs_says_so(
        sampler: str) -> None:
    """A space too large to check in full (6^5 configs): three valid ones are measured,
    then the study ends; with none valid, it ends at its first ask, saying why."""
    space = {f"P{i}": list(range(6)) for i in range(5)}
    assert ValidSpace(space, lambda c: None).exact is False
    valid = [{**dict.fromkeys(space, 0), "P0": v} for v in (1, 3, 5)]
    spec = StudySpec("t", "matmul", {"M": 64, "N": 64, "K": 64}, "bf16", "cpu")

    def check(config: dict) -> str | None:
        return None if dict(config) in valid else f"P0={config['P0']}: not this one"

    s = Search(spec, space, spec_for_key("cpu"),
               SearchSettings(sampler=sampler, trials=10, seed_from_packs=False),
               optuna.storages.InMemoryStorage(), seed=0, n_parallel=1, check=check,
               default_config={})
    asks, measured = _tune(s, in_flight=1)
    assert measured == 3 and asks <= 2 * measured and s.exhausted and s.no_valid is None
    s = Search(spec, space, spec_for_key("cpu"),
               SearchSettings(sampler=sampler, trials=10, seed_from_packs=False),
               optuna.storages.InMemoryStorage(), seed=0, n_parallel=1,
               check=lambda c: "never", default_config={})
    assert s.ask() is None and s.measured == 0
    assert s.no_valid.startswith("no valid config among the 7776 of 7776 checked: never")
    assert s.not_tuned() == s.no_valid


@pytest.mark.slow
def test_a_run_names_the_study_it_could_not_tune_and_exits_4(tmp_path: Path,
                                                             mlflow_db: Path) -> None:
    """Two matmul studies on the interpreter: M=64 is tuned, M=16 has no tile that fits
    its space (BLOCK_M 64 only): the run says so, freezes nothing for it, and exits 4."""
    import json
    import subprocess
    import sys

    import yaml

    from tests.fault_kernels import cli_env

    exp = {
        "name": "untuned", "kernel": "matmul", "dtypes": ["fp32"],
        "shapes": [{"M": 64, "N": 64, "K": 64}, {"M": 16, "N": 64, "K": 64}],
        "search": {"sampler": "grid", "trials": 2, "remeasure_top_k": 0,
                   "seed_from_packs": False},
        "search_space": {"params": {"BLOCK_M": [64], "BLOCK_N": [64], "BLOCK_K": [32, 64]}},
        "baselines": {"compile": False},
        "timing": {"warmup_ms": 1, "rep_ms": 2},
        "tracking": {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
        "output": {"packs_dir": str(tmp_path / "packs"), "runs_dir": str(tmp_path / "runs")},
        "fleet": {"compile_workers": 0},
    }
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(exp))
    proc = subprocess.run([sys.executable, "-m", "harness", "run", "exp.yaml", "--json"],
                          cwd=tmp_path, env=cli_env(tmp_path), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 4, proc.stderr[-4000:]
    rows = {r["shape"]: r for r in json.loads(proc.stdout)["rows"]}
    tuned, untuned = rows["M=64,N=64,K=64"], rows["M=16,N=64,K=64"]
    assert tuned.get("params") and not tuned.get("not_tuned")
    assert "BLOCK_M=64 > next_pow2(M)=16" in untuned["not_tuned"] and not untuned.get("params")
    assert "not tuned: matmul M=16,N=64,K=64 fp32 on cpu" in proc.stderr
    pack = json.loads((tmp_path / "packs" / "cpu" / "matmul.json").read_text())
    assert "M=16,N=64,K=64" not in json.dumps(pack)


def test_the_sampler_reads_each_trial_once_its_parameters_are_set() -> None:
    """``StrategySampler.tried`` reads a trial's point when its parameters are complete:
    the trial being asked has none yet, and is read at the next ask."""
    from harness.search.samplers import StrategySampler
    from harness.search.strategies import registry
    from harness.search.strategies.base import Setup

    space = {"A": [1, 2, 3], "B": [1, 2]}
    valid = ValidSpace(space, lambda c: None)
    sampler = StrategySampler(registry.get("grid")(Setup(valid, 0, 6)), valid)
    study = optuna.create_study(sampler=sampler)
    seen = []
    for n in range(6):
        trial = study.ask()
        config = {k: trial.suggest_categorical(k, v) for k, v in space.items()}
        assert len(sampler.tried(study)) == n + 1
        seen.append(config_key(config))
        if n % 2:
            study.tell(trial, 1.0)
    assert len(set(seen)) == 6  # each ask a config not tried before
    failed = study.ask()  # a trial that ends without parameters is never read
    study.tell(failed, state=optuna.trial.TrialState.FAIL)
    assert len(sampler.tried(study)) == 6

