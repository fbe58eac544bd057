"""``kharness packs``: list, show, resolve, diff, merge, push, pull and export config packs.

``harness.cli.build_parser`` registers this group with ``add_parser(sub)``. Exit codes: 0
success, 2 bad input (bad URL, unknown hardware, missing or damaged pack, conflicting
inputs), 1 anything else (the remote end, the network).

Decisions, for the README:

- ``merge``: inputs are pack files and online-tuning record files (the JSON lists that
  ``harness.autotune(online=True)`` writes). Packs of different hardware keys are never
  merged into one file: ``--out`` refuses them, ``--dir`` writes each (hardware, kernel)
  to its own pack, merged with the pack already there. For the same (kernel, dtype,
  shape) the entry with the lower measured latency wins (``--policy fastest``, default;
  ties: the newer provenance date), or the newer one (``--policy newest``). Every config
  must pass the kernel's ``check_config`` on that hardware.
- ``merge --dir``: each target pack is read, merged and written under its lock
  (``format.locked``): merges (and runs freezing) into one pack at once keep every entry.
- ``export --format vllm-moe``: our M counts routed rows (tokens x top_k); vLLM keys its
  configs by tokens, so ``--top-k`` is required (there is no safe default: 2 for Mixtral,
  6 for DeepSeek-V2, 8 for DeepSeek-V3) and batch size = M / top_k. vLLM's file N is the
  expert intermediate size; by default it is our N (an up-projection entry, gate and up
  unfused); ``--fused-gate-up`` halves it for vLLM's fused w13 layout [E, 2N, K]. The
  device name (from the pack or ``--device-name``) is made a file name (``safe_name``):
  every file is written inside ``--out-dir``.
- Whatever a pack file holds or is (a FIFO, a directory, a symlink loop, no permission),
  a command reports it in one line: ``list`` shows it rejected, the others exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import stat
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from rich.markup import escape

EXIT_BAD_INPUT = 2
EXIT_FAILED = 1


class _BadInput(Exception):
    pass


# -- helpers ------------------------------------------------------------------------------
def _dirs(args: argparse.Namespace) -> list[Path]:
    from harness import packs

    dirs = [Path(d) for d in args.dir] if getattr(args, "dir", None) else packs.search_path()
    unique: dict[Path, Path] = {}
    for d in dirs:  # $HARNESS_PACKS may name ./packs or the shipped packs again
        unique.setdefault(d.resolve(), d)
    return list(unique.values())


def _read(path: str | Path) -> dict[str, Any]:
    from harness.packs import format as fmt

    try:
        return fmt.read(path)
    except fmt.PackError as exc:
        raise _BadInput(str(exc)) from None


def _is_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.stat(path).st_mode)
    except OSError:  # missing, a symlink loop, no permission: no directory to list
        return False


def _listing(folder: Path) -> list[Path]:
    """The entries of ``folder`` that are not hidden, sorted; [] where it is not a
    directory. OSError where it is one that cannot be listed (no permission)."""
    if not _is_dir(folder):
        return []
    return sorted(p for p in folder.iterdir() if not p.name.startswith("."))


def _pack_files(folder: Path) -> list[Path]:
    """``<hardware>/<kernel>.json`` candidates under ``folder`` whatever their file type
    (reading them says what is wrong); _BadInput for a folder that cannot be listed."""
    try:
        return [p for p in _listing(folder) if p.name.endswith(".json")]
    except OSError as exc:
        raise _BadInput(f"{folder}: cannot list: {exc.strerror or exc}") from None


def _find(dirs: list[Path], hw: str, kernel: str | None) -> list[Path]:
    """The packs that lookup would use for ``hw`` (first directory wins per kernel)."""
    found: dict[str, Path] = {}
    for root in dirs:
        for path in _pack_files(root / hw):
            if kernel is None or path.stem == kernel:
                found.setdefault(path.stem, path)
    return [found[k] for k in sorted(found)]


def _known_hw(dirs: list[Path]) -> list[str]:
    names: set[str] = set()
    for d in dirs:
        with contextlib.suppress(OSError):  # for a message only: what can be listed
            names |= {p.name for p in _listing(d) if _is_dir(p)}
    return sorted(names)


def _target(spec: str, kernel: str | None, dirs: list[Path]) -> list[Path]:
    """A pack file, or a hardware key resolved through the search path."""
    from harness.packs import format as fmt

    p = Path(spec)
    if p.suffix == ".json" or (fmt.exists(p) and not _is_dir(p)):
        if not fmt.exists(p):
            raise _BadInput(f"{spec}: no such pack file")
        return [p]  # whatever it is: reading it says what is wrong
    paths = _find(dirs, spec, kernel)
    if not paths:
        what = f"{kernel} pack" if kernel else "packs"
        raise _BadInput(f"no {what} for hardware {spec!r} in {', '.join(map(str, dirs))} "
                        f"(hardware with packs: {', '.join(_known_hw(dirs)) or 'none'})")
    return paths


def _cfg(config: dict[str, Any] | None) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted((config or {}).items()))


def _ms(v: Any) -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f"{v:.4g} ms"


# -- list / show --------------------------------------------------------------------------
def _cmd_list(args: argparse.Namespace, console: Any) -> int:
    from harness.packs import format as fmt
    from harness.packs import verify

    rows, seen = [], set()
    dirs = _dirs(args)
    for root in dirs:
        paths = []
        try:
            hw_dirs = [d for d in _listing(root) if _is_dir(d)]
        except OSError as exc:
            hw_dirs = []
            rows.append(_unlisted(root, "", exc))
        for hw_dir in hw_dirs:
            try:
                paths += [p for p in _listing(hw_dir) if p.name.endswith(".json")]
            except OSError as exc:  # a pack folder without permissions: say so
                rows.append(_unlisted(hw_dir, hw_dir.name, exc))
        for path in paths:
            row: dict[str, Any] = {"hardware": path.parent.name, "kernel": path.stem,
                                   "path": str(path)}
            try:
                data = fmt.read(path)
                verify.check(data, str(path))  # ok only where lookup would serve it
                ents = list(fmt.iter_entries(data))
                row.update(status="ok", entries=len(ents),
                           dtypes=sorted({d for _, d, _, _ in ents}),
                           triton=sorted({str(e["provenance"].get("triton", "?"))
                                          for *_, e in ents}))
            except fmt.PackError as exc:
                row.update(status=f"rejected: {exc}", entries=0, dtypes=[], triton=[])
            if (row["hardware"], row["kernel"]) in seen:
                row["status"] = "shadowed (an earlier directory has it)"
            seen.add((row["hardware"], row["kernel"]))
            rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        print(f"no packs in {', '.join(map(str, dirs))}")
        return 0
    for r in rows:
        print(f"{r['hardware']:<8} {r['kernel']:<18} {r['entries']:>4} entries  "
              f"{','.join(r['dtypes']) or '-':<10} triton {','.join(r['triton']) or '-':<8} "
              f"{r['status']:<4}  {r['path']}")
    return 0


def _unlisted(folder: Path, hardware: str, exc: OSError) -> dict[str, Any]:
    return {"hardware": hardware, "kernel": "", "path": str(folder), "entries": 0,
            "dtypes": [], "triton": [],
            "status": f"rejected: {folder}: cannot list: {exc.strerror or exc}"}


def _cmd_show(args: argparse.Namespace, console: Any) -> int:
    from harness.packs import format as fmt

    paths = _target(args.target, args.kernel, _dirs(args))
    datas = [(p, _read(p)) for p in paths]
    if args.json:
        print(json.dumps(datas[0][1] if len(datas) == 1 else {str(p): d for p, d in datas},
                         indent=1, sort_keys=True))
        return 0
    for path, data in datas:
        print(f"{path}: {data['hardware']} / {data['kernel']}")
        for kname, dtype, skey, e in fmt.iter_entries(data):
            prov = e.get("provenance", {})
            print(f"  {kname} {dtype} {skey}\n    {_cfg(e['config'])}\n"
                  f"    latency {_ms(e['metrics'].get('latency_ms'))}  "
                  f"device {prov.get('device_name', '?')}  triton {prov.get('triton', '?')}  "
                  f"torch {prov.get('torch', '?')}  {prov.get('date', '')}")
    return 0


# -- resolve ------------------------------------------------------------------------------
def _pack_status(path: Path) -> str:
    """"ok" where lookup would serve the pack, else "rejected: why" (as ``list`` says)."""
    from harness.packs import format as fmt
    from harness.packs import verify

    try:
        verify.check(fmt.read(path), str(path))
    except fmt.PackError as exc:
        return f"rejected: {exc}"
    return "ok"


def resolve(device: str | None, arch: str | None, dirs: list[Path],
            kernel: str | None = None) -> dict[str, Any]:
    """Which packs a device would use: its hardware key, its family, the keys lookup
    tries in order, and per kernel the first of them with a pack it would serve (per
    shape, a pack without an entry near the shape passes to the next)."""
    from harness.measure import families, hardware

    sm = None
    if device is None:  # this machine's
        spec = hardware.current_device()
        device, sm = spec.name, spec.sm_count
        arch = arch or hardware.current_arch()
    key = hardware.hardware_key(device)
    group = families.family_of(key, arch, device)
    order = [key, *families.siblings(key, arch, device, sm)]
    kernels: dict[str, dict[str, Any]] = {}
    for hw in order:
        for path in _find(dirs, hw, kernel):
            row = kernels.setdefault(path.stem, {"kernel": path.stem, "hardware": None,
                                                 "path": None, "source": "default",
                                                 "passed": []})
            if row["hardware"] is not None:
                continue
            status = _pack_status(path)
            if status != "ok":
                row["passed"].append({"hardware": hw, "path": str(path), "status": status})
                continue
            row.update(hardware=hw, path=str(path),
                       source="own" if hw == key else "family")
    return {"device": device, "hardware": key, "arch": arch,
            "family": group.name if group else None,
            "family_arch": group.arch if group else None, "order": order,
            "kernels": [kernels[k] for k in sorted(kernels)]}


def _cmd_resolve(args: argparse.Namespace, console: Any) -> int:
    res = resolve(args.device, args.arch, _dirs(args), args.kernel)
    if args.json:
        print(json.dumps(res, indent=1))
        return 0
    fam = (f"family {res['family']} ({res['family_arch']})" if res["family"]
           else "no family: its own packs, then the default config")
    print(f"{res['device']} -> hardware {res['hardware']}; {fam}\n"
          f"lookup order: {' -> '.join(res['order'])} -> default config")
    if not res["kernels"]:
        what = f"{args.kernel} packs" if args.kernel else "packs"
        print(f"no {what} for any of them in {', '.join(map(str, _dirs(args)))}")
    for r in res["kernels"]:
        used = (f"{r['hardware']} ({r['source']})  {r['path']}" if r["hardware"]
                else "default config (no pack it would serve)")
        print(f"  {r['kernel']:<18} {used}")
        for p in r["passed"]:
            print(f"  {'':<18} skipped {p['hardware']}: {p['status']}")
    return 0


# -- diff ---------------------------------------------------------------------------------
def _cmd_diff(args: argparse.Namespace, console: Any) -> int:
    from harness.packs import format as fmt

    dirs = _dirs(args)
    a_paths = _target(args.a, args.kernel, dirs)
    b_paths = _target(args.b, args.kernel, dirs)
    pairs: list[tuple[Path | None, Path | None]]
    if len(a_paths) == 1 and len(b_paths) == 1:
        pairs = [(a_paths[0], b_paths[0])]
    else:  # two hardware keys: pair their packs by kernel
        ka = {p.stem: p for p in a_paths}
        kb = {p.stem: p for p in b_paths}
        pairs = [(ka.get(k), kb.get(k)) for k in sorted(set(ka) | set(kb))]
    out = []
    for pa, pb in pairs:
        da = _read(pa) if pa else {"kernels": {}}
        db = _read(pb) if pb else {"kernels": {}}
        out.append({"a": str(pa) if pa else None, "b": str(pb) if pb else None,
                    "rows": fmt.diff(da, db)})
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    for d in out:
        print(f"--- {d['a'] or '(none)'}\n+++ {d['b'] or '(none)'}")
        if not d["rows"]:
            print("  (no differences)")
        for r in d["rows"]:
            lat = f"{_ms(r['latency_ms_a'])} -> {_ms(r['latency_ms_b'])}"
            if r["latency_ratio"] is not None:
                lat += f" ({(r['latency_ratio'] - 1) * 100:+.1f}%)"
            head = f"{r['kernel']} {r['dtype']} {r['shape']}"
            if r["change"] == "added":
                print(f"+ {head}: {_cfg(r['config_b'])}  {lat}")
            elif r["change"] == "removed":
                print(f"- {head}: {_cfg(r['config_a'])}  {lat}")
            elif r["change"] == "config":
                changes = ", ".join(f"{k} {r['config_a'].get(k, '-')} -> "
                                    f"{r['config_b'].get(k, '-')}" for k in r["changed_keys"])
                print(f"~ {head}: {changes}  {lat}")
            else:
                print(f"~ {head}: same config  {lat}")
    return 0


# -- merge --------------------------------------------------------------------------------
_RECORD_FIELDS = (("hardware", str, "a string"), ("family", str, "a string"),
                  ("dtype", str, "a string"), ("shape_key", str, "a string"),
                  ("config", dict, "an object"))


def _record_error(r: Any) -> str | None:
    """Why ``r`` is not an online-tuning record of the fields merge reads (None if it is)."""
    if not isinstance(r, dict):
        return f"not an online-tuning record (a JSON object), but {_json_type(r)}"
    for name, typ, what in _RECORD_FIELDS:
        if name not in r:
            return f"not an online-tuning record (missing {name!r})"
        if not isinstance(r[name], typ):
            return f"{name}: {_json_type(r[name])}, not {what}"
    prov, lat = r.get("provenance"), r.get("latency_ms")
    if prov is not None and not isinstance(prov, dict):
        return f"provenance: {_json_type(prov)}, not an object"
    if lat is not None and (isinstance(lat, bool) or not isinstance(lat, (int, float))):
        return f"latency_ms: {_json_type(lat)}, not a number"
    return None


def _json_type(v: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
             int: "a number", float: "a number", type(None): "null"}
    return names.get(type(v), type(v).__name__)


def records_to_packs(records: list[Any], where: str) -> list[dict[str, Any]]:
    """Online-tuning records (harness.autotune) as unsigned packs, one per (hw, kernel).
    Each record is checked alone (its fields' types, then the pack schema of its one
    entry): _BadInput names the first record that fails and why."""
    from harness.packs import format as fmt

    out: dict[tuple[str, str], dict[str, Any]] = {}
    for i, r in enumerate(records):
        at = f"{where}[{i}]"
        why = _record_error(r)
        if why:
            raise _BadInput(f"{at}: {why}")
        hw, kernel, dtype, skey = r["hardware"], r["family"], r["dtype"], r["shape_key"]
        entry = {"config": dict(r["config"]), "metrics": {"latency_ms": r.get("latency_ms")},
                 "provenance": dict(r.get("provenance") or {})}
        alone = {**fmt.empty(hw, kernel), "kernels": {kernel: {dtype: {skey: entry}}},
                 "checksum": "sha256:" + "0" * 64}
        why = fmt.schema_error(alone)
        if why:
            raise _BadInput(f"{at}: not a pack entry: {why}")
        pack = out.setdefault((hw, kernel), fmt.empty(hw, kernel))
        slot = pack["kernels"][kernel].setdefault(dtype, {})
        if skey not in slot or fmt.better(slot[skey], entry):
            slot[skey] = entry
    return list(out.values())


def _load_inputs(paths: list[str]) -> list[tuple[str, dict[str, Any]]]:
    from harness.packs import format as fmt

    out = []
    for p in paths:
        try:
            doc = fmt.parse_json(fmt.read_bytes(p), p)  # size-capped and bounded, like a pack
            if isinstance(doc, list):
                out += [(p, pack) for pack in records_to_packs(doc, p)]
            else:
                out.append((p, fmt.validate(doc, p)))
        except fmt.PackError as exc:
            raise _BadInput(str(exc)) from None
    return out


def _check(pack: dict[str, Any], where: str) -> None:
    """The runtime's checks (``harness.packs.verify``): a pack lookup would refuse is
    refused here, before anything is written."""
    from harness.packs import format as fmt
    from harness.packs import verify

    try:
        verify.check(pack, where)
    except fmt.PackError as exc:
        raise _BadInput(str(exc)) from None


def _destination_error(path: Path, folder: bool) -> str | None:
    """Why ``path`` cannot take a written pack (``folder``: a directory of packs), None if
    it can (it may not exist yet)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return f"{path}: a dangling symlink" if os.path.islink(path) else None
    except OSError as exc:  # a symlink loop, no permission
        return f"{path}: {exc.strerror or exc}"
    if folder and not stat.S_ISDIR(mode):
        return f"{path}: not a directory"
    if not folder and not stat.S_ISREG(mode):
        return f"{path}: {'a directory' if stat.S_ISDIR(mode) else 'not a regular file'}, " \
               "not a pack file to write"
    return None


