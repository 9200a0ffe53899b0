"""The engine's optimizer: AdamW over units whose fp32 state lives on device, host or NVMe.

It owns the fp32 master, exp_avg and exp_avg_sq of this rank's shard of every unit
and each unit's step count. `step()` reads each unit's gradient shard and writes
the new low-precision parameters into the buffer the parameter store hands it, in
the same pass as the Adam math (fused output, in the param dtype); it yields each unit once
it is updated, and the engine commits it. It calls nobody back.

[Note: NVMe optimizer pipeline]
NVMe-resident state goes through `optimizer.pipeline_depth` staging sets (master,
exp_avg, exp_avg_sq each: exact-size pinned aligned host-pool blocks, so every read
and write is zero-copy whatever the unit's size). A set is busy from its read until
its write-back completes. While Adam runs on one unit, the reads of the next
`depth - 2` units are in flight and earlier units' writes drain; a read that needs a
set waits for the oldest write only. During the last backward of a window the
engine calls `prefetch(unit)` as each unit's gradient becomes final: its state
reads start then (they do not depend on the global gradient norm), using sets that
are free without waiting, so with clipping on only the Adam math and the last
writes remain after backward. Without clipping the engine updates each unit on
its optimizer thread as soon as its gradient is final (`step(..., drain=False)`): the
unit's writes stay in flight while the next unit is read, and `finish()` waits for
them when engine.step() begins. Either way the step's writes are waited before it
returns: an I/O error surfaces in the step that caused it. Whatever fails (a read, the
Adam pass, a write refused at submit, as a full drive's fallocate refuses it), the set
comes back to the free ones once its issued I/O has ended: a lost set is never found
again, and after `depth` of them every step died in 'pop from an empty deque'.

[Note: device gradients, host optimizer]
A CPU optimizer reading gradients that live on the GPU does not copy them with a
blocking `.to("cpu")` per unit (a device sync each): `_StagedGrads` copies each unit's
shard on the device tier's d2h stream into a host-pool block one unit ahead, so the
next unit's copy runs under this unit's Adam, and Adam waits on that copy's event
only. Gradients on NVMe (`grad_of` returns a `grads_nvme.GradFile`: [Note: gradients on
NVMe] in grads_nvme.py) are read the same way, by the gradient store into the block
(`read_into`), whatever the optimizer's tier. At most two staging blocks are alive
(`grad_staging_bytes`, counted by the planner).

[Note: units on different tiers]
With an optimizer split (planner/sizes.py [Note: optimizer split]) each unit's state lives on its own
tier, `self.locs[unit.index]`: host units keep their state in pool blocks, NVMe units go
through the pipeline above, whose staging sets are sized to the largest NVMe unit. A step
takes the units in the same order (reads issued during backward first); a host unit's Adam
runs while the reads of the next NVMe units are in flight.

Each parameter keeps its own step count (torch's per-parameter `step`): a
parameter that received no gradient in an optimizer step is not updated at all,
exactly as torch.optim.AdamW skips parameters whose `.grad` is None ([Note:
parameters without a gradient] at `_adam`). Each parameter also has its own
hyper-parameters (`Hyper`: those of its param group, which `engine.optimizer` reads
at each step: [Note: param groups] in torch_optimizer.py).
"""
from __future__ import annotations

import collections
import time
from typing import Callable, Iterator, NamedTuple, Sequence

import torch

from ..config import OptimizerConfig
from ..device import local_world_size
from ..errors import ConfigError
from ..io import aligned_empty
from ..state import Location, Unit
from ..threads import UPDATER, owned
from . import _kernels
from .state_layout import STATE_KEYS, StateLayout, cpu_adam_ranges


