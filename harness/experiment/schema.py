"""The experiment file's schema (pydantic): every field, its type and its bounds."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from harness.measure import hardware as hw
from harness.search.strategies import registry as strategies

#: Configs per study: a million is past any grid measured; more is a typo (``1.0e+30``).
MAX_TRIALS = 1_000_000
#: Optuna's samplers take NumPy seeds, which are 32-bit: a larger one failed at the first
#: study, after Ray had started.
MAX_SEED = 2**32 - 1
#: ``runs/<name>/`` and the MLflow experiment: well inside a file name's 255 bytes.
MAX_NAME = 100


class ExperimentError(Exception):
    """A bad experiment file. ``str()`` names the file and the field."""

    def __init__(self, path: str | Path, field: str, message: str):
        self.path, self.field, self.message = str(path), field, message
        super().__init__(f"{path}: {field}: {message}" if field else f"{path}: {message}")


class _Strict(BaseModel):
    # Strict: a value keeps the type YAML gave it (``true`` is not 1, ``"64"`` not 64, a
    # float not an int); floats are finite (``.inf`` as a time or a budget is a typo).
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class SearchSettings(_Strict):
    strategy: str = Field(
        "auto", validation_alias=AliasChoices("strategy", "sampler"),
        description="how the search chooses the next config: a registered strategy "
        "(harness/search/strategies; other packages add theirs under the entry-point group "
        "kernel_harness.strategies). ``sampler`` is accepted for it. auto: pattern on "
        "spaces of up to 1,000 valid configs, tpe on larger ones, the best of each on the "
        "replay of recorded sweeps (benchmarks/replay/report.md)")
    trials: int = Field(32, ge=1, le=MAX_TRIALS,
                        description="trials per study, the default config included")
    timeout_s: float | None = Field(None, gt=0, description="wall-clock limit for the whole run")
    warm_start: bool = Field(True, description="enqueue the default config as the first trial")
    seed_from_packs: bool = Field(True, description="then the winners of the packs: this "
                                  "hardware's for the same and the nearest shapes, other "
                                  "hardware's for the same shape (harness/search/warmstart.py)")
    max_abs_err: float | None = Field(None, gt=0, description="required accuracy: a trial whose "
                                      "max abs error exceeds it fails (on top of the kernel's "
                                      "own tolerance)")
    max_rel_err: float | None = Field(None, gt=0, description="likewise for the max error "
                                      "relative to the output's largest magnitude")
    remeasure_top_k: Annotated[int, Field(ge=0, le=16)] | Literal["auto"] = Field(
        "auto", description="at the end of a study, re-measure its best k configs interleaved "
        "and pick the winner by their median (0: off; auto: 5 on GPUs, off under the CPU "
        "interpreter, whose timings mean nothing)")
    remeasure_rounds: int = Field(
        5, ge=1, le=20, description="re-measurements of each of them (five: a median that one "
        "or two disturbed measurements, such as a GPU's clock dipping, do not move); one "
        "6 % behind the fastest in each of its first two is timed no further, and the "
        "baselines are timed in the first three")
    remeasure_rep_ms: float = Field(
        60.0, gt=0, description="do_bench's rep budget of each re-measurement (ms; at "
        "least timing.rep_ms): they decide between configs a few percent apart, which a "
        "short budget cannot order on a GPU whose clock moves under its power cap")
    remeasure_warmup_ms: float = Field(
        5.0, gt=0, description="do_bench's warm-up budget of each re-measurement (ms; at "
        "most timing.warmup_ms): every finalist has run in the search and the GPU is kept "
        "busy from round to round, so its clock is up; a full warm-up per round was a "
        "third of a small kernel's final phase")
    pruner: Literal["none", "threshold", "median", "percentile"] = Field(
        "none", description="multi-fidelity: each config is first timed cheaply "
        "(cheap_rep_ms), this Optuna pruner stops the clearly bad ones there, the others are "
        "timed in full (none: every config timed in full at once; threshold: cheap time "
        "> best so far x (1 + prune_margin))")
    cheap_rep_ms: float = Field(10.0, gt=0, description="do_bench's rep budget of the cheap "
                                "pass (the full pass uses timing.rep_ms)")
    prune_margin: float = Field(0.10, ge=0, description="threshold pruner: how much slower "
                                "than the best so far a cheap time may be and go on")
    prune_percentile: float = Field(25.0, gt=0, lt=100, description="percentile pruner: keep "
                                    "the configs whose cheap time is in this best percentile")
    prune_startup_trials: int = Field(4, ge=0, description="complete trials before pruning "
                                      "starts")
    max_stalled_asks: int = Field(100, ge=1, description="end a study after this many asks "
                                  "in a row that brought no new config (a strategy stuck on "
                                  "pruned or measured configs)")

    @model_validator(mode="before")
    @classmethod
    def _one_name(cls, data: Any) -> Any:
        if isinstance(data, dict) and "strategy" in data and "sampler" in data:
            raise PydanticCustomError("strategy_twice", "give one of strategy and sampler "
                                      "(sampler is the strategy's older name)")
        return data

    @field_validator("strategy")
    @classmethod
    def _registered(cls, v: str) -> str:
        if v not in strategies.names():
            raise PydanticCustomError(
                "unknown_strategy", "Input should be a registered strategy: {known} (got "
                "{got}; other packages add theirs under the entry-point group {group})",
                {"known": ", ".join(strategies.names()), "got": repr(v),
                 "group": strategies.ENTRY_POINT_GROUP})
        return v

    @property
    def sampler(self) -> str:
        """The strategy's name (``search.sampler`` is its older name)."""
        return self.strategy


