"""Checkpoints of a zerotier run: save, load (into another placement / world size), export.

    engine.save_checkpoint("ckpts", lr_scheduler=sched, client_state={"epoch": 3})
    client_state = engine.load_checkpoint("ckpts", lr_scheduler=sched)

Export to plain model weights (.safetensors / .pt) is in zerotier/export.py.

[Note: checkpoint layout]
    root/latest                  "ckpt-<step>\\n": the newest complete checkpoint
    root/ckpt-<step>/manifest.json   format, world size, stage, dtypes, fingerprint (units with
                                 their parameter names and shapes), per rank and unit the real
                                 element range [lo, hi) and the records (offset, nbytes, crc32c)
    root/ckpt-<step>/rank<r>.bin fp32 master, exp_avg, exp_avg_sq of rank r's real range of every
                                 unit, one record each, in unit order (raw little-endian fp32)
    root/ckpt-<step>/rank<r>.pt  rank r's RNG states (torch CPU, CUDA, python, numpy)
    root/ckpt-<step>/state.pt    rank 0: steps, loss scaler, lr holder, lr scheduler,
                                 client_state, unmanaged module state (frozen params, buffers)
The .pt files' crc32c are in the manifest too. Low-precision parameters are not saved: on
load they are the master rounded to the param dtype, which is what the engine keeps.

[Note: checkpoints hold data]
A crc32c is no defence (anyone can compute one), so the .pt parts hold data only and are
read with torch.load(weights_only=True): tensors, numbers, strings, None and containers
of them; a crafted pickle is refused before anything in it runs (`_load_pt`). Save checks
the same (`_check_loadable`): a client_state or scheduler state that would not load back
that way is refused, with nothing written. RNG states are stored as plain data (numpy's
as a tensor). Old checkpoints with pickled objects load only with trust_pickle=True.

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

[Note: reading a checkpoint]
Nothing read is trusted: every bad input is a CheckpointError naming the file (tested by
tests/test_fuzz.py). `latest` must hold one plain name of a directory in root; the
manifest's own checksum ([Note: manifest checksum]) and shape (`_check_manifest`: types,
ranges, records covering every unit, data files named rank<r>.bin) are checked before
anything is used, so nothing outside the checkpoint directory is ever opened; files must
be regular (a FIFO would block); a record is checked against its file's size before a
buffer is allocated; state.pt and rank<r>.pt are checked to hold what save wrote, RNG
states tried on throwaway generators, before the engine changes.
"""
from __future__ import annotations

import collections
import errno
import json
import math
import os
import random
import re
import reprlib
import secrets
import shutil
import stat
import time
from pathlib import Path
from typing import Any

import crc32c as _crc32c
import torch

from .errors import TierIOError, ZerotierError
from .io import open_direct, open_engine, round_up
from .optim.offload import STATE_KEYS

FORMAT = 1
KEEP = 2  # checkpoints of the current run kept by default ([Note: checkpoint retention])
_OUR_FILE = re.compile(r"manifest\.json|state\.pt|rank\d+\.(bin|pt)")
class CheckpointError(TierIOError):
    """A checkpoint cannot be written or read (space, corruption, missing files, mismatch)."""


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


def _crc(data) -> int:
    return _crc32c.crc32c(data)


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)  # a 0-dim tensor (a scalar parameter) has no byte view of its own
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


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
    return {"nbytes": len(data), "crc32c": _crc(data)}


def _check_loadable(obj: Any, what: str) -> None:
    """[Note: checkpoints hold data] refuse at save what would not load with weights_only=True."""
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


def _load_pt(path: Path, meta: dict, trust_pickle: bool = False) -> Any:
    """[Note: checkpoints hold data] A checkpoint's .pt parts are loaded with weights_only=True:
    tensors and plain containers only, so a crafted file (with a crc32c anyone can compute)
    cannot run code. trust_pickle=True is for old checkpoints the caller wrote and trusts."""
    import io
    import pickle
    with _open_regular(path, "a .pt part") as fh:
        data = fh.read(meta["nbytes"] + 1)  # no more than the manifest's size: a huge planted file is not read
    if len(data) != meta["nbytes"] or _crc(data) != meta["crc32c"]:
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


