"""Checkpoints of a zerotier run: save (load, into another placement / world size, is in
checkpoint_load.py).

    engine.save_checkpoint("ckpts", lr_scheduler=sched, client_state={"epoch": 3})
    client_state = engine.load_checkpoint("ckpts", lr_scheduler=sched)

Reading and checking a checkpoint directory (trusting nothing in it) is in
zerotier/checkpoint_read.py; export to plain model weights (.safetensors / .pt) is in
zerotier/export.py. Save and load receive the engine's `Parts` (below), never the engine.

[Note: checkpoint layout]
    root/latest                  "ckpt-<step>\\n": the newest complete checkpoint
    root/.zerotier-lock          held by the run saving here ([Note: the checkpoint root lock])
    root/ckpt-<step>/manifest.json   format, world size, stage, dtypes, fingerprint (units with
                                 their parameter names and shapes), per rank and unit the real
                                 element range [lo, hi) and the records (offset, nbytes, crc32c)
    root/ckpt-<step>/rank<r>.bin the update rule's state (AdamW: master, exp_avg, exp_avg_sq;
                                 manifest "optimizer") of rank r's real range of every
                                 unit, one record each, in unit order, in the state's layout
                                 (manifest "state_dtypes", "quant_block": [Note: optimizer state
                                 layout] in optim/state_layout.py; raw little-endian; no state_dtypes:
                                 fp32, as written before compact state)
    root/ckpt-<step>/rank<r>.pt  rank r's RNG states (torch CPU, CUDA, python, numpy)
    root/ckpt-<step>/state.pt    rank 0: steps, loss scaler, lr holder, lr scheduler,
                                 client_state, unmanaged module state (frozen params, buffers)
The .pt files' crc32c are in the manifest too. Low-precision parameters are not saved: on
load they are the master rounded to the param dtype, which is what the engine keeps.

[Note: checkpoint atomicity]
Every rank writes into root/.ckpt-<step>.tmp-<random>/ and fsyncs its files; a
cross-rank check makes a rank failing mid-save fail all. Rank 0 then writes the
manifest, fsyncs the directory, renames it to ckpt-<step> (an existing ckpt-<step>
is renamed aside first and deleted afterwards), fsyncs root and atomically replaces
`latest` (write latest.tmp, fsync, rename, fsync root). Until `latest` flips, the
previous checkpoint is the one loaded. Then retention runs ([Note: checkpoint retention]).
Directories and files are created 0700 / 0600 whatever the umask: a checkpoint is the
run's training state, for its owner only.

[Note: checkpoint retention]
Only what this code wrote is ever deleted, recognized by content, not by name: a
directory counts as a zerotier checkpoint when its manifest.json parses with our format
and it holds nothing but the files a save writes (`_is_ours`). Each engine carries a
run id (new at initialize, adopted from the checkpoint on load_checkpoint, so a resumed
run continues its lineage) and each manifest records it with the save time. After a
save, the newest `keep` checkpoints of the current run are kept and older ones of the
run deleted; other runs' checkpoints in the same root are never touched. A save onto a
`ckpt-<step>` that is not ours (another tool's directory, a file) is refused before
anything is written; temporary leftovers of killed saves are removed only when they
hold nothing but our files.
"""
from __future__ import annotations

import collections
import dataclasses
import errno
import json
import os
import random
import re
import secrets
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import torch

from .checkpoint_read import FORMAT, CheckpointError, crc, manifest_crc, step_of
from .errors import ZerotierError
from .io import aligned_empty, open_direct, open_engine, round_up
from .optim import kernel_math

KEEP = 2  # checkpoints of the current run kept by default ([Note: checkpoint retention])
_OUR_FILE = re.compile(r"manifest\.json|state\.pt|rank\d+\.(bin|pt)")



@dataclasses.dataclass(frozen=True)
class Parts:
    """What save and load touch, handed over by the engine at each call: its parts ([Note: the
    runtime record] in engine/runtime.py: stores, sharding, scaler, units, the step counters),
    its config now, engine.optimizer (the param groups), what every checkpoint carries
    (carried.py), the user's weights (restore.py: the unmanaged state), the parameter surface
    (a load's writes to frozen parameters), the roots this run saves into (checkpoint_lock.py),
    and the engine's synchronize and zero_grad."""
    rt: Any
    cfg: Any
    optimizer: Any
    carried: Any
    weights: Any
    surface: Any
    locks: Any
    synchronize: Callable[[], None]
    zero_grad: Callable[[], None]


