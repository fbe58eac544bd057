#!/usr/bin/env python3
"""The fleet's scaling: one many-study experiment on 1, 2, ..., N GPUs of this machine.

    python benchmarks/fleet_scaling.py [--experiment FILE] [--gpus 1,2,4] [--out DIR]
    python benchmarks/fleet_scaling.py --cpu --gpus 1,2 --out DIR   # simulated, no GPU

Each count runs the experiment from scratch as a command of its own (``kharness run``'s
path: a Ray of its own, a new MLflow store and Optuna storage, an empty Triton cache) on
the first N GPUs (``CUDA_VISIBLE_DEVICES``), and the benchmark writes a table, as JSON and
markdown, of the wall time, trials per hour, speed-up over the smallest count, each GPU's
timing fraction (seconds inside the kernel timer over its held seconds), its idle
seconds (waiting for the driver) and setup seconds (waiting for its compiles), when the
first trial came back after the command started and how long the command took after the
last result (a re-measurement's, as a rule), and the driver's own seconds per task.

``--warm``: each count on a fleet that outlives its runs, as a user iterates: a
``ray start --head`` over the first N GPUs, the experiment run twice on it with
``fleet.keep_workers_s`` (the first run starts the workers, compile service and Triton
cache; the second leases them), then ``ray stop``. The table has both runs of each
count; the speed-ups compare the second runs.

``--cpu``: no GPU needed (CI). The GPUs are simulated: each count starts a Ray whose node
advertises N GPUs of ``--key`` (``accelerator_type``), and the workers run Triton's
interpreter; the default experiment is then the tiny ``configs/scaling/tiny_cpu.yaml``,
whose kernel sleeps in each launch, so that the simulated GPUs scale like real ones.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GPU_EXPERIMENT = ROOT / "configs" / "scaling" / "matmul_8_token_counts.yaml"
CPU_EXPERIMENT = ROOT / "configs" / "scaling" / "tiny_cpu.yaml"


# -- one count: a command of its own ----------------------------------------------------------

def child(experiment: str, out: str, simulate: int, key: str, overrides: list[str]) -> None:
    """Runs in the child process: the experiment with ``overrides``, as ``kharness run``
    runs it, and its summary written to ``out``. ``simulate`` > 0: a Ray whose node
    advertises that many GPUs of ``key`` first (no real GPU: the workers interpret)."""
    import harness  # the wall time's origin, as the command's
    if simulate:
        import logging

        from harness.fleet.cluster import start_local_ray

        start_local_ray(num_gpus=simulate, resources={f"accelerator_type:{key}": simulate},
                        logging_level=logging.WARNING, log_to_driver=False,
                        runtime_env={"env_vars": {"PYTHONPATH": os.environ.get(
                            "PYTHONPATH", "")}})
    from rich.console import Console

    from harness.run.runner import run
    from harness.tracking import jsonsafe

    summary = run(experiment, console=Console(stderr=True), progress=False,
                  overrides=overrides, started_at=harness.IMPORTED_AT, stop_own_ray=True)
    if simulate:
        import ray

        ray.shutdown()
    counts = [r.get("counts", {}) for r in summary.rows]
    Path(out).write_text(jsonsafe.dumps({
        "wall_s": summary.wall_s, "timeline_s": summary.timeline,
        "gpu_held_s": summary.held_s, "kernel_timing_s": summary.timing_s,
        "timing_fraction": summary.timing_fraction, "overhead_s": summary.overhead,
        "fleet": summary.fleet, "events": summary.events,
        "trials": sum(c.get("measured", 0) + c.get("failed", 0) for c in counts),
        "pruned": sum(c.get("pruned", 0) for c in counts),
        "studies": len(summary.rows),
        "frozen": sum(1 for r in summary.rows if r.get("params")),
        "interpreted": summary.interpreted,
        "worker_startup_s": summary.worker_startup,
        "workers_reused": summary.reused,
    }, default=str, indent=1))


def _env(n: int, args: argparse.Namespace, here: Path) -> dict[str, str]:
    """The environment of count ``n``: its GPUs, an empty Triton cache of its own."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "TRITON_INTERPRET")}
    env["TRITON_CACHE_DIR"] = str(here / "triton-cache")  # empty: every binary compiled
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    if not args.cpu:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(args.devices[:n])
    return env


