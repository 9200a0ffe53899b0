"""The NVMe store's swap files: their names, blocks, reuse and index entries, the buffers their
direct I/O reads and fills, and one write per key at a time (see [Note: NVMe layout] in nvme.py).

[Note: NVMe file recycling]
Writing into a file's already-allocated blocks is much faster than writing a fresh
file (measured on the dev VM's virtio disk, O_DIRECT 64 MiB: ~5.5 GB/s overwrite vs
~1.4-2.2 GB/s fresh, because the filesystem must allocate and convert extents).
Training rewrites the same shard sizes every step, so a freed file is not unlinked but
renamed to `%free-<n>.swp` and reused by the next write of exactly the same file size
(renamed onto `<key>.swp` when that write completes). Recycled files keep counting
against tiers.nvme (they hold disk space); when a write needs their room they are
unlinked first, and `close()` unlinks them all. A file with a read in flight
is never recycled (it is unlinked instead), so no read can see a later write.

[Note: new swap files are preallocated]
A new swap file gets its blocks from fallocate(2) before its write is submitted. An O_DIRECT
write past the end of a file cannot be issued without blocking on ext4 (the filesystem must
allocate blocks and move i_size under the inode's exclusive lock), so io_uring hands it to
its io-wq workers, which run the writes of one file one after another (they are hashed by
inode): a new file went out one io.block_size request at a time, not io.queue_depth deep
(seen on the dev VM's ext4: an 8 MiB write of a new file ran on an iou-wrk worker thread; of
a preallocated or an old file, on none). Preallocated (unwritten extents, i_size set:
metadata only), each request writes inside the file and is issued at once. fallocate(2), not posix_fallocate(3): where a filesystem cannot
preallocate, glibc's fallback would write every block; the write then extends the file as
before. A disk too full for the file fails here, before any data is written.
"""
from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import crc32c
import torch

from ..errors import ConfigError
from ..io import aligned_empty
from .host import HostBuffer


def checksum_impl(name: str) -> Callable[[memoryview], int] | None:
    """The function for io.checksum: None for "none", else the `crc32c` package's hardware
    CRC32C (a hard dependency; it releases the GIL)."""
    if name == "none":
        return None
    if name != "crc32c":
        raise ConfigError(f"io.checksum: unknown algorithm {name!r} (use 'none' or 'crc32c')")
    return crc32c.crc32c


def _libc_fallocate():
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "fallocate64", None) or getattr(libc, "fallocate", None)
    if fn is not None:
        fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    return fn


_FALLOCATE = _libc_fallocate()


def preallocate(fd: int, nbytes: int) -> None:
    """Give a new file its blocks ([Note: new swap files are preallocated]); a filesystem
    that cannot is left to extend the file as it is written. Raises OSError (ENOSPC, EIO)."""
    if _FALLOCATE is None or _FALLOCATE(fd, 0, 0, nbytes) == 0:
        return
    err = ctypes.get_errno()
    if err not in (errno.EOPNOTSUPP, errno.ENOSYS):
        raise OSError(err, os.strerror(err))


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """Flat uint8 view of a contiguous tensor (no copy)."""
    return t.reshape(-1).view(torch.uint8)


def storage_room(t: torch.Tensor) -> int:
    """Bytes addressable from t.data_ptr() to the end of its storage."""
    return t.untyped_storage().nbytes() - t.storage_offset() * t.element_size()


def write_buffer(src, tensor: torch.Tensor, nbytes: int, file_bytes: int, alignment: int) -> torch.Tensor:
    """An aligned uint8 CPU tensor of file_bytes whose first nbytes are src's bytes: src's own memory
    where it allows (a pool block, an aligned tensor with room), else a staging copy."""
    if isinstance(src, HostBuffer) and src.capacity >= file_bytes and src.block.data_ptr() % alignment == 0:
        return src.block[:file_bytes]
    if (tensor.device.type == "cpu" and tensor.is_contiguous()
            and tensor.data_ptr() % alignment == 0 and storage_room(tensor) >= file_bytes):
        # Zero copy: the padding tail is whatever follows in src's own storage.
        return torch.empty(0, dtype=torch.uint8).set_(
            tensor.untyped_storage(), tensor.storage_offset() * tensor.element_size(), (file_bytes,))
    staging = aligned_empty(file_bytes, alignment)
    staging[:nbytes].copy_(byte_view(tensor.contiguous()) if tensor.device.type == "cpu"
                           else byte_view(tensor.detach().contiguous().cpu()))
    staging[nbytes:].zero_()
    return staging


def read_buffer(dst, tensor: torch.Tensor, nbytes: int, file_bytes: int, alignment: int,
                padded: bool) -> tuple[torch.Tensor, bool]:
    """Where a read of file_bytes lands, and whether it is a staging buffer to copy out of: dst's own
    memory only when the aligned length fits in memory dst owns (`padded`: the bytes after dst up to
    file_bytes are the caller's to overwrite)."""
    if isinstance(dst, HostBuffer) and dst.capacity >= file_bytes and dst.block.data_ptr() % alignment == 0:
        return dst.block[:file_bytes], False
    if (tensor.device.type == "cpu" and tensor.is_contiguous() and tensor.data_ptr() % alignment == 0
            and (nbytes == file_bytes or padded and storage_room(tensor) >= file_bytes)):
        return torch.empty(0, dtype=torch.uint8).set_(
            tensor.untyped_storage(), tensor.storage_offset() * tensor.element_size(), (file_bytes,)), False
    return aligned_empty(file_bytes, alignment), True


