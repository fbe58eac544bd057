"""Packs whatever their bytes or file type: ``harness.packs.lookup`` warns and serves the
default config, ``kharness packs`` exits 0 or 2 with one line, no path made from pack data
leaves its folder, and writers of one pack at once lose nothing (issue #44, the pack side).
The fuzzed counterpart is tests/test_fuzz_packs.py."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from harness import packs
from harness.cli import main
from harness.packs import format as fmt
from harness.packs import s3
from tests.fuzz_edits import within

ROOT = Path(__file__).resolve().parents[1]
SHAPE = {"M": 4096, "N": 1408, "K": 2048, "E": 64}
SK = "M=4096,N=1408,K=2048,E=64"


def _entry(block_m: int = 64, **provenance: Any) -> dict[str, Any]:
    return {"config": {"BLOCK_M": block_m, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8,
                       "num_warps": 8, "num_stages": 3, "PERSISTENT": 0},
            "metrics": {"latency_ms": 0.5},
            "provenance": {"device_name": "NVIDIA H100", **provenance}}


def lookup(root: Path, kernel: Any = "grouped_gemm", hw: str = "H100",
           shape: dict[str, int] | None = None, dtype: str = "bf16"
           ) -> tuple[packs.Hit, list[str]]:
    """lookup_entry on ``root`` alone: the hit and the PackWarnings it gave."""
    packs.configure([root])
    try:
        with warnings.catch_warnings(record=True) as caught, within(20):
            warnings.simplefilter("always")
            hit = packs.lookup_entry(kernel, dtype, hw, **(shape or SHAPE))
    finally:
        packs.configure(None)
    return hit, [str(w.message) for w in caught if issubclass(w.category, packs.PackWarning)]


def cli(capsys: Any, *argv: str) -> tuple[int, str, str]:
    with within(20):
        code = main(["packs", *argv])
    out = capsys.readouterr()
    return code, out.out, " ".join(out.err.split())  # rich wraps long lines


# -- 2. a pack can crash the application -------------------------------------------------
def _huge_number(root: Path, where: str) -> Path:
    path = packs.freeze(root, "H100", "grouped_gemm", "bf16", {SK: _entry()})
    if where == "provenance":  # a number of 5,000 digits: int() refuses above 4,300
        text = path.read_text().replace('"device_name": "NVIDIA H100"',
                                        '"device_name": "NVIDIA H100", "n": ' + "7" * 5000)
        path.write_text(text)
    else:  # a well-signed pack whose shape key holds it (a string: JSON parses it)
        data = packs.read(path)
        data["kernels"]["grouped_gemm"]["bf16"]["M=" + "7" * 5000 + ",N=1408,K=2048,E=64"] = \
            _entry()
        fmt.write(path, data)
    return path


@pytest.mark.parametrize("where", ["provenance", "shape_key"])
def test_a_number_of_5000_digits_is_a_bad_pack_not_a_crash(tmp_path, capsys, where):
    path = _huge_number(tmp_path, where)
    hit, msgs = lookup(tmp_path)
    assert hit.source == "default" and len(msgs) == 1 and str(path) in msgs[0], msgs
    code, out, _ = cli(capsys, "list", "--dir", str(tmp_path), "--json")
    (row,) = json.loads(out)
    assert code == 0 and row["status"].startswith("rejected: "), row
    code, _, err = cli(capsys, "show", str(path))
    assert (code, where) == (0, "shape_key") or (code == 2 and str(path) in err)
    code, _, err = cli(capsys, "merge", str(path), "--out", str(tmp_path / "o.json"))
    assert code == 2 and str(path) in err and not (tmp_path / "o.json").exists()
    with pytest.raises(s3.S3Error) as exc:
        s3.push("s3://bucket/prefix", tmp_path)  # refused locally: nothing is contacted
    assert exc.value.bad_input and str(path) in str(exc.value)
    if where == "provenance":  # a run's freeze into it: a PackError naming it
        with pytest.raises(fmt.PackError, match="digits"):
            packs.freeze(tmp_path, "H100", "grouped_gemm", "bf16", {SK: _entry()})


def _make(path: Path, kind: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "symlink_loop":
        path.symlink_to(path.name)
    elif kind == "dangling_symlink":
        path.symlink_to("nowhere.json")
    elif kind == "dev_zero":
        path.symlink_to("/dev/zero")
    else:
        raise AssertionError(kind)


NOT_FILES = ["fifo", "directory", "symlink_loop", "dangling_symlink", "dev_zero"]


@pytest.mark.parametrize("kind", NOT_FILES)
def test_a_pack_path_that_is_not_a_regular_file(tmp_path, capsys, kind):
    """Something at the pack's place that is no pack is a rejected pack: one warning naming
    it, the default config; ``list`` shows it rejected, ``merge`` and ``push`` refuse it;
    nothing blocks (a FIFO is never opened for reading)."""
    path = tmp_path / "H100" / "grouped_gemm.json"
    _make(path, kind)
    hit, msgs = lookup(tmp_path)
    assert hit.source == "default" and len(msgs) == 1 and str(path) in msgs[0], msgs
    code, out, _ = cli(capsys, "list", "--dir", str(tmp_path), "--json")
    (row,) = json.loads(out)
    assert code == 0 and row["status"].startswith("rejected: "), row
    code, _, err = cli(capsys, "merge", str(path), "--out", str(tmp_path / "o.json"))
    assert code == 2 and str(path) in err, err
    with within(20), pytest.raises(s3.S3Error) as exc:
        s3.push("s3://bucket/prefix", tmp_path)
    assert exc.value.bad_input and str(path) in str(exc.value)


def _unprivileged() -> list[str]:
    """A command prefix under which permissions apply: as root, without the capabilities
    that bypass them (setpriv); else nothing."""
    if os.geteuid() != 0:
        return []
    cmd = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"]
    if shutil.which("setpriv") is None or subprocess.run(
            [*cmd, "true"], capture_output=True).returncode != 0:
        pytest.skip("running as root without setpriv: permissions cannot be denied")
    return cmd


_UNREADABLE = r"""
import json, sys, warnings
from harness import packs
from harness.cli import main
root = sys.argv[1]
packs.configure([root])
res = {}
for hw in ("H100", "H200"):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hit = packs.lookup_entry("grouped_gemm", "bf16", hw, M=4096, N=1408, K=2048, E=64)
    res[hw] = [hit.source, [str(w.message) for w in caught]]
