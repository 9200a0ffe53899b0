"""The summary of a trace: bytes and bandwidth per link, stalls, overlap, prefetch, residency, verdict.

Computed from the trace dict alone (`summarize(trace)`), so a saved trace gives the
same Summary as the live Profiler. Times are seconds, bandwidths GB/s (1e9 bytes/s).

[Note: verdict]
Four resources can bound a step. Over the profiled window (first to last X event),
each one's busy time is the length of the union of its intervals:

  compute        forward, backward and device-optimizer spans, minus stalls
  CPU optimizer  optimizer spans (optimizer math on the CPU), minus stalls
  PCIe           transfers between host and device
  NVMe           transfers to or from nvme (nvme->device counts here, not as PCIe)

Stalls (compute waiting on a transfer) are cut out of the compute spans they sit in.
"step" spans are markers and count for nothing. The verdict names the resource with
the largest busy time: when everything else overlaps perfectly, the step cannot be
shorter than that resource's work, so it is the one to speed up or offload less to.
Ties go to compute, then CPU optimizer, NVMe, PCIe.

Overlap is the share of transfer time (summed over transfers) that falls inside
compute or optimizer spans with stalls cut out: time the transfer was hidden. The rest
of a transfer's time is "exposed".

[Note: advice follows the figures]
The hint after the verdict is chosen from what was measured, never from the verdict's
name alone: no transfers, no transfer advice (the line says what bounds the step); a
compute-bound run with little overlap, or a link-bound one, gets the advice for the
reason whose transfers were exposed longest (prefetch: lookahead; demand: prefetch;
optimizer state, gradients, parameter copy-back: their placement). A link running above
its saved peak marks that peak stale instead of printing more than 100%.
"""
from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..units import format_duration, format_size
from ..errors import ConfigError
from ..overlap.speculative import PAUSE_AFTER
from . import intervals as iv
from .trace import TraceData, read_trace, tensor_label

# Peak-rate key (zerotier bench / planner.DEFAULT_RATES, bytes/s) that bounds each link.
LINK_PEAK = {"host->device": "h2d", "device->host": "d2h", "nvme->host": "nvme_read", "host->nvme": "nvme_write",
             "nvme->device": "nvme_read", "device->nvme": "nvme_write"}
RESOURCES = ("compute", "cpu-optimizer", "nvme", "pcie")        # verdict tie-break order
VERDICTS = {"compute": "compute-bound", "cpu-optimizer": "CPU-optimizer-bound", "nvme": "NVMe-bound",
            "pcie": "PCIe-bound"}
_RESOURCE_NAMES = {"compute": "compute", "cpu-optimizer": "CPU optimizer", "nvme": "NVMe", "pcie": "PCIe"}
_CPU_OPTIMIZER_HINT = "keep more optimizer state on the device, or give CPU Adam more cores (optimizer.threads)"
# [Note: advice follows the figures]: what to change when transfers of this reason are exposed
_REASON_ADVICE = {
    "prefetch": "prefetches arrive after compute needs them: raise prefetch.lookahead (or prefetch.max_bytes), "
                "or keep the most-used parameters on a faster tier",
    "demand": "compute fetched parameters itself (prefetch misses): raise prefetch.lookahead",
    "evict": "tensors were evicted to make room: raise that tier's budget",
    "optimizer-read": "the optimizer's state moves every step: keep it in host memory (offload.optimizer = "
                      "\"host\", or a {host, nvme} split) or use a faster drive",
    "optimizer-write": "the optimizer's state moves every step: keep it in host memory (offload.optimizer = "
                       "\"host\", or a {host, nvme} split) or use a faster drive",
    "grad-offload": "gradients leave the device as backward makes them: keep them on the device "
                    "(offload.gradients = \"device\") if it has room, or in host memory rather than on nvme",
    "param-copyback": "updated parameters are copied back after every step: keep parameters on the device "
                      "(offload.params = \"device\") if it has room",
}
_NO_PREFETCH_ADVICE = ("compute fetched every parameter itself and nothing was prefetched: turn prefetch on "
                       "(prefetch.enabled = true, prefetch.lookahead >= 1)")
# where a saved peak comes from, to re-measure a stale one
_BENCH_OF = {"h2d": "zerotier bench pcie", "d2h": "zerotier bench pcie",
             "nvme_read": "zerotier bench io --path DIR_ON_THE_DRIVE",
             "nvme_write": "zerotier bench io --path DIR_ON_THE_DRIVE", "cpu_adam": "zerotier bench adam"}
