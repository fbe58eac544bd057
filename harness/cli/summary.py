"""The run's summary on the terminal: one table row per study, then the run's totals (a
campaign: each experiment's table, then the totals of the fleet they shared).

It fits 100 columns: a config shows as its difference from the kernel family's default
config (the whole config is in ``--json`` and in the study's MLflow run), the speed-ups
share one column, and paths and URIs are printed whole on lines of their own.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

#: The width the summary is laid out for, and the console's width where stdout is not a
#: terminal (logs, pipes, CI).
WIDTH = 100


def fmt(v: Any, spec: str = ".3g", suffix: str = "") -> str:
    """``v`` formatted, or "-" where the run has no value."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return f"{v:{spec}}{suffix}"


def default_config(kernel: str) -> Mapping[str, Any]:
    """The kernel family's default config; empty where the family cannot be loaded."""
    from harness.kernel import api as kernel_api

    try:
        return kernel_api.get(kernel).default_config
    except Exception:  # a user kernel that no longer imports: show whole configs
        return {}


def config_diff(config: Mapping[str, Any], default: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of ``config`` that differ from ``default`` (or are not in it)."""
    return {k: v for k, v in config.items() if k not in default or default[k] != v}


def config_text(row: Mapping[str, Any]) -> str:
    """The study's winner as its change from the family's default config."""
    config = row.get("config") or row.get("params")
    if not config:
        return "none (no config was measured)"
    diff = config_diff(config, default_config(row["kernel"]))
    return " ".join(f"{k}={v}" for k, v in diff.items()) if diff else "the default config"


def summary_table(rows: list[dict[str, Any]], interpreted: bool) -> Table:
    """One line per study: what was tuned, the winner's latency, its speed-ups over
    eager PyTorch, torch.compile and the default config, its share of the roofline
    bound and the trial counts. Configs are listed below the table, by row number."""
    title = "Tuning summary" + (" (CPU interpreter: timings are not GPU timings)"
                                if interpreted else "")
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
              padding=(0, 1, 0, 0))
    t.add_column("#", justify="right")
    t.add_column("kernel dtype, shape", overflow="fold")
    t.add_column("hw", overflow="fold")
    t.add_column("latency", justify="right")
    for k in ("eager", "compile", "default"):  # the headers wrap before the values do
        t.add_column(f"vs {k}", justify="right", min_width=6, max_width=len(k))
    t.add_column("roof", justify="right")
    t.add_column("trials", justify="right", overflow="fold")
    for i, r in enumerate(rows, 1):
        c = r.get("counts", {})
        t.add_row(
            str(i), f"{r['kernel']} {r['dtype']}\n{r['shape']}", r["hardware"],
            fmt(r.get("latency_ms"), ".4g", " ms"),
            *(fmt(r.get(f"speedup_vs_{k}"), ".2f", "×") for k in ("eager", "compile", "default")),
            fmt((r.get("roofline") or math.nan) * 100, ".0f", "%"),
            f"{c.get('measured', 0)}/{c.get('failed', 0)}/{c.get('pruned', 0)}",
        )
    return t


def print_configs(out: Console, rows: list[dict[str, Any]]) -> None:
    """Each row's winning config, as its change from the default config."""
    out.print("roof: share of the roofline bound; trials: measured/failed/pruned. "
              "Configs, as their change from the kernel's default (whole: --json, MLflow):",
              style="dim")
    for i, r in enumerate(rows, 1):
        # Wrapped between parameters, under the row's number.
        text = textwrap.fill(config_text(r), width=out.width, initial_indent=f"{i:>2} ",
                             subsequent_indent="   ", break_long_words=False)
        out.print(text, markup=False, highlight=False, soft_wrap=True)


def winner_line(rows: list[dict[str, Any]], interpreted: bool = False) -> str:
    """How far into its search each winner was found (``winner_found``), in one line: the
    study's own numbers where there is one, else the median share of each search's GPU
    time and the latest find; "" where no winner was found by a search."""
    found = [r["winner_found"] for r in rows if r.get("winner_found")]
    if not found:
        return ""
    time = "device time" if interpreted else "GPU time"
    if len(found) == 1:
        f = found[0]
        return (f"winner found at trial {f['trial']} of {f['trials']} "
                f"({f['fraction']:.0%} of the search's {time})")
    fractions = sorted(f["fraction"] for f in found)
    mid = len(fractions) // 2
    median = (fractions[mid] if len(fractions) % 2
              else (fractions[mid - 1] + fractions[mid]) / 2)
    last = max(found, key=lambda f: f["fraction"])
    return (f"winners found at a median {median:.0%} of each search's {time} (latest: "
            f"trial {last['trial']} of {last['trials']}, {last['fraction']:.0%})")


def timeline_line(timeline: Mapping[str, float]) -> str:
    """Where the wall time went, in one line: the start (command to the first trial,
    with when Ray was up and the workers ready), the search (first trial to the last
    result) and the end (last result to exit); "" without a first trial."""
    first, last, done = (timeline.get(k) for k in ("first_trial", "last_result", "done"))
    if first is None or last is None:
        return ""
    parts = [f"ray {timeline['ray_connected']:.1f} s"] if "ray_connected" in timeline else []
    if "workers_ready" in timeline:
        parts.append(f"workers {timeline['workers_ready']:.1f} s")
    inner = f" ({', '.join(parts)})" if parts else ""
    end = f", end {done - last:.1f} s" if done is not None else ""
    return f"time: start {first:.1f} s{inner}, search {last - first:.1f} s{end}"


def print_summary(out: Console, summary: Any, quiet: bool) -> None:
    """The table, the packs written and the run's totals (``--quiet``: the packs only)."""
    _experiment(out, summary, quiet)
    if quiet:
        return
    _fleet(out, summary)
    _mlflow(out, summary)


def print_campaign(out: Console, campaign: Any, quiet: bool) -> None:
    """A campaign's summary: each experiment's table, packs and MLflow run, then the
    fleet's totals, which they shared, and the campaign's line (``--quiet``: the packs
    only)."""
    for entry in campaign.experiments:
        if not quiet:
            out.print(f"experiment {entry.name}: {entry.config}", style="bold", markup=False,
                      highlight=False, soft_wrap=True)
        if entry.skipped:
            out.print(f"not run: none of its hardware ({', '.join(entry.summary.missing_hardware)})"
                      " was available", markup=False, highlight=False)
            continue
        _experiment(out, entry.summary, quiet)
        if not quiet:
            for event in entry.summary.events:
                out.print(event, markup=False)
            _mlflow(out, entry.summary)
    if quiet:
        return
    fleet = campaign.fleet
    out.print("the campaign's fleet:", style="bold")
    _fleet(out, fleet)
    skipped = sum(e.skipped for e in campaign.experiments)
    packs = sum(len(e.summary.packs) for e in campaign.experiments)
    out.print(f"campaign: {len(campaign.experiments)} experiments"
              + (f" ({skipped} not run)" if skipped else "")
              + f", {campaign.studies} studies, {packs} packs, one fleet, "
              f"wall {fleet.wall_s:.1f} s", markup=False, highlight=False)


def _experiment(out: Console, summary: Any, quiet: bool) -> None:
    """An experiment's table, its configs and the packs it wrote."""
    if not quiet:
        out.print(summary_table(summary.rows, summary.interpreted))
        print_configs(out, summary.rows)
    for p in summary.packs:
        out.print(f"pack: {p}", markup=False, highlight=False, soft_wrap=True)
    if quiet:
        return
    line = winner_line(summary.rows, summary.interpreted)
    if line:
        out.print(line, markup=False, highlight=False)


def _fleet(out: Console, summary: Any) -> None:
    """The fleet's totals: wall and GPU-held time, where it went, the fleet's events."""
    out.print(f"wall {summary.wall_s:.1f} s; GPUs held {summary.held_s:.1f} s, of which "
              f"{summary.timing_s:.1f} s timing kernels "
              f"({fmt(summary.timing_fraction * 100, '.0f', '%')}); "
              f"{summary.replaced} workers replaced, {summary.retried} trials retried"
              + (f", {summary.reused} kept workers reused" if summary.reused else "")
              + (", a spare MLflow logger taken"
                 if summary.mlflow_logger.get("spare") else "")
              + (f", run by a kept driver (pid {summary.kept_driver['pid']})"
                 if summary.kept_driver else ""))
    line = timeline_line(summary.timeline)
    if line:
        out.print(line, markup=False, highlight=False)
    if summary.overhead:
        parts = ", ".join(f"{k} {v:.1f} s" for k, v in summary.overhead.items() if v >= 0.05)
        out.print(f"GPU-held time by phase: {parts}")
    fc = summary.first_calls
    if fc.get("watched"):
        here = fc.get("compiled_here", 0)
        out.print(f"first launches: {fc['watched'] - fc['compiled_in_worker'] - here} of "
                  f"{fc['watched']} loaded a compiled binary, {fc['compiled_in_worker']} "
                  f"compiled in the worker ({fc['ahead_missed']} despite compile-ahead)"
                  + (f", {here} compiled there while the compile service started"
                     if here else ""))
        why = fc.get("in_worker_why") or {}
        if why:
            top, n = max(why.items(), key=lambda kv: kv[1])
            out.print(f"  most often because: {top} ({n})", markup=False, highlight=False)
    for node, svc in summary.fleet.get("compile_services", {}).items():
        line = _pool_line(svc)
        if line:
            out.print(f"compile service {node[:8]}: {line}", markup=False, highlight=False)
    head = summary.head_start
    if head.get("submitted"):
        out.print(f"head start: {head['compiled']} of {head['submitted']} builds done; "
                  f"{_pool_line(head)}",
                  markup=False, highlight=False)
    first = head.get("first_trials") or {}
    if first.get("measured"):
        out.print(f"head start: {first['measured']} first trials measured before the workers "
                  f"were ready (the first at {first['first_result_s']} s), {first['used']} "
                  "taken by the search", markup=False, highlight=False)
    for event in summary.events:
        out.print(f"fleet: {event}", markup=False)


def _pool_line(pool: dict[str, Any]) -> str:
    """A compile pool's start: when its processes were ready and its first compile done
    (seconds from its start); empty where it has no figures."""
    if pool.get("first_ready_s") is None:
        return ""
    line = (f"{pool.get('processes', pool.get('ready'))} processes, first ready "
            f"{pool['first_ready_s']:.1f} s, all {fmt(pool.get('all_ready_s'), '.1f', ' s')}")
    if pool.get("first_compile_done_s") is not None:
        line += f", first compile done {pool['first_compile_done_s']:.1f} s"
    return line + " after it started"


def _mlflow(out: Console, summary: Any) -> None:
    """Where the experiment's MLflow runs are, and how to see them."""
    out.print(f"MLflow: {summary.tracking_uri} (parent run {summary.parent_run_id})",
              markup=False, soft_wrap=True)
    out.print(f"  see it with: mlflow ui --backend-store-uri {summary.tracking_uri}",
              markup=False, highlight=False, soft_wrap=True)
