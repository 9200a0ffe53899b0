"""The optimizer's only door to native code: ctypes bindings of `_zt_cpu`.

`adam_step()` / `adam_step_multi()` and `lion_step_multi()` are the flat, low-level
entries the update rules (optim/rules/) call on (sub-ranges of) flat buffers; `CPUAdamW`
is built on the first. With the native library unavailable (or ZEROTIER_NATIVE=0) the
same calls run `adam_step_reference()` / `lion_step_reference()` (kernel_math.py),
pure-torch transcriptions of the scalar C loops that are also the test oracles: every
native kernel (scalar, AVX2, AVX-512, AVX-512 VBMI) is bitwise equal to them, for every state dtype.

State dtypes ([Note: compact optimizer state] in kernel_math.py): the master is fp32 or bf16
(stochastic rounding), each moment fp32, bf16 (round to nearest even) or uint8
codes of blockwise 8-bit quantization with one fp32 absmax per QUANT_BLOCK
elements ([Note: 8-bit moments] in kernel_math.py).
"""
from __future__ import annotations

import ctypes
import math
import os

import torch

from .. import _native
from ..errors import ZerotierError
from .kernel_math import QMAPS, QUANT_BLOCK, adam_step_reference, lion_step_reference

SIMD_LEVELS = ("scalar", "avx2", "avx512", "avx512vbmi")  # index == ZtSimd code
_ABI_VERSION = 5  # zt_abi_version() in native/cpu/cpu_info.cpp; bump both together
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # ZtDtype
_Q8 = 3  # ZtDtype ZT_Q8: uint8 codes of blockwise 8-bit quantization
_STATE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.uint8: _Q8}  # moments' dtypes
_MASTER_CODES = {torch.float32: 0, torch.bfloat16: 1}

_CTYPES = {"p": ctypes.c_void_p, "i64": ctypes.c_int64, "i32": ctypes.c_int32, "f64": ctypes.c_double,
           "u64": ctypes.c_uint64}


def _fields(spec: str) -> list:
    """A ctypes `_fields_` list from "name:type ..." (types: _CTYPES' keys), in order."""
    return [(name, _CTYPES[kind]) for name, kind in (field.split(":") for field in spec.split())]


class ZtAdamArgs(ctypes.Structure):
    """Mirror of `struct ZtAdamArgs` in native/cpu/adam.cpp (same field order; its size is
    checked against the library's zt_adam_args_size() at load)."""

    _fields_ = _fields("master:p exp_avg:p exp_avg_sq:p grad:p param_out:p n:i64 grad_dtype:i32 out_dtype:i32 "
                       "lr:f64 beta1:f64 beta2:f64 eps:f64 weight_decay:f64 grad_scale:f64 step:i64 decoupled:i32 "
                       "bias_correction:i32 simd:i32 threads:i32 master_dtype:i32 exp_avg_dtype:i32 "
                       "exp_avg_sq_dtype:i32 exp_avg_absmax:p exp_avg_sq_absmax:p qmaps:p sr_seed:u64")


class ZtLionArgs(ctypes.Structure):
    """Mirror of `struct ZtLionArgs` in native/cpu/lion.inc (checked against zt_lion_args_size())."""

    _fields_ = _fields("master:p exp_avg:p grad:p param_out:p n:i64 grad_dtype:i32 out_dtype:i32 lr:f64 beta1:f64 "
                       "beta2:f64 weight_decay:f64 grad_scale:f64 simd:i32 threads:i32 master_dtype:i32 "
                       "exp_avg_dtype:i32 exp_avg_absmax:p qmaps:p sr_seed:u64")


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
        lib.zt_lion_step_multi.argtypes = [ctypes.POINTER(ZtLionArgs), ctypes.c_int64]
        lib.zt_lion_step_multi.restype = ctypes.c_int64
        lib.zt_lion_args_size.restype = ctypes.c_int64
        lib.zt_grad_sumsq.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float,
                                      ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(ctypes.c_double)]
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
    size = lib.zt_lion_args_size()
    if size != ctypes.sizeof(ZtLionArgs):
        return (f"sizeof(ZtLionArgs) is {size} bytes in the library but {ctypes.sizeof(ZtLionArgs)} "
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
    """The kernel a call with `simd=requested` would use: avx512vbmi/avx512/avx2/scalar, or 'python'."""
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
            ptr(m_absmax), ptr(v_absmax), QMAPS.data_ptr(), seed or 0,
        )
    lib = _lib()
    result = lib.zt_adam_step_multi(args, len(buffers))
    if result < 0:
        raise _native.error(lib.zt_cpu_last_error, "zt_adam_step_multi", result)
    return int(result)


