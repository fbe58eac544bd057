"""Nobody waits silently for a compile: a config that compiles past its time-out fails with
a time-out outcome and its compile child goes on (or is killed and replaced, if stuck), and
a worker's client gives up on a config its node's compile service does not answer for.

The fast tests drive the service with a stand-in pool (the test decides when a compile
starts and ends) or a stand-in service; the slow ones start real compile children (the
Faulty family's ``compile_only`` sleeps ``COMPILE_MS``; ``HARNESS_FAULTS`` injects a hung
child or a lost outcome), one of them compiling a real Triton kernel for sm_90.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from harness.experiment import FleetSettings
from harness.fleet import compile as fleet_compile
from harness.fleet.compile import COMPILE_TIMEOUT_S, Precompiler, problem_key
from harness.fleet.compile_child import skeleton, timeout_outcome
from harness.fleet.compile_service import NodeCompiler, _Service
from harness.search.keys import config_key
from tests.fault_kernels import Faulty

ROOT = Path(__file__).resolve().parent.parent
FAULTY = "tests.fault_kernels:Faulty"
SHAPE = {"N": 64}
PROBLEM = problem_key(FAULTY, SHAPE, "fp32", 0)


def _cfg(**over: Any) -> dict[str, Any]:
    return {**Faulty.default_config, **over}


def _key(config: dict[str, Any]) -> tuple[str, str]:
    return (PROBLEM, config_key(config))


def _skel() -> Any:
    return skeleton(Faulty().make_inputs(SHAPE, "fp32", 0, "cpu"))


def _until(cond: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


class LocalHandle:
    """A service object in this process, called as Ray calls an actor: ``h.m.remote(*a)``
    runs ``m`` on a thread and gives a Future (``NodeCompiler`` takes it as a reply)."""

    def __init__(self, service: Any) -> None:
        self._service = service
        self._threads = ThreadPoolExecutor(8)

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._service, name)
        return SimpleNamespace(remote=lambda *args: self._threads.submit(method, *args))


class StandInPool:
    """``Precompiler``'s interface; the test starts (``on_start``) and ends compiles."""

    def __init__(self, service: _Service) -> None:
        self.processes, self.timeout_s, self.ratio = 1, service.timeout_s, 0.0
        self.on_start = service._began
        self.stats = {"relative": 0, "killed": 0, "lost": 0}
        self.futures: dict[tuple[str, str], Future] = {}

    def submit(self, problem: str, kernel: str, shape: Any, skel: Any, configs: Any,
               priority: int = fleet_compile.AHEAD) -> None:
        self.priorities = getattr(self, "priorities", [])
        self.priorities += [(config_key(c), priority) for c in configs]
        for c in configs:
            self.futures.setdefault((problem, config_key(c)), Future())

    def pending(self, problem: str, config: Any) -> Future | None:
        return self.futures.get((problem, config_key(config)))

    def stalled_s(self) -> float:
        return 0.0

    def timeline(self) -> dict[str, Any]:
        return {"first_ready_s": 0.0, "half_ready_s": 0.0, "all_ready_s": 0.0, "ready": 1,
                "first_compile_done_s": None}

    def close(self) -> None:
        pass


def _stand_in_service(timeout_s: float) -> tuple[_Service, StandInPool]:
    svc = _Service(0, compile_timeout_s=timeout_s, node="node-a")
    svc.pre = pool = StandInPool(svc)  # type: ignore[assignment]
    return svc, pool


# -- fast: the setting, the outcome, the service's long poll and the client's deadlines ----


def test_the_time_out_setting_and_its_outcome() -> None:
    assert FleetSettings().compile_timeout_s == COMPILE_TIMEOUT_S == 30.0
    assert FleetSettings(compile_timeout_s=5).compile_timeout_s == 5
    for bad in (0, -1):
        with pytest.raises(ValueError):
            FleetSettings(compile_timeout_s=bad)
    out = timeout_outcome(30.0)
    assert out == {"ok": False, "timeout": True,
                   "reason": "compile time-out: still compiling after 30 s (a config that "
                             "spills registers compiles for minutes)"}


