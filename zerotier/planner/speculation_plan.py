"""train.overlap's speculation resolved for one placement: whether it is on, the memory its held
state takes, and the step predicted as commit and rollback.

[Note: speculation in the plan]
train.overlap's speculation ([Note: speculative step] in overlap/speculative.py) resolved per placement:
`auto` is on with clipping (train.max_grad_norm) or a dynamic loss scale, when the NVMe
budget left by the rest of the plan holds the NVMe units' shadow state files
(`overlap.speculative.shadow_bytes`, every NVMe unit: the pre-step files stay until the step is
validated) and at least one unit's hold fits; otherwise off, and `Plan.speculation_note`
says why (`true` raises PlanDoesNotFit instead). What a speculated unit holds until the check
(UndoLog.speculate): a host (device) unit its undo copy (`overlap.speculative.undo_bytes`:
state and low-precision shard) on that tier, an NVMe unit its new low-precision shard on host.
Each tier gets an allowance, min(all its units' holds, the tier budget minus the rest of
the plan's need), counted in `need` (`Plan.speculation_undo_bytes`); the engine speculates a
unit, in the order gradients become final, when its hold fits in what is left of the
allowance, and the prediction follows it (`Plan.speculation_units`). The step is predicted twice, validated (commit) and
rolled back ([Note: speculation in the schedule]); `Plan.predicted_step_s` and the
breakdown are (1 - r) x commit + r x rollback at the rollback rate r (`rollback_rate`,
default 1%: `zerotier.plan(..., rollback_rate=)`, `zerotier plan --rollback-rate`; the
profiler measures it), `Plan.speculation_step_s` has both cases, the expected step and the
step without speculation.

"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..io.memory import round_up
from ..overlap.speculative import shadow_bytes, undo_bytes
from ..state import Location
from ..tiers.homes import HOMES
from ..units import format_size
from .messages import PlanDoesNotFit
from .predict import StepOptions, UnitCompute, predict
from .sizes import Sizes, held_shards_in_order
from .step_model import Schedule


@dataclass(frozen=True)
class SpeculationFit:
    """[Note: speculation in the plan] for one placement."""
    on: bool
    note: str                                   # why on or off (the plan text)
    undo: dict[str, int] = field(default_factory=lambda: {"host": 0, "device": 0})
    nvme: int = 0
    units: tuple[bool, ...] = ()                # speculated, by unit index


def fit_speculation(step: StepOptions, placement: dict[str, Location], units_on: tuple[Location, ...] | None,
                 s: Sizes, free: dict[str, int], compute: UnitCompute | None, per_rank: int) -> SpeculationFit:
    """[Note: speculation in the plan] train.overlap's speculation resolved for this placement, with the
    memory it takes from what the rest of the plan left `free`."""
    wanted = step.speculative
    why = "clipping" if step.clip else "a dynamic loss scale" if step.dynamic_scale else None
    if wanted is False:
        overlap = step.overlap or "none"
        return SpeculationFit(False, f"off (train.overlap = {overlap!r})")
    if s.world_size > 1:  # the engine speculates at one rank only ([Note: speculative step] in overlap/speculative.py)
        return SpeculationFit(False, f"off ({s.world_size} ranks: the reduced gradient shards land at the end of "
                                   "backward, so nothing can be speculated during it)")
    if wanted == "auto" and why is None:
        return SpeculationFit(False, "off (auto: no clipping and no dynamic loss scale, nothing waits for the "
                                   "whole gradient)")
    setting = "on (train.overlap = 'speculative')" if wanted is True else f"on (auto: {why})"
    shards = held_shards_in_order(s)
    tiers = units_on or (placement["optimizer"],) * len(shards)
    nvme = sum(shadow_bytes(unit, s.alignment) for unit, at in zip(s.state_units, tiers)
               if not HOMES[at].in_memory)
    if nvme > free["nvme"]:
        short = nvme - free["nvme"]
        if wanted == "auto":
            return SpeculationFit(False, f"off (auto: the NVMe budget lacks {format_size(short)} for the NVMe units' "
                                       f"shadow state files, {format_size(nvme)})")
        raise PlanDoesNotFit(f"train.overlap = 'speculative': the NVMe units' shadow state files take "
                             f"{format_size(nvme)} beside the plan's NVMe files; {format_size(short)} more nvme "
                             f"(tiers.nvme) or train.overlap = 'auto'", "optimizer",
                             [{"tier": "nvme", "more": {"nvme": short}}], placement, per_rank)
    # what a speculated unit holds until the check (UndoLog.speculate): a host or device unit its
    # undo copy on its tier, an NVMe unit its new low-precision shard (ParamStore.staged_out_bytes) on host
    # auto copies no state: host/device units are speculated with `true` only (UndoLog.copies)
    held = [("host", max(round_up(n * s.lp_bytes, s.alignment), s.alignment)) if not HOMES[at].in_memory else
            (at.value, undo_bytes(sum(unit), n, s.lp_bytes)) if wanted is True else (None, 0)
            for n, unit, at in zip(shards, s.state_units, tiers)]
    if not any(t for t, _ in held):
        return SpeculationFit(False, "off (auto: no optimizer state on NVMe; host or device state would need undo "
                                   "copies, which cost more than they hide: train.overlap = 'speculative')")
    allowance = {t: min(sum(b for at, b in held if at == t), max(0, free[t])) for t in ("host", "device")}
    # each unit as its gradient becomes final (backward order, enclosing units last), if what it holds fits
    encloses = compute.encloses if compute is not None else (False,) * len(shards)
    order = [i for i in reversed(range(len(shards))) if not encloses[i]] + \
            [i for i in range(len(shards)) if encloses[i]]
    left, units = dict(allowance), [False] * len(shards)
    for i in order:
        t, b = held[i]
        if t is not None and b <= left[t]:
            units[i], left[t] = True, left[t] - b
    if not any(units):
        room = " and ".join(f"{format_size(max(0, free[t]))} {t} left, the smallest takes "
                            f"{format_size(min(b for at, b in held if at == t))}"
                            for t in ("host", "device") if any(at == t for at, _ in held))
        if wanted == "auto":
            return SpeculationFit(False, f"off (auto: no unit's undo copy fits: {room})")
        raise PlanDoesNotFit(f"train.overlap = 'speculative': no unit's undo copy fits ({room}); raise the "
                             f"budgets or set train.overlap = 'auto'", "optimizer", [], placement,
                             per_rank)
    return SpeculationFit(True, setting, allowance, nvme, tuple(units))


def predict_step(placement: dict[str, Location], s: Sizes, device_type: str, rates: dict[str, float], local: int,
                  units_on: tuple[Location, ...] | None, compute: UnitCompute | None, step: StepOptions,
                  speculated: tuple[bool, ...] | None):
    """The schedule the plan reports, the rate keys used and, with speculation, its cases' seconds:
    the expected step (1 - r) commit + r rollback, each component weighted alike ([Note:
    speculation in the plan])."""
    without, used = predict(placement, s, device_type, rates, local, units_on, compute, step)
    if speculated is None:
        return without, used, {}
    commit, used_c = predict(placement, s, device_type, rates, local, units_on, compute, step, speculated)
    rollback, used_r = predict(placement, s, device_type, rates, local, units_on, compute, step, speculated,
                               rollback=True)
    r = step.rollback_rate
    mix = lambda a, b: {k: (1 - r) * a.get(k, 0.0) + r * b.get(k, 0.0) for k in {**a, **b}}  # noqa: E731
    expected = Schedule((1 - r) * commit.step_s + r * rollback.step_s, mix(commit.seconds, rollback.seconds),
                        mix(commit.critical, rollback.critical), mix(commit.busy, rollback.busy))
    seconds = {"commit": commit.step_s, "rollback": rollback.step_s, "expected": expected.step_s,
               "without": without.step_s}
    return expected, tuple(dict.fromkeys(used + used_c + used_r)), seconds