def _load_state(ckpt: Path, manifest: dict, trust_pickle: bool = False) -> dict:
    """state.pt, checked to hold what _global_state saved (a file with a matching crc32c can
    still hold anything: [Note: checkpoints hold data])."""
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
    group = opt["param_groups"][0] if isinstance(opt, dict) and isinstance(opt.get("param_groups"), list) \
        and len(opt["param_groups"]) == 1 else None
    if not isinstance(opt.get("state") if isinstance(opt, dict) else None, dict) or not isinstance(group, dict) \
            or not (isinstance(group.get("params"), list) and len(group["params"]) == 1
                    and type(group["params"][0]) is int) or not number(group.get("lr")):
        bad("the optimizer's state_dict is not engine.optimizer's (one group of one parameter, with an lr)")
    if state["lr_scheduler"] is not None and not isinstance(state["lr_scheduler"], dict):
        bad("the lr scheduler's state is not a dict")
    unmanaged = state["module_unmanaged"]
    if not isinstance(unmanaged, dict) or not all(isinstance(k, str) and isinstance(t, torch.Tensor)
                                                  for k, t in unmanaged.items()):
        bad("module_unmanaged is not a dict of tensors by name")
    return state


def _load_rng(ckpt: Path, manifest: dict, rank: int, trust_pickle: bool = False) -> dict:
    """rank<r>.pt's RNG states, tried on throwaway generators first so that _set_rng_state
    cannot fail halfway through a load."""
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


def fingerprint(engine) -> list[dict]:
    """The model's description stored in the manifest: units with parameter names and shapes."""
    names = _names(engine.module)
    return [{"key": u.key, "name": u.name, "numel": u.numel,
             "params": [{"names": names[id(p)], "shape": list(s), "offset": off}
                        for p, s, off in zip(u.params, u.shapes, u.offsets)]}
            for u in engine.units]


def _unmanaged_state(engine) -> dict[str, torch.Tensor]:
    """Frozen parameters and buffers (everything in module.state_dict() zerotier does not train)."""
    managed = {id(p) for u in engine.units for p in u.params}
    out = {}
    for name, t in engine.raw_state_dict().items():
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


def _step_of(path: Path) -> int | None:
    name = path.name
    if name.startswith("ckpt-") and name[5:].isdigit():
        return int(name[5:])
    return None


# ------------------------------------------------------------------------------- save

