"""Bucketed collectives for the engine: gradients reduce-scattered and parameters
all-gathered many units at a time ([Note: buckets]), over a `Comm` (comm.py).
"""
from __future__ import annotations

import collections
import threading
from typing import Any, Callable, Hashable, Sequence

import torch

from .comm import AVG, Comm, Handle
from .bucket_rows import Packing, row_offsets, unpack_rows
from .partition import Partition

# [Note: buckets]
# Launching one collective per unit costs a latency per unit (hundreds of small biases);
# one per step would not overlap backward. A bucket collects units until the next one
# would take it past `bucket_bytes`, then launches one collective for all of them (a
# unit larger than `bucket_bytes` goes alone). Layout of a reduce-scatter bucket holding
# units A, B with padded shards a, b elements:
#
#     input (N x (a + b)):   [A chunk 0 | B chunk 0] [A chunk 1 | B chunk 1] ... [.. chunk N-1]
#     output on rank r:      [A chunk r | B chunk r]      (A's shard r, then B's)
#
# so each rank receives exactly its shard of every unit ([Note: partition layout]). The
# all-gather bucket is the mirror image. Replicated units go to all-reduce buckets.
# At most `max_inflight` buckets are in flight; the next launch first waits for the
# oldest (bounded memory). Results are delivered by `on_ready(key, tensor)` on the
# thread that calls add/flush/wait, after the bucket's handle was waited. All ranks must
# add the same units in the same order (the same model gives the same backward order).

# [Note: bucket memory]
# Bucket buffers are memory of the one memory system, counted where they live: device-tier
# tensors, or host-pool blocks where a ParamGatherer's units live on the host (gloo gathers
# host memory in place). The planner counts `buffer_bytes` in that tier's need. Gradient
# buckets stay on the device, where NCCL reduces; gradients on the host cross the link
# only by the device tier's copies, with tickets, as a one-rank fetch does: an H2D copy per
# unit (compute joins them before the collective: on a GPU the copy stream runs them while
# the host goes on) and one D2H copy of the bucket's reduced shards into a host-pool block
# (`staging_bytes`), delivered once done. No synchronous copy beside the tier, no
# allocation outside it: tests/test_data_path.py counts every copy with 2 ranks.


class _BufferPool:
    """Bucket buffers kept for reuse: a fresh CPU allocation of bucket size page-faults on first
    touch (~0.45 ms per MiB here, as long as the copy itself x7), once per bucket otherwise.
    At most `keep` buffers exist, in use or free: one that fits none of the free ones replaces
    the smallest of them when the pool is full. A buffer is given back only after its bucket's
    handle was waited and every copy reading it ran, so its next use is ordered after the last.
    [Note: bucket memory]: every buffer comes from a tier, counted against its budget: a host-pool
    block where the bucket's tensors are host memory (`on_host`), else a device-tier tensor."""

    def __init__(self, keep: int):
        self.keep = keep
        self.device_tier = self.host_pool = None  # set by _Bucketer.allocate_from
        self.on_host = False
        self.limit: int | None = None  # elements of a bucket of every unit: no buffer is larger
        self._free: list = []  # device-tier tensors or host-pool blocks (HostBuffer)
        self._count = 0  # buffers alive: free or in use

    def take(self, numel: int, dtype: torch.dtype, capacity: int):
        """(buffer, its first numel elements as `dtype`); give the buffer back with give()."""
        if self.device_tier is None:
            raise RuntimeError("bucket buffers come from the tiers: call allocate_from() before the first add()")
        for i, buf in enumerate(self._free):
            t = _tensor(buf)
            if t.dtype == dtype and t.numel() >= numel:
                return self._free.pop(i), t[:numel]
        if self._free and self._count >= self.keep:
            self._drop(self._free.pop(min(range(len(self._free)), key=lambda i: _tensor(self._free[i]).numel())))
        numel_alloc = max(numel, capacity if self.limit is None else min(capacity, self.limit))
        if self.on_host:
            buf = self.host_pool.alloc(numel_alloc * dtype.itemsize, dtype, "collective bucket")
        else:
            buf = self.device_tier.alloc((numel_alloc,), dtype, "collective bucket")
        self._count += 1
        return buf, _tensor(buf)[:numel]

    def give(self, buf) -> None:
        self._free.append(buf)

    def _drop(self, buf) -> None:
        self._count -= 1
        if self.on_host:
            self.host_pool.free(buf)
        else:
            self.device_tier.free(buf)


