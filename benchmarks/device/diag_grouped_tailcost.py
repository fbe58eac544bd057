"""What would the grouped GEMM's tail tiles cost if they streamed no weights?

Session 17 found the realistic routings' whole gap to 90 % of dense in the experts' last
partial blocks (the tails): ~20 % of the time for ~16 % of the rows. The one design not
built against it, a 2-CTA cluster whose tail tile receives its expert's W box by TMA
multicast from the last full tile, can at best make a tail's W stream free. This script
times that best case and its neighbours with the kernel's diagnostic ``TAIL_EMU`` (tail
tiles only; full tiles unchanged):

- 1: the tail tile loads its W box once and multiplies it at every K step (no W stream:
  a bound on anything that shares or multicasts the tails' weights);
- 2: the same for its A box too (nothing streamed: only the tails' MMAs and stores left);
- 3: the tail tile returns at once (the tails cost nothing but their CTAs' launch).

"Tail" here is a tile of the table's classes 1 and up (half, quarter and finer pieces);
a remainder of 193-255 rows runs as one padded full-height tile (class 0) and stays real
in every variant: a runtime branch that caught those too made the full tiles' code 12
points slower (session 18 call 4, balanced routing), so it was taken out. The variants'
outputs are wrong in the tails' rows on purpose, so only the rows of whole 256-row
blocks are checked; the real kernel is checked whole and timed twice (the run's noise
floor). The balanced routing has no tails: there every variant is the same work, so it
shows whether the diagnostic moved the full tiles' code. The log-normal routing's whole
blocks alone, at their own M, run beside them. Each variant is timed right beside
dense cuBLAS of the same FLOPs.

Study ``fixed`` (see ``fixed_configs``): what a tail tile costs beyond its work. Study
``grid``: the launch with every tile but one returning at once (TAIL_EMU=4).

    python3 benchmarks/device/diag_grouped_tailcost.py [--study main|fixed|grid] [--rounds 7] \
        [--rep 100] [--json F]
"""

from __future__ import annotations

import torch

from benchmarks.device.diag_grouped_concurrent import split_problem
from benchmarks.device.diag_grouped_steady import (
    SHAPE,
    dump_pairs,
    make_problems,
    paired_rounds,
    print_pairs,
    timing_args,
    verify,
)
from harness import packs
from kernels.grouped_gemm import GroupedGemm, _dense_baseline

EMU = {1: "tails stream no W", 2: "tails stream nothing", 3: "tails skipped"}