class TimingSettings(_Strict):
    warmup_ms: float = Field(25.0, gt=0)
    rep_ms: float = Field(100.0, gt=0)
    trial_timeout_s: float = Field(300.0, gt=0, description="a trial longer than this is a hang")


class TrackingSettings(_Strict):
    uri: str | None = Field(None, description="MLflow tracking URI; default: sqlite:///mlflow.db "
                            "or $MLFLOW_TRACKING_URI. An HTTP(S) URI's user:password moves "
                            "into MLFLOW_TRACKING_USERNAME/PASSWORD as the file is read")
    experiment: str | None = Field(None, description="MLflow experiment name; default: the name")

    @field_validator("uri")
    @classmethod
    def _no_credentials(cls, v: str | None) -> str | None:
        from harness.experiment.uris import uri_problem
        from harness.tracking.redact import move_credentials

        # Checked before the credentials move: a URI read wrongly would move part of a
        # password and leave the rest in the URI. The message never holds the URI.
        why = uri_problem(v) if v else None
        if why:
            raise ValueError(why)
        return move_credentials(v)


class OutputSettings(_Strict):
    packs_dir: str = Field("packs", min_length=1, description="where the run's packs are "
                           "written: the user's directory (./packs), never the shipped ones")
    runs_dir: str = Field("runs", min_length=1)

    @field_validator("packs_dir")
    @classmethod
    def _not_the_package(cls, v: str) -> str:
        package = Path(__file__).resolve().parents[1]  # harness/: shipped packs live there
        try:
            inside = Path(v).resolve().is_relative_to(package)
        except (OSError, RuntimeError) as exc:  # a symlink loop, a name too long
            raise ValueError(f"{v!r}: {exc}") from None
        if inside:
            raise ValueError(f"{v!r} is inside the installed harness package ({package}): "
                             "a run writes to the user's packs directory, e.g. 'packs'")
        return v


class FleetSettings(_Strict):
    wait_for_nodes_s: float = Field(
        0.0, ge=0, description="how long to wait for an autoscaler to bring nodes of a listed "
        "hardware key the cluster lacks (0: report it and skip its studies at once)")
    queue_depth: Annotated[int, Field(ge=1, le=64)] | Literal["auto"] = Field(
        "auto", description="tasks queued on each worker, so that it never waits on the "
        "driver; the worker compiles the queued configs ahead while it times the current one "
        "(auto: its compile processes + 2)")
    compile_workers: Annotated[int, Field(ge=0, le=64)] | Literal["auto"] = Field(
        "auto", description="processes per worker that compile queued configs ahead "
        "(0: compile on first launch; auto: the node's cores per GPU less one, at most 16)")
    compile_timeout_s: float = Field(
        30.0, gt=0, description="a config whose compile takes longer fails its trial as a "
        "compile time-out, on the node's compile service (one that spills registers can "
        "compile for minutes); configs compiled in the worker itself (compile_workers: 0, "
        "or a family that does not compile ahead) are bounded by timing.trial_timeout_s "
        "instead")
    compile_timeout_ratio: float = Field(
        5.0, ge=0, description="once 5 configs of a problem have compiled, one still "
        "compiling after this many times their median compile time fails as a compile "
        "time-out too (never before 10 s; 0: only compile_timeout_s)")
    max_retries: int = Field(2, ge=0, description="retries of a trial whose worker was lost")
    start_timeout_s: float = Field(600.0, gt=0, description="how long a worker may take to start")
    keep_workers_s: float = Field(
        0.0, ge=0, description="keep the GPU workers and their compile processes this many "
        "idle seconds after the run, on a cluster that outlives it (`ray start --head`, `ray "
        "job submit`), so that the next run with the same code starts on them at once "
        "(0: they end with the run; they hold their GPUs while kept)")
    bookkeeping: Literal["auto", "processes", "threads"] = Field(
        "auto", description="where the run writes its Optuna trials and MLflow logs: "
        "processes of their own, so that a driver feeding GPUs never waits on SQLite, or "
        "threads of the driver, which start at once and cost no CPU beside it (a driver "
        "of few cores, a run on simulated GPUs); auto: processes where the run has GPU "
        "targets")


