"""Budgets + model -> placement: does the run fit, where does each kind of state go,
and roughly how long will a step take. What each placement holds: [Note: bytes per parameter]
in planner/sizes.py; the speculative step's part: [Note: speculation in the plan] in
planner/speculation_plan.py.

`auto` fills the fastest tier first, by access frequency: parameters (read in
forward and backward) before gradients (written in backward) before optimizer
state (touched once per step). A plan that does not fit raises PlanDoesNotFit (a
BudgetError) at initialize(), naming what does not fit and how much more of which
tier helps, then the whole shortfall and its cheapest fixes ([Note: the whole shortfall]
in planner/report.py).


The step time: [Note: step-time prediction] in predict.py, the schedule it lays out in
planner/step_model.py. `auto` placement: among the placements (and the optimizer split) that
fit, the one with the lowest predicted step; ties keep the fastest-tier-first order above
(`Plan.alternatives` lists every candidate considered).

[Note: needs per component]
The plan's bytes are kept per component, `Plan.needs[component][tier]`: `params`, `gradients`,
`optimizer` (each kind where it is placed, with its working sets, as sizes.bytes_for counts
them from the stores' own sizing functions), `speculation` (the speculative step's allowance and
shadow files), `delayed` (train.overlap = 'delayed': its gradient copies and staged parameters,
`Delayed.plan_terms`; a host budget without room for them refuses the plan), `activations` and
`materialization`. `Plan.need` is their sum per tier; nothing is checked outside the plan.
ZEROTIER_CHECK_PLAN=1 compares the run's peaks with these terms ([Note: the plan against the
run's peaks] in plan_check.py).
"""
from __future__ import annotations

import dataclasses
import itertools

from ..config import OffloadConfig
from ..errors import ConfigError
from ..optim.rules import make_rule
from ..optim.state_layout import StateLayout
from ..overlap.delayed import Delayed
from ..state import DTYPES, Location
from ..tiers.homes import HOMES
from .budgets import nvme_off, resolve_budgets
from .inputs import ModelFacts, Node, PlanConfig
from .machine_fit import shortfall
from .messages import PlanDoesNotFit, device_step_does_not_fit, does_not_fit, split_does_not_fit
from .predict import COMPONENTS, DEFAULT_RATES, bound_by, predict
from .record import Plan
from .report import whole_shortfall
from .sizes import (KINDS, Sizes, auto_split, bytes_for, check_sharding, held_shards_in_order, model_state_bytes,
                    split_bytes, split_units, tier_holds)
from .speculation_plan import fit_speculation, predict_step
from .step_on import UpdateCosts, choose, cpu_rate_key, device_rate_key, shard_in_place, staging_bytes_of


