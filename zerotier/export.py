"""Plain model weights from a run or a checkpoint: consolidated state dicts and
`zerotier export CKPT --to model.safetensors|model.pt|DIR [--dtype bf16]`.

Export reads the checkpoint directory alone (the fp32 masters of every rank, one unit in
memory at a time) and streams safetensors out: a JSON header, then the tensors' raw
little-endian bytes in header order, written to a temporary name, fsynced and renamed.
Why not the safetensors library's writer: `save_file` needs every tensor in memory at
once, and a model trained here may not fit in RAM; the tests read every export back
with the library's own reader. `--to DIR` writes a Hugging Face directory:
`model.safetensors` and, when the trained model had a transformers config (saved in the
checkpoint's manifest), `config.json`, so `from_pretrained(DIR)` loads it.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Iterator

import torch

from .checkpoint_read import CheckpointError, RankFiles, load_state, read_manifest, resolve
from .errors import ZerotierError
from .state import DTYPES

_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
              torch.uint8: "U8", torch.bool: "BOOL"}
_ST_FROM = {v: k for k, v in _ST_DTYPES.items()}
_DTYPE_NAMES = {**DTYPES, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def consolidated_state_dict(weights, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Model weights by state_dict name (collective with several ranks; rank 0's is the full dict).
    `weights`: the engine's UserWeights (engine/restore.py)."""
    full = weights.parameters_fp32()
    by_id = {}
    names = {id(p): n for n, p in weights.rt.module.named_parameters()}
    for unit in weights.rt.units:
        for p in unit.params:
            by_id[id(p)] = full[names[id(p)]].to(dtype)
    out = {}
    for name, t in weights.raw_state_dict().items():
        if id(t) in by_id:
            out[name] = by_id[id(t)]
        else:
            t = t.detach().cpu()
            out[name] = t.to(dtype, copy=True) if t.is_floating_point() else t.clone()  # frozen: read from home
    return out


def iter_full_params(path, dtype: torch.dtype = torch.float32) -> Iterator[tuple[list[str], torch.Tensor]]:
    """From a checkpoint alone: (names, full tensor) per trained parameter, one unit in memory at a time."""
    ckpt = resolve(path)
    manifest = read_manifest(ckpt)
    files = RankFiles(ckpt, manifest)
    try:
        for i, u in enumerate(manifest["units"]):
            flat = torch.empty(u["numel"])
            files.piece(i, "master", 0, u["numel"], flat)
            for p in u["params"]:
                n = math.prod(p["shape"])
                yield p["names"], flat[p["offset"]: p["offset"] + n].view(p["shape"]).to(dtype)
    finally:
        files.close()


def export(path, out, dtype: str | torch.dtype = "fp32", trust_pickle: bool = False) -> Path:
    """Write a checkpoint's model weights (plus saved frozen params/buffers) to .safetensors or .pt.
    trust_pickle: load an old checkpoint's pickled parts (only for checkpoints you wrote yourself)."""
    if isinstance(dtype, str):
        if dtype not in _DTYPE_NAMES:
            raise ZerotierError(f"export --dtype {dtype!r}: expected one of fp32, bf16, fp16")
        dtype = _DTYPE_NAMES[dtype]
    ckpt = resolve(path)
    manifest = read_manifest(ckpt)
    extra = load_state(ckpt, manifest, trust_pickle)["module_unmanaged"]
    extra = {n: (t.to(dtype) if t.is_floating_point() else t) for n, t in extra.items()}
    _check_extra(ckpt, manifest, extra)
    out = Path(out)
    hf_dir = out.suffix == "" or out.is_dir()
    if not hf_dir and out.suffix not in (".safetensors", ".pt", ".pth", ".bin"):
        raise ZerotierError(f"export --to {out}: unknown format; use a name ending in .safetensors or .pt, "
                            "or a directory (a Hugging Face model directory)")
    if not hf_dir and not out.parent.is_dir():
        raise ZerotierError(f"export --to {out}: the directory {out.parent} does not exist; create it first")
    try:
        if hf_dir:
            out.mkdir(parents=True, exist_ok=True)
            _export_safetensors(ckpt, manifest, extra, out / "model.safetensors", dtype)
            if manifest.get("hf_config") is not None:
                (out / "config.json").write_text(json.dumps(manifest["hf_config"], indent=2, sort_keys=True) + "\n")
        elif out.suffix == ".safetensors":
            _export_safetensors(ckpt, manifest, extra, out, dtype)
        else:
            sd = {}
            for names, t in iter_full_params(ckpt, dtype):
                t = t.clone()
                for n in names:
                    sd[n] = t
            sd.update(extra)
            torch.save(sd, out)
    except ZerotierError:
        raise
    except OSError as exc:  # the output side: space, permissions, a file where a directory should be
        raise ZerotierError(f"export --to {out}: cannot write ({exc.strerror or exc}"
                            f"{f': {exc.filename}' if exc.filename else ''})") from None
    return out


def _check_extra(ckpt: Path, manifest: dict, extra: dict[str, torch.Tensor]) -> None:
    """The saved frozen parameters and buffers can be written beside the trained weights:
    names of their own, dtypes safetensors has."""
    trained = {n for u in manifest["units"] for p in u["params"] for n in p["names"]}
    for name, t in extra.items():
        if name in trained or name == "__metadata__":
            raise CheckpointError(f"checkpoint {ckpt}/state.pt: the buffer or frozen parameter {name!r} has the "
                                  f"name of a trained parameter — the checkpoint is inconsistent; load an earlier one")
        if t.dtype not in _ST_DTYPES:
            raise ZerotierError(f"export: {name!r} has dtype {t.dtype}, which safetensors export does not support "
                                f"({', '.join(str(d).replace('torch.', '') for d in _ST_DTYPES)})")


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)  # a 0-dim tensor (a scalar parameter) has no byte view of its own
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def _export_safetensors(path, manifest: dict, extra: dict, out: Path, dtype: torch.dtype) -> None:
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "global_steps": str(manifest["global_steps"])}}
    offset = 0
    item = dtype.itemsize
    for u in manifest["units"]:
        for p in u["params"]:
            n = math.prod(p["shape"])
            for name in p["names"]:
                header[name] = {"dtype": _ST_DTYPES[dtype], "shape": p["shape"],
                                "data_offsets": [offset, offset + n * item]}
                offset += n * item
    for name, t in extra.items():
        nb = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nb]}
        offset += nb
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    tmp = out.with_name(out.name + ".tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(len(head).to_bytes(8, "little"))
            fh.write(head)
            for names, t in iter_full_params(path, dtype):
                for _ in names:
                    fh.write(_tensor_bytes(t))
            for t in extra.values():
                fh.write(_tensor_bytes(t))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, out)
    except BaseException:  # a corrupt record, ENOSPC, Ctrl-C: no half-written .tmp is left
        tmp.unlink(missing_ok=True)
        raise