def lion_step_multi(buffers, *, lr, beta1, beta2, weight_decay, grad_scale=1.0, simd="auto", threads=None) -> int:
    """One Lion update of many (master, exp_avg, grad, param_out|None, exp_avg_absmax|None,
    sr_seed|None) tuples in one native call, in place (native/cpu/lion.inc has the math). The
    dtypes are adam_step's (exp_avg: fp32, bf16, or uint8 codes of the signed map with its block
    scales); lr, beta1, beta2 and weight_decay may each be a list with one value per tuple.
    Returns the count of non-finite scaled gradients. The native call releases the GIL."""
    def each(value):
        return list(value) if isinstance(value, (list, tuple)) else [value] * len(buffers)
    lrs, b1s, b2s, wds = map(each, (lr, beta1, beta2, weight_decay))
    for master, exp_avg, grad, param_out, m_absmax, seed in buffers:
        n = master.numel()
        _check_master(master, n, seed)
        _check_moment(exp_avg, m_absmax, "exp_avg", n)
        _check_buffer(grad, "grad", n, tuple(_DTYPE_CODES))
        if param_out is not None:
            _check_buffer(param_out, "param_out", n, (torch.float32, torch.bfloat16, torch.float16))
    level = simd_level(simd)
    if level == "python":
        return sum(lion_step_reference(master, exp_avg, grad, param_out=out, exp_avg_absmax=m_absmax, sr_seed=seed,
                                       lr=lr_, beta1=b1, beta2=b2, weight_decay=wd, grad_scale=grad_scale)
                   for (master, exp_avg, grad, out, m_absmax, seed), lr_, b1, b2, wd
                   in zip(buffers, lrs, b1s, b2s, wds))
    args = (ZtLionArgs * len(buffers))()
    ptr = (lambda t: t.data_ptr() if t is not None else None)
    for i, (master, exp_avg, grad, out, m_absmax, seed) in enumerate(buffers):
        args[i] = ZtLionArgs(
            master.data_ptr(), exp_avg.data_ptr(), grad.data_ptr(), ptr(out), master.numel(),
            _DTYPE_CODES[grad.dtype], _DTYPE_CODES[out.dtype] if out is not None else -1,
            lrs[i], b1s[i], b2s[i], wds[i], grad_scale, SIMD_LEVELS.index(level),
            threads if threads is not None else default_threads(),
            _MASTER_CODES[master.dtype], _STATE_CODES[exp_avg.dtype], ptr(m_absmax), QMAPS.data_ptr(), seed or 0,
        )
    lib = _lib()
    result = lib.zt_lion_step_multi(args, len(buffers))
    if result < 0:
        raise _native.error(lib.zt_cpu_last_error, "zt_lion_step_multi", result)
    return int(result)


def grad_sumsq(grad: torch.Tensor, scale: float = 1.0, threads: int | None = None, simd: str = "auto") -> float:
    """Sum of squares of grad*scale (fp32/bf16/fp16 CPU contiguous), in double (relative error
    ~1e-7: float partial sums per 4096 elements); inf/NaN in the buffer propagate."""
    _check_buffer(grad, "grad", grad.numel(), tuple(_DTYPE_CODES))
    level = simd_level(simd)
    if level == "python":
        g = grad.double() * scale
        return float((g * g).sum())
    lib = _lib()
    out = ctypes.c_double()
    rc = lib.zt_grad_sumsq(grad.data_ptr(), _DTYPE_CODES[grad.dtype], grad.numel(), scale,
                           threads if threads is not None else default_threads(), SIMD_LEVELS.index(level),
                           ctypes.byref(out))
    if rc < 0:
        raise _native.error(lib.zt_cpu_last_error, "zt_grad_sumsq", rc)
    return out.value


_DTYPE_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}


def state_bytes_per_param(master_dtype, moment_dtype, moments: int = 2) -> float:
    """Optimizer-state bytes per parameter, block scales included: master + `moments` moments
    (Adam's two, Lion's one).
    Dtypes as config names ("fp32", "bf16", "int8" for moments) or torch dtypes (torch.uint8
    = 8-bit codes). fp32/fp32 = 12, bf16/bf16 = 6, bf16/int8 = 2 + 2 * (1 + 4/QUANT_BLOCK)."""
    master_dtype, moment_dtype = (_DTYPE_NAMES.get(d, d) for d in (master_dtype, moment_dtype))
    if master_dtype not in _MASTER_CODES:
        raise ZerotierError(f"master dtype {master_dtype} is not one of fp32, bf16")
    if moment_dtype not in _STATE_CODES:
        raise ZerotierError(f"moment dtype {moment_dtype} is not one of fp32, bf16, int8")
    moment = 1 + 4 / QUANT_BLOCK if moment_dtype == torch.uint8 else moment_dtype.itemsize
    return float(master_dtype.itemsize + moments * moment)
