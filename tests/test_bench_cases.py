"""The benchmark's cases: each kernel family declares its own (``Kernel.bench``), each
naming one of its seed shapes and one of its dtypes; a cases file may still choose
others."""

from __future__ import annotations

from pathlib import Path

from harness.kernel import api as kernel_api
from harness.measure import bench


def test_the_default_cases_are_the_families_own_and_valid() -> None:
    cases = bench.load_cases()
    assert cases
    assert {c.kernel for c in cases} <= set(kernel_api.builtin_names())
    for case in cases:
        fam = kernel_api.get(case.kernel)
        assert case.shape_name in fam.shapes, case
        assert case.dtype in fam.dtypes, case
    # The max-autotune row is asked for where it compiles in reasonable time only, and
    # comes last: a short budget cuts the slowest row first.
    assert any(c.max_autotune for c in cases)
    assert not any(c.max_autotune and not c.compile for c in cases)
    assert not any(c.max_autotune for c in cases[:-1])
    # Where torch.compile is left out, the family says why, and no case of it times it.
    fam = kernel_api.get("selective_scan")
    assert "did not finish compiling" in fam.no_compile_baseline
    scan = [c for c in cases if c.kernel == "selective_scan"]
    assert scan and not any(c.compile for c in scan)
    assert all(c.compile for c in cases if c.kernel == "matmul")
    only = bench.load_cases(only=["grouped_gemm"])
    assert {c.kernel for c in only} == {"grouped_gemm"}
    assert [c.shape_name for c in only] == ["deepseek-v3-16b", "deepseek-v3-16b-m128"]


def test_a_cases_file_chooses_other_cases(tmp_path: Path) -> None:
    path = tmp_path / "cases.yaml"
    path.write_text("cases:\n"
                    "  - {kernel: matmul, shape: square-4096, dtype: bf16}\n"
                    "  - {kernel: silu, shape: r8192-c4096, dtype: fp16, compile: false}\n"
                    "  - {kernel: selective_scan, shape: b1-L512-n16, dtype: fp32}\n")
    cases = bench.load_cases(path)
    assert cases == [bench.Case("matmul", "square-4096", "bf16"),
                     bench.Case("silu", "r8192-c4096", "fp16", compile=False),
                     bench.Case("selective_scan", "b1-L512-n16", "fp32", compile=False)]
    assert bench.load_cases(path, only=["silu"]) == cases[1:2]