def test_the_long_poll_returns_on_news_and_repeats_outcomes_until_acknowledged() -> None:
    """The service answers a client as soon as one of its configs has an outcome, for keys
    it submitted while the poll was outstanding too; each answer says which of its
    configs are compiling, and since when."""
    svc, pool = _stand_in_service(5.0)
    a, b = _cfg(SLEEP_MS=1), _cfg(SLEEP_MS=2)
    with ThreadPoolExecutor(2) as threads:
        t0 = time.monotonic()  # a first poll is answered at once: the node, the time-out
        first = svc.outcomes("c1", 10.0, [])
        assert time.monotonic() - t0 < 1.0 and first["outcomes"] == first["started"] == {}
        assert first["node"] == "node-a" and first["timeout_s"] == 5.0
        poll = threads.submit(svc.outcomes, "c1", 10.0, [])
        time.sleep(0.1)
        assert not poll.done()  # nothing to say yet
        svc.submit(PROBLEM, FAULTY, SHAPE, None, [a, b], "c1")  # submitted while it waits
        pool.on_start(_key(a))
        pool.on_start(_key(b))
        time.sleep(0.1)
        assert not poll.done()  # a start wakes nobody
        t0 = time.monotonic()
        pool.futures[_key(a)].set_result({"ok": True})
        got = poll.result(timeout=5)
        assert time.monotonic() - t0 < 1.0
        assert got["outcomes"] == {_key(a): {"ok": True}}
        assert got["started"].keys() == {_key(b)} and got["started"][_key(b)] >= 0.1
        # Not acknowledged: said again; acknowledged: not any more.
        assert svc.outcomes("c1", 0.0, [])["outcomes"] == {_key(a): {"ok": True}}
        assert svc.outcomes("c1", 0.0, [_key(a)])["outcomes"] == {}
        # Another client asking for a compiled config gets it at once.
        svc.submit(PROBLEM, FAULTY, SHAPE, None, [a], "c2")
        assert svc.outcomes("c2", 10.0, [])["outcomes"] == {_key(a): {"ok": True}}
        assert svc.info()["deduplicated"] == 1


def test_a_queued_trial_s_config_reaches_the_pool_as_urgent() -> None:
    """Through the worker's client and the node's service: configs known to come go to
    the pool as ``AHEAD``; one of them asked for again for a queued trial goes again as
    ``URGENT`` (the pool moves it up), and a torch.compile baseline as ``BACKGROUND``."""
    svc, pool = _stand_in_service(5.0)
    client = NodeCompiler(LocalHandle(svc), 1, grace_s=1.0)
    try:
        known, queued = _cfg(SLEEP_MS=1), _cfg(SLEEP_MS=2)
        client.submit(PROBLEM, FAULTY, SHAPE, None, [known, queued])
        _until(lambda: len(getattr(pool, "priorities", [])) == 2, 5, "the known configs")
        client.submit(PROBLEM, FAULTY, SHAPE, None, [queued], fleet_compile.URGENT)
        _until(lambda: len(pool.priorities) == 3, 5, "the queued trial's config")
        svc.prebuild(FAULTY, SHAPE, "fp32", 0)
        assert [p for _, p in pool.priorities] == [fleet_compile.AHEAD] * 2 + [
            fleet_compile.URGENT, fleet_compile.BACKGROUND]
        assert pool.priorities[2][0] == config_key(queued)
    finally:
        client.close()


