"""PNG of a trace: residency per tier against its budget, and bandwidth per link, over time.

matplotlib is an optional extra (`pip install 'zerotier-offload[plot]'`). The figure is drawn
with the object API on the Agg canvas, so no pyplot state or GUI backend is touched.
"""
from __future__ import annotations

from ..errors import ZerotierError
from .intervals import union
from .trace import bandwidth_series, read_trace

_TIER_COLORS = {"device": "tab:green", "host": "tab:blue", "nvme": "tab:orange"}


def plot_trace(trace: dict, path: str) -> str:
    """Draw `trace` (Profiler.trace() or load_trace()) to the PNG `path`; returns `path`."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ZerotierError("plotting the profile needs matplotlib: pip install matplotlib "
                            "(or pip install 'zerotier-offload[plot]')") from None
    data = read_trace(trace)
    start_us, end_us = data.meta["window_us"]
    fig = Figure(figsize=(10, 6.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax_res, ax_bw = fig.subplots(2, 1, sharex=True)

    top = max((max(used, budget) for points in data.residency.values() for _, used, budget in points), default=0)
    unit, scale = ("GiB", 2**30) if top >= 2**30 else ("MiB", 2**20)
    for tier, points in sorted(data.residency.items()):
        points = points + [(max(end_us, points[-1][0]), *points[-1][1:])]  # hold the last sample to the end
        t = [(ts - start_us) / 1e6 for ts, _, _ in points]
        color = _TIER_COLORS.get(tier)
        ax_res.step(t, [used / scale for _, used, _ in points], where="post", color=color, label=f"{tier} resident")
        ax_res.step(t, [budget / scale for _, _, budget in points], where="post", color=color, linestyle="--",
                    linewidth=1, label=f"{tier} budget")
    ax_res.set_ylabel(f"{unit} (log scale)")
    # Budgets are often 1000x what is resident (an NVMe budget of the whole disk): a log
    # axis keeps both readable.
    ax_res.set_yscale("symlog", linthresh=1 / 1024)
    ax_res.set_title("residency per tier (dashed: budget)")
    if data.residency:
        ax_res.legend(loc="upper right", fontsize="small", ncol=3)
    else:
        ax_res.text(0.5, 0.5, "no residency samples", transform=ax_res.transAxes, ha="center", va="center")

    bin_us = data.meta["bandwidth_bin_us"]
    for link, points in bandwidth_series(data.transfers, start_us, bin_us).items():
        ax_bw.step([(ts - start_us) / 1e6 for ts, _ in points], [gbps for _, gbps in points], where="post",
                   label=link)
    compute = [(s, e) for s, e, kind, *_ in data.computes if kind != "step"]
    for s, e in union(compute)[:2000]:  # compute spans shaded, so overlap is visible
        ax_bw.axvspan((s - start_us) / 1e6, (e - start_us) / 1e6, color="0.9", zorder=0, linewidth=0)
    ax_bw.set_ylabel("GB/s")
    ax_bw.set_xlabel("seconds since the first recorded event")
    ax_bw.set_title(f"bandwidth per link ({bin_us / 1e3:.1f} ms bins; grey: compute)")
    if data.transfers:
        ax_bw.legend(loc="upper right", fontsize="small", ncol=3)
    ax_bw.set_xlim(0, max((end_us - start_us) / 1e6, 1e-6))
    try:
        fig.savefig(path, format="png", dpi=110)
    except OSError as exc:
        raise ZerotierError(f"cannot write the profile plot to {path}: {exc.strerror or exc}") from None
    return path

