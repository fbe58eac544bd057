"""Optuna's model-based samplers as strategies: ``tpe`` (the default), ``cmaes``, ``gp``.

Each runs on a study of its own (in memory) that holds what the harness told it. A
sampler proposes as it would; its proposal is then moved to the nearest valid config not
yet tried (fewest tunables changed, ties at random), and that config is the trial it
learns from. Configs the harness measured without asking (the warm start's, those of a
resumed study) are added to its study as finished trials when told.
"""

from __future__ import annotations

import math
import random
from collections.abc import Set
from typing import Any

from harness.search.strategies.base import Outcome, Point, Setup, Strategy
from harness.search.strategies.registry import register


class OptunaStrategy(Strategy):
    """An Optuna sampler (``make_sampler``) repaired into the valid set. A subclass names
    its sampler; ``OptunaStrategy.wrapping(sampler)`` wraps any Optuna sampler object
    (the replay compares samplers that have no name)."""

    #: Asks its sampler draws at random before it models results (``ahead``: past them
    #: it follows the measurements).
    startup: int = 8

    def __init__(self, setup: Setup, sampler: Any = None) -> None:
        import optuna
        from optuna.distributions import CategoricalDistribution

        from harness.search.strategies.repair import RepairSampler

        super().__init__(setup)
        self._dists = {n: CategoricalDistribution(c)
                       for n, c in zip(self.space.names, self.space.choices, strict=True)}
        # A sampler object given (``wrapping``) cannot be built again for ``ahead``'s probe.
        self._rebuildable = sampler is None
        base = sampler if sampler is not None else self.make_sampler(setup)
        self._sampler = RepairSampler(self.space, base, random.Random(setup.seed),
                                      self._dists)
        self._study = optuna.create_study(direction="minimize", sampler=self._sampler)
        self._open: dict[Point, Any] = {}  # point -> its trial, asked and not yet told

    def make_sampler(self, setup: Setup) -> Any:
        raise NotImplementedError

    @classmethod
    def wrapping(cls, sampler: Any, setup: Setup) -> OptunaStrategy:
        """A strategy that repairs ``sampler``'s (an Optuna sampler's) proposals."""
        return cls(setup, sampler)

    def ask(self, tried: Set[Point]) -> Point | None:
        from optuna.trial import TrialState

        self._sampler.seen = tried
        trial = self._study.ask(self._dists)
        if self._sampler.exhausted:
            self._study.tell(trial, state=TrialState.FAIL)
            return None
        point = self.space.index(trial.params)
        if point is None or point in tried:  # the sampler kept a fixed proposal
            self._study.tell(trial, state=TrialState.FAIL)
            return None
        self._open[point] = trial
        return point

    def ahead(self, n: int) -> list[Point]:
        """The first ``n`` asks before any result: a sampler's start-up draws (random, from
        its seed) until it has results to model, so the study's own strategy, with the
        same set-up, asks the same while the default and the warm start are measured."""
        return self.first_asks(min(n, self.startup)) if self._rebuildable else []

    def tell(self, point: Point, outcome: Outcome) -> None:
        import optuna
        from optuna.trial import TrialState

        trial = self._open.pop(point, None)
        value = outcome.latency_ms
        if trial is None:  # measured without being asked: a finished trial of its own
            params = self.space.config(point)
            if _finite(outcome):
                done = optuna.trial.create_trial(params=params, distributions=self._dists,
                                                 value=value)
            elif outcome.status == "cut" and value is not None:
                done = optuna.trial.create_trial(
                    params=params, distributions=self._dists, state=TrialState.PRUNED,
                    intermediate_values={0: value})
            else:
                done = optuna.trial.create_trial(params=params, distributions=self._dists,
                                                 state=TrialState.FAIL)
            self._study.add_trial(done)
        elif _finite(outcome):
            self._study.tell(trial, value)
        elif outcome.status == "cut" and value is not None:
            trial.report(value, 0)  # cut after its cheap pass, as the harness records it
            self._study.tell(trial, state=TrialState.PRUNED)
        else:
            self._study.tell(trial, state=TrialState.FAIL)


def _finite(outcome: Outcome) -> bool:
    v = outcome.latency_ms
    return outcome.ok and v is not None and math.isfinite(v)


@register("tpe")
class TPEStrategy(OptunaStrategy):
    """Optuna's TPE: multivariate, 8 random start-up trials, a constant liar while
    configs are in flight (so that parallel workers are not handed the same region)."""

    def make_sampler(self, setup: Setup) -> Any:
        import optuna

        return optuna.samplers.TPESampler(seed=setup.seed, constant_liar=setup.parallel > 1,
                                          multivariate=True, n_startup_trials=self.startup)


@register("cmaes")
class CmaEsStrategy(OptunaStrategy):
    """Optuna's CMA-ES (categorical tunables, all of the harness's, are drawn by its
    independent sampler: at random)."""

    def make_sampler(self, setup: Setup) -> Any:
        import optuna

        return optuna.samplers.CmaEsSampler(seed=setup.seed, warn_independent_sampling=False)


@register("gp")
class GPStrategy(OptunaStrategy):
    """Optuna's Gaussian-process sampler."""

    def make_sampler(self, setup: Setup) -> Any:
        import optuna

        return optuna.samplers.GPSampler(seed=setup.seed, n_startup_trials=self.startup)

    startup = 10  # Optuna's own default for its Gaussian process
