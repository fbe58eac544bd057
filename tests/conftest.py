"""Test set-up: Triton's interpreter where no GPU is present, the ``gpu`` marker, and
empty MLflow stores for tests that need one."""

import atexit
import contextlib
import os
import shutil
import sqlite3
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# A GPU per test process: `HARNESS_TEST_GPUS=0,1,2,3 pytest -m gpu -n 4 --dist loadfile`
# gives xdist's worker gwN the N-th of those GPUs (and the runs it starts), so that the GPU
# tests of a 4-GPU machine run four files at once. Set before torch opens the device.
_gpus = [g for g in os.environ.get("HARNESS_TEST_GPUS", "").split(",") if g.strip()]
if _gpus and os.environ.get("PYTEST_XDIST_WORKER", "").startswith("gw"):
    _n = int(os.environ["PYTEST_XDIST_WORKER"][2:])
    os.environ["CUDA_VISIBLE_DEVICES"] = _gpus[_n % len(_gpus)].strip()

try:
    import torch

    HAS_GPU = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    HAS_GPU = False

if not HAS_GPU:
    # Must be set before any @triton.jit runs, so it lives here, not in a fixture.
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if HAS_GPU else "cpu"

# A Ray temp dir per test process (and the runs it starts), set here rather than inherited
# (pytest -n's workers get the controller's environment): a run without RAY_ADDRESS joins
# the Ray whose address the last `ray start` left in it, and a simulated cluster of one
# test process must not be joined by another's runs. Short: Ray's sockets live under it.
_worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix=f"kh-{_worker}-", dir="/tmp")
atexit.register(shutil.rmtree, os.environ["RAY_TMPDIR"], True)

# A run that keeps its workers leaves a kept driver process for the next command: the
# tests that are about it turn this back off, with a socket folder of their own.
os.environ["KHARNESS_NO_KEPT_DRIVER"] = "1"


# The costliest files first, from their measured wall times on two cores (`--junitxml`,
# 2026-11-27). `-n 2 --dist loadfile` hands whole files to the two processes in collection
# order (pyproject.toml turns off xdist's reordering by test count, which put these
# single-test files last): a long file handed out last would run alone at the end.
COSTLIEST_FIRST = [
    "test_fleet_cluster", "test_minigpt_block", "test_fleet_jobs", "test_grouped_gemm",
    "test_fleet_nodes", "test_fleet_scaling", "test_remeasure", "test_trial_logger",
    "test_grouped_gemm_gluon", "test_fleet_resume", "test_bench", "test_report",
    "test_tracking_server", "test_pipeline", "test_lost_wakeups", "test_compile_timeout",
    "test_bookkeeping_faults", "test_search_valid", "test_packs_s3",
]


def _cost_rank(item: pytest.Item) -> int:
    name = item.path.stem
    return COSTLIEST_FIRST.index(name) if name in COSTLIEST_FIRST else len(COSTLIEST_FIRST)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_cost_rank)  # stable: each file's tests keep their order
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a GPU; run on the device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device() -> str:
    return DEVICE


def copy_sqlite(src: Path, dest: Path) -> Path:
    """``src`` copied to ``dest`` through SQLite's backup API: whole, whatever its journal
    mode, even while a connection holds it open."""
    with contextlib.closing(sqlite3.connect(src)) as a, \
            contextlib.closing(sqlite3.connect(dest)) as b:
        a.backup(b)
    return dest


@pytest.fixture
def sqlite_copy() -> Callable[[Path, Path], Path]:
    """``copy_sqlite`` for tests."""
    return copy_sqlite


@pytest.fixture(scope="session")
def empty_mlflow_db(tmp_path_factory) -> Callable[[Path], Path]:
    """``copy(dest)``: an empty MLflow SQLite store at ``dest``. A new store runs every
    MLflow migration (seconds of CPU), so the schema is built once per test run and
    copied (through SQLite's backup API: whole, whatever its journal mode)."""
    from mlflow.tracking import MlflowClient

    template = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    MlflowClient(f"sqlite:///{template}").search_experiments()

    return lambda dest: copy_sqlite(template, dest)


@pytest.fixture
def mlflow_db(empty_mlflow_db, tmp_path) -> Path:
    """An empty MLflow store of this test's own: ``tmp_path / "mlflow.db"``."""
    return empty_mlflow_db(tmp_path / "mlflow.db")


@pytest.fixture(scope="module")
def faulty_ray(tmp_path_factory) -> Iterator[Path]:
    """A local Ray of the module's own that its runs join (as runs join a `ray start`
    cluster: no Ray started or stopped per run), its workers seeing the tests package
    and the module's Faulty-kernel events directory, which is returned (emptied by
    ``faulty_events`` for each test)."""
    import logging

    import ray

    from harness.fleet.cluster import start_local_ray

    events = tmp_path_factory.mktemp("events")
    root = str(Path(__file__).resolve().parent.parent)
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    if ray.is_initialized():  # an earlier module's, which this process no longer uses
        ray.shutdown()
    start_local_ray(logging_level=logging.WARNING, log_to_driver=False,
                    runtime_env={"env_vars": {"PYTHONPATH": path, "FAULT_DIR": str(events)}})
    try:
        yield events
    finally:
        ray.shutdown()


@pytest.fixture
def faulty_events(faulty_ray: Path) -> Path:
    (faulty_ray / "events.jsonl").unlink(missing_ok=True)
    return faulty_ray


_MLFLOW_ENV = ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")


@pytest.fixture(autouse=True)
def _mlflow_environment_restored() -> Iterator[None]:
    """MLflow's variables as they were before each test: ``mlflow.set_tracking_uri`` writes
    the URI into the environment, and a URI's credentials move there as it is read, so
    a test's tracking store would otherwise become the next test's default."""
    before = {k: os.environ.get(k) for k in _MLFLOW_ENV}
    yield
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
