"""SQLite connections that commit in WAL mode with ``synchronous=NORMAL``.

The Optuna storage and the MLflow logger commit once or more per trial; with SQLite's
defaults (rollback journal, ``synchronous=FULL``) each commit waits for fsync. In WAL mode
with ``synchronous=NORMAL`` a killed process still loses no committed transaction (only a
power loss could lose the last ones).
"""

from __future__ import annotations

import sqlite3
from typing import Any


def fast_commits(dbapi_conn: Any, _record: Any) -> None:
    """A SQLAlchemy ``connect`` listener: sets the two pragmas on SQLite connections and
    leaves any other database's alone."""
    if isinstance(dbapi_conn, sqlite3.Connection):
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.close()