def _cmd_merge(args: argparse.Namespace, console: Any) -> int:
    from harness.packs import format as fmt

    dest = Path(args.out or args.dir_out)
    why = _destination_error(dest, folder=not args.out)
    if why:
        raise _BadInput(f"cannot merge into {why}")
    inputs = _load_inputs(args.inputs)
    for where, pack in inputs:
        _check(pack, where)
    groups: dict[tuple[str, str], list[tuple[str, dict[str, Any]]]] = {}
    for where, pack in inputs:
        groups.setdefault((pack["hardware"], pack["kernel"]), []).append((where, pack))
    if args.out and len(groups) > 1:
        raise _BadInput("refusing to merge packs of different hardware or kernels into one "
                        f"file: {', '.join(f'{h}/{k}' for h, k in sorted(groups))} (use --dir "
                        "to write one pack each)")
    targets = {g: dest if args.out else fmt.pack_path(dest, *g) for g in groups}
    with contextlib.ExitStack() as held:
        if args.dir_out:  # read, merge and write each pack under its lock; in the order
            # of their paths as strings, as a pull takes them: no two commands deadlock
            for target in sorted(set(targets.values()), key=str):
                held.enter_context(fmt.locked(target))
        plans = []
        for (hw, kernel), members in sorted(groups.items()):
            target = targets[(hw, kernel)]
            if args.dir_out and fmt.exists(target):
                members = [(str(target), _read(target))] + members
                _check(members[0][1], members[0][0])
            try:
                merged = fmt.merge([p for _, p in members], args.policy,
                                   [w for w, _ in members])
            except fmt.PackError as exc:
                raise _BadInput(str(exc)) from None
            plans.append((target, merged, hw, kernel, len(members)))
        for target, merged, hw, kernel, n_inputs in plans:  # every group checked: now write
            fmt.write(target, merged)
            n = sum(1 for _ in fmt.iter_entries(merged))
            print(f"wrote {target}: {hw}/{kernel}, {n} entries from {n_inputs} inputs "
                  f"(policy {args.policy})")
    return 0


