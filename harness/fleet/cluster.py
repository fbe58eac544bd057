"""The cluster: connecting to Ray, finding GPUs by hardware key, asking an autoscaler for
more, and checking that a worker sees the GPU its node advertises.

Hardware keys come from Ray's ``accelerator_type:<name>`` node resources: Ray sets them
itself for NVIDIA GPUs (``H100``, ``H200``, ``A100-80G``, ...); GPUs Ray does not
recognise, such as the AMD Radeon PRO V710, need the resource declared at ``ray start
--resources='{"accelerator_type:V710": 1}'``.

A Ray that a run starts for itself listens on loopback only (``start_local_ray``):
joining or starting a cluster (``ray start``, ``RAY_ADDRESS``) is how it is opened. It
ends with the run, however the run ends (``watch_session``).
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import ray

from harness.measure import hardware

log = logging.getLogger(__name__)


class NoHardwareError(RuntimeError):
    pass


class RayStartError(RuntimeError):
    """The run's own Ray did not come up (twice), or the one to join refused it."""


def check_placement(expected: str, ray_name: str | None, info: Mapping[str, Any]) -> None:
    """Raise where a worker placed as ``expected`` sees another GPU (a node whose
    ``accelerator_type`` resource is wrong). Interpreted workers see no GPU: no check."""
    if info.get("interpreted") or info.get("device_key") == expected:
        return
    resource = f"accelerator_type:{ray_name or expected}"
    raise NoHardwareError(
        f"a worker placed on a node advertising {resource} (hardware {expected}) sees a "
        f"{info.get('device_name')!r}, which is {info.get('device_key')}: fix that node's "
        f"resources at `ray start` (a V710 node: --resources='{{\"accelerator_type:V710\": 1}}')")



def normal_priority() -> int:
    """Give every thread of this process the default CPU priority (nice 0) where the OS
    allows it; the niceness it runs at. Ray starts its workers at nice 15
    (``worker_niceness``), and a timing thread at nice 15 waits behind every other
    process on the node: measured on a 2-core machine beside two busy processes, a
    100 ms sleep timed at 121 to 350 ms in a worker at nice 15, 107 to 110 ms at nice 0.
    Compile children stay below it (their services add 10 to Ray's 15): they are what
    should yield."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no procfs: the calling thread only
        tids = [0]
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, 0)
        except OSError:  # not permitted (no CAP_SYS_NICE), or the thread has ended
            continue
    try:
        return os.getpriority(os.PRIO_PROCESS, 0)
    except OSError:
        return 0


def _join_local(address: str, kw: dict[str, Any]) -> None:
    """Join the Ray this machine's last `ray start` left, with its token: Ray sends the
    token it finds on disk only where its own search found the address (a bare
    ``ray.init()``), not for an address given, which a token-auth head refuses (measured:
    20 s of retries, then ConnectionError)."""
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )

        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    except (ImportError, AttributeError):  # a Ray without token auth, or moved
        pass
    try:
        ray.init(address=address, **kw)
    except ConnectionError as exc:
        raise RayStartError(
            f"could not join the Ray at {address} that this machine's last `ray start` "
            f"left ({exc}); `ray stop` ends it, or set RAY_ADDRESS (and its token, "
            "RAY_AUTH_TOKEN) to the cluster to use") from None


def _answers(address: str, timeout_s: float = 2.0) -> bool:
    """Whether a server accepts connections at ``address`` ("host:port")."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


#: Ray starts a pool of idle task workers with its first driver, one per CPU (1.5 CPU-s
#: each). A run's work is actors, which start processes of their own with the run's
#: environment: on a 2-core machine the pool was 3 of a local Ray's 13.6 CPU-s to start.
NO_PRESTART = {"enable_worker_prestart": False, "prestart_worker_first_driver": False}