def save(engine, root, *, lr_scheduler=None, client_state=None, keep: int | None = KEEP) -> Path:
    """Save `engine`'s training state under `root` (collective: every rank calls it).

    Returns the checkpoint directory root/ckpt-<global_steps>. `keep`: how many of this
    run's checkpoints to keep (None: all). See [Note: checkpoint layout],
    [Note: checkpoint atomicity] and [Note: checkpoint retention]."""
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ZerotierError(f"save_checkpoint(keep={keep!r}): keep is how many of this run's checkpoints "
                            f"to keep, an int >= 1 (or None to keep all)")
    accum = engine.cfg.train.grad_accum_steps
    if engine.micro_steps % accum:
        raise ZerotierError(f"save_checkpoint at micro-step {engine.micro_steps}: in the middle of a gradient "
                            f"accumulation window (grad_accum_steps = {accum}); the accumulated gradients are "
                            f"not saved. Save right after an engine.step() that returned True")
    rank, world = engine.rank, engine.world_size
    problem = None
    root = Path(root)
    final = root / f"ckpt-{engine.global_steps}"
    try:  # before anything is written: a refused save leaves nothing behind
        _check_loadable(client_state, "client_state")
        if lr_scheduler is not None:
            _check_loadable(lr_scheduler.state_dict(), "the lr scheduler's state_dict()")
        if rank == 0 and os.path.lexists(final) and not _is_ours(final):
            raise CheckpointError(errno.EEXIST, f"save_checkpoint: {final} exists and is not a zerotier "
                                                f"checkpoint (not written by this code); it is left as it is: "
                                                f"move it away or save to another directory")
        latest = root / "latest"
        if rank == 0 and latest.is_dir() and not latest.is_symlink():  # the commit could not replace it
            raise CheckpointError(errno.EISDIR, f"save_checkpoint: {latest} is a directory, not the file naming "
                                                f"the newest checkpoint; nothing was written: remove or rename "
                                                f"it, or save to another directory")
    except CheckpointError as exc:
        problem = exc
    if world > 1:  # every rank stops, the one with the problem with its own message
        try:
            engine.sharding.comm.check_all_ranks(problem is None, "save_checkpoint: client_state")
        except ZerotierError:
            if problem is None:
                raise
    if problem is not None:
        raise problem
    engine.synchronize()
    step = engine.global_steps
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
        records = _write_rank_data(engine, tmp / f"rank{rank}.bin")
        files[f"rank{rank}.pt"] = _save_pt({"rng": _rng_state()}, tmp / f"rank{rank}.pt")
        if rank == 0:
            files["state.pt"] = _save_pt(_global_state(engine, lr_scheduler, client_state), tmp / "state.pt")
    except OSError as exc:
        error = exc if isinstance(exc, CheckpointError) else _space_error(tmp, f"rank {rank}'s files", exc)
    except BaseException as exc:  # noqa: BLE001 — re-raised below, after the other ranks know
        error = exc
    try:
        if dist is not None:
            engine.sharding.comm.check_all_ranks(error is None, "checkpoint save")
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
            _commit(engine, root, tmp, final, gathered, keep)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            error = exc if isinstance(exc, CheckpointError) else _space_error(tmp, "the manifest", exc)
        except BaseException as exc:  # noqa: BLE001
            shutil.rmtree(tmp, ignore_errors=True)
            error = exc
    if dist is not None:
        try:
            engine.sharding.comm.check_all_ranks(error is None, "checkpoint commit")
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


def _write_rank_data(engine, path: Path) -> list[dict]:
    """[Note: checkpoint streaming] This rank's real optimizer-state ranges go to `path` through
    zerotier's I/O engine, O_DIRECT where the filesystem allows: each record starts at an
    `io.alignment` boundary (nbytes stays exact; the padding after it is zeros and no reader
    looks at it), up to _WRITES_IN_FLIGHT records are in flight from aligned buffers, and the
    next unit's state is being read from the NVMe tier meanwhile (UnitOptimizer.iter_state):
    the drive's queue stays full instead of each read and write waiting for the last. The
    host memory this takes is the buffers of the units in flight, not the model's state."""
    io_cfg = engine.cfg.io
    align = io_cfg.alignment
    records, inflight = [], collections.deque()
    offset = 0

    def retire(item) -> None:
        ticket, want, _keep = item
        got = ticket.wait()
        if got != want:
            raise OSError(errno.EIO, f"short write: {got} of {want} bytes")
    with open_engine(io_cfg) as eng:
        fd, _direct = open_direct(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, direct=io_cfg.o_direct)
        try:
            try:
                for unit, state in engine.unit_optimizer.iter_state(engine.units, align):
                    n = unit.shard_hi - unit.shard_lo
                    for k in STATE_KEYS:
                        nbytes = 4 * n
                        padded = round_up(nbytes, align) if nbytes else 0
                        t = state[k]  # aligned, with room for `padded` bytes (iter_state)
                        raw = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage(), 4 * t.storage_offset(),
                                                                    (padded,))
                        raw[nbytes:].zero_()
                        records.append({"unit": unit.index, "key": k, "offset": offset, "nbytes": nbytes,
                                        "crc32c": _crc(raw[:nbytes].numpy())})
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


def _global_state(engine, lr_scheduler, client_state) -> dict:
    return {"global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
            "scaler": engine.scaler.state_dict(), "optimizer": engine.optimizer.state_dict(),
            "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
            "client_state": client_state, "module_unmanaged": _unmanaged_state(engine)}