# ------------------------------------------------------------------------------- helpers

def _write_bytes(fh, data) -> None:
    """One write of a file's bytes (a seam for fault injection in tests)."""
    fh.write(data)


def _create(path: Path):
    """A new file for writing, 0600 whatever the umask, never through a symlink."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT
    return os.fdopen(fd, "wb")


def _mkdir_private(path: Path) -> None:
    """Create `path` (and missing parents) 0700; an existing directory is left as it is."""
    if not path.is_dir():
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(path, 0o700)  # mkdir's mode is filtered by the umask


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_pt(obj: Any, path: Path) -> dict:
    """torch.save to `path` through _write_bytes, fsynced; returns {nbytes, crc32c}."""
    import io
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getbuffer()
    with _create(path) as fh:
        _write_bytes(fh, data)
        fh.flush()
        os.fsync(fh.fileno())
    return {"nbytes": len(data), "crc32c": crc(data)}


def _check_loadable(obj: Any, what: str) -> None:
    """[Note: checkpoints hold data] (checkpoint_read.py): refuse at save what would not load with weights_only=True."""
    import io
    buf = io.BytesIO()
    try:
        torch.save(obj, buf)
        buf.seek(0)
        torch.load(buf, weights_only=True, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - pickling errors, UnpicklingError: all mean "not data"
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise CheckpointError(f"save_checkpoint: {what} holds objects that cannot be loaded back safely "
                              f"(torch.load(weights_only=True): {first}). A checkpoint stores data, not code: "
                              "keep to tensors, numbers, strings, None, lists, tuples and dicts of them") from None


def _space_error(tmp: Path, what: str, exc: OSError) -> CheckpointError:
    if exc.errno == errno.ENOSPC:
        return CheckpointError(f"checkpoint save into {tmp.parent}: no space left on device while writing "
                               f"{what} — free space on that filesystem (or save to another directory) and "
                               f"save again; the previous checkpoint is intact and nothing was left behind")
    return CheckpointError(f"checkpoint save into {tmp.parent}: writing {what} failed: {exc.strerror or exc}; "
                           f"the previous checkpoint is intact")


def _dist():
    import torch.distributed as dist
    return dist


def _names(module: torch.nn.Module) -> dict[int, list[str]]:
    """id(param) -> every name it has in the module (tied weights have several)."""
    out: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), []).append(name)
    return out


def fingerprint(parts) -> list[dict]:
    """The model's description stored in the manifest: units with parameter names and shapes."""
    names = _names(parts.rt.module)
    return [{"key": u.key, "name": u.name, "numel": u.numel,
             "params": [{"names": names[id(p)], "shape": list(s), "offset": off}
                        for p, s, off in zip(u.params, u.shapes, u.offsets)]}
            for u in parts.rt.units]


def _unmanaged_state(parts) -> dict[str, torch.Tensor]:
    """Frozen parameters and buffers (everything in module.state_dict() zerotier does not train); frozen
    units' parameters are read from their home through the surface ([Note: frozen units] in state.py)."""
    managed = {id(p) for u in parts.rt.units for p in u.params}
    out = {}
    for name, t in parts.weights.raw_state_dict().items():
        if id(t) not in managed:
            out[name] = t.detach().cpu().clone()
    return out


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy as np
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                          "has_gauss": int(has_gauss), "gauss": float(gauss)}  # plain data: weights_only
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


# ------------------------------------------------------------------------------- save

