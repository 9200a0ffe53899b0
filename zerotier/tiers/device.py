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

On a CPU the suite runs a subclass that copies as a lagging GPU would ([Note: the lagging
device] in tiers/lagging.py); `make_device_tier` picks it.
"""
from __future__ import annotations

import threading
import time

import torch

from ..errors import ZerotierError
from ..io.memory import round_up
from ..io.ticket import CompletedTicket
from .base import BudgetedTier, charging

# Accounting granularity on CUDA: the caching allocator rounds blocks up to 512 B.
_CUDA_ROUND = 512

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

    lagging = False  # [Note: the lagging device] in tiers/lagging.py: the suite's CPU instrument

    def __init__(self, budget: int, device: torch.device | str | None = None, timing: bool = False) -> None:
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
        self._charged: dict[int, str] = {}  # data_ptr -> component ([Note: peaks per component] in base.py)
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
            component = charging()
            if component is not None:  # [Note: peaks per component] in base.py
                with self._lock:
                    self._charged[t.data_ptr()] = component
                self.charge(component, nbytes)
        return t

    def free(self, t: torch.Tensor) -> None:
        """Release t's bytes from the budget; memory returns once every reference is dropped."""
        if t.numel() == 0:
            return
        with self._lock:
            nbytes = self._live.pop(t.data_ptr(), None)
            component = self._charged.pop(t.data_ptr(), None)
        if nbytes is not None:
            self.charge(component, -nbytes)
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
        self.charge(charging(), self._accounted(nbytes))

    def free_storage(self, flat: torch.Tensor) -> None:
        """Resize `flat`'s storage to 0: the memory goes now, whoever holds views of it."""
        nbytes = flat.untyped_storage().nbytes()
        if nbytes:
            flat.untyped_storage().resize_(0)
            self.release(self._accounted(nbytes))
            self.charge(charging(), -self._accounted(nbytes))

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
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def copy_d2h(self, dst: torch.Tensor, src: torch.Tensor):
        """dst (host) <- src (device)."""
        return self._copy(dst, src, inbound=False)

    def join(self, ticket) -> None:
        """Make compute wait for a copy: on CUDA the current stream waits on the copy's event
        (the host does not block); on the CPU the copy has run, so this only re-raises its error."""
        if isinstance(ticket, EventTicket):
            ticket.wait_on(torch.cuda.current_stream(self.device))
        else:
            ticket.wait()

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, inbound: bool, after=None):
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise ValueError(f"device tier: copy {src.dtype} {list(src.shape)} -> "
                             f"{dst.dtype} {list(dst.shape)}: shapes/dtypes differ")
        nbytes = src.numel() * src.element_size()
        (super().count_in if inbound else super().count_out)(nbytes)  # not a synchronous copy's
        if not self.is_cuda:
            return self._cpu_copy(dst, src, nbytes, inbound, after)
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

    def _cpu_copy(self, dst: torch.Tensor, src: torch.Tensor, nbytes: int, inbound: bool, after):
        """On the CPU: the calling worker thread is the copy stream."""
        dst.copy_(src)
        return CompletedTicket(nbytes)

    @property
    def shares_host_memory(self) -> bool:
        """Compute reads host memory where it is (a CPU device): a copy to the device can be skipped."""
        return not self.is_cuda

    def stats(self) -> dict[str, int]:
        out = super().stats()
        with self._lock:
            out["live_tensors"] = len(self._live)
        return out

    def close(self) -> None:
        if self.is_cuda:
            self.h2d_stream.synchronize()
            self.d2h_stream.synchronize()
