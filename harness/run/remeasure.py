"""Noise: a study's winner is decided by re-measuring its best configs side by side.

A search measures each config once, at a moment of its own (clocks, temperature, the
neighbours on the node): two configs within a percent of each other swap places from run
to run. At the end of a study its top ``k`` configs are measured again, interleaved
(A B C A B C ...), so that slow drifts hit them alike; the winner is the one with the
lowest median of those re-measurements, and each candidate's spread is recorded. Where
two candidates were measured in the same rounds, how far apart they are is the median of
their same-round ratios: a GPU whose clock moves under its power cap shifts a whole round
(the spread of one candidate's re-measurements reached 10-22 % on an H200 at 5/20 ms),
which the ratio of two medians would read as a difference between the configs.

When candidates are within noise of the best (their median within ``NOISE`` (2 %) of the
best median, or within half the best's own spread of re-measurements, at most
``MAX_NOISE``), unless their same-round ratios say otherwise (slower than the best by more
than ``CONSISTENT_GAP`` in every one of at least ``CONSISTENT_ROUNDS`` rounds: an order
that the interleaved rounds keep every time is a measurement, not noise), the one that is
more robust across neighbouring shapes wins: the one whose latency, relative to the best
of each other study of the same kernel, dtype and hardware, is lowest on average where it
was measured there (by its re-measured median where that study re-measured it, else by
the search's one measurement: ``best_estimates``). With no such evidence the
pack's current winner for the shape (the incumbent, re-measured beside the top configs
where the search found it within ``INCUMBENT_BAND`` of its best) stays if it is among
them: a re-tune replaces a pack entry only for a config measurably faster, so packs do
not churn between runs over configs the GPU's noise cannot order. Otherwise the one
with the smallest footprint wins (fewest pipeline stages, then warps, then the smallest
tile): a rule, not a measurement, so that a re-run whose top configs are the same picks
the same winner, where the lowest of medians within noise would be a coin toss. Between
equal footprints the lower same-round ratio to the best decides: a tile of 256x128 and
one of 128x256 are no smaller than each other, and the config's key (what decided
before) ordered them by name, which on an H100 put a config 2 % behind the fastest in
the pack.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from harness.search import config_key

#: Candidates within this fraction of the best median are "within noise" of it ...
#: Two percent, not one: re-measurements interleaved within a run agree to about a
#: percent, but the same two configs move by more than that from one run to the next
#: (an H200, 8192^3 bf16 matmul: 4 and 5 pipeline stages tied within 1 % in most runs,
#: the 5-stage one more than 1 % ahead in one of four runs of 2026-11-23), so a
#: one-percent band let a re-run pick the other.
NOISE = 0.02
#: ... or within half the best's relative spread, up to this much: a single slow
#: re-measurement must not make a config 10 % slower by its median a tie.
MAX_NOISE = 0.03
#: A candidate slower than the best by more than this in every same-round pair ...
CONSISTENT_GAP = 0.005
#: ... of at least this many rounds is measurably slower, however small its median gap:
#: with no difference between them, five rounds all ordered one way happen 1 time in 32.
#: Seen on an H200 (2026-11-24, grouped GEMM at the MoE shape): a config 1.0-2.2 % slower
#: in each of 5 rounds tied within NOISE and won on footprint; back-to-back timings put
#: it 2-4 % behind the fastest on every routing and on the H100.
CONSISTENT_ROUNDS = 5
#: The incumbent is re-measured when the search measured it within this fraction of the
#: study's best (further off, it cannot come out within noise of the winner). A search's
#: single short measurement is noisy: on an H200 at 5/20 ms the same config's search
#: latency varied by up to 10 % between runs (2026-11-24), and at 5 % the incumbent
#: missed the re-measurement it would have tied in.
INCUMBENT_BAND = 0.15
#: A top config the search measured more than this fraction slower than its best is no
#: finalist: a search's measurement is off by 10 % at worst (above), so 50 % slower
#: cannot come out within noise of the winner, and its rounds were a third of a small
#: study's final phase (an H200 quickstart: top configs 1.7-2.1x the best).
FINALIST_BAND = 0.5


def schedule(n: int, rounds: int) -> list[int]:
    """Interleaved order of ``rounds`` measurements of ``n`` candidates: 0 1 2 0 1 2 ..."""
    return [i for _ in range(rounds) for i in range(n)]


@dataclass
class Candidate:
    config: dict[str, Any]
    search_ms: float  # what the search measured
    samples: list[float] = field(default_factory=list)  # re-measured medians
    failures: list[str] = field(default_factory=list)
    rounds: list[int] = field(default_factory=list)  # the round of each sample, where known
    results: list[dict[str, Any]] = field(default_factory=list)  # each sample's measurement

    def add(self, latency_ms: float, round_: int,
            result: Mapping[str, Any] | None = None) -> None:
        self.samples.append(latency_ms)
        self.rounds.append(round_)
        self.results.append(dict(result or {}))

    @property
    def median_result(self) -> dict[str, Any]:
        """The whole measurement behind the median sample (the lower middle one of an even
        count), so that a winner's latency, p20/p80 and rates come from one timing; {}
        where the measurements were not kept."""
        if not self.samples or len(self.results) != len(self.samples):
            return {}
        order = sorted(range(len(self.samples)), key=self.samples.__getitem__)
        return self.results[order[(len(order) - 1) // 2]]

    @property
    def median(self) -> float:
        return statistics.median(self.samples) if self.samples else math.inf

    @property
    def lo(self) -> float:
        return min(self.samples) if self.samples else math.inf

    @property
    def hi(self) -> float:
        return max(self.samples) if self.samples else math.inf

    @property
    def spread(self) -> float:
        """(max - min) / median of the re-measurements."""
        return (self.hi - self.lo) / self.median if self.samples else math.nan


def _same_round_ratios(c: Candidate, best: Candidate) -> list[float]:
    mine = dict(zip(c.rounds, c.samples, strict=False))
    theirs = dict(zip(best.rounds, best.samples, strict=False))
    return [mine[r] / theirs[r] for r in sorted(mine.keys() & theirs.keys())]


def relative(c: Candidate, best: Candidate) -> tuple[float, bool]:
    """``c``'s latency over ``best``'s, and whether it is paired: the median of their
    same-round ratios where both have samples of known rounds in common, else the ratio
    of their medians."""
    ratios = _same_round_ratios(c, best)
    if ratios:
        return statistics.median(ratios), True
    return c.median / best.median, False


def within_noise(c: Candidate, best: Candidate) -> bool:
    """Whether ``c`` is within noise of ``best`` by its latency relative to it: ``NOISE``
    paired; unpaired, a drift that spread the best's own samples widens the band (up to
    ``MAX_NOISE``)."""
    ratio, paired = relative(c, best)
    loose = min(MAX_NOISE, max(NOISE, (best.spread if best.spread == best.spread else 0) / 2))
    return ratio <= 1 + (NOISE if paired else loose)


def consistently_slower(c: Candidate, best: Candidate) -> bool:
    """Whether ``c`` was slower than ``best`` by more than ``CONSISTENT_GAP`` in every
    one of at least ``CONSISTENT_ROUNDS`` same-round pairs."""
    ratios = _same_round_ratios(c, best)
    return len(ratios) >= CONSISTENT_ROUNDS and min(ratios) > 1 + CONSISTENT_GAP


def robustness(config: Mapping[str, Any],
               neighbours: Sequence[Mapping[str, float]]) -> float:
    """Mean of latency / that study's best, over the neighbouring studies that measured
    ``config`` (``neighbours``: config key -> latency per study); inf without evidence."""
    k = config_key(config)
    ratios = [n[k] / min(n.values()) for n in neighbours if k in n and n]
    return statistics.fmean(ratios) if ratios else math.inf


def best_estimates(search: Mapping[str, float],
                   cands: Sequence[Candidate]) -> dict[str, float]:
    """Config key -> a study's best estimate of each config's latency, as a neighbour's
    evidence for ``robustness``: the median of its re-measurements where it has them
    (interleaved, longer windows), else the search's one measurement (on an H200 a
    config's search latency moved by up to 10 % between runs)."""
    out = dict(search)
    out.update({config_key(c.config): c.median for c in cands if c.samples})
    return out


