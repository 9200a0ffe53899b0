"""Budgets + model -> placement: does the run fit, where does each kind of state go,
and roughly how long will a step take.

Bytes per parameter (N = trainable parameters, L = bytes of the param dtype):
  low-precision params   L*N   on their tier; off-device ones also need a device
                               working set of (lookahead + 2) x largest unit
  fp32 gradients         4*N   accumulation buffer (device or host)
  fp32 master + m + v   12*N   (device, host or nvme; nvme also needs 3 host
                               staging sets of 12 x largest unit for the pipeline)

`auto` fills the fastest tier first, by access frequency: parameters (read in
forward and backward) before gradients (written in backward) before optimizer
state (touched once per step). A plan that does not fit raises BudgetError at
initialize(), naming what does not fit and how much more of which tier helps.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass

import psutil
import torch

from .config import OffloadConfig, PrecisionConfig, PrefetchConfig, TiersConfig, format_size
from .errors import BudgetError
from .state import DTYPES, Location

# Bandwidths assumed when none were measured on this node (GB/s, params/s);
# `zerotier bench` measures the real ones. Figures: GUIDE.md section 3 and PCIe 4 x16.
DEFAULT_RATES = {"h2d": 20e9, "d2h": 20e9, "nvme_read": 7e9, "nvme_write": 4.5e9, "cpu_adam": 1.9e9,
                 "device_adam": 50e9}

KINDS = ("params", "gradients", "optimizer")  # in auto-placement priority order


@dataclass(frozen=True)
class Plan:
    placement: dict[str, Location]      # kind -> tier
    need: dict[str, int]                # tier -> bytes this plan uses there
    budgets: dict[str, int]             # tier -> budget (auto resolved)
    predicted_step_s: float
    breakdown: dict[str, float]         # seconds per component of the prediction
    numel: int

    def summary(self) -> str:
        lines = [f"zerotier plan: {self.numel / 1e6:.1f}M trainable parameters"]
        for kind in KINDS:
            lines.append(f"  {kind:10s} -> {self.placement[kind].value}")
        lines.append(f"  {'tier':8s} {'needed':>12s} {'budget':>12s}")
        for tier in ("device", "host", "nvme"):
            lines.append(f"  {tier:8s} {format_size(self.need[tier]):>12s} {format_size(self.budgets[tier]):>12s}")
        parts = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in self.breakdown.items() if v > 0)
        lines.append(f"  predicted optimizer+swap time per step: {self.predicted_step_s * 1e3:.1f} ms"
                     f" ({parts or 'no swap traffic'}; plus your forward/backward compute)")
        return "\n".join(lines)


def resolve_budgets(tiers: TiersConfig, device: torch.device) -> dict[str, int]:
    """Turn "auto" budgets into bytes for this node."""
    available = psutil.virtual_memory().available
    if tiers.device != "auto":
        dev = int(tiers.device)
    elif device.type == "cuda":
        dev = int(torch.cuda.mem_get_info(device)[0] * 0.9)
    else:  # the CPU "device" pool and the host tier share RAM: split what is free
        dev = int(available * 0.4)
    if tiers.host != "auto":
        host = int(tiers.host)
    else:
        host = int(available * (0.4 if device.type == "cpu" else 0.8))
    if tiers.nvme_path is None or tiers.nvme == 0:
        nvme = 0
    elif tiers.nvme == "auto":
        nvme = int(shutil.disk_usage(tiers.nvme_path).free * 0.9)
    else:
        nvme = int(tiers.nvme)
    return {"device": dev, "host": host, "nvme": nvme}


def _bytes_for(kind: str, loc: Location, numel: int, largest: int, lp_bytes: int, lookahead: int) -> dict[str, int]:
    need = {"device": 0, "host": 0, "nvme": 0}
    if kind == "params":
        need[loc.value] += lp_bytes * numel
        if loc is not Location.DEVICE:
            need["device"] += (lookahead + 2) * largest * lp_bytes
        if loc is Location.NVME:
            need["host"] += (lookahead + 2) * largest * lp_bytes
    elif kind == "gradients":
        need[loc.value] += 4 * numel
    else:
        need[loc.value] += 12 * numel
        if loc is Location.NVME:
            need["host"] += 3 * 12 * largest + 4 * largest  # 3 staging sets + a grad staging flat
    return need


def make_plan(unit_numels: list[int], tiers: TiersConfig, offload: OffloadConfig, precision: PrecisionConfig,
              prefetch: PrefetchConfig, device: torch.device, budgets: dict[str, int] | None = None,
              rates: dict[str, float] | None = None) -> Plan:
    """Choose a tier for each kind of state within the budgets, or raise BudgetError."""
    budgets = budgets or resolve_budgets(tiers, device)
    rates = {**DEFAULT_RATES, **(rates or {})}
    numel = sum(unit_numels)
    largest = max(unit_numels, default=0)
    lp_bytes = DTYPES[precision.param_dtype].itemsize
    lookahead = prefetch.lookahead if prefetch.enabled else 0
    free = dict(budgets)
    need = {"device": 0, "host": 0, "nvme": 0}
    placement: dict[str, Location] = {}
    for kind in KINDS:
        requested = getattr(offload, kind)
        candidates = [Location(requested)] if requested != "auto" else list(Location)
        if kind == "gradients" and Location.NVME in candidates:
            if requested == "nvme":
                raise BudgetError("offload.gradients = 'nvme' is not supported: gradients are accumulated in "
                                  "memory; use 'host' (the optimizer state can still live on nvme)")
            candidates.remove(Location.NVME)
        chosen = None
        for loc in candidates:
            want = _bytes_for(kind, loc, numel, largest, lp_bytes, lookahead)
            if all(want[t] <= free[t] for t in want):
                chosen = loc
                break
        if chosen is None:
            raise BudgetError(_does_not_fit(kind, candidates, numel, largest, lp_bytes, lookahead, free, budgets))
        placement[kind] = chosen
        for t, b in _bytes_for(kind, chosen, numel, largest, lp_bytes, lookahead).items():
            free[t] -= b
            need[t] += b
    breakdown = _predict(placement, numel, lp_bytes, device, rates)
    return Plan(placement, need, budgets, sum(breakdown.values()), breakdown, numel)


def _does_not_fit(kind, candidates, numel, largest, lp_bytes, lookahead, free, budgets) -> str:
    options = []
    for loc in candidates:
        want = _bytes_for(kind, loc, numel, largest, lp_bytes, lookahead)
        short = {t: want[t] - free[t] for t in want if want[t] > free[t]}
        if loc is Location.NVME and budgets["nvme"] == 0:
            options.append(f"enable the nvme tier (set tiers.nvme_path; needs {format_size(want['nvme'])})")
            continue
        options.append(" and ".join(f"{format_size(b)} more {t} (tiers.{t} is {format_size(budgets[t])})"
                                    for t, b in short.items()) + f" to place it on {loc.value}")
    return (f"the {kind} of {numel:,} parameters do not fit within the tier budgets; "
            f"it would take: " + "; or ".join(options))


def _predict(placement, numel, lp_bytes, device, rates) -> dict[str, float]:
    """Seconds per step spent on optimizer math and swap traffic (compute not included)."""
    out = {"params_h2d": 0.0, "grads_d2h": 0.0, "optimizer": 0.0, "optimizer_nvme": 0.0, "params_copyback": 0.0}
    on_gpu = device.type == "cuda"
    if placement["params"] is not Location.DEVICE:
        out["params_h2d"] = 2 * lp_bytes * numel / rates["h2d"] if on_gpu else 0.0
        if placement["params"] is Location.NVME:
            out["params_h2d"] += 2 * lp_bytes * numel / rates["nvme_read"]
    if placement["gradients"] is Location.HOST and on_gpu:
        out["grads_d2h"] = 4 * numel / rates["d2h"]
    if placement["optimizer"] is Location.DEVICE and on_gpu:
        out["optimizer"] = 28 * numel / rates["device_adam"]
    else:
        out["optimizer"] = numel / rates["cpu_adam"]
    if placement["optimizer"] is Location.NVME:
        out["optimizer_nvme"] = 12 * numel / rates["nvme_read"] + 12 * numel / rates["nvme_write"]
    if placement["optimizer"] is not Location.DEVICE and placement["params"] is Location.DEVICE and on_gpu:
        out["params_copyback"] = lp_bytes * numel / rates["h2d"]
    return out
