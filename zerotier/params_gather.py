"""ZeRO-3 parameter fetches: this rank's shard staged from its home, all-gathered into the device flat.

[Note: ZeRO-3 reads off the compute thread]
At ZeRO-3 a fetch is an all-gather, which every rank must issue in the same order from
the compute thread, among its other collectives. With the home on NVMe the shard must
first be read, and a read's duration differs per rank, so the gather cannot be issued
when the read lands. A prefetch hands the read (and the H2D copy of the shard, after a
mark taken when its device buffer was allocated) to a fetch worker, as at one rank, and
the compute thread issues the gathers of the prefetches read so far at its next demand
(`ShardGathers.issue`), oldest first: a point in the program every rank reaches in the same
order. It waits there only for a read still running after a module's compute; a demand
that was not prefetched reads on the compute thread (GPU review N14). A prefetch dropped
before its gather was issued (`ParamStore.drop_inflight`) issues none, on every rank alike. A read
that failed is read again on the compute thread before the gather, as at one rank
(hostile trial #24); the gather itself is collective, never retried alone.
"""
from __future__ import annotations

import collections

import torch

from .state import Unit


class Fetch:
    """A fetch in flight: the parameter version it copies and how to finish it on the compute thread."""

    def __init__(self, version: int, future=None, handle=None, keep=None, read=None):
        self.version = version
        self.future = future    # fetch worker: returns the copy's ticket
        self.handle = handle    # ZeRO-3: the all-gather's handle
        self.keep = keep        # ZeRO-3: the gather's input (Staged), alive until the gather is done
        self.read = read        # ZeRO-3, home on NVMe: a fetch worker's read of the shard, not gathered yet


class Now:
    """A demand fetch's ticket with the interface of a worker's future (`Fetch.future`)."""

    def __init__(self, ticket):
        self.ticket = ticket

    def result(self):
        return self.ticket


class Staged:
    """ZeRO-3: this rank's shard where the all-gather reads it. `shard`: a device-tier tensor
    (`temp`, freed once the gather is done), the ZeRO-3 device home, or on the CPU the host
    bytes themselves; `block`: the NVMe read's pool block, given back once the gather read it;
    `copy`: the H2D copy into `temp`, which compute joins before the gather."""

    def __init__(self, shard: torch.Tensor, temp: "torch.Tensor | None" = None, block=None, copy=None):
        self.shard, self.temp, self.block, self.copy = shard, temp, block, copy


