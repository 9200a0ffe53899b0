"""An I/O ticket that carries what the profiler records of it: the optimizer's NVMe state reads and
writes (state_store.py) and its gradient reads (grad_staging.py)."""
from __future__ import annotations

import time


class Profiled:
    """An I/O ticket plus what the profiler needs to record it once it has completed.
    The end time is when the waiter saw completion (an upper bound of the I/O's end)."""

    def __init__(self, ticket, name, role, src, dst, nbytes, reason, start_ns):
        self.ticket, self.name, self.role, self.src, self.dst = ticket, name, role, src, dst
        self.nbytes, self.reason, self.start_ns = nbytes, reason, start_ns
        self.recorded = False

    def wait(self):
        return self.ticket.wait()

    def done(self):
        return self.ticket.done()

    def record(self, prof) -> None:
        if not self.recorded:
            self.recorded = True
            prof.record(self.name, self.role, self.src, self.dst, self.nbytes, self.reason, self.start_ns,
                        time.perf_counter_ns(), stream="nvme-io")
