"""A Ray that a run starts for itself listens on loopback only: its driver, GCS, raylet,
object manager, dashboard agent and workers (joining or starting a cluster is the
explicit way to open it)."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = r"""
import json, os, time
import ray
from harness.fleet.cluster import Cluster
from tests.test_fleet_loopback import listening

assert Cluster.connect() == "local"

@ray.remote(num_cpus=0)
class Probe:
    def pid(self):
        return os.getpid()

probe = Probe.remote()
ray.get(probe.pid.remote())
time.sleep(1)  # the dashboard agent and the runtime-env agent are up by now
print(json.dumps(listening(os.getpid())))
ray.shutdown()
"""


def _tree(root: int) -> set[int]:
    """``root`` and its descendants (from /proc)."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parent[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, todo = {root}, [root]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p and c not in out]
        out.update(kids)
        todo += kids
    return out


def _address(hex_addr: str) -> str:
    """/proc/net/tcp's "0100007F:1F90" as "127.0.0.1:8080" (words in host order)."""
    ip, port = hex_addr.split(":")
    raw = bytes.fromhex(ip)
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    addr = ipaddress.ip_address(raw)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped:
        addr = addr.ipv4_mapped
    return f"{addr}:{int(port, 16)}"


def listening(root: int) -> list[list[str]]:
    """[process name, local address] of every TCP socket listening in ``root``'s process
    tree (/proc/net/tcp{,6}, matched to the processes' file descriptors)."""
    inodes: dict[str, str] = {}
    for pid in _tree(root):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes[target[8:-1]] = name
        except OSError:
            continue
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # LISTEN
                out.append([inodes[f[9]], _address(f[1])])
    return out


def _loopback(address: str) -> bool:
    return ipaddress.ip_address(address.rsplit(":", 1)[0]).is_loopback


def test_a_ray_the_run_starts_listens_on_loopback_only() -> None:
    # A Ray directory of its own: a `ray start` elsewhere on the machine is not joined.
    tmp = tempfile.mkdtemp(prefix="rl", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=tmp, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300, cwd=tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    listening = json.loads(proc.stdout.strip().splitlines()[-1])
    names = {n for n, _ in listening}
    # The servers are there to be checked: Ray's own and the driver's.
    assert {"gcs_server", "raylet"} <= names, listening
    public = [x for x in listening if not _loopback(x[1])]
    assert len(listening) > len(names) >= 2  # more than the two
    assert not public, f"listening beyond loopback: {public}"