def full_block_rows(offsets: list[int], bm: int = 256) -> torch.Tensor:
    """A mask of the rows that lie in an expert's whole ``bm``-row blocks (what every
    variant computes)."""
    keep = torch.zeros(offsets[-1], dtype=torch.bool)
    for lo, hi in zip(offsets[:-1], offsets[1:], strict=True):
        keep[lo: lo + (hi - lo) // bm * bm] = True
    return keep


# The H200 pack's Triton-kernel entry of sessions 14-18 (the H100's differed only in
# TAIL_WINDOW=0), for when this GPU's pack holds a Gluon engine's config instead.
TRITON_PACK = {"BLOCK_K": 64, "BLOCK_M": 256, "BLOCK_N": 128, "BLOCK_TABLE": 1, "FLATTEN": 0,
               "GROUP_M": 1, "PERSISTENT": 0, "TAIL_SPLIT": 2, "TAIL_WINDOW": 4,
               "TMA_STORE": 0, "USE_TMA": 1, "WARP_SPEC": 0, "num_stages": 4, "num_warps": 8}


def best_config() -> dict:
    """Session 17's best realistic config of the Triton kernel: this GPU's pack (or
    ``TRITON_PACK`` where the pack holds a Gluon config) + SWAP_AB, TMA store,
    TAIL_FINE=2."""
    pack = dict(packs.lookup_entry("grouped_gemm", "bf16", **SHAPE).config)
    if int(pack.get("GLUON", 0)):
        pack = dict(TRITON_PACK)
    return {**pack, "SWAP_AB": 1, "TMA_STORE": 1, "TAIL_FINE": 2}


def gluon_config(dynamic: bool = False) -> dict:
    """The persistent Gluon engine beside the best config: fixed stride, or tiles from a
    counter with ``dynamic``."""
    return {**best_config(), "GLUON": 2 if dynamic else 1, "SWAP_AB": 0, "TAIL_FINE": 0,
            "PERSISTENT": 1, "TAIL_SPLIT": 2, "BLOCK_K": 64, "num_stages": 3, "GROUP_M": 1,
            "TAIL_WINDOW": 0}


def configs() -> dict[str, dict]:
    """The best config, twice, and its TAIL_EMU variants."""
    best = best_config()
    out = {"real": best}
    out |= {f"TAIL_EMU={k}: {v}": {**best, "TAIL_EMU": k} for k, v in EMU.items()}
    out["real (again)"] = dict(best)
    return out


def fixed_configs() -> dict[str, dict]:
    """Study ``fixed``: does a tail tile cost a CTA's fixed price (launch, table lookup,
    pipeline fill and drain) as well as its work? The best config and its skipped tails,
    one CTA per tile and persistent (one program per SM striding over the tiles, where a
    skipped tile costs only its lookup), and the persistent Gluon engine, whose loads run
    across tile boundaries (fixed stride and counter). With 4 stages and the TMA store the
    persistent Triton variants need 262 KB of shared memory and fail on Hopper (session 18
    call 2): they stay as reported failures."""
    best = best_config()
    pers = {**best, "PERSISTENT": 1}
    return {"real": best, "TAIL_EMU=3: tails skipped": {**best, "TAIL_EMU": 3},
            "persistent": pers, "persistent, TAIL_EMU=3": {**pers, "TAIL_EMU": 3},
            "Gluon, counter": gluon_config(dynamic=True), "Gluon, stride": gluon_config(),
            "real (again)": dict(best)}


def fixed_problems(whole: dict[str, dict]) -> dict[str, tuple[dict, dict]]:
    """The two realistic routings of ``whole`` (``make_problems``' inputs), and the
    log-normal one's full 256-row blocks alone (every expert's rows past its last full
    block taken out) at their own M."""
    pi, ps, _, _ = split_problem(whole["log-normal"], full_only=True)
    return {"log-normal": (whole["log-normal"], SHAPE), "uniform": (whole["uniform"], SHAPE),
            f"log-normal full blocks only (M={ps['M']})": (pi, ps)}


def main() -> None:
    args = timing_args(rounds=7, study="main").parse_args()
    fam = GroupedGemm()
    whole = make_problems(fam)
    if args.study == "fixed":
        cfgs, problems = fixed_configs(), fixed_problems(whole)
    elif args.study == "grid":
        # What the launch costs with every tile returning at once, beside the tails alone
        # skipped, on the whole routing and on its full blocks alone.
        best = best_config()
        cfgs = {"real": best, "TAIL_EMU=3: tails skipped": {**best, "TAIL_EMU": 3},
                "TAIL_EMU=4: every tile but one skipped": {**best, "TAIL_EMU": 4}}
        problems = fixed_problems(whole)
        del problems["uniform"]
    else:
        cfgs = configs()
        problems = {p: (i, SHAPE) for p, i in whole.items()}
        problems |= {k: v for k, v in fixed_problems(whole).items() if "full blocks" in k}
    fns: dict = {}
    dense: dict = {}
    notes: dict[str, str] = {}
    for prob, (inputs, shape) in problems.items():
        ref = fam.reference(inputs, shape)
        real = {n: c for n, c in cfgs.items() if "TAIL_EMU" not in c}
        verify({n: (lambda c=c, i=inputs, s=shape: fam.launcher(i, s, c))
                for n, c in real.items()}, ref, prob, fns, notes)
        keep = full_block_rows(inputs["offsets_host"]).to(ref.device)
        for name, cfg in cfgs.items():
            if name in real:
                continue
            try:
                fn = fam.launcher(inputs, shape, cfg)
                got = fn().float()
                if cfg["TAIL_EMU"] < 4:  # 4 computes one tile
                    torch.testing.assert_close(got[keep], ref[keep], atol=2e-2, rtol=2e-2)
                fns[(prob, name)] = fn
            except Exception as exc:  # reported, not fatal
                notes[f"{prob} {name}"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        dense[prob] = _dense_baseline(inputs, shape)
        del ref
    times, ratios, dense_ms = paired_rounds(fns, dense, args.rounds, args.rep)
    print_pairs(times, ratios, args.rounds, args.rep)
    for k, v in notes.items():
        print("note:", k, v)
    for name, cfg in cfgs.items():
        print(f"{name}: {cfg}")
    if args.json:
        dump_pairs(args.json, times, ratios, dense_ms, notes, configs=cfgs)


if __name__ == "__main__":
    main()
