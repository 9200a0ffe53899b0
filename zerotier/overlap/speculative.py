"""When the window's update may run during backward before the global check allows it, and what
undoes it: `train.overlap = "speculative"` and "auto" (the default), and the undo log.

[Note: speculative step]
With clipping (train.max_grad_norm) or a dynamic loss scale, no unit may be updated before the
global gradient norm is known, which is after the last gradient of the window. Speculation
(SuperOffload's speculation-then-validation) updates each unit anyway, during the window's last
backward, as soon as its gradient is final ([Note: early step] in overlap/early.py: the same hook,
the same optimizer thread), with clip coefficient 1 and no overflow assumed, and keeps what an exact
undo needs in its log (UndoLog.speculate: each of the unit's state homes' `undoable()`, tiers/homes.py;
the optimizer's `rewind` restores them):
  * NVMe state: the pre-step files. The update writes the unit's other file set (NVMeHome.writes_to,
    the twin of each file); the commit makes it current. No copy is made;
    the drive holds a second set of the state files (shadow_bytes, which the plan counts in the
    NVMe budget).
  * host or device state: an undo copy of the unit's state buffers, on the state's own tier,
    within the plan's allowance (`plan.speculation_undo_bytes`); a unit whose copy does not fit
    is updated after the check, as without speculation. Only with "speculative": the copy reads and
    writes the unit's whole state once more on the optimizer thread (12 B/param each way at
    fp32), which on an H200 with the optimizer on host made a 1.3B step slower, not faster
    (1176 ms with speculation at --clip 100 vs 781 ms without clipping or speculation; the undo
    copies also took 15 GB more RSS). `auto` speculates NVMe-state units only.
  * the new low-precision parameters wait in a write-back buffer (ParamStore.staged_out), never
    in the parameters' home, so no forward, state_dict or weight read sees them before the
    check (they count in the same allowance).
engine.step() computes the norm as always, then validates: the speculated updates stand when the
step would have used exactly what they used — clip factor exactly 1 (train.max_grad_norm's and a
user's clip_grad_norm_'s), a finite norm, the same loss scale and each parameter's same
hyper-parameters (an lr changed between backward and step). Commit: each unit's new parameters
are sent home (ParamStore.commit: the version bump that publishes them) and its NVMe file set
flips. Otherwise every speculated unit is rolled back (state copied back, step counts restored,
shadow files ignored, write-back buffers dropped) and the step runs as without speculation: the
true coefficient, or skipped on overflow. Either way the result is bitwise the non-speculative
step's: the same kernel runs on the same bytes with the same scalars (grad_scale = factor /
loss scale, and factor == 1.0 exactly on commit).

A call that changes the window after a speculated update (zero_grad, p.grad = ..., another
backward of the same micro-batch, a checkpoint or an optimizer state_dict, engine.synchronize)
cancels the speculation first (Speculative.cancel): roll back, the gradients reopened;
so unlike train.early_step nothing the user does is refused. A failure during the window
(I/O error, Ctrl-C) rolls back too: the window is PARTIAL, not BROKEN.

When it pays: when the update after backward is on the critical path, i.e. the optimizer lives
off the accelerator (CPU Adam, NVMe reads and writes), and clipping rarely fires (after warm-up,
usually well under 1 % of steps). It costs the undo copies (memory bandwidth on the optimizer
thread, hidden under backward) and, on a rollback, the restore plus the normal update again.
`auto` (the default) turns it on when clipping or a dynamic scale is set (for NVMe-state units:
the undo costs no copy there), pauses it after
PAUSE_AFTER rollbacks in a row (clipping that fires every step, as in warm-up, makes every
speculation wasted work), and tries again after a pause that doubles each time (PAUSE_STEPS up
to MAX_PAUSE_STEPS); "speculative" always speculates; "none" (and every other policy) never.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable

from .. import threads
from ..state import Location, Unit
from .base import OverlapPolicy

PAUSE_AFTER = 3         # rollbacks in a row before auto pauses: one is noise, three is a regime
PAUSE_STEPS = 16        # optimizer steps without speculation after the first pause
MAX_PAUSE_STEPS = 1024  # the pause doubles after each failed retry, up to this


class SpeculationPolicy:
    """Whether the next window speculates ([Note: speculative step]); fed each window's outcome."""

    def __init__(self, mode: "bool | str", clipping: bool, dynamic_scale: bool):
        self.mode = mode
        self.useful = clipping or dynamic_scale  # without either, train.early_step is the exact, copy-free way
        self.in_a_row = 0      # rollbacks in a row
        self.paused_for = 0    # optimizer steps left in the current pause
        self.pause = PAUSE_STEPS
        self.windows = 0       # windows speculated
        self.rollbacks = 0     # of which rolled back

    def wanted(self) -> bool:
        if self.mode is True:
            return True
        if self.mode is False or not self.useful:
            return False
        return self.paused_for == 0

    def outcome(self, rolled_back: "bool | None") -> None:
        """After each optimizer step: True / False when the window speculated, None when it did not."""
        if rolled_back is None:
            self.paused_for = max(0, self.paused_for - 1)
            return
        self.windows += 1
        if not rolled_back:
            self.in_a_row, self.pause = 0, PAUSE_STEPS
            return
        self.rollbacks += 1
        self.in_a_row += 1
        if self.mode == "auto" and self.in_a_row >= PAUSE_AFTER:
            self.paused_for = self.pause
            self.pause = min(2 * self.pause, MAX_PAUSE_STEPS)
            self.in_a_row = PAUSE_AFTER - 1  # a failed retry pauses again at once

    @property
    def rollback_rate(self) -> float:
        return self.rollbacks / self.windows if self.windows else 0.0


