"""GPUs nobody tuned for: lookup falls back from a hardware key's own pack to its GPU
family's (same architecture), then to the default config; real packs in tmp dirs."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest

from harness import packs
from harness.cli.main import main as kharness
from harness.kernel import api as kernel_api
from harness.measure import families, hardware

SHAPE = {"M": 4096, "N": 1408, "K": 2048, "E": 64}
SK = "M=4096,N=1408,K=2048,E=64"


def _entry(block_m: int, device: str) -> dict[str, Any]:
    v = packs.runtime_versions()
    return {"config": {"BLOCK_M": block_m, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8,
                       "num_warps": 8, "num_stages": 4, "PERSISTENT": 1},
            "metrics": {"latency_ms": 0.5},
            "provenance": {"device_name": device, "triton": v["triton"], "torch": v["torch"]}}


@pytest.fixture
def root(tmp_path):
    """An H100 pack (BLOCK_M 64) and an H200 pack (BLOCK_M 256) of the grouped GEMM."""
    packs.freeze(tmp_path, "H100", "grouped_gemm", "bf16",
                 {SK: _entry(64, "NVIDIA H100 80GB HBM3")})
    packs.freeze(tmp_path, "H200", "grouped_gemm", "bf16",
                 {SK: _entry(256, "NVIDIA H200"),
                  "M=65536,N=1408,K=2048,E=64": _entry(128, "NVIDIA H200")})
    packs.configure([tmp_path])
    packs.reset_stats()
    yield tmp_path
    packs.configure(None)
    packs.reset_stats()


def _caught(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(w.message) for w in caught if issubclass(w.category, packs.PackWarning)]


@pytest.mark.parametrize("device", ["NVIDIA H800", "NVIDIA GH200 480GB", "NVIDIA H100 PCIe",
                                    "NVIDIA H100 NVL", "NVIDIA H20"])
def test_an_untuned_hopper_gets_the_closest_siblings_pack_with_one_warning(root, device):
    key = hardware.hardware_key(device)
    assert key not in ("H100", "H200") and families.family_of(key).arch == "sm_90"

    def go():
        return [packs.lookup_entry("grouped_gemm", "bf16", key, **{**SHAPE, "M": m})
                for m in (4096, 4096, 3000, 50000, 7)]

    hits, msgs = _caught(go)
    # Of the two packs, H100's is the closer for each of them (SM count and bandwidth).
    assert [s for s in families.siblings(key) if s in ("H100", "H200")][0] == "H100"
    assert {h.source for h in hits} == {"family"} and {h.hardware for h in hits} == {"H100"}
    assert hits[0].path == str(root / "H100" / "grouped_gemm.json")
    assert hits[0].shape_key == SK and hits[0].config["BLOCK_M"] == 64
    assert len(msgs) == 1, msgs  # once per kernel and device, whatever the shapes
    assert "using the H100 pack" in msgs[0] and "NVIDIA H100 80GB HBM3" in msgs[0]
    assert f"on {key}:" in msgs[0] and "Hopper" in msgs[0]
    # A family hit is a miss of this GPU: counted and recorded for tuning it.
    assert packs.stats["family"] == 5 and packs.stats["default"] == 0
    rec = next(r for r in packs.misses() if r["shape"]["M"] == 4096)
    assert rec["hardware"] == key and rec["source"] == "family" and "H100 pack" in rec["why"]


def test_the_h100_parts_prefer_the_h100_pack(root):
    for device in ("NVIDIA H800", "NVIDIA H100 PCIe", "NVIDIA H100 NVL"):
        key = hardware.hardware_key(device)
        hit, _ = _caught(lambda key=key: packs.lookup_entry("grouped_gemm", "bf16", key,
                                                            **SHAPE))
        assert (hit.source, hit.hardware, hit.config["BLOCK_M"]) == ("family", "H100", 64)


def test_the_exact_key_still_wins(root):
    packs.freeze(root, "H800", "grouped_gemm", "bf16", {SK: _entry(32, "NVIDIA H800")})
    hit, msgs = _caught(lambda: packs.lookup_entry("grouped_gemm", "bf16", "H800", **SHAPE))
    assert (hit.source, hit.hardware, hit.config["BLOCK_M"]) == ("exact", "H800", 32)
    assert msgs == []
    # Its nearest entry too: the family is asked only where the own pack has none.
    hit, msgs = _caught(lambda: packs.lookup_entry("grouped_gemm", "bf16", "H800",
                                                   **{**SHAPE, "M": 65536}))
    assert (hit.source, hit.hardware, hit.config["BLOCK_M"]) == ("nearest", "H800", 32)
    # H100 itself: its own pack, never H200's.
    hit, _ = _caught(lambda: packs.lookup_entry("grouped_gemm", "bf16", "H100", **SHAPE))
    assert (hit.source, hit.hardware) == ("exact", "H100")


def test_an_own_pack_without_the_shape_passes_to_the_family(root):
    # The own pack has fp16 entries only: a bf16 lookup goes on to the siblings.
    packs.freeze(root, "H800", "grouped_gemm", "fp16", {SK: _entry(32, "NVIDIA H800")})
    hit, msgs = _caught(lambda: packs.lookup_entry("grouped_gemm", "bf16", "H800", **SHAPE))
    assert (hit.source, hit.hardware) == ("family", "H100")
    assert len(msgs) == 1 and "has no bf16 entry" in msgs[0]
    # ... and one with no entry anywhere in the family (another N) gets the default.
    hit, msgs = _caught(lambda: packs.lookup_entry("grouped_gemm", "bf16", "H800",
                                                   **{**SHAPE, "N": 4096}))
    assert hit.source == "default" and len(msgs) == 1 and "default config" in msgs[0]


def test_an_unknown_architecture_gets_the_default_with_the_usual_warning(root):
    key = hardware.hardware_key("NVIDIA GeForce RTX 5090")
    assert families.family_of(key) is None and families.siblings(key) == ()
    hit, msgs = _caught(lambda: packs.lookup_entry("grouped_gemm", "bf16", key, **SHAPE))
    default = kernel_api.get("grouped_gemm").default_config
    assert hit.source == "default" and hit.config == default and hit.hardware is None
    assert len(msgs) == 1 and f"no {key} pack for grouped_gemm" in msgs[0]
    # The CPU has no family either.
    hit, _ = _caught(lambda: packs.lookup_entry("grouped_gemm", "bf16", "cpu", **SHAPE))
    assert hit.source == "default"


def _damage(path: Path, how: str) -> None:
    if how == "garbage":
        path.write_bytes(os.urandom(300))
    elif how == "truncated":
        path.write_text(path.read_text()[:100])
    elif how == "tampered":
        data = json.loads(path.read_text())
        data["kernels"]["grouped_gemm"]["bf16"][SK]["config"]["BLOCK_M"] = 16
        path.write_text(json.dumps(data))
    elif how == "directory":
        path.unlink()
        path.mkdir()
    elif how == "fifo":
        path.unlink()
        os.mkfifo(path)


@pytest.mark.parametrize("how", ["garbage", "truncated", "tampered", "directory", "fifo"])
def test_a_malformed_family_pack_falls_through_to_the_next(root, how):
    _damage(root / "H100" / "grouped_gemm.json", how)
    hit, msgs = _caught(lambda: packs.lookup_entry("grouped_gemm", "bf16", "H800", **SHAPE))
    # H800's order: H100 (rejected), H100-NVL, GH200 (no packs), then H200.
    assert (hit.source, hit.hardware, hit.config["BLOCK_M"]) == ("family", "H200", 256)
    assert any("ignoring pack" in m and str(root / "H100") in m for m in msgs), msgs
    assert sum("using the H200 pack" in m for m in msgs) == 1
    # Every sibling bad: the default config, still without raising.
    _damage(root / "H200" / "grouped_gemm.json", how)
    packs.configure([root])
    hit, _ = _caught(lambda: packs.lookup_entry("grouped_gemm", "bf16", "H800", **SHAPE))
    assert hit.source == "default"


def test_a_rejected_own_pack_falls_through_to_the_family(root):
    (root / "H100" / "grouped_gemm.json").write_text("{")
    hit, msgs = _caught(lambda: packs.lookup_entry("grouped_gemm", "bf16", "H100", **SHAPE))
    assert (hit.source, hit.hardware) == ("family", "H200")
    assert len(msgs) == 2 and "ignoring pack" in msgs[0] and "using the H200 pack" in msgs[1]


def test_the_fast_path_caches_the_family_resolution(root):
    first, _ = _caught(lambda: packs.lookup("grouped_gemm", "bf16", "H800", **SHAPE))
    again, msgs = _caught(lambda: packs.lookup("grouped_gemm", "bf16", "H800", **SHAPE))
    assert again is first and msgs == [] and again["BLOCK_M"] == 64
    assert packs.stats["family"] == 2
    rec = packs.misses()[0]
    assert rec["calls"] == 2 and rec["source"] == "family"


def test_misses_of_a_family_hit_become_an_experiment_for_this_gpu(root, tmp_path):
    _caught(lambda: packs.lookup("grouped_gemm", "bf16", "H100-PCIe", **SHAPE))
    from harness import experiment

    (path,) = packs.write_misses(tmp_path / "misses.yaml")
    exp = experiment.load(path)
    assert exp.hardware == ["H100-PCIe"] and exp.shapes == [SHAPE]
    assert "family" in path.read_text()


def test_a_sibling_entry_that_fails_this_gpus_checks_is_not_served(tmp_path):
    """The H100 entry passes on H100 (132 SMs) but this kernel's own check refuses it on
    H100 PCIe (114 SMs): lookup goes on to the next entry, then the default."""

    class NeedsManySMs(type(kernel_api.get("rmsnorm"))):
        name = "rmsnorm"

        def check_config(self, config, shape, spec):
            if config["BLOCK_SIZE"] > 256 and spec.sm_count < 120:
                return f"BLOCK_SIZE {config['BLOCK_SIZE']} needs 120 SMs"
            return super().check_config(config, shape, spec)

    v = packs.runtime_versions()

    def e(bs: int) -> dict[str, Any]:
        return {"config": {"BLOCK_SIZE": bs, "num_warps": 4}, "metrics": {"latency_ms": 1.0},
                "provenance": {"device_name": "NVIDIA H100 80GB HBM3", **v}}

    packs.freeze(tmp_path, "H100", "rmsnorm", "bf16",
                 {"rows=8192,cols=4096": e(4096), "rows=8192,cols=256": e(256)})
    packs.configure([tmp_path])
    kern = NeedsManySMs()
    try:
        assert hardware.spec_for_key("H100-PCIe").sm_count == 114
        hit, _ = _caught(lambda: packs.lookup_entry(kern, "bf16", "H100-PCIe", rows=8192,
                                                    cols=4096))
        assert (hit.source, hit.hardware, hit.shape_key) == ("family", "H100",
                                                             "rows=8192,cols=256")
        hit, _ = _caught(lambda: packs.lookup_entry(kern, "bf16", "H800", rows=8192,
                                                    cols=4096))
        assert (hit.source, hit.shape_key) == ("family", "rows=8192,cols=4096")
    finally:
        packs.configure(None)


def test_pack_entry_reads_one_pack_only(root):
    assert packs.pack_entry("H800", "grouped_gemm", "bf16", SHAPE) is None
    hit = packs.pack_entry("H200", "grouped_gemm", "bf16", {**SHAPE, "M": 60000})
    assert (hit.source, hit.hardware, hit.shape_key) == ("nearest", "H200",
                                                         "M=65536,N=1408,K=2048,E=64")
    assert packs.stats == {"exact": 0, "nearest": 0, "family": 0, "default": 0}


# -- the table ----------------------------------------------------------------------------
def test_sibling_order_is_closest_first_then_the_tables_order():
    # Equal figures to H100's: H800 first for H100 (distance 0), H100 first for H800.
    assert families.siblings("H100")[0] == "H800"
    assert families.siblings("H800")[0] == "H100"
    assert families.siblings("H100-PCIe")[:2] == ("H100", "H800")  # same distance: table
    # An unknown part of a known architecture: its detected SM count orders them; with
    # nothing known, the table's order.
    assert families.siblings("NVIDIA-Foo", "sm_90", "NVIDIA Foo", 114)[0] == "H100-PCIe"
    table = tuple(m.key for m in families.FAMILIES["sm_90"].members)
    assert families.siblings("NVIDIA-Foo", "sm_90") == table
    assert families.siblings("V710") == () and families.family_of("V710").arch == "gfx1101"


def test_family_by_architecture_then_member_then_name_pattern():
    # The architecture the device reports decides first.
    assert families.family_of("NVIDIA-Bar", "sm_80").name.startswith("Ampere")
    # A derived key of a part with no key of its own: by its name.
    key = hardware.hardware_key("NVIDIA A800-SXM4-80GB")
    assert families.family_of(key).arch == "sm_80" and families.siblings(key) == ("A100",)
    assert families.family_of("GH200").arch == "sm_90"
    assert families.family_of("NVIDIA-GB200").arch == "sm_100"
    assert families.family_of("cpu") is None and families.family_of("x", "sm_999") is None
    spec = hardware.spec_for_key("H20")
    assert (spec.sm_count, spec.has_tma, spec.has_wgmma, spec.smem_per_block) == \
        (78, True, True, 227 * 1024)


def test_register_refuses_a_key_in_two_families_and_a_bad_pattern():
    with pytest.raises(ValueError, match="already belong to sm_90"):
        families.register(families.Family("sm_87", "Orin", "nvidia", 163 * 1024,
                                          (families.Member("H100", 16, 200),)))
    with pytest.raises(ValueError, match="pattern"):
        families.register(families.Family("sm_87", "Orin", "nvidia", 163 * 1024, (),
                                          patterns=("(",)))
    assert "sm_87" not in families.FAMILIES


def test_a_registered_family_serves_its_members(tmp_path):
    packs.freeze(tmp_path, "H100", "grouped_gemm", "bf16", {SK: _entry(64, "NVIDIA H100")})
    packs.configure([tmp_path])
    fam = families.Family("sm_90", "Hopper", "nvidia", 227 * 1024,
                          (*families.FAMILIES["sm_90"].members,
                           families.Member("H100-Custom", 132, 3350)), has_tma=True,
                          has_wgmma=True)
    old = families.register(fam) and families.FAMILIES["sm_90"]
    try:
        assert old is fam
        hit, _ = _caught(lambda: packs.lookup_entry("grouped_gemm", "bf16", "H100-Custom",
                                                    **SHAPE))
        assert (hit.source, hit.hardware) == ("family", "H100")
    finally:
        families.register(families.Family(
            "sm_90", "Hopper", "nvidia", 227 * 1024,
            tuple(m for m in fam.members if m.key != "H100-Custom"), has_tma=True,
            has_wgmma=True))
        packs.configure(None)


# -- the command line ---------------------------------------------------------------------
def test_packs_resolve_names_the_pack_a_device_would_use(root, capsys):
    assert kharness(["packs", "resolve", "--device", "NVIDIA H800", "--dir", str(root),
                      "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["hardware"] == "H800" and res["family_arch"] == "sm_90"
    assert res["order"][:2] == ["H800", "H100"]
    (row,) = res["kernels"]
    assert (row["kernel"], row["hardware"], row["source"]) == ("grouped_gemm", "H100", "family")
    # A malformed H100 pack is skipped, as lookup skips it.
    (root / "H100" / "grouped_gemm.json").write_text("{")
    assert kharness(["packs", "resolve", "--device", "NVIDIA H800", "--dir", str(root)]) == 0
    out = capsys.readouterr().out
    assert "H800 -> hardware H800; family Hopper (sm_90)" in out
    assert "H200 (family)" in out and "skipped H100: rejected" in out
    assert kharness(["packs", "resolve", "--device", "NVIDIA GeForce RTX 5090", "--dir",
                      str(root)]) == 0
    assert "no family" in capsys.readouterr().out


# -- the decorator ------------------------------------------------------------------------
def test_the_decorator_launches_the_family_pack(tmp_path):
    import torch
    import triton
    import triton.language as tl

    import harness

    @triton.jit
    def add_kernel(x_ptr, y_ptr, out_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
        offs = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        mask = offs < n_elements
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask)
                 + tl.load(y_ptr + offs, mask=mask), mask=mask)

    v = packs.runtime_versions()
    packs.freeze(tmp_path, "H100", "vector_add", "fp32", {"n_elements=1000": {
        "config": {"BLOCK_SIZE": 256, "num_warps": 4}, "metrics": {"latency_ms": 0.01},
        "provenance": {"device_name": "NVIDIA H100 80GB HBM3", **v}}})
    packs.configure([tmp_path])
    try:
        add = harness.autotune(kernel="vector_add", key=["n_elements"],
                               default={"BLOCK_SIZE": 32}, hardware_key="H800")(add_kernel)
        seen: list[int] = []

        def grid(meta):
            seen.append(meta["BLOCK_SIZE"])
            return (triton.cdiv(meta["n_elements"], meta["BLOCK_SIZE"]),)

        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(1000, generator=g), torch.randn(1000, generator=g)
        out = torch.empty_like(x)
        if torch.cuda.is_available():
            x, y, out = x.cuda(), y.cuda(), out.cuda()
        with pytest.warns(packs.PackWarning, match="using the H100 pack"):
            add[grid](x, y, out, x.numel())
        torch.testing.assert_close(out, x + y)
        (hit,) = add.hits.values()
        assert seen == [256] and (hit.source, hit.hardware) == ("family", "H100")
    finally:
        packs.configure(None)


@pytest.mark.gpu
def test_this_gpu_has_a_family_and_its_own_pack_wins():
    """On an H100 or H200: the architecture the device reports is in the table, the other
    one is its first shipped sibling, and its own shipped pack serves its own shapes."""
    spec, arch = hardware.current_device(), hardware.current_arch()
    fam = families.family_of(spec.key, arch, spec.name)
    assert fam is not None and fam.arch == arch, (spec, arch)
    if spec.key in ("H100", "H200"):
        other = "H200" if spec.key == "H100" else "H100"
        sibs = families.siblings(spec.key, arch, spec.name, spec.sm_count)
        assert [s for s in sibs if s in ("H100", "H200")] == [other]
        hit = packs.lookup_entry("grouped_gemm", "bf16", None, M=49152, N=1408, K=2048, E=64)
        assert (hit.source, hit.hardware) == ("exact", spec.key)


def test_the_docs_table_lists_the_registry() -> None:
    """docs/packs.md's family table is the registry's, row for row."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "packs.md").read_text()
    section = text.split("## GPUs nobody tuned for", 1)[1].split("\n## ", 1)[0]
    rows = [ln.split("|")[1:-1] for ln in section.splitlines() if ln.startswith("| `")]
    documented = {r[0].strip().strip("`"): (r[1].strip(), [k.strip() for k in r[2].split(",")])
                  for r in rows}
    assert documented == {a: (f.name, [m.key for m in f.members])
                          for a, f in families.FAMILIES.items()}
