"""The parameter store: where each unit's low-precision parameters live and how they move.

[Note: a unit's parameter bytes]
Each unit has a *home* (`ParamSlot.home`, [Note: homes] in tiers/homes.py) for the
low-precision bytes this rank keeps (the full flat, or at ZeRO-3 this rank's shard) and,
when it is streamed, one device flat that compute reads through `p.data` views:

  placement   home (at rest)                                   device flat
  device      DeviceHome: the device flat itself (never released)  always resident
  host        HostHome: a host-pool block (pinned, aligned)    fetched / released per use
  nvme        NVMeHome: file `<key>.param`                     fetched / released per use
  ZeRO-3      the home holds only this rank's shard             gathered per use (params_gather.py)

A fetch is `home.read_into(flat)`: two DMAs and no CPU copy from NVMe (the file into a
pinned aligned pool block, zero-copy, then `device_tier.copy_h2d` into the device flat);
from a host home it is the copy alone. At ZeRO-3 the shard is all-gathered into the flat
instead. A prefetch runs the same code on a fetch worker (the CPU's "stream"); the compute
thread `join`s its ticket before use. Releasing resizes the flat's storage to 0 ([Note:
freeing by storage resize] in tiers/device.py).

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
side, else a pool block. `commit(unit)` then sends it home without waiting
(`home.write_from`): an async NVMe write (the block returns to the pool when the write completes; the next
fetch of the unit waits on the write's ticket and surfaces its error: params_writes.py), an async
copy to the device, or (ZeRO-1/2) a bucketed all-gather into the full flat,
finished by `finish_commits()` at the end of the step. [Note: write-back buffers of a gather]
A ZeRO-1/2 rank's new shards wait for that gather in buffers on the optimizer's side: the plan
counts them in the optimizer's term (ParamSizing.writeback_bytes in OptStateSizing.plan_terms),
so they are allocated from `out_tiers`, the tiers charged to the optimizer ([Note: peaks per
component] in tiers/base.py).

"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .device import enter as enter_device
from .errors import BudgetError
from .io.memory import round_up
from .params_gather import Fetch, Now, ShardGathers
from .params_terms import ParamSizing
from .params_writes import WriteBacks, refuse_rewrite
from .slots import SlotField
from .state import PARAM_TRANSITIONS, Location, ParamState, Unit, transition
from .threads import COMPUTE, UPDATER, owned
from .tiers.homes import HOMES, Home, Tiers, tensor_of


@dataclass(slots=True, eq=False)
class ParamSlot:
    """One unit's parameter bytes and their life ([Note: a unit's parameter bytes]). `home` is where
    they rest (for a unit not streamed: the device flat itself). `fetch` and `failed_write` are
    shared by the compute and updater threads: read and written under the store's `_lock`
    ([Note: thread ownership] in threads.py)."""

    state: ParamState = ParamState.RESIDENT
    version: int = 0                                # [Note: parameter versions]
    fetched: int = 0                                # the version the device flat holds while RESIDENT
    streamed: bool = False                          # fetched / released per use
    device_flat: "torch.Tensor | None" = None       # compute copy (views = p.data); the home if not streamed
    home: "Home | None" = None                      # [Note: homes] in tiers/homes.py
    fetch: "Fetch | None" = None                    # issued, not consumed yet
    out: object = None                              # out_buffer(): awaiting commit (updater thread)
    written_in_place: bool = False                  # device_out(): the home holds the update (updater thread)
    failed_write: "BaseException | None" = None     # [Note: a failed write-back] in params_writes.py


class ParamStore(ParamSizing):
    """[Note: a unit's parameter bytes]; its sizing (the planner's term) is ParamSizing's (params_terms.py)."""

    def __init__(self, units: list[Unit], loc: Location, lp_dtype: torch.dtype, device_tier, host_pool, store,
                 sharding, out_loc: Location, out_tiers: tuple, lookahead: int = 0, profiler=None):
        self.units, self.loc, self.lp_dtype = units, loc, lp_dtype
        self.device_tier, self.host_pool, self.store, self.sharding = device_tier, host_pool, store, sharding
        self.home_kind = HOMES[loc]               # the class of every unit's home ([Note: homes])
        self.tiers = Tiers(device_tier, host_pool, store)
        self.device = device_tier.device
        self.out_on_device = HOMES[out_loc].on_device  # the optimizer's side; its temporaries count there
        self.out_device = self.device if self.out_on_device else torch.device("cpu")
        self.out_tiers = out_tiers  # (device tier, host pool) [Note: write-back buffers of a gather]
        self.profiler = profiler              # None when profiling is off
        self.slots = [ParamSlot() for _ in units]  # by unit index
        self._states = SlotField(self.slots, "state")  # what transition() writes
        self.wasted_prefetches = 0                # fetches dropped unused (stale version, or synchronize())
        self.master_of = None                     # unit -> its fp32 master shard (set by the engine)
        self._joins: list = []                   # device copies of commits compute must wait for
        self._keep: list = []                    # write-back temporaries, freed by finish_commits()
        self._lock = threading.Lock()
        self.writes = WriteBacks(self.slots, self._lock, WriteBacks.in_flight(lookahead))  # to NVMe homes
        # The CPU's copy "stream": fetch workers run NVMe reads and host->device copies of
        # prefetches, overlapping compute. On CUDA they only issue work (the copies run on
        # the device tier's h2d stream).
        self._workers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="zerotier-fetch",
                                           initializer=enter_device, initargs=(self.device,))
        self.gathers = ShardGathers(self.slots, lp_dtype, device_tier, host_pool, sharding, self._workers, profiler)
        if sharding.active:  # ZeRO-1/2 commits: the gather buckets count where the parameters live
            sharding.gatherer.allocate_from(device_tier, [u.part for u in units if not u.part.replicated],
                                            None if self.home_kind.on_device else host_pool)  # [Note: bucket memory]

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

    # ------------------------------------------------------------------ place

    @owned(COMPUTE)
    def place(self, unit: Unit, lp: torch.Tensor) -> None:
        """Put this rank's low-precision bytes `lp` (full flat, or its ZeRO-3 shard; CPU) at home
        and point the parameters at the device flat. The user's original tensors are dropped."""
        slot = self.slots[unit.index]
        gathered = self.sharding.gathered(unit)
        streamed = slot.streamed = not self.home_kind.on_device or gathered
        if streamed:  # views are taken while the storage is whole, then it is dropped
            flat = torch.empty(unit.part.padded_numel if gathered else unit.numel, dtype=self.lp_dtype,
                               device=self.device)
        else:  # the device flat is the home
            slot.home = self.home_kind.reserve(unit.param_key, unit.numel, self.lp_dtype, self.tiers)
            flat = slot.home.view()
            flat.copy_(lp)
        slot.device_flat = flat
        for p, view in unit.views(flat):
            p.data = view
        if not streamed:
            return
        flat.untyped_storage().resize_(0)
        slot.state = ParamState.RELEASED
        home = slot.home = self.home_kind.reserve(unit.param_key, lp.numel(), self.lp_dtype, self.tiers)
        if home.view() is not None:
            home.view().copy_(lp)
        else:  # a file: written from a pool block
            block = self.host_pool.alloc(lp.numel() * lp.element_size(), self.lp_dtype, unit.param_key)
            block.tensor.copy_(lp)
            ticket = home.write_from(block)
            self.host_pool.free(block, after=ticket)
            self.writes.track(unit.index, ticket)

    def finish_place(self) -> None:
        """Wait for the initial NVMe writes still in flight (place() keeps at most writes.max_writes)."""
        self.writes.check(self.writes.pending())

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
        if self.gathers.reading:
            self.gathers.issue(self._abandon_gather)
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
        self.gathers.reading.clear()  # every rank drops the same ones: no gather is issued for them
        for unit, fetch in inflight:
            self._drop(unit, fetch)

    def _start(self, unit: Unit, reason: str) -> Fetch:
        """RELEASED -> FETCHING: give the flat its bytes and issue the copy (or gather)."""
        i, slot = unit.index, self.slots[unit.index]
        self.device_tier.fill_storage(slot.device_flat, unit.param_key)
        transition(self._states, i, ParamState.FETCHING, PARAM_TRANSITIONS, "parameters")
        try:
            self.writes.check([i])  # the bytes at home must be the last committed ones
            if slot.failed_write is not None:
                self._rewrite_home(unit)
            if self.sharding.gathered(unit):
                return self.gathers.start(unit, reason)
            if reason == "demand":  # the compute thread needs it now: no hop through a worker
                ticket = self._load(unit, reason, None)
                return Fetch(slot.version, future=Now(ticket))
            # the copy waits for the compute work enqueued *now*, not when the worker runs (GPU review N7)
            issued = self.device_tier.mark()
            return Fetch(slot.version, future=self._workers.submit(self._load, unit, reason, issued))
        except BaseException:
            self._abandon(unit)
            raise

    def _load(self, unit: Unit, reason: str, issued):
        """Home -> device flat (a fetch worker for prefetches). Returns the copy's ticket."""
        slot, prof, ticket = self.slots[unit.index], self.profiler, None
        token = prof.begin(unit.param_key, "param", slot.home.name, "device", unit.numel * self.lp_dtype.itemsize,
                           reason) if prof is not None else None
        try:
            ticket = slot.home.read_into(slot.device_flat, after=issued)
            return ticket
        finally:
            if token is not None:
                prof.end(token, copy=ticket)

    def _finish(self, fetch: Fetch) -> None:
        if fetch.future is not None:
            self.device_tier.join(fetch.future.result())
            return
        self.gathers.finish(fetch)

    def _abandon_gather(self, unit: Unit, fetch: Fetch) -> None:
        """A ZeRO-3 gather failed at its issue: the fetch is no longer the unit's."""
        with self._lock:
            if self.slots[unit.index].fetch is fetch:
                self.slots[unit.index].fetch = None
        self._drop(unit, fetch, wasted=False)

    def _drop(self, unit: Unit, fetch: Fetch, wasted: bool = True) -> None:
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

    @owned(UPDATER)
    def out_buffer(self, unit: Unit) -> torch.Tensor:
        """Where the optimizer writes this rank's new low-precision shard (shard_numel elements): the
        home when it is memory on the optimizer's side, not a ZeRO-1/2 full flat (the gather fills it)."""
        home = self.slots[unit.index].home.view()
        if home is not None and home.device.type == self.out_device.type and (
                unit.part.replicated or self.sharding.gathered(unit)):
            return home
        return self.staged_out(unit)

    @owned(UPDATER)
    def device_out(self, unit: Unit) -> "torch.Tensor | None":
        """Where an update running on the device writes this rank's new shard ([Note: device staging] in
        optim/device_staging.py): the home itself where it is device memory holding exactly that shard
        (a replicated unit, or ZeRO-3's own shard), so nothing goes through the host and back; None
        elsewhere (the update writes out_buffer(unit)). commit() then has nothing to send."""
        slot = self.slots[unit.index]
        home = slot.home.view() if slot.home.on_device else None
        if home is None or not (unit.part.replicated or self.sharding.gathered(unit)):
            return None
        slot.written_in_place = True
        return home

    @owned(UPDATER)
    def staged_out(self, unit: Unit) -> torch.Tensor:
        """out_buffer for a speculated update ([Note: speculative step] in overlap/speculative.py): always a
        write-back buffer, never the home, so the new parameters are not seen before commit()."""
        slot = self.slots[unit.index]
        if slot.out is None:
            gathered = not unit.part.replicated and not self.sharding.gathered(unit)
            slot.out = self._temp(unit.shard_numel, self.out_on_device,
                                  self.out_tiers if gathered else None)  # [Note: write-back buffers of a gather]
        return tensor_of(slot.out)

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
        if out is not None:
            self._give_back(out)

    def _give_back(self, out, after=None) -> None:
        """A write-back temporary to its tier (a pool block behind `after`, the ticket reading it)."""
        if isinstance(out, torch.Tensor):
            self.device_tier.free(out)  # on CUDA record_stream keeps it until a copy reading it ran
        else:
            self.host_pool.free(out, after=after)

    @owned(UPDATER)
    def commit(self, unit: Unit) -> None:
        """The optimizer wrote out_buffer(unit): bump the version and send the bytes home (async)."""
        i, slot = unit.index, self.slots[unit.index]
        home = slot.home
        slot.version += 1
        if slot.written_in_place:  # device_out(): the update wrote the home where it is
            slot.written_in_place = False
            return
        out, slot.out = slot.out, None
        nbytes = unit.shard_numel * self.lp_dtype.itemsize
        src = "host" if self.out_device.type == "cpu" else "device"
        prof = self.profiler
        token = prof.begin(unit.param_key, "param", src, home.name, nbytes, "param-copyback") \
            if prof is not None and src != home.name else None
        if src != home.name and home.on_device:
            self.device_tier.count_in(nbytes)
        ticket = None
        if out is None:
            pass  # the optimizer wrote the home in place
        elif not unit.part.replicated and not self.sharding.gathered(unit):
            self._gather_commit(unit, out)
        else:
            ticket = home.write_from(out)
            if home.checked_at_read:  # the next fetch checks it ([Note: a failed write-back])
                self._give_back(out, after=ticket)
                self.writes.track(i, ticket)
            else:  # a copy into memory: compute joins it at the end of the step
                if ticket is not None:
                    self._joins.append(ticket)
                self._keep.append((out, ticket))
        if token is not None:
            prof.end(token, copy=None if home.checked_at_read else ticket)

    def _gather_commit(self, unit: Unit, out) -> None:
        """ZeRO-1/2: all-gather every rank's new shard into the full flat at home ([Note: a gather's write-back])."""
        i, home, shard = unit.index, self.slots[unit.index].home, tensor_of(out)
        self._keep.append((out, None))
        target, done, full = home.view(), None, []
        if target is None:  # a file: into a pool block taken when the gather lands (params_writes.py)
            def land():
                self.writes.make_room(i)
                full.append(self.host_pool.alloc(unit.numel * self.lp_dtype.itemsize, self.lp_dtype, unit.param_key))
                return full[0].tensor

            def write(_flat):
                ticket = home.write_from(full[0])
                self.host_pool.free(full[0], after=ticket)
                self.writes.record(i, ticket)
            target, done = land, write
        where = "cpu" if callable(target) else target.device.type
        if shard.device.type != where:  # gather where the target lives
            moved = self._temp(shard.numel(), on_device=where != "cpu")
            copy = self.device_tier.copy_h2d if where != "cpu" else self.device_tier.copy_d2h
            copy(tensor_of(moved), shard).wait()
            self._keep.append((moved, None))
            shard = tensor_of(moved)
        self.sharding.gather_params(unit, shard, target, done)

    def _temp(self, numel: int, on_device: bool, tiers: tuple | None = None):
        """A write-back temporary: a budgeted tensor on the device tier, else a host-pool block, from
        `tiers` (device tier, host pool; default the parameters' own)."""
        device_tier, host_pool = tiers or (self.device_tier, self.host_pool)
        if not on_device:
            return host_pool.alloc(numel * self.lp_dtype.itemsize, self.lp_dtype, "param write-back")
        return device_tier.alloc((numel,), self.lp_dtype, "param write-back")

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
            self._give_back(out, after=ticket)

    def _rewrite_home(self, unit: Unit) -> None:
        """[Note: a failed write-back] Write the unit's home again from the fp32 master."""
        slot = self.slots[unit.index]
        refuse_rewrite(unit, slot.home.name, slot.failed_write, rebuildable=self.master_of is not None and (
            unit.part.replicated or self.sharding.gathered(unit)))
        master = self.master_of(unit)  # first: it may refuse (a delayed update holds the write-back state)
        self.out_buffer(unit).copy_(master)
        self.commit(unit)
        self.writes.check([unit.index])  # landed: no longer stale; the drive still refuses: its error again

    @owned(COMPUTE)
    def synchronize(self) -> None:
        """Finish all parameter work in flight: unconsumed prefetches, gathers, NVMe write-backs."""
        self.drop_inflight()
        self.finish_commits()
        self.writes.check(self.writes.pending())

    # ------------------------------------------------------------------ access

    def load(self, unit: Unit, lp_source: torch.Tensor) -> None:
        """Replace this rank's shard with `lp_source` (e.g. a checkpoint's fp32 master shard)."""
        self.out_buffer(unit).copy_(lp_source)
        self.commit(unit)

    def close(self) -> None:
        self._workers.shutdown(wait=True)
        self.writes.close()

