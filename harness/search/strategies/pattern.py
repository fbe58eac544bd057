"""``pattern``: a walk over a kernel space's ordinal tunables, ranked by what it measured.

Kernel tunables are ordered (tile sizes are increasing powers of two; warps, stages), the
best config is usually a few steps from a good one, and a study starts from good ones:
the kernel's default config and the winners of other shapes and GPUs (the warm start),
which the study measures first. From there this strategy asks for the untried valid
neighbours of the best configs measured so far (one tunable moved by one step first,
then two at once, then further), ranked by a model of the latencies measured so far;
among neighbours the model cannot tell apart, the one its model of device seconds
(compile and timing) expects cheapest goes first. Where every neighbour of the best
configs has been tried it draws at random among the valid configs.

The model (``OrdinalModel``) is a Gaussian process on log latency with a kernel made for
ordered tunables: a value is like its neighbours (an untried tile size is predicted from
the sizes beside it, not from the mean of everything), two tunables may interact (a
tile's size and its warps), and a trend carries on (more stages kept helping, so the next
count is expected to help too). Candidates are ranked by its prediction less a share of
its uncertainty, so that a direction not yet measured is tried before the known ones are
refined. Latencies above twice the best count as twice the best: a config ten times
slower (a wide tile on four warps) says little about its other values.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator, Sequence, Set
from typing import Any

from harness.search.strategies.base import Outcome, Point, Setup, Strategy
from harness.search.strategies.registry import register


def ordinal_ranks(choices: Sequence[object]) -> list[int]:
    """Each choice's rank in its tunable's order: by value where all are numbers (a
    space may list 128 before 64), else as listed."""
    if all(isinstance(c, int | float) and not isinstance(c, bool) for c in choices):
        order = sorted(range(len(choices)), key=lambda i: choices[i])  # type: ignore[index]
        ranks = [0] * len(choices)
        for r, i in enumerate(order):
            ranks[i] = r
        return ranks
    return list(range(len(choices)))


class OrdinalModel:
    """Kernel ridge regression (the mean of a Gaussian process) over points, with a
    kernel for ordinal tunables: ``k(a, b) = sum_i e_i / alpha + sum_{i<j} e_i e_j /
    pair_alpha + <t(a), t(b)> / trend_alpha + noise [a == b]``, where ``e_i = exp(-|rank
    difference of tunable i| / length)`` (neighbouring values are alike: an untried tile
    size is predicted from its neighbours', not from the mean), the pair term lets two
    tunables interact (a tile's size and its warps), and ``t`` is a point's ordinal
    positions, centred (a trend: more stages kept helping, so the next count should too).
    Its cost grows with the points fitted, not with the space."""

    def __init__(self, ranks: Sequence[Sequence[int]], alpha: float = 1.0,
                 pair_alpha: float | None = 10.0, trend_alpha: float | None = 1.0,
                 noise: float = 0.05, length: float = 1.5):
        import numpy as np  # here: the schema imports this module (through the registry)

        self.np = np
        width = max(len(r) for r in ranks)
        # rank[i][v]: tunable i's choice v's ordinal position, centred
        self.rank = np.array([[r[v] - (len(r) - 1) / 2 if v < len(r) else 0.0
                               for v in range(width)] for r in ranks])
        self.alpha, self.pair_alpha, self.trend_alpha = alpha, pair_alpha, trend_alpha
        self.noise, self.length = noise, length
        self.offset = 10.0
        self.x: Any = None
        self.dual: Any = None
        self.chol: Any = None
        self.mean = 0.0

    def _ranks(self, pts: Any) -> Any:
        return self.rank[self.np.arange(pts.shape[1]), pts]

    def _kernel(self, a: Any, b: Any) -> Any:
        np = self.np
        ra, rb = self._ranks(a), self._ranks(b)
        e = np.exp(-np.abs(ra[:, None, :] - rb[None, :, :]) / self.length)
        total = e.sum(-1)
        k = total / self.alpha
        if self.pair_alpha:
            k += (total ** 2 - (e ** 2).sum(-1)) / 2 / self.pair_alpha
        if self.trend_alpha:
            # With an offset of its own: a line need not pass through the middle rank.
            k += (ra @ rb.T + self.offset) / self.trend_alpha
        return k

    def fit(self, points: Sequence[Point], ys: Sequence[float]) -> OrdinalModel:
        np = self.np
        self.x = np.asarray(points, dtype=int)
        y = np.asarray(ys, dtype=float)
        self.mean = float(y.mean())
        self.chol = np.linalg.cholesky(self._kernel(self.x, self.x)
                                       + self.noise * np.eye(len(y)))
        self.dual = np.linalg.solve(self.chol.T, np.linalg.solve(self.chol, y - self.mean))
        return self

    def predict(self, points: Sequence[Point]) -> Any:
        pts = self.np.asarray(points, dtype=int)
        return self.mean + self._kernel(pts, self.x) @ self.dual

    def spread(self, points: Sequence[Point]) -> Any:
        """How little the fitted points say about each of ``points``: the Gaussian
        process's posterior standard deviation."""
        np = self.np
        pts = np.asarray(points, dtype=int)
        cross = np.linalg.solve(self.chol, self._kernel(self.x, pts))
        d = pts.shape[1]  # k(p, p): every e_i is 1
        prior = np.full(len(pts), d / self.alpha)
        if self.pair_alpha:
            prior += d * (d - 1) / 2 / self.pair_alpha
        if self.trend_alpha:
            prior += ((self._ranks(pts) ** 2).sum(-1) + self.offset) / self.trend_alpha
        return np.sqrt(np.maximum(prior - (cross ** 2).sum(0), 0.0))


@register("pattern")
class PatternStrategy(Strategy):
    """Neighbours of the best measured configs, nearest first, ranked by an ordinal
    latency model and then a cost model."""

    #: The best measured configs whose neighbours are candidates.
    centres = 3
    #: Configs measured before the model ranks candidates (before: a random neighbour of
    #: the best one).
    min_fit = 2
    #: Predicted log latencies this close to the lowest tie; the cheapest of them goes.
    tie = 0.02
    #: Latencies count as at most this multiple of the best.
    clip = 2.0
    #: The latency model (``OrdinalModel``): penalties, noise and length in ordinal steps.
    alpha, pair_alpha, trend_alpha, noise, length = 1.0, 3.0, 1.0, 0.01, 2.0
    #: Candidates rank by predicted log latency less this many spreads (``spread``): a
    #: value the measurements say little about gets its chance.
    explore = 0.3
    #: The most measured configs a model is fitted on (the fastest): its cost is cubic.
    max_fit = 256

    def __init__(self, setup: Setup) -> None:
        super().__init__(setup)
        self._rng = random.Random(setup.seed)
        self._rank_of = [ordinal_ranks(c) for c in self.space.choices]
        self._index_of = [{r: i for i, r in enumerate(ranks)} for ranks in self._rank_of]
        self.latency: dict[Point, float] = {}  # measured (cut: its cheap pass)
        self.cost: dict[Point, float] = {}  # device seconds, where known

    def tell(self, point: Point, outcome: Outcome) -> None:
        ms = outcome.latency_ms
        if outcome.status in ("measured", "cut") and ms is not None and 0 < ms < math.inf:
            self.latency[point] = ms
        if 0 < outcome.cost_s < math.inf:
            self.cost[point] = outcome.cost_s

    def ask(self, tried: Set[Point]) -> Point | None:
        best = sorted(self.latency, key=self.latency.__getitem__)[:self.centres]
        if not best:  # nothing measured yet: around where the study starts
            best = [p for p in (self.setup.default, *self.setup.starts) if p is not None]
        for radius in (1, 2, 3):
            cands = {p for c in best for p in self.neighbours(c, radius)
                     if p not in tried and self.space.reason(p) is None}
            if cands:
                return self._pick(sorted(cands), best)
        return self.space.sample(self._rng, tried)

    def ahead(self, n: int) -> list[Point]:
        """The first ``n`` asks before any result: neighbours of the default and the
        starts, in the order this strategy's seeded draws take them. The study's own
        strategy, with the same set-up, asks the same until its first result arrives
        (then its walk follows the measurements, mostly nearby)."""
        return self.first_asks(n)

    def neighbours(self, centre: Point, radius: int) -> Iterator[Point]:
        """Points ``radius`` ordinal steps from ``centre``: one tunable moved ``radius``
        steps, or ``radius`` tunables one step each."""
        ranks = [self._rank_of[i][v] for i, v in enumerate(centre)]

        def moved(moves: dict[int, int]) -> Point | None:
            out = list(centre)
            for i, d in moves.items():
                j = self._index_of[i].get(ranks[i] + d)
                if j is None:
                    return None
                out[i] = j
            return tuple(out)

        moves: list[dict[int, int]] = [{i: d} for i in range(len(centre))
                                       for d in (-radius, radius)]
        if radius > 1:
            moves += [dict(zip(idx, signs, strict=True))
                      for idx in itertools.combinations(range(len(centre)), radius)
                      for signs in itertools.product((-1, 1), repeat=radius)]
        for m in moves:
            p = moved(m)
            if p is not None:
                yield p

    def _pick(self, cands: list[Point], centres: list[Point]) -> Point:
        if len(self.latency) < self.min_fit:
            near = [p for p in cands if self._steps(p, centres[0]) <= 1] or cands
            return self._rng.choice(near)
        pts = sorted(self.latency, key=self.latency.__getitem__)[:self.max_fit]
        cap = self.latency[pts[0]] * self.clip
        model = OrdinalModel(self._rank_of, self.alpha, self.pair_alpha, self.trend_alpha,
                             self.noise, self.length)
        model.fit(pts, [math.log(min(self.latency[p], cap)) for p in pts])
        pred = model.predict(cands)
        if self.explore:
            pred = pred - self.explore * model.spread(cands)
        lo = float(pred.min())
        close = [p for p, v in zip(cands, pred, strict=True) if v <= lo + self.tie]
        if len(close) > 1 and len(self.cost) >= self.min_fit:
            cpts = list(self.cost)[-self.max_fit:]
            cost = OrdinalModel(self._rank_of, self.alpha, None, self.trend_alpha, self.noise,
                                self.length)
            cpred = cost.fit(cpts, [math.log(self.cost[p]) for p in cpts]).predict(close)
            return close[int(cpred.argmin())]
        return close[self._rng.randrange(len(close))]

    def _steps(self, a: Point, b: Point) -> int:
        return sum(abs(self._rank_of[i][x] - self._rank_of[i][y])
                   for i, (x, y) in enumerate(zip(a, b, strict=True)))