def _commit(engine, root: Path, tmp: Path, final: Path, gathered: list, keep: int | None) -> None:
    world = engine.world_size
    ranks = []
    for r, (records, files) in enumerate(gathered):
        lo_hi = [list(u.part.shard_range(r)) for u in engine.units]
        ranks.append({"file": f"rank{r}.bin", "ranges": lo_hi, "records": records,
                      "rng": files[f"rank{r}.pt"]})
    manifest = {
        "format": FORMAT, "global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
        "world_size": world, "zero_stage": engine.sharding.stage,
        "param_dtype": str(engine.lp_dtype).replace("torch.", ""),
        "unit_steps": [list(steps) for steps in engine.unit_optimizer.steps],  # per unit, per parameter
        "units": fingerprint(engine), "ranks": ranks, "state": gathered[0][1]["state.pt"],
        "hf_config": _hf_config(engine.module),  # for `zerotier export --to DIR` (config.json)
        "run": {"id": engine.run_id, "saved_ns": time.time_ns()},  # [Note: checkpoint retention]
    }
    manifest["crc32c"] = _manifest_crc(manifest)  # [Note: manifest checksum]
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
    _prune(root, final, engine.run_id, keep)


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
        if _step_of(p) is not None and p != current:
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


# ------------------------------------------------------------------------------- read

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
            found = sorted((p.name for p in path.iterdir() if _step_of(p) is not None), key=lambda n: int(n[5:]))
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


