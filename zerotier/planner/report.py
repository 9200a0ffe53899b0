"""What a plan that does not fit lacks, all of it at once, and the cheapest ways to fix it.

[Note: the whole shortfall]
The placement loop (planner.py: _place) stops at the first kind of state that fits nowhere; a user
who adds what that kind lacks used to meet the next kind's shortfall ("33.77 GiB more nvme",
then "734 GiB more"). So the refusal also lays out the whole plan placed the cheapest way:
every kind over the tiers its offload.* setting allows (explicit ones fixed, an explicit
optimizer split as written), each tier's need summed as sizes.bytes_for counts it, and of
the routes the one whose missing bytes cost least, at rough relative prices per byte
(`PRICE`: GPU memory > RAM > NVMe; ties to the fastest-tier-first route). The message has:

  - a table per tier of that route: needed / budget / missing;
  - the cheapest fixes, in order: that route's missing bytes as settings; compact optimizer
    state (precision.master_dtype = "bf16", moment_dtype = "int8": 12 -> 4 B/param) and what
    it saves, where the state is exact; the next cheapest routes (another kind moved to NVMe);
  - the largest unit, by name and bytes, when one unit alone cannot fit its tier: its
    parameters on the device while it computes, its optimizer staging set in host memory when
    the optimizer state is on NVMe. No budget short of that size helps; a finer train.wrap does.

Speculation's extra state is not in the routes (it turns itself off where it does not fit).
"""
from __future__ import annotations

import dataclasses
import itertools

from ..config import OffloadConfig
from ..units import format_setting, format_size
from ..optim.state_layout import StateLayout
from ..state import TIER_NAMES as TIERS, Location
from ..tiers.homes import HOMES
from .sizes import KINDS, bytes_for, split_bytes, split_units, tier_holds

PRICE = {"device": 100, "host": 10, "nvme": 1}  # relative cost of a byte: HBM, DRAM, flash
COMPACT = StateLayout("bf16", "int8")


def _route_need(route: dict, s, base: dict[str, int], cuda: bool) -> dict[str, int]:
    """Each tier's need with every kind where `route` puts it (a Location, or a tuple of unit
    tiers: an optimizer split), counted as planner.py's _place counts them."""
    need = dict(base)
    s = dataclasses.replace(s, grads_on_gpu=False, grads_on_nvme=False)
    for kind, where in route.items():
        want = split_bytes(where, s) if isinstance(where, tuple) else bytes_for(kind, where, s)
        for t, b in want.items():
            need[t] += b
        if kind == "gradients":
            s = dataclasses.replace(s, grads_on_gpu=cuda and HOMES[where].on_device,
                                    grads_on_nvme=not HOMES[where].in_memory)
    return need


def _routes(offload: OffloadConfig, s, base: dict[str, int], budgets: dict[str, int], cuda: bool) -> list[tuple]:
    """Every complete placement `offload` allows, as (cost, need, route), cheapest first."""
    choices = []
    for kind in KINDS:
        requested = getattr(offload, kind)
        if isinstance(requested, dict):
            choices.append([split_units(requested, s)])
        elif requested == "auto":
            choices.append([loc for loc in Location if tier_holds(kind, loc, cuda, s.state)])
        else:
            choices.append([Location(requested)])
    out = []
    for order, combo in enumerate(itertools.product(*choices)):
        route = dict(zip(KINDS, combo))
        need = _route_need(route, s, base, cuda)
        cost = sum(PRICE[t] * max(0, need[t] - budgets[t]) for t in TIERS)
        out.append((cost, order, need, route))
    out.sort(key=lambda r: r[:2])
    return [(cost, need, route) for cost, _, need, route in out]


def _where(route: dict) -> str:
    return ", ".join(f"{kind} " + (f"split {'/'.join(dict.fromkeys(loc.value for loc in where))}"
                                   if isinstance(where, tuple) else f"on {where.value}")
                     for kind, where in route.items())


