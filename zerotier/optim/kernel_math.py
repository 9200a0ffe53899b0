"""The native CPU kernels' math in pure torch: 8-bit blockwise quantization of moments, stochastic
rounding of a bf16 master, and the reference Adam(W) and Lion updates. The references are the
fallback when native code is unavailable (ZEROTIER_NATIVE=0) and the oracle every native kernel
(scalar, AVX2, AVX-512 with and without VBMI) is bitwise equal to, for every state dtype; `_kernels.py` (the only door to
native code) hands the kernels this module's quantization maps by pointer."""
from __future__ import annotations

import math
import struct

import torch

from ..errors import ZerotierError

# [Note: compact optimizer state] Why stochastic rounding for a bf16 master, not Kahan
# compensation: a Kahan buffer must be as wide as what it compensates, so bf16 master +
# bf16 compensation is 4 B/param again: the fp32 master's bytes on every NVMe/PCIe link,
# which is what compact state exists to halve. Stochastic rounding keeps 2 B/param and is
# unbiased (E[round(x)] = x), so updates smaller than half a bf16 ulp still move the weight
# in expectation instead of being lost (Gupta et al. 2015; Zamirai et al. 2020). The random
# bits are counter-based: element i of a call rounds with sr_bits(sr_seed + i), a hash, so
# the result depends on the seed and the element alone, not on threads or SIMD level, and
# a caller that steps a shard in pieces adds each piece's offset to the seed.
#   sr_bits(c) = fmix32(lo32(c) ^ fmix32(hi32(c) ^ 0x9E3779B9)) >> 16   (murmur3's fmix32)
#   bf16 = (bits(x) + sr_bits) >> 16   (truncation after adding 16 random bits; NaN stays a
#   quiet NaN as in round-to-nearest)
QUANT_BLOCK = 256

# [Note: 8-bit moments] Blockwise dynamic quantization, as bitsandbytes' 8-bit Adam (Dettmers,
# Lewis, Shleifer, Zettlemoyer, "8-bit Optimizers via Block-wise Quantization", ICLR 2022):
# a moment of n elements is cut into blocks of QUANT_BLOCK from its first element; each
# block stores absmax = max |x| (fp32) and one uint8 code per element, the index of the
# nearest value of a 256-entry map to x / absmax. The maps are the paper's dynamic (tree)
# quantization: per code, a run of leading zeros picks the decade 10^-6 .. 10^0 and the
# remaining bits a linear fraction in it, so small values keep relative precision. exp_avg
# uses the signed map (sign bit + 7), exp_avg_sq the unsigned one (its sign bit spent on
# one more fraction bit): bitsandbytes' create_dynamic_map(signed, 7, 8). Block-wise scales
# confine an outlier's damage to its block and make the quantization embarrassingly
# parallel. QUANT_BLOCK = 256, bitsandbytes' own blockwise optimizer block (the paper used
# 2048): a smaller block holds fewer elements hostage to one outlier, for 4/256 = 0.016
# B/param per moment of scales, and 256 is a multiple of every SIMD width and cache line.
# The step dequantizes the old moments, updates them in fp32, moves the parameter with
# the fp32 values, then re-quantizes each block with its new absmax. Nearest is exact and
# deterministic: code = #{k : mid[k] < x/absmax} for the 255 midpoints mid[k] = (map[k] +
# map[k+1]) / 2 (fp32), a tie rounds down; absmax 0 divides by 1; NaN gives code 0 and the
# NaN absmax it came from. The same tables (QMAPS) go to the native kernel, so both agree
# bit for bit. A sub-range view must start on a block boundary of its storage.


