"""What every checkpoint of an engine carries besides the training state: its lr scheduler and the
user's registered objects (a data position, a sampler). Saved by save_checkpoint, by the checkpoint
train.checkpoint_on_signal writes and by ZerotierTrainer's; restored by load_checkpoint.

    engine.set_lr_scheduler(torch.optim.lr_scheduler.LambdaLR(engine.optimizer, warmup))
    engine.register_for_checkpointing(data_position)   # anything with state_dict() / load_state_dict()

[Note: what a checkpoint carries]
A checkpoint can be written inside engine.step() (a graceful stop: [Note: graceful stop] in
stop.py), right after the update, before the loop's code that follows step() runs. So:
  - the engine's lr scheduler (set_lr_scheduler, as DeepSpeed's initialize(lr_scheduler=)) is
    stepped by the engine right after each update (not after a skipped one: an fp16 overflow),
    before any checkpoint: the loop must not call its step() too. A scheduler the loop steps
    after engine.step() would be saved one step behind there, so register_for_checkpointing
    refuses lr schedulers over engine.optimizer;
  - registered objects are saved as they are then, in the order registered (accelerate's
    register_for_checkpointing): advance them before step() (a data position when the batch is
    taken, as a stateful data loader does). A stop requested between steps then waits for the end
    of the next step, not its forward (one rank: [Note: graceful stop]): by the forward the loop
    has advanced them for its batch already. load_checkpoint restores them in that order; the same
    number of objects of the same types must be registered (a checkpoint whose objects an engine
    with none registered would drop is loaded with a warning, as is one whose lr scheduler state an
    engine with none set, and no lr_scheduler=, would drop: checkpoint_load.load).
Their states are data (checked at save as client_state is: [Note: checkpoints hold data]).
"""
from __future__ import annotations

import warnings

from .errors import ZerotierError


def _stateful(obj) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _scheduler_over(obj, optimizer) -> bool:
    return callable(getattr(obj, "step", None)) and getattr(obj, "optimizer", None) is optimizer


class Carried:
    """An engine's lr scheduler and registered objects ([Note: what a checkpoint carries])."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.lr_scheduler = None
        self.objects: list = []

    def set_lr_scheduler(self, scheduler) -> None:
        if self.lr_scheduler is not None:
            raise ZerotierError("engine.set_lr_scheduler: this engine has an lr scheduler already; one per engine")
        if not (_stateful(scheduler) and _scheduler_over(scheduler, self.optimizer)):
            raise ZerotierError(f"engine.set_lr_scheduler({type(scheduler).__name__}): needs an lr scheduler built "
                                "over engine.optimizer (with step(), state_dict() and load_state_dict()), e.g. "
                                "torch.optim.lr_scheduler.LambdaLR(engine.optimizer, fn)")
        if type(scheduler).__name__ == "ReduceLROnPlateau":
            raise ZerotierError("engine.set_lr_scheduler(ReduceLROnPlateau): its step() needs a metric, so the engine "
                                "cannot step it: step it in your loop and pass it to engine.save_checkpoint / "
                                "load_checkpoint(lr_scheduler=...)")
        self.lr_scheduler = scheduler
        self._steps = getattr(scheduler, "_step_count", None)  # torch's count of its step() calls

    def register(self, objects) -> None:
        for obj in objects:
            if not _stateful(obj):
                raise ZerotierError(f"engine.register_for_checkpointing({type(obj).__name__}): it has no state_dict() "
                                    "and load_state_dict(); register objects that have both")
            if _scheduler_over(obj, self.optimizer):
                raise ZerotierError(
                    f"engine.register_for_checkpointing({type(obj).__name__}): an lr scheduler over engine.optimizer "
                    "is stepped by the loop after engine.step(), so a checkpoint written inside engine.step() "
                    "(train.checkpoint_on_signal) would hold it one step behind. Give it to the engine instead: "
                    "engine.set_lr_scheduler(scheduler) (the engine steps it after every update: remove your "
                    "scheduler.step() call), and every checkpoint carries it")
        self.objects.extend(objects)

    def stepped(self) -> None:
        """An update was applied (the optimizer step count moved on)."""
        scheduler = self.lr_scheduler
        if scheduler is None:
            return
        if self._steps is not None and getattr(scheduler, "_step_count", None) != self._steps:
            raise ZerotierError(f"the engine's lr scheduler ({type(scheduler).__name__}) was stepped outside the "
                                "engine: engine.set_lr_scheduler hands its stepping to the engine, which steps it "
                                "after every update; remove the loop's scheduler.step() call")
        scheduler.step()
        self._steps = getattr(scheduler, "_step_count", None)

    def states(self) -> list[dict]:
        """What save_checkpoint writes for the registered objects (state.pt's "registered")."""
        return [{"type": type(obj).__name__, "state": obj.state_dict()} for obj in self.objects]

    def check(self, saved: list[dict], ckpt) -> None:
        """Before anything loads: `saved` (the checkpoint's) can be restored into the registered objects."""
        ours = [type(obj).__name__ for obj in self.objects]
        theirs = [s["type"] for s in saved]
        if not ours and theirs:
            warnings.warn(f"load_checkpoint({ckpt}): the checkpoint carries the state of {len(theirs)} registered "
                          f"object(s) ({', '.join(theirs)}) but none is registered with this engine, so they are not "
                          "restored: call engine.register_for_checkpointing(...) with the same objects before "
                          "load_checkpoint to resume them", stacklevel=4)
        elif ours != theirs:
            raise ZerotierError(f"checkpoint {ckpt} carries registered objects {theirs} but this engine has {ours} "
                                "registered: register the same objects in the same order (engine."
                                "register_for_checkpointing) before load_checkpoint (nothing was loaded)")

    def restore(self, saved: list[dict]) -> None:
        """After load_checkpoint restored the rest (the lr scheduler included)."""
        for obj, s in zip(self.objects, saved):
            obj.load_state_dict(s["state"])
        if self.lr_scheduler is not None:  # its step count is the checkpoint's now
            self._steps = getattr(self.lr_scheduler, "_step_count", None)
