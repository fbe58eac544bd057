"""Pack format and runtime lookup: exact, nearest, default fallback, integrity."""

from __future__ import annotations

import json
import warnings

import pytest

from harness import packs
from harness.packs import format as fmt

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
    from harness import kernel_api

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
