"""Credentials in a tracking URI are never stored or printed: they move into MLflow's
own environment variables as the experiment file is read (the end-to-end run against a
tracking server: tests/test_tracking_server.py)."""

from __future__ import annotations

import pytest
import yaml

from harness import experiment
from harness.tracking.redact import PASSWORD_ENV, USERNAME_ENV, move_credentials

PASSWORD = "s3cr%40t-never-stored"  # percent-encoded '@' in the URI


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for var in (USERNAME_ENV, PASSWORD_ENV, "MLFLOW_TRACKING_URI",
                "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"):
        monkeypatch.delenv(var, raising=False)


def test_an_http_uri_loses_its_credentials_to_the_environment():
    import os

    uri = move_credentials(f"https://alice:{PASSWORD}@mlflow.example.com:5000/path?x=1")
    assert uri == "https://mlflow.example.com:5000/path?x=1"
    assert os.environ[USERNAME_ENV] == "alice"
    assert os.environ[PASSWORD_ENV] == "s3cr@t-never-stored"


@pytest.mark.parametrize("uri", ["sqlite:///mlflow.db", "http://127.0.0.1:5000", None, "",
                                 "file:///tmp/mlruns", "http://[::1:bad"])
def test_other_uris_are_left_as_they_are(uri):
    import os

    assert move_credentials(uri) == uri
    assert USERNAME_ENV not in os.environ and PASSWORD_ENV not in os.environ


def test_the_experiment_never_holds_the_password(tmp_path):
    import os

    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump({
        "name": "cred", "kernel": "grouped_gemm", "dtypes": ["fp16"],
        "shapes": [{"M": 320, "N": 128, "K": 128, "E": 4}],
        "tracking": {"uri": f"http://user:{PASSWORD}@127.0.0.1:5099"}}))
    exp = experiment.load(path, semantics=False)
    assert exp.tracking.uri == "http://127.0.0.1:5099"
    assert PASSWORD not in exp.model_dump_json()
    assert os.environ[PASSWORD_ENV] == "s3cr@t-never-stored"


def test_the_tracker_takes_them_from_the_environment_too(mlflow_db, monkeypatch):
    """``MLFLOW_TRACKING_URI`` with credentials: the Tracker's URI (which the run's
    state records) has none, and MLflow's "View run ... at" links are silenced."""
    import os

    from harness.tracking.tracker import tracking_uri

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://bob:{PASSWORD}@127.0.0.1:5099")
    assert tracking_uri(None) == "http://127.0.0.1:5099"
    assert os.environ[USERNAME_ENV] == "bob"
    from harness.tracking.tracker import Tracker

    Tracker(f"sqlite:///{mlflow_db}", "quiet")
    assert os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] == "true"
