"""What zerotier manages: one `Unit` (layout only) per module that owns parameters (a trainable
unit, and a frozen one for its requires_grad=False parameters), and the states a unit's
parameters and gradient pass through in a step.

[Note: units]
A unit is the set of trainable parameters (a frozen unit: frozen ones, [Note: frozen
units]) of a *wrapped* module's subtree that no nested wrapped module holds, flattened
in registration order (FSDP's wrapping). The wrapped modules are the root plus those
`train.wrap` picks: by default the model's repeated blocks — the children of a ModuleList/Sequential/ModuleDict whose class occurs
more than once there (each transformer layer, each MoE expert) — or every module of the
listed classes. A unit is resident for its module's whole forward (and refetched for
its backward), so a parameter read anywhere inside that module — by a child's
forward, or directly, as nn.MultiheadAttention reads `out_proj.weight` — is there;
one used outside it (`h @ self.emb.weight` in the root) belongs to an enclosing unit,
the root's at worst. A parameter shared by several units' modules (tied weights)
belongs to the first; the others' modules fetch that unit too. It is the grain of
everything: fetched/released together (ZeRO-3 style), one optimizer sub-group,
one set of NVMe files. `Unit` is layout only: which parameters, their shapes and
offsets in the flat, and (set once by `Sharding.assign`) the partition over
data-parallel ranks. Nothing writes it afterwards. Where each kind of state lives
and how it moves is owned by one store each:

  state                    owner                    where (by placement)
  low-precision params     params.ParamStore        device flat / host pool block / NVMe file `<key>.param`
  gradient accumulator     grads.GradStore          device tensor / host pool block
  fp32 master, exp_avg(_sq) optim.UnitOptimizer     device tensors / host pool blocks / NVMe files

[Note: frozen units]
`offload.params` covers every parameter. The frozen (requires_grad=False) floating
parameters of a wrapped module's subtree form a second unit of that module, flagged
`frozen`, listed after every trainable unit (indices continue). ParamStore holds it
like any other (home on device/host/NVMe, in precision.param_dtype) and the module's
hooks fetch and release it with the trainable unit, but it has no gradient, no fp32
master and no optimizer state: GradStore, UnitOptimizer and everything that steps or
clips see `engine.units` (the trainable ones) only; `engine.param_units` is both.
Its home bytes are its truth: a write through the surface stores there, and
state_dict/checkpoints read them (so with a bf16 param_dtype a frozen fp32 weight is
rounded to bf16 once, as model.to(bf16) would). Non-floating frozen parameters stay
unmanaged on the device. LoRA is the case it is for: the frozen base streams from
host or NVMe while only the adapters train.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from .tier_names import TIER_NAMES


class Location(enum.Enum):
    """The three tiers, named by tier_names.TIER_NAMES (fastest first)."""

    DEVICE, HOST, NVME = TIER_NAMES

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class IllegalTransition(RuntimeError):
    """A store was asked to move a unit between states that do not connect (a bug, not bad input)."""


class ParamState(enum.Enum):
    """Where a unit's low-precision parameters are, as seen from compute (params.ParamStore).

    RELEASED: the unit's device flat has storage of size 0: `p.data` are views of it
        (shapes and dtypes stay truthful) but no device bytes are held or counted.
        Its bytes live only at home (host pool block or NVMe file, or this rank's
        shard at ZeRO-3).
    FETCHING: device bytes are allocated and counted; a copy (or all-gather) into them
        is in flight, tagged with the parameter version it reads.
    RESIDENT: the device flat holds the current version; compute may read `p.data`.
    Units whose parameters always live on the device (not streamed) are RESIDENT for
    the whole run.
    """

    RELEASED = "released"
    FETCHING = "fetching"
    RESIDENT = "resident"


PARAM_TRANSITIONS = {
    ParamState.RELEASED: {ParamState.FETCHING},
    ParamState.FETCHING: {ParamState.RESIDENT, ParamState.RELEASED},  # RELEASED: a dropped prefetch
    ParamState.RESIDENT: {ParamState.RELEASED},
}


class GradState(enum.Enum):
    """What a unit's gradient holds in the current accumulation window (grads.GradStore).

    EMPTY: nothing since the last optimizer step (accumulator is zero).
    ACCUMULATING: at least one micro-batch's gradient was added; more may follow.
    READY: final for this window: this rank's reduced shard is what the optimizer reads.
    STEPPED: the optimizer consumed it; zeroed (back to EMPTY) at the end of the step.
    """

    EMPTY = "empty"
    ACCUMULATING = "accumulating"
    READY = "ready"
    STEPPED = "stepped"


GRAD_TRANSITIONS = {
    GradState.EMPTY: {GradState.ACCUMULATING},
    GradState.ACCUMULATING: {GradState.ACCUMULATING, GradState.READY, GradState.EMPTY},  # EMPTY: skipped step
    # ACCUMULATING: a speculated window reopened (one rank, [Note: speculative step] in overlap/speculative.py)
    GradState.READY: {GradState.STEPPED, GradState.EMPTY, GradState.ACCUMULATING},
    GradState.STEPPED: {GradState.EMPTY},
}


def check_transition(old, new, allowed: dict, what: str):
    """`new` if `allowed` (a transition table: state -> the states it may go to) connects `old` to
    it, else IllegalTransition naming `what` and both states."""
    if new not in allowed[old]:
        raise IllegalTransition(f"{what} cannot go from {old.value} to {new.value}")
    return new


def transition(states: list, index: int, new, allowed: dict, what: str) -> None:
    """states[index] -> new, or IllegalTransition naming the unit and both states."""
    states[index] = check_transition(states[index], new, allowed, f"unit {index}: {what}")


@dataclass(frozen=True, eq=False)
class Unit:
    index: int
    name: str                                  # qualified module name ("" = root)
    params: tuple[torch.nn.Parameter, ...]
    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]                   # element offset of each param in the flat
    numel: int
    modules: tuple[str, ...] = ()              # every module using these params (ties)
    # data-parallel sharding (see [Note: sharding] in dist/sharding.py); one rank: the whole flat
    part: object = field(default=None)         # dist.partition.Partition
    shard_lo: int = 0                          # this rank's real elements: [shard_lo, shard_hi)
    shard_hi: int = 0
    frozen: bool = False                       # [Note: frozen units]: no gradient, master or optimizer state
    # elements of this rank's (padded) shard: what the optimizer and gradient shard hold; fixed by
    # `part` at construction (the whole flat without one), so the step reads a field, not a call
    shard_numel: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shard_numel", self.numel if self.part is None else self.part.shard_numel)

    @property
    def key(self) -> str:
        """Stem of this unit's NVMe keys."""
        return f"u{self.index:05d}"

    @property
    def param_key(self) -> str:
        return f"{self.key}.param"

    def views(self, flat: torch.Tensor):
        """(param, view of flat shaped like the param) pairs."""
        for p, shape, off in zip(self.params, self.shapes, self.offsets):
            yield p, flat[off: off + shape.numel()].view(shape)


