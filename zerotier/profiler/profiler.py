"""The Profiler the engine holds: the Recorder (events.py) plus its outputs.

The outputs sit above the recorder: the Chrome trace (trace.py), the summary computed from it
(summary.py), the file (trace_file.py) and the plot. The recorder's hot path imports none of them.
"""
from __future__ import annotations

from typing import Mapping

from ..config import ProfileConfig
from .events import Recorder, Residency
from .plot import plot_trace
from .summary import Summary, summarize
from .trace import build_trace
from .trace_file import check_trace_path, save_trace


class Profiler(Recorder):
    """A Recorder whose records can be read back as a trace, a summary, a file and a plot.

    `peak_rates` are this node's peak rates in bytes/s (keys h2d, d2h, nvme_read, nvme_write;
    cpu_adam in params/s); when None, `zerotier.bench.load_rates()` is tried when the trace is
    exported; {} means none (no "of peak" column). `cfg.trace_path`, when set, is checked now
    (ConfigError before the run, not a lost trace after it) and written at close(). The other
    arguments are the Recorder's.
    """

    def __init__(self, cfg: ProfileConfig, residency: Residency | None = None,
                 peak_rates: Mapping[str, float] | None = None, device=None,
                 unit_names: Mapping[str, str] | None = None, planned_rollback_rate: float | None = None):
        if cfg.trace_path is not None:
            check_trace_path(cfg.trace_path)
        self._peak_rates = dict(peak_rates) if peak_rates is not None else None
        super().__init__(cfg, residency, device, unit_names, planned_rollback_rate)

    @classmethod
    def from_config(cls, cfg: ProfileConfig, residency: Residency | None = None,
                    peak_rates: Mapping[str, float] | None = None, device=None,
                    unit_names: Mapping[str, str] | None = None,
                    planned_rollback_rate: float | None = None) -> "Profiler | None":
        """A Profiler when `cfg.enabled`, else None (what the engine stores when profiling is off).
        `device`: the compute device; a CUDA one is timed with events ([Note: CUDA timing] in events.py)."""
        return cls(cfg, residency, peak_rates, device, unit_names, planned_rollback_rate) if cfg.enabled else None

    def peak_rates(self) -> dict[str, float] | None:
        """This node's peak rates: the ones given, else `zerotier.bench.load_rates()`, else None."""
        if self._peak_rates is None:
            self._peak_rates = _bench_rates() or {}
        return self._peak_rates or None

    def trace(self) -> dict:
        """The Chrome/Perfetto trace of everything recorded so far (see trace.py)."""
        return build_trace(self)

    def report(self, top: int = 10) -> Summary:
        """Summary of everything recorded so far, computed from `trace()` (so a saved trace gives the same)."""
        return summarize(self.trace(), top=top)

    def save(self, path: str | None = None) -> str:
        """Write the trace JSON (gzip when the name ends in .gz) to `path` or cfg.trace_path; returns the path."""
        path = path or self.cfg.trace_path
        if path is None:
            raise ValueError("profiler.save() needs a path: profile.trace_path is not set")
        save_trace(self.trace(), path)
        return path

    def plot(self, path: str) -> str:
        return plot_trace(self.trace(), path)

    def close(self) -> str | None:
        """Stop the sampler, take a last sample, write cfg.trace_path if set (returns it). Idempotent."""
        if not self.finish():
            return None
        return self.save() if self.cfg.trace_path else None

    def __enter__(self) -> "Profiler":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _bench_rates() -> dict[str, float] | None:
    """`zerotier bench` results of this node, if that module exists and has measured any."""
    try:
        from zerotier.bench import load_rates

        rates = load_rates()
    except Exception:  # no bench module yet, or no readable results: profile without peaks
        return None
    if not isinstance(rates, Mapping):
        return None
    return {str(k): float(v) for k, v in rates.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0}
