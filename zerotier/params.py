"""The parameter store: where each unit's low-precision parameters live and how they move.

[Note: a unit's parameter bytes]
Each unit has a *home* for the low-precision bytes this rank keeps (the full flat,
or at ZeRO-3 this rank's shard) and, when it is streamed, one device flat that
compute reads through `p.data` views:

  placement   home (at rest)                               device flat
  device      the device flat itself (never released)      always resident
  host        `host_buf`: a host-pool block (pinned, aligned)  fetched / released per use
  nvme        file `<key>.param`                            fetched / released per use
  ZeRO-3      the home holds only this rank's shard         gathered per use

A fetch is two DMAs and no CPU copy: NVMe -> a pinned aligned pool block
(`store.read` into the block, zero-copy) -> `device_tier.copy_h2d` into the device
flat; from a host home it is the copy alone. At ZeRO-3 the shard is all-gathered
into the flat instead. A prefetch runs the same code on a fetch worker (the CPU's
"stream"); the compute thread `join`s its ticket before use. Releasing resizes the
flat's storage to 0 ([Note: freeing by storage resize] in tiers/device.py).

[Note: ZeRO-3 reads off the compute thread]
At ZeRO-3 a fetch is an all-gather, which every rank must issue in the same order from
the compute thread, among its other collectives. With the home on NVMe the shard must
first be read, and a read's duration differs per rank, so the gather cannot be issued
when the read lands. A prefetch hands the read (and the H2D copy of the shard, after a
mark taken when its device buffer was allocated) to a fetch worker, as at one rank, and
the compute thread issues the gathers of the prefetches read so far at its next demand
(`_issue_gathers`), oldest first: a point in the program every rank reaches in the same
order. It waits there only for a read still running after a module's compute; a demand
that was not prefetched reads on the compute thread (GPU review N14). A prefetch dropped
before its gather was issued (`drop_inflight`) issues none, on every rank alike. A read
that failed is read again on the compute thread before the gather, as at one rank
(hostile trial #24); the gather itself is collective, never retried alone.

[Note: parameter versions]
Every optimizer update of a unit bumps its version (`commit`). A fetch records the
version it copies; `demand` uses a prefetched copy only if its version is current,
else waits for it, drops it and fetches again, and refetches a resident copy that a
commit outdated (a unit left resident by a forward that failed half-way, then a
checkpoint loaded). So a prefetch issued before a step
(e.g. a unit skipped by data-dependent routing while its gradient from an earlier
micro-batch still gets applied) is never trained on.

[Note: write-back]
The optimizer writes the new low-precision shard into `out_buffer(unit)` in the
same pass as the Adam math: the home itself when it is memory on the optimizer's
side, else a pool block. `commit(unit)` then sends it home without waiting: an
async NVMe write (the block returns to the pool when the write completes; the next
fetch of the unit waits on the write's ticket and surfaces its error), an async
copy to the device, or (ZeRO-1/2) a bucketed all-gather into the full flat,
finished by `finish_commits()` at the end of the step.

[Note: a failed write-back]
An NVMe write-back is checked when the unit is next fetched, after step() returned.
If it failed (ENOSPC, EIO), the file still holds the previous version (a rewrite
goes to a new file, renamed on success), so reading it would train on stale
weights. The unit is marked stale: the fetch raises the write's error, and every
later fetch first rewrites the file from the fp32 master (`master_of`, the truth),
raising again while the drive still refuses. ZeRO-1/2 homes hold the full flat
gathered from every rank, which one rank cannot rebuild alone: there the fetch
refuses and names load_checkpoint. So does it while a delayed update is pending
(`delayed.master_of`): that update moves the master past the weights the file must
hold, and nothing keeps them ([Note: delayed update] in delayed.py).
"""
from __future__ import annotations

import collections
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .device import enter as enter_device
from .errors import BudgetError, ZerotierError
from .io.memory import round_up
from .slots import SlotField
from .state import PARAM_TRANSITIONS, Location, ParamState, Unit, transition
from .threads import COMPUTE, UPDATER, owned


class _Fetch:
    """A fetch in flight: the parameter version it copies and how to finish it on the compute thread."""

    def __init__(self, version: int, future=None, handle=None, keep=None, read=None):
        self.version = version
        self.future = future    # fetch worker: returns the copy's ticket
        self.handle = handle    # ZeRO-3: the all-gather's handle
        self.keep = keep        # ZeRO-3: the gather's input (_Staged), alive until the gather is done
        self.read = read        # ZeRO-3, home on NVMe: a fetch worker's read of the shard, not gathered yet


