"""PNG of a trace: where each step's time goes, bandwidth per link, residency per tier.

Three rows, read top to bottom:

  1. a stacked bar per step: compute, stall, CPU optimizer, exposed transfer and other
     ([Note: step time] in spans.py): the parts add up to the step's wall time; a red
     triangle over a bar marks a step whose speculation was rolled back. With a plan
     (`zerotier profile --plot --plan`), a panel beside it: each component's planned and
     measured seconds per step (versus_plan.plan_comparison);
  2. bandwidth per link over time, each link its own colour and line style (dotted: its saved
     peak), compute running as a thin band along the bottom, not a full-height fill;
  3. residency per tier, one panel each on its own linear scale, against its budget (a budget
     far above what was resident is written in the title instead of squashing the curve).

The time panels (2, 3) mark step boundaries (grey vertical lines) and the speculative step's
rollbacks (red: triangles along the top of the bandwidth panel, dotted lines in residency).
Legends sit outside the axes, so they cover no data. matplotlib is an optional extra
(`pip install 'zerotier-offload[plot]'`). The figure is drawn with the object API on the Agg canvas,
so no pyplot state or GUI backend is touched. `figure()` builds it (tests read its artists by
`gid`), `plot_trace()` writes it.
"""
from __future__ import annotations

from ..units import format_size
from ..errors import ZerotierError
from .intervals import union
from .schema import LINK_PEAK, same_memory
from .spans import step_times
from .trace import bandwidth_series, read_trace
from .versus_plan import plan_comparison

_TIER_COLORS = {"device": "tab:green", "host": "tab:blue", "nvme": "tab:orange"}
# (StepTime field, legend label, colour): bottom to top of each bar
_PARTS = (("compute_s", "compute", "tab:green"), ("stall_s", "stall (compute waits on a transfer)", "tab:red"),
          ("cpu_optimizer_s", "CPU optimizer", "tab:purple"),
          ("exposed_transfer_s", "exposed transfer (nothing else runs)", "tab:orange"),
          ("other_s", "other (Python, hooks, idle)", "0.75"))
# one (colour, line style, width) per link, busiest first: overlapping series stay apart (dotted is the peaks')
_LINK_STYLES = (("tab:blue", "-", 2.2), ("tab:orange", "--", 1.8), ("tab:green", "-.", 1.6),
                ("tab:red", (0, (5, 1, 1, 1, 1, 1)), 1.4), ("tab:brown", (0, (8, 2)), 1.3), ("tab:pink", "-", 1.0))
_COMPUTE_BAND = 0.035  # height of the compute band, as a share of the bandwidth panel
_BUDGET_SHOWN = 4.0   # a budget up to this many times the panel's peak is drawn; a larger one is only named
_LEGEND = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "fontsize": "small", "borderaxespad": 0.0}
_ROLLBACK = {"color": "tab:red", "label": "speculation rolled back", "gid": "rollback"}
_BOUNDARY = {"color": "0.35", "linewidth": 0.8, "alpha": 0.7, "zorder": 1, "gid": "step-boundary"}


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


def plot_trace(trace: dict, path: str, plan: dict | None = None) -> str:
    """Draw `trace` (Profiler.trace() or load_trace()) to the PNG `path`; returns `path`. `plan`: a
    `zerotier plan --json` (versus_plan.load_plan) whose components are drawn beside the measured ones."""
    fig = figure(trace, plan)
    try:
        fig.savefig(path, format="png", dpi=80)
    except OSError as exc:
        raise ZerotierError(f"cannot write the profile plot to {path}: {exc.strerror or exc}") from None
    return path


