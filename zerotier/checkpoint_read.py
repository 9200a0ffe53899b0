"""Reading a checkpoint directory without trusting it: `latest` and paths confined to the
root, the manifest (its checksum and schema), the rank data files, the .pt parts loaded
weights_only. Used by checkpoint.load and by export; it knows files, not engines.

The layout is [Note: checkpoint layout] in checkpoint.py, which writes it.

[Note: checkpoints hold data]
A crc32c is no defence (anyone can compute one), so the .pt parts hold data only and are
read with torch.load(weights_only=True): tensors, numbers, strings, None and containers
of them; a crafted pickle is refused before anything in it runs (`_load_pt`). Save checks
the same (`_check_loadable` in checkpoint.py): a client_state or scheduler state that would
not load back that way is refused, with nothing written. RNG states are stored as plain
data (numpy's as a tensor). Old checkpoints with pickled objects load only with
trust_pickle=True.

[Note: reading a checkpoint]
Nothing read is trusted: every bad input is a CheckpointError naming the file (tested by
tests/test_fuzz.py). `latest` must hold one plain name of a directory in root; the
manifest's own checksum ([Note: manifest checksum]) and shape (`_check_manifest`: types,
ranges, records covering every unit, data files named rank<r>.bin) are checked before
anything is used, so nothing outside the checkpoint directory is ever opened; files must
be regular (a FIFO would block); a record is checked against its file's size before a
buffer is allocated; state.pt and rank<r>.pt are checked to hold what save wrote, RNG
states tried on throwaway generators, before the engine changes. So are the records: a
load reads every record it needs once before storing any (`RankFiles.check`; the records
are read twice), and every read checks its checksum and what it decodes to ([Note: loaded
state is checked] in optim/state_layout.py: finite, exp_avg_sq and int8 block scales >= 0).
"""
from __future__ import annotations

import json
import math
import os
import random
import reprlib
import stat
from pathlib import Path
from typing import Any

import crc32c as _crc32c
import torch

from .errors import TierIOError
from .optim import kernel_math
from .optim.rules import RULES, make_rule
from .optim.state_layout import STATE_DTYPES, StateLayout

FORMAT = 1


class CheckpointError(TierIOError):
    """A checkpoint cannot be written or read (space, corruption, missing files, mismatch)."""


def crc(data) -> int:
    return _crc32c.crc32c(data)


def state_layout(manifest: dict) -> StateLayout:
    """The optimizer state's layout the checkpoint was saved in ([Note: optimizer state layout]);
    checkpoints written before compact state have none: fp32; before [Note: small parameters keep
    fp32 moments], int8 moments everywhere (fp32_below 0); before update rules, AdamW's state
    ("optimizer": the rule's name)."""
    dtypes = manifest.get("state_dtypes") or {}
    rule = make_rule(manifest.get("optimizer", "adamw"))
    return StateLayout(dtypes.get("master", "fp32"), dtypes.get("exp_avg", "fp32"),
                       fp32_below=manifest.get("fp32_moments_below", 0), keys=rule.state_keys,
                       nonnegative=rule.nonnegative)


def check_rule(manifest: dict, ckpt, rule) -> None:
    """The checkpoint holds the state of the engine's update rule (optim/rules/): another rule's
    state is refused before anything changes."""
    saved = manifest.get("optimizer", "adamw")
    if saved != rule.name:
        raise CheckpointError(f"checkpoint {ckpt} holds {saved} optimizer state "
                              f"({', '.join(state_layout(manifest).keys)}), this engine runs {rule.name} "
                              f"({', '.join(rule.state_keys)}): load it with optimizer.type = {saved!r}")


def record_layout(manifest: dict, unit_index: int, lo: int, hi: int) -> StateLayout:
    """The layout of a record holding elements [lo, hi) of a unit: the checkpoint's layout with
    the fp32 ranges that the unit's parameters (the manifest's units) give that range."""
    params = manifest["units"][unit_index]["params"]
    return state_layout(manifest).for_params([math.prod(p["shape"]) for p in params],
                                             [p["offset"] for p in params], lo, hi)


