"""Pack files at random: bytes, mutated JSON structure (signed again or not), numbers of
any size, nesting of any depth, and file types (directory, FIFO, unreadable file, symlink
loop, dangling symlink, a device, an unreadable hardware directory).
``harness.packs.lookup`` returns a config within seconds and never raises;
``kharness packs list`` exits 0, ``show`` and ``merge`` 0 or 2, never with a traceback.
Online-tuning record files are fuzzed through ``merge`` the same way."""

from __future__ import annotations

import copy
import json
import os
import re
import tempfile
import warnings
from pathlib import Path
from typing import Any

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.configuration import set_hypothesis_home_dir  # noqa: E402

# Hypothesis keeps caches in ./.hypothesis by default: tests write to temporary
# directories only.
set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "kernel-harness-hypothesis")

from harness import packs  # noqa: E402
from harness.cli import main  # noqa: E402
from harness.packs import format as fmt  # noqa: E402
from tests.fuzz_edits import edit, get, paths, within  # noqa: E402

_GG = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8,
       "num_stages": 3, "PERSISTENT": 0}
_MM = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4,
       "num_stages": 3}
#: (kernel, hardware, dtype, shape, entries): the valid packs that are mutated.
BASES = [
    ("grouped_gemm", "H100", "bf16", {"M": 4096, "N": 1408, "K": 2048, "E": 64},
     {"M=4096,N=1408,K=2048,E=64": _GG, "M=65536,N=1408,K=2048,E=64": {**_GG, "BLOCK_M": 128}}),
    ("matmul", "H200", "bf16", {"M": 256, "N": 256, "K": 256},
     {"M=256,N=256,K=256": _MM, "M=512,N=512,K=512": {**_MM, "num_warps": 8}}),
]

#: Stand-ins replaced in the file's text by what json.dumps cannot write.
RAW = {"@BIG@": "7" * 5000, "@NEGBIG@": "-" + "9" * 4400, "@FLOAT@": "1e99999",
       "@NAN@": "NaN", "@INF@": "-Infinity", "@DEEP@": "[" * 50000 + "]" * 50000,
       "@DEEPOBJ@": '{"a":' * 3000 + "1" + "}" * 3000, "@FRAC@": "0." + "3" * 5000}

SCALARS = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(2 ** 70), max_value=2 ** 70),
    st.sampled_from([0, 1, -1, 3, 1024, 2 ** 31, 2 ** 63, 10 ** 30, 10 ** 400]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
    st.sampled_from(sorted(RAW) + [
        "H100", "H200", "grouped_gemm", "matmul", "bf16", "../../x", "x/../../y", "a" * 300,
        "M=1,N=1,K=1", "M=" + "9" * 5000 + ",N=1,K=1", "\x00", "é", "num_warps", "128",
        "sha256:" + "0" * 64]),
)
#: Config values: any size, any sign, the launch options' edges.
TUNED = st.one_of(st.integers(), st.integers(-(10 ** 120), 10 ** 120),
                  st.sampled_from([0, 1, 2, 3, 16, 32, 33, 64, 255, 256, 1024, -1, 2 ** 64]),
                  st.floats(allow_nan=False, allow_infinity=False), st.booleans(),
                  st.text(max_size=8))
NAMES = st.one_of(st.sampled_from([
    "schema_version", "hardware", "kernel", "kernels", "checksum", "config", "metrics",
    "provenance", "latency_ms", "device_name", "triton", "torch", "date", "bf16", "fp16",
    "grouped_gemm", "matmul", "silu", "BLOCK_M", "num_warps", "num_stages", "num_ctas",
    "maxnreg", "M=1,N=1408,K=2048,E=64", "M=1,N=1,K=1", "rows=1,cols=1", "..", "a/b"]),
    st.text(max_size=12))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(NAMES, inner, max_size=4)), max_leaves=10)




def _mutate(data: st.DataObject, doc: Any) -> Any:
    doc = copy.deepcopy(doc)
    grown = False
    for _ in range(data.draw(st.integers(0, 3), label="mutations")):
        where = paths(doc)
        path = data.draw(st.sampled_from(where), label="where")
        how = data.draw(st.sampled_from(["replace", "delete", "add", "nest", "grow", "tune",
                                         "tune"]), label="how")
        configs = [p for p in where if p and p[-1] == "config"
                   and isinstance(get(doc, p), dict)]
        if how == "tune" and configs:  # a value of a config: what passes the schema
            config = get(doc, data.draw(st.sampled_from(configs), label="config"))
            config[data.draw(NAMES, label="knob")] = data.draw(TUNED, label="value")
            continue
        # Grown once, and from a small node: a pack of ~1-10 MB at most.
        small = bool(path) and len(json.dumps(get(doc, path))) < 4000
        edit(data, doc, path, how, NAMES, VALUES, grow=not grown and small)
        grown = grown or (how == "grow" and small)
    return doc


_VERSIONS = {k: v for k, v in packs.runtime_versions().items() if v}


def _pack(base: tuple) -> dict[str, Any]:
    kernel, hw, dtype, _, entries = base
    data = fmt.empty(hw, kernel)
    data["kernels"][kernel][dtype] = {
        k: {"config": dict(c), "metrics": {"latency_ms": 0.1},
            "provenance": {"device_name": f"NVIDIA {hw}", **_VERSIONS}}
        for k, c in entries.items()}
    return json.loads(fmt.dumps(data))


def _record(base: tuple) -> dict[str, Any]:
    kernel, hw, dtype, shape, entries = base
    key, config = next(iter(entries.items()))
    return {"kernel": kernel, "family": kernel, "hardware": hw, "dtype": dtype,
            "shape": shape, "shape_key": key, "config": dict(config), "latency_ms": 0.2,
            "provenance": {"source": "online", "device_name": f"NVIDIA {hw}"}}


