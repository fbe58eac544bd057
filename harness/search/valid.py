"""The valid part of a search space: the configs that pass the kernel's static constraints.

The samplers draw from it, so that an ask is never spent on a config static pruning
would reject (the grouped GEMM's space on Hopper: 60 M configs, 0.3 % of them valid).

A config is a point of the space's grid, numbered 0 .. size-1 (mixed radix over the
parameters' choices). A seeded pseudo-random permutation of those numbers is the grid's
order: the grid sampler walks it, skipping invalid configs, and so does the compile-ahead
(``grid_order``), so both agree on what comes first whatever the space's size.

Small spaces (``EXACT_LIMIT`` configs at most) are checked in full once: the valid set is
then known exactly (its size, and why every config fails where none passes). Larger ones
are checked lazily, a config at a time, as the samplers draw them (a check costs tens of
microseconds).
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence, Set
from typing import Any

Space = dict[str, list[Any]]
Check = Callable[[Mapping[str, Any]], "str | None"]
Index = tuple[int, ...]

#: Spaces up to this size are checked in full when a study starts (~0.1-0.3 s).
EXACT_LIMIT = 4096
#: Random draws before a sampler of a large space gives up finding an untried valid config.
MAX_DRAWS = 20_000
#: Random draws made at once (numpy), checked one by one.
_BATCH = 256
#: Grid positions a walk looks at before giving up (a space whose valid configs are rarer).
MAX_WALK = 50_000


class Permutation:
    """A seeded bijection of ``range(n)`` (a 4-round Feistel network over the next even
    power of two, cycle-walked into range): the grid's order without materialising it."""

    def __init__(self, n: int, seed: int):
        self.n = max(1, n)
        bits = max(2, (self.n - 1).bit_length())
        bits += bits & 1
        self.half = bits // 2
        self.mask = (1 << self.half) - 1
        rng = random.Random(f"grid-order:{seed}")
        self.keys = [rng.getrandbits(32) for _ in range(4)]

    def _round(self, r: int, key: int) -> int:
        h = (r * 0x9E3779B1 + key) & 0xFFFFFFFF
        h ^= h >> 15
        h = (h * 0x85EBCA77) & 0xFFFFFFFF
        h ^= h >> 13
        return h & self.mask

    def __call__(self, i: int) -> int:
        x = i
        while True:
            left, right = x >> self.half, x & self.mask
            for key in self.keys:
                left, right = right, left ^ self._round(right, key)
            x = (left << self.half) | right
            if x < self.n:
                return x


def summarize_reasons(reasons: Counter[str], total: int, top: int = 2) -> str:
    """Why no config passes: the most frequent reasons, with how many configs each."""
    parts = [f"{why} ({n} configs)" for why, n in reasons.most_common(top)]
    more = len(reasons) - top
    return (f"no config of the {total} passes the kernel's constraints: " + "; ".join(parts)
            + (f"; and {more} other reasons" if more > 0 else ""))


