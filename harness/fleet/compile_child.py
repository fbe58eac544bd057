"""What runs inside a compile process (``harness.fleet.compile``'s pool starts them): its
set-up and warm-up, one config's ``compile_only`` on meta tensors under its own timer, a
problem's torch.compile prebuild, and the inputs' layouts (``skeleton``) that the pool
sends it and it builds again (``materialise``)."""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

from harness.measure import hardware

log = logging.getLogger(__name__)

#: Niceness of the compile children. They are throughput work that fills every spare
#: core; the driver, the GPU worker and Ray are latency work the GPU waits on, and with
#: 14 children on 16 cores they were starved at a search's start (the GPU idled 0.6-1 s
#: waiting for the driver at an H200 run's start).
COMPILE_NICE = 10


#: The key of a "config" that asks a compile child for a problem's torch.compile
#: baseline instead of a kernel config (``CompileService.prebuild``).
PREBUILD = "__prebuild__"


def _prebuild(fam: Any, shape: dict, dtype: str, seed: int) -> None:
    """Build ``fam``'s torch.compile baseline for one problem as a worker would, once,
    on the node's first GPU (real inputs: Inductor runs what it generates), so that
    Inductor's graph and kernels are in the node's caches when the worker builds its
    own: the worker then holds its GPU for a cache hit, not for the build."""
    # One process compiles: Inductor's own pool of compile workers per child would
    # put hundreds of processes on a node.
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    import torch

    from harness.measure.timing import compiled_eager

    inputs = fam.make_inputs(shape, dtype, seed, "cuda")
    compiled_eager(fam)(inputs, shape)
    torch.cuda.synchronize()
    del inputs
    torch.cuda.empty_cache()


def timeout_outcome(timeout_s: float, median_s: float | None = None,
                    **extra: Any) -> dict[str, Any]:
    """A compile's outcome when it ran past ``timeout_s``: the trial fails with its reason.
    ``median_s``: the time-out was relative to its problem's median compile."""
    if median_s is None:
        why = f"still compiling after {timeout_s:g} s"
    else:
        why = (f"still compiling after {timeout_s:.3g} s, {timeout_s / median_s:.0f}x the "
               f"median compile of this problem's configs ({median_s:.2g} s)")
    return {"ok": False, "timeout": True, **extra,
            "reason": f"compile time-out: {why} (a config that spills registers compiles "
                      "for minutes)"}


@dataclass(frozen=True)
class TensorSpec:
    """A tensor's layout without its data: enough to compile a kernel for it."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    device: str


def skeleton(value: Any) -> Any:
    """Inputs with every tensor replaced by its TensorSpec (cheap to send to a child)."""
    import torch

    if isinstance(value, torch.Tensor):
        return TensorSpec(tuple(value.shape), tuple(value.stride()),
                          str(value.dtype).removeprefix("torch."), value.device.type)
    if isinstance(value, dict):
        return {k: skeleton(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(skeleton(v) for v in value)
    return value


def materialise(value: Any, device: str = "meta") -> Any:
    """Tensors laid out as a skeleton says, on ``device``. The default, ``meta``, holds no
    memory: a compile child must never take device memory from the worker it serves, and
    Triton specializes a meta tensor exactly as an aligned device tensor."""
    import torch

    if isinstance(value, TensorSpec):
        return torch.empty_strided(value.shape, value.stride, dtype=getattr(torch, value.dtype),
                                   device=device)
    if isinstance(value, dict):
        return {k: materialise(v, device) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(materialise(v, device) for v in value)
    return value


_CHILD: dict[str, Any] = {}  # problem -> inputs a compile child built (the last two)
# A compile child's timer: ``armed`` while a compile runs, so that an alarm that comes once
# the compile is over raises nothing; ``fired`` once it went off during the compile.
_ALARM = {"armed": False, "fired": False}


class CompileTimeout(TimeoutError):
    """Raised in a compile child by its timer, inside the compile it interrupts."""


def _on_alarm(signum: int, frame: Any) -> None:
    if _ALARM["armed"]:
        _ALARM["fired"] = True
        raise CompileTimeout("compile time-out")


def _hang_forever() -> None:
    """The ``compile_hang`` fault: a compile deaf to its timer, as one stuck in C code."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    while True:
        time.sleep(3600)