print(json.dumps(res))
sys.exit(main(["packs", "list", "--dir", root, "--json"]))
"""


def test_unreadable_pack_directory_and_file(tmp_path):
    """``packs/H100`` with no permissions and an unreadable ``packs/H200/*.json`` (H100's
    family sibling): lookup warns once per file and serves the default config; ``list``
    reports both. In a process of its own, where the permissions apply."""
    prefix = _unprivileged()
    root = tmp_path / "packs"
    for hw in ("H100", "H200"):
        packs.freeze(root, hw, "grouped_gemm", "bf16", {SK: _entry()})
    (root / "H200" / "grouped_gemm.json").chmod(0)
    (root / "H100").chmod(0)
    try:
        proc = subprocess.run([*prefix, sys.executable, "-c", _UNREADABLE, str(root)],
                              capture_output=True, text=True, timeout=120, cwd=ROOT)
    finally:
        (root / "H100").chmod(0o755)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    first, _, rest = proc.stdout.partition("\n")
    res = json.loads(first)
    # H100's lookup tries its sibling's (H200's) pack too: each file is named once, by
    # the first lookup that read it.
    msgs = res["H100"][1] + res["H200"][1]
    assert [source for source, _ in res.values()] == ["default", "default"], res
    assert len(msgs) == 2 and all("Permission denied" in m for m in msgs), msgs
    for hw in ("H100", "H200"):
        assert sum(f"{root}/{hw}/" in m for m in msgs) == 1, msgs
    rows = json.loads(rest)
    assert {r["hardware"] for r in rows if r["status"].startswith("rejected: ")} == \
        {"H100", "H200"}, rows


# -- 3. export writes outside --out-dir --------------------------------------------------
@pytest.mark.parametrize("source", ["provenance", "option"])
def test_export_writes_only_inside_out_dir(tmp_path, capsys, source):
    name = "x/../../../../elsewhere/ESCAPED"
    e = _entry()
    if source == "provenance":
        e["provenance"]["device_name"] = name
    pack = packs.freeze(tmp_path / "v", "H200", "grouped_gemm", "bf16",
                        {"M=768,N=1408,K=2048,E=64": e})
    out = tmp_path / "a" / "b" / "c" / "d" / "out"
    argv = ["export", "--format", "vllm-moe", "--top-k", "6", "--pack", str(pack),
            "--out-dir", str(out)] + (["--device-name", name] if source == "option" else [])
    code, _, err = cli(capsys, *argv)
    assert code == 0, err
    stray = [p for p in tmp_path.rglob("*") if not (
        p.is_relative_to(tmp_path / "v") or p == out or p in out.parents or p.parent == out)]
    assert stray == [], stray
    (f,) = out.iterdir()
    assert f.is_file()
    assert f.name == "E=64,N=1408,device_name=x_.._.._.._.._elsewhere_ESCAPED.json"
    assert set(json.loads(f.read_text())) == {"128"}


def test_safe_names_and_child_paths(tmp_path):
    assert fmt.safe_name("NVIDIA H200 NVL") == "NVIDIA_H200_NVL"
    assert fmt.safe_name("../..") == "unnamed" and fmt.safe_name("") == "unnamed"
    assert fmt.safe_name("a\x00b/c\\d") == "a_b_c_d"
    assert len(fmt.safe_name("x" * 1000)) <= 128
    assert fmt.child(tmp_path, "ok.json") == tmp_path / "ok.json"
    for bad in ("../x.json", "a/b.json", "..", ".", "", "a\x00b"):
        with pytest.raises(fmt.PackError):
            fmt.child(tmp_path, bad)
    for hw, kernel in (("../x", "k"), ("H100", "a/b"), ("..", "k"), ("H100", ""),
                       (["H100"], "k"), ("H100", "k\x00")):
        with pytest.raises(fmt.PackError):
            fmt.pack_path(tmp_path, hw, kernel)  # type: ignore[arg-type]


# -- 6. concurrent writers of one pack ---------------------------------------------------
def _race(jobs: list[Callable[[], int]], rounds: int, check: Callable[[int], bool]
          ) -> tuple[int, list[int]]:
    """Run the jobs of each round in processes of their own, released together; how many
    rounds ``check(round)`` failed, and the exit codes that were not 0."""
    ctx = multiprocessing.get_context("fork")  # the kernel families are imported already
    lost, bad = 0, []
    for r in range(rounds):
        barrier = ctx.Barrier(len(jobs))
        codes = ctx.Array("i", len(jobs))

        def run(i: int, job: Callable[[int], int], r: int, barrier: Any = barrier,
                codes: Any = codes) -> None:
            barrier.wait()
            codes[i] = job(r)

        procs = [ctx.Process(target=run, args=(i, job, r)) for i, job in enumerate(jobs)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        bad += [c for c in codes if c] + [p.exitcode for p in procs if p.exitcode]
        lost += not check(r)
    return lost, bad


def _merge_input(tmp_path: Path, m: int) -> Path:
    src = packs.freeze(tmp_path / f"in{m}", "H100", "grouped_gemm", "bf16",
                       {f"M={m},N=1408,K=2048,E=64": _entry()})
    return src


def test_concurrent_merges_into_one_pack_lose_nothing(tmp_path, capsys):
    """Two ``kharness packs merge IN --dir OUT`` at once, into a pack that has an entry
    already: every round keeps all three."""
    a, b = _merge_input(tmp_path, 1), _merge_input(tmp_path, 2)
    dest = [tmp_path / f"out{r}" for r in range(20)]
    for d in dest:
        packs.freeze(d, "H100", "grouped_gemm", "bf16", {"M=7,N=1408,K=2048,E=64": _entry()})
    assert main(["packs", "merge", str(a), "--out", str(tmp_path / "warm.json")]) == 0

    def merge(src: Path) -> Callable[[int], int]:
        return lambda r: main(["packs", "merge", str(src), "--dir", str(dest[r])])

    def kept(r: int) -> bool:
        data = packs.read(fmt.pack_path(dest[r], "H100", "grouped_gemm"))
        return {k.split(",")[0] for k in data["kernels"]["grouped_gemm"]["bf16"]} == \
            {"M=1", "M=2", "M=7"}

    lost, bad = _race([merge(a), merge(b)], len(dest), kept)
    capsys.readouterr()
    assert (lost, bad) == (0, []), f"entries lost in {lost} of {len(dest)} rounds"


def test_concurrent_freezes_into_one_pack_lose_nothing(tmp_path):
    """``harness.run.freeze`` of two experiments into one packs folder: ``packs.freeze`` from
    two processes at once keeps both entries."""
    dest = [tmp_path / f"out{r}" for r in range(20)]

    def freeze(m: int) -> Callable[[int], int]:
        def job(r: int) -> int:
            packs.freeze(dest[r], "H100", "grouped_gemm", "bf16",
                         {f"M={m},N=1408,K=2048,E=64": _entry()})
            return 0
        return job

    def kept(r: int) -> bool:
        data = packs.read(fmt.pack_path(dest[r], "H100", "grouped_gemm"))
        return len(data["kernels"]["grouped_gemm"]["bf16"]) == 2

    lost, bad = _race([freeze(1), freeze(2)], len(dest), kept)
    assert (lost, bad) == (0, []), f"entries lost in {lost} of {len(dest)} rounds"


def test_concurrent_online_records_lose_nothing(tmp_path):
    """Two processes tuning online into one record file: every record is kept."""
    from harness.autotune import append_record

    files = [tmp_path / f"online{r}.json" for r in range(20)]

    def record(m: int) -> Callable[[int], int]:
        def job(r: int) -> int:
            append_record(files[r], {"n": m})
            return 0
        return job

    lost, bad = _race([record(1), record(2)], len(files),
                      lambda r: sorted(x["n"] for x in json.loads(files[r].read_text()))
                      == [1, 2])
    assert (lost, bad) == (0, []), f"records lost in {lost} of {len(files)} rounds"


# -- 7. malformed online-tuning records --------------------------------------------------
GOOD_RECORD = {"kernel": "grouped_gemm", "family": "grouped_gemm", "hardware": "H100",
               "dtype": "bf16", "shape": SHAPE, "shape_key": SK,
               "config": _entry()["config"], "latency_ms": 0.5,
               "provenance": {"source": "online", "device_name": "NVIDIA H100"}}


@pytest.mark.parametrize(("field", "value"), [
    ("provenance", "abc"), ("provenance", [["device_name", "x"]]), ("hardware", ["H100"]),
    ("family", {"a": 1}), ("dtype", None), ("shape_key", 5), ("config", [1, 2]),
    ("config", "abc"), ("latency_ms", "fast"), ("latency_ms", [1]), ("hardware", "../../x"),
    ("config", None), (None, "abc"), (None, 5), (None, None), (None, [GOOD_RECORD])])
def test_merge_of_malformed_online_records_exits_2(tmp_path, capsys, field, value):
    rec = value if field is None else {**GOOD_RECORD, field: value}
    path = tmp_path / "online.json"
    path.write_text(json.dumps([GOOD_RECORD, rec]))
    dest = tmp_path / "packs"
    code, _, err = cli(capsys, "merge", str(path), "--dir", str(dest))
    assert code == 2 and f"{path}[1]" in err and "Traceback" not in err, err
    assert not dest.exists()


def test_a_good_record_merges(tmp_path, capsys):
    path = tmp_path / "online.json"
    path.write_text(json.dumps([GOOD_RECORD]))
    code, _, err = cli(capsys, "merge", str(path), "--dir", str(tmp_path / "packs"))
    assert code == 0, err
    assert packs.read(tmp_path / "packs" / "H100" / "grouped_gemm.json")["kernels"][
        "grouped_gemm"]["bf16"][SK]["config"] == GOOD_RECORD["config"]


# -- 9. the smaller ones -----------------------------------------------------------------
def test_merge_into_a_directory_or_a_symlink_loop_exits_2(tmp_path, capsys):
    src = _merge_input(tmp_path, 1)
    (tmp_path / "adir").mkdir()
    code, _, err = cli(capsys, "merge", str(src), "--out", str(tmp_path / "adir"))
    assert code == 2 and "adir" in err and "Traceback" not in err, err
    loop = tmp_path / "loop"
    loop.symlink_to("loop")
    code, _, err = cli(capsys, "merge", str(src), "--dir", str(loop))
    assert code == 2 and "loop" in err and "Traceback" not in err, err
    afile = tmp_path / "afile"
    afile.write_text("")
    code, _, err = cli(capsys, "merge", str(src), "--dir", str(afile))
    assert code == 2 and "afile" in err, err


def test_entries_of_another_kernel_reject_the_pack(tmp_path, capsys):
    path = packs.freeze(tmp_path, "H100", "grouped_gemm", "bf16", {SK: _entry()})
    data = packs.read(path)
    data["kernels"]["matmul"] = {"bf16": {"M=1,N=1,K=1": {
        "config": {"NOT_A_TUNABLE": "x"}, "metrics": {}, "provenance": {}}}}
    fmt.write(path, data)
    hit, msgs = lookup(tmp_path)
    assert hit.source == "default" and len(msgs) == 1 and "matmul" in msgs[0], msgs
    code, out, _ = cli(capsys, "list", "--dir", str(tmp_path), "--json")
    assert json.loads(out)[0]["status"].startswith("rejected: ")
    code, _, err = cli(capsys, "merge", str(path), "--out", str(tmp_path / "o.json"))
    assert code == 2 and "matmul" in err


@pytest.mark.parametrize(("option", "value"), [
    ("num_warps", 1024), ("num_warps", 3), ("num_warps", 0), ("num_warps", 64),
    ("num_stages", -1), ("num_stages", 1000)])
def test_launch_options_out_of_range_reject_the_pack(tmp_path, option, value):
    """An H100 matmul entry with ``num_warps: 1024`` passes the family's own checks: the
    launch options' ranges are checked for every kernel."""
    config = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4,
              "num_stages": 3, option: value}
    packs.freeze(tmp_path, "H100", "matmul", "bf16", {"M=256,N=256,K=256": {
        "config": config, "metrics": {"latency_ms": 0.1}, "provenance": {}}})
    hit, msgs = lookup(tmp_path, "matmul", shape={"M": 256, "N": 256, "K": 256})
    assert hit.source == "default" and len(msgs) == 1, msgs
    assert option in msgs[0] and str(value) in msgs[0], msgs


@pytest.mark.parametrize(("option", "value", "served"), [
    ("num_warps", "8", False), ("num_warps", True, False), ("num_warps", 1024, False),
    ("num_stages", -1, False), ("num_ctas", 3, False), ("maxnreg", 100000, False),
    ("num_warps", 8, True), ("num_ctas", 2, True), ("maxnreg", 128, True)])
def test_launch_options_of_a_kernel_without_a_family_are_checked(tmp_path, option, value,
                                                                 served):
    """A kernel with no family types only its default config's keys: its launch options
    are still checked before they reach a launch."""
    from harness.autotune import _AdHoc

    fam = _AdHoc("vector_add", ["n_elements"], {"BLOCK_SIZE": 128})
    packs.freeze(tmp_path, "H100", "vector_add", "fp32", {"n_elements=4096": {
        "config": {"BLOCK_SIZE": 256, option: value}, "metrics": {}, "provenance": {}}})
    hit, msgs = lookup(tmp_path, fam, shape={"n_elements": 4096}, dtype="fp32")
    assert (hit.source == "exact") == served, (hit, msgs)
    assert served or (len(msgs) == 1 and option in msgs[0]), msgs


def test_configure_refuses_a_single_path(tmp_path):
    packs.configure([tmp_path])
    try:
        for bad in ("abc", tmp_path, b"abc", ["a", 5]):
            with pytest.raises(TypeError, match="list of directories"):
                packs.configure(bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="strict"):
            packs.configure(strict="no")  # type: ignore[arg-type]
        assert packs.search_path() == [tmp_path]  # a refused call changes nothing
        packs.configure((str(tmp_path), tmp_path / "b"))  # any iterable of paths
        assert packs.search_path() == [tmp_path, tmp_path / "b"]
    finally:
        packs.configure(None)


def test_lookup_dims_must_be_integers(tmp_path):
    import numpy as np

    packs.freeze(tmp_path, "H100", "grouped_gemm", "bf16", {SK: _entry(64)})
    for bad in (1.9, "4096", float("nan"), float("inf"), None, 4096.5):
        with pytest.raises(ValueError, match=r"M=.* is not an integer"):
            lookup(tmp_path, shape={**SHAPE, "M": bad})
    for same in (4096, 4096.0, np.int64(4096)):
        hit, _ = lookup(tmp_path, shape={**SHAPE, "M": same})
        assert hit.source == "exact" and hit.config["BLOCK_M"] == 64, same
    with pytest.raises(ValueError, match="hardware key"):
        lookup(tmp_path, hw="../H100")


def test_a_corrupted_record_file_is_kept_and_a_new_one_started(tmp_path):
    from harness.autotune import append_record

    for i, text in enumerate(['[{"a": 1}, {"b"', '{"not": "a list"}', "7" * 5000]):
        rec = tmp_path / f"online{i}.json"
        rec.write_text(text)
        with pytest.warns(packs.PackWarning, match="corrupt"):
            append_record(rec, {"x": 1})
        assert json.loads(rec.read_text()) == [{"x": 1}]
        (kept,) = tmp_path.glob(f"online{i}.json.corrupt-*")
        assert kept.read_text() == text
        append_record(rec, {"x": 2})  # the new one goes on as usual
        assert json.loads(rec.read_text()) == [{"x": 1}, {"x": 2}]
