"""Shared pieces of the fuzz tests: paths into a JSON-like document and one edit at one
of them, as Hypothesis draws it."""

from __future__ import annotations

import contextlib
import copy
import signal
from collections.abc import Iterator
from typing import Any

from hypothesis import strategies as st


def paths(node: Any, prefix: tuple = (), out: list[tuple] | None = None,
          limit: int = 500) -> list[tuple]:
    """The paths into ``node``, the first ``limit`` of them (a grown document has
    millions: walking them all would be the fuzzer's own cost)."""
    out = [] if out is None else out
    out.append(prefix)
    children = node.items() if isinstance(node, dict) else enumerate(node) \
        if isinstance(node, list) else ()
    for k, v in children:
        if len(out) >= limit:
            break
        paths(v, (*prefix, k), out, limit)
    return out


def get(node: Any, path: tuple) -> Any:
    for part in path:
        node = node[part]
    return node


def edit(data: st.DataObject, doc: Any, path: tuple, how: str, names: st.SearchStrategy,
         values: st.SearchStrategy, grow: bool = True) -> None:
    """Apply the edit ``how`` at ``path`` of ``doc`` in place: replace, delete, add a key,
    nest, repeat a list's first item, or (``grow``) multiply a node into a list or map of
    50 or 2,000 copies."""
    if not path:
        if how == "add" and isinstance(doc, dict):
            doc[data.draw(names)] = data.draw(values)
        return
    parent, key = get(doc, path[:-1]), path[-1]
    if how == "replace":
        parent[key] = data.draw(values, label="value")
    elif how == "delete":
        del parent[key]
    elif how == "add" and isinstance(parent[key], dict):
        parent[key][data.draw(names, label="key")] = data.draw(values, label="value")
    elif how == "nest":
        parent[key] = data.draw(st.sampled_from([[parent[key]], {"x": parent[key]}]))
    elif how == "repeat" and isinstance(parent[key], list) and parent[key]:
        parent[key].append(copy.deepcopy(parent[key][0]))  # a shape or dtype twice
    elif how == "grow" and grow:
        n = data.draw(st.sampled_from([50, 2000]), label="size")
        parent[key] = [parent[key]] * n if data.draw(st.booleans()) \
            else {f"k{i}": parent[key] for i in range(n)}


@contextlib.contextmanager
def within(seconds: float) -> Iterator[None]:
    """Fail rather than hang: SIGALRM interrupts a blocking open() or read()."""
    def fire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"still blocked after {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
