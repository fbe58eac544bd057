"""Does padding cost less when it is zeros? The grouped GEMM with its tail padding
zero-filled, emulated, beside dense cuBLAS.

The GPUs run these GEMMs at their 700 W cap, so a kernel's speed follows its energy per
FLOP, and a tensor core multiplying zeros toggles far fewer bits than one multiplying
data. The harness's kernel pads every expert's last block with the *next* expert's rows
(A is one [M, K] tensor; the store masks them): its padding is real data at full
energy. cuBLAS's batched GEMM reads each batch through its own bounds, so its padding
is TMA's zero fill, and session 15 saw it keep 91-98 % of dense with tails of every size.

Emulation: each expert's rows padded up to a multiple of ``--pad`` rows (256: every block
full; 64: the split tails' granularity) in a larger A, the padding rows zeros or random,
the kernel run on the padded routing; every figure against dense cuBLAS at the routing's
*real* M (the same useful FLOPs). Beside them, dense cuBLAS itself with a share of A's
rows zeroed, which tests the energy premise without any grouped kernel.

    python3 benchmarks/device/diag_grouped_zeropad.py [--rounds 5] [--rep 150]
"""

from __future__ import annotations

import torch

from benchmarks.device.diag_grouped_steady import (
    SHAPE,
    make_problems,
    time_and_report,
    timing_args,
    verify,
)
from harness import packs
from kernels.grouped_gemm import GroupedGemm, _dense_baseline, counts_to_offsets

GLUON = {"GLUON": 1, "USE_TMA": 1, "PERSISTENT": 1, "BLOCK_TABLE": 1, "BLOCK_K": 32,
         "BLOCK_M": 256, "BLOCK_N": 128, "num_warps": 8, "num_stages": 6, "GROUP_M": 1,
         "TAIL_SPLIT": 0, "TMA_STORE": 1}


def padded(inputs: dict, pad: int, zeros: bool) -> tuple[dict, dict]:
    """``inputs`` with every expert's rows padded up to a multiple of ``pad`` (its real
    rows first), the padding zeros or fresh random rows; and the padded shape."""
    a, w, offs = inputs["a"], inputs["w"], inputs["offsets_host"]
    counts = [offs[e + 1] - offs[e] for e in range(len(offs) - 1)]
    pcounts = [-(-c // pad) * pad for c in counts]
    poffs = counts_to_offsets(pcounts)
    ap = (torch.zeros if zeros else torch.randn)(poffs[-1], a.shape[1], device=a.device)
    ap = ap.to(a.dtype)
    for e, c in enumerate(counts):
        ap[poffs[e]:poffs[e] + c] = a[offs[e]:offs[e] + c]
    return ({"a": ap, "w": w, "offsets": torch.tensor(poffs, dtype=torch.int32,
                                                      device=a.device),
             "offsets_host": poffs}, {**SHAPE, "M": poffs[-1]})


def zero_rows_dense(inputs: dict, share: float) -> tuple[object, torch.Tensor]:
    """Dense cuBLAS on A with its last ``share`` of rows zeroed (expert 0's W): the
    runner and its reference."""
    a = inputs["a"].clone()
    a[int(a.shape[0] * (1 - share)):] = 0
    w0 = inputs["w"][0]
    out = torch.empty(a.shape[0], w0.shape[0], dtype=a.dtype, device=a.device)
    return (lambda: torch.mm(a, w0.t(), out=out)), a.float() @ w0.float().t()


def main() -> None:
    args = timing_args(rep=150).parse_args()
    fam = GroupedGemm()
    pack = dict(packs.lookup_entry("grouped_gemm", "bf16", **SHAPE).config)
    full = {**pack, "TAIL_SPLIT": 0, "TAIL_WINDOW": 0}
    print(f"pack config: {pack}")
    fns: dict = {}
    dense: dict = {}
    notes: dict = {}
    for prob, inputs in make_problems(fam).items():
        ref = fam.reference(inputs, SHAPE)
        verify({"pack": lambda i=inputs: fam.launcher(i, SHAPE, pack),
                "pack, 256-row tails (no split)": lambda i=inputs: fam.launcher(i, SHAPE, full)},
               ref, prob, fns, notes)
        del ref
        if prob == "balanced":
            for share in (0.125, 0.25, 0.5):
                fn, dref = zero_rows_dense(inputs, share)
                verify({f"dense cuBLAS, last {share:.1%} of A's rows zero": lambda f=fn: f},
                       dref, prob, fns, notes)
                del dref
            verify({"gluon k32 s6 (no tails here)": lambda i=inputs: fam.launcher(i, SHAPE, GLUON)},
                   fam.reference(inputs, SHAPE), prob, fns, notes)
        else:
            for pad, cfg, what in ((256, full, "pack, no split"), (64, pack, "pack"),
                                   (256, GLUON, "gluon k32 s6")):
                for zeros in (True, False):
                    pin, pshape = padded(inputs, pad, zeros)
                    pref = fam.reference(pin, pshape)
                    name = (f"{what}, experts padded to {pad} rows with "
                            f"{'zeros' if zeros else 'random rows'}")
                    verify({name: lambda i=pin, s=pshape, c=cfg: fam.launcher(i, s, c)},
                           pref, prob, fns, notes)
                    del pref
        dense[prob] = _dense_baseline(inputs, SHAPE)
    _, _, dense_ms = time_and_report(fns, dense, notes, args.rounds, args.rep, args.json,
                                     pack=pack, gluon=GLUON)
    for prob, xs in dense_ms.items():
        print(f"dense cuBLAS beside {prob}: median {sorted(xs)[len(xs) // 2]:.4f} ms")


if __name__ == "__main__":
    main()
