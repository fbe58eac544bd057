"""``kharness run``: validate the experiment files, refuse to overwrite an earlier run
unless told how (``--resume`` or ``--fresh``), run them (several: one campaign on one
fleet, ``harness.run.campaign``), print the summary."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from harness.cli import json_stdout, kept_driver
from harness.cli.summary import WIDTH, print_campaign, print_summary
from harness.tracking.redact import redact

EXIT_BAD_INPUT = 2
EXIT_NO_HARDWARE = 3
EXIT_NOT_TUNED = 4


#: The signal that stopped the run (a library may raise a KeyboardInterrupt of its own
#: in place of the one the handler raised).
_STOPPED_BY: dict[str, int] = {}


def _raise_stopped(signum: int, frame: Any) -> None:
    """SIGTERM (``timeout``, a scheduler, ``ray job stop``) raised in the main thread as
    Ctrl-C is, so that the same clean-up runs."""
    _STOPPED_BY.setdefault("signum", signum)
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _stop_on_signals() -> None:
    """SIGTERM stops the run as Ctrl-C does (Python's default ends it at once, without
    stopping its workers or storing what was measured)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_stopped)


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
    from harness.experiment import ExperimentError, expand, is_campaign, load, load_all

    campaign = is_campaign(args.experiments)
    try:
        # The files' form here (milliseconds); the checks that import the kernel family
        # (seconds: torch) run while Ray starts (``run``), which a failing one stops:
        # a bad file still leaves nothing behind, and a good one does not wait for them.
        if campaign:
            items = load_all(expand(args.experiments), args.set or (), surroundings=False)
        else:
            path = args.experiments[0]
            items = [(path, load(path, args.set or (), semantics=False))]
    except ExperimentError as exc:
        console.print(f"[bold red]error:[/] {escape(redact(str(exc)))}")
        return EXIT_BAD_INPUT
    earlier = [(exp.name, before) for _, exp in items
               if (before := earlier_run(exp.output.runs_dir, exp.name)) is not None]
    if earlier and not (args.resume or args.fresh):
        for name, before in earlier:
            console.print("[bold red]error:[/] " + escape(
                f"experiment {name!r} has an earlier run in {before}/. Pass --resume to "
                "continue it, or --fresh to start over (replacing its studies)."),
                highlight=False)
        return EXIT_BAD_INPUT
    if args.fresh:
        for _, before in earlier:
            console.print(replaced_by_fresh(before), markup=False, highlight=False)
    env = dict(os.environ)  # as the command got it: what a kept driver for it is keyed on
    if args.json:
        json_stdout.keep_apart()
    _ray_auth_mode()
    _stop_on_signals()
    import harness
    from harness.fleet import NoHardwareError, RayStartError
    from harness.tracking.tracker import TrackingError

    kwargs = {"resume": args.resume, "console": console,
              "progress": not (args.quiet or args.json), "overrides": args.set or (),
              "started_at": harness.IMPORTED_AT, "stop_own_ray": True}
    from harness.run.campaign import CampaignSummary
    from harness.run.results import Summary

    summary = Summary(t0=harness.IMPORTED_AT)  # filled as it goes: read even if stopped
    result = CampaignSummary()  # a campaign's, likewise
    summary.kept_driver = result.fleet.kept_driver = dict(kept_driver.SERVED)
    _keep_driver(max(exp.fleet.keep_workers_s for _, exp in items), env)
    try:
        if campaign:
            from harness.run.campaign import run_campaign

            result = run_campaign(args.experiments, result=result, **kwargs)
        else:
            from harness.run.runner import run

            summary = run(args.experiments[0], summary=summary, **kwargs)
    except ExperimentError as exc:
        console.print(f"[bold red]error:[/] {escape(redact(str(exc)))}")
        return EXIT_BAD_INPUT
    except NoHardwareError as exc:
        console.print(f"[bold red]error:[/] {escape(redact(str(exc)))}", markup=True)
        return EXIT_NO_HARDWARE
    except (RayStartError, TrackingError) as exc:
        console.print(f"[bold red]error:[/] {escape(redact(str(exc)))}")
        return 1
    except KeyboardInterrupt:
        signum = _STOPPED_BY.get("signum", signal.SIGINT)
        stopped = signal.Signals(signum).name
        files = " ".join(args.experiments)
        console.print(f"[bold yellow]stopped ({stopped})[/]: the trials "
                      "measured so far are kept in each experiment's Optuna storage; "
                      f"`kharness run {escape(files)} --resume` goes on from them",
                      highlight=False)
        if args.json and campaign:  # how far it got, for whoever stopped it
            for s in [result.fleet, *(e.summary for e in result.experiments)]:
                s.wall_s = time.monotonic() - s.t0
            _redact_campaign(result)
            json_stdout.emit({**campaign_json(result), "stopped": stopped})
        elif args.json:
            summary.wall_s = time.monotonic() - summary.t0
            _print_json(summary, stopped=stopped)
        return 128 + signum
    if campaign:
        return _campaign_done(args, result, console)
    if args.json:
        _print_json(summary)
        return _not_tuned(summary.rows, console)
    _redact(summary)
    print_summary(_stdout(), summary, quiet=args.quiet)
    return _not_tuned(summary.rows, console)


