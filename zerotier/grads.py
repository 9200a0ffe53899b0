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

[Note: gradients on NVMe]
With `offload.gradients = "nvme"` (NvmeGradStore) a unit's sum over the window lives in
a swap file, `<unit>.grad` (at ZeRO-1 with several ranks the reduced shard has its own,
`<unit>.grad_shard`). During a backward the unit's fresh gradient is gathered in one
host staging block, in the dtype autograd delivers (nothing is rounded early). Once
every parameter of the unit has its gradient (or at the end of backward), a
`zerotier-grad-io` worker *folds* it into the file: the window's first backward converts
it to `grad_dtype` and writes it; each later one reads the file, adds, and writes it back
(read-modify-write), and the sum of squares of what is written is kept for clipping.
The adds are those of a host accumulator, in the same dtype and order, so the update is
bitwise the same as with gradients on host. Decided against: accumulating the window in
host memory (a buffer per unit is the model's gradient bytes, the RAM this placement
exists to save) and one file per micro-batch (the optimizer would read K files, the disk
would hold K copies). The price is NVMe traffic: a window of K micro-batches writes
G*Psi K times and reads it K - 1 times, plus the optimizer's one read.
Host RAM for gradients is the staging only, never the model's size: the blocks of units
being filled (usually one or two: the root unit's gradients arrive at the start and the
end of backward) and GRAD_WRITES folds in flight (accumulate waits for the oldest before
handing over another): `nvme_staging_bytes`, which the planner counts. The optimizer
reads a unit's file one unit ahead (`shard()` returns an `NvmeGrad`: [Note: device
gradients, host optimizer] in optim/offload.py). With several ranks the fresh gradient,
rounded to grad_dtype as a zeroed accumulator would round it, is the reduce-scatter
input at stages 2-3 and the reduced shard is folded into the file; at stages 0-1 the
window's last backward reads the sum back as the input (one more read per unit and step).
"""
from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait as wait_futures

import torch
from torch._C import DisableTorchFunctionSubclass

from .device import enter as enter_device
from .io.ticket import ChainTicket, wait_all
from .dist.buckets import GradBucketer
from .state import GRAD_TRANSITIONS, GradState, Location, Unit, transition
from .optim import _kernels
from .optim.offload import NvmeGrad
from .threads import COMPUTE, GRAD_ADD, GRAD_IO, UPDATER, owned

GRAD_WRITES = 2  # [Note: gradients on NVMe]: folds in flight (the worker threads)
OPEN_UNITS = 2   # units being filled at once that the planner counts (the root unit and the one in backward)
STAGED_UNITS = 2  # GPU review N6: gradient D2H staging in flight, in the largest unit's bytes (_StagingBound)


def make_grad_store(units: list[Unit], loc: Location, grad_dtype: torch.dtype, device_tier, host_pool, sharding,
                    reduce_bucket_size: int, store=None, profiler=None) -> "GradStore":
    """The gradient store for placement `loc`; gradients on NVMe need the NVMe `store`."""
    if loc is Location.NVME:
        return NvmeGradStore(units, grad_dtype, device_tier, host_pool, sharding, reduce_bucket_size, store,
                             profiler)
    return GradStore(units, loc, grad_dtype, device_tier, host_pool, sharding, reduce_bucket_size, profiler)


class GradStore:
    defers_reduce = True  # a backward may skip the reduce (engine.no_sync): the accumulator keeps the sum

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
        self._present: list[set[int]] = [set() for _ in range(n)]  # [Note: zero gradients that still step]
        self._keep_zeros = False                                   # the last drop was set_to_none=False
        self._blocks = []                                     # host-pool blocks this store holds
        self._adder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zerotier-grad",
                                         initializer=enter_device, initargs=(self.device,)) \
            if self.device.type == "cuda" and loc is Location.HOST else None
        self.bucketer = GradBucketer(reduce_bucket_size, self._shard_ready, comm=sharding.comm,
                                     reduce_dtype=torch.float32) if sharding.active else None
        if self.bucketer is not None:  # the buckets live on the device: counted there ([Note: bucket memory])
            self.bucketer.allocate_from(device_tier, [u.part for u in units],
                                        host_pool if loc is not Location.DEVICE else None)
        self._reduce_order = [u.index for u in reversed(units)]  # [Note: the same collectives on every rank]
        self._final = [False] * n                                # final in this backward, not yet queued
        self._queued = 0                                         # reduce-order position reached
        self._agreed = False                                     # this window's Sharding.agree() done
        self._handed: set[int] = set()  # units whose gradient an early step owns until step() ([Note: thread ownership])
        self._staging: _StagingBound | None = None  # D2H staging of host gradients (CUDA), made at the first offload

    @owned(COMPUTE)
    def place(self, unit: Unit) -> None:
        i = unit.index
        self.acc[i] = self._alloc(self.loc, unit.numel, f"{unit.key}.grad")
        self.reduced[i] = self.acc[i] if self._aliased(unit) else self._alloc(self.loc, unit.shard_numel,
                                                                              f"{unit.key}.grad_shard")

    @staticmethod
    def offload_staging_bytes(largest: int, grad_itemsize: int, alignment: int) -> int:
        """Host-pool bytes of the per-parameter D2H staging blocks in flight with host gradients on
        a CUDA device ([Note: a unit's gradient bytes]; GPU review N6): STAGED_UNITS x the largest
        unit's gradient, each block rounded up to the pool's alignment. The planner counts exactly this."""
        return STAGED_UNITS * (-(-largest * grad_itemsize // alignment) * alignment)

    def _aliased(self, unit: Unit) -> bool:
        """The optimizer reads the accumulator itself ([Note: a unit's gradient bytes])."""
        return not self.sharding.active or (unit.part.replicated and self.sharding.stage <= 1)

    def _alloc(self, loc: Location, numel: int, what: str) -> torch.Tensor:
        if loc is Location.DEVICE:
            t = self.device_tier.alloc((numel,), self.grad_dtype, what)
        else:
            block = self.host_pool.alloc(numel * self.grad_dtype.itemsize, self.grad_dtype, what)
            self._blocks.append(block)
            t = block.tensor
        return t.zero_()

    # ------------------------------------------------------------------ backward

    @owned(COMPUTE)
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
        self._present[index].add(i)
        if flat.device == acc.device:
            acc.copy_(flat) if first else acc.add_(flat)
            if offload:
                self.device_tier.count_out(nbytes)
        else:  # [Note: a unit's gradient bytes]: async D2H into a pool block, add after its event
            if self._staging is None:
                self._staging = _StagingBound(self.offload_staging_bytes(
                    max(u.numel for u in self.units), grad.element_size(), self.host_pool.alignment),
                    self.host_pool.alignment)
            size = self._staging.admit(nbytes)  # waits for the oldest adds past the bound (N6)
            block = self.host_pool.alloc(nbytes, grad.dtype, "gradient staging")
            ticket = self.device_tier.copy_d2h(block.tensor, flat)
            add = self._adder.submit(self._add_after, ticket, acc, block, first)
            self._staging.add(add, size)
            self._adds[index].append(add)
        if token is not None:
            prof.end(token, copy=ticket)
        if self.state[index] is not GradState.ACCUMULATING:
            transition(self.state, index, GradState.ACCUMULATING, GRAD_TRANSITIONS, "gradient")
        self._seen[index] += 1
        return self._seen[index] >= len(unit.params)

    @owned(GRAD_ADD)
    def _add_after(self, ticket, acc: torch.Tensor, block, first: bool) -> None:
        try:
            ticket.wait()
            acc.copy_(block.tensor) if first else acc.add_(block.tensor)
        finally:
            self.host_pool.free(block)  # before the future completes: _StagingBound counts on it

    def settle(self, unit: Unit) -> None:
        """Wait for the unit's pending host adds (re-raising their errors)."""
        adds, self._adds[unit.index] = self._adds[unit.index], []
        for future in adds:
            future.result()

    @owned(COMPUTE)
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
            self.bucketer.add(i, self._reduce_input(unit), unit.part)
            self._queued += 1

    def _reduce_input(self, unit: Unit) -> torch.Tensor:
        """The unit's full gradient for the reduce-scatter: its accumulator."""
        self.settle(unit)
        return self.acc[unit.index]

    def _shard_ready(self, index: int, shard: torch.Tensor) -> None:
        reduced = self.reduced[index]
        if self.sharding.stage >= 2:
            reduced.add_(shard)  # accumulated over micro-batches (the bucketer delivers it where it lives)
        else:
            reduced.copy_(shard)  # the accumulator held the window's sum

    @owned(COMPUTE)
    def end_backward(self, reduced: bool) -> None:
        """After loss.backward(): reset per-backward counts; finish the reductions issued. A unit
        handed to an early step is the optimizer thread's to settle (GPU review N8)."""
        self._seen = [0] * len(self.units)
        for unit in self.units:
            if unit.index not in self._handed:
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

    @owned(COMPUTE)
    def hand_over(self, unit: Unit) -> None:
        """[Note: early step] The unit's gradient is final for this window and now belongs to the
        optimizer thread, which settles it (`ready`) before its update: the autograd thread does
        not wait for the unit's host adds (GPU review N8). Returned at `zero()`, after step()."""
        self._handed.add(unit.index)

    @owned(UPDATER)
    def ready(self, unit: Unit) -> None:
        """The unit's gradient is final for this window (its reduced shard is complete)."""
        self.settle(unit)
        i = unit.index
        if self._stale[i]:  # parameters without a gradient in this window read as zero
            for k in set(range(len(unit.params))) - self._got[i]:
                self.acc[i][unit.offsets[k]: unit.offsets[k] + unit.shapes[k].numel()].zero_()
            self._stale[i] = False
        transition(self.state, unit.index, GradState.READY, GRAD_TRANSITIONS, "gradient")

    @owned(COMPUTE)
    def ready_all(self) -> list[Unit]:
        """End of the window: every accumulating unit is final. Returns the units now READY
        (with several ranks: the units that got a gradient on any rank)."""
        zeros = self._zero_only_units()
        if self.sharding.active and not self._agreed:  # per parameter: a gradient on any rank? (once a window)
            self._agreed = True
            flags = self.sharding.agree([k in self._got[u.index] or (self._keep_zeros and k in self._present[u.index])
                                         for u in self.units for k in range(len(u.params))])
            for unit in self.units:
                i, n = unit.index, len(unit.params)
                got, flags = {k for k in range(n) if flags[k]}, flags[n:]
                self._got[i] = got
                if got and self.state[i] is GradState.EMPTY:  # its reduced shard is this window's
                    transition(self.state, i, GradState.ACCUMULATING, GRAD_TRANSITIONS, "gradient")
        for unit in zeros:
            if self.state[unit.index] is GradState.EMPTY:
                transition(self.state, unit.index, GradState.ACCUMULATING, GRAD_TRANSITIONS, "gradient")
                self._fill_zeros(unit)
        for unit in self.units:
            if self.state[unit.index] is GradState.ACCUMULATING:
                self.ready(unit)
        return [u for u in self.units if self.state[u.index] is GradState.READY]

    def _zero_only_units(self) -> list[Unit]:
        """Units with no gradient in this window but a zero one to step ([Note: zero gradients that still step])."""
        if not self._keep_zeros:
            return []
        return [u for u in self.units if self.state[u.index] is GradState.EMPTY and self._present[u.index]]

    def _fill_zeros(self, unit: Unit) -> None:
        """The EMPTY unit's gradient reads as zero: stale slices are zeroed by ready(); with several
        ranks _drop zeroed the accumulator and the shard."""
        self._stale[unit.index] = not self.sharding.active

    def got(self, unit: Unit) -> frozenset[int] | None:
        """The unit's parameters (indices) that got a gradient in this window, on any rank; None
        when all did. The optimizer leaves the others untouched, as torch skips a .grad of None."""
        got = self._got[unit.index]
        if self._keep_zeros:
            got = got | self._present[unit.index]
        return None if len(got) == len(unit.params) else frozenset(got)

    def has(self, unit: Unit, k: int) -> bool:
        """Whether parameter k of the unit has a gradient (a zero one included) in this window."""
        return k in self._got[unit.index] or (self._keep_zeros and k in self._present[unit.index])

    def read_param(self, unit: Unit, k: int) -> torch.Tensor:
        """Parameter k's gradient in this window (one rank): a view of its accumulator slice
        (writes reach the window) or zeros (a zero gradient that still steps, or no accumulator)."""
        self.settle(unit)
        i, offset, numel = unit.index, unit.offsets[k], unit.shapes[k].numel()
        if k not in self._got[i]:
            return torch.zeros(unit.shapes[k], dtype=self.grad_dtype, device=self.acc[i].device)
        return self.acc[i][offset: offset + numel].view(unit.shapes[k])

    @owned(COMPUTE)
    def set_param(self, unit: Unit, k: int, value: "torch.Tensor | None") -> None:
        """`p.grad = value` for parameter k inside the window (one rank): its slice becomes `value`,
        or it has no gradient any more (None: not stepped, as torch skips a .grad of None)."""
        self.settle(unit)
        i, offset, numel = unit.index, unit.offsets[k], unit.shapes[k].numel()
        if self.state[i] not in (GradState.EMPTY, GradState.ACCUMULATING):
            raise RuntimeError(f"gradient of unit {unit.name!r} set while {self.state[i].name}")
        sl = self.acc[i][offset: offset + numel]
        if value is None:
            sl.zero_()
            self._got[i].discard(k)
            self._present[i].discard(k)
            return
        sl.copy_(value.reshape(-1))
        self._got[i].add(k)
        self._present[i].add(k)
        if self.state[i] is GradState.EMPTY:
            transition(self.state, i, GradState.ACCUMULATING, GRAD_TRANSITIONS, "gradient")

    @owned(UPDATER)
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

    @owned(COMPUTE)
    def zero(self, set_to_none: "bool | None" = None) -> None:
        """Drop every gradient (end of a step, or a skipped one). `set_to_none`: the user's zero_grad
        (False: parameters that had a gradient keep a zero one, [Note: zero gradients that still
        step]); None: the engine's own drop after a step, which keeps the user's last choice."""
        self._handed = set()
        if set_to_none is not None:
            self._keep_zeros = not set_to_none
        if set_to_none:
            self._present = [set() for _ in self.units]
        for unit in self.units:
            i = unit.index
            self.settle(unit)
            # with several ranks an EMPTY unit may hold another rank's reduced gradient (every unit is
            # reduced every reducing backward) until ready_all: a dropped window drops it too
            if self.state[i] is not GradState.EMPTY or self.sharding.active:
                self._drop(i)
            if self.state[i] is not GradState.EMPTY:
                transition(self.state, i, GradState.EMPTY, GRAD_TRANSITIONS, "gradient")
            self._got[i] = set()
            with DisableTorchFunctionSubclass():  # torch's own .grad (a failed backward's), not the window's
                for p in unit.params:
                    p.grad = None
        self._seen = [0] * len(self.units)
        self._final, self._queued = [False] * len(self.units), 0  # a failed backward's queue too
        self._agreed = False

    def _drop(self, i: int) -> None:
        """Unit i's accumulated gradient reads as zero from now on."""
        if self.sharding.active:
            self.acc[i].zero_()
            if self.reduced[i] is not self.acc[i]:
                self.reduced[i].zero_()
        else:  # [Note: no zeroing pass]
            self._stale[i] = True

    def close(self) -> None:
        """Stop the adder thread and give the accumulators' pool blocks back. Idempotent."""
        if self._adder is not None:
            self._adder.shutdown(wait=True)
        blocks, self._blocks = self._blocks, []
        for block in blocks:
            self.host_pool.free(block)


class NvmeGradStore(GradStore):
    """The gradient store with each unit's window sum in NVMe files ([Note: gradients on NVMe]).
    `acc` and `reduced` stay None: the sums are files, the fresh gradients pool blocks."""

    def __init__(self, units: list[Unit], grad_dtype: torch.dtype, device_tier, host_pool, sharding,
                 reduce_bucket_size: int, store, profiler=None):
        super().__init__(units, Location.NVME, grad_dtype, device_tier, host_pool, sharding, reduce_bucket_size,
                         profiler)
        self.store = store
        n = len(units)
        self._reduce_each = sharding.active and sharding.stage >= 2  # the fresh gradient is the reduce input
        self.defers_reduce = not self._reduce_each
        self._files: list[tuple[str, str, int] | None] = [None] * n  # (sum key, reduced key, its numel)
        self._fresh: list = [None] * n                     # this backward's gradient (a pool block)
        self._fresh_got: list[set[int]] = [set() for _ in range(n)]  # its parameters delivered so far
        self._copies: list[list] = [[] for _ in range(n)]  # D2H copies into it in flight (CUDA)
        self._reducing: dict[int, object] = {}             # pool blocks handed to the reduce, by unit
        self._written: set[str] = set()                    # keys holding this window's sum (others: zero)
        self._sumsq = [0.0] * n                            # of each reduced file, as last written
        self._jobs: list[list[Future]] = [[] for _ in range(n)]  # folds not yet settled, by unit
        self._inflight: collections.deque[Future] = collections.deque()
        self._lock = threading.Lock()
        # [Note: gradients on NVMe]: the folds (read-modify-write), off the autograd thread
        self._io = ThreadPoolExecutor(max_workers=GRAD_WRITES, thread_name_prefix="zerotier-grad-io",
                                      initializer=enter_device, initargs=(self.device,))

    @staticmethod
    def staging_bytes(largest: int, largest_shard: int, lp_bytes: int, grad_bytes: int, world_size: int,
                      stage: int) -> int:
        """Host-pool bytes this store stages at most (the planner counts exactly this): OPEN_UNITS
        fresh gradients being filled, GRAD_WRITES folds in flight (a source: a fresh gradient or an
        fp32 reduced shard; and the sum read back), and with several ranks three units' gradients
        waiting in reduce buckets (units at least a bucket large; smaller ones: three buckets' worth)."""
        several = world_size > 1
        fresh = largest * (grad_bytes if several and stage >= 2 else lp_bytes)
        fold = max(fresh, 4 * largest_shard) + largest * grad_bytes
        return OPEN_UNITS * fresh + GRAD_WRITES * fold + (3 * largest * grad_bytes if several else 0)

    @staticmethod
    def conversion_bytes(largest: int, lp_bytes: int, grad_bytes: int, world_size: int, stage: int) -> int:
        """Device bytes of the casts of fresh gradients to grad_dtype on a CUDA device (stages 2-3
        with several ranks, where the fresh gradient is the reduce input), alive until the unit's
        reduce waits for its copies: OPEN_UNITS units' worth. The planner counts exactly this."""
        if world_size == 1 or stage < 2 or lp_bytes == grad_bytes:
            return 0
        return OPEN_UNITS * largest * grad_bytes

    def place(self, unit: Unit) -> None:
        total = f"{unit.key}.grad"
        aliased = self._aliased(unit)
        self._files[unit.index] = (total, total if aliased else f"{unit.key}.grad_shard",
                                   unit.numel if aliased else unit.shard_numel)

    # ------------------------------------------------------------------ backward

    @owned(COMPUTE)
    def accumulate(self, unit: Unit, i: int, grad: torch.Tensor) -> bool:
        index = unit.index
        fresh = self._fresh[index]
        if fresh is None:  # rounded now where it is the reduce input, as a zeroed accumulator would be
            dtype = self.grad_dtype if self._reduce_each else grad.dtype
            fresh = self._fresh[index] = self.host_pool.alloc(unit.numel * dtype.itemsize, dtype,
                                                              f"{unit.key}.grad staging")
        offset, numel = unit.offsets[i], unit.shapes[i].numel()
        dst, flat = fresh.tensor[offset: offset + numel], grad.reshape(-1)
        nbytes = numel * grad.element_size()
        prof = self.profiler
        token = prof.begin(unit.key + ".grad", "grad", "device", "host", nbytes, "grad-offload") \
            if prof is not None else None
        ticket = None
        if flat.device.type == "cpu":
            dst.copy_(flat)
            self.device_tier.count_out(nbytes)
        elif flat.dtype == dst.dtype:
            ticket = self.device_tier.copy_d2h(dst, flat)
            self._copies[index].append(ticket)
        else:  # rounded on the device, where the gradient is (the same rounding as the CPU's copy_), in a
            # device-tier buffer given back when the copy is waited (GPU review N13: conversion_bytes)
            cast = self.device_tier.alloc(flat.shape, dst.dtype, f"{unit.key}.grad cast")
            try:
                ticket = self.device_tier.copy_d2h(dst, cast.copy_(flat))
            except BaseException:
                self.device_tier.free(cast)
                raise
            self._copies[index].append(ChainTicket(ticket, _freeing(self.device_tier, cast)))
        if token is not None:
            prof.end(token, copy=ticket)
        self._fresh_got[index].add(i)
        self._got[index].add(i)
        self._present[index].add(i)
        if self.state[index] is not GradState.ACCUMULATING:
            transition(self.state, index, GradState.ACCUMULATING, GRAD_TRANSITIONS, "gradient")
        self._seen[index] += 1
        complete = self._seen[index] >= len(unit.params)
        if complete and not self._reduce_each:
            self._fold_fresh(unit)
        return complete

    def _take_fresh(self, unit: Unit):
        """The unit's gradient of this backward (zeros where a parameter got none) and the copies
        still filling it."""
        i = unit.index
        fresh, self._fresh[i] = self._fresh[i], None
        copies, self._copies[i] = self._copies[i], []
        got, self._fresh_got[i] = self._fresh_got[i], set()
        if fresh is None:  # several ranks reduce every unit, with or without a gradient here
            fresh = self.host_pool.alloc(unit.numel * self.grad_dtype.itemsize, self.grad_dtype,
                                         f"{unit.key}.grad staging")
            fresh.tensor.zero_()
        for k in set(range(len(unit.params))) - got:
            fresh.tensor[unit.offsets[k]: unit.offsets[k] + unit.shapes[k].numel()].zero_()
        return fresh, copies

    def _fold_fresh(self, unit: Unit) -> None:
        fresh, copies = self._take_fresh(unit)
        total, reduced, _ = self._files[unit.index]
        self._fold(unit.index, total, fresh, copies, add=total in self._written, sumsq=total == reduced)

    def _fold(self, index: int, key: str, src, waits: list, add: bool, sumsq: bool) -> None:
        """Hand `src` (a pool block, now the job's) to a worker: the file `key` becomes file + src
        (`add`) or src, in grad_dtype. Waits first while GRAD_WRITES folds are in flight."""
        self._written.add(key)
        while True:
            with self._lock:
                while self._inflight and self._inflight[0].done():
                    self._inflight.popleft()
                if len(self._inflight) < GRAD_WRITES:
                    break
                oldest = self._inflight[0]
            wait_futures([oldest])  # its error is raised by settle()
        try:
            job = self._io.submit(self._fold_job, key, src, waits, add, index if sumsq else None)
        except BaseException:
            _wait_quietly(waits)
            self.host_pool.free(src)
            raise
        with self._lock:
            self._jobs[index].append(job)
            self._inflight.append(job)

    @owned(GRAD_IO)
    def _fold_job(self, key: str, src, waits: list, add: bool, sumsq_index: int | None) -> None:
        """On a zerotier-grad-io worker: read-modify-write of one gradient file."""
        out = None
        try:
            wait_all(waits)
            dtype = self.grad_dtype
            if add or src.dtype != dtype:
                out = self.host_pool.alloc(src.tensor.numel() * dtype.itemsize, dtype, f"{key} (sum)")
                if add:
                    self._timed(key, "nvme", "host", out.nbytes, lambda: self.store.read(key, out))
                    out.tensor.add_(src.tensor)
                else:
                    out.tensor.copy_(src.tensor)
            result = out if out is not None else src
            if sumsq_index is not None:
                self._sumsq[sumsq_index] = _kernels.grad_sumsq(result.tensor)
            self._timed(key, "host", "nvme", result.nbytes, lambda: self.store.write(key, result, what=key))
        finally:
            self.host_pool.free(src)
            if out is not None:
                self.host_pool.free(out)

    def _timed(self, key: str, src: str, dst: str, nbytes: int, issue) -> None:
        """Issue an NVMe read or write of a gradient file and wait for it (recorded when profiling)."""
        start = time.perf_counter_ns()
        issue().wait()
        if self.profiler is not None:
            self.profiler.record(key, "grad", src, dst, nbytes, "grad-offload", start, time.perf_counter_ns(),
                                 stream="nvme-io")

    def settle(self, unit: Unit) -> None:
        """Wait for the unit's folds (re-raising their errors until the window is dropped). Safe from
        any thread: a fold is forgotten only once it has succeeded."""
        i = unit.index
        with self._lock:
            jobs = list(self._jobs[i])
        for job in jobs:
            job.result()
        with self._lock:
            done = {id(job) for job in jobs}
            self._jobs[i] = [job for job in self._jobs[i] if id(job) not in done]

    def _reduce_input(self, unit: Unit) -> torch.Tensor:
        i = unit.index
        if self._reduce_each:  # stages 2-3: this backward's gradient
            src, copies = self._take_fresh(unit)
            self._reducing[i] = src  # (given back by _shard_ready, or by zero() after an error)
            wait_all(copies)
        else:  # stages 0-1, the window's last backward: its sum, read back from its file
            self.settle(unit)
            total, _, _ = self._files[i]
            src = self._reducing[i] = self.host_pool.alloc(unit.numel * self.grad_dtype.itemsize,
                                                           self.grad_dtype, f"{unit.key}.grad (reduce input)")
            if total in self._written:
                self._timed(total, "nvme", "host", src.nbytes, lambda: self.store.read(total, src))
            else:
                src.tensor.zero_()
        return src.tensor

    def _shard_ready(self, index: int, shard: torch.Tensor) -> None:
        self.host_pool.free(self._reducing.pop(index))
        block = self.host_pool.alloc(shard.numel() * shard.element_size(), shard.dtype,
                                     f"{self.units[index].key}.grad_shard staging")
        block.tensor.copy_(shard)  # `shard` is a view of a bucket buffer the bucketer reuses
        _, reduced, _ = self._files[index]
        # stages 2-3 sum the micro-batches' reduced shards; at 0-1 the shard is the window's sum
        self._fold(index, reduced, block, [], add=self._reduce_each and reduced in self._written, sumsq=True)

    def end_backward(self, reduced: bool) -> None:
        if not self._reduce_each:  # units with a parameter that got no gradient in this backward
            for unit in self.units:
                if self._fresh[unit.index] is not None:
                    self._fold_fresh(unit)
        super().end_backward(reduced)
        for unit in self.units:  # the reduced shards' folds: errors surface in this backward
            self.settle(unit)

    # ------------------------------------------------------------------ step

    def _fill_zeros(self, unit: Unit) -> None:
        _, reduced, numel = self._files[unit.index]
        block = self.host_pool.alloc(numel * self.grad_dtype.itemsize, self.grad_dtype, f"{reduced} (zeros)")
        block.tensor.zero_()
        self._fold(unit.index, reduced, block, [], add=False, sumsq=True)

    def read_param(self, unit: Unit, k: int) -> torch.Tensor:
        """A copy (the sum is a file): writes to it do not reach the window."""
        i, offset, numel = unit.index, unit.offsets[k], unit.shapes[k].numel()
        if k not in self._got[i]:
            return torch.zeros(unit.shapes[k], dtype=self.grad_dtype)
        return self._with_file(unit, None)[offset: offset + numel].clone().view(unit.shapes[k])

    @owned(COMPUTE)
    def set_param(self, unit: Unit, k: int, value: "torch.Tensor | None") -> None:
        i, offset, numel = unit.index, unit.offsets[k], unit.shapes[k].numel()
        if self.state[i] not in (GradState.EMPTY, GradState.ACCUMULATING):
            raise RuntimeError(f"gradient of unit {unit.name!r} set while {self.state[i].name}")

        def edit(flat):
            flat[offset: offset + numel] = 0 if value is None else value.reshape(-1).to(flat.dtype)
        self._with_file(unit, edit)
        if value is None:
            self._got[i].discard(k)
            self._present[i].discard(k)
        else:
            self._got[i].add(k)
            self._present[i].add(k)
            if self.state[i] is GradState.EMPTY:
                transition(self.state, i, GradState.ACCUMULATING, GRAD_TRANSITIONS, "gradient")

    def _with_file(self, unit: Unit, edit) -> torch.Tensor:
        """The unit's window sum read from its file (zeros if none yet); `edit(flat)` changes it and
        it is written back (one rank: the file the optimizer reads). Returns a copy."""
        self.settle(unit)
        total, _, _ = self._files[unit.index]
        block = self.host_pool.alloc(unit.numel * self.grad_dtype.itemsize, self.grad_dtype, f"{total} (edit)")
        try:
            if total in self._written:
                self._timed(total, "nvme", "host", block.nbytes, lambda: self.store.read(total, block))
            else:
                block.tensor.zero_()
            if edit is not None:
                edit(block.tensor)
                self._sumsq[unit.index] = _kernels.grad_sumsq(block.tensor)
                self._written.add(total)
                self._timed(total, "host", "nvme", block.nbytes, lambda: self.store.write(total, block, what=total))
            return block.tensor.clone()
        finally:
            self.host_pool.free(block)

    @owned(UPDATER)
    def ready(self, unit: Unit) -> None:
        """Files hold zeros for parameters without a gradient: nothing to fix. Not settled here:
        shard() settles (on the optimizer thread for an early step)."""
        transition(self.state, unit.index, GradState.READY, GRAD_TRANSITIONS, "gradient")

    def shard(self, unit: Unit) -> NvmeGrad:
        self.settle(unit)
        _, reduced, numel = self._files[unit.index]
        return NvmeGrad(reduced, numel, self.grad_dtype)

    def sumsq(self, units: list[Unit]) -> float:
        total = 0.0
        for unit in units:
            if self.state[unit.index] is not GradState.EMPTY:
                self.settle(unit)
                total += self._sumsq[unit.index]
        return total

    @owned(COMPUTE)
    def zero(self, set_to_none: "bool | None" = None) -> None:
        self._forget()
        super().zero(set_to_none)

    def _drop(self, i: int) -> None:
        total, reduced, _ = self._files[i]
        self._written.difference_update((total, reduced))
        self._sumsq[i] = 0.0

    def _forget(self) -> None:
        """Wait for every fold (their errors belong to the window being dropped) and give back the
        staging of a backward that stopped half-way."""
        with self._lock:
            jobs = [job for unit_jobs in self._jobs for job in unit_jobs]
            self._jobs = [[] for _ in self.units]
            self._inflight.clear()
        wait_futures(jobs)
        for i in range(len(self.units)):
            fresh, self._fresh[i] = self._fresh[i], None
            copies, self._copies[i] = self._copies[i], []
            self._fresh_got[i] = set()
            _wait_quietly(copies)
            if fresh is not None:
                self.host_pool.free(fresh)
        reducing, self._reducing = self._reducing, {}
        for block in reducing.values():
            self.host_pool.free(block)

    def close(self) -> None:
        self._io.shutdown(wait=True)
        self._forget()
        super().close()


class _StagingBound:
    """GPU review N6: per-parameter gradient staging blocks in flight (a D2H copy, then the adder's
    add, which frees the block) hold at most `limit` pool bytes (GradStore.offload_staging_bytes,
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


def _freeing(device_tier, tensor: torch.Tensor):
    """A ChainTicket's finish: the copy out of `tensor` is done (or failed), give it back."""
    def finish(outcome):
        device_tier.free(tensor)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome
    return finish


def _wait_quietly(tickets: list) -> None:
    try:
        wait_all(tickets)
    except Exception:  # noqa: BLE001 - a dropped gradient's copy; its memory is what matters
        pass
