"""Bucketed collectives for the engine: gradients reduce-scattered and parameters
all-gathered many units at a time ([Note: buckets]), over a `Comm` (comm.py).
"""
from __future__ import annotations

import collections
import threading
from typing import Any, Callable, Hashable, Sequence

import torch

from .comm import AVG, Comm, Handle
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


class _BufferPool:
    """Bucket buffers kept for reuse: a fresh CPU allocation of bucket size page-faults on first
    touch (~0.45 ms per MiB here, as long as the copy itself x7), once per bucket otherwise.
    At most `keep` buffers exist, in use or free: one that fits none of the free ones replaces
    the smallest of them when the pool is full. A buffer is given back only after its bucket's
    handle was waited, so on CUDA its next use (on the compute stream) is ordered after the
    last one. With a device tier, buffers on its device are allocated from it (counted against
    tiers.device: GPU review N13; the planner's term is `_Bucketer.buffer_bytes`)."""

    def __init__(self, keep: int, device_tier=None):
        self.keep, self.device_tier = keep, device_tier
        self.limit: int | None = None  # elements of a bucket of every unit: no buffer is larger
        self._free: list[torch.Tensor] = []
        self._count = 0  # buffers alive: free or in use

    def take(self, numel: int, dtype: torch.dtype, device: torch.device, capacity: int) -> torch.Tensor:
        for i, buf in enumerate(self._free):
            if buf.dtype == dtype and buf.device == device and buf.numel() >= numel:
                return self._free.pop(i)[:numel]
        if self._free and self._count >= self.keep:
            self._drop(self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].numel())))
        shape, tier = (max(numel, capacity if self.limit is None else min(capacity, self.limit)),), self.device_tier
        if tier is not None and device == tier.device:
            buf = tier.alloc(shape, dtype, "collective bucket")
        else:
            buf = torch.empty(shape, dtype=dtype, device=device)
        self._count += 1
        return buf[:numel]

    def give(self, view: torch.Tensor) -> None:
        self._free.append(view._base if view._base is not None else view)

    def _drop(self, buf: torch.Tensor) -> None:
        self._count -= 1
        if self.device_tier is not None and buf.device == self.device_tier.device:
            self.device_tier.free(buf)


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
    def buffer_bytes(cls, bucket_bytes: int, itemsize: int, parts: Sequence[Partition], max_inflight: int = 2) -> int:
        """Bytes of the bucket buffers a bucketer of the units `parts` (those it buckets) holds at
        most, buffers allocated from a device tier (`allocate_from`): max_inflight + 1 buffers of a
        bucket's capacity, or of a unit larger than a bucket, or of every unit (then one buffer of
        each kind, sharded and replicated, reused every step). The planner counts exactly this
        (GPU review N13)."""
        if not parts:
            return 0
        limit, capacity = cls._limit(parts), cls._capacity(bucket_bytes, itemsize, parts[0].world_size)
        if capacity >= limit:
            return len({p.replicated for p in parts}) * limit * itemsize
        largest = max(cls._limit([p]) for p in parts)
        return (max_inflight + 1) * itemsize * min(max(capacity, largest), limit)

    def allocate_from(self, device_tier, parts: Sequence[Partition]) -> None:
        """Before the first bucket: allocate the buffers that live on `device_tier`'s device from it,
        none larger than a bucket of every unit in `parts` (the units this bucketer will see)."""
        self._pool.device_tier, self._pool.limit = device_tier, self._limit(parts)

    def _buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        capacity = self._capacity(self.bucket_bytes, dtype.itemsize, self.world_size)
        return self._pool.take(numel, dtype, device, capacity)

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


class GradBucketer(_Bucketer):
    """Reduce-scatters units' flat gradients in buckets during backward ([Note: buckets]).

    add(key, grad_flat, partition) when a unit's gradient is final for this backward;
    `grad_flat` (numel elements, any float dtype) must stay unchanged until its bucket
    launches (at the latest in flush()); it may live elsewhere than `device` (the bucket is
    packed by a copy). on_ready(key, grad_shard) then receives this rank's
    reduced shard: `partition.shard_numel` elements (padding included, zero) in
    `reduce_dtype` (default: the gradient's dtype). It is a view of a reused bucket buffer,
    valid only until on_ready returns: copy or accumulate it where the shard lives.
    Replicated units are all-reduced: on_ready gets the whole reduced flat.
    """

    def __init__(self, bucket_bytes: int, on_ready: Callable[[Hashable, torch.Tensor], None], *,
                 comm: Comm, group: Any = None, op=AVG, reduce_dtype: torch.dtype | None = None,
                 max_inflight: int = 2, device: torch.device | None = None):
        super().__init__(bucket_bytes, comm, group, max_inflight)
        self.on_ready, self.op, self.reduce_dtype = on_ready, op, reduce_dtype
        self.device = device  # where buckets live and reduce (None: the gradient's device)
        self._pending: dict[bool, list[tuple[Hashable, torch.Tensor, Partition]]] = {False: [], True: []}
        self._pending_bytes = {False: 0, True: 0}

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

    def _launch_pending(self, replicated: bool) -> None:
        units, self._pending[replicated], self._pending_bytes[replicated] = self._pending[replicated], [], 0
        first = units[0][1]
        dtype = self.reduce_dtype or first.dtype
        widths = [p.shard_numel for _, _, p in units]
        offsets, total = _offsets(widths), sum(widths)
        n = 1 if replicated else self.world_size
        buf = self._buffer((n + 1) * total if not replicated else total, dtype, self.device or first.device)
        if replicated:
            for (_, grad, _), off, w in zip(units, offsets, widths):
                buf[off:off + w].copy_(grad.reshape(-1))
            handle, result = self.comm.all_reduce(buf, self.op, self.group), buf
        else:
            packed, result = buf[:n * total].view(n, total), buf[n * total:]
            for (_, grad, p), off, w in zip(units, offsets, widths):
                _pack_rows(packed[:, off:off + w], grad.reshape(-1), p.numel)
            handle = self.comm.reduce_scatter(result, packed.view(-1), self.group, self.op, input_is_scratch=True)

        def complete():
            for (key, _, _), off, w in zip(units, offsets, widths):
                self.on_ready(key, result[off:off + w])
            self._pool.give(buf)
        self._launch(handle, complete)


