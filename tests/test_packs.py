"""Pack format and runtime lookup: exact, nearest, default fallback, integrity."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from harness import packs
from harness.packs import format as fmt
from harness.packs import schema
from harness.packs.lookup import SHIPPED as SHIPPED_DIR

SHAPE = {"M": 4096, "N": 1408, "K": 2048, "E": 64}


def _entry(block_m: int) -> dict:
    return {"config": {"BLOCK_M": block_m, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8,
                       "num_warps": 8, "num_stages": 4, "PERSISTENT": 1},
            "metrics": {"latency_ms": 0.5}, "provenance": {"device_name": "NVIDIA H100"}}


@pytest.fixture
def pack_dir(tmp_path):
    packs.freeze(tmp_path, "H100", "grouped_gemm", "bf16", {
        "M=4096,N=1408,K=2048,E=64": _entry(64),
        "M=65536,N=1408,K=2048,E=64": _entry(256),
    })
    packs.configure([tmp_path])
    yield tmp_path
    packs.configure(None)


def test_exact_hit(pack_dir):
    hit = packs.lookup_entry("grouped_gemm", "bf16", "H100", **SHAPE)
    assert hit.source == "exact" and hit.config["BLOCK_M"] == 64
    assert hit.path == str(pack_dir / "H100" / "grouped_gemm.json")


def test_nearest_in_log_space(pack_dir):
    # 40000 is nearer 65536 than 4096 in log2 space (0.71 vs 3.29).
    hit = packs.lookup_entry("grouped_gemm", "bf16", "H100", **{**SHAPE, "M": 40000})
    assert hit.source == "nearest" and hit.config["BLOCK_M"] == 256
    hit = packs.lookup_entry("grouped_gemm", "bf16", "H100", **{**SHAPE, "M": 2048})
    assert hit.config["BLOCK_M"] == 64


def test_exact_dims_must_match_else_default(pack_dir):
    from harness.kernel import api as kernel_api

    default = kernel_api.get("grouped_gemm").default_config
    with pytest.warns(packs.PackWarning, match="default config"):
        hit = packs.lookup_entry("grouped_gemm", "bf16", "H100", **{**SHAPE, "N": 4096})
    assert hit.source == "default" and hit.config == default


def test_no_pack_for_hardware_falls_back_with_warning(pack_dir):
    with pytest.warns(packs.PackWarning, match="no A100 pack"):
        hit = packs.lookup_entry("grouped_gemm", "bf16", "A100", **SHAPE)
    assert hit.source == "default"


def test_merge_keeps_other_entries(pack_dir):
    packs.freeze(pack_dir, "H100", "grouped_gemm", "fp16", {"M=1,N=1408,K=2048,E=64": _entry(16)})
    data = packs.read(pack_dir / "H100" / "grouped_gemm.json")
    assert set(data["kernels"]["grouped_gemm"]) == {"bf16", "fp16"}
    assert len(data["kernels"]["grouped_gemm"]["bf16"]) == 2


@pytest.mark.parametrize("damage", ["truncate", "tamper", "schema", "garbage"])
def test_damaged_pack_is_rejected_and_lookup_falls_back(pack_dir, damage):
    path = pack_dir / "H100" / "grouped_gemm.json"
    text = path.read_text()
    if damage == "truncate":
        path.write_text(text[: len(text) // 2])
    elif damage == "tamper":
        data = json.loads(text)
        data["kernels"]["grouped_gemm"]["bf16"]["M=4096,N=1408,K=2048,E=64"]["config"][
            "BLOCK_M"] = 512
        path.write_text(json.dumps(data))
    elif damage == "schema":
        data = json.loads(text)
        data["schema_version"] = 99
        path.write_text(json.dumps(data))
    else:
        path.write_bytes(b"\x00\xff not json")
    with pytest.raises(fmt.PackError, match=str(path)):
        packs.read(path)
    packs.configure([pack_dir])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hit = packs.lookup_entry("grouped_gemm", "bf16", "H100", **SHAPE)
    assert hit.source == "default"
    assert any(str(path) in str(w.message) for w in caught)


def test_write_is_atomic_and_checksummed(tmp_path):
    path = fmt.write(tmp_path / "x" / "k.json", {**fmt.empty("H100", "k"), "note": float("nan")})
    data = json.loads(path.read_text())
    assert data["note"] is None and data["checksum"] == fmt.checksum(data)
    assert [p.name for p in path.parent.iterdir()] == ["k.json"]  # no temp files left


# -- schema: the published JSON Schema, and every shipped pack against it ----------------
SHIPPED = sorted(SHIPPED_DIR.glob("*/*.json"))


def _schema_validator():
    jsonschema = pytest.importorskip("jsonschema")
    schema = fmt.json_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_schema_and_shipped_packs_are_package_data():
    text = Path(__file__).resolve().parents[1].joinpath("pyproject.toml").read_text()
    assert '"harness.packs" = ["pack.schema.json", "shipped/*/*.json"]' in text
    assert fmt.json_schema()["properties"]["schema_version"]["const"] == fmt.SCHEMA_VERSION
    assert SHIPPED_DIR.is_relative_to(Path(packs.__file__).parent)


def test_published_schema_is_the_models():
    """pack.schema.json is generated from the pydantic models (schema.json_schema):
    regenerate it when they change."""
    assert fmt.json_schema() == schema.json_schema()


def test_packs_are_shipped():
    assert {p.parent.name for p in SHIPPED} == {"H100", "H200"}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_shipped_pack_follows_schema_and_kernel_constraints(path):
    validator = _schema_validator()
    data = json.loads(path.read_text())
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(data)]
    assert not errors, errors
    assert packs.read(path) == data  # checksum and the runtime's own schema check
    assert (data["hardware"], data["kernel"]) == (path.parent.name, path.stem)
    from harness.kernel import api as kernel_api
    from harness.measure.hardware import spec_for_key

    fam = kernel_api.get(data["kernel"])
    for kname, _, skey, entry in fmt.iter_entries(data):
        assert kname == fam.name
        shape = fam.validate_shape(fam.parse_shape_key(skey))
        assert fam.check_config(entry["config"], shape, spec_for_key(data["hardware"])) is None
        prov = entry["provenance"]
        assert prov["triton"] and prov["torch"] and prov["device_name"] and prov["date"]
        assert prov.get("interpreted") is False, "shipped packs come from GPU runs"
        assert entry["metrics"]["latency_ms"] > 0


def _good_pack() -> dict:
    data = fmt.empty("H100", "grouped_gemm")
    data["kernels"]["grouped_gemm"]["bf16"] = {"M=4096,N=1408,K=2048,E=64": _entry(64)}
    return json.loads(fmt.dumps(data))


def _break(data: dict, how: str) -> dict:
    e = data["kernels"]["grouped_gemm"]["bf16"]["M=4096,N=1408,K=2048,E=64"]
    if how == "config_list":
        e["config"]["BLOCK_M"] = [64]
    elif how == "config_null":
        e["config"]["BLOCK_M"] = None
    elif how == "no_metrics":
        del e["metrics"]
    elif how == "no_provenance":
        del e["provenance"]
    elif how == "empty_config":
        e["config"] = {}
    elif how == "bad_shape_key":
        data["kernels"]["grouped_gemm"]["bf16"]["M=4096;N=1"] = e
    elif how == "bad_hardware":
        data["hardware"] = "../etc"
    elif how == "kernels_list":
        data["kernels"] = []
    elif how == "negative_latency":
        e["metrics"]["latency_ms"] = -1.0
    elif how == "triton_number":
        e["provenance"]["triton"] = 3.6
    elif how == "no_kernel":
        del data["kernel"]
    data["checksum"] = fmt.checksum(data)  # a well-signed but malformed pack
    return data


BREAKS = ["config_list", "config_null", "no_metrics", "no_provenance", "empty_config",
          "bad_shape_key", "bad_hardware", "kernels_list", "negative_latency",
          "triton_number", "no_kernel"]


def test_runtime_checks_agree_with_json_schema_on_a_good_pack():
    validator = _schema_validator()
    data = _good_pack()
    assert not list(validator.iter_errors(data))
    assert fmt.schema_error(data) is None


@pytest.mark.parametrize("how", BREAKS)
def test_runtime_checks_agree_with_json_schema_on_bad_packs(how, tmp_path):
    validator = _schema_validator()
    data = _break(_good_pack(), how)
    assert list(validator.iter_errors(data)), "the JSON Schema should reject it"
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(fmt.PackError, match=f"{path}: wrong schema"):
        packs.read(path)


def _caught(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(w.message) for w in caught if issubclass(w.category, packs.PackWarning)]


def _write_signed(pack_dir, data):
    path = pack_dir / data["hardware"] / f"{data['kernel']}.json"
    fmt.write(path, data)
    packs.configure([pack_dir])
    return path


def test_config_failing_kernel_constraints_rejects_the_pack(pack_dir):
    data = packs.read(pack_dir / "H100" / "grouped_gemm.json")
    data["kernels"]["grouped_gemm"]["bf16"]["M=4096,N=1408,K=2048,E=64"]["config"][
        "BLOCK_M"] = 24  # not a power of two: check_config refuses it
    path = _write_signed(pack_dir, data)
    packs.read(path)  # schema and checksum are fine: only the kernel knows
    hit, msgs = _caught(lambda: packs.lookup_entry("grouped_gemm", "bf16", "H100", **SHAPE))
    assert hit.source == "default"
    assert any(str(path) in m and "constraints on H100" in m and "BLOCK_M=24" in m
               for m in msgs), msgs


def test_constraints_are_checked_for_the_packs_hardware(tmp_path):
    # 4 stages of 256x256x64 tiles (256 KiB of shared memory) fit no Hopper block.
    big = {**_entry(256), "config": {**_entry(256)["config"], "BLOCK_N": 256, "BLOCK_K": 64,
                                     "num_stages": 4}}
    packs.freeze(tmp_path, "H100", "grouped_gemm", "bf16", {"M=4096,N=1408,K=2048,E=64": big})
    packs.configure([tmp_path])
    try:
        hit, msgs = _caught(lambda: packs.lookup_entry("grouped_gemm", "bf16", "H100", **SHAPE))
    finally:
        packs.configure(None)
    assert hit.source == "default" and any("shared memory" in m for m in msgs)


def test_pack_in_the_wrong_directory_is_rejected(pack_dir):
    src = pack_dir / "H100" / "grouped_gemm.json"
    dst = pack_dir / "A100" / "grouped_gemm.json"
    dst.parent.mkdir()
    dst.write_bytes(src.read_bytes())
    hit, msgs = _caught(lambda: packs.lookup_entry("grouped_gemm", "bf16", "A100", **SHAPE))
    assert hit.source == "default"
    assert any(str(dst) in m and "for hardware 'H100'" in m for m in msgs), msgs


def test_shape_key_of_another_kernel_is_rejected(pack_dir):
    data = packs.read(pack_dir / "H100" / "grouped_gemm.json")
    data["kernels"]["grouped_gemm"]["bf16"]["rows=4,cols=8"] = _entry(64)
    path = _write_signed(pack_dir, data)
    hit, msgs = _caught(lambda: packs.lookup_entry("grouped_gemm", "bf16", "H100", **SHAPE))
    assert hit.source == "default" and any(str(path) in m and "rows=4" in m for m in msgs)


def test_rejected_pack_warns_once_and_never_raises(pack_dir):
    path = pack_dir / "H100" / "grouped_gemm.json"
    path.write_text("{")
    packs.configure([pack_dir])
    _, msgs = _caught(lambda: [packs.lookup("grouped_gemm", "bf16", "H100", **{**SHAPE, "M": m})
                               for m in (1, 2, 3, 4)])
    assert len(msgs) == 1 and str(path) in msgs[0] and "ignoring pack" in msgs[0], msgs
    assert packs.load("H100", "grouped_gemm") == (None, None)


# -- versions -----------------------------------------------------------------------------
def _versioned(triton: str, torch: str | None = None) -> dict:
    e = _entry(128)
    e["provenance"] = {"device_name": "NVIDIA H100", "triton": triton,
                       "torch": torch or packs.runtime_versions()["torch"]}
    return e


@pytest.fixture
def old_pack(tmp_path):
    packs.freeze(tmp_path, "H100", "grouped_gemm", "bf16", {
        "M=4096,N=1408,K=2048,E=64": _versioned("2.0.0"),
        "M=65536,N=1408,K=2048,E=64": _versioned("2.0.0"),
    })
    packs.configure([tmp_path], strict=None)
    yield tmp_path / "H100" / "grouped_gemm.json"
    packs.configure(None, strict=None)


def test_other_triton_version_is_used_with_one_warning(old_pack):
    def go():
        return [packs.lookup_entry("grouped_gemm", "bf16", "H100", **{**SHAPE, "M": m})
                for m in (4096, 65536, 1000, 4096)]

    hits, msgs = _caught(go)
    assert all(h.source in ("exact", "nearest") and h.config["BLOCK_M"] == 128 for h in hits)
    assert len(msgs) == 1 and str(old_pack) in msgs[0] and "triton 2.0.0" in msgs[0]


def test_strict_mode_refuses_other_versions(old_pack):
    packs.configure(strict=True)
    assert packs.strict()
    hits, msgs = _caught(lambda: [packs.lookup_entry("grouped_gemm", "bf16", "H100", **SHAPE)
                                  for _ in range(3)])
    assert all(h.source == "default" for h in hits)
    assert len(msgs) == 1 and "strict mode refuses" in msgs[0] and str(old_pack) in msgs[0]


def test_strict_mode_from_environment(old_pack, monkeypatch):
    monkeypatch.setenv("HARNESS_PACKS_STRICT", "1")
    packs.configure(strict=None)  # back to the environment; drops cached packs
    hit, _ = _caught(lambda: packs.lookup_entry("grouped_gemm", "bf16", "H100", **SHAPE))
    assert hit.source == "default"
    monkeypatch.setenv("HARNESS_PACKS_STRICT", "0")
    packs.configure(strict=None)
    hit, _ = _caught(lambda: packs.lookup_entry("grouped_gemm", "bf16", "H100", **SHAPE))
    assert hit.source == "exact"


def test_same_release_with_another_local_build_is_not_another_version(tmp_path):
    now = packs.runtime_versions()
    packs.freeze(tmp_path, "H100", "grouped_gemm", "bf16", {
        "M=4096,N=1408,K=2048,E=64": _versioned(now["triton"] + "+local",
                                                now["torch"].split("+")[0] + "+cu999")})
    packs.configure([tmp_path], strict=True)
    try:
        hit, msgs = _caught(lambda: packs.lookup_entry("grouped_gemm", "bf16", "H100", **SHAPE))
    finally:
        packs.configure(None, strict=None)
    assert hit.source == "exact" and not msgs


# -- the fast path ------------------------------------------------------------------------
def test_lookup_returns_a_shared_read_only_mapping(pack_dir):
    a = packs.lookup("grouped_gemm", "bf16", "H100", **SHAPE)
    b = packs.lookup("grouped_gemm", "bf16", "H100", **SHAPE)
    assert a is b and a["BLOCK_M"] == 64 and dict(a) == packs.lookup_entry(
        "grouped_gemm", "bf16", "H100", **SHAPE).config
    with pytest.raises(TypeError):
        a["BLOCK_M"] = 1  # the cache cannot be poisoned by a caller
    # Another keyword order is the same shape.
    assert packs.lookup("grouped_gemm", "bf16", "H100", E=64, K=2048, N=1408, M=4096) == a


def test_configure_drops_resolved_lookups(pack_dir, tmp_path_factory):
    assert packs.lookup("grouped_gemm", "bf16", "H100", **SHAPE)["BLOCK_M"] == 64
    other = tmp_path_factory.mktemp("other")
    packs.freeze(other, "H100", "grouped_gemm", "bf16", {"M=4096,N=1408,K=2048,E=64":
                                                        _entry(32)})
    packs.configure([other])
    assert packs.lookup("grouped_gemm", "bf16", "H100", **SHAPE)["BLOCK_M"] == 32


# -- stats and misses ---------------------------------------------------------------------
@pytest.fixture
def counting(pack_dir):
    packs.reset_stats()
    yield pack_dir
    packs.reset_stats()


def test_stats_count_every_call_and_misses_each_shape(counting):
    def go():
        for _ in range(3):
            packs.lookup("grouped_gemm", "bf16", "H100", **SHAPE)                 # exact
            packs.lookup("grouped_gemm", "bf16", "H100", **{**SHAPE, "M": 40000})  # nearest
            packs.lookup("grouped_gemm", "bf16", "H100", **{**SHAPE, "N": 4096})   # default
        packs.lookup("grouped_gemm", "bf16", "A100", **SHAPE)                      # no pack

    _caught(go)
    assert packs.stats == {"exact": 3, "nearest": 3, "family": 0, "default": 4}
    recs = {(r["hardware"], r["shape_key"]): r for r in packs.misses()}
    assert set(recs) == {("H100", "M=40000,N=1408,K=2048,E=64"),
                         ("H100", "M=4096,N=4096,K=2048,E=64"),
                         ("A100", "M=4096,N=1408,K=2048,E=64")}
    near = recs[("H100", "M=40000,N=1408,K=2048,E=64")]
    assert near["source"] == "nearest" and near["entry"] == "M=65536,N=1408,K=2048,E=64"
    assert near["calls"] == 3
    assert recs[("A100", "M=4096,N=1408,K=2048,E=64")]["source"] == "default"


def test_misses_file_is_a_valid_experiment(counting, tmp_path):
    from harness import experiment

    _caught(lambda: [packs.lookup("grouped_gemm", "bf16", hw, **{**SHAPE, "M": m})
                     for hw in ("H100", "A100") for m in (100, 40000)])
    (path,) = packs.write_misses(tmp_path / "misses.yaml")
    assert path == tmp_path / "misses.yaml"
    exp = experiment.load(path)
    assert exp.kernel == "grouped_gemm" and exp.dtypes == ["bf16"]
    assert exp.hardware == ["A100", "H100"]
    assert {s["M"] for s in exp.shapes} == {100, 40000}
    assert "kharness run" in path.read_text()
    # Without near-misses only the A100 shapes (no pack) and M=100 on H100... which is a
    # near-miss too: every H100 shape has a nearest entry.
    (path,) = packs.write_misses(tmp_path / "strict.yaml", include_nearest=False)
    assert experiment.load(path).hardware == ["A100"]


def test_misses_of_several_kernels_give_one_file_each(counting, tmp_path):
    from harness import experiment

    _caught(lambda: (packs.lookup("grouped_gemm", "bf16", "A100", **SHAPE),
                     packs.lookup("silu", "fp16", "A100", rows=8, cols=4096)))
    paths = packs.write_misses(tmp_path / "misses.yaml")
    assert paths == [tmp_path / "misses_grouped_gemm.yaml", tmp_path / "misses_silu.yaml"]
    silu = experiment.load(paths[1])
    assert silu.kernel == "silu" and silu.shapes == [{"rows": 8, "cols": 4096}]
    assert silu.dtypes == ["fp16"]


def test_no_misses_writes_nothing(counting, tmp_path):
    packs.lookup("grouped_gemm", "bf16", "H100", **SHAPE)
    assert packs.write_misses(tmp_path / "m.yaml") == [] and not (tmp_path / "m.yaml").exists()


def test_misses_file_written_at_exit(tmp_path):
    import os
    import subprocess
    import sys

    out = tmp_path / "exit-misses.yaml"
    code = ("import warnings; warnings.simplefilter('ignore'); from harness import packs; "
            "packs.lookup('grouped_gemm', 'bf16', 'A100', M=4096, N=1408, K=2048, E=64)")
    env = {**os.environ, "HARNESS_PACKS_MISSES": str(out), "HARNESS_PACKS": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr
    from harness import experiment

    assert experiment.load(out).shapes == [SHAPE]


def test_a_miss_warns_once_per_layer_not_per_batch_size(pack_dir):
    hits, msgs = _caught(lambda: [packs.lookup_entry("grouped_gemm", "bf16", "H100",
                                                     **{**SHAPE, "N": 4096, "M": m})
                                  for m in (1, 16, 300, 5000)])
    assert all(h.source == "default" for h in hits)
    assert len(msgs) == 1 and "default config" in msgs[0]


# -- the runtime's checks: types, size, mode ----------------------------------------------
@pytest.mark.parametrize(("value", "words"), [("128", "'128' is not of type int"),
                                              (True, "True is not of type int"),
                                              (64.0, "64.0 is not of type int")])
def test_config_value_of_the_wrong_type_rejects_the_pack(pack_dir, value, words):
    data = packs.read(pack_dir / "H100" / "grouped_gemm.json")
    data["kernels"]["grouped_gemm"]["bf16"]["M=4096,N=1408,K=2048,E=64"]["config"][
        "BLOCK_M"] = value
    path = _write_signed(pack_dir, data)
    hit, msgs = _caught(lambda: packs.lookup_entry("grouped_gemm", "bf16", "H100", **SHAPE))
    assert hit.source == "default"
    assert len(msgs) == 1 and str(path) in msgs[0] and words in msgs[0]


def test_unknown_tunable_rejects_the_pack(pack_dir):
    data = packs.read(pack_dir / "H100" / "grouped_gemm.json")
    data["kernels"]["grouped_gemm"]["bf16"]["M=4096,N=1408,K=2048,E=64"]["config"][
        "BLOCK_Q"] = 1
    _write_signed(pack_dir, data)
    hit, msgs = _caught(lambda: packs.lookup_entry("grouped_gemm", "bf16", "H100", **SHAPE))
    assert hit.source == "default" and "unknown tunable 'BLOCK_Q'" in msgs[0]


def test_a_pack_above_the_size_cap_is_refused_unread(tmp_path):
    import time

    data = _good_pack()
    big = {f"M={m},N=1408,K=2048,E=64": _entry(64) for m in range(1, 40000)}
    data["kernels"]["grouped_gemm"]["bf16"].update(big)
    path = fmt.write(tmp_path / "H100" / "grouped_gemm.json", data)
    assert path.stat().st_size > fmt.MAX_BYTES
    for where in ("valid", "tampered"):
        if where == "tampered":
            path.write_text(path.read_text().replace('"BLOCK_M": 64', '"BLOCK_M": 32', 1))
        t0 = time.monotonic()
        with pytest.raises(fmt.PackError, match="refused unread"):
            packs.read(path)
        assert time.monotonic() - t0 < 0.5
    with pytest.raises(fmt.PackError, match="refused unread"):
        fmt.loads(path.read_bytes(), "bytes")


def test_packs_are_written_readable_by_others_and_atomically(tmp_path):
    import os
    import stat

    old = os.umask(0o022)
    try:
        path = packs.freeze(tmp_path, "H100", "grouped_gemm", "bf16",
                            {"M=4096,N=1408,K=2048,E=64": _entry(64)})
        assert stat.S_IMODE(path.stat().st_mode) == 0o644
        os.umask(0o077)  # a stricter umask is respected
        path = fmt.write(tmp_path / "H100" / "other.json", fmt.empty("H100", "other"))
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    finally:
        os.umask(old)
    # No temporary file left; freeze's lock file (hidden) stays, as flock needs.
    assert sorted(p.name for p in (tmp_path / "H100").iterdir()) == [
        ".grouped_gemm.json.lock", "grouped_gemm.json", "other.json"]
