"""The delayed parameter update (`train.delayed_update`): ZeRO-Offload's DPU. Opt-in, and not
the same training as without it.

[Note: delayed update]
The math (one rank; engine.step() or, in the plain loop, engine.optimizer.step() ends a window:
[Note: the plain PyTorch loop] in window.py). At the step that ends window k the gradients g_k
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

How (Window._apply, `DelayedUpdate`):
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
(Window.finish_delayed), and so does every call that reads or replaces the fp32 state through
it: save_checkpoint / load_checkpoint, the optimizer's state_dict / load_state_dict,
model.state_dict(), writes of managed parameters' values, parameters_fp32,
consolidated_state_dict, close(). So does any other read of the weights between windows (after
a step(), before the next forward with grad enabled: Window.publish_for_read): a managed
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
already runs on the accelerator), train.early_step / train.speculative_step = true (their
updates run during backward, under the pending one).
"""
from __future__ import annotations

from concurrent.futures import Future

from . import threads
from .units import format_setting
from .errors import BudgetError, ConfigError, ZerotierError
from .state import DTYPES, Location


def host_bytes(shard_numels: list[int], grad_itemsize: int, lp_itemsize: int, alignment: int) -> int:
    """Host-pool bytes a delayed update holds at most beyond the plan's ([Note: delayed update]): each
    unit's gradient copy and its staged new parameters, each a block rounded up to `alignment`."""
    def block(nbytes: int) -> int:
        return -(-nbytes // alignment) * alignment
    return sum(block(n * grad_itemsize) + block(n * lp_itemsize) for n in shard_numels)


def refuse(cfg, plan, world_size: int, shard_numels: "list[int] | None" = None) -> None:
    """What train.delayed_update cannot run, refused before anything is placed ([Note: delayed update]);
    with `shard_numels` (the stepped units'), also a host budget without room for host_bytes()."""
    train = cfg.train
    if not train.delayed_update:
        return
    why = None
    if train.early_step:
        why = "train.early_step = true updates units during backward, under the pending update: set one of them"
    elif train.speculative_step is True:
        why = ("train.speculative_step = true updates units during backward, under the pending update: set "
               "train.speculative_step = false or 'auto' (auto is off with a delayed update)")
    elif world_size > 1:
        why = (f"{world_size} ranks: the delayed update runs on one rank only (each rank's shard update and its "
               "gather would have to overlap the next window); train without it, or on one rank")
    elif plan.placement["gradients"] is Location.NVME:
        why = ("the gradients are on nvme (offload.gradients): the window's gradients are copied to host memory "
               "for the update that runs during the next window, which gradients on nvme are there to spare; "
               "set offload.gradients = 'host', or train without the delayed update")
    else:
        optimizer = plan.optimizer_units or (plan.placement["optimizer"],)
        if Location.DEVICE in optimizer:
            why = ("the optimizer state is on the device (offload.optimizer): the update already runs on the "
                   "accelerator, and the delay hides a CPU update; set offload.optimizer = 'host' or 'nvme'")
    if why is not None:
        raise ConfigError(f"train.delayed_update = true cannot run here: {why}")
    if shard_numels is None:
        return
    precision = cfg.precision
    extra = host_bytes(shard_numels, DTYPES[precision.accumulator_dtype].itemsize,
                       DTYPES[precision.param_dtype].itemsize, cfg.io.alignment)
    # the speculative step is off with it: its allowance (in the plan's need) is free for this
    room = plan.budgets["host"] - plan.need["host"] + plan.speculation_undo_bytes["host"]
    if extra > room:
        raise BudgetError(f"train.delayed_update = true needs {extra:,} B of host memory beyond the plan's (a copy "
                          f"of the window's gradients and the new parameters staged until the next step), and "
                          f"tiers.host leaves {max(room, 0):,} B: raise tiers.host to at least "
                          f"{format_setting(plan.budgets['host'] + extra - room)}, or train without the delayed "
                          "update")


class DelayedUpdate:
    """The one update in flight under train.delayed_update ([Note: delayed update]): a window's
    units, the copies of their gradients, and the future of their update on the optimizer thread."""

    def __init__(self, engine, optim_thread):
        self.engine = engine
        self._thread = optim_thread
        self.future: Future | None = None
        self.units: list = []             # units whose new parameters wait in staged_out
        self._grads: dict[int, object] = {}  # unit index -> host-pool block: the gradient copy
        self.applied_after = 0            # UnitOptimizer.applied once the update is done
        self.error: BaseException | None = None  # the update's failure, once waited for

    @property
    def pending(self) -> bool:
        """An update was launched and not yet published (it may be done)."""
        return bool(self.units)

    def launch(self, units: list, hyper_of, grad_scale: float) -> None:
        """Copy the window's gradients of `units` (READY) and start their update; the caller drops
        the window's gradients after this. Nothing is started if a copy fails."""
        e = self.engine
        grads, got, hypers = {}, {}, {}
        try:
            for unit in units:
                shard = e.grads.shard(unit)
                block = e.host_pool.alloc(shard.numel() * shard.element_size(), shard.dtype,
                                          f"{unit.key}.grad delayed")
                grads[unit.index] = block
                block.tensor.copy_(shard)  # a device shard: a synchronous D2H copy
                got[unit.index] = e.grads.got(unit)
                hypers[unit.index] = list(hyper_of(unit))  # an lr scheduler may change them meanwhile
        except BaseException:
            for block in grads.values():
                e.host_pool.free(block)
            raise
        self.units, self._grads, self.error = list(units), grads, None
        self.applied_after = e.unit_optimizer.applied + len(units)

        def run():
            opt = e.unit_optimizer
            for unit in opt.step(self.units, lambda u: grads[u.index].tensor, e.params.staged_out,
                                 lambda u: hypers[u.index], grad_scale, drain=True, got_of=lambda u: got[u.index]):
                e.host_pool.free(grads.pop(unit.index))  # its update read it: the memory goes back now
        threads.hand(threads.OPTIMIZER, e.params, e.unit_optimizer)  # [Note: thread ownership]
        self.future = self._thread.submit(run)

    def wait(self) -> None:
        """Wait for the update (a Ctrl-C meanwhile is held until it is done: none may still run once an
        error reached the caller) and take the updater back; its error is kept in `error`."""
        future, self.future = self.future, None
        if future is None:
            return
        interrupted = None
        while True:
            try:
                self.error = future.exception()
                break
            except KeyboardInterrupt as exc:
                interrupted = exc
        e = self.engine
        threads.hand(threads.COMPUTE, e.params, e.unit_optimizer)
        for block in self._grads.values():
            e.host_pool.free(block)
        self._grads = {}
        if interrupted is not None:
            raise interrupted

    def finish(self) -> None:
        """Wait for the update and publish every unit's new parameters. If it failed, its staged
        parameters are dropped and its error raised (some units were updated, others not: the
        caller breaks the engine)."""
        self.wait()
        e = self.engine
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
        self.wait()
        for unit in self.units:
            self.engine.params.drop_out(unit)
        self.units, self.error = [], None


def master_of(engine, unit):
    """The fp32 master a stale unit's file is rewritten from ([Note: a failed write-back] in params_writes.py).
    While a delayed update is pending, the master has moved on (or is moving) past the weights the file
    must hold, and nothing else keeps them: the engine breaks, naming load_checkpoint, rather than
    train the window on weights one update fresher than its other units' ([Note: delayed update])."""
    update = engine.window.delayed
    if update is not None and update.pending:
        cause = engine.params.slots[unit.index].failed_write
        why = (f"writing the parameters of unit '{unit.name or '<root>'}' to {engine.params.loc.value} failed "
               f"({cause}) while the delayed update (train.delayed_update) moved its fp32 master on, so the weights "
               "this window must read are kept nowhere")
        engine.window.mark_broken(why)
        raise ZerotierError(f"{why}. Load a checkpoint (engine.load_checkpoint(root)) to continue") from cause
    return engine.unit_optimizer.read_state(unit, ("master",))["master"]


def grad_copy_bytes(grad_numels: list[int], grad_itemsize: int) -> int:
    """Host bytes of one window's gradient copy ([Note: delayed update]): what a plan must add."""
    return sum(grad_numels) * grad_itemsize


