"""The Chrome / Perfetto trace: built from a Profiler's records, and read back (files: trace_file.py).

Layout (open in ui.perfetto.dev or chrome://tracing):

  pid 1 "compute"         one track per thread that marked compute spans or waited (stalls)
  pid 2 "transfers"       one track per stream / thread that ran transfers
  pid 10+ "tier <name>"   counters: residency (used vs budget) and bandwidth of each link into the tier

Every transfer is an "X" event whose `args` hold what the summary needs (tensor, role,
src, dst, bytes, reason, stall_us, stream); the top-level "zerotier" object holds the
rest (prefetch counters, peak rates, the speculative step's counters; each speculated window
is also an instant event, cat "speculation", on the compute process). So
`summarize(load_trace(path))` equals the in-memory `Profiler.report()`: both are computed
from this dict.

[Note: trace lanes]
Chrome's format needs the "X" events of one track (pid, tid) to nest: no two may
partly overlap. Transfers do overlap on one worker (async tickets issued by one
thread) and a caller may interleave begin/end pairs, so each track is split into
lanes: events sorted by (start, -end) go to the first lane whose open events they
nest in; each lane becomes its own tid ("zerotier-fetch_0", "zerotier-fetch_0 #2").
Nesting is decided on the exported floats (ts, ts + dur), the same arithmetic a
reader uses, so rounding cannot break it.

[Note: stall attribution]
Stall is compute time lost to a transfer, from three sources, never counted twice:
 1. `end(token, stall_ns)` / `record(..., stall_ns=)`: the caller knew it;
 2. a transfer run by a thread that has compute spans, inside those spans and outside
    its waits: the compute thread made the copy itself, so it waited all along;
 3. waits (`wait_begin`/`wait_end`, `record_wait`) on tensor T from s to e: shared
    among T's transfers overlapping [s, e] by their overlap; the rest of the wait
    (e.g. a wait that outlasts them) goes to the latest of T's transfers started
    before e. A wait with no such transfer is "unmatched": still stall in the summary.
"""
from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from . import intervals as iv
from .schema import COMPUTE_KINDS, REASONS, ROLES, TIERS

FORMAT = 1
PID_COMPUTE, PID_TRANSFERS, PID_TIER0 = 1, 2, 10
BANDWIDTH_BINS = 200          # bandwidth counters: the profiled window in this many bins...
MIN_BIN_US = 1000.0           # ...each at least 1 ms wide
STALL_CANDIDATES = 16         # transfers of a tensor looked back at when attributing one wait