class ValidSpace:
    """The configs of ``space`` that ``check`` (config -> reason or None) accepts."""

    def __init__(self, space: Mapping[str, Sequence[Any]], check: Check, seed: int = 0,
                 exact_limit: int = EXACT_LIMIT):
        self.names = list(space)
        self.choices = [list(space[n]) for n in self.names]
        self.radix = [len(c) for c in self.choices]
        self.size = math.prod(self.radix)
        self._lookup = [{_hashable(v): i for i, v in enumerate(c)} for c in self.choices]
        self._check = check
        self._reasons: dict[Index, str | None] = {}
        self.rejected: Counter[str] = Counter()  # reason -> configs checked and rejected
        self.order = Permutation(self.size, seed)
        self.exact = self.size <= exact_limit
        self._walk_pos = 0  # grid positions before this one are tried or invalid
        self.valid: list[Index] = []  # exact: every valid config, in grid order
        if self.exact:
            self.valid = [idx for idx in (self.decode(self.order(p)) for p in range(self.size))
                          if self.reason(idx) is None]

    # -- numbering ----------------------------------------------------------------------
    def decode(self, flat: int) -> Index:
        out = []
        for r in reversed(self.radix):
            flat, i = divmod(flat, r)
            out.append(i)
        return tuple(reversed(out))

    def config(self, idx: Index) -> dict[str, Any]:
        return {n: c[i] for n, c, i in zip(self.names, self.choices, idx, strict=True)}

    def is_point(self, idx: Any) -> bool:
        """Whether ``idx`` is a point of the grid (one choice index per parameter)."""
        return (isinstance(idx, tuple | list) and len(idx) == len(self.radix)
                and all(isinstance(i, int) and 0 <= i < r
                        for i, r in zip(idx, self.radix, strict=True)))

    def index(self, config: Mapping[str, Any]) -> Index | None:
        """The config's point of the grid; None for a config outside the space."""
        try:
            return tuple(lk[_hashable(config[n])] for n, lk in zip(self.names, self._lookup,
                                                                 strict=True))
        except (KeyError, TypeError):
            return None

    # -- validity -------------------------------------------------------------------------
    def reason(self, idx: Index) -> str | None:
        """Why the config fails the static constraints, or None (checked once)."""
        if idx not in self._reasons:
            try:
                why = self._check(self.config(idx))
            except Exception as exc:  # a check that raises rejects, with the error
                why = f"check_config raised {type(exc).__name__}: {exc}"
            self._reasons[idx] = why
            if why:
                self.rejected[why] += 1
        return self._reasons[idx]

    @property
    def count(self) -> int | None:
        """How many configs are valid (None: a large space, not known)."""
        return len(self.valid) if self.exact else None

    @property
    def empty_reason(self) -> str | None:
        """Why no config is valid, where that is known (None: some config is)."""
        if self.exact and not self.valid:
            return summarize_reasons(self.rejected, self.size)
        return None

    def why_none_found(self) -> str:
        """Why draws found no valid config (a large space: checked in part)."""
        if self.exact:
            return summarize_reasons(self.rejected, self.size)
        checked = len(self._reasons)
        parts = [f"{why} ({n} configs)" for why, n in self.rejected.most_common(2)]
        return (f"no valid config among the {checked} of {self.size} checked: "
                + "; ".join(parts))

    # -- drawing ---------------------------------------------------------------------
    def next_in_grid(self, seen: Set[Index]) -> Index | None:
        """The first valid, untried config in grid order (None: none left)."""
        if self.exact:
            return next((idx for idx in self.valid if idx not in seen), None)
        stop = min(self.size, self._walk_pos + MAX_WALK)
        while self._walk_pos < stop:
            idx = self.decode(self.order(self._walk_pos))
            if idx not in seen and self.reason(idx) is None:
                return idx
            self._walk_pos += 1
        return None

    def sample(self, rng: random.Random, seen: Set[Index]) -> Index | None:
        """A valid, untried config drawn uniformly (None: none left, or none found)."""
        if self.exact:
            left = [idx for idx in self.valid if idx not in seen]
            return rng.choice(left) if left else None
        import numpy as np  # here: the schema reaches this module through the strategies

        gen = np.random.default_rng(rng.getrandbits(64))
        for _ in range(MAX_DRAWS // _BATCH):
            for row in gen.integers(0, self.radix, size=(_BATCH, len(self.radix))).tolist():
                idx = tuple(row)
                if idx not in seen and self.reason(idx) is None:
                    return idx
        return self.next_in_grid(seen)  # valid configs are rare: walk to one

    def nearest(self, proposal: Mapping[str, Any], rng: random.Random,
                seen: Set[Index]) -> Index | None:
        """The valid, untried config nearest ``proposal`` (fewest parameters changed;
        ties drawn at random): a sampler's wish repaired into the valid set."""
        idx = self.index(proposal)
        if idx is not None and idx not in seen and self.reason(idx) is None:
            return idx
        if idx is None:
            return self.sample(rng, seen)
        if self.exact:
            left = [v for v in self.valid if v not in seen]
            if not left:
                return None
            dist = [sum(a != b for a, b in zip(v, idx, strict=True)) for v in left]
            best = min(dist)
            return rng.choice([v for v, d in zip(left, dist, strict=True) if d == best])
        for radius in (1, 2):
            for cand in _neighbours(idx, self.radix, radius, rng):
                if cand not in seen and self.reason(cand) is None:
                    return cand
        return self.sample(rng, seen)

    def grid_configs(self) -> Iterator[dict[str, Any]]:
        """Every config in grid order, valid or not (the compile-ahead checks them itself)."""
        for p in range(self.size):
            yield self.config(self.decode(self.order(p)))


#: Radius-2 neighbours a repair checks at most (a large space: ~40 parameters' choices).
_MAX_RADIUS2 = 400


def _neighbours(idx: Index, radix: Sequence[int], radius: int,
                rng: random.Random) -> Iterator[Index]:
    """Configs that differ from ``idx`` in exactly ``radius`` (1 or 2) parameters, in a
    random order (radius 2: a random sample of them)."""
    singles = [(p, v) for p, r in enumerate(radix) for v in range(r) if v != idx[p]]
    if radius == 1:
        rng.shuffle(singles)
        for p, v in singles:
            yield idx[:p] + (v,) + idx[p + 1:]
        return
    for _ in range(_MAX_RADIUS2):
        (p, v), (q, w) = rng.sample(singles, 2) if len(singles) > 1 else (singles[0],) * 2
        if p == q:
            continue
        out = list(idx)
        out[p], out[q] = v, w
        yield tuple(out)


def _hashable(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v


def grid_order(space: Mapping[str, Sequence[Any]], seed: int) -> Iterator[dict[str, Any]]:
    """The space's configs in the order the grid sampler (seeded ``seed``) walks them,
    invalid ones included: a worker compiling ahead in this order, checking each, has
    first what is asked first."""
    return ValidSpace(space, lambda c: None, seed, exact_limit=0).grid_configs()
