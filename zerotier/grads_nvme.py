"""GradStore's NVMe backend: each unit's window sum in swap files.

[Note: gradients on NVMe]
With `offload.gradients = "nvme"` (`NvmeGrads`, GradStore's backend) a unit's sum over
the window lives in a swap file, `<unit>.grad` (at ZeRO-1 with several ranks the reduced shard has its own,
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
handing over another): `NvmeGrads.staging_bytes`, which the planner counts. The
optimizer reads a unit's file one unit ahead: `shard()` returns a `GradFile`, which reads
the file into the optimizer's block ([Note: device gradients, host optimizer] in
optim/grad_staging.py). With several ranks the fresh gradient,
rounded to grad_dtype as a zeroed accumulator would round it, is the reduce-scatter
input at stages 2-3 and the reduced shard is folded into the file; at stages 0-1 the
window's last backward reads the sum back as the input (one more read per unit and step).
"""
from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait as wait_futures
from dataclasses import dataclass, field

import torch

from .device import enter as enter_device
from .io.ticket import ChainTicket, wait_all
from .optim import _kernels
from .state import Unit
from .threads import GRAD_IO, owned

GRAD_WRITES = 2  # [Note: gradients on NVMe]: folds in flight (the worker threads)
OPEN_UNITS = 2   # units being filled at once that the planner counts (the root unit and the one in backward)


class GradFile:
    """A unit's gradient shard in an NVMe file: what GradStore.shard returns for gradients on NVMe.
    The optimizer gives a pool block of `numel` x `dtype` and `read_into` fills it; only the
    gradient store opens its files. `key` names the file for the profiler."""

    __slots__ = ("key", "numel", "dtype", "_grads", "_unit")

    def __init__(self, key: str, numel: int, dtype: torch.dtype, grads: "NvmeGrads", unit: Unit):
        self.key, self.numel, self.dtype, self._grads, self._unit = key, numel, dtype, grads, unit

    def read_into(self, block):
        """Read the shard into the pool block `block`; returns the read's ticket."""
        return self._grads.read_into(self._unit, block)


@dataclass(slots=True, eq=False)
class GradFileSlot:
    """One unit's gradient on NVMe: its files and this backward's staging ([Note: gradients on NVMe])."""

    sum_key: str                                 # file of the window's sum, `<unit>.grad`
    shard_key: str                               # file the optimizer reads (the sum's own when aliased)
    shard_numel: int                             # its elements
    fresh: object = None                         # this backward's gradient: a host-pool block being filled
    fresh_got: set[int] = field(default_factory=set)  # its parameters delivered so far
    copies: list = field(default_factory=list)   # D2H copies into `fresh` in flight (CUDA)
    reducing: object = None                      # a host-pool block handed to the reduce
    written: set[str] = field(default_factory=set)  # its files holding this window's sum (others: zero)
    sumsq: float = 0.0                           # of the shard file, as last written
    folds: list[Future] = field(default_factory=list)  # folds not yet settled (guarded by the backend's _lock)


