"""Device tier: budgeted tensors on the compute device, and the one component that copies
between host and device.

On a CUDA machine the tier is a budget over the caching allocator plus two copy
streams; on a CPU-only machine the "device" is a budgeted region of RAM and a copy
runs on the calling thread (the engine calls copies from its fetch workers, which
are the CPU's "streams"). The same calling code serves both: every copy returns a
ticket, and `join(ticket)` makes compute wait for it.

[Note: copy streams and events]
`h2d_stream` carries host->device copies (parameter fetches and write-backs);
`d2h_stream` carries device->host copies (gradient offload). Both overlap compute
on the current stream and each other. Each copy first makes its stream wait for
the current stream (the tensor was allocated/produced there: allocate on the
writing stream, or wait for it), then records an event after the copy; tensor
and event travel together in an EventTicket, which keeps both sides of the copy
alive until the event has completed. The device tensor is also `record_stream`-ed
on the copy stream so the caching allocator cannot hand its memory to another
stream before the copy is done, even if it is freed early. A consumer on another
stream calls `join(ticket)` (the stream waits, the host does not); a host consumer
calls `ticket.wait()`. `non_blocking=True` is used only when the host side is
pinned: from pageable memory CUDA would stage through its own buffer and run
synchronously anyway.

[Note: freeing by storage resize]
A streamed unit keeps one device flat for the whole run; `p.data` are views of it.
Releasing it resizes its storage to 0 bytes (FSDP2's rule): the memory really goes
back to the allocator even if autograd saved views of the parameters, and the
budget is released at the same moment, so accounting tells the truth. Fetching
resizes it back and fills it; saved views see the refilled bytes.

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
from ..io.memory import round_up
from ..io.ticket import CompletedTicket
from .base import BudgetedTier

# Accounting granularity on CUDA: the caching allocator rounds blocks up to 512 B.
_CUDA_ROUND = 512

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

    def __init__(self, tier: "DeviceTier", dst: torch.Tensor, src: torch.Tensor, nbytes: int, inbound: bool):
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


class EventTicket:
    """A CUDA copy in flight: the event recorded after it, and the tensors it touches.
    With timing on (profiling), `timing_events` = (start, end) events around the copy on
    `stream_name`'s stream, for the profiler ([Note: CUDA timing] in profiler/events.py)."""

    def __init__(self, event: "torch.cuda.Event", nbytes: int, keepalive: tuple, start_event=None,
                 stream_name: str = "") -> None:
        self._event = event
        self._nbytes = nbytes
        self._keepalive: tuple | None = keepalive  # both sides of the copy, until done
        self.timing_events = (start_event, event) if start_event is not None else None
        self.stream_name = stream_name

    def done(self) -> bool:
        if self._event.query():
            self._keepalive = None
            return True
        return False

    def wait(self, timeout: float | None = None) -> int:
        if timeout is None:
            self._event.synchronize()
        else:
            deadline = time.monotonic() + timeout
            while not self._event.query():
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"device copy of {self._nbytes} B not done after {timeout} s")
                time.sleep(50e-6)
        self._keepalive = None
        return self._nbytes

    def wait_on(self, stream: "torch.cuda.Stream | None" = None) -> None:
        """Make `stream` (default: the current one) wait for the copy; the host does not block."""
        (stream or torch.cuda.current_stream()).wait_event(self._event)