def undo_bytes(state_bytes: int, shard_numel: int, lp_itemsize: int) -> int:
    """Bytes of one host- or device-resident unit's undo copy ([Note: speculative step]): its state
    buffers (`state_bytes`, their sum: OptStateStore.key_bytes) and its new low-precision shard's
    old bytes, in the host pool (host state) or on the device tier (device state)."""
    return state_bytes + shard_numel * lp_itemsize


def shadow_bytes(key_bytes: Iterable[int], alignment: int) -> int:
    """NVMe bytes of one NVMe-resident unit's speculative state files ([Note: speculative step]):
    the pre-step files stay until the step is validated, so the new ones are a second copy, a file
    per state buffer (`key_bytes`: OptStateStore.key_bytes) rounded up to `alignment`."""
    return sum(-(-nbytes // alignment) * alignment for nbytes in key_bytes)


@dataclass
class _Undo:
    """What undoes one speculated unit's update."""

    tier: Location          # where `held` bytes are counted (the allowance's tier: the home's memory_tier)
    held: int               # undo copies + the parameters' write-back buffer
    undos: list             # each state home's Undo (Home.undoable: an undo copy, or the NVMe file's twin)
    steps: list[int]        # the parameters' step counts before the update
    applied: int            # UnitOptimizer.applied before it


class UndoLog:
    """What undoes this window's speculated updates ([Note: speculative step]): each speculated
    unit's homes' Undo records (undo copies of host and device state, the current one of each NVMe
    file's two versions). Its state is the updater's, as the optimizer's ([Note: thread ownership]
    in threads.py)."""

    def __init__(self, optimizer, allowance: "dict[str, int]", copies: bool):
        """allowance: undo bytes a window may hold, by tier ("host", "device": the plan's
        speculation_undo_bytes). copies: host/device state may be speculated (train.overlap
        = "speculative"); without, NVMe-state units only."""
        self.optimizer = optimizer
        self.allowance = {Location.HOST: allowance["host"], Location.DEVICE: allowance["device"]}
        self.copies = copies
        self._held = {Location.HOST: 0, Location.DEVICE: 0}
        self._undo: dict[int, _Undo] = {}  # speculated units of this window: what undoes them

    def _updater(self, what: str) -> None:
        if threads.CHECK:
            threads.check(self.optimizer, threads.UPDATER, f"UndoLog.{what}")

    def speculate(self, unit: Unit, out_bytes: int) -> bool:
        """Make `unit`'s next update undoable, if the window's allowance holds its undo: host or
        device state is copied aside (the undo copy), NVMe state keeps its files (the update writes
        the other set). `out_bytes`: the bytes of the write-back buffer the speculated parameters
        wait in until commit, held on the state's memory tier (0: they wait where they would
        anyway). False: the unit is updated after the window's check instead."""
        self._updater("speculate")
        opt = self.optimizer
        slot = opt.state.slots[unit.index]
        if slot.kind.in_memory and not self.copies:
            return False
        tier = slot.kind.memory_tier
        need = out_bytes + (slot.layout.state_bytes(unit.shard_numel) if slot.kind.in_memory else 0)
        if self._held[tier] + need > self.allowance[tier]:
            return False
        undos = [home.undoable() for home in slot.homes.values()]
        self._held[tier] += need
        self._undo[unit.index] = _Undo(tier, need, undos, list(opt.state.steps[unit.index]), opt.applied)
        return True

    @property
    def speculated(self) -> list[int]:
        """Indices of the units speculated in this window."""
        return list(self._undo)

    def copy_bytes(self) -> int:
        """Bytes copied aside for this window's undo copies."""
        return sum(undo.held for u in self._undo.values() for undo in u.undos)

    def commit(self) -> None:
        """The window's check agreed: the speculated updates stand. Their NVMe writes must have
        landed (the caller waited: the optimizer's `finish()`); each unit's new file set becomes current."""
        self._updater("commit")
        for undo in self._undo.values():
            for home_undo in undo.undos:
                home_undo.commit()
            self._held[undo.tier] -= undo.held
        self._undo.clear()

    def roll_back(self) -> int:
        """The window's check disagreed: every speculated unit gets its state and step counts back,
        exactly (UnitOptimizer.rewind). Returns the bytes moved (memory restores)."""
        self._updater("roll_back")
        opt = self.optimizer
        # the count before the window's first speculated update (some may not have begun)
        applied = min((undo.applied for undo in self._undo.values()), default=opt.applied)
        moved = opt.rewind({index: (undo.undos, undo.steps) for index, undo in self._undo.items()}, applied)
        for undo in self._undo.values():
            self._held[undo.tier] -= undo.held
        self._undo.clear()
        return moved


class Speculative(OverlapPolicy):
    """`train.overlap = "speculative"` (always, with undo copies of host and device state) and, as
    AutoSpeculative, "auto": [Note: speculative step]. Holds the window's UndoLog."""

    name = "speculative"
    speculates: "bool | str" = True

    def __init__(self, rt, window, optimizer):
        super().__init__(rt, window, optimizer)
        # the plan resolved the mode for this placement ([Note: speculation in the plan] in planner/speculation_plan.py)
        mode = self.speculates if rt.plan.speculative else False
        self.speculation = SpeculationPolicy(mode, rt.settings.cfg.train.max_grad_norm is not None, rt.scaler.dynamic)
        self.undo = UndoLog(rt.unit_optimizer, rt.plan.speculation_undo_bytes, copies=self.speculates is True)
        self._speculating = False           # this window's last backward updates units speculatively
        self._spec_hyper: dict[int, list] = {}  # unit index -> the Hyper its speculated update used
        self._spec_scale = 1.0              # the gradient scale speculated updates used (1 / loss scale)
        self._rollback_started: tuple | None = None  # a rollback's (start, units, undo bytes, bytes moved)

    def on_unit_final(self, last_micro: bool):
        e = self.rt
        if last_micro and not e.sharding.active and self.speculation.wanted():
            self._speculating = True
            self._spec_scale = 1.0 / e.scaler.scale
            return self._start
        return super().on_unit_final(last_micro)

    def _start(self, unit) -> None:
        """Update `unit` on the optimizer thread with clip coefficient 1, undoably, while backward goes
        on; its new parameters wait in a staged write-back buffer until engine.step() validates the
        window. A unit whose undo does not fit the allowance only has its NVMe state reads started."""
        e, scale = self.rt, self._spec_scale

        def update(hypers):
            e.unit_optimizer.state.prefetch(unit)  # NVMe: its read, and [Note: the last final unit's read]
            if not self.undo.speculate(unit, e.params.staged_out_bytes(unit)):
                return
            self._spec_hyper[unit.index] = hypers.of(unit.index)
            e.unit_optimizer.update([unit], e.grads, e.params, hypers, scale, drain=False, keep_grads=True,
                                    speculative=True)
        self.on_optimizer_thread(unit, update)

    def started(self) -> bool:
        return False if self._speculating else super().started()  # speculated updates are undone on demand

    def cancel(self) -> None:
        """A call that changes the window after speculated updates (another backward, zero_grad,
        p.grad = ..., engine.synchronize: checkpoints, state_dicts): wait for them, undo them, reopen
        the window's gradients. Nothing if the window did not speculate."""
        if not self._speculating:
            return
        self._speculating = False
        self.wait()
        self._roll_back()
        self.rt.grads.reopen()

    def _roll_back(self) -> int:
        """Undo every speculated update of the window (after its futures were waited); the staged
        parameters are dropped (the redo, if any, writes them again). Returns bytes moved."""
        e = self.rt
        indices = self.undo.speculated
        moved = self.undo.roll_back()
        for i in indices:
            e.params.drop_out(e.units[i])
        self._spec_hyper.clear()
        return moved

    def _validate(self, factor: float, overflow: bool) -> "tuple[set[int], bool | None]":
        """After the window's norm: commit the speculated updates if the step would have made exactly
        them, else roll them back. Returns (units committed, rolled back?: None when nothing was
        speculated) and reports to the profiler."""
        e = self.rt
        if not self._speculating:
            return set(), None
        self._speculating = False
        indices = self.undo.speculated
        if not indices:
            return set(), None
        hypers = self.optimizer.hyper_table()
        valid = (not overflow and factor == 1.0 and self._spec_scale == 1.0 / e.scaler.scale
                 and all(hypers.of(i) == self._spec_hyper.get(i) for i in indices))
        undo_bytes = self.undo.copy_bytes()
        prof = e.profiler
        if valid:
            for i in indices:
                e.grads.stepped(e.units[i])
                e.params.commit(e.units[i])
            self.undo.commit()
            self._spec_hyper.clear()
            if prof is not None:
                prof.speculation(len(indices), 0, undo_bytes, 0, 0.0)
            return set(indices), False
        start = time.perf_counter()
        moved = self._roll_back()
        opt = e.unit_optimizer
        moved += sum(opt.layout.state_bytes(e.units[i].shard_numel) for i in indices
                     if opt.state.on_nvme(e.units[i]))  # read again for the redo
        self._rollback_started = (start, len(indices), undo_bytes, moved)
        return set(), True

    def _outcome(self, rolled_back: "bool | None") -> None:
        """The window's outcome to the auto policy and, for a rollback, to the profiler: units, bytes,
        and the seconds from the rollback to the end of the redone update."""
        self.speculation.outcome(rolled_back)
        if not rolled_back:
            return
        start, units, undo_bytes, moved = self._rollback_started
        prof = self.rt.profiler
        if prof is not None:
            prof.speculation(units, units, undo_bytes, moved, time.perf_counter() - start)

    def skip(self, factor: float) -> None:
        _, rolled_back = self._validate(factor, overflow=True)
        self._outcome(rolled_back)

    def apply(self, pending: list, grad_scale: float, factor: float) -> None:
        e = self.rt
        committed, rolled_back = self._validate(factor, overflow=False)
        e.unit_optimizer.update([u for u in pending if u.index not in committed], e.grads, e.params,
                                self.optimizer.hyper_table(), grad_scale)
        self._outcome(rolled_back)
        e.params.finish_commits()  # ZeRO-1/2: the new parameter shards reach every rank

    def _undo_window(self) -> None:
        if self._speculating:  # undone, so the failure leaves no unit updated
            self._speculating = False
            self._roll_back()


class AutoSpeculative(Speculative):
    """`train.overlap = "auto"` (the default): speculates NVMe-state units, where the undo is the old
    files, when clipping or a dynamic loss scale is set; pauses after rollbacks in a row."""

    name = "auto"
    speculates = "auto"
