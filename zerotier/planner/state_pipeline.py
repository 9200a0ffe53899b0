"""The NVMe optimizer pipeline as the step model (step_model.py) sees it: which state reads find room
in the packed staging sets, and which write-backs a read waits for.

[Note: the pipeline in the schedule]
The model replays OptStateStore's decisions (optim/state_store.py, optim/staging_sets.py) while
it builds the step's graph, on bytes: each NVMe unit's `state_bytes` (per key, rounded up to
`alignment`) takes ranges of one of `pipeline_depth` sets whose blocks are the largest unit's
([Note: packed staging sets]); a set is empty again when its last unit's write-back has been
waited. `prefetch` (the backward's, never waiting) issues a read only where it fits, so the units
whose reads run under backward are those that fit by bytes, in final order, with the previous
window's last final unit read at this window's first final ([Note: the last final unit's read]).
A blocking read (step()'s, an early or speculated unit's own) waits for the oldest writes, one at
a time, until it fits: the read, and the thread that issued it, wait for those writes; with no
write left in flight a read ahead is not issued (the store's `_lease` gives None), the unit's own
read at its turn is let through (the engine would fail it: the plan's depth rules that out). The store
also gives back writes found done without waiting; the model does not (it cannot know at build
time), so a set may come back later in the model than in the engine, never earlier. A unit
without `state_bytes` takes a whole set (the model before packing).
"""
from __future__ import annotations


class PackedSets:
    """[Note: packed staging sets] (optim/staging_sets.py) as the model sees them: `depth` sets of
    per-key blocks of `capacity`; a unit takes aligned ranges, first in a set in use with room, else
    in an empty one; a set's ranges come back together when its last unit's I/O has ended."""

    def __init__(self, capacity: tuple[int, ...], depth: int):
        self.capacity = capacity
        self.fill = [[0] * len(capacity) for _ in range(depth)]
        self.users = [0] * depth

    def take(self, need: tuple[int, ...]) -> int | None:
        sets = range(len(self.users))
        for s in [s for s in sets if self.users[s]] + [s for s in sets if not self.users[s]]:
            if all(f + n <= c for f, n, c in zip(self.fill[s], need, self.capacity)):
                self.fill[s] = [f + n for f, n in zip(self.fill[s], need)]
                self.users[s] += 1
                return s
        return None

    def give_back(self, s: int | None) -> None:
        if s is None:  # a read the model let through without room (the engine would fail it)
            return
        self.users[s] -= 1
        if not self.users[s]:
            self.fill[s] = [0] * len(self.capacity)


class StatePipeline:
    """The NVMe optimizer pipeline's reads and writes as OptStateStore issues them ([Note: NVMe
    optimizer pipeline]): which reads find room, and which write-backs a read must wait for."""

    def __init__(self, g, units: list, shape, last_final: int | None):
        self.g, self.units, self.last_final = g, units, last_final
        nvme = [u for u in units if on_nvme(u, shape)]
        keys = max((len(u.state_bytes) for u in nvme), default=0)
        align = max(1, shape.alignment)
        self.need = {i: tuple(-(-b // align) * align for b in u.state_bytes) if len(u.state_bytes) == keys > 0
                     else None for i, u in enumerate(units) if on_nvme(u, shape)}
        # each key's block: the largest NVMe unit's (a unit without bytes takes a whole set)
        whole = tuple(max((n[k] for n in self.need.values() if n), default=1) for k in range(max(1, keys)))
        self.need = {i: n or whole for i, n in self.need.items()}
        self.sets = PackedSets(whole, shape.pipeline_depth)
        self.reads: dict[int, tuple[int, int]] = {}   # unit -> (set, read task), in issue order
        self.writing: list[tuple[int, int]] = []      # (set, write task), oldest first
        self.finals = 0

    def read(self, i: int, issue, block: bool, now: bool = False) -> list[int]:
        """`_issue_read`: unit i's read after `issue`, if it fits (`block`: after the oldest writes
        until it does, or until none is left: then not issued, unless `now`, the unit the thread
        updates next, whose read the model lets through without room). Returns the writes waited
        for (the issuing thread waits for them too)."""
        if i in self.reads or i not in self.need:
            return []
        waited: list[int] = []
        s = self.sets.take(self.need[i])
        while s is None and block and self.writing:
            done, write = self.writing.pop(0)
            self.sets.give_back(done)
            waited.append(write)
            s = self.sets.take(self.need[i])
        if s is not None or now:
            self.reads[i] = (s, self.g.add("optimizer_nvme", "nvme", self.units[i].state_read_s,
                                           (issue, *waited)))
        return waited

    def prefetch(self, i: int, issue) -> None:
        """`prefetch(unit)` (never waits); at the window's first, the previous window's last final too."""
        if i not in self.need:
            return
        self.finals += 1
        self.read(i, issue, block=False)
        if self.finals == 1 and self.last_final is not None:
            self.read(self.last_final, issue, block=False)

    def read_order(self, order: list[int]) -> list[int]:
        """`read_order`: the units whose reads were issued first, in issue order."""
        issued = list(self.reads)
        return [i for i in issued if i in order] + [i for i in order if i not in self.reads]

    def drain(self) -> None:
        """`finish()`: every write-back waited, its ranges back."""
        for s, _ in self.writing:
            self.sets.give_back(s)
        self.writing = []

    def drop_reads(self) -> None:
        """`drop_prefetched()`: the reads ahead forgotten, their ranges back."""
        for s, _ in self.reads.values():
            self.sets.give_back(s)
        self.reads = {}


def on_nvme(u, shape) -> bool:
    """The unit's optimizer state goes through the pipeline (a UnitWork, in a StepShape)."""
    return shape.state_on_nvme and u.trainable and bool(u.state_read_s or u.state_write_s or u.state_bytes)
