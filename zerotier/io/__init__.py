"""Async file I/O for the NVMe tier: issue reads/writes of CPU tensors, wait on Tickets.

    from zerotier.io import open_engine, open_direct, aligned_empty
    fd, direct = open_direct(path, os.O_RDWR | os.O_CREAT)
    buf = aligned_empty(64 << 20)
    with open_engine(cfg.io) as eng:
        t = eng.write(fd, buf, 0, path)      # returns at once
        ...                                  # overlap other work
        t.wait()

Backends (chosen by `open_engine` from `IOConfig.backend`):
  io_uring  native engine on raw io_uring syscalls (default when `probe_io_uring()` is ok)
  threads   native engine on a pthread pool of pread/pwrite (`cfg.threads` workers)
  aiofiles  pure Python: os.preadv/os.pwritev on a thread pool (the name is historical); used
            when the native library is unavailable or disabled with ZEROTIER_NATIVE=0
"auto" picks io_uring, else threads, else aiofiles. Fault injection for tests:
`IOEngine.inject_fault` (see its class docstring).
"""
from __future__ import annotations

import errno as errno_mod
import mmap
import os
import threading
import warnings

from .. import _native
from ..config import IOConfig
from ..errors import NativeUnavailableError, TierIOError
from .memory import aligned_empty, is_aligned, round_up
from .ticket import (ChainTicket, CompletedTicket, FutureTicket, IOEngine, Ticket, TicketLike,
                     wait_all)

__all__ = [
    "IOEngine", "Ticket", "CompletedTicket", "FutureTicket", "ChainTicket", "TicketLike", "wait_all",
    "TierIOError",
    "aligned_empty", "is_aligned", "round_up",
    "open_engine", "probe_io_uring", "native_available", "open_direct", "supports_o_direct",
]


def native_available() -> bool:
    """True if the native engine library is loaded (not disabled, built, current ABI)."""
    from . import native
    return native.library() is not None


def probe_io_uring() -> tuple[bool, str]:
    """(usable, why): whether the native io_uring backend can run here, and if not, why.

    Does a real round trip (io_uring_setup, ring mmap, opcode probe, one NOP), so seccomp
    filters and `kernel.io_uring_disabled` are caught. With ZEROTIER_NATIVE=0 returns
    (False, "native engine disabled").
    """
    from . import native
    return native.probe_io_uring()


_warned: set[str] = set()


def _warn_once(key: str, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


def open_engine(cfg: IOConfig | None = None) -> IOEngine:
    """An IOEngine for `cfg.backend` (see the module docstring for the choice)."""
    cfg = cfg if cfg is not None else IOConfig()  # validated by the config rules
    want = cfg.backend
    from .aio import AioFilesEngine
    if want == "aiofiles":
        return AioFilesEngine(cfg)
    if not _native.native_enabled():
        if want != "auto":
            _warn_once("forced", f"io.backend={want!r} ignored: ZEROTIER_NATIVE=0 forces the "
                                 "aiofiles backend")
        return AioFilesEngine(cfg)
    from . import native
    if native.library() is None:
        if want != "auto":
            native.require_library()  # raises NativeUnavailableError with the reason
        _warn_once("missing", "native I/O engine unavailable ("
                   + _native.status()["_zt_io"] + "); using the slower aiofiles backend")
        return AioFilesEngine(cfg)
    if want in ("auto", "io_uring"):
        ok, why = native.probe_io_uring()
        if ok:
            try:
                return native.NativeEngine(cfg, "io_uring")
            except NativeUnavailableError as exc:
                if want == "io_uring":
                    raise
                _warn_once("uring-start", f"{exc}; using the threads backend")
        elif want == "io_uring":
            raise NativeUnavailableError(
                f"io.backend='io_uring' but io_uring is unusable here: {why}. "
                "Use io.backend='threads' (or 'auto').")
    return native.NativeEngine(cfg, "threads")


# --- O_DIRECT --------------------------------------------------------------------------

_fs_lock = threading.Lock()
_no_direct_fs: set[int] = set()  # st_dev of filesystems that refused O_DIRECT


def _fs_key(path: str, dir_fd: int | None) -> int:
    if dir_fd is not None:
        return os.fstat(dir_fd).st_dev
    parent = os.path.dirname(os.path.abspath(path)) or "."
    return os.stat(parent).st_dev


def _dir_name(path: str, dir_fd: int | None) -> str:
    if dir_fd is not None:
        try:
            return os.readlink(f"/proc/self/fd/{dir_fd}")
        except OSError:
            return f"directory fd {dir_fd}"
    return os.path.dirname(os.path.abspath(path))


def lexists_at(path: str, dir_fd: int | None) -> bool:
    """os.path.lexists, relative to `dir_fd` when given."""
    try:
        os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False


def open_direct(path: str | os.PathLike, flags: int, mode: int = 0o600, *,
                direct: bool = True, dir_fd: int | None = None) -> tuple[int, bool]:
    """Open `path` (relative to `dir_fd` when given: openat) with O_DIRECT | O_NOFOLLOW |
    O_CLOEXEC added to `flags`.

    Returns (fd, direct). If the filesystem refuses O_DIRECT (EINVAL, e.g. some tmpfs or
    FUSE mounts), opens buffered instead and warns once per filesystem; later opens on
    that filesystem go straight to buffered. With direct=False, opens buffered.
    """
    path = os.fspath(path)
    base = flags | os.O_NOFOLLOW | os.O_CLOEXEC
    if direct:
        key = _fs_key(path, dir_fd)
        if key not in _no_direct_fs:
            creating = bool(flags & os.O_CREAT and flags & os.O_EXCL)
            existed = creating and lexists_at(path, dir_fd)
            try:
                return os.open(path, base | os.O_DIRECT, mode, dir_fd=dir_fd), True
            except OSError as exc:
                if exc.errno != errno_mod.EINVAL:
                    raise
                # Some kernels create the file before refusing O_DIRECT: undo our O_EXCL
                # creation so the buffered retry does not fail with EEXIST.
                if creating and not existed and lexists_at(path, dir_fd):
                    os.unlink(path, dir_fd=dir_fd)
                with _fs_lock:
                    first = key not in _no_direct_fs
                    _no_direct_fs.add(key)
                if first:
                    warnings.warn(
                        f"{_dir_name(path, dir_fd)}: filesystem does not support "
                        "O_DIRECT; zerotier uses buffered I/O there (page cache in the way: "
                        "lower, less predictable bandwidth and extra host memory use)",
                        RuntimeWarning, stacklevel=2)
    return os.open(path, base, mode, dir_fd=dir_fd), False


def supports_o_direct(directory: str | os.PathLike, alignment: int = 4096) -> bool:
    """True if an aligned O_DIRECT write+read round trip works in `directory`.

    Stronger than trying open(): some filesystems accept O_DIRECT at open and fail the I/O.
    """
    name = f".zt_odirect_probe.{os.getpid()}.{threading.get_ident()}"
    path = os.path.join(os.fspath(directory), name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT | os.O_NOFOLLOW
                     | os.O_CLOEXEC, 0o600)
    except OSError:
        return False
    try:
        with mmap.mmap(-1, alignment) as page:  # anonymous mmap: page-aligned
            page.write(b"z" * alignment)
            return (os.pwrite(fd, page, 0) == alignment
                    and os.preadv(fd, [page], 0) == alignment)
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(path)