def make_plan(model: ModelFacts, config: PlanConfig, node: Node) -> Plan:
    """Choose a tier for each kind of state within the per-rank budgets, or raise PlanDoesNotFit.
    Its inputs: [Note: the plan's inputs] in inputs.py.

    world_size/stage shard each kind's bytes as ZeRO does ([Note: bytes per parameter]);
    config.grad_bytes defaults to the engine's accumulators (precision.grad_dtype), give the param
    dtype's size for the ZeRO paper's accounting. node.rates None uses this node's `zerotier bench`
    results where saved, else DEFAULT_RATES ([Note: step-time prediction]). model.compute: each
    unit's measured forward/backward (zerotier.plan measures them); config.step: accumulation,
    clipping, early step. model.materialize_bytes: host-pool bytes a meta-built model's
    materialization holds during initialize (materialize.pool_bytes), counted in tiers.host beside
    everything else. node.machine: the node's memory the chosen plan's need is checked against
    (`Plan.machine_note`; [Note: the plan against the machine] in machine_fit.py); None: not checked.
    model.activations: one micro-batch's activation bytes on the device and where the figure comes
    from ([Note: activation memory] in activations.py), counted in need["device"]; None: not counted.
    model.names: each unit's module name, for a refusal that names the largest unit ([Note: the
    whole shortfall] in planner/report.py). model.units: each unit's parameters' numels, what the
    optimizer state's layout follows ([Note: the optimizer's bytes per unit]).
    `auto` kinds: every tier choice (and the optimizer split) that fits is predicted and the
    fastest taken, ties to the fastest-tier-first choice; all are in `Plan.alternatives`.
    """
    stage, world_size, step, offload = config.zero.stage, node.world_size, config.step, config.offload
    check_sharding(stage, world_size)
    if not 0.0 <= step.rollback_rate <= 1.0:
        raise ConfigError(f"rollback_rate must be in [0, 1] (a share of the speculated steps), got {step.rollback_rate}")
    budgets = node.budgets or resolve_budgets(config.tiers, node.device)
    names = {n: name for n, name in reversed(list(zip([*model.numels, *model.frozen], model.names)))}
    args = (model, config, node, budgets, _resolve_rates(node.rates), names)
    autos = [k for k in KINDS if getattr(offload, k) == "auto"]
    try:
        first, error = _place(offload, *args), None
    except PlanDoesNotFit as exc:
        first, error = None, exc
    if not autos:
        if error is not None:
            raise error.explained()
        return _on(node, first, model.activations)
    tried = [first] if first is not None else []
    layout = StateLayout.of(config.precision, make_rule(step.optimizer))
    choices = [[loc.value for loc in Location if tier_holds(k, loc, node.device.type == "cuda", layout)]
               + (["auto"] if k == "optimizer" else []) for k in autos]
    for combo in itertools.product(*choices):  # "auto" optimizer: a split where one is faster
        try:
            plan = _place(dataclasses.replace(offload, **dict(zip(autos, combo))), *args)
        except PlanDoesNotFit:
            continue
        if all((p.placement, p.optimizer_units) != (plan.placement, plan.optimizer_units) for p in tried):
            tried.append(plan)
    if not tried:
        raise error.explained()
    best = tried[0]
    for plan in tried[1:]:
        if plan.predicted_step_s < best.predicted_step_s * (1 - 1e-9):
            best = plan
    rows = tuple(sorted((_alternative(p, p is best) for p in tried), key=lambda r: r["predicted_step_s"]))
    return _on(node, dataclasses.replace(best, alternatives=rows), model.activations)


def _on(node: Node, plan: Plan, activations: tuple[int, str] | None) -> Plan:
    """The plan with what the node's machine lacks for it ([Note: the plan against the machine]) and
    where its activation figure comes from ([Note: activation memory])."""
    if activations:
        plan = dataclasses.replace(plan, activation_source=activations[1])  # its bytes: needs["activations"]
    if node.machine is None:
        return plan
    return dataclasses.replace(plan, machine_note=shortfall(plan.need, node.machine,
                                                            node.ranks_per_node or plan.world_size))


def _alternative(plan: Plan, chosen: bool) -> dict:
    """One row of the alternatives table."""
    where = {k: ("split" if k == "optimizer" and plan.optimizer_units else v.value)
             for k, v in plan.placement.items()}
    return {"placement": where, "optimizer_split": {t: b for t, (b, _) in plan.optimizer_split.items()} or None,
            "tiers": dict(plan.need), "predicted_step_s": plan.predicted_step_s, "bound_by": plan.bound_by,
            "chosen": chosen}


