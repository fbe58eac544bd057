"""What a run needs from its surroundings, checked before Ray starts: its folders can be
written, and its tracking store is one MLflow knows, with its database driver installed
and its server answering.

Each check takes milliseconds (a server that does not answer: ``PROBE_TIMEOUT_S`` at
most); a file that fails one exits 2 naming the file and the field, with nothing
written and no Ray started. Without them, each was found after Ray had started (a
tracking server that is down: MLflow retried for minutes), or at the run's end (a packs
folder that cannot be written: after the whole search).
"""

from __future__ import annotations

import os
import socket
import threading
import urllib.request
from pathlib import Path
from urllib.parse import unquote, urlsplit

from harness.experiment.schema import Experiment, ExperimentError
from harness.experiment.uris import DATABASES, scheme_of, uri_problem

#: How long a tracking or database server may take to accept a connection.
PROBE_TIMEOUT_S = 5.0

_HTTP_PORTS = {"http": 80, "https": 443}


def _unwritable(folder: Path) -> str | None:
    """Why ``folder`` cannot be written or created, else None. Nothing is created."""
    probe = folder
    while not os.path.lexists(probe) and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        return (f"{probe} is not a folder" if probe == folder
                else f"cannot be created: {probe} is not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable" + ("" if probe == folder else ", so it cannot be created")
    return None


def _probe(host: str, port: int, timeout_s: float) -> str | None:
    """None when ``host:port`` accepts a TCP connection within ``timeout_s``, else why
    not. On a thread, so that a name lookup (which takes no time-out) is bounded too."""
    out: list[str | None] = []

    def connect() -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout_s):
                out.append(None)
        except OSError as exc:
            out.append(exc.strerror or str(exc) or type(exc).__name__)

    thread = threading.Thread(target=connect, name="harness-preflight", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return out[0] if out else f"no answer within {timeout_s:g} s"


def _http_target(scheme: str, host: str, port: int) -> tuple[str, int, str]:
    """Where MLflow's HTTP client connects for ``host:port``: the proxy the environment
    names for it (``https_proxy``, ``no_proxy``, as requests reads them), or the server."""
    proxy = urllib.request.getproxies().get(scheme)
    if proxy and not urllib.request.proxy_bypass(host):
        p = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        if p.hostname:
            return p.hostname, p.port or 80, f" through the proxy {p.hostname}:{p.port or 80}"
    return host, port, ""


def _database(uri: str) -> tuple[str | None, int | None, str | None]:
    """A database URI's host and port, and why its driver cannot be loaded (else None)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        url = make_url(uri)
        dialect = url.get_dialect()
    except (ArgumentError, NoSuchModuleError, ValueError) as exc:
        return None, None, f"SQLAlchemy cannot read it ({type(exc).__name__})"
    try:
        dialect.import_dbapi()
    except ImportError as exc:
        module = exc.name or str(exc)
        return None, None, (f"its database driver {module!r} is not installed "
                            f"(SQLAlchemy's {url.drivername} dialect needs it)")
    return url.host, url.port, None


def _sqlite_file(uri: str) -> Path | None:
    """The file of a ``sqlite:///`` URI (relative to the working directory, or
    ``sqlite:////absolute``); None for an in-memory database."""
    rest = uri.split("://", 1)[1] if "://" in uri else ""
    name = unquote(rest.split("?", 1)[0])[1:]  # the third '/' ends the (empty) host
    return None if name in ("", ":memory:") else Path(name)


def _tracking_store(uri: str) -> str | None:
    """Why the tracking store at ``uri`` cannot be opened now, else None."""
    scheme = scheme_of(uri)
    base = scheme.split("+", 1)[0]
    if base == "sqlite":
        db = _sqlite_file(uri)
        if db is not None:
            if db.exists():
                if not db.is_file():
                    return f"{db} is not a file"
                if not os.access(db, os.R_OK | os.W_OK):
                    return f"{db} is not writable"
            why = _unwritable(db.parent)  # SQLite writes its journal beside the file
            if why:
                return f"its folder {db.parent}: {why}"
        return None
    if scheme in ("", "file"):
        folder = Path(unquote(urlsplit(uri).path) if scheme else uri)
        why = _unwritable(folder)
        return f"{folder}: {why}" if why else None
    if base in DATABASES:
        host, port, why = _database(uri)
        if why or not host:  # no host: a local socket, whatever the driver makes of it
            return why
        port = port or DATABASES[base]
        why = _probe(host, port, PROBE_TIMEOUT_S)
        return f"the database server {host}:{port} does not answer ({why})" if why else None
    if scheme in _HTTP_PORTS:
        parts = urlsplit(uri)
        host = parts.hostname or ""
        port = parts.port or _HTTP_PORTS[scheme]
        target, target_port, via = _http_target(scheme, host, port)
        why = _probe(target, target_port, PROBE_TIMEOUT_S)
        return (f"no tracking server answers at {host}:{port}{via} ({why}): start it, or "
                "fix the URI" if why else None)
    return None  # databricks, a plugin's store: their own clients say what is wrong


def preflight(path: str | Path, exp: Experiment) -> None:
    """The run's folders can be written and its tracking store opened; else
    ExperimentError naming the field. Run before anything is written or started."""
    from harness.tracking.redact import redact
    from harness.tracking.tracker import DEFAULT_URI, tracking_uri

    for field, folder in (("output.runs_dir", exp.output.runs_dir),
                          ("output.packs_dir", exp.output.packs_dir)):
        why = _unwritable(Path(folder))
        if why:
            raise ExperimentError(path, field, f"{folder!r}: {why}")
    field = "tracking.uri"
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if not exp.tracking.uri and env:
        field = "tracking.uri (unset: $MLFLOW_TRACKING_URI)"
        why = uri_problem(env)  # the file's own URI had this check with its form
        if why:
            raise ExperimentError(path, field, why)
    uri = tracking_uri(exp.tracking.uri) or DEFAULT_URI
    why = _tracking_store(uri)
    if why:
        raise ExperimentError(path, field, redact(f"{redact(uri)}: {why}"))
