"""Pure-Python backend (`io.backend = "aiofiles"`, the name is historical): the engine used
when the native library is unavailable (ZEROTIER_NATIVE=0, or no build). Same API and
semantics as the native engine.

A request is split into `block_size` chunks; each chunk is one task on a
ThreadPoolExecutor of min(`cfg.threads`, `cfg.queue_depth`) workers (so at most that many
chunks are in flight) that runs `os.preadv`/`os.pwritev` until the chunk is done. The last
chunk to finish resolves the request's Future; callers get a FutureTicket over it, so
`wait()` works from any thread.

Buffer lifetime: the request record holds the tensor until all its chunks returned, and a
chunk that started is never abandoned (close(cancel=True) only fails chunks that have not
started), so the memory outlives every syscall that touches it.
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import errno as errno_mod
import fcntl
import os
import threading

import torch

from ..config import IOConfig
from ..errors import ZerotierError
from .ticket import FutureTicket, IOEngine, Ticket


def _may_resume_read(fd: int, done: int) -> bool:
    """After a partial read ending at `done`, may we read on? With O_DIRECT an unaligned
    stop can only be EOF (and reading on from there would fail with EINVAL)."""
    if done % 512 == 0:
        return True
    try:
        return not (fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)
    except OSError:
        return True


class _Request:
    """One request's chunks in flight; resolves `future` (bytes valid from the start, or
    -errno of the first failing chunk) when the last chunk returns."""

    def __init__(self, buf: torch.Tensor, nbytes: int, chunks: int) -> None:
        self.buf = buf  # keeps the memory alive until every chunk has returned
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.valid = nbytes
        self.err = 0
        self.remaining = chunks
        self.lock = threading.Lock()

    def chunk_done(self, start: int, length: int, done: int, err: int) -> None:
        with self.lock:
            if err and not self.err:
                self.err = err
            if not err and done < length:
                self.valid = min(self.valid, start + done)
            self.remaining -= 1
            last = self.remaining == 0
        if last:
            self.buf = None
            self.future.set_result(-self.err if self.err else self.valid)


class AioFilesEngine(IOEngine):
    backend = "aiofiles"

    def __init__(self, cfg: IOConfig):
        super().__init__(cfg)
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(1, min(cfg.threads, cfg.queue_depth)), thread_name_prefix="zt-aio")
        self._futures: set[concurrent.futures.Future] = set()
        self._cancelled = False  # set by close(cancel=True): unstarted chunks fail
        self._closing: list[concurrent.futures.Future] = []  # in flight at close(): waited in _join
        self._closed = False     # open; its worker threads stay with this process (self._pid) across fork()

    def describe(self) -> str:
        return (f"aiofiles (python thread pool) threads={self.cfg.threads} qd={self.cfg.queue_depth}"
                + (" (closed)" if self._closed else ""))

    def _submit(self, op: str, fd: int, buf: torch.Tensor, nbytes: int, offset: int,
                path: str) -> Ticket:
        if os.getpid() != self._pid:  # a forked child: the pool has no threads here, it would hang
            raise ZerotierError(f"this I/O engine (aiofiles) was opened by process {self._pid}; its forked child "
                                f"{os.getpid()} cannot use it (the engine's threads stay with the parent): open a "
                                "new engine in the child (zerotier.io.open_engine) or do the I/O in the parent")
        bs = self.cfg.block_size
        starts = range(0, nbytes, bs)
        req = _Request(buf, nbytes, len(starts))
        fut = req.future
        with self._lock:
            if self._closed:
                raise ZerotierError("I/O engine (aiofiles) is closed")
            self._futures.add(fut)
            if nbytes:
                # A writable view of the tensor's memory; `req.buf` keeps it alive.
                mem = memoryview((ctypes.c_char * nbytes).from_address(buf.data_ptr())).cast("B")
                for s in starts:
                    self._executor.submit(self._chunk, req, op, fd, mem[s:s + bs], s, offset + s)
        fut.add_done_callback(self._discard)  # outside the lock: it may run right here
        if not nbytes:
            fut.set_result(0)
        return FutureTicket(fut, op, fd, nbytes, offset, path, keepalive=buf)

    def _discard(self, fut: concurrent.futures.Future) -> None:
        with self._lock:
            self._futures.discard(fut)

    def _chunk(self, req: _Request, op: str, fd: int, mem: memoryview, start: int,
               offset: int) -> None:
        done, err = 0, 0
        try:
            if self._cancelled:
                err = errno_mod.ECANCELED
                return
            n = len(mem)
            while done < n:
                try:  # EINTR is retried inside os.preadv/pwritev (PEP 475)
                    if op == "read":
                        got = os.preadv(fd, [mem[done:]], offset + done)
                    else:
                        got = os.pwritev(fd, [mem[done:]], offset + done)
                except OSError as exc:
                    err = exc.errno or errno_mod.EIO
                    return
                if got == 0:  # read: EOF; write: no progress
                    err = 0 if op == "read" else errno_mod.EIO
                    return
                done += got
                if op == "read" and done < n and not _may_resume_read(fd, done):
                    return
        finally:
            req.chunk_done(start, len(mem), done, err)

    def _stop(self, cancel: bool) -> None:
        """Mark closed (and cancel unstarted chunks); the chunks in flight finish in _join."""
        self._closed = True
        if cancel:
            self._cancelled = True
        self._closing = list(self._futures)

    def _join(self) -> None:
        concurrent.futures.wait(self._closing)  # outside the lock: a finishing chunk takes it
        self._executor.shutdown(wait=True)

    def pending(self) -> int:
        return len(self._futures)
