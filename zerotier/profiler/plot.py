"""PNG of a trace: where each step's time goes, bandwidth per link, residency per tier.

Three rows, read top to bottom:

  1. a stacked bar per step: compute, stall, CPU optimizer, exposed transfer and other
     ([Note: step time] in summary.py): the parts add up to the step's wall time;
  2. bandwidth per link over time (dotted: the link's saved peak), compute shaded grey;
  3. residency per tier, one panel each on its own linear scale, against its budget (a budget
     far above what was resident is written in the title instead of squashing the curve).

Legends sit outside the axes, so they cover no data. matplotlib is an optional extra
(`pip install 'zerotier-offload[plot]'`). The figure is drawn with the object API on the Agg canvas,
so no pyplot state or GUI backend is touched.
"""
from __future__ import annotations

from ..config import format_size
from ..errors import ZerotierError
from .intervals import union
from .summary import LINK_PEAK, same_memory, step_times
from .trace import bandwidth_series, read_trace

_TIER_COLORS = {"device": "tab:green", "host": "tab:blue", "nvme": "tab:orange"}
# (StepTime field, legend label, colour): bottom to top of each bar
_PARTS = (("compute_s", "compute", "tab:green"), ("stall_s", "stall (compute waits on a transfer)", "tab:red"),
          ("cpu_optimizer_s", "CPU optimizer", "tab:purple"),
          ("exposed_transfer_s", "exposed transfer (nothing else runs)", "tab:orange"),
          ("other_s", "other (Python, hooks, idle)", "0.75"))
_BUDGET_SHOWN = 4.0   # a budget up to this many times the panel's peak is drawn; a larger one is only named
_LEGEND = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "fontsize": "small", "borderaxespad": 0.0}