class _Staged:
    """ZeRO-3: this rank's shard where the all-gather reads it. `shard`: a device-tier tensor
    (`temp`, freed once the gather is done), the ZeRO-3 device home, or on the CPU the host
    bytes themselves; `block`: the NVMe read's pool block, reused only after `copy` (the H2D
    copy into `temp`) ran."""

    def __init__(self, shard: torch.Tensor, temp: "torch.Tensor | None" = None, block=None, copy=None):
        self.shard, self.temp, self.block, self.copy = shard, temp, block, copy


@dataclass(slots=True, eq=False)
class ParamSlot:
    """One unit's parameter bytes and their life ([Note: a unit's parameter bytes]). Its home is
    one of `device_flat` (not streamed), `device_shard`, `host_buf` or `nvme_key`. `fetch` and
    `failed_write` are shared by the compute and updater threads: read and written under the
    store's `_lock` ([Note: thread ownership] in threads.py)."""

    state: ParamState = ParamState.RESIDENT
    version: int = 0                                # [Note: parameter versions]
    fetched: int = 0                                # the version the device flat holds while RESIDENT
    streamed: bool = False                          # fetched / released per use
    device_flat: "torch.Tensor | None" = None       # compute copy (views = p.data); the home if not streamed
    device_shard: "torch.Tensor | None" = None      # ZeRO-3 home on the device
    host_buf: object = None                         # home in the host pool (HostBuffer)
    nvme_key: "str | None" = None                   # home in this NVMe file
    fetch: "_Fetch | None" = None                   # issued, not consumed yet
    out: object = None                              # out_buffer(): awaiting commit (updater thread)
    failed_write: "BaseException | None" = None     # [Note: a failed write-back]