def one_count(n: int, args: argparse.Namespace, work: Path, run: int = 0,
              env: dict[str, str] | None = None,
              extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """The experiment on the first ``n`` GPUs, from scratch (``run`` > 0: the run-th on
    a warm fleet, in the same folder); the child's summary plus the command's wall time
    as seen from outside."""
    here = work / f"gpus{n}"
    here.mkdir(parents=True, exist_ok=True)
    env = env or _env(n, args, here)
    exp = here / "experiment.yaml"
    exp.write_text(Path(args.experiment).read_text())
    overrides = [f"tracking.uri=sqlite:///{here / 'mlflow.db'}",
                 f"output.runs_dir={here / 'runs'}", f"output.packs_dir={here / 'packs'}",
                 *extra]
    out = here / f"summary{run or ''}.json"
    if run:
        # A warm fleet's runs are the command a user types, so that what the command
        # keeps between runs (the kept driver) is measured too. The second run replaces
        # the first's studies: a user iterating re-runs the same experiment.
        cmd = [sys.executable, "-m", "harness", "run", str(exp), "--json",
               *(["--fresh"] if run > 1 else []), *[a for o in overrides for a in ("--set", o)]]
    else:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(exp), str(out),
               str(n if args.cpu else 0), args.key, *overrides]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=here, env=env, capture_output=True, text=True,
                          timeout=args.timeout_s)
    wall = time.monotonic() - t0
    (here / f"stderr{run or ''}.txt").write_text(proc.stderr[-200_000:])
    if run and proc.returncode == 0:
        out.write_text(json.dumps(_from_command(json.loads(proc.stdout)), indent=1))
    if proc.returncode != 0 or not out.is_file():
        return {"gpus": n, "run": run, "error": f"exit {proc.returncode}: {proc.stderr[-2000:]}",
                "command_wall_s": wall}
    res = json.loads(out.read_text())
    res.update(gpus=n, command_wall_s=round(wall, 2), run=run)
    return res


def _from_command(j: dict[str, Any]) -> dict[str, Any]:
    """A command's ``--json`` summary in the child's form."""
    counts = [r.get("counts", {}) for r in j["rows"]]
    return {
        "wall_s": j["wall_s"], "timeline_s": j["timeline_s"], "gpu_held_s": j["gpu_held_s"],
        "kernel_timing_s": j["kernel_timing_s"], "timing_fraction": j["timing_fraction"],
        "overhead_s": j["overhead_s"], "events": j["events"],
        "fleet": {"workers": j["workers"], "driver_s": j["driver_s"],
                  "compile_services": j["compile_services"]},
        "trials": sum(c.get("measured", 0) + c.get("failed", 0) for c in counts),
        "pruned": sum(c.get("pruned", 0) for c in counts), "studies": len(j["rows"]),
        "frozen": sum(1 for r in j["rows"] if r.get("params")),
        "interpreted": j["interpreted"], "worker_startup_s": j["worker_startup_s"],
        "workers_reused": j["workers_reused"], "kept_driver": j["kept_driver"],
        "mlflow_logger": j["mlflow_logger"]}


