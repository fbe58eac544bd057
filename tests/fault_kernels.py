"""Deliberately faulty kernel families for the fleet's tests (``tests.fault_kernels:Faulty``).

One family, one tunable ``FAULT`` that picks what goes wrong:

- ``none``: a correct result (after ``SLEEP_MS``, if any), from a Triton kernel;
- ``compile``: on a GPU a kernel that fails to compile; on the CPU the interpreter does
  not compile, so the launcher raises Triton's ``CompilationError`` itself;
- ``oor``: raises ``OutOfResources``, the way Triton reports a config needing too much
  shared memory;
- ``illegal``: on a GPU a kernel storing 2**40 elements past its buffer, a real illegal
  address that poisons the CUDA context; on the CPU CUDA's error text as a RuntimeError;
- ``hang``: sleeps an hour;
- ``COMPILE_MS``: how long its ahead-of-time compile takes;
- ``wrong``: a result off by one; ``nan``: a result with a NaN;
- ``stale`` (not in the space; tests name it): its output buffer already holds the right
  answer, as a block the allocator hands back from an earlier config would, and the
  kernel writes only its first half.

Every launch, ``compile_only`` and ``load_only`` appends a JSON line to ``$FAULT_DIR/events.jsonl``
(event, config, pid, node, time) so that tests can see where and when things ran.
"""

from __future__ import annotations

import ast
import json
import os
import time
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import triton
import triton.language as tl

from harness.kernel.api import Config, Inputs, Kernel, Shape, Tolerance

FAULTS = ("none", "compile", "oor", "illegal", "hang", "wrong", "nan", "inexact")


@triton.jit
def _scale_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(y_ptr + offs, x * 2.0, mask=mask)


