"""GradStore's memory backend: an accumulator per unit on the host or the device
([Note: a unit's gradient bytes] and [Note: no zeroing pass] in grads.py).
"""
from __future__ import annotations

import collections
from concurrent.futures import Future, ThreadPoolExecutor, wait as wait_futures
from dataclasses import dataclass, field

import torch

from .device import enter as enter_device
from .optim import _kernels
from .state import Location, Unit
from .tiers.homes import HOMES, Tiers
from .threads import GRAD_ADD, owned

STAGED_UNITS = 2  # GPU review N6: gradient D2H staging in flight, in the largest unit's bytes (_StagingBound)


@dataclass(slots=True, eq=False)
class AccumulatorSlot:
    """One unit's gradient sums in memory on the gradient tier ([Note: a unit's gradient bytes])."""

    acc: "torch.Tensor | None" = None      # the full flat over the window (a host-pool block's tensor, or device)
    reduced: "torch.Tensor | None" = None  # this rank's reduced shard, or `acc` itself (aliased)
    adds: list = field(default_factory=list)  # host adds after a D2H copy, pending (CUDA offload)
    stale: bool = False                    # [Note: no zeroing pass]


class MemoryGrads:
    """GradStore's backend with an accumulator per unit on the host or the device."""

    defers_reduce = True     # a skipped reduce leaves the sum in the accumulator
    settled_by_ready = True  # the optimizer reads the accumulator itself: READY means its adds landed

    def __init__(self, units: list[Unit], loc: Location, grad_dtype: torch.dtype, device_tier, host_pool, sharding,
                 profiler=None):
        self.units, self.loc, self.grad_dtype = units, loc, grad_dtype
        self.home_kind = HOMES[loc]  # the accumulators' tier ([Note: homes] in tiers/homes.py)
        self.device_tier, self.host_pool, self.sharding, self.profiler = device_tier, host_pool, sharding, profiler
        self.tiers = Tiers(device_tier, host_pool)
        self.slots = [AccumulatorSlot() for _ in units]
        self._blocks = []  # host-pool blocks this backend holds
        device = device_tier.device
        self._adder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zerotier-grad",
                                         initializer=enter_device, initargs=(device,)) \
            if device.type == "cuda" and not self.home_kind.on_device else None
        self._staging: _StagingBound | None = None  # D2H staging of host gradients (CUDA), made at the first offload

    @staticmethod
    def host_blocks(loc: Location, units: int, world_size: int, stage: int) -> int:
        """Host-pool blocks the accumulators hold: per unit its home's (and its reduced shard's when
        sharded)."""
        return units * (2 if world_size > 1 and stage >= 1 else 1) * HOMES[loc].blocks_at_rest

    @staticmethod
    def staging_bytes(largest: int, grad_itemsize: int, alignment: int) -> int:
        """Host-pool bytes of the per-parameter D2H staging blocks in flight with host gradients on
        a CUDA device ([Note: a unit's gradient bytes]; GPU review N6): STAGED_UNITS x the largest
        unit's gradient, each block rounded up to the pool's alignment. The planner counts exactly this."""
        return STAGED_UNITS * (-(-largest * grad_itemsize // alignment) * alignment)

    def place(self, unit: Unit, whole: bool) -> None:
        """`whole`: the optimizer reads the full sum, so the reduced shard is the accumulator itself."""
        slot = self.slots[unit.index]
        slot.acc = self._alloc(unit.numel, f"{unit.key}.grad")
        slot.reduced = slot.acc if whole else self._alloc(unit.shard_numel, f"{unit.key}.grad_shard")

    def _alloc(self, numel: int, what: str) -> torch.Tensor:
        home = self.home_kind.reserve(what, numel, self.grad_dtype, self.tiers)
        if home.block is not None:
            self._blocks.append(home.block)
        return home.view().zero_()

    def accumulate(self, unit: Unit, i: int, grad: torch.Tensor, first_in_window: bool) -> None:
        slot = self.slots[unit.index]
        offset, numel = unit.offsets[i], unit.shapes[i].numel()
        acc = slot.acc[offset: offset + numel]
        flat = grad.reshape(-1)
        offload = acc.device.type == "cpu" and not self.home_kind.on_device
        nbytes = numel * grad.element_size()
        prof = self.profiler
        token = prof.begin(unit.key + ".grad", "grad", "device", "host", nbytes, "grad-offload") \
            if prof is not None and offload else None
        first = slot.stale and first_in_window  # [Note: no zeroing pass]
        ticket = None
        if flat.device == acc.device:
            acc.copy_(flat) if first else acc.add_(flat)
            if offload:
                self.device_tier.count_out(nbytes)
        else:  # [Note: a unit's gradient bytes]: async D2H into a pool block, add after its event
            if self._staging is None:
                self._staging = _StagingBound(self.staging_bytes(
                    max(u.numel for u in self.units), grad.element_size(), self.host_pool.alignment),
                    self.host_pool.alignment)
            size = self._staging.admit(nbytes)  # waits for the oldest adds past the bound (N6)
            block = self.host_pool.alloc(nbytes, grad.dtype, "gradient staging")
            ticket = self.device_tier.copy_d2h(block.tensor, flat)
            add = self._adder.submit(self._add_after, ticket, acc, block, first)
            self._staging.add(add, size)
            slot.adds.append(add)
        if token is not None:
            prof.end(token, copy=ticket)

    @owned(GRAD_ADD)
    def _add_after(self, ticket, acc: torch.Tensor, block, first: bool) -> None:
        try:
            ticket.wait()
            acc.copy_(block.tensor) if first else acc.add_(block.tensor)
        finally:
            self.host_pool.free(block)  # before the future completes: _StagingBound counts on it

    def unit_complete(self, unit: Unit) -> None:
        pass  # the adds in flight are the unit's sum

    def settle(self, unit: Unit) -> None:
        slot = self.slots[unit.index]
        adds, slot.adds = slot.adds, []
        for future in adds:
            future.result()

    def reduce_input(self, unit: Unit) -> torch.Tensor:
        """The unit's full gradient for the reduce-scatter: its accumulator."""
        self.settle(unit)
        return self.slots[unit.index].acc

    def shard_reduced(self, index: int, shard: torch.Tensor) -> None:
        reduced = self.slots[index].reduced
        if self.sharding.stage >= 2:
            reduced.add_(shard)  # accumulated over micro-batches (the bucketer delivers it where it lives)
        else:
            reduced.copy_(shard)  # the accumulator held the window's sum

    def end_backward(self) -> None:
        pass

    def after_backward(self, reduced: bool) -> None:
        if reduced and self.sharding.stage >= 2:  # the micro-batch's sum now lives in the shards
            for slot in self.slots:
                if slot.acc is not slot.reduced:
                    slot.acc.zero_()

    def ready(self, unit: Unit, got: set[int]) -> None:
        slot = self.slots[unit.index]
        if slot.stale:  # parameters without a gradient in this window read as zero
            for k in set(range(len(unit.params))) - got:
                slot.acc[unit.offsets[k]: unit.offsets[k] + unit.shapes[k].numel()].zero_()
            slot.stale = False

    def fill_zeros(self, unit: Unit) -> None:
        """The EMPTY unit's gradient reads as zero: stale slices are zeroed by ready(); with several
        ranks drop() zeroed the accumulator and the shard."""
        self.slots[unit.index].stale = not self.sharding.active

    def read_param(self, unit: Unit, k: int, has_sum: bool) -> torch.Tensor:
        acc = self.slots[unit.index].acc
        if not has_sum:
            return torch.zeros(unit.shapes[k], dtype=self.grad_dtype, device=acc.device)
        offset = unit.offsets[k]
        return acc[offset: offset + unit.shapes[k].numel()].view(unit.shapes[k])

    def set_param(self, unit: Unit, k: int, value: "torch.Tensor | None") -> None:
        offset = unit.offsets[k]
        sl = self.slots[unit.index].acc[offset: offset + unit.shapes[k].numel()]
        sl.zero_() if value is None else sl.copy_(value.reshape(-1))

    def shard(self, unit: Unit) -> torch.Tensor:
        return self.slots[unit.index].reduced

    def sumsq(self, unit: Unit) -> "float | torch.Tensor":
        grad = self.slots[unit.index].reduced
        if grad.device.type == "cpu":
            return _kernels.grad_sumsq(grad)
        return torch.linalg.vector_norm(grad, dtype=torch.float64).square()

    def forget(self) -> None:
        pass  # nothing is in flight past settle()

    def drop(self, unit: Unit) -> None:
        """The unit's accumulated gradient reads as zero from now on."""
        slot = self.slots[unit.index]
        if self.sharding.active:
            slot.acc.zero_()
            if slot.reduced is not slot.acc:
                slot.reduced.zero_()
        else:  # [Note: no zeroing pass]
            slot.stale = True

    def close(self) -> None:
        if self._adder is not None:
            self._adder.shutdown(wait=True)
        blocks, self._blocks = self._blocks, []
        for block in blocks:
            self.host_pool.free(block)


class _StagingBound:
    """GPU review N6: per-parameter gradient staging blocks in flight (a D2H copy, then the adder's
    add, which frees the block) hold at most `limit` pool bytes (MemoryGrads.staging_bytes,
    counted by the planner): past it, the next gradient waits for the oldest adds. Compute thread
    only; each add's future is the handoff ([Note: thread ownership])."""

    def __init__(self, limit: int, alignment: int):
        self.limit, self.alignment = limit, alignment
        self._inflight: collections.deque[tuple[Future, int]] = collections.deque()  # oldest first
        self.bytes = 0   # pool bytes (rounded to the alignment) of the blocks in flight
        self.peak = 0

    def admit(self, nbytes: int) -> int:
        """Wait until a block of `nbytes` fits (a single one always does); returns its counted size."""
        size = -(-nbytes // self.alignment) * self.alignment
        while self._inflight and (self._inflight[0][0].done() or self.bytes + size > self.limit):
            future, n = self._inflight.popleft()
            wait_futures([future])  # its error is raised by settle()
            self.bytes -= n
        return size

    def add(self, future: Future, size: int) -> None:
        self._inflight.append((future, size))
        self.bytes += size
        self.peak = max(self.peak, self.bytes)