def save(parts: Parts, root, *, lr_scheduler=None, client_state=None, keep: int | None = KEEP) -> Path:
    """Save the engine's training state under `root` (collective: every rank calls it).

    Returns the checkpoint directory root/ckpt-<global_steps>. `keep`: how many of this
    run's checkpoints to keep (None: all). See [Note: checkpoint layout],
    [Note: checkpoint atomicity] and [Note: checkpoint retention]."""
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ZerotierError(f"save_checkpoint(keep={keep!r}): keep is how many of this run's checkpoints "
                            f"to keep, an int >= 1 (or None to keep all)")
    accum = parts.cfg.train.grad_accum_steps
    if parts.rt.steps.micro_steps % accum:
        raise ZerotierError(f"save_checkpoint at micro-step {parts.rt.steps.micro_steps}: in the middle of a gradient "
                            f"accumulation window (grad_accum_steps = {accum}); the accumulated gradients are "
                            f"not saved. Save right after an engine.step() that returned True")
    rank, world = parts.rt.sharding.rank, parts.rt.sharding.world
    problem = None
    root = Path(root)
    final = root / f"ckpt-{parts.rt.steps.global_steps}"
    lr_scheduler = lr_scheduler if lr_scheduler is not None else parts.carried.lr_scheduler
    registered = []  # [Note: what a checkpoint carries] in carried.py
    try:  # before anything is written: a refused save leaves nothing behind
        _check_loadable(client_state, "client_state")
        if lr_scheduler is not None:
            _check_loadable(lr_scheduler.state_dict(), "the lr scheduler's state_dict()")
        registered = parts.carried.states()
        _check_loadable(registered, "a registered object's state_dict() (engine.register_for_checkpointing)")
        if rank == 0 and os.path.lexists(final) and not _is_ours(final):
            raise CheckpointError(errno.EEXIST, f"save_checkpoint: {final} exists and is not a zerotier "
                                                f"checkpoint (not written by this code); it is left as it is: "
                                                f"move it away or save to another directory")
        latest = root / "latest"
        if rank == 0 and latest.is_dir() and not latest.is_symlink():  # the commit could not replace it
            raise CheckpointError(errno.EISDIR, f"save_checkpoint: {latest} is a directory, not the file naming "
                                                f"the newest checkpoint; nothing was written: remove or rename "
                                                f"it, or save to another directory")
        if rank == 0:  # [Note: the checkpoint root lock] in checkpoint_lock.py
            parts.locks.acquire(root, parts.rt.steps.run_id)
    except CheckpointError as exc:
        problem = exc
    if world > 1:  # every rank stops, the one with the problem with its own message
        try:
            parts.rt.sharding.comm.check_all_ranks(problem is None, "save_checkpoint: client_state")
        except ZerotierError:
            if problem is None:
                raise
    if problem is not None:
        raise problem
    parts.synchronize()
    step = parts.rt.steps.global_steps
    dist = _dist() if world > 1 else None
    token = [secrets.token_hex(4)]
    if dist is not None:
        dist.broadcast_object_list(token, src=0)
    tmp = root / f".ckpt-{step}.tmp-{token[0]}"
    error: BaseException | None = None
    records: list[dict] = []
    files: dict[str, dict] = {}
    try:
        _mkdir_private(root)
        _mkdir_private(tmp)
        records = _write_rank_data(parts, tmp / f"rank{rank}.bin")
        files[f"rank{rank}.pt"] = _save_pt({"rng": _rng_state()}, tmp / f"rank{rank}.pt")
        if rank == 0:
            files["state.pt"] = _save_pt(_global_state(parts, lr_scheduler, client_state, registered),
                                         tmp / "state.pt")
    except OSError as exc:
        error = exc if isinstance(exc, CheckpointError) else _space_error(tmp, f"rank {rank}'s files", exc)
    except BaseException as exc:  # noqa: BLE001 — re-raised below, after the other ranks know
        error = exc
    try:
        if dist is not None:
            parts.rt.sharding.comm.check_all_ranks(error is None, "checkpoint save")
    except BaseException as exc:
        if error is None:
            error = exc
    if error is not None:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise error
    gathered = [(records, files)]
    if dist is not None:
        gathered = [None] * world
        dist.all_gather_object(gathered, (records, files))
    if rank == 0:
        try:
            _commit(parts, root, tmp, final, gathered, keep)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            error = exc if isinstance(exc, CheckpointError) else _space_error(tmp, "the manifest", exc)
        except BaseException as exc:  # noqa: BLE001
            shutil.rmtree(tmp, ignore_errors=True)
            error = exc
    if dist is not None:
        try:
            parts.rt.sharding.comm.check_all_ranks(error is None, "checkpoint commit")
        except BaseException as exc:
            if error is None:
                error = exc
    if error is not None:
        raise error
    return final