# -- push / pull --------------------------------------------------------------------------
def _cmd_push(args: argparse.Namespace, console: Any) -> int:
    from harness.packs import s3

    m = s3.push(args.url, args.dir or "packs", endpoint_url=args.endpoint_url,
                replace=args.replace)
    print(f"published {len(m['packs'])} packs to {args.url.rstrip('/')}/manifest.json "
          f"(id {m['id']})")
    for e in m["packs"]:
        print(f"  {e['path']}  sha256:{e['sha256'][:12]}  {e['size']} B")
    return 0


def _cmd_pull(args: argparse.Namespace, console: Any) -> int:
    from harness.packs import s3

    paths = s3.pull(args.url, args.dir or "packs", endpoint_url=args.endpoint_url,
                    manifest=args.manifest)
    print(f"pulled {len(paths)} packs from {args.url} into {args.dir or 'packs'}")
    for p in paths:
        print(f"  {p}")
    return 0


# -- export -------------------------------------------------------------------------------
_VLLM_KEYS = {"BLOCK_SIZE_M": "BLOCK_M", "BLOCK_SIZE_N": "BLOCK_N", "BLOCK_SIZE_K": "BLOCK_K",
              "GROUP_SIZE_M": "GROUP_M", "num_warps": "num_warps", "num_stages": "num_stages"}
