"""The lagging device: a CPU device tier whose copies complete late, as a GPU's do. A test
instrument, never a GPU result; `make_device_tier` picks it where the environment asks.

[Note: the lagging device]
A test instrument for the CPU suite (issue 22 item 3b), never a GPU result. On the CPU a
copy runs when it is called, so code that forgets to wait for a copy still reads the
right bytes there and only breaks on a GPU, where the copy engine runs far behind the
host. With `ZEROTIER_LAGGING_DEVICE=1` in the environment (tests/conftest.py sets it for
the whole suite, and spawned ranks inherit it; `=0` turns it off), a CPU DeviceTier
copies the way a lagging GPU does:
  - each copy completes late, `ZEROTIER_LAGGING_DEVICE_MS` (default 20) ms after it was
    issued, on the tier's own worker thread (`zerotier-lagging-copy`), not on the caller;
    until then its ticket's done() is False, so `host_pool.free(block, after=ticket)`
    keeps the block parked;
  - its destination is poisoned (NaN, or 0xA5 bytes for integers) from issue until the
    data lands: reading it before `join(ticket)` / `ticket.wait()` sees NaN;
  - `join(ticket)` lands the data (compute may read the destination) but the copy's
    event stays pending, as `stream.wait_event` leaves the host free on a GPU;
    `ticket.wait()` completes it now (the host blocked until the copy ran);
  - its source is compared with a snapshot taken at issue. Written before the data
    landed: the copy read undefined bytes, so the destination stays NaN (whoever uses
    it fails; a prefetch dropped unused is harmless). Written after compute joined the
    copy, before its event (a block freed without `after=` and handed to the next read,
    GPU review N5): a violation. The ticket's wait() raises, every later copy, join or
    close() of the tier raises, and the failure is listed in `lagging_violations`, which
    the suite's fixture checks after every test.
The issue's "poison the source after completion" is done as this check instead: a
source such as a unit's host home is legitimately read by every fetch of the unit, so
poisoning it would break correct code, while the snapshot catches every write into
the source between issue and completion, whether or not anyone reads it afterwards.
Where the CPU path copies synchronously instead of through the tier (gradients, a
host-resident optimizer reading them in place), the GPU path's syncs have no ticket to
carry them; so the copies compute has joined also complete when a copy ordered after
compute is issued (every copy waits for the current stream or a mark), at a synchronous
CPU copy (`count_in`/`count_out`) and when a copy's destination is released
(`free_storage`, `free`: compute is done with it).
Cost per copy: a snapshot, a fill, the copy and two byte compares, all memcpy-speed.
"""
from __future__ import annotations

import collections
import os
import threading
import time

import torch

from ..errors import ZerotierError
from .device import DeviceTier

# [Note: the lagging device]: every violation seen in this process, for the test suite's check.
lagging_violations: list[str] = []
_LAG_DEFAULT_MS = 20.0


def _lag_from_env() -> float | None:
    """Seconds each CPU copy lags ([Note: the lagging device]); None when the instrument is off."""
    if os.environ.get("ZEROTIER_LAGGING_DEVICE", "0").strip() in ("", "0"):
        return None
    return float(os.environ.get("ZEROTIER_LAGGING_DEVICE_MS", _LAG_DEFAULT_MS)) / 1e3


def _poison(t: torch.Tensor) -> None:
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.is_contiguous() and t.numel():
        t.view(-1).view(torch.uint8).fill_(0xA5)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _holds(t: torch.Tensor, ptr: int) -> bool:
    """t still views the memory it had at issue: not released by a storage resize ([Note: freeing by
    storage resize]; on a GPU record_stream keeps that memory for the copy, and refilled storage is
    other memory), so writing or reading it now is the copy's business."""
    if t.data_ptr() != ptr:
        return False
    extent = sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1 if t.numel() else 0
    return t.untyped_storage().nbytes() >= (t.storage_offset() + extent) * t.element_size()