def test_a_lost_outcome_resolves_the_client_within_the_grace(monkeypatch, caplog) -> None:
    """``compile_lost``: the service records nothing for a compile that ended; the client
    knows when it started and gives up on it a time-out and a grace later, with a warning
    naming the node. The trial fails as a compile time-out: a compile the service did not
    answer for is never left to the worker's own thread, where nothing bounds it."""
    svc, pool = _stand_in_service(0.5)
    client = NodeCompiler(LocalHandle(svc), 1, grace_s=0.5)
    cfg, other = _cfg(SLEEP_MS=1), _cfg(SLEEP_MS=2)
    monkeypatch.setenv("HARNESS_FAULTS", "compile_lost")
    client.submit(PROBLEM, FAULTY, SHAPE, None, [cfg])
    _until(lambda: _key(cfg) in pool.futures, 5, "the submit")
    monkeypatch.delenv("HARNESS_FAULTS")
    with caplog.at_level(logging.WARNING, logger="harness.fleet.compile_service"):
        t0 = time.monotonic()
        pool.on_start(_key(cfg))
        pool.futures[_key(cfg)].set_result({"ok": True})  # ended; the outcome is lost
        out = client.pending(PROBLEM, cfg).result(timeout=5)
        waited = time.monotonic() - t0
    assert out["ok"] is False and out["timeout"] is True
    assert out["reason"].startswith("compile time-out: the compile service on node node-a "
                                    "did not answer for this config within ")
    assert 0.9 <= waited < 2.0, waited
    assert "node node-a did not answer for 1 config(s)" in caplog.text
    # The client goes on: the next config's outcome arrives.
    client.submit(PROBLEM, FAULTY, SHAPE, None, [other])
    _until(lambda: _key(other) in pool.futures, 5, "the submit")
    pool.on_start(_key(other))
    pool.futures[_key(other)].set_result({"ok": True, "compile_s": 0.1})
    assert client.pending(PROBLEM, other).result(timeout=5)["ok"]
    client.close()


def test_once_warm_the_client_stays_warm() -> None:
    """``warm`` (the worker compiles its first config itself only before it) does not
    turn back when every outcome has been waited on and the configs left are queued."""
    svc, pool = _stand_in_service(5.0)
    client = NodeCompiler(LocalHandle(svc), 1, grace_s=1.0)
    try:
        done, queued = _cfg(SLEEP_MS=1), _cfg(SLEEP_MS=2)
        assert not client.warm()
        client.submit(PROBLEM, FAULTY, SHAPE, None, [done])
        _until(lambda: _key(done) in pool.futures, 5, "the submit")
        pool.on_start(_key(done))
        pool.futures[_key(done)].set_result({"ok": True})
        assert client.wait(PROBLEM, done)["ok"] and client.warm()
        client.submit(PROBLEM, FAULTY, SHAPE, None, [queued])  # never started
        assert client.pending(PROBLEM, done) is None and client.warm()
    finally:
        client.close()


def test_a_time_out_reaches_the_client_as_the_trial_s_failure() -> None:
    svc, pool = _stand_in_service(30.0)
    client = NodeCompiler(LocalHandle(svc), 1)
    cfg = _cfg(SLEEP_MS=3)
    client.submit(PROBLEM, FAULTY, SHAPE, None, [cfg])
    _until(lambda: _key(cfg) in pool.futures, 5, "the submit")
    pool.on_start(_key(cfg))
    pool.futures[_key(cfg)].set_result(timeout_outcome(30.0))
    assert client.wait(PROBLEM, cfg) == timeout_outcome(30.0)
    assert client.pending(PROBLEM, cfg) is None  # collected
    assert svc.info()["timed_out"] == 1
    client.close()


class SilentService:
    """A service that takes configs and answers a poll only while ``answering`` is set."""

    def __init__(self) -> None:
        self.answering = threading.Event()
        self.submits = 0
        self.submit = SimpleNamespace(remote=self._submit)
        self.outcomes = SimpleNamespace(remote=self._outcomes)

    def _submit(self, *args: Any) -> None:
        self.submits += 1

    def _outcomes(self, client_id: str, timeout_s: float, received: Any) -> Future:
        fut: Future = Future()
        if self.answering.is_set():
            fut.set_result({"outcomes": {}, "started": {}, "node": "node-s",
                            "timeout_s": 1.0, "stalled_s": 0.0})
        return fut


