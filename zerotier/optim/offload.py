"""The engine's optimizer: an update rule (optim/rules/: AdamW, Adam, Lion) run over every unit's
state, wherever the state store (state_store.py) keeps it.

`step()` reads each unit's gradient shard and writes the new low-precision parameters into the
buffer the parameter store hands it, in the same pass as the update math (fused output, in the
param dtype); it yields each unit once it is updated. `update()` is the loop an overlap policy
starts (the policy decides when, the driver does it): `step()` over the units, each one marked
stepped in the gradient store and committed by the parameter store as it is yielded. The
hyper-parameters come as data (rules/base.py's HyperTable), not a call back. The state, its placement, the NVMe pipeline ([Note: NVMe optimizer pipeline]) and the step
counts are the store's (`self.state`); gradients that are not in host memory for a CPU update are
staged by grad_staging.py ([Note: device gradients, host optimizer]). Where each unit's update runs
is apart from where its state lives ([Note: where the update runs] in planner/step_on.py): a
host- or NVMe-homed unit whose plan says "device" is staged to the device for its update and back
(device_staging.py, [Note: device staging]).

[Note: the asynchronous device step]
A unit stepped on the device does not hold the optimizer thread: `_update` stages its state in,
issues the update rule's device variant and the copies out on the device's streams, and returns
their tickets; the thread goes on with the next unit (a CPU unit's native update runs while the
device works), and the device unit is retired once its copies out are done: its NVMe home's
write-back issued then (the staging set's ranges held until that write lands), its parameters
committed then. `DeviceStaging.SETS` (2) device updates are in flight at most: a third waits for
the oldest to retire (its staging set). Units leave `step()` in the order they were taken up
(InOrder below: a CPU unit updated behind a device unit still in flight waits for it), so the
parameter store commits and the gradient store releases as before. The thread retires every
device update in flight before a unit whose NVMe read is not issued yet (the read may need the
ranges they hold) and at the end of `step()`, which therefore returns with every update done, as
before. Until a unit is retired, nobody reads or writes its host bytes (its state's home, or its
staging set) or its output buffer: the copies out write them. After a failure every update in
flight is waited for and its staging set's ranges come back (InOrder.abandon).

Each parameter keeps its own step count (torch's per-parameter `step`): a
parameter that received no gradient in an optimizer step is not updated at all,
exactly as torch.optim.AdamW skips parameters whose `.grad` is None ([Note:
parameters without a gradient] at `_update`). Each parameter also has its own
hyper-parameters (the rule's: those of its param group, which `engine.optimizer` reads
at each step: [Note: param groups] in torch_optimizer.py).
"""
from __future__ import annotations

import collections
from typing import Callable, Iterator, Sequence

import torch

from ..config import OptimizerConfig
from ..device import local_world_size
from ..errors import ConfigError
from ..state import Location, Unit
from ..threads import UPDATER, owned
from ..tiers.homes import HOMES
from . import _kernels
from .device_staging import DeviceStaging
from .grad_staging import StagedGrads
from .rules import AdamW, UpdateRule
from .rules.base import HyperTable
from .state_layout import StateLayout
from .state_store import OptStateStore


