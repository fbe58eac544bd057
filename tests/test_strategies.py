"""The strategy seam: the registry (built-ins and entry-point plug-ins), the schema's
check of ``search.strategy``, and every strategy driven through Search's ask / tell."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Set
from pathlib import Path

import optuna
import pytest
import yaml

from harness.experiment import ExperimentError, SearchSettings, StudySpec, load
from harness.measure.hardware import spec_for_key
from harness.measure.timing import TrialResult
from harness.search import Search, make_storage, storage_url
from harness.search import replay as rp
from harness.search.strategies import registry
from harness.search.strategies.base import Outcome, Point, Setup, Strategy

ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / "benchmarks" / "replay" / "H100" / "matmul__M128_N8192_K8192__bf16__g216.json"
SHAPE = {"M": 64, "N": 64, "K": 64}
SPACE = {"BLOCK_M": [32, 64, 128], "BLOCK_N": [32, 64], "BLOCK_K": [32], "num_warps": [2, 4]}


def _ok(ms: float) -> TrialResult:
    return TrialResult(ok=True, latency_ms=ms, max_abs_err=0, max_rel_err=0, compile_s=0.5,
                       timing_s=0.1)


class Recorder(Strategy):
    """Largest points first; records what it is asked and told."""

    def __init__(self, setup: Setup) -> None:
        super().__init__(setup)
        self.asked: list[Point] = []
        self.told: list[tuple[Point, Outcome]] = []

    def ask(self, tried: Set[Point]) -> Point | None:
        left = [p for p in self.space.valid if p not in tried]
        point = max(left) if left else None
        if point is not None:
            self.asked.append(point)
        return point

    def tell(self, point: Point, outcome: Outcome) -> None:
        self.told.append((point, outcome))


def _search(storage, strategy=Recorder, **settings) -> Search:
    """A matmul study at M=N=K=64 on the H100's static spec: BLOCK_M=128 is pruned, the
    other 8 configs are valid; the default config is the 64 x 64 tile on 4 warps."""
    from harness.kernel import api as kernel_api

    spec = StudySpec("t", "matmul", SHAPE, "fp32", "H100")
    default = {**kernel_api.get("matmul").default_config, "BLOCK_M": 64, "BLOCK_N": 64,
               "num_warps": 4}
    return Search(spec, SPACE, spec_for_key("H100"),
                  SearchSettings(trials=settings.pop("trials", 4), seed_from_packs=False,
                                 **settings), storage, seed=0, n_parallel=1,
                  default_config=default, strategy=strategy)


def test_registry_lists_every_builtin_once() -> None:
    names = registry.names()
    for name in ("tpe", "random", "grid", "cmaes", "gp", "pattern", "auto"):
        assert name in names and registry.get(name).name == name
    assert names == sorted(set(names))
    with pytest.raises(registry.StrategyError, match="known strategies are .*grid.*tpe"):
        registry.get("annealing")
    with pytest.raises(TypeError, match="not a Strategy subclass"):
        registry.register("x")(int)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="registered twice"):
        registry.register("grid")(Recorder)


def test_schema_checks_the_name_against_the_registry(tmp_path: Path) -> None:
    path = tmp_path / "e.yaml"
    path.write_text("name: s\nkernel: matmul\nshapes: [{M: 64, N: 64, K: 64}]\n"
                    "search: {strategy: annealing}\n")
    with pytest.raises(ExperimentError) as err:
        load(path, semantics=False)
    msg = str(err.value)
    assert str(path) in msg and "search.strategy" in msg and "annealing" in msg
    assert all(n in msg for n in registry.names()) and registry.ENTRY_POINT_GROUP in msg
    # ``sampler`` is the older name of the same field; both at once is refused.
    assert load(path, ["search.strategy=grid"], semantics=False).search.strategy == "grid"
    path.write_text("name: s\nkernel: matmul\nshapes: [{M: 64, N: 64, K: 64}]\n"
                    "search: {sampler: random}\n")
    exp = load(path, semantics=False)
    assert exp.search.strategy == exp.search.sampler == "random"
    with pytest.raises(ExperimentError, match="search: give one of strategy and sampler"):
        load(path, ["search.strategy=grid"], semantics=False)


def test_search_drives_a_strategy_through_ask_and_tell(tmp_path: Path) -> None:
    """The default config first (enqueued, not asked), then the strategy's points; every
    outcome is told, the enqueued one's too, with its device seconds."""
    storage = make_storage(storage_url(tmp_path, "seam"))
    s = _search(storage)
    strategy = s.strategy
    assert isinstance(strategy, Recorder) and strategy.setup.budget == 4
    default = strategy.setup.default
    assert default is not None and s.valid.config(default) == {
        "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 4}
    got = []
    while (asked := s.ask()) is not None:
        trial, config = asked
        got.append(s.valid.index(config))
        s.tell(trial, config, _ok(float(len(got))) if len(got) != 2 else
               TrialResult(ok=False, reason="boom", compile_s=1.0))
    assert got[0] == default and got[1:] == strategy.asked == sorted(got[1:], reverse=True)
    assert [p for p, _ in strategy.told] == got
    assert [o.status for _, o in strategy.told] == ["measured", "failed", "measured",
                                                    "measured"]
    assert strategy.told[0][1] == Outcome("measured", 1.0, pytest.approx(0.6))
    assert s.attr("strategy") == "Recorder"  # its class's name: it is not registered

    # Resumed: a new strategy is told the past, in order, before its first ask.
    again = _search(storage, trials=6)
    assert [p for p, _ in again.strategy.told] == got
    trial, config = again.ask()
    assert s.valid.index(config) not in got


def test_found_at_says_how_far_into_the_search_the_winner_came() -> None:
    """Four GPU trials costing 1, 2, 3 and 4 s (a failed one among them); the fastest
    config is the third: found at trial 3 of 4, after 6 of the 10 s."""
    s = _search(optuna.storages.InMemoryStorage(), trials=4)
    latencies = [3.0, None, 1.0, 2.0]
    for i, ms in enumerate(latencies):
        trial, config = s.ask()
        cost = {"compile_s": 0.5 * (i + 1), "timing_s": 0.5 * (i + 1)}
        s.tell(trial, config, TrialResult(ok=False, reason="boom", **cost) if ms is None
               else TrialResult(ok=True, latency_ms=ms, max_abs_err=0, max_rel_err=0, **cost))
    best = s.best()[0]
    assert s.found_at(best) == {"trial": 3, "trials": 4, "budget": 4, "gpu_s": 6.0,
                                "search_gpu_s": 10.0, "fraction": 0.6}
    assert s.found_at({**best, "num_warps": 99}) is None and s.found_at(None) is None


def test_a_strategy_with_nothing_left_ends_the_study() -> None:
    class Nothing(Recorder):
        def ask(self, tried: Set[Point]) -> Point | None:
            return None

    s = _search(optuna.storages.InMemoryStorage(), Nothing, warm_start=False)
    assert s.ask() is None and s.exhausted and s.done()


def test_a_point_outside_the_space_is_a_clear_error() -> None:
    class Wrong(Recorder):
        name = "wrong"

        def ask(self, tried: Set[Point]) -> Point | None:
            return (7, 0, 0, 0)

    s = _search(optuna.storages.InMemoryStorage(), Wrong, warm_start=False)
    with pytest.raises(TypeError, match="strategy 'wrong' asked for .*not a point"):
        s.ask()


@pytest.mark.parametrize("name", ["tpe", "random", "grid", "cmaes", "pattern", "auto"])
def test_every_builtin_asks_valid_untried_configs_until_the_space_is_done(name: str) -> None:
    """Through Search on a space of 12 configs, 2 of them invalid (BLOCK_M=128 on 2
    warps): each strategy hands out the 10 valid ones, each once, and then none."""
    def check(c):
        return "too big" if c["BLOCK_M"] == 128 and c["num_warps"] == 2 else None

    spec = StudySpec("t", "matmul", SHAPE, "fp32", "H100")
    s = Search(spec, SPACE, spec_for_key("H100"),
               SearchSettings(strategy=name, trials=50, seed_from_packs=False),
               optuna.storages.InMemoryStorage(), seed=1, n_parallel=2, check=check,
               default_config={"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 4})
    seen = []
    while (asked := s.ask()) is not None:
        trial, config = asked
        assert check(config) is None
        seen.append(tuple(sorted(config.items())))
        s.tell(trial, config, _ok(1 + config["BLOCK_M"] / 64 + config["num_warps"] / 8))
    assert len(seen) == len(set(seen)) == 10 and s.pruned == 0


# -- a plug-in, installed as another package would be --------------------------------------

PLUGIN = '''
"""A strategy of another package: the valid configs, largest first."""
import os

from harness.search.strategies import Strategy


class Descending(Strategy):
    def _log(self, line):
        with open(os.environ["STRATEGY_LOG"], "a") as f:
            f.write(line + "\\n")

    def ask(self, tried):
        left = [p for p in self.space.valid if p not in tried]
        point = max(left) if left else None
        self._log(f"ask {point}")
        return point

    def tell(self, point, outcome):
        self._log(f"tell {point} {outcome.status}")
'''


def _install_plugin(root: Path) -> Path:
    """A distribution ``kh-descending`` (its dist-info and module) under ``root``, which
    goes on the subprocess's path: ``importlib.metadata`` finds its entry point there."""
    site = root / "site"
    (site / "kh_descending").mkdir(parents=True)
    (site / "kh_descending" / "__init__.py").write_text(PLUGIN)
    info = site / "kh_descending-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kh-descending\n"
                                   "Version: 0.1\n")
    (info / "entry_points.txt").write_text(
        f"[{registry.ENTRY_POINT_GROUP}]\ndescending = kh_descending:Descending\n")
    (info / "RECORD").write_text("")
    return site


def _env(site: Path, log: Path) -> dict[str, str]:
    from tests.fault_kernels import cli_env

    env = cli_env(log.parent)
    env["PYTHONPATH"] = f"{site}:{env['PYTHONPATH']}"
    env["STRATEGY_LOG"] = str(log)
    return env


def test_a_plugin_strategy_replays_by_name(tmp_path: Path) -> None:
    site = _install_plugin(tmp_path)
    log = tmp_path / "strategy.log"
    code = textwrap.dedent("""
        import json, sys
        from harness.search import replay as rp
        from harness.search.strategies import registry
        print(json.dumps(registry.names()))
        sys.exit(rp.main(["run", sys.argv[1], "--strategy", "descending"]))
    """)
    proc = subprocess.run([sys.executable, "-c", code, str(TABLE)], env=_env(site, log),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    names_line, _, rest = proc.stdout.partition("\n")
    assert "descending" in json.loads(names_line)
    m = json.loads(rest)
    assert m["sampler"] == "descending" and m["reached"] and m["trials"] >= 2
    lines = log.read_text().splitlines()
    assert sum(x.startswith("ask") for x in lines) == m["asks"] - 1  # the default: enqueued
    assert sum(x.startswith("tell") for x in lines) == m["trials"]
    # Without the plug-in on the path the name is unknown, and the error lists the others.
    proc = subprocess.run([sys.executable, "-m", "harness.search.replay", "run", str(TABLE),
                           "--strategy", "descending"], env=_env(tmp_path / "none", log),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "unknown strategy 'descending'" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_a_plugin_strategy_runs_a_cpu_experiment_by_name(tmp_path: Path,
                                                          mlflow_db: Path) -> None:
    """``search.strategy: descending`` (the plug-in's entry point) in a real run on the
    interpreter: the plug-in chooses the configs, the study records its name, and a
    name that is not registered is refused with exit code 2."""
    site = _install_plugin(tmp_path)
    log = tmp_path / "strategy.log"
    exp = {
        "name": "plugin", "kernel": "matmul", "dtypes": ["fp32"],
        "shapes": [{"M": 64, "N": 64, "K": 64}],
        "search": {"strategy": "descending", "trials": 3, "remeasure_top_k": 0,
                   "seed_from_packs": False},
        "search_space": {"params": {"BLOCK_M": [32, 64], "BLOCK_N": [64], "BLOCK_K": [32],
                                    "GROUP_M": [8], "num_warps": [4], "num_stages": [1, 2]}},
        "baselines": {"compile": False},
        "timing": {"warmup_ms": 1, "rep_ms": 2},
        "tracking": {"uri": f"sqlite:///{mlflow_db}"},
        "output": {"packs_dir": str(tmp_path / "packs"), "runs_dir": str(tmp_path / "runs")},
        "fleet": {"compile_workers": 0},
    }
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(exp))
    proc = subprocess.run([sys.executable, "-m", "harness", "run", "exp.yaml", "--json"],
                          cwd=tmp_path, env=_env(site, log), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    row = json.loads(proc.stdout)["rows"][0]
    assert row["counts"]["measured"] == 3 and row["params"]
    lines = log.read_text().splitlines()
    asks = [x for x in lines if x.startswith("ask")]
    # The default config (128 x 128) is no point of this space: every config was asked.
    assert len(asks) == 3 and len([x for x in lines if x.startswith("tell")]) == 3
    study = optuna.load_study(study_name="plugin/matmul/M=64,N=64,K=64/fp32/cpu",
                              storage=f"sqlite:///{tmp_path / 'runs' / 'plugin' / 'optuna.db'}")
    assert study.user_attrs["strategy"] == "descending"
    assert row["winner_found"]["trials"] == 3

    exp["search"]["strategy"] = "nonesuch"
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({**exp, "name": "bad"}))
    proc = subprocess.run([sys.executable, "-m", "harness", "run", "bad.yaml"],
                          cwd=tmp_path, env=_env(site, log), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "search.strategy" in proc.stderr and "descending" in proc.stderr
    assert "Traceback" not in proc.stderr


# -- pattern: the strategy built for kernel spaces ------------------------------------------


def test_ordinal_ranks_order_numbers_by_value_and_the_rest_as_listed() -> None:
    from harness.search.strategies.pattern import ordinal_ranks

    assert ordinal_ranks([64, 16, 256, 32]) == [2, 0, 3, 1]
    assert ordinal_ranks(["fp16", "bf16", "tf32"]) == [0, 1, 2]
    assert ordinal_ranks([True, False]) == [0, 1]  # booleans are not sizes


def _pattern(space: dict, check=lambda c: None, default=None, seed: int = 0):
    from harness.search.strategies.pattern import PatternStrategy
    from harness.search.valid import ValidSpace

    valid = ValidSpace(space, check, seed)
    point = valid.index(default) if default else None
    return PatternStrategy(Setup(valid, seed, budget=20, default=point)), valid


def test_pattern_neighbours_are_ordinal_steps() -> None:
    """Tile sizes listed out of order still step by value: from 64, one step is 32 or
    128; two tunables move one step each at radius 2."""
    space = {"BLOCK": [128, 32, 64, 256], "warps": [2, 4, 8]}
    s, valid = _pattern(space)
    centre = valid.index({"BLOCK": 64, "warps": 4})
    one = {tuple(valid.config(p).values()) for p in s.neighbours(centre, 1)}
    assert one == {(32, 4), (128, 4), (64, 2), (64, 8)}
    two = {tuple(valid.config(p).values()) for p in s.neighbours(centre, 2)}
    assert two == {(256, 4), (32, 2), (32, 8), (128, 2), (128, 8)}


def test_the_ordinal_model_predicts_an_untried_value_from_its_neighbours() -> None:
    """One tunable of eight ordered values, latency falling with each step: measured at
    the first four, the model expects the fifth to be faster still (the trend), not the
    mean of what it saw; it reproduces what it measured, is sure of it, and is less sure
    the further a value is from the measured ones."""
    from harness.search.strategies.pattern import OrdinalModel

    pts = [(v,) for v in range(4)]
    ys = [4.0, 3.0, 2.0, 1.0]
    model = OrdinalModel([list(range(8))], noise=1e-4).fit(pts, ys)
    assert model.predict(pts) == pytest.approx(ys, abs=1e-2)
    nxt, far = model.predict([(4,), (7,)])
    assert nxt < 1.0 and far < nxt  # carried on, not back to the mean (2.5)
    spread = model.spread([(1,), (4,), (7,)])
    assert spread[0] < 0.05 < spread[1] < spread[2]


def test_pattern_walks_from_the_default_to_the_optimum_of_a_smooth_space() -> None:
    """A bowl over four ordinal tunables (480 configs, 20 of them invalid)
    with its minimum four steps from the default: pattern, told each result, reaches it
    within 16 asks, every ask a valid untried config near one measured before it."""
    space = {"BLOCK_M": [16, 32, 64, 128, 256, 512], "BLOCK_N": [16, 32, 64, 128],
             "warps": [1, 2, 4, 8, 16], "stages": [2, 3, 4, 5]}

    def check(c):
        return "too big" if c["BLOCK_M"] * c["BLOCK_N"] > 512 * 64 else None

    def latency(c):
        import math

        return (1 + (math.log2(c["BLOCK_M"]) - 7) ** 2 + (math.log2(c["BLOCK_N"]) - 6) ** 2
                + 0.5 * (math.log2(c["warps"]) - 2) ** 2 + 0.3 * (c["stages"] - 4) ** 2)

    default = {"BLOCK_M": 32, "BLOCK_N": 32, "warps": 2, "stages": 3}
    for seed in range(3):
        s, valid = _pattern(space, check, default, seed)
        tried = {valid.index(default)}
        s.tell(valid.index(default), Outcome("measured", latency(default), 1.0))
        asks, ms = 0, latency(default)
        while ms > 1.0 and asks < 16:
            point = s.ask(frozenset(tried))
            assert point is not None and point not in tried and valid.reason(point) is None
            assert min(s._steps(point, t) for t in tried) <= 3
            tried.add(point)
            ms = latency(valid.config(point))
            s.tell(point, Outcome("measured", ms, 1.0))
            asks += 1
        assert ms == 1.0, (seed, asks)


def test_pattern_reaches_every_committed_case_within_its_budget() -> None:
    """Each recorded sweep of the corpus, replayed with pattern (seed 0): within 2 % of
    the grid's best well before the grid is spent."""
    for path in sorted((ROOT / "benchmarks" / "replay").glob("*/*.json")):
        t = rp.Table.load(path)
        m = rp.metrics(rp.replay(t, "pattern", 0, in_flight=2), t)
        assert m["reached"] and m["cost_fraction"] < 0.4, (t.name, m)


# -- auto: the default, by the space's size ---------------------------------------------------


def test_auto_walks_small_spaces_and_models_large_ones() -> None:
    """``auto`` runs pattern on a space of up to LARGE valid configs (the recorded grids of
    at most 216, where the walk won) and TPE on a larger one or one too large to count
    (the recorded spaces of 2,000 and more, where TPE won); it asks what that strategy
    asks, seed for seed."""
    from harness.search.strategies.auto import LARGE, AutoStrategy
    from harness.search.valid import ValidSpace

    small = ValidSpace(SPACE, lambda c: None, 0)
    assert AutoStrategy(Setup(small, 0, budget=8)).chosen == "pattern"
    big_space = {"a": list(range(40)), "b": list(range(40))}  # 1,600 configs, all valid
    big = ValidSpace(big_space, lambda c: None, 0)
    assert big.count is not None and big.count > LARGE
    assert AutoStrategy(Setup(big, 0, budget=8)).chosen == "tpe"
    # Half of them invalid: 800 left, a small space again.
    half = ValidSpace(big_space, lambda c: "odd" if c["a"] % 2 else None, 0)
    assert half.count == 800 and AutoStrategy(Setup(half, 0, budget=8)).chosen == "pattern"
    huge = ValidSpace({f"t{i}": [1, 2, 4, 8] for i in range(8)}, lambda c: None, 0)
    assert huge.count is None and AutoStrategy(Setup(huge, 0, budget=8)).chosen == "tpe"
    auto, tpe = AutoStrategy(Setup(big, 3, budget=8)), registry.get("tpe")(Setup(big, 3, budget=8))
    tried: set[Point] = set()
    for _ in range(5):
        p = auto.ask(tried)
        assert p == tpe.ask(tried)
        tried.add(p)


@pytest.mark.parametrize("name", ["tpe", "cmaes", "auto"])
def test_a_model_based_strategy_knows_its_first_asks_ahead(name: str) -> None:
    """What the fleet compiles before a study's first result (``ahead``) is what the
    study's strategy then asks: an Optuna sampler's start-up draws come from its seed."""
    from harness.search.valid import ValidSpace

    space = {"a": list(range(40)), "b": list(range(40)), "c": [1, 2]}
    valid = ValidSpace(space, lambda c: "odd" if (c["a"] + c["b"]) % 3 == 0 else None, 0)
    default = valid.index({"a": 4, "b": 5, "c": 1})
    setup = Setup(valid, 7, budget=20, parallel=2, default=default)
    first = registry.get(name)(setup).ahead(4)
    assert len(first) == 4 and default not in first
    study = registry.get(name)(setup)
    tried = {default}
    study.tell(default, Outcome("measured", 1.0, 0.5))  # the default, measured unasked
    asked = []
    for _ in range(4):
        p = study.ask(tried)
        asked.append(p)
        tried.add(p)
    assert asked == first
