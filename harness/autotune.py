"""``harness.autotune``: launch a ``@triton.jit`` kernel with its frozen pack config.

    @harness.autotune(kernel="grouped_gemm", key=["M", "N", "K", "E"])
    @triton.jit
    def my_kernel(a_ptr, ..., M, N, K, E, BLOCK_M: tl.constexpr, ...): ...

    my_kernel[grid](a, ..., M, N, K, E)      # grid: a tuple or a callable of the meta dict

Each call reads the ``key`` arguments (by name, positional or keyword), looks up the config
for this device once per distinct key (``harness.packs`` rules: exact, nearest, a sibling
GPU's pack, default), and launches with the config's meta-parameters and launch options.
Nothing is benchmarked.

``kernel`` names a kernel family (registered name or ``package.module:Class``), whose
``dims`` the ``key`` arguments give, in any order (or a dict ``{dim: argument name}``), and
whose nearest rule, default config and constraints apply. A kernel with no family gives
``default={...}``: its dims are the key names, matched in log space (``exact=[...]`` for
dims that must match), and its pack lives at ``<packs>/<hardware>/<kernel>.json`` all the
same.

Opt-in online tuning (``online=True, configs=[...]``): on a miss (the lookup fell back to
a sibling GPU's pack or the default config) the configs are benchmarked once for that key with
``triton.testing.do_bench`` (on the CPU interpreter: the first config that passes the
kernel's constraints is taken, unmeasured), and the winner is appended to a JSON record
file (``record=`` or ``$HARNESS_PACKS_ONLINE``) that ``kharness packs merge`` freezes into a
pack. Benchmarking runs the kernel many times on the caller's arguments, so it must be
safe to repeat (as with ``triton.autotune`` without ``reset_to_zero``). Processes that
record into one file at once keep every record (the append holds a lock); a record file
that is not a JSON list is kept as ``<file>.corrupt-<UTC time>``, with a warning, and a new
one is started; a file that cannot be written costs a warning, never the launch.
"""

from __future__ import annotations

import datetime as dt
import json
import numbers
import os
import sys
import threading
import types
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from harness import packs as _packs
from harness.kernel import api as kernel_api
from harness.measure import hardware
from harness.packs import format as fmt

#: Launch options a config may carry besides the kernel's own meta-parameters.
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")
#: Accepted only by the AMD backend (NVIDIA raises on them).
AMD_OPTIONS = ("waves_per_eu", "matrix_instr_nonkdim", "kpack")

_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}


class _AdHoc(kernel_api.Kernel):
    """Lookup rules for a kernel that no family describes: the key names are its dims."""

    def __init__(self, name: str, dims: Sequence[str], default: Mapping[str, Any],
                 exact: Sequence[str] = ()):
        self.name = name
        self.dims = tuple(dims)
        self.exact_dims = tuple(exact)
        self.default_config = dict(default)

    def declared_tunables(self) -> dict[str, kernel_api.Tunable]:
        """The default config's keys, typed by its values (not limited to them)."""
        out: dict[str, kernel_api.Tunable] = {}
        for k, v in self.default_config.items():
            t = kernel_api.infer_tunable([v])
            out[k] = kernel_api.Tunable(type=t.type if t else None)
        return out

    def check_tunables(self, config: Mapping[str, Any]) -> str | None:
        """Only the default config's keys are typed: a pack may carry other knobs, which
        the launch drops where they are not arguments of the kernel (``launch_kwargs``)."""
        return super().check_tunables({k: v for k, v in config.items()
                                       if k in self.default_config})

    def _no(self, *_: Any) -> Any:
        raise NotImplementedError(f"{self.name} has no Kernel family: lookup only")

    make_inputs = reference = launcher = flops = bytes_moved = _no


def _arg_names(fn: Any) -> list[str]:
    while fn is not None:
        names = getattr(fn, "arg_names", None)
        if names is not None:
            return list(names)
        fn = getattr(fn, "fn", None)
    raise TypeError("harness.autotune wraps a @triton.jit function (it has no arg_names)")


def _pack_dtype(named: Mapping[str, Any]) -> str:
    for v in named.values():
        dtype = getattr(v, "dtype", None)
        if dtype is not None and hasattr(v, "data_ptr"):
            name = str(dtype).replace("torch.", "")
            return _DTYPES.get(name, name)
    raise TypeError("harness.autotune: no tensor argument to take the dtype from; "
                    "pass dtype='bf16' (or fp16, fp32) to the decorator")


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