def start_local_ray(**kw: Any) -> None:
    """Start a Ray for this process only, every server of it (GCS, raylet, workers,
    object manager, dashboard agent) bound to 127.0.0.1. Ray binds its servers to all
    interfaces unless the node's address is loopback, and it resolves a loopback
    address given to ``ray.init`` to the host's own, except where clusters are turned
    off (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``): the setting, read when Ray is
    imported, is applied for the start and passed to the processes Ray starts.

    The session is watched (``watch_session``): it ends with this process, however this
    process ends; one that a killed run left is ended first."""
    from ray._private import ray_constants

    end_orphaned_sessions()
    system = {**NO_PRESTART, **kw.pop("_system_config", {})}
    env = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
    before_env, before = os.environ.get(env), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[env] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        for attempt in (1, 2):
            try:
                ray.init(address="local", include_dashboard=False, _system_config=system,
                         **kw)
                watch_session()
                return
            except Exception as exc:  # Ray raises a bare Exception on its start timeout
                # Ray waits a fixed 30 s for its raylet to register. On a loaded machine
                # (measured: a 2-core box running two test processes) that wait ran out
                # once; a second start came up.
                ray.shutdown()
                if "timed out during startup" not in str(exc):
                    raise
                if attempt == 2:
                    raise RayStartError(
                        f"Ray did not start on this machine, twice ({exc}). Its logs are "
                        f"under {os.environ.get('RAY_TMPDIR', '/tmp/ray')}/session_latest/"
                        "logs; an overloaded machine or a full /tmp are the usual causes."
                    ) from exc
                log.warning("Ray did not start in time (%s): starting it again", exc)
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before
        if before_env is None:
            os.environ.pop(env, None)
        else:
            os.environ[env] = before_env


# -- a run's own Ray ends with it -------------------------------------------------------
# Ray ties its GCS and raylet to the driver (the kernel kills them when it dies), but not
# the raylet's agents: after a `kill -9` of the driver, ray::DashboardAgent and
# ray::RuntimeEnvAgent were re-parented to pid 1, each stuck for a minute reporting the
# raylet's death to the dead GCS (SIGTERM waits behind that call), 127.0.0.1:52365 still
# open. No signal reaches them through the kernel either: PR_SET_PDEATHSIG is set by a
# process on itself, and the raylet, their parent, does not set it for them. So a
# watchdog process (plain Python, no Ray: milliseconds to start) ends the session's
# processes once the driver or the raylet is gone; a record of the session, per user,
# lets the next run end what a watchdog killed with its driver left.
#
# The functions down to ``_watch`` run in the watchdog too (``_watchdog_program``): the
# standard library only, and no name of this module besides each other.

#: How often the watchdog looks at the driver and the raylet.
WATCH_POLL_S = 0.5
#: How long a session's process has after SIGTERM before SIGKILL.
END_GRACE_S = 1.0


