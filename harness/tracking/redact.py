"""Secrets never reach the terminal or the logs.

``redact(text)`` replaces the values of the secret environment variables, the Ray auth
token (``~/.ray/auth_token``) and the password of any ``scheme://user:password@host`` URI
with ``***``. ``install()`` puts a filter doing that on every handler of the root logger,
so that every log record, whoever emits it, is redacted. ``move_credentials`` takes the
credentials out of a tracking URI before anything stores it.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

MASK = "***"

#: Environment variables whose values are secrets.
SECRET_ENV = (
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_ACCESS_KEY_ID",
    "MLFLOW_TRACKING_TOKEN",
    "MLFLOW_TRACKING_PASSWORD",
    "RAY_AUTH_TOKEN",
    "HF_TOKEN",
    "GITHUB_TOKEN",
    "DATABASE_PASSWORD",
    "PGPASSWORD",
)
# Shorter values would mask ordinary words ("1", "true").
_MIN_SECRET_LEN = 6
# The password runs to the last '@' of the URI, not its first '/': a password holding an
# unencoded '/', '?', '#' or '@' is still a password (``http://u:ab/cd@host``). Quotes
# and brackets end a URI written inside a repr or JSON. A URI with an '@' in its path
# loses that path too; masking more is the safe side.
_URI_PASSWORD = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^:/@\s]*):"
                           r"(?P<pw>[^\s'\"<>()\[\]{}]+)@")
# AWS access key ids have a fixed shape; secret keys are caught by value above.
_AWS_KEY_ID = re.compile(r"\b(?:AKIA|ASIA)[A-Z0-9]{16}\b")


def _ray_token() -> str | None:
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def secrets() -> list[str]:
    """The secret values known now, longest first (a secret inside another masks whole)."""
    values = {os.environ.get(name, "") for name in SECRET_ENV}
    token = _ray_token()
    if token:
        values.add(token)
    return sorted((v for v in values if len(v) >= _MIN_SECRET_LEN), key=len, reverse=True)


def redact(text: str) -> str:
    """``text`` with every known secret and URI password replaced by ``***``."""
    if not text:
        return text
    for value in secrets():
        text = text.replace(value, MASK)
    text = _URI_PASSWORD.sub(lambda m: f"{m['scheme']}{m['user']}:{MASK}@", text)
    return _AWS_KEY_ID.sub(MASK, text)


#: Where MLflow's HTTP client takes basic-auth credentials from.
USERNAME_ENV, PASSWORD_ENV = "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"


def move_credentials(uri: str | None) -> str | None:
    """``uri`` without the ``user:password@`` of an HTTP(S) tracking server: they move
    into ``MLFLOW_TRACKING_USERNAME`` / ``MLFLOW_TRACKING_PASSWORD``, from which MLflow
    sends them (in this process and in those it starts), so that no URI the harness
    stores, logs or passes to Ray holds them. Other URIs are returned as they are (a
    database URI's password is masked wherever it is shown: ``redact``)."""
    if not uri or "@" not in uri:
        return uri
    try:
        parts = urlsplit(uri)
        user, password = parts.username, parts.password
    except ValueError:  # not a URI (a bad port): left to MLflow to refuse, masked
        return uri
    if parts.scheme.lower() not in ("http", "https") or (user is None and password is None):
        return uri
    if user:
        os.environ[USERNAME_ENV] = unquote(user)
    if password is not None:
        os.environ[PASSWORD_ENV] = unquote(password)
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


class RedactFilter(logging.Filter):
    """Redacts the formatted message of every record (args folded in first)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a bad format string: leave the record to logging's own error
            return True
        clean = redact(message)
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        if clean != message or record.args:
            record.msg, record.args = clean, None
        return True


def install(logger: logging.Logger | None = None) -> RedactFilter:
    """Attach the filter to ``logger``'s handlers (default: root) and the logger itself.

    Handler filters see records propagated from child loggers too; logger filters only
    see the logger's own records, so both are set."""
    logger = logger or logging.getLogger()
    flt = RedactFilter()
    logger.addFilter(flt)
    for handler in logger.handlers:
        handler.addFilter(flt)
    return flt
