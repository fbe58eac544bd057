"""Diagnose compile-ahead: does a compile child's ``compile_only`` build the binary that
the worker's first launch then loads?

For each (family, shape, config) below, a spawned child runs the fleet's own
``_compile_in_child`` on the skeleton of CUDA inputs (as a worker's compile child does);
then this process launches the config on the real inputs. Both record Triton's JIT
specialization (``knobs.runtime.jit_cache_hook``) and whether the on-disk cache hit
(``knobs.compilation.listener``). Prints, per case, the parent's first-call time, the
cache verdict and the fields of the specialization that differ.

    python3 benchmarks/device/diag_compile_ahead.py > diag.json
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import tempfile
import time

CASES = [
    ("matmul", {"M": 4096, "N": 4096, "K": 4096},
     {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4,
      "GROUP_M": 8}),
    ("grouped_gemm", {"M": 3072, "N": 1408, "K": 2048, "E": 64},
     {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 4,
      "num_stages": 4, "PERSISTENT": 0, "USE_TMA": 0}),
    ("grouped_gemm", {"M": 3072, "N": 1408, "K": 2048, "E": 64},
     {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8,
      "num_stages": 3, "PERSISTENT": 1, "USE_TMA": 0}),
]


def _install_hooks(log: list) -> None:
    from triton import knobs

    def jit_hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        log.append({"what": "jit", "fn": fn.name, "warmup": is_manual_warmup,
                    "spec": json.loads(compile["specialization_data"])})
        return False

    def listener(*, src, metadata, metadata_group, times, cache_hit):
        log.append({"what": "compile", "name": getattr(src, "name", "?"),
                    "cache_hit": cache_hit, "hash": metadata.get("hash")})

    knobs.runtime.jit_cache_hook = jit_hook
    knobs.compilation.listener = listener


def _child(kernel: str, shape: dict, problem: str, skel, config: dict) -> dict:
    log: list = []
    _install_hooks(log)
    from harness.fleet import _compile_in_child

    t0 = time.perf_counter()
    res = _compile_in_child(kernel, shape, problem, skel, config)
    return {"result": res, "log": log, "s": time.perf_counter() - t0}


def _diff(a: dict, b: dict, path: str = "") -> list[str]:
    out = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k, "<absent>"), b.get(k, "<absent>")
        if isinstance(va, dict) and isinstance(vb, dict):
            out += _diff(va, vb, f"{path}{k}.")
        elif va != vb:
            out.append(f"{path}{k}: child={va!r} parent={vb!r}")
    return out


def main() -> None:
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="diag-triton-")
    import torch

    from harness import kernel_api
    from harness.fleet import _problem_key, skeleton

    ctx = multiprocessing.get_context("spawn")
    report = []
    with ctx.Pool(1) as pool:
        for kernel, shape, config in CASES:
            fam = kernel_api.get(kernel)
            inputs = fam.make_inputs(shape, "bf16", 0, "cuda")
            torch.cuda.synchronize()
            problem = _problem_key(kernel, shape, "bf16", 0)
            child = pool.apply(_child, (kernel, shape, problem, skeleton(inputs), config))
            log: list = []
            _install_hooks(log)
            t0 = time.perf_counter()
            fam.launcher(inputs, shape, config)()
            torch.cuda.synchronize()
            first_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            fam.launcher(inputs, shape, config)()
            torch.cuda.synchronize()
            second_s = time.perf_counter() - t0
            from triton import knobs

            knobs.runtime.jit_cache_hook = None
            knobs.compilation.listener = None
            cj = [e for e in child["log"] if e["what"] == "jit"]
            pj = [e for e in log if e["what"] == "jit"]
            diffs = _diff(cj[0]["spec"], pj[0]["spec"]) if cj and pj else ["no jit record"]
            report.append({
                "kernel": kernel, "shape": shape, "config": config,
                "child_s": round(child["s"], 3), "child_result": child["result"],
                "parent_first_call_s": round(first_s, 4),
                "parent_second_call_s": round(second_s, 4),
                "child_compiles": [e for e in child["log"] if e["what"] == "compile"],
                "parent_compiles": [e for e in log if e["what"] == "compile"],
                "spec_diffs": diffs,
            })
            print(f"{kernel} {config}: child {child['s']:.2f}s {child['result'].get('ok')}, "
                  f"parent first call {first_s:.3f}s (second {second_s:.4f}s), parent "
                  f"cache hits {[e['cache_hit'] for e in log if e['what'] == 'compile']}, "
                  f"diffs {diffs[:6]}", file=sys.stderr)
    report.append(_pool_case())
    json.dump(report, sys.stdout, indent=1, default=str)


def _decode_configs(n: int) -> list[dict]:
    import itertools

    grid = itertools.product([64, 128, 256], [128, 256], [32, 64], [1, 8], [4, 8], [3, 4],
                             [0, 1])
    keys = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages",
            "PERSISTENT")
    out = [dict(zip(keys, v, strict=True), USE_TMA=0) for v in grid]
    return out[::max(1, len(out) // n)][:n]


def _pool_case() -> dict:
    """The worker's own Precompiler (14 spawn children) on 24 grouped-GEMM configs, then
    this process's first call of each, in order, with the compile listener on."""
    import cProfile
    import io
    import pstats

    import torch
    from triton import knobs

    from harness import kernel_api
    from harness.fleet import Precompiler, _problem_key, skeleton

    kernel, shape = "grouped_gemm", {"M": 3072, "N": 1408, "K": 2048, "E": 64}
    fam = kernel_api.get(kernel)
    inputs = fam.make_inputs(shape, "bf16", 0, "cuda")
    problem = _problem_key(kernel, shape, "bf16", 0)
    configs = _decode_configs(24)
    pre = Precompiler(int(os.environ.get("CHILDREN", "14")))
    pre.start()
    pre.submit(problem, kernel, shape, skeleton(inputs), configs)
    rows = []
    prof_text = ""
    for i, cfg in enumerate(configs):
        t0 = time.perf_counter()
        ahead = pre.wait(problem, cfg)
        wait_s = time.perf_counter() - t0
        log: list = []
        _install_hooks(log)
        prof = cProfile.Profile() if i == 5 else None
        t0 = time.perf_counter()
        if prof:
            prof.enable()
        fam.launcher(inputs, shape, cfg)()
        torch.cuda.synchronize()
        if prof:
            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(25)
            prof_text = buf.getvalue()
        first_s = time.perf_counter() - t0
        knobs.runtime.jit_cache_hook = None
        knobs.compilation.listener = None
        rows.append({"config": cfg, "wait_s": round(wait_s, 3), "ahead": ahead,
                     "first_call_s": round(first_s, 4),
                     "cache_hits": [e["cache_hit"] for e in log if e["what"] == "compile"]})
        print(f"pool {i}: wait {wait_s:.3f}s first {first_s:.3f}s hits {rows[-1]['cache_hits']}"
              f" ahead {ahead}", file=sys.stderr)
    pre.close()
    print(prof_text, file=sys.stderr)
    return {"pool_case": rows, "profile": prof_text}


if __name__ == "__main__":
    main()
