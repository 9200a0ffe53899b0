"""The overlap seam: what of a window's update runs outside engine.step()'s own path, on the
optimizer thread, and what the window must wait for, undo or refuse because of it.

[Note: overlap policies]
One policy object per engine (`train.overlap`, chosen once by `policy_for`, overlap/__init__.py)
serves the Window (engine/window.py), which keeps the window's state, its norm and its
refusals and asks the policy at each point where an update may already be running. A policy
receives the runtime record (`rt`: the stores, tiers, scaler, sharding, profiler and config,
[Note: the runtime record] in engine/runtime.py), its window and engine.optimizer (the
hyper-parameters an update uses), never the Engine:

  on_unit_final(last_micro)   this backward's use of each unit's complete gradient (or None)
  refuses(call)               a call the window's started update cannot honour: the message, or None
  cancel()                    a call changes the window: speculated updates undone
  before_norm()               the norm reads every gradient: updates started during backward waited
  before_update() / skip() / apply(pending, grad_scale, factor)   the window's step
  quiesce() / failure()       an error reaches the caller: nothing may still run; does it break the engine?
  on_forward / before_read / publish / master_of   reads of the weights between windows
and, at the class level, for the planner and the engine's construction: `early_step` and
`speculates` (what the step-time prediction and the plan's speculation take), `refuse(cfg,
plan, world_size)` (what it cannot run, before anything is placed; what it holds is its plan term).

The base class is the machinery every policy shares: the optimizer thread ("zerotier-optim"),
the futures of the updates started during backward (`early`), the hand-over of the updater
([Note: thread ownership] in threads.py). A policy decides when a list of units is updated; the
driver does it (`UnitOptimizer.update` in optim/offload.py, with this step's HyperTable from
`engine.optimizer.hyper_table()`). Its behaviour is NoOverlap's: nothing of the update runs before the step. A new policy is one module with a
subclass and one entry in overlap/__init__.py's POLICIES.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .. import threads
from ..device import enter as enter_device

# The messages of the calls a started update cannot honour (the early step's: [Note: early step]).
STARTED = {
    "engine.backward()": (
        "engine.backward() again after a backward whose update already started (train.overlap = 'early' applies "
        "the window's update during its last backward): call engine.step() first, or set train.overlap "
        "= 'auto' (the default) to accumulate several backward() calls into one micro-batch as torch does"),
    "zero_grad()": (
        "zero_grad() after a backward whose update already started (train.overlap = 'early' applies the window's "
        "update during its last backward, so its gradients cannot be dropped any more): call engine.step() first, "
        "or set train.overlap = 'auto' (the default) to drop a window's gradients before step()"),
    "clip_grad_norm_": (
        "clip_grad_norm_ after a backward whose update already started (train.overlap = 'early' applies the "
        "window's update during its last backward, unclipped): set train.max_grad_norm instead, or set "
        "train.overlap = 'auto' (the default)"),
    "setting p.grad": (
        "p.grad set after a backward whose update already started (train.overlap = 'early' applies the window's "
        "update during its last backward): call engine.step() first, or set train.overlap = 'auto' (the default)"),
}


def wait_out(future: Future) -> "tuple[BaseException | None, KeyboardInterrupt | None]":
    """Wait for `future` whatever arrives meanwhile (a Ctrl-C is held until it is done: none of its work
    may still run once an error reached the caller). Returns its exception and the Ctrl-C held, if any."""
    interrupted = None
    while True:
        try:
            return future.exception(), interrupted
        except KeyboardInterrupt as exc:
            interrupted = exc


class OverlapPolicy:
    """[Note: overlap policies] The shared machinery, and NoOverlap's behaviour."""

    name = "none"                  # its train.overlap value
    early_step = False             # updates a unit during backward where that is exact ([Note: early step])
    speculates: "bool | str" = False  # the planner's speculation: True, "auto" or False

    def __init__(self, rt, window, optimizer):
        self.rt, self.window, self.optimizer = rt, window, optimizer
        self.surface = None  # the parameter surface, once built over the window (engine.py): Delayed gates its reads
        # The "optimizer stream": one thread running updates during backward (and a delayed update).
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zerotier-optim",
                                          initializer=enter_device, initargs=(rt.device,))
        self.early: list[Future] = []  # updates started during this backward, on that thread

    @classmethod
    def refuse(cls, cfg, plan, world_size: int) -> None:
        """What this policy cannot run here: a ZerotierError before anything is placed."""

    # ------------------------------------------------------------ backward

    def on_unit_final(self, last_micro: bool):
        """The callable this backward runs on each unit whose gradient became final, or None. Without
        overlap: the NVMe state reads start then ([Note: NVMe optimizer pipeline] in optim/offload.py)."""
        e = self.rt
        return e.unit_optimizer.state.prefetch if last_micro and not e.sharding.active else None

    def started(self) -> bool:
        """Some unit's update of this window already started and cannot be undone."""
        return bool(self.early) or self.rt.unit_optimizer.applied != self.window.applied_before

    def refuses(self, call: str) -> "str | None":
        """Why `call` (a key of STARTED) cannot be honoured now, or None."""
        return STARTED[call] if self.started() else None

    def cancel(self) -> None:
        """A call changes the window after its update began: undo what can be undone."""

    # ------------------------------------------------------------ the step

    def before_norm(self) -> None:
        self.wait()

    def before_update(self) -> None:
        """The window's norm and clip factor are known; its update comes next (or a skip)."""

    def skip(self, factor: float) -> None:
        """An overflowed step (dynamic loss scale): nothing is applied."""

    def apply(self, pending: list, grad_scale: float, factor: float) -> None:
        """The window's update of `pending` (its READY units) after the optimizer's step() ran."""
        e = self.rt
        e.unit_optimizer.update(pending, e.grads, e.params, self.optimizer.hyper_table(), grad_scale)
        e.params.finish_commits()  # ZeRO-1/2: the new parameter shards reach every rank

    def on_optimizer_thread(self, unit, update) -> None:
        """Hand `unit`'s complete gradient to the optimizer thread and run `update(hypers)` there.
        The gradient is handed over whole: the optimizer thread waits for its host adds
        (`grads.ready` -> settle), so backward never blocks on the host per unit (GPU review N8)."""
        e = self.rt
        e.grads.hand_over(unit)
        if e.device.type == "cuda":  # the gradient add above was queued on the compute stream
            done = torch.cuda.Event()
            done.record()
        else:
            done = None
        hypers = self.optimizer.hyper_table()  # this step's, read on this thread

        def run():
            if done is not None:
                done.synchronize()
            e.grads.ready(unit)
            update(hypers)
        # [Note: thread ownership]
        threads.hand(threads.OPTIMIZER, e.grads, e.params, e.unit_optimizer, e.unit_optimizer.state)
        self.early.append(self._thread.submit(run))

    def wait(self) -> None:
        """Wait for the updates started during backward and for their NVMe write-backs (left in
        flight so each unit's read overlapped the previous writes); re-raise the first error."""
        early, self.early = self.early, []
        waits = [future.result for future in early] + ([self._take_back] if early else []) + \
            ([self.rt.unit_optimizer.state.finish] if early else [])
        first = None
        for wait in waits:  # every one is waited, then the first error (from the optimizer thread) raised
            try:
                wait()
            except BaseException as exc:  # noqa: BLE001
                first = first or exc
        if first is not None:
            raise first

    def _take_back(self) -> None:
        """Every early update's future was waited: the updater's state is the compute thread's again."""
        e = self.rt
        threads.hand(threads.COMPUTE, e.grads, e.params, e.unit_optimizer, e.unit_optimizer.state)

    # ------------------------------------------------------------ errors ([Note: a step is all or nothing])

    def quiesce(self) -> None:
        """Wait for every update started during backward, whatever it raises (a second Ctrl-C
        included): none may still run once an error has reached the caller."""
        early, self.early = self.early, []
        for future in early:
            wait_out(future)
        self._take_back()
        optimizer = self.rt.unit_optimizer.state
        try:
            optimizer.finish()
        except BaseException:  # noqa: BLE001 - the error being raised already tells the story
            pass
        self._undo_window()
        optimizer.drop_prefetched()  # a retry reads afresh, never a stale failure (#24)

    def _undo_window(self) -> None:
        """quiesce(): what this window updated undoably is undone (nothing without speculation)."""

    def failure(self) -> "str | None":
        """After quiesce(): why the failure breaks the engine beyond the window's own updates, or None."""
        return None

    def applied_baseline(self) -> int:
        """UnitOptimizer.applied as a new window starts (updates in flight counted as done)."""
        return self.rt.unit_optimizer.applied

    # ------------------------------------------------------------ reads between windows

    def on_forward(self, grad_enabled: bool) -> None:
        """The root forward begins (a training forward when `grad_enabled`)."""

    def on_drop(self) -> None:
        """The window ended."""

    def before_read(self) -> None:
        """A read of the weights (a forward, a parameter's value) outside backward waits for each update
        started during the window's last backward: it sees the update whole ([Note: early step])."""
        if self.early and not self.window.in_backward:
            self.wait()

    def publish(self, what: str, force: bool = False) -> None:
        """engine.synchronize() and what calls it: an update held back is published."""

    def master_of(self, unit):
        """The fp32 master a stale unit's parameter file is rewritten from ([Note: a failed write-back])."""
        return self.rt.unit_optimizer.state.read_state(unit, ("master",))["master"]

    def shutdown(self) -> None:
        self._thread.shutdown(wait=True)