class UnitOptimizer:
    """The update loop: `rule` over units whose state `state` holds (see the module docstring)."""

    def __init__(self, units: list[Unit], cfg: OptimizerConfig, loc: "Location | tuple[Location, ...]", device_tier,
                 host_pool, store, profiler=None, layout: StateLayout = StateLayout(),
                 rule: UpdateRule | None = None, step_on: Sequence[str] = (), staging_tier=None):
        """loc: the tier of every unit's state, or each unit's tier by unit index ([Note: units on
        different tiers]; a split spans host and NVMe only). layout: the state's keys and dtypes
        ([Note: optimizer state layout]), the keys `rule`'s (default: AdamW). store: the NVMe tier.
        step_on: "cpu" / "device" by unit index (Plan.optimizer_step_on; empty: every update where
        its state lives). staging_tier: the device tier the staging of [Note: device staging] is
        reserved from (the plan's device_step term; default: device_tier)."""
        self.units, self.cfg, self.layout = units, cfg, layout
        self.rule = rule if rule is not None else AdamW()
        locs = [loc] * len(units) if isinstance(loc, Location) else list(loc)
        if not layout.exact and any(HOMES[at].on_device for at in locs) and device_tier.device.type != "cpu":
            raise ConfigError(f"precision.master_dtype = {layout.master!r}, precision.moment_dtype = "
                              f"{layout.moments!r}: compact optimizer state is updated by the CPU kernel, and "
                              f"offload.optimizer puts it on {device_tier.device} (fp32 only there, torch's fused "
                              "Adam): set offload.optimizer = 'host' or 'nvme', or both dtypes to 'fp32'")
        self.state = OptStateStore(units, locs, layout, device_tier, host_pool, store, cfg.pipeline_depth, profiler)
        self.device_tier, self.host_pool, self.profiler = device_tier, host_pool, profiler
        # auto: this process's cores, shared with the other ranks of the node
        self.threads = max(1, _kernels.default_threads() // local_world_size()) if cfg.threads == "auto" \
            else int(cfg.threads)
        self.device = device_tier.device if locs and HOMES[locs[0]].on_device else torch.device("cpu")
        # [Note: device staging]: the units homed off the device whose update runs on it
        staged = [u for u, at, on in zip(units, locs, step_on) if on == "device" and not HOMES[at].on_device]
        self._device_staged = frozenset(u.index for u in staged)
        self.device_staging = DeviceStaging(staged, {u.index: self.state.slots[u.index].layout for u in staged},
                                            staging_tier or device_tier, profiler) if staged else None
        self._got: dict[int, frozenset[int] | None] = {}  # step(): parameters with a gradient, by unit
        self._keep_grads = False  # step(): the gradients are read after the update (not consumed)
        self._staged_grads: StagedGrads | None = None  # step(): the gradients it stages into host blocks
        self.applied = 0  # unit updates begun so far (the engine tells a clean failure from a partial one)

    @owned(UPDATER)
    def rewind(self, kept: "dict[int, tuple[list, list[int]]]", applied: int) -> int:
        """An undo log's rollback ([Note: speculative step] in overlap/speculative.py): the state
        store puts the units back (`OptStateStore.rewind`), and `applied` is the count before the
        first of them. Returns the bytes copied back."""
        moved = self.state.rewind(kept)
        self.applied = applied
        return moved

    def close(self) -> None:
        """Finish the state's NVMe I/O in flight and give its staging back. Idempotent."""
        self.state.close()
        if self.device_staging is not None:
            self.device_staging.close()

    # ------------------------------------------------------------------ step

    @owned(UPDATER)
    def update(self, units: list[Unit], grads, params, hypers: HyperTable, grad_scale: float, drain: bool = True,
               keep_grads: bool = False, speculative: bool = False) -> None:
        """The update an overlap policy starts (it decides when, this does it): `step` over `units`
        reading the gradient store's shards (`grads`: GradStore) into the parameter store's output
        buffers (`params`: ParamStore), and each unit's new parameters committed as soon as it is
        done, unless `speculative` ([Note: speculative step] in overlap/speculative.py: staged
        until the window is validated)."""
        out_of = params.staged_out if speculative else params.out_buffer
        for unit in self.step(units, grads.shard, out_of, hypers, grad_scale, drain, got_of=grads.got,
                              keep_grads=keep_grads, device_out_of=None if speculative else params.device_out):
            if not speculative:
                grads.stepped(unit)
                params.commit(unit)

    @owned(UPDATER)
    def step(self, units: list[Unit], grad_of: Callable[[Unit], torch.Tensor],
             out_of: Callable[[Unit], torch.Tensor], hypers: HyperTable, grad_scale: float,
             drain: bool = True, got_of: Callable[[Unit], "frozenset[int] | None"] | None = None,
             keep_grads: bool = False,
             device_out_of: "Callable[[Unit], torch.Tensor | None] | None" = None) -> Iterator[Unit]:
        """Update `units`, yielding each once its master and its low-precision output are written.
        `grad_of(unit)`: the gradient shard to read; `out_of(unit)`: where the new params go;
        `hypers`: this step's hyper-parameters by group, and each unit's parameters' groups; `got_of(unit)`: the unit's
        parameters that got a gradient (None: all of them) — the others are left untouched
        ([Note: parameters without a gradient]).
        drain=False leaves NVMe write-backs in flight (an early update during backward: the
        next unit's read overlaps them); `state.finish()` waits for them. An fp32 gradient shard on
        the device is consumed (left scaled by `grad_scale`) unless `keep_grads`, for gradients
        read after the update ([Note: the fused kernel reads the gradient in place] in rules/adamw.py).
        `device_out_of(unit)`: for a unit staged to the device, where on the device its new params may be
        written in place (ParamStore.device_out), instead of `out_of(unit)` and a copy back."""
        self._keep_grads = keep_grads
        self._got = {u.index: got_of(u) for u in units} if got_of is not None else {}
        order = self.state.read_order(units)
        first = grad_of(order[0]) if order else None  # every unit's gradient lives on the same tier
        # a unit updated on the device reads a gradient tensor where it is ([Note: device staging])
        direct = self._device_staged if isinstance(first, torch.Tensor) else frozenset()
        host_order = [u for u in order if u.index not in direct]
        staged = self._staged_grads = None
        if host_order and (not isinstance(first, torch.Tensor)  # a GradFile
                           or self.device.type == "cpu" and first.device.type == "cuda"):
            staged = self._staged_grads = StagedGrads(host_order, grad_of, self.device_tier, self.host_pool,
                                                      self.profiler)
            grad_of = (lambda u, read=grad_of: read(u) if u.index in direct else staged(u)) if direct else staged
        try:
            yield from self._step(order, grad_of, out_of, hypers, grad_scale, drain, device_out_of)
        finally:
            if staged is not None:
                staged.close()
            self._staged_grads = None

    def _step(self, order, grad_of, out_of, hypers: HyperTable, grad_scale: float, drain: bool,
              device_out_of) -> Iterator[Unit]:
        state = self.state
        ahead = max(1, state.depth - 2)
        nvme_order = [u for u in order if state.on_nvme(u)]
        done = 0  # NVMe units of `order` stepped so far
        flight = InOrder()  # [Note: the asynchronous device step]
        sets = DeviceStaging.SETS
        completed = False
        try:
            for unit in order:
                hyper = [hypers.groups[g] for g in hypers.unit_groups[unit.index]]  # data, no call back
                on_nvme = state.on_nvme(unit)
                on_device = unit.index in self._device_staged
                if on_nvme and not state.read_issued(unit):  # its read may need the sets device units hold
                    yield from flight.settle_all()
                elif on_device and flight.in_flight >= sets:  # its staging set is the oldest's
                    yield from flight.settle(wait=1)
                # [Note: units on different tiers]: before a host unit, only free sets
                state.read_ahead(nvme_order[done: done + 1 + ahead], block=on_nvme)
                done += on_nvme
                if on_device:
                    raw = state.take_staged(unit) if on_nvme else state.live_state(unit)
                    try:
                        in_place = device_out_of(unit) if device_out_of is not None else None
                        out = out_of(unit) if in_place is None else in_place
                        tickets = self._update(unit, raw, grad_of(unit), out, hyper, grad_scale,
                                               in_place=in_place is not None)
                    except BaseException:
                        if on_nvme:
                            state.drop_staged(unit)
                        raise
                    if on_nvme:  # its staging set's ranges are held until its write-back is issued
                        update = InFlight(tickets, on_done=lambda u=unit: state.write_staged(u),
                                          on_failed=lambda u=unit: state.drop_staged(u))
                    else:
                        update = InFlight(tickets)
                    flight.add(unit, update)
                elif on_nvme:
                    with state.staged(unit) as bufs:  # [Note: NVMe optimizer pipeline]
                        self._update(unit, bufs, grad_of(unit), out_of(unit), hyper, grad_scale)
                    flight.add(unit)
                else:
                    self._update(unit, state.live_state(unit), grad_of(unit), out_of(unit), hyper, grad_scale)
                    flight.add(unit)
                yield from flight.settle()
            yield from flight.settle_all()
            completed = True
        finally:
            if not completed:
                flight.abandon()
            if drain or not completed:  # after an error every write is waited, and the error raised
                state.finish()

    @owned(UPDATER)
    def _update(self, unit: Unit, raw: dict, grad, out, hypers: Sequence, grad_scale: float,
                in_place: bool = False) -> "list | None":
        """[Note: parameters without a gradient] Each parameter keeps its own step count and
        hyper-parameters, as in torch. When every parameter of the unit got a gradient and their
        counts and hyper-parameters agree (always, unless data-dependent control flow skipped one
        or the unit's parameters are in different param groups), one pass updates the whole
        shard. Otherwise the parameters' slices of the shard are updated, each with its own count
        and hyper-parameters (adjacent slices that share them as one range; on the CPU, all of
        them in one native call), and the slices of parameters without a gradient are left as
        they are (their new low-precision output is the cast of the unchanged master). `raw`: the
        unit's state buffers ([Note: optimizer state layout]). A unit staged to the device
        ([Note: device staging]) returns the tickets of its copies out, not waited: `raw` and `out`
        hold the update once they are done ([Note: the asynchronous device step]); `in_place`: `out` is
        device memory (the parameters' home, ParamStore.device_out) that the update writes itself."""
        self.applied += 1  # from here on the unit's state may differ from before the step
        got = self._got.pop(unit.index, None)
        slot = self.state.slots[unit.index]
        steps = slot.steps
        for k in range(len(steps)):
            if got is None or k in got:
                steps[k] += 1
        whole = got is None and len(set(steps)) == 1 and len(set(hypers)) == 1  # one pass over the shard
        if unit.index not in self._device_staged:
            self._update_here(unit, raw, grad, out, hypers, grad_scale, got, steps, whole)
            return None
        staged = self.device_staging.stage_in(unit, raw, grad, None if in_place else out, writes_all=whole)
        if staged.grad_ticket is not None and self._staged_grads is not None:  # its block outlives the call
            self._staged_grads.read_by(unit, staged.grad_ticket)
        self._update_here(unit, staged.raw, staged.grad, out if in_place else staged.out, hypers, grad_scale, got,
                          steps, whole)
        return staged.stage_out()

    def _on_device(self, unit: Unit, master: torch.Tensor) -> bool:
        """The unit's update runs the rule's device variant: its state is on an accelerator, or staged
        to the device ([Note: device staging]); else the native CPU kernel."""
        return unit.index in self._device_staged or master.device.type != "cpu"

    def _update_here(self, unit: Unit, raw: dict, grad, out, hypers: Sequence, grad_scale: float, got, steps,
                     whole: bool) -> None:
        """`_update`'s math where `raw` is: the CPU kernel, or the rule's device variant (state on an
        accelerator, or staged to the device). `whole`: one pass over the shard, else per parameter."""
        n, layout = unit.shard_numel, self.state.slots[unit.index].layout  # fixed at placement
        master = layout.typed("master", raw["master"], n)
        moments = {k: layout.typed(k, raw[k], n) for k in layout.moment_keys}
        if grad.device != master[0].device:
            grad = grad.to(master[0].device)
        prof = self.profiler
        span = prof.compute_begin("device-optimizer" if self._on_device(unit, master[0]) else "optimizer",
                                  label=unit.key, numel=unit.numel) if prof is not None else None
        if whole:
            self._apply(unit, master, moments, grad, out, [(0, n, steps[0], hypers[0])], grad_scale)
        else:
            ranges: list[list] = []  # [a, b, step, hyper]: slices of the shard to update
            lo, hi = unit.shard_lo, unit.shard_hi
            for k, (offset, shape) in enumerate(zip(unit.offsets, unit.shapes)):
                a, b = max(offset, lo) - lo, min(offset + shape.numel(), hi) - lo
                if a >= b:
                    continue  # not in this rank's shard
                if got is None or k in got:
                    if ranges and ranges[-1][1] == a and ranges[-1][2:] == [steps[k], hypers[k]]:
                        ranges[-1][1] = b
                    else:
                        ranges.append([a, b, steps[k], hypers[k]])
                elif out is not None and out.data_ptr() != master[0].data_ptr():
                    out[a:b].copy_(master[0][a:b])
            self._apply(unit, master, moments, grad, out, ranges, grad_scale)
        if span is not None:
            prof.compute_end(span)

    def _apply(self, unit: Unit, master, moments: dict, grad, out, ranges, grad_scale: float) -> None:
        """The rule's update over the slices [a, b) of the shard in `ranges` ((a, b, step, hyper)
        each), with the unit's layout (its slot's, fixed at placement). master and each moment:
        (values, tail) pairs, the layout's `typed` views ([Note: optimizer state layout]); on the CPU the rule's native variant runs them in one call, bf16
        masters, int8 runs and fp32 ranges ([Note: small parameters keep fp32 moments]) included;
        on the device (an accelerator, or state staged to it: [Note: device staging]), the rule's
        device variant runs them, fp32 or compact state."""
        if not ranges:
            return
        on_device = self._on_device(unit, master[0])
        layout = self.state.slots[unit.index].layout
        common = dict(grad=grad, out=out, unit_index=unit.index, shard_lo=unit.shard_lo,
                      bias_correction=self.cfg.bias_correction, grad_scale=grad_scale)
        if not on_device:  # `out` is host memory too (ParamStore.out_buffer): one native call
            layout.step_pieces(self.rule.cpu_pieces, master[0], moments, ranges, simd=self.cfg.simd,
                               threads=self.threads, **common)
        else:
            layout.step_pieces(self.rule.device_pieces, master[0], moments, ranges, keep_grad=self._keep_grads,
                               **common)


# ------------------------------------------------------------------ [Note: the asynchronous device step]

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
    """The units of one step, handed on in the order they were taken up ([Note: the asynchronous device step])."""

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
