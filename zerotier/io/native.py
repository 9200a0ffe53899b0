"""ctypes bindings of `_zt_io` (native/io/io_engine.cpp): the only module that talks to it.

`NativeEngine` drives the C engine (io_uring or pthread-pool backend). Every foreign call
goes through `ctypes.CDLL`, which releases the GIL for its duration, so a thread blocked
in `zt_io_wait` never stalls other Python threads.

[Note: in-flight table] The C engine reads/writes caller memory until a request is
observed complete. `NativeEngine._inflight` maps each native request id to the tensor it
touches and is the single owner of that reference: it is dropped only once the native side
reported the request complete (by `Ticket.wait`/`done`, the orphan sweep, or `close`).
So a caller may drop a Ticket without waiting and the buffer still outlives the I/O.

[Note: engines after fork] An engine belongs to the process that opened it (the C side
refuses calls from any other, see native/io/io_engine.cpp). In a forked child, submitting
raises NativeError before touching any lock a parent thread may have held, and close() (the
store's finalizer included) only forgets the engine: the parent still owns it.
"""
from __future__ import annotations

import ctypes
import errno as errno_mod
import os
import weakref
from collections import deque
from functools import lru_cache
import torch

from .. import _native
from ..config import IOConfig
from ..errors import NativeError, NativeUnavailableError, ZerotierError
from .ticket import IOEngine, Ticket

BACKENDS = {"io_uring": 0, "threads": 1}
OPS = {"read": 0, "write": 1}
_ABI_VERSION = 3  # zt_io_abi_version() in native/io/io_engine.cpp; bump both together
_WAIT_SLICE_MS = 250  # block in native wait in slices so Ctrl-C is seen in the main thread


def abi_mismatch(lib: ctypes.CDLL) -> str | None:
    """Why `lib` (a freshly loaded `_zt_io`) cannot serve these bindings, or None; declares
    its functions on the way. Called by `_native.load`."""
    try:
        lib.zt_io_abi_version.restype, lib.zt_io_abi_version.argtypes = ctypes.c_int, []
    except AttributeError:
        return "it has no zt_io_abi_version()"
    version = lib.zt_io_abi_version()
    if version != _ABI_VERSION:
        return f"its ABI version is {version}, these bindings need {_ABI_VERSION}"
    vp, i64, u64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64, ctypes.c_int
    sigs = {
        "zt_io_create": (vp, [c_int, c_int, c_int, u64]),
        "zt_io_submit": (i64, [vp, c_int, c_int, vp, u64, u64]),
        "zt_io_wait": (c_int, [vp, i64, i64, ctypes.POINTER(i64)]),
        "zt_io_poll": (c_int, [vp, i64, ctypes.POINTER(i64)]),
        "zt_io_cancel": (c_int, [vp]),
        "zt_io_inflight": (i64, [vp]),
        "zt_io_info": (c_int, [vp, ctypes.c_char_p, c_int]),
        "zt_io_destroy": (c_int, [vp]),
        "zt_io_uring_probe": (c_int, [ctypes.c_char_p, c_int]),
        "zt_io_last_error": (ctypes.c_char_p, []),
    }
    try:
        for name, (restype, argtypes) in sigs.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
    except AttributeError as exc:
        return f"a function is missing ({exc})"
    return None


def library() -> ctypes.CDLL | None:
    """The declared `_zt_io` library, or None (ZEROTIER_NATIVE=0, not built, or refused)."""
    return _native.load("_zt_io")


def require_library() -> ctypes.CDLL:
    return _native.require("_zt_io")  # raises with the loader's reason


def _checked(lib: ctypes.CDLL, function: str, rc: int) -> int:
    """`rc` unless it is a ZtStatus failure (below every -errno), which raises NativeError."""
    if rc <= _native.ERR_EXCEPTION:
        raise _native.error(lib.zt_io_last_error, function, rc)
    return rc


@lru_cache(maxsize=None)
def _probe_cached(lib: ctypes.CDLL) -> tuple[bool, str]:
    why = ctypes.create_string_buffer(256)
    ok = _checked(lib, "zt_io_uring_probe", lib.zt_io_uring_probe(why, len(why)))
    return bool(ok), why.value.decode(errors="replace")


def probe_io_uring() -> tuple[bool, str]:
    """(usable, reason): a full io_uring round trip (setup, mmap, opcode probe, NOP)."""
    if not _native.native_enabled():
        return False, "native engine disabled"
    lib = library()
    if lib is None:
        return False, "native library _zt_io unavailable: " + _native.status()["_zt_io"]
    return _probe_cached(lib)


class NativeTicket(Ticket):
    """A request of the C engine; its result is fetched (and cached) on first completion."""

    __slots__ = ("_engine", "_rid")

    def __init__(self, engine: "NativeEngine", rid: int, op: str, fd: int, nbytes: int,
                 offset: int, path: str):
        super().__init__(op, fd, nbytes, offset, path)
        self._engine = engine
        self._rid = rid

    def _poll(self) -> int | None:
        return self._engine._poll(self._rid)

    def _block(self, timeout: float | None) -> int | None:
        return self._engine._wait(self._rid, timeout)

    def __del__(self):
        # Dropped unwaited: hand the id to the engine, which keeps the buffer alive until
        # the request completes (see [Note: in-flight table]).
        if self._result is None:
            eng = self._engine
            if eng is not None:
                eng._orphans.append(self._rid)