def test_a_service_that_does_not_answer_is_given_up_and_said_so(monkeypatch, caplog) -> None:
    """A service that never answered is given ``START_S`` (it may still be starting), one
    that answered before a poll's length and the grace; then every open config compiles
    in the worker, with one warning, and so do new ones until the service answers again."""
    monkeypatch.setattr(NodeCompiler, "LONG_POLL_S", 0.3)
    monkeypatch.setattr(NodeCompiler, "START_S", 1.0)
    svc = SilentService()
    client = NodeCompiler(svc, 1, grace_s=0.3, node="node-s")
    a, b, c, d = (_cfg(SLEEP_MS=i) for i in (1, 2, 3, 4))
    with caplog.at_level(logging.WARNING, logger="harness.fleet.compile_service"):
        t0 = time.monotonic()
        client.submit(PROBLEM, FAULTY, SHAPE, None, [a])
        out = client.pending(PROBLEM, a).result(timeout=5)
        assert 1.0 <= time.monotonic() - t0 < 2.5
        assert out["ok"] is False and "node node-s did not answer for this config within" \
            in out["reason"]
        # While it is silent, a new config is not sent and compiles in the worker at once.
        client.submit(PROBLEM, FAULTY, SHAPE, None, [c])
        assert client.pending(PROBLEM, c).result(timeout=1)["ok"] is False
        assert svc.submits == 1
        # Once it answers, configs go to it again ...
        svc.answering.set()
        _until(lambda: not client._silent, 5, "the service to be heard again")
        assert "node node-s answers again" in caplog.text
        svc.answering.clear()
        # ... and once it has answered, a silence is noticed after a poll and the grace.
        t0 = time.monotonic()
        client.submit(PROBLEM, FAULTY, SHAPE, None, [b, d])
        outs = [client.pending(PROBLEM, x).result(timeout=5) for x in (b, d)]
        assert time.monotonic() - t0 < 1.5
        assert svc.submits == 2
    for out in outs:
        assert out["ok"] is False and "did not answer for this config within" in out["reason"]
    assert "node node-s did not answer" in caplog.text and "2 config(s)" in caplog.text
    client.close()


def test_a_default_wait_is_bounded_and_says_what_it_waited_for() -> None:
    """A config never started (queued behind others) ends a default wait of the time-out
    and the grace with an outcome that says so; the worker then compiles it itself."""
    svc, pool = _stand_in_service(0.3)
    client = NodeCompiler(LocalHandle(svc), 1, grace_s=0.3)
    cfg = _cfg(SLEEP_MS=5)
    client.submit(PROBLEM, FAULTY, SHAPE, None, [cfg])
    # Its first poll is answered at once: the client learns the node and the time-out.
    _until(lambda: client.node == "node-a" and client.timeout_s == 0.3, 5,
           "the service's first answer")
    t0 = time.monotonic()
    out = client.wait(PROBLEM, cfg)
    assert 0.5 <= time.monotonic() - t0 < 1.5
    assert out == {"ok": False, "reason": "not compiled after 1 s: queued behind other "
                                          "compiles on node node-a"}
    client.close()


# -- slow: real compile children --------------------------------------------------------


@pytest.mark.slow
def test_a_compile_over_its_time_out_fails_and_frees_its_child(tmp_path: Path,
                                                               monkeypatch) -> None:
    """The time-out counts from a compile's start, not from its submission: of two 0.7 s
    compiles on one child the second ends 1.4 s after it was submitted and is fine. A 5 s
    compile times out a second after it started, its child's timer frees the child, and
    the next config compiles in that same child."""
    monkeypatch.setenv("FAULT_DIR", str(tmp_path))
    starts: dict[str, float] = {}
    pre = Precompiler(1, timeout_s=1.0, on_start=lambda k: starts.setdefault(k[1],
                                                                                time.monotonic()))
    try:
        pre.start()
        _until(lambda: all(c["ready"] for c in pre.children()), 60, "a warm child")
        a, b = _cfg(COMPILE_MS=700, SLEEP_MS=1), _cfg(COMPILE_MS=700, SLEEP_MS=2)
        slow, after = _cfg(COMPILE_MS=5000, SLEEP_MS=3), _cfg(SLEEP_MS=4)
        pre.submit(PROBLEM, FAULTY, SHAPE, _skel(), [a, b, slow, after])
        assert pre.wait(PROBLEM, a)["ok"] and pre.wait(PROBLEM, b)["ok"]
        out = pre.wait(PROBLEM, slow)
        waited = time.monotonic() - starts[config_key(slow)]
        assert out["timeout"] is True and out["reason"] == timeout_outcome(1.0)["reason"]
        assert waited < 1.0 + 2.0, waited
        nxt = pre.wait(PROBLEM, after)
        assert nxt["ok"] and nxt["pid"] == out["pid"]  # the same child, freed
        assert pre.stats == {"timed_out": 1, "relative": 0, "killed": 0, "lost": 0}
    finally:
        pre.close()