def _load_pt(path: Path, meta: dict, trust_pickle: bool = False) -> Any:
    """[Note: checkpoints hold data] A checkpoint's .pt parts are loaded with weights_only=True:
    tensors and plain containers only, so a crafted file (with a crc32c anyone can compute)
    cannot run code. trust_pickle=True is for old checkpoints the caller wrote and trusts."""
    import io
    import pickle
    with _open_regular(path, "a .pt part") as fh:
        data = fh.read(meta["nbytes"] + 1)  # no more than the manifest's size: a huge planted file is not read
    if len(data) != meta["nbytes"] or crc(data) != meta["crc32c"]:
        raise CheckpointError(f"checkpoint {path}: checksum mismatch (or wrong size: {len(data)} bytes, "
                              f"expected {meta['nbytes']}) — the file is corrupt; load an earlier checkpoint")
    try:
        return torch.load(io.BytesIO(data), weights_only=not trust_pickle, map_location="cpu")
    except pickle.UnpicklingError as exc:
        first = (str(exc).strip().splitlines() or ["?"])[0][:200]
        raise CheckpointError(
            f"checkpoint {path}: holds objects outside torch's safe set for weights_only loading ({first}). "
            "This version writes only tensors and plain data, so the file is from an older zerotier or was "
            "tampered with; nothing in it was run. If you wrote it and trust it, load it with "
            "trust_pickle=True (engine.load_checkpoint(root, trust_pickle=True), zerotier export "
            "--trust-pickle)") from None
    except Exception as exc:  # noqa: BLE001 - torch.load of bytes that are no torch file: any error type
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise CheckpointError(f"checkpoint {path}: not a torch file ({first}) — the file is corrupt; load an "
                              f"earlier checkpoint") from None


def load_state(ckpt: Path, manifest: dict, trust_pickle: bool = False) -> dict:
    """state.pt, checked to hold what checkpoint._global_state saved (a file with a matching
    crc32c can still hold anything: [Note: checkpoints hold data])."""
    path = ckpt / "state.pt"
    state = _load_pt(path, manifest["state"], trust_pickle)

    def bad(what: str):
        raise CheckpointError(f"checkpoint {path}: {what} — not the state this code saves; load an earlier "
                              f"checkpoint")
    if not isinstance(state, dict) or not {"global_steps", "micro_steps", "scaler", "optimizer", "lr_scheduler",
                                           "client_state", "module_unmanaged"} <= state.keys():
        bad("keys missing")
    for key in ("global_steps", "micro_steps"):
        if type(state[key]) is not int or state[key] < 0:
            bad(f"{key} is {reprlib.repr(state[key])}")
    def number(v) -> bool:
        return type(v) in (int, float) and math.isfinite(v) and v >= 0

    scaler = state["scaler"]
    if not isinstance(scaler, dict) or not number(scaler.get("scale")) \
            or not all(type(scaler.get(k)) is int for k in ("good_steps", "hysteresis", "skipped_steps")):
        bad("the loss scaler's state is not {scale, good_steps, hysteresis, skipped_steps}")
    opt = state["optimizer"]
    groups = opt.get("param_groups") if isinstance(opt, dict) else None
    if not isinstance(opt.get("state") if isinstance(opt, dict) else None, dict) or not isinstance(groups, list) \
            or not groups or not all(isinstance(g, dict) and isinstance(g.get("params"), list)
                                     and all(type(i) is int for i in g["params"]) and number(g.get("lr"))
                                     for g in groups):
        bad("the optimizer's state_dict is not engine.optimizer's (param groups of parameter indices, each with "
            "an lr)")
    if state["lr_scheduler"] is not None and not isinstance(state["lr_scheduler"], dict):
        bad("the lr scheduler's state is not a dict")
    registered = state.setdefault("registered", [])  # absent before [Note: what a checkpoint carries]
    if not isinstance(registered, list) or not all(isinstance(r, dict) and isinstance(r.get("type"), str)
                                                   and "state" in r for r in registered):
        bad("the registered objects' states are not a list of {type, state}")
    unmanaged = state["module_unmanaged"]
    if not isinstance(unmanaged, dict) or not all(isinstance(k, str) and isinstance(t, torch.Tensor)
                                                  for k, t in unmanaged.items()):
        bad("module_unmanaged is not a dict of tensors by name")
    return state


