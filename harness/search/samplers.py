"""Samplers and pruners of the studies.

Every sampler draws from the space's valid set (``valid.ValidSpace``) and never repeats a
config the study has tried: ``random`` draws uniformly among the untried valid configs,
``grid`` walks them in the grid's seeded order, and the model-based samplers (TPE, CMA-ES,
GP) propose as they would, their proposal then repaired to the nearest untried valid
config. An ask is a config to measure, not a guess static pruning throws away.
"""

from __future__ import annotations

import random
from typing import Any

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution
from optuna.trial import FrozenTrial, TrialState

from harness.experiment import SearchSettings
from harness.search.valid import Index, ValidSpace


class ValidSampler(optuna.samplers.BaseSampler):
    """Hands out valid, untried configs: by ``mode`` ``random``, ``grid``, or ``repair``
    (``base``'s proposal moved to the nearest valid untried config). A trial enqueued with
    its parameters (warm start, a resumed config) keeps them."""

    def __init__(self, valid: ValidSpace, mode: str, seed: int,
                 base: optuna.samplers.BaseSampler | None = None):
        if mode == "repair" and base is None:
            raise ValueError("repair needs a base sampler")
        self.valid, self.mode, self.base = valid, mode, base
        self._rng = random.Random(seed)
        self._space = {n: CategoricalDistribution(c)
                       for n, c in zip(valid.names, valid.choices, strict=True)}
        self._tried: dict[int, Index | None] = {}  # trial number -> its config's point
        self.exhausted_at: int | None = None  # the trial for which none was left

    def reseed_rng(self) -> None:
        self._rng.seed()
        if self.base is not None:
            self.base.reseed_rng()

    def tried(self, study: optuna.Study) -> set[Index]:
        """The points of every config the study has (complete parameters), in any state."""
        for t in study.get_trials(deepcopy=False):
            if t.number not in self._tried and len(t.params) == len(self._space):
                self._tried[t.number] = self.valid.index(t.params)
        return {idx for idx in self._tried.values() if idx is not None}

    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial
                                    ) -> dict[str, BaseDistribution]:
        return {n: d for n, d in self._space.items() if not d.single()}

    def sample_relative(self, study: optuna.Study, trial: FrozenTrial,
                        search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        if not search_space or trial.system_attrs.get("fixed_params"):
            return {}
        seen = self.tried(study)
        if self.mode == "grid":
            idx = self.valid.next_in_grid(seen)
        elif self.mode == "random":
            idx = self.valid.sample(self._rng, seen)
        else:
            idx = self.valid.nearest(self._propose(study, trial), self._rng, seen)
        if idx is None:
            self.exhausted_at = trial.number
        return {} if idx is None else self.valid.config(idx)

    def _propose(self, study: optuna.Study, trial: FrozenTrial) -> dict[str, Any]:
        assert self.base is not None
        space = self.base.infer_relative_search_space(study, trial)
        params = dict(self.base.sample_relative(study, trial, space)) if space else {}
        for name, dist in self._space.items():
            if name not in params:
                params[name] = (dist.choices[0] if dist.single() else
                                self.base.sample_independent(study, trial, name, dist))
        return params

    def sample_independent(self, study: optuna.Study, trial: FrozenTrial, name: str,
                           distribution: BaseDistribution) -> Any:
        # Reached only where nothing valid and untried is left: the Search answers the
        # repeat from what it knows.
        if self.base is not None:
            return self.base.sample_independent(study, trial, name, distribution)
        assert isinstance(distribution, CategoricalDistribution)
        return self._rng.choice(distribution.choices)

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        if self.base is not None:
            self.base.before_trial(study, trial)

    def after_trial(self, study: optuna.Study, trial: FrozenTrial, state: TrialState,
                    values: Any) -> None:
        if self.base is not None:
            self.base.after_trial(study, trial, state, values)


def base_sampler(name: str, seed: int, n_parallel: int) -> optuna.samplers.BaseSampler | None:
    """The model-based sampler whose proposals ``ValidSampler`` repairs (None: random and
    grid, which draw from the valid set themselves)."""
    if name == "tpe":
        # constant_liar keeps parallel workers from being handed the same config.
        return optuna.samplers.TPESampler(seed=seed, constant_liar=n_parallel > 1,
                                          multivariate=True, n_startup_trials=8)
    if name == "cmaes":
        return optuna.samplers.CmaEsSampler(seed=seed, warn_independent_sampling=False)
    if name == "gp":
        return optuna.samplers.GPSampler(seed=seed)
    if name in ("random", "grid"):
        return None
    raise ValueError(f"unknown sampler {name!r}")


def make_sampler(settings: SearchSettings, valid: ValidSpace, seed: int,
                 n_parallel: int) -> ValidSampler:
    name = settings.sampler
    base = base_sampler(name, seed, n_parallel)
    mode = name if name in ("random", "grid") else "repair"
    return ValidSampler(valid, mode, seed, base)


class ThresholdPruner(optuna.pruners.BasePruner):
    """Multi-fidelity cut: a trial whose cheap measurement (step 0) is more than ``margin``
    slower than the best full measurement so far stops there, once ``n_startup_trials``
    trials are complete. Cheap timings are noisier, hence the margin."""

    def __init__(self, margin: float = 0.10, n_startup_trials: int = 4):
        self.margin = margin
        self.n_startup_trials = n_startup_trials

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        step = trial.last_step
        if step is None:
            return False
        done = [t.value for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                if t.value is not None]
        if len(done) < self.n_startup_trials:
            return False
        return trial.intermediate_values[step] > min(done) * (1 + self.margin)


def make_pruner(settings: SearchSettings) -> optuna.pruners.BasePruner:
    """The multi-fidelity pruner (``search.pruner``); ``none``: every config is timed in
    full at once."""
    name, startup = settings.pruner, settings.prune_startup_trials
    if name == "none":
        return optuna.pruners.NopPruner()
    if name == "threshold":
        return ThresholdPruner(settings.prune_margin, startup)
    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=startup, n_warmup_steps=0)
    if name == "percentile":
        return optuna.pruners.PercentilePruner(settings.prune_percentile,
                                               n_startup_trials=startup, n_warmup_steps=0)
    raise ValueError(f"unknown pruner {name!r}")
