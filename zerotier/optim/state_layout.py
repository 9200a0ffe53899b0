"""The bytes of the optimizer state ([Note: optimizer state layout]): what the state of one unit's
shard is, on every tier, in NVMe files and in checkpoints, whatever its update rule's keys
(optim/rules/) and its dtypes (fp32, bf16, blockwise int8)."""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from . import _kernels, kernel_math
from .rules import AdamW, UpdateRule

STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}  # int8: the codes' storage


# [Note: small parameters keep fp32 moments] With int8 moments, the moments of parameters of fewer
# than FP32_MOMENT_NUMEL elements stay fp32, as bitsandbytes' 8-bit Adam does (its
# min_8bit_size = 4096): norms and biases, and in toy models the embeddings. They cost about 6 B
# more per element of theirs: a few thousandths of a percent of a large model's state. Why
# (issue 27's runs, a transformers Llama from config, hidden 64, vocab 35, 100 steps, fp32
# master, final loss vs fp32 state): int8 moments for every element +18.8%; fp32 moments below
# 4096 elements +0.6%. Bisected: fp32 norms alone +18.8%; the input embedding's (35 x 64) fp32
# moments alone +1.3%, its int8 exp_avg with fp32 exp_avg_sq +0.5%, the reverse +20.8%, its
# blocks cut to one row (64) -0.9%. The cause is exp_avg_sq of an embedding in blocks that span
# rows: a block's absmax comes from the frequent tokens' rows, and the rare tokens' small second
# moments fall to the map's bottom codes (or 0), so their updates m / (sqrt(v) + eps) grow; the
# 8-bit optimizers paper gives embeddings 32-bit state for this reason (its stable embedding
# layer). A real model's embedding is far above 4096 elements and stays int8 here: what is left
# (issue 27). Which elements are fp32 is a function of the unit's parameter shapes and the
# shard's range (`StateLayout.for_params`), never stored: by parameter, not by piece, so a
# parameter split between ranks is fp32 or int8 on every rank, and a checkpoint's layout follows
# from its manifest's units. The shard's other elements form runs (the maximal slices between
# fp32 ones), each quantized in blocks from its own first element ([Note: 8-bit moments]).
FP32_MOMENT_NUMEL = 4096


