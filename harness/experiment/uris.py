"""Whether a tracking URI names a store MLflow can open: the form only (no import of
MLflow, no connection), so that the experiment's schema refuses it with the file's other
mistakes. The answers never hold the URI, which may hold a password."""

from __future__ import annotations

from urllib.parse import urlsplit

#: The stores MLflow's own registry knows (``mlflow.tracking._tracking_service.utils``);
#: a plugin adds its scheme through the ``mlflow.tracking_store`` entry points.
_STORES = ("", "file", "databricks", "databricks-uc", "uc", "http", "https")
DATABASES = {"postgresql": 5432, "mysql": 3306, "mssql": 1433, "sqlite": None}


def scheme_of(uri: str) -> str:
    """The URI's scheme, lower case; '' for a path (a Windows drive letter included)."""
    scheme = urlsplit(uri).scheme.lower()
    return "" if len(scheme) == 1 else scheme


def _plugin_schemes() -> set[str]:
    from importlib.metadata import entry_points

    return {ep.name for ep in entry_points(group="mlflow.tracking_store")}


def uri_problem(uri: str) -> str | None:
    """Why MLflow cannot use ``uri`` as a tracking store, else None. Cheap (no import,
    no connection), so that the file's form check refuses it; the answer never holds
    the URI, which may hold a password."""
    # Python's own messages quote the parts they fail on, a password's among them.
    try:
        parts = urlsplit(uri)
    except ValueError:
        return "not a valid URI (an unclosed '[' of an IPv6 host?)"
    rest = uri.split("://", 1)[1] if "://" in uri else ""
    if parts.netloc and "@" not in parts.netloc and "@" in rest[len(parts.netloc):]:
        # ``http://user:pa/ss@host``: the host part ends at the first '/', '?' or '#', so
        # the server would be 'user' and the password would stay in the URI.
        return ("an '@' after the host: a password holding '/', '?' or '#' must have them "
                "percent-encoded (%2F, %3F, %23); better, leave the password out of the "
                "URI and set MLFLOW_TRACKING_PASSWORD")
    try:
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        return "not a valid URI: its port is not a number from 0 to 65535"
    scheme = scheme_of(uri)
    if scheme in _STORES or scheme.split("+", 1)[0] in DATABASES:
        return None
    if scheme in _plugin_schemes():
        return None
    known = ", ".join(s for s in (*DATABASES, *_STORES) if s)
    return (f"the scheme {scheme!r} is not a tracking store MLflow knows ({known}, or a "
            "path)")