# vLLM's dtype selector in the file name (None: no selector; bf16 and fp16 share configs).
_VLLM_DTYPE = {"bf16": None, "fp16": None, "fp32": "float32"}


def export_vllm_moe(data: dict[str, Any], top_k: int, dtype: str = "bf16",
                    device_name: str | None = None, fused_gate_up: bool = False,
                    k: int | None = None) -> dict[str, dict[str, dict[str, int]]]:
    """vLLM fused-MoE config files from a grouped_gemm pack: file name -> {batch: config}."""
    from harness.kernel import api as kernel_api
    from harness.packs import format as fmt

    fam = kernel_api.get("grouped_gemm")
    if data["kernel"] != fam.name:
        raise _BadInput(f"vllm-moe export needs a grouped_gemm pack, not {data['kernel']}")
    if top_k < 1:
        raise _BadInput("--top-k must be >= 1")
    if dtype not in _VLLM_DTYPE:
        raise _BadInput(f"--dtype {dtype}: vllm-moe export knows {sorted(_VLLM_DTYPE)}")
    ents = fmt.entries(data, fam.name, dtype)
    if not ents:
        raise _BadInput(f"the {data['hardware']} grouped_gemm pack has no {dtype} entries")
    if device_name is None:
        names = Counter(str(e["provenance"].get("device_name", "")) for e in ents.values())
        names.pop("", None)
        if not names:
            raise _BadInput("the pack records no device name: pass --device-name")
        device_name = names.most_common(1)[0][0]
    # Spaces become "_" as vLLM's get_config_file_name does; so does every character that
    # could make the name a path ("/", ".." at the start): it comes from data.
    device = fmt.safe_name(device_name, fallback="unknown")
    groups: dict[tuple[int, int], dict[int, tuple[float, dict[str, int]]]] = {}
    ks: dict[tuple[int, int], set[int]] = {}
    for skey, e in ents.items():
        s = fam.parse_shape_key(skey)
        if k is not None and s["K"] != k:
            continue
        if fused_gate_up and s["N"] % 2:
            raise _BadInput(f"{skey}: --fused-gate-up needs an even N")
        n = s["N"] // 2 if fused_gate_up else s["N"]
        ks.setdefault((s["E"], n), set()).add(s["K"])
        batch = max(1, round(s["M"] / top_k))
        cfg = {**fam.default_config, **e["config"]}
        try:  # the pack passed verify.check: typed ints; a hand-made dict may not have
            vcfg = {vk: int(cfg[ok]) for vk, ok in _VLLM_KEYS.items()}
        except (KeyError, TypeError, ValueError) as exc:
            raise _BadInput(f"{skey}: no vLLM config ({type(exc).__name__}: {exc})") from None
        lat = fmt._latency(e)
        slot = groups.setdefault((s["E"], n), {})
        if batch not in slot or lat < slot[batch][0]:
            slot[batch] = (lat, vcfg)
    clash = {g: sorted(v) for g, v in ks.items() if len(v) > 1}
    if clash:
        raise _BadInput("entries with different K map to the same vLLM file "
                        f"(E, N) -> K: {clash}; choose one with --k")
    if not groups:
        raise _BadInput(f"no {dtype} entries with K={k}")
    sel = _VLLM_DTYPE[dtype]
    out = {}
    for (e_, n), slot in sorted(groups.items()):
        name = f"E={e_},N={n},device_name={device}" + (f",dtype={sel}" if sel else "") + ".json"
        out[name] = {str(b): slot[b][1] for b in sorted(slot)}
    return out


