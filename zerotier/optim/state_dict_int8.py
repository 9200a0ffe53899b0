"""int8 moments in engine.optimizer's state_dict ([Note: int8 moments in the optimizer
state_dict]): each parameter's codes and block scales as stored, beside torch's fp32 moments
(AdamW's exp_avg / exp_avg_sq, Lion's exp_avg: the update rule's), and the unit's buffers
rebuilt from them on load.

[Note: int8 moments in the optimizer state_dict]
torch's layout holds the moments as fp32 `exp_avg` / `exp_avg_sq`, which every reader
understands, so state_dict() gives int8 moments decoded. Quantized again on load they are not
the codes they were: a block's absmax comes back as its largest decoded value, not the absmax
the kernel kept (issue 37 row 2: 1.5e-3 to 5.5e-3 relative off after 3 steps). So a parameter
with int8 moments also carries them as stored, in `state[i][INT8]`: {"quant_block",
"block_offset" (its first element's place in its first block), and for each moment of the rule
(AdamW: "exp_avg", "exp_avg_sq") its uint8 codes, one per element, and "<moment>_absmax" (fp32,
one per block it touches)}; and the dict's MOMENT_DTYPE says the moments' dtype (absent: fp32, torch's).
load_state_dict rebuilds a unit's int8 buffers from its parameters' entries and takes them when
they decode to the dict's exp_avg / exp_avg_sq exactly, which holds when the unit is blocked as
the saver's was; otherwise (other units, a ZeRO shard, moments edited or trained on by torch
since, no entries) it quantizes the fp32 moments and warns as a checkpoint does ([Note:
converting state dtypes on load] in checkpoint_load.py), as it does for a lossy dtype (fp32 or bf16
moments into int8). A unit split between ranks has other blocks on each rank: its parameters
carry no entries, and such a unit always loads quantized (with the warning). Parameters with
fp32 moments ([Note: small parameters keep fp32 moments]) need none: exp_avg is exact.
"""
from __future__ import annotations

import torch

from ..errors import ZerotierError
from .kernel_math import QUANT_BLOCK
from .state_layout import STATE_DTYPES, StateLayout, first_bad_value

INT8 = "zerotier_int8"  # a parameter's entry in state[i]
MOMENT_DTYPE = "zerotier_moment_dtype"  # the state dict's: the moments' dtype where they were saved


def entries(layout: StateLayout, raw: dict[str, torch.Tensor], unit) -> list[dict | None]:
    """The INT8 entry of each parameter of a whole (replicated) unit from its moment buffers `raw`
    (uint8, `layout` = the unit's); None for a parameter with fp32 moments."""
    out = []
    for shape, offset in zip(unit.shapes, unit.offsets):
        where = _blocks_of(layout, unit.shard_numel, offset, offset + shape.numel())
        if where is None:
            out.append(None)
            continue
        codes, scales, block_offset = where
        entry = {"quant_block": QUANT_BLOCK, "block_offset": block_offset}
        for k in layout.moment_keys:
            values, tail = layout.typed(k, raw[k], unit.shard_numel)
            entry[k] = values[codes].clone()
            entry[f"{k}_absmax"] = tail[scales].clone()
        out.append(entry)
    return out


def unit_buffers(layout: StateLayout, unit, full: dict[str, torch.Tensor],
                 given: list[dict | None]) -> dict[str, torch.Tensor] | None:
    """A whole unit's int8 moment buffers with the codes and scales of `given` (each parameter's
    entry or None), when they decode to `full` (fp32 moments of the unit) exactly; else None."""
    n = unit.shard_numel
    moments = layout.moment_keys
    raw = {k: torch.zeros(layout.nbytes(k, n), dtype=torch.uint8) for k in moments}
    for k in moments:
        layout.encode(k, full[k], raw[k])  # the parameters without an entry (zeros: never stepped)
    for shape, offset, entry in zip(unit.shapes, unit.offsets, given):
        where = _blocks_of(layout, n, offset, offset + shape.numel())
        if entry is None or where is None:
            continue
        codes, scales, block_offset = where
        if entry["quant_block"] != QUANT_BLOCK or entry["block_offset"] != block_offset \
                or any(entry[f"{k}_absmax"].numel() != scales.stop - scales.start for k in moments):
            return None  # blocked otherwise than here
        for k in moments:
            values, tail = layout.typed(k, raw[k], n)
            values[codes] = entry[k].reshape(-1)
            tail[scales] = entry[f"{k}_absmax"].reshape(-1)
    if all(torch.equal(layout.decode(k, raw[k], n), full[k]) for k in moments):
        return raw
    return None


def checked_entry(value, numel: int, where: str, moments: tuple[str, ...]) -> dict | None:
    """A loaded parameter's INT8 entry, its scales checked ([Note: loaded state is checked]); None
    when there is none or it is not one (the moments are then quantized)."""
    entry = value.get(INT8) if isinstance(value, dict) else None
    if not isinstance(entry, dict) or type(entry.get("quant_block")) is not int \
            or type(entry.get("block_offset")) is not int:
        return None
    out = {"quant_block": entry["quant_block"], "block_offset": entry["block_offset"]}
    for k in moments:
        codes, scales = entry.get(k), entry.get(f"{k}_absmax")
        if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8 or codes.numel() != numel \
                or not isinstance(scales, torch.Tensor) or not scales.is_floating_point():
            return None
        scales = scales.detach().to("cpu", torch.float32).reshape(-1)
        i = first_bad_value(scales, nonnegative=True)
        if i is not None:
            raise ZerotierError(f"{where}: its {INT8} {k}_absmax holds {float(scales[i])} at block {i}: a block "
                                f"scale of int8 moments is finite and >= 0, so this state dict was damaged or "
                                f"edited. Nothing was loaded; load a state dict saved by the run")
        out[k], out[f"{k}_absmax"] = codes.detach().cpu().reshape(-1), scales
    return out


def saved_moment_dtype(state_dict: dict) -> str:
    """The moments' dtype where `state_dict` was saved (fp32 for torch's AdamW)."""
    dtype = state_dict.get(MOMENT_DTYPE)
    return dtype if isinstance(dtype, str) and dtype in STATE_DTYPES else "fp32"


def _blocks_of(layout: StateLayout, n: int, a: int, b: int) -> tuple[slice, slice, int] | None:
    """Where the int8 moments of elements [a, b) of a shard of n elements are: (their codes in
    the typed values, their blocks' scales in the tail, a's place in its block); None for fp32
    moments."""
    run = layout.run_of(n, a, b)
    if run is None:
        return None
    start, code = run
    first, last = (a - start) // QUANT_BLOCK, (b - 1 - start) // QUANT_BLOCK
    at = code // QUANT_BLOCK  # the run's first block scale
    return slice(code + a - start, code + b - start), slice(at + first, at + last + 1), (a - start) % QUANT_BLOCK
