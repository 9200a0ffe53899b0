"""A live, list-like view of one field across a store's per-unit slots.

Each store keeps one slot object per unit (`params.ParamSlot`, `grads.GradSlot`, ...).
`state.transition(states, index, ...)` and a few readers outside the stores take the
per-unit states as a list: a `SlotField` is that list, read and written through the
slots, so there is one copy of each unit's state.
"""
from __future__ import annotations

from typing import Any, Iterator, Sequence


class SlotField(Sequence):
    """`slots[i].<name>` for every i, as a sequence. Writes (`view[i] = x`) go to the slot:
    `transition()` uses them; nothing outside the store that owns the slots should."""

    __slots__ = ("_slots", "_name")

    def __init__(self, slots: list, name: str):
        self._slots, self._name = slots, name

    def __getitem__(self, index: int) -> Any:
        return getattr(self._slots[index], self._name)

    def __setitem__(self, index: int, value: Any) -> None:
        setattr(self._slots[index], self._name, value)

    def __len__(self) -> int:
        return len(self._slots)

    def __iter__(self) -> Iterator[Any]:
        name = self._name
        return (getattr(slot, name) for slot in self._slots)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None  # a live view: equal to a list while the values are

    def __repr__(self) -> str:
        return f"SlotField({self._name}: {list(self)!r})"