class NvmeGrads:
    """GradStore's backend with each unit's window sum in NVMe files ([Note: gradients on NVMe])."""

    settled_by_ready = False  # shard() settles, so a unit's folds overlap the updates of the units before it

    def __init__(self, units: list[Unit], grad_dtype: torch.dtype, device_tier, host_pool, sharding, store,
                 profiler=None):
        self.units, self.grad_dtype = units, grad_dtype
        self.device_tier, self.host_pool, self.sharding, self.store = device_tier, host_pool, sharding, store
        self.profiler = profiler
        self._reduce_each = sharding.active and sharding.stage >= 2  # the fresh gradient is the reduce input
        self.defers_reduce = not self._reduce_each
        self.slots: list[GradFileSlot | None] = [None] * len(units)  # made by place()
        self._inflight: collections.deque[Future] = collections.deque()  # folds not done, oldest first
        self._lock = threading.Lock()
        # [Note: gradients on NVMe]: the folds (read-modify-write), off the autograd thread
        self._io = ThreadPoolExecutor(max_workers=GRAD_WRITES, thread_name_prefix="zerotier-grad-io",
                                      initializer=enter_device, initargs=(device_tier.device,))

    # ------------------------------------------------------------------ sizing (the planner's terms)

    @staticmethod
    def writes_in_flight() -> int:
        """Gradient files being rewritten at once (folds in flight), each needing a second file's room."""
        return GRAD_WRITES

    @staticmethod
    def host_blocks(loc, units: int, world_size: int, stage: int) -> int:
        """Host-pool blocks staging_bytes counts: the open units' fresh gradients, each fold's source
        and sum read back, and with several ranks three reduce inputs."""
        return OPEN_UNITS + 2 * GRAD_WRITES + (3 if world_size > 1 else 0)

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

    def place(self, unit: Unit, whole: bool) -> None:
        """`whole`: the optimizer reads the full sum, so the shard file is the sum's own."""
        total = f"{unit.key}.grad"
        self.slots[unit.index] = GradFileSlot(total, total if whole else f"{unit.key}.grad_shard",
                                              unit.numel if whole else unit.shard_numel)

    # ------------------------------------------------------------------ backward

    def accumulate(self, unit: Unit, i: int, grad: torch.Tensor, first_in_window: bool) -> None:
        slot = self.slots[unit.index]
        if slot.fresh is None:  # rounded now where it is the reduce input, as a zeroed accumulator would be
            dtype = self.grad_dtype if self._reduce_each else grad.dtype
            slot.fresh = self.host_pool.alloc(unit.numel * dtype.itemsize, dtype, f"{unit.key}.grad staging")
        offset, numel = unit.offsets[i], unit.shapes[i].numel()
        dst, flat = slot.fresh.tensor[offset: offset + numel], grad.reshape(-1)
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
            slot.copies.append(ticket)
        else:  # rounded on the device, where the gradient is (the same rounding as the CPU's copy_), in a
            # device-tier buffer given back when the copy is waited (GPU review N13: conversion_bytes)
            cast = self.device_tier.alloc(flat.shape, dst.dtype, f"{unit.key}.grad cast")
            try:
                ticket = self.device_tier.copy_d2h(dst, cast.copy_(flat))
            except BaseException:
                self.device_tier.free(cast)
                raise
            slot.copies.append(ChainTicket(ticket, _freeing(self.device_tier, cast)))
        if token is not None:
            prof.end(token, copy=ticket)
        slot.fresh_got.add(i)

    def unit_complete(self, unit: Unit) -> None:
        if not self._reduce_each:
            self._fold_fresh(unit)

    def _take_fresh(self, unit: Unit):
        """The unit's gradient of this backward (zeros where a parameter got none) and the copies
        still filling it."""
        slot = self.slots[unit.index]
        fresh, slot.fresh = slot.fresh, None
        copies, slot.copies = slot.copies, []
        got, slot.fresh_got = slot.fresh_got, set()
        if fresh is None:  # several ranks reduce every unit, with or without a gradient here
            fresh = self.host_pool.alloc(unit.numel * self.grad_dtype.itemsize, self.grad_dtype,
                                         f"{unit.key}.grad staging")
            fresh.tensor.zero_()
        for k in set(range(len(unit.params))) - got:
            fresh.tensor[unit.offsets[k]: unit.offsets[k] + unit.shapes[k].numel()].zero_()
        return fresh, copies

    def _fold_fresh(self, unit: Unit) -> None:
        slot = self.slots[unit.index]
        fresh, copies = self._take_fresh(unit)
        self._fold(slot, slot.sum_key, fresh, copies, add=slot.sum_key in slot.written,
                   sumsq=slot.sum_key == slot.shard_key)

    def _fold(self, slot: GradFileSlot, key: str, src, waits: list, add: bool, sumsq: bool) -> None:
        """Hand `src` (a pool block, now the job's) to a worker: the file `key` becomes file + src
        (`add`) or src, in grad_dtype. Waits first while GRAD_WRITES folds are in flight."""
        slot.written.add(key)
        while True:
            with self._lock:
                while self._inflight and self._inflight[0].done():
                    self._inflight.popleft()
                if len(self._inflight) < GRAD_WRITES:
                    break
                oldest = self._inflight[0]
            wait_futures([oldest])  # its error is raised by settle()
        try:
            job = self._io.submit(self._fold_job, key, src, waits, add, slot if sumsq else None)
        except BaseException:
            _wait_quietly(waits)
            self.host_pool.free(src)
            raise
        with self._lock:
            slot.folds.append(job)
            self._inflight.append(job)

    @owned(GRAD_IO)
    def _fold_job(self, key: str, src, waits: list, add: bool, sumsq_slot: "GradFileSlot | None") -> None:
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
            if sumsq_slot is not None:
                sumsq_slot.sumsq = _kernels.grad_sumsq(result.tensor)
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
        slot = self.slots[unit.index]
        with self._lock:
            jobs = list(slot.folds)
        for job in jobs:
            job.result()
        with self._lock:
            done = {id(job) for job in jobs}
            slot.folds = [job for job in slot.folds if id(job) not in done]

    def reduce_input(self, unit: Unit) -> torch.Tensor:
        slot = self.slots[unit.index]
        if self._reduce_each:  # stages 2-3: this backward's gradient
            src, copies = self._take_fresh(unit)
            slot.reducing = src  # (given back by shard_reduced, or by forget() after an error)
            wait_all(copies)
        else:  # stages 0-1, the window's last backward: its sum, read back from its file
            self.settle(unit)
            src = slot.reducing = self.host_pool.alloc(unit.numel * self.grad_dtype.itemsize, self.grad_dtype,
                                                       f"{unit.key}.grad (reduce input)")
            if slot.sum_key in slot.written:
                self._timed(slot.sum_key, "nvme", "host", src.nbytes, lambda: self.store.read(slot.sum_key, src))
            else:
                src.tensor.zero_()
        return src.tensor

    def shard_reduced(self, index: int, shard: torch.Tensor) -> None:
        slot = self.slots[index]
        reducing, slot.reducing = slot.reducing, None
        self.host_pool.free(reducing)
        block = self.host_pool.alloc(shard.numel() * shard.element_size(), shard.dtype,
                                     f"{self.units[index].key}.grad_shard staging")
        block.tensor.copy_(shard)  # `shard` is a view of a bucket buffer the bucketer reuses
        # stages 2-3 sum the micro-batches' reduced shards; at 0-1 the shard is the window's sum
        self._fold(slot, slot.shard_key, block, [], add=self._reduce_each and slot.shard_key in slot.written,
                   sumsq=True)

    def end_backward(self) -> None:
        if not self._reduce_each:  # units with a parameter that got no gradient in this backward
            for unit, slot in zip(self.units, self.slots):
                if slot.fresh is not None:
                    self._fold_fresh(unit)

    def after_backward(self, reduced: bool) -> None:
        for unit in self.units:  # the reduced shards' folds: errors surface in this backward
            self.settle(unit)

    # ------------------------------------------------------------------ step

    def ready(self, unit: Unit, got: set[int]) -> None:
        pass  # files hold zeros for parameters without a gradient: nothing to fix

    def fill_zeros(self, unit: Unit) -> None:
        slot = self.slots[unit.index]
        block = self.host_pool.alloc(slot.shard_numel * self.grad_dtype.itemsize, self.grad_dtype,
                                     f"{slot.shard_key} (zeros)")
        block.tensor.zero_()
        self._fold(slot, slot.shard_key, block, [], add=False, sumsq=True)

    def read_param(self, unit: Unit, k: int, has_sum: bool) -> torch.Tensor:
        """A copy (the sum is a file): writes to it do not reach the window."""
        if not has_sum:
            return torch.zeros(unit.shapes[k], dtype=self.grad_dtype)
        offset, numel = unit.offsets[k], unit.shapes[k].numel()
        return self._with_file(unit, None)[offset: offset + numel].clone().view(unit.shapes[k])

    def set_param(self, unit: Unit, k: int, value: "torch.Tensor | None") -> None:
        offset, numel = unit.offsets[k], unit.shapes[k].numel()

        def edit(flat):
            flat[offset: offset + numel] = 0 if value is None else value.reshape(-1).to(flat.dtype)
        self._with_file(unit, edit)

    def _with_file(self, unit: Unit, edit) -> torch.Tensor:
        """The unit's window sum read from its file (zeros if none yet); `edit(flat)` changes it and
        it is written back (one rank: the file the optimizer reads). Returns a copy."""
        self.settle(unit)
        slot = self.slots[unit.index]
        total = slot.sum_key
        block = self.host_pool.alloc(unit.numel * self.grad_dtype.itemsize, self.grad_dtype, f"{total} (edit)")
        try:
            if total in slot.written:
                self._timed(total, "nvme", "host", block.nbytes, lambda: self.store.read(total, block))
            else:
                block.tensor.zero_()
            if edit is not None:
                edit(block.tensor)
                slot.sumsq = _kernels.grad_sumsq(block.tensor)
                slot.written.add(total)
                self._timed(total, "host", "nvme", block.nbytes, lambda: self.store.write(total, block, what=total))
            return block.tensor.clone()
        finally:
            self.host_pool.free(block)

    def shard(self, unit: Unit) -> GradFile:
        slot = self.slots[unit.index]
        return GradFile(slot.shard_key, slot.shard_numel, self.grad_dtype, self, unit)

    def read_into(self, unit: Unit, block):
        """Read the unit's shard file into the caller's pool block (zero-copy); returns the ticket."""
        return self.store.read(self.slots[unit.index].shard_key, block)

    def sumsq(self, unit: Unit) -> float:
        return self.slots[unit.index].sumsq

    def drop(self, unit: Unit) -> None:
        slot = self.slots[unit.index]
        slot.written.clear()
        slot.sumsq = 0.0

    def forget(self) -> None:
        """Wait for every fold (their errors belong to the window being dropped) and give back the
        staging of a backward that stopped half-way."""
        with self._lock:
            jobs = [job for slot in self.slots if slot is not None for job in slot.folds]
            for slot in self.slots:
                if slot is not None:
                    slot.folds = []
            self._inflight.clear()
        wait_futures(jobs)
        for slot in self.slots:
            if slot is None:
                continue
            fresh, slot.fresh = slot.fresh, None
            copies, slot.copies = slot.copies, []
            reducing, slot.reducing = slot.reducing, None
            slot.fresh_got = set()
            _wait_quietly(copies)
            for block in (fresh, reducing):
                if block is not None:
                    self.host_pool.free(block)

    def close(self) -> None:
        self._io.shutdown(wait=True)
        self.forget()


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