def build_trace(prof) -> dict:
    """Trace dict (the `traceEvents` JSON object format) of a Profiler's records so far (its
    Recorder's snapshot, with the peak rates the Profiler knows)."""
    from .. import __version__

    rec = prof.snapshot()
    t0 = prof.t0_ns
    transfers, waits = rec["transfers"], rec["waits"]
    stall_ns, matched = _attribute_stalls(transfers, waits, rec["computes"])
    events: list[dict] = []
    tracks = _Tracks(events)

    units = prof.unit_names
    by_stream: dict[str, list] = defaultdict(list)
    for (name, role, src, dst, nbytes, reason, stream, start, end, _), stall in zip(transfers, stall_ns):
        ts, dur = (start - t0) / 1e3, (end - start) / 1e3
        by_stream[stream].append((ts, dur, {
            "name": f"{reason} {tensor_label(name, units)} {src}->{dst}", "cat": "transfer", "ph": "X", "ts": ts,
            "dur": dur, "args": {"tensor": name, "role": role, "src": src, "dst": dst, "bytes": nbytes,
                                 "reason": reason, "stall_us": stall / 1e3, "stream": stream,
                                 **_module(name, units)}}))
    by_thread: dict[str, list] = defaultdict(list)
    for label, kind, thread, start, end, numel in rec["computes"]:
        ts, dur = (start - t0) / 1e3, (end - start) / 1e3
        by_thread[thread].append((ts, dur, {"name": label, "cat": "compute", "ph": "X", "ts": ts, "dur": dur,
                                            "args": {"kind": kind, "numel": numel, "thread": thread}}))
    for (name, thread, start, end), found in zip(waits, matched):
        ts, dur = (start - t0) / 1e3, (end - start) / 1e3
        by_thread[thread].append((ts, dur, {"name": f"stall {tensor_label(name, units)}", "cat": "stall", "ph": "X",
                                            "ts": ts, "dur": dur, "args": {"tensor": name, "matched": found,
                                                                           "thread": thread, **_module(name, units)}}))
    tracks.process(PID_COMPUTE, "compute")
    for thread in sorted(by_thread):
        tracks.place(PID_COMPUTE, thread, by_thread[thread])
    tracks.process(PID_TRANSFERS, "transfers")
    for stream in sorted(by_stream):
        tracks.place(PID_TRANSFERS, stream, by_stream[stream])

    timed = [e for e in events if e.get("ph") == "X"]
    start_us = min((e["ts"] for e in timed), default=0.0)
    end_us = max((e["ts"] + e["dur"] for e in timed), default=0.0)
    bin_us = max((end_us - start_us) / BANDWIDTH_BINS, MIN_BIN_US)
    counters: list[dict] = []
    links = [e["args"] | {"ts": e["ts"], "dur": e["dur"]} for e in timed if e["cat"] == "transfer"]
    bandwidth = bandwidth_series(links, start_us, bin_us)
    sampled = {tier for _, values in rec["samples"] for tier in values}
    used_tiers = sampled | {link.split("->")[1] for link in bandwidth}
    tier_pid = {tier: PID_TIER0 + i for i, tier in enumerate(list(TIERS) + sorted(sampled - set(TIERS)))}
    for tier, pid in tier_pid.items():
        if tier in used_tiers:
            tracks.process(pid, f"tier {tier}")
    for t_ns, values in rec["samples"]:
        for tier, (used, budget) in values.items():
            counters.append({"name": f"residency {tier}", "cat": "residency", "ph": "C", "ts": (t_ns - t0) / 1e3,
                             "pid": tier_pid[tier], "tid": 0, "args": {"used": used, "budget": budget}})
    for link, series in bandwidth.items():
        pid = tier_pid[link.split("->")[1]]
        counters += [{"name": f"bandwidth {link}", "cat": "bandwidth", "ph": "C", "ts": ts, "pid": pid, "tid": 0,
                      "args": {"GB/s": gbps}} for ts, gbps in series]
    counters.sort(key=lambda e: e["ts"])
    # [Note: speculation counters]: each speculated window as an instant on the compute process
    marks = [{"name": "speculation rolled back" if rolled else "speculation validated", "cat": "speculation",
              "ph": "i", "s": "p", "ts": (t_ns - t0) / 1e3, "pid": PID_COMPUTE, "tid": 0,
              "args": {"speculated": units, "rolled_back": rolled, "undo_bytes": undo, "rollback_bytes": moved,
                       "rollback_s": secs}}
             for t_ns, units, rolled, undo, moved, secs in rec["speculation"]]

    outcomes = rec["prefetch"]  # counted over the whole run
    by_link: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    by_reason: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for (src, dst, reason), (n, nbytes) in rec["run_totals"].items():
        for total in (by_link[f"{src}->{dst}"], by_reason[reason]):
            total[0] += n
            total[1] += nbytes
    meta = {
        "format": FORMAT, "version": __version__, "t0_unix_s": prof.wall_t0,
        "window_us": [start_us, end_us], "bandwidth_bin_us": bin_us,
        "sample_interval_ms": prof.cfg.sample_interval_ms, "sampler_error": rec["sampler_error"],
        "peak_rates": prof.peak_rates(), "device": prof.device_type,
        "prefetch": {"issued": outcomes["issued"], "hits": outcomes["hit"], "misses": outcomes["miss"],
                     "wasted": outcomes["wasted"]},
        "vocabulary": {"tiers": list(TIERS), "reasons": list(REASONS), "roles": list(ROLES),
                       "compute_kinds": list(COMPUTE_KINDS)},
        # every transfer since the profiler started, also those older than the events kept (max_events)
        "run_totals": {"transfers": sum(n for n, _ in by_link.values()), "bytes": sum(b for _, b in by_link.values()),
                       "by_link": {k: {"transfers": n, "bytes": b} for k, (n, b) in sorted(by_link.items())},
                       "by_reason": {k: {"transfers": n, "bytes": b} for k, (n, b) in sorted(by_reason.items())}},
        "speculation": rec["speculation_totals"],  # the whole run's ([Note: speculation counters])
        "unit_names": units,  # unit key -> module path (tensor_label)
        "planned_rollback_rate": prof.planned_rollback_rate,  # the plan's assumption, None: not speculating
    }
    return {"traceEvents": events + counters + marks, "displayTimeUnit": "ms", "zerotier": meta}