#: A finalist slower than the best by more than ``PRUNE_GAP`` in each of its first
#: ``PRUNE_ROUNDS`` same-round pairs is timed no further: twice the widest tie band, it
#: cannot come out within noise of the winner, and its later rounds only held the GPU
#: (a quickstart on an H200 spent 5.4 of its 7.2 s in its final rounds, most of them
#: finalists 2-10x the best of a 7 us kernel).
PRUNE_GAP = 2 * MAX_NOISE
PRUNE_ROUNDS = 2
#: The baselines (eager, torch.compile, a default config that is no finalist) are timed
#: in the first this many rounds only: their figure is a speed-up shown to a user, not
#: a choice between configs a percent apart (the bench, likewise, times 3 rounds).
BASELINE_ROUNDS = 3


def outclassed(cands: Sequence[Candidate]) -> list[int]:
    """The finalists to time no further (their indices): those ``PRUNE_GAP`` slower than
    the best so far in each of at least ``PRUNE_ROUNDS`` rounds they were timed in side
    by side. Never the best; what they measured stays, and ``pick`` still reads it."""
    timed = [c for c in cands if c.samples]
    if len(timed) < 2:
        return []
    best = min(timed, key=lambda c: c.median)
    out = []
    for i, c in enumerate(cands):
        if c is best or not c.samples:
            continue
        ratios = _same_round_ratios(c, best)
        if len(ratios) >= PRUNE_ROUNDS and min(ratios) > 1 + PRUNE_GAP:
            out.append(i)
    return out