def _manifest_crc(manifest: dict) -> int:
    """[Note: manifest checksum] crc32c of the manifest's canonical JSON (sorted keys, no
    spaces) without its own "crc32c" key. Save stores it in the manifest; read_manifest
    recomputes it from the parsed manifest, so any change to a value (a one-bit flip of a
    step count) is caught, while the file's bytes need not be canonical. A manifest without
    the key was written before the checksum and is read unchecked (a flip cannot delete
    the key: at most rename it, which leaves every value intact)."""
    body = {k: v for k, v in manifest.items() if k != "crc32c"}
    return _crc(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


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
    if "crc32c" in manifest and manifest["crc32c"] != _manifest_crc(manifest):
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
            if type(unit) is not int or not 0 <= unit < len(units) or key not in STATE_KEYS or (unit, key) in seen:
                bad(f"ranks[{r}] has a record for unit {reprlib.repr(unit)} key {reprlib.repr(key)}")
            seen.add((unit, key))
            lo, hi = ranges[unit]
            if count(rec.get("nbytes"), f"ranks[{r}] record nbytes") != 4 * (hi - lo):
                bad(f"ranks[{r}]'s {key} record of unit {unit} holds {rec['nbytes']} bytes, its range "
                    f"[{lo}, {hi}) is {4 * (hi - lo)}")
            count(rec.get("offset"), f"ranks[{r}] record offset")
            count(rec.get("crc32c"), f"ranks[{r}] record crc32c")
        if len(seen) != len(units) * len(STATE_KEYS):
            bad(f"ranks[{r}] lacks records: {len(seen)} of {len(units) * len(STATE_KEYS)}")
    for i, u in enumerate(units):  # the ranks' ranges cover every unit: nothing is left unread
        end = 0
        for lo, hi in sorted(rank["ranges"][i] for rank in ranks):
            if lo > end:
                break
            end = max(end, hi)
        if end != u["numel"]:
            bad(f"the ranks' ranges of unit {i} cover [0, {end}) of its {u['numel']} elements")


class _RankFiles:
    """Open data files of a checkpoint; reads records with crc32c verification."""

    def __init__(self, ckpt: Path, manifest: dict):
        self.ckpt, self.manifest = ckpt, manifest
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
        out = torch.empty(rec["nbytes"] // 4, dtype=torch.float32)
        view = memoryview(out.view(torch.uint8).numpy()) if out.numel() else memoryview(bytearray())
        fh.seek(rec["offset"])
        got = fh.readinto(view) if out.numel() else 0
        if got != rec["nbytes"]:
            raise CheckpointError(f"checkpoint {path}: short read of {name} at offset {rec['offset']} ({got} of "
                                  f"{rec['nbytes']} bytes) — the file is truncated; load an earlier checkpoint")
        if _crc(view) != rec["crc32c"]:
            raise CheckpointError(f"checkpoint {path}: checksum mismatch in {name} at offset {rec['offset']} — "
                                  f"the file is corrupt; load an earlier checkpoint")
        return out

    def piece(self, unit_index: int, key: str, lo: int, hi: int, out: torch.Tensor) -> None:
        """Fill out[:hi-lo] with elements [lo, hi) of a unit's flat, from every old rank overlapping."""
        seen = set()
        for r, rank in enumerate(self.manifest["ranks"]):
            olo, ohi = rank["ranges"][unit_index]
            a, b = max(lo, olo), min(hi, ohi)
            if a >= b or (olo, ohi) in seen:  # replicated units: every rank saved the same flat
                continue
            seen.add((olo, ohi))
            data = self.read(r, unit_index, key)
            out[a - lo: b - lo].copy_(data[a - olo: b - olo])

    def close(self) -> None:
        for fh in self.fh.values():
            fh.close()
        self.fh.clear()


def _check_fingerprint(engine, manifest: dict, ckpt: Path) -> None:
    ours, theirs = fingerprint(engine), manifest["units"]
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


# ------------------------------------------------------------------------------- load

def load(engine, root, *, lr_scheduler=None, trust_pickle: bool = False):
    """Load a checkpoint into `engine` (collective: every rank calls it); returns client_state.

    Works into another tier placement, ZeRO stage or world size: each rank computes its own
    range of every unit and reads the overlapping pieces of the old ranks' records, verifying
    each record's crc32c. RNG states: new rank r gets old rank r's states if the old run had a
    rank r, else old rank 0's (so with more ranks than before, ranks >= the old world size
    share rank 0's random streams)."""
    ckpt = resolve(root)
    manifest = read_manifest(ckpt)
    _check_fingerprint(engine, manifest, ckpt)
    engine.synchronize()  # fetches issued but not consumed would hold the old parameters
    files = _RankFiles(ckpt, manifest)
    try:
        state = _load_state(ckpt, manifest, trust_pickle)
        if lr_scheduler is not None and state["lr_scheduler"] is None:  # before anything changes
            raise ZerotierError(f"checkpoint {ckpt} was saved without an lr scheduler state; call "
                                f"load_checkpoint without lr_scheduler= (nothing was loaded)")
        sd = engine.raw_state_dict()
        for name, t in state["module_unmanaged"].items():
            if name in sd and t.shape != sd[name].shape:
                raise ZerotierError(f"checkpoint {ckpt} does not match this model: its '{name}' has shape "
                                    f"{list(t.shape)}, the model's {list(sd[name].shape)} (nothing was loaded)")
        old_world = manifest["world_size"]
        src = engine.rank if engine.rank < old_world else 0
        rng = _load_rng(ckpt, manifest, src, trust_pickle)
        for unit, step in zip(engine.units, manifest["unit_steps"]):
            lo, hi = unit.shard_lo, unit.shard_hi
            bufs = {}
            for k in STATE_KEYS:
                buf = torch.zeros(unit.part.shard_numel)
                files.piece(unit.index, k, lo, hi, buf)
                bufs[k] = buf
            engine.unit_optimizer.write_state(unit, bufs, step)
            engine.params.load(unit, bufs["master"])  # new low-precision params from the master
            del bufs
        engine.params.synchronize()
    finally:
        files.close()
    with torch.no_grad():
        for name, t in state["module_unmanaged"].items():
            if name in sd:
                sd[name].data.copy_(t) if isinstance(sd[name], torch.nn.Parameter) else sd[name].copy_(t)
    engine.zero_grad()
    engine.global_steps = state["global_steps"]
    engine.micro_steps = state["micro_steps"]
    engine.scaler.load_state_dict(state["scaler"])
    engine.optimizer.load_state_dict(state["optimizer"])
    if lr_scheduler is not None:
        lr_scheduler.load_state_dict(state["lr_scheduler"])
    _set_rng_state(rng)
    run = manifest.get("run")
    if isinstance(run, dict) and isinstance(run.get("id"), str):
        engine.run_id = run["id"]  # the resumed run continues its lineage ([Note: checkpoint retention])
    return state["client_state"]
