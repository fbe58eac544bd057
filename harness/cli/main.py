"""The ``kharness`` command line.

Exit codes: 0 success, 2 bad input (experiment file, arguments), 3 no usable hardware,
1 anything else.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from harness import jsonsafe

EXIT_BAD_INPUT = 2
EXIT_NO_HARDWARE = 3


def _fmt(v: Any, spec: str = ".3g", suffix: str = "") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return f"{v:{spec}}{suffix}"


def summary_table(rows: list[dict[str, Any]], interpreted: bool) -> Table:
    title = "Tuning summary" + (" (CPU interpreter: timings are not GPU timings)"
                                if interpreted else "")
    t = Table(title=title, show_lines=False)
    for col in ("hardware", "kernel", "shape", "dtype", "best config", "latency",
                "vs eager", "vs compile", "vs default", "roofline", "trials ok/fail/pruned"):
        t.add_column(col, overflow="fold")
    for r in rows:
        c = r.get("counts", {})
        config = r.get("params")
        t.add_row(
            r["hardware"], r["kernel"], r["shape"], r["dtype"],
            " ".join(f"{k}={v}" for k, v in config.items()) if config else "[red]none[/]",
            _fmt(r.get("latency_ms"), ".4g", " ms"),
            _fmt(r.get("speedup_vs_eager"), ".2f", "×"),
            _fmt(r.get("speedup_vs_compile"), ".2f", "×"),
            _fmt(r.get("speedup_vs_default"), ".2f", "×"),
            _fmt((r.get("roofline") or math.nan) * 100, ".0f", "%"),
            f"{c.get('measured', 0)}/{c.get('failed', 0)}/{c.get('pruned', 0)}",
        )
    return t


def _cmd_run(args: argparse.Namespace, console: Console) -> int:
    from harness.experiment import ExperimentError, load

    try:
        # Every check, the kernel family's included, before Ray starts: a bad file leaves
        # nothing behind, not even a Ray session.
        load(args.experiment, args.set or ())
    except ExperimentError as exc:
        console.print(f"[bold red]error:[/] {exc}")
        return EXIT_BAD_INPUT
    _ray_auth_mode()
    import harness
    from harness.fleet import NoHardwareError
    from harness.run import run

    try:
        summary = run(args.experiment, resume=args.resume, console=console,
                      progress=not (args.quiet or args.json), overrides=args.set or (),
                      started_at=harness.IMPORTED_AT, stop_own_ray=True)
    except ExperimentError as exc:
        console.print(f"[bold red]error:[/] {exc}")
        return EXIT_BAD_INPUT
    except NoHardwareError as exc:
        console.print(f"[bold red]error:[/] {_redact(str(exc))}", markup=True)
        return EXIT_NO_HARDWARE
    from harness.tracking.redact import redact

    summary.tracking_uri = redact(summary.tracking_uri)
    summary.events = [redact(e) for e in summary.events]
    if args.json:
        print(jsonsafe.dumps({
            "rows": summary.rows, "packs": summary.packs,
            "missing_hardware": summary.missing_hardware,
            "interpreted": summary.interpreted, "mlflow_parent_run_id": summary.parent_run_id,
            "tracking_uri": summary.tracking_uri, "wall_s": summary.wall_s,
            "gpu_held_s": summary.held_s, "kernel_timing_s": summary.timing_s,
            "timing_fraction": summary.timing_fraction, "overhead_s": summary.overhead,
            "timeline_s": summary.timeline, "worker_startup_s": summary.worker_startup,
            "mlflow_logger": summary.mlflow_logger,
            "first_calls": summary.first_calls,
            "workers_replaced": summary.replaced, "workers_reused": summary.reused,
            "trials_retried": summary.retried,
            "events": summary.events,
            "resumed": summary.resumed,
        }, default=str, indent=1))
        return 0
    out = Console()
    if not out.is_terminal:
        out = Console(width=200)  # logs and pipes: do not fold the table to 80 columns
    if not args.quiet:
        out.print(summary_table(summary.rows, summary.interpreted))
    for p in summary.packs:
        out.print(f"pack: {p}")
    if not args.quiet:
        out.print(f"wall {summary.wall_s:.1f} s; GPUs held {summary.held_s:.1f} s, of which "
                  f"{summary.timing_s:.1f} s timing kernels "
                  f"({_fmt(summary.timing_fraction * 100, '.0f', '%')}); "
                  f"{summary.replaced} workers replaced, {summary.retried} trials retried"
                  + (f", {summary.reused} kept workers reused" if summary.reused else ""))
        if summary.overhead:
            parts = ", ".join(f"{k} {v:.1f} s" for k, v in summary.overhead.items() if v >= 0.05)
            out.print(f"GPU-held time by phase: {parts}")
        fc = summary.first_calls
        if fc.get("watched"):
            out.print(f"first launches: {fc['watched'] - fc['compiled_in_worker']} of "
                      f"{fc['watched']} loaded a compiled binary, {fc['compiled_in_worker']} "
                      f"compiled in the worker ({fc['ahead_missed']} despite compile-ahead)")
        for event in summary.events:
            out.print(f"fleet: {event}")
        out.print(f"MLflow: {summary.tracking_uri} (parent run {summary.parent_run_id}); "
                  f"see it with: mlflow ui --backend-store-uri {summary.tracking_uri}")
    return 0


def _ray_auth_mode() -> None:
    """A `ray start --head` turns token authentication on by itself, but a driver joining
    it through RAY_ADDRESS sends the token only with RAY_AUTH_MODE=token, read when Ray is
    imported; without it the join fails with "InvalidAuthToken". Sending a token is
    harmless: a cluster without authentication accepts the driver either way."""
    if not os.environ.get("RAY_ADDRESS") or os.environ.get("RAY_AUTH_MODE"):
        return
    if (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")
            or (Path.home() / ".ray" / "auth_token").is_file()):
        os.environ["RAY_AUTH_MODE"] = "token"


def _redact(text: str) -> str:
    from harness.tracking.redact import redact

    return redact(text)


def _cmd_report(args: argparse.Namespace, console: Console) -> int:
    from harness.tracking.report import ReportError, write_report

    try:
        out = write_report(args.source, args.out, runs_dir=args.runs_dir,
                           tracking_uri=args.tracking_uri)
    except ReportError as exc:
        console.print(f"[bold red]error:[/] {_redact(str(exc))}")
        return EXIT_BAD_INPUT
    console.print(f"report: {out}", markup=False)
    return 0


def _cmd_bench(args: argparse.Namespace, console: Console) -> int:
    from harness.bench import CASES_FILE, TUNING_EXPERIMENT, CostSettings, run_bench

    command = "kharness bench " + " ".join(sys.argv[2:]) if len(sys.argv) > 2 else "kharness bench"
    cost = CostSettings(Path(args.tuning_experiment or TUNING_EXPERIMENT), quick=args.quick,
                        enabled=not args.no_cost)
    report = run_bench(args.out, args.kernel or None, command,
                       cases_file=args.cases or CASES_FILE, budget_s=args.budget_s,
                       log=lambda m: console.print(m, markup=False), cost=cost,
                       rounds=args.rounds)
    console.print(f"bench: {len(report['cases'])} cases in {report['wall_s']:.0f} s -> "
                  f"{args.out}/{report['environment']['hardware']}/bench.md")
    return 1 if report.get("errors") else 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kharness", description=__doc__.splitlines()[0])
    p.add_argument("--log-level", default="WARNING",
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="tune an experiment and freeze its packs")
    r.add_argument("experiment", help="experiment YAML file")
    r.add_argument("--resume", action="store_true",
                   help="continue the experiment's studies and MLflow runs where they stopped")
    r.add_argument("--quiet", action="store_true", help="no progress or table; pack paths only")
    r.add_argument("--json", action="store_true", help="machine-readable summary on stdout")
    r.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a field of the file, e.g. --set search.trials=50 "
                        "(repeatable; values are YAML)")
    r.set_defaults(func=_cmd_run)
    b = sub.add_parser("bench", help="every zoo kernel vs its baselines on this GPU")
    b.add_argument("--out", default="benchmarks/results", help="results root")
    b.add_argument("--kernel", action="append", help="only these kernels (repeatable)")
    b.add_argument("--cases", help="cases YAML (default: benchmarks/cases.yaml)")
    b.add_argument("--budget-s", type=float, default=540.0,
                   help="stop starting new cases after this many seconds")
    b.add_argument("--tuning-experiment", help="experiment whose run measures the tuning cost "
                   "(default: configs/matmul_grid216.yaml)")
    b.add_argument("--no-cost", action="store_true",
                   help="only the kernel tables: no tuning, lookup or decorator sections")
    b.add_argument("--quick", action="store_true", help="short lookup benchmark (smoke runs)")
    b.add_argument("--rounds", type=int, default=3,
                   help="measure a case's variants in turn this many times; each shows its "
                   "median round (default 3)")
    b.set_defaults(func=_cmd_bench)
    rp = sub.add_parser("report", help="a self-contained HTML report of an experiment")
    rp.add_argument("source", help="experiment name, its runs directory (runs/<name>), its "
                    "experiment YAML, or the MLflow parent run id")
    rp.add_argument("--out", default="report.html", help="HTML file to write")
    rp.add_argument("--runs-dir", default="runs", help="where experiments keep their state")
    rp.add_argument("--tracking-uri", help="MLflow tracking URI (default: the experiment's)")
    rp.set_defaults(func=_cmd_report)
    from harness.packs_cli import add_parser as add_packs_parser
    add_packs_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on bad arguments already
        return int(exc.code or 0)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    from harness.tracking.redact import install

    install()  # every log record, whoever emits it, has its secrets masked
    console = Console(stderr=True)
    if not console.is_terminal:
        console = Console(stderr=True, width=200)  # logs: keep lines whole
    return args.func(args, console)


def entry() -> None:
    """The ``kharness`` command: ``main``, then a fast exit. After a run, the interpreter's
    own teardown (freeing torch, Ray's and gRPC's native state) took ~2 s of the command's
    wall on its own; everything the harness writes is written and flushed by then, and a
    Ray this process started is stopped first (its exit hook would be skipped too)."""
    rc = main()
    try:
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            ray.shutdown()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(rc)


if __name__ == "__main__":
    entry()
