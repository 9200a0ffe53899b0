"""The measured run beside its plan: `zerotier profile TRACE --plan PLAN.json`, and the speculative
step's measured rollback rate beside the one the plan assumed.
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from ..errors import ConfigError
from ..overlap.speculative import PAUSE_AFTER
from ..units import format_duration
from . import intervals as iv
from .schema import speculation_sums
from .spans import step_times
from .trace import read_trace


FAR_OFF = 3.0  # a measured rollback rate above this many times the plan's is warned about


def rollback_warning(rolled: int, windows: int, planned: float | None) -> str | None:
    """A warning and what to do when the speculative step rolled back far more often (> FAR_OFF x) than
    the plan assumed ([Note: speculation in the plan] in planner/speculation_plan.py: 1% by default), so the plan's
    expected step is optimistic; None when it did not, or nothing is known to compare."""
    if not windows or planned is None or rolled / windows <= FAR_OFF * planned:
        return None
    rate = rolled / windows
    times = f"{rate / planned:.1f}x" if planned > 0 else "above"
    return (f"warning: {100 * rate:.1f}% of the speculated windows rolled back ({rolled:,} of {windows:,}), {times} the "
            f"{100 * planned:.1f}% the plan assumed: its expected step is optimistic (a rollback restores the state and "
            f"redoes the update). Clipping or a loss-scale overflow fires often on a fresh model and in warm-up "
            f"(train.overlap = 'auto' pauses after {PAUSE_AFTER} rollbacks in a row); if it keeps firing, set "
            f"train.overlap = 'none', or plan at the measured rate: zerotier.plan(..., rollback_rate={rate:.2f}) "
            f"or `zerotier plan --rollback-rate {rate:.2f}`")


# [Note: measured against the plan]
# `zerotier profile TRACE --plan PLAN.json` (a `zerotier plan --json` or Plan.to_dict()) puts
# each component of the plan's breakdown ([Note: step-time prediction] in predict.py) beside
# the same work measured in the trace, per step (the window's totals over its steps):
#   forward / backward / optimizer   compute spans of that kind (optimizer: CPU or device)
#   params_h2d / params_nvme         prefetch and demand transfers: to the device / from nvme
#   grads_d2h / grads_nvme           grad-offload transfers: device->host / to or from nvme; and the
#                                    optimizer's read of a gradient file (optimizer-read, role grad)
#   optimizer_nvme                   optimizer-read and optimizer-write transfers of the state to/from nvme
#   optimizer_staging                the same between host and device (the device step's staging)
#   params_copyback                  param-copyback transfers
# Transfer seconds are the union of their spans (concurrent transfers count once), so a
# component's figure is the time its resource was busy with it, as the plan's seconds are.
# The verdict names the component furthest from the plan in seconds: the one whose rate or
# overlap the prediction got most wrong. Components the trace does not time (grad_norm: inside
# the step, not a span of its own) are listed with the plan's figure only, as is the speculative
# step's undo copies and restores (speculation: inside the optimizer's spans) and the drive's share
# of the cores (nvme_cpu: compute and Adam slowed, not a span); its rollback rate is compared beside ([Note: speculation counters], speculation_comparison).


_UNTIMED = ("grad_norm", "speculation", "nvme_cpu")  # plan components the trace has no span of


def _component(t: dict) -> str | None:
    reason, src, dst = t["reason"], t["src"], t["dst"]
    if reason in ("prefetch", "demand"):
        return "params_nvme" if src == "nvme" else "params_h2d"
    if reason == "grad-offload":
        return "grads_nvme" if "nvme" in (src, dst) else "grads_d2h"
    if reason in ("optimizer-read", "optimizer-write"):
        if "nvme" not in (src, dst):  # the device step's copies ([Note: the device step in the schedule])
            return "optimizer_staging"
        return "grads_nvme" if t.get("role") == "grad" else "optimizer_nvme"  # a gradient read from its file
    if reason == "param-copyback":
        return "params_nvme" if dst == "nvme" else "params_copyback"
    return None


def measured_components(trace: dict) -> tuple[dict[str, float], int]:
    """[Note: measured against the plan] Seconds per step of each plan component, and the steps."""
    data = read_trace(trace)
    steps = max(1, len(step_times(trace)))
    spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for s, e, kind, _, _ in data.computes:
        name = {"forward": "forward", "backward": "backward", "optimizer": "optimizer",
                "device-optimizer": "optimizer"}.get(kind)
        if name is not None:
            spans[name].append((s, e))
    for t in data.transfers:
        name = _component(t)
        if name is not None:
            spans[name].append((t["ts"], t["ts"] + t["dur"]))
    return {name: iv.length(iv.union(v)) / 1e6 / steps for name, v in spans.items()}, steps


_PLAN_SECONDS = 1e9  # a plan's seconds lie in [0, this]: a step of 30 years is not a plan


def load_plan(path: str) -> dict:
    """A `zerotier plan --json` file for `zerotier profile --plan`, checked for what plan_comparison
    and speculation_comparison read: ConfigError naming the file, the key and what is expected."""
    def fail(key: str, expected: str, value) -> ConfigError:
        return ConfigError(f"--plan {path}: {key}: expected {expected}, got {value!r}; pass the output of "
                           "`zerotier plan --json` (made with `zerotier bench` results) for this run")

    def seconds(key: str, value, optional: bool = False) -> None:
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
              and 0 <= value <= _PLAN_SECONDS)  # NaN fails the comparison
        if not ok and not (optional and value is None):
            raise fail(key, f"seconds, a number from 0 to {_PLAN_SECONDS:g}" + (" or null" if optional else ""), value)

    try:
        plan = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--plan: cannot read {path}: {exc}") from None
    if not isinstance(plan, dict):
        raise fail("the file", "a JSON object", type(plan).__name__)
    breakdown = plan.get("breakdown_s")
    if not isinstance(breakdown, dict) or not breakdown:
        raise fail("breakdown_s", "an object of seconds per component (a plan made without `zerotier bench` "
                   "results has none)", breakdown)
    for name, value in breakdown.items():
        seconds(f"breakdown_s.{name}", value)
    seconds("predicted_step_s", plan.get("predicted_step_s"), optional=True)
    if not isinstance(plan.get("speculative"), (bool, type(None))):
        raise fail("speculative", "true, false or null", plan["speculative"])
    rate = plan.get("rollback_rate")
    if rate is not None and not (isinstance(rate, (int, float)) and not isinstance(rate, bool) and 0 <= rate <= 1):
        raise fail("rollback_rate", "a share from 0 to 1 or null", rate)
    cases = plan.get("speculation_step_s")
    if not isinstance(cases, (dict, type(None))):
        raise fail("speculation_step_s", "an object of seconds (commit, rollback, without) or null", cases)
    for case in ("commit", "rollback", "without") if cases else ():
        seconds(f"speculation_step_s.{case}", cases.get(case))
    return plan


def plan_comparison(trace: dict, plan: dict) -> tuple[list[tuple[str, float, float | None]], str]:
    """Rows (component, planned s, measured s or None) and the verdict line naming the component
    furthest from the plan ([Note: measured against the plan])."""
    planned = plan.get("breakdown_s") or {}
    measured, steps = measured_components(trace)
    rows = [(name, float(planned.get(name, 0.0)), measured.get(name))
            for name in dict.fromkeys([*planned, *measured])
            if planned.get(name, 0.0) > 0 or measured.get(name, 0.0) > 0]
    timed = [(name, p, m) for name, p, m in rows if m is not None or name not in _UNTIMED]
    if not timed:
        return rows, "plan: nothing to compare (no component in the plan or the trace)"
    name, p, m = max(timed, key=lambda r: abs((r[2] or 0.0) - r[1]))
    walls = sorted(s.wall_s for s in step_times(trace))
    step = walls[len(walls) // 2] if walls else None
    predicted = plan.get("predicted_step_s")
    head = (f"plan: step measured {format_duration(step)} (median of {steps}) vs predicted "
            f"{format_duration(predicted)}; " if step is not None and predicted else "plan: ")
    return rows, (head + f"furthest from the plan: {name}, measured {format_duration(m or 0.0)} per step vs "
                  f"planned {format_duration(p)}")


def plan_table(rows: list[tuple[str, float, float | None]], line: str) -> str:
    out = [f"  {'component':16s} {'planned':>10s} {'measured':>10s}"]
    for name, p, m in rows:
        out.append(f"  {name:16s} {format_duration(p):>10s} {format_duration(m) if m is not None else '-':>10s}")
    return "\n".join(out + [line])


def speculation_comparison(trace: dict, plan: dict) -> str | None:
    """The rollback rate measured in the trace beside the one the plan assumed ([Note: speculation
    in the plan] in planner/speculation_plan.py), and the plan's expected step at the measured rate; None when
    neither the plan nor the run speculated."""
    sums = speculation_sums(trace["zerotier"])
    windows, rolled = sums["speculation_windows"], sums["rolled_back_windows"]
    planned = plan.get("speculative")
    if not planned and not windows:
        return None
    rate = rolled / windows if windows else None
    measured = (f"rollback rate measured {100 * rate:.1f}% ({rolled:,} of {windows:,} windows)" if windows else
                "no window speculated in the trace (speculation off, paused after rollbacks, or not profiled)")
    if not planned:
        return f"plan: speculative step off in the plan, on in the run: {measured}"
    r = float(plan.get("rollback_rate") or 0.0)
    line = f"plan: {measured} vs planned {100 * r:.1f}%"
    cases = plan.get("speculation_step_s") or {}
    if rate is not None and "commit" in cases and "rollback" in cases:
        at = (1 - rate) * cases["commit"] + rate * cases["rollback"]
        line += (f"; at the measured rate the plan expects {format_duration(at)} per step (commit "
                 f"{format_duration(cases['commit'])}, rollback {format_duration(cases['rollback'])}, without "
                 f"speculation {format_duration(cases['without'])})")
    warning = rollback_warning(rolled, windows, r)
    return line + (f"\nplan: {warning}" if warning else "")
