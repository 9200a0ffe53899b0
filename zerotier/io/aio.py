"""aiofiles backend: the pure-Python engine used when the native library is unavailable
(ZEROTIER_NATIVE=0, or no build). Same API and semantics as the native engine.

A private event loop runs in a daemon thread; each request is one coroutine that splits
the buffer into `block_size` chunks and runs `os.preadv`/`os.pwritev` through
`aiofiles.os.wrap` (i.e. on the loop's executor: a pool of `cfg.threads` threads), at most
`cfg.queue_depth` chunks at a time. Callers get a FutureTicket over the
`run_coroutine_threadsafe` future, so `wait()` works from any thread and `await` from any
loop (asyncio.wrap_future).

Buffer lifetime: the request coroutine holds the tensor until all its chunks returned, and
chunks already handed to an executor thread are never abandoned (cancellation only stops
chunks that have not started), so the memory outlives every syscall that touches it.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import errno as errno_mod
import fcntl
import os
import threading

import aiofiles.os
import torch

from ..config import IOConfig
from ..errors import ZerotierError
from .ticket import FutureTicket, IOEngine, Ticket

_pread = aiofiles.os.wrap(os.preadv)
_pwrite = aiofiles.os.wrap(os.pwritev)


def _may_resume_read(fd: int, done: int) -> bool:
    """After a partial read ending at `done`, may we read on? With O_DIRECT an unaligned
    stop can only be EOF (and reading on from there would fail with EINVAL)."""
    if done % 512 == 0:
        return True
    try:
        return not (fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)
    except OSError:
        return True


class AioFilesEngine(IOEngine):
    backend = "aiofiles"

    def __init__(self, cfg: IOConfig):
        super().__init__(cfg)
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(1, cfg.threads), thread_name_prefix="zt-aio")
        self._loop = asyncio.new_event_loop()
        self._loop.set_default_executor(self._executor)  # where aiofiles.os.wrap runs calls
        self._slots = asyncio.Semaphore(max(1, cfg.queue_depth))  # chunks in flight
        self._futures: set[concurrent.futures.Future] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._cancelled = False  # set by close(cancel=True): unstarted chunks fail
        self._thread = threading.Thread(target=self._loop.run_forever, name="zt-aio-loop",
                                        daemon=True)
        self._thread.start()

    def describe(self) -> str:
        return (f"aiofiles threads={self.cfg.threads} qd={self.cfg.queue_depth}"
                + (" (closed)" if self._closed else ""))

    def _submit(self, op: str, fd: int, buf: torch.Tensor, nbytes: int, offset: int,
                path: str) -> Ticket:
        with self._lock:
            if self._closed:
                raise ZerotierError("I/O engine (aiofiles) is closed")
            coro = self._transfer(op, fd, buf, nbytes, offset)
            fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
            self._futures.add(fut)
        fut.add_done_callback(self._futures.discard)
        return FutureTicket(fut, op, fd, nbytes, offset, path, keep=buf)

    async def _transfer(self, op: str, fd: int, buf: torch.Tensor, nbytes: int,
                        offset: int) -> int:
        """One request: all chunks concurrently; bytes valid from the start, or -errno."""
        if nbytes == 0:
            return 0
        # A writable view of the tensor's memory; `buf` (this frame) keeps it alive.
        mem = memoryview((ctypes.c_char * nbytes).from_address(buf.data_ptr())).cast("B")
        bs = self.cfg.block_size
        starts = range(0, nbytes, bs)
        results = await asyncio.gather(
            *(self._chunk(op, fd, mem[s:s + bs], offset + s) for s in starts))
        valid = nbytes
        for s, (done, err) in zip(starts, results):
            if err:
                return -err
            if done < min(bs, nbytes - s):
                valid = min(valid, s + done)
        return valid

    async def _chunk(self, op: str, fd: int, mem: memoryview, offset: int) -> tuple[int, int]:
        """(bytes done, errno or 0) for one chunk, resuming partial transfers."""
        async with self._slots:
            if self._cancelled:
                return 0, errno_mod.ECANCELED
            done, n = 0, len(mem)
            while done < n:
                try:  # EINTR is retried inside os.preadv/pwritev (PEP 475)
                    if op == "read":
                        got = await _pread(fd, [mem[done:]], offset + done)
                    else:
                        got = await _pwrite(fd, [mem[done:]], offset + done)
                except OSError as exc:
                    return done, exc.errno or errno_mod.EIO
                if got == 0:  # read: EOF; write: no progress
                    return done, (0 if op == "read" else errno_mod.EIO)
                done += got
                if op == "read" and done < n and not _may_resume_read(fd, done):
                    break
            return done, 0

    def close(self, cancel: bool = False) -> None:
        """Wait for (or cancel unstarted chunks of) in-flight requests; stop the loop."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if cancel:
                self._cancelled = True
            futs = list(self._futures)
        concurrent.futures.wait(futs)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
        self._executor.shutdown(wait=True)

    def pending(self) -> int:
        return len(self._futures)

    def __del__(self):
        try:
            if not getattr(self, "_closed", True):
                self.close()
        except Exception:
            pass
