"""The optimizer's state store: where each unit's optimizer state lives and how it moves.

One `OptSlot` per unit holds the unit's home per state key (one per key of the update rule,
optim/rules/, in the layout of [Note: optimizer state layout]: a `Home` of the unit's tier,
tiers/homes.py: a device tensor, a host-pool block or an NVMe file) and its parameters' step counts. The store
places a unit's initial state, hands the update its buffers (in place on host and device, through
the pipeline below for NVMe), reads and writes state for checkpoints and state dicts, and iterates
it for checkpoints. It knows no update rule: the driver (offload.py) runs the rule on what it
hands out.

[Note: NVMe optimizer pipeline]
NVMe-resident state goes through `optimizer.pipeline_depth` staging sets (one block per state
key: exact-size pinned aligned host-pool blocks, so every read and write is zero-copy whatever
the unit's size). A unit takes ranges of a set, not the whole set ([Note: packed staging sets] in
staging_sets.py: beside a large unit a set holds several small ones), busy from its read until
its write-back completes. While the update runs on one unit, the reads of the next `depth - 2`
units are in flight and earlier units' writes drain; a read that finds no room waits for the
oldest writes until it fits. During the last backward of a window the engine calls
`prefetch(unit)` as each unit's gradient becomes final: its state reads start then (they do not
depend on the global gradient norm), in room that is free without waiting, so with clipping on
only the update math, the reads that found no room and the last writes remain after backward. Without clipping the engine updates each unit on its optimizer thread as soon as its
gradient is final (`step(..., drain=False)`): the unit's writes stay in flight while the next
unit is read, and `finish()` waits for them when engine.step() begins. Either way the step's
writes are waited before it returns: an I/O error surfaces in the step that caused it. Whatever
fails (a read, the update, a write refused at submit, as a full drive's fallocate refuses it),
its ranges come back once its issued I/O has ended, so no failure leaves a staging set's ranges
taken for good, and none hands them to another unit while a transfer still uses them (a Ctrl-C
that lands in a wait is held until that transfer is done, then raised: `_wait`).

[Note: the last final unit's read]
The unit whose gradient is final last in a backward (the root unit, whose embedding is the first
thing the forward reads) had its state read start as the backward ended, so all of it lay on
engine.step()'s critical path: on bench_planner's gpt2, 464 MB of 975, read before the root's
update and the writes behind it. Its state does not change until the step updates it, so at the
first `prefetch` of a window (the first unit final in its last backward) the store also starts the
read of the unit that was final last in the previous window, if it fits: it then runs under the
backward. A hint only: a window whose first unit was not final in the previous one learns nothing,
and a read nobody consumes this step stays valid for the unit's next update (every change of the
state consumes or drops the reads ahead: staged, write_state, rewind, drop_prefetched).

[Note: units on different tiers]
With an optimizer split (planner/sizes.py [Note: optimizer split]) each unit's state lives on its own
tier, `slots[unit.index].kind`: host units keep their state in pool blocks, NVMe units go through
the pipeline above, whose staging sets are sized to the largest NVMe unit. A step takes the units
in the same order (reads issued during backward first); a host unit's update runs while the
reads of the next NVMe units are in flight.
"""
from __future__ import annotations

import collections
import contextlib
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ..errors import ConfigError
from ..io import aligned_empty
from ..state import Location, Unit
from ..threads import UPDATER, owned
from ..tiers.homes import HOMES, Home, HostBytes, Tiers
from .profiled_io import Profiled
from .staging_sets import Lease, StagingSets
from .state_layout import StateLayout
from .state_terms import OptStateSizing