_COMPUTE_KINDS = {"forward", "backward", "device-optimizer"}
HIDDEN_PCT = 80.0  # compute-bound says "transfers are hidden" only from this overlap on
# On a CPU-only machine the "device" is a pool of RAM: its host<->device link is a memory copy, not PCIe.
_CPU_NAMES = {"pcie": "RAM copy"}
_CPU_VERDICTS = {"pcie": "copy-bound"}


def same_memory(link: str, device: str | None) -> bool:
    """[Note: same memory] On a CPU-only machine the "device" tier is a budgeted pool of host RAM, so
    a host<->device "transfer" is an in-memory copy, or none at all (the optimizer updated the
    parameters in place, a ZeRO-3 gather read the host shard where it lies), timed around whatever the
    engine did there. Its bytes / time is no link's bandwidth (a demo printed host->device 1206.81 GB/s):
    the table labels such a link "(same memory)" and gives it no GB/s, the plot leaves it out of
    the bandwidth panel. Its transfers, bytes and busy time still count (RAM copy in the verdict)."""
    return device == "cpu" and link in ("host->device", "device->host")


def _names(device: str | None) -> tuple[dict[str, str], dict[str, str]]:
    """(resource names, verdict names) for the machine the trace was taken on (meta "device")."""
    if device == "cpu":
        return {**_RESOURCE_NAMES, **_CPU_NAMES}, {**VERDICTS, **_CPU_VERDICTS}
    return _RESOURCE_NAMES, VERDICTS


@dataclass(frozen=True)
class LinkStats:
    link: str                   # "src->dst"
    transfers: int
    bytes: int
    busy_s: float               # union of this link's transfer intervals
    gbps: float | None          # bytes / busy_s, GB/s; None for a same-memory link (no bandwidth to speak of)
    peak_gbps: float | None     # this node's measured peak for the link, when known
    # host<->device on a CPU-only machine, where the device is host RAM: an in-memory copy or no copy
    # at all (parameters updated in place), never a link transfer ([Note: same memory])
    same_memory: bool = False

    @property
    def pct_of_peak(self) -> float | None:
        """Achieved share of the peak; above 100 the saved peak is stale (`peak_stale`), not exceeded."""
        return 100.0 * self.gbps / self.peak_gbps if self.peak_gbps and self.gbps is not None else None

    @property
    def peak_stale(self) -> bool:
        """The link ran faster than its saved peak: that figure is no peak (measured under load, on a
        different kind of I/O, or on another drive) and must be measured again."""
        return self.peak_gbps is not None and self.gbps is not None and self.gbps > self.peak_gbps


@dataclass(frozen=True)
class ReasonStats:
    reason: str
    transfers: int
    bytes: int
    stall_s: float
    exposed_s: float = 0.0      # summed transfer time not hidden under compute ([Note: verdict])


@dataclass(frozen=True)
class TensorStats:
    name: str                   # as recorded: the unit's key and the tensor ("u00003.exp_avg")
    role: str
    transfers: int
    bytes: int
    stall_s: float
    reasons: tuple[str, ...]
    label: str = ""             # as a reader knows it: "layers.3 (u00003).exp_avg" (trace.tensor_label)


@dataclass(frozen=True)
class TierResidency:
    tier: str
    peak_bytes: int
    budget_bytes: int           # the largest budget sampled
    samples: int

    @property
    def pct_of_budget(self) -> float | None:
        return 100.0 * self.peak_bytes / self.budget_bytes if self.budget_bytes else None