def footprint(config: Mapping[str, Any]) -> tuple:
    """A config's resource use, for ties: pipeline stages, warps, tile area, then the
    config's key (total order). The area multiplies the ``BLOCK_*`` values above 1: a
    0/1 switch that happens to be named BLOCK_* (the grouped GEMM's BLOCK_TABLE) is no
    tile size, and at 0 it made the area 0 (the smallest) for every config without it."""
    def num(k: str) -> float:
        v = config.get(k, 0)
        return float(v) if isinstance(v, (int, float)) else 0.0

    dims = [num(k) for k in config if k.startswith("BLOCK")]
    area = math.prod(d for d in dims if d > 1) if dims else 0.0
    return (num("num_stages"), num("num_warps"), area, config_key(config))


def pick(cands: Sequence[Candidate],
         robust: Callable[[Mapping[str, Any]], float] = lambda c: math.inf,
         incumbent: Mapping[str, Any] | None = None) -> tuple[Candidate, str] | None:
    """The winner and why; None when no candidate was re-measured successfully.
    ``incumbent``: the config the pack holds now for this shape, if any."""
    ok = [c for c in cands if c.samples]
    if not ok:
        return None
    best = min(ok, key=lambda c: c.median)
    tied = [c for c in ok if within_noise(c, best) and not consistently_slower(c, best)]
    if len(tied) > 1:
        scored = sorted(tied, key=lambda c: (robust(c.config), c.median))
        if math.isfinite(robust(scored[0].config)):
            win = scored[0]
            return win, (f"{len(tied)} configs within noise; the most robust across "
                         f"neighbouring shapes ({robust(win.config):.3f} x their best)")
        kept = [c for c in tied if incumbent is not None
                and config_key(c.config) == config_key(incumbent)]
        if kept:
            return kept[0], (f"{len(tied)} configs within noise; the pack's current "
                             "winner stays")
        def order(c: Candidate) -> tuple:
            # Equal footprints: the same-round ratio to the best, the one measurement
            # that has ordered them; the config key last, for a total order.
            *resources, key = footprint(c.config)
            return (*resources, relative(c, best)[0], key)

        win = min(tied, key=order)
        return win, (f"{len(tied)} configs within noise; no neighbouring shapes: the "
                     "smallest footprint (stages, warps, tile, then same-round ratio)")
    return best, "lowest median of the interleaved re-measurements"


# -- a study's re-measurement: its candidates, its tasks, its winner ----------------------

#: ``search.remeasure_top_k: auto`` on GPUs. Five, not three: a config's search time is
#: taken at the clock of its moment (an H200 at its power cap moves between ~1500 and
#: 1980 MHz), and in one of four runs of the 8192^3 grid (2026-11-23) the config the
#: other three chose was fifth by its search time, 16 % behind, and never re-measured.
AUTO_TOP_K = 5


def top_k(setting: int | str, interpreted: bool) -> int:
    """How many of a study's best configs are re-measured (``auto``: none under the
    interpreter, whose timings order nothing)."""
    return (0 if interpreted else AUTO_TOP_K) if setting == "auto" else int(setting)


def candidates(top: Sequence[tuple[Mapping[str, Any], Mapping[str, Any]]],
               incumbent: tuple[Mapping[str, Any], Mapping[str, Any]] | None,
               default: tuple[Mapping[str, Any], Mapping[str, Any]] | None
               ) -> list[Candidate]:
    """The finalists: the search's top configs within ``FINALIST_BAND`` of its best,
    the pack's current winner and the kernel's default config (each once, whatever the
    search measured of them), with what the search measured of each."""
    out: list[Candidate] = []
    seen: set[str] = set()
    best = min((r.get("latency_ms", math.inf) for _, r in top), default=math.inf)
    top = [(c, r) for i, (c, r) in enumerate(top)
           if i == 0 or not r.get("latency_ms", math.inf) > best * (1 + FINALIST_BAND)]
    for cfg, res in [*top, *([incumbent] if incumbent else []), *([default] if default else [])]:
        key = config_key(cfg)
        if key not in seen:
            seen.add(key)
            out.append(Candidate(dict(cfg), res.get("latency_ms", math.nan)))
    return out


def decide(cands: Sequence[Candidate], robust: Callable[[Mapping[str, Any]], float],
           incumbent: Mapping[str, Any] | None,
           default: Mapping[str, Any] | None) -> tuple[Candidate, str] | None:
    """``pick``, except that the kernel's default config is never beaten by a config
    the re-measurement cannot tell from it: where the default is within noise of the
    winner (or faster), the default is frozen."""
    chosen = pick(cands, robust, incumbent)
    if chosen is None or default is None:
        return chosen
    key = config_key(default)
    mine = next((c for c in cands if config_key(c.config) == key and c.samples), None)
    win, why = chosen
    if mine is None or mine is win:
        return chosen
    ratio, paired = relative(mine, win)
    if ratio <= 1 + NOISE and not consistently_slower(mine, win):
        return mine, (f"the default config is within noise of the fastest ({ratio:.3f}x "
                      f"{'same-round' if paired else 'medians'}): it stays")
    return win, why