def load_rng(ckpt: Path, manifest: dict, rank: int, trust_pickle: bool = False) -> dict:
    """rank<r>.pt's RNG states, tried on throwaway generators first so that
    checkpoint._set_rng_state cannot fail halfway through a load."""
    path = ckpt / f"rank{rank}.pt"
    rng = _load_pt(path, manifest["ranks"][rank]["rng"], trust_pickle)
    try:
        if not isinstance(rng, dict) or not isinstance(rng.get("rng"), dict):
            raise TypeError("no 'rng' dict")
        rng = rng["rng"]
        torch.Generator().set_state(rng["torch"])
        random.Random().setstate(rng["python"])
        if "numpy" in rng:
            import numpy as np
            n = rng["numpy"]
            if not isinstance(n, dict) or not isinstance(n.get("keys"), torch.Tensor):
                raise TypeError("numpy's state is not {kind, keys, pos, has_gauss, gauss}")
            np.random.RandomState().set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"],
                                               n["has_gauss"], n["gauss"]))
        if "cuda" in rng and not (isinstance(rng["cuda"], (list, tuple))
                                  and all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8 for t in rng["cuda"])):
            raise TypeError("cuda states are not byte tensors")
    except Exception as exc:  # noqa: BLE001 - whatever the generators refuse (type, size, value)
        raise CheckpointError(f"checkpoint {path}: not the RNG states this code saves ({type(exc).__name__}: "
                              f"{str(exc)[:200]}) — load an earlier checkpoint") from None
    return rng


def step_of(path: Path) -> int | None:
    name = path.name
    if name.startswith("ckpt-") and name[5:].isdigit():
        return int(name[5:])
    return None


