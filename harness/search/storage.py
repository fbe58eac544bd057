"""Where the studies live: one Optuna storage per experiment (``runs/<name>/optuna.db``)."""

from __future__ import annotations

from pathlib import Path

import optuna

from harness.search.sqlite_commits import fast_commits


def storage_url(runs_dir: str | Path, experiment: str) -> str:
    path = Path(runs_dir).resolve() / experiment / "optuna.db"
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


def make_storage(url: str) -> optuna.storages.BaseStorage:
    """The studies' storage. SQLite runs in WAL mode with ``synchronous=NORMAL``: a
    commit no longer waits for fsync (3-4x faster ask/tell, which the driver does for
    every trial), and a killed driver still loses no committed trial (only a power loss
    could lose the last ones)."""
    if not url.startswith("sqlite:"):
        return optuna.storages.RDBStorage(url)
    from sqlalchemy import event

    storage = optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 60}})

    event.listen(storage.engine, "connect", fast_commits)
    storage.engine.dispose()  # connections opened before the listener reconnect with it
    return storage


def drop_studies(url: str, names: list[str]) -> list[str]:
    """Delete the studies of these names that an earlier run left in the storage (a run
    without ``--resume`` starts them afresh); the names it deleted. One storage serves
    them all: each storage opened checks the schema's version (about half a second on
    SQLite), and a SQLite file that does not exist yet holds nothing to delete.

    A SQLite file that holds nothing else is removed whole: Optuna deletes a study row by
    row through its ORM (4.4 s for 8 studies of 180 trials on an H200 host's CPU, the
    warm run's whole wait for its first trial), a new file costs a tenth of a second."""
    path = Path(url.removeprefix("sqlite:///")) if url.startswith("sqlite:///") else None
    if path is not None and not path.exists():
        return []
    storage = make_storage(url)
    try:
        existing = {s.study_name for s in storage.get_all_studies()}
        dropped = [name for name in names if name in existing]
        if path is None or existing - set(names):
            for name in dropped:
                optuna.delete_study(study_name=name, storage=storage)
            return dropped
    finally:
        storage.engine.dispose()
    # Closed (its last connection checkpointed the WAL): the side files first, so that a
    # stop half-way leaves at worst the old file at its last checkpoint, which the next
    # run drops again, never a stale WAL beside a new file.
    for suffix in ("-shm", "-wal", "-journal", ""):
        path.with_name(path.name + suffix).unlink(missing_ok=True)
    return dropped
