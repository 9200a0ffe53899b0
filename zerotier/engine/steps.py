"""Where a run is: its step counts and the id of the run they count.

[Note: the step counters]
One `StepCounter` per engine holds micro_steps (micro-batches stepped) and global_steps
(updates applied), the engine's `global_steps` / `micro_steps` read them. The window is their
one writer while training (a micro-batch, an update, a dropped window starting again at its
first micro-batch); a checkpoint load restores them, with the run id, through `restore`.
run_id names this run's checkpoints ([Note: checkpoint retention] in checkpoint.py): a
resumed run takes the id of the run it resumes.
"""
from __future__ import annotations

import secrets


class StepCounter:
    def __init__(self):
        self.micro_steps = 0
        self.global_steps = 0
        self.run_id = secrets.token_hex(8)

    def window_ends(self, accum: int) -> bool:
        """The next micro-batch is the last of its accumulation window of `accum`."""
        return (self.micro_steps + 1) % accum == 0

    def at_window_start(self, accum: int) -> bool:
        return self.micro_steps % accum == 0

    def micro_step(self) -> None:
        self.micro_steps += 1

    def update(self) -> None:
        self.global_steps += 1

    def drop_window(self, accum: int) -> None:
        """A dropped window starts again at its first micro-batch ([Note: a step is all or nothing])."""
        self.micro_steps -= self.micro_steps % accum

    def restore(self, global_steps: int, micro_steps: int, run_id: "str | None" = None) -> None:
        """A checkpoint's counts (and the run it continues, when it names one)."""
        self.global_steps, self.micro_steps = global_steps, micro_steps
        if run_id is not None:
            self.run_id = run_id
