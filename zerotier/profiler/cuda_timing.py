"""Device work timed with CUDA events, in the Recorder's perf_counter_ns clock ([Note: CUDA timing]
in events.py): the clock that records the events and reads their times, and the records that wait
for their events to be reached."""
from __future__ import annotations

import threading
import time
from typing import Callable

_now = time.perf_counter_ns

# what ("transfer", "compute" or "wait"), the Recorder's fields of the record, its start and end (ns)
Deliver = Callable[[str, tuple, int, int], None]


class CudaClock:
    """Timing events on one CUDA device, in the perf_counter_ns clock: a reference event is recorded
    and synchronized at the start, and an event's time is that instant plus its elapsed time."""

    def __init__(self, device):
        import torch

        self.torch, self.device = torch, device
        self.reference = self.record()
        self.reference.synchronize()
        self.reference_ns = _now()

    def record(self, stream=None):
        """A timing event recorded now on `stream` (default: the calling thread's current stream)."""
        event = self.torch.cuda.Event(enable_timing=True)
        event.record(stream if stream is not None else self.torch.cuda.current_stream(self.device))
        return event

    def ns(self, event) -> int:
        event.synchronize()
        return self.reference_ns + int(self.reference.elapsed_time(event) * 1e6)


class PendingTimings:
    """Records timed by a start and an end event, kept until the events are reached and then handed
    to `deliver` with their times in the perf_counter_ns clock.

    [Note: pending timings are bounded] GPU review N11: a long profiled run held millions of events
    until the report. Past RESOLVE_AT pending records the ones whose events have been reached are
    delivered without waiting; past MAX_PENDING the oldest half is delivered, waiting for its events.
    """

    RESOLVE_AT = 512     # pending records before the reached ones are delivered
    MAX_PENDING = 4096   # pending records before the oldest half is delivered, waiting

    def __init__(self, clock: CudaClock, deliver: Deliver):
        self.clock, self.deliver = clock, deliver
        self.pending: list[tuple] = []  # (what, fields, start_event, end_event)
        self.lock = threading.Lock()    # records come from every thread; resolving takes a batch

    def add(self, what: str, fields: tuple, start_event, end_event) -> None:
        """Keep one record until its events are reached (bounded: see the Note)."""
        with self.lock:  # not a bare append: resolve() rewrites the list, and would drop one made meanwhile
            self.pending.append((what, fields, start_event, end_event))
        if len(self.pending) >= self.RESOLVE_AT:
            self.resolve(wait=False)

    def resolve(self, wait: bool = True) -> None:
        """Deliver the pending records: all of them (waiting for their events), or with wait=False
        those already reached, and with too many pending the oldest half."""
        with self.lock:
            if wait:
                batch = list(self.pending)
            else:
                batch = self.pending[: len(self.pending) // 2] if len(self.pending) >= self.MAX_PENDING else []
                batch += [r for r in self.pending[len(batch):] if r[2].query() and r[3].query()]
            taken = {id(r) for r in batch}
            self.pending[:] = [r for r in self.pending if id(r) not in taken]
        for what, fields, start_event, end_event in batch:
            end = self.clock.ns(end_event)
            self.deliver(what, fields, min(self.clock.ns(start_event), end), end)
