"""Parameter write-backs to homes that are files: their tickets in flight, and a failed one's recovery.

[Note: a failed write-back]
An NVMe write-back is checked when the unit is next fetched, after step() returned.
If it failed (ENOSPC, EIO), the file still holds the previous version (a rewrite
goes to a new file, renamed on success), so reading it would train on stale
weights. The unit is marked stale: the fetch raises the write's error, and every
later fetch first rewrites the file from the fp32 master (`master_of`, the truth),
raising again while the drive still refuses. ZeRO-1/2 homes hold the full flat
gathered from every rank, which one rank cannot rebuild alone: there the fetch
refuses and names load_checkpoint. So does it while a delayed update is pending
(`Delayed.master_of`): that update moves the master past the weights the file must
hold, and nothing keeps them ([Note: delayed update] in overlap/delayed.py).

[Note: a gather's write-back]
At ZeRO-1/2 over several ranks a file home is written from a pool block the unit's full flat
is gathered into (ParamStore._gather_commit). The block is taken when the gather lands, not
at commit (a bucket of every unit would hold every unit's block meanwhile), and only once at
most `max_writes - 1` writes are in flight (`make_room`): so the blocks and the second files
of the rewrites are at most `max_writes`, the largest units', as the plan counts them
(ParamStore.host_staging_bytes, `_nvme_rewrites` in planner/sizes.py). The wait runs inside
the gather's completion, which must not stop half-way (the rest of its bucket), so an older
write's error is not raised there: it stays with its unit (`failed_write`) for its next fetch.
"""
from __future__ import annotations

from .errors import ZerotierError
from .state import Unit


class WriteBacks:
    """The NVMe write-back tickets not yet checked, by unit index, oldest first, at most `max_writes`
    in flight. `slots[i].failed_write` is set when unit i's last write failed ([Note: a failed
    write-back]). `lock` is the parameter store's: a fetch on the compute thread and the
    optimizer thread's commits check the same units ([Note: thread ownership] in threads.py)."""

    def __init__(self, slots, lock, max_writes: int) -> None:
        self.slots, self._lock, self.max_writes = slots, lock, max_writes
        self.tickets: dict[int, object] = {}

    @staticmethod
    def in_flight(lookahead: int) -> int:
        """Write-backs in flight at most (`max_writes`): distinct units."""
        return lookahead + 2

    def track(self, index: int, ticket) -> None:
        """Keep a write-back's ticket; past `max_writes` in flight, wait for the oldest, so the pool
        blocks they read stay within ParamStore.host_staging_bytes however slow the drive."""
        self.check([index])  # an earlier write of the same unit (store writes are ordered)
        with self._lock:  # GPU review N15: a fetch on the compute thread pops from tickets meanwhile
            self.tickets[index] = ticket
        while True:
            with self._lock:
                oldest = next(iter(self.tickets)) if len(self.tickets) > self.max_writes else None
            if oldest is None:
                break
            self.check([oldest])

    def make_room(self, index: int) -> None:
        """[Note: a gather's write-back] Wait for unit `index`'s earlier write and for the oldest until
        fewer than `max_writes` are in flight; their errors stay with their units, raised at their fetch."""
        while True:
            with self._lock:
                oldest = next(iter(self.tickets)) if len(self.tickets) >= self.max_writes else None
                waiting = index if index in self.tickets else oldest
            if waiting is None:
                return
            try:
                self.check([waiting])
            except Exception:  # noqa: BLE001 - recorded in failed_write by check(), raised at the unit's fetch
                pass

    def record(self, index: int, ticket) -> None:
        """Keep a write-back's ticket issued after make_room(index) (a gather's completion)."""
        with self._lock:
            self.tickets[index] = ticket

    def pending(self) -> list[int]:
        with self._lock:
            return list(self.tickets)

    def check(self, indices) -> None:
        """Wait for the write-backs of these units; raise the first error (TierIOError...)."""
        first = None
        for i in indices:
            # The ticket stays in `tickets` until its outcome is recorded: a thread checking the same
            # unit meanwhile (the compute thread's fetch while the optimizer thread's track()
            # waits) waits on it too and sees its error, never an unchecked home ([Note: thread ownership])
            with self._lock:
                ticket = self.tickets.get(i)
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
            with self._lock:  # failed_write is shared like tickets: both under the lock
                if self.tickets.get(i) is ticket:
                    del self.tickets[i]
                    if outcome is None:
                        self.slots[i].failed_write = None  # a newer write-back landed
                    elif outcome is not False:
                        self.slots[i].failed_write = outcome  # [Note: a failed write-back]
        if first is not None:
            raise first

    def close(self) -> None:
        for ticket in list(self.tickets.values()):
            try:
                ticket.wait()
            except Exception:  # noqa: BLE001 - closing: the store reports nothing more
                pass
        self.tickets.clear()


def refuse_rewrite(unit: Unit, where: str, cause: BaseException, rebuildable: bool) -> None:
    """[Note: a failed write-back] Raise why the home of `unit` (on tier `where`) cannot be written
    again from its fp32 master, if it cannot: a frozen unit has none; a ZeRO-1/2 home
    (`rebuildable` False) holds every rank's shards."""
    if unit.frozen:  # [Note: frozen units]: no master; its home was the only copy
        raise ZerotierError(
            f"frozen unit '{unit.name or '<root>'}': writing its parameters to {where} failed ({cause}), "
            "so its file holds the values before that write and nothing else holds the new ones. Free the drive "
            "and build the engine again (zerotier.initialize, or from_pretrained)") from cause
    if not rebuildable:
        raise ZerotierError(
            f"unit '{unit.name or '<root>'}': writing its updated parameters to {where} failed "
            f"({cause}), so its file holds the previous step's weights, and this rank cannot rebuild them "
            "alone (ZeRO-1/2 with several ranks). Load a checkpoint (engine.load_checkpoint(root)) to "
            "continue") from cause
