"""The Optuna sampler and pruners of the studies.

A study's Optuna study samples through ``StrategySampler``: each trial takes its search
strategy's next point (``harness.search.strategies``: a valid config the study has not
tried), so that an ask is a config to measure, not a guess static pruning throws away.
The pruners are the multi-fidelity cut (``search.pruner``).
"""

from __future__ import annotations

import random
from typing import Any

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution
from optuna.trial import FrozenTrial, TrialState

from harness.experiment import SearchSettings
from harness.search.strategies.base import Strategy
from harness.search.valid import Index, ValidSpace


class StrategySampler(optuna.samplers.BaseSampler):
    """The sampler of a study's Optuna study: a trial that was not enqueued (warm start, a
    resumed config) takes the strategy's next point. What the study has tried is read
    from its trials as they come."""

    def __init__(self, strategy: Strategy, valid: ValidSpace):
        self.strategy, self.valid = strategy, valid
        self._space = {n: CategoricalDistribution(c)
                       for n, c in zip(valid.names, valid.choices, strict=True)}
        self._next = 0  # trials before this position are read (or in ``_incomplete``)
        self._incomplete: list[int] = []  # positions of trials read before their params
        self._tried: set[Index] = set()
        self._rng = random.Random(0)
        self.exhausted_at: int | None = None  # the trial for which none was left

    def tried(self, study: optuna.Study) -> set[Index]:
        """The points of every config the study has (complete parameters), in any state.
        Each call reads only the trials added since the last and those whose parameters
        were incomplete then (the trial being asked), so that a study of thousands of
        trials does not read them all again at every ask."""
        trials = study.get_trials(deepcopy=False)  # in trial-number order
        todo = [*self._incomplete, *range(self._next, len(trials))]
        self._next, self._incomplete = len(trials), []
        for i in todo:
            t = trials[i]
            if len(t.params) == len(self._space):
                idx = self.valid.index(t.params)
                if idx is not None:
                    self._tried.add(idx)
            else:
                self._incomplete.append(i)
        return self._tried

    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial
                                    ) -> dict[str, BaseDistribution]:
        return {n: d for n, d in self._space.items() if not d.single()}

    def sample_relative(self, study: optuna.Study, trial: FrozenTrial,
                        search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        if not search_space or trial.system_attrs.get("fixed_params"):
            return {}
        point = self.strategy.ask(frozenset(self.tried(study)))
        if point is None:
            self.exhausted_at = trial.number
            return {}
        if not self.valid.is_point(point):
            raise TypeError(f"strategy {self.strategy.name!r} asked for {point!r}, which is "
                            f"not a point of the space (one choice index per tunable of "
                            f"{self.valid.names})")
        return self.valid.config(tuple(point))

    def sample_independent(self, study: optuna.Study, trial: FrozenTrial, name: str,
                           distribution: BaseDistribution) -> Any:
        # Reached only where the strategy had nothing left: the Search answers the repeat
        # from what it knows.
        assert isinstance(distribution, CategoricalDistribution)
        return self._rng.choice(distribution.choices)


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