def _dynamic_map(signed: bool) -> torch.Tensor:
    """bitsandbytes.functional.create_dynamic_map(signed, max_exponent_bits=7, total_bits=8)."""
    data = []
    for i in range(7):
        items = 2**i + 1 if signed else 2 ** (i + 1) + 1
        bounds = torch.linspace(0.1, 1, items, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        data += (10 ** (-6 + i) * means).tolist()
        if signed:
            data += (-(10 ** (-6 + i)) * means).tolist()
    data += [0.0, 1.0]
    return torch.tensor(sorted(data), dtype=torch.float32)


def _qmaps() -> torch.Tensor:
    """(4, 256) fp32: signed map, its midpoints, unsigned map, its midpoints (255 + inf)."""
    rows = []
    for signed in (True, False):
        qmap = _dynamic_map(signed)
        mid = (qmap[:-1] + qmap[1:]) / 2
        assert qmap.numel() == 256 and bool((mid[1:] > mid[:-1]).all()), "quantization map not strictly sorted"
        rows += [qmap, torch.cat([mid, torch.tensor([float("inf")])])]
    return torch.stack(rows).contiguous()


QMAPS = _qmaps()  # lives as long as the module: the native kernel reads it by pointer
_QMAPS_ON: dict[torch.device, torch.Tensor] = {}


def qmaps_on(device: torch.device) -> torch.Tensor:
    """QMAPS on `device`: the same tables, copied once per device (the CPU's is QMAPS itself)."""
    if device.type == "cpu":
        return QMAPS
    maps = _QMAPS_ON.get(device)
    if maps is None:
        maps = _QMAPS_ON[device] = QMAPS.to(device)
    return maps


def _blocks(n: int) -> int:
    return -(-n // QUANT_BLOCK)


def quantize_blockwise(x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 `x` (flattened) as (uint8 codes, fp32 absmax per QUANT_BLOCK elements): the
    quantization the kernel applies to an updated moment ([Note: 8-bit moments]); signed
    for exp_avg, unsigned for exp_avg_sq (negative values become 0). On x's device."""
    x = x.reshape(-1).float()
    n, device = x.numel(), x.device
    nblocks = _blocks(n)
    if n == 0:
        return torch.empty(0, dtype=torch.uint8, device=device), torch.empty(0, device=device)
    blocks = torch.zeros(nblocks * QUANT_BLOCK, device=device)
    blocks[:n] = x
    blocks = blocks.view(nblocks, QUANT_BLOCK)
    absmax = blocks.abs().amax(dim=1)  # NaN propagates
    scale = torch.where(absmax > 0, absmax, 1.0)
    xn = blocks.div_(scale[:, None])
    codes = torch.searchsorted(qmaps_on(device)[1 if signed else 3][:255], xn, side="left")  # #{k: mid[k] < xn}
    codes.masked_fill_(torch.isnan(xn), 0)
    return codes.to(torch.uint8).view(-1)[:n].clone(), absmax


def dequantize_blockwise(codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    """uint8 `codes` with their block scales `absmax` back to fp32 (map[code] * absmax), on their device."""
    n = codes.numel()
    if absmax.numel() != _blocks(n):
        raise ZerotierError(f"{n} codes need {_blocks(n)} block scales (QUANT_BLOCK = {QUANT_BLOCK}), "
                            f"got {absmax.numel()}")
    values = qmaps_on(codes.device)[0 if signed else 2][codes.reshape(-1).long()]
    return values.mul_(absmax.float().repeat_interleave(QUANT_BLOCK)[:n])


_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32), in place (the high product wraps in int64; its
    low 32 bits are exact)."""
    high = x * (c >> 16)
    return x.mul_(c & 0xFFFF).add_(high.bitwise_left_shift_(16)).bitwise_and_(_MASK32)


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's finalizer on int64 lanes holding 32-bit values, in place."""
    x ^= x >> 16
    x = _mul32(x, 0x85EBCA6B)
    x ^= x >> 13
    x = _mul32(x, 0xC2B2AE35)
    x ^= x >> 16
    return x


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


def to_bf16_stochastic(x: torch.Tensor, seed: int) -> torch.Tensor:
    """fp32 `x` to bf16 by stochastic rounding, on x's device: element i adds the 16 bits
    fmix32(lo ^ fmix32(hi ^ 0x9E3779B9)) >> 16 of the 64-bit counter seed + i, then truncates
    ([Note: compact optimizer state])."""
    counter = torch.arange(x.numel(), dtype=torch.int64, device=x.device).add_(seed & _MASK32)
    hi = (counter >> 32).add_(seed >> 32).bitwise_and_(_MASK32).bitwise_xor_(0x9E3779B9)
    bits = _fmix32(counter.bitwise_and_(_MASK32).bitwise_xor_(_fmix32(hi))).bitwise_right_shift_(16)
    del hi
    u = x.reshape(-1).view(torch.int32).long().bitwise_and_(_MASK32)
    rounded = bits.add_(u).bitwise_and_(_MASK32).bitwise_right_shift_(16)
    rounded = torch.where(torch.isnan(x.reshape(-1)), u.bitwise_right_shift_(16).bitwise_or_(0x40), rounded)
    return rounded.sub_((rounded >> 15) << 16).to(torch.int16).view(torch.bfloat16).view(x.shape)


# [Note: the update in torch ops] adam_update and lion_update are the scalar kernels'
# (native/cpu/adam.cpp, lion.inc) element loops in torch ops over whole chunks, on the
# tensors' device: the same fp32 operations in the same order, one rounding each (separate
# kernels: nothing fuses a multiply and an add), the coefficients rounded to fp32 once as the
# kernel's `Coef`, the square root correctly rounded (torch.sqrt on fp32 CPU tensors is not:
# SLEEF, up to 1 ulp off; the fp64 root rounded to fp32 is, like sqrtps and CUDA's sqrt, as
# double rounding is exact for the root of an fp32), the same stochastic rounding bits from
# (seed, element) and the same blockwise re-quantization. So they are bitwise the native
# kernel's result on the CPU (tests/test_device_pieces.py, every SIMD level), and should be on
# any device whose fp32 +, -, *, / round to nearest as IEEE says (CUDA without fast math: the
# cuda tests hold it to issue 34's bounds, not yet run on a GPU). They serve as the kernels'
# fallback and oracle (adam_step_reference, lion_step_reference) and as the update rules'
# device variant (UpdateRule.device_pieces).
# They work on TORCH_CHUNK elements at a time (a multiple of QUANT_BLOCK, so a chunk's
# moments re-quantize whole blocks), in place on fp32 state: at most
# TORCH_TEMP_BYTES_PER_ELEMENT * TORCH_CHUNK bytes of temporaries beside the state, which the
# planner counts (`UpdateRule.device_temp_bytes`); the peak is the int64 lanes of the
# stochastic rounding's hash. The count of non-finite scaled gradients they return stays a
# tensor on the device (no host sync).
TORCH_CHUNK = 1 << 18
TORCH_TEMP_BYTES_PER_ELEMENT = 64


def _f32(value: float) -> float:
    """A Python float rounded to fp32 once (exact as a Python float, so an op with an fp32 tensor
    multiplies by exactly this fp32 value)."""
    return struct.unpack("f", struct.pack("f", value))[0]


def _chunks(n: int, chunk: int):
    """(a, b, block slice) of each chunk of n elements: the chunk's slice of an int8 moment's block scales."""
    for a in range(0, n, chunk):
        b = min(a + chunk, n)
        yield a, b, slice(a // QUANT_BLOCK, _blocks(b))


def _load(values: torch.Tensor, absmax, blocks: slice, a: int, b: int, signed: bool) -> torch.Tensor:
    """Elements [a, b) of a moment or master as fp32: the buffer's own view when it is fp32 (updated
    in place), else a new tensor (widened bf16, or map[code] * absmax)."""
    if values.dtype == torch.uint8:
        return dequantize_blockwise(values[a:b], absmax[blocks], signed)
    return values[a:b].float()


def _store(values: torch.Tensor, absmax, blocks: slice, a: int, b: int, new: torch.Tensor, signed: bool) -> None:
    if values.dtype == torch.uint8:
        codes, scales = quantize_blockwise(new, signed)
        values[a:b].copy_(codes)
        absmax[blocks].copy_(scales)
    elif values.dtype != torch.float32:
        values[a:b].copy_(new)  # bf16: round to nearest even


def _store_master(master: torch.Tensor, a: int, b: int, p: torch.Tensor, seed, param_out) -> None:
    if master.dtype == torch.bfloat16:
        master[a:b].copy_(to_bf16_stochastic(p, seed + a))
    if param_out is not None:
        param_out[a:b].copy_(master[a:b])


def _scaled_grad(grad: torch.Tensor, scale: float, count: torch.Tensor) -> torch.Tensor:
    g = grad.to(torch.float32, copy=True).mul_(scale)
    count.add_((~torch.isfinite(g)).sum())
    return g


def adam_update(master, exp_avg, exp_avg_sq, grad, *, step, lr, beta1, beta2, eps, weight_decay, decoupled=True,
                bias_correction=True, grad_scale=1.0, param_out=None, exp_avg_absmax=None, exp_avg_sq_absmax=None,
                sr_seed=None, chunk=TORCH_CHUNK) -> torch.Tensor:
    """The scalar Adam(W) kernel in torch ops ([Note: the update in torch ops]): master, moments and
    param_out updated in place, in the dtypes of `_kernels.adam_step`; returns the count of
    non-finite scaled gradients as a tensor on the device."""
    scale, omb1, b2, omb2 = _f32(grad_scale), _f32(1.0 - beta1), _f32(beta2), _f32(1.0 - beta2)
    decay, wd, eps32 = _f32(1.0 - lr * weight_decay), _f32(weight_decay), _f32(eps)
    bc1 = 1.0 - beta1**step if bias_correction else 1.0
    bc2 = 1.0 - beta2**step if bias_correction else 1.0
    step_size, inv_bc2_sqrt = _f32(lr / bc1), _f32(1.0 / math.sqrt(bc2))  # [Note: one division per element]
    count = torch.zeros((), dtype=torch.int64, device=master.device)
    for a, b, blocks in _chunks(master.numel(), chunk):
        g = _scaled_grad(grad[a:b], scale, count)
        p = master[a:b].float()
        if decoupled:
            p.mul_(decay)
        elif weight_decay != 0.0:
            g.add_(p * wd)
        m = _load(exp_avg, exp_avg_absmax, blocks, a, b, signed=True)
        v = _load(exp_avg_sq, exp_avg_sq_absmax, blocks, a, b, signed=False)
        t = torch.sub(g, m).mul_(omb1)
        m.add_(t)                            # m + (1-b1)*(g - m)
        v.mul_(b2).add_(g.mul_(g).mul_(omb2))  # v*b2 + (1-b2)*(g*g)
        del g
        denom = v.double().sqrt_().float().mul_(inv_bc2_sqrt).add_(eps32)
        p.sub_(torch.div(m, denom, out=t).mul_(step_size))  # p - (lr/bc1)*(m/denom)
        del t, denom
        _store_master(master, a, b, p, sr_seed, param_out)
        _store(exp_avg, exp_avg_absmax, blocks, a, b, m, signed=True)
        _store(exp_avg_sq, exp_avg_sq_absmax, blocks, a, b, v, signed=False)
    return count


def adam_step_reference(
    master, exp_avg, exp_avg_sq, grad, *, step, lr, beta1, beta2, eps, weight_decay,
    decoupled=True, bias_correction=True, grad_scale=1.0, param_out=None,
    exp_avg_absmax=None, exp_avg_sq_absmax=None, sr_seed=None,
) -> int:
    """The scalar kernel's Adam(W) in torch ops (`adam_update`), bitwise equal to every native kernel
    for every state dtype; returns the count of non-finite scaled gradients."""
    return int(adam_update(master, exp_avg, exp_avg_sq, grad, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                           weight_decay=weight_decay, decoupled=decoupled, bias_correction=bias_correction,
                           grad_scale=grad_scale, param_out=param_out, exp_avg_absmax=exp_avg_absmax,
                           exp_avg_sq_absmax=exp_avg_sq_absmax, sr_seed=sr_seed))


def lion_update(master, exp_avg, grad, *, lr, beta1, beta2, weight_decay, grad_scale=1.0, param_out=None,
                exp_avg_absmax=None, sr_seed=None, chunk=TORCH_CHUNK) -> torch.Tensor:
    """The scalar Lion kernel (native/cpu/lion.inc) in torch ops ([Note: the update in torch ops]):
    c = b1*m + (1-b1)*g; p = p*(1 - lr*wd) - lr*sign(c); m = b2*m + (1-b2)*g, with torch.sign
    (0 for +-0 and NaN). Returns the count of non-finite scaled gradients as a tensor on the device."""
    scale, b1, omb1, b2, omb2 = _f32(grad_scale), _f32(beta1), _f32(1.0 - beta1), _f32(beta2), _f32(1.0 - beta2)
    decay, lr32 = _f32(1.0 - lr * weight_decay), _f32(lr)
    count = torch.zeros((), dtype=torch.int64, device=master.device)
    for a, b, blocks in _chunks(master.numel(), chunk):
        g = _scaled_grad(grad[a:b], scale, count)
        p = master[a:b].float().mul_(decay)
        m = _load(exp_avg, exp_avg_absmax, blocks, a, b, signed=True)
        c = (m * b1).add_(g * omb1)
        p.sub_(torch.sign(c).mul_(lr32))
        del c
        m.mul_(b2).add_(g.mul_(omb2))
        _store_master(master, a, b, p, sr_seed, param_out)
        _store(exp_avg, exp_avg_absmax, blocks, a, b, m, signed=True)
    return count


def lion_step_reference(master, exp_avg, grad, *, lr, beta1, beta2, weight_decay, grad_scale=1.0, param_out=None,
                        exp_avg_absmax=None, sr_seed=None) -> int:
    """The scalar Lion kernel in torch ops (`lion_update`), bitwise equal to every native kernel for
    every state dtype; returns the count of non-finite scaled gradients."""
    return int(lion_update(master, exp_avg, grad, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay,
                           grad_scale=grad_scale, param_out=param_out, exp_avg_absmax=exp_avg_absmax,
                           sr_seed=sr_seed))