def figure(trace: dict, plan: dict | None = None):
    """The matplotlib Figure plot_trace writes (on an Agg canvas)."""
    Figure, FigureCanvasAgg = load_matplotlib()
    data = read_trace(trace)
    tiers = sorted(data.residency, key=lambda t: (list(_TIER_COLORS).index(t) if t in _TIER_COLORS else 9, t))
    fig = Figure(figsize=(12 if plan is not None else 11, 9.5), layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(3, max(1, len(tiers)), height_ratios=(1.1, 1.0, 0.8))
    steps = step_times(trace)
    start_us = data.meta["window_us"][0]
    rollbacks = [(e["ts"] - start_us) / 1e6 for e in trace["traceEvents"]
                 if e.get("cat") == "speculation" and e.get("name") == "speculation rolled back"]
    boundaries = [s.start_s for s in steps[1:]]
    if plan is None:
        _steps(fig.add_subplot(grid[0, :]), steps, rollbacks)
    else:
        top = grid[0, :].subgridspec(1, 2, width_ratios=(1.6, 1.0))
        _steps(fig.add_subplot(top[0, 0]), steps, rollbacks, narrow=True)
        _plan(fig.add_subplot(top[0, 1]), *plan_comparison(trace, plan))
    _bandwidth(fig.add_subplot(grid[1, :]), data, boundaries, rollbacks)
    if tiers:
        for i, tier in enumerate(tiers):
            _residency(fig.add_subplot(grid[2, i]), tier, data, boundaries, rollbacks)
    else:
        ax = fig.add_subplot(grid[2, :])
        ax.set_axis_off()
        ax.text(0.5, 0.5, "no residency samples", transform=ax.transAxes, ha="center", va="center")
    return fig


def _marks(ax, boundaries: list[float], rollbacks: list[float], top_markers: bool) -> None:
    """Step boundaries as grey vertical lines; rollbacks as red triangles along the top (top_markers) or
    dotted red lines."""
    for k, x in enumerate(boundaries):
        ax.axvline(x, label="step boundary" if k == 0 else None, **_BOUNDARY)
    if rollbacks and top_markers:
        ax.plot(rollbacks, [1.0] * len(rollbacks), marker="v", markersize=8, linestyle="none", clip_on=False,
                transform=ax.get_xaxis_transform(), zorder=5, **_ROLLBACK)
    elif rollbacks:
        for k, x in enumerate(rollbacks):
            ax.axvline(x, linestyle=":", linewidth=1.2, zorder=4,
                       **(_ROLLBACK if k == 0 else {**_ROLLBACK, "label": None}))


def _steps(ax, steps: list, rollbacks: list[float], narrow: bool = False) -> None:
    scale, unit = (1.0, "s") if max((s.wall_s for s in steps), default=0) >= 1 else (1e3, "ms")
    x = range(1, len(steps) + 1)
    bottom = [0.0] * len(steps)
    for field, label, color in _PARTS:
        heights = [scale * getattr(s, field) for s in steps]
        ax.bar(x, heights, bottom=bottom, color=color, label=label, width=0.8 if len(steps) > 1 else 0.4)
        bottom = [b + h for b, h in zip(bottom, heights)]
    rolled = sorted({k for t in rollbacks for k, s in enumerate(steps, 1)
                     if s.start_s <= t < s.start_s + s.wall_s or (k == len(steps) and t >= s.start_s)})
    if rolled:
        ax.plot(rolled, [bottom[k - 1] for k in rolled], marker="v", markersize=9, linestyle="none",
                **{**_ROLLBACK, "label": "step with a rolled-back speculation"})
    total = sum(s.wall_s for s in steps) or 1.0
    parts = [f"{label.split(' (')[0]} {100 * sum(getattr(s, field) for s in steps) / total:.0f}%"
             for field, label, _ in _PARTS]
    count = f"{len(steps)} step{'s' if len(steps) != 1 else ''}"
    if narrow:  # beside the plan panel: the shares on two lines of their own
        ax.set_title(f"where step time goes ({count})\n{', '.join(parts[:3])},\n{', '.join(parts[3:])}",
                     fontsize="medium")
    else:
        ax.set_title(f"where step time goes ({count}: {', '.join(parts)})", fontsize="medium")
    ax.set_xlabel("step")
    ax.set_ylabel(f"wall time ({unit})")
    ax.set_xlim(0.4, len(steps) + 0.6)
    ax.set_ylim(0, 1.1 * max(bottom, default=0) or 1)
    if len(steps) <= 20:
        ax.set_xticks(list(x))
    ax.legend(**_LEGEND)


def _plan(ax, rows: list[tuple[str, float, float | None]], line: str) -> None:
    """Planned beside measured seconds per step, one pair of bars per component (versus_plan.plan_comparison)."""
    rows = rows[::-1]  # the plan's order, top to bottom
    y = range(len(rows))
    top = max([p for _, p, _ in rows] + [m or 0.0 for _, _, m in rows] + [1e-9])
    scale, unit = (1.0, "s") if top >= 1 else (1e3, "ms")
    ax.barh([k + 0.2 for k in y], [scale * p for _, p, _ in rows], height=0.4, color="0.7", hatch="//",
            edgecolor="0.4", linewidth=0.5, label="planned", gid="plan-planned")
    ax.barh([k - 0.2 for k in y], [scale * (m or 0.0) for _, _, m in rows], height=0.4, color="tab:blue",
            label="measured", gid="plan-measured")
    for k, (_, _, m) in zip(y, rows):
        if m is None:  # a component the trace has no span of
            ax.text(0, k - 0.2, " not timed", va="center", fontsize="x-small", color="0.3")
    ax.set_yticks(list(y), [name for name, _, _ in rows], fontsize="small")
    ax.set_xlabel(f"per step ({unit})")
    furthest = line.split("furthest from the plan: ")[-1].split(",")[0] if "furthest" in line else None
    ax.set_title("planned vs measured" + (f" (furthest: {furthest})" if furthest else ""), fontsize="medium")
    ax.legend(fontsize="small", loc="lower right")


def _bandwidth(ax, data, boundaries: list[float], rollbacks: list[float]) -> None:
    start_us, end_us = data.meta["window_us"]
    bin_us = data.meta["bandwidth_bin_us"]
    peaks = data.meta.get("peak_rates") or {}
    series = bandwidth_series(data.transfers, start_us, bin_us)
    same = [link for link in series if same_memory(link, data.meta.get("device"))]  # [Note: same memory]
    drawn = sorted((link for link in series if link not in same), key=lambda link: -sum(g for _, g in series[link]))
    for k, link in enumerate(drawn):
        color, style, width = _LINK_STYLES[k % len(_LINK_STYLES)]
        points = series[link]
        ax.step([(ts - start_us) / 1e6 for ts, _ in points], [gbps for _, gbps in points], where="post",
                label=link, color=color, linestyle=style, linewidth=width, gid=f"link {link}", zorder=3)
        peak = peaks.get(LINK_PEAK.get(link, ""))
        if peak:
            ax.axhline(peak / 1e9, color=color, linestyle=":", linewidth=1, zorder=2,
                       label=f"{link} saved peak {peak / 1e9:.2f} GB/s")
    spans = [((s - start_us) / 1e6, (e - s) / 1e6)
             for s, e in union((s, e) for s, e, kind, *_ in data.computes if kind != "step")[:2000]]
    if spans:  # a thin band along the bottom: the series above it stay readable
        ax.broken_barh(spans, (0, _COMPUTE_BAND), transform=ax.get_xaxis_transform(), color="0.55", linewidth=0,
                       label="compute running", gid="compute-band", zorder=2)
    _marks(ax, boundaries, rollbacks, top_markers=True)
    ax.set_ylabel("GB/s")
    ax.set_xlabel("seconds since the first recorded event")
    left_out = f"; {', '.join(same)}: same memory, not drawn" if same else ""
    ax.set_title(f"bandwidth per link ({bin_us / 1e3:.1f} ms bins; grey band: compute running{left_out})",
                 fontsize="medium")
    ax.set_xlim(0, max((end_us - start_us) / 1e6, 1e-6))
    top = ax.get_ylim()[1]  # 0 GB/s just above the compute band, so the band hides no series
    ax.set_ylim(-top * 1.4 * _COMPUTE_BAND / (1 - 1.4 * _COMPUTE_BAND), top)
    if not drawn:
        ax.text(0.5, 0.5, "no transfers between tiers" + (" (only same-memory moves)" if same else ""),
                transform=ax.transAxes, ha="center", va="center")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**_LEGEND)


def _residency(ax, tier: str, data, boundaries: list[float], rollbacks: list[float]) -> None:
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
    _marks(ax, boundaries, rollbacks, top_markers=False)
    ax.set_ylabel(f"resident ({unit})")
    ax.set_xlabel("seconds")
    ax.set_xlim(0, max((end_us - start_us) / 1e6, 1e-6))
