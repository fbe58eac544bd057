"""The benchmark's cases: package data (an installed harness finds them), each naming a
kernel family, one of its seed shapes and one of its dtypes."""

from __future__ import annotations

from pathlib import Path

from harness.kernel import api as kernel_api
from harness.measure import bench


def test_the_default_cases_are_package_data_and_valid() -> None:
    assert bench.CASES_FILE.is_file()
    assert bench.CASES_FILE.parent == Path(bench.__file__).resolve().parent
    cases = bench.load_cases()
    assert cases
    for case in cases:
        fam = kernel_api.get(case.kernel)
        assert case.shape_name in fam.shapes, case
        assert case.dtype in fam.dtypes, case
    # The max-autotune row is asked for where it compiles in reasonable time only.
    assert any(c.max_autotune for c in cases)
    assert not any(c.max_autotune and not c.compile for c in cases)
    only = bench.load_cases(only=["grouped_gemm"])
    assert {c.kernel for c in only} == {"grouped_gemm"}
    assert {c.shape_name for c in only} == {"deepseek-v3-16b", "deepseek-v3-16b-m128"}
