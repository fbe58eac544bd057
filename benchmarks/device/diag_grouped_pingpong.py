"""The warp-specialized Gluon engine (GLUON=3: a TMA producer warp, two consumer warp
groups on alternate tiles; GLUON=4: the same with its tiles from a counter) beside the
best Triton config and the single-consumer Gluon engine, on the three routings at the
MoE shape, each timed right beside dense cuBLAS of the same FLOPs; cuBLAS's batched GEMM
on the balanced routing (the same work as the grouped GEMM there) beside them.

Session 18 (Nsight Compute) found the full tiles' remaining gap to cuBLAS in the tensor
pipe's idle time around tile boundaries: this kernel overlaps one consumer's store with
the other's wgmmas, as cuBLAS's Hopper kernels do.

    python3 benchmarks/device/diag_grouped_pingpong.py [--rounds 5] [--rep 100] [--json F] \
        [--study main|sweep|grid|window|coop|fine|direct|swap|tails|tall|inline|stores|onepiece|
         tallinline]

Study ``sweep``: GLUON=3's own options (stages, grouped order, tail split, TMA store) on
the log-normal routing, one round each, to pick the ones ``main`` times. Study ``grid``:
their combinations on both realistic routings. Study ``window``: the tails dealt out
last (``window_configs``). Study ``coop``: one consumer of two warp groups
(``coop_configs``). Study ``fine``: tails below 64 rows transposed (``fine_configs``).
Study ``direct``: outputs stored from registers (``direct_configs``). Study ``swap``:
every tile transposed (``swap_configs``). Study ``tails``: transposed tiles with each
expert's tail in one piece (``tail_configs``). Study ``tall``: ping-pong tiles of 1.5
blocks (``tall_configs``). Study ``inline``: no block table launch
(``inline_configs``). Study ``stores``: the pack's kind of config with and without TMA
stores (``store_configs``). Study ``onepiece``: without the table, short tails in one
piece of the least height (``inline_fine_configs``). Study ``tallinline``: tall tiles
without the table (``tall_inline_configs``).
"""

from __future__ import annotations

from benchmarks.device.diag_grouped_bound import bmm
from benchmarks.device.diag_grouped_steady import (
    SHAPE,
    make_problems,
    time_and_report,
    timing_args,
    verify,
)
from benchmarks.device.diag_grouped_tailcost import best_config, gluon_config
from harness import packs
from kernels.grouped_gemm import GroupedGemm, _dense_baseline

# GLUON=3's fixed part: 128 x 128 tiles per consumer, 64-deep K steps.
PINGPONG = {**gluon_config(), "GLUON": 3, "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64,
            "num_warps": 4, "num_stages": 4, "GROUP_M": 1, "TAIL_SPLIT": 1, "TMA_STORE": 1}


def pingpong(**change: int) -> dict:
    """GLUON=3's base config with ``change``."""
    return {**PINGPONG, **change}


def sweep_configs() -> dict[str, dict]:
    """GLUON=3's options, one at a time from the base."""
    out = {"ping-pong s4": pingpong()}
    for stages in (3, 5):
        out[f"ping-pong s{stages}"] = pingpong(num_stages=stages)
    for g in (4, 8):
        out[f"ping-pong GROUP_M={g}"] = pingpong(GROUP_M=g)
    out["ping-pong TAIL_SPLIT=0"] = pingpong(TAIL_SPLIT=0)
    out["ping-pong TMA_STORE=0"] = pingpong(TMA_STORE=0)
    out["ping-pong BLOCK_K=128 s2"] = pingpong(BLOCK_K=128, num_stages=2)
    return out


def grid_configs() -> dict[str, dict]:
    """Study ``grid``: stages x grouped order x TMA store, the options call 2's sweep
    left open (session 19)."""
    return {f"ping-pong s{s} GROUP_M={g} TMA_STORE={t}": pingpong(num_stages=s, GROUP_M=g,
                                                                  TMA_STORE=t)
            for s in (4, 5) for g in (1, 2, 4) for t in (0, 1)}