def load_matplotlib():
    """matplotlib's Figure and Agg canvas classes, else a ZerotierError saying how to install it
    (`zerotier profile --plot` asks first, so it fails before the report, not after)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ZerotierError("plotting the profile needs matplotlib: pip install matplotlib "
                            "(or pip install 'zerotier-offload[plot]')") from None
    return Figure, FigureCanvasAgg


def plot_trace(trace: dict, path: str) -> str:
    """Draw `trace` (Profiler.trace() or load_trace()) to the PNG `path`; returns `path`."""
    Figure, FigureCanvasAgg = load_matplotlib()
    data = read_trace(trace)
    tiers = sorted(data.residency, key=lambda t: (list(_TIER_COLORS).index(t) if t in _TIER_COLORS else 9, t))
    fig = Figure(figsize=(11, 9.5), layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(3, max(1, len(tiers)), height_ratios=(1.1, 1.0, 0.8))
    _steps(fig.add_subplot(grid[0, :]), trace)
    _bandwidth(fig.add_subplot(grid[1, :]), data)
    if tiers:
        for i, tier in enumerate(tiers):
            _residency(fig.add_subplot(grid[2, i]), tier, data)
    else:
        ax = fig.add_subplot(grid[2, :])
        ax.set_axis_off()
        ax.text(0.5, 0.5, "no residency samples", transform=ax.transAxes, ha="center", va="center")
    try:
        fig.savefig(path, format="png", dpi=80)
    except OSError as exc:
        raise ZerotierError(f"cannot write the profile plot to {path}: {exc.strerror or exc}") from None
    return path


def _steps(ax, trace: dict) -> None:
    steps = step_times(trace)
    scale, unit = (1.0, "s") if max((s.wall_s for s in steps), default=0) >= 1 else (1e3, "ms")
    x = range(1, len(steps) + 1)
    bottom = [0.0] * len(steps)
    for field, label, color in _PARTS:
        heights = [scale * getattr(s, field) for s in steps]
        ax.bar(x, heights, bottom=bottom, color=color, label=label, width=0.8 if len(steps) > 1 else 0.4)
        bottom = [b + h for b, h in zip(bottom, heights)]
    total = sum(s.wall_s for s in steps) or 1.0
    shares = ", ".join(f"{label.split(' (')[0]} {100 * sum(getattr(s, field) for s in steps) / total:.0f}%"
                       for field, label, _ in _PARTS)
    ax.set_title(f"where step time goes ({len(steps)} step{'s' if len(steps) != 1 else ''}: {shares})",
                 fontsize="medium")
    ax.set_xlabel("step")
    ax.set_ylabel(f"wall time ({unit})")
    ax.set_xlim(0.4, len(steps) + 0.6)
    if len(steps) <= 20:
        ax.set_xticks(list(x))
    ax.legend(**_LEGEND)


def _bandwidth(ax, data) -> None:
    start_us, end_us = data.meta["window_us"]
    bin_us = data.meta["bandwidth_bin_us"]
    peaks = data.meta.get("peak_rates") or {}
    series = bandwidth_series(data.transfers, start_us, bin_us)
    same = [link for link in series if same_memory(link, data.meta.get("device"))]  # [Note: same memory]
    for link, points in series.items():
        if link in same:
            continue
        line, = ax.step([(ts - start_us) / 1e6 for ts, _ in points], [gbps for _, gbps in points], where="post",
                        label=link, linewidth=1.2)
        peak = peaks.get(LINK_PEAK.get(link, ""))
        if peak:
            ax.axhline(peak / 1e9, color=line.get_color(), linestyle=":", linewidth=1,
                       label=f"{link} saved peak {peak / 1e9:.2f} GB/s")
    for s, e in union((s, e) for s, e, kind, *_ in data.computes if kind != "step")[:2000]:
        ax.axvspan((s - start_us) / 1e6, (e - start_us) / 1e6, color="0.92", zorder=0, linewidth=0)
    ax.set_ylabel("GB/s")
    ax.set_xlabel("seconds since the first recorded event")
    left_out = f"; {', '.join(same)}: same memory, not drawn" if same else ""
    ax.set_title(f"bandwidth per link ({bin_us / 1e3:.1f} ms bins; grey: compute running{left_out})", fontsize="medium")
    ax.set_xlim(0, max((end_us - start_us) / 1e6, 1e-6))
    ax.set_ylim(bottom=0)
    if data.transfers:
        ax.legend(**_LEGEND)
    else:
        ax.text(0.5, 0.5, "no transfers between tiers", transform=ax.transAxes, ha="center", va="center")


def _residency(ax, tier: str, data) -> None:
    start_us, end_us = data.meta["window_us"]
    points = data.residency[tier]
    points = points + [(max(end_us, points[-1][0]), *points[-1][1:])]  # hold the last sample to the end
    peak = max(used for _, used, _ in points)
    budget = max(b for _, _, b in points)
    top = max(peak, 1)
    unit, size = next((u, s) for u, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1)) if top >= s)
    t = [(ts - start_us) / 1e6 for ts, _, _ in points]
    color = _TIER_COLORS.get(tier, "tab:gray")
    ax.fill_between(t, [used / size for _, used, _ in points], step="post", color=color, alpha=0.35, linewidth=0)
    ax.step(t, [used / size for _, used, _ in points], where="post", color=color, linewidth=1.2)
    pct = f" ({100 * peak / budget:.0f}%)" if budget else ""
    if budget and budget <= _BUDGET_SHOWN * top:
        ax.step(t, [b / size for _, _, b in points], where="post", color="black", linestyle="--", linewidth=1)
        ax.set_ylim(0, 1.08 * budget / size)
        note = "dashed: budget"
    else:
        ax.set_ylim(0, 1.15 * top / size)
        note = "budget off this scale" if budget else "no budget"
    ax.set_title(f"{tier}: peak {format_size(peak)} of {format_size(budget)}{pct}\n({note})", fontsize="small")
    ax.set_ylabel(f"resident ({unit})")
    ax.set_xlabel("seconds")
    ax.set_xlim(0, max((end_us - start_us) / 1e6, 1e-6))
