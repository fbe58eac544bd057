"""Where a standalone run's first seconds go: imports, a local ``ray.init`` as the harness
does it, a GPU actor's start, and compile children started by spawn vs forkserver
(preloaded). Prints one JSON object.

    python3 benchmarks/device/diag_startup.py
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

T: dict[str, float] = {}


def _t(name: str, t0: float) -> float:
    T[name] = round(time.perf_counter() - t0, 3)
    return time.perf_counter()


def _warm() -> int:
    import torch  # noqa: F401
    import triton  # noqa: F401

    from harness import kernel_api  # noqa: F401

    return os.getpid()


def _pool_start(method: str, n: int, preload: list[str] | None = None) -> float:
    ctx = multiprocessing.get_context(method)
    if preload is not None:
        ctx.set_forkserver_preload(preload)
    t0 = time.perf_counter()
    with ProcessPoolExecutor(n, mp_context=ctx) as pool:
        list(pool.map(lambda_free_warm, range(n)))
    return round(time.perf_counter() - t0, 3)


def lambda_free_warm(_: int) -> int:
    return _warm()


def main() -> None:
    t = time.perf_counter()
    import torch

    t = _t("import_torch", t)
    import triton  # noqa: F401

    t = _t("import_triton", t)
    import ray

    t = _t("import_ray", t)
    import optuna  # noqa: F401

    t = _t("import_optuna", t)
    import mlflow  # noqa: F401

    t = _t("import_mlflow", t)
    torch.cuda.init()
    t = _t("cuda_init", t)
    n = int(os.environ.get("CHILDREN", "14"))
    T["spawn_pool_warm"] = _pool_start("spawn", n)
    T["forkserver_pool_warm"] = _pool_start("forkserver", n,
                                            ["torch", "triton", "harness.kernel_api"])
    t = time.perf_counter()
    os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
    ray.init(logging_level="WARNING", log_to_driver=False, include_dashboard=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}})
    t = _t("ray_init", t)

    @ray.remote(num_gpus=1)
    class A:
        def __init__(self) -> None:
            import torch

            self.n = torch.cuda.device_count()

        def ping(self) -> int:
            return self.n

    a = A.remote()
    ray.get(a.ping.remote())
    t = _t("gpu_actor_ready", t)
    ray.shutdown()
    _t("ray_shutdown", t)
    print(json.dumps(T))
    print(json.dumps(T), file=sys.stderr)


if __name__ == "__main__":
    main()