def test_a_free_child_takes_the_most_urgent_config_first(tmp_path: Path,
                                                         monkeypatch) -> None:
    """A config a worker has queued to measure (``URGENT``) compiles before the ones known
    to come (``AHEAD``), and those before a torch.compile baseline (``BACKGROUND``); a
    known config asked for again by a queued trial moves up."""
    monkeypatch.setenv("FAULT_DIR", str(tmp_path))
    order: list[str] = []
    pre = Precompiler(1, on_start=lambda k: order.append(k[1]))
    try:
        pre.start()
        _until(lambda: all(c["ready"] for c in pre.children()), 60, "a warm child")
        a1, a2, a3 = (_cfg(COMPILE_MS=400, SLEEP_MS=i) for i in (1, 2, 3))
        bg, urgent = _cfg(SLEEP_MS=4), _cfg(SLEEP_MS=5)
        pre.submit(PROBLEM, FAULTY, SHAPE, _skel(), [a1, a2, a3])  # AHEAD by default
        _until(lambda: order, 10, "the first compile to start")
        pre.submit(PROBLEM, FAULTY, SHAPE, _skel(), [bg], fleet_compile.BACKGROUND)
        pre.submit(PROBLEM, FAULTY, SHAPE, _skel(), [urgent], fleet_compile.URGENT)
        pre.submit(PROBLEM, FAULTY, SHAPE, _skel(), [a3], fleet_compile.URGENT)
        assert all(pre.wait(PROBLEM, c)["ok"] for c in (a1, a2, a3, bg, urgent))
        assert order == [config_key(c) for c in (a1, urgent, a3, a2, bg)], order
    finally:
        pre.close()


@pytest.mark.slow
def test_a_config_compiling_far_longer_than_its_problems_others_is_cut_early(
        tmp_path: Path, monkeypatch) -> None:
    """Five configs of a problem compile in ~0.3 s: a sixth still compiling after 5x
    their median (here never before 1 s) times out then, long before the 60 s time-out,
    its child's timer is rung at once, and the same child takes the next config. The same
    slow config of another problem, whose configs have not compiled yet, is not cut."""
    monkeypatch.setenv("FAULT_DIR", str(tmp_path))
    starts: dict[tuple[str, str], float] = {}
    pre = Precompiler(1, timeout_s=60.0, ratio=5.0, floor_s=1.0,
                      on_start=lambda k: starts.setdefault(k, time.monotonic()))
    other = problem_key(FAULTY, {"N": 128}, "fp32", 0)
    try:
        pre.start()
        _until(lambda: all(c["ready"] for c in pre.children()), 60, "a warm child")
        fast = [_cfg(COMPILE_MS=300, SLEEP_MS=i) for i in range(5)]
        slow, after = _cfg(COMPILE_MS=8000, SLEEP_MS=9), _cfg(SLEEP_MS=10)
        pre.submit(PROBLEM, FAULTY, SHAPE, _skel(), [*fast, slow, after])
        assert all(pre.wait(PROBLEM, c)["ok"] for c in fast)
        out = pre.wait(PROBLEM, slow)
        waited = time.monotonic() - starts[_key(slow)]
        assert out["timeout"] is True and "x the median compile" in out["reason"], out
        assert 1.0 <= waited < 3.5, waited  # 5 x ~0.3 s (the 1 s floor), not the 8 s
        nxt = pre.wait(PROBLEM, after)
        assert nxt["ok"] and nxt["pid"] == out["pid"]  # the timer freed the same child
        assert pre.stats["relative"] == 1 and pre.stats["killed"] == 0
        # Another problem whose compiles were all loads from the cache (under 0.25 s):
        # no median yet, the absolute time-out applies.
        hits = [_cfg(SLEEP_MS=20 + i) for i in range(5)]
        pre.submit(other, FAULTY, {"N": 128}, _skel(), [*hits, _cfg(COMPILE_MS=2500)])
        assert all(pre.wait(other, c)["ok"] for c in hits)
        assert pre.wait(other, _cfg(COMPILE_MS=2500))["ok"]
        assert pre.stats["timed_out"] == 1
    finally:
        pre.close()