def file_stem(key: str) -> str:
    """Filesystem-safe, injective name for a key ('%XX' escapes; long keys hashed)."""
    safe = "".join(chr(b) if chr(b).isascii() and (chr(b).isalnum() or chr(b) in "._-") else f"%{b:02X}"
                   for b in key.encode())
    if len(safe) > 180:
        safe = f"{safe[:120]}~{hashlib.sha256(key.encode()).hexdigest()[:32]}"
    return safe


HINTS = {
    errno.ENOSPC: "free space on {dir} or lower tiers.nvme",
    errno.EDQUOT: "disk quota exceeded: free space on {dir} or lower tiers.nvme",
    errno.EIO: "the drive reported an I/O error: check it (dmesg, smartctl) or move tiers.nvme_path "
               "to a healthy disk",
    errno.EROFS: "{dir} is not writable (read-only filesystem): fix tiers.nvme_path",
    errno.EACCES: "{dir} is not writable: fix its permissions or tiers.nvme_path",
    errno.EPERM: "{dir} is not writable: fix its permissions or tiers.nvme_path",
    errno.ENOENT: "the swap file vanished: something removed files from the run directory",
}


class FileRecycler:
    """Freed swap files kept for the next write of the same file size ([Note: NVMe file
    recycling]). Not thread-safe: the store calls it under its lock. `unlink(name)` removes a file
    quietly; `release(nbytes)` gives its room back to the tier's budget."""

    def __init__(self, unlink: Callable[[str], None], release: Callable[[int], None]) -> None:
        self._unlink, self._release = unlink, release
        self._by_size: dict[int, list[str]] = {}  # file size -> names of freed files
        self.bytes = 0                             # their sizes, still counted against tiers.nvme
        self.reuses = 0

    @property
    def files(self) -> int:
        return sum(len(names) for names in self._by_size.values())

    def keep(self, name: str, file_bytes: int) -> None:
        """A freed file (already renamed to `name`) waits for reuse."""
        self._by_size.setdefault(file_bytes, []).append(name)
        self.bytes += file_bytes

    def take(self, file_bytes: int) -> str | None:
        """A kept file of exactly this size, its room still counted; None if there is none."""
        names = self._by_size.get(file_bytes)
        if not names:
            return None
        name = names.pop()
        if not names:
            del self._by_size[file_bytes]
        self.bytes -= file_bytes
        self.reuses += 1
        return name

    def trim(self, want: int) -> int:
        """Unlink kept files, largest first, until `want` bytes are released; returns the bytes."""
        released = 0
        for size in sorted(self._by_size, reverse=True):
            names = self._by_size[size]
            while names and released < want:
                self._unlink(names.pop())
                self.bytes -= size
                self._release(size)
                released += size
            if not names:
                del self._by_size[size]
        return released


@dataclass(frozen=True)
class NVMeEntry:
    """What the store's index remembers about one committed shard file."""

    key: str
    file: str            # file name inside the run dir
    dtype: str           # e.g. "torch.bfloat16"
    shape: tuple
    nbytes: int          # logical bytes
    file_bytes: int      # nbytes rounded up to io.alignment: what the file holds and the budget counts
    checksum: int | None
    checksum_algo: str


def dtype_from_str(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def quiet_wait(ticket) -> None:
    """Wait for a ticket whose failure is reported to its own caller, not to us."""
    try:
        ticket.wait()
    except Exception:  # noqa: BLE001
        pass


_CLAIM = object()  # placeholder in KeyWrites while a write is being issued


class KeyWrites:
    """One write per key in flight, committed in the order they were asked for; a read of a key
    waits for its write. Uses the store's condition (whose lock guards the store's index too) and
    `check_open()`, which raises once the store is closed."""

    def __init__(self, cond, check_open: Callable[[], None]) -> None:
        self._cond, self._check_open = cond, check_open
        self._pending: dict[str, object] = {}  # key -> its write's ticket (or _CLAIM while being issued)

    def claim(self, key: str) -> None:
        """Mark key as being written; first wait for a write of it already in flight."""
        while True:
            with self._cond:
                self._check_open()
                prev = self._pending.get(key)
                if prev is None:
                    self._pending[key] = _CLAIM
                    return
                if prev is _CLAIM:
                    self._cond.wait()
                    continue
            quiet_wait(prev)  # its finish() removes it
            with self._cond:  # unless a Ctrl-C interrupted that finish() before it could
                if self._pending.get(key) is prev and prev.done():
                    del self._pending[key]

    def issued(self, key: str, ticket) -> None:
        """The claimed write of key has its ticket (the condition held)."""
        if self._pending.get(key) is _CLAIM:  # (finish may have run already)
            self._pending[key] = ticket
        self._cond.notify_all()

    def unclaim(self, key: str, ticket) -> None:
        with self._cond:
            if self._pending.get(key) in (_CLAIM, ticket):
                del self._pending[key]
            self._cond.notify_all()

    def wait(self, key: str) -> None:
        """Wait for the write of key in flight, if any (its error belongs to its caller)."""
        with self._cond:
            while self._pending.get(key) is _CLAIM:
                self._cond.wait()
            prev = self._pending.get(key)
        if prev is not None:
            quiet_wait(prev)


class Write:
    """A write in flight: its file, what the index will hold, the buffer the engine reads, the
    checksum taken beside it ([Note: the checksum beside the write] in nvme.py) and the component its
    file is charged to ([Note: peaks per component] in base.py; None without the check)."""

    def __init__(self, key: str, fd: int, name: str, path: Path, entry: "NVMeEntry", buf: torch.Tensor, inner,
                 component: str | None):
        self.key, self.fd, self.name, self.entry, self.buf, self.inner = key, fd, name, entry, buf, inner
        self.path = path
        self.summed, self.sums = threading.Event(), []
        self.ticket = None  # its ChainTicket, once issued
        self.component = component
