"""Trace-based parameter prefetch.

[Note: prefetch trace]
The first training pass (forward + backward) records the order in which units are fetched (forward, then backward,
including activation-checkpoint recomputation). Later steps replay it: each
demand fetch of unit k checks k against the trace and, if it matches, issues
asynchronous fetches for the next `lookahead` units within `max_bytes` of
parameters in flight (a unit larger than `max_bytes` is still prefetched when
nothing else is in flight, so very large layers are never demand-only). When the order diverges (data-dependent control flow),
the step falls back to fetching on demand, one warning names the module, and
the order of that step is recorded as the new trace (a step that only stops part way along
the trace, as one whose forward raised, keeps it; a step running past the end of a trace that
no step has followed to its end yet, as after a first step that failed, extends it silently).
It never raises.
"""
from __future__ import annotations

import warnings
from typing import Callable

from ..config import PrefetchConfig


class PrefetchScheduler:
    def __init__(self, cfg: PrefetchConfig, unit_bytes: list[int], unit_names: list[str],
                 issue: Callable[[int], None], inflight_bytes: Callable[[], int]):
        self.cfg = cfg
        self.unit_bytes = unit_bytes
        self.unit_names = unit_names
        self.issue = issue                  # start an async fetch of a unit (no-op if resident/in flight)
        self.inflight_bytes = inflight_bytes
        self.trace: list[int] | None = None  # replayed order
        self.recording: list[int] = []       # order seen during this step
        self.pos = 0
        self.diverged = False
        self.divergences = 0
        self.replayed = False                # a pass followed the trace to its end: a whole pass's order

    def on_demand(self, index: int) -> None:
        """Called when compute needs unit `index` now."""
        self.recording.append(index)
        if not self.cfg.enabled or self.trace is None or self.diverged:
            return
        if self.pos >= len(self.trace) or self.trace[self.pos] != index:
            self.diverged = True
            if self.pos >= len(self.trace) and not self.replayed:
                return  # the trace is a pass that stopped part way (the first one failed): it grows, no warning
            expected = self.unit_names[self.trace[self.pos]] if self.pos < len(self.trace) else "end of trace"
            warnings.warn(f"zerotier prefetch: module order changed at '{self.unit_names[index] or '<root>'}' "
                          f"(trace expected '{expected or '<root>'}'); fetching on demand for this step and "
                          "recording the new order", RuntimeWarning, stacklevel=3)
            self.divergences += 1
            return
        self.pos += 1
        budget = self.cfg.max_bytes if self.cfg.max_bytes != "auto" else float("inf")
        for nxt in self.trace[self.pos: self.pos + self.cfg.lookahead]:
            inflight = self.inflight_bytes()
            if inflight and inflight + self.unit_bytes[nxt] > budget:
                break
            self.issue(nxt)

    def begin_pass(self) -> None:
        """A new training forward starts: adopt the last pass's order if it was new. A pass that
        stopped part way along the trace (an error in its forward or backward) changed no order:
        it keeps the trace, so the retry is prefetched and warns of nothing. A trace no pass has
        followed to its end yet may be such a stopped pass (the first one): running past its end
        extends it without a warning."""
        if not self.recording:
            return
        if self.trace is None or self.diverged:
            self.trace, self.replayed = self.recording, False
        elif self.pos == len(self.trace):
            self.replayed = True
        self.recording = []
        self.pos = 0
        self.diverged = False