def tensor_label(name: str, unit_names: dict[str, str]) -> str:
    """A tensor as a reader knows it: `u00003.exp_avg` of the unit at module `layers.3` is
    `layers.3 (u00003).exp_avg` (the root module's unit: `<root> (u00000).param`); a name whose
    unit has no module path given stays as it is."""
    key, dot, rest = name.partition(".")
    module = unit_names.get(key)
    return name if module is None else f"{module or '<root>'} ({key}){dot}{rest}"


def _module(name: str, unit_names: dict[str, str]) -> dict[str, str]:
    """{"module": path} of the unit of tensor `name` for an event's args, or {} when unknown."""
    module = unit_names.get(name.partition(".")[0])
    return {} if module is None else {"module": module or "<root>"}


class _Tracks:
    """Assigns tids and writes the "M" metadata naming processes and tracks."""

    def __init__(self, events: list[dict]):
        self.events = events
        self.next_tid = 1

    def process(self, pid: int, name: str) -> None:
        self.events += [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}},
                        {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}}]

    def place(self, pid: int, name: str, items: list[tuple[float, float, dict]]) -> None:
        """Add the X events of one stream/thread, split into lanes ([Note: trace lanes])."""
        items.sort(key=lambda item: (item[0], -(item[0] + item[1])))
        lanes: list[list[float]] = []     # per lane: end times of its open events, outermost first
        tids: list[int] = []
        for ts, dur, event in items:
            end = ts + dur
            for k, stack in enumerate(lanes):
                while stack and stack[-1] <= ts:
                    stack.pop()
                if not stack or end <= stack[-1]:
                    stack.append(end)
                    break
            else:
                k = len(lanes)
                lanes.append([end])
                tids.append(self.next_tid)
                self.next_tid += 1
                label = name if k == 0 else f"{name} #{k + 1}"
                self.events += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": tids[k], "args": {"name": label}},
                                {"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tids[k],
                                 "args": {"sort_index": tids[k]}}]
            event["pid"], event["tid"] = pid, tids[k]
            self.events.append(event)