@dataclass(frozen=True)
class Summary:
    wall_s: float                              # profiled window: first to last X event
    transfers: int
    total_bytes: int
    transfer_s: float                          # summed durations of all transfers
    links: tuple[LinkStats, ...]               # by bytes, largest first
    reasons: tuple[ReasonStats, ...]           # in REASONS order, those that occurred
    stall_s: float                             # compute waiting on transfers
    overlap_pct: float | None                  # share of transfer_s hidden under compute (None: no transfers)
    prefetch_issued: int
    prefetch_hits: int
    prefetch_misses: int
    prefetch_wasted: int
    top_tensors: tuple[TensorStats, ...]       # by bytes moved
    residency: tuple[TierResidency, ...]
    busy_s: dict[str, float]                   # per resource of [Note: verdict]
    optimizer_params_per_s: float | None       # elements / duration of the optimizer spans that gave numel
    optimizer_peak_params_per_s: float | None  # cpu_adam peak, when known
    verdict: str                               # compute-bound / PCIe-bound (copy-bound on a CPU) / NVMe-bound /
    verdict_line: str                          # CPU-optimizer-bound
    device: str | None = None                  # "cuda" / "cpu": the machine the trace was taken on
    # every transfer since the profiler started (the figures above cover the events kept: profile.max_events);
    # None for a trace written before these were recorded
    run_transfers: int | None = None
    run_bytes: int | None = None
    run_links: tuple[tuple[str, int, int], ...] = ()   # (link, transfers, bytes), by bytes, largest first
    param_fetches: int = 0     # parameter fetches onto the device (prefetch + demand) of the whole run
    # the speculative step over the whole run ([Note: speculation counters] in events.py); zeros when it did
    # not run (or the trace predates it)
    speculation_windows: int = 0      # optimizer steps whose window speculated
    rolled_back_windows: int = 0      # of which rolled back
    speculated_units: int = 0
    rolled_back_units: int = 0
    undo_bytes: int = 0               # copied to make undo copies
    rollback_bytes: int = 0           # moved by rollbacks (restores, NVMe re-reads)
    rollback_s: float = 0.0           # seconds rollbacks and their redo took
    planned_rollback_rate: float | None = None  # what the run's plan assumed (None: not recorded / not speculating)
    trace: dict = field(default=None, compare=False, repr=False)  # what it was computed from (for plot)

    @property
    def prefetch_hit_rate(self) -> float | None:
        used = self.prefetch_hits + self.prefetch_misses
        return self.prefetch_hits / used if used else None

    @property
    def rollback_rate(self) -> float | None:
        """Windows rolled back / windows speculated (None: nothing was speculated)."""
        return self.rolled_back_windows / self.speculation_windows if self.speculation_windows else None

    def shares(self) -> dict[str, float]:
        """Busy share of the profiled window per resource, 0..1."""
        return {r: (t / self.wall_s if self.wall_s > 0 else 0.0) for r, t in self.busy_s.items()}

    def to_dict(self) -> dict:
        """Plain JSON-able form (the JSON summary)."""
        out = asdict(self)
        out.pop("trace")
        out["prefetch_hit_rate"] = self.prefetch_hit_rate
        out["rollback_rate"] = self.rollback_rate
        return out

    def plot(self, path: str, plan: dict | None = None) -> str:
        """PNG of where each step's time goes, bandwidth per link and residency per tier (needs matplotlib);
        with `plan` (a `zerotier plan --json`), its components beside the measured ones."""
        from .plot import plot_trace

        return plot_trace(self.trace, path, plan)

    def table(self) -> str:
        return _table(self)


