"""Fetching and releasing units' low-precision parameters on the compute device.

See [Note: fetch and release] in engine.py for when this happens. A fetch copies the
unit's parameters from their tier (host memory or NVMe) into a buffer counted by the
device tier; at stage 3 it is this rank's shard followed by an all-gather. Prefetches
run on worker threads (the CPU's "copy streams"; on CUDA they queue the H2D copy on
`copy_stream` and hand back an event), except stage-3 gathers, which are issued on the
thread running forward/backward so every rank issues its collectives in the same order.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..state import Location, Unit


class _Gathering:
    """A stage-3 all-gather in flight; `result()` has the interface of a fetch future."""

    def __init__(self, handle, flat: torch.Tensor, shard: torch.Tensor):
        self.handle, self.flat, self.shard = handle, flat, shard  # shard lives until the gather ends

    def done(self) -> bool:
        return self.handle.done()

    def result(self):
        self.handle.wait()
        self.shard = None
        return self.flat, None



class ParamFetcher:
    def __init__(self, device: torch.device, lp_dtype: torch.dtype, device_tier, store, sharding, profiler):
        self.device, self.lp_dtype = device, lp_dtype
        self.device_tier, self.store, self.sharding = device_tier, store, sharding
        self.profiler = profiler  # None when profiling is off
        self.units: list[Unit] = []
        self._inflight: dict[int, Future | _Gathering] = {}  # issued, not yet consumed
        self._lock = threading.Lock()
        self._workers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="zerotier-fetch")
        self.copy_stream = torch.cuda.Stream() if device.type == "cuda" else None

    def load(self, unit: Unit, reason: str):
        """Bring a unit's low-precision params to the compute device (a fetch worker for
        reason="prefetch", the compute thread for reason="demand")."""
        flat = self.device_tier.alloc((unit.numel,), self.lp_dtype, unit.param_key)
        nbytes = unit.numel * self.lp_dtype.itemsize
        self.device_tier.count_in(nbytes)
        prof = self.profiler
        token = prof.begin(unit.param_key, "param", unit.param_loc.value, "device", nbytes, reason) \
            if prof is not None else None
        try:
            if unit.param_loc is Location.NVME and self.device.type == "cpu":
                self.store.read(unit.param_key, flat).wait()  # straight into the device buffer
                return flat, None
            if unit.param_loc is Location.NVME:
                host = torch.empty(unit.numel, dtype=self.lp_dtype)
                self.store.read(unit.param_key, host).wait()
            else:
                host = unit.host_param
            if self.device.type == "cpu":
                flat.copy_(host)
                return flat, None
            with torch.cuda.stream(self.copy_stream):
                flat.copy_(host, non_blocking=host.is_pinned())
                ready = torch.cuda.Event()
                ready.record()
            return flat, ready
        except BaseException:
            self.device_tier.free(flat)
            raise
        finally:
            if token is not None:
                prof.end(token)

    def gather(self, unit: Unit, reason: str) -> "_Gathering":
        """Stage 3: this rank's shard to the device, then an async all-gather of the full flat.
        Issued on the thread running forward/backward, in the same order on every rank."""
        shard = self.load_shard(unit, reason)
        flat = self.device_tier.alloc((unit.part.padded_numel,), self.lp_dtype, unit.param_key)
        return _Gathering(self.sharding.all_gather(unit, flat, shard), flat, shard)

    def load_shard(self, unit: Unit, reason: str) -> torch.Tensor:
        if unit.param_loc is Location.DEVICE:
            return unit.param_shard
        nbytes = unit.part.shard_numel * self.lp_dtype.itemsize
        prof = self.profiler
        token = prof.begin(unit.param_key, "param", unit.param_loc.value, "device", nbytes, reason) \
            if prof is not None else None
        if unit.param_loc is Location.NVME:
            host = torch.empty(unit.part.shard_numel, dtype=self.lp_dtype)
            self.store.read(unit.param_key, host).wait()
        else:
            host = unit.param_shard
        self.device_tier.count_in(nbytes)
        shard = host.to(self.device)
        if token is not None:
            prof.end(token)
        return shard

    def prefetch(self, index: int) -> None:
        """Start an asynchronous fetch of unit `index` (no-op if resident or in flight)."""
        unit = self.units[index]
        with self._lock:
            if unit.device_flat is not None or index in self._inflight:
                return
        if self.sharding.gathered(unit):
            self._inflight[index] = self.gather(unit, "prefetch")
        else:
            with self._lock:
                self._inflight[index] = self._workers.submit(self.load, unit, "prefetch")
        if self.profiler is not None:
            self.profiler.prefetch_issued(unit.param_key)

    def inflight_bytes(self) -> int:
        # Counts every issued, not yet consumed fetch (not only unfinished ones): the prefetch
        # decision must not depend on timing, or ranks would issue stage-3 gathers differently.
        with self._lock:
            return sum(self.units[i].numel * self.lp_dtype.itemsize for i in self._inflight)

    def demand(self, unit: Unit) -> None:
        """Compute needs `unit` now: make it resident (waiting on a prefetch if any)."""
        if unit.device_flat is not None:
            return
        with self._lock:
            future = self._inflight.pop(unit.index, None)
        prof = self.profiler
        if prof is not None:
            prof.prefetch_used(unit.param_key, hit=future is not None)
            waited = prof.wait_begin(unit.param_key)
        if future is None and self.sharding.gathered(unit):
            future = self.gather(unit, "demand")
        flat, ready = future.result() if future is not None else self.load(unit, "demand")
        if prof is not None:
            prof.wait_end(waited)
        if ready is not None:
            # [Note: fetch and release] the copy ran on copy_stream; compute waits for
            # it, and record_stream keeps the block from reuse until compute is done.
            torch.cuda.current_stream().wait_event(ready)
            flat.record_stream(torch.cuda.current_stream())
        unit.device_flat = flat
        for p, view in unit.views(flat):
            p.data = view

    def release(self, unit: Unit) -> None:
        """Drop the unit's device copy (streamed units only); `p.data` becomes empty."""
        if not unit.streamed or unit.device_flat is None:
            return
        empty = torch.empty(0, dtype=self.lp_dtype, device=self.device)
        for p in unit.params:
            p.data = empty
        self.device_tier.free(unit.device_flat)
        unit.device_flat = None

    def drop_inflight(self) -> None:
        """Discard fetches issued but not consumed (their buffers return to the device tier)."""
        with self._lock:
            inflight, self._inflight = list(self._inflight.values()), {}
        for future in inflight:
            self.device_tier.free(future.result()[0])

    def close(self) -> None:
        self._workers.shutdown(wait=True)
