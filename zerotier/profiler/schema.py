"""The profiler's vocabulary: what a recorded transfer, compute span and speculation record may say.

Shared by the recorder (events.py checks each call against it), the trace (trace.py writes it
into the file's "vocabulary" and checks a loaded trace against it) and the readers (summary,
plot), so none of them imports another for a name.

[Note: speculation counters]
The speculative step ([Note: speculative step] in overlap/speculative.py) reports once per optimizer
step in which it ran (`speculation(...)`): units speculated and rolled back, the bytes of the
undo copies and of the rollback, the rollback's seconds. The profiler keeps the whole run's
sums (a lock: a few adds per step) and the newest max_events records; the trace carries the
sums in its "speculation" object (SPECULATION_TOTALS) and each record as an instant event, and
the summary's rollback rate is windows rolled back / windows speculated, printed beside the rate
the run's plan assumed (`planned_rollback_rate`, the trace's "planned_rollback_rate") with a
warning and what to do when it is far above it (versus_plan.rollback_warning).
"""
from __future__ import annotations

from ..tier_names import TIER_NAMES as TIERS

# Why a transfer happened; docs/profiler.md says where the engine uses each one.
REASONS = ("demand", "prefetch", "evict", "optimizer-read", "optimizer-write", "grad-offload", "param-copyback")
ROLES = ("param", "grad", "master", "exp_avg", "exp_avg_sq", "optimizer-state")
# Compute spans: forward/backward/device-optimizer count as compute, optimizer as CPU-optimizer
# time, step is an enclosing marker only (see [Note: verdict] in verdict.py).
COMPUTE_KINDS = ("forward", "backward", "optimizer", "device-optimizer", "step")

# [Note: speculation counters] The speculative step's sums over the run, as the trace's "speculation" object
# holds them: windows speculated, windows rolled back, units speculated, units rolled back, bytes copied for
# undo copies, bytes a rollback moved, seconds rollbacks took.
SPECULATION_TOTALS = ("windows", "rolled_back_windows", "speculated_units", "rolled_back_units", "undo_bytes",
                      "rollback_bytes", "rollback_s")

# Peak-rate key (zerotier bench / planner.DEFAULT_RATES, bytes/s) that bounds each link.
LINK_PEAK = {"host->device": "h2d", "device->host": "d2h", "nvme->host": "nvme_read", "host->nvme": "nvme_write",
             "nvme->device": "nvme_read", "device->nvme": "nvme_write"}

__all__ = ["TIERS", "REASONS", "ROLES", "COMPUTE_KINDS", "SPECULATION_TOTALS", "LINK_PEAK", "same_memory",
           "speculation_sums"]


def same_memory(link: str, device: str | None) -> bool:
    """[Note: same memory] On a CPU-only machine the "device" tier is a budgeted pool of host RAM, so
    a host<->device "transfer" is an in-memory copy, or none at all (the optimizer updated the
    parameters in place, a ZeRO-3 gather read the host shard where it lies), timed around whatever the
    engine did there. Its bytes / time is no link's bandwidth (a demo printed host->device 1206.81 GB/s):
    the table labels such a link "(same memory)" and gives it no GB/s, the plot leaves it out of
    the bandwidth panel. Its transfers, bytes and busy time still count (RAM copy in the verdict)."""
    return device == "cpu" and link in ("host->device", "device->host")


def speculation_sums(meta: dict) -> dict:
    """The Summary's speculation fields from a trace's "speculation" object and planned rate
    ([Note: speculation counters]); zeros for a trace taken without speculation (or before it was recorded)."""
    sums = meta.get("speculation") or {}
    return {"speculation_windows": sums.get("windows", 0), "rolled_back_windows": sums.get("rolled_back_windows", 0),
            "speculated_units": sums.get("speculated_units", 0), "rolled_back_units": sums.get("rolled_back_units", 0),
            "undo_bytes": sums.get("undo_bytes", 0), "rollback_bytes": sums.get("rollback_bytes", 0),
            "rollback_s": float(sums.get("rollback_s", 0.0)), "planned_rollback_rate": meta.get("planned_rollback_rate")}