class Hyper(NamedTuple):
    """One parameter's Adam(W) hyper-parameters for one step: its param group's values."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool  # AdamW's decay of the weights (True) or Adam's L2 term in the gradient


HyperOf = Callable[[Unit], Sequence[Hyper]]  # a unit -> each of its parameters' Hyper, in unit.params order


def plain_file(unit: Unit, key: str, update: bool = False) -> str:
    """The NVMe key of `unit`'s state buffer `key`: one file per buffer. `update`: the key an update
    writes (an undo log may divert it: UnitOptimizer.file_of)."""
    return f"{unit.key}.{key}"


class _Profiled:
    """An I/O ticket plus what the profiler needs to record it once it has completed.
    The end time is when the waiter saw completion (an upper bound of the I/O's end)."""

    def __init__(self, ticket, name, role, src, dst, nbytes, reason, start_ns):
        self.ticket, self.name, self.role, self.src, self.dst = ticket, name, role, src, dst
        self.nbytes, self.reason, self.start_ns = nbytes, reason, start_ns
        self.recorded = False

    def wait(self):
        return self.ticket.wait()

    def done(self):
        return self.ticket.done()

    def record(self, prof) -> None:
        if not self.recorded:
            self.recorded = True
            prof.record(self.name, self.role, self.src, self.dst, self.nbytes, self.reason, self.start_ns,
                        time.perf_counter_ns(), stream="nvme-io")


class UnitOptimizer:
    """Adam(W) step over units, wherever their state lives (see the module docstring)."""

    def __init__(self, units: list[Unit], cfg: OptimizerConfig, loc: "Location | tuple[Location, ...]", device_tier,
                 host_pool, store, profiler=None, layout: StateLayout = StateLayout()):
        """loc: the tier of every unit's state, or each unit's tier by unit index ([Note: units on
        different tiers]; a split spans host and NVMe only). layout: the state's dtypes
        ([Note: optimizer state layout])."""
        self.units, self.cfg, self.layout = units, cfg, layout
        self.locs: list[Location] = [loc] * len(units) if isinstance(loc, Location) else list(loc)
        if len(self.locs) != len(units) or (Location.DEVICE in self.locs and len(set(self.locs)) > 1):
            raise ConfigError(f"optimizer state placement {[at.value for at in self.locs]} for {len(units)} "
                              "units: give one tier per unit, a split over host and nvme only")
        self._nvme_units = [u for u in units if self.locs[u.index] is Location.NVME]
        self.device_tier, self.host_pool, self.store = device_tier, host_pool, store
        if not layout.exact and Location.DEVICE in self.locs and device_tier.device.type != "cpu":
            raise ConfigError(f"precision.master_dtype = {layout.master!r}, precision.moment_dtype = "
                              f"{layout.moments!r}: compact optimizer state is updated by the CPU kernel, and "
                              f"offload.optimizer puts it on {device_tier.device} (fp32 only there, torch's fused "
                              "Adam): set offload.optimizer = 'host' or 'nvme', or both dtypes to 'fp32'")
        self.profiler = profiler  # None when profiling is off
        # auto: this process's cores, shared with the other ranks of the node
        self.threads = max(1, _kernels.default_threads() // local_world_size()) if cfg.threads == "auto" \
            else int(cfg.threads)
        # optimizer steps applied per parameter (torch's per-parameter `step`), by unit
        self.steps: list[list[int]] = [[0] * len(u.params) for u in units]
        self._state: list[dict | None] = [None] * len(units)  # device/host: key -> tensor (or HostBuffer)
        self.device = device_tier.device if self.locs and self.locs[0] is Location.DEVICE else torch.device("cpu")
        # [Note: NVMe optimizer pipeline]
        self.depth = cfg.pipeline_depth
        self._sets: list[dict] = []              # staging sets of pool blocks, made at the first NVMe step
        self._free_sets: collections.deque[int] = collections.deque()
        self._writing: collections.deque[tuple[int, list]] = collections.deque()  # (set, write tickets)
        self._reads: dict[int, tuple[int, list]] = {}   # unit index -> (set, read tickets), in issue order
        self._got: dict[int, frozenset[int] | None] = {}  # step(): parameters with a gradient, by unit
        self._keep_grads = False  # step(): the gradients are read after the update (not consumed)
        self.applied = 0  # unit updates begun so far (the engine tells a clean failure from a partial one)
        # [Note: initial NVMe writes] Initialization keeps the writes of up to `depth` units in flight
        # (their master blocks + one shared zeros block: within the staging the planner counts,
        # depth x 12 B x the largest shard), so the drive's queue stays full while the next units
        # are materialized and cast.
        self._placing: collections.deque = collections.deque()  # (master block, write tickets), oldest first
        self._zeros = None  # host-pool block of zeros, the largest shard's size: every unit's initial moments
        # where each state buffer's NVMe file is: plain_file, or an undo log's (overlap/speculative.py)
        self.file_of: Callable[[Unit, str, bool], str] = plain_file

    @staticmethod
    def grad_staging_bytes(largest_shard: int, grad_itemsize: int) -> int:
        """Host-pool bytes of [Note: device gradients, host optimizer]: two gradient shards."""
        return 2 * largest_shard * grad_itemsize

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

    @staticmethod
    def staging_bytes(depth: int, largest_shard: int, layout: StateLayout = StateLayout()) -> int:
        """Host-pool bytes of the NVMe pipeline's staging sets (the planner counts exactly this)."""
        return depth * layout.state_bytes(largest_shard)

    @staticmethod
    def host_blocks(loc: Location, units: int, depth: int, grads_staged: bool, writeback: bool) -> int:
        """Host-pool blocks the optimizer holds at most at once (the planner rounds each up to
        io.alignment): a block per state key per unit on host (_place_state), a set of them per
        pipeline slot on NVMe (_make_sets), two gradient shards staged (_StagedGrads) and, at
        ZeRO-1/2 over several ranks, each unit's updated shard until the gather (ParamStore.writeback_bytes)."""
        blocks = {Location.HOST: len(STATE_KEYS) * units, Location.NVME: len(STATE_KEYS) * depth}.get(loc, 0)
        return blocks + 2 * grads_staged + units * writeback

    def _key(self, unit: Unit, key: str, update: bool = False) -> str:
        """The NVMe key of `unit`'s state buffer `key`; `update`: the file an update writes."""
        return self.file_of(unit, key, update)

    # ------------------------------------------------------------------ what an undo log uses

    def live_state(self, unit: Unit) -> dict:
        """A host- or device-resident unit's state buffers (key -> tensor), updated in place."""
        return self._state[unit.index]

    @owned(UPDATER)
    def rewind(self, kept: "dict[int, tuple[dict, list[int]]]", applied: int) -> int:
        """Put units back as an undo log kept them ([Note: speculative step] in overlap/speculative.py):
        `kept` maps a unit index to (key -> its pre-step bytes, empty for NVMe state; the parameters' step
        counts), `applied` is the count before the first. NVMe writes in flight are waited (their files are
        the discarded set: a write error there is dropped with them). Returns the bytes copied back."""
        try:
            self._drain_writes()
        except Exception:  # noqa: BLE001 - the discarded files' writes: nothing reads them
            pass
        self.drop_prefetched()
        moved = 0
        for index, (copies, steps) in kept.items():
            for k, src in copies.items():
                self._state[index][k].copy_(src)
                moved += src.numel()
            self.steps[index] = steps
        self.applied = applied
        return moved

    # ------------------------------------------------------------------ place

    @owned(UPDATER)
    def place(self, unit: Unit, master: torch.Tensor) -> None:
        """Put the fp32 master of this rank's shard (a CPU tensor) and zero moments on the tier, in
        the state's layout (a bf16 master: rounded to nearest).
        [Note: initial NVMe writes] NVMe: the writes are left in flight; finish_place() waits."""
        n = unit.shard_numel
        loc = self.locs[unit.index]
        layout = self.layout.for_unit(unit)  # [Note: small parameters keep fp32 moments]
        if loc is Location.NVME:
            moment_bytes = layout.nbytes("exp_avg", n)
            if self._zeros is None or self._zeros.tensor.numel() < moment_bytes:
                self._finish_placing(0)  # writes in flight read the old zeros block
                if self._zeros is not None:
                    self.host_pool.free(self._zeros)
                largest = max(self.layout.for_unit(u).nbytes("exp_avg", u.shard_numel) for u in self._nvme_units)
                self._zeros = self.host_pool.alloc(largest, torch.uint8, "optimizer.zeros")
                self._zeros.tensor.zero_()
            block = self.host_pool.alloc(layout.nbytes("master", n), torch.uint8, f"{unit.key}.master")
            layout.encode("master", master, block.tensor)
            zeros = self._zeros.tensor[:moment_bytes]  # aligned, with the room of the largest shard after it
            self._placing.append((block, [self.store.write(self._key(unit, k), block if k == "master" else zeros)
                                          for k in STATE_KEYS]))
            self._finish_placing(self.depth)
            return
        state = {}
        for key in STATE_KEYS:
            nbytes = layout.nbytes(key, n)
            if loc is Location.DEVICE:
                raw = state[key] = self.device_tier.alloc((nbytes,), torch.uint8, f"{unit.key}.{key}")
            else:
                raw = state[key] = self.host_pool.alloc(nbytes, torch.uint8, f"{unit.key}.{key}").tensor
            layout.encode(key, master, raw) if key == "master" else raw.zero_()
        self._state[unit.index] = state

    # ------------------------------------------------------------------ step

    @owned(UPDATER)
    def step(self, units: list[Unit], grad_of: Callable[[Unit], torch.Tensor],
             out_of: Callable[[Unit], torch.Tensor], hyper_of: HyperOf, grad_scale: float,
             drain: bool = True, got_of: Callable[[Unit], "frozenset[int] | None"] | None = None,
             keep_grads: bool = False) -> Iterator[Unit]:
        """Update `units`, yielding each once its master and its low-precision output are written.
        `grad_of(unit)`: the gradient shard to read; `out_of(unit)`: where the new params go;
        `hyper_of(unit)`: each parameter's hyper-parameters; `got_of(unit)`: the unit's
        parameters that got a gradient (None: all of them) — the others are left untouched
        ([Note: parameters without a gradient]).
        drain=False leaves NVMe write-backs in flight (an early update during backward: the
        next unit's read overlaps them); `finish()` waits for them. An fp32 gradient shard on
        the device is consumed (left scaled by `grad_scale`) unless `keep_grads`, for gradients
        read after the update ([Note: the fused kernel reads the gradient in place])."""
        self._keep_grads = keep_grads
        self._got = {u.index: got_of(u) for u in units} if got_of is not None else {}
        if not self._nvme_units:
            order = units
        else:  # units whose reads started during backward go first, in the order they were issued
            order = sorted(units, key=lambda u: list(self._reads).index(u.index) if u.index in self._reads
                           else len(self._reads) + u.index)
        first = grad_of(order[0]) if order else None
        if first is not None and (not isinstance(first, torch.Tensor)  # a GradFile
                                  or self.device.type == "cpu" and first.device.type == "cuda"):
            grad_of = _StagedGrads(order, grad_of, self.device_tier, self.host_pool, self.profiler)
        try:
            yield from self._step(order, grad_of, out_of, hyper_of, grad_scale, drain)
        finally:
            if isinstance(grad_of, _StagedGrads):
                grad_of.close()

    def _step(self, order, grad_of, out_of, hyper_of: HyperOf, grad_scale: float, drain: bool) -> Iterator[Unit]:
        ahead = max(1, self.depth - 2)
        nvme_order = [u for u in order if self.locs[u.index] is Location.NVME]
        done = 0  # NVMe units of `order` stepped so far
        completed = False
        try:
            for unit in order:
                on_nvme = self.locs[unit.index] is Location.NVME
                for nxt in nvme_order[done: done + 1 + ahead]:  # [Note: units on different tiers]
                    if nxt.index not in self._reads:
                        self._issue_read(nxt, block=on_nvme)  # before a host unit: only free sets
                if not on_nvme:
                    self._adam(unit, self._state[unit.index], grad_of(unit), out_of(unit), hyper_of(unit), grad_scale)
                    yield unit
                    continue
                done += 1
                slot, tickets = self._reads.pop(unit.index)
                try:
                    self._wait(tickets)
                except BaseException:
                    self._free_sets.append(slot)  # nothing was read into it that anyone will use
                    raise
                bufs = self._set_views(slot, unit)
                try:
                    self._adam(unit, bufs, grad_of(unit), out_of(unit), hyper_of(unit), grad_scale)
                    writes = self._io(unit, bufs, "optimizer-write")
                except BaseException:
                    self._free_sets.append(slot)  # [Note: NVMe optimizer pipeline]: the set comes back
                    raise
                self._writing.append((slot, writes))
                yield unit
            completed = True
        finally:
            if drain or not completed:  # after an error every write is waited, and the error raised
                self._drain_writes()

    @owned(UPDATER)
    def finish(self) -> None:
        """Wait for the NVMe write-backs still in flight; raise the first error."""
        self._drain_writes()

    @owned(UPDATER)
    def prefetch(self, unit: Unit) -> None:
        """NVMe state: start reading `unit`'s state now if a staging set is free (never waits)."""
        if self.locs[unit.index] is Location.NVME and unit.index not in self._reads:
            self._issue_read(unit, block=False)

    @owned(UPDATER)
    def _adam(self, unit: Unit, raw: dict, grad, out, hypers: Sequence[Hyper], grad_scale: float) -> None:
        """[Note: parameters without a gradient] Each parameter keeps its own step count and
        hyper-parameters, as in torch. When every parameter of the unit got a gradient and their
        counts and hyper-parameters agree (always, unless data-dependent control flow skipped one
        or the unit's parameters are in different param groups), one pass updates the whole
        shard. Otherwise the parameters' slices of the shard are updated, each with its own count
        and hyper-parameters (adjacent slices that share them as one range; on the CPU, all of
        them in one native call), and the slices of parameters without a gradient are left as
        they are (their new low-precision output is the cast of the unchanged master). `raw`: the
        unit's state buffers ([Note: optimizer state layout])."""
        self.applied += 1  # from here on the unit's state may differ from before the step
        got = self._got.pop(unit.index, None)
        steps = self.steps[unit.index]
        for k in range(len(steps)):
            if got is None or k in got:
                steps[k] += 1
        n, layout = unit.shard_numel, self.layout.for_unit(unit)
        master, exp_avg, exp_avg_sq = (layout.typed(k, raw[k], n) for k in STATE_KEYS)
        if grad.device != master[0].device:
            grad = grad.to(master[0].device)
        prof = self.profiler
        span = prof.compute_begin("optimizer" if master[0].device.type == "cpu" else "device-optimizer",
                                  label=unit.key, numel=unit.numel) if prof is not None else None
        if got is None and len(set(steps)) == 1 and len(set(hypers)) == 1:
            self._adam_ranges(unit, master, exp_avg, exp_avg_sq, grad, out, [(0, n, steps[0], hypers[0])],
                              grad_scale)
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
            self._adam_ranges(unit, master, exp_avg, exp_avg_sq, grad, out, ranges, grad_scale)
        if span is not None:
            prof.compute_end(span)

    def _adam_ranges(self, unit: Unit, master, exp_avg, exp_avg_sq, grad, out, ranges, grad_scale: float) -> None:
        """Adam(W) over the slices [a, b) of the shard in `ranges` ((a, b, step, hyper) each).
        master, exp_avg, exp_avg_sq: (values, tail) pairs, StateLayout.typed's views ([Note:
        optimizer state layout]); on the CPU `cpu_adam_ranges` (state_layout.py) runs them, bf16
        masters, int8 runs and fp32 ranges ([Note: small parameters keep fp32 moments]) included;
        on an accelerator the state is fp32."""
        if not ranges:
            return
        common = dict(bias_correction=self.cfg.bias_correction, grad_scale=grad_scale)
        (master, _), (exp_avg, avg_absmax), (exp_avg_sq, sq_absmax) = master, exp_avg, exp_avg_sq
        if master.device.type == "cpu":  # `out` is host memory too (ParamStore.out_buffer): one native call
            cpu_adam_ranges(unit.index, unit.shard_lo, (master, None), (exp_avg, avg_absmax),
                            (exp_avg_sq, sq_absmax), grad, out, ranges, simd=self.cfg.simd, threads=self.threads,
                            layout=self.layout.for_unit(unit), **common)
            return
        for a, b, step, h in ranges:  # fp32 state (the constructor refuses compact state on an accelerator)
            kwargs = dict(step=step, lr=h.lr, beta1=h.beta1, beta2=h.beta2, eps=h.eps, weight_decay=h.weight_decay,
                          decoupled=h.decoupled, **common)
            part = None if out is None else out[a:b]
            if master.is_cuda and self.cfg.bias_correction:  # torch's fused kernel: one pass, no sync
                _fused_adam(master[a:b], exp_avg[a:b], exp_avg_sq[a:b], grad[a:b], part, keep_grad=self._keep_grads,
                            **kwargs)
            else:  # optimizer state on the accelerator: the same math in torch ops
                _kernels.adam_step_reference(master[a:b], exp_avg[a:b], exp_avg_sq[a:b], grad[a:b], param_out=part,
                                             **kwargs)

    # ------------------------------------------------------------------ NVMe pipeline

    def _make_sets(self) -> None:
        largest = {k: max(self.layout.for_unit(u).nbytes(k, u.shard_numel) for u in self._nvme_units)
                   for k in STATE_KEYS}
        self._sets = [{k: self.host_pool.alloc(largest[k], torch.uint8, f"optimizer staging {k}")
                       for k in STATE_KEYS} for _ in range(self.depth)]
        self._free_sets.extend(range(self.depth))

    def _take_set(self, block: bool) -> int | None:
        if not self._sets:
            self._make_sets()
        while self._writing and all(t.done() for t in self._writing[0][1]):
            self._retire_write()
        if self._free_sets:
            return self._free_sets.popleft()
        if not block:
            return None
        self._retire_write()  # the oldest write-back must land before its set is reused
        return self._free_sets.popleft()

    def _retire_write(self) -> None:
        slot, tickets = self._writing.popleft()
        self._free_sets.append(slot)
        self._wait(tickets)

    def _issue_read(self, unit: Unit, block: bool) -> None:
        slot = self._take_set(block)
        if slot is None:
            return
        try:
            self._reads[unit.index] = (slot, self._io(unit, self._set_views(slot, unit), "optimizer-read"))
        except BaseException:
            self._free_sets.append(slot)
            raise

    def _set_views(self, slot: int, unit: Unit) -> dict:
        """The set's blocks as this unit's state: pool buffers sized to the shard, padded room after."""
        layout = self.layout.for_unit(unit)
        return {k: buf.tensor[: layout.nbytes(k, unit.shard_numel)] for k, buf in self._sets[slot].items()}

    def _io(self, unit: Unit, bufs: dict, reason: str) -> list:
        """Submit reads or writes of a unit's three state tensors; tickets carry profiler info."""
        read = reason == "optimizer-read"
        tickets = []
        try:
            for k in STATE_KEYS:
                tickets.append(self.store.read(self._key(unit, k), bufs[k], padded=True) if read
                               else self.store.write(self._key(unit, k, update=True), bufs[k]))
        except BaseException:  # refused at submit (a full drive's fallocate): the set's I/O ends first
            for t in tickets:
                try:
                    t.wait()
                except BaseException:  # noqa: BLE001 - the submit's error is the one raised
                    pass
            raise
        if self.profiler is None:
            return tickets
        start = time.perf_counter_ns()
        src, dst = ("nvme", "host") if read else ("host", "nvme")
        layout = self.layout.for_unit(unit)
        return [_Profiled(t, f"{unit.key}.{k}", k, src, dst, layout.nbytes(k, unit.shard_numel), reason, start)
                for t, k in zip(tickets, STATE_KEYS)]

    def _wait(self, tickets: list) -> None:
        """Wait for every ticket (even after a failure), then raise the first error."""
        prof = self.profiler
        prof = prof if tickets and isinstance(tickets[0], _Profiled) else None  # place(): plain store tickets
        token = prof.wait_begin(tickets[0].name) if prof is not None else None
        first = None
        for t in tickets:
            try:
                t.wait()
            except BaseException as exc:  # noqa: BLE001 - re-raised below, after the rest landed
                first = first or exc
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
        for slot, tickets in reads.values():
            try:
                self._wait(tickets)
            except Exception:  # noqa: BLE001 - see the docstring
                pass
            finally:
                self._free_sets.append(slot)

    # ------------------------------------------------------------------ access

    def read_state(self, unit: Unit, keys: tuple[str, ...] = STATE_KEYS,
                   encoded: bool = False) -> dict[str, torch.Tensor]:
        """fp32 `keys` (master, exp_avg, exp_avg_sq) of a unit's shard: the live tensors for fp32 state
        on host or device, else fp32 copies on the CPU (decoded: [Note: optimizer state layout]).
        With `encoded`: CPU copies of the layout's own buffers (what write_state(encoded=True) takes)."""
        n, layout = unit.shard_numel, self.layout.for_unit(unit)
        if self.locs[unit.index] is not Location.NVME:
            raw = self._state[unit.index]
            if encoded:
                return {k: raw[k][: layout.nbytes(k, n)].to("cpu", copy=True) for k in keys}
            if layout.exact:
                return {k: layout.typed(k, raw[k], n)[0] for k in keys}
            return {k: layout.decode(k, raw[k].cpu(), n) for k in keys}
        out = {}
        for k in keys:
            raw = torch.empty(layout.nbytes(k, n), dtype=torch.uint8)
            self.store.read(self._key(unit, k), raw).wait()
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
            n, layout = unit.shard_numel, self.layout.for_unit(unit)
            loc = self.locs[unit.index]
            if loc is Location.HOST:
                return self._state[unit.index], []
            bufs = {k: aligned_empty(layout.nbytes(k, n), alignment)[: layout.nbytes(k, n)]
                    for k in STATE_KEYS}
            if loc is Location.NVME:
                return bufs, [self.store.read(self._key(unit, k), bufs[k], padded=True) for k in STATE_KEYS]
            for k in STATE_KEYS:
                bufs[k].copy_(self._state[unit.index][k])
            return bufs, []

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
        """Replace the state tensors in `state` (master, exp_avg, exp_avg_sq: any of them) of a unit
        and its parameters' step counts (one int: all of them), wherever they live; the keys not in
        `state` are kept. The tensors are fp32 CPU tensors of the shard's size, stored in the
        layout's dtypes (round to nearest, int8 re-blocked), or with `encoded` the layout's own
        buffers (`layout.nbytes(key, n)` uint8 each, as iter_state yields them), stored as they are."""
        unknown = set(state) - set(STATE_KEYS)
        if unknown:
            raise ValueError(f"write_state: unknown state keys {sorted(unknown)} (known: {STATE_KEYS})")
        self.drop_prefetched()
        self.steps[unit.index] = [steps] * len(unit.params) if isinstance(steps, int) else list(steps)
        keys = [k for k in STATE_KEYS if k in state]
        n, layout = unit.shard_numel, self.layout.for_unit(unit)
        on_nvme = self.locs[unit.index] is Location.NVME
        for k in keys:
            live = None if on_nvme else self._state[unit.index][k]
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
            if on_nvme:
                self.store.write(self._key(unit, k), raw).wait()

    def close(self) -> None:
        """Finish NVMe I/O in flight and give the staging sets back (the state stays readable). Idempotent."""
        try:
            self.drop_prefetched()
            self._drain_writes()
        except Exception:  # noqa: BLE001 - closing: errors were reported by the step that caused them
            pass
        sets, self._sets = self._sets, []
        self._free_sets.clear()
        for staging in sets:
            for block in staging.values():
                self.host_pool.free(block)


# [Note: the fused kernel reads the gradient in place]
# torch's fused Adam(W) kernel takes the gradient scale as a tensor it *divides* by, and
# writes the quotient back into the gradient. So zerotier passes 1 / grad_scale and the
# fp32 gradient shard is read in place, with no scaled copy on the device (GPU review N13;
# torch.optim.AdamW(fused=True) under a GradScaler does the same). found_inf stays None:
# the engine skips an overflowed step before calling the optimizer. The shard then holds
# grad x grad_scale, which is harmless where the step consumes it (the window's gradients
# are dropped after it); an early step's gradient is read again (the window's norm, p.grad),
# so there `keep_grad` makes a scaled copy instead. A copy (that one, or the fp32 cast of a
# low-precision gradient, which the kernel cannot read) is made CAST_CHUNK elements at a
# time: at most `fused_temp_bytes()` on the device, which the planner counts.
CAST_CHUNK = 1 << 22  # elements of a gradient cast or scaled at once: 16 MiB of fp32


def fused_temp_bytes() -> int:
    """Device bytes `_fused_adam` allocates at most (one fp32 chunk); the planner counts exactly this."""
    return 4 * CAST_CHUNK


def _fused_adam(master, exp_avg, exp_avg_sq, grad, out, *, step, lr, beta1, beta2, eps, weight_decay,
                decoupled, bias_correction, grad_scale, keep_grad=False) -> None:
    """Adam(W) with torch's fused kernel (what torch.optim.AdamW(fused=True) runs): one kernel
    over the shard, no host sync (the step count is filled on the device, not copied). An fp32
    `grad` is read in place and left scaled by `grad_scale`; see [Note: the fused kernel reads
    the gradient in place] for when a bounded copy is made instead."""
    step_t = torch.full((), float(step), dtype=torch.float32, device=master.device)
    fused = torch._fused_adamw_ if decoupled else torch._fused_adam_
    kwargs = dict(amsgrad=False, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
                  maximize=False, found_inf=None)
    if grad.dtype == torch.float32 and not (keep_grad and grad_scale != 1.0):
        divisor = None if grad_scale == 1.0 else torch.full((), 1.0 / grad_scale, dtype=torch.float32,
                                                             device=master.device)
        fused([master], [grad], [exp_avg], [exp_avg_sq], [], [step_t], grad_scale=divisor, **kwargs)
    else:
        for a in range(0, master.numel(), CAST_CHUNK):
            b = min(a + CAST_CHUNK, master.numel())
            chunk = grad[a:b].float() if grad.dtype != torch.float32 else grad[a:b].clone()
            if grad_scale != 1.0:
                chunk.mul_(grad_scale)
            fused([master[a:b]], [chunk], [exp_avg[a:b]], [exp_avg_sq[a:b]], [], [step_t], grad_scale=None,
                  **kwargs)
    if out is not None and out.data_ptr() != master.data_ptr():
        out.copy_(master)


class _StagedGrads:
    """grad_of for an optimizer over device gradients or NVMe gradient files ([Note: device gradients,
    host optimizer]): called for the units in `order`, returns each one's shard in a host-pool block,
    the copy or read of the next unit already issued. A block is freed when the next unit is asked
    for, or at close()."""

    def __init__(self, order: list[Unit], grad_of: Callable[[Unit], object], device_tier,
                 host_pool, profiler=None):
        self._next = {a.index: b for a, b in zip(order, order[1:])}
        self._grad_of, self._device_tier, self._host_pool = grad_of, device_tier, host_pool
        self._profiler = profiler
        self._staged: dict[int, tuple] = {}  # unit index -> (pool block, copy or read ticket)
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
                    ticket = _Profiled(ticket, grad.key, "grad", "nvme", "host", nbytes, "optimizer-read", start)
            else:
                ticket = self._device_tier.copy_d2h(block.tensor, grad)
        except BaseException:
            self._host_pool.free(block)
            raise
        self._staged[unit.index] = (block, ticket)

    def __call__(self, unit: Unit) -> torch.Tensor:
        if self._current is not None:  # the previous unit's Adam is done with its block
            self._host_pool.free(self._staged.pop(self._current)[0])
        self._issue(unit)
        nxt = self._next.get(unit.index)
        if nxt is not None:
            self._issue(nxt)  # overlaps this unit's Adam
        self._current = unit.index
        block, ticket = self._staged[unit.index]
        ticket.wait()
        if isinstance(ticket, _Profiled):
            ticket.record(self._profiler)
        return block.tensor

    def close(self) -> None:
        """Wait for the copies and reads still in flight and give their blocks back; an error of one
        no unit asked for is dropped (the next step reads afresh)."""
        for block, ticket in self._staged.values():
            try:
                ticket.wait()
            except Exception:  # noqa: BLE001 - see the docstring
                pass
            self._host_pool.free(block)
        self._staged.clear()