class PackedKernel:
    """A ``@triton.jit`` function launched with frozen pack configs (see the module doc)."""

    def __init__(self, fn: Any, kernel: str, key: Sequence[str] | Mapping[str, str],
                 dtype: str | None = None, *, default: Mapping[str, Any] | None = None,
                 exact: Sequence[str] = (), configs: Sequence[Mapping[str, Any]] | None = None,
                 online: bool = False, record: str | Path | None = None,
                 hardware_key: str | None = None, warmup: int = 25, rep: int = 100):
        self.fn = fn
        self.arg_names = _arg_names(fn)
        key_map = dict(key) if isinstance(key, Mapping) else {k: k for k in key}
        try:
            self.family: kernel_api.Kernel = kernel_api.get(kernel)
            self._label: str | kernel_api.Kernel = kernel
        except (KeyError, ImportError, AttributeError) as exc:
            if default is None:
                raise ValueError(f"harness.autotune: {exc}; for a kernel with no family, "
                                 "give its default config: default={...}") from None
            self.family = _AdHoc(kernel, list(key_map), default, exact)
            self._label = self.family
        dims = self.family.dims
        if set(key_map) != set(dims):
            raise ValueError(f"harness.autotune: key {sorted(key_map)} must name the dims "
                             f"{list(dims)} of {self.family.name}")
        missing = [a for a in key_map.values() if a not in self.arg_names]
        if missing:
            raise ValueError(f"harness.autotune: key arguments {missing} are not arguments "
                             f"of {getattr(fn, '__name__', fn)} ({self.arg_names})")
        self.key = {d: key_map[d] for d in dims}
        self._key_args = tuple(self.key.values())
        self.dtype = dtype
        self.configs = [dict(c) for c in (configs or [])]
        if online and not self.configs:
            raise ValueError("harness.autotune: online=True needs configs=[...] to try")
        self.online = online
        self.record = record
        self.hardware_key = hardware_key
        self.warmup, self.rep = warmup, rep
        self._options = LAUNCH_OPTIONS + (AMD_OPTIONS if hardware.current_device().vendor
                                          == "amd" else ())
        self._cache: dict[tuple, dict[str, Any]] = {}
        #: The pack lookup (harness.packs.Hit) behind each distinct key.
        self.hits: dict[tuple, _packs.Hit] = {}
        #: What online tuning found in this process (also appended to the record file).
        self.tuned: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        return lambda *args, **kwargs: self.run(*args, grid=grid, **kwargs)

    def __getattr__(self, name: str) -> Any:  # .src, .__name__, ... of the jit function
        if name == "fn":
            raise AttributeError(name)
        return getattr(self.fn, name)

    def __repr__(self) -> str:
        return f"harness.autotune({self.family.name}, key={list(self.key)})({self.fn!r})"

    # -- launching ----------------------------------------------------------------------
    def run(self, *args: Any, grid: Any, **kwargs: Any) -> Any:
        if len(args) > len(self.arg_names):
            raise TypeError(f"{len(args)} positional arguments for {len(self.arg_names)} "
                            "parameters")
        named = dict(zip(self.arg_names, args, strict=False))
        named.update(kwargs)
        try:
            kvals = tuple(named[a] for a in self._key_args)
        except KeyError as exc:
            raise TypeError(f"harness.autotune: key argument {exc} not given") from None
        dtype = self.dtype or _pack_dtype(named)
        launch = self._cache.get((kvals, dtype))
        if launch is None:
            launch = self._resolve(kvals, dtype, named, args, kwargs, grid)
        if kwargs and not launch.keys().isdisjoint(kwargs):
            raise ValueError(f"harness.autotune: {sorted(launch.keys() & kwargs.keys())} "
                             "come from the pack; do not pass them")
        return self.fn[grid](*args, **kwargs, **launch)

    def launch_kwargs(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """The config's meta-parameters that are arguments of the kernel, plus the launch
        options; other keys (a family's knobs for another code path) are dropped."""
        return {k: v for k, v in config.items()
                if (k in self.arg_names or k in self._options)}

    def _resolve(self, kvals: tuple, dtype: str, named: dict[str, Any], args: tuple,
                 kwargs: dict[str, Any], grid: Any) -> dict[str, Any]:
        with self._lock:
            cached = self._cache.get((kvals, dtype))
            if cached is not None:
                return cached
            for a, v in zip(self._key_args, kvals, strict=True):
                if not isinstance(v, numbers.Integral) or isinstance(v, bool):
                    raise TypeError(f"harness.autotune: key argument {a!r} must be an int, "
                                    f"not {type(v).__name__}")
            shape = {d: int(v) for d, v in zip(self.key, kvals, strict=True)}
            hit = _packs.lookup_entry(self._label, dtype, self.hardware_key, **shape)
            config = hit.config
            # A sibling GPU's pack (a family hit) is a miss for this GPU: tune it too.
            if hit.source in ("default", "family") and self.online:
                config = self._tune(shape, dtype, hit.config, args, kwargs, grid)
            launch = self.launch_kwargs(config)
            given = set(self.arg_names[:len(args)]) & launch.keys()
            if given:
                raise ValueError(f"harness.autotune: {sorted(given)} come from the pack; do "
                                 "not pass them")
            self.hits[(kvals, dtype)] = hit
            self._cache[(kvals, dtype)] = launch
            return launch

    # -- online tuning ------------------------------------------------------------------
    def _tune(self, shape: dict[str, int], dtype: str, fallback: dict[str, Any],
              args: tuple, kwargs: dict[str, Any], grid: Any) -> dict[str, Any]:
        device = hardware.current_device()
        hw = self.hardware_key or device.key
        spec = device if hw == device.key else hardware.spec_for_key(hw)
        tried: list[dict[str, Any]] = []
        for cfg in self.configs:
            full = {**self.family.default_config, **cfg}
            why = self.family.check_config(full, shape, spec)
            if why:
                tried.append({"config": full, "error": f"pruned: {why}"})
            else:
                tried.append({"config": full})
        ok = [t for t in tried if "error" not in t]
        best: dict[str, Any] | None = None
        if device.interpreted:
            # No timer worth the name on the interpreter: take the first valid config.
            best = ok[0] if ok else None
        else:
            from triton.testing import do_bench

            for t in ok:
                kw = self.launch_kwargs(t["config"])
                try:
                    t["latency_ms"] = float(do_bench(
                        lambda kw=kw: self.fn[grid](*args, **kwargs, **kw),
                        warmup=self.warmup, rep=self.rep, return_mode="median"))
                except Exception as exc:  # out of resources, compile error: skip it
                    t["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            timed = [t for t in ok if "latency_ms" in t]
            best = min(timed, key=lambda t: t["latency_ms"]) if timed else None
        if best is None:
            warnings.warn(f"harness.autotune: no config of {len(self.configs)} ran for "
                          f"{self.family.name} {shape}; using the default config",
                          _packs.PackWarning, stacklevel=4)
            return fallback
        versions = _packs.runtime_versions()
        rec = {
            "kernel": self._label if isinstance(self._label, str) else self.family.name,
            "family": self.family.name, "hardware": hw, "dtype": dtype, "shape": shape,
            "shape_key": self.family.shape_key(shape), "config": best["config"],
            "latency_ms": best.get("latency_ms"),
            "candidates": tried,
            "provenance": {"source": "online", "device_name": device.name,
                           "triton": versions["triton"] or "", "torch": versions["torch"] or "",
                           "date": _now(), "interpreted": device.interpreted},
        }
        self.tuned.append(rec)
        path = self.record or os.environ.get("HARNESS_PACKS_ONLINE")
        if path:
            try:
                append_record(path, rec)
            except (OSError, fmt.PackError) as exc:  # the tuned config runs all the same
                warnings.warn(f"harness.autotune: could not record to {path}: {exc}",
                              _packs.PackWarning, stacklevel=4)
        return best["config"]


_record_lock = threading.Lock()


def _set_aside(path: Path, why: str) -> Path:
    """Rename a record file that is not a JSON list to ``<file>.corrupt-<UTC time>``
    (never over an earlier one) and warn: its records are kept for a person to read."""
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    kept = path.with_name(f"{path.name}.corrupt-{stamp}")
    n = 1
    while fmt.exists(kept):
        n += 1
        kept = path.with_name(f"{path.name}.corrupt-{stamp}-{n}")
    os.replace(path, kept)
    warnings.warn(f"harness.autotune: the record file {path} is corrupt ({why}); kept as "
                  f"{kept.name}, starting a new one", _packs.PackWarning, stacklevel=4)
    return kept


def append_record(path: str | Path, rec: Mapping[str, Any]) -> None:
    """Append one online-tuning result to a JSON list file: under a lock beside it (other
    processes appending at once wait), written atomically. A file that is not a JSON list
    is set aside as ``<file>.corrupt-<UTC time>`` with a PackWarning, and a new list
    started; one that is not a regular file, or cannot be read, raises PackError."""
    path = Path(path)
    with _record_lock, fmt.locked(path):
        old: Any = []
        if fmt.exists(path):
            raw = fmt.read_bytes(path, limit=None)  # PackError: a FIFO, no permission, ...
            try:
                old = fmt.parse_json(raw, str(path))
            except fmt.PackError as exc:
                old = exc
            if not isinstance(old, list):
                kinds = {dict: "an object", str: "a string", bool: "a boolean",
                         type(None): "null"}
                why = str(old).removeprefix(f"{path}: ") if isinstance(old, Exception) \
                    else f"{kinds.get(type(old), 'a number')}, not a list of records"
                _set_aside(path, why)
                old = []
        fmt.write_text(path, json.dumps(old + [rec], indent=1) + "\n")


def autotune(kernel: str, key: Sequence[str] | Mapping[str, str], dtype: str | None = None,
             **options: Any) -> Callable[[Any], PackedKernel]:
    """Decorate a ``@triton.jit`` function to launch with its frozen pack config.

    ``kernel``: the family (or, with ``default=``, any name); ``key``: the arguments that
    give the family's dims; ``dtype``: the pack dtype (default: from the first tensor
    argument). ``options``: ``default``, ``exact``, ``configs``, ``online``, ``record``,
    ``hardware_key``, ``warmup``, ``rep`` (see PackedKernel and the module doc).
    """
    def wrap(fn: Any) -> PackedKernel:
        return PackedKernel(fn, kernel, key, dtype, **options)

    return wrap


class _CallableModule(types.ModuleType):
    """``harness.autotune`` is both this module and the decorator: once the submodule is
    imported, Python binds the package attribute to the module, so the module forwards
    calls to ``autotune``."""

    def __call__(self, *args: Any, **kwargs: Any) -> Callable[[Any], PackedKernel]:
        return autotune(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