def test_the_relative_time_out_setting() -> None:
    assert FleetSettings().compile_timeout_ratio == fleet_compile.COMPILE_TIMEOUT_RATIO == 5.0
    assert FleetSettings(compile_timeout_ratio=0).compile_timeout_ratio == 0
    with pytest.raises(ValueError):
        FleetSettings(compile_timeout_ratio=-1)
    out = timeout_outcome(12.5, median_s=2.5)
    assert out["reason"].startswith("compile time-out: still compiling after 12.5 s, 5x the "
                                    "median compile of this problem's configs (2.5 s)")


@pytest.mark.slow
def test_a_hung_child_is_killed_and_the_others_compiles_go_on(monkeypatch) -> None:
    """``compile_hang``: a child deaf to its timer. Its config times out on the pool's own
    clock, the child is killed a grace later and replaced, and a compile another child
    runs meanwhile ends well."""
    starts: dict[str, float] = {}
    pre = Precompiler(2, timeout_s=2.0, kill_grace_s=0.5,
                      on_start=lambda k: starts.setdefault(k[1], time.monotonic()))
    try:
        pre.start()
        _until(lambda: len(pre.children()) == 2 and all(c["ready"] for c in pre.children()),
               60, "two warm children")
        hung, during, after = _cfg(SLEEP_MS=1), _cfg(COMPILE_MS=1500, SLEEP_MS=2), \
            _cfg(SLEEP_MS=3)
        monkeypatch.setenv("HARNESS_FAULTS", "compile_hang")
        pre.submit(PROBLEM, FAULTY, SHAPE, _skel(), [hung])
        monkeypatch.delenv("HARNESS_FAULTS")
        _until(lambda: config_key(hung) in starts, 5, "the hung compile to start")
        # The kill comes 2 + 0.5 (the pool's slack) + 0.5 s after the hung compile started;
        # this one runs from 1.8 to 3.3 s.
        time.sleep(max(0.0, starts[config_key(hung)] + 1.8 - time.monotonic()))
        pre.submit(PROBLEM, FAULTY, SHAPE, _skel(), [during])
        out = pre.wait(PROBLEM, hung)
        assert out["timeout"] is True
        assert time.monotonic() - starts[config_key(hung)] < 2.0 + 2.0
        hung_pid = out["pid"]
        done = pre.wait(PROBLEM, during)
        assert done["ok"] and done["pid"] != hung_pid, done
        kill_at = starts[config_key(hung)] + 3.0
        assert starts[config_key(during)] < kill_at < time.monotonic()
        _until(lambda: pre.stats["killed"] == 1, 5, "the kill")
        _until(lambda: len(pre.children()) == 2 and all(c["ready"] for c in pre.children())
               and hung_pid not in {c["pid"] for c in pre.children()}, 60, "a new child")
        with pytest.raises(ProcessLookupError):
            os.kill(hung_pid, 0)
        pre.submit(PROBLEM, FAULTY, SHAPE, _skel(), [after])
        assert pre.wait(PROBLEM, after)["ok"]
        assert pre.stats["lost"] == 0
    finally:
        pre.close()


