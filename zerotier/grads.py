"""The gradient store: accumulation over micro-batches, reduction across ranks, and the
shard the optimizer reads.

[Note: a unit's gradient bytes]
Each unit has an accumulator (`acc`, the full flat in `precision.grad_dtype`) on the
gradient tier: a host-pool block (pinned, aligned) or a device tensor, with one rank
or several. The optimizer reads `shard(unit)`: the accumulator itself with one rank
(or a replicated unit at stages 0-1), else this rank's reduced shard (`shard_numel`
elements on the gradient tier), filled by the bucketed reduce-scatter, whose buckets
live on the compute device (NCCL reduces device memory; a host accumulator is packed
into its bucket by a copy).

[Note: the same collectives on every rank]
Ranks may differ in which units get a gradient (data-dependent routing: an MoE expert
used on one rank only) and in the order hooks fire. Collectives must not: so every
unit is reduced in every reducing backward, in one fixed order (reverse unit index,
close to backward order). A unit whose gradient is final is queued as soon as every
unit before it in that order was; units without a gradient this backward are queued
at its end (their accumulators hold zeros, or the window's sum so far). At the window's
end one all-reduce(MAX) of per-parameter "got a gradient" flags (Sharding.agree) makes every
rank step exactly the parameters that got a gradient on any rank — the others are not
updated, as in torch.

Offload to a host accumulator is the torchao idiom: the gradient is copied on the
device tier's d2h stream (which first waits for compute) into a pool block, an
event is recorded, and a worker thread adds the block into the accumulator after
the event, off the autograd thread. On the CPU the gradient is already host memory:
it is added where it is. `settle(unit)` waits for a unit's pending adds; everything
that reads an accumulator calls it first.

[Note: no zeroing pass]
With one rank an accumulator is not zeroed after a step: it is marked stale, and each
parameter's first gradient of the next window is *copied* into its slice instead of
added (torch's AccumulateGrad steals the first gradient the same way). That saves a
write pass over every gradient byte per step and turns the first add's two reads into
one. When the window ends (`ready`), slices of parameters that got no gradient are
zeroed; a unit that got none at all stays EMPTY and is never read (`sumsq` skips it).
With several ranks the reduce-scatter reads whole accumulators: they are zeroed.

[Note: zero gradients that still step]
torch's zero_grad(set_to_none=False) leaves every parameter that had a gradient with a zero
`.grad`, and AdamW steps such a parameter (its moments decay, weight decay applies) even
when the next window gives it no gradient. `zero(set_to_none=False)` keeps that: `_present`
holds, per unit, the parameters that got a gradient since the last set_to_none drop, and
while `_keep_zeros` is on (the caller's last drop was set_to_none=False) they count as
having a gradient of zero at the window's end (`ready_all`, `got`); a unit with nothing
but such zeros is readied with its slices zeroed. One parameter's gradient can also be
replaced or dropped inside a window (`set_param`: `p.grad = t` / `p.grad = None`).

[Note: the gradient store's backends]
`GradStore` keeps the window's bookkeeping per unit (`GradSlot`: state, which parameters
got a gradient, the reduce order) and delegates where the sums live to one backend:
`grads_memory.MemoryGrads` (an accumulator per unit, host or device: the notes above) or
`grads_nvme.NvmeGrads` (a file per unit: [Note: gradients on NVMe] in grads_nvme.py).
Only the store touches its files: the optimizer gets a `GradFile` from `shard()` and asks
it to read into a pool block it gives (`read_into`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch._C import DisableTorchFunctionSubclass

from .dist.buckets import GradBucketer
from .errors import ConfigError
from .grads_memory import STAGED_UNITS, MemoryGrads
from .grads_nvme import GRAD_WRITES, OPEN_UNITS, GradFile, NvmeGrads
from .slots import SlotField
from .state import GRAD_TRANSITIONS, GradState, Location, Unit, transition
from .tiers.homes import HOMES, Home
from .threads import COMPUTE, UPDATER, owned

__all__ = ["GRAD_WRITES", "OPEN_UNITS", "STAGED_UNITS", "GradFile", "GradSlot", "GradStore", "MemoryGrads",
           "NvmeGrads"]


def refuse_sparse_gradients(model: torch.nn.Module) -> None:
    """A trainable nn.Embedding / nn.EmbeddingBag built with sparse=True makes sparse gradients; the
    store sums dense flats, and AdamW (torch's too: "Adam does not support sparse gradients") steps
    dense ones. Refused at initialize, naming the module, before anything is placed."""
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.sparse \
                and module.weight.requires_grad:
            raise ConfigError(
                f"module '{name or '<root>'}' ({type(module).__name__}) was built with sparse=True: its weight "
                "would get sparse gradients, which zerotier's AdamW does not take (nor does torch.optim.AdamW: "
                "\"Adam does not support sparse gradients\"). Build it with sparse=False (the default; the "
                "training is the same, with a dense gradient), or freeze its weight (requires_grad_(False)) "
                "before zerotier.initialize")


@dataclass(slots=True, eq=False)
class GradSlot:
    """One unit's gradient in the current window, wherever its sum lives (the backend's slot)."""

    state: GradState = GradState.EMPTY
    seen: int = 0                                   # gradients delivered in this backward
    got: set[int] = field(default_factory=set)      # parameters with a gradient in this window
    present: set[int] = field(default_factory=set)  # [Note: zero gradients that still step]
    final: bool = False                             # final in this backward, not yet queued for the reduce
    handed: bool = False                            # an early step owns it until step() ([Note: thread ownership])


def _backend(loc: Location):
    """The backend class for gradients on `loc`: files on NVMe, accumulators in memory otherwise."""
    return MemoryGrads if HOMES[loc].in_memory else NvmeGrads


class GradStore:
    """Gradients of every unit over an accumulation window ([Note: the gradient store's backends])."""

    def __init__(self, units: list[Unit], loc: Location, grad_dtype: torch.dtype, device_tier, host_pool, sharding,
                 reduce_bucket_size: int, store=None, profiler=None):
        self.units, self.loc, self.grad_dtype, self.sharding = units, loc, grad_dtype, sharding
        self.slots = [GradSlot() for _ in units]    # by unit index
        self._states = SlotField(self.slots, "state")  # what transition() writes
        self._keep_zeros = False                       # the last drop was set_to_none=False
        if _backend(loc) is NvmeGrads:  # the backend is chosen once
            if store is None:
                raise ValueError("GradStore: gradients on nvme need the NVMe store")
            self.backend = NvmeGrads(units, grad_dtype, device_tier, host_pool, sharding, store, profiler)
        else:
            self.backend = MemoryGrads(units, loc, grad_dtype, device_tier, host_pool, sharding, profiler)
        self.bucketer = GradBucketer(reduce_bucket_size, self.backend.shard_reduced, comm=sharding.comm,
                                     reduce_dtype=torch.float32) if sharding.active else None
        if self.bucketer is not None:  # the buckets live on the device: counted there ([Note: bucket memory])
            self.bucketer.allocate_from(device_tier, [u.part for u in units],
                                        None if HOMES[loc].on_device else host_pool)
        self._reduce_order = [u.index for u in reversed(units)]  # [Note: the same collectives on every rank]
        self._queued = 0                                         # reduce-order position reached
        self._agreed = False                                     # this window's Sharding.agree() done

    @property
    def defers_reduce(self) -> bool:
        """A backward may skip the reduce (engine.no_sync): the sum so far is kept for the next."""
        return self.backend.defers_reduce

    @property
    def state(self) -> SlotField:
        """Every unit's GradState, read-only for the engine (slots[i].state is the truth); to go once
        engine.py reads `slots`."""
        return self._states

    # ------------------------------------------------------------------ sizing (the planner's terms)

    offload_staging_bytes = staticmethod(MemoryGrads.staging_bytes)
    nvme_staging_bytes = staticmethod(NvmeGrads.staging_bytes)
    nvme_conversion_bytes = staticmethod(NvmeGrads.conversion_bytes)
    nvme_writes_in_flight = staticmethod(NvmeGrads.writes_in_flight)

    @staticmethod
    def host_blocks(loc: Location, units: int, world_size: int, stage: int) -> int:
        """Host-pool blocks the gradients hold at most at once: on the host an accumulator per unit
        (and its reduced shard when sharded); on NVMe the staging of NvmeGrads.staging_bytes."""
        return _backend(loc).host_blocks(loc, units, world_size, stage)

    @staticmethod
    def plan_terms(home: type[Home], s) -> dict[str, int]:
        """The gradients' bytes per tier with accumulators in homes of class `home` ([Note: bytes per
        parameter] in planner/sizes.py; `s`: the planner's Sizes): the accumulators, their staging,
        and with several ranks the reduce buckets and the copies on each side of the reduce."""
        tier = home.location.value
        need = home.plan_bytes(s.held_numel("gradients"), s.grad_bytes)
        if home.in_memory and not home.on_device and s.cuda and s.engine_buffers:
            need["host"] += GradStore.offload_staging_bytes(s.largest, s.lp_bytes, s.alignment)  # the D2H in flight
        if not home.in_memory:  # [Note: gradients on NVMe]: the full gradient is staging only
            if s.engine_buffers:
                need["host"] += GradStore.nvme_staging_bytes(s.largest, s.held_largest("gradients"), s.lp_bytes,
                                                            s.grad_bytes, s.world_size, s.stage)
            if s.engine_buffers and s.world_size > 1 and s.stage == 1:  # the reduced shards' files too
                need[tier] += s.grad_bytes * sum(s.shard_numels())
        elif s.engine_buffers and s.world_size > 1 and s.stage >= 1:
            # The engine keeps both the full gradient (the reduce-scatter input; freeing
            # it per bucket is future work) and this rank's reduced shard (the partition's
            # padded shard), on the gradient tier. Stages >= 2 counted the shard above, stage 1
            # the full flat.
            need[tier] += s.grad_bytes * (s.numel if s.stage >= 2 else sum(s.shard_numels()))
        if s.engine_buffers and s.world_size > 1:  # the reduce buckets: fp32, on the device
            need["device"] += GradBucketer.buffer_bytes(s.reduce_bucket, 4, s.partitions())
            if not home.on_device:  # [Note: bucket memory]: host gradients cross by the tier's copies
                need["host"] += GradBucketer.staging_bytes(s.reduce_bucket, 4, s.partitions(), alignment=s.alignment)
                need["device"] += GradBucketer.conversion_bytes(s.largest, s.grad_bytes)
            if not home.in_memory and s.cuda:
                need["device"] += GradStore.nvme_conversion_bytes(s.largest, s.lp_bytes, s.grad_bytes, s.world_size,
                                                                 s.stage)
        return need

    @owned(COMPUTE)
    def place(self, unit: Unit) -> None:
        # the optimizer reads the full sum itself, not a reduced shard ([Note: a unit's gradient bytes])
        whole = not self.sharding.active or (unit.part.replicated and self.sharding.stage <= 1)
        self.backend.place(unit, whole)

    # ------------------------------------------------------------------ backward

    @owned(COMPUTE)
    def accumulate(self, unit: Unit, i: int, grad: torch.Tensor) -> bool:
        """Fold parameter i's fresh gradient into the unit's sum. True once every parameter of
        the unit has delivered its gradient in this backward."""
        slot = self.slots[unit.index]
        self.backend.accumulate(unit, i, grad, first_in_window=i not in slot.got)
        slot.got.add(i)
        slot.present.add(i)
        if slot.state is not GradState.ACCUMULATING:
            transition(self._states, unit.index, GradState.ACCUMULATING, GRAD_TRANSITIONS, "gradient")
        slot.seen += 1
        complete = slot.seen >= len(unit.params)
        if complete:
            self.backend.unit_complete(unit)
        return complete

    def settle(self, unit: Unit) -> None:
        """Wait for the unit's pending adds or folds (re-raising their errors)."""
        self.backend.settle(unit)

    @owned(COMPUTE)
    def reduce(self, unit: Unit) -> None:
        """The unit's gradient is final for this backward: queue it for the reduce-scatter once
        every unit before it in the fixed order is ([Note: the same collectives on every rank])."""
        self.slots[unit.index].final = True
        self._queue_final(everything=False)

    def _queue_final(self, everything: bool) -> None:
        while self._queued < len(self._reduce_order):
            i = self._reduce_order[self._queued]
            if not (everything or self.slots[i].final):
                return
            unit = self.units[i]
            self.bucketer.add(i, self.backend.reduce_input(unit), unit.part)
            self._queued += 1

    @owned(COMPUTE)
    def end_backward(self, reduced: bool) -> None:
        """After loss.backward(): reset per-backward counts; finish the reductions issued. A unit
        handed to an early step is the optimizer thread's to settle (GPU review N8)."""
        self.backend.end_backward()
        for slot in self.slots:
            slot.seen = 0
        for unit, slot in zip(self.units, self.slots):
            if not slot.handed:
                self.settle(unit)
        if reduced:
            self._queue_final(everything=True)  # units without a gradient too, in the same order
            for slot in self.slots:
                slot.final = False
            self._queued = 0
            self.bucketer.flush()
            self.bucketer.wait()
        self.backend.after_backward(reduced)

    # ------------------------------------------------------------------ step

    @owned(COMPUTE)
    def hand_over(self, unit: Unit) -> None:
        """[Note: early step] The unit's gradient is final for this window and now belongs to the
        optimizer thread, which settles it (`ready`) before its update: the autograd thread does
        not wait for the unit's host adds (GPU review N8). Returned at `zero()`, after step()."""
        self.slots[unit.index].handed = True

    @owned(UPDATER)
    def ready(self, unit: Unit) -> None:
        """The unit's gradient is final for this window (its reduced shard is complete)."""
        if self.backend.settled_by_ready:
            self.settle(unit)
        self.backend.ready(unit, self.slots[unit.index].got)
        transition(self._states, unit.index, GradState.READY, GRAD_TRANSITIONS, "gradient")

    @owned(COMPUTE)
    def ready_all(self) -> list[Unit]:
        """End of the window: every accumulating unit is final. Returns the units now READY
        (with several ranks: the units that got a gradient on any rank)."""
        zeros = self._zero_only_units()
        if self.sharding.active and not self._agreed:  # per parameter: a gradient on any rank? (once a window)
            self._agreed = True
            flags = self.sharding.agree([self.has(u, k) for u in self.units for k in range(len(u.params))])
            for unit, slot in zip(self.units, self.slots):
                n = len(unit.params)
                slot.got, flags = {k for k in range(n) if flags[k]}, flags[n:]
                if slot.got and slot.state is GradState.EMPTY:  # its reduced shard is this window's
                    transition(self._states, unit.index, GradState.ACCUMULATING, GRAD_TRANSITIONS, "gradient")
        for unit in zeros:
            if self.slots[unit.index].state is GradState.EMPTY:
                transition(self._states, unit.index, GradState.ACCUMULATING, GRAD_TRANSITIONS, "gradient")
                self.backend.fill_zeros(unit)
        for unit, slot in zip(self.units, self.slots):
            if slot.state is GradState.ACCUMULATING:
                self.ready(unit)
        return [u for u, slot in zip(self.units, self.slots) if slot.state is GradState.READY]

    def _zero_only_units(self) -> list[Unit]:
        """Units with no gradient in this window but a zero one to step ([Note: zero gradients that still step])."""
        if not self._keep_zeros:
            return []
        return [u for u, slot in zip(self.units, self.slots) if slot.state is GradState.EMPTY and slot.present]

    def got(self, unit: Unit) -> frozenset[int] | None:
        """The unit's parameters (indices) that got a gradient in this window, on any rank; None
        when all did. The optimizer leaves the others untouched, as torch skips a .grad of None."""
        slot = self.slots[unit.index]
        got = slot.got | slot.present if self._keep_zeros else slot.got
        return None if len(got) == len(unit.params) else frozenset(got)

    def has(self, unit: Unit, k: int) -> bool:
        """Whether parameter k of the unit has a gradient (a zero one included) in this window."""
        slot = self.slots[unit.index]
        return k in slot.got or (self._keep_zeros and k in slot.present)

    def read_param(self, unit: Unit, k: int) -> torch.Tensor:
        """Parameter k's gradient in this window (one rank): a view of its accumulator slice (writes
        reach the window) or a copy (the sum is a file); zeros for a zero gradient that still steps."""
        self.settle(unit)
        return self.backend.read_param(unit, k, has_sum=k in self.slots[unit.index].got)

    @owned(COMPUTE)
    def set_param(self, unit: Unit, k: int, value: "torch.Tensor | None") -> None:
        """`p.grad = value` for parameter k inside the window (one rank): its slice becomes `value`,
        or it has no gradient any more (None: not stepped, as torch skips a .grad of None)."""
        slot = self.slots[unit.index]
        self.settle(unit)
        if slot.state not in (GradState.EMPTY, GradState.ACCUMULATING):
            raise RuntimeError(f"gradient of unit {unit.name!r} set while {slot.state.name}")
        self.backend.set_param(unit, k, value)
        if value is None:
            slot.got.discard(k)
            slot.present.discard(k)
            return
        slot.got.add(k)
        slot.present.add(k)
        if slot.state is GradState.EMPTY:
            transition(self._states, unit.index, GradState.ACCUMULATING, GRAD_TRANSITIONS, "gradient")

    @owned(COMPUTE)
    def reopen(self) -> None:
        """[Note: speculative step] The window goes on after its speculated updates were undone
        (one rank): units made READY during the last backward accumulate again."""
        for unit, slot in zip(self.units, self.slots):
            if slot.state is GradState.READY:
                transition(self._states, unit.index, GradState.ACCUMULATING, GRAD_TRANSITIONS, "gradient")
            slot.handed = False

    @owned(UPDATER)
    def stepped(self, unit: Unit) -> None:
        transition(self._states, unit.index, GradState.STEPPED, GRAD_TRANSITIONS, "gradient")

    def shard(self, unit: Unit) -> "torch.Tensor | GradFile":
        """What the optimizer reads: this rank's reduced gradient shard (padding is zero), or with
        gradients on NVMe a GradFile it reads into a block of its own (`read_into`)."""
        if not self.backend.settled_by_ready:
            self.settle(unit)
        return self.backend.shard(unit)

    def sumsq(self, units: list[Unit]) -> "float | torch.Tensor":
        """Sum of squares of these units' gradients (fp64 accumulation). Host gradients: a float
        (native kernel). Device gradients: a 0-d fp64 tensor on the device, never synced here —
        the step reads the global norm once, after the all-reduce."""
        host, device = 0.0, []
        for unit in units:
            if self.slots[unit.index].state is GradState.EMPTY:
                continue  # no gradient in this window (the accumulator may be stale)
            if not self.backend.settled_by_ready:
                self.settle(unit)
            value = self.backend.sumsq(unit)
            if isinstance(value, torch.Tensor):
                device.append(value)
            else:
                host += value
        if not device:
            return host
        return torch.stack(device).sum() + host

    @owned(COMPUTE)
    def zero(self, set_to_none: "bool | None" = None) -> None:
        """Drop every gradient (end of a step, or a skipped one). `set_to_none`: the user's zero_grad
        (False: parameters that had a gradient keep a zero one, [Note: zero gradients that still
        step]); None: the engine's own drop after a step, which keeps the user's last choice."""
        self.backend.forget()
        if set_to_none is not None:
            self._keep_zeros = not set_to_none
        for unit, slot in zip(self.units, self.slots):
            slot.handed = False
            if set_to_none:
                slot.present = set()
            self.settle(unit)
            # with several ranks an EMPTY unit may hold another rank's reduced gradient (every unit is
            # reduced every reducing backward) until ready_all: a dropped window drops it too
            if slot.state is not GradState.EMPTY or self.sharding.active:
                self.backend.drop(unit)
            if slot.state is not GradState.EMPTY:
                transition(self._states, unit.index, GradState.EMPTY, GRAD_TRANSITIONS, "gradient")
            slot.got = set()
            slot.seen, slot.final = 0, False  # a failed backward's counts and queue too
            with DisableTorchFunctionSubclass():  # torch's own .grad (a failed backward's), not the window's
                for p in unit.params:
                    p.grad = None
        self._queued = 0
        self._agreed = False

    def close(self) -> None:
        """Stop the backend's threads and give its pool blocks back. Idempotent."""
        self.backend.close()
