"""The accumulation window: gradients of one or more backwards, applied by one step. Both loop
styles drive it (engine.backward()/engine.step(), and the plain loss.backward()/
optimizer.step()); its state is one `WindowState`, moved through WINDOW_TRANSITIONS only.

[Note: the plain PyTorch loop]
Besides engine.backward(loss) / engine.step() (every micro-batch; the engine divides by
grad_accum_steps and applies the loss scale), the loop PyTorch users write works:

    loss = model(x, y); (loss / accum).backward()
    if last micro-batch: engine.optimizer.step(); engine.optimizer.zero_grad()

The module's hooks drive everything, as with FSDP: the first hook of a backward the
engine did not start enters it and queues its end with autograd (releases, end of
accumulation); engine.optimizer is a real torch Optimizer whose step() applies the
accumulated gradients (clipping by train.max_grad_norm) and whose zero_grad() drops
them; lr schedulers drive its param_groups. The loop divides its own loss, so
train.grad_accum_steps plays no part. Where a plain backward cannot be exact, the
first hook raises at once, naming engine.backward: a dynamic or static loss scale
(it must multiply the loss), several ranks (the engine's backward decides when to
reduce), or engine.backward used earlier in the same window. Updates during backward
are off in this loop (no backward is known to end the window).

[Note: early step]
Opt-in (`train.early_step = true`): the update becomes visible before step(), so
zero_grad(), p.grad = ..., a user's clip_grad_norm_ or a second backward between the
window's last backward and step() cannot be honoured and are refused. Off (the
default), nothing changes before step() and the window can be dropped exactly;
measured cost of off on CPU in docs/design.md. With it on:
when no global operation stands between a gradient and its update — no
clipping, no dynamic loss scale (whose overflow check needs every gradient),
and this backward ends an accumulation window — a unit's Adam update starts on
the optimizer thread as soon as all its gradients are final (its last
post-accumulate-grad hook), overlapping the rest of backward. It is exact: the
update uses the same gradient, lr and step count as it would after backward,
and no later part of this backward reads the unit's parameters (autograd runs a
leaf's AccumulateGrad once, after every use). engine.step() waits for these
updates, then steps the remaining units. Otherwise, with optimizer state on
NVMe, the unit's state reads start at that moment instead (they do not depend
on the gradient norm): see [Note: NVMe optimizer pipeline].
"""
from __future__ import annotations

import contextlib
import enum
import math
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .. import threads
from ..delayed import DelayedUpdate
from ..device import enter as enter_device
from ..errors import ZerotierError
from ..overlap.speculative import SpeculationPolicy, UndoLog
from ..state import Location, check_transition
from .surface import internal


class WindowState(enum.Enum):
    """Where the engine is in an accumulation window (like FSDP2's TrainingState). The gradients
    themselves are GradStore's (GradState per unit); this says which calls are legal now.

    IDLE: no backward in this micro-batch; the window may hold earlier micro-batches' gradients.
    ENGINE_BACKWARD: inside engine.backward(loss).
    ENGINE_GRADS: engine.backward(loss) returned: another backward, or engine.step(), is next.
    PLAIN_BACKWARD: inside a plain loss.backward() the hooks entered ([Note: the plain PyTorch loop]).
    PLAIN_GRADS: gradients of plain backwards (or `p.grad = ...`) wait for optimizer.step().
    APPLYING: the window's update runs torch's optimizer.step() (an lr scheduler's count), which
        does nothing more.
    PARTIAL: a backward failed half-way: its gradients are partial until zero_grad() drops them.
    BROKEN: a step failed after some units were updated ([Note: a step is all or nothing]);
        only load_checkpoint() leads out.
    CLOSED: engine.close() ran; every training call is refused.
    The window's norm (grad_norm()) is a value, not a state: once taken, more gradients are refused
    until the step or zero_grad() ends the window."""

    IDLE = "idle"
    ENGINE_BACKWARD = "engine backward"
    ENGINE_GRADS = "engine gradients"
    PLAIN_BACKWARD = "plain backward"
    PLAIN_GRADS = "plain gradients"
    APPLYING = "applying"
    PARTIAL = "partial"
    BROKEN = "broken"
    CLOSED = "closed"