@pytest.mark.slow
def test_a_lost_outcome_of_a_real_compile_resolves_the_client(monkeypatch, caplog) -> None:
    """The service with its own compile children, called as a worker calls it."""
    monkeypatch.setenv("HARNESS_PRECOMPILE", "force")
    svc = _Service(1, compile_timeout_s=1.0, node="node-b")
    client = NodeCompiler(LocalHandle(svc), 1, grace_s=1.0)
    try:
        _until(lambda: all(c["ready"] for c in svc.pre.children()), 60, "a warm child")
        lost, fine, slow = _cfg(SLEEP_MS=1), _cfg(SLEEP_MS=2), _cfg(COMPILE_MS=4000, SLEEP_MS=3)
        monkeypatch.setenv("HARNESS_FAULTS", "compile_lost")
        with caplog.at_level(logging.WARNING, logger="harness.fleet.compile_service"):
            t0 = time.monotonic()
            client.submit(PROBLEM, FAULTY, SHAPE, _skel(), [lost])
            # The fault is read as the service takes the config in (on its thread).
            _until(lambda: svc.pre.pending(PROBLEM, lost) is not None, 5, "the submit")
            monkeypatch.delenv("HARNESS_FAULTS")
            out = client.wait(PROBLEM, lost)
            assert time.monotonic() - t0 < 1.0 + 1.0 + 1.5
        assert "node node-b did not answer for this config within" in out["reason"]
        assert "node-b did not answer for 1 config(s)" in caplog.text
        client.submit(PROBLEM, FAULTY, SHAPE, _skel(), [fine, slow])
        assert client.wait(PROBLEM, fine)["ok"]
        t0 = time.monotonic()
        out = client.wait(PROBLEM, slow)
        assert out["timeout"] is True and time.monotonic() - t0 < 1.0 + 2.0
        assert svc.info()["timed_out"] == 1
    finally:
        client.close()
        svc.close()


def _load_softmax() -> Any:
    spec = importlib.util.spec_from_file_location(
        "mymod", ROOT / "benchmarks" / "outside" / "mymod.py")
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod.Softmax


class SoftmaxSm90(Faulty):
    """The outside softmax's ``compile_only`` as on an H100 (sm_90), on any machine."""

    def compile_only(self, inputs: Any, shape: Any, config: Any) -> None:
        import torch
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from triton.runtime.jit import mangle_type

        x = torch.empty(shape["R"], shape["C"], dtype=inputs["x"].dtype, device="meta")
        fn, _grid, args, meta, _out = _load_softmax()()._launch({"x": x}, config)
        sig = {name: mangle_type(v) for name, v in zip(fn.arg_names, args, strict=False)}
        consts = {k: v for k, v in meta.items() if k in fn.arg_names}
        sig.update({k: "constexpr" for k in consts})
        triton.compile(ASTSource(fn, signature=sig, constexprs=consts),
                       target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": meta["num_warps"],
                                "num_stages": meta["num_stages"]})


_SM90_POOL = """
import json, time
import torch
from harness.fleet.compile import Precompiler, problem_key
from harness.fleet.compile_child import skeleton
from harness.search.keys import config_key

kernel = "tests.test_compile_timeout:SoftmaxSm90"
shape = {"R": 4096, "C": 4096}
problem = problem_key(kernel, shape, "fp32", 0)
starts = {}
pre = Precompiler(1, timeout_s=15.0, kill_grace_s=2.0,
                  on_start=lambda k: starts.setdefault(k[1], time.monotonic()))
slow = {"BLOCK_R": 8, "num_warps": 1, "num_stages": 1}
fast = {"BLOCK_R": 1, "num_warps": 4, "num_stages": 1}
pre.submit(problem, kernel, shape, skeleton({"x": torch.empty(8, 8)}), [slow, fast])
out = pre.wait(problem, slow, timeout_s=120)
waited = time.monotonic() - starts[config_key(slow)]
nxt = pre.wait(problem, fast, timeout_s=120)
print(json.dumps({"slow": out, "waited": waited, "fast": nxt, "stats": pre.stats}))
pre.close()
"""