def _cmd_export(args: argparse.Namespace, console: Any) -> int:
    from harness.measure import hardware
    from harness.packs import format as fmt

    if args.pack:
        path = Path(args.pack)
        if not path.is_file():
            raise _BadInput(f"{path}: no such pack file")
    else:
        hw = args.hardware or hardware.current_device().key
        (path,) = _target(hw, "grouped_gemm", _dirs(args))
    data = _read(path)
    _check(data, str(path))  # what lookup would refuse is not exported either
    files = export_vllm_moe(data, args.top_k, args.dtype, args.device_name,
                            args.fused_gate_up, args.k)
    out_dir = Path(args.out_dir)
    why = _destination_error(out_dir, folder=True)
    if why:
        raise _BadInput(f"cannot export into {why}")
    try:  # names from data: each one file name inside out_dir, or nothing is written
        targets = {name: fmt.child(out_dir, name) for name in files}
    except fmt.PackError as exc:
        raise _BadInput(str(exc)) from None
    for name, body in files.items():
        fmt.write_text(targets[name], json.dumps(body, indent=4) + "\n")
        print(f"wrote {targets[name]}: {len(body)} batch sizes (from {path}, top_k "
              f"{args.top_k})")
    return 0


# -- registration -------------------------------------------------------------------------
def _guard(func: Any) -> Any:
    """Bad input -> exit 2, remote trouble -> exit 1, each with one clear line."""
    def run(args: argparse.Namespace, console: Any) -> int:
        from harness.packs import s3
        from harness.packs.format import PackError

        try:
            return func(args, console)
        except (_BadInput, PackError) as exc:
            console.print(f"[bold red]error:[/] {escape(str(exc))}")
            return EXIT_BAD_INPUT
        except s3.S3Error as exc:
            console.print(f"[bold red]error:[/] {escape(str(exc))}")
            return EXIT_BAD_INPUT if exc.bad_input else EXIT_FAILED
        except ImportError as exc:
            console.print(f"[bold red]error:[/] {escape(str(exc))} (S3 needs: pip install "
                          "'kernel-harness[s3]')")
            return EXIT_FAILED
        except OSError as exc:  # a full disk, a folder that cannot be written: one line
            what = f"{exc.filename}: " if exc.filename else ""
            console.print(f"[bold red]error:[/] {escape(what + (exc.strerror or str(exc)))}")
            return EXIT_FAILED
    return run


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``kharness packs ...`` on the top-level subparsers."""
    p = subparsers.add_parser("packs", help="list, inspect, merge, publish and export packs",
                              description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="packs_command", required=True)

    def dirs(q: argparse.ArgumentParser, help_: str) -> None:
        q.add_argument("--dir", action="append", metavar="DIR", help=help_)

    search_help = ("pack directory (repeatable; default: the lookup search path: "
                   "$HARNESS_PACKS, ./packs, the shipped packs)")
    q = sub.add_parser("list", help="the packs on the search path")
    dirs(q, search_help)
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=_guard(_cmd_list))

    q = sub.add_parser("show", help="the entries of a pack")
    q.add_argument("target", help="a pack file, or a hardware key (H100, H200, ...)")
    q.add_argument("--kernel", help="with a hardware key: only this kernel's pack")
    dirs(q, search_help)
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=_guard(_cmd_show))

    q = sub.add_parser("resolve", help="which packs a GPU would use: its own, else its "
                       "family's (a GPU nobody tuned for)")
    q.add_argument("--device", help="device name as the GPU reports it, e.g. 'NVIDIA H800' "
                   "(default: this machine's)")
    q.add_argument("--arch", help="its architecture where known (sm_90, gfx942): picks the "
                   "family before the name does")
    q.add_argument("--kernel", help="only this kernel")
    dirs(q, search_help)
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=_guard(_cmd_resolve))

    q = sub.add_parser("diff", help="configs and latencies that differ between two packs")
    q.add_argument("a", help="a pack file (e.g. an older version) or a hardware key")
    q.add_argument("b", help="a pack file or a hardware key")
    q.add_argument("--kernel", help="with hardware keys: only this kernel")
    dirs(q, search_help)
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=_guard(_cmd_diff))

    q = sub.add_parser("merge", help="combine packs (and online-tuning records) of one "
                       "hardware type tuned on different machines")
    q.add_argument("inputs", nargs="+", help="pack files and/or online-tuning record files")
    dest = q.add_mutually_exclusive_group(required=True)
    dest.add_argument("--out", "-o", help="write one pack file (inputs of one hardware/kernel)")
    dest.add_argument("--dir", dest="dir_out", metavar="DIR",
                      help="merge into DIR/<hardware>/<kernel>.json, one pack per group")
    q.add_argument("--policy", choices=["fastest", "newest"], default="fastest",
                   help="which entry wins for the same shape (default: lower latency)")
    q.set_defaults(func=_guard(_cmd_merge))

    for name, help_ in (("push", "publish packs to S3 (objects first, manifest last)"),
                        ("pull", "fetch the published packs from S3, verified")):
        q = sub.add_parser(name, help=help_)
        q.add_argument("url", help="s3://bucket/prefix")
        q.add_argument("--dir", default=None, help="local pack directory (default: packs)")
        q.add_argument("--endpoint-url", default=None,
                       help="S3 endpoint (default: $AWS_ENDPOINT_URL, else AWS)")
        if name == "push":
            q.add_argument("--replace", action="store_true",
                           help="publish exactly the local packs (default: add to or "
                           "replace within the published set)")
            q.set_defaults(func=_guard(_cmd_push))
        else:
            q.add_argument("--manifest", default=None, metavar="ID",
                           help="an older published set: manifests/<ID>.json")
            q.set_defaults(func=_guard(_cmd_pull))

    q = sub.add_parser("export", help="write a pack in another framework's format")
    q.add_argument("--format", required=True, choices=["vllm-moe"])
    q.add_argument("--top-k", type=int, required=True,
                   help="experts per token: vLLM keys by tokens, our M is tokens x top_k")
    src = q.add_mutually_exclusive_group()
    src.add_argument("--hardware", help="hardware key (default: this machine's)")
    src.add_argument("--pack", help="a grouped_gemm pack file")
    dirs(q, search_help)
    q.add_argument("--dtype", default="bf16", help="pack dtype to export (default: bf16)")
    q.add_argument("--device-name", help="vLLM device name (default: the pack's provenance, "
                   "e.g. 'NVIDIA H200' -> NVIDIA_H200)")
    q.add_argument("--fused-gate-up", action="store_true",
                   help="our N is vLLM's fused gate+up width 2N: halve it in the file name")
    q.add_argument("--k", type=int, help="only entries with this K (hidden size)")
    q.add_argument("--out-dir", default=".", help="where to write (default: .)")
    q.set_defaults(func=_guard(_cmd_export))
    return p


def main(argv: list[str] | None = None) -> int:
    """``python -m harness.cli.packs ...`` (the same as ``kharness packs ...``)."""
    from rich.console import Console

    parser = argparse.ArgumentParser(prog="kharness")
    add_parser(parser.add_subparsers(dest="command", required=True))
    try:
        args = parser.parse_args(["packs", *(argv if argv is not None else sys.argv[1:])])
    except SystemExit as exc:
        return int(exc.code or 0)
    return args.func(args, Console(stderr=True, width=200))


if __name__ == "__main__":
    sys.exit(main())
