"""`train.overlap = "delayed"`: the delayed parameter update, ZeRO-Offload's DPU. Opt-in, and not
the same training as without it.

[Note: delayed update]
The math (one rank; engine.step() or, in the plain loop, engine.optimizer.step() ends a window:
[Note: the plain PyTorch loop] in engine/window.py). At the step that ends window k the gradients g_k
were computed on the weights in force; the norm and clip factor of g_k are taken as always;
then the update of the previous window (g_{k-1}) is waited for and published, and the update
with g_k is launched. So a window's forward and backward read weights one update behind the
optimizer, and the CPU update of window k overlaps the forward and backward of window k+1
instead of following them. In plain torch (the reference of tests/test_delayed_update.py):

    g_k = grad(loss_k, w)                    # on the current weights
    if pending: clip_grad_norm_(pending); AdamW.step(pending)
    pending = g_k                            # overflowed (dynamic scale): pending = None

The update of g_k uses g_k's own clip factor and loss scale and the hyper-parameters (lr) in
force at the step() that ended window k; step counts go 1, 2, ... as without the delay.

How (Window._apply, `Delayed`):
  1. finish(): wait for window k-1's update on the optimizer thread, hand the updater back to
     the compute thread ([Note: thread ownership] in threads.py), commit each unit's staged
     parameters (ParamStore.commit: the version bump that publishes them) and finish the
     commits. An overflowed window (dynamic scale) stops here: a skipped step, nothing launched.
  2. launch(): copy this window's gradient shards into host-pool blocks (one extra copy of the
     window's gradients, held until each unit is updated; the gradients are then dropped as
     after any step, so the next window accumulates into the same accumulators), copy the units'
     hyper-parameters and "got a gradient" sets, hand the updater to the optimizer thread and
     submit UnitOptimizer.step over the copies. New parameters go to ParamStore.staged_out (a
     write-back buffer, never the home, as a speculated update's: [Note: speculative step]), so
     no forward of window k+1 reads them; they are published at step 1 of the next step().
While an update runs, the compute thread never calls the updater's methods (UnitOptimizer,
ParamStore's write-back state): the NVMe state reads that engine.backward starts early
(UnitOptimizer.prefetch) are off. The gradient store is not handed over: the update reads the
copies only.

Ending the delay. engine.synchronize() finishes and publishes the pending update
(Delayed.publish), and so does every call that reads or replaces the fp32 state through
it: save_checkpoint / load_checkpoint, the optimizer's state_dict / load_state_dict,
model.state_dict(), writes of managed parameters' values, parameters_fp32,
consolidated_state_dict, close(). So does any other read of the weights between windows (after
a step(), before the next forward with grad enabled: Delayed.before_read): a managed
parameter's value (p.clone(), p.data, p.detach(), print; the surface's hot path is off while
an update waits, ParamSurface.publish_first), engine.gathered(), a forward without grad (an
evaluation). Every read at one moment thus returns the same weights, the ones state_dict
returns. The window after such a call reads fresh weights, one step less stale than an
uninterrupted DPU run would; so a checkpoint is an exact resume point of the run that wrote it
(that run goes on from the same published state), but that run is not the run that did not
save. A forward with grad enabled opens the window: until its step() a parameter read returns
the weights the window computes with (one update behind) and publishes nothing, and a call that
would publish is refused: backward would re-fetch other weights than its forward used. close()
finishes it whatever the state.

Not supported (ConfigError at initialize, naming the key): several ranks (each rank's update
would also need its ZeRO gather overlapped), gradients on NVMe (the copy is held in host
memory, which NVMe gradients are there to spare), optimizer state on the device (the update
already runs on the accelerator). An update during backward (early, speculative) would run under
the pending one: those are other values of train.overlap.
"""
from __future__ import annotations

from .. import threads
from ..errors import ConfigError, ZerotierError
from ..state import Location
from ..tier_names import TIER_NAMES
from ..units import format_setting
from .base import OverlapPolicy, wait_out


