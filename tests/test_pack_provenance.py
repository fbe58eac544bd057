"""Every shipped pack entry says where, when and with what it was measured (commit,
versions, device, date), what its config computes in (precision) and the accuracy bound
it met, and its measured error meets that bound.

An entry that lacks any of it is stale: it must be re-tuned on its GPU with the current
code (no provenance is filled in by hand). Those are reported, per pack, as expected
failures naming the experiment to run, so the suite stays green while they exist and says
which they are (``pytest -ra``); a field that is present but wrong fails outright."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest

from harness.experiment import load as load_experiment
from harness.kernel import api as kernel_api
from harness.packs import format as fmt
from harness.packs.lookup import SHIPPED as SHIPPED_DIR

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = sorted(SHIPPED_DIR.glob("*/*.json"))
REQUIRED = ("git_sha", "triton", "torch", "cuda", "device_name", "date", "experiment",
            "precision", "accuracy_bound")


@cache
def _experiments() -> dict[object, Path]:
    """The experiments of configs/ that write the packs, by name and by (kernel, dtype)."""
    out: dict[object, Path] = {}
    for path in sorted((ROOT / "configs").rglob("*.yaml")):
        exp = load_experiment(path)
        if exp.output.packs_dir == "packs":
            for dtype in exp.dtypes:
                out.setdefault((exp.kernel, dtype), path.relative_to(ROOT))
            out[exp.name] = path.relative_to(ROOT)
    return out


def _missing(prov: dict) -> list[str]:
    return [k for k in REQUIRED if prov.get(k) in (None, "", "unknown")]


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_shipped_entries_have_provenance_and_meet_their_bound(
        path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A family's precision can depend on where it runs (fp32 dots: tf32x3 on a GPU, IEEE
    # under the interpreter); an entry is checked as its GPU ran it, never interpreted.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    data = fmt.read(path)
    hw = data["hardware"]
    exps = _experiments()
    stale = []
    for kernel, dtype, skey, entry in fmt.iter_entries(data):
        prov, metrics = entry["provenance"], entry["metrics"]
        where = f"{hw} {kernel} {dtype} {skey}"
        # What is there must be right, stale or not.
        if prov.get("device_name"):
            assert hw in prov["device_name"].replace(" ", ""), (where, prov["device_name"])
        assert not prov.get("interpreted"), where
        fam = kernel_api.get(kernel)
        if prov.get("precision"):
            assert prov["precision"] == fam.precision(entry["config"], dtype), where
        bound = prov.get("accuracy_bound") or {}
        for key in ("max_abs_err", "max_rel_err"):
            if key in bound:
                assert metrics.get(key) is not None and metrics[key] <= bound[key], (
                    f"{where}: {key} {metrics.get(key)} > its bound {bound[key]}")
        missing = _missing(prov)
        if missing:
            exp = exps.get((kernel, dtype), exps.get(str(prov.get("experiment"))))
            stale.append(f"{kernel} {dtype} {skey} lacks {', '.join(missing)} "
                         f"(re-tune: kharness run {exp} on an {hw})")
    if stale:
        pytest.xfail(f"{path.parent.name}/{path.name}: {len(stale)} stale entries, then copy "
                     f"packs/{hw}/{path.name} over the shipped one: " + "; ".join(stale))
