"""NVMe tier: one swap file per shard inside a locked, per-run directory.

[Note: NVMe layout]
    <tiers.nvme_path>/zerotier-<pid>-<random>/     mode 0700, one per store (run)
        .lock         flock(LOCK_EX|LOCK_NB) held for the store's lifetime
        owner.json    {"magic", pid, hostname, boot_id, pid_start, start_time}
        <key>.swp     one file per shard, O_CREAT|O_EXCL|O_NOFOLLOW, 0600,
                      size = nbytes rounded up to io.alignment (O_DIRECT needs it)

One file per shard keeps the store simple to reason about: no allocator, no
fragmentation, space returns to the filesystem on unlink, a corrupt or truncated
file damages one shard only (freed files are reused, new ones preallocated: [Note: NVMe
file recycling] and [Note: new swap files are preallocated] in nvme_files.py). docs/tiers.md
compares it with a slab + extent allocator. The run directory is created under a hidden temporary name and renamed
into place once locked and labelled, so a scanner never sees a half-made one.

[Note: the checksum beside the write]
A write's checksum (io.checksum) is taken after its request is submitted, while the engine
writes the same bytes: both only read them. Taken before, it held each write back by its own
time (a 32 MiB shard: 15 ms at the 2.2 GB/s crc32c ran at on this 2-core VM under load, a
third of the 48 ms the drive takes at 0.7 GB/s), and the drive idled whenever nothing else was
queued. finish() waits for it (another thread may see the write complete first) and commits
the entry with it; a write whose checksum was never taken (a Ctrl-C inside it) is discarded
like a failed one.

[Note: NVMe state on error]
A failed write leaves the previous version of the shard (if any) in place: a key
that already exists is rewritten to a temporary file that is renamed over the old
one only when the write has completed. Source tensors are only ever read. Any
failure (ENOSPC, EIO, short read, checksum mismatch) raises TierIOError naming the
tier, the file, the offset and the remedy, and the store stays usable for other
keys.

[Note: buffers in flight]
Every ticket returned by write()/read() holds the buffer the I/O engine reads or
fills (and the file descriptor) until the I/O has completed; the bookkeeping
(commit to the index, checksum check, copy out of a staging buffer, fd close) runs
exactly once, in whichever thread first observes completion (wait(), done(),
close()). In the zero-copy write path the engine reads straight from the caller's
tensor: do not modify it until the ticket completes.
"""
from __future__ import annotations

import dataclasses
import errno
import functools
import logging
import os
import shutil
import threading
import weakref
from pathlib import Path

import torch

from ..config import IOConfig, TiersConfig
from ..errors import ConfigError, TierIOError, ZerotierError
from ..io import lexists_at, open_direct, open_engine
from ..io.memory import round_up
from ..io.ticket import ChainTicket, CompletedTicket
from ..units import format_size
from .base import BudgetedTier, charging
from .host import HostBuffer
from .nvme_files import (HINTS, FileRecycler, KeyWrites, NVMeEntry, Write, byte_view, checksum_impl,
                         dtype_from_str, file_stem, preallocate, quiet_wait, read_buffer, write_buffer)
from .rundir import _RECYCLED_PREFIX, _SUFFIX, _TMP_SUFFIX, RunDir, _check_parent, scan_stale

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------- store

