"""A host- or NVMe-homed unit's optimizer state staged to the device for its update there
([Note: where the update runs] in planner/step_on.py: `Plan.optimizer_step_on`).

[Note: device staging]
A unit whose state lives on host or NVMe and whose update runs on the device keeps its home;
only its update moves. `DeviceStaging.staged(...)` takes the state's host bytes (the host home's
pool blocks, or the NVMe pipeline's staging set: pinned on CUDA, so the copies are asynchronous),
and:
  1. copies each state key H2D on the device tier's h2d stream into the staging set (device
     tensors reserved from the device tier, one uint8 buffer per key sized to the largest staged
     unit, plus the new low-precision output's and, for a gradient in host memory, the gradient's);
     compute joins each copy's event (the compute stream waits, the host does not);
  2. hands the device views to the caller, which runs the update rule's device variant on them and
     writes the low-precision output into the staged output buffer, on the compute stream;
  3. copies the state and the output D2H on the d2h stream, each copy waiting for the compute
     stream first (copy_d2h), and waits for them on the host before it returns: the caller then
     finds the new state in its home's bytes (the NVMe pipeline issues its write-back from them) and
     the new parameters in `out`, as after the CPU update.
Stream/event invariant ([Note: copy streams and events] in tiers/device.py): no staging buffer is
written before the copies reading it completed, because a set is reused only by the next
`staged(...)`, which begins after this one waited for its D2H tickets; every device tensor is
allocated once, on the compute stream, and lives until close(). `SETS` (1) staging sets are
alive at once, each `set_bytes` of device memory: the plan counts `SETS x set_bytes` of the
device-stepped units ([Note: the device step's staging memory] in planner/step_on.py), the very
figures the buffers are sized by. On a CPU "device"
the same code runs: the copies go into separate buffers (the lagging device of the CPU suite
copies late and poisons destinations, so a missing join fails there) and the rule's device
variant runs on them instead of the native kernel.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from ..state import Unit
from .state_layout import StateLayout
from .state_terms import OptStateSizing, UnitBytes


class DeviceStaging:
    """The staging set of [Note: device staging], for the units `units` (their layouts `layouts`, by unit index)."""

    SETS = 1  # staging sets alive at once (units whose state is staged on the device at once)

    @staticmethod
    def set_bytes(state_set: UnitBytes, largest_shard: int, lp_itemsize: int, grad_itemsize: int = 0) -> int:
        """Device bytes of one staging set: `state_set`, per state key the largest staged unit's buffer
        (OptStateSizing.staging_set of the staged units' key bytes); the low-precision output of the
        largest staged shard; its gradient when the gradients are staged in from host memory
        (`grad_itemsize`; 0 when the update reads them on the device). The plan's term is `SETS` of these."""
        return sum(state_set) + largest_shard * (lp_itemsize + grad_itemsize)

    def __init__(self, units: list[Unit], layouts: dict[int, StateLayout], device_tier, profiler=None):
        self.device_tier, self.profiler = device_tier, profiler
        self.device = device_tier.device
        keys = next(iter(layouts.values())).keys
        # a set's buffers: set_bytes's figures, per key the largest staged unit's
        state_set = OptStateSizing.staging_set(tuple(layouts[u.index].nbytes(k, u.shard_numel) for k in keys)
                                               for u in units)
        self._largest = dict(zip(keys, state_set))
        self._largest_shard = max(u.shard_numel for u in units)
        self._state: dict[str, torch.Tensor] = {}     # key -> uint8 device buffer (made at the first use)
        self._extra: dict[str, torch.Tensor] = {}     # "out" / "grad" -> device buffer, by dtype at first use

    def _buffer(self, what: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The set's device buffer `what` (a state key, "out" or "grad") as `numel` elements of `dtype`."""
        pool = self._state if what in self._largest else self._extra
        buf = pool.get(what)
        if buf is None or buf.dtype != dtype:
            if buf is not None:
                self.device_tier.free(buf)
            size = self._largest[what] if what in self._largest else self._largest_shard
            buf = pool[what] = self.device_tier.alloc((size,), dtype, f"optimizer device staging {what}")
        return buf[:numel]

    @contextlib.contextmanager
    def staged(self, unit: Unit, raw: dict, grad: torch.Tensor, out: "torch.Tensor | None",
               writes_all: bool = True) -> Iterator[tuple]:
        """[Note: device staging] `raw`: the unit's state bytes in host memory (key -> uint8), `grad` its
        gradient shard, `out` where its new low-precision shard goes. Yields (raw, grad, out) on the
        device for the update; after it, the state and the output are back in `raw` and `out`.
        `writes_all`: the update writes every element of `out` (else `out` is staged in too, so the
        elements it leaves, such as the shard's padding, go back as they were)."""
        tier = self.device_tier
        staged = {k: self._buffer(k, host.numel(), torch.uint8) for k, host in raw.items()}
        inbound = [(f"{unit.key}.{k}", k, staged[k], host) for k, host in raw.items()]
        if grad.device.type != self.device.type:  # a gradient in host memory (or staged there)
            dev_grad = self._buffer("grad", grad.numel(), grad.dtype)
            inbound.append((f"{unit.key}.grad", "grad", dev_grad, grad))
            grad = dev_grad
        dev_out = None if out is None else self._buffer("out", out.numel(), out.dtype)
        if dev_out is not None and not writes_all:
            inbound.append((unit.param_key, "param", dev_out, out))
        for ticket in self._copies(unit, inbound, "host", "device", "optimizer-read", tier.copy_h2d):
            tier.join(ticket)
        yield staged, grad, dev_out
        outbound = [(f"{unit.key}.{k}", k, raw[k], staged[k]) for k in raw]
        if out is not None:
            outbound.append((unit.param_key, "param", out, dev_out))
        for ticket in self._copies(unit, outbound, "device", "host", "optimizer-write", tier.copy_d2h):
            ticket.wait()

    def _copies(self, unit: Unit, pairs: list, src: str, dst: str, reason: str, copy) -> list:
        """Issue `copy(dst, src)` for each (name, role, dst tensor, src tensor), profiled as transfers of
        `reason` from tier `src` to `dst` (a state key is its role, as in the NVMe pipeline's records);
        returns the tickets."""
        prof, tickets = self.profiler, []
        for name, role, to, frm in pairs:
            token = prof.begin(name, role, src, dst, frm.numel() * frm.element_size(), reason) \
                if prof is not None else None
            ticket = copy(to, frm)
            tickets.append(ticket)
            if token is not None:
                prof.end(token, copy=ticket)
        return tickets

    def close(self) -> None:
        """Give the staging buffers back to the device tier. Idempotent."""
        for pool in (self._state, self._extra):
            for buf in pool.values():
                self.device_tier.free(buf)
            pool.clear()