def _place(offload: OffloadConfig, model: ModelFacts, config: PlanConfig, node: Node, budgets: dict[str, int],
           resolved: tuple[dict[str, float], dict[str, str]], unit_names: dict[int, str]) -> Plan:
    """One placement: `auto` kinds take the fastest tier that fits, in KINDS order."""
    unit_numels, frozen_numels, compute, step = model.numels, model.frozen, model.compute, config.step
    tiers, precision, prefetch, zero, grad_bytes = config.tiers, config.precision, config.prefetch, config.zero, \
        config.grad_bytes
    device, world_size, stage = node.device, node.world_size, zero.stage
    activation_bytes, materialize_bytes = model.activations[0] if model.activations else 0, model.materialize_bytes
    rates, rate_sources = resolved
    lp_bytes = DTYPES[precision.param_dtype].itemsize
    sizes = Sizes(numels=tuple(sorted(unit_numels, reverse=True)), lp_bytes=lp_bytes,
                   grad_bytes=DTYPES[precision.accumulator_dtype].itemsize if grad_bytes is None else grad_bytes,
                   lookahead=prefetch.lookahead if prefetch.enabled else 0, stage=stage, world_size=world_size,
                   pipeline_depth=config.pipeline_depth, engine_buffers=grad_bytes is None, nested=model.nested,
                   alignment=config.alignment, cuda=device.type == "cuda", frozen=tuple(frozen_numels),
                   state=StateLayout.of(precision, make_rule(step.optimizer)), rule=make_rule(step.optimizer))
    state_bytes = {kind: round(b * (sizes.with_frozen() if kind == "params" else sizes).rank_numel(kind)) for kind, b
                   in (("params", lp_bytes), ("gradients", sizes.grad_bytes),
                       ("optimizer", sizes.state.bytes_per_param))}
    frozen_bytes = state_bytes["params"] - lp_bytes * sizes.rank_numel("params")  # [Note: frozen units]
    assert sum(state_bytes.values()) - frozen_bytes == model_state_bytes(sizes.numel, stage, world_size, lp_bytes,
                                                                         sizes.grad_bytes, sizes.state.bytes_per_param)
    sizes = dataclasses.replace(sizes, unit_order=tuple(unit_numels), unit_params=model.units,
                                reduce_bucket=zero.reduce_bucket_size, gather_bucket=zero.allgather_bucket_size,
                                persistence=zero.persistence_threshold)  # the collectives' bucket sizes
    local = node.ranks_per_node or world_size
    free = dict(budgets)
    base_sizes, base = sizes, {"device": activation_bytes, "host": materialize_bytes, "nvme": 0}
    # [Note: needs per component]: [Note: activation memory], [Note: materialization in the host pool]
    needs = {"activations": _on_tiers(device=activation_bytes), "materialization": _on_tiers(host=materialize_bytes)}
    free["host"] -= materialize_bytes
    free["device"] -= activation_bytes
    placement: dict[str, Location] = {}
    units_on: tuple[Location, ...] | None = None  # [Note: optimizer split]
    for kind in KINDS:
        requested = getattr(offload, kind)
        if isinstance(requested, dict):  # an explicit optimizer split (config.py allows it there only)
            units_on = split_units(requested, sizes)
            want = split_bytes(units_on, sizes)
            short = {t: want[t] - free[t] for t in want if want[t] > free[t]}
            if short:
                raise PlanDoesNotFit(split_does_not_fit(units_on, short, sizes, budgets), kind,
                                     [{"tier": "split", "more": short}], placement, sum(state_bytes.values()))
            chosen = Location.NVME
        else:
            candidates = [Location(requested)] if requested != "auto" else \
                [loc for loc in Location if tier_holds(kind, loc, sizes.cuda, sizes.state)]
            chosen = None
            for loc in candidates:
                want = bytes_for(kind, loc, sizes)
                if all(want[t] <= free[t] for t in want):
                    chosen = loc
                    break
            if kind == "optimizer" and requested == "auto" and chosen in (None, Location.NVME):
                units_on = auto_split(sizes, free)
                if units_on is not None and chosen is Location.NVME:  # the split only where it is faster
                    whole = predict({**placement, kind: chosen}, sizes, device.type, rates, local, None, compute,
                                    step)[0]
                    split = predict({**placement, kind: chosen}, sizes, device.type, rates, local, units_on,
                                    compute, step)[0]
                    units_on = units_on if split.step_s < whole.step_s else None
                chosen = Location.NVME if units_on is not None else chosen
        if units_on is not None and len(set(units_on)) == 1:  # fractions rounded to whole units: one tier
            chosen, units_on = units_on[0], None
        if chosen is None:
            message, options = does_not_fit(kind, candidates, sizes, free, budgets, nvme_off(tiers))
            error = PlanDoesNotFit(message, kind, options, placement, sum(state_bytes.values()))
            error.explain = lambda: whole_shortfall(  # [Note: the whole shortfall], built if it is raised
                offload, base_sizes, base, budgets, sizes.cuda, nvme_off(tiers), unit_names)
            raise error
        placement[kind] = chosen
        want = split_bytes(units_on, sizes) if kind == "optimizer" and units_on else bytes_for(kind, chosen, sizes)
        for t, b in want.items():
            free[t] -= b
        needs[kind] = want
        if kind == "gradients":
            sizes = dataclasses.replace(sizes, grads_on_gpu=device.type == "cuda" and HOMES[chosen].on_device,
                                        grads_on_nvme=not HOMES[chosen].in_memory)
    # [Note: where the update runs]: each unit's side, and the device memory its staging takes
    def step_s(split) -> float:  # the step the plan reports with this split: its speculation included
        options = dataclasses.replace(step, on_device=tuple(side == "device" for side in split.units))
        room = dict(free, device=free["device"] - split.staging_bytes)
        try:
            spec = fit_speculation(options, placement, units_on, sizes, room, compute, sum(state_bytes.values()))
        except PlanDoesNotFit:
            return float("inf")  # raised below for the split chosen
        return predict_step(placement, sizes, device.type, rates, local, units_on, compute, options,
                            spec.units if spec.on else None)[0].step_s
    step_on = _step_on(step.step_on, placement, units_on, sizes, rates, local, free, budgets,
                       sum(state_bytes.values()), step_s)
    needs["device_step"] = _on_tiers(device=step_on.staging_bytes)
    free["device"] -= step_on.staging_bytes
    step = dataclasses.replace(step, on_device=tuple(side == "device" for side in step_on.units))
    spec = fit_speculation(step, placement, units_on, sizes, free, compute, sum(state_bytes.values()))
    needs["speculation"] = _on_tiers(**spec.undo, nvme=spec.nvme)
    if step.overlap == Delayed.name and Delayed.refusal(world_size, placement, units_on) is None:
        # [Note: delayed update]: the window's gradient copies and staged parameters, in the host pool
        delayed = Delayed.plan_terms(sizes)
        extra = delayed["host"]
        if extra > free["host"] - spec.undo["host"]:
            raise PlanDoesNotFit(Delayed.too_little_host(extra, free["host"], budgets["host"]), "gradients",
                                 [{"tier": "host", "more": {"host": extra - free["host"]}}], placement,
                                 sum(state_bytes.values()))
        needs["delayed"] = delayed
    schedule, used, spec_s = predict_step(placement, sizes, device.type, rates, local, units_on, compute, step,
                                           spec.units if spec.on else None)
    breakdown = {c: schedule.seconds.get(c, 0.0) for c in COMPONENTS}
    split: dict[str, tuple[int, int]] = {}
    for loc, unit in zip(units_on or (), sizes.state_units):
        b, k = split.get(loc.value, (0, 0))
        split[loc.value] = (b + sum(unit), k + 1)
    return Plan(placement, needs, budgets, schedule.step_s, breakdown, sizes.numel, world_size, stage,
                state_bytes, {k: rate_sources[k] for k in used}, sizes.grad_bytes, lp_bytes, precision.accumulator_dtype,
                units_on, split, sum(frozen_numels), frozen_bytes,
                {c: schedule.critical.get(c, 0.0) for c in COMPONENTS},
                bound_by(schedule.critical, device.type, all(side == "device" for side in step_on.units)),
                compute is not None,
                state_layout=sizes.state, speculative=spec.on, rollback_rate=step.rollback_rate,
                speculation_units=spec.units if spec.on else (), speculation_step_s=spec_s,
                speculation_note=spec.note, optimizer_step_on=step_on.units, optimizer_step_sides=step_on.sides,
                optimizer_step_request=step.step_on)


