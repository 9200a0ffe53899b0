"""Tickets (handles of asynchronous work) and the IOEngine base class that issues them.

A Ticket is the issue/wait split of one read or write: `engine.read(...)` returns at once;
`ticket.wait()` returns the bytes transferred or raises `TierIOError`. Every backend
implements the two hooks `_poll` and `_block`; the base class caches the first result, so
waiting twice is cheap and every waiter sees the same outcome.

Result convention, shared with the native engine: an int >= 0 is the number of bytes valid
from the start of the buffer (less than requested means a short transfer, e.g. EOF: the
caller decides), an int < 0 is -errno.

[Note: tickets]
This module is the one home of the ticket types; everything asynchronous in zerotier
(file I/O, the NVMe store, host<->device copies) hands back an object with
`wait(timeout=None) -> int` (bytes; raises on failure) and `done()` (`TicketLike`):
  Ticket           one engine request (NativeTicket in native.py)
  CompletedTicket  a result known at creation (no work, an injected fault, a refused submit)
  FutureTicket     work on a worker thread (a concurrent.futures.Future)
  ChainTicket      an inner ticket plus bookkeeping that runs once when it completes
`wait_all` waits for a batch (`wait_each` for any waits). Whatever memory the work reads or
writes is referenced by the ticket until it completes.
"""
from __future__ import annotations

import concurrent.futures
import errno as errno_mod
import functools
import os
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol

import torch

from ..config import IOConfig
from ..errors import TierIOError, ZerotierError

_EINVAL_HINT = (" (O_DIRECT needs the buffer address, file offset and length aligned to the "
                "device's logical block size; use zerotier.io.aligned_empty and aligned offsets)")


class Ticket:
    """Handle of one submitted read/write.

    Attributes: `op` ("read"/"write"), `fd`, `nbytes` (bytes requested), `offset`, `path`
    (for messages; "" if unknown).

    - `done()` never blocks.
    - `wait(timeout=None)` returns bytes transferred (may be < nbytes for a short read),
      raises `TierIOError` (errno set, message naming path, op and offset) on failure and
      the builtin `TimeoutError` if `timeout` seconds pass first.
    - `add_done_callback(fn)` calls `fn(ticket)` once the result is known (in the thread
      that observed it; immediately if already known). Keep callbacks tiny.
    """

    __slots__ = ("op", "fd", "nbytes", "offset", "path", "_result", "_lock", "_cb_lock",
                 "_callbacks", "__weakref__")

    def __init__(self, op: str, fd: int, nbytes: int, offset: int, path: str = ""):
        self.op, self.fd, self.nbytes, self.offset, self.path = op, fd, nbytes, offset, path
        self._result: int | None = None
        self._lock = threading.Lock()      # held while fetching the result from the backend
        self._cb_lock = threading.Lock()   # guards _callbacks vs _set (never held for long)
        self._callbacks: list[Callable[[Ticket], None]] | None = None

    # --- backend hooks ----------------------------------------------------------------
    def _poll(self) -> int | None:
        """The result if the backend has it now, else None. Must not block."""
        raise NotImplementedError

    def _block(self, timeout: float | None) -> int | None:
        """Block up to `timeout` s (None: forever); the result, or None on timeout."""
        raise NotImplementedError

    # --- public API ---------------------------------------------------------------------
    def done(self) -> bool:
        if self._result is not None:
            return True
        if not self._lock.acquire(blocking=False):  # another thread is fetching it
            return False
        try:
            if self._result is None:
                r = self._poll()
                if r is not None:
                    self._set(r)
        finally:
            self._lock.release()
        return self._result is not None

    def wait(self, timeout: float | None = None) -> int:
        if self._result is None:
            deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
            if not self._lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
                raise TimeoutError(self._describe(f"not done after {timeout} s"))
            try:
                if self._result is None:
                    left = None if deadline is None else max(0.0, deadline - time.monotonic())
                    r = self._block(left)
                    if r is None:
                        raise TimeoutError(self._describe(f"not done after {timeout} s"))
                    self._set(r)
            finally:
                self._lock.release()
        return self._check()

    def add_done_callback(self, fn: Callable[["Ticket"], None]) -> None:
        with self._cb_lock:
            if self._result is None:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(fn)
                return
        fn(self)

    # --- internals ----------------------------------------------------------------------
    def _set(self, result: int) -> None:
        with self._cb_lock:
            if self._result is not None:
                return
            self._result = int(result)
            callbacks, self._callbacks = self._callbacks, None
        for fn in callbacks or ():
            try:
                fn(self)
            except Exception as exc:  # a broken callback must not lose the result
                warnings.warn(f"Ticket done-callback {fn!r} raised {exc!r}", RuntimeWarning)

    def _collect(self) -> None:
        """Block until the result is cached, without raising (used by engine.close)."""
        with self._lock:
            if self._result is None:
                self._set(self._block(None))

    def _check(self) -> int:
        r = self._result
        assert r is not None
        if r < 0:
            raise self.error(-r)
        return r

    def error(self, err: int) -> TierIOError:
        """The TierIOError for errno `err` on this ticket's request."""
        # OSError appends ": '<path>'" itself (filename), so the text leaves it out.
        msg = (f"{os.strerror(err)} during {self.op} of {self.nbytes} bytes "
               f"at offset {self.offset} (fd {self.fd})")
        if err == errno_mod.EINVAL:
            msg += _EINVAL_HINT
        return TierIOError(err, msg, self.path or None)

    def _describe(self, extra: str = "") -> str:
        where = f" of {self.path!r}" if self.path else ""
        s = f"{self.op} of {self.nbytes} bytes at offset {self.offset}{where} (fd {self.fd})"
        return f"{s}: {extra}" if extra else s

    def __repr__(self) -> str:
        state = "pending" if self._result is None else f"result={self._result}"
        return f"<{type(self).__name__} {self._describe()} {state}>"