def _settings(need: dict[str, int], budgets: dict[str, int], nvme_off: str) -> str:
    """The settings that give `need`: 'tiers.nvme = "768 GiB" (734.00 GiB more nvme)'."""
    parts = []
    for t in TIERS:
        short = need[t] - budgets[t]
        if short <= 0:
            continue
        if t == "nvme" and budgets["nvme"] == 0:
            parts.append(f"enable the nvme tier ({nvme_off}) with room for {format_size(need[t])}")
        else:
            parts.append(f'tiers.{t} = "{format_setting(need[t])}" ({format_size(short)} more {t})')
    return " and ".join(parts)


def _largest_unit(s, budgets: dict[str, int], route: dict, names: dict[int, str]) -> str:
    """[Note: the whole shortfall] The largest unit, when it alone cannot fit its tier."""
    from ..optim.state_store import OptStateStore

    full = s.with_frozen()
    numel = full.largest
    name = names.get(numel)
    who = ("the root unit (the model's own parameters outside its blocks: embeddings, head)" if name == "" else
           f"unit {name!r}" if name else "the largest unit")
    params = numel * s.lp_bytes
    if params > budgets["device"]:
        return (f"{who} has {numel:,} parameters, {format_size(params)}, more than the whole device budget "
                f"({format_size(budgets['device'])}): its parameters are on the device while it computes. Split it "
                "(train.wrap: a finer wrap) or raise tiers.device")
    optimizer_home = HOMES.get(route.get("optimizer"))  # None for a split: a tuple of unit tiers
    if optimizer_home is not None and not optimizer_home.in_memory:  # NVMe: the state is staged through host
        staging = OptStateStore.staging_bytes(1, s.state_units)
        if staging > budgets["host"]:
            return (f"{who} has {numel:,} parameters; one staging set of its optimizer state, "
                    f"{format_size(staging)}, is more than the whole host budget ({format_size(budgets['host'])}). "
                    "Split it (train.wrap: a finer wrap) or raise tiers.host")
    return ""


def whole_shortfall(offload: OffloadConfig, s, base: dict[str, int], budgets: dict[str, int],
                    cuda: bool, nvme_off: str, names: dict[int, str]) -> tuple[str, dict]:
    """[Note: the whole shortfall] The table and the fixes, appended to PlanDoesNotFit's message, and
    the table as data (`zerotier plan --json`'s missing.whole)."""
    routes = _routes(offload, s, base, budgets, cuda)
    cost, need, route = routes[0]
    data = {"placement": {k: ("split" if isinstance(w, tuple) else w.value) for k, w in route.items()},
            "tiers": {t: {"needed": need[t], "budget": budgets[t], "missing": max(0, need[t] - budgets[t])}
                      for t in TIERS}}
    lines = [f"The whole plan, placed the cheapest way ({_where(route)}):",
             f"  {'tier':8s} {'needed':>12s} {'budget':>12s} {'missing':>12s}"]
    for t in TIERS:
        lines.append(f"  {t:8s} {format_size(need[t]):>12s} {format_size(budgets[t]):>12s} "
                     f"{format_size(max(0, need[t] - budgets[t])):>12s}")
    fixes = []
    if cost:
        fixes.append(_settings(need, budgets, nvme_off))
    if s.state.bytes_per_param > COMPACT.bytes_per_param:
        small = dataclasses.replace(s, state=COMPACT)
        saved = round((s.state.bytes_per_param - COMPACT.bytes_per_param) * s.rank_numel("optimizer"))
        c_cost, c_need, c_route = _routes(offload, small, base, budgets, cuda)[0]
        then = "then it fits" if not c_cost else f"then {_settings(c_need, budgets, nvme_off)}"
        fixes.append(f'compact optimizer state (precision.master_dtype = "bf16", precision.moment_dtype = "int8": '
                     f"{s.state.bytes_per_param:.4g} -> {COMPACT.bytes_per_param:.4g} B/param) saves "
                     f"{format_size(saved)}; {then} ({_where(c_route)})")
    for other_cost, other_need, other_route in routes[1:3]:
        if other_cost and other_route != route:
            fixes.append(f"or {_where(other_route)}: {_settings(other_need, budgets, nvme_off)}")
    lines.append("Cheapest fixes, in order:")
    lines += [f"  {i}. {fix}" for i, fix in enumerate(fixes, 1)]
    unit = _largest_unit(s, budgets, route, names)
    if unit:
        lines.append(f"One unit alone does not fit: {unit}.")
    return "\n" + "\n".join(lines), data
