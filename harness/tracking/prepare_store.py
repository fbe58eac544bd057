"""A new SQLite MLflow store, set up off the run's critical path.

MLflow creates a new SQLite store's tables on first use (its schema migrations: 3.5 s on
an H200 host, 16 cores busy starting Ray and compile processes). A run's MLflow logger
process is ready seconds after Ray is up, and on a first run in a directory the search
then waited for those migrations (its experiment's MLflow run comes first). A run that
starts its own Ray therefore has the store built here, in a process of its own, as soon
as every file passed its checks (while Ray starts): in a file beside the store's, moved
into place only whole (a hard link, which fails where a store appeared meanwhile: that
one is kept). The logger then opens a store that exists.

    python -m harness.tracking.prepare_store sqlite:////abs/path/mlflow.db
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from harness.tracking.tracker import SQLITE_PREFIX as PREFIX


def new_sqlite_store(uri: str) -> Path | None:
    """The file of an SQLite store ``uri`` names where it does not exist yet; None for
    any other store, or one that exists."""
    if not uri.startswith(PREFIX):
        return None
    path = Path(uri[len(PREFIX):]).resolve()
    return None if path.exists() else path


def prepare(path: Path) -> bool:
    """Build an MLflow store at ``path`` if none is there once built: whether this one
    was moved into place. Runs in the process of its own that ``main`` is."""
    from mlflow.tracking import MlflowClient

    from harness.tracking.tracker import _sqlite_fast_commits

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.building")
    side = [tmp.with_name(tmp.name + s) for s in ("-wal", "-shm", "-journal")]
    try:
        _sqlite_fast_commits()  # the journal mode the logger's connections use
        client = MlflowClient(PREFIX + str(tmp))
        client.search_experiments(max_results=1)  # creates the tables
        client._tracking_client.store.engine.dispose()  # last connection: WAL folded in
        if any(p.exists() for p in side):
            return False  # not whole in one file: the logger builds its own
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        return True
    finally:
        for p in (tmp, *side):
            p.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    path = new_sqlite_store(args[0]) if args else None
    if path is None:
        return 0
    return 0 if prepare(path) else 1


if __name__ == "__main__":
    sys.exit(main())
