"""``kharness packs list | show | diff | merge | export`` (push/pull: test_packs_s3.py)."""

from __future__ import annotations

import json

import pytest

from harness import packs
from harness.cli import main
from harness.packs import format as fmt

SHAPE_KEY = "M=4096,N=1408,K=2048,E=64"


def _entry(block_m: int, latency: float | None = 0.5, date: str = "2026-01-01T00:00:00+00:00",
           **extra) -> dict:
    return {"config": {"BLOCK_M": block_m, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8,
                       "num_warps": 8, "num_stages": 3, "PERSISTENT": 0, **extra},
            "metrics": {"latency_ms": latency},
            "provenance": {"device_name": "NVIDIA H200", "date": date, "triton": "3.6.0",
                           "torch": "2.11.0"}}


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "packs"
    packs.freeze(root, "H100", "grouped_gemm", "bf16", {SHAPE_KEY: _entry(64, 0.50)})
    packs.freeze(root, "H200", "grouped_gemm", "bf16", {
        SHAPE_KEY: _entry(128, 0.40),
        "M=49152,N=1408,K=2048,E=64": _entry(128, 0.57),
    })
    return root


def _run(capsys, *argv):
    code = main(["packs", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_list(tree, capsys):
    code, out, _ = _run(capsys, "list", "--dir", str(tree))
    assert code == 0 and "H100" in out and "H200" in out and "2 entries" in out
    code, out, _ = _run(capsys, "list", "--dir", str(tree), "--json")
    rows = json.loads(out)
    assert [(r["hardware"], r["kernel"], r["entries"], r["status"]) for r in rows] == [
        ("H100", "grouped_gemm", 1, "ok"), ("H200", "grouped_gemm", 2, "ok")]


def test_list_flags_a_damaged_pack_and_shadowing(tree, tmp_path, capsys):
    (tree / "H100" / "grouped_gemm.json").write_text("[]")
    other = tmp_path / "other"
    packs.freeze(other, "H200", "grouped_gemm", "bf16", {SHAPE_KEY: _entry(64)})
    code, out, _ = _run(capsys, "list", "--dir", str(tree), "--dir", str(other), "--json")
    status = {(r["path"]): r["status"] for r in json.loads(out)}
    assert code == 0
    assert status[str(tree / "H100" / "grouped_gemm.json")].startswith("rejected: ")
    assert status[str(other / "H200" / "grouped_gemm.json")].startswith("shadowed")


def test_show_by_hardware_and_by_file(tree, capsys):
    code, out, _ = _run(capsys, "show", "H200", "--dir", str(tree))
    assert code == 0 and SHAPE_KEY in out and "BLOCK_M=128" in out and "0.4 ms" in out
    code, out, _ = _run(capsys, "show", str(tree / "H100" / "grouped_gemm.json"), "--json")
    assert code == 0 and json.loads(out)["hardware"] == "H100"


@pytest.mark.parametrize("argv,msg", [
    (["show", "A100"], "no packs for hardware 'A100'"),
    (["show", "H200", "--kernel", "rmsnorm"], "no rmsnorm pack for hardware 'H200'"),
    (["show", "missing.json"], "missing.json: no such pack file"),
    (["diff", "H100", "V710"], "no packs for hardware 'V710'"),
    (["export", "--format", "vllm-moe", "--top-k", "6", "--hardware", "A100"],
     "no grouped_gemm pack for hardware 'A100'"),
])
def test_bad_input_exits_2_with_a_clear_message(tree, capsys, argv, msg):
    code, _, err = _run(capsys, *argv, "--dir", str(tree))
    assert code == 2 and msg in err and "Traceback" not in err
    assert "H100, H200" in err or "no such pack file" in err


def test_damaged_pack_is_named(tree, capsys):
    path = tree / "H100" / "grouped_gemm.json"
    path.write_text(path.read_text()[:100])
    code, _, err = _run(capsys, "show", str(path))
    assert code == 2 and str(path) in err.replace("\n", "") and "not valid JSON" in err


def test_diff_two_files_shows_configs_and_latency(tree, tmp_path, capsys):
    new = tmp_path / "new.json"
    data = packs.read(tree / "H200" / "grouped_gemm.json")
    data["kernels"]["grouped_gemm"]["bf16"][SHAPE_KEY] = _entry(256, 0.30)
    del data["kernels"]["grouped_gemm"]["bf16"]["M=49152,N=1408,K=2048,E=64"]
    data["kernels"]["grouped_gemm"]["bf16"]["M=1024,N=1408,K=2048,E=64"] = _entry(32, 0.1)
    fmt.write(new, data)
    code, out, _ = _run(capsys, "diff", str(tree / "H200" / "grouped_gemm.json"), str(new))
    assert code == 0
    assert f"~ grouped_gemm bf16 {SHAPE_KEY}: BLOCK_M 128 -> 256" in out
    assert "0.4 ms -> 0.3 ms (-25.0%)" in out
    assert "+ grouped_gemm bf16 M=1024" in out and "- grouped_gemm bf16 M=49152" in out
    code, out, _ = _run(capsys, "diff", str(tree / "H200" / "grouped_gemm.json"), str(new),
                        "--json")
    (d,) = json.loads(out)
    assert {r["change"] for r in d["rows"]} == {"config", "added", "removed"}


def test_diff_two_hardware_keys(tree, capsys):
    code, out, _ = _run(capsys, "diff", "H100", "H200", "--dir", str(tree))
    assert code == 0 and "BLOCK_M 64 -> 128" in out and "(-20.0%)" in out


def test_merge_fastest_wins_by_default(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    packs.freeze(tmp_path / "ma", "H200", "grouped_gemm", "bf16", {
        SHAPE_KEY: _entry(64, 0.50, "2026-03-01T00:00:00+00:00"),
        "M=1,N=1408,K=2048,E=64": _entry(16, 0.01)})
    packs.freeze(tmp_path / "mb", "H200", "grouped_gemm", "bf16", {
        SHAPE_KEY: _entry(128, 0.45, "2026-01-01T00:00:00+00:00")})
    packs.freeze(tmp_path / "mb", "H200", "grouped_gemm", "fp16", {
        SHAPE_KEY: _entry(32, None)})
    (tmp_path / "ma" / "H200" / "grouped_gemm.json").rename(a)
    (tmp_path / "mb" / "H200" / "grouped_gemm.json").rename(b)

    out = tmp_path / "out.json"
    code, stdout, _ = _run(capsys, "merge", str(a), str(b), "--out", str(out))
    assert code == 0 and "3 entries" in stdout
    merged = packs.read(out)["kernels"]["grouped_gemm"]
    assert merged["bf16"][SHAPE_KEY]["config"]["BLOCK_M"] == 128  # 0.45 ms < 0.50 ms
    assert set(merged["bf16"]) == {SHAPE_KEY, "M=1,N=1408,K=2048,E=64"}
    assert merged["fp16"][SHAPE_KEY]["config"]["BLOCK_M"] == 32

    code, _, _ = _run(capsys, "merge", str(a), str(b), "--out", str(out), "--policy", "newest")
    assert code == 0
    assert packs.read(out)["kernels"]["grouped_gemm"]["bf16"][SHAPE_KEY]["config"][
        "BLOCK_M"] == 64  # March beats January


def test_merge_refuses_different_hardware_in_one_file(tree, tmp_path, capsys):
    out = tmp_path / "out.json"
    code, _, err = _run(capsys, "merge", str(tree / "H100" / "grouped_gemm.json"),
                        str(tree / "H200" / "grouped_gemm.json"), "--out", str(out))
    assert code == 2 and "different hardware" in err and not out.exists()
    # --dir writes one pack per hardware, merged with what is there.
    dest = tmp_path / "dest"
    packs.freeze(dest, "H100", "grouped_gemm", "bf16", {"M=7,N=1408,K=2048,E=64": _entry(16)})
    code, _, _ = _run(capsys, "merge", str(tree / "H100" / "grouped_gemm.json"),
                      str(tree / "H200" / "grouped_gemm.json"), "--dir", str(dest))
    assert code == 0
    assert set(packs.read(dest / "H100" / "grouped_gemm.json")["kernels"]["grouped_gemm"][
        "bf16"]) == {SHAPE_KEY, "M=7,N=1408,K=2048,E=64"}
    assert packs.read(dest / "H200" / "grouped_gemm.json")["hardware"] == "H200"


def test_merge_refuses_configs_failing_the_kernels_constraints(tree, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    data = packs.read(tree / "H100" / "grouped_gemm.json")
    data["kernels"]["grouped_gemm"]["bf16"][SHAPE_KEY]["config"]["BLOCK_K"] = 48
    fmt.write(bad, data)
    code, _, err = _run(capsys, "merge", str(bad), "--out", str(tmp_path / "o.json"))
    assert code == 2 and "BLOCK_K=48" in err and str(bad) in err


@pytest.mark.parametrize(("key", "value", "words"), [
    ("BLOCK_K", 48, "constraints"), ("BLOCK_M", "128", "not of type int"),
    ("BLOCK_Q", 1, "unknown tunable 'BLOCK_Q'")])
def test_list_and_merge_apply_the_runtimes_checks(tree, tmp_path, capsys, key, value, words):
    """A pack that lookup would refuse is listed as rejected, and merged into nothing:
    with --dir, no group is written when one input fails."""
    data = packs.read(tree / "H100" / "grouped_gemm.json")
    data["kernels"]["grouped_gemm"]["bf16"][SHAPE_KEY]["config"][key] = value
    bad = fmt.write(tree / "H100" / "grouped_gemm.json", data)
    code, out, _ = _run(capsys, "list", "--dir", str(tree), "--json")
    status = {r["path"]: r["status"] for r in json.loads(out)}
    assert code == 0 and status[str(bad)].startswith("rejected: ") and words in status[str(bad)]
    good = tree / "H200" / "grouped_gemm.json"
    dest = tmp_path / "merged"
    code, _, err = _run(capsys, "merge", str(good), str(bad), "--dir", str(dest))
    assert code == 2 and words in " ".join(err.split()) and not dest.exists()


def test_merge_refuses_a_damaged_input(tree, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text((tree / "H100" / "grouped_gemm.json").read_text().replace("64", "65", 1))
    code, _, err = _run(capsys, "merge", str(bad), "--out", str(tmp_path / "o.json"))
    assert code == 2 and "checksum mismatch" in err


def _vllm_pack(tmp_path):
    root = tmp_path / "v"
    packs.freeze(root, "H200", "grouped_gemm", "bf16", {
        "M=6,N=1408,K=2048,E=64": _entry(16, 0.02),
        "M=768,N=1408,K=2048,E=64": _entry(64, 0.05),
        "M=49152,N=1408,K=2048,E=64": _entry(128, 0.57, GROUP_M=1),
        "M=4096,N=2048,K=1408,E=64": _entry(64, 0.3),  # the down projection: another file
    })
    return root


def test_export_vllm_moe(tmp_path, capsys):
    root = _vllm_pack(tmp_path)
    out = tmp_path / "out"
    code, stdout, err = _run(capsys, "export", "--format", "vllm-moe", "--top-k", "6",
                             "--hardware", "H200", "--dir", str(root), "--out-dir", str(out))
    assert code == 0, err
    up = json.loads((out / "E=64,N=1408,device_name=NVIDIA_H200.json").read_text())
    down = json.loads((out / "E=64,N=2048,device_name=NVIDIA_H200.json").read_text())
    # vLLM reads {int(batch): config} and takes the nearest batch size: tokens = M / top_k.
    assert sorted(int(k) for k in up) == [1, 128, 8192] and list(down) == ["683"]
    assert up["8192"] == {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64,
                          "GROUP_SIZE_M": 1, "num_warps": 8, "num_stages": 3}
    assert all(set(c) == {"BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M",
                          "num_warps", "num_stages"} for c in up.values())


def test_export_options(tmp_path, capsys):
    root = _vllm_pack(tmp_path)
    out = tmp_path / "out"
    pack = str(root / "H200" / "grouped_gemm.json")
    code, _, err = _run(capsys, "export", "--format", "vllm-moe", "--top-k", "2", "--pack",
                        pack, "--fused-gate-up", "--k", "2048", "--device-name",
                        "NVIDIA H200 NVL", "--out-dir", str(out))
    assert code == 0, err
    (f,) = out.iterdir()
    assert f.name == "E=64,N=704,device_name=NVIDIA_H200_NVL.json"
    assert sorted(int(k) for k in json.loads(f.read_text())) == [3, 384, 24576]
    # --top-k is required: our M is routed rows, vLLM's is tokens.
    code, _, err = _run(capsys, "export", "--format", "vllm-moe", "--pack", pack)
    assert code == 2 and "required: --top-k" in err


def test_export_refuses_other_kernels_and_empty_dtypes(tmp_path, capsys):
    root = _vllm_pack(tmp_path)
    pack = str(root / "H200" / "grouped_gemm.json")
    code, _, err = _run(capsys, "export", "--format", "vllm-moe", "--top-k", "6", "--pack",
                        pack, "--dtype", "fp16")
    assert code == 2 and "no fp16 entries" in err
    packs.freeze(tmp_path / "r", "H200", "rmsnorm", "bf16",
                 {"rows=8,cols=4096": {"config": {"BLOCK_SIZE": 4096, "num_warps": 8},
                                       "metrics": {}, "provenance": {}}})
    code, _, err = _run(capsys, "export", "--format", "vllm-moe", "--top-k", "6", "--pack",
                        str(tmp_path / "r" / "H200" / "rmsnorm.json"))
    assert code == 2 and "needs a grouped_gemm pack" in err
