"""Warm start: a new study's first trials are the winners of neighbouring shapes on this
hardware and of the same shape on other hardware, taken from the packs."""

from __future__ import annotations

from pathlib import Path

from harness.experiment import SearchSettings, StudySpec
from harness.kernel import api as kernel_api
from harness.measure.hardware import spec_for_key
from harness.packs import format as packfmt
from harness.search import Search, make_storage, storage_url
from harness.search.warmstart import incumbent, seeds_from_packs

MM = kernel_api.get("matmul")
SPACE = {"BLOCK_M": [64, 128], "BLOCK_N": [64, 128, 256], "BLOCK_K": [32, 64],
         "GROUP_M": [8], "num_warps": [4, 8], "num_stages": [3, 4]}


def _cfg(bm: int, bn: int, stages: int = 3) -> dict:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8,
            "num_stages": stages}


def _pack(root: Path, hw: str, entries: dict[str, dict]) -> None:
    packfmt.freeze(root, hw, "matmul", "bf16", {
        k: {"config": c, "metrics": {"latency_ms": 1.0}, "provenance": {"device_name": hw}}
        for k, c in entries.items()})


def _packs(tmp_path: Path) -> Path:
    root = tmp_path / "packs"
    _pack(root, "H100", {"M=4096,N=4096,K=4096": _cfg(128, 256),
                         "M=1024,N=1024,K=1024": _cfg(64, 64),
                         "M=64,N=64,K=64": _cfg(128, 128, stages=7)})  # stages outside SPACE
    _pack(root, "H200", {"M=2048,N=2048,K=2048": _cfg(128, 128, stages=4)})
    return root


def test_seeds_come_nearest_first_this_hardware_first(tmp_path: Path) -> None:
    seeds = seeds_from_packs(_packs(tmp_path), MM, "bf16", "H100",
                             {"M": 2048, "N": 2048, "K": 2048}, SPACE, spec_for_key("H100"))
    where = [w for _, w in seeds]
    # Both H100 neighbours are 3 doublings away; then the H200 entry of this very shape.
    assert set(where[:2]) == {"H100 M=4096,N=4096,K=4096", "H100 M=1024,N=1024,K=1024"}
    assert where[2] == "H200 M=2048,N=2048,K=2048" and len(seeds) == 3  # 7 stages: left out
    assert all(set(c) == set(SPACE) for c, _ in seeds)
    assert seeds_from_packs(tmp_path / "none", MM, "bf16", "H100",
                            {"M": 2048, "N": 2048, "K": 2048}, SPACE,
                            spec_for_key("H100")) == []


def test_a_fresh_study_tries_the_seeds_first(tmp_path: Path) -> None:
    shape = {"M": 2048, "N": 2048, "K": 2048}
    seeds = seeds_from_packs(_packs(tmp_path), MM, "bf16", "H100", shape, SPACE,
                             spec_for_key("H100"))
    spec = StudySpec("ws", "matmul", shape, "bf16", "H100")
    storage = make_storage(storage_url(tmp_path, "ws"))
    settings = SearchSettings(sampler="random", trials=10, warm_start=False)
    s = Search(spec, SPACE, spec_for_key("H100"), settings, storage, 0, n_parallel=1,
               seeds=seeds)
    asked = [s.ask()[1] for _ in range(len(seeds))]
    assert asked == [c for c, _ in seeds]
    assert s.study.user_attrs["warm_start_seeds"][2]["from"] == "H200 M=2048,N=2048,K=2048"


def test_a_pack_frozen_before_a_tunable_existed_still_seeds_and_is_the_incumbent(
        tmp_path: Path) -> None:
    """A pack entry without a key the kernel gained later (here SWAP_AB) runs with that
    key's default; warm start and the re-tune's incumbent see it so, not as a config
    outside the space (which would drop the pack's incumbent from a re-tune)."""
    gg = kernel_api.get("grouped_gemm")
    shape = {"M": 49152, "N": 1408, "K": 2048, "E": 64}
    old = {"BLOCK_M": 256, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 8,
           "num_stages": 4, "USE_TMA": 1, "TAIL_SPLIT": 1}
    root = tmp_path / "packs"
    packfmt.freeze(root, "H100", "grouped_gemm", "bf16", {gg.shape_key(shape): {
        "config": old, "metrics": {"latency_ms": 0.5}, "provenance": {}}})
    space = {"BLOCK_M": [128, 256], "TAIL_SPLIT": [0, 1], "SWAP_AB": [0, 1]}
    seeds = seeds_from_packs(root, gg, "bf16", "H100", shape, space, spec_for_key("H100"))
    assert [c for c, _ in seeds] == [{"BLOCK_M": 256, "TAIL_SPLIT": 1, "SWAP_AB": 0}]
    held = incumbent(root, gg, "bf16", "H100", shape)
    assert held == {**gg.default_config, **old} and held["SWAP_AB"] == 0