def _text(data: st.DataObject, doc: Any, sign: bool) -> bytes:
    if sign and isinstance(doc, dict):
        try:  # signed again after the mutation: the checks behind the checksum are reached
            doc = {**doc, "checksum": fmt.checksum(doc)}
        except (TypeError, ValueError):
            pass
    text = json.dumps(doc, indent=data.draw(st.sampled_from([None, 1])))
    for mark, raw in RAW.items():  # the first of each: a grown document repeats them
        text = text.replace(json.dumps(mark), raw, 1).replace(json.dumps(mark), "0")
    edit = data.draw(st.sampled_from(["none", "none", "number", "number", "truncate",
                                      "insert"]), label="edit")
    numbers = list(re.finditer(r"\d+", text))
    if edit == "number" and numbers:  # a number (or a shape key's) of any size, in place
        m = data.draw(st.sampled_from(numbers), label="number")
        text = text[:m.start()] + data.draw(st.sampled_from(
            ["7" * 5000, "1" * 4301, "9" * 101, "2" * 100, "1e99999", "0" * 50,
             str(2 ** 128 + 1), "5.5"]), label="digits") + text[m.end():]
    elif edit == "truncate":
        text = text[: data.draw(st.integers(0, len(text)), label="cut")]
    elif edit == "insert":
        at = data.draw(st.integers(0, len(text)), label="at")
        text = text[:at] + data.draw(st.sampled_from(
            ["{", "]", ",", "\x00", "\ud800", '"', "7" * 5000, "[" * 5000, "\\u0000",
             "NaN", "1e400"]), label="insert") + text[at:]
    return text.encode("utf-8", "surrogatepass")


FILE_KINDS = ["file"] * 6 + ["directory", "fifo", "unreadable", "symlink_loop",
                             "dangling_symlink", "device", "unreadable_dir", "empty"]


def _place(path: Path, kind: str, raw: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind in ("file", "unreadable", "unreadable_dir"):
        path.write_bytes(raw)
        if kind == "unreadable":
            path.chmod(0)
        elif kind == "unreadable_dir":
            path.parent.chmod(0)
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "directory":
        path.mkdir()
        (path / "x.json").write_bytes(raw)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink_loop":
        path.symlink_to(path.name)
    elif kind == "dangling_symlink":
        path.symlink_to("missing.json")
    elif kind == "device":
        path.symlink_to("/dev/zero")


def test_lookup_never_raises_or_hangs_on_any_pack_file(capsys):
    @settings(max_examples=150, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(data=st.data())
    def check(data: st.DataObject) -> None:
        base = data.draw(st.sampled_from(BASES), label="base")
        kernel, hw, dtype, shape, _ = base
        what = data.draw(st.sampled_from(["pack", "pack", "pack", "bytes", "records"]),
                         label="content")
        if what == "bytes":
            raw = data.draw(st.binary(max_size=400), label="bytes")
        elif what == "records":
            recs = [_mutate(data, _record(base)) for _ in range(data.draw(st.integers(1, 2)))]
            raw = _text(data, recs, sign=False)
        else:
            raw = _text(data, _mutate(data, _pack(base)), sign=data.draw(st.booleans()))
        kind = data.draw(st.sampled_from(FILE_KINDS), label="file kind")
        with tempfile.TemporaryDirectory(prefix="fuzz-packs-") as tmp:
            root = Path(tmp) / "packs"
            path = root / hw / f"{kernel}.json"
            _place(path, kind, raw)
            try:
                packs.configure([root])
                with within(20), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    for _ in range(2):  # the second: the cached pack, the fast path
                        cfg = packs.lookup(kernel, dtype, hw, **shape)
                        hit = packs.lookup_entry(kernel, dtype, hw, **shape)
                assert dict(cfg) == hit.config and hit.source in ("exact", "nearest",
                                                                  "default")
                event(f"{what} in a {kind}: {hit.source}")
                for argv, codes in (
                        (["list", "--dir", str(root), "--json"], (0,)),
                        (["show", str(path)], (0, 2)),
                        (["merge", str(path), "--out", str(Path(tmp) / "out.json")], (0, 2)),
                        (["merge", str(path), "--dir", str(Path(tmp) / "merged")], (0, 2))):
                    with within(20):
                        code = main(["packs", *argv])
                    out = capsys.readouterr()
                    assert code in codes, (argv, code, out.err[-2000:], raw[:300])
                    assert "Traceback" not in out.err + out.out, out.err[-3000:]
                if hit.source != "default":  # served: the file is a pack that passed
                    # (as root, "unreadable" files and directories are read all the same)
                    assert what == "pack" and kind in ("file", "unreadable", "unreadable_dir")
            finally:
                packs.configure(None)
                if kind == "unreadable_dir":
                    path.parent.chmod(0o755)

    check()


def test_the_bases_are_valid(tmp_path):
    """The fuzzer mutates valid packs and records: each base alone is served exactly, and
    merges."""
    for base in BASES:
        kernel, hw, dtype, shape, _ = base
        fmt.write(fmt.pack_path(tmp_path, hw, kernel), _pack(base))
        packs.configure([tmp_path])
        try:
            assert packs.lookup_entry(kernel, dtype, hw, **shape).source == "exact"
        finally:
            packs.configure(None)
        rec = tmp_path / f"{kernel}-online.json"
        rec.write_text(json.dumps([_record(base)]))
        assert main(["packs", "merge", str(rec), "--dir", str(tmp_path / "m")]) == 0