class LateTicket:
    """A copy on the lagging CPU device ([Note: the lagging device]): done() only once the tier's
    worker completed it, `lag` after issue; wait() completes it now; land() (join) gives the
    destination its bytes without completing it.

    Where the copy reads a source written since issue, the bytes it delivers are undefined: the
    destination gets NaN instead of data (whoever uses it fails; a dropped prefetch is harmless).
    A source written after the destination landed, before the event, is the N5 defect (compute
    read good bytes here, undefined ones on a GPU): a violation."""

    def __init__(self, tier: "LaggingDeviceTier", dst: torch.Tensor, src: torch.Tensor, nbytes: int, inbound: bool):
        self._tier = tier
        self._nbytes = nbytes
        self._what = f"{'h2d' if inbound else 'd2h'} copy of {src.dtype} {list(src.shape)}"
        self._dst, self._src = dst, src
        self._dst_ptr, self._src_ptr = dst.data_ptr(), src.data_ptr()
        self._snapshot = src.detach().clone()  # what the copy engine reads
        _poison(dst)  # until the data lands
        self.deadline = time.monotonic() + tier.lag_s
        self._lock = threading.Lock()
        self._landed = False  # the destination holds what the copy delivers (good bytes or NaN)
        self._good = True     # the source was intact when the copy delivered
        self._done = False
        self._error: str | None = None

    def _source_intact(self) -> bool:
        return not _holds(self._src, self._src_ptr) or _same_bytes(self._src, self._snapshot)

    def land(self) -> None:
        """Compute waits for the copy: the destination holds its bytes from here on."""
        with self._lock:
            self._land_locked()

    def _land_locked(self) -> None:
        if self._landed or self._done:
            return
        self._landed = True
        self._good = self._source_intact()
        if self._good and _holds(self._dst, self._dst_ptr):
            self._dst.copy_(self._snapshot)  # else it stays poisoned: the copy read undefined bytes

    def complete(self) -> None:
        """The copy's event: deliver if not yet, check the source was left alone, release both sides."""
        with self._lock:
            if self._done:
                return
            landed_before = self._landed
            self._land_locked()
            if landed_before and self._good and not self._source_intact():
                self._error = (f"lagging device: the source of a {self._what} ({self._nbytes} B) was written "
                               f"after compute joined the copy but before its event: reused before its ticket "
                               f"was done (free(block, after=ticket), ticket.wait()); on a GPU the copy may "
                               f"read the new bytes (GPU review N5)")
                if _holds(self._dst, self._dst_ptr):
                    _poison(self._dst)
            self._dst = self._src = self._snapshot = None
            self._done = True
        if self._error is not None:
            self._tier._lag_violation(self._error)

    def done(self) -> bool:
        return self._done

    def writes(self, storage_ptr: int) -> bool:
        dst = self._dst
        return dst is not None and dst.untyped_storage().data_ptr() == storage_ptr

    def wait(self, timeout: float | None = None) -> int:
        self.complete()
        if self._error is not None:
            raise ZerotierError(self._error)
        return self._nbytes


