"""When the window's update may run during backward before the global check allows it, and what
undoes it: the policy of `train.speculative_step`, and its undo log.

[Note: speculative step]
With clipping (train.max_grad_norm) or a dynamic loss scale, no unit may be updated before the
global gradient norm is known, which is after the last gradient of the window. Speculation
(SuperOffload's speculation-then-validation) updates each unit anyway, during the window's last
backward, as soon as its gradient is final ([Note: early step] in window.py: the same hook, the
same optimizer thread), with clip coefficient 1 and no overflow assumed, and keeps what an exact
undo needs in its log (UndoLog.speculate; the optimizer offers `live_state`, `file_of` and `rewind`):
  * NVMe state: the pre-step files. The update writes the unit's other file set (UndoLog.file_of,
    the optimizer's file naming while the log lives); the commit makes it current. No copy is made;
    the drive holds a second set of the state files (shadow_bytes, which the plan counts in the
    NVMe budget).
  * host or device state: an undo copy of the unit's state buffers, on the state's own tier,
    within the plan's allowance (`plan.speculation_undo_bytes`); a unit whose copy does not fit
    is updated after the check, as without speculation. Only with `true`: the copy reads and
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
cancels the speculation first (Window.cancel_speculation): roll back, the gradients reopened;
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
to MAX_PAUSE_STEPS); `true` always speculates, `false` never.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import threads
from ..optim.state_layout import STATE_KEYS, StateLayout
from ..state import Location, Unit

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


def undo_bytes(shard_numel: int, lp_itemsize: int, layout: StateLayout = StateLayout()) -> int:
    """Bytes of one host- or device-resident unit's undo copy ([Note: speculative step]): its state
    buffers and its new low-precision shard's old bytes, in the host pool (host state) or on the
    device tier (device state)."""
    return layout.state_bytes(shard_numel) + shard_numel * lp_itemsize


def shadow_bytes(shard_numel: int, alignment: int, layout: StateLayout = StateLayout()) -> int:
    """NVMe bytes of one NVMe-resident unit's speculative state files ([Note: speculative step]):
    the pre-step files stay until the step is validated, so the new ones are a second copy."""
    return sum(-(-layout.nbytes(k, shard_numel) // alignment) * alignment for k in STATE_KEYS)


@dataclass
class _Undo:
    """What undoes one speculated unit's update."""

    tier: Location          # where `held` bytes are counted (the allowance's tier)
    held: int               # undo copies + the parameters' write-back buffer
    copies: dict            # host/device state: key -> its pre-step bytes (pool block / device tensor)
    steps: list[int]        # the parameters' step counts before the update
    applied: int            # UnitOptimizer.applied before it


def _tensor(copy) -> torch.Tensor:
    return copy if isinstance(copy, torch.Tensor) else copy.tensor


class UndoLog:
    """What undoes this window's speculated updates ([Note: speculative step]): undo copies of host
    and device state, and which of each NVMe unit's two state file sets is current. Its state is
    the updater's, as the optimizer's ([Note: thread ownership] in threads.py)."""

    def __init__(self, optimizer, device_tier, host_pool, allowance: "dict[str, int]", copies: bool):
        """allowance: undo bytes a window may hold, by tier ("host", "device": the plan's
        speculation_undo_bytes). copies: host/device state may be speculated (train.speculative_step
        = true); without, NVMe-state units only."""
        self.optimizer, self.device_tier, self.host_pool = optimizer, device_tier, host_pool
        self.allowance = {Location.HOST: allowance["host"], Location.DEVICE: allowance["device"]}
        self.copies = copies
        self._held = {Location.HOST: 0, Location.DEVICE: 0}
        self._undo: dict[int, _Undo] = {}  # speculated units of this window: what undoes them
        self._file_version = [0] * len(optimizer.units)  # which of a unit's two NVMe file sets is current
        optimizer.file_of = self.file_of

    def _updater(self, what: str) -> None:
        if threads.CHECK:
            threads.check(self.optimizer, threads.UPDATER, f"UndoLog.{what}")

    def file_of(self, unit: Unit, key: str, update: bool = False) -> str:
        """The NVMe key of `unit`'s state buffer `key`: the current file set, or for a speculated
        unit's update the other one (the pre-step files stay)."""
        version = self._file_version[unit.index] ^ (update and unit.index in self._undo)
        return f"{unit.key}.{key}" if version == 0 else f"{unit.key}.{key}~1"

    def speculate(self, unit: Unit, out_bytes: int) -> bool:
        """Make `unit`'s next update undoable, if the window's allowance holds its undo: host or
        device state is copied aside (the undo copy), NVMe state keeps its files (the update writes
        the other set). `out_bytes`: the bytes of the write-back buffer the speculated parameters
        wait in until commit, held on the state's memory tier (0: they wait where they would
        anyway). False: the unit is updated after the window's check instead."""
        self._updater("speculate")
        opt = self.optimizer
        loc = opt.locs[unit.index]
        if loc is not Location.NVME and not self.copies:
            return False
        tier = Location.HOST if loc is Location.NVME else loc
        n = unit.shard_numel
        need = out_bytes + (0 if loc is Location.NVME else opt.layout.for_unit(unit).state_bytes(n))
        if self._held[tier] + need > self.allowance[tier]:
            return False
        copies = {}
        if loc is not Location.NVME:
            live = opt.live_state(unit)
            for k in STATE_KEYS:
                if loc is Location.DEVICE:
                    copies[k] = self.device_tier.alloc(live[k].shape, torch.uint8, f"{unit.key}.{k} undo")
                else:
                    copies[k] = self.host_pool.alloc(live[k].numel(), torch.uint8, f"{unit.key}.{k} undo")
                _tensor(copies[k]).copy_(live[k])
        self._held[tier] += need
        self._undo[unit.index] = _Undo(tier, need, copies, list(opt.steps[unit.index]), opt.applied)
        return True

    @property
    def speculated(self) -> list[int]:
        """Indices of the units speculated in this window."""
        return list(self._undo)

    def copy_bytes(self) -> int:
        """Bytes copied aside for this window's undo copies."""
        return sum(_tensor(c).numel() for u in self._undo.values() for c in u.copies.values())

    def commit(self) -> None:
        """The window's check agreed: the speculated updates stand. Their NVMe writes must have
        landed (the caller waited: the optimizer's `finish()`); each unit's new file set becomes current."""
        self._updater("commit")
        for index, undo in self._undo.items():
            if self.optimizer.locs[index] is Location.NVME:
                self._file_version[index] ^= 1
            self._free(undo)
        self._undo.clear()

    def roll_back(self) -> int:
        """The window's check disagreed: every speculated unit gets its state and step counts back,
        exactly (UnitOptimizer.rewind). Returns the bytes moved (memory restores)."""
        self._updater("roll_back")
        opt = self.optimizer
        # the count before the window's first speculated update (some may not have begun)
        applied = min((undo.applied for undo in self._undo.values()), default=opt.applied)
        moved = opt.rewind({index: ({k: _tensor(c) for k, c in undo.copies.items()}, undo.steps)
                            for index, undo in self._undo.items()}, applied)
        for undo in self._undo.values():
            self._free(undo)
        self._undo.clear()
        return moved

    def _free(self, undo: _Undo) -> None:
        self._held[undo.tier] -= undo.held
        for copy in undo.copies.values():
            self.device_tier.free(copy) if isinstance(copy, torch.Tensor) else self.host_pool.free(copy)
