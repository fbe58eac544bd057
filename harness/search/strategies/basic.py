"""Strategies that need no model: ``random`` draws uniformly among the valid configs not
yet tried; ``grid`` walks them in the grid's seeded order (``valid.Permutation``), the
order the compile-ahead of a new worker follows too (``ahead``)."""

from __future__ import annotations

import random
from collections.abc import Set

from harness.search.strategies.base import Point, Setup, Strategy
from harness.search.strategies.registry import register


@register("random")
class RandomStrategy(Strategy):
    """Uniform among the valid, untried configs."""

    def __init__(self, setup: Setup) -> None:
        super().__init__(setup)
        self._rng = random.Random(setup.seed)

    def ask(self, tried: Set[Point]) -> Point | None:
        return self.space.sample(self._rng, tried)


@register("grid")
class GridStrategy(Strategy):
    """The valid configs in the grid's seeded order."""

    ahead_whatever_results = True

    def ask(self, tried: Set[Point]) -> Point | None:
        return self.space.next_in_grid(tried)

    def ahead(self, n: int) -> list[Point]:
        out: dict[Point, None] = {}  # ordered, and a set for next_in_grid
        while len(out) < n:
            point = self.space.next_in_grid(out.keys())
            if point is None:
                break
            out[point] = None
        return list(out)