S = WindowState
WINDOW_TRANSITIONS = {
    S.IDLE: {S.ENGINE_BACKWARD, S.PLAIN_BACKWARD, S.PLAIN_GRADS, S.IDLE, S.BROKEN, S.CLOSED},
    S.ENGINE_BACKWARD: {S.ENGINE_GRADS, S.PARTIAL, S.BROKEN, S.CLOSED},
    S.ENGINE_GRADS: {S.ENGINE_BACKWARD, S.APPLYING, S.IDLE, S.BROKEN, S.CLOSED},  # IDLE: a micro-step, a drop
    S.PLAIN_BACKWARD: {S.PLAIN_GRADS, S.BROKEN, S.CLOSED},
    S.PLAIN_GRADS: {S.PLAIN_BACKWARD, S.APPLYING, S.PARTIAL, S.IDLE, S.BROKEN, S.CLOSED},  # PARTIAL: a dead backward
    S.APPLYING: {S.ENGINE_GRADS, S.PLAIN_GRADS},  # back to the loop that applies; then IDLE, or BROKEN
    S.PARTIAL: {S.IDLE, S.BROKEN, S.CLOSED},
    S.BROKEN: {S.IDLE, S.BROKEN, S.CLOSED},  # IDLE: a checkpoint loaded
    S.CLOSED: set(),
}
BACKWARDS = frozenset({S.ENGINE_BACKWARD, S.PLAIN_BACKWARD})


