"""The strategy interface: which config a study measures next.

A strategy chooses, one config at a time, among the *valid* configs of a study's space
(those that pass the kernel's static constraints, ``harness.search.valid``) that the
study has not tried yet. Every study drives every strategy the same way
(``harness.search.study.Search``; the replay drives it through the same ``Search``)::

    strategy = cls(setup)          # once per study (again on resume, then told the past)
    point = strategy.ask(tried)    # a valid point not in ``tried``; None: nothing left
    strategy.tell(point, outcome)  # what its measurement gave; also for the configs the
                                   # study measured without asking (warm start, resume)

A *point* is a config's position on the space's grid: one choice index per tunable, in
the space's order (``setup.space.config(point)`` is the config, ``setup.space.index``
the way back). A space lists each tunable's choices in order (tile sizes ascending), so
a point's coordinates are ordinal. The study keeps the budget, answers repeated configs
from what it measured, and stores everything; a strategy only chooses.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Set
from dataclasses import dataclass
from typing import ClassVar, Literal

from harness.search.valid import Index, ValidSpace

#: A config's position on its space's grid (``ValidSpace``): choice indices, in order.
Point = Index


@dataclass(frozen=True)
class Setup:
    """What a strategy is given about its study."""

    space: ValidSpace  # the valid configs: ``reason(point)`` is None for each of them
    seed: int
    budget: int  # configs the study measures at most
    parallel: int = 1  # configs in flight at once: asks come before earlier ones are told
    #: The kernel's default config (known to run well enough), where it is a valid point.
    #: The study measures it first (``search.warm_start``) without asking.
    default: Point | None = None
    #: Configs that won elsewhere (``harness.search.warmstart``: other shapes, other GPUs),
    #: best first; the study measures them after the default without asking.
    starts: tuple[Point, ...] = ()


@dataclass(frozen=True)
class Outcome:
    """What became of one config."""

    status: Literal["measured", "failed", "cut"]
    #: ``measured``: its median latency; ``cut``: the cheap pass's, after which the
    #: multi-fidelity pruner stopped it; ``failed``: None.
    latency_ms: float | None = None
    cost_s: float = math.nan  # device seconds it took (first launch + timing); nan: unknown

    @property
    def ok(self) -> bool:
        return self.status == "measured"


class Strategy(ABC):
    """Chooses the configs a study measures. Subclasses register under a name
    (``harness.search.strategies.register``, or the ``kernel_harness.strategies``
    entry-point group of another package) that ``search.strategy`` selects."""

    #: The registered name (set by the registry).
    name: ClassVar[str] = ""
    #: Whether ``ahead`` is what it asks whatever the results (a grid's order), not only
    #: until a first result arrives: a study that has not begun has all of it compiled.
    ahead_whatever_results: ClassVar[bool] = False

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        self.space = setup.space

    @abstractmethod
    def ask(self, tried: Set[Point]) -> Point | None:
        """A valid point not in ``tried`` (every config the study has, in any state, in
        flight included), or None when there is none to propose."""

    def tell(self, point: Point, outcome: Outcome) -> None:  # noqa: B027 (optional)
        """The outcome of a config the study measured (asked by this strategy or not)."""

    def ahead(self, n: int) -> list[Point]:
        """Up to ``n`` points this strategy asks first, which the workers compile while
        they start: whatever the results (a grid: its order), or those it asks before
        its first result arrives; [] where it cannot tell."""
        return []

    def first_asks(self, n: int) -> list[Point]:
        """The first ``n`` asks of a new strategy of this class and set-up, told nothing:
        what a seeded strategy asks until its first result (the default's and the warm
        start's, measured without asking, count as tried)."""
        probe = type(self)(self.setup)
        tried = {p for p in (self.setup.default, *self.setup.starts) if p is not None}
        out: list[Point] = []
        while len(out) < n:
            point = probe.ask(tried)
            if point is None or point in tried:
                break
            out.append(point)
            tried.add(point)
        return out