@dataclass(frozen=True)
class StateLayout:
    """[Note: optimizer state layout] The bytes of one unit's optimizer state, the same on every
    tier, in NVMe unit files and in checkpoints: one buffer per key of its update rule (`keys`:
    "master", then the rule's moments; one file per key per unit), sized `nbytes(key, n)` for a shard of n elements. An fp32 or bf16 key holds n
    values. An int8 moment holds, for the runs of the shard (the slices not in `fp32_ranges`,
    [Note: small parameters keep fp32 moments]), their one-byte codes, each run starting at a
    multiple of QUANT_BLOCK codes (zero codes between), padded to 4 bytes; then one fp32 absmax per
    block of each run, in run order (blocks start at the run's first element); then the fp32
    values of the `fp32_ranges` elements, in order. Without fp32 ranges: n codes, padded to 4
    bytes, and one absmax per QUANT_BLOCK elements of the shard. The block scales travel with the
    codes, and zero bytes mean zero moments in every dtype (absmax 0). A moment is signed unless
    the rule lists it `nonnegative` (AdamW's exp_avg_sq: the unsigned map, [Note: 8-bit moments]
    in kernel_math.py).

    The master's dtype is `master` (fp32, or bf16 updated with stochastic rounding: `sr_seed`),
    every moment's `moments`. AdamW's fp32/fp32 is the default and torch AdamW's exact state. The
    layout of the optimizer as configured has no fp32 ranges; `for_unit` gives a unit's."""

    master: str = "fp32"   # precision.master_dtype
    moments: str = "fp32"  # precision.moment_dtype
    fp32_below: int = FP32_MOMENT_NUMEL  # int8 moments: parameters with fewer elements keep fp32 moments
    fp32_ranges: tuple[tuple[int, int], ...] = ()  # one shard's slices [a, b) with fp32 moments (for_unit)
    keys: tuple[str, ...] = AdamW.state_keys  # the update rule's state: "master", then its moments
    nonnegative: frozenset = AdamW.nonnegative  # its moments that are never negative (unsigned int8 map)

    @classmethod
    def of(cls, precision, rule: UpdateRule | None = None) -> "StateLayout":
        rule = rule if rule is not None else AdamW()
        return cls(precision.master_dtype, precision.moment_dtype, keys=rule.state_keys, nonnegative=rule.nonnegative)

    @property
    def moment_keys(self) -> tuple[str, ...]:
        return self.keys[1:]

    def signed(self, key: str) -> bool:
        """Whether `key`'s int8 codes use the signed map."""
        return key not in self.nonnegative

    def for_unit(self, unit) -> "StateLayout":
        """This layout for the shard of `unit` this rank holds ([Note: small parameters keep fp32 moments])."""
        return self.for_params([s.numel() for s in unit.shapes], unit.offsets, unit.shard_lo, unit.shard_hi)

    def for_params(self, numels, offsets, lo: int, hi: int) -> "StateLayout":
        """This layout for the elements [lo, hi) of a unit whose parameters have `numels` elements at
        `offsets` in its flat: their slices with fp32 moments, relative to lo."""
        if self.moments != "int8" or not self.fp32_below:
            return self
        return replace(self, fp32_ranges=_small_ranges(tuple(numels), tuple(offsets), lo, hi, self.fp32_below))

    def dtype(self, key: str) -> str:
        return self.master if key == "master" else self.moments

    @property
    def exact(self) -> bool:
        """fp32 everywhere: torch AdamW's state, bit for bit."""
        return self.master == self.moments == "fp32"

    def nbytes(self, key: str, n: int) -> int:
        """Bytes of `key`'s buffer for a shard of n elements."""
        if self.dtype(key) == "int8":
            runs, wide = self._runs(n), self._wide(n)
            return _codes_bytes(_stream(runs)) + 4 * sum(_blocks(b - a) for a, b, _ in runs) + \
                4 * sum(b - a for a, b in wide)
        return n * STATE_DTYPES[self.dtype(key)].itemsize

    def state_bytes(self, n: int) -> int:
        """Bytes of a shard's whole state (one buffer per key)."""
        return sum(self.nbytes(k, n) for k in self.keys)

    @property
    def master_itemsize(self) -> int:
        return STATE_DTYPES[self.master].itemsize

    @property
    def bytes_per_param(self) -> float:
        """The state's bytes per element, block scales included, of parameters with int8 moments
        (what the planner counts; fp32 moments of small parameters are 6 B more per element)."""
        return _kernels.state_bytes_per_param(self.master, self.moments, len(self.keys) - 1)

    def typed(self, key: str, raw: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`key`'s buffer `raw` (uint8, at least nbytes(key, n)) as (values, tail): views, no copy.
        fp32/bf16: n values and None. int8: the codes of every run (with the gaps between runs) and
        the fp32 tail: the runs' block scales, then the fp32 ranges' values (`pieces` splits both)."""
        if self.dtype(key) == "int8":
            runs = self._runs(n)
            at, size = _codes_bytes(_stream(runs)), self.nbytes(key, n)
            return raw[:_stream(runs)], raw[at: size].view(torch.float32)
        return raw[: self.nbytes(key, n)].view(STATE_DTYPES[self.dtype(key)]), None

    def pieces(self, n: int, values: torch.Tensor, tail: torch.Tensor):
        """An int8 moment's typed() views split by slice of the shard: (a, b, codes, absmax) for each
        run, (a, b, fp32 values, None) for each fp32 range, in shard order."""
        runs, wide = self._runs(n), self._wide(n)
        blocks = sum(_blocks(b - a) for a, b, _ in runs)
        out = [(a, b, values[s: s + b - a], tail[s // kernel_math.QUANT_BLOCK: s // kernel_math.QUANT_BLOCK + _blocks(b - a)])
               for a, b, s in runs]
        at = blocks
        for a, b in wide:
            out.append((a, b, tail[at: at + b - a], None))
            at += b - a
        return sorted(out, key=lambda piece: piece[0])

    def decode(self, key: str, raw: torch.Tensor, n: int) -> torch.Tensor:
        """`key`'s values as a new fp32 tensor of n elements."""
        values, tail = self.typed(key, raw, n)
        if tail is None:
            return values.float() if values.dtype != torch.float32 else values.clone()
        out = torch.empty(n)
        for a, b, part, absmax in self.pieces(n, values, tail):
            out[a:b] = part if absmax is None else kernel_math.dequantize_blockwise(part, absmax, signed=self.signed(key))
        return out

    def encode(self, key: str, values: torch.Tensor, raw: torch.Tensor) -> None:
        """Write fp32 `values` into `key`'s buffer `raw` (round to nearest; int8: each run re-blocked
        from its first element, absmax recomputed)."""
        n = values.numel()
        dst, tail = self.typed(key, raw, n)
        if tail is None:
            dst.copy_(values)
            return
        raw[: _codes_bytes(dst.numel())].zero_()
        values = values.float().reshape(-1)
        for a, b, part, absmax in self.pieces(n, dst, tail):
            if absmax is None:
                part.copy_(values[a:b])
                continue
            codes, scales = kernel_math.quantize_blockwise(values[a:b].contiguous(), signed=self.signed(key))
            part.copy_(codes)
            absmax.copy_(scales)

    def resize(self, key: str, raw: torch.Tensor, n: int, m: int, out: torch.Tensor) -> torch.Tensor:
        """`key`'s buffer for n elements as the buffer for m (out: uint8, nbytes(key, m)): the first
        min(n, m) elements and their block scales, zero moments after. For the real range of a padded shard
        and back (checkpoints hold the real range; the padding is at the end, so both sizes have the
        same fp32 ranges and runs but the last)."""
        out.zero_()
        k = min(n, m)
        (src, src_tail), (dst, dst_tail) = self.typed(key, raw, n), self.typed(key, out, m)
        if src_tail is None:
            dst[:k].copy_(src[:k])
            return out
        for (a, b, s, s_absmax), (a2, b2, d, d_absmax) in zip(self.pieces(n, src, src_tail),
                                                               self.pieces(m, dst, dst_tail)):
            assert a == a2, "resize: the two sizes' slices differ before the end"
            j = min(b, b2) - a
            d[:j].copy_(s[:j])
            if s_absmax is not None:
                d_absmax[: _blocks(j)].copy_(s_absmax[: _blocks(j)])
                d[j:] = _zero_code(signed=self.signed(key))  # added elements of a kept block: 0, not map[0]
        return out

    def step_pieces(self, update, master: torch.Tensor, moments: dict, ranges, **step_args) -> None:
        """An update rule's variant (`update`: UpdateRule.cpu_pieces, the native CPU call, or
        UpdateRule.device_pieces, torch ops on the tensors' device) over the slices [a, b)
        of a shard in `ranges` ((a, b, step, hyper) each), cut in pieces the kernel can take, in one
        call. `master`: the shard's master values; `moments` by key: `typed` pairs of this layout
        (the unit's: `for_unit`); `step_args`: the rest of the variant's arguments (grad, out,
        unit_index, shard_lo, ...). int8 moments go to the kernel one run at a time (codes, block
        scales) and one fp32 range at a time ([Note: small parameters keep fp32 moments]). Their
        blocks start at each run's first element, which parameter slices do not follow: when every
        run a range touches is covered whole, the pieces go to the kernel as they are; otherwise
        (the rare case of [Note: parameters without a gradient] in offload.py) the ranges are
        updated on fp32 copies of the moments (4 B per element and moment), and the runs they touch
        re-quantized once after (a run no range touches keeps its bytes)."""
        n, keys = master.numel(), list(moments)
        step_args = dict(step_args, master=master)
        if all(tail is None for _, tail in moments.values()):  # fp32 / bf16 moments
            update([(a, b, step, h, {k: (v[a:b], None) for k, (v, _) in moments.items()})
                    for a, b, step, h in ranges], **step_args)
            return
        slices = {k: self.pieces(n, values, tail) for k, (values, tail) in moments.items()}
        first = slices[keys[0]]  # every moment has the same runs and fp32 ranges
        whole = all(a <= sa and sb <= b for a, b, _, _ in ranges for sa, sb, _, absmax in first
                    if absmax is not None and max(a, sa) < min(b, sb))
        if whole:
            pieces = []
            for a, b, step, h in ranges:
                for j, (sa, sb, _, _) in enumerate(first):
                    x, y = max(a, sa), min(b, sb)
                    if x < y:  # a whole run, or a part of an fp32 range
                        pieces.append((x, y, step, h, {k: (slices[k][j][2][x - sa: y - sa], slices[k][j][3])
                                                       for k in keys}))
            update(pieces, **step_args)
            return
        wide = {}  # the moments as fp32 copies
        for k in keys:
            values = torch.empty(n, device=master.device)
            for a, b, part, absmax in slices[k]:
                values[a:b] = part if absmax is None else \
                    kernel_math.dequantize_blockwise(part, absmax, signed=self.signed(k))
            wide[k] = values
        update([(a, b, step, h, {k: (wide[k][a:b], None) for k in keys}) for a, b, step, h in ranges], **step_args)
        for k in keys:
            for a, b, part, absmax in slices[k]:
                if not any(max(a, x) < min(b, y) for x, y, _, _ in ranges):
                    continue  # no range touches it: its bytes stay as they are
                if absmax is None:
                    part.copy_(wide[k][a:b])
                    continue
                codes, scales = kernel_math.quantize_blockwise(wide[k][a:b], signed=self.signed(k))
                part.copy_(codes)
                absmax.copy_(scales)

    def run_of(self, n: int, a: int, b: int) -> tuple[int, int] | None:
        """(first element, first code in the buffer) of the int8 run holding all of [a, b) in a
        shard of n elements; None when [a, b) is empty or not within one run (fp32 moments)."""
        if self.moments != "int8" or a >= b:
            return None
        return next(((ra, s) for ra, rb, s in self._runs(n) if ra <= a and b <= rb), None)

    def first_bad(self, key: str, raw: torch.Tensor, n: int) -> tuple[str, int, float] | None:
        """[Note: loaded state is checked] The first value of `key`'s buffer that no Adam run holds,
        as (what, element of the shard, value): a non-finite value or block scale, a negative
        value of a `nonnegative` moment (exp_avg_sq) or block scale; None when there is none. Any
        byte is a valid int8 code."""
        values, tail = self.typed(key, raw, n)
        pieces = [(0, n, values, None)] if tail is None else self.pieces(n, values, tail)
        for a, _b, part, absmax in pieces:
            if absmax is not None:
                i = first_bad_value(absmax, nonnegative=True)
                if i is not None:
                    return "block scale", a + i * kernel_math.QUANT_BLOCK, float(absmax[i])
                continue
            i = first_bad_value(part, nonnegative=key in self.nonnegative)
            if i is not None:
                return "value", a + i, float(part[i])
        return None

    def lossy_from(self, old: "StateLayout", key: str) -> bool:
        """Whether converting `key` from `old`'s dtype to this layout's loses precision."""
        rank = {"fp32": 2, "bf16": 1, "int8": 0}
        return rank[self.dtype(key)] < rank[old.dtype(key)]

    def _wide(self, n: int) -> list[tuple[int, int]]:
        """The fp32 ranges within a shard of n elements."""
        return [(a, min(b, n)) for a, b in self.fp32_ranges if a < n]

    def _runs(self, n: int) -> list[tuple[int, int, int]]:
        """(a, b, s): the slices of [0, n) not in the fp32 ranges, each with the index of its first
        code in the buffer (a multiple of QUANT_BLOCK)."""
        runs, at, s = [], 0, 0
        for a, b in self._wide(n) + [(n, n)]:
            if at < a:
                runs.append((at, a, s))
                s += _blocks(a - at) * kernel_math.QUANT_BLOCK
            at = max(at, b)
        return runs


# [Note: loaded state is checked]
# A checksum says the bytes are the ones written, not that they are state an Adam run holds:
# a checkpoint or state dict edited with its checksums recomputed (issue 37 row 13: int8 block
# scales of NaN, inf or -1) loaded silently and training went NaN. So what a load decodes is
# checked before the engine changes: masters and moments finite, exp_avg_sq >= 0, int8 block
# scales finite and >= 0 (a block's absmax; 0 for an all-zero block). Every value Adam and the
# quantizer produce from finite gradients passes; a run whose state a NaN gradient reached is
# refused on load too, as it holds nothing worth resuming.
def first_bad_value(values: torch.Tensor, nonnegative: bool) -> int | None:
    """Flat index of the first non-finite (or, `nonnegative`, negative) element of `values`, or None."""
    values = values.reshape(-1)
    bad = ~torch.isfinite(values)
    if nonnegative:
        bad |= values < 0
    return int(bad.nonzero()[0]) if bool(bad.any()) else None


@functools.lru_cache(maxsize=4096)
def _small_ranges(numels: tuple, offsets: tuple, lo: int, hi: int, below: int) -> tuple[tuple[int, int], ...]:
    """[Note: small parameters keep fp32 moments] The slices of [lo, hi) (relative to lo) of the
    parameters with fewer than `below` elements, adjacent ones merged."""
    out: list[list[int]] = []
    for numel, offset in sorted(zip(numels, offsets), key=lambda p: p[1]):
        a, b = max(offset, lo) - lo, min(offset + numel, hi) - lo
        if numel >= below or a >= b:
            continue
        if out and out[-1][1] == a:
            out[-1][1] = b
        else:
            out.append([a, b])
    return tuple((a, b) for a, b in out)


@functools.lru_cache(maxsize=2)
def _zero_code(signed: bool) -> int:
    """The code of 0.0 in a moment's quantization map ([Note: 8-bit moments])."""
    return int((kernel_math.QMAPS[0 if signed else 2] == 0).nonzero()[0])


def _stream(runs) -> int:
    """Codes in an int8 moment's buffer: the last run's end in it."""
    return runs[-1][2] + runs[-1][1] - runs[-1][0] if runs else 0


def _blocks(n: int) -> int:
    return -(-n // kernel_math.QUANT_BLOCK)


def _codes_bytes(n: int) -> int:
    return -(-n // 4) * 4  # the absmax after the codes is 4-byte aligned