def _tensor(buf) -> torch.Tensor:
    return buf if isinstance(buf, torch.Tensor) else buf.tensor


class _Bucketer:
    def __init__(self, bucket_bytes: int, comm: Comm, group: Any, max_inflight: int):
        if bucket_bytes <= 0 or max_inflight < 1:
            raise ValueError(f"bucket_bytes must be > 0 and max_inflight >= 1, got {bucket_bytes}, {max_inflight}")
        self.comm = comm
        self.group = group
        self.bucket_bytes = bucket_bytes
        self.max_inflight = max_inflight
        self.buckets_launched = 0
        self._inflight: collections.deque[tuple[Handle, Callable[[], None]]] = collections.deque()
        self._pool = _BufferPool(max_inflight + 1)  # in flight, and the one being packed
        self._lock = threading.RLock()
        self.rank, self.world_size = self.comm.rank(group), self.comm.world_size(group)

    @staticmethod
    def _capacity(bucket_bytes: int, itemsize: int, world_size: int) -> int:
        """Elements of a bucket buffer: a bucket of bucket_bytes needs (N + 1) / N of it, the
        N-chunk flat and one chunk."""
        return bucket_bytes // itemsize * (world_size + 1) // world_size + 1

    @staticmethod
    def _limit(parts: Sequence[Partition]) -> int:
        """Elements of a bucket holding every unit in `parts`: no buffer needs more."""
        return sum(p.numel if p.replicated else (p.world_size + 1) * p.shard_numel for p in parts)

    @classmethod
    def _largest_buffer(cls, bucket_bytes: int, itemsize: int, parts: Sequence[Partition]) -> int:
        """Elements of the largest bucket buffer: a bucket's capacity, or a unit larger than a
        bucket, never more than a bucket of every unit."""
        limit, capacity = cls._limit(parts), cls._capacity(bucket_bytes, itemsize, parts[0].world_size)
        return min(max(capacity, max(cls._limit([p]) for p in parts)), limit)

    @classmethod
    def buffer_bytes(cls, bucket_bytes: int, itemsize: int, parts: Sequence[Partition], max_inflight: int = 2,
                     alignment: int = 1) -> int:
        """Bytes of the bucket buffers a bucketer of the units `parts` (those it buckets) holds at
        most ([Note: bucket memory]): max_inflight + 1 buffers of a bucket's capacity, or of a unit
        larger than a bucket, or of every unit (then one buffer of each kind, sharded and replicated,
        reused every step); each rounded up to `alignment` (the host pool's, for buffers there).
        The planner counts exactly this (GPU review N13)."""
        if not parts:
            return 0
        limit, capacity = cls._limit(parts), cls._capacity(bucket_bytes, itemsize, parts[0].world_size)
        if capacity >= limit:
            return len({p.replicated for p in parts}) * _round(limit * itemsize, alignment)
        return (max_inflight + 1) * _round(itemsize * cls._largest_buffer(bucket_bytes, itemsize, parts), alignment)

    def allocate_from(self, device_tier, parts: Sequence[Partition], host_pool=None) -> None:
        """Before the first bucket: the tiers the bucket buffers come from ([Note: bucket memory]),
        none larger than a bucket of every unit in `parts` (the units this bucketer will see).
        `host_pool`: the units' tensors are host memory; the buckets are then blocks of it (a
        ParamGatherer gathers where its outputs live; GradBucketer overrides this)."""
        self._pool.device_tier, self._pool.host_pool, self._pool.limit = device_tier, host_pool, self._limit(parts)
        self._pool.on_host = host_pool is not None

    def _buffer(self, numel: int, dtype: torch.dtype):
        capacity = self._capacity(self.bucket_bytes, dtype.itemsize, self.world_size)
        return self._pool.take(numel, dtype, capacity)

    def _launch(self, handle: Handle, complete: Callable[[], None]) -> None:
        self.buckets_launched += 1
        self._inflight.append((handle, complete))
        while len(self._inflight) > self.max_inflight:
            self._complete_oldest()
        while self._inflight and self._inflight[0][0].done():
            self._complete_oldest()

    def _complete_oldest(self) -> None:
        handle, complete = self._inflight.popleft()
        handle.wait()
        complete()

    def flush(self) -> None:
        """Launch the partly filled buckets (call at the end of backward)."""
        raise NotImplementedError

    def wait(self) -> None:
        """flush(), then wait every bucket and deliver every result (call before the optimizer step)."""
        with self._lock:
            self.flush()
            while self._inflight:
                self._complete_oldest()