class CompletedTicket(Ticket):
    """A ticket whose result is known at creation: `CompletedTicket(nbytes)` for work that
    finished synchronously or needed none, `CompletedTicket(-errno, op, fd, ...)` for an
    injected fault or a refused submit."""

    __slots__ = ()

    def __init__(self, result: int, op: str = "task", fd: int = -1, nbytes: int = 0,
                 offset: int = 0, path: str = ""):
        super().__init__(op, fd, nbytes, offset, path)
        self._result = int(result)

    def _poll(self) -> int | None:
        return self._result

    def _block(self, timeout: float | None) -> int | None:
        return self._result


class FutureTicket(Ticket):
    """A ticket backed by a concurrent.futures.Future (work on a worker thread).

    The future resolves to bytes or -errno (raised as TierIOError by wait()); if it raises
    instead, wait() re-raises that exception. `keepalive` holds whatever the work reads or
    writes (the I/O buffer, both sides of a copy) at least as long as the ticket.
    """

    __slots__ = ("_fut", "_keep", "_exc")

    def __init__(self, fut: concurrent.futures.Future, op: str = "task", fd: int = -1,
                 nbytes: int = 0, offset: int = 0, path: str = "", keepalive: object = None):
        super().__init__(op, fd, nbytes, offset, path)
        self._fut = fut
        self._keep = keepalive
        self._exc: BaseException | None = None
        fut.add_done_callback(lambda _f: self.done())  # run done-callbacks promptly

    def _from_future(self) -> int:
        try:
            return int(self._fut.result())
        except concurrent.futures.CancelledError:
            return -errno_mod.ECANCELED
        except Exception as exc:  # noqa: BLE001 - re-raised by wait() (see _check)
            self._exc = exc
            return -errno_mod.EIO

    def _poll(self) -> int | None:
        return self._from_future() if self._fut.done() else None

    def _block(self, timeout: float | None) -> int | None:
        try:
            self._fut.result(timeout)
        except (concurrent.futures.TimeoutError, TimeoutError):
            return None
        except concurrent.futures.CancelledError:
            pass
        except Exception:  # noqa: BLE001 - the work failed: _from_future keeps the error
            pass
        return self._from_future()

    def _check(self) -> int:
        if self._exc is not None:
            raise self._exc
        return super()._check()


class TicketLike(Protocol):
    """What every ticket offers (see [Note: tickets])."""

    def wait(self, timeout: float | None = None) -> int: ...
    def done(self) -> bool: ...