def window_configs() -> dict[str, dict]:
    """Study ``window``: the tails after every full block (the table's TAIL_WINDOW over
    the last experts; 64 = all of them), so that the fixed stride deals the short tiles
    out last, to the programs with one full tile fewer. Modelled on the two routings'
    tables (a half tile at 0.5-0.7 of a full one): the busiest program's excess over the
    mean falls from 1.9-3.9 % to 0.1-1.1 %."""
    return {f"ping-pong s{s} TAIL_WINDOW={w}": pingpong(num_stages=s, TAIL_WINDOW=w)
            for s in (4, 5) for w in (0, 16, 64)}


def coop_configs() -> dict[str, dict]:
    """Study ``coop``: one consumer of two warp groups splitting 256 x 128 tiles (the
    tile and split of cuBLAS's batched GEMM here, nvjet_sm90_tst_128x256_64x4, session
    18 call 17), beside ping-pong s5: a W box serves twice the rows, the store is not
    hidden."""
    coop = pingpong(num_warps=8, BLOCK_M=256, num_stages=3, TAIL_SPLIT=2)
    return {"ping-pong s5": pingpong(num_stages=5),
            "coop 256x128 s3": coop,
            "coop 256x128 BK32 s6": {**coop, "BLOCK_K": 32, "num_stages": 6},
            "coop 256x128 s3 TAIL_SPLIT=1": {**coop, "TAIL_SPLIT": 1},
            "coop 256x128 s3, counter": {**coop, "GLUON": 4},
            "coop 128x256 s3": {**coop, "BLOCK_M": 128, "BLOCK_N": 256, "TAIL_SPLIT": 1},
            "ping-pong s5 (again)": pingpong(num_stages=5)}


def fine_configs() -> dict[str, dict]:
    """Study ``fine``: tails below 64 rows transposed (TAIL_SPLIT=2: halves and 32-row
    quarters; TAIL_FINE 1 / 2: the last quarter down to 16 / 8 rows), against the
    half-tile tails. Modelled on the two routings' tables: the padded rows fall from
    3.8 / 4.6 % of M to 1.5 / 1.4 %, for 12 / 8 more tail pieces."""
    out = {}
    for st in (4, 5):
        out[f"ping-pong s{st}"] = pingpong(num_stages=st)
        for fine in (0, 1, 2):
            out[f"ping-pong s{st} TAIL_SPLIT=2 TAIL_FINE={fine}"] = pingpong(
                num_stages=st, TAIL_SPLIT=2, TAIL_FINE=fine)
    return out


def direct_configs() -> dict[str, dict]:
    """Study ``direct``: outputs stored straight from the accumulators' registers
    (DIRECT_STORE), so the staging tiles' shared memory goes to the ring: ping-pong with
    6-7 stages, and the cooperative split with cuBLAS's 128x256 tile and 4 stages (call
    12: cuBLAS's bmm streams 24 KB a K step per 128x128 of output, ping-pong 32 KB)."""
    coop = pingpong(num_warps=8, BLOCK_N=256, num_stages=4, TMA_STORE=0, DIRECT_STORE=1)
    return {"ping-pong s5": pingpong(num_stages=5),
            "this GPU's pack (ping-pong s4, staged masked stores)": pingpong(TMA_STORE=0),
            "ping-pong s6 direct": pingpong(num_stages=6, TMA_STORE=0, DIRECT_STORE=1),
            "ping-pong s7 direct": pingpong(num_stages=7, TMA_STORE=0, DIRECT_STORE=1),
            "coop 128x256 s4 direct": coop,
            "coop 256x128 s4 direct": {**coop, "BLOCK_M": 256, "BLOCK_N": 128,
                                       "TAIL_SPLIT": 2},
            "ping-pong s5 (again)": pingpong(num_stages=5)}


