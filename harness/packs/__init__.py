"""Config packs: the format (``format``) and the runtime lookup (``lookup``).

Applications import only this package (and the kernels): no Ray, Optuna or MLflow.
"""

from harness.packs.format import PackError, freeze, pack_path, read, write
from harness.packs.lookup import (
    Hit,
    PackWarning,
    configure,
    load,
    lookup,
    lookup_entry,
    search_path,
    stats,
)

__all__ = [
    "Hit", "PackError", "PackWarning", "configure", "freeze", "load", "lookup",
    "lookup_entry", "pack_path", "read", "search_path", "stats", "write",
]
