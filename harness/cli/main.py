"""The ``kharness`` command line: its parser, the report and bench commands, and the
console script's entry point (``run`` is ``run_command``, ``packs`` is ``packs``).

Exit codes: 0 success, 2 bad input (experiment file, arguments), 3 no usable hardware,
4 a study tuned nothing (every config pruned or failed; the run names it and why),
1 anything else.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import traceback
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from harness.cli import kept_driver
from harness.cli.run_command import EXIT_BAD_INPUT, EXIT_NO_HARDWARE, cmd_run
from harness.tracking.redact import install, redact

__all__ = ["EXIT_BAD_INPUT", "EXIT_NO_HARDWARE", "build_parser", "entry", "main"]

DESCRIPTION = ("Tune Triton kernels on the GPUs of a Ray cluster, record every trial in "
               "MLflow and freeze the winners into per-hardware config packs.")
_RST_LITERAL = re.compile(r"``([^`]+)``")


class _Parser(argparse.ArgumentParser):
    """Help and usage as plain text: the docstrings that subcommands take their
    descriptions from are reStructuredText, whose ``literals`` show here without the
    backticks. Subparsers are built with the same class."""

    def format_help(self) -> str:
        return _RST_LITERAL.sub(r"\1", super().format_help())

    def format_usage(self) -> str:
        return _RST_LITERAL.sub(r"\1", super().format_usage())


def _cmd_report(args: argparse.Namespace, console: Console) -> int:
    from harness.tracking.report import ReportError, write_report

    try:
        out = write_report(args.source, args.out, runs_dir=args.runs_dir,
                           tracking_uri=args.tracking_uri)
    except ReportError as exc:
        console.print(f"[bold red]error:[/] {escape(redact(str(exc)))}")
        return EXIT_BAD_INPUT
    console.print(f"report: {out}", markup=False)
    return 0


def _cmd_bench(args: argparse.Namespace, console: Console) -> int:
    from harness.kernel import api as kernel_api
    from harness.measure.bench import TUNING_EXPERIMENT, CostSettings, ResumeError, run_bench

    for name in args.kernel or []:
        try:
            kernel_api.resolve(name)
        except (KeyError, ImportError, AttributeError) as exc:  # unknown, or a broken plug-in
            console.print(f"[bold red]error:[/] --kernel {escape(name)}: {escape(str(exc))}")
            return EXIT_BAD_INPUT
    command = "kharness bench " + " ".join(sys.argv[2:]) if len(sys.argv) > 2 else "kharness bench"
    if args.regret or args.sibling:
        return _cmd_regret(args, console, command)
    cost = CostSettings(Path(args.tuning_experiment or TUNING_EXPERIMENT), quick=args.quick,
                        enabled=not args.no_cost)
    try:
        report = run_bench(args.out, args.kernel or None, command,
                           cases_file=args.cases, budget_s=args.budget_s,
                           log=lambda m: console.print(m, markup=False), cost=cost,
                           rounds=args.rounds, resume=args.resume)
    except ResumeError as exc:
        console.print(f"[bold red]error:[/] --resume: {escape(str(exc))}")
        return EXIT_BAD_INPUT
    wall = (report["continued_by"][-1] if args.resume and report.get("continued_by")
            else report)["wall_s"]
    console.print(f"bench: {len(report['cases'])} cases ({wall:.0f} s) -> "
                  f"{args.out}/{report['environment']['hardware']}/bench.md")
    return 1 if report.get("errors") else 0


def _cmd_regret(args: argparse.Namespace, console: Console, command: str) -> int:
    from harness.measure.regret import run_regret

    report = run_regret(args.out, args.kernel or None, command,
                        cases_file=args.cases, siblings=args.sibling,
                        budget_s=args.budget_s, rounds=args.rounds,
                        log=lambda m: console.print(m, markup=False))
    console.print(f"bench --regret: {len(report['cases'])} cases in {report['wall_s']:.0f} s "
                  f"-> {args.out}/{report['environment']['hardware']}/regret.md")
    return 1 if report.get("errors") else 0


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kharness", description=DESCRIPTION)
    p.add_argument("--log-level", default="WARNING",
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="tune experiments and freeze their packs",
                       description="Tune the experiments of the files given and freeze their "
                       "packs. Several files (or a folder: every *.yaml in it) run as one "
                       "campaign: one Ray and one set of GPU workers for all their studies, "
                       "each experiment keeping its own packs, MLflow experiment, "
                       "runs/<name>/ and summary.",
                       epilog="A run that keeps its workers (fleet.keep_workers_s on a "
                       "`ray start` cluster) also leaves a kept driver: the next run from "
                       "the same directory and environment runs in it, already imported "
                       "and joined to Ray (docs/fleet.md). KHARNESS_NO_KEPT_DRIVER=1 runs "
                       "the command in its own process.")
    r.add_argument("experiments", nargs="+", metavar="EXPERIMENT",
                   help="experiment YAML file, or a folder of them")
    again = r.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true",
                       help="continue each experiment's studies and MLflow runs where they "
                       "stopped")
    again.add_argument("--fresh", action="store_true",
                       help="start over where an experiment has an earlier run: its studies "
                       "in runs/<name>/ are replaced (its MLflow runs stay)")
    r.add_argument("--quiet", action="store_true", help="no progress or table; pack paths only")
    r.add_argument("--json", action="store_true", help="machine-readable summary on stdout")
    r.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a field of every file, e.g. --set search.trials=50 "
                        "(repeatable; values are YAML)")
    r.set_defaults(func=cmd_run)
    b = sub.add_parser("bench", help="every zoo kernel vs its baselines on this GPU")
    b.add_argument("--out", default="benchmarks/results", help="results root")
    b.add_argument("--kernel", action="append", help="only these kernels (repeatable)")
    b.add_argument("--cases", help="cases YAML (default: the bench cases each built-in "
                   "kernel family declares)")
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
    b.add_argument("--resume", action="store_true",
                   help="continue the bench.json in --out (same GPU, torch, Triton, CUDA): "
                   "keep its cases and cost sections, measure only those it lacks (skipped "
                   "by a budget, failed, or added since)")
    b.add_argument("--regret", action="store_true",
                   help="instead: time each case's own pack entry, its family siblings' "
                   "(H100's on an H200) and the default config in the same rounds; writes "
                   "regret.{json,md} (sibling ms / own ms)")
    b.add_argument("--sibling", action="append", metavar="KEY",
                   help="with --regret: the sibling packs to time (repeatable; default: "
                   "this GPU's family)")
    b.set_defaults(func=_cmd_bench)
    rp = sub.add_parser("report", help="a self-contained HTML report of an experiment")
    rp.add_argument("source", help="experiment name, its runs directory (runs/<name>), its "
                    "experiment YAML, or the MLflow parent run id")
    rp.add_argument("--out", default="report.html", help="HTML file to write")
    rp.add_argument("--runs-dir", default="runs", help="where experiments keep their state")
    rp.add_argument("--tracking-uri", help="MLflow tracking URI (default: the experiment's)")
    rp.set_defaults(func=_cmd_report)
    from harness.cli.packs import add_parser as add_packs_parser
    add_packs_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on bad arguments already
        return int(exc.code or 0)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    install()  # every log record, whoever emits it, has its secrets masked
    console = Console(stderr=True)
    if not console.is_terminal:
        console = Console(stderr=True, width=200)  # logs: keep lines whole
    return args.func(args, console)


def _cwd_importable() -> None:
    """The working directory first on ``sys.path``, as ``python -m harness`` has it: an
    experiment's ``kernel: mymod:Cls`` imports ``mymod.py`` from where the command runs,
    from the console script as from ``python -m`` (whose script directory is the venv's
    ``bin/`` instead). Ray's workers get the same directory first on their path."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


def _main_redacted() -> int:
    """``main``, with an error it did not expect reported as Python would, a traceback
    and exit code 1, but redacted: a library's error (MLflow's, SQLAlchemy's) may hold a
    URI with its password."""
    try:
        return main()
    except Exception:
        sys.stderr.write(redact(traceback.format_exc()))
        return 1


def here() -> int:
    """The command of ``sys.argv`` in this process: its exit status."""
    _cwd_importable()
    return _main_redacted()


def entry() -> None:
    """The ``kharness`` command: handed to a kept driver where one serves it
    (``harness.cli.kept_driver``), else ``main`` here; then a fast exit. After a run, the
    interpreter's own teardown (freeing torch, Ray's and gRPC's native state) took ~2 s
    of the command's wall on its own; everything the harness writes is written and
    flushed by then, and a Ray this process started is stopped first (its exit hook
    would be skipped too)."""
    import harness

    rc = kept_driver.forward(sys.argv[1:], harness.IMPORTED_AT)
    if rc is None:
        rc = here()
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