class LaggingDeviceTier(DeviceTier):
    """A CPU DeviceTier that copies the way a lagging GPU does ([Note: the lagging device])."""

    lagging = True

    def __init__(self, budget: int, device: torch.device | str = "cpu", timing: bool = False,
                 lag_s: float | None = None) -> None:
        super().__init__(budget, device, timing)
        if self.is_cuda:
            raise ZerotierError("the lagging device is a CPU test instrument: a CUDA device lags by itself")
        self.lag_s = lag_s if lag_s is not None else (_lag_from_env() or _LAG_DEFAULT_MS / 1e3)
        self._lag_queue: collections.deque[LateTicket] = collections.deque()
        self._lag_cv = threading.Condition()
        self._lag_worker: threading.Thread | None = None
        self._lag_errors: list[str] = []
        self._joined: list[LateTicket] = []  # joined by compute, event still pending

    @property
    def shares_host_memory(self) -> bool:
        return False  # it copies to the device as a GPU would

    def free(self, t: torch.Tensor) -> None:
        if t.numel():
            self._released(t)
        super().free(t)

    def free_storage(self, flat: torch.Tensor) -> None:
        self._released(flat)
        super().free_storage(flat)

    def mark(self):
        return self._compute_position()

    def join(self, ticket) -> None:
        """The bytes land and the copy's event stays pending, as `stream.wait_event` leaves the host free."""
        if not isinstance(ticket, LateTicket):
            super().join(ticket)
            return
        self._raise_lag_errors()
        ticket.land()
        with self._lag_cv:
            self._joined = [t for t in self._joined if not t.done()] + [ticket]

    def count_in(self, nbytes: int) -> None:
        """Count a transfer into the device; on the CPU callers use it for the copy they did
        synchronously (host memory is the device's), which on a GPU is a copy ordered after compute:
        on the lagging device the copies compute had joined complete here."""
        super().count_in(nbytes)
        for earlier in self._compute_position():
            earlier.complete()

    def count_out(self, nbytes: int) -> None:
        """As count_in, device to host."""
        super().count_out(nbytes)
        for earlier in self._compute_position():
            earlier.complete()

    def _released(self, t: torch.Tensor) -> None:
        """Compute is done with `t`: the copies into it complete ([Note: the lagging device])."""
        storage = t.untyped_storage().data_ptr()
        with self._lag_cv:
            into = [ticket for ticket in self._lag_queue if ticket.writes(storage)]
        for ticket in into:
            ticket.complete()

    def _compute_position(self) -> tuple:
        """What compute has joined so far: a copy ordered after compute (every copy waits for the
        current stream, or for a mark) completes only after those ([Note: the lagging device])."""
        with self._lag_cv:
            self._joined = [t for t in self._joined if not t.done()]
            return tuple(self._joined)

    def _cpu_copy(self, dst: torch.Tensor, src: torch.Tensor, nbytes: int, inbound: bool,
                  after) -> LateTicket:
        self._raise_lag_errors()
        # ordered after compute (the current stream, or the mark taken on the compute thread), so
        # after the copies compute had joined by then: their events are reached first
        for earlier in (after if after is not None else self._compute_position()):
            earlier.complete()
        ticket = LateTicket(self, dst, src, nbytes, inbound)
        with self._lag_cv:
            self._lag_queue.append(ticket)
            if self._lag_worker is None:
                self._lag_worker = threading.Thread(target=self._lag_loop, name="zerotier-lagging-copy",
                                                    daemon=True)
                self._lag_worker.start()
            self._lag_cv.notify()
        return ticket

    def _lag_loop(self) -> None:
        """Complete each copy at its deadline, in issue order (deadlines are too); exit when idle."""
        while True:
            with self._lag_cv:
                while not self._lag_queue:
                    if not self._lag_cv.wait(timeout=1.0) and not self._lag_queue:
                        self._lag_worker = None
                        return
                ticket = self._lag_queue[0]
            delay = ticket.deadline - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            try:
                ticket.complete()
            except BaseException as exc:  # noqa: BLE001 - the instrument must not die silently
                self._lag_violation(f"lagging device: completing a copy failed: {exc!r}")
            with self._lag_cv:
                self._lag_queue.popleft()

    def _lag_violation(self, message: str) -> None:
        with self._lag_cv:
            self._lag_errors.append(message)
        lagging_violations.append(message)

    def _raise_lag_errors(self) -> None:
        """A violation stays: every later copy, join and close of this tier raises it."""
        if self._lag_errors:
            raise ZerotierError(self._lag_errors[0])

    def close(self) -> None:
        """Every copy completes (and is checked) before the tier goes."""
        with self._lag_cv:
            pending = list(self._lag_queue)
        for ticket in pending:
            ticket.complete()
        self._raise_lag_errors()


def make_device_tier(budget: int, device: torch.device | str | None = None, timing: bool = False) -> DeviceTier:
    """The device tier for `device`: on a CPU with ZEROTIER_LAGGING_DEVICE set (the test suite), the
    lagging one ([Note: the lagging device])."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if torch.device(device).type == "cpu" and _lag_from_env() is not None:
        return LaggingDeviceTier(budget, device, timing)
    return DeviceTier(budget, device, timing)
