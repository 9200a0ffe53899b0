"""Locate and load zerotier's torch-free native libraries (ctypes, C ABI).

The libraries are built by `pip install` (see setup.py) next to this file as
`_zt_cpu*.so` (Adam kernels, thread pool, CPU feature detection) and `_zt_io*.so`
(async file I/O engine). Binding declarations live with their single user:
`zerotier/optim/_kernels.py` and `zerotier/io/native.py`.

ZEROTIER_NATIVE=0 disables them, forcing the pure-Python paths (the test oracle).
"""
from __future__ import annotations

import ctypes
import importlib.machinery
import os
from pathlib import Path

from .errors import NativeUnavailableError

_HERE = Path(__file__).resolve().parent
_cache: dict[str, ctypes.CDLL | None] = {}
_load_errors: dict[str, str] = {}


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
            _load_errors[name] = f"{name} is not built next to {_HERE} (run `pip install -e .`)"
            _cache[name] = None
        else:
            try:
                _cache[name] = ctypes.CDLL(str(path))
            except OSError as exc:  # pragma: no cover - broken build
                _load_errors[name] = f"{path}: {exc}"
                _cache[name] = None
    return _cache[name]


def require(name: str) -> ctypes.CDLL:
    """Like load() but raise a clear error instead of returning None."""
    lib = load(name)
    if lib is None:
        why = "ZEROTIER_NATIVE=0 is set" if not native_enabled() else _load_errors.get(name, "unknown")
        raise NativeUnavailableError(f"native library {name} is unavailable: {why}")
    return lib


def status() -> dict[str, str]:
    """Per library: 'loaded', 'disabled (ZEROTIER_NATIVE=0)' or 'missing: <why>'."""
    out = {}
    for name in ("_zt_cpu", "_zt_io"):
        if not native_enabled():
            out[name] = "disabled (ZEROTIER_NATIVE=0)"
        elif load(name) is not None:
            out[name] = "loaded"
        else:
            out[name] = "missing: " + _load_errors.get(name, "unknown")
    return out