def host_bytes(shard_numels: list[int], grad_itemsize: int, lp_itemsize: int, alignment: int) -> int:
    """Host-pool bytes a delayed update holds at most beyond the plan's ([Note: delayed update]): each
    unit's gradient copy and its staged new parameters, each a block rounded up to `alignment`."""
    def block(nbytes: int) -> int:
        return -(-nbytes // alignment) * alignment
    return sum(block(n * grad_itemsize) + block(n * lp_itemsize) for n in shard_numels)


class Delayed(OverlapPolicy):
    """The one update in flight ([Note: delayed update]): a window's units, the copies of their
    gradients, and the future of their update on the optimizer thread."""

    name = "delayed"

    def __init__(self, rt, window, optimizer):
        super().__init__(rt, window, optimizer)
        self.future = None
        self.units: list = []             # units whose new parameters wait in staged_out
        self._grads: dict[int, object] = {}  # unit index -> host-pool block: the gradient copy
        self.applied_after = 0            # UnitOptimizer.applied once the update is done
        self.error: BaseException | None = None  # the update's failure, once waited for
        self._forward_in_window = False   # a training forward ran since the last window ended

    @staticmethod
    def refusal(world_size: int, placement: dict, optimizer_units: "tuple | None") -> "str | None":
        """Why the delayed update cannot run with this placement ([Note: delayed update]); None when it
        can. The planner counts its host bytes (host_bytes, the plan's "delayed" term) only then."""
        if world_size > 1:
            return (f"{world_size} ranks: the delayed update runs on one rank only (each rank's shard update and its "
                    "gather would have to overlap the next window); train without it, or on one rank")
        if placement["gradients"] is Location.NVME:
            return ("the gradients are on nvme (offload.gradients): the window's gradients are copied to host memory "
                    "for the update that runs during the next window, which gradients on nvme are there to spare; "
                    "set offload.gradients = 'host', or train without the delayed update")
        if Location.DEVICE in (optimizer_units or (placement["optimizer"],)):
            return ("the optimizer state is on the device (offload.optimizer): the update already runs on the "
                    "accelerator, and the delay hides a CPU update; set offload.optimizer = 'host' or 'nvme'")
        return None

    @classmethod
    def refuse(cls, cfg, plan, world_size: int) -> None:
        """What the delayed update cannot run, refused before anything is placed. Its host bytes are the
        plan's "delayed" term: make_plan refuses a host budget without room for them (too_little_host)."""
        why = cls.refusal(world_size, plan.placement, plan.optimizer_units)
        if why is not None:
            raise ConfigError(f"train.overlap = 'delayed' cannot run here: {why}")

    @classmethod
    def plan_terms(cls, s) -> dict[str, int]:
        """The plan's "delayed" term per tier ([Note: needs per component] in planner/planner.py):
        host_bytes of every unit's optimizer shard; `s` is the planner's Sizes."""
        need = dict.fromkeys(TIER_NAMES, 0)
        need["host"] = host_bytes(s.held_shards("optimizer"), s.grad_bytes, s.lp_bytes, s.alignment)
        return need

    @staticmethod
    def too_little_host(extra: int, room: int, host_budget: int) -> str:
        """What a host budget without room for host_bytes() beside the rest of the plan lacks."""
        return (f"train.overlap = 'delayed' needs {extra:,} B of host memory beyond the plan's (a copy "
                f"of the window's gradients and the new parameters staged until the next step), and "
                f"tiers.host leaves {max(room, 0):,} B: raise tiers.host to at least "
                f"{format_setting(host_budget + extra - room)}, or train without the delayed "
                "update")

    @property
    def pending(self) -> bool:
        """An update was launched and not yet published (it may be done)."""
        return bool(self.units)

    # ------------------------------------------------------------ the window's hooks

    def on_unit_final(self, last_micro: bool):
        return None  # the compute thread never calls the updater's methods while an update runs

    def started(self) -> bool:
        return False  # the update in flight is the previous window's

    def before_update(self) -> None:
        self._finish()  # the previous window's update is published

    def apply(self, pending: list, grad_scale: float, factor: float) -> None:
        self.launch(pending, self.optimizer.hyper_table(), grad_scale)  # runs during the next window

    def quiesce(self) -> None:
        self._wait_update()  # waited, not published
        super().quiesce()

    def failure(self) -> "str | None":
        if self.error is None:
            return None
        why = (f"the delayed update of the previous window failed ({type(self.error).__name__}: {self.error}) "
               "after some of its units were updated")
        self.drop()
        return why

    def applied_baseline(self) -> int:
        return self.applied_after if self.pending else super().applied_baseline()  # in flight: counted as done

    def on_forward(self, grad_enabled: bool) -> None:
        self._forward_in_window = self._forward_in_window or grad_enabled  # opens the window
        self._gate_reads()

    def on_drop(self) -> None:
        self._forward_in_window = False
        self._gate_reads()

    def before_read(self) -> None:
        """A read of the weights (a parameter's value, a forward without grad, engine.gathered())
        between windows publishes the pending update first, so it sees what model.state_dict() sees
        and ends the delay; within a window (from its training forward to its step) it reads the
        weights the window computes with, and publishes nothing."""
        super().before_read()
        if self.pending and not self._forward_in_window and self.window.can_publish:
            self._finish()
        self._gate_reads()

    def _gate_reads(self) -> None:
        """The surface's hot path (reads of resident units as torch) is off while a read would publish."""
        if self.surface is not None:
            self.surface.publish_first = self.pending and not self._forward_in_window

    def publish(self, what: str, force: bool = False) -> None:
        """engine.synchronize() and what calls it (checkpoints, state_dicts, weight reads and writes):
        the pending update lands and is published, ending the delay. Refused between a window's
        training forward and its step (unless `force`: close)."""
        if not self.pending:
            return
        broken = self.window.broken is not None
        if self._forward_in_window and not force and not broken:
            raise ZerotierError(f"{what} between a training forward and engine.step() with train.overlap = "
                                "'delayed': it would publish the previous window's update now, so this window's backward "
                                "would re-fetch other weights than its forward used. Call it after engine.step() "
                                "(or run that forward under torch.no_grad())")
        if broken:
            self.drop()
        else:
            self._finish()
        self._gate_reads()

    def _finish(self) -> None:
        """The update in flight lands and is published. Its failure breaks the engine (some units were
        updated, others not): [Note: a step is all or nothing]."""
        try:
            self.finish()
        except BaseException as exc:
            self.window.mark_broken(f"the delayed update of the previous window failed ({type(exc).__name__}: "
                                    f"{exc}) after some of its units were updated")
            raise
        self.window.applied_before = self.rt.unit_optimizer.applied

    def master_of(self, unit):
        """The fp32 master a stale unit's file is rewritten from ([Note: a failed write-back] in params_writes.py).
        While an update is pending, the master has moved on (or is moving) past the weights the file must
        hold, and nothing else keeps them: the engine breaks, naming load_checkpoint, rather than train the
        window on weights one update fresher than its other units'."""
        if self.pending:
            rt = self.rt
            cause = rt.params.slots[unit.index].failed_write
            why = (f"writing the parameters of unit '{unit.name or '<root>'}' to {rt.params.loc.value} failed "
                   f"({cause}) while the delayed update (train.overlap = 'delayed') moved its fp32 master on, so the "
                   "weights this window must read are kept nowhere")
            self.window.mark_broken(why)
            raise ZerotierError(f"{why}. Load a checkpoint (engine.load_checkpoint(root)) to continue") from cause
        return super().master_of(unit)

    # ------------------------------------------------------------ the update in flight

    def launch(self, units: list, hypers, grad_scale: float) -> None:
        """Copy the window's gradients of `units` (READY) and start their update; the caller drops
        the window's gradients after this. Nothing is started if a copy fails."""
        e = self.rt
        grads, got = {}, {}  # `hypers`: a snapshot (HyperTable), whatever an lr scheduler changes meanwhile
        try:
            for unit in units:
                shard = e.grads.shard(unit)
                block = e.host_pool.alloc(shard.numel() * shard.element_size(), shard.dtype,
                                          f"{unit.key}.grad delayed")
                grads[unit.index] = block
                block.tensor.copy_(shard)  # a device shard: a synchronous D2H copy
                got[unit.index] = e.grads.got(unit)
        except BaseException:
            for block in grads.values():
                e.host_pool.free(block)
            raise
        self.units, self._grads, self.error = list(units), grads, None
        self.applied_after = e.unit_optimizer.applied + len(units)

        def run():
            opt = e.unit_optimizer
            for unit in opt.step(self.units, lambda u: grads[u.index].tensor, e.params.staged_out,
                                 hypers, grad_scale, drain=True, got_of=lambda u: got[u.index]):
                e.host_pool.free(grads.pop(unit.index))  # its update read it: the memory goes back now
        # [Note: thread ownership]
        threads.hand(threads.OPTIMIZER, e.params, e.unit_optimizer, e.unit_optimizer.state)
        self.future = self._thread.submit(run)

    def _wait_update(self) -> None:
        """Wait for the update in flight, if any (a Ctrl-C meanwhile is held until it is done, then
        raised) and take the updater back; its error is kept in `error`."""
        future, self.future = self.future, None
        if future is None:
            return
        self.error, interrupted = wait_out(future)
        e = self.rt
        threads.hand(threads.COMPUTE, e.params, e.unit_optimizer, e.unit_optimizer.state)
        for block in self._grads.values():
            e.host_pool.free(block)
        self._grads = {}
        if interrupted is not None:
            raise interrupted

    def finish(self) -> None:
        """Wait for the update and publish every unit's new parameters. If it failed, its staged
        parameters are dropped and its error raised (some units were updated, others not: the
        caller breaks the engine)."""
        self._wait_update()
        e = self.rt
        units, self.units = self.units, []
        error, self.error = self.error, None
        if error is not None:
            for unit in units:
                e.params.drop_out(unit)
            raise error
        for unit in units:
            e.params.commit(unit)
        e.params.finish_commits()

    def drop(self) -> None:
        """Forget a failed update's staged parameters (load_checkpoint replaces every state)."""
        self._wait_update()
        for unit in self.units:
            self.rt.params.drop_out(unit)
        self.units, self.error = [], None
