"""The verdict of a profile: which resource bounds the step, and what to change.

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

from collections import defaultdict

from ..units import format_duration

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
HIDDEN_PCT = 80.0  # compute-bound says "transfers are hidden" only from this overlap on
# On a CPU-only machine the "device" is a pool of RAM: its host<->device link is a memory copy, not PCIe.
_CPU_NAMES = {"pcie": "RAM copy"}
_CPU_VERDICTS = {"pcie": "copy-bound"}


def resource_names(device: str | None) -> tuple[dict[str, str], dict[str, str]]:
    """(resource names, verdict names) for the machine the trace was taken on (meta "device")."""
    if device == "cpu":
        return {**_RESOURCE_NAMES, **_CPU_NAMES}, {**VERDICTS, **_CPU_VERDICTS}
    return _RESOURCE_NAMES, VERDICTS



def verdict(busy_s: dict[str, float], wall_s: float, device: str | None = None,
            overlap_pct: float | None = None, exposed_s: dict[tuple[str, str], float] | None = None,
            prefetch_issued: int = 0) -> tuple[str, str]:
    """[Note: verdict]: the resource with the largest busy time, and a hint that follows from the
    figures ([Note: advice follows the figures]). `exposed_s`: {(resource, reason): seconds of
    transfer time not hidden under compute}; empty when nothing moved."""
    if wall_s <= 0 or not any(busy_s.values()):
        return "no activity", "verdict: nothing recorded (no transfers or compute spans in the profiled window)"
    names, verdicts = resource_names(device)
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