def summarize(trace: dict, top: int = 10) -> Summary:
    """Summary of a trace dict (from `Profiler.trace()` or `load_trace(path)`)."""
    data = read_trace(trace)
    xs = data.transfers
    start_us, end_us = data.meta["window_us"]
    wall_us = end_us - start_us

    busy_us, hidden_under = _busy(data)
    peaks = data.meta.get("peak_rates") or {}
    by_link: dict[str, list[dict]] = defaultdict(list)
    for t in xs:
        by_link[f"{t['src']}->{t['dst']}"].append(t)
    links = []
    for link, items in by_link.items():
        nbytes = sum(t["bytes"] for t in items)
        busy = iv.length(iv.union((t["ts"], t["ts"] + t["dur"]) for t in items)) / 1e6
        peak = peaks.get(LINK_PEAK.get(link, ""))
        same = same_memory(link, data.meta.get("device"))
        links.append(LinkStats(link, len(items), nbytes, busy,
                               None if same else nbytes / busy / 1e9 if busy > 0 else 0.0,
                               None if same else peak / 1e9 if peak else None, same))
    links.sort(key=lambda s: (-s.bytes, s.link))

    hidden = [iv.overlap(t["ts"], t["ts"] + t["dur"], hidden_under(t["stream"])) for t in xs]
    exposed_us: dict[tuple[str, str], float] = defaultdict(float)   # (resource, reason) -> µs not hidden
    for t, h in zip(xs, hidden):
        exposed_us[_resource(t), t["reason"]] += t["dur"] - h
    order = {r: i for i, r in enumerate(data.meta["vocabulary"]["reasons"])}
    by_reason: dict[str, list[dict]] = defaultdict(list)
    for t in xs:
        by_reason[t["reason"]].append(t)
    reasons = tuple(ReasonStats(r, len(v), sum(t["bytes"] for t in v), sum(t["stall_us"] for t in v) / 1e6,
                                sum(e for (_, why), e in exposed_us.items() if why == r) / 1e6)
                    for r, v in sorted(by_reason.items(), key=lambda kv: order.get(kv[0], len(order))))

    by_tensor: dict[str, list[dict]] = defaultdict(list)
    for t in xs:
        by_tensor[t["tensor"]].append(t)
    units = data.meta.get("unit_names") or {}
    tensors = [TensorStats(name, v[0]["role"], len(v), sum(t["bytes"] for t in v),
                           sum(t["stall_us"] for t in v) / 1e6,
                           tuple(sorted({t["reason"] for t in v}, key=lambda r: order.get(r, len(order)))),
                           tensor_label(name, units))
               for name, v in by_tensor.items()]
    tensors.sort(key=lambda s: (-s.bytes, s.name))

    transfer_us = sum(t["dur"] for t in xs)
    hidden_us = sum(hidden)
    stall_us = sum(t["stall_us"] for t in xs) + sum(e - s for s, e, _, found, _ in data.stalls if not found)

    residency = tuple(TierResidency(tier, max(u for _, u, _ in v), max(b for _, _, b in v), len(v))
                      for tier, v in sorted(data.residency.items()))

    counted = [(e - s, n) for s, e, kind, n, _ in data.computes if kind == "optimizer" and n > 0]
    opt_us = sum(d for d, _ in counted)
    opt_rate = sum(n for _, n in counted) / (opt_us / 1e6) if opt_us > 0 else None
    pf = data.meta["prefetch"]
    busy_s = {r: busy_us[r] / 1e6 for r in RESOURCES}
    device = data.meta.get("device")
    overlap_pct = 100.0 * hidden_us / transfer_us if transfer_us > 0 else None
    totals = data.meta.get("run_totals")
    fetched = (sum(v["transfers"] for r, v in totals["by_reason"].items() if r in ("prefetch", "demand"))
               if totals is not None else sum(1 for t in xs if t["reason"] in ("prefetch", "demand")))
    verdict, line = _verdict(busy_s, wall_us / 1e6, device, overlap_pct,
                             {k: v / 1e6 for k, v in exposed_us.items()}, pf["issued"])
    run_links = () if totals is None else tuple(sorted(
        ((link, v["transfers"], v["bytes"]) for link, v in totals["by_link"].items()), key=lambda t: (-t[2], t[0])))
    return Summary(
        wall_s=wall_us / 1e6, transfers=len(xs), total_bytes=sum(t["bytes"] for t in xs), transfer_s=transfer_us / 1e6,
        links=tuple(links), reasons=reasons, stall_s=stall_us / 1e6,
        overlap_pct=overlap_pct,
        prefetch_issued=pf["issued"], prefetch_hits=pf["hits"], prefetch_misses=pf["misses"],
        prefetch_wasted=pf["wasted"], top_tensors=tuple(tensors[:top]), residency=residency, busy_s=busy_s,
        optimizer_params_per_s=opt_rate, optimizer_peak_params_per_s=peaks.get("cpu_adam"),
        verdict=verdict, verdict_line=line, device=device, trace=trace,
        run_transfers=None if totals is None else totals["transfers"],
        run_bytes=None if totals is None else totals["bytes"], run_links=run_links, param_fetches=fetched,
        **_speculation(data.meta))


def _speculation(meta: dict) -> dict:
    """The Summary's speculation fields from the trace's counters ([Note: speculation counters])."""
    sums = meta.get("speculation") or {}
    return {"speculation_windows": sums.get("windows", 0), "rolled_back_windows": sums.get("rolled_back_windows", 0),
            "speculated_units": sums.get("speculated_units", 0), "rolled_back_units": sums.get("rolled_back_units", 0),
            "undo_bytes": sums.get("undo_bytes", 0), "rollback_bytes": sums.get("rollback_bytes", 0),
            "rollback_s": float(sums.get("rollback_s", 0.0)), "planned_rollback_rate": meta.get("planned_rollback_rate")}


def _resource(t: dict) -> str:
    """The resource of [Note: verdict] a transfer keeps busy."""
    return "nvme" if "nvme" in (t["src"], t["dst"]) else "pcie"


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