def _attribute_stalls(transfers: list[tuple], waits: list[tuple],
                      computes: list[tuple]) -> tuple[list[float], list[bool]]:
    """Stall ns per transfer, and whether each wait found a transfer ([Note: stall attribution])."""
    stall = [float(t[9]) for t in transfers]
    # 1. copies the compute thread made itself inside its spans, where it was not already waiting
    busy: dict[str, iv.Intervals] = {}
    for thread in {c[2] for c in computes}:
        spans = iv.union((c[3], c[4]) for c in computes if c[2] == thread)
        busy[thread] = iv.subtract(spans, iv.union((w[2], w[3]) for w in waits if w[1] == thread))
    for i, t in enumerate(transfers):
        if t[6] in busy:
            stall[i] += iv.overlap(t[7], t[8], busy[t[6]])
    # 2. waits, shared among the transfers of the tensor waited for
    index: dict[str, list[tuple[int, int, int]]] = defaultdict(list)   # name -> (start, end, i)
    for i, t in enumerate(transfers):
        index[t[0]].append((t[7], t[8], i))
    starts = {}
    for name, items in index.items():
        items.sort()
        starts[name] = [s for s, _, _ in items]
    matched = []
    for name, _, s, e in waits:
        items = index.get(name)
        k = bisect.bisect_right(starts[name], e) if items else 0
        if k == 0:
            matched.append(False)
            continue
        wait = float(e - s)
        shares = [(max(0, min(e, t_end) - max(s, t_start)), i)
                  for t_start, t_end, i in items[max(0, k - STALL_CANDIDATES):k]]
        covered = sum(share for share, _ in shares)
        scale = wait / covered if covered > wait else 1.0
        for share, i in shares:
            stall[i] += share * scale
        stall[items[k - 1][2]] += max(0.0, wait - covered)
        matched.append(True)
    return stall, matched


def bandwidth_series(transfers: list[dict], start_us: float, bin_us: float) -> dict[str, list[tuple[float, float]]]:
    """{"src->dst": [(bin start µs, GB/s), ..., (end, 0.0)]}; each transfer's bytes spread evenly over its span."""
    bins: dict[str, list[float]] = {}
    for t in transfers:
        link = f"{t['src']}->{t['dst']}"
        first = int((t["ts"] - start_us) // bin_us)
        last = int((t["ts"] + t["dur"] - start_us) // bin_us)
        series = bins.setdefault(link, [])
        if len(series) <= last:
            series.extend([0.0] * (last + 1 - len(series)))
        if t["dur"] <= 0 or first == last:
            series[first] += t["bytes"]
            continue
        per_us = t["bytes"] / t["dur"]
        for b in range(first, last + 1):
            lo = max(t["ts"], start_us + b * bin_us)
            hi = min(t["ts"] + t["dur"], start_us + (b + 1) * bin_us)
            series[b] += per_us * max(0.0, hi - lo)
    out = {}
    for link in sorted(bins):
        series = bins[link]
        points = [(start_us + b * bin_us, nbytes / (bin_us * 1e3)) for b, nbytes in enumerate(series)]
        out[link] = points + [(start_us + len(series) * bin_us, 0.0)]
    return out


# ---------------------------------------------------------------------------------------------
# Reading back


@dataclass
class TraceData:
    """What the summary and the plot read from a trace dict."""
    transfers: list[dict]                 # args of each transfer plus ts / dur (µs)
    computes: list[tuple[float, float, str, int, str]]  # (ts, end, kind, numel, thread)
    stalls: list[tuple[float, float, str, bool, str]]   # (ts, end, tensor, matched, thread)
    residency: dict[str, list[tuple[float, int, int]]]  # tier -> [(ts, used, budget)]
    meta: dict[str, Any]


def read_trace(trace: dict) -> TraceData:
    transfers, computes, stalls = [], [], []
    residency: dict[str, list] = defaultdict(list)
    for e in trace["traceEvents"]:
        ph, cat = e.get("ph"), e.get("cat")
        if ph == "X":
            end = e["ts"] + e["dur"]
            if cat == "transfer":
                transfers.append(e["args"] | {"ts": e["ts"], "dur": e["dur"]})
            elif cat == "compute":
                computes.append((e["ts"], end, e["args"]["kind"], e["args"]["numel"], e["args"]["thread"]))
            elif cat == "stall":
                stalls.append((e["ts"], end, e["args"]["tensor"], e["args"]["matched"], e["args"]["thread"]))
        elif ph == "C" and cat == "residency":
            residency[e["name"].split(" ", 1)[1]].append((e["ts"], e["args"]["used"], e["args"]["budget"]))
    return TraceData(transfers, computes, stalls, dict(residency), trace["zerotier"])
