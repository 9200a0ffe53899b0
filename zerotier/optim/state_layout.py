"""The bytes of the optimizer state ([Note: optimizer state layout]) and the native CPU Adam call
over them: what the state of one unit's shard is, on every tier, in NVMe files and in checkpoints,
whatever its dtypes (fp32, bf16, blockwise int8)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _kernels

STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")
OPTIMIZER_BYTES = 4 * len(STATE_KEYS)  # fp32 master + two moments per element (the default StateLayout)
STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}  # int8: the codes' storage


@dataclass(frozen=True)
class StateLayout:
    """[Note: optimizer state layout] The bytes of one unit's optimizer state, the same on every
    tier, in NVMe unit files and in checkpoints: one buffer per STATE_KEYS key (so one file per
    key per unit), sized `nbytes(key, n)` for a shard of n elements. An fp32 or bf16 key holds n
    values. An int8 moment holds n one-byte codes, padded to 4 bytes, then one fp32 absmax per
    QUANT_BLOCK elements of the shard (blocks start at the shard's first element): its block
    scales travel with it, and zero bytes mean zero moments in every dtype (absmax 0).
    exp_avg is signed, exp_avg_sq unsigned ([Note: 8-bit moments] in _kernels.py).

    The master's dtype is `master` (fp32, or bf16 updated with stochastic rounding: `sr_seed`),
    both moments' `moments`. fp32/fp32 is the default and torch AdamW's exact state."""

    master: str = "fp32"   # precision.master_dtype
    moments: str = "fp32"  # precision.moment_dtype

    @classmethod
    def of(cls, precision) -> "StateLayout":
        return cls(precision.master_dtype, precision.moment_dtype)

    def dtype(self, key: str) -> str:
        return self.master if key == "master" else self.moments

    @property
    def exact(self) -> bool:
        """fp32 everywhere: torch AdamW's state, bit for bit."""
        return self.master == self.moments == "fp32"

    def nbytes(self, key: str, n: int) -> int:
        """Bytes of `key`'s buffer for a shard of n elements."""
        if self.dtype(key) == "int8":
            return _codes_bytes(n) + 4 * _blocks(n)
        return n * STATE_DTYPES[self.dtype(key)].itemsize

    def state_bytes(self, n: int) -> int:
        """Bytes of a shard's whole state (the three buffers)."""
        return sum(self.nbytes(k, n) for k in STATE_KEYS)

    @property
    def bytes_per_param(self) -> float:
        """The state's bytes per element, block scales included (what the planner counts)."""
        return _kernels.state_bytes_per_param(self.master, self.moments)

    def typed(self, key: str, raw: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`key`'s buffer `raw` (uint8, at least nbytes(key, n)) as (values, absmax or None): views, no copy."""
        if self.dtype(key) == "int8":
            at = _codes_bytes(n)
            return raw[:n], raw[at: at + 4 * _blocks(n)].view(torch.float32)
        return raw[: self.nbytes(key, n)].view(STATE_DTYPES[self.dtype(key)]), None

    def decode(self, key: str, raw: torch.Tensor, n: int) -> torch.Tensor:
        """`key`'s values as a new fp32 tensor of n elements."""
        values, absmax = self.typed(key, raw, n)
        if absmax is None:
            return values.float() if values.dtype != torch.float32 else values.clone()
        return _kernels.dequantize_blockwise(values, absmax, signed=key == "exp_avg")

    def encode(self, key: str, values: torch.Tensor, raw: torch.Tensor) -> None:
        """Write fp32 `values` into `key`'s buffer `raw` (round to nearest; int8: re-blocked from the
        shard's first element, absmax recomputed)."""
        n = values.numel()
        dst, absmax = self.typed(key, raw, n)
        if absmax is None:
            dst.copy_(values)
            return
        codes, scales = _kernels.quantize_blockwise(values.float().contiguous(), signed=key == "exp_avg")
        dst.copy_(codes)
        absmax.copy_(scales)
        raw[n: _codes_bytes(n)].zero_()

    def resize(self, key: str, raw: torch.Tensor, n: int, m: int, out: torch.Tensor) -> torch.Tensor:
        """`key`'s buffer for n elements as the buffer for m (out: uint8, nbytes(key, m)): the first
        min(n, m) elements and their block scales, zeros after. For the real range of a padded shard
        and back (checkpoints hold the real range)."""
        out.zero_()
        k = min(n, m)
        (src, src_absmax), (dst, dst_absmax) = self.typed(key, raw, n), self.typed(key, out, m)
        dst[:k].copy_(src[:k])
        if src_absmax is not None:
            dst_absmax[: _blocks(k)].copy_(src_absmax[: _blocks(k)])
        return out

    def lossy_from(self, old: "StateLayout", key: str) -> bool:
        """Whether converting `key` from `old`'s dtype to this layout's loses precision."""
        rank = {"fp32": 2, "bf16": 1, "int8": 0}
        return rank[self.dtype(key)] < rank[old.dtype(key)]


def _blocks(n: int) -> int:
    return -(-n // _kernels.QUANT_BLOCK)


def _codes_bytes(n: int) -> int:
    return -(-n // 4) * 4  # the absmax after the codes is 4-byte aligned


def sr_seed(unit_index: int, step: int) -> int:
    """[Note: stochastic rounding seed] The seed of a bf16 master's stochastic rounding in one unit's
    update: a function of the unit's index and the step count alone (splitmix64), so a resumed run
    rounds exactly as the uninterrupted one. The kernel rounds element i with seed + i; the caller
    adds the shard's offset in the unit, so each element of the unit draws its own stream whatever
    the world size."""
    z = ((unit_index << 32) ^ step) + 0x9E3779B97F4A7C15 & 0xFFFFFFFFFFFFFFFF
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) >> 2  # < 2**62: room to add element offsets within int64


def cpu_adam_ranges(unit_index: int, shard_lo: int, master, exp_avg, exp_avg_sq, grad, out, ranges, *,
                    grad_scale: float, bias_correction: bool, simd: str, threads: int) -> None:
    """Adam(W) with the native CPU kernel over the slices [a, b) of a unit's shard in `ranges`
    ((a, b, step, hyper) each), in one native call. master, exp_avg, exp_avg_sq: (values, absmax or
    None) pairs ([Note: optimizer state layout]); `out` is host memory too. A bf16 master is rounded
    stochastically, seeded by [Note: stochastic rounding seed] (`unit_index`, the step, and the
    element's offset in the unit: `shard_lo` + a). int8 moments are quantized in blocks from the
    shard's first element, which parameter slices do not follow: a whole-shard range goes to the
    kernel as is; slices are updated on fp32 copies of the moments (8 B per element of the shard,
    in the rare case of [Note: parameters without a gradient] in offload.py), re-quantized once after."""
    common = dict(bias_correction=bias_correction, grad_scale=grad_scale)
    (master, _), (exp_avg, avg_absmax), (exp_avg_sq, sq_absmax) = master, exp_avg, exp_avg_sq
    codes = None
    if avg_absmax is not None and not (len(ranges) == 1 and tuple(ranges[0][:2]) == (0, master.numel())):
        codes = (exp_avg, avg_absmax), (exp_avg_sq, sq_absmax)
        exp_avg = _kernels.dequantize_blockwise(exp_avg, avg_absmax, signed=True)
        exp_avg_sq = _kernels.dequantize_blockwise(exp_avg_sq, sq_absmax, signed=False)
        avg_absmax = sq_absmax = None
    bf16_master = master.dtype == torch.bfloat16
    buffers = [(master[a:b], exp_avg[a:b], exp_avg_sq[a:b], grad[a:b], None if out is None else out[a:b],
                avg_absmax, sq_absmax, sr_seed(unit_index, step) + shard_lo + a if bf16_master else None)
               for a, b, step, _ in ranges]
    hs = [h for _, _, _, h in ranges]
    _kernels.adam_step_multi(buffers, step=[s for _, _, s, _ in ranges], lr=[h.lr for h in hs],
                             beta1=[h.beta1 for h in hs], beta2=[h.beta2 for h in hs],
                             eps=[h.eps for h in hs], weight_decay=[h.weight_decay for h in hs],
                             decoupled=[h.decoupled for h in hs], simd=simd,
                             threads=threads, **common)
    if codes is not None:
        for values, (dst, dst_absmax), signed in ((exp_avg, codes[0], True), (exp_avg_sq, codes[1], False)):
            new_codes, new_absmax = _kernels.quantize_blockwise(values, signed=signed)
            dst.copy_(new_codes)
            dst_absmax.copy_(new_absmax)