class BaselineSettings(_Strict):
    compile: bool | Literal["auto"] = Field(
        "auto", description="time the PyTorch eager code under torch.compile as a third "
        "baseline (auto: on GPUs, not under the CPU interpreter, where it says nothing)")


#: A tunable's choices: a non-empty list of scalars, or null (remove the tunable).
Choices = Annotated[list[StrictBool | StrictInt | StrictFloat | StrictStr],
                    Field(min_length=1)] | None


def _not_empty(v: dict[str, Any] | None) -> dict[str, Any] | None:
    if v is not None and not v:
        raise ValueError("empty: name the tunables to change, or leave the section out "
                         "(the family's whole space is tuned without it)")
    return v


class SpaceSection(_Strict):
    params: dict[str, Choices] | None = None

    @field_validator("params")
    @classmethod
    def _params(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        return _not_empty(v)


class SearchSpace(_Strict):
    """The inline ``search_space``: applied over the family's declared space
    (``Kernel.search_space``), in the same structure."""

    params: dict[str, Choices] | None = None
    vendors: dict[Literal["nvidia", "amd", "cpu"], SpaceSection | None] | None = None
    hardware: dict[str, SpaceSection | None] | None = None

    @field_validator("params", "vendors")
    @classmethod
    def _sections(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        return _not_empty(v)

    @field_validator("hardware")
    @classmethod
    def _hw_sections(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        for key in v or {}:
            _check_hw_key(key)
        return _not_empty(v)


def _each_once(v: list[Any], field: str) -> list[Any]:
    """``v`` where no item repeats: each (shape, dtype, hardware) is one study, and a
    repeat would be a second study of the same problem (its name, storage and pack
    entry)."""
    seen: dict[Any, int] = {}
    for i, item in enumerate(v):
        key = tuple(sorted(item.items())) if isinstance(item, dict) else item
        if key in seen:
            raise ValueError(f"{field}[{i}] repeats {field}[{seen[key]}]: list each once")
        seen[key] = i
    return v


def _check_hw_key(key: str) -> None:
    if not hw.is_known_key(key):
        raise ValueError(f"unknown hardware key {key!r}: known keys are "
                         f"{', '.join(hw.known_keys())} (or 'auto'; a GPU the list lacks "
                         "goes by its device name, e.g. NVIDIA-GeForce-RTX-4090)")


class Experiment(_Strict):
    name: str = Field(..., min_length=1, max_length=MAX_NAME)
    kernel: str = Field(..., min_length=1)
    shapes: list[dict[str, int]] = Field(..., min_length=1)
    dtypes: list[Literal["bf16", "fp16", "fp32"]] = Field(default_factory=lambda: ["bf16"],
                                                           min_length=1)
    hardware: list[str] = Field(default_factory=lambda: ["auto"], min_length=1)
    search_space: dict[str, Any] = Field(default_factory=dict)
    search: SearchSettings = Field(default_factory=SearchSettings)
    timing: TimingSettings = Field(default_factory=TimingSettings)
    tracking: TrackingSettings = Field(default_factory=TrackingSettings)
    output: OutputSettings = Field(default_factory=OutputSettings)
    fleet: FleetSettings = Field(default_factory=FleetSettings)
    baselines: BaselineSettings = Field(default_factory=BaselineSettings)
    seed: int = Field(0, ge=0, le=MAX_SEED)

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", v):
            raise ValueError("use letters, digits, '.', '_' and '-' only")
        return v

    @field_validator("shapes", "dtypes")
    @classmethod
    def _listed_once(cls, v: list[Any], info: ValidationInfo) -> list[Any]:
        return _each_once(v, info.field_name or "")

    @field_validator("hardware")
    @classmethod
    def _hw_keys(cls, v: list[str]) -> list[str]:
        _each_once(v, "hardware")
        for key in v:
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]*", key):
                raise ValueError(f"bad hardware key {key!r}")
        if "auto" in v and len(v) > 1:
            raise ValueError("'auto' cannot be combined with explicit hardware keys")
        for key in v:
            if key != "auto":
                _check_hw_key(key)
        return v
