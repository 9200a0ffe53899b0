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

`schema.py` holds the vocabulary, `events.py` records (the Recorder: the hot path), `trace.py`
builds the Chrome trace and `trace_file.py` saves / loads it, `spans.py` splits its time, `verdict.py` names what
bounds the step, `summary.py` computes the Summary from a trace, `versus_plan.py` puts it beside
a plan, `plot.py` draws it, and `profiler.py`'s Profiler is the Recorder with those outputs.
docs/profiler.md explains what is recorded and how to read the outputs.
"""
from .plot import plot_trace
from .profiler import Profiler
from .schema import COMPUTE_KINDS, REASONS, ROLES, SPECULATION_TOTALS, TIERS
from .spans import StepTime, step_times
from .summary import LinkStats, ReasonStats, Summary, TensorStats, TierResidency, summarize
from .trace_file import load_trace, save_trace

__all__ = ["COMPUTE_KINDS", "REASONS", "ROLES", "SPECULATION_TOTALS", "TIERS", "Profiler", "plot_trace", "LinkStats", "ReasonStats",
           "StepTime", "Summary", "TensorStats", "TierResidency", "step_times", "summarize", "load_trace", "save_trace"]
