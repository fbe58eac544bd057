"""Config packs: the format (``format``), the runtime lookup (``lookup``) and S3
distribution (``s3``, imported on use: it needs boto3).

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
    misses,
    pack_entry,
    reset_stats,
    search_path,
    stats,
    strict,
)
from harness.packs.miss_files import write_misses
from harness.packs.versions import runtime_versions

__all__ = [
    "Hit", "PackError", "PackWarning", "configure", "freeze", "load", "lookup",
    "lookup_entry", "misses", "pack_entry", "pack_path", "read", "reset_stats",
    "runtime_versions", "search_path", "stats", "strict", "write", "write_misses",
]