def _keep_driver(keep_s: float, env: dict[str, str]) -> None:
    """A run that keeps its workers leaves a kept driver for the next command from here
    (``harness.cli.kept_driver``), unless one waits already. Started with the run, so
    that it is ready when the run ends; where the run has no cluster that outlives it,
    it finds so and ends. A run a kept driver serves leaves none: that driver's reserve
    takes the socket, and a standby started here could take its lock first (the reserve
    would end, and the next command wait for this one's imports)."""
    if keep_s and kept_driver.enabled(env) and not kept_driver.SERVED:
        from harness.cli import kept_server

        kept_server.ensure(keep_s, env)


def _campaign_done(args: argparse.Namespace, result: Any, console: Console) -> int:
    """A campaign's summary (each experiment's, then the fleet's) and its exit code: no
    hardware where an experiment was skipped for lack of it, else not tuned where a
    study froze nothing."""
    _redact_campaign(result)
    if args.json:
        json_stdout.emit(campaign_json(result))
    else:
        print_campaign(_stdout(), result, quiet=args.quiet)
    for entry in result.experiments:
        if entry.skipped:
            console.print(f"[bold red]not run:[/] experiment {entry.name}: none of its "
                          f"hardware ({', '.join(entry.summary.missing_hardware)}) was "
                          "available", highlight=False)
    rc = _not_tuned([r for e in result.experiments for r in e.summary.rows], console)
    return EXIT_NO_HARDWARE if any(e.skipped for e in result.experiments) else rc


def _print_json(summary: Any, **extra: Any) -> None:
    """The run's ``--json`` object on stdout, redacted (``extra``: more of its keys)."""
    _redact(summary)
    json_stdout.emit({**summary_json(summary), **extra})


def _redact_campaign(result: Any) -> None:
    """Each experiment's summary and the fleet's, redacted."""
    for entry in result.experiments:
        _redact(entry.summary)
    _redact(result.fleet)


def _redact(summary: Any) -> None:
    summary.tracking_uri = redact(summary.tracking_uri)
    summary.events = [redact(e) for e in summary.events]


def _stdout() -> Console:
    out = Console()
    if not out.is_terminal:
        out = Console(width=WIDTH)  # logs and pipes: the width the summary is laid out for
    return out


def summary_json(summary: Any) -> dict[str, Any]:
    """A run's ``--json`` object."""
    return {
        "rows": summary.rows, "packs": summary.packs,
        "missing_hardware": summary.missing_hardware,
        "interpreted": summary.interpreted, "mlflow_parent_run_id": summary.parent_run_id,
        "tracking_uri": summary.tracking_uri, "wall_s": summary.wall_s,
        "gpu_held_s": summary.held_s, "kernel_timing_s": summary.timing_s,
        "timing_fraction": summary.timing_fraction, "overhead_s": summary.overhead,
        "timeline_s": summary.timeline, "worker_startup_s": summary.worker_startup,
        "worker_nice": summary.worker_nice,
        "mlflow_logger": summary.mlflow_logger,
        "first_calls": summary.first_calls, "head_start": summary.head_start,
        "compile_services": summary.fleet.get("compile_services", {}),
        "workers": summary.fleet.get("workers", []), "driver_s": summary.fleet.get("driver_s", {}),
        "workers_replaced": summary.replaced, "workers_reused": summary.reused,
        "kept_driver": summary.kept_driver, "trials_retried": summary.retried,
        "events": summary.events,
        "resumed": summary.resumed,
    }


#: The keys of ``summary_json`` that are the fleet's: a campaign's, once for all.
FLEET_KEYS = ("interpreted", "wall_s", "gpu_held_s", "kernel_timing_s", "timing_fraction",
              "overhead_s", "timeline_s", "worker_startup_s", "worker_nice", "first_calls",
              "head_start", "compile_services", "workers", "driver_s", "workers_replaced",
              "workers_reused", "kept_driver", "trials_retried", "events")


def campaign_json(result: Any) -> dict[str, Any]:
    """A campaign's ``--json`` object: each experiment's summary, then the fleet's
    figures and the campaign's timeline."""
    experiments = []
    for e in result.experiments:
        s = e.summary
        experiments.append({
            "name": e.name, "config": e.config, "skipped": e.skipped, "rows": s.rows,
            "packs": s.packs, "missing_hardware": s.missing_hardware,
            "interpreted": s.interpreted, "mlflow_parent_run_id": s.parent_run_id,
            "tracking_uri": s.tracking_uri, "timeline_s": s.timeline,
            "studies_s": s.fleet.get("studies", {}), "mlflow_logger": s.mlflow_logger,
            "events": s.events, "resumed": s.resumed})
    fleet = summary_json(result.fleet)
    return {"experiments": experiments, "studies": result.studies,
            "packs": [p for e in experiments for p in e["packs"]],
            **{k: fleet[k] for k in FLEET_KEYS}}


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