def _open_regular(path: Path, what: str):
    """`path` opened for reading if it is a regular file (a FIFO or device would block or never
    end); a missing or odd file is a CheckpointError naming it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the name
        raise CheckpointError(f"checkpoint {path}: cannot open {what} ({getattr(exc, 'strerror', None) or exc}) — "
                              f"the checkpoint is incomplete; load an earlier checkpoint") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"checkpoint {path}: {what} is not a regular file — load an earlier checkpoint")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def resolve(path) -> Path:
    """A checkpoint directory from `root` (via root/latest) or a ckpt-N directory itself.

    `latest` must hold the name of a directory inside root (what save writes): an absolute
    path, `../x` or anything but one plain name is refused, so loading never leaves root."""
    path = Path(path)
    if (path / "manifest.json").is_file():
        return path
    latest = path / "latest"
    if not os.path.lexists(latest):
        try:
            found = sorted((p.name for p in path.iterdir() if step_of(p) is not None), key=lambda n: int(n[5:]))
        except OSError:  # not a directory, or not readable
            found = []
        hint = f"; it holds {', '.join(found[-3:])}: load one of them directly" if found else ""
        raise CheckpointError(f"no checkpoint at {path}: neither {path}/latest nor {path}/manifest.json "
                              f"exists{hint}")
    hint = "load one of the ckpt-* directories there directly"
    if not latest.is_file():
        kind = "a directory" if latest.is_dir() else "not a regular file"
        raise CheckpointError(f"checkpoint root {path}: 'latest' is {kind}, not the file naming the newest "
                              f"checkpoint — {hint} (and remove 'latest' so the next save can write it)")
    with _open_regular(latest, "'latest'") as fh:
        raw = fh.read(256)
    try:
        name = raw.decode("utf-8").strip()
        shown = repr(name[:60])
    except UnicodeDecodeError:
        name, shown = None, "bytes that are not UTF-8 text"
    if not name or name in (".", "..") or any(c in name for c in "/\\\0\n"):
        raise CheckpointError(f"checkpoint root {path}: 'latest' holds {shown}, not the name of a checkpoint "
                              f"directory inside {path} (like ckpt-10) — {hint}")
    target = path / name
    if not (target / "manifest.json").is_file():
        raise CheckpointError(f"checkpoint root {path}: 'latest' names {name}, which has no "
                              f"manifest.json — {hint}")
    return target


def manifest_crc(manifest: dict) -> int:
    """[Note: manifest checksum] crc32c of the manifest's canonical JSON (sorted keys, no
    spaces) without its own "crc32c" key. Save stores it in the manifest; read_manifest
    recomputes it from the parsed manifest, so any change to a value (a one-bit flip of a
    step count) is caught, while the file's bytes need not be canonical. A manifest without
    the key was written before the checksum and is read unchecked (a flip cannot delete
    the key: at most rename it, which leaves every value intact)."""
    body = {k: v for k, v in manifest.items() if k != "crc32c"}
    return crc(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def read_manifest(ckpt: Path) -> dict:
    """The manifest of checkpoint directory `ckpt`, checksum and shape verified: what it
    returns can be indexed as save wrote it, and names only files inside `ckpt`."""
    with _open_regular(ckpt / "manifest.json", "the manifest") as fh:
        data = fh.read()
    try:
        manifest = json.loads(data)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:200]
        raise CheckpointError(f"checkpoint {ckpt}/manifest.json cannot be read (not JSON: {why}) — the file is "
                              f"corrupt; load an earlier checkpoint") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"checkpoint {ckpt}/manifest.json: not a JSON object — the file is corrupt; load "
                              f"an earlier checkpoint")
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {ckpt}: format {reprlib.repr(manifest.get('format'))}, this zerotier "
                              f"reads format {FORMAT} (or the manifest is corrupt)")
    if "crc32c" in manifest and manifest["crc32c"] != manifest_crc(manifest):
        raise CheckpointError(f"checkpoint {ckpt}/manifest.json: checksum mismatch — the manifest is corrupt or "
                              f"was edited; load an earlier checkpoint")
    _check_manifest(manifest, f"checkpoint {ckpt}/manifest.json")
    return manifest


_MAX = 1 << 62  # counts and sizes past this are no checkpoint's (and overflow torch's int64)


def _check_manifest(m: dict, where: str) -> None:
    """Types, ranges and consistency of a manifest: a wrong one is a CheckpointError here,
    never a KeyError, an out-of-range read or a huge allocation later."""
    def bad(what: str):
        raise CheckpointError(f"{where}: {what} — the manifest does not describe a checkpoint this code "
                              f"wrote (damaged, or edited); load an earlier checkpoint")

    def count(value, name: str, lo: int = 0) -> int:
        if type(value) is not int or not lo <= value < _MAX:
            bad(f"{name} is {reprlib.repr(value)}, not a count >= {lo}")
        return value

    def items(value, name: str, n: int | None = None, kind: type = dict) -> list:
        if not isinstance(value, list) or (n is not None and len(value) != n) \
                or not all(isinstance(v, kind) for v in value):
            size = "" if n is None else f"{n} "
            bad(f"{name} is {reprlib.repr(value)}, not a list of {size}{kind.__name__}s")
        return value

    def file_meta(value, name: str) -> None:
        if not isinstance(value, dict):
            bad(f"{name} is {reprlib.repr(value)}, not {{nbytes, crc32c}}")
        count(value.get("nbytes"), f"{name}.nbytes")
        count(value.get("crc32c"), f"{name}.crc32c")

    for key in ("global_steps", "micro_steps"):
        count(m.get(key), key)
    world = count(m.get("world_size"), "world_size", 1)
    if m.get("zero_stage") not in (0, 1, 2, 3) or type(m.get("zero_stage")) is not int:
        bad(f"zero_stage is {reprlib.repr(m.get('zero_stage'))}, not 0-3")
    if not isinstance(m.get("param_dtype"), str):
        bad(f"param_dtype is {reprlib.repr(m.get('param_dtype'))}, not a dtype name")
    if m.get("hf_config") is not None and not isinstance(m["hf_config"], dict):
        bad("hf_config is not a JSON object")
    units = items(m.get("units"), "units")
    names: set[str] = set()
    for i, u in enumerate(units):
        if not isinstance(u.get("key"), str) or not isinstance(u.get("name"), str):
            bad(f"units[{i}] has no key or module name")
        numel = count(u.get("numel"), f"units[{i}].numel")
        for j, p in enumerate(items(u.get("params"), f"units[{i}].params")):
            at = f"units[{i}].params[{j}]"
            shape = [count(d, f"{at}.shape") for d in items(p.get("shape"), f"{at}.shape", kind=int)]
            if count(p.get("offset"), f"{at}.offset") + math.prod(shape) > numel:
                bad(f"{at} (shape {shape} at offset {p['offset']}) runs past its unit's {numel} elements")
            if not items(p.get("names"), f"{at}.names", kind=str):
                bad(f"{at}.names is empty")
            for name in p["names"]:
                if name in names or name == "__metadata__":
                    bad(f"parameter name {name!r} appears twice")
                names.add(name)
    for i, steps in enumerate(items(m.get("unit_steps"), "unit_steps", len(units), list)):
        for s in items(steps, f"unit_steps[{i}]", len(units[i]["params"]), int):
            count(s, f"unit_steps[{i}]")
    file_meta(m.get("state"), "state")
    below = m.get("fp32_moments_below", 0)  # [Note: small parameters keep fp32 moments]
    if type(below) is not int or below < 0:
        bad(f"fp32_moments_below is {reprlib.repr(below)}, not an element count")
    rule_name = m.get("optimizer", "adamw")  # the update rule whose state the records hold
    if not isinstance(rule_name, str) or rule_name not in RULES:
        bad(f"optimizer is {reprlib.repr(rule_name)}, not one of {', '.join(RULES)}")
    keys = make_rule(rule_name).state_keys
    dtypes = m.get("state_dtypes")
    if dtypes is not None:
        if not isinstance(dtypes, dict) or set(dtypes) != set(keys) \
                or not all(isinstance(dtypes[k], str) and dtypes[k] in STATE_DTYPES for k in keys) \
                or len({dtypes[k] for k in keys[1:]}) != 1 \
                or dtypes["master"] not in ("fp32", "bf16"):
            bad(f"state_dtypes is {reprlib.repr(dtypes)}, not a master dtype (fp32, bf16) and one moment dtype "
                f"(fp32, bf16, int8) for {', '.join(keys)}")
        if dtypes["exp_avg"] == "int8" and m.get("quant_block") != kernel_math.QUANT_BLOCK:
            raise CheckpointError(f"{where}: its int8 moments are quantized in blocks of "
                                  f"{reprlib.repr(m.get('quant_block'))} elements, this zerotier reads blocks of "
                                  f"{kernel_math.QUANT_BLOCK}: load it with the zerotier version that saved it and "
                                  f"save it with precision.moment_dtype = 'fp32' or 'bf16'")
    ranks = items(m.get("ranks"), "ranks", world)
    for r, rank in enumerate(ranks):
        if rank.get("file") != f"rank{r}.bin":  # a plain name: nothing outside the checkpoint is read
            bad(f"ranks[{r}].file is {reprlib.repr(rank.get('file'))}, not 'rank{r}.bin'")
        file_meta(rank.get("rng"), f"ranks[{r}].rng")
        ranges = items(rank.get("ranges"), f"ranks[{r}].ranges", len(units), list)
        for i, lo_hi in enumerate(ranges):
            lo, hi = (count(v, f"ranks[{r}].ranges[{i}]") for v in items(lo_hi, f"ranks[{r}].ranges[{i}]", 2, int))
            if not lo <= hi <= units[i]["numel"]:
                bad(f"ranks[{r}].ranges[{i}] = [{lo}, {hi}) is outside unit {i}'s {units[i]['numel']} elements")
        seen = set()
        for rec in items(rank.get("records"), f"ranks[{r}].records"):
            unit, key = rec.get("unit"), rec.get("key")
            if type(unit) is not int or not 0 <= unit < len(units) or key not in keys or (unit, key) in seen:
                bad(f"ranks[{r}] has a record for unit {reprlib.repr(unit)} key {reprlib.repr(key)}")
            seen.add((unit, key))
            lo, hi = ranges[unit]
            layout = record_layout(m, unit, lo, hi)
            if count(rec.get("nbytes"), f"ranks[{r}] record nbytes") != layout.nbytes(key, hi - lo):
                bad(f"ranks[{r}]'s {key} record of unit {unit} holds {rec['nbytes']} bytes, its range "
                    f"[{lo}, {hi}) in {layout.dtype(key)} is {layout.nbytes(key, hi - lo)}")
            count(rec.get("offset"), f"ranks[{r}] record offset")
            count(rec.get("crc32c"), f"ranks[{r}] record crc32c")
        if len(seen) != len(units) * len(keys):
            bad(f"ranks[{r}] lacks records: {len(seen)} of {len(units) * len(keys)}")
    for i, u in enumerate(units):  # the ranks' ranges cover every unit: nothing is left unread
        end = 0
        for lo, hi in sorted(rank["ranges"][i] for rank in ranks):
            if lo > end:
                break
            end = max(end, hi)
        if end != u["numel"]:
            bad(f"the ranks' ranges of unit {i} cover [0, {end}) of its {u['numel']} elements")


_VALID = {"master": "a master weight is finite",  # [Note: loaded state is checked]
          "exp_avg": "exp_avg is finite, int8 block scales finite and >= 0",
          "exp_avg_sq": "exp_avg_sq is finite and >= 0, int8 block scales too"}


class RankFiles:
    """Open data files of a checkpoint; reads records with crc32c verification. `read` returns a
    record's bytes as saved (in `layout`), `piece` fp32 values."""

    def __init__(self, ckpt: Path, manifest: dict):
        self.ckpt, self.manifest = ckpt, manifest
        self.layout = state_layout(manifest)
        self.fh: dict[int, Any] = {}
        self.index = [{(rec["unit"], rec["key"]): rec for rec in r["records"]} for r in manifest["ranks"]]

    def read(self, r: int, unit_index: int, key: str) -> torch.Tensor:
        rec = self.index[r][(unit_index, key)]
        path = self.ckpt / self.manifest["ranks"][r]["file"]  # a plain name (read_manifest)
        if r not in self.fh:
            self.fh[r] = _open_regular(path, "the data file")
        fh = self.fh[r]
        name = f"u{unit_index:05d}.{key}"
        size = os.fstat(fh.fileno()).st_size
        if rec["offset"] + rec["nbytes"] > size:  # before allocating: the manifest's sizes are not trusted
            raise CheckpointError(f"checkpoint {path}: short read of {name} at offset {rec['offset']} "
                                  f"({max(0, size - rec['offset'])} of {rec['nbytes']} bytes) — the file is "
                                  f"truncated; load an earlier checkpoint")
        out = torch.empty(rec["nbytes"], dtype=torch.uint8)
        view = memoryview(out.numpy()) if out.numel() else memoryview(bytearray())
        fh.seek(rec["offset"])
        got = fh.readinto(view) if out.numel() else 0
        if got != rec["nbytes"]:
            raise CheckpointError(f"checkpoint {path}: short read of {name} at offset {rec['offset']} ({got} of "
                                  f"{rec['nbytes']} bytes) — the file is truncated; load an earlier checkpoint")
        if crc(view) != rec["crc32c"]:
            raise CheckpointError(f"checkpoint {path}: checksum mismatch in {name} at offset {rec['offset']} — "
                                  f"the file is corrupt; load an earlier checkpoint")
        lo, hi = self.manifest["ranks"][r]["ranges"][unit_index]
        bad = record_layout(self.manifest, unit_index, lo, hi).first_bad(key, out, hi - lo)
        if bad is not None:  # [Note: loaded state is checked] in optim/state_layout.py
            what, at, value = bad
            raise CheckpointError(f"checkpoint {path}: {name} ({key} of {self._param_at(unit_index, lo + at)}) holds "
                                  f"a {what} of {value}: {_VALID[key]}, so the checkpoint was damaged or edited (its "
                                  f"checksums match); load an earlier checkpoint")
        return out

    def _param_at(self, unit_index: int, element: int) -> str:
        """The parameter holding `element` of a unit's flat, as 'name' element i."""
        for p in self.manifest["units"][unit_index]["params"]:
            if p["offset"] <= element < p["offset"] + math.prod(p["shape"]):
                return f"'{p['names'][0]}' element {element - p['offset']}"
        return f"unit {unit_index} element {element}"

    def sources(self, unit_index: int, lo: int, hi: int):
        """(old rank, its range [olo, ohi)) of each record holding elements of [lo, hi) of a unit,
        one per distinct range (replicated units: every rank saved the same flat)."""
        seen = set()
        for r, rank in enumerate(self.manifest["ranks"]):
            olo, ohi = rank["ranges"][unit_index]
            if max(lo, olo) < min(hi, ohi) and (olo, ohi) not in seen:
                seen.add((olo, ohi))
                yield r, olo, ohi

    def check(self, ranges) -> None:
        """Read every record of the elements [lo, hi) of each (unit index, lo, hi) in `ranges` once,
        one at a time: a damaged record or a bad value ([Note: loaded state is checked]) is refused
        before a load changes the engine (which then reads them again as it stores them)."""
        for unit_index, lo, hi in ranges:
            for r, _, _ in self.sources(unit_index, lo, hi):
                for key in self.layout.keys:
                    self.read(r, unit_index, key)

    def piece(self, unit_index: int, key: str, lo: int, hi: int, out: torch.Tensor) -> None:
        """Fill out[:hi-lo] (fp32) with elements [lo, hi) of a unit's flat, from every old rank
        overlapping, decoded from the checkpoint's dtype."""
        for r, olo, ohi in self.sources(unit_index, lo, hi):
            a, b = max(lo, olo), min(hi, ohi)
            layout = record_layout(self.manifest, unit_index, olo, ohi)
            data = layout.decode(key, self.read(r, unit_index, key), ohi - olo)
            out[a - lo: b - lo].copy_(data[a - olo: b - olo])

    def close(self) -> None:
        for fh in self.fh.values():
            fh.close()
        self.fh.clear()