def _round(nbytes: int, alignment: int) -> int:
    return -(-nbytes // alignment) * alignment


class GradBucketer(_Bucketer):
    """Reduce-scatters units' flat gradients in buckets during backward ([Note: buckets]).

    add(key, grad_flat, partition) when a unit's gradient is final for this backward;
    `grad_flat` (numel elements, any float dtype) must stay unchanged until its bucket's
    result is delivered (at the latest in wait()). on_ready(key, grad_shard) then receives this
    rank's reduced shard: `partition.shard_numel` elements (padding included, zero) in
    `reduce_dtype` (default: the gradient's dtype), valid only until on_ready returns (a view
    of a reused buffer): copy or accumulate it where the shard lives.
    Replicated units are all-reduced: on_ready gets the whole reduced flat.

    The buckets live on the device tier's device (NCCL reduces device memory). Gradients that
    are host memory (`allocate_from(..., host_pool=)`) move through the device tier's copies
    ([Note: bucket memory]): each is packed into its bucket by an H2D copy that compute joins
    before the collective, and a bucket's reduced shards come back by one D2H copy into a
    host-pool block, delivered (on_ready gets views of that block) once the copy is done: at
    the next bucket launch, or in wait().
    """

    def __init__(self, bucket_bytes: int, on_ready: Callable[[Hashable, torch.Tensor], None], *,
                 comm: Comm, group: Any = None, op=AVG, reduce_dtype: torch.dtype | None = None,
                 max_inflight: int = 2):
        super().__init__(bucket_bytes, comm, group, max_inflight)
        self.on_ready, self.op, self.reduce_dtype = on_ready, op, reduce_dtype
        self._pending: dict[bool, list[tuple[Hashable, torch.Tensor, Partition]]] = {False: [], True: []}
        self._pending_bytes = {False: 0, True: 0}
        # host gradients: buckets reduced, their shards' D2H copies issued, not delivered yet
        self._landing: collections.deque[tuple[Any, Callable[[], None]]] = collections.deque()
        self._parts: Sequence[Partition] = ()
        self._landing_free: list = []  # host-pool blocks of `_landing_blocks`' size, kept for reuse

    def allocate_from(self, device_tier, parts: Sequence[Partition], host_pool=None) -> None:
        """The buckets come from `device_tier`; with `host_pool` the gradients and their reduced
        shards are host memory, and the shards land in blocks of it."""
        super().allocate_from(device_tier, parts, host_pool)
        self._pool.on_host = False
        self._parts = parts

    @classmethod
    def _landing_blocks(cls, bucket_bytes: int, itemsize: int, parts: Sequence[Partition],
                        max_inflight: int) -> tuple[int, int]:
        """(count, elements each) of the host-pool blocks the reduced shards land in: one per bucket
        in flight or landing (max_inflight + 1, `_deliver`), each as large as the largest result (a
        sharded bucket's is 1 / (N + 1) of its buffer); where one bucket holds every unit, one per
        kind (sharded, replicated). Every block has the one size, so any serves any bucket: after
        the first step the host pool makes none."""
        if cls._capacity(bucket_bytes, itemsize, parts[0].world_size) >= cls._limit(parts):
            sizes = [sum(p.shard_numel for p in parts if p.replicated == kind) for kind in {p.replicated for p in parts}]
            return len(sizes), max(sizes)
        largest, n = cls._largest_buffer(bucket_bytes, itemsize, parts), parts[0].world_size
        return max_inflight + 1, max(largest if p.replicated else largest // (n + 1) for p in parts)

    @classmethod
    def staging_bytes(cls, bucket_bytes: int, itemsize: int, parts: Sequence[Partition], max_inflight: int = 2,
                      alignment: int = 1) -> int:
        """Host-pool bytes of the blocks the reduced shards land in from the device buckets,
        gradients on the host (`_landing_blocks`), each rounded up to the pool's `alignment`.
        The planner counts exactly this."""
        if not parts:
            return 0
        count, numel = cls._landing_blocks(bucket_bytes, itemsize, parts, max_inflight)
        return count * _round(numel * itemsize, alignment)

    @staticmethod
    def conversion_bytes(largest_numel: int, grad_itemsize: int, reduce_itemsize: int = 4) -> int:
        """Device-tier bytes of a host gradient of another dtype than the buckets', copied to the
        device before it is cast into its bucket: one unit at a time. The planner counts this."""
        return 0 if grad_itemsize == reduce_itemsize else largest_numel * grad_itemsize

    def add(self, key: Hashable, grad_flat: torch.Tensor, partition: Partition) -> None:
        if grad_flat.numel() != partition.numel:
            raise ValueError(f"GradBucketer.add({key!r}): gradient has {grad_flat.numel()} elements, "
                             f"partition says {partition.numel}")
        if partition.world_size != self.world_size:
            raise ValueError(f"GradBucketer.add({key!r}): partition is for world size {partition.world_size}, "
                             f"the group has {self.world_size}")
        dtype = self.reduce_dtype or grad_flat.dtype
        size = partition.padded_numel * dtype.itemsize
        with self._lock:
            rep = partition.replicated
            if self._pending[rep] and self._pending_bytes[rep] + size > self.bucket_bytes:
                self._launch_pending(rep)
            self._pending[rep].append((key, grad_flat, partition))
            self._pending_bytes[rep] += size
            if self._pending_bytes[rep] >= self.bucket_bytes:
                self._launch_pending(rep)

    def flush(self) -> None:
        with self._lock:
            for rep in (False, True):
                if self._pending[rep]:
                    self._launch_pending(rep)

    def wait(self) -> None:
        with self._lock:
            super().wait()
            self._deliver(every=True)

    def _launch(self, handle: Handle, complete: Callable[[], None]) -> None:
        super()._launch(handle, complete)
        self._deliver(every=False)

    def _deliver(self, every: bool) -> None:
        """Deliver the landed results, oldest first: all of them (`every`), else those whose copy
        is done, and the oldest while more than max_inflight buckets are in flight or landing (so
        gradients wait in at most max_inflight + 1 buckets, with or without landing, and the
        host pool holds at most max_inflight + 1 landing blocks: `staging_bytes`)."""
        while self._landing and (every or self._landing[0][0].done()
                                 or len(self._landing) + len(self._inflight) > self.max_inflight):
            ticket, deliver = self._landing.popleft()
            ticket.wait()
            deliver()

    def _launch_pending(self, replicated: bool) -> None:
        units, self._pending[replicated], self._pending_bytes[replicated] = self._pending[replicated], [], 0
        dtype = self.reduce_dtype or units[0][1].dtype
        widths = [p.shard_numel for _, _, p in units]
        offsets, total = row_offsets(widths), sum(widths)
        n = 1 if replicated else self.world_size
        buf, flat = self._buffer((n + 1) * total if not replicated else total, dtype)
        pack = Packing(self._pool.device_tier, self._pool.host_pool is not None)
        try:
            if replicated:
                result = flat
                for (_, grad, p), off, w in zip(units, offsets, widths):
                    pack.rows(result[off:off + w].view(1, w), grad.reshape(-1), p.numel)
            else:
                packed, result = flat[:n * total].view(n, total), flat[n * total:]
                for (_, grad, p), off, w in zip(units, offsets, widths):
                    pack.rows(packed[:, off:off + w], grad.reshape(-1), p.numel)
            pack.join()  # the collective reads the bucket after its copies (compute waits, not the host)
        except BaseException:
            pack.wait()
            self._pool.give(buf)
            raise
        if replicated:
            handle = self.comm.all_reduce(result, self.op, self.group)
        else:
            handle = self.comm.reduce_scatter(result, packed.view(-1), self.group, self.op, input_is_scratch=True)

        def deliver(shards: torch.Tensor, staged=None):
            pack.wait()  # the gradients were read: their owner may write them again
            for (key, _, _), off, w in zip(units, offsets, widths):
                self.on_ready(key, shards[off:off + w])
            if staged is not None:
                self._landing_free.append(staged)
            self._pool.give(buf)

        def complete():
            if self._pool.host_pool is None:
                deliver(result)
                return
            staged = self._landing_block(dtype)
            try:  # ordered after the collective: handle.wait() made compute wait for it
                ticket = self._pool.device_tier.copy_d2h(staged.tensor[:total], result)
            except BaseException:
                self._landing_free.append(staged)
                raise
            self._landing.append((ticket, lambda: deliver(staged.tensor[:total], staged)))
        self._launch(handle, complete)

    def _landing_block(self, dtype: torch.dtype):
        """A host-pool block for one bucket's reduced shards (`_landing_blocks`: one size for all).
        The first one comes with all the others, so how many buckets land at once (timing) never
        makes the pool allocate after the first backward."""
        for i, block in enumerate(self._landing_free):
            if block.dtype == dtype:
                return self._landing_free.pop(i)
        count, numel = self._landing_blocks(self.bucket_bytes, dtype.itemsize, self._parts, self.max_inflight)
        blocks = [self._pool.host_pool.alloc(numel * dtype.itemsize, dtype, "reduced gradient shards")
                  for _ in range(count)]
        self._landing_free += blocks[1:]
        return blocks[0]


class ParamGatherer(_Bucketer):
    """All-gathers units' parameter shards into their full flats, in buckets ([Note: buckets]).

    add(key, shard, partition, out_flat): `shard` is this rank's shard (partition.shard_numel
    elements); `out_flat` (contiguous, at least partition.numel elements) receives the
    gathered real elements; on_ready(key, out_flat) is called once they are there. `shard`
    must stay unchanged and `out_flat` unread until then. `out_flat` may instead be a function
    returning it, called when the gather lands (memory taken only then, not while the unit waits
    for its bucket). A unit alone in its bucket whose
    `out_flat` has exactly `padded_numel` elements is gathered straight into it (no copies):
    allocate stage-3 gather buffers padded. Replicated units are copied (no communication).
    Shards and outputs are on one side: with `allocate_from(..., host_pool=)` both are host
    memory and the buckets are host-pool blocks ([Note: bucket memory]).
    """

    def __init__(self, bucket_bytes: int, on_ready: Callable[[Hashable, torch.Tensor], None] | None = None, *,
                 comm: Comm, group: Any = None, max_inflight: int = 2):
        super().__init__(bucket_bytes, comm, group, max_inflight)
        self.on_ready = on_ready or (lambda key, flat: None)
        self._pending: list[tuple[Hashable, torch.Tensor, Partition, torch.Tensor]] = []
        self._pending_bytes = 0

    def add(self, key: Hashable, shard: torch.Tensor, partition: Partition, out_flat: torch.Tensor) -> None:
        if shard.numel() != partition.shard_numel:
            raise ValueError(f"ParamGatherer.add({key!r}): shard has {shard.numel()} elements (expected "
                             f"{partition.shard_numel})")
        if not callable(out_flat):
            self._check_out(key, partition, out_flat)
        with self._lock:
            if callable(out_flat) and partition.replicated:
                out_flat = self._check_out(key, partition, out_flat())
            if partition.replicated:
                if out_flat.data_ptr() != shard.data_ptr():
                    out_flat.view(-1)[:partition.numel].copy_(shard.reshape(-1))
                self.on_ready(key, out_flat)
                return
            size = partition.padded_numel * shard.element_size()
            if self._pending and self._pending_bytes + size > self.bucket_bytes:
                self.flush()
            self._pending.append((key, shard, partition, out_flat))
            self._pending_bytes += size
            if self._pending_bytes >= self.bucket_bytes:
                self.flush()

    @staticmethod
    def _check_out(key: Hashable, partition: Partition, out_flat: torch.Tensor) -> torch.Tensor:
        if out_flat.numel() < partition.numel or not out_flat.is_contiguous():
            raise ValueError(f"ParamGatherer.add({key!r}): out_flat must be contiguous with at least "
                             f"{partition.numel} elements, has {out_flat.numel()}")
        return out_flat

    def flush(self) -> None:
        with self._lock:
            if not self._pending:
                return
            units, self._pending, self._pending_bytes = self._pending, [], 0
            key, shard, p, out = units[0]
            if len(units) == 1 and not callable(out) and out.numel() == p.padded_numel \
                    and out.dtype == shard.dtype and shard.is_contiguous():
                handle = self.comm.all_gather(out.view(-1), shard.view(-1), self.group)
                self._launch(handle, lambda: self.on_ready(key, out))
                return
            n, dtype = self.world_size, shard.dtype
            widths = [p.shard_numel for _, _, p, _ in units]
            offsets, total = row_offsets(widths), sum(widths)
            buf, flat = self._buffer((n + 1) * total, dtype)
            packed, gathered = flat[:total], flat[total:].view(n, total)
            for (_, s, _, _), off, w in zip(units, offsets, widths):
                packed[off:off + w].copy_(s.reshape(-1))
            handle = self.comm.all_gather(gathered.view(-1), packed, self.group)

            def complete():
                for (key, _, p, out), off, w in zip(units, offsets, widths):
                    if callable(out):
                        out = self._check_out(key, p, out())
                    unpack_rows(out.view(-1)[:p.numel], gathered[:, off:off + w], p.numel)
                    self.on_ready(key, out)
                self._pool.give(buf)
            self._launch(handle, complete)
