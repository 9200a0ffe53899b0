"""A host- or NVMe-homed unit's optimizer state staged to the device for its update there
([Note: where the update runs] in planner/step_on.py: `Plan.optimizer_step_on`).

[Note: device staging]
A unit whose state lives on host or NVMe and whose update runs on the device keeps its home;
only its update moves. `DeviceStaging.staged(...)` takes the state's host bytes (the host home's
pool blocks, or the NVMe pipeline's staging set: pinned on CUDA, so the copies are asynchronous),
and:
  1. copies each state key H2D on the device tier's h2d stream into the staging set (device
     tensors reserved from the device tier, one uint8 buffer per key sized to the largest staged
     unit, plus the new low-precision output's unless the parameters' device home takes it in place
     (ParamStore.device_out), and, for a gradient in host memory, the gradient's);
     compute joins each copy's event (the compute stream waits, the host does not);
  2. hands the device views to the caller, which runs the update rule's device variant on them and
     writes the low-precision output into the staged output buffer, on the compute stream;
  3. `Staged.stage_out()` copies the state and the output D2H on the d2h stream, each copy waiting
     for the compute stream first (copy_d2h), and returns their tickets without waiting: once they
     are done the caller finds the new state in its home's bytes (the NVMe pipeline issues its
     write-back from them) and the new parameters in `out`, as after the CPU update. Until then
     nobody reads or writes those host bytes ([Note: the asynchronous device step] in offload.py).
Stream/event invariant ([Note: copy streams and events] in tiers/device.py): no staging buffer is
written before the copies reading it completed: the `SETS` (2) sets are taken in turn, and
stage_in on a set first waits on the host for the D2H tickets of the unit that used it last
(the caller has normally waited them already, to retire that unit); every device tensor is
allocated once, on the compute stream, and lives until close(). Each set is `set_bytes` of device
memory: the plan counts `SETS x set_bytes` of the device-stepped units ([Note: the device step's
staging memory] in planner/step_on.py), the very figures the buffers are sized by. On a CPU "device"
the same code runs: the copies go into separate buffers (the lagging device of the CPU suite
copies late and poisons destinations, so a missing join fails there) and the rule's device
variant runs on them instead of the native kernel.
"""
from __future__ import annotations

import torch

from ..state import Unit
from .state_layout import StateLayout
from .state_terms import OptStateSizing, UnitBytes


class DeviceStaging:
    """The staging sets of [Note: device staging], for the units `units` (their layouts `layouts`, by unit index)."""

    SETS = 2  # staging sets alive at once: device updates in flight (one staged in while one goes out)

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
        # per set: what -> device buffer (a state key: uint8; "out" / "grad": by dtype at first use)
        self._sets: list[dict[str, torch.Tensor]] = [{} for _ in range(self.SETS)]
        self._last: list[list] = [[] for _ in range(self.SETS)]  # per set: the D2H tickets of its last unit
        self._turn = 0  # the set the next unit takes

    def _buffer(self, bufs: dict, what: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A set's device buffer `what` (a state key, "out" or "grad") as `numel` elements of `dtype`."""
        buf = bufs.get(what)
        if buf is None or buf.dtype != dtype:
            if buf is not None:
                self.device_tier.free(buf)
            size = self._largest.get(what, self._largest_shard)
            buf = bufs[what] = self.device_tier.alloc((size,), dtype, f"optimizer device staging {what}")
        return buf[:numel]

    def stage_in(self, unit: Unit, raw: dict, grad: torch.Tensor, out: "torch.Tensor | None",
                 writes_all: bool = True) -> "Staged":
        """[Note: device staging] `raw`: the unit's state bytes in host memory (key -> uint8), `grad` its
        gradient shard, `out` where its new low-precision shard goes. Returns the device views for the
        update (compute has joined their copies in); its `stage_out()` sends the state and the output
        back into `raw` and `out`. `writes_all`: the update writes every element of `out` (else `out` is
        staged in too, so the elements it leaves, such as the shard's padding, go back as they were)."""
        tier, turn = self.device_tier, self._turn
        self._turn = (turn + 1) % self.SETS
        for ticket in self._last[turn]:  # the set's previous unit has left it
            ticket.wait()
        self._last[turn] = []
        bufs = self._sets[turn]
        staged = {k: self._buffer(bufs, k, host.numel(), torch.uint8) for k, host in raw.items()}
        inbound = [(f"{unit.key}.{k}", k, staged[k], host) for k, host in raw.items()]
        if grad.device.type != self.device.type:  # a gradient in host memory (or staged there)
            dev_grad = self._buffer(bufs, "grad", grad.numel(), grad.dtype)
            inbound.append((f"{unit.key}.grad", "grad", dev_grad, grad))
            grad = dev_grad
        dev_out = None if out is None else self._buffer(bufs, "out", out.numel(), out.dtype)
        if dev_out is not None and not writes_all:
            inbound.append((unit.param_key, "param", dev_out, out))
        tickets = self._copies(unit, inbound, "host", "device", "optimizer-read", tier.copy_h2d)
        for ticket in tickets:
            tier.join(ticket)
        grad_ticket = next((t for (_, role, _, _), t in zip(inbound, tickets) if role == "grad"), None)
        return Staged(self, turn, unit, raw, out, staged, grad, dev_out, grad_ticket)

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

    @property
    def nbytes(self) -> int:
        """Device bytes the staging sets hold now (at most SETS x set_bytes: a set is made at its first use)."""
        return sum(b.numel() * b.element_size() for bufs in self._sets for b in bufs.values())

    def close(self) -> None:
        """Wait for the copies out still in flight, then give the staging buffers back to the device
        tier. Idempotent."""
        for k, tickets in enumerate(self._last):
            for ticket in tickets:
                ticket.wait()
            self._last[k] = []
        for bufs in self._sets:
            for buf in bufs.values():
                self.device_tier.free(buf)
            bufs.clear()


class Staged:
    """One unit's state on a staging set: `raw` (key -> device uint8 view), `grad` and `out` (device
    views) for the update; `stage_out()` after it ([Note: device staging]). `grad_ticket`: the copy of a
    gradient staged in from host memory (None where the update reads it on the device)."""

    def __init__(self, staging: DeviceStaging, turn: int, unit: Unit, host_raw: dict, host_out, raw: dict,
                 grad: torch.Tensor, out: "torch.Tensor | None", grad_ticket=None):
        self._staging, self._turn, self._unit = staging, turn, unit
        self._host_raw, self._host_out = host_raw, host_out
        self.raw, self.grad, self.out, self.grad_ticket = raw, grad, out, grad_ticket

    def stage_out(self) -> list:
        """Issue the D2H copies of the state and the output after the update (on the compute stream);
        returns their tickets, not waited: the host bytes are the update's result once they are done."""
        staging, unit = self._staging, self._unit
        outbound = [(f"{unit.key}.{k}", k, self._host_raw[k], self.raw[k]) for k in self._host_raw]
        if self._host_out is not None:
            outbound.append((unit.param_key, "param", self._host_out, self.out))
        tickets = staging._copies(unit, outbound, "device", "host", "optimizer-write",
                                  staging.device_tier.copy_d2h)
        staging._last[self._turn] = tickets
        return tickets
