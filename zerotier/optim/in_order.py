"""Units of one optimizer step handed on in unit order while device updates are in flight
([Note: the asynchronous device step] in offload.py).

The optimizer thread updates a CPU unit before it returns to the loop, while a device unit's
update is only issued (copies and kernel on the device's streams) and finishes later. `InOrder`
holds each unit until every unit before it is finished, so the units leave `step()` (and are
committed by the parameter store, marked stepped by the gradient store) in the order they were
taken up, as when every update finished in its turn. A device update in flight is an `InFlight`:
its D2H tickets, and what retiring it does once they are done (an NVMe home's write-back).
"""
from __future__ import annotations

import collections
from typing import Callable, Iterator

from ..state import Unit


class InFlight:
    """A device update issued and not yet retired: `tickets` (its copies out), `retire()` after them."""

    def __init__(self, tickets: list, on_done: "Callable[[], None] | None" = None,
                 on_failed: "Callable[[], None] | None" = None):
        self.tickets, self._on_done, self._on_failed = tickets, on_done, on_failed

    def done(self) -> bool:
        return all(t.done() for t in self.tickets)

    def retire(self) -> None:
        """Wait for the copies out, then do what follows them (an NVMe write-back); an error is raised
        after every copy ended, with `on_failed` run instead."""
        first = None
        for t in self.tickets:
            try:
                t.wait()
            except BaseException as exc:  # noqa: BLE001 - raised below, after the rest landed
                first = first or exc
        if first is not None:
            self.abandon()
            raise first
        if self._on_done is not None:
            self._on_done()

    def abandon(self) -> None:
        """The step failed: wait for the copies out (their errors dropped), then undo what the update
        holds (an NVMe staging set's ranges)."""
        for t in self.tickets:
            try:
                t.wait()
            except BaseException:  # noqa: BLE001 - the step's first error is the one raised
                pass
        if self._on_failed is not None:
            self._on_failed()


class InOrder:
    """The units of one step, handed on in the order they were added (see the module docstring)."""

    def __init__(self) -> None:
        self._queue: collections.deque[tuple[Unit, InFlight | None]] = collections.deque()
        self.in_flight = 0  # device updates added and not retired

    def add(self, unit: Unit, update: InFlight | None = None) -> None:
        """`unit` is updated (`update` None) or its device update is issued (`update`)."""
        self._queue.append((unit, update))
        self.in_flight += update is not None

    def settle(self, wait: int = 0) -> Iterator[Unit]:
        """Hand on the leading units whose updates are finished, retiring device updates on the way:
        the oldest `wait` device updates in flight are waited for, the others only taken when done."""
        while self._queue:
            unit, update = self._queue[0]
            if update is not None:
                if wait > 0:
                    wait -= 1
                elif not update.done():
                    return
                self._queue.popleft()
                self.in_flight -= 1
                update.retire()
            else:
                self._queue.popleft()
            yield unit

    def settle_all(self) -> Iterator[Unit]:
        """Every unit, every device update waited for."""
        return self.settle(wait=self.in_flight)

    def abandon(self) -> None:
        """The step failed: every device update in flight is abandoned (InFlight.abandon), nothing handed on."""
        queue, self._queue = self._queue, collections.deque()
        self.in_flight = 0
        for _, update in queue:
            if update is not None:
                update.abandon()
