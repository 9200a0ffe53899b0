"""Gradient shards staged into host memory for a CPU update rule.

[Note: device gradients, host optimizer]
A CPU optimizer reading gradients that live on the GPU does not copy them with a
blocking `.to("cpu")` per unit (a device sync each): `StagedGrads` copies each unit's
shard on the device tier's d2h stream into a host-pool block one unit ahead, so the
next unit's copy runs under this unit's update, and the update waits on that copy's event
only. Gradients on NVMe (`grad_of` returns a `grads_nvme.GradFile`: [Note: gradients on
NVMe] in grads_nvme.py) are read the same way, by the gradient store into the block
(`read_into`), whatever the optimizer's tier. At most two staging blocks are alive
(`StagedGrads.staging_bytes`, counted by the planner). A unit updated on the device copies its
block H2D and the optimizer thread does not wait for that copy ([Note: the asynchronous device
step] in offload.py): `read_by(unit, ticket)` names it, and the block is given back only once that
copy is done (waited when the next unit is asked for: by then it has normally run), so the next
read into the block cannot overwrite bytes the copy has not read yet.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from ..state import Unit
from .profiled_io import Profiled


class StagedGrads:
    """grad_of for an optimizer over device gradients or NVMe gradient files ([Note: device gradients,
    host optimizer]): called for the units in `order`, returns each one's shard in a host-pool block,
    the copy or read of the next unit already issued. A block is freed when the next unit is asked
    for, or at close()."""

    @staticmethod
    def staging_bytes(largest_shard: int, grad_itemsize: int) -> int:
        """Host-pool bytes of [Note: device gradients, host optimizer]: two gradient shards."""
        return 2 * largest_shard * grad_itemsize

    def __init__(self, order: list[Unit], grad_of: Callable[[Unit], object], device_tier,
                 host_pool, profiler=None):
        self._next = {a.index: b for a, b in zip(order, order[1:])}
        self._grad_of, self._device_tier, self._host_pool = grad_of, device_tier, host_pool
        self._profiler = profiler
        self._staged: dict[int, tuple] = {}  # unit index -> (pool block, copy or read ticket)
        self._readers: dict[int, object] = {}  # unit index -> the device copy reading its block (read_by)
        self._current: int | None = None

    def _issue(self, unit: Unit) -> None:
        if unit.index in self._staged:
            return
        grad = self._grad_of(unit)
        on_nvme = not isinstance(grad, torch.Tensor)  # a grads_nvme.GradFile: the gradient store reads it
        nbytes = grad.numel * grad.dtype.itemsize if on_nvme else grad.numel() * grad.element_size()
        block = self._host_pool.alloc(nbytes, grad.dtype, f"{unit.key}.grad staging")
        try:
            if on_nvme:
                start = time.perf_counter_ns()
                ticket = grad.read_into(block)
                if self._profiler is not None:
                    ticket = Profiled(ticket, grad.key, "grad", "nvme", "host", nbytes, "optimizer-read", start)
            else:
                ticket = self._device_tier.copy_d2h(block.tensor, grad)
        except BaseException:
            self._host_pool.free(block)
            raise
        self._staged[unit.index] = (block, ticket)

    def __call__(self, unit: Unit) -> torch.Tensor:
        if self._current is not None:  # the previous unit's update is done with its block
            self._give_back(self._current)
        self._issue(unit)
        nxt = self._next.get(unit.index)
        if nxt is not None:
            self._issue(nxt)  # overlaps this unit's Adam
        self._current = unit.index
        block, ticket = self._staged[unit.index]
        ticket.wait()
        if isinstance(ticket, Profiled):
            ticket.record(self._profiler)
        return block.tensor

    def read_by(self, unit: Unit, ticket) -> None:
        """A device copy reads `unit`'s block: the block is kept until `ticket` is done."""
        self._readers[unit.index] = ticket

    def _give_back(self, index: int) -> None:
        block = self._staged.pop(index)[0]
        reader = self._readers.pop(index, None)
        try:
            if reader is not None:
                reader.wait()
        finally:
            self._host_pool.free(block)

    def close(self) -> None:
        """Wait for the copies and reads still in flight and give their blocks back; an error of one
        no unit asked for is dropped (the next step reads afresh)."""
        for index, (block, ticket) in self._staged.items():
            for waited in (ticket, self._readers.get(index)):
                try:
                    if waited is not None:
                        waited.wait()
                except Exception:  # noqa: BLE001 - see the docstring
                    pass
            self._host_pool.free(block)
        self._staged.clear()
        self._readers.clear()
