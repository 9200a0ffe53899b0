"""When the window's update may run during backward before the global check allows it, and what
undoes it: the policy of `train.speculative_step`.

[Note: speculative step]
With clipping (train.max_grad_norm) or a dynamic loss scale, no unit may be updated before the
global gradient norm is known, which is after the last gradient of the window. Speculation
(SuperOffload's speculation-then-validation) updates each unit anyway, during the window's last
backward, as soon as its gradient is final ([Note: early step] in window.py: the same hook, the
same optimizer thread), with clip coefficient 1 and no overflow assumed, and keeps what an exact
undo needs (UnitOptimizer.speculate):
  * NVMe state: the pre-step files. The update writes the unit's other file set (`_key(...,
    shadow)`); the commit makes it current. No copy is made; the drive holds a second set of the
    state files (UnitOptimizer.shadow_bytes, which the plan counts in the NVMe budget).
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