class DeviceTier(BudgetedTier):
    """Budgeted allocations on `device` ("cuda[:N]" or "cpu") plus async copies."""

    def __init__(self, budget: int, device: torch.device | str | None = None, timing: bool = False,
                 lag_s: float | None = None) -> None:
        super().__init__("device", budget, hint="Raise tiers.device, or offload more state to host/nvme "
                                                "(offload.params / offload.gradients / offload.optimizer).")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ZerotierError(f"device tier: {device} requested but torch.cuda is unavailable")
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
        elif device.type != "cpu":
            raise ZerotierError(f"device tier: unsupported device {device} (use cuda or cpu)")
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.timing = timing and self.is_cuda  # copies carry timing events (the profiler is on)
        self._lock = threading.Lock()
        self._live: dict[int, int] = {}  # data_ptr -> accounted bytes, for free()
        # [Note: the lagging device]: a test instrument, CPU only; lag_s None reads the environment.
        self.lag_s = None if self.is_cuda else (lag_s if lag_s is not None else _lag_from_env())
        self.lagging = self.lag_s is not None
        self._lag_queue: collections.deque[LateTicket] = collections.deque()
        self._lag_cv = threading.Condition()
        self._lag_worker: threading.Thread | None = None
        self._lag_errors: list[str] = []
        self._joined: list[LateTicket] = []  # joined by compute, event still pending
        if self.is_cuda:
            # [Note: copy streams and events]: swap-in and swap-out each get a stream,
            # so they overlap compute on the current stream and each other.
            self.h2d_stream = torch.cuda.Stream(device)
            self.d2h_stream = torch.cuda.Stream(device)

    def _accounted(self, nbytes: int) -> int:
        return round_up(nbytes, _CUDA_ROUND) if self.is_cuda else nbytes

    def alloc(self, shape, dtype: torch.dtype, what: str = "") -> torch.Tensor:
        """An uninitialised tensor on the device, counted against tiers.device."""
        shape = tuple(shape)
        numel = 1
        for d in shape:
            numel *= d
        nbytes = self._accounted(numel * dtype.itemsize)
        self.reserve(nbytes, what or f"{dtype} {list(shape)} tensor")
        try:
            t = torch.empty(shape, dtype=dtype, device=self.device)
        except BaseException:  # CUDA OOM or the OS refusing: undo the reservation
            self.release(nbytes)
            raise
        if nbytes:
            with self._lock:
                self._live[t.data_ptr()] = nbytes
        return t

    def free(self, t: torch.Tensor) -> None:
        """Release t's bytes from the budget; memory returns once every reference is dropped."""
        if t.numel() == 0:
            return
        if self.lagging:
            self._released(t)
        with self._lock:
            nbytes = self._live.pop(t.data_ptr(), None)
        if nbytes is None:
            raise ZerotierError(f"device tier: free() of a tensor it did not allocate "
                                f"({t.dtype} {list(t.shape)} at {t.data_ptr():#x})")
        self.release(nbytes)

    # ------------------------------------------------- storage-resized tensors ([Note: freeing by storage resize])

    def fill_storage(self, flat: torch.Tensor, what: str) -> None:
        """Give `flat` its bytes back, counted against the budget (BudgetError: nothing changes)."""
        nbytes = flat.numel() * flat.element_size()
        self.reserve(self._accounted(nbytes), what)
        try:
            flat.untyped_storage().resize_(nbytes)
        except BaseException:
            self.release(self._accounted(nbytes))
            raise

    def free_storage(self, flat: torch.Tensor) -> None:
        """Resize `flat`'s storage to 0: the memory goes now, whoever holds views of it."""
        if self.lagging:
            self._released(flat)
        nbytes = flat.untyped_storage().nbytes()
        if nbytes:
            flat.untyped_storage().resize_(0)
            self.release(self._accounted(nbytes))

    # ------------------------------------------------------------------ copies ([Note: copy streams and events])

    def copy_h2d(self, dst: torch.Tensor, src: torch.Tensor, after=None):
        """dst (device) <- src (host). Keep neither side in use until the ticket is done. `after`: a
        mark() taken on the compute thread when dst was allocated; without it the copy waits for
        the calling thread's current stream as it is now."""
        return self._copy(dst, src, inbound=True, after=after)

    def mark(self):
        """An event recorded on the current (compute) stream now, for a copy issued later from
        another thread (copy_h2d's `after`); None on the CPU, where copies run when called."""
        if not self.is_cuda:
            return self._compute_position() if self.lagging else None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def copy_d2h(self, dst: torch.Tensor, src: torch.Tensor):
        """dst (host) <- src (device)."""
        return self._copy(dst, src, inbound=False)

    def join(self, ticket) -> None:
        """Make compute wait for a copy: on CUDA the current stream waits on the copy's event
        (the host does not block); on the CPU the copy has run, so this only re-raises its error
        (on the lagging device the bytes land and the event stays pending)."""
        if isinstance(ticket, EventTicket):
            ticket.wait_on(torch.cuda.current_stream(self.device))
        elif isinstance(ticket, LateTicket):  # compute waits; the copy's event stays pending
            self._raise_lag_errors()
            ticket.land()
            with self._lag_cv:
                self._joined = [t for t in self._joined if not t.done()] + [ticket]
        else:
            ticket.wait()

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, inbound: bool, after=None):
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise ValueError(f"device tier: copy {src.dtype} {list(src.shape)} -> "
                             f"{dst.dtype} {list(dst.shape)}: shapes/dtypes differ")
        nbytes = src.numel() * src.element_size()
        (super().count_in if inbound else super().count_out)(nbytes)  # not a synchronous copy's
        if not self.is_cuda:
            if self.lagging:
                return self._lagging_copy(dst, src, nbytes, inbound, after)
            dst.copy_(src)  # the calling worker thread is the CPU's copy stream
            return CompletedTicket(nbytes)
        host, dev = (src, dst) if inbound else (dst, src)
        stream = self.h2d_stream if inbound else self.d2h_stream
        if after is not None:  # dev was made on the compute stream when `after` was recorded
            stream.wait_event(after)
        else:  # dev was made on the current stream
            stream.wait_stream(torch.cuda.current_stream(self.device))
        start = None
        if self.timing:
            start = torch.cuda.Event(enable_timing=True)
            start.record(stream)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=host.is_pinned())
            event = torch.cuda.Event(enable_timing=self.timing)
            event.record(stream)
        dev.record_stream(stream)
        return EventTicket(event, nbytes, keepalive=(dst, src), start_event=start,
                           stream_name="cuda:h2d" if inbound else "cuda:d2h")

    # ------------------------------------------------------------------ [Note: the lagging device]

    def count_in(self, nbytes: int) -> None:
        """Count a transfer into the device; on the CPU callers use it for the copy they did
        synchronously (host memory is the device's), which on a GPU is a copy ordered after compute:
        on the lagging device the copies compute had joined complete here."""
        super().count_in(nbytes)
        if self.lagging:
            for earlier in self._compute_position():
                earlier.complete()

    def count_out(self, nbytes: int) -> None:
        """As count_in, device to host."""
        super().count_out(nbytes)
        if self.lagging:
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

    def _lagging_copy(self, dst: torch.Tensor, src: torch.Tensor, nbytes: int, inbound: bool,
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

    def stats(self) -> dict[str, int]:
        out = super().stats()
        with self._lock:
            out["live_tensors"] = len(self._live)
        return out

    def close(self) -> None:
        if self.is_cuda:
            self.h2d_stream.synchronize()
            self.d2h_stream.synchronize()
        elif self.lagging:  # every copy completes (and is checked) before the tier goes
            with self._lag_cv:
                pending = list(self._lag_queue)
            for ticket in pending:
                ticket.complete()
            self._raise_lag_errors()
