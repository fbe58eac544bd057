"""``auto``: the strategy the replay of recorded sweeps found best for the study's space.

On the recorded sweeps (``benchmarks/replay``, ``docs/search.md``) the two best strategies
split by the size of the space. On grids of up to a few hundred valid configs ``pattern``
(a walk from the default to neighbouring tile sizes) reaches 2 % of the optimum for less
GPU time than TPE: its first steps from a good default are most of such a grid's
improvements, while TPE spends 8 random start-up trials. On spaces of 2,000 valid configs
and more (10-14 tunables: tile shapes, stages, warps, persistence, TMA, launch orders)
TPE wins: a walk moving one tunable at a time needs many steps to cross such a space,
while TPE's model of which values go with good latencies moves several at once.

``auto`` therefore runs ``pattern`` where the space holds at most ``LARGE`` valid configs,
else ``tpe``. A space too large to count (more than ``valid.EXACT_LIMIT`` raw configs) is
large.
"""

from __future__ import annotations

from collections.abc import Set

from harness.search.strategies.base import Outcome, Point, Setup, Strategy
from harness.search.strategies.registry import get, register

#: Valid configs above which a space counts as large. The recorded evidence has spaces
#: of at most 216 valid configs (pattern best) and of 2,086-2,712 (TPE best): the bound
#: sits between them.
LARGE = 1000


def choose(setup: Setup) -> str:
    """The strategy ``auto`` runs for ``setup``'s space."""
    count = setup.space.count
    return "pattern" if count is not None and count <= LARGE else "tpe"


@register("auto")
class AutoStrategy(Strategy):
    """``pattern`` on spaces of up to ``LARGE`` valid configs, ``tpe`` on larger ones."""

    def __init__(self, setup: Setup) -> None:
        super().__init__(setup)
        self.chosen = choose(setup)
        self.inner: Strategy = get(self.chosen)(setup)

    def ask(self, tried: Set[Point]) -> Point | None:
        return self.inner.ask(tried)

    def tell(self, point: Point, outcome: Outcome) -> None:
        self.inner.tell(point, outcome)

    def ahead(self, n: int) -> list[Point]:
        return self.inner.ahead(n)