def _busy(data: TraceData):
    """Busy µs per resource ([Note: verdict]) and, per stream, the compute time that hides its transfers.

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


# ---------------------------------------------------------------------------------------------
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


def _verdict(busy_s: dict[str, float], wall_s: float, device: str | None = None,
             overlap_pct: float | None = None, exposed_s: dict[tuple[str, str], float] | None = None,
             prefetch_issued: int = 0) -> tuple[str, str]:
    """[Note: verdict]: the resource with the largest busy time, and a hint that follows from the
    figures ([Note: advice follows the figures]). `exposed_s`: {(resource, reason): seconds of
    transfer time not hidden under compute}; empty when nothing moved."""
    if wall_s <= 0 or not any(busy_s.values()):
        return "no activity", "verdict: nothing recorded (no transfers or compute spans in the profiled window)"
    names, verdicts = _names(device)
    exposed_s = exposed_s or {}
    bound = max(RESOURCES, key=lambda r: (busy_s[r], -RESOURCES.index(r)))
    others = ", ".join(f"{names[r]} {100 * busy_s[r] / wall_s:.0f}%" for r in RESOURCES if r != bound)
    what = "transfers" if bound in ("nvme", "pcie") else "spans"
    if not exposed_s:  # nothing moved: say what bounds the step, no transfer advice
        hint = ("nothing moved between tiers, so there is no transfer to hide or tune: the step is "
                + ("compute alone" if bound == "compute" else f"the CPU optimizer's math; {_CPU_OPTIMIZER_HINT}"))
    elif bound == "cpu-optimizer":
        hint = _CPU_OPTIMIZER_HINT
    elif bound == "compute" and (overlap_pct is None or overlap_pct >= HIDDEN_PCT):
        hint = "transfers are hidden; more offload would cost little"
    elif bound == "compute":
        hint = (f"but only {overlap_pct:.0f}% of transfer time ran under compute: "
                + _transfer_advice(exposed_s, None, prefetch_issued, names))
    else:
        hint = _transfer_advice(exposed_s, bound, prefetch_issued, names)
    return verdicts[bound], (f"verdict: {verdicts[bound]}: {names[bound]} {what} busy "
                             f"{100 * busy_s[bound] / wall_s:.0f}% of the profiled {format_duration(wall_s)} ({others}); "
                             f"{hint}")


def _transfer_advice(exposed_s: dict[tuple[str, str], float], resource: str | None, prefetch_issued: int,
                     names: dict[str, str]) -> str:
    """Advice for the reason whose transfers (on `resource`, or on any link) were exposed longest."""
    by_reason: dict[str, float] = defaultdict(float)
    for (res, reason), seconds in exposed_s.items():
        if resource is None or res == resource:
            by_reason[reason] += seconds
    reason = max(by_reason, key=lambda r: (by_reason[r], r), default=None)
    if reason is None or by_reason[reason] <= 0:
        return "its transfers all ran under compute or the optimizer: none was exposed"
    advice = _NO_PREFETCH_ADVICE if reason == "demand" and prefetch_issued == 0 else _REASON_ADVICE[reason]
    where = f"{names[resource]} " if resource is not None else ""
    return f"most exposed: {reason} {where}transfers ({format_duration(by_reason[reason])}): {advice}"


# ---------------------------------------------------------------------------------------------
# Terminal table


def _table(s: Summary) -> str:
    pct = lambda v: "-" if v is None else f"{v:.0f}%"   # noqa: E731
    lines = [f"zerotier swap profile: {s.wall_s:.3f} s profiled, {s.transfers:,} transfers, "
             f"{format_size(s.total_bytes)} moved"]
    if s.run_transfers is not None and s.run_transfers > s.transfers:
        links = ", ".join(f"{link} {format_size(nbytes)}" for link, _, nbytes in s.run_links)
        lines.append(f"  whole run: {s.run_transfers:,} transfers, {format_size(s.run_bytes)} moved ({links}); "
                     f"the figures below cover the newest {s.transfers:,} (profile.max_events)")
    if s.links:
        label = lambda k: f"{k.link} (same memory)" if k.same_memory else k.link  # noqa: E731
        width = max(14, *(len(label(k)) for k in s.links))
        lines.append(f"  {'link':<{width}} {'transfers':>9} {'bytes':>11} {'busy ms':>9} {'GB/s':>7} {'peak GB/s':>9}"
                     f" {'of peak':>7}")
        for k in s.links:
            peak = f"{k.peak_gbps:.2f}" if k.peak_gbps else "-"
            gbps = "-" if k.gbps is None else f"{k.gbps:.2f}"
            lines.append(f"  {label(k):<{width}} {k.transfers:>9,} {format_size(k.bytes):>11} {1e3 * k.busy_s:>9.1f} "
                         f"{gbps:>7} {peak:>9} {'stale' if k.peak_stale else pct(k.pct_of_peak):>7}")
        if any(k.same_memory for k in s.links):
            lines.append("  note: on this CPU-only machine the device is host RAM: host<->device moves are in-memory "
                         "copies or none at all (parameters updated in place), not a link, so they have no GB/s")
        for k in s.links:
            if k.peak_stale:
                key = LINK_PEAK[k.link]
                lines.append(f"  note: {k.link} ran at {k.gbps:.2f} GB/s, above its saved peak of "
                             f"{k.peak_gbps:.2f} GB/s: that figure is stale (measured under load, on another "
                             f"drive, or by an older zerotier); measure again with `{_BENCH_OF[key]}`")
        lines.append(f"  {'reason':<15} {'transfers':>8} {'bytes':>11} {'stall ms':>9} {'exposed ms':>10}")
        for r in s.reasons:
            lines.append(f"  {r.reason:<15} {r.transfers:>8,} {format_size(r.bytes):>11} {1e3 * r.stall_s:>9.1f} "
                         f"{1e3 * r.exposed_s:>10.1f}")
    stall_pct = 100 * s.stall_s / s.wall_s if s.wall_s > 0 else 0.0
    overlap = "-" if s.overlap_pct is None else f"{s.overlap_pct:.1f}%"
    lines.append(f"  stall {format_duration(s.stall_s)} ({stall_pct:.1f}% of profiled time); "
                 f"overlap {overlap} of transfer time hidden under compute")
    rate = s.prefetch_hit_rate
    if s.param_fetches == 0 and not (s.prefetch_issued or s.prefetch_hits or s.prefetch_misses):
        lines.append("  prefetch: params on device: nothing to prefetch (no parameter was fetched onto it)")
    else:
        lines.append(f"  prefetch {s.prefetch_issued:,} issued, {s.prefetch_hits:,} hits, {s.prefetch_misses:,} "
                     f"misses ({'-' if rate is None else f'{100 * rate:.1f}%'} hit rate), {s.prefetch_wasted:,} "
                     "wasted")
    if s.optimizer_params_per_s is not None:
        peak = s.optimizer_peak_params_per_s
        vs = ""
        if peak and s.optimizer_params_per_s > peak:
            vs = (f" (above the saved cpu_adam peak of {peak / 1e6:,.0f} M: that figure is stale; measure again "
                  f"with `{_BENCH_OF['cpu_adam']}`)")
        elif peak:
            vs = f" ({100 * s.optimizer_params_per_s / peak:.0f}% of the cpu_adam peak {peak / 1e6:,.0f})"
        lines.append(f"  CPU optimizer {s.optimizer_params_per_s / 1e6:,.1f} M params/s{vs}")
    if s.speculation_windows:
        lines.append(speculation_line(s))
        warning = rollback_warning(s.rolled_back_windows, s.speculation_windows, s.planned_rollback_rate)
        if warning:
            lines.append(f"  {warning}")
    if s.residency:
        lines.append(f"  {'tier':<8} {'peak resident':>13} {'budget':>11} {'peak %':>7}")
        for r in s.residency:
            lines.append(f"  {r.tier:<8} {format_size(r.peak_bytes):>13} {format_size(r.budget_bytes):>11} "
                         f"{pct(r.pct_of_budget):>7}")
    if s.top_tensors:
        lines.append(f"  top {len(s.top_tensors)} tensors by traffic")
        width = max(20, *(len(t.label or t.name) for t in s.top_tensors))
        lines.append(f"  {'#':>3}  {'tensor':<{width}} {'role':<11} {'transfers':>9} {'bytes':>11} {'stall ms':>9}  "
                     "reasons")
        for i, t in enumerate(s.top_tensors, 1):
            lines.append(f"  {i:>3}  {t.label or t.name:<{width}} {t.role:<11} {t.transfers:>9,} {format_size(t.bytes):>11} "
                         f"{1e3 * t.stall_s:>9.1f}  {', '.join(t.reasons)}")
    shares = s.shares()
    names, _ = _names(s.device)
    lines.append("  busy " + ", ".join(f"{names[r]} {100 * shares[r]:.0f}%" for r in RESOURCES)
                 + " of profiled time")
    lines.append(s.verdict_line)
    return "\n".join(lines)


def speculation_line(s: Summary) -> str:
    """The speculative step's line of the table: the rollback rate and what rollbacks cost."""
    rolled = s.rolled_back_windows
    cost = (f"; rollbacks moved {format_size(s.rollback_bytes)} and took {format_duration(s.rollback_s)} "
            f"({format_duration(s.rollback_s / rolled)} each)" if rolled else "")
    planned = "" if s.planned_rollback_rate is None else f" (the plan assumed {100 * s.planned_rollback_rate:.1f}%)"
    return (f"  speculative step: {s.speculation_windows:,} windows speculated ({s.speculated_units:,} units), "
            f"{rolled:,} rolled back: rollback rate {100 * s.rollback_rate:.1f}%{planned}; undo copies "
            f"{format_size(s.undo_bytes)}{cost}")