class ChainTicket:
    """Wraps an inner ticket and runs `finish(result)` exactly once when it completes.

    `finish` receives the inner result (an int) or the exception the inner ticket
    raised, and returns the final byte count or raises the final error. Its outcome
    is cached: every later wait() returns the same count or re-raises the same
    error. A timeout of the inner wait propagates without finishing anything.
    """

    def __init__(self, inner: TicketLike, finish: Callable[[int | BaseException], int]) -> None:
        self._inner = inner
        self._finish = finish
        self._lock = threading.Lock()
        self._finished = False
        self._result: int = 0
        self._error: BaseException | None = None

    def _complete(self, outcome: int | BaseException) -> int:
        with self._lock:
            if not self._finished:
                try:
                    self._result = self._finish(outcome)
                except BaseException as exc:  # noqa: BLE001 - cached and re-raised below
                    self._error = exc
                self._finished = True
                self._finish = None  # type: ignore[assignment]  # drop buffers it captured
                self._inner = _FINISHED  # type: ignore[assignment]
        error = self._error
        if error is not None:
            if not isinstance(error, Exception):
                # A Ctrl-C (or SystemExit) that landed inside finish() is delivered once, to this
                # waiter; later waits (close() draining, hostile trial #30) see an ordinary error.
                self._error = ZerotierError(f"I/O completion interrupted by {type(error).__name__}: "
                                            "this transfer's bookkeeping did not finish")
            raise error
        return self._result

    def wait(self, timeout: float | None = None) -> int:
        if self._finished:
            return self._complete(0)
        try:
            outcome: int | BaseException = self._inner.wait(timeout)
        except TimeoutError:
            raise
        except Exception as exc:  # noqa: BLE001 - handed to finish()
            outcome = exc
        return self._complete(outcome)

    def done(self) -> bool:
        if self._finished:
            return True
        if not self._inner.done():
            return False
        try:  # run the bookkeeping now; errors stay cached for wait()
            self.wait(0)
        except Exception:  # noqa: BLE001
            pass
        return True


_FINISHED = CompletedTicket(0)


def wait_each(waits: Iterable[Callable[[], Any]]) -> list:
    """[Note: wait for all, raise the first] Call every wait in order, even after one raised (or
    a Ctrl-C: the work behind the rest still writes into buffers the caller is about to drop, or
    holds state another thread must get back), then raise the first error. Returns the results in
    order when none raised. A wait is any callable that blocks until its work is done:
    `ticket.wait`, `future.result`, a pipeline's `finish`, a bound method that waits and records."""
    results: list = []
    first: BaseException | None = None
    for wait in waits:
        try:
            results.append(wait())
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after the rest landed
            first = first or exc
    if first is not None:
        raise first
    return results


def wait_all(tickets: Iterable[Any], timeout: float | None = None) -> list:
    """wait_each of the tickets' wait() ([Note: wait for all, raise the first]): works for anything
    with `wait()`; with a timeout, each wait gets what is left of it. Returns the wait() results
    in order."""
    if timeout is None:
        return wait_each(t.wait for t in tickets)
    deadline = time.monotonic() + timeout
    return wait_each(functools.partial(_wait_until, t, deadline) for t in tickets)


def _wait_until(ticket: Any, deadline: float) -> Any:
    return ticket.wait(max(deadline - time.monotonic(), 0.0))


@dataclass
class _Fault:
    op: str          # "read", "write" or "any"
    errno: int
    short: bool
    count: int


def _buffer_nbytes(buf: torch.Tensor) -> int:
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"I/O buffer must be a torch.Tensor, got {type(buf).__name__}")
    if buf.device.type != "cpu":
        raise ValueError(f"I/O buffer must be a CPU tensor, got device {buf.device}")
    if not buf.is_contiguous():
        raise ValueError("I/O buffer must be contiguous")
    return buf.numel() * buf.element_size()