def warm_count(n: int, args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """Count ``n`` on a ``ray start --head`` fleet over its GPUs: the experiment twice
    with kept workers (the second run is the warm one), then the head stopped."""
    here = work / f"gpus{n}"
    here.mkdir(parents=True, exist_ok=True)
    env = _env(n, args, here)
    head = ["ray", "start", "--head", "--port", "0", "--dashboard-host", "127.0.0.1",
            "--include-dashboard", "false", "--disable-usage-stats", "--num-gpus", str(n)]
    if args.cpu:  # simulated GPUs of the key
        head += ["--resources", json.dumps({f"accelerator_type:{args.key}": n})]
    started = subprocess.run(head, env=env, capture_output=True, text=True, timeout=300)
    if started.returncode != 0:
        return [{"gpus": n, "run": 1, "error": f"ray start: {started.stderr[-2000:]}"}]
    env = {**env, "RAY_AUTH_MODE": env.get("RAY_AUTH_MODE", "token")}
    keep = (f"fleet.keep_workers_s={args.keep_s:g}",)
    try:
        out = []
        for run in (1, 2):
            out.append(one_count(n, args, work, run=run, env=env, extra=keep))
            if "error" in out[-1]:
                break
        return out
    finally:
        subprocess.run(["ray", "stop", "--force"], env=env, capture_output=True, timeout=120)
        # The kept drivers its runs left: the next count starts from nothing kept.
        subprocess.run(["pkill", "-f", "harness.cli.kept_server"], capture_output=True)


# -- the table --------------------------------------------------------------------------------

def _row(res: dict[str, Any], base: dict[str, Any] | None) -> dict[str, Any]:
    if "error" in res:
        return {"gpus": res["gpus"], "run": res.get("run") or "cold",
                "error": res["error"][-300:]}
    wall = res["command_wall_s"]
    tl = res.get("timeline_s", {})
    startup = wall - res.get("wall_s", wall)  # the interpreter's start before harness
    workers = res.get("fleet", {}).get("workers", [])
    driver = res.get("fleet", {}).get("driver_s", {})
    tasks = driver.get("tasks") or 0
    row = {
        "gpus": res["gpus"], "run": res.get("run") or "cold",
        "studies": res.get("studies"), "trials": res.get("trials"),
        "workers_reused": res.get("workers_reused"),
        "wall_s": round(wall, 2),
        "trials_per_hour": round(res.get("trials", 0) / wall * 3600) if wall else None,
        "speedup": (round(base["command_wall_s"] / wall, 3)
                    if base and "command_wall_s" in base and wall and res.get("run") != 1
                    else None),
        "search_s": (round(tl["last_trial"] - tl["first_trial"], 2)
                     if "first_trial" in tl and "last_trial" in tl else None),
        "first_trial_s": round(tl["first_trial"] + startup, 2) if "first_trial" in tl else None,
        # The last result of any kind (a re-measurement, usually) to the command's exit.
        "after_last_trial_s": (round(wall - tl["last_result"] - startup, 2)
                               if "last_result" in tl else None),
        "timing_fraction": res.get("timing_fraction"),
        "per_gpu_timing_fraction": [w.get("timing_fraction") for w in workers],
        "per_gpu_idle_s": [w.get("idle_s", 0.0) for w in workers],
        "per_gpu_setup_s": [w.get("setup_s", 0.0) for w in workers],
        "held_s": round(res.get("gpu_held_s", 0.0), 2),
        "timing_s": round(res.get("kernel_timing_s", 0.0), 2),
        "idle_s": res.get("overhead_s", {}).get("idle"),
        "compile_wait_s": res.get("overhead_s", {}).get("setup"),
        "driver_ms_per_task": (round(1e3 * (driver.get("hand_out", 0) + driver.get("results", 0))
                                     / tasks, 2) if tasks else None),
        "compile_services": res.get("fleet", {}).get("compile_services", {}),
    }
    return row


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    if isinstance(v, list):
        return " / ".join(_fmt(x) for x in v)
    return str(v)


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    cols = [("gpus", "GPUs"), ("run", "run"), ("studies", "studies"), ("trials", "trials"),
            ("wall_s", "wall s"), ("trials_per_hour", "trials/h"), ("speedup", "speed-up"),
            ("per_gpu_timing_fraction", "timing fraction per GPU"),
            ("idle_s", "idle s (all GPUs)"), ("compile_wait_s", "compile wait s"),
            ("first_trial_s", "command → first trial s"),
            ("after_last_trial_s", "last trial → exit s"),
            ("driver_ms_per_task", "driver ms/task")]
    lines = [f"Fleet scaling: `{meta['experiment']}` on {meta['device']} ({meta['date']})",
             "", f"Command: `{meta['command']}`", "",
             "| " + " | ".join(h for _, h in cols) + " |",
             "|" + "---|" * len(cols)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['gpus']} | error: {r['error'][:120]} |")
            continue
        lines.append("| " + " | ".join(_fmt(r.get(k)) for k, _ in cols) + " |")
    return "\n".join(lines) + "\n"


def _device() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.split("\n")
        names = [n.strip() for n in out if n.strip()]
        if names:
            return f"{len(names)}x {names[0]}"
    except (OSError, subprocess.SubprocessError):
        pass
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        experiment, out, simulate, key, *sets = argv[1:]
        child(experiment, out, int(simulate), key, sets)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experiment", help="the many-study experiment (default: the 8 token "
                    "counts of the bf16 matmul; with --cpu the tiny one)")
    ap.add_argument("--gpus", default="1,2", help="GPU counts to run, e.g. 1,2,4")
    ap.add_argument("--devices", help="the GPUs to take them from (default: "
                    "CUDA_VISIBLE_DEVICES, else 0..N-1)")
    ap.add_argument("--cpu", action="store_true", help="simulated GPUs, interpreter (CI)")
    ap.add_argument("--key", default="H100", help="hardware key of the simulated GPUs")
    ap.add_argument("--out", required=True, help="folder for scaling.json and scaling.md")
    ap.add_argument("--work", help="folder for each count's run (default: a temporary one)")
    ap.add_argument("--timeout-s", type=float, default=1800)
    ap.add_argument("--warm", action="store_true", help="each count twice on a `ray start` "
                    "fleet with kept workers (the second run is the warm one)")
    ap.add_argument("--keep-s", type=float, default=600.0,
                    help="fleet.keep_workers_s of the --warm runs")
    args = ap.parse_args(argv)
    args.experiment = args.experiment or str(CPU_EXPERIMENT if args.cpu else GPU_EXPERIMENT)
    counts = [int(x) for x in args.gpus.split(",") if x.strip()]
    visible = args.devices or os.environ.get("CUDA_VISIBLE_DEVICES") or ""
    args.devices = ([d for d in visible.split(",") if d] if visible
                    else [str(i) for i in range(max(counts))])
    if not args.cpu and len(args.devices) < max(counts):
        ap.error(f"{max(counts)} GPUs asked for, {len(args.devices)} available")
    work = Path(args.work or tempfile.mkdtemp(prefix="fleet-scaling-"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    for n in counts:
        print(f"{n} GPU(s) ...", file=sys.stderr, flush=True)
        new = warm_count(n, args, work) if args.warm else [one_count(n, args, work)]
        results += new
        for res in new:
            print(json.dumps({k: v for k, v in res.items()
                              if k in ("gpus", "run", "command_wall_s", "trials",
                                       "timing_fraction", "error")}), file=sys.stderr, flush=True)
        rows = write(results, args, argv, out)  # after each count: a cut run keeps them
    print(markdown(rows, _meta(args, argv)))
    return 0 if all("error" not in r for r in rows) else 1


def _meta(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    return {"experiment": os.path.relpath(args.experiment, ROOT), "device": _device() if
            not args.cpu else f"simulated {args.key} GPUs on {_device()}",
            "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": "python benchmarks/fleet_scaling.py " + " ".join(argv),
            "git_sha": os.environ.get("HARNESS_GIT_SHA", "")}


def write(results: list[dict[str, Any]], args: argparse.Namespace, argv: list[str],
          out: Path) -> list[dict[str, Any]]:
    """The table of ``results`` so far, as scaling.json and scaling.md in ``out``."""
    # The speed-ups compare like with like: the cold runs, or the warm (second) runs.
    base = next((r for r in results if "error" not in r and r.get("run") in (0, 2, None)),
                None)
    rows = [_row(r, base) for r in results]
    meta = _meta(args, argv)
    (out / "scaling.json").write_text(json.dumps({"meta": meta, "rows": rows,
                                                  "raw": results}, indent=1, default=str))
    (out / "scaling.md").write_text(markdown(rows, meta))
    return rows


if __name__ == "__main__":
    sys.exit(main())