_WRITES_IN_FLIGHT = 3  # records (one unit) being written at once ([Note: checkpoint streaming])


def _write_record(eng, fd: int, buf: torch.Tensor, offset: int, path: str):
    """Submit one record's write (a seam for fault injection in tests); returns its ticket."""
    return eng.write(fd, buf, offset, path)


def _write_rank_data(parts, path: Path) -> list[dict]:
    """[Note: checkpoint streaming] This rank's real optimizer-state ranges go to `path` through
    zerotier's I/O engine, O_DIRECT where the filesystem allows: each record starts at an
    `io.alignment` boundary (nbytes stays exact; the padding after it is zeros and no reader
    looks at it), up to _WRITES_IN_FLIGHT records are in flight from aligned buffers, and the
    next unit's state is being read from the NVMe tier meanwhile (UnitOptimizer.iter_state):
    the drive's queue stays full instead of each read and write waiting for the last. The
    host memory this takes is the buffers of the units in flight, not the model's state."""
    io_cfg = parts.cfg.io
    align = io_cfg.alignment
    records, inflight = [], collections.deque()
    offset = 0
    store = parts.rt.unit_optimizer.state
    layout = store.layout

    def retire(item) -> None:
        ticket, want, _keep = item
        got = ticket.wait()
        if got != want:
            raise OSError(errno.EIO, f"short write: {got} of {want} bytes")
    with open_engine(io_cfg) as eng:
        fd, _direct = open_direct(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, direct=io_cfg.o_direct)
        try:
            try:
                for unit, state in store.iter_state(parts.rt.units, align):
                    n, unit_layout = unit.shard_hi - unit.shard_lo, store.slots[unit.index].layout
                    for k in layout.keys:
                        nbytes = unit_layout.nbytes(k, n)
                        padded = round_up(nbytes, align) if nbytes else 0
                        t = state[k]  # aligned, with room for `padded` bytes (iter_state)
                        if layout.dtype(k) == "int8" and n != unit.shard_numel:  # block scales move up
                            t = unit_layout.resize(k, t, unit.shard_numel, n, aligned_empty(nbytes, align)[:nbytes])
                        raw = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage(), t.storage_offset(),
                                                                    (padded,))
                        raw[nbytes:].zero_()
                        records.append({"unit": unit.index, "key": k, "offset": offset, "nbytes": nbytes,
                                        "crc32c": crc(raw[:nbytes].numpy())})
                        if padded:
                            inflight.append((_write_record(eng, fd, raw, offset, str(path)), padded, raw))
                        offset += padded
                    while len(inflight) > _WRITES_IN_FLIGHT:
                        retire(inflight.popleft())
                while inflight:
                    retire(inflight.popleft())
            finally:
                for ticket, _want, _keep in inflight:  # an error above: the rest land before buffers go
                    try:
                        ticket.wait()
                    except Exception:  # noqa: BLE001 - the first error is the one raised
                        pass
            os.fsync(fd)
        finally:
            os.close(fd)
    return records


def _hf_config(module) -> dict | None:
    """A transformers model's config as plain JSON data, else None."""
    config = getattr(module, "config", None)
    to_json = getattr(config, "to_json_string", None)
    if to_json is None:
        return None
    try:
        return json.loads(to_json())
    except (TypeError, ValueError):
        return None


def _global_state(parts, lr_scheduler, client_state, registered: list) -> dict:
    return {"global_steps": parts.rt.steps.global_steps, "micro_steps": parts.rt.steps.micro_steps,
            "scaler": parts.rt.scaler.state_dict(),
            "optimizer": parts.optimizer.groups_state_dict(),  # the Adam state is in the rank files
            "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
            "client_state": client_state, "module_unmanaged": _unmanaged_state(parts), "registered": registered}


