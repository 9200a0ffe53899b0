"""The bytes of the optimizer state ([Note: optimizer state layout]) and the native CPU Adam call
over them: what the state of one unit's shard is, on every tier, in NVMe files and in checkpoints,
whatever its dtypes (fp32, bf16, blockwise int8)."""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from . import _kernels

STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")
OPTIMIZER_BYTES = 4 * len(STATE_KEYS)  # fp32 master + two moments per element (the default StateLayout)
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
    tier, in NVMe unit files and in checkpoints: one buffer per STATE_KEYS key (so one file per
    key per unit), sized `nbytes(key, n)` for a shard of n elements. An fp32 or bf16 key holds n
    values. An int8 moment holds, for the runs of the shard (the slices not in `fp32_ranges`,
    [Note: small parameters keep fp32 moments]), their one-byte codes, each run starting at a
    multiple of QUANT_BLOCK codes (zero codes between), padded to 4 bytes; then one fp32 absmax per
    block of each run, in run order (blocks start at the run's first element); then the fp32
    values of the `fp32_ranges` elements, in order. Without fp32 ranges: n codes, padded to 4
    bytes, and one absmax per QUANT_BLOCK elements of the shard. The block scales travel with the
    codes, and zero bytes mean zero moments in every dtype (absmax 0). exp_avg is signed,
    exp_avg_sq unsigned ([Note: 8-bit moments] in _kernels.py).

    The master's dtype is `master` (fp32, or bf16 updated with stochastic rounding: `sr_seed`),
    both moments' `moments`. fp32/fp32 is the default and torch AdamW's exact state. The layout
    of the optimizer as configured has no fp32 ranges; `for_unit` gives a unit's."""

    master: str = "fp32"   # precision.master_dtype
    moments: str = "fp32"  # precision.moment_dtype
    fp32_below: int = FP32_MOMENT_NUMEL  # int8 moments: parameters with fewer elements keep fp32 moments
    fp32_ranges: tuple[tuple[int, int], ...] = ()  # one shard's slices [a, b) with fp32 moments (for_unit)

    @classmethod
    def of(cls, precision) -> "StateLayout":
        return cls(precision.master_dtype, precision.moment_dtype)

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
        """Bytes of a shard's whole state (the three buffers)."""
        return sum(self.nbytes(k, n) for k in STATE_KEYS)

    @property
    def bytes_per_param(self) -> float:
        """The state's bytes per element, block scales included, of parameters with int8 moments
        (what the planner counts; fp32 moments of small parameters are 6 B more per element)."""
        return _kernels.state_bytes_per_param(self.master, self.moments)

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
        out = [(a, b, values[s: s + b - a], tail[s // _kernels.QUANT_BLOCK: s // _kernels.QUANT_BLOCK + _blocks(b - a)])
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
            out[a:b] = part if absmax is None else _kernels.dequantize_blockwise(part, absmax, signed=key == "exp_avg")
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
            codes, scales = _kernels.quantize_blockwise(values[a:b].contiguous(), signed=key == "exp_avg")
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
                d[j:] = _zero_code(signed=key == "exp_avg")  # added elements of a kept block: 0, not map[0]
        return out

    def run_of(self, n: int, a: int, b: int) -> tuple[int, int] | None:
        """(first element, first code in the buffer) of the int8 run holding all of [a, b) in a
        shard of n elements; None when [a, b) is empty or not within one run (fp32 moments)."""
        if self.moments != "int8" or a >= b:
            return None
        return next(((ra, s) for ra, rb, s in self._runs(n) if ra <= a and b <= rb), None)

    def first_bad(self, key: str, raw: torch.Tensor, n: int) -> tuple[str, int, float] | None:
        """[Note: loaded state is checked] The first value of `key`'s buffer that no Adam run holds,
        as (what, element of the shard, value): a non-finite value or block scale, a negative
        exp_avg_sq or block scale; None when there is none. Any byte is a valid int8 code."""
        values, tail = self.typed(key, raw, n)
        pieces = [(0, n, values, None)] if tail is None else self.pieces(n, values, tail)
        for a, _b, part, absmax in pieces:
            if absmax is not None:
                i = first_bad_value(absmax, nonnegative=True)
                if i is not None:
                    return "block scale", a + i * _kernels.QUANT_BLOCK, float(absmax[i])
                continue
            i = first_bad_value(part, nonnegative=key == "exp_avg_sq")
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
                s += _blocks(a - at) * _kernels.QUANT_BLOCK
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
    return int((_kernels._QMAPS[0 if signed else 2] == 0).nonzero()[0])


def _stream(runs) -> int:
    """Codes in an int8 moment's buffer: the last run's end in it."""
    return runs[-1][2] + runs[-1][1] - runs[-1][0] if runs else 0


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
                    grad_scale: float, bias_correction: bool, simd: str, threads: int,
                    layout: StateLayout | None = None) -> None:
    """Adam(W) with the native CPU kernel over the slices [a, b) of a unit's shard in `ranges`
    ((a, b, step, hyper) each), in one native call. master, exp_avg, exp_avg_sq: `layout.typed`
    pairs ([Note: optimizer state layout]) of the unit's `layout` (`for_unit`; None: a layout
    without fp32 ranges); `out` is host memory too. A bf16 master is rounded stochastically, seeded
    by [Note: stochastic rounding seed] (`unit_index`, the step, and the element's offset in the
    unit: `shard_lo` + the piece's first element). int8 moments go to the kernel one run at a time
    (codes, block scales) and one fp32 range at a time (fp32 values) ([Note: small parameters keep
    fp32 moments]). Their blocks start at each run's first element, which parameter slices do not
    follow: when every run a range touches is covered whole, the pieces go to the kernel as they
    are; otherwise (the rare case of [Note: parameters without a gradient] in offload.py) the
    ranges are updated on fp32 copies of the moments (8 B per element of the shard), and the runs
    they touch re-quantized once after (a run no range touches keeps its bytes)."""
    (master, _), (exp_avg, avg_tail), (exp_avg_sq, sq_tail) = master, exp_avg, exp_avg_sq
    n = master.numel()
    step_args = dict(master=master, grad=grad, out=out, unit_index=unit_index, shard_lo=shard_lo,
                     bias_correction=bias_correction, grad_scale=grad_scale, simd=simd, threads=threads)
    if avg_tail is None:  # fp32 / bf16 moments
        _adam_pieces([(a, b, step, h, (exp_avg[a:b], None), (exp_avg_sq[a:b], None)) for a, b, step, h in ranges],
                     **step_args)
        return
    layout = layout if layout is not None else StateLayout(moments="int8", fp32_below=0)
    slices = list(zip(layout.pieces(n, exp_avg, avg_tail), layout.pieces(n, exp_avg_sq, sq_tail)))
    whole = all(a <= sa and sb <= b for a, b, _, _ in ranges for (sa, sb, _, absmax), _ in slices
                if absmax is not None and max(a, sa) < min(b, sb))
    if whole:
        pieces = []
        for a, b, step, h in ranges:
            for (sa, sb, m, m_absmax), (_, _, v, v_absmax) in slices:
                x, y = max(a, sa), min(b, sb)
                if x < y:  # a whole run, or a part of an fp32 range
                    pieces.append((x, y, step, h, (m[x - sa: y - sa], m_absmax), (v[x - sa: y - sa], v_absmax)))
        _adam_pieces(pieces, **step_args)
        return
    wide = []  # the moments as fp32 copies
    for j, signed in ((0, True), (1, False)):
        values = torch.empty(n)
        for piece in slices:
            a, b, part, absmax = piece[j]
            values[a:b] = part if absmax is None else _kernels.dequantize_blockwise(part, absmax, signed=signed)
        wide.append(values)
    _adam_pieces([(a, b, step, h, (wide[0][a:b], None), (wide[1][a:b], None)) for a, b, step, h in ranges],
                 **step_args)
    for j, signed in ((0, True), (1, False)):
        for piece in slices:
            a, b, part, absmax = piece[j]
            if not any(max(a, x) < min(b, y) for x, y, _, _ in ranges):
                continue  # no range touches it: its bytes stay as they are
            if absmax is None:
                part.copy_(wide[j][a:b])
                continue
            codes, scales = _kernels.quantize_blockwise(wide[j][a:b], signed=signed)
            part.copy_(codes)
            absmax.copy_(scales)


def _adam_pieces(pieces, *, master, grad, out, unit_index, shard_lo, bias_correction, grad_scale, simd,
                 threads) -> None:
    """One native call over (a, b, step, hyper, (exp_avg, absmax), (exp_avg_sq, absmax)) pieces of a shard."""
    if not pieces:
        return
    bf16_master = master.dtype == torch.bfloat16
    buffers = [(master[a:b], m, v, grad[a:b], None if out is None else out[a:b], m_absmax, v_absmax,
                sr_seed(unit_index, step) + shard_lo + a if bf16_master else None)
               for a, b, step, _, (m, m_absmax), (v, v_absmax) in pieces]
    hs = [p[3] for p in pieces]
    _kernels.adam_step_multi(buffers, step=[p[2] for p in pieces], lr=[h.lr for h in hs],
                             beta1=[h.beta1 for h in hs], beta2=[h.beta2 for h in hs],
                             eps=[h.eps for h in hs], weight_decay=[h.weight_decay for h in hs],
                             decoupled=[h.decoupled for h in hs], simd=simd, threads=threads,
                             bias_correction=bias_correction, grad_scale=grad_scale)
