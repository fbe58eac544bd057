"""Tracking: MLflow runs (``tracker``, the only module that talks to MLflow), the
HTML report (``report``) and secret redaction (``redact``)."""
