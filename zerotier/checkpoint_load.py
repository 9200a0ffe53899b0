"""Loading a checkpoint into a running engine, whatever its placement, stage or world size
(saving, and the checkpoint's layout: checkpoint.py; reading a directory untrusted:
checkpoint_read.py).

[Note: converting state dtypes on load]
A checkpoint loads into any precision.master_dtype / moment_dtype: each key is decoded to fp32
from the checkpoint's dtype and stored in the engine's (round to nearest; int8 re-quantized in
blocks from the new shard's first element), with one warning naming each conversion that loses
precision (to a narrower dtype, or int8 re-blocked under another sharding). Same dtypes load
exactly: fp32 and bf16 round-trip through fp32 unchanged, and int8 records whose range is the
new shard's are copied byte for byte (codes and block scales).
"""
from __future__ import annotations

import random
import warnings
from pathlib import Path

import torch

from .checkpoint import Parts, fingerprint
from .checkpoint_read import RankFiles, check_rule, load_rng, load_state, read_manifest, resolve, state_layout
from .errors import ZerotierError


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "numpy" in state:
        import numpy as np
        n = state["numpy"]
        np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        else:
            torch.cuda.set_rng_state(cuda[0])


def _same_range(parts, manifest: dict, unit) -> int | None:
    """The old rank whose range of `unit` is this rank's, or None."""
    for r, rank in enumerate(manifest["ranks"]):
        if rank["ranges"][unit.index] == [unit.shard_lo, unit.shard_hi]:
            return r
    return None


def _warn_lossy(parts, ckpt: Path, manifest: dict) -> None:
    """[Note: converting state dtypes on load] One warning naming the conversions that lose precision."""
    old, new = state_layout(manifest), parts.rt.unit_optimizer.layout
    lossy = [f"{k} {old.dtype(k)} -> {new.dtype(k)}" for k in new.keys if new.lossy_from(old, k)]
    if new.moments == old.moments == "int8" and any(_same_range(parts, manifest, u) is None for u in parts.rt.units):
        lossy.append("int8 moments re-quantized in the new sharding's blocks")
    if lossy:
        warnings.warn(f"load_checkpoint({ckpt}): the optimizer state loses precision: {', '.join(lossy)} "
                      f"(precision.master_dtype = {new.master!r}, moment_dtype = {new.moments!r}; the checkpoint "
                      f"was saved with {old.master!r} / {old.moments!r})", stacklevel=3)


def _load_unit_state(parts, files: RankFiles, unit, steps) -> None:
    """[Note: converting state dtypes on load] One unit's state into the engine's layout."""
    opt, old = parts.rt.unit_optimizer.state, files.layout
    lo, hi, n = unit.shard_lo, unit.shard_hi, unit.part.shard_numel
    same = _same_range(parts, files.manifest, unit)
    new = opt.slots[unit.index].layout
    for k in new.keys:
        if old.dtype(k) == new.dtype(k) == "int8" and old.fp32_below == new.fp32_below and same is not None:
            raw = new.resize(k, files.read(same, unit.index, k), hi - lo, n,  # byte for byte
                             torch.zeros(new.nbytes(k, n), dtype=torch.uint8))
            opt.write_state(unit, {k: raw}, steps, encoded=True)
            continue
        values = torch.zeros(n)
        files.piece(unit.index, k, lo, hi, values)
        opt.write_state(unit, {k: values}, steps)


def _check_fingerprint(parts, manifest: dict, ckpt: Path) -> None:
    ours, theirs = fingerprint(parts), manifest["units"]
    for i in range(max(len(ours), len(theirs))):
        a = ours[i] if i < len(ours) else None
        b = theirs[i] if i < len(theirs) else None
        strip = (lambda u: None if u is None else (u["name"], u["numel"],
                                                   [(p["shape"], p["offset"]) for p in u["params"]]))
        if strip(a) != strip(b):
            def desc(u):
                return "nothing" if u is None else f"unit {u['key']} (module '{u['name']}', {u['numel']} elements, " \
                                                   f"shapes {[p['shape'] for p in u['params']]})"
            raise ZerotierError(f"checkpoint {ckpt} does not match this model: the first difference is unit "
                                f"{i}: the checkpoint has {desc(b)}, the model has {desc(a)}. Load it into the "
                                f"model it was saved from")