def _proc_start(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks since boot), which tells it from a
    later process given the same pid; None where there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _proc_alive(pid: int, start: int | None) -> bool:
    """Whether the process that had ``pid`` and ``start`` still runs (not a zombie)."""
    if _proc_start(pid) != start or start is None:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def _session_members(record: dict) -> list[list[int]]:
    """The live processes of the recorded Ray session, as [pid, start]: those recorded
    as it started (GCS, raylet, monitors, agents), and the processes the raylet started
    after it whose parent is no longer the raylet (agents, workers: their command lines
    read ``ray::...``, their environment names the raylet's pid). A process another
    raylet runs, one that took the pid since, has that raylet for its parent. This
    user's processes only."""
    raylet_pid, raylet_start = record["raylet"]
    recorded = {tuple(p) for p in record["pids"]}
    marker = f"RAY_RAYLET_PID={raylet_pid}".encode()
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        pid = int(name)
        try:
            if os.stat(f"/proc/{pid}").st_uid != os.getuid():
                continue
            start = _proc_start(pid)
            if start is None:
                continue
            if (pid, start) in recorded:
                out.append([pid, start])
                continue
            if start < raylet_start:
                continue  # older than the session: not one of its processes
            with open(f"/proc/{pid}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            if ppid == raylet_pid:
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    out.append([pid, start])
        except (OSError, ValueError, IndexError):
            continue  # it ended meanwhile, or is not ours to read
    return out


def _end_session(record: dict, grace_s: float = END_GRACE_S) -> int:
    """End the recorded session's live processes: SIGTERM, then SIGKILL for those still
    there after ``grace_s``; again for those a raylet ended meanwhile left orphaned
    (they count as its members only once it is gone). How many there were."""
    ended: set[tuple[int, int]] = set()
    for _ in range(3):
        members = [p for p in _session_members(record) if tuple(p) not in ended]
        if not members:
            break
        ended.update(tuple(p) for p in members)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            left = [p for p in members if _proc_alive(*p)]
            for pid, start in left:
                if _proc_start(pid) == start:  # not a new process given the pid since
                    try:
                        os.kill(pid, sig)
                    except OSError:
                        pass
            deadline = time.monotonic() + grace_s
            while left and time.monotonic() < deadline:
                time.sleep(0.05)
                left = [p for p in left if _proc_alive(*p)]
            if not left:
                break
    return len(ended)


def _watch(record_path: str) -> None:
    """The watchdog: wait while the driver and the raylet run, then end what is left of
    the session (all of it after a `kill -9` of the driver; stragglers after the
    driver's ``ray.shutdown``) and drop its record."""
    with open(record_path) as f:
        record = json.load(f)
    while _proc_alive(*record["owner"]) and _proc_alive(*record["raylet"]):
        time.sleep(WATCH_POLL_S)
    _end_session(record)
    try:
        os.unlink(record_path)
    except OSError:
        pass


def _watchdog_program() -> str:
    """The watchdog's source: the functions above and a call of ``_watch``."""
    parts = ["from __future__ import annotations",
             "import json, os, signal, sys, time",
             f"WATCH_POLL_S = {WATCH_POLL_S!r}", f"END_GRACE_S = {END_GRACE_S!r}"]
    parts += [inspect.getsource(fn) for fn in (_proc_start, _proc_alive, _session_members,
                                               _end_session, _watch)]
    parts.append("_watch(sys.argv[1])")
    return "\n".join(parts)


def sessions_dir() -> Path | None:
    """This user's records of the Ray sessions runs started (created 0700); None where
    there is no /proc, or the folder is not this user's own."""
    if not os.path.isdir("/proc/self"):
        return None
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    top = Path(base) / f"kernel-harness-{os.getuid()}"
    try:
        top.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(top)
        if st.st_uid != os.getuid() or not os.path.isdir(top) or os.path.islink(top):
            return None  # another user's, or a link: a shared /tmp is not trusted
        folder = top / "ray-sessions"
        folder.mkdir(mode=0o700, exist_ok=True)
        return folder
    except OSError:
        return None


def _write_record(path: Path, record: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def watch_session() -> Path | None:
    """Record the Ray session this process just started and start its watchdog; the
    record's path (None where it cannot be watched: no /proc, Ray's layout changed)."""
    folder = sessions_dir()
    if folder is None:
        return None
    try:
        node = ray._private.worker._global_node
        session_dir = node.get_session_dir_path()
        pids = [info.process.pid for infos in node.all_processes.values() for info in infos]
        raylet = node.all_processes["raylet"][0].process.pid
    except (AttributeError, KeyError, IndexError, TypeError) as exc:
        log.warning("the run's own Ray cannot be watched (%s): a killed run may leave its "
                    "processes behind", exc)
        return None
    children = []
    for name in os.listdir("/proc"):  # the raylet's agents, started before ray.init returned
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                if int(f.read().rsplit(b")", 1)[1].split()[1]) == raylet:
                    children.append(int(name))
        except (OSError, ValueError, IndexError):
            continue
    record = {"owner": [os.getpid(), _proc_start(os.getpid())],
              "raylet": [raylet, _proc_start(raylet)], "session_dir": session_dir,
              "pids": [[p, _proc_start(p)] for p in {*pids, *children}]}
    path = folder / f"{Path(session_dir).name}.json"
    _write_record(path, record)
    try:
        dog = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _watchdog_program(), str(path)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            cwd="/", start_new_session=True)  # no terminal's signals: it outlives the driver
    except OSError as exc:
        log.warning("the run's own Ray has no watchdog (%s): a killed run may leave its "
                    "processes behind, for the next run to end", exc)
        return path
    _write_record(path, {**record, "watchdog": [dog.pid, _proc_start(dog.pid)]})
    return path


def end_orphaned_sessions() -> int:
    """End the Ray sessions whose run was killed and whose watchdog is gone too (killed
    with it): their agents hold ports and memory. How many processes were ended."""
    folder = sessions_dir()
    ended = 0
    for path in sorted(folder.glob("*.json")) if folder else []:
        try:
            record = json.loads(path.read_text())
            if _proc_alive(*record["owner"]) or (
                    "watchdog" in record and _proc_alive(*record["watchdog"])):
                continue  # its run goes on, or its watchdog is at it
            n = _end_session(record)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("cannot read the Ray session record %s (%s): removed", path, exc)
            n = 0
        path.unlink(missing_ok=True)
        if n:
            log.warning("ended %d processes of the Ray session %s, which a killed run "
                        "(process %s) left", n, record.get("session_dir"),
                        record.get("owner", ["?"])[0])
        ended += n
    return ended


def node_resources() -> dict[str, tuple[float, int]]:
    """Node id -> its CPUs and GPUs, for the live nodes."""
    return {n["NodeID"]: (float(n["Resources"].get("CPU", 0)), int(n["Resources"].get("GPU", 0)))
            for n in ray.nodes() if n.get("Alive")}


class Cluster:
    """What the cluster holds, by hardware key (``discover``), and the autoscaler."""

    def __init__(self) -> None:
        self._names: dict[str, dict[str, int]] = {}  # hardware key -> Ray name -> GPUs
        self.nodes: dict[str, str] = {}  # node id -> hardware key (GPU nodes)
        self.unlabelled = 0  # GPUs on nodes with no accelerator_type resource
        self._requested = False  # an autoscaler request is outstanding

    # -- connecting and discovering ---------------------------------------------------
    @staticmethod
    def connect() -> str:
        """Join RAY_ADDRESS / the job's cluster if there is one, or a Ray already running
        on this machine (``ray start --head``: its GCS address is returned), else start a
        Ray for this run only ("local"). The caller's own SIGTERM and SIGINT handlers
        stay: Ray's core worker installs handlers that abort the process (the command's
        stop on SIGTERM then stored nothing and said nothing)."""
        kept = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            return Cluster._connect()
        finally:
            if threading.current_thread() is threading.main_thread():
                for sig, handler in kept.items():
                    if callable(handler):
                        signal.signal(sig, handler)

    @staticmethod
    def running_head() -> str | None:
        """The address of the Ray this machine's last `ray start` left, if it answers:
        what a bare ray.init() joins (not address="auto", which joins any Ray here,
        another driver's own included). None where there is none, or it is dead."""
        try:
            # Ray's reader is private: where it moved, decide as before.
            from ray._private.services import find_bootstrap_address

            running = find_bootstrap_address(None)
        except (ImportError, AttributeError):
            running = None
        if running and not _answers(running):
            # The file outlives a head that was killed (or crashed); joining it, Ray waits
            # on the dead GCS for minutes (measured: still waiting after 150 s).
            log.warning("the Ray this machine's last `ray start` left (%s) does not answer: "
                        "starting a Ray for this run (`ray stop` clears the stale address)",
                        running)
            running = None
        return running or None

    @staticmethod
    def _connect() -> str:
        if ray.is_initialized():
            return "existing"
        if os.environ.get("RAY_ADDRESS"):
            ray.init(logging_level=logging.WARNING)
            return os.environ["RAY_ADDRESS"]
        # Workers must import a user's kernel module from the working directory. Only the
        # cwd and the caller's PYTHONPATH: the driver's whole sys.path would put the base
        # interpreter's site-packages ahead of the venv's (crashing workers).
        path = os.pathsep.join(p for p in [os.getcwd(), os.environ.get("PYTHONPATH", "")] if p)
        kw: dict[str, Any] = {"logging_level": logging.WARNING, "log_to_driver": False,
                              "runtime_env": {"env_vars": {"PYTHONPATH": path}}}
        running = Cluster.running_head()
        if running:
            # Joined rather than a second Ray over the same GPUs; it outlives this run, so
            # it keeps workers and is not stopped.
            _join_local(running, kw)
            return running
        # Ray starts a Python worker per core up front; the harness needs one per GPU, and
        # on a 16-core box those imports slow the start and the compile children.
        os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
        # "local": a new Ray even where a stale address file is left (a bare ray.init()
        # would join the address in it).
        start_local_ray(**kw)
        return "local"

    def discover(self) -> dict[str, int]:
        """GPUs in the cluster per hardware key; ``{"cpu": 1}`` where there are none.

        A node's key comes from its ``accelerator_type:<name>`` resource. GPUs with no
        such resource are counted in ``unlabelled`` and left out: their type is unknown.
        """
        counts: dict[str, int] = {}
        self._names, self.nodes, self.unlabelled = {}, {}, 0
        for node in ray.nodes():
            if not node.get("Alive"):
                continue
            res = node.get("Resources", {})
            gpus = int(res.get("GPU", 0))
            if gpus <= 0:
                continue
            names = [k.split(":", 1)[1] for k in res if k.startswith("accelerator_type:")]
            if not names:
                self.unlabelled += gpus
                continue
            # Two names (Ray's own and a declared one) may name the same GPU: a known key
            # wins, and a name that is the key itself (the declared one) before others.
            name = min(names, key=lambda n: (hardware.hardware_key(n) not in
                                             hardware.KNOWN_KEYS, hardware.hardware_key(n) != n,
                                             n))
            key = hardware.hardware_key(name)
            self.nodes[node["NodeID"]] = key
            by_name = self._names.setdefault(key, {})
            by_name[name] = by_name.get(name, 0) + gpus
            counts[key] = counts.get(key, 0) + gpus
        if not counts and not self.unlabelled:
            return {"cpu": 1}
        return counts

    def wait_for_nodes(self, keys: list[str], timeout_s: float, poll_s: float = 2.0,
                       on_poll: Callable[[dict[str, int]], None] | None = None) -> dict[str, int]:
        """Ask the autoscaler for one GPU of each of ``keys`` and wait up to ``timeout_s``
        until each is in the cluster; return the GPUs found then."""
        bundles = [{"GPU": 1, f"accelerator_type:{k}": 1} for k in keys]
        try:
            from ray.autoscaler import sdk

            sdk.request_resources(bundles=bundles)
            self._requested = True
        except Exception as exc:  # no autoscaler API: waiting may still see nodes join
            log.warning("could not ask the autoscaler for %s: %s", keys, exc)
        deadline = time.monotonic() + timeout_s
        while True:
            available = self.discover()
            if on_poll is not None:
                on_poll(available)
            left = deadline - time.monotonic()
            if all(k in available for k in keys) or left <= 0:
                return available
            time.sleep(min(poll_s, left))

    def _release_request(self) -> None:
        if not self._requested:
            return
        self._requested = False
        try:
            from ray.autoscaler import sdk

            sdk.request_resources(bundles=[])  # the nodes may scale down again
        except Exception as exc:
            log.warning("could not withdraw the autoscaler request: %s", exc)

