"""Swap-traffic profiler: every transfer between tiers, its reason and stall; trace, summary, plot.

    prof = Profiler.from_config(cfg.profile, residency=tiers_residency)   # None when disabled
    ...
    if prof is not None:
        token = prof.begin("u00003.param", "param", "nvme", "host", nbytes, "prefetch")
    ...
    if prof is not None:
        prof.end(token)
    ...
    print(prof.report().table())      # terminal table; prof.save() / prof.plot(path)

`events.py` records (the hot path), `trace.py` builds / saves / loads the Chrome trace,
`summary.py` computes the Summary and verdict from a trace, `plot.py` draws it.
docs/profiler.md explains what is recorded and how to read the outputs.
"""
from .events import COMPUTE_KINDS, REASONS, ROLES, SPECULATION_TOTALS, TIERS, Profiler
from .plot import plot_trace
from .summary import LinkStats, ReasonStats, StepTime, Summary, TensorStats, TierResidency, step_times, summarize
from .trace import load_trace, save_trace

__all__ = ["COMPUTE_KINDS", "REASONS", "ROLES", "SPECULATION_TOTALS", "TIERS", "Profiler", "plot_trace", "LinkStats", "ReasonStats",
           "StepTime", "Summary", "TensorStats", "TierResidency", "step_times", "summarize", "load_trace", "save_trace"]
