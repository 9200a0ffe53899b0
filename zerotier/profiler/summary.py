"""The summary of a trace: bytes and bandwidth per link, stalls, overlap, prefetch, residency, verdict.

Computed from the trace dict alone (`summarize(trace)`), so a saved trace gives the
same Summary as the live Profiler. Times are seconds, bandwidths GB/s (1e9 bytes/s).

The verdict and its advice: verdict.py ([Note: verdict]); busy spans and each step's split:
spans.py; the run beside its plan: versus_plan.py.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field

from ..units import format_duration, format_size
from . import intervals as iv
from .plot import plot_trace
from .schema import LINK_PEAK, same_memory, speculation_sums
from .spans import busy_time
from .trace import read_trace, tensor_label
from .verdict import RESOURCES, resource_names, verdict
from .versus_plan import rollback_warning

# where a saved peak comes from, to re-measure a stale one
_BENCH_OF = {"h2d": "zerotier bench pcie", "d2h": "zerotier bench pcie",
             "nvme_read": "zerotier bench io --path DIR_ON_THE_DRIVE",
             "nvme_write": "zerotier bench io --path DIR_ON_THE_DRIVE", "cpu_adam": "zerotier bench adam"}


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
        return plot_trace(self.trace, path, plan)

    def table(self) -> str:
        return _table(self)


def summarize(trace: dict, top: int = 10) -> Summary:
    """Summary of a trace dict (from `Profiler.trace()` or `load_trace(path)`)."""
    data = read_trace(trace)
    xs = data.transfers
    start_us, end_us = data.meta["window_us"]
    wall_us = end_us - start_us

    busy_us, hidden_under = busy_time(data)
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
    bound, line = verdict(busy_s, wall_us / 1e6, device, overlap_pct,
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
        verdict=bound, verdict_line=line, device=device, trace=trace,
        run_transfers=None if totals is None else totals["transfers"],
        run_bytes=None if totals is None else totals["bytes"], run_links=run_links, param_fetches=fetched,
        **speculation_sums(data.meta))


def _resource(t: dict) -> str:
    """The resource of [Note: verdict] a transfer keeps busy."""
    return "nvme" if "nvme" in (t["src"], t["dst"]) else "pcie"


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
    names, _ = resource_names(s.device)
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