def swap_configs() -> dict[str, dict]:
    """Study ``swap``: every tile transposed (SWAP_AB), W's rows on wgmma's M and the
    routed rows on its N: the form of cuBLAS's batched GEMM here (session 19 call 12,
    nvjet_sm90_tst_128x256_64x4_1x1_h_bz_coopA_TNN: 128 of W's rows by 256 routed rows,
    split between two warp groups, 4 stages of 64). Cooperative 256-row tiles, their
    tails transposed down to 16 rows, with staged TMA stores (3 stages fit) or register
    stores (4 stages); ping-pong transposed."""
    coop = pingpong(num_warps=8, BLOCK_M=256, num_stages=3, TAIL_SPLIT=2, SWAP_AB=1)
    return {"ping-pong s5": pingpong(num_stages=5),
            "ping-pong s5 SWAP_AB": pingpong(num_stages=5, SWAP_AB=1),
            "coop 256x128 s3 SWAP_AB": coop,
            "coop 256x128 s3 SWAP_AB TAIL_FINE=2": {**coop, "TAIL_FINE": 2},
            "coop 256x128 s4 SWAP_AB direct TAIL_FINE=2": {
                **coop, "num_stages": 4, "TMA_STORE": 0, "DIRECT_STORE": 1, "TAIL_FINE": 2},
            "coop 256x128 BK32 s6 SWAP_AB TAIL_FINE=2": {**coop, "BLOCK_K": 32,
                                                         "num_stages": 6, "TAIL_FINE": 2},
            "ping-pong s5 (again)": pingpong(num_stages=5)}


def tail_configs() -> dict[str, dict]:
    """Study ``tails``: every tile transposed, each expert's tail in one piece of the
    least height that holds it (TAIL_SPLIT=1 with TAIL_FINE=2: a tail of r rows streams
    W[e] once, where TAIL_SPLIT=2 runs up to two pieces), ping-pong and cooperative, the
    latter with its tiles also from the counter (session 19 call 6: 2-4 points on the
    realistic routings). Call 1 of session 20 (``swap``): the cooperative 256-row kernel
    transposed at 96.2 % on the balanced routing, 83-85 % on the realistic ones."""
    coop = pingpong(num_warps=8, BLOCK_M=256, num_stages=3, TAIL_SPLIT=1, SWAP_AB=1)
    swap = pingpong(num_stages=5, SWAP_AB=1)
    return {"ping-pong s5": pingpong(num_stages=5),
            "ping-pong s5 SWAP_AB": swap,
            "ping-pong s5 SWAP_AB one tail": {**swap, "TAIL_FINE": 2},
            "ping-pong s5 SWAP_AB TAIL_SPLIT=2 TAIL_FINE=2": {**swap, "TAIL_SPLIT": 2,
                                                               "TAIL_FINE": 2},
            "ping-pong s4 SWAP_AB TMA_STORE=0": {**swap, "num_stages": 4, "TMA_STORE": 0},
            "coop 256x128 s3 SWAP_AB one tail": {**coop, "TAIL_FINE": 2},
            "coop 256x128 s3 SWAP_AB one tail, counter": {**coop, "TAIL_FINE": 2, "GLUON": 4},
            "coop 256x128 s3 SWAP_AB TAIL_SPLIT=1, counter": {**coop, "GLUON": 4},
            "coop 256x128 s3 SWAP_AB TAIL_SPLIT=0, counter": {**coop, "GLUON": 4,
                                                               "TAIL_SPLIT": 0},
            "ping-pong s5 SWAP_AB (again)": swap}


def tall_configs() -> dict[str, dict]:
    """Study ``tall``: ping-pong, transposed, tiles of 192 rows (TALL_TILE: two
    accumulators a consumer, 192 fp32 registers a thread), so that a W box serves 1.5
    times the rows: modelled on the log-normal table, the boxes streamed fall by 15 %
    (1,368 against 1,616 64x64 boxes per n-tile and K step; the balanced routing at
    128-row tiles, 95 % of dense in calls 1-2, streams 1,536)."""
    swap = pingpong(num_stages=5, SWAP_AB=1, TAIL_FINE=2)
    tall = {**swap, "num_stages": 4, "TALL_TILE": 1}
    direct = {**tall, "num_stages": 5, "TMA_STORE": 0, "DIRECT_STORE": 1}
    return {"ping-pong s5": pingpong(num_stages=5),
            "ping-pong s5 SWAP_AB one tail": swap,
            "tall s4": tall,
            "tall s4 TAIL_FINE=0": {**tall, "TAIL_FINE": 0},
            "tall s4, counter": {**tall, "GLUON": 4},
            "tall s3": {**tall, "num_stages": 3},
            "tall s5 direct": direct,
            "tall s4 GROUP_M=4": {**tall, "GROUP_M": 4},
            "ping-pong s5 SWAP_AB one tail (again)": swap}