FAR_OFF = 3.0  # a measured rollback rate above this many times the plan's is warned about


def rollback_warning(rolled: int, windows: int, planned: float | None) -> str | None:
    """A warning and what to do when the speculative step rolled back far more often (> FAR_OFF x) than
    the plan assumed ([Note: speculation in the plan] in planner.py: 1% by default), so the plan's
    expected step is optimistic; None when it did not, or nothing is known to compare."""
    if not windows or planned is None or rolled / windows <= FAR_OFF * planned:
        return None
    rate = rolled / windows
    times = f"{rate / planned:.1f}x" if planned > 0 else "above"
    return (f"warning: {100 * rate:.1f}% of the speculated windows rolled back ({rolled:,} of {windows:,}), {times} the "
            f"{100 * planned:.1f}% the plan assumed: its expected step is optimistic (a rollback restores the state and "
            f"redoes the update). Clipping or a loss-scale overflow fires often on a fresh model and in warm-up "
            f"(train.speculative_step = \"auto\" pauses after {PAUSE_AFTER} rollbacks in a row); if it keeps firing, set "
            f"train.speculative_step = false, or plan at the measured rate: zerotier.plan(..., rollback_rate={rate:.2f}) "
            f"or `zerotier plan --rollback-rate {rate:.2f}`")