@pytest.mark.slow
def test_a_softmax_config_that_compiles_for_half_a_minute_times_out(tmp_path: Path) -> None:
    """The case seen on an H100 host: 8 rows of 4096 fp32 in one warp's registers compile
    for about 35 s for sm_90 (LLVM, then ptxas). With a 15 s time-out (a fast config compiles
    within it on two loaded cores) the trial's outcome comes about 15 s after the compile
    started, and the next config compiles (in the same
    child once LLVM returns, or in a new one). A fresh process: its compile children must
    compile, not interpret (a forkserver started under the interpreter stays so)."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), TRITON_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-c", _SM90_POOL], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["slow"].get("timeout") is True, got
    assert got["slow"]["reason"] == timeout_outcome(15.0)["reason"]
    assert got["waited"] < 15.0 + 2.0, got
    assert got["fast"]["ok"], got


@pytest.mark.slow
def test_the_service_as_a_ray_actor_answers_a_time_out_and_the_next_config(
        tmp_path: Path) -> None:
    import ray

    from harness.fleet.compile_service import start_services

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR",
             log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "FAULT_DIR": str(tmp_path),
                                       "HARNESS_PRECOMPILE": "force"}})
    try:
        node = ray.get_runtime_context().get_node_id()
        services = start_services({node: (2.0, 1)}, 1, compile_timeout_s=1.0)
        assert ray.get(services[node].info.remote(), timeout=120)["compile_timeout_s"] == 1.0
        client = NodeCompiler(services[node], 1, grace_s=2.0)
        # The service's processes import torch first: under load that takes longer than
        # the time-out and the grace, and a queue that does not move is (rightly) given up.
        for tries in range(1, 41):  # a new config each time: an answered one stays answered
            first = _cfg(SLEEP_MS=2 + tries)
            client.submit(PROBLEM, FAULTY, SHAPE, _skel(), [first])
            if client.wait(PROBLEM, first, timeout_s=60).get("ok"):
                break
        else:
            raise AssertionError("the compile service compiled nothing in 40 tries")
        slow, fine = _cfg(COMPILE_MS=4000, SLEEP_MS=1), _cfg(SLEEP_MS=2)
        client.submit(PROBLEM, FAULTY, SHAPE, _skel(), [slow, fine])
        out = client.wait(PROBLEM, slow, timeout_s=60)
        assert out["timeout"] is True and out["reason"] == timeout_outcome(1.0)["reason"]
        assert client.wait(PROBLEM, fine, timeout_s=60)["ok"]
        assert client.node == node
        info = ray.get(services[node].info.remote(), timeout=30)
        assert info["timed_out"] == 1 and info["compiled"] >= 2
        client.close()
    finally:
        ray.shutdown()


def test_the_module_constants_agree() -> None:
    assert fleet_compile.PRECOMPILE_WAIT_S == (fleet_compile.COMPILE_TIMEOUT_S
                                               + fleet_compile.ANSWER_GRACE_S)


def test_a_prebuild_leaves_the_child_s_inputs_to_the_configs_after_it(monkeypatch) -> None:
    """A child that built a problem's torch.compile baseline (no skeleton sent) compiles
    that problem's configs next against the inputs their skeleton describes."""
    from harness.fleet import compile_child

    seen: list[Any] = []
    monkeypatch.setattr(Faulty, "compile_only",
                        lambda self, inputs, shape, config: seen.append(inputs))
    monkeypatch.setattr(compile_child, "_prebuild", lambda *a: None)
    monkeypatch.setattr(compile_child, "_CHILD", {})
    problem = problem_key(FAULTY, SHAPE, "fp32", 7)
    prebuild = {compile_child.PREBUILD: "torch.compile", "dtype": "fp32", "seed": 7}
    assert compile_child._compile_in_child(FAULTY, SHAPE, problem, None, prebuild)["ok"]
    out = compile_child._compile_in_child(FAULTY, SHAPE, problem, _skel(), _cfg())
    assert out["ok"], out
    assert len(seen) == 1 and tuple(seen[0]["x"].shape) == (SHAPE["N"],)
    # A config sent with no skeleton for a problem this child never saw says so.
    out = compile_child._compile_in_child(FAULTY, SHAPE, "elsewhere", None, _cfg())
    assert not out["ok"] and "no input layouts" in out["reason"]