def inline_configs() -> dict[str, dict]:
    """Study ``inline`` (session 21): GLUON=3 with BLOCK_TABLE=0, every partition finding
    its tiles' experts from the offsets, so a call is one launch, not the table's and the
    GEMM's (``probe_table_share.py``, H200 call 9: the table launch added 11 us, 2.4 %,
    to a 470 us call); session 22 adds TAIL_DEAL (each wave's half tiles dealt
    round-robin to the programs)."""
    swap = pingpong(num_stages=5, SWAP_AB=1)
    inline = {**swap, "BLOCK_TABLE": 0}
    dealt = {**inline, "TAIL_DEAL": 1}
    pack = packs.lookup_entry("grouped_gemm", "bf16", **SHAPE)
    return {f"this GPU's pack ({pack.source})": dict(pack.config),
            "ping-pong s5 SWAP_AB": swap,
            "ping-pong s5 SWAP_AB, no table": inline,
            "ping-pong s5 SWAP_AB, no table, dealt": dealt,
            "ping-pong s5, no table, dealt": {**dealt, "SWAP_AB": 0},
            "ping-pong s4 SWAP_AB, no table, dealt": {**dealt, "num_stages": 4},
            "ping-pong s5 SWAP_AB (again)": swap,
            "ping-pong s5 SWAP_AB, no table (again)": inline,
            "ping-pong s5 SWAP_AB, no table, dealt (again)": dealt}


def store_configs() -> dict[str, dict]:
    """Study ``stores`` (session 23): transposed ping-pong s5 without the table, with TMA
    stores (whole tiles inside their expert) and without (every tile's masked stores from
    the staging tile), dealt and not, each twice. Session 23's call 1 had the H200 pack
    (no TMA stores; the transposed grid's re-measurement put it first, 0.4702 ms) at
    87.5 % of dense and the same config with TMA stores at 89.6-90.1 %."""
    swap = pingpong(num_stages=5, SWAP_AB=1, BLOCK_TABLE=0)
    out = {}
    for rep in ("", " (again)"):
        for deal in (0, 1):
            for tma in (1, 0):
                name = f"ping-pong s5 SWAP_AB, no table, TMA_STORE={tma}"
                out[name + (", dealt" if deal else "") + rep] = {**swap, "TMA_STORE": tma,
                                                                 "TAIL_DEAL": deal}
    return out


def inline_fine_configs() -> dict[str, dict]:
    """Study ``onepiece`` (session 23): without the table, an expert's short tail as one
    piece of the least height that holds it (TAIL_FINE: 64, 32 or 16 rows, one W stream
    each), dealt or not, beside the H200 pack (s4, dealt, half tails) and the same with
    5 stages. On the harness's routing (31 of the 64 experts end in a short tail) the
    padded rows fall from 1,856 (3.8 % of M) to 1,296 (2.6 %), for no more W streams;
    with the table (session 20) one-piece tails measured within noise of half tails."""
    swap = pingpong(num_stages=5, SWAP_AB=1, BLOCK_TABLE=0, TMA_STORE=0, TAIL_DEAL=1)
    out = {}
    for rep in ("", " (again)"):
        out["the H200 pack: s4 dealt" + rep] = {**swap, "num_stages": 4}
        out["s5 dealt" + rep] = swap
        out["s5 dealt, one-piece tails" + rep] = {**swap, "TAIL_FINE": 2}
        out["s4 dealt, one-piece tails" + rep] = {**swap, "num_stages": 4, "TAIL_FINE": 2}
    return out