def _init_child(environ: dict[str, str]) -> None:
    """Each compile child's set-up. A forkserver is started once per process, so its
    children inherit the environment of that moment: take the pool owner's current one
    (cache directory, device selection, ...). Then yield the CPU to the processes the GPU
    waits on."""
    os.environ.clear()
    os.environ.update(environ)
    try:
        os.nice(COMPILE_NICE)
    except OSError as exc:  # a sandbox that forbids it: children at normal priority
        log.warning("compile children keep their priority: %s", exc)


def _warm_child(steps: dict[str, float]) -> None:
    """Import what compiling needs and open the device, before the first config comes;
    the seconds of each step go into ``steps`` (where a child's start-up goes)."""
    import importlib

    t0 = time.perf_counter()
    import torch

    for name in ("triton", "harness.kernel.api"):
        importlib.import_module(name)
    steps["imports_s"] = time.perf_counter() - t0
    if torch.cuda.is_available() and not hardware.interpreted():
        t0 = time.perf_counter()
        torch.cuda.init()
        steps["cuda_init_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        try:
            from harness.measure import compile_warmup as _compile_warmup

            _compile_warmup.compile_once()
        except Exception as exc:  # only a warm-up: the first config pays instead
            log.warning("compile warm-up failed: %s", exc)
        steps["warmup_s"] = time.perf_counter() - t0


def _compile_in_child(kernel: str, shape: dict, problem: str, skel: Any, config: dict,
                      timeout_s: float = 0.0, hang: bool = False) -> dict[str, Any]:
    """Runs in a compile child: the family's ``compile_only`` for one config, on meta
    tensors. It compiles without launching or allocating, so it never touches the GPU the
    parent is timing. ``timeout_s`` > 0: interrupted once it has run that long (from the
    process's main thread, where signals are handled)."""
    t0 = time.perf_counter()
    _ALARM["fired"] = False
    try:
        from harness.kernel import api as kernel_api

        fam = kernel_api.get(kernel)
        # A prebuild carries no skeleton (it builds real inputs): it must not stand in for
        # the problem's inputs, or every later config of it here compiles against None.
        if not config.get(PREBUILD) and _CHILD.get(problem) is None:
            if skel is None:
                raise ValueError(f"no input layouts sent for {problem}")
            while len(_CHILD) >= 2:
                _CHILD.pop(next(iter(_CHILD)))
            _CHILD[problem] = materialise(skel)
        if timeout_s > 0:
            if signal.getsignal(signal.SIGALRM) is not _on_alarm:
                signal.signal(signal.SIGALRM, _on_alarm)
            _ALARM["armed"] = True
            # Again every second after the first: a compiler that swallows one
            # interruption meets the next.
            signal.setitimer(signal.ITIMER_REAL, timeout_s, 1.0)
        if hang:
            _hang_forever()
        if config.get(PREBUILD):
            _prebuild(fam, shape, config["dtype"], config["seed"])
        else:
            fam.compile_only(_CHILD[problem], shape, config)
        _ALARM["armed"] = False
        out: dict[str, Any] = {"ok": True}
    except BaseException as exc:  # the parent measures this config anyway
        _ALARM["armed"] = False
        out = {"ok": False, "reason": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
    finally:
        _ALARM["armed"] = False
        if timeout_s > 0:
            signal.setitimer(signal.ITIMER_REAL, 0)
    elapsed = time.perf_counter() - t0
    if _ALARM["fired"]:  # whatever the compiler made of the interruption
        return timeout_outcome(timeout_s, pid=os.getpid(), compile_s=elapsed)
    return {**out, "pid": os.getpid(), "compile_s": elapsed}


def child_main(conn: Any, environ: dict[str, str]) -> None:
    """A compile child: warm up, say so, then compile each config the pool sends until it
    sends None or goes away."""
    # time.monotonic() is the machine's clock: the pool places the child's start on its
    # own timeline (how long the fork server took to fork it).
    steps: dict[str, float] = {"entered": time.monotonic()}
    _init_child(environ)
    signal.signal(signal.SIGALRM, _on_alarm)
    try:
        _warm_child(steps)
    except Exception as exc:  # the first config meets the error and reports it
        log.warning("compile child warm-up failed: %s", exc)
    try:
        conn.send(("ready", os.getpid(), os.nice(0), steps))
        while True:
            task = conn.recv()
            if task is None:
                return
            tid, args, timeout_s, hang = task
            conn.send(("done", tid, _compile_in_child(*args, timeout_s=timeout_s, hang=hang)))
    except (EOFError, OSError, KeyboardInterrupt):
        return  # the pool is gone
