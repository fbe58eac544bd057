"""``kharness run``: validate the experiment file, refuse to overwrite an earlier run
unless told how (``--resume`` or ``--fresh``), run it, print the summary."""

from __future__ import annotations

import argparse
import contextlib
import os
import sqlite3
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from harness.cli.summary import WIDTH, print_summary
from harness.tracking import jsonsafe
from harness.tracking.redact import redact

EXIT_BAD_INPUT = 2
EXIT_NO_HARDWARE = 3
EXIT_NOT_TUNED = 4


def earlier_run(runs_dir: str | Path, name: str) -> Path | None:
    """The experiment's runs directory where an earlier run measured something (or its
    storage cannot be read to tell), else None. A run that failed before its first trial
    (its tracking server went away as it started, its workers never came) left empty
    studies and a state that nothing can resume: they do not block the next run, which
    replaces them."""
    path = Path(runs_dir) / name
    db = path / "optuna.db"
    if not db.is_file():
        return None
    return None if _trial_count(db) == 0 else path


def _trial_count(db: Path) -> int | None:
    """The trials in an Optuna SQLite storage (read-only; None where it cannot be read)."""
    try:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
            return int(conn.execute("SELECT COUNT(*) FROM trials").fetchone()[0])
    except (sqlite3.Error, TypeError):
        return None


def replaced_by_fresh(run_dir: Path) -> str:
    """What ``--fresh`` replaces in ``run_dir``, in words."""
    n = _trial_count(run_dir / "optuna.db")
    trials = f"{n} trials" if n is not None else "its trials"
    return (f"--fresh: starting over; the earlier run's studies in {run_dir}/optuna.db "
            f"({trials}) and its state are replaced. Its MLflow runs stay; the packs it "
            f"changes are copied to {run_dir}/previous_packs/ first.")


def cmd_run(args: argparse.Namespace, console: Console) -> int:
    from harness.experiment import ExperimentError, load

    try:
        # The file's form here (milliseconds); the checks that import the kernel family
        # (seconds: torch) run while Ray starts (``run``), which a failing one stops:
        # a bad file still leaves nothing behind, and a good one does not wait for them.
        exp = load(args.experiment, args.set or (), semantics=False)
    except ExperimentError as exc:
        console.print(f"[bold red]error:[/] {escape(redact(str(exc)))}")
        return EXIT_BAD_INPUT
    before = earlier_run(exp.output.runs_dir, exp.name)
    if before is not None and not (args.resume or args.fresh):
        console.print("[bold red]error:[/] " + escape(
            f"experiment {exp.name!r} has an earlier run in {before}/. Pass --resume to "
            "continue it, or --fresh to start over (replacing its studies)."),
            highlight=False)
        return EXIT_BAD_INPUT
    if before is not None and args.fresh:
        console.print(replaced_by_fresh(before), markup=False, highlight=False)
    _ray_auth_mode()
    import harness
    from harness.fleet import NoHardwareError, RayStartError
    from harness.run.runner import run
    from harness.tracking.tracker import TrackingError

    try:
        summary = run(args.experiment, resume=args.resume, console=console,
                      progress=not (args.quiet or args.json), overrides=args.set or (),
                      started_at=harness.IMPORTED_AT, stop_own_ray=True)
    except ExperimentError as exc:
        console.print(f"[bold red]error:[/] {escape(redact(str(exc)))}")
        return EXIT_BAD_INPUT
    except NoHardwareError as exc:
        console.print(f"[bold red]error:[/] {escape(redact(str(exc)))}", markup=True)
        return EXIT_NO_HARDWARE
    except (RayStartError, TrackingError) as exc:
        console.print(f"[bold red]error:[/] {escape(redact(str(exc)))}")
        return 1
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
            "worker_nice": summary.worker_nice,
            "mlflow_logger": summary.mlflow_logger,
            "first_calls": summary.first_calls,
            "workers_replaced": summary.replaced, "workers_reused": summary.reused,
            "trials_retried": summary.retried,
            "events": summary.events,
            "resumed": summary.resumed,
        }, default=str, indent=1))
        return _not_tuned(summary.rows, console)
    out = Console()
    if not out.is_terminal:
        out = Console(width=WIDTH)  # logs and pipes: the width the summary is laid out for
    print_summary(out, summary, quiet=args.quiet)
    return _not_tuned(summary.rows, console)


def _not_tuned(rows: list[dict], console: Console) -> int:
    """Each study that froze nothing, with why (on stderr); EXIT_NOT_TUNED if any."""
    missed = [r for r in rows if r.get("not_tuned")]
    for r in missed:
        console.print(f"[bold red]not tuned:[/] {r['kernel']} {r['shape']} {r['dtype']} "
                      f"on {r['hardware']}: {r['not_tuned']}", markup=True, highlight=False)
    return EXIT_NOT_TUNED if missed else 0


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