def tall_inline_configs() -> dict[str, dict]:
    """Study ``tallinline`` (session 24): tall tiles (1.5 blocks, a W box for 192 rows)
    without the table, so one launch; an expert's rows in tall tiles and one last tile
    of at most a block, dealt or not, beside the H200 pack (s4 dealt, 128-row tiles) and
    the finalists' best median (s5 dealt, TMA stores). Tall tiles need 4 stages (their
    slots hold half a block more of A); with the table and the counter they bought
    nothing on the H200 and 5-6 points on the H100 (session 20)."""
    pack = pingpong(num_stages=4, SWAP_AB=1, BLOCK_TABLE=0, TMA_STORE=0, TAIL_DEAL=1)
    tall = {**pack, "TALL_TILE": 1}
    return {"the H200 pack: s4 dealt": pack,
            "s5 dealt, TMA stores": {**pack, "num_stages": 5, "TMA_STORE": 1},
            "tall s4, no table, dealt": tall,
            "tall s4, no table, dealt, TMA stores": {**tall, "TMA_STORE": 1},
            "tall s4, no table, dealt, one-piece tails": {**tall, "TAIL_FINE": 2},
            "tall s4, no table": {**tall, "TAIL_DEAL": 0},
            "tall s4, table": {**tall, "TAIL_DEAL": 0, "BLOCK_TABLE": 1},
            "the H200 pack: s4 dealt (again)": pack,
            "tall s4, no table, dealt (again)": tall}


def main_configs() -> dict[str, dict]:
    """The best Triton config, the Gluon engine and this GPU's pack beside GLUON=3 / 4
    and the transposed ping-pong (ping-pong s5 twice: the run's noise floor)."""
    pack = packs.lookup_entry("grouped_gemm", "bf16", **SHAPE)
    return {"best Triton config": best_config(), "Gluon, stride": gluon_config(),
            f"this GPU's pack ({pack.source})": dict(pack.config),
            "ping-pong s5": pingpong(num_stages=5),
            "ping-pong s5, counter": pingpong(num_stages=5, GLUON=4),
            "ping-pong s5 SWAP_AB": pingpong(num_stages=5, SWAP_AB=1),
            "ping-pong s5 (again)": pingpong(num_stages=5)}


def main() -> None:
    args = timing_args(rounds=5, study="main").parse_args()
    fam = GroupedGemm()
    problems = make_problems(fam)
    if args.study == "sweep":
        cfgs = sweep_configs()
        problems = {"log-normal": problems["log-normal"]}
    elif args.study == "coop":
        cfgs = coop_configs()
    elif args.study == "direct":
        cfgs = direct_configs()
    elif args.study == "swap":
        cfgs = swap_configs()
    elif args.study == "tails":
        cfgs = tail_configs()
    elif args.study == "tall":
        cfgs = tall_configs()
    elif args.study == "stores":
        cfgs = store_configs()
        problems = {"log-normal": problems["log-normal"]}
    elif args.study == "onepiece":
        cfgs = inline_fine_configs()
        del problems["balanced"]
    elif args.study == "tallinline":
        cfgs = tall_inline_configs()
    elif args.study == "inline":
        cfgs = inline_configs()
        del problems["balanced"]
    elif args.study in ("grid", "window", "fine"):
        cfgs = {"grid": grid_configs, "window": window_configs,
                "fine": fine_configs}[args.study]()
        del problems["balanced"]
    else:
        cfgs = main_configs()
    fns: dict = {}
    dense: dict = {}
    notes: dict[str, str] = {}
    for prob, inputs in problems.items():
        ref = fam.reference(inputs, SHAPE)
        cands = {name: (lambda c=cfg, i=inputs: fam.launcher(i, SHAPE, c))
                 for name, cfg in cfgs.items()}
        if prob == "balanced":
            cands["cuBLAS bmm"] = lambda i=inputs: bmm(i, False)[0]
        verify(cands, ref, prob, fns, notes)
        dense[prob] = _dense_baseline(inputs, SHAPE)
        del ref
    time_and_report(fns, dense, notes, args.rounds, args.rep, args.json, configs=cfgs)
    for name, cfg in cfgs.items():
        print(f"{name}: {cfg}")


if __name__ == "__main__":
    main()