class ParamGatherer(_Bucketer):
    """All-gathers units' parameter shards into their full flats, in buckets ([Note: buckets]).

    add(key, shard, partition, out_flat): `shard` is this rank's shard (partition.shard_numel
    elements); `out_flat` (contiguous, at least partition.numel elements) receives the
    gathered real elements; on_ready(key, out_flat) is called once they are there. `shard`
    must stay unchanged and `out_flat` unread until then. A unit alone in its bucket whose
    `out_flat` has exactly `padded_numel` elements is gathered straight into it (no copies):
    allocate stage-3 gather buffers padded. Replicated units are copied (no communication).
    """

    def __init__(self, bucket_bytes: int, on_ready: Callable[[Hashable, torch.Tensor], None] | None = None, *,
                 comm: Comm, group: Any = None, max_inflight: int = 2):
        super().__init__(bucket_bytes, comm, group, max_inflight)
        self.on_ready = on_ready or (lambda key, flat: None)
        self._pending: list[tuple[Hashable, torch.Tensor, Partition, torch.Tensor]] = []
        self._pending_bytes = 0

    def add(self, key: Hashable, shard: torch.Tensor, partition: Partition, out_flat: torch.Tensor) -> None:
        if shard.numel() != partition.shard_numel or out_flat.numel() < partition.numel:
            raise ValueError(f"ParamGatherer.add({key!r}): shard has {shard.numel()} elements (expected "
                             f"{partition.shard_numel}), out_flat {out_flat.numel()} (expected >= {partition.numel})")
        if not out_flat.is_contiguous():
            raise ValueError(f"ParamGatherer.add({key!r}): out_flat must be contiguous")
        with self._lock:
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

    def flush(self) -> None:
        with self._lock:
            if not self._pending:
                return
            units, self._pending, self._pending_bytes = self._pending, [], 0
            key, shard, p, out = units[0]
            if len(units) == 1 and out.numel() == p.padded_numel and out.dtype == shard.dtype \
                    and shard.is_contiguous():
                handle = self.comm.all_gather(out.view(-1), shard.view(-1), self.group)
                self._launch(handle, lambda: self.on_ready(key, out))
                return
            n, dtype = self.world_size, shard.dtype
            widths = [p.shard_numel for _, _, p, _ in units]
            offsets, total = _offsets(widths), sum(widths)
            buf = self._buffer((n + 1) * total, dtype, shard.device)
            packed, gathered = buf[:total], buf[total:].view(n, total)
            for (_, s, _, _), off, w in zip(units, offsets, widths):
                packed[off:off + w].copy_(s.reshape(-1))
            handle = self.comm.all_gather(gathered.view(-1), packed, self.group)

            def complete():
                for (key, _, p, out), off, w in zip(units, offsets, widths):
                    _unpack_rows(out.view(-1)[:p.numel], gathered[:, off:off + w], p.numel)
                    self.on_ready(key, out)
                self._pool.give(buf)
            self._launch(handle, complete)


def _offsets(widths: Sequence[int]) -> list[int]:
    out, total = [], 0
    for w in widths:
        out.append(total)
        total += w
    return out


def _pack_rows(dst: torch.Tensor, flat: torch.Tensor, numel: int) -> None:
    """dst (N x s) = the flat padded with zeros to N*s, row r = chunk r."""
    n_rows, s = dst.shape
    if s == 0:
        return
    full = numel // s
    if full:
        dst[:full].copy_(flat[:full * s].view(full, s))
    if full < n_rows:
        rem = numel - full * s
        dst[full, :rem].copy_(flat[full * s:numel])
        dst[full, rem:].zero_()
        dst[full + 1:].zero_()


def _unpack_rows(out: torch.Tensor, src: torch.Tensor, numel: int) -> None:
    """out (numel) = the first numel elements of src (N x s) read row by row."""
    n_rows, s = src.shape
    if s == 0:
        return
    full = numel // s
    if full:
        out[:full * s].view(full, s).copy_(src[:full])
    rem = numel - full * s
    if rem:
        out[full * s:].copy_(src[full, :rem])
