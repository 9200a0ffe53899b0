"""The optimizer's only door to native code: ctypes bindings of `_zt_cpu`.

`adam_step()` is the flat, low-level entry the engine calls on (sub-ranges of)
flat buffers; `CPUAdamW` is built on it. With the native library unavailable
(or ZEROTIER_NATIVE=0) the same calls run `adam_step_reference()`, a pure-torch
transcription of the scalar C loop that is also the test oracle: every native
kernel (scalar, AVX2, AVX-512) is bitwise equal to it, for every state dtype.

State dtypes ([Note: compact optimizer state]): the master is fp32 or bf16
(stochastic rounding), each moment fp32, bf16 (round to nearest even) or uint8
codes of blockwise 8-bit quantization with one fp32 absmax per QUANT_BLOCK
elements ([Note: 8-bit moments]).
"""
from __future__ import annotations

import ctypes
import math
import os

import torch

from .. import _native
from ..errors import ZerotierError

SIMD_LEVELS = ("scalar", "avx2", "avx512")  # index == ZtSimd code
_ABI_VERSION = 3  # zt_abi_version() in native/cpu/cpu_info.cpp; bump both together
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # ZtDtype
_Q8 = 3  # ZtDtype ZT_Q8: uint8 codes of blockwise 8-bit quantization
_STATE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.uint8: _Q8}  # moments' dtypes
_MASTER_CODES = {torch.float32: 0, torch.bfloat16: 1}

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
# NaN absmax it came from. The same tables (_QMAPS) go to the native kernel, so both agree
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


_QMAPS = _qmaps()  # lives as long as the module: the native kernel reads it by pointer


class ZtAdamArgs(ctypes.Structure):
    """Mirror of `struct ZtAdamArgs` in native/cpu/adam.cpp (same field order; its size is
    checked against the library's zt_adam_args_size() at load)."""

    _fields_ = [
        ("master", ctypes.c_void_p),
        ("exp_avg", ctypes.c_void_p),
        ("exp_avg_sq", ctypes.c_void_p),
        ("grad", ctypes.c_void_p),
        ("param_out", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("grad_dtype", ctypes.c_int32),
        ("out_dtype", ctypes.c_int32),
        ("lr", ctypes.c_double),
        ("beta1", ctypes.c_double),
        ("beta2", ctypes.c_double),
        ("eps", ctypes.c_double),
        ("weight_decay", ctypes.c_double),
        ("grad_scale", ctypes.c_double),
        ("step", ctypes.c_int64),
        ("decoupled", ctypes.c_int32),
        ("bias_correction", ctypes.c_int32),
        ("simd", ctypes.c_int32),
        ("threads", ctypes.c_int32),
        ("master_dtype", ctypes.c_int32),
        ("exp_avg_dtype", ctypes.c_int32),
        ("exp_avg_sq_dtype", ctypes.c_int32),
        ("exp_avg_absmax", ctypes.c_void_p),
        ("exp_avg_sq_absmax", ctypes.c_void_p),
        ("qmaps", ctypes.c_void_p),
        ("sr_seed", ctypes.c_uint64),
    ]


def abi_mismatch(lib: ctypes.CDLL) -> str | None:
    """Why `lib` (a freshly loaded `_zt_cpu`) cannot serve these bindings, or None; declares
    its functions on the way. Called by `_native.load`."""
    try:
        lib.zt_abi_version.restype = ctypes.c_int
    except AttributeError:
        return "it has no zt_abi_version() (built before ABI versioning)"
    version = lib.zt_abi_version()
    if version != _ABI_VERSION:
        return f"its ABI version is {version}, these bindings need {_ABI_VERSION}"
    try:
        lib.zt_adam_step_multi.argtypes = [ctypes.POINTER(ZtAdamArgs), ctypes.c_int64]
        lib.zt_adam_step_multi.restype = ctypes.c_int64
        lib.zt_grad_sumsq.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float,
                                      ctypes.c_int32, ctypes.POINTER(ctypes.c_double)]
        lib.zt_grad_sumsq.restype = ctypes.c_int32
        lib.zt_cpu_simd_supported.restype = ctypes.c_int
        lib.zt_cpu_last_error.restype = ctypes.c_char_p
        lib.zt_adam_args_size.restype = ctypes.c_int64
    except AttributeError as exc:
        return f"a function is missing ({exc})"
    size = lib.zt_adam_args_size()
    if size != ctypes.sizeof(ZtAdamArgs):
        return (f"sizeof(ZtAdamArgs) is {size} bytes in the library but {ctypes.sizeof(ZtAdamArgs)} "
                "in its ctypes mirror (zerotier/optim/_kernels.py)")
    return None


