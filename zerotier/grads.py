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
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from .device import enter as enter_device
from .dist.buckets import GradBucketer
from .state import GRAD_TRANSITIONS, GradState, Location, Unit, transition
from .optim import _kernels


class GradStore:
    def __init__(self, units: list[Unit], loc: Location, grad_dtype: torch.dtype, device_tier, host_pool, sharding,
                 reduce_bucket_size: int, profiler=None):
        self.units, self.loc, self.grad_dtype = units, loc, grad_dtype
        self.device_tier, self.host_pool, self.sharding = device_tier, host_pool, sharding
        self.device = device_tier.device
        self.profiler = profiler
        n = len(units)
        self.state = [GradState.EMPTY] * n
        self.acc: list[torch.Tensor | None] = [None] * n      # full flat, accumulated over micro-batches
        self.reduced: list[torch.Tensor | None] = [None] * n  # this rank's reduced shard (or acc, aliased)
        self._seen = [0] * n                                  # gradients of this backward so far
        self._adds: list[list] = [[] for _ in range(n)]       # pending host adds (CUDA offload)
        self._stale = [False] * n                             # [Note: no zeroing pass]
        self._got: list[set[int]] = [set() for _ in range(n)]  # params with a gradient in this window
        self._blocks = []                                     # host-pool blocks this store holds
        self._adder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zerotier-grad",
                                         initializer=enter_device, initargs=(self.device,)) \
            if self.device.type == "cuda" and loc is not Location.DEVICE else None
        self.bucketer = GradBucketer(reduce_bucket_size, self._shard_ready, comm=sharding.comm,
                                     reduce_dtype=torch.float32, device=self.device) if sharding.active else None
        self._reduce_order = [u.index for u in reversed(units)]  # [Note: the same collectives on every rank]
        self._final = [False] * n                                # final in this backward, not yet queued
        self._queued = 0                                         # reduce-order position reached
        self._agreed = False                                     # this window's Sharding.agree() done

    def place(self, unit: Unit) -> None:
        i = unit.index
        sharding = self.sharding
        self.acc[i] = self._alloc(self.loc, unit.numel, f"{unit.key}.grad")
        aliased = not sharding.active or (unit.part.replicated and sharding.stage <= 1)
        self.reduced[i] = self.acc[i] if aliased else self._alloc(self.loc, unit.shard_numel,
                                                                  f"{unit.key}.grad_shard")

    def _alloc(self, loc: Location, numel: int, what: str) -> torch.Tensor:
        if loc is Location.DEVICE:
            t = self.device_tier.alloc((numel,), self.grad_dtype, what)
        else:
            block = self.host_pool.alloc(numel * self.grad_dtype.itemsize, self.grad_dtype, what)
            self._blocks.append(block)
            t = block.tensor
        return t.zero_()

    # ------------------------------------------------------------------ backward

    def accumulate(self, unit: Unit, i: int, grad: torch.Tensor) -> bool:
        """Fold parameter i's fresh gradient into the unit's accumulator. True once every
        parameter of the unit has delivered its gradient in this backward."""
        index = unit.index
        offset, numel = unit.offsets[i], unit.shapes[i].numel()
        acc = self.acc[index][offset: offset + numel]
        flat = grad.reshape(-1)
        offload = acc.device.type == "cpu" and self.loc is Location.HOST
        nbytes = numel * grad.element_size()
        prof = self.profiler
        token = prof.begin(unit.key + ".grad", "grad", "device", "host", nbytes, "grad-offload") \
            if prof is not None and offload else None
        first, ticket = False, None
        if self._stale[index]:  # [Note: no zeroing pass]
            first = i not in self._got[index]
        self._got[index].add(i)
        if flat.device == acc.device:
            acc.copy_(flat) if first else acc.add_(flat)
            if offload:
                self.device_tier.count_out(nbytes)
        else:  # [Note: a unit's gradient bytes]: async D2H into a pool block, add after its event
            block = self.host_pool.alloc(nbytes, grad.dtype, "gradient staging")
            ticket = self.device_tier.copy_d2h(block.tensor, flat)
            self._adds[index].append(self._adder.submit(self._add_after, ticket, acc, block, first))
        if token is not None:
            prof.end(token, copy=ticket)
        if self.state[index] is not GradState.ACCUMULATING:
            transition(self.state, index, GradState.ACCUMULATING, GRAD_TRANSITIONS, "gradient")
        self._seen[index] += 1
        return self._seen[index] >= len(unit.params)

    def _add_after(self, ticket, acc: torch.Tensor, block, first: bool) -> None:
        ticket.wait()
        acc.copy_(block.tensor) if first else acc.add_(block.tensor)
        self.host_pool.free(block)

    def settle(self, unit: Unit) -> None:
        """Wait for the unit's pending host adds (re-raising their errors)."""
        adds, self._adds[unit.index] = self._adds[unit.index], []
        for future in adds:
            future.result()

    def reduce(self, unit: Unit) -> None:
        """The unit's accumulator is final for this backward: queue it for the reduce-scatter
        once every unit before it in the fixed order is ([Note: the same collectives on every rank])."""
        self._final[unit.index] = True
        self._queue_final(everything=False)

    def _queue_final(self, everything: bool) -> None:
        while self._queued < len(self._reduce_order):
            i = self._reduce_order[self._queued]
            if not (everything or self._final[i]):
                return
            unit = self.units[i]
            self.settle(unit)
            self.bucketer.add(i, self.acc[i], unit.part)
            self._queued += 1

    def _shard_ready(self, index: int, shard: torch.Tensor) -> None:
        reduced = self.reduced[index]
        if self.sharding.stage >= 2:
            reduced.add_(shard.to(reduced.device))  # accumulated over micro-batches
        else:
            reduced.copy_(shard)  # the accumulator held the window's sum

    def end_backward(self, reduced: bool) -> None:
        """After loss.backward(): reset per-backward counts; finish the reductions issued."""
        self._seen = [0] * len(self.units)
        for unit in self.units:
            self.settle(unit)
        if reduced:
            self._queue_final(everything=True)  # units without a gradient too, in the same order
            self._final, self._queued = [False] * len(self.units), 0
            self.bucketer.flush()
            self.bucketer.wait()
            if self.sharding.stage >= 2:  # the micro-batch's sum now lives in the shards
                for i, acc in enumerate(self.acc):
                    if acc is not self.reduced[i]:
                        acc.zero_()

    # ------------------------------------------------------------------ step

    def ready(self, unit: Unit) -> None:
        """The unit's gradient is final for this window (its reduced shard is complete)."""
        self.settle(unit)
        i = unit.index
        if self._stale[i]:  # parameters without a gradient in this window read as zero
            for k in set(range(len(unit.params))) - self._got[i]:
                self.acc[i][unit.offsets[k]: unit.offsets[k] + unit.shapes[k].numel()].zero_()
            self._stale[i] = False
        transition(self.state, unit.index, GradState.READY, GRAD_TRANSITIONS, "gradient")

    def ready_all(self) -> list[Unit]:
        """End of the window: every accumulating unit is final. Returns the units now READY
        (with several ranks: the units that got a gradient on any rank)."""
        if self.sharding.active and not self._agreed:  # per parameter: a gradient on any rank? (once a window)
            self._agreed = True
            flags = self.sharding.agree([k in self._got[u.index] for u in self.units for k in range(len(u.params))])
            for unit in self.units:
                i, n = unit.index, len(unit.params)
                got, flags = {k for k in range(n) if flags[k]}, flags[n:]
                self._got[i] = got
                if got and self.state[i] is GradState.EMPTY:  # its reduced shard is this window's
                    transition(self.state, i, GradState.ACCUMULATING, GRAD_TRANSITIONS, "gradient")
        for unit in self.units:
            if self.state[unit.index] is GradState.ACCUMULATING:
                self.ready(unit)
        return [u for u in self.units if self.state[u.index] is GradState.READY]

    def got(self, unit: Unit) -> frozenset[int] | None:
        """The unit's parameters (indices) that got a gradient in this window, on any rank; None
        when all did. The optimizer leaves the others untouched, as torch skips a .grad of None."""
        got = self._got[unit.index]
        return None if len(got) == len(unit.params) else frozenset(got)

    def stepped(self, unit: Unit) -> None:
        transition(self.state, unit.index, GradState.STEPPED, GRAD_TRANSITIONS, "gradient")

    def shard(self, unit: Unit) -> torch.Tensor:
        """What the optimizer reads: this rank's reduced gradient shard (padding is zero)."""
        return self.reduced[unit.index]

    def sumsq(self, units: list[Unit]) -> "float | torch.Tensor":
        """Sum of squares of these units' gradients (fp64 accumulation). Host gradients: a float
        (native kernel). Device gradients: a 0-d fp64 tensor on the device, never synced here —
        the step reads the global norm once, after the all-reduce."""
        host, device = 0.0, []
        for unit in units:
            if self.state[unit.index] is GradState.EMPTY:
                continue  # no gradient in this window (the accumulator may be stale)
            grad = self.reduced[unit.index]
            if grad.device.type == "cpu":
                host += _kernels.grad_sumsq(grad)
            else:
                device.append(torch.linalg.vector_norm(grad, dtype=torch.float64).square())
        if not device:
            return host
        return torch.stack(device).sum() + host

    def zero(self) -> None:
        """Drop every gradient (end of a step, or a skipped one)."""
        for unit in self.units:
            i = unit.index
            self.settle(unit)
            if self.state[i] is not GradState.EMPTY:
                if self.sharding.active:
                    self.acc[i].zero_()
                    if self.reduced[i] is not self.acc[i]:
                        self.reduced[i].zero_()
                else:  # [Note: no zeroing pass]
                    self._stale[i] = True
                transition(self.state, i, GradState.EMPTY, GRAD_TRANSITIONS, "gradient")
            self._got[i] = set()
            for p in unit.params:
                p.grad = None
        self._seen = [0] * len(self.units)
        self._final, self._queued = [False] * len(self.units), 0  # a failed backward's queue too
        self._agreed = False

    def close(self) -> None:
        """Stop the adder thread and give the accumulators' pool blocks back. Idempotent."""
        if self._adder is not None:
            self._adder.shutdown(wait=True)
        blocks, self._blocks = self._blocks, []
        for block in blocks:
            self.host_pool.free(block)