class IOEngine:
    """Positioned reads/writes of CPU tensors on caller-opened file descriptors.

    Use `zerotier.io.open_engine(cfg)` to get one. `backend` names the implementation
    ("io_uring", "threads", "aiofiles"). Requests larger than `cfg.block_size` are split
    into chunks of that size, at most `cfg.queue_depth` in flight; a Ticket completes when
    all its chunks do. The engine keeps the tensor alive until the request completes.
    `close()` waits for in-flight requests (`close(cancel=True)` cancels those chunks not
    yet issued, whose tickets then fail with ECANCELED); it is idempotent, and the engine
    is a context manager.

    Fault injection (for tests of the layers above; works on every backend):
    `engine.inject_fault(op="read", errno=errno.EIO, count=1, short=False)` makes the next
    `count` matching operations (op "read", "write" or "any") fail with `errno` without
    touching the file, or, with `short=True`, transfer only the first half of the buffer
    (rounded down to `cfg.alignment`) and report that byte count, as a short read/write
    would. Faults queue in FIFO order; `clear_faults()` drops the remaining ones.
    """

    backend: str = "?"

    def __init__(self, cfg: IOConfig):
        self.cfg = cfg
        self._faults: list[_Fault] = []
        self._fault_lock = threading.Lock()
        self._pid = os.getpid()        # the process that owns it ([Note: engines after fork] in native.py)
        self._lock = threading.Lock()  # _closed; submission vs close
        self._closed = True            # until the backend is open: its __init__ sets False last

    # --- public API ---------------------------------------------------------------------
    def read(self, fd: int, buf: torch.Tensor, offset: int, path: str = "") -> Ticket:
        """Read buf.nbytes bytes at file `offset` into the contiguous CPU tensor `buf`."""
        return self._issue("read", fd, buf, offset, path)

    def write(self, fd: int, buf: torch.Tensor, offset: int, path: str = "") -> Ticket:
        """Write the bytes of the contiguous CPU tensor `buf` at file `offset`."""
        return self._issue("write", fd, buf, offset, path)

    def inject_fault(self, op: str = "read", errno: int = errno_mod.EIO, count: int = 1,
                     short: bool = False) -> None:
        """Make the next `count` `op` operations fail with `errno` (or go short). See class doc."""
        if op not in ("read", "write", "any"):
            raise ValueError(f"op must be 'read', 'write' or 'any', got {op!r}")
        if count < 1:
            raise ValueError("count must be >= 1")
        if not short and errno <= 0:
            raise ValueError("errno must be a positive errno value")
        with self._fault_lock:
            self._faults.append(_Fault(op, int(errno), bool(short), int(count)))

    def clear_faults(self) -> None:
        with self._fault_lock:
            self._faults.clear()

    def close(self, cancel: bool = False) -> None:
        """Finish (or with cancel=True, cancel not-yet-issued chunks of) all in-flight requests,
        record their results in their Tickets, stop the engine. Idempotent. In a forked child it
        only forgets the engine: the parent still owns it ([Note: engines after fork] in native.py)."""
        if os.getpid() != self._pid:  # before the lock: a parent thread may have held it
            self._closed = True
            return
        with self._lock:
            if self._closed:
                return
            self._stop(cancel)
        self._join()

    def describe(self) -> str:
        return self.backend

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.describe()}>"

    def __del__(self):
        try:
            if not getattr(self, "_closed", True):
                self.close()
        except Exception:  # interpreter shutdown: nothing sensible left to do
            pass

    # --- backend hooks ------------------------------------------------------------------
    def _stop(self, cancel: bool) -> None:
        """Under the engine's lock, once: cancel (if asked) or collect the requests in flight, set
        _closed, release the backend."""
        raise NotImplementedError

    def _join(self) -> None:
        """After _stop, outside the lock: wait for what finishes only without it (worker threads)."""

    def _submit(self, op: str, fd: int, buf: torch.Tensor, nbytes: int, offset: int,
                path: str) -> Ticket:
        """Start transferring the first `nbytes` bytes of `buf`; never blocks on I/O."""
        raise NotImplementedError

    # --- internals ----------------------------------------------------------------------
    def _issue(self, op: str, fd: int, buf: torch.Tensor, offset: int, path: str) -> Ticket:
        nbytes = _buffer_nbytes(buf)
        offset, fd = int(offset), int(fd)
        if offset < 0:
            raise ValueError(f"file offset must be >= 0, got {offset}")
        fault = self._take_fault(op)
        if fault is not None:
            if not fault.short:
                return self._failed_ticket(fault.errno, op, fd, nbytes, offset, path)
            align = max(1, self.cfg.alignment)
            nbytes = (nbytes // 2) // align * align
        return self._submit(op, fd, buf, nbytes, offset, path)

    def _take_fault(self, op: str) -> _Fault | None:
        if not self._faults:
            return None
        with self._fault_lock:
            for f in self._faults:
                if f.op in (op, "any"):
                    f.count -= 1
                    if f.count == 0:
                        self._faults.remove(f)
                    return f
        return None

    @staticmethod
    def _failed_ticket(err: int, op: str, fd: int, nbytes: int, offset: int,
                       path: str) -> Ticket:
        return CompletedTicket(-err, op, fd, nbytes, offset, path)
