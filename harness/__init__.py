"""kernel-harness: tune Triton kernels across a GPU fleet, ship frozen config packs.

The runtime side (``harness.packs``) imports no Ray, Optuna or MLflow.
"""

__version__ = "0.1.0"