def _commit(parts, root: Path, tmp: Path, final: Path, gathered: list, keep: int | None) -> None:
    world = parts.rt.sharding.world
    ranks = []
    for r, (records, files) in enumerate(gathered):
        lo_hi = [list(u.part.shard_range(r)) for u in parts.rt.units]
        ranks.append({"file": f"rank{r}.bin", "ranges": lo_hi, "records": records,
                      "rng": files[f"rank{r}.pt"]})
    manifest = {
        "format": FORMAT, "global_steps": parts.rt.steps.global_steps, "micro_steps": parts.rt.steps.micro_steps,
        "world_size": world, "zero_stage": parts.rt.sharding.stage,
        "param_dtype": str(parts.rt.lp_dtype).replace("torch.", ""),
        "unit_steps": [list(steps) for steps in parts.rt.unit_optimizer.state.steps],  # per unit, per parameter
        "optimizer": parts.rt.unit_optimizer.rule.name,  # whose state the records hold (absent: adamw)
        "state_dtypes": {k: parts.rt.unit_optimizer.layout.dtype(k) for k in parts.rt.unit_optimizer.layout.keys},
        "quant_block": kernel_math.QUANT_BLOCK,
        "fp32_moments_below": parts.rt.unit_optimizer.layout.fp32_below,  # [Note: small parameters keep fp32 moments]
        "units": fingerprint(parts), "ranks": ranks, "state": gathered[0][1]["state.pt"],
        "hf_config": _hf_config(parts.rt.module),  # for `zerotier export --to DIR` (config.json)
        "run": {"id": parts.rt.steps.run_id, "saved_ns": time.time_ns()},  # [Note: checkpoint retention]
    }
    manifest["crc32c"] = manifest_crc(manifest)  # [Note: manifest checksum]
    data = json.dumps(manifest).encode()
    with _create(tmp / "manifest.json") as fh:
        _write_bytes(fh, data)
        fh.flush()
        os.fsync(fh.fileno())
    _fsync_dir(tmp)
    aside = None
    if final.exists():
        aside = root / f".{final.name}.old-{secrets.token_hex(4)}"
        os.rename(final, aside)
    os.rename(tmp, final)
    _fsync_dir(root)
    latest_tmp = root / "latest.tmp"
    with _create(latest_tmp) as fh:
        _write_bytes(fh, f"{final.name}\n".encode())
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(latest_tmp, root / "latest")
    _fsync_dir(root)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    _prune(root, final, parts.rt.steps.run_id, keep)


def _run_of(ckpt: Path) -> dict | None:
    """The manifest's {"id", "saved_ns"} if `ckpt` is a checkpoint this code wrote, else None."""
    if not _only_our_files(ckpt):
        return None
    try:
        with open(ckpt / "manifest.json", "rb") as fh:
            manifest = json.loads(fh.read())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return None
    run = manifest.get("run")  # absent in checkpoints written before run ids
    return run if isinstance(run, dict) else {"id": None, "saved_ns": 0}


def _is_ours(ckpt: Path) -> bool:
    return _run_of(ckpt) is not None


def _prune(root: Path, current: Path, run_id: str, keep: int | None) -> None:
    """[Note: checkpoint retention] Keep the newest `keep` checkpoints of this run; remove
    leftovers of killed saves that hold only our files."""
    mine = []
    for p in root.iterdir():
        if step_of(p) is not None and p != current:
            run = _run_of(p)
            if run is not None and run.get("id") == run_id:
                mine.append((run.get("saved_ns", 0), p))
    if keep is not None:
        for _, old in sorted(mine, key=lambda t: t[0])[:max(0, len(mine) - (keep - 1))]:
            shutil.rmtree(old, ignore_errors=True)
    for p in root.iterdir():
        if p.name.startswith(".ckpt-") and (".tmp-" in p.name or ".old-" in p.name) and _only_our_files(p):
            shutil.rmtree(p, ignore_errors=True)


def _only_our_files(path: Path) -> bool:
    """A real directory holding nothing but the files a save writes."""
    try:
        return (not os.path.islink(path) and path.is_dir()
                and all(_OUR_FILE.fullmatch(n) for n in os.listdir(path)))
    except OSError:
        return False
