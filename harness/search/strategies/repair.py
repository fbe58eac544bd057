"""An Optuna sampler whose proposals are moved into the valid set: the heart of the
``optuna_family`` strategies (imported when one of them is built: Optuna is heavy)."""

from __future__ import annotations

import random
from collections.abc import Set
from typing import Any

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution
from optuna.trial import FrozenTrial, TrialState

from harness.search.valid import Index, ValidSpace


class RepairSampler(optuna.samplers.BaseSampler):
    """``base``'s proposal moved to the nearest valid config not in ``seen`` (set before
    each ask); ``exhausted`` once none is left."""

    def __init__(self, space: ValidSpace, base: optuna.samplers.BaseSampler,
                 rng: random.Random, dists: dict[str, CategoricalDistribution]):
        self.space, self.base, self._rng, self._space = space, base, rng, dists
        self.seen: Set[Index] = frozenset()
        self.exhausted = False

    def reseed_rng(self) -> None:
        self._rng.seed()
        self.base.reseed_rng()

    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial
                                    ) -> dict[str, BaseDistribution]:
        return {n: d for n, d in self._space.items() if not d.single()}

    def sample_relative(self, study: optuna.Study, trial: FrozenTrial,
                        search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        if not search_space:
            return {}
        idx = self.space.nearest(self._propose(study, trial), self._rng, self.seen)
        if idx is None:
            self.exhausted = True
            return {}
        return self.space.config(idx)

    def _propose(self, study: optuna.Study, trial: FrozenTrial) -> dict[str, Any]:
        space = self.base.infer_relative_search_space(study, trial)
        params = dict(self.base.sample_relative(study, trial, space)) if space else {}
        for name, dist in self._space.items():
            if name not in params:
                params[name] = (dist.choices[0] if dist.single() else
                                self.base.sample_independent(study, trial, name, dist))
        return params

    def sample_independent(self, study: optuna.Study, trial: FrozenTrial, name: str,
                           distribution: BaseDistribution) -> Any:
        # Reached only where nothing valid and untried is left (``exhausted``).
        return self.base.sample_independent(study, trial, name, distribution)

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        self.base.before_trial(study, trial)

    def after_trial(self, study: optuna.Study, trial: FrozenTrial, state: TrialState,
                    values: Any) -> None:
        self.base.after_trial(study, trial, state, values)