def wrapped_modules(model: torch.nn.Module, wrap) -> set[str]:
    """Names of the modules that are units ([Note: units]): the root ("") plus, for `wrap` =
    "auto", the repeated blocks; for a tuple of class names, the modules of those classes; for a
    callable, the modules for which wrap(name, module) is true."""
    names = {""}
    if wrap == "auto":
        for name, module in model.named_modules():
            if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)):
                classes = [type(child) for child in module.children()]
                for child_name, child in module.named_children():
                    if classes.count(type(child)) > 1:
                        names.add(f"{name}.{child_name}" if name else child_name)
    elif callable(wrap):
        names |= {name for name, module in model.named_modules() if wrap(name, module)}
    else:
        wanted = set(wrap)
        found = {type(m).__name__ for m in model.modules()}
        missing = wanted - found
        if missing:
            from .errors import ConfigError
            raise ConfigError(f"train.wrap names {sorted(missing)}, but the model has no module of "
                              f"{'that class' if len(missing) == 1 else 'those classes'}; its classes: "
                              f"{', '.join(sorted(found))}")
        names |= {name for name, module in model.named_modules() if type(module).__name__ in wanted}
    return names


def build_units(model: torch.nn.Module, wrap="auto") -> list[Unit]:
    """The units ([Note: units], [Note: frozen units]): per wrapped module one unit of its
    trainable parameters and one of its frozen floating ones; the trainable units first, then the
    frozen ones, each kind in the order its first parameter is registered.

    A parameter shared by several modules (tied weights) belongs to the unit of the first
    module that registers it; the wrapped modules of later users are listed in `modules`.
    """
    wrapped = wrapped_modules(model, wrap)
    found = {False: [], True: []}   # frozen? -> [(wrapper, params, users)]
    unit_of: dict[tuple[bool, str], int] = {}   # (frozen, wrapped module name) -> index in found[frozen]
    owner: dict[int, tuple[bool, int]] = {}     # id(param) -> (frozen, index in found[frozen])
    for mod_name, module in model.named_modules(remove_duplicate=False):  # a shared module under each name
        wrapper = _nearest(mod_name, wrapped)
        for p in module._parameters.values():
            if p is None or not (p.requires_grad or p.is_floating_point()):
                continue  # an integer buffer-like parameter: unmanaged
            if id(p) in owner:  # tied: the wrapper of this module fetches the owner's unit too
                frozen, k = owner[id(p)]
                users = found[frozen][k][2]
                if wrapper not in users:
                    users.append(wrapper)
                continue
            frozen = not p.requires_grad
            if (frozen, wrapper) not in unit_of:
                unit_of[frozen, wrapper] = len(found[frozen])
                found[frozen].append((wrapper, [], [wrapper]))
            owner[id(p)] = frozen, unit_of[frozen, wrapper]
            found[frozen][unit_of[frozen, wrapper]][1].append(p)
    units = []
    for frozen in (False, True):
        for name, params, users in found[frozen]:
            offsets, total = [], 0
            for p in params:
                offsets.append(total)
                total += p.numel()
            units.append(Unit(index=len(units), name=name, params=tuple(params), shapes=tuple(p.shape for p in params),
                              offsets=tuple(offsets), numel=total, modules=tuple(users), frozen=frozen))
    return units


def nested_numel(units: list[Unit]) -> int:
    """Elements of the units that stay resident around another one: the most, over all units, of
    the summed numel of the units whose module encloses it (the root's, and any wrapped ancestor's:
    resident for their whole forward). The planner adds it to the fetch working set."""
    by_name: dict[str, int] = {}  # a module's trainable and frozen units together
    for u in units:
        by_name[u.name] = by_name.get(u.name, 0) + u.numel
    most = 0
    for unit in units:
        if not unit.name:
            continue
        parts = unit.name.split(".")
        enclosing = [""] + [".".join(parts[:k]) for k in range(1, len(parts))]
        most = max(most, sum(by_name.get(name, 0) for name in enclosing))
    return most


def _nearest(name: str, wrapped: set[str]) -> str:
    """The innermost wrapped module containing module `name` (itself, an ancestor, or the root)."""
    while name not in wrapped:
        name = name.rpartition(".")[0]
    return name