# [Note: measured against the plan]
# `zerotier profile TRACE --plan PLAN.json` (a `zerotier plan --json` or Plan.to_dict()) puts
# each component of the plan's breakdown ([Note: step-time prediction] in predict.py) beside
# the same work measured in the trace, per step (the window's totals over its steps):
#   forward / backward / optimizer   compute spans of that kind (optimizer: CPU or device)
#   params_h2d / params_nvme         prefetch and demand transfers: to the device / from nvme
#   grads_d2h / grads_nvme           grad-offload transfers: device->host / to or from nvme
#   optimizer_nvme                   optimizer-read and optimizer-write transfers
#   params_copyback                  param-copyback transfers
# Transfer seconds are the union of their spans (concurrent transfers count once), so a
# component's figure is the time its resource was busy with it, as the plan's seconds are.
# The verdict names the component furthest from the plan in seconds: the one whose rate or
# overlap the prediction got most wrong. Components the trace does not time (grad_norm: inside
# the step, not a span of its own) are listed with the plan's figure only, as is the speculative
# step's undo copies and restores (speculation: inside the optimizer's spans); its rollback rate
# is compared beside ([Note: speculation counters], speculation_comparison).


_UNTIMED = ("grad_norm", "speculation")  # plan components the trace has no span of


def _component(t: dict) -> str | None:
    reason, src, dst = t["reason"], t["src"], t["dst"]
    if reason in ("prefetch", "demand"):
        return "params_nvme" if src == "nvme" else "params_h2d"
    if reason == "grad-offload":
        return "grads_nvme" if "nvme" in (src, dst) else "grads_d2h"
    if reason in ("optimizer-read", "optimizer-write"):
        return "optimizer_nvme"
    if reason == "param-copyback":
        return "params_nvme" if dst == "nvme" else "params_copyback"
    return None


def measured_components(trace: dict) -> tuple[dict[str, float], int]:
    """[Note: measured against the plan] Seconds per step of each plan component, and the steps."""
    data = read_trace(trace)
    steps = max(1, len(step_times(trace)))
    spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for s, e, kind, _, _ in data.computes:
        name = {"forward": "forward", "backward": "backward", "optimizer": "optimizer",
                "device-optimizer": "optimizer"}.get(kind)
        if name is not None:
            spans[name].append((s, e))
    for t in data.transfers:
        name = _component(t)
        if name is not None:
            spans[name].append((t["ts"], t["ts"] + t["dur"]))
    return {name: iv.length(iv.union(v)) / 1e6 / steps for name, v in spans.items()}, steps


_PLAN_SECONDS = 1e9  # a plan's seconds lie in [0, this]: a step of 30 years is not a plan


