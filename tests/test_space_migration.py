"""The spaces derived from each built-in family's tunables equal the search_spaces/*.yaml
files they replace: the raw structure, and the space every vendor and hardware key
resolves to, in order."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from harness.kernel import api as kernel_api
from harness.search import spaces

ROOT = Path(__file__).resolve().parent.parent
FILES = {"fused_elementwise": ["rmsnorm", "silu", "silu_mul", "softplus_clamp"],
         "mulsum_bmm": ["mulsum_bmm", "mulsum_ydiag", "mulsum_states", "mulsum_c_states"]}
CASES = [(f.stem, name) for f in sorted((ROOT / "search_spaces").glob("*.yaml"))
         for name in FILES.get(f.stem, [f.stem])]
VENDORS = ("nvidia", "amd", "cpu")
HARDWARE = ("H100", "H200", "A100", "B200", "MI300X", "MI325X", "V710", "cpu", "?")


def test_every_builtin_had_a_file() -> None:
    assert sorted(n for _, n in CASES) == kernel_api.builtin_names()


@pytest.mark.parametrize(("file", "name"), CASES)
def test_derived_space_equals_the_yaml(file: str, name: str) -> None:
    old = yaml.safe_load((ROOT / "search_spaces" / f"{file}.yaml").read_text())
    new = kernel_api.resolve(name).search_space()
    assert new == old
    keys = {*HARDWARE, *(old.get("hardware") or {})}
    for vendor in VENDORS:
        for hw in sorted(keys):
            a = spaces.resolve([old], vendor, hw)
            b = spaces.resolve([new], vendor, hw)
            assert list(a.items()) == list(b.items()), (vendor, hw)


def test_derived_bench_cases_equal_the_yaml() -> None:
    from harness.measure import bench

    old = bench.load_cases(ROOT / "harness" / "measure" / "bench_cases.yaml")
    new = bench.load_cases()
    assert sorted(map(repr, new)) == sorted(map(repr, old))
    assert len(new) == len(old) == 23
    assert [c for c in new if c.max_autotune] == new[-1:]