class ShardGathers:
    """The ZeRO-3 side of the parameter store: stages each gathered unit's shard from its home
    (`slots[i].home`, [Note: homes] in tiers/homes.py) and issues the all-gathers into its
    device flat, in the same order on every rank."""

    def __init__(self, slots, lp_dtype: torch.dtype, device_tier, host_pool, sharding, workers, profiler=None):
        self.slots, self.lp_dtype = slots, lp_dtype
        self.device_tier, self.host_pool, self.sharding = device_tier, host_pool, sharding
        self.workers, self.profiler = workers, profiler
        self.reading: collections.deque[tuple[Unit, Fetch]] = collections.deque()  # read, not gathered yet

    @staticmethod
    def staging_bytes(lookahead: int, shard_numels: list[int], lp_itemsize: int) -> int:
        """Device bytes of the shards staged for their all-gather (`_shard_buffer`), homes off the
        device: one per fetch in flight (`lookahead` prefetches + the demand), so the largest
        (padded) shards. The planner counts exactly this (GPU review N13)."""
        return sum(sorted(shard_numels, reverse=True)[:lookahead + 1]) * lp_itemsize

    def start(self, unit: Unit, reason: str) -> Fetch:
        """Issued on the thread running forward/backward: every rank gathers in the same order."""
        slot = self.slots[unit.index]
        fetch = Fetch(slot.version, keep=Staged(None, self._shard_buffer(unit)))
        try:
            if reason == "prefetch" and slot.home.view() is None:  # [Note: ZeRO-3 reads off the compute thread]
                # the copy into the shard buffer waits for the compute work enqueued now (GPU review N7)
                fetch.read = self.workers.submit(self.stage, unit, reason, fetch.keep.temp, self.device_tier.mark())
                self.reading.append((unit, fetch))
            else:
                self.gather(unit, fetch, self.stage(unit, reason, fetch.keep.temp))
        except BaseException:
            if fetch.read is None:
                self.release(fetch.keep)
            raise
        return fetch

    def _shard_buffer(self, unit: Unit) -> "torch.Tensor | None":
        """A device-tier buffer for this rank's shard (counted: the planner's
        ParamStore.gather_staging_bytes), or None where the gather reads the shard where it is:
        the device home, or host memory where the device shares it (a CPU device; not the lagging
        device, which copies as a GPU would: [Note: the lagging device] in tiers/lagging.py)."""
        if self.slots[unit.index].home.on_device or self.device_tier.shares_host_memory:
            return None
        return self.device_tier.alloc((unit.shard_numel,), self.lp_dtype, f"{unit.param_key} shard")

    def stage(self, unit: Unit, reason: str, temp: "torch.Tensor | None", issued=None) -> Staged:
        """This rank's shard where the all-gather can read it: read from its home into `temp` (after
        `issued`, a mark taken when `temp` was allocated; a fetch worker for a prefetch from NVMe), or
        without `temp` the host bytes in place (from NVMe: a pool block read for it). On an error
        nothing is left but `temp`, the caller's."""
        home = self.slots[unit.index].home
        if home.on_device:
            return Staged(home.view())
        nbytes = unit.shard_numel * self.lp_dtype.itemsize
        prof = self.profiler
        token = prof.begin(unit.param_key, "param", home.name, "device", nbytes, reason) \
            if prof is not None else None
        block = ticket = None
        try:
            if temp is not None:
                ticket = home.read_into(temp, after=issued)
                return Staged(temp, temp, copy=ticket)
            host = home.view()
            if host is None:  # a file: read into a pool block
                block = self.host_pool.alloc(nbytes, self.lp_dtype, unit.param_key)
                home.read_into(block).wait()
                host = block.tensor
            self.device_tier.count_in(nbytes)  # host memory is the device's: the gather reads it in place
            return Staged(host, block=block)
        except BaseException:
            if block is not None:
                self.host_pool.free(block)
            raise
        finally:
            if token is not None:
                prof.end(token, copy=ticket)

    def gather(self, unit: Unit, fetch: Fetch, staged: Staged) -> None:
        """Compute thread: issue the all-gather of the staged shard into the device flat."""
        fetch.keep = staged
        if staged.copy is not None:  # compute waits for the H2D copy on the device, not on the host
            self.device_tier.join(staged.copy)
        fetch.handle = self.sharding.all_gather(unit, self.slots[unit.index].device_flat, staged.shard)

    def issue(self, abandon) -> None:
        """[Note: ZeRO-3 reads off the compute thread] At a demand: the gathers of the prefetches
        whose shard a fetch worker read, oldest first (waiting for a read still running). A gather
        that fails is given to `abandon(unit, fetch)` and its error raised."""
        while self.reading:
            unit, fetch = self.reading[0]
            try:
                try:
                    staged = fetch.read.result()
                except Exception:  # noqa: BLE001 - the worker is done; its read may predate a fix (#24)
                    fetch.read = None
                    staged = self.stage(unit, "demand", fetch.keep.temp)
                fetch.read = None
                self.gather(unit, fetch, staged)
            except BaseException:
                self.reading.popleft()
                abandon(unit, fetch)
                raise
            self.reading.popleft()

    def release(self, staged: Staged) -> None:
        """The gather read the staged shard (or none will): give its buffers back."""
        if staged.block is not None:  # GPU review N5: reused only after the H2D copy ran
            self.host_pool.free(staged.block, after=staged.copy)
        if staged.temp is not None:
            self.device_tier.free(staged.temp)

    def finish(self, fetch: Fetch) -> None:
        """Wait for the gather (or, dropped before it was issued, for the read), then release its input."""
        if fetch.keep is None:
            return  # finished already
        try:
            if fetch.handle is not None:
                fetch.handle.wait()
            elif fetch.read is not None:  # dropped before its gather was issued: only the read to wait for
                read, fetch.read = fetch.read, None
                fetch.keep = read.result()
        finally:
            staged, fetch.keep = fetch.keep, None
            self.release(staged)