class ParamStore:
    def __init__(self, units: list[Unit], loc: Location, lp_dtype: torch.dtype, device_tier, host_pool, store,
                 sharding, out_loc: Location, lookahead: int = 0, profiler=None):
        self.units, self.loc, self.lp_dtype = units, loc, lp_dtype
        self.device_tier, self.host_pool, self.store, self.sharding = device_tier, host_pool, store, sharding
        self.device = device_tier.device
        self.out_on_device = out_loc is Location.DEVICE  # the optimizer's side; its temporaries count there
        self.out_device = self.device if self.out_on_device else torch.device("cpu")
        self.profiler = profiler              # None when profiling is off
        self.slots = [ParamSlot() for _ in units]  # by unit index
        self._states = SlotField(self.slots, "state")  # what transition() writes
        self.wasted_prefetches = 0                # fetches dropped unused (stale version, or synchronize())
        self._reading: collections.deque[tuple[int, _Fetch]] = collections.deque()  # ZeRO-3 reads, not gathered
        # NVMe write-back tickets not yet checked, by unit, oldest first: the queue _track_write bounds
        self._writes: dict[int, object] = {}
        self.master_of = None                     # unit -> its fp32 master shard (set by the engine)
        self.max_writes = self.writes_in_flight(lookahead)
        self._joins: list = []                   # device copies of commits compute must wait for
        self._keep: list = []                    # write-back temporaries, freed by finish_commits()
        self._lock = threading.Lock()
        # The CPU's copy "stream": fetch workers run NVMe reads and host->device copies of
        # prefetches, overlapping compute. On CUDA they only issue work (the copies run on
        # the device tier's h2d stream).
        self._workers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="zerotier-fetch",
                                           initializer=enter_device, initargs=(self.device,))
        if sharding.active:  # ZeRO-1/2 commits: the gather buckets count where the parameters live
            sharding.gatherer.allocate_from(device_tier, [u.part for u in units if not u.part.replicated],
                                            host_pool if loc is not Location.DEVICE else None)  # [Note: bucket memory]

    # Read-only views kept for the engine's and surface's readers (slots[i].<field> is the truth).
    # To go once engine.py and surface.py read `slots`.
    @property
    def state(self) -> SlotField:
        """Every unit's ParamState, live (surface keeps it: transition() writes through it)."""
        return self._states

    @property
    def streamed(self) -> SlotField:
        return SlotField(self.slots, "streamed")

    @property
    def version(self) -> list[int]:
        """A snapshot of every unit's parameter version."""
        return [slot.version for slot in self.slots]

    @property
    def device_flat(self) -> SlotField:
        return SlotField(self.slots, "device_flat")

    # ------------------------------------------------------------------ sizing (the planner's terms)

    @staticmethod
    def writes_in_flight(lookahead: int) -> int:
        """NVMe write-backs in flight at most (`max_writes`, bounded by _track_write): distinct units."""
        return lookahead + 2

    @staticmethod
    def host_blocks(loc: Location, lookahead: int, units: int) -> int:
        """Host-pool blocks the parameters hold at most at once: a home per unit on the host; on NVMe
        a block per fetch in flight (`lookahead` prefetches + the demand) and per write-back in
        flight (`writes_in_flight`), as host_staging_bytes counts their bytes."""
        if loc is Location.HOST:
            return units
        if loc is Location.NVME:
            return lookahead + 1 + ParamStore.writes_in_flight(lookahead)
        return 0

    @staticmethod
    def host_staging_bytes(lookahead: int, shard_numels: list[int], lp_itemsize: int) -> int:
        """Pool bytes NVMe-resident params need at most: a block per fetch in flight (`lookahead`
        prefetches + the demand: distinct units) plus one per write-back in flight (at most
        `writes_in_flight(lookahead)` distinct units, see _track_write), so the largest units'
        sizes. `shard_numels`: every unit's rank shard. The planner counts exactly this."""
        top = sorted(shard_numels, reverse=True)
        return (sum(top[:lookahead + 1]) + sum(top[:ParamStore.writes_in_flight(lookahead)])) * lp_itemsize

    @staticmethod
    def gather_staging_bytes(lookahead: int, shard_numels: list[int], lp_itemsize: int) -> int:
        """Device bytes of the ZeRO-3 shards staged for their all-gather (`_shard_buffer`), homes
        off the device: one per fetch in flight (`lookahead` prefetches + the demand), so the
        largest (padded) shards. The planner counts exactly this (GPU review N13)."""
        return sum(sorted(shard_numels, reverse=True)[:lookahead + 1]) * lp_itemsize

    @staticmethod
    def writeback_bytes(rank_numel: int, lp_itemsize: int) -> int:
        """ZeRO-1/2 over several ranks: bytes of the out buffers of one step (this rank's new shard
        of every unit), alive until finish_commits() (the all-gathers read them). Planner's term."""
        return rank_numel * lp_itemsize

    # ------------------------------------------------------------------ place

    @owned(COMPUTE)
    def place(self, unit: Unit, lp: torch.Tensor) -> None:
        """Put this rank's low-precision bytes `lp` (full flat, or its ZeRO-3 shard; CPU) at home
        and point the parameters at the device flat. The user's original tensors are dropped."""
        slot = self.slots[unit.index]
        gathered = self.sharding.gathered(unit)
        streamed = slot.streamed = self.loc is not Location.DEVICE or gathered
        if streamed:  # views are taken while the storage is whole, then it is dropped
            flat = torch.empty(unit.part.padded_numel if gathered else unit.numel, dtype=self.lp_dtype,
                               device=self.device)
        else:
            flat = self.device_tier.alloc((unit.numel,), self.lp_dtype, unit.param_key)
            flat.copy_(lp)
        slot.device_flat = flat
        for p, view in unit.views(flat):
            p.data = view
        if not streamed:
            return
        flat.untyped_storage().resize_(0)
        slot.state = ParamState.RELEASED
        if self.loc is Location.DEVICE:  # ZeRO-3 shard on the device
            slot.device_shard = self.device_tier.alloc((lp.numel(),), self.lp_dtype, unit.param_key)
            slot.device_shard.copy_(lp)
        elif self.loc is Location.HOST:
            slot.host_buf = self.host_pool.alloc(lp.numel() * lp.element_size(), self.lp_dtype, unit.param_key)
            slot.host_buf.tensor.copy_(lp)
        else:
            slot.nvme_key = unit.param_key
            block = self.host_pool.alloc(lp.numel() * lp.element_size(), self.lp_dtype, unit.param_key)
            block.tensor.copy_(lp)
            ticket = self.store.write(slot.nvme_key, block)
            self.host_pool.free(block, after=ticket)
            self._track_write(unit.index, ticket)

    def finish_place(self) -> None:
        """Wait for the initial NVMe writes still in flight (place() keeps at most max_writes)."""
        self._check_writes(self._pending_writes())

    # ------------------------------------------------------------------ fetch / release

    @owned(COMPUTE)
    def prefetch(self, index: int) -> None:
        """Start fetching unit `index` if it is released and nothing is in flight. A prefetch
        that does not fit the device budget is skipped (the demand fetch will report it)."""
        unit, slot = self.units[index], self.slots[index]
        with self._lock:
            if slot.state is not ParamState.RELEASED or slot.fetch is not None:
                return
        try:
            fetch = self._start(unit, "prefetch")
        except BudgetError:
            return
        with self._lock:
            slot.fetch = fetch
        if self.profiler is not None:
            self.profiler.prefetch_issued(unit.param_key)

    def inflight_bytes(self) -> int:
        # Counts every issued, not yet consumed fetch (not only unfinished ones): the prefetch
        # decision must not depend on timing, or ranks would issue ZeRO-3 gathers differently.
        with self._lock:
            return sum(unit.numel * self.lp_dtype.itemsize for unit, slot in zip(self.units, self.slots)
                       if slot.fetch is not None)

    @owned(COMPUTE)
    def demand(self, unit: Unit, then=None) -> None:
        """Compute needs `unit` now: make it resident (using a prefetch of the current version).
        `then()` runs once the unit's fetch is issued, before waiting for it (the prefetches)."""
        if self._reading:
            self._issue_gathers()
        slot = self.slots[unit.index]
        if slot.state is ParamState.RESIDENT and slot.streamed and slot.fetched != slot.version:
            self.release(unit)  # committed since its fetch (a checkpoint loaded after a forward failed half-way)
        if slot.state is ParamState.RESIDENT:
            if then is not None:
                then()
            return
        with self._lock:
            fetch, slot.fetch = slot.fetch, None
        if fetch is not None and fetch.version != slot.version:  # [Note: parameter versions]
            self._drop(unit, fetch)
            fetch = None
        prof = self.profiler
        if prof is not None:
            prof.prefetch_used(unit.param_key, hit=fetch is not None)
        prefetched = fetch is not None
        if fetch is None:
            fetch = self._start(unit, "demand")
        waited = None
        try:
            if then is not None:
                then()
            if prof is not None:
                waited = prof.wait_begin(unit.param_key, device=True)
            try:
                self._finish(fetch)
            except Exception:
                if not prefetched or fetch.handle is not None:
                    raise
                # A prefetch that failed is not this demand's answer: it may predate a fix (a
                # permission restored, space freed; hostile trial #24). A fresh read reports
                # whatever still fails. (A ZeRO-3 gather is collective: never retried alone.)
                self._drop(unit, fetch)
                fetch = None
                fetch = self._start(unit, "demand")
                self._finish(fetch)
        except BaseException:
            if fetch is not None:
                self._drop(unit, fetch, wasted=False)
            raise
        finally:
            if waited is not None:
                prof.wait_end(waited)
        slot.fetched = fetch.version
        transition(self._states, unit.index, ParamState.RESIDENT, PARAM_TRANSITIONS, "parameters")

    @owned(COMPUTE)
    def release(self, unit: Unit) -> None:
        """Drop a streamed unit's device bytes (no-op when not resident or not streamed)."""
        slot = self.slots[unit.index]
        if not slot.streamed or slot.state is not ParamState.RESIDENT:
            return
        self.device_tier.free_storage(slot.device_flat)
        transition(self._states, unit.index, ParamState.RELEASED, PARAM_TRANSITIONS, "parameters")

    @owned(COMPUTE)
    def drop_inflight(self) -> None:
        """Discard fetches issued but not consumed (e.g. before loading new weights)."""
        inflight = []
        with self._lock:
            for unit, slot in zip(self.units, self.slots):
                if slot.fetch is not None:
                    inflight.append((unit, slot.fetch))
                    slot.fetch = None
        self._reading.clear()  # every rank drops the same ones: no gather is issued for them
        for unit, fetch in inflight:
            self._drop(unit, fetch)

    def _start(self, unit: Unit, reason: str) -> _Fetch:
        """RELEASED -> FETCHING: give the flat its bytes and issue the copy (or gather)."""
        i, slot = unit.index, self.slots[unit.index]
        self.device_tier.fill_storage(slot.device_flat, unit.param_key)
        transition(self._states, i, ParamState.FETCHING, PARAM_TRANSITIONS, "parameters")
        fetch = None
        try:
            self._check_writes([i])  # the bytes at home must be the last committed ones
            if slot.failed_write is not None:
                self._rewrite_home(unit)
            if self.sharding.gathered(unit):
                # Issued on the thread running forward/backward: every rank gathers in the same order.
                fetch = _Fetch(slot.version, keep=_Staged(None, self._shard_buffer(unit)))
                if reason == "prefetch" and self.loc is Location.NVME:  # [Note: ZeRO-3 reads off the compute thread]
                    # the copy into the shard buffer waits for the compute work enqueued now (GPU review N7)
                    fetch.read = self._workers.submit(self._stage_shard, unit, reason, fetch.keep.temp,
                                                      self.device_tier.mark())
                    self._reading.append((i, fetch))
                else:
                    self._gather(unit, fetch, self._stage_shard(unit, reason, fetch.keep.temp))
                return fetch
            if reason == "demand":  # the compute thread needs it now: no hop through a worker
                ticket = self._load(unit, reason, None)
                return _Fetch(slot.version, future=_Now(ticket))
            # the copy waits for the compute work enqueued *now*, not when the worker runs (GPU review N7)
            issued = self.device_tier.mark()
            return _Fetch(slot.version, future=self._workers.submit(self._load, unit, reason, issued))
        except BaseException:
            if fetch is not None and fetch.read is None:
                self._release_staged(fetch.keep)
            self._abandon(unit)
            raise

    def _load(self, unit: Unit, reason: str, issued):
        """Home -> device flat (a fetch worker for prefetches). Returns the copy's ticket."""
        slot = self.slots[unit.index]
        nbytes = unit.numel * self.lp_dtype.itemsize
        prof = self.profiler
        token = prof.begin(unit.param_key, "param", self.loc.value, "device", nbytes, reason) \
            if prof is not None else None
        ticket = None
        try:
            if self.loc is Location.HOST:
                ticket = self.device_tier.copy_h2d(slot.device_flat, slot.host_buf.tensor, after=issued)
                return ticket
            block = self.host_pool.alloc(nbytes, self.lp_dtype, unit.param_key)
            try:
                self.store.read(slot.nvme_key, block).wait()
                ticket = self.device_tier.copy_h2d(slot.device_flat, block.tensor, after=issued)
            except BaseException:
                self.host_pool.free(block)
                raise
            self.host_pool.free(block, after=ticket)
            return ticket
        finally:
            if token is not None:
                prof.end(token, copy=ticket)

    def _shard_buffer(self, unit: Unit) -> "torch.Tensor | None":
        """ZeRO-3: a device-tier buffer for this rank's shard (counted: the planner's
        ParamStore.gather_staging_bytes), or None where the gather reads the shard where it is:
        the device home, or host memory, which is the CPU device's (not on the lagging device,
        which copies as a GPU would: [Note: the lagging device] in tiers/device.py)."""
        if self.loc is Location.DEVICE or (self.device.type == "cpu" and not self.device_tier.lagging):
            return None
        return self.device_tier.alloc((unit.shard_numel,), self.lp_dtype, f"{unit.param_key} shard")

    def _stage_shard(self, unit: Unit, reason: str, temp: "torch.Tensor | None", issued=None) -> _Staged:
        """ZeRO-3: this rank's shard where the all-gather can read it: read from NVMe into a pool
        block (a fetch worker for a prefetch: [Note: ZeRO-3 reads off the compute thread]) and
        copied into `temp` (after `issued`, a mark taken when `temp` was allocated). On an error
        nothing is left but `temp`, the caller's."""
        slot = self.slots[unit.index]
        if self.loc is Location.DEVICE:
            return _Staged(slot.device_shard)
        nbytes = unit.shard_numel * self.lp_dtype.itemsize
        prof = self.profiler
        token = prof.begin(unit.param_key, "param", self.loc.value, "device", nbytes, reason) \
            if prof is not None else None
        block = ticket = None
        try:
            if self.loc is Location.HOST:
                host = slot.host_buf.tensor
            else:
                block = self.host_pool.alloc(nbytes, self.lp_dtype, unit.param_key)
                self.store.read(slot.nvme_key, block).wait()
                host = block.tensor
            if temp is None:  # host memory is the device's: the gather reads it in place
                self.device_tier.count_in(nbytes)
                return _Staged(host, block=block)
            ticket = self.device_tier.copy_h2d(temp, host, after=issued)
            return _Staged(temp, temp, block, ticket)
        except BaseException:
            if block is not None:
                self.host_pool.free(block)
            raise
        finally:
            if token is not None:
                prof.end(token, copy=ticket)

    def _gather(self, unit: Unit, fetch: _Fetch, staged: _Staged) -> None:
        """ZeRO-3, compute thread: issue the all-gather of the staged shard into the device flat."""
        fetch.keep = staged
        if staged.copy is not None:  # compute waits for the H2D copy on the device, not on the host
            self.device_tier.join(staged.copy)
        fetch.handle = self.sharding.all_gather(unit, self.slots[unit.index].device_flat, staged.shard)

    def _issue_gathers(self) -> None:
        """[Note: ZeRO-3 reads off the compute thread] At a demand: the gathers of the prefetches
        whose shard a fetch worker read, oldest first (waiting for a read still running)."""
        while self._reading:
            i, fetch = self._reading[0]
            unit = self.units[i]
            try:
                try:
                    staged = fetch.read.result()
                except Exception:  # noqa: BLE001 - the worker is done; its read may predate a fix (#24)
                    fetch.read = None
                    staged = self._stage_shard(unit, "demand", fetch.keep.temp)
                fetch.read = None
                self._gather(unit, fetch, staged)
            except BaseException:
                self._reading.popleft()
                with self._lock:
                    if self.slots[i].fetch is fetch:
                        self.slots[i].fetch = None
                self._drop(unit, fetch, wasted=False)
                raise
            self._reading.popleft()

    def _release_staged(self, staged: _Staged) -> None:
        """The gather read the staged shard (or none will): give its buffers back."""
        if staged.block is not None:  # GPU review N5: reused only after the H2D copy ran
            self.host_pool.free(staged.block, after=staged.copy)
        if staged.temp is not None:
            self.device_tier.free(staged.temp)

    def _finish(self, fetch: _Fetch) -> None:
        if fetch.future is not None:
            self.device_tier.join(fetch.future.result())
            return
        if fetch.keep is None:
            return  # ZeRO-3: finished already
        try:
            if fetch.handle is not None:
                fetch.handle.wait()
            elif fetch.read is not None:  # dropped before its gather was issued: only the read to wait for
                read, fetch.read = fetch.read, None
                fetch.keep = read.result()
        finally:
            staged, fetch.keep = fetch.keep, None
            self._release_staged(staged)

    def _drop(self, unit: Unit, fetch: _Fetch, wasted: bool = True) -> None:
        """Wait for an unwanted or failed fetch (it writes the flat), then release its bytes."""
        try:
            self._finish(fetch)
        except Exception:  # noqa: BLE001 - a fresh fetch follows and reports any lasting error
            pass
        if wasted:
            self.wasted_prefetches += 1
            if self.profiler is not None:
                self.profiler.prefetch_wasted(unit.param_key)
        self._abandon(unit)

    def _abandon(self, unit: Unit) -> None:
        """FETCHING -> RELEASED after a failed or unwanted fetch."""
        self.device_tier.free_storage(self.slots[unit.index].device_flat)
        transition(self._states, unit.index, ParamState.RELEASED, PARAM_TRANSITIONS, "parameters")

    # ------------------------------------------------------------------ write-back ([Note: write-back])

    def _shard_home(self, unit: Unit) -> torch.Tensor | None:
        """This rank's low-precision shard at home when it is memory the optimizer can write."""
        slot = self.slots[unit.index]
        if not unit.part.replicated and not self.sharding.gathered(unit):
            return None  # ZeRO-1/2: home holds the full flat, filled by the all-gather
        if self.loc is Location.DEVICE:
            return slot.device_shard if self.sharding.gathered(unit) else slot.device_flat
        if self.loc is Location.HOST:
            return slot.host_buf.tensor
        return None

    @owned(UPDATER)
    def out_buffer(self, unit: Unit) -> torch.Tensor:
        """Where the optimizer writes this rank's new low-precision shard (shard_numel elements)."""
        home = self._shard_home(unit)
        if home is not None and home.device.type == self.out_device.type:
            return home
        slot = self.slots[unit.index]
        if slot.out is None:
            slot.out = self._temp(unit.shard_numel, self.out_on_device)
        out = slot.out
        return _tensor(out)

    @owned(UPDATER)
    def staged_out(self, unit: Unit) -> torch.Tensor:
        """out_buffer for a speculated update ([Note: speculative step] in overlap/speculative.py): always a
        write-back buffer, never the home, so the new parameters are not seen before commit()."""
        slot = self.slots[unit.index]
        if slot.out is None:
            slot.out = self._temp(unit.shard_numel, self.out_on_device)
        return _tensor(slot.out)

    def staged_out_bytes(self, unit: Unit) -> int:
        """Bytes staged_out(unit) holds until the window is validated (a host-pool block: rounded
        up to the pool's alignment, as the plan counts it)."""
        nbytes = unit.shard_numel * self.lp_dtype.itemsize
        if self.out_on_device:
            return nbytes
        return max(round_up(nbytes, self.host_pool.alignment), self.host_pool.alignment)

    @owned(UPDATER)
    def drop_out(self, unit: Unit) -> None:
        """Give back a staged write-back buffer without committing it (a rolled-back speculation)."""
        slot = self.slots[unit.index]
        out, slot.out = slot.out, None
        if isinstance(out, torch.Tensor):
            self.device_tier.free(out)
        elif out is not None:
            self.host_pool.free(out)

    @owned(UPDATER)
    def commit(self, unit: Unit) -> None:
        """The optimizer wrote out_buffer(unit): bump the version and send the bytes home (async)."""
        i, slot = unit.index, self.slots[unit.index]
        slot.version += 1
        out, slot.out = slot.out, None
        nbytes = unit.shard_numel * self.lp_dtype.itemsize
        src = "host" if self.out_device.type == "cpu" else "device"
        prof = self.profiler
        token = prof.begin(unit.param_key, "param", src, self.loc.value, nbytes, "param-copyback") \
            if prof is not None and src != self.loc.value else None
        if src != self.loc.value and self.loc is Location.DEVICE:
            self.device_tier.count_in(nbytes)
        ticket = None
        if out is None:
            pass  # the optimizer wrote the home in place
        elif not unit.part.replicated and not self.sharding.gathered(unit):
            self._gather_commit(unit, out)
        elif self.loc is Location.NVME:
            if isinstance(out, torch.Tensor):  # the optimizer is on the device: home through a pool block
                staged = self.host_pool.alloc(nbytes, self.lp_dtype, unit.param_key)
                self.device_tier.copy_d2h(staged.tensor, out).wait()  # the file write reads the block
                self.device_tier.free(out)
                out = staged
            ticket = self.store.write(slot.nvme_key, out)
            self.host_pool.free(out, after=ticket)
            self._track_write(i, ticket)
        else:  # home is memory on the other side of the host/device link
            home = self._shard_home(unit)
            tensor = _tensor(out)
            if home.device.type == tensor.device.type:  # a staged buffer on the home's side (staged_out): no link
                home.copy_(tensor)
                self._keep.append((out, None))
            else:
                copy = self.device_tier.copy_h2d if home.device.type != "cpu" else self.device_tier.copy_d2h
                ticket = copy(home, tensor)
                self._joins.append(ticket)
                self._keep.append((out, ticket))
        if token is not None:
            prof.end(token, copy=ticket if self.loc is not Location.NVME else None)

    def _gather_commit(self, unit: Unit, out) -> None:
        """ZeRO-1/2: all-gather every rank's new shard into the full flat at home."""
        i, slot = unit.index, self.slots[unit.index]
        shard = _tensor(out)
        self._keep.append((out, None))
        if self.loc is Location.NVME:
            full = self.host_pool.alloc(unit.numel * self.lp_dtype.itemsize, self.lp_dtype, unit.param_key)

            def write(_flat):
                ticket = self.store.write(slot.nvme_key, full)
                self.host_pool.free(full, after=ticket)
                with self._lock:
                    self._writes[i] = ticket
            target, done = full.tensor, write
        else:
            target = slot.device_flat if self.loc is Location.DEVICE else slot.host_buf.tensor
            done = None
        if shard.device.type != target.device.type:  # gather where the target lives
            moved = self._temp(shard.numel(), on_device=target.device.type != "cpu")
            copy = self.device_tier.copy_h2d if target.device.type != "cpu" else self.device_tier.copy_d2h
            copy(_tensor(moved), shard).wait()
            self._keep.append((moved, None))
            shard = _tensor(moved)
        self.sharding.gather_params(unit, shard, target, done)

    def _temp(self, numel: int, on_device: bool):
        """A write-back temporary: a budgeted tensor on the device tier, else a host-pool block."""
        if not on_device:
            return self.host_pool.alloc(numel * self.lp_dtype.itemsize, self.lp_dtype, "param write-back")
        return self.device_tier.alloc((numel,), self.lp_dtype, "param write-back")

    @owned(COMPUTE)
    def finish_commits(self) -> None:
        """End of a step: the ZeRO-1/2 gathers complete, compute waits for device write-backs.
        NVMe writes stay in flight: the next fetch of each unit waits on its own."""
        self.sharding.finish_gather()
        joins, self._joins = self._joins, []
        for ticket in joins:
            self.device_tier.join(ticket)
        keep, self._keep = self._keep, []
        for out, ticket in keep:  # gathers are complete; a copy may still run (freed after it)
            if isinstance(out, torch.Tensor):
                self.device_tier.free(out)  # record_stream keeps it until the copy ran
            else:
                self.host_pool.free(out, after=ticket)

    def _track_write(self, index: int, ticket) -> None:
        """Keep an NVMe write-back's ticket; past `max_writes` in flight, wait for the oldest, so
        the pool blocks they read stay within ParamStore.host_staging_bytes however slow the drive."""
        self._check_writes([index])  # an earlier write of the same unit (store writes are ordered)
        with self._lock:  # GPU review N15: a fetch on the compute thread pops from _writes meanwhile
            self._writes[index] = ticket
        while True:
            with self._lock:
                oldest = next(iter(self._writes)) if len(self._writes) > self.max_writes else None
            if oldest is None:
                break
            self._check_writes([oldest])

    def _pending_writes(self) -> list[int]:
        with self._lock:
            return list(self._writes)

    def _check_writes(self, indices) -> None:
        """Wait for the NVMe write-backs of these units; raise the first error (TierIOError...)."""
        first = None
        for i in indices:
            # The ticket stays in _writes until its outcome is recorded: a thread checking the same
            # unit meanwhile (the compute thread's fetch while the optimizer thread's _track_write
            # waits) waits on it too and sees its error, never an unchecked home ([Note: thread ownership])
            with self._lock:
                ticket = self._writes.get(i)
            if ticket is None:
                continue
            outcome = None
            try:
                ticket.wait()
            except Exception as exc:  # noqa: BLE001 - every ticket is waited, the first error raised
                first, outcome = first or exc, exc
            except BaseException as exc:  # noqa: BLE001 - Ctrl-C: the write itself may still succeed
                first = first or exc
                outcome = False
            with self._lock:  # failed_write is shared like _writes: both under _lock
                if self._writes.get(i) is ticket:
                    del self._writes[i]
                    if outcome is None:
                        self.slots[i].failed_write = None  # a newer write-back landed
                    elif outcome is not False:
                        self.slots[i].failed_write = outcome  # [Note: a failed write-back]
        if first is not None:
            raise first

    def _rewrite_home(self, unit: Unit) -> None:
        """[Note: a failed write-back] Write the unit's home again from the fp32 master."""
        i = unit.index
        cause = self.slots[i].failed_write
        if unit.frozen:  # [Note: frozen units]: no master; its home was the only copy
            raise ZerotierError(
                f"frozen unit '{unit.name or '<root>'}': writing its parameters to {self.loc.value} failed ({cause}), "
                "so its file holds the values before that write and nothing else holds the new ones. Free the drive "
                "and build the engine again (zerotier.initialize, or from_pretrained)") from cause
        if self.master_of is None or (not unit.part.replicated and not self.sharding.gathered(unit)):
            raise ZerotierError(
                f"unit '{unit.name or '<root>'}': writing its updated parameters to {self.loc.value} failed "
                f"({cause}), so its file holds the previous step's weights, and this rank cannot rebuild them "
                "alone (ZeRO-1/2 with several ranks). Load a checkpoint (engine.load_checkpoint(root)) to "
                "continue") from cause
        master = self.master_of(unit)  # first: it may refuse (a delayed update holds the write-back state)
        self.out_buffer(unit).copy_(master)
        self.commit(unit)
        self._check_writes([i])  # landed: no longer stale; the drive still refuses: its error again

    @owned(COMPUTE)
    def synchronize(self) -> None:
        """Finish all parameter work in flight: unconsumed prefetches, gathers, NVMe write-backs."""
        self.drop_inflight()
        self.finish_commits()
        self._check_writes(self._pending_writes())

    # ------------------------------------------------------------------ access

    def load(self, unit: Unit, lp_source: torch.Tensor) -> None:
        """Replace this rank's shard with `lp_source` (e.g. a checkpoint's fp32 master shard)."""
        self.out_buffer(unit).copy_(lp_source)
        self.commit(unit)

    def close(self) -> None:
        self._workers.shutdown(wait=True)
        for i, ticket in list(self._writes.items()):
            try:
                ticket.wait()
            except Exception:  # noqa: BLE001 - closing: the store reports nothing more
                pass
        self._writes.clear()


def _tensor(buf) -> torch.Tensor:
    """The tensor of a pool block (HostBuffer) or a device tensor."""
    return buf if isinstance(buf, torch.Tensor) else buf.tensor


class _Now:
    """A demand fetch's ticket with the interface of a worker's future."""

    def __init__(self, ticket):
        self.ticket = ticket

    def result(self):
        return self.ticket