@dataclass
class OptSlot:
    """One unit's optimizer state: `homes` maps each state key to where its bytes live, a home of
    class `kind` ([Note: homes] in tiers/homes.py) holding `layout.nbytes(key, shard)` uint8 bytes
    (reserved by place())."""

    unit: Unit
    kind: type[Home]
    homes: dict[str, Home] = field(default_factory=dict)
    steps: list[int] = field(default_factory=list)  # optimizer steps applied per parameter (torch's `step`)
    layout: StateLayout | None = None  # the store's layout for this unit's shard (for_unit), fixed at placement

    def views(self) -> dict[str, torch.Tensor]:
        """The state buffers of an in-memory home (key -> its bytes), updated in place."""
        return {k: home.view() for k, home in self.homes.items()}


class OptStateStore(OptStateSizing):
    """Every unit's optimizer state, wherever it lives (see the module docstring)."""

    def __init__(self, units: list[Unit], locs: list[Location], layout: StateLayout, device_tier, host_pool, nvme,
                 depth: int, profiler=None):
        """locs: each unit's tier by unit index ([Note: units on different tiers]; a split spans host
        and NVMe only). layout: the state's keys and dtypes ([Note: optimizer state layout])."""
        if len(locs) != len(units) or (any(HOMES[at].on_device for at in locs) and len(set(locs)) > 1):
            raise ConfigError(f"optimizer state placement {[at.value for at in locs]} for {len(units)} "
                              "units: give one tier per unit, a split over host and nvme only")
        self.units, self.layout, self.depth, self.profiler = units, layout, depth, profiler
        self.device_tier, self.host_pool, self.nvme = device_tier, host_pool, nvme
        self.tiers = Tiers(device_tier, host_pool, nvme)
        self.slots = [OptSlot(u, HOMES[at], {}, [0] * len(u.params), layout.for_unit(u)) for u, at in zip(units, locs)]
        self._nvme_units = [u for u in units if not self.slots[u.index].kind.in_memory]  # through the pipeline
        # [Note: NVMe optimizer pipeline]
        self._host_staging: StagingSets | None = None  # made at the first NVMe step ([Note: packed staging sets])
        self._writing: collections.deque[tuple[Lease, list]] = collections.deque()  # (its ranges, write tickets)
        self._reads: dict[int, tuple[Lease, list]] = {}   # unit index -> (its ranges, read tickets), in issue order
        self._finals: list[int] = []          # NVMe units prefetched as final in this window, in order
        self._held: dict[int, Lease] = {}     # take_staged's leases, by unit index, until written or dropped
        self._last_final: int | None = None   # the last of them in the previous window ([Note: the last final unit's read])
        # [Note: initial NVMe writes] Initialization keeps the writes of up to `depth` units in flight
        # (their master blocks + one shared zeros block: within the staging the planner counts,
        # depth x the state's bytes of the largest shard), so the drive's queue stays full while the
        # next units are materialized and cast.
        self._placing: collections.deque = collections.deque()  # (master block, write tickets), oldest first
        self._zeros = None  # host-pool block of zeros, the largest moment's size: every unit's initial moments

    @property
    def locs(self) -> list[Location]:
        """Each unit's tier, by unit index."""
        return [slot.kind.location for slot in self.slots]

    @property
    def steps(self) -> list[list[int]]:
        """Each unit's per-parameter step counts, by unit index (the slots' lists, mutable)."""
        return [slot.steps for slot in self.slots]

    @property
    def has_nvme(self) -> bool:
        return bool(self._nvme_units)

    def on_nvme(self, unit: Unit) -> bool:
        """The unit's state is in files: its update goes through the pipeline's staging sets."""
        return not self.slots[unit.index].kind.in_memory

    # ------------------------------------------------------------------ place

    @owned(UPDATER)
    def place(self, unit: Unit, master: torch.Tensor) -> None:
        """Put the fp32 master of this rank's shard (a CPU tensor) and zero moments on the tier, in
        the state's layout (a bf16 master: rounded to nearest).
        [Note: initial NVMe writes] NVMe: the writes are left in flight; finish_place() waits."""
        n, slot = unit.shard_numel, self.slots[unit.index]
        layout = self.slots[unit.index].layout  # [Note: small parameters keep fp32 moments]
        slot.homes = {k: slot.kind.reserve(f"{unit.key}.{k}", layout.nbytes(k, n), torch.uint8, self.tiers)
                      for k in layout.keys}
        if not slot.kind.in_memory:
            moment_bytes = max(layout.nbytes(k, n) for k in layout.moment_keys)
            if self._zeros is None or self._zeros.tensor.numel() < moment_bytes:
                self._finish_placing(0)  # writes in flight read the old zeros block
                if self._zeros is not None:
                    self.host_pool.free(self._zeros)
                largest = max(self.slots[u.index].layout.nbytes(k, u.shard_numel) for u in self._nvme_units
                              for k in self.layout.moment_keys)
                self._zeros = self.host_pool.alloc(largest, torch.uint8, "optimizer.zeros")
                self._zeros.tensor.zero_()
            block = self.host_pool.alloc(layout.nbytes("master", n), torch.uint8, f"{unit.key}.master")
            layout.encode("master", master, block.tensor)
            zeros = self._zeros.tensor  # aligned, with the room of the largest shard after each moment
            self._placing.append((block, [home.write_from(block if k == "master" else HostBytes(zeros[: home.numel]))
                                          for k, home in slot.homes.items()]))
            self._finish_placing(self.depth)
            return
        for key, raw in slot.views().items():
            layout.encode(key, master, raw) if key == "master" else raw.zero_()

    @owned(UPDATER)
    def finish_place(self) -> None:
        """Wait for the initial NVMe writes still in flight; free their blocks."""
        self._finish_placing(0)
        if self._zeros is not None:
            self.host_pool.free(self._zeros)
            self._zeros = None

    def _finish_placing(self, keep: int) -> None:
        """[Note: initial NVMe writes] Wait for the oldest units' writes until `keep` are in flight."""
        while len(self._placing) > keep:
            block, tickets = self._placing.popleft()
            try:
                self._wait(tickets)
            finally:
                self.host_pool.free(block)

    # ------------------------------------------------------------------ what an update uses

    def live_state(self, unit: Unit) -> dict:
        """A host- or device-resident unit's state buffers (key -> tensor), updated in place."""
        return self.slots[unit.index].views()

    def read_order(self, units: list[Unit]) -> list[Unit]:
        """`units` with those whose NVMe reads started (during backward) first, in issue order."""
        if not self._nvme_units:
            return units
        issued = list(self._reads)
        return sorted(units, key=lambda u: issued.index(u.index) if u.index in self._reads
                      else len(issued) + u.index)

    @owned(UPDATER)
    def read_ahead(self, units: list[Unit], block: bool) -> None:
        """Issue the NVMe reads of `units` not yet issued; `block`: wait for a set if none is free
        (False before a host unit's update: only free sets)."""
        for unit in units:
            if unit.index not in self._reads:
                self._issue_read(unit, block)

    @owned(UPDATER)
    def prefetch(self, unit: Unit) -> None:
        """NVMe state: start reading `unit`'s state now if there is room (never waits); at the first
        unit of a window, the state of the unit final last in the previous one too ([Note: the last
        final unit's read])."""
        if not self.on_nvme(unit):
            return
        if unit.index in self._finals:  # each unit is final once a window: the next window's first
            self._last_final, self._finals = self._finals[-1], []
        self._finals.append(unit.index)
        ahead = self._last_final if len(self._finals) == 1 else None
        for index in (unit.index, ahead):
            if index is not None and index not in self._reads:
                self._issue_read(self.slots[index].unit, block=False)

    @contextlib.contextmanager
    def staged(self, unit: Unit) -> Iterator[dict]:
        """An NVMe unit's state buffers (its read waited for) for the update inside the block; its
        write-back is issued after it, left in flight ([Note: NVMe optimizer pipeline])."""
        bufs = self.take_staged(unit)
        try:
            yield bufs
        except BaseException:
            self.drop_staged(unit)
            raise
        self.write_staged(unit)

    def read_issued(self, unit: Unit) -> bool:
        """The unit's NVMe read is issued (take_staged will not need a set)."""
        return unit.index in self._reads

    @owned(UPDATER)
    def take_staged(self, unit: Unit) -> dict:
        """`staged`'s first half, for an update that outlives one call (the asynchronous device step:
        [Note: the asynchronous device step] in offload.py): the unit's state buffers once its read
        landed; the unit holds its ranges until write_staged or drop_staged."""
        lease, tickets = self._reads.pop(unit.index)
        try:
            self._wait(tickets)
        except BaseException:
            self._host_staging.give_back(lease)  # [Note: NVMe optimizer pipeline]: the set comes back
            raise
        self._held[unit.index] = lease
        return lease.views

    @owned(UPDATER)
    def write_staged(self, unit: Unit) -> None:
        """The update of take_staged's buffers is done: issue their write-back, left in flight."""
        lease = self._held.pop(unit.index)
        try:
            writes = self._io(unit, lease.views, "optimizer-write")
        except BaseException:
            self._host_staging.give_back(lease)
            raise
        self._writing.append((lease, writes))

    @owned(UPDATER)
    def drop_staged(self, unit: Unit) -> None:
        """The update of take_staged's buffers failed: their ranges come back, nothing is written."""
        self._host_staging.give_back(self._held.pop(unit.index))

    @owned(UPDATER)
    def finish(self) -> None:
        """Wait for the NVMe write-backs still in flight; raise the first error."""
        self._drain_writes()

    @owned(UPDATER)
    def rewind(self, kept: "dict[int, tuple[list, list[int]]]") -> int:
        """Put units' state back as an undo log kept it ([Note: speculative step] in
        overlap/speculative.py): `kept` maps a unit index to (its homes' Undo records, from
        Home.undoable; the parameters' step counts). NVMe writes in flight are waited (their files
        are the discarded set: a write error there is dropped with them). Returns the bytes copied back."""
        try:
            self._drain_writes()
        except Exception:  # noqa: BLE001 - the discarded files' writes: nothing reads them
            pass
        self.drop_prefetched()
        moved = 0
        for index, (undos, steps) in kept.items():
            moved += sum(undo.restore() for undo in undos)
            self.slots[index].steps = steps
        return moved

    # ------------------------------------------------------------------ NVMe pipeline

    def _lease(self, unit: Unit, block: bool) -> Lease | None:
        """Ranges of the staging sets for `unit`'s state ([Note: packed staging sets]). `block`: wait for
        the oldest write-backs until they fit (unless none is left in flight: then None)."""
        if self._host_staging is None:  # each key's block: the largest NVMe unit's (the planner's staging_bytes)
            keys = self.layout.keys
            largest = self.staging_set(tuple(self.slots[u.index].layout.nbytes(k, u.shard_numel) for k in keys)
                                       for u in self._nvme_units)
            self._host_staging = StagingSets(self.host_pool, dict(zip(keys, largest)), self.depth)
        while self._writing and all(t.done() for t in self._writing[0][1]):
            self._retire_write()
        layout = self.slots[unit.index].layout
        nbytes = {k: layout.nbytes(k, unit.shard_numel) for k in self.layout.keys}
        while True:
            lease = self._host_staging.take(nbytes)
            if lease is not None or not block or not self._writing:
                return lease
            self._retire_write()  # the oldest write-back must land before its ranges are reused

    def _retire_write(self) -> None:
        """The oldest write-back waited, then its ranges given back (also when it failed: its
        tickets are all done once _wait ends)."""
        lease, tickets = self._writing.popleft()
        try:
            self._wait(tickets)
        finally:
            self._host_staging.give_back(lease)

    def _issue_read(self, unit: Unit, block: bool) -> None:
        lease = self._lease(unit, block)
        if lease is None:
            return
        try:
            self._reads[unit.index] = (lease, self._io(unit, lease.views, "optimizer-read"))
        except BaseException:
            self._host_staging.give_back(lease)
            raise

    def _io(self, unit: Unit, bufs: dict, reason: str) -> list:
        """Submit reads or writes of a unit's state buffers (the staging set's blocks: padded);
        tickets carry profiler info."""
        read = reason == "optimizer-read"
        homes = self.slots[unit.index].homes
        tickets = []
        try:
            for k in self.layout.keys:
                tickets.append(homes[k].read_into(HostBytes(bufs[k], padded=True)) if read
                               else homes[k].write_from(HostBytes(bufs[k])))
        except BaseException:  # refused at submit (a full drive's fallocate): the set's I/O ends first
            try:
                self._wait(tickets)
            except BaseException:  # noqa: BLE001 - the submit's error is the one raised
                pass
            raise
        if self.profiler is None:
            return tickets
        start = time.perf_counter_ns()
        src, dst = ("nvme", "host") if read else ("host", "nvme")
        layout = self.slots[unit.index].layout
        return [Profiled(t, f"{unit.key}.{k}", k, src, dst, layout.nbytes(k, unit.shard_numel), reason, start)
                for t, k in zip(tickets, self.layout.keys)]

    def _wait(self, tickets: list) -> None:
        """Wait for every ticket (even after a failure), then raise the first error. A Ctrl-C is
        held until its ticket is done, as every other error ends with it ([Note: NVMe optimizer
        pipeline]: the caller gives the buffers back once this ends, and I/O may not still use them)."""
        prof = self.profiler
        prof = prof if tickets and isinstance(tickets[0], Profiled) else None  # place(): plain store tickets
        token = prof.wait_begin(tickets[0].name) if prof is not None else None
        first = None
        for t in tickets:
            while True:
                try:
                    t.wait()
                except KeyboardInterrupt as exc:  # the I/O goes on: wait for it again
                    first = first or exc
                    continue
                except BaseException as exc:  # noqa: BLE001 - re-raised below, after the rest landed
                    first = first or exc
                break
            if prof is not None:
                t.record(prof)
        if token is not None:
            prof.wait_end(token)
        if first is not None:
            raise first

    def _drain_writes(self) -> None:
        first = None
        while self._writing:
            try:
                self._retire_write()
            except BaseException as exc:  # noqa: BLE001
                first = first or exc
        if first is not None:
            raise first

    @owned(UPDATER)
    def drop_prefetched(self) -> None:
        """Forget state reads issued ahead (before the state is replaced, when a step is skipped
        or failed). Their errors are dropped with them: the next read of the unit is issued
        afresh and reports whatever still fails (hostile trial #24)."""
        reads, self._reads = self._reads, {}
        for lease, tickets in reads.values():
            try:
                self._wait(tickets)
            except Exception:  # noqa: BLE001 - see the docstring
                pass
            finally:
                self._host_staging.give_back(lease)

    # ------------------------------------------------------------------ access

    def read_state(self, unit: Unit, keys: tuple[str, ...] | None = None,
                   encoded: bool = False) -> dict[str, torch.Tensor]:
        """fp32 `keys` (default: every key of the rule: master, then its moments) of a unit's shard:
        the live tensors for fp32 state on host or device, else fp32 copies on the CPU (decoded:
        [Note: optimizer state layout]). With `encoded`: CPU copies of the layout's own buffers
        (what write_state(encoded=True) takes)."""
        n, layout = unit.shard_numel, self.slots[unit.index].layout
        keys = layout.keys if keys is None else keys
        slot = self.slots[unit.index]
        if slot.kind.in_memory:
            raw = slot.views()
            if encoded:
                return {k: raw[k][: layout.nbytes(k, n)].to("cpu", copy=True) for k in keys}
            if layout.exact:
                return {k: layout.typed(k, raw[k], n)[0] for k in keys}
            return {k: layout.decode(k, raw[k].cpu(), n) for k in keys}
        out = {}
        for k in keys:
            raw = torch.empty(layout.nbytes(k, n), dtype=torch.uint8)
            slot.homes[k].read_into(HostBytes(raw)).wait()
            out[k] = raw if encoded else layout.typed(k, raw, n)[0] if layout.exact else layout.decode(k, raw, n)
        return out

    def iter_state(self, units: list[Unit], alignment: int) -> Iterator[tuple[Unit, dict[str, torch.Tensor]]]:
        """Each unit's state buffers as they are stored ([Note: optimizer state layout]: uint8,
        `layout.nbytes(key, shard_numel)` each) in aligned CPU memory (storage padded to `alignment`
        bytes: [Note: checkpoint streaming] in checkpoint.py), the next unit's NVMe reads already in
        flight; reads still in flight are waited for if the caller stops early. Host-resident state
        is yielded as it lives in its pool blocks (aligned and padded already: no copy); the caller
        may write only the padding."""
        def issue(unit: Unit):
            n, slot = unit.shard_numel, self.slots[unit.index]
            layout = slot.layout
            padded = {k: home.padded_view() for k, home in slot.homes.items()}
            if all(view is not None for view in padded.values()):
                return padded, []
            bufs = {k: aligned_empty(layout.nbytes(k, n), alignment)[: layout.nbytes(k, n)] for k in layout.keys}
            return bufs, [slot.homes[k].read_into(HostBytes(bufs[k], padded=True)) for k in layout.keys]

        ahead: collections.deque = collections.deque()
        try:
            for j, unit in enumerate(units):
                if not ahead:
                    ahead.append(issue(unit))
                if j + 1 < len(units):
                    ahead.append(issue(units[j + 1]))
                bufs, tickets = ahead.popleft()
                self._wait(tickets)
                yield unit, bufs
        finally:
            for _bufs, tickets in ahead:  # the engine must not write into memory we drop
                try:
                    self._wait(tickets)
                except Exception:  # noqa: BLE001 - the caller is already leaving with its own error
                    pass

    @owned(UPDATER)
    def write_state(self, unit: Unit, state: dict[str, torch.Tensor], steps: "int | list[int]",
                    encoded: bool = False) -> None:
        """Replace the state tensors in `state` (any of the rule's keys) of a unit and its
        parameters' step counts (one int: all of them), wherever they live; the keys not in
        `state` are kept. The tensors are fp32 CPU tensors of the shard's size, stored in the
        layout's dtypes (round to nearest, int8 re-blocked), or with `encoded` the layout's own
        buffers (`layout.nbytes(key, n)` uint8 each, as iter_state yields them), stored as they are."""
        unknown = set(state) - set(self.layout.keys)
        if unknown:
            raise ValueError(f"write_state: unknown state keys {sorted(unknown)} (known: {self.layout.keys})")
        self.drop_prefetched()
        slot = self.slots[unit.index]
        slot.steps = [steps] * len(unit.params) if isinstance(steps, int) else list(steps)
        n, layout = unit.shard_numel, self.slots[unit.index].layout
        for k in (k for k in self.layout.keys if k in state):
            live = slot.homes[k].view()
            if encoded:
                raw = state[k].contiguous()
                if raw.dtype != torch.uint8 or raw.numel() != layout.nbytes(k, n):
                    raise ValueError(f"write_state(encoded=True): {k} must be {layout.nbytes(k, n)} uint8 "
                                     f"bytes, got {raw.numel()} {raw.dtype}")
                if live is not None:
                    live.copy_(raw)
            elif live is not None:
                layout.encode(k, state[k], live)
            else:
                raw = torch.empty(layout.nbytes(k, n), dtype=torch.uint8)
                layout.encode(k, state[k], raw)
            if live is None:
                slot.homes[k].write_from(HostBytes(raw)).wait()

    def close(self) -> None:
        """Finish NVMe I/O in flight and give the staging sets back (the state stays readable). Idempotent."""
        try:
            self.drop_prefetched()
            self._drain_writes()
        except Exception:  # noqa: BLE001 - closing: errors were reported by the step that caused them
            pass
        staging, self._host_staging = self._host_staging, None
        if staging is not None:
            staging.close()