@triton.jit
def _out_of_bounds_kernel(y_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    # 2**40 elements (4 TiB) past the buffer: unmapped on every GPU, an illegal address.
    far = offs.to(tl.int64) + (1 << 40)
    tl.store(y_ptr + far, offs.to(tl.float32))


@triton.jit
def _does_not_compile_kernel(y_ptr, BLOCK: tl.constexpr):
    # arange needs a power-of-two range: a compile-time error, as a bad config would give.
    offs = tl.arange(0, 3)
    tl.store(y_ptr + offs, offs.to(tl.float32))


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def record(event: str, config: Config, **extra: Any) -> None:
    """Append one event line for the tests (no-op without FAULT_DIR)."""
    root = os.environ.get("FAULT_DIR")
    if not root:
        return
    # A compile child is no Ray worker: its node is its compile service's.
    node = os.environ.get("HARNESS_NODE_ID")
    try:
        import ray

        if ray.is_initialized():
            node = ray.get_runtime_context().get_node_id()
    except Exception:
        pass
    line = json.dumps({"event": event, "config": dict(config), "pid": os.getpid(),
                       "node": node, "t": time.time(), **extra}, sort_keys=True)
    with open(os.path.join(root, "events.jsonl"), "a") as f:
        f.write(line + "\n")


def read_events(root: str | os.PathLike) -> list[dict[str, Any]]:
    path = os.path.join(root, "events.jsonl")
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:  # a line being written
                pass
    return out


def _compilation_error(why: str) -> Exception:
    from triton.compiler.errors import CompilationError

    return CompilationError(None, ast.parse("x").body[0], why)


class Faulty(Kernel):
    """``y = 2 x`` that fails on purpose, as its ``FAULT`` config says."""

    name: ClassVar[str] = "faulty"
    dims: ClassVar[tuple[str, ...]] = ("N",)
    dtypes: ClassVar[tuple[str, ...]] = ("fp32", "fp16", "bf16")
    default_config: ClassVar[dict[str, Any]] = {"FAULT": "none", "SLEEP_MS": 0, "BLOCK": 128,
                                                "COMPILE_MS": 0}
    space: ClassVar[dict[str, Any]] = {"params": {"FAULT": list(FAULTS), "SLEEP_MS": [0],
                                                  "BLOCK": [128], "COMPILE_MS": [0]}}
    shapes: ClassVar[dict[str, dict[str, int]]] = {"test": {"N": 256}}

    def make_inputs(self, shape: Shape, dtype: str, seed: int, device: str) -> Inputs:
        g = torch.Generator(device="cpu").manual_seed(seed)
        tdt = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
        return {"x": torch.randn(int(shape["N"]), generator=g).to(tdt).to(device)}

    def reference(self, inputs: Inputs, shape: Shape) -> torch.Tensor:
        return inputs["x"].float() * 2

    def eager(self, inputs: Inputs, shape: Shape) -> torch.Tensor:
        return inputs["x"] * 2

    def launcher(self, inputs: Inputs, shape: Shape, config: Config) -> Callable[[], Any]:
        cfg = {**self.default_config, **config}
        fault, sleep_s, block = str(cfg["FAULT"]), float(cfg["SLEEP_MS"]) / 1e3, int(cfg["BLOCK"])
        x = inputs["x"]
        y = torch.empty_like(x)
        n = x.numel()
        grid = (triton.cdiv(n, block),)

        if fault == "stale":
            y.copy_(x.float() * 2)
            grid = (triton.cdiv(n // 2, block),)
            n = n // 2

        def run() -> torch.Tensor:
            record("launch", config, N=shape["N"])
            if sleep_s:
                time.sleep(sleep_s)
            if fault == "compile":
                if _interpreted():
                    raise _compilation_error("simulated: arange's range must be a power of 2")
                _does_not_compile_kernel[(1,)](y, BLOCK=block)
            elif fault == "oor":
                from triton.runtime.errors import OutOfResources

                raise OutOfResources(300 * 1024, 227 * 1024, "shared memory")
            elif fault == "illegal":
                if _interpreted() or x.device.type != "cuda":
                    raise RuntimeError("CUDA error: an illegal memory access was encountered")
                _out_of_bounds_kernel[grid](y, BLOCK=block)
                torch.cuda.synchronize()  # the fault surfaces here
            elif fault == "hang":
                time.sleep(3600)
            _scale_kernel[grid](x, y, n, BLOCK=block)
            if fault == "wrong":
                y.add_(1)
            elif fault == "inexact":  # inside the tolerance, 1e-3 off: a tf32-like config
                y.mul_(1 + 1e-3)
            elif fault == "nan":
                y[0] = float("nan")
            return y

        run.out = y  # type: ignore[attr-defined]
        return run

    def compile_only(self, inputs: Inputs, shape: Shape, config: Config) -> None:
        """Records that a compile child saw ``config`` (and compiles it on a GPU), after
        ``COMPILE_MS``: a config that is slow to compile."""
        time.sleep(float({**self.default_config, **config}["COMPILE_MS"]) / 1e3)
        self._warmup("compile", inputs, config, N=shape["N"])

    def load_only(self, inputs: Inputs, shape: Shape, config: Config) -> None:
        """Records that the worker loaded ``config`` ahead (and loads it on a GPU)."""
        self._warmup("load", inputs, config)

    def _warmup(self, event: str, inputs: Inputs, config: Config, **extra: Any) -> None:
        record(event, config, **extra)
        cfg = {**self.default_config, **config}
        if not _interpreted():
            x = inputs["x"]
            _scale_kernel.warmup(x, torch.empty_like(x), x.numel(), BLOCK=int(cfg["BLOCK"]),
                                 grid=(1,))

    def flops(self, shape: Shape) -> float:
        return float(shape["N"])

    def bytes_moved(self, shape: Shape, dtype: str) -> float:
        return 8.0 * shape["N"]

    def compute_dtype(self, dtype: str) -> str | None:
        return None

    def tolerance(self, dtype: str, config: Config) -> Tolerance:
        return Tolerance(1e-2, 1e-2)


def cli_env(events: str | os.PathLike) -> dict[str, str]:
    """The environment of a `python -m harness` subprocess driving the Faulty kernel: its
    events go to ``events``, the tests package is importable, and the worker decides about
    the interpreter and Ray for itself (no inherited TRITON_INTERPRET or RAY_ADDRESS)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "FAULT_DIR": str(events),
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    env.pop("TRITON_INTERPRET", None)
    env.pop("RAY_ADDRESS", None)
    return env


class WrongDefault(Faulty):
    """Faulty whose default config gives a wrong result: the default, re-measured beside
    every study's finalists, then never wins, and a test sees the searched configs and the
    pack's entry decide alone."""

    default_config: ClassVar[dict[str, Any]] = {**Faulty.default_config, "FAULT": "wrong"}


def run_quietly(path: str | os.PathLike) -> Any:
    """``harness.run.runner.run`` of the experiment at ``path``, its console output discarded:
    the run's Summary."""
    import io

    from rich.console import Console

    from harness.run.runner import run

    return run(path, console=Console(file=io.StringIO(), width=200), progress=False)


def may_renice() -> bool:
    """Whether a process of this user may lower its niceness (root, or CAP_SYS_NICE):
    then a worker started at Ray's nice 15 takes nice 0 back."""
    import subprocess
    import sys

    code = "import os; os.nice(15); os.setpriority(os.PRIO_PROCESS, 0, 0)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0