class NativeEngine(IOEngine):
    """The C engine behind the IOEngine API. backend: "io_uring" or "threads"."""

    def __init__(self, cfg: IOConfig, backend: str):
        super().__init__(cfg)
        if backend not in BACKENDS:
            raise ValueError(
                f"unknown native backend {backend!r}; expected one of {sorted(BACKENDS)}")
        self._lib = require_library()
        handle = self._lib.zt_io_create(BACKENDS[backend], cfg.queue_depth, cfg.threads,
                                        cfg.block_size)
        if not handle:
            why = (self._lib.zt_io_last_error() or b"").decode(errors="replace")
            raise NativeUnavailableError(f"cannot start the {backend} I/O engine: {why}")
        self.backend = backend
        self._h = ctypes.c_void_p(handle)
        self._inflight: dict[int, torch.Tensor] = {}      # rid -> buffer, see the module note
        self._tickets: weakref.WeakValueDictionary[int, NativeTicket] = (
            weakref.WeakValueDictionary())                # rid -> live Ticket (for close)
        self._orphans: deque[int] = deque()               # rids whose Ticket died unwaited
        self._closed = False                              # open (IOEngine holds _pid and _lock)

    def describe(self) -> str:
        out = ctypes.create_string_buffer(256)
        if self._closed:
            return f"{self.backend} (closed)"
        _checked(self._lib, "zt_io_info", self._lib.zt_io_info(self._h, out, len(out)))
        return out.value.decode()

    def _forked_error(self) -> NativeError:
        return NativeError(
            f"this I/O engine ({self.backend}) was opened by process {self._pid}; its forked child "
            f"{os.getpid()} cannot use it (the engine's threads stay with the parent): open a new "
            "engine in the child (zerotier.io.open_engine) or do the I/O in the parent")

    # --- submission -------------------------------------------------------------------
    def _submit(self, op: str, fd: int, buf: torch.Tensor, nbytes: int, offset: int,
                path: str) -> Ticket:
        if os.getpid() != self._pid:  # before the lock: a parent thread may have held it
            raise self._forked_error()
        with self._lock:
            if self._closed:
                raise ZerotierError(f"I/O engine ({self.backend}) is closed")
            if self._orphans:
                self._sweep_orphans()
            rid = _checked(self._lib, "zt_io_submit",
                           self._lib.zt_io_submit(self._h, OPS[op], fd, buf.data_ptr(), nbytes, offset))
            if rid < 0:  # refused before any I/O (ENOMEM, EINVAL): surface as a failed ticket
                return self._failed_ticket(-rid, op, fd, nbytes, offset, path)
            self._inflight[rid] = buf
            ticket = NativeTicket(self, rid, op, fd, nbytes, offset, path)
            self._tickets[rid] = ticket
            return ticket

    def _sweep_orphans(self):
        # deque append/popleft are atomic: a Ticket.__del__ (GC can run anywhere, in any
        # thread) may append while we sweep without losing an entry.
        res = ctypes.c_int64()
        for _ in range(len(self._orphans)):
            rid = self._orphans.popleft()
            if _checked(self._lib, "zt_io_poll", self._lib.zt_io_poll(self._h, rid, ctypes.byref(res))) == 0:
                self._orphans.append(rid)  # still running
            else:
                self._inflight.pop(rid, None)

    # --- completion (called by NativeTicket under its own lock) ---------------------------
    def _poll(self, rid: int) -> int | None:
        if self._closed:
            return None
        res = ctypes.c_int64()
        rc = _checked(self._lib, "zt_io_poll", self._lib.zt_io_poll(self._h, rid, ctypes.byref(res)))
        if rc == 0:
            return None
        self._inflight.pop(rid, None)
        return res.value if rc == 1 else -errno_mod.ENOENT

    def _wait(self, rid: int, timeout: float | None) -> int | None:
        """Block until done (result) or `timeout` seconds pass (None)."""
        res = ctypes.c_int64()
        if timeout is None:
            while True:
                rc = _checked(self._lib, "zt_io_wait",
                              self._lib.zt_io_wait(self._h, rid, _WAIT_SLICE_MS, ctypes.byref(res)))
                if rc != 1:
                    break
        else:
            ms = max(0, int(timeout * 1000 + 0.999))
            rc = _checked(self._lib, "zt_io_wait", self._lib.zt_io_wait(self._h, rid, ms, ctypes.byref(res)))
            if rc == 1:
                return None
        self._inflight.pop(rid, None)
        return res.value if rc == 0 else -errno_mod.ENOENT

    # --- shutdown -----------------------------------------------------------------------
    def _stop(self, cancel: bool) -> None:
        if cancel:
            _checked(self._lib, "zt_io_cancel", self._lib.zt_io_cancel(self._h))
        for rid in list(self._inflight):
            t = self._tickets.get(rid)
            if t is not None:
                t._collect()  # waits under the ticket's lock; caches the result
            else:
                self._wait(rid, None)
        self._closed = True
        self._inflight.clear()
        self._orphans.clear()
        _checked(self._lib, "zt_io_destroy", self._lib.zt_io_destroy(self._h))
        self._h = ctypes.c_void_p()

    def pending(self) -> int:
        """Requests submitted and not yet complete."""
        return 0 if self._closed else _checked(self._lib, "zt_io_inflight", self._lib.zt_io_inflight(self._h))
