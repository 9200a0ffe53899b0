"""The tier protocol: budgeted byte accounting shared by device, host and NVMe tiers,
and the small ticket types the tiers hand back for asynchronous work.

[Note: tier accounting]
Every tier counts *real* bytes it holds against its budget: the host pool counts
aligned blocks (live + cached for reuse), the NVMe store counts file sizes rounded
up to the I/O alignment, the device tier counts the bytes of the tensors it handed
out. `reserve()` is the single place a budget is enforced, so every BudgetError
carries the same facts: tier, requested bytes, free bytes, and what to change.

[Note: tickets]
All asynchronous work (file I/O, H2D/D2H copies, staged moves) returns an object
with `wait(timeout=None) -> int` (bytes transferred; raises on failure), `done()`
and `__await__`. zerotier.io.Ticket is the native one; the helpers below wrap it
(`ChainTicket`: run bookkeeping once when the I/O completes), a future
(`FutureTicket`: work on a worker thread) or nothing (`DoneTicket`). Whatever
memory the work reads or writes is referenced by the ticket until it completes.
"""
from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Protocol, runtime_checkable

from ..errors import BudgetError

from ..config import format_size


TIER_NAMES = ("device", "host", "nvme")


def align_up(nbytes: int, alignment: int) -> int:
    """Round nbytes up to a multiple of alignment (alignment > 0)."""
    return -(-nbytes // alignment) * alignment


# --------------------------------------------------------------------------- tiers

@runtime_checkable
class Tier(Protocol):
    """What the manager, the planner and the profiler may rely on for every tier."""

    name: str

    @property
    def budget(self) -> int: ...
    @property
    def used(self) -> int: ...
    @property
    def peak(self) -> int: ...
    def reserve(self, nbytes: int, what: str = "") -> None: ...
    def release(self, nbytes: int) -> None: ...
    def stats(self) -> dict[str, int]: ...


class BudgetedTier:
    """Thread-safe byte accounting against a fixed budget (see [Note: tier accounting]).

    Subclasses call `reserve()` before they take memory/disk and `release()` after
    they give it back, and `count_in()` / `count_out()` for bytes moved into / out of
    the tier. `hint` is the remedy printed in BudgetError messages.
    """

    def __init__(self, name: str, budget: int, hint: str) -> None:
        if name not in TIER_NAMES:
            raise ValueError(f"tier name must be one of {TIER_NAMES}, got {name!r}")
        if not isinstance(budget, int) or budget < 0:
            raise ValueError(f"{name} tier budget must be a non-negative int of bytes, got {budget!r}")
        self.name = name
        self._budget = budget
        self._hint = hint
        self._acct_lock = threading.Lock()
        self._used = 0
        self._peak = 0
        self._bytes_in = 0
        self._bytes_out = 0
        self._allocations = 0

    @property
    def budget(self) -> int:
        return self._budget

    @property
    def used(self) -> int:
        return self._used

    @property
    def peak(self) -> int:
        return self._peak

    @property
    def free_bytes(self) -> int:
        return max(self._budget - self._used, 0)

    def reserve(self, nbytes: int, what: str = "") -> None:
        """Account nbytes against the budget or raise BudgetError (nothing is reserved then)."""
        if nbytes < 0:
            raise ValueError(f"{self.name} tier: cannot reserve a negative size ({nbytes})")
        with self._acct_lock:
            if self._used + nbytes > self._budget:
                raise BudgetError(self._budget_message(nbytes, what))
            self._used += nbytes
            self._peak = max(self._peak, self._used)
            self._allocations += 1

    def try_reserve(self, nbytes: int) -> bool:
        """reserve() that answers False instead of raising (no message is built)."""
        with self._acct_lock:
            if self._used + nbytes > self._budget:
                return False
            self._used += nbytes
            self._peak = max(self._peak, self._used)
            self._allocations += 1
            return True

    def release(self, nbytes: int) -> None:
        with self._acct_lock:
            if nbytes < 0 or nbytes > self._used:
                raise AssertionError(
                    f"{self.name} tier accounting error: releasing {nbytes} B with {self._used} B in use")
            self._used -= nbytes

    def count_in(self, nbytes: int) -> None:
        with self._acct_lock:
            self._bytes_in += nbytes

    def count_out(self, nbytes: int) -> None:
        with self._acct_lock:
            self._bytes_out += nbytes

    def stats(self) -> dict[str, int]:
        """Plain numbers a profiler can sample: current, peak, budget, bytes_in, bytes_out, allocations."""
        with self._acct_lock:
            return {
                "current": self._used,
                "peak": self._peak,
                "budget": self._budget,
                "bytes_in": self._bytes_in,
                "bytes_out": self._bytes_out,
                "allocations": self._allocations,
            }

    def _budget_message(self, nbytes: int, what: str) -> str:
        subject = f" for {what}" if what else ""
        free = self._budget - self._used
        return (
            f"{self.name} tier budget exceeded: requested {_both(nbytes)}{subject}, "
            f"free {_both(free)} of budget {format_size(self._budget)} "
            f"(in use {format_size(self._used)}). {self._hint}"
        )


def _both(nbytes: int) -> str:
    """'1.50 MiB (1572864 B)': human size plus exact bytes (just '12 B' when small)."""
    human = format_size(nbytes)
    return human if nbytes < 1024 else f"{human} ({nbytes} B)"


# ------------------------------------------------------------------------- tickets

class TicketLike(Protocol):
    def wait(self, timeout: float | None = None) -> int: ...
    def done(self) -> bool: ...


class DoneTicket:
    """A ticket for work that completed synchronously (or needed no work)."""

    def __init__(self, nbytes: int = 0) -> None:
        self._nbytes = nbytes

    def wait(self, timeout: float | None = None) -> int:
        return self._nbytes

    def done(self) -> bool:
        return True

    def __await__(self):
        return self._nbytes
        yield  # pragma: no cover - makes this a generator


class FutureTicket:
    """A ticket backed by a concurrent.futures.Future (work on a worker thread).

    `keepalive` holds whatever the work reads/writes until the ticket is dropped.
    """

    def __init__(self, future: Future, keepalive: Any = None) -> None:
        self._future = future
        self._keepalive = keepalive

    def wait(self, timeout: float | None = None) -> int:
        return self._future.result(timeout)

    def done(self) -> bool:
        return self._future.done()

    def __await__(self):
        return asyncio.wrap_future(self._future).__await__()


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
        if self._error is not None:
            raise self._error
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

    def __await__(self):
        if not self._finished:
            inner_await = getattr(self._inner, "__await__", None)
            if inner_await is not None:
                try:
                    yield from inner_await()
                except Exception:  # noqa: BLE001 - wait() below reports it
                    pass
            else:  # poll a ticket that is not awaitable itself
                while not self._inner.done():
                    yield from asyncio.sleep(0.0005).__await__()
        return self.wait()


_FINISHED = DoneTicket(0)


def wait_all(tickets, timeout: float | None = None) -> list[int]:
    """Wait for every ticket (even after a failure), then raise the first error."""
    deadline = None if timeout is None else time.monotonic() + timeout
    results: list[int] = []
    first: BaseException | None = None
    for t in tickets:
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        try:
            results.append(t.wait(left))
        except Exception as exc:  # noqa: BLE001
            results.append(0)
            first = first or exc
    if first is not None:
        raise first
    return results
