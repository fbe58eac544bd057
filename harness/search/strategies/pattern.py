"""``pattern``: a walk over a kernel space's ordinal tunables (placeholder)."""

from __future__ import annotations

import random
from collections.abc import Set

from harness.search.strategies.base import Point, Setup, Strategy
from harness.search.strategies.registry import register


@register("pattern")
class PatternStrategy(Strategy):
    def __init__(self, setup: Setup) -> None:
        super().__init__(setup)
        self._rng = random.Random(setup.seed)

    def ask(self, tried: Set[Point]) -> Point | None:
        return self.space.sample(self._rng, tried)