def _refuse_missing_scheduler(ckpt: Path, step: int, given: bool) -> None:
    """No error may advise a path that trains differently: loading without the scheduler restarts it."""
    which = "lr_scheduler=" if given else "the engine's lr scheduler (engine.set_lr_scheduler)"
    raise ZerotierError(
        f"checkpoint {ckpt} holds no lr scheduler state (it was saved without one), so {which} cannot be restored "
        f"from it (nothing was loaded); a schedule restarted at its first step would train differently from the run "
        f"that saved it. To go on with the schedule at step {step}: build the scheduler as that run did, load the "
        f"checkpoint without one (no lr_scheduler=, no engine.set_lr_scheduler before the load), then call "
        f"scheduler.step() {step} times (exact for a schedule of the step count alone: LambdaLR, transformers' "
        f"get_*_schedule_with_warmup). Then engine.set_lr_scheduler(scheduler): every later checkpoint carries it")


def load(parts: Parts, root, *, lr_scheduler=None, trust_pickle: bool = False):
    """Load a checkpoint into the engine (collective: every rank calls it); returns client_state.

    Works into another tier placement, ZeRO stage or world size: each rank computes its own
    range of every unit and reads the overlapping pieces of the old ranks' records, verifying
    each record's crc32c. RNG states: new rank r gets old rank r's states if the old run had a
    rank r, else old rank 0's (so with more ranks than before, ranks >= the old world size
    share rank 0's random streams)."""
    ckpt = resolve(root)
    manifest = read_manifest(ckpt)
    _check_fingerprint(parts, manifest, ckpt)
    check_rule(manifest, ckpt, parts.rt.unit_optimizer.rule)
    scheduler = lr_scheduler if lr_scheduler is not None else parts.carried.lr_scheduler
    parts.synchronize()  # fetches issued but not consumed would hold the old parameters
    files = RankFiles(ckpt, manifest)
    try:
        state = load_state(ckpt, manifest, trust_pickle)
        if scheduler is not None and state["lr_scheduler"] is None:  # before anything changes
            _refuse_missing_scheduler(ckpt, state["global_steps"], given=lr_scheduler is not None)
        if scheduler is None and state["lr_scheduler"] is not None:
            warnings.warn(f"load_checkpoint({ckpt}): the checkpoint carries lr scheduler state, but no lr_scheduler= "
                          "was given and the engine has none set, so it is not restored: a scheduler built afresh "
                          "restarts its schedule at the first step. Set the scheduler before loading: "
                          "engine.set_lr_scheduler(sched) or load_checkpoint(root, lr_scheduler=sched) (see "
                          "docs/checkpoint.md)", RuntimeWarning, stacklevel=3)
        parts.carried.check(state["registered"], ckpt)
        try:
            parts.optimizer.checked(state["optimizer"])
        except ValueError as exc:
            raise ZerotierError(f"checkpoint {ckpt} does not match engine.optimizer's param groups ({exc}): "
                                "make the same add_param_group calls before loading (nothing was loaded)") from exc
        sd = parts.weights.raw_state_dict()
        for name, t in state["module_unmanaged"].items():
            if name in sd and t.shape != sd[name].shape:
                raise ZerotierError(f"checkpoint {ckpt} does not match this model: its '{name}' has shape "
                                    f"{list(t.shape)}, the model's {list(sd[name].shape)} (nothing was loaded)")
        old_world = manifest["world_size"]
        src = parts.rt.sharding.rank if parts.rt.sharding.rank < old_world else 0
        rng = load_rng(ckpt, manifest, src, trust_pickle)
        files.check([(u.index, u.shard_lo, u.shard_hi) for u in parts.rt.units])  # before anything changes
        _warn_lossy(parts, ckpt, manifest)
        for unit, step in zip(parts.rt.units, manifest["unit_steps"]):
            _load_unit_state(parts, files, unit, step)
            parts.rt.params.load(unit, parts.rt.unit_optimizer.state.read_state(unit, ("master",))["master"].cpu())
        parts.rt.params.synchronize()
    finally:
        files.close()
    with torch.no_grad(), parts.surface.batch():  # frozen units' parameters: one store per unit
        for name, t in state["module_unmanaged"].items():
            if name in sd:
                sd[name].data.copy_(t) if isinstance(sd[name], torch.nn.Parameter) else sd[name].copy_(t)
    parts.zero_grad()
    run = manifest.get("run")  # the resumed run continues its lineage ([Note: checkpoint retention])
    parts.rt.steps.restore(state["global_steps"], state["micro_steps"],
                                 run["id"] if isinstance(run, dict) and isinstance(run.get("id"), str) else None)
    parts.rt.scaler.load_state_dict(state["scaler"])
    parts.optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(state["lr_scheduler"])
    parts.carried.restore(state["registered"])
    _set_rng_state(rng)
    return state["client_state"]
