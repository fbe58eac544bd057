"""Writing the shapes that missed the packs as experiment files, to tune them later
(``HARNESS_PACKS_MISSES``: at the process's exit)."""

from __future__ import annotations

import atexit
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any

from harness.kernel import api as kernel_api
from harness.packs import format as fmt
from harness.packs.lookup import PackWarning, misses


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-.") or "kernel"


def write_misses(path: str | Path, include_nearest: bool = True) -> list[Path]:
    """Write the recorded misses as experiment YAML (README "Experiment files"), one
    experiment per kernel: ``path`` itself when one kernel missed, else
    ``<stem>_<kernel><suffix>`` per kernel next to it. Returns the files written (none if
    nothing missed). Near-misses are included unless ``include_nearest`` is False.

    Kernels that no Kernel family describes (``harness.autotune`` with an ad-hoc name)
    cannot be tuned by ``kharness run`` and are left out with a warning.
    """
    import datetime as dt

    import yaml

    path = Path(path)
    groups: dict[str, list[dict[str, Any]]] = {}
    for rec in misses():
        if rec["source"] == "nearest" and not include_nearest:
            continue
        groups.setdefault(rec["kernel"], []).append(rec)
    plans = []
    for label, recs in sorted(groups.items()):
        try:
            fam = kernel_api.get(label)
        except (KeyError, ImportError, AttributeError, TypeError):
            warnings.warn(f"misses of {label!r} not written: it is not a registered kernel "
                          "family or import path", PackWarning, stacklevel=2)
            continue
        recs.sort(key=lambda r: (r["hardware"], r["dtype"], [r["shape"][d] for d in fam.dims]))
        shapes: list[dict[str, int]] = []
        for r in recs:
            if r["shape"] not in shapes:
                shapes.append(r["shape"])
        dtypes = sorted({r["dtype"] for r in recs if r["dtype"] in fam.dtypes})
        if not dtypes:
            continue
        hw = sorted({r["hardware"] for r in recs})
        now = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        head = [f"# Shapes that missed the {fam.name} packs, recorded by harness.packs "
                f"({now}).", "# Tune them with: kharness run <this file>", "#"]
        head += [f"#   {r['hardware']} {r['dtype']} {r['shape_key']}: {r['source']}"
                 f"{' (' + r['why'] + ')' if r['why'] else ''}, {r['calls']} calls"
                 for r in recs]
        doc = {"name": _safe(f"misses-{fam.name}"), "kernel": label, "shapes": shapes,
               "dtypes": dtypes, "hardware": hw, "output": {"packs_dir": "packs"}}
        plans.append((fam.name, "\n".join(head) + "\n"
                      + yaml.safe_dump(doc, sort_keys=False, default_flow_style=None)))
    if len(plans) == 1:
        targets = [path]
    else:
        targets = [path.with_name(f"{path.stem}_{_safe(n)}{path.suffix or '.yaml'}")
                   for n, _ in plans]
    for target, (_, text) in zip(targets, plans, strict=True):
        fmt.write_text(target, text)
    return targets


def _write_misses_at_exit() -> None:
    path = os.environ.get("HARNESS_PACKS_MISSES")
    if not path or not misses():
        return
    try:
        write_misses(path)
    except Exception as exc:  # never turn a clean exit into a traceback
        print(f"harness.packs: could not write misses to {path}: {exc}", file=sys.stderr)


atexit.register(_write_misses_at_exit)
