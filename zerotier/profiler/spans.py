"""Where time goes in a trace: per-thread busy spans, busy time per resource, and each step's split.

Read by the summary (the verdict's busy times, overlap) and the plot (the stacked bar per step).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from . import intervals as iv
from .trace import TraceData, read_trace

_COMPUTE_KINDS = {"forward", "backward", "device-optimizer"}


def _spans(data: TraceData) -> tuple[dict[str, iv.Intervals], dict[str, iv.Intervals], dict[str, iv.Intervals]]:
    """Per thread: compute and CPU-optimizer intervals with the thread's stalls (its waits) and
    its own copies cut out, and those own copies made inside its spans (stall too: the compute
    thread waited on a copy it made itself)."""
    spans = lambda items: [(s, e) for s, e, *_ in items]  # noqa: E731
    by_stream: dict[str, list] = defaultdict(list)
    for t in data.transfers:
        by_stream[t["stream"]].append((t["ts"], t["ts"] + t["dur"]))
    compute: dict[str, iv.Intervals] = {}
    optimizer: dict[str, iv.Intervals] = {}
    own_copies: dict[str, iv.Intervals] = {}
    for thread in sorted({c[4] for c in data.computes}):
        own = iv.union(by_stream.get(thread, []))
        lost = iv.union(spans(w for w in data.stalls if w[4] == thread) + own)
        mine = [c for c in data.computes if c[4] == thread]
        raw_compute = iv.union(spans(c for c in mine if c[2] in _COMPUTE_KINDS))
        raw_optimizer = iv.union(spans(c for c in mine if c[2] == "optimizer"))
        compute[thread] = iv.subtract(raw_compute, lost)
        optimizer[thread] = iv.subtract(raw_optimizer, lost)
        worked = iv.union(raw_compute + raw_optimizer)
        own_copies[thread] = iv.subtract(worked, iv.subtract(worked, own))   # worked ∩ own
    return compute, optimizer, own_copies


def busy_time(data: TraceData):
    """Busy µs per resource ([Note: verdict] in verdict.py) and, per stream, the compute time that
    hides its transfers.

    A thread's compute spans lose the time it stalled (its waits) and the time it ran
    transfers itself: a copy made by the compute thread hides nothing.
    """
    compute, optimizer, _ = _spans(data)
    xs = data.transfers
    busy_us = {
        "compute": iv.length(iv.union(x for v in compute.values() for x in v)),
        "cpu-optimizer": iv.length(iv.union(x for v in optimizer.values() for x in v)),
        "nvme": iv.length(iv.union((t["ts"], t["ts"] + t["dur"]) for t in xs if "nvme" in (t["src"], t["dst"]))),
        "pcie": iv.length(iv.union((t["ts"], t["ts"] + t["dur"]) for t in xs
                                   if {t["src"], t["dst"]} == {"host", "device"})),
    }
    cache: dict[str, iv.Intervals] = {}

    def hidden_under(stream: str) -> iv.Intervals:
        if stream not in cache:
            cache[stream] = iv.union(x for thread in compute if thread != stream
                                     for x in compute[thread] + optimizer[thread])
        return cache[stream]
    return busy_us, hidden_under


# Where each step's time goes (the plot's stacked bars)


@dataclass(frozen=True)
class StepTime:
    """One step's wall time split so the parts add up to it ([Note: step time]). Seconds."""
    start_s: float              # since the profiled window's start
    wall_s: float
    compute_s: float            # forward, backward, device optimizer (stalls and own copies cut out)
    stall_s: float              # compute waiting on a transfer, or making the copy itself
    cpu_optimizer_s: float      # CPU Adam while no compute ran
    exposed_transfer_s: float   # a transfer in flight while nothing computed or stalled on it
    other_s: float              # none of these: Python, hooks, waits on no transfer, idle


def step_times(trace: dict) -> list[StepTime]:
    """[Note: step time]
    Steps are cut at "step" markers when the trace has them, else at the first forward after
    optimizer work (so the micro-batches of one accumulation window are one step; a trace
    without optimizer work is one step). Each instant of a step goes to the first of compute,
    stall, CPU optimizer, exposed transfer that is active then; what is left is "other". So the
    parts of a bar add up to the step's wall time, and overlapped work shows as the part it
    hid under: a transfer hidden under compute adds nothing to the bar."""
    data = read_trace(trace)
    start_us, end_us = data.meta["window_us"]
    compute, optimizer, own = _spans(data)
    compute_iv = iv.union(x for v in compute.values() for x in v)
    stall_iv = iv.subtract(iv.union([(s, e) for s, e, *_ in data.stalls] + [x for v in own.values() for x in v]),
                           compute_iv)
    busy = iv.union(compute_iv + stall_iv)
    optimizer_iv = iv.subtract(iv.union(x for v in optimizer.values() for x in v), busy)
    busy = iv.union(busy + optimizer_iv)
    exposed_iv = iv.subtract(iv.union((t["ts"], t["ts"] + t["dur"]) for t in data.transfers), busy)

    out = []
    bounds = _step_bounds(data, start_us, end_us)
    for a, b in zip(bounds, bounds[1:]):
        parts = [iv.overlap(a, b, x) / 1e6 for x in (compute_iv, stall_iv, optimizer_iv, exposed_iv)]
        wall = (b - a) / 1e6
        out.append(StepTime((a - start_us) / 1e6, wall, *parts, max(0.0, wall - sum(parts))))
    return out


def _step_bounds(data: TraceData, start_us: float, end_us: float) -> list[float]:
    """Start of each step and the window's end ([Note: step time])."""
    markers = sorted(s for s, _, kind, *_ in data.computes if kind == "step")
    if markers:
        starts = markers
    else:
        optimizer_starts = sorted(s for s, _, kind, *_ in data.computes if kind in ("optimizer", "device-optimizer"))
        starts, k = [], 0
        for f in sorted(s for s, _, kind, *_ in data.computes if kind == "forward"):
            seen = k
            while k < len(optimizer_starts) and optimizer_starts[k] < f:
                k += 1
            if not starts or k > seen:
                starts.append(f)
    starts = [s for s in starts if start_us <= s < end_us]
    return [start_us] + starts[1:] + [end_us]   # the first step also holds what came before it
