"""A config's Triton launches, built once for three uses: running them (the launcher),
compiling them without running (``compile_only``: the fleet's compile-ahead, on meta
tensors) and loading their binaries (``load_only``). A family mixes in one of these so
that what is compiled ahead is exactly what later runs:

- ``SingleLaunch``: a config is one Triton launch (``_launch``);
- ``Launches``: a fixed sequence of Triton launches (``_launches``);
- ``Planned``: any forward (torch ops between the launches, launches that depend on the
  config's path) together with the list of the Triton launches it makes (``_plan``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from harness.kernel.base import Config, Inputs, Shape


@dataclass(frozen=True)
class Launch:
    """One Triton launch of a config, built once: run it, or only compile it (inputs may
    be meta tensors: the fleet's compile-ahead), or only load its binary into this
    process. A family that launches several kernels per config keeps a list of these, so
    that what is compiled ahead is exactly what its forward runs."""

    fn: Any  # the @triton.jit function
    grid: tuple[int, ...]
    args: tuple
    meta: dict[str, Any]

    def __call__(self) -> None:
        self.fn[self.grid](*self.args, **self.meta)

    def warmup(self) -> Any:
        """Compile without running (``JITFunction.warmup``); the compiled kernel."""
        return self.fn.warmup(*self.args, grid=self.grid, **self.meta)

    def load(self) -> None:
        """Bring the binary into this process as its first launch would (Triton's
        in-memory cache, the GPU module and the launcher), without launching: on the real
        inputs, so that the launch finds it under the same key."""
        init = getattr(self.warmup(), "_init_handles", None)  # lazy until the first launch
        if callable(init):
            init()


class Planned:
    """Mix-in for a family that defines ``_plan(inputs, shape, config) -> (run,
    launches)``: the forward of ``config`` (buffers allocated once) and the Triton
    launches it makes. The launcher is ``run``; ``compile_only`` and ``load_only`` go
    over ``launches``. A launch whose arguments the forward computes anew on each call
    may be planned on stand-ins of the same dtype and layout (meta tensors): Triton
    keys a binary on those, not on the data."""

    compiles_ahead: ClassVar[bool] = True

    def _plan(self, inputs: Inputs, shape: Shape,
              config: Config) -> tuple[Callable[[], Any], list[Launch]]:
        raise NotImplementedError

    def launcher(self, inputs: Inputs, shape: Shape, config: Config) -> Callable[[], Any]:
        return self._plan(inputs, shape, config)[0]

    def compile_only(self, inputs: Inputs, shape: Shape, config: Config) -> None:
        """Compile ``config``'s launches as the launcher would launch them, without
        running them. The inputs may be meta tensors: nothing is allocated or launched."""
        for lc in self._plan(inputs, shape, config)[1]:
            lc.warmup()

    def load_only(self, inputs: Inputs, shape: Shape, config: Config) -> None:
        """Bring ``config``'s binaries into this process without launching (``Launch.load``)."""
        for lc in self._plan(inputs, shape, config)[1]:
            lc.load()


class Launches(Planned):
    """``Planned`` for a family whose config is a fixed sequence of Triton launches: it
    defines ``_launches(inputs, config) -> (list[Launch], out)`` once; the launcher runs
    them in order and returns ``out``."""

    def _launches(self, inputs: Inputs, config: Config) -> tuple[list[Launch], Any]:
        raise NotImplementedError

    def _plan(self, inputs: Inputs, shape: Shape,
              config: Config) -> tuple[Callable[[], Any], list[Launch]]:
        launches, out = self._launches(inputs, config)
        # Bound once: indexing a JITFunction by its grid costs host time on every call.
        bound = [(lc.fn[lc.grid], lc.args, lc.meta) for lc in launches]

        def run() -> Any:
            for kernel, args, meta in bound:
                kernel(*args, **meta)
            return out

        run.out = out  # type: ignore[attr-defined]
        return run, launches


class SingleLaunch(Launches):
    """``Launches`` for a family whose config is one Triton launch: it defines
    ``_launch(inputs, config) -> (jit_fn, grid, args, meta, out)``."""

    def _launch(self, inputs: Inputs, config: Config) -> tuple[Any, tuple, tuple, dict, Any]:
        raise NotImplementedError

    def _launches(self, inputs: Inputs, config: Config) -> tuple[list[Launch], Any]:
        jit_fn, grid, args, meta, out = self._launch(inputs, config)
        return [Launch(jit_fn, grid, args, meta)], out
