"""harness.autotune: frozen pack configs for a @triton.jit kernel, under the interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

import harness
from harness import packs
from harness.packs import format as fmt

ROOT = Path(__file__).resolve().parents[1]

# The decorator example of docs/packs.md, run as written: the docs cannot go stale.
DOCS_PACKS = ROOT / "docs" / "packs.md"


def _docs_example() -> str:
    text = DOCS_PACKS.read_text()
    marker = "<!-- example: decorator (run by tests/test_autotune_decorator.py) -->"
    assert marker in text, f"{DOCS_PACKS} lost its tested decorator example"
    block = text.split(marker, 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    return block


@triton.jit
def _add_kernel(x_ptr, y_ptr, out_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < n_elements
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x + y, mask=mask)


@triton.jit
def _matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, E,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C = A @ B for row-major fp16 A [M, K], B [K, N]; E (experts) only keys the pack."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptr + rm[:, None] * K + (k0 + rk)[None, :],
                    mask=(rm[:, None] < M) & ((k0 + rk)[None, :] < K), other=0.0)
        b = tl.load(b_ptr + (k0 + rk)[:, None] * N + rn[None, :],
                    mask=((k0 + rk)[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc += tl.dot(a.to(tl.float32), b.to(tl.float32))
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc.to(tl.float16),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def _entry(config: dict, latency: float = 0.01) -> dict:
    v = packs.runtime_versions()
    return {"config": config, "metrics": {"latency_ms": latency},
            "provenance": {"device_name": "cpu", "triton": v["triton"], "torch": v["torch"]}}


@pytest.fixture
def pack_dir(tmp_path):
    packs.configure([tmp_path])
    packs.reset_stats()
    yield tmp_path
    packs.configure(None)
    packs.reset_stats()


def _add(block_seen: list, **deco):
    """A fresh decorated vector add (each test gets its own per-key cache)."""
    kern = harness.autotune(kernel="vector_add", key=["n_elements"],
                            default={"BLOCK_SIZE": 32}, **deco)(_add_kernel)

    def grid(meta):
        block_seen.append(meta["BLOCK_SIZE"])
        return (triton.cdiv(meta["n_elements"], meta["BLOCK_SIZE"]),)

    return kern, grid


def _inputs(n: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(n, generator=g).to(dtype)
    y = torch.randn(n, generator=g).to(dtype)
    return x, y, torch.empty_like(x)


def test_harness_import_stays_light():
    code = ("import sys, harness; assert 'torch' not in sys.modules and 'triton' not in "
            "sys.modules, sorted(sys.modules); assert callable(harness.autotune); "
            "from harness.autotune import PackedKernel")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)


def test_vector_add_launches_the_pack_config(pack_dir):
    packs.freeze(pack_dir, "cpu", "vector_add", "fp32", {
        "n_elements=1000": _entry({"BLOCK_SIZE": 256, "num_warps": 4, "UNUSED_KNOB": 3}),
        "n_elements=100000": _entry({"BLOCK_SIZE": 1024, "num_warps": 8}),
    })
    seen: list[int] = []
    add, grid = _add(seen)
    x, y, out = _inputs(1000)
    add[grid](x, y, out, x.numel())                     # exact, positional key
    torch.testing.assert_close(out, x + y)
    x, y, out = _inputs(700, seed=1)
    add[grid](x, y, out, n_elements=x.numel())          # nearest (log space), keyword key
    torch.testing.assert_close(out, x + y)
    x, y, out = _inputs(60000, seed=2)
    add[grid](x_ptr=x, y_ptr=y, out_ptr=out, n_elements=x.numel())
    torch.testing.assert_close(out, x + y)
    assert seen == [256, 256, 1024]
    sources = {k[0][0]: h.source for k, h in add.hits.items()}
    assert sources == {1000: "exact", 700: "nearest", 60000: "nearest"}


def test_a_pack_value_of_the_wrong_type_is_never_launched(pack_dir):
    """``"BLOCK_SIZE": "256"`` (a string) would reach the kernel as a string: the pack is
    refused as a whole, with one warning naming it, and the default config runs."""
    packs.freeze(pack_dir, "cpu", "vector_add", "fp32", {
        "n_elements=1000": _entry({"BLOCK_SIZE": "256", "num_warps": 4})})
    seen: list[int] = []
    add, grid = _add(seen)
    x, y, out = _inputs(1000)
    with pytest.warns(packs.PackWarning, match="'256' is not of type int"):
        add[grid](x, y, out, x.numel())
    torch.testing.assert_close(out, x + y)
    assert seen == [32]


def test_no_pack_falls_back_to_the_default_with_a_warning(pack_dir):
    seen: list[int] = []
    add, grid = _add(seen)
    x, y, out = _inputs(100)
    with pytest.warns(packs.PackWarning, match="no cpu pack for vector_add"):
        add[grid](x, y, out, x.numel())
    torch.testing.assert_close(out, x + y)
    assert seen == [32] and packs.stats["default"] == 1


def test_lookup_happens_once_per_distinct_key(pack_dir, monkeypatch):
    packs.freeze(pack_dir, "cpu", "vector_add", "fp32",
                 {"n_elements=64": _entry({"BLOCK_SIZE": 64})})
    calls = []
    real = packs.lookup_entry
    monkeypatch.setattr(packs, "lookup_entry", lambda *a, **k: calls.append(k) or real(*a, **k))
    seen: list[int] = []
    add, grid = _add(seen)
    for n in (64, 64, 64, 100, 100):
        x, y, out = _inputs(n)
        add[grid](x, y, out, n)
        torch.testing.assert_close(out, x + y)
    assert [c["n_elements"] for c in calls] == [64, 100]


def test_dtype_comes_from_the_tensors_or_the_decorator(pack_dir):
    packs.freeze(pack_dir, "cpu", "vector_add", "fp16",
                 {"n_elements=128": _entry({"BLOCK_SIZE": 128})})
    packs.freeze(pack_dir, "cpu", "vector_add", "fp32",
                 {"n_elements=128": _entry({"BLOCK_SIZE": 64})})
    seen: list[int] = []
    add, grid = _add(seen)
    for dt in (torch.float16, torch.float32):
        x, y, out = _inputs(128, dt)
        add[grid](x, y, out, 128)
        torch.testing.assert_close(out, x + y)
    fixed, grid2 = _add(seen, dtype="fp16")
    x, y, out = _inputs(128)
    fixed[grid2](x, y, out, 128)
    assert seen == [128, 64, 128]


def test_kernel_family_rules_apply(pack_dir):
    """With kernel="grouped_gemm": its nearest rule (N, K, E exact) and default config;
    config keys that are not kernel arguments (GROUP_M, PERSISTENT) are dropped."""
    cfg = {"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 8, "PERSISTENT": 1,
           "num_warps": 4, "num_stages": 2}
    packs.freeze(pack_dir, "cpu", "grouped_gemm", "fp16",
                 {"M=64,N=32,K=32,E=4": _entry(cfg)})
    mm = harness.autotune(kernel="grouped_gemm", key=["M", "N", "K", "E"])(_matmul_kernel)
    seen = []

    def grid(meta):
        seen.append((meta["BLOCK_M"], meta["BLOCK_N"], meta["BLOCK_K"]))
        return (triton.cdiv(meta["M"], meta["BLOCK_M"]), triton.cdiv(meta["N"], meta["BLOCK_N"]))

    g = torch.Generator(device="cpu").manual_seed(0)
    for M, N in ((64, 32), (40, 32), (64, 48)):
        a = torch.randn(M, 32, generator=g).half()
        b = torch.randn(32, N, generator=g).half()
        c = torch.empty(M, N, dtype=torch.float16)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", packs.PackWarning)
            mm[grid](a, b, c, M, N, 32, E=4)
        torch.testing.assert_close(c.float(), a.float() @ b.float(), atol=2e-2, rtol=2e-2)
    default = mm.family.default_config
    assert seen == [(32, 16, 16), (32, 16, 16),
                    (default["BLOCK_M"], default["BLOCK_N"], default["BLOCK_K"])]
    assert [h.source for h in mm.hits.values()] == ["exact", "nearest", "default"]
    assert mm.launch_kwargs(cfg) == {"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": 16,
                                     "num_warps": 4, "num_stages": 2}


def test_online_tuning_records_and_merge_freezes_it(pack_dir, tmp_path_factory):
    """On a miss with online=True the interpreter takes the first config that passes the
    kernel's constraints; the record file freezes into a pack with `packs merge`."""
    from harness.cli import main

    record = tmp_path_factory.mktemp("rec") / "online.json"
    configs = [{"BLOCK_M": 24, "BLOCK_N": 16, "BLOCK_K": 16},  # fails check_config
               {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16, "num_warps": 2},
               {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 32}]
    mm = harness.autotune(kernel="grouped_gemm", key=["M", "N", "K", "E"], online=True,
                          configs=configs, record=record)(_matmul_kernel)
    seen = []

    def grid(meta):
        seen.append(meta["BLOCK_M"])
        return (triton.cdiv(meta["M"], meta["BLOCK_M"]), triton.cdiv(meta["N"], meta["BLOCK_N"]))

    g = torch.Generator(device="cpu").manual_seed(1)
    a = torch.randn(48, 32, generator=g).half()
    b = torch.randn(32, 32, generator=g).half()
    c = torch.empty(48, 32, dtype=torch.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", packs.PackWarning)
        mm[grid](a, b, c, 48, 32, 32, 4)
        mm[grid](a, b, c, 48, 32, 32, 4)  # tuned once per key
    torch.testing.assert_close(c.float(), a.float() @ b.float(), atol=2e-2, rtol=2e-2)
    assert seen == [16, 16]
    (rec,) = json.loads(record.read_text())
    assert rec["hardware"] == "cpu" and rec["shape_key"] == "M=48,N=32,K=32,E=4"
    assert rec["config"]["BLOCK_M"] == 16 and rec["config"]["GROUP_M"] == 8  # full config
    assert rec["candidates"][0]["error"].startswith("pruned: BLOCK_M=24")
    assert rec["provenance"]["source"] == "online" and mm.tuned == [rec]

    assert main(["packs", "merge", str(record), "--dir", str(pack_dir)]) == 0
    frozen = packs.read(fmt.pack_path(pack_dir, "cpu", "grouped_gemm"))
    assert frozen["kernels"]["grouped_gemm"]["fp16"]["M=48,N=32,K=32,E=4"]["config"] == \
        rec["config"]
    packs.configure([pack_dir])
    hit = packs.lookup_entry("grouped_gemm", "fp16", "cpu", M=48, N=32, K=32, E=4)
    assert hit.source == "exact" and hit.config == rec["config"]


def test_online_tuning_record_from_environment(pack_dir, tmp_path, monkeypatch):
    record = tmp_path / "env-online.json"
    monkeypatch.setenv("HARNESS_PACKS_ONLINE", str(record))
    seen: list[int] = []
    add, grid = _add(seen, online=True, configs=[{"BLOCK_SIZE": 16}, {"BLOCK_SIZE": 64}])
    x, y, out = _inputs(100)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", packs.PackWarning)
        add[grid](x, y, out, 100)
    torch.testing.assert_close(out, x + y)
    assert seen == [16]
    (rec,) = json.loads(record.read_text())
    assert rec["kernel"] == "vector_add" and rec["config"] == {"BLOCK_SIZE": 16}


def test_online_tuning_keeps_a_corrupted_record_and_survives_an_unwritable_one(
        pack_dir, tmp_path):
    """A record file that is not a JSON list is kept aside, with a warning, and a new one
    started; a record path that cannot be written costs a warning, not the launch."""
    record = tmp_path / "online.json"
    record.write_text('[{"kernel": "vector_add", "conf')  # a write cut short
    seen: list[int] = []
    add, grid = _add(seen, online=True, configs=[{"BLOCK_SIZE": 16}], record=record)
    x, y, out = _inputs(100)
    with pytest.warns(packs.PackWarning, match="is corrupt"):
        add[grid](x, y, out, 100)
    torch.testing.assert_close(out, x + y)
    (kept,) = tmp_path.glob("online.json.corrupt-*")
    assert kept.read_text() == '[{"kernel": "vector_add", "conf'
    (rec,) = json.loads(record.read_text())
    assert rec["config"] == {"BLOCK_SIZE": 16}

    (tmp_path / "a-folder").mkdir()
    add, grid = _add(seen, online=True, configs=[{"BLOCK_SIZE": 16}],
                     record=tmp_path / "a-folder")
    with pytest.warns(packs.PackWarning, match="could not record"):
        add[grid](x, y, out, 100)
    torch.testing.assert_close(out, x + y)
    assert seen == [16, 16]


def test_bad_use_is_reported_clearly(pack_dir):
    with pytest.raises(ValueError, match="must name the dims"):
        harness.autotune(kernel="grouped_gemm", key=["M", "N"])(_matmul_kernel)
    with pytest.raises(ValueError, match="default config"):
        harness.autotune(kernel="no_such_kernel", key=["n_elements"])(_add_kernel)
    with pytest.raises(ValueError, match="not arguments"):
        harness.autotune(kernel="k", key=["n"], default={"BLOCK_SIZE": 16})(_add_kernel)
    with pytest.raises(ValueError, match="needs configs"):
        harness.autotune(kernel="k", key=["n_elements"], default={"BLOCK_SIZE": 16},
                         online=True)(_add_kernel)
    with pytest.raises(TypeError, match="arg_names"):
        harness.autotune(kernel="k", key=["n"], default={"BLOCK_SIZE": 16})(lambda n: n)
    seen: list[int] = []
    add, grid = _add(seen)
    x, y, out = _inputs(64)
    with pytest.raises(TypeError, match="'n_elements' not given"):
        add[grid](x, y, out)
    with pytest.raises(TypeError, match="must be an int"):
        add[grid](x, y, out, 64.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", packs.PackWarning)
        with pytest.raises(ValueError, match="come from the pack"):
            add[grid](x, y, out, 64, BLOCK_SIZE=16)



def test_docs_example_runs(tmp_path):
    import runpy

    script = tmp_path / "example.py"
    script.write_text(_docs_example())  # from a file: @triton.jit reads the source
    try:
        ns = runpy.run_path(str(script), run_name="__main__")
    finally:
        packs.configure(None)
    (hit,) = ns["add_kernel"].hits.values()
    assert hit.source == "nearest" and hit.config["BLOCK_SIZE"] == 1024