class Window:
    """The loop state of one engine and the step that ends a window. Reads the engine's stores
    (params, grads, unit_optimizer), scaler, sharding and counters; runs early updates on its
    optimizer thread."""

    def __init__(self, engine):
        self.engine = engine
        self.steps = engine.runtime.steps  # their one writer while training ([Note: the step counters])
        self.state = S.IDLE
        self._why: str | None = None        # PARTIAL / BROKEN: what happened, for the refusals
        self.norm: float | None = None      # grad_norm() of this window, once computed
        self.last_norm = 0.0                # the last update's norm (grad_norm() between windows)
        self.user_clip = 1.0                # this window's clip_grad_norm_ factor ([Note: the user's clipping])
        self._no_sync = False               # inside engine.no_sync()
        self._last_loss = None              # weakref to the last engine.backward(loss)'s loss
        self._on_complete = None            # this backward's use of a unit's complete gradient (grad_hook)
        self._slots: dict[int, tuple] | None = None  # id(param) -> (unit, index): grad_get / grad_set
        self._applied_before = engine.unit_optimizer.applied  # unit updates before this window
        # The "optimizer stream": one thread running early Adam updates during backward.
        self._optim_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zerotier-optim",
                                                initializer=enter_device, initargs=(engine.device,))
        self.early: list[Future] = []
        # [Note: speculative step] in overlap/speculative.py
        train = engine.cfg.train
        # the plan resolved train.speculative_step ([Note: speculation in the plan] in planner/speculation_plan.py)
        speculate = train.speculative_step if engine.plan.speculative and not train.delayed_update else False
        self.speculation = SpeculationPolicy(speculate, train.max_grad_norm is not None, engine.scaler.dynamic)
        self.undo = UndoLog(engine.unit_optimizer, engine.device_tier, engine.host_pool,
                            engine.plan.speculation_undo_bytes, copies=train.speculative_step is True)
        self._speculating = False           # this window's last backward updates units speculatively
        self._spec_hyper: dict[int, list] = {}  # unit index -> the Hyper its speculated update used
        self._spec_scale = 1.0              # the gradient scale speculated updates used (1 / loss scale)
        self._rollback_started: tuple | None = None  # a rollback's (start, units, undo bytes, bytes moved)
        # [Note: delayed update] in delayed.py: the previous window's update, on the optimizer thread
        self.delayed = DelayedUpdate(engine, self._optim_thread) if train.delayed_update else None
        self._forward_in_window = False     # a training forward ran since the last window ended
        self._forward_awaits_backward = False  # a forward under grad returned since the last backward began

    def _to(self, new: WindowState) -> None:
        self.state = check_transition(self.state, new, WINDOW_TRANSITIONS, "the accumulation window")

    @property
    def in_backward(self) -> bool:
        return self.state in BACKWARDS

    @property
    def broken(self) -> "str | None":
        """Why the engine is broken ([Note: a step is all or nothing]), or None."""
        return self._why if self.state is S.BROKEN else None

    def between_windows(self) -> bool:
        """A forward now begins a new window (graceful stop's boundary, one rank)."""
        e = self.engine
        return self.state is not S.ENGINE_GRADS and self.steps.at_window_start(e.cfg.train.grad_accum_steps)

    def ends_window(self) -> bool:
        """The next engine.step() is the window's last micro-batch."""
        return self.steps.window_ends(self.engine.cfg.train.grad_accum_steps)

    # ------------------------------------------------------------ backward, both loops

    def backward(self, loss: torch.Tensor) -> None:
        """engine.backward(loss): scaled, accumulated ([Note: early step])."""
        e = self.engine
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ZerotierError("engine.backward(loss) needs the scalar loss tensor of this micro-batch")
        self._forward_awaits_backward = False  # its backward was called (refused or not: the graph is the user's)
        self.refuse_if_closed("engine.backward()")
        self.refuse_if_broken("engine.backward()")
        if self.state is S.PLAIN_GRADS:
            raise ZerotierError("engine.backward(loss) after a plain loss.backward() in the same window: use one "
                                "loop style per window (call engine.optimizer.step() or engine.zero_grad() first)")
        self.refuse_after_grad_norm("engine.backward()")
        self.cancel_speculation()  # a second backward of the micro-batch: its gradients add to the window
        if self.state is S.ENGINE_GRADS and self._last_loss is not None and self._last_loss() is loss:
            raise ZerotierError("engine.backward(loss) twice with the same loss tensor: the first backward freed its "
                                "graph (torch raises 'Trying to backward through the graph a second time'); compute "
                                "the loss again, or call engine.step() after each micro-batch's backward")
        if self.updated():  # a second backward of this micro-batch (torch accumulates it)
            raise ZerotierError("engine.backward() again after a backward whose update already started "
                                "(train.early_step = true applies the window's update during its last "
                                "backward): call engine.step() first, or leave train.early_step off (the "
                                "default) to accumulate several backward() calls into one micro-batch as torch does")
        train = e.cfg.train
        scale = e.scaler.scale / train.grad_accum_steps
        last_micro = self.ends_window()
        # engine.no_sync(): no reduce before the window's last micro-batch (the accumulator keeps the sum)
        reduce_now = e.sharding.reduces_now(last_micro) and \
            (last_micro or not self._no_sync or not e.grads.defers_reduce)
        if reduce_now:
            self._on_complete = e.grads.reduce  # bucketed reduce-scatter, overlapping the rest of backward
        elif (train.early_step and train.max_grad_norm is None and not e.scaler.dynamic and last_micro
              and not e.sharding.active):
            self._on_complete = self._start_early_step
        elif last_micro and not e.sharding.active and self.speculation.wanted():
            self._on_complete = self._start_speculative_step
            self._speculating = True
            self._spec_scale = 1.0 / e.scaler.scale
        elif last_micro and not e.sharding.active and self.delayed is None:
            self._on_complete = e.unit_optimizer.prefetch  # NVMe state reads start now
        self._to(S.ENGINE_BACKWARD)
        span = e.profiler.compute_begin("backward") if e.profiler is not None else None
        try:
            try:
                (loss * scale).backward()
            finally:
                if span is not None:
                    e.profiler.compute_end(span)
                self._on_complete = None
                for unit in e.param_units:
                    e.params.release(unit)
            e.grads.end_backward(reduced=reduce_now)
        except BaseException as exc:
            self._failed("engine.backward()", exc)
            raise
        self._to(S.ENGINE_GRADS)
        self._last_loss = weakref.ref(loss)

    def begin_plain_backward(self) -> None:
        """[Note: the plain PyTorch loop] A plain loss.backward() enters here (hooks.enter_backward)."""
        self.refuse_if_broken("loss.backward()")
        self.refuse_after_grad_norm("loss.backward()")
        e, why = self.engine, None
        if e.scaler.dynamic or e.scaler.scale != 1.0:
            why = "the loss scale (precision.loss_scale) must multiply the loss before backward"
        elif e.sharding.active:
            why = "with several ranks the engine's backward decides when gradients are reduced"
        elif self.state is S.ENGINE_GRADS:
            why = "engine.backward(loss) was used in this window: one loop style per window"
        if why is not None:
            raise ZerotierError(f"a plain loss.backward() cannot be exact here ({why}): call engine.backward(loss) "
                                "and engine.step() after every micro-batch instead")
        self._on_complete = None
        self._to(S.PLAIN_BACKWARD)
        self._forward_awaits_backward = False

    def end_plain_backward(self) -> None:
        """The end of a plain loss.backward() (queued by hooks.enter_backward)."""
        e = self.engine
        self._to(S.PLAIN_GRADS)
        for unit in e.param_units:
            e.params.release(unit)
        e.grads.end_backward(reduced=False)

    def on_root_forward(self) -> None:
        """A forward begins while a plain loss.backward() is still open: it died half-way (its end
        never ran), so its gradients are partial. A training forward (grad enabled) opens the window:
        it reads the weights one update behind ([Note: delayed update]); one without grad is a read."""
        self._forward_in_window = self._forward_in_window or torch.is_grad_enabled()
        self._gate_reads()
        if self.state is S.PLAIN_BACKWARD:
            self.end_plain_backward()
            self._why = "a loss.backward() failed half-way through its gradients"
            self._to(S.PARTIAL)

    def forward_returned(self) -> None:
        """The root's forward returned under grad (hooks.py): its graph waits for a backward."""
        if not self.in_backward:
            self._forward_awaits_backward = True

    def grad_hook(self, unit, i: int):
        """The post-accumulate-grad hook of `unit`'s parameter i ([Note: fetch and release] in hooks.py)."""
        e = self.engine

        def hook(p: torch.Tensor) -> None:
            try:
                with internal():
                    sparse = p.grad.layout is not torch.strided
                if sparse:  # refused before the window moves: zero_grad() recovers
                    raise self._sparse_gradient(p)
                e.hooks.enter_backward()
            except BaseException:
                with internal():
                    p.grad = None  # never a silent accumulation a later step would apply
                raise
            with internal():
                complete = e.grads.accumulate(unit, i, p.grad)
                p.grad = None
            if not complete:
                return
            e.params.release(unit)
            if self._on_complete is not None:
                self._on_complete(unit)
        return hook

    def _sparse_gradient(self, p: torch.Tensor) -> ZerotierError:
        """A sparse gradient (F.embedding(..., sparse=True) on a parameter of a dense module) reached a
        parameter: the store sums dense flats and AdamW steps dense ones, as torch's AdamW refuses it."""
        name = next((n for n, q in self.engine.module.named_parameters() if q is p), "?")
        return ZerotierError(
            f"parameter '{name}' got a sparse gradient (F.embedding(..., sparse=True) makes one), "
            "which zerotier's AdamW does not take (nor does torch.optim.AdamW: \"Adam does not support sparse "
            "gradients\"). Call it with sparse=False (the default; the training is the same, with a dense "
            "gradient), then engine.zero_grad() and go on: this backward's gradients were not applied")

    def _start_early_step(self, unit) -> None:
        """[Note: early step] update `unit` on the optimizer thread while backward goes on."""
        scale = 1.0 / self.engine.scaler.scale

        def update(hyper_of):
            # step() waits for the writes; the window's norm reads this gradient again
            self._update([unit], hyper_of, scale, drain=False, keep_grads=True)
        self._on_optimizer_thread(unit, update)

    def _start_speculative_step(self, unit) -> None:
        """[Note: speculative step] in overlap/speculative.py: update `unit` on the optimizer thread with clip
        coefficient 1, undoably, while backward goes on; its new parameters wait in a staged
        write-back buffer until engine.step() validates the window. A unit whose undo does not fit
        the allowance only has its NVMe state reads started, as without speculation."""
        e, scale = self.engine, self._spec_scale

        def update(hyper_of):
            if not self.undo.speculate(unit, e.params.staged_out_bytes(unit)):
                e.unit_optimizer.prefetch(unit)
                return
            self._spec_hyper[unit.index] = list(hyper_of(unit))
            self._update([unit], hyper_of, scale, drain=False, keep_grads=True, speculative=True)
        self._on_optimizer_thread(unit, update)

    def _on_optimizer_thread(self, unit, update) -> None:
        """Hand `unit`'s complete gradient to the optimizer thread and run `update(hyper_of)` there.
        The gradient is handed over whole: the optimizer thread waits for its host adds
        (`grads.ready` -> settle), so backward never blocks on the host per unit (GPU review N8)."""
        e = self.engine
        e.grads.hand_over(unit)
        if e.device.type == "cuda":  # the gradient add above was queued on the compute stream
            done = torch.cuda.Event()
            done.record()
        else:
            done = None
        hyper_of = e.optimizer.hyper_of()

        def run():
            if done is not None:
                done.synchronize()
            e.grads.ready(unit)
            update(hyper_of)
        threads.hand(threads.OPTIMIZER, e.grads, e.params, e.unit_optimizer)  # [Note: thread ownership]
        self.early.append(self._optim_thread.submit(run))

    def cancel_speculation(self) -> None:
        """[Note: speculative step] A call that changes the window after speculated updates (another
        backward, zero_grad, p.grad = ..., engine.synchronize: checkpoints, state_dicts): wait for
        them, undo them, reopen the window's gradients. Nothing if the window did not speculate."""
        if not self._speculating:
            return
        self._speculating = False
        self.wait_early_steps()
        self._roll_back(skip=True)
        self.engine.grads.reopen()

    def _roll_back(self, skip: bool) -> int:
        """Undo every speculated update of the window (after its futures were waited); `skip`: the
        staged parameters are dropped (the redo, if any, writes them again). Returns bytes moved."""
        e = self.engine
        indices = self.undo.speculated
        moved = self.undo.roll_back()
        for i in indices:
            e.params.drop_out(e.units[i])
        self._spec_hyper.clear()
        return moved

    def _validate(self, factor: float, overflow: bool) -> "tuple[set[int], bool | None]":
        """[Note: speculative step] After the window's norm: commit the speculated updates if the step
        would have made exactly them, else roll them back. Returns (units committed, rolled back?:
        None when nothing was speculated) and reports to the profiler."""
        e = self.engine
        if not self._speculating:
            return set(), None
        self._speculating = False
        opt = e.unit_optimizer
        indices = self.undo.speculated
        if not indices:
            return set(), None
        hyper_of = e.optimizer.hyper_of()
        valid = (not overflow and factor == 1.0 and self._spec_scale == 1.0 / e.scaler.scale
                 and all(list(hyper_of(e.units[i])) == self._spec_hyper.get(i) for i in indices))
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
        moved = self._roll_back(skip=True)
        moved += sum(opt.layout.state_bytes(e.units[i].shard_numel) for i in indices
                     if opt.locs[i] is Location.NVME)  # read again for the redo
        self._rollback_started = (start, len(indices), undo_bytes, moved)
        return set(), True

    # ------------------------------------------------------------ the step, both loops

    def step(self) -> bool:
        """engine.step(): see Engine.step and [Note: a step is all or nothing] there."""
        e = self.engine
        self.refuse_if_closed("engine.step()")
        self.refuse_if_broken("engine.step()")
        if self.state is S.PLAIN_GRADS:
            raise ZerotierError("engine.step() after a plain loss.backward(): call engine.optimizer.step() in that "
                                "loop, or engine.backward(loss) then engine.step()")
        if self.state is not S.ENGINE_GRADS:
            raise ZerotierError("engine.step() called before engine.backward(loss): there are no gradients "
                                "to apply")
        if not self.ends_window():
            self.steps.micro_step()
            self._to(S.IDLE)
            return False
        try:
            updated = self._apply()
        except BaseException as exc:
            self._failed("engine.step()", exc)
            raise
        self.steps.micro_step()
        self.drop()
        return updated

    def optimizer_step(self) -> bool:
        """engine.optimizer.step() in the plain PyTorch loop: apply the gradients that loss.backward()
        accumulated (any number of them: the loop divides its loss for accumulation itself), then
        drop them ([Note: the plain PyTorch loop]). False when there was nothing to apply."""
        self.refuse_if_closed("optimizer.step()")
        self.refuse_if_broken("optimizer.step()")
        if self.state is S.ENGINE_GRADS:
            raise ZerotierError("engine.optimizer.step() after engine.backward(loss): call engine.step() in that "
                                "loop (optimizer.step() belongs to the plain loss.backward() loop)")
        if self.state is not S.PLAIN_GRADS:
            return False  # no gradients: torch's optimizers do nothing either
        try:
            self._apply()
        except BaseException as exc:
            self._failed("optimizer.step()", exc)
            raise
        self.drop()
        return True

    def grad_norm(self) -> float:
        """Engine.grad_norm: computed once per window; between windows, the last update's."""
        e = self.engine
        self.refuse_if_closed("engine.grad_norm()")
        if self.norm is None and not self.has_grads():
            return self.last_norm
        if self.norm is None:
            self.wait_early_steps()
            e.grads.ready_all()
            local = e.grads.sumsq([u for u in e.units if e.sharding.local_sumsq_share(u)])
            self.norm = math.sqrt(e.sharding.global_sum(local)) / e.scaler.scale
        return self.norm

    def _apply(self) -> bool:
        """The update at the end of an accumulation window (see Engine.step())."""
        e = self.engine
        total_norm = self.grad_norm()
        pending = e.grads.ready_all()  # units stepped early are STEPPED already
        inv_scale = 1.0 / e.scaler.scale
        overflow = not math.isfinite(total_norm)
        factor = self.user_clip  # [Note: the user's clipping], then train.max_grad_norm on what it left
        if e.cfg.train.max_grad_norm is not None:
            factor *= min(1.0, e.cfg.train.max_grad_norm / (total_norm * factor + 1e-6))
        if self.delayed is not None:
            self._finish_delayed()  # [Note: delayed update]: the previous window's update is published
        if overflow and e.scaler.dynamic:
            _, rolled_back = self._validate(factor, overflow)
            self._rolled_back(rolled_back)
            e.scaler.update(overflow=True)
            e.unit_optimizer.drop_prefetched()
            return False
        self.last_norm = total_norm
        loop = self.state
        self._to(S.APPLYING)  # the optimizer's step() counts for lr schedulers, and does nothing more
        try:
            e.optimizer.count_step()
        finally:
            self._to(loop)
        if self.delayed is not None:  # [Note: delayed update]: this window's update runs during the next
            self.delayed.launch(pending, e.optimizer.hyper_of(), factor * inv_scale)
        else:
            committed, rolled_back = self._validate(factor, overflow)  # [Note: speculative step]
            self._update([u for u in pending if u.index not in committed], e.optimizer.hyper_of(),
                         factor * inv_scale)
            self._rolled_back(rolled_back)
            e.params.finish_commits()  # ZeRO-1/2: the new parameter shards reach every rank
        e.scaler.update(overflow=False)
        self.steps.update()
        return True

    def _finish_delayed(self) -> None:
        """[Note: delayed update] The update in flight lands and is published. Its failure breaks the
        engine (some units were updated, others not): [Note: a step is all or nothing]."""
        try:
            self.delayed.finish()
        except BaseException as exc:
            self.mark_broken(f"the delayed update of the previous window failed ({type(exc).__name__}: {exc}) "
                             "after some of its units were updated")
            raise
        self._applied_before = self.engine.unit_optimizer.applied

    def publish_for_read(self) -> None:
        """[Note: delayed update] A read of the weights (a parameter's value, a forward without grad,
        engine.gathered()) between windows publishes the pending update first, so it sees what
        model.state_dict() sees and ends the delay; within a window (from its training forward to its
        step) it reads the weights the window computes with, and publishes nothing.
        [Note: early step] A read after the window's last backward (a forward, say) first waits for the
        updates started during that backward: it sees each unit's update whole, never a home the
        optimizer thread is still writing (the lagging device caught a forward's fetch copying one)."""
        if self.early and not self.in_backward:
            self.wait_early_steps()
        if self.delayed is not None and self.delayed.pending and not self._forward_in_window \
                and not self.in_backward and self.state not in (S.BROKEN, S.CLOSED):
            self._finish_delayed()
        self._gate_reads()

    def _gate_reads(self) -> None:
        """The surface's hot path (reads of resident units as torch) is off while a read would publish."""
        surface = getattr(self.engine, "surface", None)
        if surface is not None:
            surface.publish_first = self.delayed is not None and self.delayed.pending \
                and not self._forward_in_window

    def finish_delayed(self, what: str, force: bool = False) -> None:
        """engine.synchronize() and what calls it (checkpoints, state_dicts, weight reads and writes):
        the pending delayed update lands and is published, ending the delay ([Note: delayed update]).
        Refused between a window's training forward and its step (unless `force`: close)."""
        if self.delayed is None or not self.delayed.pending:
            return
        if self._forward_in_window and not force and self.state is not S.BROKEN:
            raise ZerotierError(f"{what} between a training forward and engine.step() with train.delayed_update = "
                                "true: it would publish the previous window's update now, so this window's backward "
                                "would re-fetch other weights than its forward used. Call it after engine.step() "
                                "(or run that forward under torch.no_grad())")
        if self.state is S.BROKEN:
            self.delayed.drop()
        else:
            self._finish_delayed()
        self._gate_reads()

    def _rolled_back(self, rolled_back: "bool | None") -> None:
        """The window's speculation outcome to the policy and, for a rollback, to the profiler: units,
        bytes, and the seconds from the rollback to the end of the redone update."""
        self.speculation.outcome(rolled_back)
        if not rolled_back:
            return
        start, units, undo_bytes, moved = self._rollback_started
        prof = self.engine.profiler
        if prof is not None:
            prof.speculation(units, units, undo_bytes, moved, time.perf_counter() - start)

    def _update(self, units: list, hyper_of, grad_scale: float, drain: bool = True, keep_grads: bool = False,
                speculative: bool = False) -> None:
        """Adam on `units`; each one's new parameters are committed as soon as it is done, unless
        `speculative` ([Note: speculative step]: staged until the window is validated)."""
        e = self.engine
        out_of = e.params.staged_out if speculative else e.params.out_buffer
        for unit in e.unit_optimizer.step(units, e.grads.shard, out_of, hyper_of, grad_scale,
                                          drain, got_of=e.grads.got, keep_grads=keep_grads):
            if not speculative:
                e.grads.stepped(unit)
                e.params.commit(unit)

    # ------------------------------------------------------------ errors ([Note: a step is all or nothing])

    def _failed(self, what: str, exc: BaseException) -> None:
        """An error (or Ctrl-C) inside backward() or step(): stop the background updates before it
        reaches the caller; break the engine if any unit was updated in this window
        ([Note: a step is all or nothing]); a backward that stopped half-way leaves partial
        gradients, which must be dropped (zero_grad) before training goes on."""
        self.quiesce()
        applied = self.engine.unit_optimizer.applied
        if self.state is S.BROKEN:
            return  # a delayed update that failed said so ([Note: delayed update])
        if self.delayed is not None and self.delayed.error is not None:
            self.mark_broken(f"the delayed update of the previous window failed ({type(self.delayed.error).__name__}: "
                             f"{self.delayed.error}) after some of its units were updated")
            self.delayed.drop()
        elif applied != self._applied_before:
            self.mark_broken(f"{what} failed ({type(exc).__name__}: {exc}) after {applied - self._applied_before} "
                             "of the window's unit updates were applied, so some units hold new weights and others "
                             "old ones")
        elif what == "engine.backward()":
            self._why = (f"{what} failed ({type(exc).__name__}: {exc}) after part of this micro-batch's "
                         "gradients were accumulated")
            self._to(S.PARTIAL)

    def mark_broken(self, why: str) -> None:
        self._why = why
        self._to(S.BROKEN)

    def quiesce(self) -> None:
        """Wait for every update started during backward, whatever it raises (a second Ctrl-C
        included): none may still run once an error has reached the caller. A delayed update is
        waited, not published ([Note: delayed update])."""
        if self.delayed is not None:
            self.delayed.wait()
        early, self.early = self.early, []
        for future in early:
            while True:
                try:
                    future.exception()
                    break
                except KeyboardInterrupt:
                    continue
        self._take_back_update()
        optimizer = self.engine.unit_optimizer
        try:
            optimizer.finish()
        except BaseException:  # noqa: BLE001 - the error being raised already tells the story
            pass
        if self._speculating:  # [Note: speculative step]: undone, so the failure leaves no unit updated
            self._speculating = False
            self._roll_back(skip=True)
        optimizer.drop_prefetched()  # a retry reads afresh, never a stale failure (#24)

    def refuse_if_closed(self, what: str) -> None:
        if self.state is S.CLOSED:
            raise ZerotierError(f"{what} after engine.close(): this engine no longer trains the model (close() "
                                "put the weights back into it). Call zerotier.initialize(model, config) again "
                                "to go on training")

    def refuse_if_broken(self, what: str) -> None:
        if self.state is S.BROKEN:
            raise ZerotierError(f"{what} refused: {self._why}. Load a checkpoint "
                                "(engine.load_checkpoint(root)) to continue from a consistent state")
        if self.state is S.PARTIAL and what != "engine.save_checkpoint()":
            raise ZerotierError(f"{what} refused: {self._why}. Call engine.zero_grad() to drop this "
                                "accumulation window's gradients, its earlier micro-batches' too (or load a "
                                "checkpoint), then go on: the window starts again at its first micro-batch, so "
                                "run its micro-batches again or go on with the next ones")

    def refuse_before_backward(self, what: str) -> None:
        """`what` would change the weights under a forward's graph whose backward has not run: torch's
        backward then fails ('modified by an inplace operation'); ours would re-fetch the new weights."""
        if self._forward_awaits_backward:
            raise ZerotierError(f"{what} between a forward and its backward: the backward would run on weights "
                                "other than the ones its forward used (torch refuses this order too: 'one of the "
                                "variables needed for gradient computation has been modified by an inplace "
                                "operation'). Call it before the forward, or after the backward; a forward that "
                                "will never be backwarded is dropped by engine.zero_grad() (and one run under "
                                "torch.no_grad() builds no graph)")

    def refuse_after_grad_norm(self, what: str) -> None:
        if self.norm is not None:
            raise ZerotierError(f"{what} after engine.grad_norm(): the norm closed this accumulation window; "
                                "call the step (engine.step() / engine.optimizer.step()) or zero_grad() first")

    def wait_early_steps(self) -> None:
        """Wait for the updates started during backward and for their NVMe write-backs (left in
        flight so each unit's read overlapped the previous writes); re-raise the first error."""
        early, self.early = self.early, []
        waits = [future.result for future in early] + ([self._take_back_update] if early else []) + \
            ([self.engine.unit_optimizer.finish] if early else [])
        first = None
        for wait in waits:  # every one is waited, then the first error (from the optimizer thread) raised
            try:
                wait()
            except BaseException as exc:  # noqa: BLE001
                first = first or exc
        if first is not None:
            raise first

    def _take_back_update(self) -> None:
        """Every early step's future was waited: the updater's state is the compute thread's again."""
        e = self.engine
        threads.hand(threads.COMPUTE, e.grads, e.params, e.unit_optimizer)

    # ------------------------------------------------------------ dropping a window

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Engine.zero_grad."""
        self.refuse_if_closed("engine.zero_grad()")
        self.cancel_speculation()
        if self.updated() and self.state is not S.BROKEN:
            raise ZerotierError("zero_grad() after a backward whose update already started (train.early_step = "
                                "true applies the window's update during its last backward, so its gradients "
                                "cannot be dropped any more): call engine.step() first, or leave "
                                "train.early_step off (the default) to drop a window's gradients before step()")
        if self.state is S.PARTIAL:
            # [Note: a step is all or nothing] in engine.py: the dropped window starts again at its
            # first micro-batch (issue 37 row 12: kept, the count ended every later window one
            # micro-batch early)
            e = self.engine
            self.steps.drop_window(e.cfg.train.grad_accum_steps)
        self.drop(set_to_none)

    def drop(self, set_to_none: "bool | None" = None) -> None:
        """The window ends: its gradients are dropped (after a step: set_to_none None keeps the
        user's last zero_grad choice). A broken engine stays broken; a plain backward that died
        half-way is ended first."""
        if self.state is S.PLAIN_BACKWARD:
            self.end_plain_backward()
        self.engine.grads.zero(set_to_none)
        self.user_clip = 1.0
        self.norm = None
        if self.state is not S.BROKEN:
            self._why = None
            self._to(S.IDLE)
        self._forward_in_window = False
        self._forward_awaits_backward = False
        # a delayed update in flight moves `applied` on the optimizer thread: counted as done
        self._applied_before = self.delayed.applied_after if self.delayed is not None and self.delayed.pending \
            else self.engine.unit_optimizer.applied
        self._gate_reads()

    def loaded(self) -> None:
        """A checkpoint was loaded: a consistent state again, in a new window."""
        if self.state is S.BROKEN:
            self._why = None
            self._to(S.IDLE)
        self.drop()

    # ------------------------------------------------------------ gradients as torch shows them

    def slot(self, p) -> "tuple | None":
        """(unit, index in unit) of a managed parameter; None for any other tensor."""
        if self._slots is None:
            self._slots = {id(q): (unit, k) for unit in self.engine.units for k, q in enumerate(unit.params)}
        return self._slots.get(id(p))

    def has_grads(self) -> bool:
        e = self.engine
        return self.state in (S.ENGINE_GRADS, S.PLAIN_GRADS) or \
            any(e.grads.has(u, k) for u in e.units for k in range(len(u.params)))

    def updated(self) -> bool:
        """Some unit's update of this window already started (train.early_step, [Note: early step]);
        speculated updates do not count: they are undone on demand ([Note: speculative step])."""
        if self._speculating or self.delayed is not None:  # a delayed update is the previous window's
            return False
        return bool(self.early) or self.engine.unit_optimizer.applied != self._applied_before

    def gradient_assigned(self) -> None:
        """`p.grad = tensor` (grad_view.py) in a window without a backward: optimizer.step() applies it."""
        if self.state is S.IDLE:
            self._to(S.PLAIN_GRADS)

    @contextlib.contextmanager
    def no_sync(self):
        before, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = before

    # ------------------------------------------------------------ the end

    def close(self) -> None:
        """Every update in flight waited (a delayed one published); from here on every training call is
        refused."""
        self.quiesce()
        try:
            self.finish_delayed("engine.close()", force=True)
        except Exception:  # noqa: BLE001 - the step that waited for it would have raised it; close goes on
            pass
        self._to(S.CLOSED)

    def shutdown(self) -> None:
        self._optim_thread.shutdown(wait=True)
