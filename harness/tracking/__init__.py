"""Tracking: the experiment's MLflow runs (``tracker``: the only module that talks to
MLflow), a study's plots (``plots``), the HTML report (``report``, from
``templates/report.html.j2``) and secret redaction (``redact``).

Imports go one way: ``report`` -> ``tracker`` -> ``plots``.
"""