class NVMeStore(BudgetedTier):
    """The NVMe tier (see [Note: NVMe layout]). Thread-safe.

    write(key, src) -> ticket     read(key, dst) -> ticket     nbytes(key), stats(), close()

    Tickets return the shard's logical byte count from wait().
    """

    def __init__(self, tiers_cfg: TiersConfig, io_cfg: IOConfig, *, budget: int | None = None,
                 engine=None) -> None:
        """`budget`: this rank's bytes, `plan.budgets["nvme"]`; "auto" is resolved by the planner
        alone (planner.resolve_budgets, per rank), so a fixed tiers.nvme is the only default."""
        if tiers_cfg.nvme_path is None:
            raise ConfigError("tiers.nvme_path: the nvme tier needs a directory (tiers.nvme is "
                              f"{tiers_cfg.nvme!r}); set tiers.nvme_path or set tiers.nvme = 0")
        parent = Path(tiers_cfg.nvme_path)
        _check_parent(parent)
        if budget is None:
            if tiers_cfg.nvme == "auto":
                raise ValueError("NVMeStore: tiers.nvme = 'auto' is resolved by planner.resolve_budgets; "
                                 "pass budget=plan.budgets['nvme']")
            budget = tiers_cfg.nvme
        self.parent = parent
        super().__init__("nvme", int(budget), hint=f"Raise tiers.nvme (free space on {parent}: "
                                                   f"{format_size(shutil.disk_usage(parent).free)}) "
                                                   f"or keep less state on nvme.")
        self.io_cfg = io_cfg
        self.alignment = io_cfg.alignment
        self._checksum, self.checksum_algo = checksum_impl(io_cfg.checksum), io_cfg.checksum
        scan_stale(parent)  # removes the run directories of dead runs on this path
        self._run = RunDir.create(parent)
        self.run_dir = self._run.path  # for messages: files are reached through _dir_fd only
        self._dir_fd = self._run.dir_fd  # [Note: the held run directory]
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)       # signals changes of _key_writes
        self._index: dict[str, NVMeEntry] = {}
        self._key_writes = KeyWrites(self._cond, self._check_open)  # one write per key in flight
        self._inflight: set[ChainTicket] = set()           # every ticket not finished yet
        self._gen = 0
        self._closed = False
        self._errors = 0
        self._recycled = FileRecycler(self._unlink_quiet, self.release)  # [Note: NVMe file recycling]
        self._readers: dict[str, int] = {}   # key -> reads in flight (their files are not recycled)
        try:
            self.engine = engine if engine is not None else open_engine(io_cfg)
        except BaseException:
            self._run.remove()
            raise
        # Cleanup at garbage collection / interpreter exit, without referencing self.
        self._finalizer = weakref.finalize(self, _finalize_store, self._run, self.engine)

    # -------------------------------------------------------------- public API

    def write(self, key: str, src: torch.Tensor | HostBuffer, *, what: str = "") -> ChainTicket:
        """Write src (any dtype/shape/device) as shard `key`; replaces an existing key.

        Zero-copy when src is an aligned contiguous CPU tensor with room for the
        aligned length (or a HostBuffer); otherwise src is copied into an aligned
        staging buffer first. BudgetError (nothing written) if tiers.nvme is exceeded.
        """
        self._check_key(key)
        tensor = src.view() if isinstance(src, HostBuffer) else src
        nbytes = tensor.numel() * tensor.element_size()
        self._key_writes.claim(key)  # waits for an earlier write of this key: writes commit in order
        try:
            w = self._issue_write(key, src, tensor, nbytes, round_up(nbytes, self.alignment), what, charging())
        except BaseException:
            self._key_writes.unclaim(key, None)
            raise
        ticket = w.ticket = ChainTicket(w.inner, functools.partial(self._finish_write, w))
        with self._cond:
            self._inflight.add(ticket)
            self._key_writes.issued(key, ticket)
        try:  # [Note: the checksum beside the write]: the engine is writing buf meanwhile
            if self._checksum is not None:
                w.sums.append(self._checksum(w.buf[:nbytes].numpy()))
        finally:
            w.summed.set()
        return ticket

    def _issue_write(self, key: str, src, tensor: torch.Tensor, nbytes: int, file_bytes: int,
                     what: str, component: str | None) -> "Write":
        """Account the file, open it (a recycled one, a new one, or a rewrite's temporary), give it its
        blocks and submit the write. On an error nothing is left: no file, no bytes accounted."""
        fd = -1
        # The file's bytes are accounted from here on: a recycled file's already are.
        with self._lock:
            recycled = self._recycled.take(file_bytes) if file_bytes else None
        if recycled is None:
            self._reserve_file(file_bytes, what or f"shard '{key}'")
        self.charge(component, file_bytes)  # [Note: peaks per component]
        try:
            buf = write_buffer(src, tensor, nbytes, file_bytes, self.alignment)
            with self._lock:
                self._check_open()
                replacing = key in self._index
                self._gen += 1
                gen = self._gen
            stem = file_stem(key)
            # A rewrite or a recycled file is written under another name and renamed
            # onto <key>.swp on success; a new key's fresh file is written in place.
            if recycled is not None:
                name, flags = recycled, os.O_WRONLY
            elif replacing:
                name, flags = f"{stem}{_SUFFIX}.{gen}{_TMP_SUFFIX}", os.O_WRONLY | os.O_CREAT | os.O_EXCL
            else:
                name, flags = f"{stem}{_SUFFIX}", os.O_WRONLY | os.O_CREAT | os.O_EXCL
            path = self.run_dir / name
            fd = self._open(name, flags, key, "create" if flags & os.O_CREAT else "open")
            if flags & os.O_CREAT and file_bytes:
                try:
                    preallocate(fd, file_bytes)
                except OSError as exc:
                    raise self._io_error("write", key, path, exc) from None
            entry = NVMeEntry(key=key, file=f"{stem}{_SUFFIX}", dtype=str(tensor.dtype),
                              shape=tuple(tensor.shape), nbytes=nbytes, file_bytes=file_bytes,
                              checksum=None, checksum_algo=self.checksum_algo)
            inner = self.engine.write(fd, buf, 0, path=str(path)) if file_bytes else CompletedTicket(0)
        except BaseException:
            if fd >= 0:
                os.close(fd)
                self._unlink_quiet(name)
            elif recycled is not None:
                self._unlink_quiet(recycled)
            self.release(file_bytes)
            self.charge(component, -file_bytes)
            raise
        return Write(key, fd, name, path, entry, buf, inner, component)

    def _finish_write(self, w: "Write", outcome: int | BaseException) -> int:
        """Runs once, when the write has completed (see [Note: buffers in flight]): commit the file
        under its key, or count the error, drop the file and raise it."""
        key, path, file_bytes = w.key, w.path, w.entry.file_bytes
        err, interrupted = None, None
        try:
            os.close(w.fd)
            if isinstance(outcome, BaseException):
                err = self._io_error("write", key, path, outcome)
            elif outcome != file_bytes:
                err = TierIOError(errno.EIO, self._msg("write", key, path, outcome,
                                  f"short write: {outcome} of {file_bytes} B written",
                                  "disk full or failing? free space on {dir} or check the drive"))
            w.summed.wait()
            if err is None and self._checksum is not None and not w.sums:
                err = TierIOError(errno.EINTR, self._msg("write", key, path, 0,
                                  "interrupted before its checksum was taken", "write it again"))
        except BaseException as exc:  # noqa: BLE001 - a Ctrl-C here: the bookkeeping still runs
            interrupted = exc
            err = err or TierIOError(errno.EINTR, self._msg("write", key, path, 0,
                                     f"interrupted by {type(exc).__name__}", "write it again"))
        try:
            with self._lock:
                self._inflight.discard(w.ticket)
                old = self._index.get(key)
                if err is None and w.name != w.entry.file:
                    err = self._commit_rename(key, w.name, w.entry.file, old)
                if err is not None:
                    self._errors += 1
                    self._unlink_quiet(w.name)
                    self.release(file_bytes)
                    self.charge(w.component, -file_bytes)
                    raise err
                self._index[key] = dataclasses.replace(w.entry, checksum=w.sums[0]) if w.sums else w.entry
                if old is not None:  # replaced: recycled or released ([Note: peaks per component])
                    self.charge(w.component, -old.file_bytes)
        finally:
            self._key_writes.unclaim(key, w.ticket)
            if interrupted is not None:
                raise interrupted
        self.count_in(w.entry.nbytes)
        return w.entry.nbytes

    def read(self, key: str, dst: torch.Tensor | HostBuffer, *, padded: bool = False) -> ChainTicket:
        """Fill dst with shard `key`. dst must hold exactly the shard's bytes; its dtype
        must match the shard's (or be uint8). The length read and (io.checksum) the
        checksum are verified before wait() returns.

        Zero-copy when dst is a HostBuffer, or an aligned CPU tensor whose storage has room
        for the aligned length and `padded=True` says the bytes after dst up to that length
        are the caller's to overwrite (reads and writes then accept the same padded blocks).
        Otherwise the read goes through an aligned staging buffer."""
        self._check_key(key)
        self._key_writes.wait(key)
        with self._lock:
            self._check_open()
            entry = self._index.get(key)
        if entry is None:
            raise KeyError(f"nvme tier: no shard {key!r} in {self.run_dir}")
        tensor = dst.view() if isinstance(dst, HostBuffer) else dst
        dst_bytes = tensor.numel() * tensor.element_size()
        if dst_bytes != entry.nbytes:
            raise ValueError(f"nvme tier: shard {key!r} holds {entry.nbytes} B ({entry.dtype} "
                             f"{list(entry.shape)}), destination has {dst_bytes} B")
        if tensor.dtype not in (dtype_from_str(entry.dtype), torch.uint8):
            raise ValueError(f"nvme tier: shard {key!r} is {entry.dtype}, destination is {tensor.dtype}")
        buf, staged = read_buffer(dst, tensor, entry.nbytes, entry.file_bytes, self.alignment, padded)
        path = self.run_dir / entry.file
        fd = self._open(entry.file, os.O_RDONLY, key, "open")
        with self._lock:
            self._readers[key] = self._readers.get(key, 0) + 1

        def finish(outcome: int | BaseException) -> int:
            try:
                os.close(fd)
            finally:  # even after a Ctrl-C in os.close: close() and later writes wait on _inflight/_readers
                with self._lock:
                    self._inflight.discard(ticket)
                    self._end_read(key)
            try:
                if isinstance(outcome, BaseException):
                    raise self._io_error("read", key, path, outcome)
                if outcome != entry.file_bytes:
                    raise TierIOError(errno.EIO, self._msg(
                        "read", key, path, outcome,
                        f"short read: got {outcome} of {entry.file_bytes} B",
                        "file truncated? something modified the run directory or the drive "
                        "lost data; the shard cannot be recovered from nvme"))
                if entry.checksum is not None:
                    impl = self._checksum
                    got = impl(buf[: entry.nbytes].numpy())
                    if got != entry.checksum:
                        raise TierIOError(errno.EBADMSG, self._msg(
                            "read", key, path, 0,
                            f"{entry.checksum_algo} checksum mismatch: file has {got:#010x}, "
                            f"written {entry.checksum:#010x}",
                            "the file was corrupted on disk or modified behind zerotier's back"))
            except TierIOError:
                with self._lock:
                    self._errors += 1
                raise
            if staged:
                byte_view(tensor).copy_(buf[: entry.nbytes]) if tensor.is_contiguous() else \
                    tensor.copy_(buf[: entry.nbytes].view(tensor.dtype).view(tensor.shape))
            self.count_out(entry.nbytes)
            return entry.nbytes

        try:
            inner = self.engine.read(fd, buf, 0, path=str(path)) if entry.file_bytes else CompletedTicket(0)
        except BaseException:
            os.close(fd)
            with self._lock:
                self._end_read(key)
            raise
        ticket = ChainTicket(inner, finish)
        with self._lock:
            self._inflight.add(ticket)
        return ticket

    def nbytes(self, key: str) -> int:
        """Logical bytes of shard `key` as last written (waits for a pending write of it)."""
        self._key_writes.wait(key)
        with self._lock:
            entry = self._index.get(key)
        if entry is None:
            raise KeyError(f"nvme tier: no shard {key!r} in {self.run_dir}")
        return entry.nbytes

    def stats(self) -> dict[str, int]:
        """Base figures (current = bytes of all files: shards + recycled) plus store details."""
        out = super().stats()
        with self._lock:
            out.update(files=len(self._index), inflight=len(self._inflight), errors=self._errors,
                       recycled=self._recycled.bytes, recycled_files=self._recycled.files,
                       reuses=self._recycled.reuses)
        return out

    def close(self) -> None:
        """Wait for in-flight I/O, close the engine, remove the run dir. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        interrupt = self._drain()
        self._finalizer.detach()
        try:
            self.engine.close()
        finally:
            interrupt = self._drain() or interrupt  # tickets issued while close() began: finished by the engine
            with self._lock:
                try:
                    self._recycled.trim(self._recycled.bytes)
                except OSError:
                    pass  # e.g. the run dir's permission changed: _run.remove() warns and leaves it
                for e in self._index.values():
                    self.release(e.file_bytes)
                self._index.clear()
            self._run.remove()
        if interrupt is not None:  # a Ctrl-C that landed while draining, raised once everything is closed
            raise interrupt

    def _drain(self) -> BaseException | None:
        """Wait for every ticket in flight. A ticket whose finish() a Ctrl-C interrupted before
        its bookkeeping never took itself off _inflight: finished, it is dropped here, so this
        ends. Returns the first KeyboardInterrupt/SystemExit a wait raised (close() raises it
        after cleaning up)."""
        interrupt = None
        while True:
            with self._lock:
                inflight = list(self._inflight)
            if not inflight:
                return interrupt
            for t in inflight:
                try:
                    quiet_wait(t)
                except BaseException as exc:  # noqa: BLE001 - kept for the caller, after the rest
                    interrupt = interrupt or exc
            with self._lock:
                self._inflight.difference_update(t for t in inflight if t.done())

    def __enter__(self) -> "NVMeStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --------------------------------------------------------------- internals

    # [Note: NVMe file recycling] -------------------------------------------------

    def _recycle_name_for(self, key: str) -> str | None:
        """A fresh recycled-file name, or None if key's file may still be read (lock held)."""
        if self._readers.get(key):
            return None
        self._gen += 1
        return f"{_RECYCLED_PREFIX}{self._gen}{_SUFFIX}"

    def _commit_rename(self, key: str, name: str, final: str, old: NVMeEntry | None) -> OSError | None:
        """Move a completed write (file `name`) onto <key>.swp; the old version's file (if
        any) is kept for reuse, or released. Lock held; readers of key wait for this write
        to commit."""
        kept = self._recycle_name_for(key) if old is not None else None
        try:
            if kept is not None:
                self._rename(final, kept)
            self._rename(name, final)
        except OSError as exc:
            try:  # put the old version back under its name (the directory may refuse even a stat)
                if kept is not None and not lexists_at(final, self._dir_fd):
                    self._rename(kept, final)
            except OSError:
                pass
            return self._io_error("rename", key, self.run_dir / name, exc)
        if old is not None:
            if kept is not None:
                self._recycled.keep(kept, old.file_bytes)
            else:  # the rename above replaced (unlinked) it
                self.release(old.file_bytes)
        return None

    def _reserve_file(self, nbytes: int, what: str) -> None:
        """reserve(), unlinking recycled files first if the budget needs their room."""
        if self.try_reserve(nbytes):
            return
        with self._lock:
            self._recycled.trim(self.used + nbytes - self.budget)
        self.reserve(nbytes, what)  # raises BudgetError with the standard message

    def _end_read(self, key: str) -> None:
        n = self._readers.get(key, 0) - 1
        if n > 0:
            self._readers[key] = n
        else:
            self._readers.pop(key, None)

    def _check_open(self) -> None:
        if self._closed:
            raise ZerotierError(f"nvme tier: store {self.run_dir} is closed")

    @staticmethod
    def _check_key(key: str) -> None:
        if not isinstance(key, str) or not key:
            raise ValueError(f"nvme tier: shard keys are non-empty strings, got {key!r}")

    # [Note: the held run directory]: every file is reached relative to _dir_fd.

    def _open(self, name: str, flags: int, key: str, op: str) -> int:
        try:
            # O_NOFOLLOW | O_CLOEXEC (| O_DIRECT, falling back to buffered with one warning)
            fd, _direct = open_direct(name, flags, 0o600, direct=self.io_cfg.o_direct, dir_fd=self._dir_fd)
        except OSError as exc:
            raise self._io_error(op, key, self.run_dir / name, exc) from None
        return fd

    def _rename(self, src: str, dst: str) -> None:
        os.rename(src, dst, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)

    def _unlink_quiet(self, name: str) -> None:
        """Remove a file no longer needed (a failed write's, a trimmed recycled one). Its failure is
        not the caller's error: in an unwritable run directory the write's own TierIOError must reach
        the user, not a raw PermissionError from this cleanup; close() removes what is left."""
        try:
            os.unlink(name, dir_fd=self._dir_fd)
        except OSError:
            pass

    def _io_error(self, op: str, key: str, path: Path, exc: BaseException) -> BaseException:
        """Re-state a low-level failure with tier, key, file, offset and remedy; keep errno."""
        if not isinstance(exc, OSError):
            return exc
        code = exc.errno
        reason = os.strerror(code) if code else str(exc)
        hint = HINTS.get(code, "check the drive and tiers.nvme_path")
        err = TierIOError(code if code is not None else errno.EIO,
                          self._msg(op, key, path, 0, reason, hint))
        err.__cause__ = exc
        return err

    def _msg(self, op: str, key: str, path: Path, offset: int, what: str, hint: str) -> str:
        hint = hint.format(dir=self.parent)
        return f"nvme tier: {op} of shard {key!r} at offset {offset} of {path} failed: {what}" + \
            (f"; {hint}" if hint else "")


def _finalize_store(run: RunDir, engine) -> None:
    """weakref.finalize hook: the store was dropped without close() (GC or exit)."""
    try:
        engine.close()
    finally:
        run.remove()
