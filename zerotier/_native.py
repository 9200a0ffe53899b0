"""Locate and load zerotier's torch-free native libraries (ctypes, C ABI).

The libraries are built by `pip install` (see setup.py) next to this file as
`_zt_cpu*.so` (Adam kernels, thread pool, CPU feature detection) and `_zt_io*.so`
(async file I/O engine). Binding declarations live with their single user:
`zerotier/optim/_kernels.py` and `zerotier/io/native.py`.

ZEROTIER_NATIVE=0 disables them, forcing the pure-Python paths (the test oracle).

At load each library must match its bindings: `abi_mismatch(lib)` of the binding module
compares the ABI version (and, for `_zt_cpu`, sizeof(ZtAdamArgs)) with what the Python side
was written for. A library that does not match, or does not load, is refused: status() says
why, a RuntimeWarning says so once, and the pure-Python paths run instead.

Failures of native calls follow [Note: native error contract] in native/zt_api.h: a
negative status code (ERR_* below; the I/O library also returns -errno as a request's
result) plus a thread-local message, which `error()` turns into a NativeError.
"""
from __future__ import annotations

import ctypes
import importlib
import importlib.machinery
import os
import warnings
from pathlib import Path
from typing import Callable

from .errors import NativeError, NativeUnavailableError

_HERE = Path(__file__).resolve().parent
# The module that declares each library's functions and knows the ABI it was written for.
_BINDINGS = {"_zt_cpu": "zerotier.optim._kernels", "_zt_io": "zerotier.io.native"}

# ZtStatus in native/zt_api.h
ERR_ARGS, ERR_SIMD = -1, -2  # _zt_cpu only (in _zt_io these values are -EPERM, -ENOENT)
ERR_EXCEPTION, ERR_FORKED, ERR_HANDLE = -10000, -10001, -10002
_ERR_NAMES = {ERR_ARGS: "ZT_ERR_ARGS", ERR_SIMD: "ZT_ERR_SIMD", ERR_EXCEPTION: "ZT_ERR_EXCEPTION",
              ERR_FORKED: "ZT_ERR_FORKED", ERR_HANDLE: "ZT_ERR_HANDLE"}
_cache: dict[str, ctypes.CDLL | None] = {}
_load_errors: dict[str, str] = {}  # name -> "missing: <why>" or "refused: <why>"


def native_enabled() -> bool:
    """False when the user forced the pure-Python path with ZEROTIER_NATIVE=0."""
    return os.environ.get("ZEROTIER_NATIVE", "1").strip().lower() not in ("0", "false", "no", "off")


def _find(name: str) -> Path | None:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = _HERE / f"{name}{suffix}"
        if candidate.exists():
            return candidate
    return None


def load(name: str) -> ctypes.CDLL | None:
    """Return the loaded library `name` (e.g. "_zt_cpu"), or None if unavailable.

    ctypes.CDLL releases the GIL for the duration of every foreign call, which
    is what lets Adam kernels and I/O waits run beside Python threads.
    """
    if not native_enabled():
        return None
    if name not in _cache:
        path = _find(name)
        if path is None:
            _load_errors[name] = f"missing: {name} is not built next to {_HERE} (run `pip install -e .`)"
            _cache[name] = None
        else:
            _cache[name] = _open(name, path)
    return _cache[name]


def _open(name: str, path: Path) -> ctypes.CDLL | None:
    """dlopen `path` and check it against its bindings; None (reason recorded, warned) if refused."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:  # pragma: no cover - broken build
        why = f"cannot be loaded: {exc}"
    else:
        mismatch = importlib.import_module(_BINDINGS[name]).abi_mismatch(lib)
        if mismatch is None:
            return lib
        why = f"does not match this zerotier: {mismatch}"
    _load_errors[name] = (f"refused: {path.name} {why}; rebuild it "
                          "(`pip install -e .` or `python setup.py build_ext --inplace`)")
    warnings.warn(f"native library {name} {_load_errors[name]}. Using the pure-Python path "
                  "instead (slower)", RuntimeWarning, stacklevel=3)
    return None


def error(last_error: Callable[[], bytes | None], function: str, code: int) -> NativeError:
    """The NativeError for native `function` having returned failure `code`; `last_error` is
    the library's zt_*_last_error (thread-local: call this in the thread that made the call)."""
    msg = (last_error() or b"").decode(errors="replace")
    if msg.startswith(function + ": "):
        msg = msg[len(function) + 2:]
    kind = _ERR_NAMES.get(code, f"code {code}")
    return NativeError(f"native call {function} failed: {msg or 'no message'} [{kind}]")


def require(name: str) -> ctypes.CDLL:
    """Like load() but raise a clear error instead of returning None."""
    lib = load(name)
    if lib is None:
        why = "ZEROTIER_NATIVE=0 is set" if not native_enabled() else _load_errors.get(name, "unknown")
        raise NativeUnavailableError(f"native library {name} is unavailable: {why}")
    return lib


def status() -> dict[str, str]:
    """Per library: 'loaded', 'disabled (ZEROTIER_NATIVE=0)', 'missing: <why>' (not built) or
    'refused: <why>' (does not load or does not match its bindings)."""
    out = {}
    for name in ("_zt_cpu", "_zt_io"):
        if not native_enabled():
            out[name] = "disabled (ZEROTIER_NATIVE=0)"
        elif load(name) is not None:
            out[name] = "loaded"
        else:
            out[name] = _load_errors.get(name, "missing: unknown")
    return out