def _lib() -> ctypes.CDLL | None:
    return _native.load("_zt_cpu")


def native_available() -> bool:
    return _lib() is not None


def default_threads() -> int:
    """Threads the CPU kernels use by default: the cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def simd_levels_available() -> list[str]:
    """SIMD levels this CPU can run, lowest first ([] when native is unavailable)."""
    lib = _lib()
    return [] if lib is None else list(SIMD_LEVELS[: lib.zt_cpu_simd_supported() + 1])


def simd_level(requested: str = "auto") -> str:
    """The kernel a call with `simd=requested` would use: avx512/avx2/scalar, or 'python'."""
    levels = simd_levels_available()
    if not levels:
        return "python"
    if requested == "auto":
        return levels[-1]
    if requested not in SIMD_LEVELS:
        raise ZerotierError(f"unknown simd level {requested!r}; choose one of auto, {', '.join(SIMD_LEVELS)}")
    if requested not in levels:
        raise ZerotierError(f"simd={requested!r} is not supported by this CPU (available: {', '.join(levels)})")
    return requested


def _check_buffer(t: torch.Tensor, name: str, n: int, dtypes) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ZerotierError(f"{name} is on {t.device}; the CPU Adam kernel needs CPU tensors")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ZerotierError(f"{name} has dtype {t.dtype}; expected one of: {allowed}")
    if not t.is_contiguous():
        raise ZerotierError(
            f"{name} is not contiguous; the kernel updates memory in place and will not "
            "silently update a temporary copy (call .contiguous() on the parameter itself)"
        )
    if t.numel() != n:
        raise ZerotierError(f"{name} has {t.numel()} elements, expected {n} (all buffers must match the master)")


def _blocks(n: int) -> int:
    return -(-n // QUANT_BLOCK)


def _check_moment(values: torch.Tensor, absmax, name: str, n: int) -> None:
    """A moment buffer and its block scales: fp32/bf16 without absmax, or uint8 codes with one
    fp32 absmax per QUANT_BLOCK elements, starting on a block boundary ([Note: 8-bit moments])."""
    _check_buffer(values, name, n, tuple(_STATE_CODES))
    if values.dtype != torch.uint8:
        if absmax is not None:
            raise ZerotierError(f"{name}_absmax given for a {values.dtype} {name}: block scales belong to uint8 codes")
        return
    if absmax is None:
        raise ZerotierError(f"{name} holds uint8 codes of 8-bit blockwise quantization: pass {name}_absmax "
                            f"(fp32, one per {QUANT_BLOCK} elements)")
    _check_buffer(absmax, f"{name}_absmax", _blocks(n), (torch.float32,))
    if values.storage_offset() % QUANT_BLOCK:
        raise ZerotierError(
            f"{name} starts at element {values.storage_offset()} of its buffer, inside a quantization block "
            f"(QUANT_BLOCK = {QUANT_BLOCK}): a sub-range of 8-bit codes must start on a block boundary, since "
            "each block is re-quantized as a whole; step the whole block or align the range")


def _check_master(master: torch.Tensor, n: int, sr_seed) -> None:
    _check_buffer(master, "master", n, tuple(_MASTER_CODES))
    if master.dtype == torch.bfloat16 and sr_seed is None:
        raise ZerotierError("a bf16 master is updated with stochastic rounding: pass sr_seed (an int, e.g. a hash "
                            "of the unit and the step, plus the piece's offset when a shard is stepped in pieces)")
    if sr_seed is not None and not 0 <= sr_seed < 2**64:
        raise ZerotierError(f"sr_seed must be an int in [0, 2**64), got {sr_seed}")


def adam_step(
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool = True,
    bias_correction: bool = True,
    grad_scale: float = 1.0,
    param_out: torch.Tensor | None = None,
    exp_avg_absmax: torch.Tensor | None = None,
    exp_avg_sq_absmax: torch.Tensor | None = None,
    sr_seed: int | None = None,
    simd: str = "auto",
    threads: int | None = None,
) -> int:
    """One Adam(W) update of flat buffers, in place. Returns the count of non-finite grads.

    master: fp32, or bf16 (stochastic rounding seeded by `sr_seed`: element i rounds with
    the bits of sr_seed + i, [Note: compact optimizer state]). exp_avg / exp_avg_sq: fp32,
    bf16 (round-to-nearest-even) or uint8 codes with `exp_avg_absmax` / `exp_avg_sq_absmax`
    (fp32, ceil(n / QUANT_BLOCK) block scales, updated too; [Note: 8-bit moments]).
    grad: fp32/bf16/fp16; param_out: optional fp32/bf16/fp16 buffer receiving the updated
    master in the same pass (the stored value; bf16/fp16 of an fp32 master: round to
    nearest even), e.g. the parameter's own home.
    `step` is the step number after this update (1 on the first). Gradients are
    multiplied by `grad_scale` first (1/loss_scale times the clip coefficient).
    Pass views (`buf[a:b]`) to step a sub-range (8-bit moments: from a block boundary).
    The native call releases the GIL.
    """
    return adam_step_multi([(master, exp_avg, exp_avg_sq, grad, param_out, exp_avg_absmax, exp_avg_sq_absmax,
                             sr_seed)], step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                           weight_decay=weight_decay, decoupled=decoupled, bias_correction=bias_correction,
                           grad_scale=grad_scale, simd=simd, threads=threads)


def _entry(bufs) -> tuple:
    """(master, exp_avg, exp_avg_sq, grad, param_out, exp_avg_absmax, exp_avg_sq_absmax, sr_seed)."""
    if len(bufs) == 5:
        return (*bufs, None, None, None)
    if len(bufs) == 8:
        return tuple(bufs)
    raise ZerotierError(f"adam_step_multi takes tuples of 5 (master, exp_avg, exp_avg_sq, grad, param_out) or 8 "
                        f"(+ exp_avg_absmax, exp_avg_sq_absmax, sr_seed) buffers, got {len(bufs)}")


def adam_step_multi(buffers, *, step, lr, beta1, beta2, eps, weight_decay, decoupled=True,
                    bias_correction=True, grad_scale=1.0, simd="auto", threads=None) -> int:
    """adam_step over many tuples in one native call: the threads split all elements at once
    (one wake-up, not one per tensor). A tuple is (master, exp_avg, exp_avg_sq, grad,
    param_out|None), or with compact state (..., param_out|None, exp_avg_absmax|None,
    exp_avg_sq_absmax|None, sr_seed|None), the dtypes of `adam_step`. `step`, lr, beta1,
    beta2, eps, weight_decay and decoupled may each be a list with one value per tuple
    (parameters of different param groups in one call)."""
    buffers = [_entry(b) for b in buffers]

    def each(value):
        return list(value) if isinstance(value, (list, tuple)) else [value] * len(buffers)
    steps, lrs, b1s, b2s, epss, wds, decs = map(each, (step, lr, beta1, beta2, eps, weight_decay, decoupled))
    for (master, exp_avg, exp_avg_sq, grad, param_out, m_absmax, v_absmax, seed), s in zip(buffers, steps):
        n = master.numel()
        _check_master(master, n, seed)
        _check_moment(exp_avg, m_absmax, "exp_avg", n)
        _check_moment(exp_avg_sq, v_absmax, "exp_avg_sq", n)
        _check_buffer(grad, "grad", n, tuple(_DTYPE_CODES))
        if param_out is not None:
            _check_buffer(param_out, "param_out", n, (torch.float32, torch.bfloat16, torch.float16))
        if s < 1:
            raise ZerotierError(f"step must be >= 1 (the step number after this update), got {s}")
    level = simd_level(simd)
    if level == "python":
        return sum(adam_step_reference(*bufs[:4], step=s, param_out=bufs[4], exp_avg_absmax=bufs[5],
                                       exp_avg_sq_absmax=bufs[6], sr_seed=bufs[7], lr=lr_, beta1=b1, beta2=b2, eps=e,
                                       weight_decay=wd, decoupled=dec, bias_correction=bias_correction,
                                       grad_scale=grad_scale)
                   for bufs, s, lr_, b1, b2, e, wd, dec in zip(buffers, steps, lrs, b1s, b2s, epss, wds, decs))
    args = (ZtAdamArgs * len(buffers))()
    ptr = (lambda t: t.data_ptr() if t is not None else None)
    for i, ((master, exp_avg, exp_avg_sq, grad, out, m_absmax, v_absmax, seed), s) in enumerate(zip(buffers, steps)):
        args[i] = ZtAdamArgs(
            master.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(), grad.data_ptr(),
            ptr(out), master.numel(), _DTYPE_CODES[grad.dtype],
            _DTYPE_CODES[out.dtype] if out is not None else -1, lrs[i], b1s[i], b2s[i], epss[i], wds[i], grad_scale,
            s, int(decs[i]), int(bias_correction), SIMD_LEVELS.index(level),
            threads if threads is not None else default_threads(),
            _MASTER_CODES[master.dtype], _STATE_CODES[exp_avg.dtype], _STATE_CODES[exp_avg_sq.dtype],
            ptr(m_absmax), ptr(v_absmax), _QMAPS.data_ptr(), seed or 0,
        )
    lib = _lib()
    result = lib.zt_adam_step_multi(args, len(buffers))
    if result < 0:
        raise _native.error(lib.zt_cpu_last_error, "zt_adam_step_multi", result)
    return int(result)


def grad_sumsq(grad: torch.Tensor, scale: float = 1.0, threads: int | None = None) -> float:
    """Sum of squares of grad*scale (fp32/bf16/fp16 CPU contiguous), in double."""
    _check_buffer(grad, "grad", grad.numel(), tuple(_DTYPE_CODES))
    lib = _lib()
    if lib is None:
        g = grad.double() * scale
        return float((g * g).sum())
    out = ctypes.c_double()
    rc = lib.zt_grad_sumsq(grad.data_ptr(), _DTYPE_CODES[grad.dtype], grad.numel(), scale,
                           threads if threads is not None else default_threads(), ctypes.byref(out))
    if rc < 0:
        raise _native.error(lib.zt_cpu_last_error, "zt_grad_sumsq", rc)
    return out.value


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
    mid = _QMAPS[1 if signed else 3][:255].contiguous()
    codes = torch.searchsorted(mid, xn, side="left")  # #{k: mid[k] < xn}
    codes = torch.where(torch.isnan(xn), 0, codes)
    return codes.to(torch.uint8).view(-1)[:n].clone(), absmax


def dequantize_blockwise(codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    """uint8 `codes` with their block scales `absmax` back to fp32 (map[code] * absmax)."""
    n = codes.numel()
    if absmax.numel() != _blocks(n):
        raise ZerotierError(f"{n} codes need {_blocks(n)} block scales (QUANT_BLOCK = {QUANT_BLOCK}), "
                            f"got {absmax.numel()}")
    values = _QMAPS[0 if signed else 2][codes.reshape(-1).long()]
    return values * absmax.float().repeat_interleave(QUANT_BLOCK)[:n]


_DTYPE_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}


def state_bytes_per_param(master_dtype, moment_dtype) -> float:
    """Optimizer-state bytes per parameter, block scales included: master + two moments.
    Dtypes as config names ("fp32", "bf16", "int8" for moments) or torch dtypes (torch.uint8
    = 8-bit codes). fp32/fp32 = 12, bf16/bf16 = 6, bf16/int8 = 2 + 2 * (1 + 4/QUANT_BLOCK)."""
    master_dtype, moment_dtype = (_DTYPE_NAMES.get(d, d) for d in (master_dtype, moment_dtype))
    if master_dtype not in _MASTER_CODES:
        raise ZerotierError(f"master dtype {master_dtype} is not one of fp32, bf16")
    if moment_dtype not in _STATE_CODES:
        raise ZerotierError(f"moment dtype {moment_dtype} is not one of fp32, bf16, int8")
    moment = 1 + 4 / QUANT_BLOCK if moment_dtype == torch.uint8 else moment_dtype.itemsize
    return float(master_dtype.itemsize + 2 * moment)


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


def _to_bf16_stochastic(x: torch.Tensor, seed: int) -> torch.Tensor:
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
        master.copy_(_to_bf16_stochastic(p, sr_seed))
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
