"""The native CPU kernels' math in pure torch: 8-bit blockwise quantization of moments, stochastic
rounding of a bf16 master, and the reference Adam(W) and Lion updates. The references are the
fallback when native code is unavailable (ZEROTIER_NATIVE=0) and the oracle every native kernel
(scalar, AVX2, AVX-512) is bitwise equal to, for every state dtype; `_kernels.py` (the only door to
native code) hands the kernels this module's quantization maps by pointer."""
from __future__ import annotations

import math

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




def _blocks(n: int) -> int:
    return -(-n // QUANT_BLOCK)


def quantize_blockwise(x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 `x` (flattened) as (uint8 codes, fp32 absmax per QUANT_BLOCK elements): the
    quantization the kernel applies to an updated moment ([Note: 8-bit moments]); signed
    for exp_avg, unsigned for exp_avg_sq (negative values become 0)."""
    x = x.reshape(-1).float()
    n = x.numel()
    nblocks = _blocks(n)
    if n == 0:
        return torch.empty(0, dtype=torch.uint8), torch.empty(0)
    blocks = torch.zeros(nblocks * QUANT_BLOCK)
    blocks[:n] = x
    blocks = blocks.view(nblocks, QUANT_BLOCK)
    absmax = blocks.abs().amax(dim=1)  # NaN propagates
    scale = torch.where(absmax > 0, absmax, torch.ones(()))
    xn = blocks / scale[:, None]
    mid = QMAPS[1 if signed else 3][:255].contiguous()
    codes = torch.searchsorted(mid, xn, side="left")  # #{k: mid[k] < xn}
    codes = torch.where(torch.isnan(xn), 0, codes)
    return codes.to(torch.uint8).view(-1)[:n].clone(), absmax


def dequantize_blockwise(codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    """uint8 `codes` with their block scales `absmax` back to fp32 (map[code] * absmax)."""
    n = codes.numel()
    if absmax.numel() != _blocks(n):
        raise ZerotierError(f"{n} codes need {_blocks(n)} block scales (QUANT_BLOCK = {QUANT_BLOCK}), "
                            f"got {absmax.numel()}")
    values = QMAPS[0 if signed else 2][codes.reshape(-1).long()]
    return values * absmax.float().repeat_interleave(QUANT_BLOCK)[:n]



_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32), without int64 overflow."""
    return (x * (c & 0xFFFF) + ((x * (c >> 16)) << 16)) & _MASK32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


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
    """fp32 `x` to bf16 by stochastic rounding: element i adds the 16 bits
    fmix32(lo ^ fmix32(hi ^ 0x9E3779B9)) >> 16 of the 64-bit counter seed + i, then truncates
    ([Note: compact optimizer state])."""
    n = x.numel()
    i = torch.arange(n, dtype=torch.int64)
    lo = (i + (seed & _MASK32)) & _MASK32
    hi = ((seed >> 32) + ((i + (seed & _MASK32)) >> 32)) & _MASK32
    bits = _fmix32(lo ^ _fmix32(hi ^ 0x9E3779B9)) >> 16
    u = x.view(torch.int32).long() & _MASK32
    rounded = ((u + bits) & _MASK32) >> 16
    nan = torch.isnan(x)
    rounded = torch.where(nan, (u >> 16) | 0x40, rounded)
    return (rounded - ((rounded >> 15) << 16)).to(torch.int16).view(torch.bfloat16)


def adam_step_reference(
    master, exp_avg, exp_avg_sq, grad, *, step, lr, beta1, beta2, eps, weight_decay,
    decoupled=True, bias_correction=True, grad_scale=1.0, param_out=None,
    exp_avg_absmax=None, exp_avg_sq_absmax=None, sr_seed=None,
) -> int:
    """Pure-torch transcription of the scalar kernel: the same fp32 operations in the same
    order, one rounding each (no fused multiply-add), and the same rounding of each state
    dtype, so every native kernel is bitwise equal to it. fp32 state runs on any device
    (the engine's device optimizer); compact state on the CPU."""
    def f32(value):  # a Python float rounded to fp32 once, as the kernel's coefficients
        return torch.tensor(value, dtype=torch.float32, device=master.device)
    g = grad.float() * f32(grad_scale)
    nonfinite = int((~torch.isfinite(g)).sum())
    p = master.float()
    if decoupled:
        p = p * f32(1.0 - lr * weight_decay)
    elif weight_decay != 0.0:
        g = g + f32(weight_decay) * p
    m = _load_moment(exp_avg, exp_avg_absmax, signed=True)
    v = _load_moment(exp_avg_sq, exp_avg_sq_absmax, signed=False)
    m = m + f32(1.0 - beta1) * (g - m)
    v = v * f32(beta2) + f32(1.0 - beta2) * (g * g)
    bc1 = 1.0 - beta1**step if bias_correction else 1.0
    bc2 = 1.0 - beta2**step if bias_correction else 1.0
    # torch.sqrt on fp32 CPU tensors is not correctly rounded (SLEEF, up to 1 ulp off);
    # the fp64 root rounded to fp32 is, like the kernels' sqrtps (double rounding is
    # exact for the square root of an fp32)
    denom = v.double().sqrt().float() * f32(1.0 / math.sqrt(bc2)) + f32(eps)  # [Note: one division per element]
    p = p - f32(lr / bc1) * (m / denom)
    if master.dtype == torch.bfloat16:
        master.copy_(to_bf16_stochastic(p, sr_seed))
    else:
        master.copy_(p)
    _store_moment(exp_avg, exp_avg_absmax, m, signed=True)
    _store_moment(exp_avg_sq, exp_avg_sq_absmax, v, signed=False)
    if param_out is not None:
        param_out.copy_(master)
    return nonfinite


def _load_moment(values, absmax, signed: bool) -> torch.Tensor:
    if values.dtype == torch.uint8:
        return dequantize_blockwise(values, absmax, signed).to(values.device)
    return values.float()


def _store_moment(values, absmax, new: torch.Tensor, signed: bool) -> None:
    if values.dtype == torch.uint8:
        codes, scales = quantize_blockwise(new, signed)
        values.copy_(codes)
        absmax.copy_(scales)
    else:
        values.copy_(new)  # bf16: round to nearest even


def lion_step_reference(master, exp_avg, grad, *, lr, beta1, beta2, weight_decay, grad_scale=1.0, param_out=None,
                        exp_avg_absmax=None, sr_seed=None) -> int:
    """Pure-torch transcription of the scalar Lion kernel (native/cpu/lion.inc): the same fp32
    operations in the same order, one rounding each, and the same rounding of each state dtype.
    c = b1*m + (1-b1)*g; p = p*(1 - lr*wd) - lr*sign(c); m = b2*m + (1-b2)*g, with torch.sign
    (0 for +-0 and NaN). Returns the count of non-finite scaled gradients."""
    def f32(value):
        return torch.tensor(value, dtype=torch.float32, device=master.device)
    g = grad.float() * f32(grad_scale)
    nonfinite = int((~torch.isfinite(g)).sum())
    p = master.float() * f32(1.0 - lr * weight_decay)
    m = _load_moment(exp_avg, exp_avg_absmax, signed=True)
    c = m * f32(beta1) + f32(1.0 - beta1) * g
    p = p - f32(lr) * torch.sign(c)
    m = m * f32(beta2) + f32(1.0 - beta2) * g
    if master.dtype == torch.bfloat16:
        master.copy_(to_bf16_stochastic(p, sr_seed))
    else:
        master.copy_(p)
    _store_moment(exp_avg, exp_avg_absmax, m, signed=True)
    if param_out is not None:
        param_out.copy_(master)
    return nonfinite