def _step_on(requested: str, placement: dict[str, Location], units_on: tuple[Location, ...] | None, sizes: Sizes,
             rates: dict[str, float], local: int, free: dict[str, int], budgets: dict[str, int], per_rank_bytes: int,
             step_s):
    """[Note: choosing where each update runs] Each unit's side; `auto` takes the split, or every unit
    on the device, only where it shortens the whole step (`step_s(split)`: the step the plan reports,
    speculation included, where the device's units share compute, the links and the drive with the
    rest) and the device has room for its staging; `device` without that room is refused ([Note: the
    device step's staging memory])."""
    homes = units_on or (placement["optimizer"],) * len(sizes.unit_order)
    # the new params go through the set unless each unit's device home holds its shard (ParamStore.device_out):
    # every unit replicated (one rank, stage 0) or stage 3's own shard; at stages 1-2 the shards are gathered
    out_in_place = shard_in_place(HOMES[placement["params"]].on_device, sizes.world_size, sizes.stage)
    costs = UpdateCosts.of(rates, sizes.state.bytes_per_param, sizes.grad_bytes, sizes.lp_bytes, cuda=sizes.cuda,
                           grads_on_device=HOMES[placement["gradients"]].on_device,
                           params_on_device=HOMES[placement["params"]].on_device,
                           params_in_place=out_in_place, local_ranks=local,
                           master_bytes=sizes.state.master_itemsize,
                           cpu_key=cpu_rate_key(rates, sizes.rule, sizes.state),
                           device_key=device_rate_key(rates, sizes.rule, sizes.state))
    shards = held_shards_in_order(sizes)
    # the engine stages a gradient in only from off the device of a CUDA run ([Note: device staging])
    grads_staged = sizes.cuda and not HOMES[placement["gradients"]].on_device
    staging = staging_bytes_of(sizes.state_units, shards, 0 if out_in_place else sizes.lp_bytes,
                               sizes.grad_bytes if grads_staged else 0)
    chosen = choose(requested, homes, shards, costs, sizes.cuda, staging)
    cpu = choose("cpu", homes, shards, costs, sizes.cuda, staging)
    if requested == "auto" and chosen.units != cpu.units and chosen.staging_bytes <= free["device"]:
        # the schedule runs the device's units as the engine does ([Note: the device step in the schedule]):
        # the split, every unit on the CPU, or every unit on the device, the fastest whole step (ties: the
        # CPU, then the split)
        every = choose("device", homes, shards, costs, sizes.cuda, staging)
        candidates = [cpu, chosen] + ([every] if every.staging_bytes <= free["device"] else [])
        return min(candidates, key=step_s)
    if chosen.staging_bytes <= free["device"]:
        return chosen
    if requested == "device":
        short = chosen.staging_bytes - free["device"]
        raise PlanDoesNotFit(device_step_does_not_fit(chosen.staging_bytes, free["device"], budgets["device"]),
                             "optimizer", [{"tier": "device", "more": {"device": short}}], placement,
                             per_rank_bytes)
    return cpu


def _on_tiers(device: int = 0, host: int = 0, nvme: int = 0) -> dict[str, int]:
    """A component's term: its bytes on each tier."""
    return {"device": device, "host": host, "nvme": nvme}


def _resolve_rates(rates: dict[str, float] | None) -> tuple[dict[str, float], dict[str, str]]:
    """Rates for the prediction and where each came from."""
    if rates is not None:
        source, given = "given", rates
    else:
        from ..bench import load_rates  # light: json + os only
        source, given = "measured", load_rates() or {}
    merged = {**DEFAULT_RATES, **given}
    return merged, {k: (source if k in given else "default") for k in merged}