def load_plan(path: str) -> dict:
    """A `zerotier plan --json` file for `zerotier profile --plan`, checked for what plan_comparison
    and speculation_comparison read: ConfigError naming the file, the key and what is expected."""
    def fail(key: str, expected: str, value) -> ConfigError:
        return ConfigError(f"--plan {path}: {key}: expected {expected}, got {value!r}; pass the output of "
                           "`zerotier plan --json` (made with `zerotier bench` results) for this run")

    def seconds(key: str, value, optional: bool = False) -> None:
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
              and 0 <= value <= _PLAN_SECONDS)  # NaN fails the comparison
        if not ok and not (optional and value is None):
            raise fail(key, f"seconds, a number from 0 to {_PLAN_SECONDS:g}" + (" or null" if optional else ""), value)

    try:
        plan = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--plan: cannot read {path}: {exc}") from None
    if not isinstance(plan, dict):
        raise fail("the file", "a JSON object", type(plan).__name__)
    breakdown = plan.get("breakdown_s")
    if not isinstance(breakdown, dict) or not breakdown:
        raise fail("breakdown_s", "an object of seconds per component (a plan made without `zerotier bench` "
                   "results has none)", breakdown)
    for name, value in breakdown.items():
        seconds(f"breakdown_s.{name}", value)
    seconds("predicted_step_s", plan.get("predicted_step_s"), optional=True)
    if not isinstance(plan.get("speculative"), (bool, type(None))):
        raise fail("speculative", "true, false or null", plan["speculative"])
    rate = plan.get("rollback_rate")
    if rate is not None and not (isinstance(rate, (int, float)) and not isinstance(rate, bool) and 0 <= rate <= 1):
        raise fail("rollback_rate", "a share from 0 to 1 or null", rate)
    cases = plan.get("speculation_step_s")
    if not isinstance(cases, (dict, type(None))):
        raise fail("speculation_step_s", "an object of seconds (commit, rollback, without) or null", cases)
    for case in ("commit", "rollback", "without") if cases else ():
        seconds(f"speculation_step_s.{case}", cases.get(case))
    return plan


def plan_comparison(trace: dict, plan: dict) -> tuple[list[tuple[str, float, float | None]], str]:
    """Rows (component, planned s, measured s or None) and the verdict line naming the component
    furthest from the plan ([Note: measured against the plan])."""
    planned = plan.get("breakdown_s") or {}
    measured, steps = measured_components(trace)
    rows = [(name, float(planned.get(name, 0.0)), measured.get(name))
            for name in dict.fromkeys([*planned, *measured])
            if planned.get(name, 0.0) > 0 or measured.get(name, 0.0) > 0]
    timed = [(name, p, m) for name, p, m in rows if m is not None or name not in _UNTIMED]
    if not timed:
        return rows, "plan: nothing to compare (no component in the plan or the trace)"
    name, p, m = max(timed, key=lambda r: abs((r[2] or 0.0) - r[1]))
    walls = sorted(s.wall_s for s in step_times(trace))
    step = walls[len(walls) // 2] if walls else None
    predicted = plan.get("predicted_step_s")
    head = (f"plan: step measured {format_duration(step)} (median of {steps}) vs predicted "
            f"{format_duration(predicted)}; " if step is not None and predicted else "plan: ")
    return rows, (head + f"furthest from the plan: {name}, measured {format_duration(m or 0.0)} per step vs "
                  f"planned {format_duration(p)}")


def plan_table(rows: list[tuple[str, float, float | None]], line: str) -> str:
    out = [f"  {'component':16s} {'planned':>10s} {'measured':>10s}"]
    for name, p, m in rows:
        out.append(f"  {name:16s} {format_duration(p):>10s} {format_duration(m) if m is not None else '-':>10s}")
    return "\n".join(out + [line])


def speculation_comparison(trace: dict, plan: dict) -> str | None:
    """The rollback rate measured in the trace beside the one the plan assumed ([Note: speculation
    in the plan] in planner.py), and the plan's expected step at the measured rate; None when
    neither the plan nor the run speculated."""
    sums = _speculation(trace["zerotier"])
    windows, rolled = sums["speculation_windows"], sums["rolled_back_windows"]
    planned = plan.get("speculative")
    if not planned and not windows:
        return None
    rate = rolled / windows if windows else None
    measured = (f"rollback rate measured {100 * rate:.1f}% ({rolled:,} of {windows:,} windows)" if windows else
                "no window speculated in the trace (speculation off, paused after rollbacks, or not profiled)")
    if not planned:
        return f"plan: speculative step off in the plan, on in the run: {measured}"
    r = float(plan.get("rollback_rate") or 0.0)
    line = f"plan: {measured} vs planned {100 * r:.1f}%"
    cases = plan.get("speculation_step_s") or {}
    if rate is not None and "commit" in cases and "rollback" in cases:
        at = (1 - rate) * cases["commit"] + rate * cases["rollback"]
        line += (f"; at the measured rate the plan expects {format_duration(at)} per step (commit "
                 f"{format_duration(cases['commit'])}, rollback {format_duration(cases['rollback'])}, without "
                 f"speculation {format_duration(cases['without'])})")
    warning = rollback_warning(rolled, windows, r)
    return line + (f"\nplan: {warning}" if warning else "")
