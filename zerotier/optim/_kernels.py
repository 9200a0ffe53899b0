"""The optimizer's only door to native code: ctypes bindings of `_zt_cpu`.

`adam_step()` is the flat, low-level entry the engine calls on (sub-ranges of)
flat buffers; `CPUAdamW` is built on it. With the native library unavailable
(or ZEROTIER_NATIVE=0) the same calls run `adam_step_reference()`, a pure-torch
transcription of the scalar C loop that is also the test oracle.
"""
from __future__ import annotations

import ctypes
import os

import torch

from .. import _native
from ..errors import ZerotierError

SIMD_LEVELS = ("scalar", "avx2", "avx512")  # index == ZtSimd code
_ABI_VERSION = 2  # zt_abi_version() in native/cpu/cpu_info.cpp; bump both together
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


class ZtAdamArgs(ctypes.Structure):
    """Mirror of `struct ZtAdamArgs` in native/cpu/adam.cpp (same field order; its size is
    checked against the library's zt_adam_args_size() at load)."""

    _fields_ = [
        ("param", ctypes.c_void_p),
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


def _check_buffer(t: torch.Tensor, name: str, n: int, dtypes: tuple[torch.dtype, ...]) -> None:
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
    simd: str = "auto",
    threads: int | None = None,
) -> int:
    """One Adam(W) update of flat buffers, in place. Returns the count of non-finite grads.

    master/exp_avg/exp_avg_sq: fp32; grad: fp32/bf16/fp16; param_out: optional
    fp32/bf16/fp16 buffer receiving the updated parameter in the same pass (bf16/fp16:
    round-to-nearest-even), e.g. the parameter's own home.
    `step` is the step number after this update (1 on the first). Gradients are
    multiplied by `grad_scale` first (1/loss_scale times the clip coefficient).
    Pass views (`buf[a:b]`) to step a sub-range. The native call releases the GIL.
    """
    return adam_step_multi([(master, exp_avg, exp_avg_sq, grad, param_out)], step=step, lr=lr, beta1=beta1,
                           beta2=beta2, eps=eps, weight_decay=weight_decay, decoupled=decoupled,
                           bias_correction=bias_correction, grad_scale=grad_scale, simd=simd, threads=threads)


def adam_step_multi(buffers, *, step, lr, beta1, beta2, eps, weight_decay, decoupled=True,
                    bias_correction=True, grad_scale=1.0, simd="auto", threads=None) -> int:
    """adam_step over many (master, exp_avg, exp_avg_sq, grad, param_out|None) tuples in
    one native call: the threads split all elements at once (one wake-up, not one per
    tensor). `step`, lr, beta1, beta2, eps, weight_decay and decoupled may each be a list
    with one value per tuple (parameters of different param groups in one call)."""
    def each(value):
        return list(value) if isinstance(value, (list, tuple)) else [value] * len(buffers)
    steps, lrs, b1s, b2s, epss, wds, decs = map(each, (step, lr, beta1, beta2, eps, weight_decay, decoupled))
    for (master, exp_avg, exp_avg_sq, grad, param_out), s in zip(buffers, steps):
        n = master.numel()
        _check_buffer(master, "master", n, (torch.float32,))
        _check_buffer(exp_avg, "exp_avg", n, (torch.float32,))
        _check_buffer(exp_avg_sq, "exp_avg_sq", n, (torch.float32,))
        _check_buffer(grad, "grad", n, tuple(_DTYPE_CODES))
        if param_out is not None:
            _check_buffer(param_out, "param_out", n, (torch.float32, torch.bfloat16, torch.float16))
        if s < 1:
            raise ZerotierError(f"step must be >= 1 (the step number after this update), got {s}")
    level = simd_level(simd)
    if level == "python":
        return sum(adam_step_reference(*bufs[:4], step=s, param_out=bufs[4], lr=lr_, beta1=b1, beta2=b2, eps=e,
                                       weight_decay=wd, decoupled=dec, bias_correction=bias_correction,
                                       grad_scale=grad_scale)
                   for bufs, s, lr_, b1, b2, e, wd, dec in zip(buffers, steps, lrs, b1s, b2s, epss, wds, decs))
    args = (ZtAdamArgs * len(buffers))()
    for i, ((master, exp_avg, exp_avg_sq, grad, out), s) in enumerate(zip(buffers, steps)):
        args[i] = ZtAdamArgs(
            master.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(), grad.data_ptr(),
            out.data_ptr() if out is not None else None, master.numel(), _DTYPE_CODES[grad.dtype],
            _DTYPE_CODES[out.dtype] if out is not None else -1, lrs[i], b1s[i], b2s[i], epss[i], wds[i], grad_scale,
            s, int(decs[i]), int(bias_correction), SIMD_LEVELS.index(level),
            threads if threads is not None else default_threads(),
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


def adam_step_reference(
    master, exp_avg, exp_avg_sq, grad, *, step, lr, beta1, beta2, eps, weight_decay,
    decoupled=True, bias_correction=True, grad_scale=1.0, param_out=None,
) -> int:
    """Pure-torch transcription of the scalar kernel (fp32, same operation order)."""
    g = grad.float() * grad_scale
    nonfinite = int((~torch.isfinite(g)).sum())
    if decoupled:
        master.mul_(1.0 - lr * weight_decay)  # rounded to fp32 like the kernel's `decay`
    elif weight_decay != 0.0:
        g = g + weight_decay * master
    exp_avg.add_(g - exp_avg, alpha=1.0 - beta1)
    exp_avg_sq.mul_(beta2).add_(g * g, alpha=1.0 - beta2)
    bc1 = 1.0 - beta1**step if bias_correction else 1.0
    bc2 = 1.0 - beta2**step if bias_correction else 1.0
    step_size = torch.tensor(lr / bc1, dtype=torch.float32)
    denom = exp_avg_sq.sqrt() / torch.tensor(bc2**0.5, dtype=torch.float32) + eps
    master.sub_(step_size * (exp_avg / denom))
    if param_out is not None:
        param_out.copy_(master)
    return nonfinite
