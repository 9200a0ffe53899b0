"""The offload engine: hooks a model's forward/backward and drives the stores, prefetch and
the optimizer. It owns no bytes itself:

  params.ParamStore     where each unit's low-precision parameters live, fetch / release / write-back
  grads.GradStore       gradient accumulation, reduction, the shard the optimizer reads
  optim.UnitOptimizer   fp32 master + Adam moments, the update
  schedule.PrefetchScheduler   the order of fetches (trace of step 1)

    engine = zerotier.initialize(model, config)
    loss = engine(batch)          # forward (the module's own hooks fetch parameters)
    engine.backward(loss)         # scaled, accumulated; grads stream to their tier
    engine.step()                 # every micro-batch; updates at accumulation boundaries

See docs/design.md for a unit's bytes through one step. By concern:

  hooks.ModuleHooks     the module hooks: fetch before forward, release after, refetch for backward
  window.Window         the accumulation window's state (WindowState) and the step that ends it
  restore.UserWeights   the trained weights as the user's model shows them, and given back at close()
"""
from __future__ import annotations

import sys
import weakref

import torch

from ..config import Config
from ..device import choose as choose_device
from ..dist import init_distributed
from ..dist.sharding import Sharding
from ..errors import ConfigError, TrainingStopped, ZerotierError
from ..grads import GradStore, refuse_sparse_gradients
from ..materialize import pool_bytes as materialize_pool_bytes
from ..optim.offload import UnitOptimizer
from ..optim.rules import make_rule
from ..optim.state_layout import StateLayout
from ..optim.torch_optimizer import EngineOptimizer, Loop, exempt_from_decay
from .trainer_guard import check_plain_trainer
from ..params import ParamStore
from ..planner.machine_fit import refuse_over as refuse_over_machine
from ..planner import plan_check
from ..planner.inputs import ModelFacts, Node, PlanConfig
from ..planner.planner import make_plan
from ..profiler import Profiler
from .restore import UserWeights
from ..scaler import LossScaler
from ..schedule import PrefetchScheduler
from .hooks import ModuleHooks
from ..state import DTYPES, Location, build_units
from .placement import Placement
from .param_surface import ParamSurface
from .runtime import Runtime, Settings
from .window import Window
from ..overlap import policy_for
from . import clip, stop
from ..carried import Carried
from ..checkpoint_lock import RootLocks
from ..tiers.base import Charged
from ..tiers.lagging import make_device_tier
from ..tiers.host import HostPool, trim_heap
from ..units import format_size


def _weak_call(engine: "Engine", name: str):
    """engine.<name>(*args) through a weak reference (nothing once the engine is gone): for the
    collaborators the user's objects hold (engine.optimizer, the parameters' surface)."""
    ref = weakref.ref(engine)

    def call(*args):
        live = ref()
        return None if live is None else getattr(live, name)(*args)
    return call


def initialize(model: torch.nn.Module, config=None, *, wrap=None, init_fn=None) -> "Engine":
    """Wrap `model` for training under `config` (dict, file path or Config). `wrap`: a callable
    (module name, module) -> bool choosing the modules that are units; overrides train.wrap
    ([Note: units] in state.py). A model built on the meta device is materialized unit by unit,
    by each module's reset_parameters() or `init_fn(module)` ([Note: meta-device models])."""
    engine = Engine(model, Config.coerce(config).auto_to_defaults(), wrap, init_fn)  # [Note: keys a trainer fills]
    clip.install(engine)  # torch.nn.utils.clip_grad_norm_ on its parameters ([Note: the user's clipping])
    return engine


class Engine:
    def __init__(self, model: torch.nn.Module, cfg: Config, wrap=None, init_fn=None):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"zerotier.initialize expects an nn.Module, got {type(model).__name__}")
        owner = getattr(model, "_zerotier_engine", None)
        if owner is not None and owner() is not None:
            raise ConfigError("this model is already managed by a zerotier engine (zerotier.initialize was called "
                              "on it before): call that engine's close() first, which puts the trained weights "
                              "back into the model, or build a new model")
        if getattr(model, "_zerotier_lost", None):  # [Note: a failed initialize]
            raise ConfigError(model._zerotier_lost)
        self.settings = Settings(cfg)  # engine.cfg ([Note: the runtime record] in runtime.py)
        self.module = model
        # [Note: choosing the device] in device.py: before anything allocates or a group exists
        self.device = choose_device(cfg.train.device)
        refuse_sparse_gradients(model)
        units = build_units(model, cfg.train.wrap if wrap is None else wrap)
        if not any(not u.frozen for u in units):
            raise ConfigError("the model has no trainable parameters (all are frozen or there are none); "
                              "there is nothing for zerotier to train")
        self.lp_dtype = DTYPES[cfg.precision.param_dtype]
        # [Note: the user's model stays the truth] in restore.py: what each parameter was before we took it
        user_form = {id(p): (p.dtype, p.device) for u in units for p in u.params}
        self.rank, self.world_size = init_distributed(cfg.zero, self.device)
        self.sharding = Sharding(cfg.zero, self.rank, self.world_size)
        # [Note: frozen units] in state.py: the stepped units, then the frozen ones (indices go on)
        self.param_units = self.sharding.assign(units)
        self.units = [u for u in self.param_units if not u.frozen]
        self.frozen_units = self.param_units[len(self.units):]
        self.plan = make_plan(ModelFacts.of(self.param_units, materialize_bytes=materialize_pool_bytes(
                                  self.param_units, self.lp_dtype, cfg.io.alignment)),
                              PlanConfig.of(cfg), Node(self.device, world_size=self.world_size))
        refuse_over_machine(self.plan.need, self.device)  # [Note: the plan against the machine]
        policy_for(cfg).refuse(cfg, self.plan, self.world_size)  # [Note: overlap policies]
        placement = self.plan.placement
        self.store = None
        if Location.NVME in placement.values():
            from ..tiers.nvme import NVMeStore  # only runs that use NVMe open a run directory
            self.store = NVMeStore(cfg.tiers, cfg.io, budget=self.plan.budgets["nvme"])
        # Every byte the engine keeps on the compute device is counted by the device tier,
        # every host byte is a block of the pinned aligned host pool (tiers.host).
        self.device_tier = make_device_tier(self.plan.budgets["device"], self.device, timing=cfg.profile.enabled)
        self.host_pool = HostPool(self.plan.budgets["host"], alignment=cfg.io.alignment,
                                  pin=self.device.type == "cuda",  # [Note: a reused block's slack is the cache's]
                                  slack_limit=self.plan.budgets["host"] - self.plan.need["host"])
        # None when profiling is off: every call site is one `if prof is not None:` (zero cost).
        self.profiler = Profiler.from_config(cfg.profile, self._residency, device=self.device,
                                             unit_names={u.key: u.name for u in self.param_units},
                                             planned_rollback_rate=self.plan.rollback_rate if self.plan.speculative
                                             else None)
        self.scaler = LossScaler(cfg.precision)
        self._check_plan = plan_check.enabled()  # [Note: the plan against the run's peaks]
        charge = lambda tier, kind: Charged(tier, kind) if self._check_plan and tier is not None else tier  # noqa: E731
        tiers = lambda kind: [charge(t, kind) for t in (self.device_tier, self.host_pool, self.store)]  # noqa: E731
        optimizer_loc = self.plan.optimizer_units or placement["optimizer"]  # a tier, or one per unit (a split)
        rule = make_rule(cfg.optimizer.type)  # the update rule (optim/rules/)
        self.unit_optimizer = UnitOptimizer(self.units, cfg.optimizer, optimizer_loc, *tiers("optimizer"),
                                            self.profiler, StateLayout.of(cfg.precision, rule), rule,
                                            self.plan.optimizer_step_on, charge(self.device_tier, "device_step"))
        no_decay = exempt_from_decay(model, self.units, cfg.optimizer.no_weight_decay)  # checked before placing
        self.params = ParamStore(self.param_units, placement["params"], self.lp_dtype, *tiers("params"),
                                 self.sharding, placement["optimizer"], tiers("optimizer")[:2],
                                 cfg.prefetch.lookahead if cfg.prefetch.enabled else 0, self.profiler)
        self.params.master_of = lambda unit: self.window.overlap.master_of(unit)  # [Note: a failed write-back]
        self.grads = GradStore(self.units, placement["gradients"], DTYPES[cfg.precision.accumulator_dtype],
                               *tiers("gradients")[:2], self.sharding, cfg.zero.reduce_bucket_size,
                               charge(self.store, "gradients"), self.profiler)
        # [Note: the runtime record] in runtime.py: what the collaborators below receive instead of the engine
        self.runtime = Runtime(model, self.device, self.lp_dtype, self.plan, self.sharding, self.scaler,
                               self.profiler, self.param_units, self.units, self.frozen_units, self.params,
                               self.grads, self.unit_optimizer, self.device_tier, self.host_pool, self.store,
                               self.settings)
        self.weights = UserWeights(self.runtime, user_form, self.synchronize)
        self.checkpoint_locks = RootLocks()  # the roots it saves into ([Note: the checkpoint root lock])
        self._stop_code = 0  # [Note: graceful stop] in stop.py
        self._placement = Placement(self.runtime, self.weights, init_fn)  # the units into the stores
        try:
            self._placement.run()
        except BaseException:
            self._placement.undo()  # [Note: a failed initialize] in placement.py
            self.store = None  # closed with its run directory
            self.sharding.close()
            raise
        # over the placed parameters ([Note: param groups]); the HF Trainer check: trainer_guard.py
        self.optimizer = EngineOptimizer(self.runtime, cfg.optimizer, self._optimizer_loop(), no_decay,
                                         on_first_train=check_plain_trainer, given=cfg.given)
        # the loop's state ([Note: the plain PyTorch loop] in window.py); its update counts in engine.optimizer
        self.window = Window(self.runtime, self.optimizer)
        self.carried = Carried(self.optimizer)  # [Note: what a checkpoint carries] in carried.py
        self.scheduler = PrefetchScheduler(
            cfg.prefetch, [u.numel * self.lp_dtype.itemsize for u in self.param_units],
            [u.name for u in self.param_units],
            self.params.prefetch, self.params.inflight_bytes)
        # [Note: the parameter surface] in surface.py: reads and writes of managed parameters
        self.surface = ParamSurface(self.runtime, self.window, self.weights, _weak_call(self, "synchronize"))
        self.hooks = ModuleHooks(self.runtime, self.window, self.scheduler, self.surface, user_form,
                                 self._stop_before_window)  # [Note: fetch and release] in hooks.py
        self.hooks.register([u for u in self.param_units if self.params.streamed[u.index]])
        self.window.overlap.surface = self.surface  # what a delayed update gates ([Note: delayed update])
        if cfg.train.handle_signals:
            stop.register(self)
        model._zerotier_engine = weakref.ref(self)  # the model does not keep the engine alive
        self.hooks.handles.append(self.weights.install_state_dict_hook(model))
        self.surface.adopt()
        self.hooks.guard_root_methods()
        trim_heap()  # the user's tensors and placement temporaries ([Note: heap trimming])

    @property
    def cfg(self) -> Config:
        return self.settings.cfg

    @cfg.setter
    def cfg(self, cfg: Config) -> None:
        """A new Config for the live engine (ZerotierTrainer's train keys): every collaborator reads it
        at its next call ([Note: the runtime record] in runtime.py)."""
        self.settings.cfg = cfg

    def _residency(self) -> dict[str, tuple[int, int]]:
        tiers = {"device": self.device_tier, "host": self.host_pool}
        if self.store is not None:
            tiers["nvme"] = self.store
        return {name: (t.used, t.budget) for name, t in tiers.items()}

    # ------------------------------------------------------------ training API

    def __call__(self, *args, **kwargs):
        if self.profiler is None:
            return self.module(*args, **kwargs)
        with self.profiler.compute("forward"):
            return self.module(*args, **kwargs)

    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        return self.train(False)

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate `loss` of one micro-batch (divided by grad_accum_steps, times the loss scale)."""
        self.window.backward(loss)

    def step(self) -> bool:
        """Call after every micro-batch's backward. Returns True when the parameters were updated.

        [Note: a step is all or nothing] If step() raises before any unit was updated, nothing
        changed: the gradients are intact and step() may be called again; a backward that failed
        half-way leaves partial gradients, which zero_grad() drops with the rest of the window, whose
        micro-batch count starts again at its first micro-batch (so the window is run again, or the
        next data forms whole windows, never windows shifted by the failed one). Once a unit was
        updated (here or during backward) an error leaves the engine *broken*
        (WindowState.BROKEN): some units hold the new weights, others the old; step(), backward()
        and save_checkpoint() then refuse, naming load_checkpoint(). No update runs after the error
        has reached the caller."""
        ends_window, steps = self.window.ends_window(), self.global_steps
        updated = self.window.step()
        if self._check_plan:
            plan_check.check_peaks(self.plan.needs, device=self.device_tier, host=self.host_pool, nvme=self.store)
        if self.global_steps != steps:
            self.carried.stepped()  # the engine's lr scheduler, before a checkpoint may be written
        if ends_window:
            self._maybe_stop()
        return updated

    def _optimizer_loop(self) -> Loop:
        """engine.optimizer's calls into the loop, through weak references: the optimizer (which an lr
        scheduler or the user may hold) keeps no engine alive."""
        ref = weakref.ref(self)
        return Loop(step=_weak_call(self, "_plain_step"), zero_grad=_weak_call(self, "zero_grad"),
                    synchronize=_weak_call(self, "synchronize"), closed=lambda: ref() is None or ref().closed)

    def _plain_step(self) -> None:
        """engine.optimizer.step() of the plain PyTorch loop ([Note: the plain PyTorch loop] in window.py)."""
        steps = self.global_steps
        applied = self.window.optimizer_step()
        if self._check_plan:  # [Note: the plan against the run's peaks]
            plan_check.check_peaks(self.plan.needs, device=self.device_tier, host=self.host_pool, nvme=self.store)
        if self.global_steps != steps:
            self.carried.stepped()
        if applied:
            self._maybe_stop()

    @property
    def lr_scheduler(self):
        """The lr scheduler set by set_lr_scheduler, or None."""
        return self.carried.lr_scheduler

    def set_lr_scheduler(self, scheduler) -> None:
        """Hand `scheduler` (built over engine.optimizer) to the engine, as DeepSpeed's initialize(lr_scheduler=):
        the engine steps it after every update (the loop no longer does) and every checkpoint carries it, the
        one train.checkpoint_on_signal writes included; load_checkpoint restores it ([Note: what a checkpoint
        carries] in carried.py)."""
        self.carried.set_lr_scheduler(scheduler)

    def register_for_checkpointing(self, *objects) -> None:
        """Objects with state_dict() / load_state_dict() (a data position, a sampler) that every checkpoint
        carries and load_checkpoint restores, in this order (accelerate's register_for_checkpointing;
        [Note: what a checkpoint carries] in carried.py)."""
        self.carried.register(objects)

    @property
    def micro_steps(self) -> int:
        """Micro-batches stepped ([Note: the step counters] in steps.py)."""
        return self.runtime.steps.micro_steps

    @property
    def global_steps(self) -> int:
        """Updates applied ([Note: the step counters] in steps.py)."""
        return self.runtime.steps.global_steps

    @property
    def run_id(self) -> str:
        """Names this run's checkpoints ([Note: checkpoint retention] in checkpoint.py)."""
        return self.runtime.steps.run_id

    def grad_norm(self) -> float:
        """The global norm (before clipping, loss scale removed) of the gradients the next update
        will apply; computed once per window (a collective with several ranks). What HF Trainer
        logs as grad_norm (zerotier.integrations.transformers). Read when this window has no
        gradient yet (after a step), it is the last update's norm and closes nothing."""
        return self.window.grad_norm()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients of the current accumulation window (and a failed backward's partial ones).
        set_to_none=False follows torch: parameters that had a gradient keep a zero one, which Adam
        still steps ([Note: zero gradients that still step] in grads.py)."""
        self.window.zero_grad(set_to_none)

    def no_sync(self):
        """Like DDP's and FSDP's no_sync(): backward() calls inside accumulate their gradients on
        this rank without the reduce-scatter; the window's last micro-batch always reduces (the
        accumulator holds the sum, so the update is the same). One rank: nothing to skip.
        Gradients on NVMe at ZeRO-2/3 reduce each micro-batch anyway (their accumulator is the
        reduced shard's file)."""
        self.window.refuse_if_closed("engine.no_sync()")
        return self.window.no_sync()

    def synchronize(self) -> None:
        """Finish the work in flight: Adam updates started during backward, parameter fetches
        issued but not consumed (e.g. before loading new weights), write-backs."""
        self.window.synchronize("engine.synchronize()")  # [Note: overlap policies]
        self.unit_optimizer.state.drop_prefetched()
        self.params.synchronize()

    # ------------------------------------------------------------ graceful stop ([Note: graceful stop])

    @property
    def closed(self) -> bool:
        return self.window.closed

    @property
    def stop_requested(self) -> bool:
        return self._stop_code != 0

    def request_stop(self, code: int = stop.REQUEST) -> None:
        """Stop at the next step boundary: write a checkpoint to train.checkpoint_on_signal (if set),
        close, and raise zerotier.TrainingStopped. With several ranks, every rank stops after the
        same step. SIGTERM and SIGINT call this (train.handle_signals)."""
        self._stop_code = max(self._stop_code, code)
        self.sharding.stop_code = self._stop_code

    def _maybe_stop(self) -> None:
        """End of a step: stop if this rank (one rank) or any rank (several: agreed in this
        window's Sharding.agree) asked to."""
        if self.sharding.agreed_stop if self.sharding.active else self._stop_code:
            self._stop()

    def _stop_before_window(self) -> None:
        """A training forward would begin a new window (one rank, nothing registered to carry): stop
        before it if asked (the hooks call this; [Note: what a checkpoint carries] in carried.py)."""
        if self.stop_requested and not self.sharding.active and self.window.between_windows() \
                and not self.carried.objects:
            self._stop()

    def _stop(self) -> None:
        code = self.sharding.agreed_stop if self.sharding.active else self._stop_code
        why = stop.describe(code) if code == self._stop_code else f"{stop.describe(code)} on another rank"
        root = self.cfg.train.checkpoint_on_signal
        saved = self.save_checkpoint(root) if root is not None else None
        self.close(restore_weights=saved is None)  # the checkpoint holds the weights: exit fast
        message = (f"zerotier: training stopped after step {self.global_steps} ({why}); "
                   + (f"checkpoint {saved}: resume with engine.load_checkpoint({str(root)!r})" if saved is not None
                      else "no checkpoint written (set train.checkpoint_on_signal to write one)"))
        if self.rank == 0:
            print(message, file=sys.stderr, flush=True)
        raise TrainingStopped(message, stop.exit_status(code), saved)


    def gathered(self, params=None):
        """Context manager: the units of `params` (default: every managed parameter) stay resident
        inside, so many reads of them fetch each unit once (FSDP's summon_full_params). Reads and
        writes outside it work too, one fetch per call ([Note: the parameter surface])."""
        wanted = None if params is None else {id(p) for p in params}
        units = [u for u in self.param_units if wanted is None or any(id(p) in wanted for p in u.params)]
        return self.surface.fetched(units)

    def parameters_fp32(self) -> dict[str, torch.Tensor]:
        """Full-precision weights by parameter name (copies; reads NVMe-resident masters).
        With several ranks this is a collective: every rank must call it."""
        return self.weights.parameters_fp32()

    def raw_state_dict(self) -> dict:
        """`module.state_dict(keep_vars=True)` as torch makes it, without the trained weights (restore.py)."""
        return self.weights.raw_state_dict()

    # ------------------------------------------------------------ checkpoints (checkpoint.py, checkpoint_load.py)

    def _checkpoint_parts(self):
        """What a checkpoint's save and load touch (checkpoint.Parts), the config as it is now."""
        from ..checkpoint import Parts
        return Parts(self.runtime, self.cfg, self.optimizer, self.carried, self.weights, self.surface,
                     self.checkpoint_locks, self.synchronize, self.zero_grad)

    def save_checkpoint(self, root, *, lr_scheduler=None, client_state=None, keep: int | None = 2):
        """Save the training state under `root` as root/ckpt-<global_steps> (collective; only at an
        optimizer-step boundary). Keeps this run's newest `keep` checkpoints (None: all); never
        deletes anything it did not write. Returns the checkpoint directory. See docs/checkpoint.md."""
        from .. import checkpoint
        self.window.refuse_if_broken("engine.save_checkpoint()")
        try:
            return checkpoint.save(self._checkpoint_parts(), root, lr_scheduler=lr_scheduler,
                                   client_state=client_state, keep=keep)
        finally:
            trim_heap()  # the streaming buffers ([Note: heap trimming])

    def load_checkpoint(self, root, *, lr_scheduler=None, trust_pickle: bool = False):
        """Load root/latest (or a ckpt-N directory) into this engine, whatever its placement, stage or
        world size (collective). Returns the saved client_state. See checkpoint_load.load for RNG rules."""
        from .. import checkpoint_load
        self.window.refuse_if_closed("engine.load_checkpoint()")
        self.window.refuse_before_backward("engine.load_checkpoint()")
        self.window.quiesce()
        versions = list(self.params.version)  # a commit bumps them: did the load change anything?
        try:
            client_state = checkpoint_load.load(self._checkpoint_parts(), root, lr_scheduler=lr_scheduler,
                                                trust_pickle=trust_pickle)
        except BaseException as exc:
            if self.params.version != versions:
                self.window.mark_broken(f"engine.load_checkpoint() failed half-way ({type(exc).__name__}: {exc})")
            raise
        self.window.loaded()  # a consistent state again, a new window ([Note: a step is all or nothing])
        trim_heap()  # the streaming buffers ([Note: heap trimming])
        return client_state

    def consolidated_state_dict(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """Plain model weights by state_dict name (trained params from the fp32 master, plus frozen
        params and buffers), for model.load_state_dict. Collective with several ranks."""
        from .. import export
        return export.consolidated_state_dict(self.weights, dtype)

    def report(self):
        """Swap-traffic summary of the run so far (needs profile.enabled = true)."""
        if self.profiler is None:
            raise ZerotierError("engine.report() needs profiling: set profile.enabled = true in the config")
        return self.profiler.report()

    def swap_summary(self) -> str:
        """A terminal table of what moved between tiers: the profiler's table when profiling
        is on, else the tiers' own byte counters."""
        if self.profiler is not None:
            return self.report().table()
        lines = ["swap summary (tier byte counters; set profile.enabled = true for the full table):"]
        tiers = [self.device_tier, self.host_pool] + ([self.store] if self.store is not None else [])
        for tier in tiers:
            st = tier.stats()
            lines.append(f"  {tier.name:7s} in {format_size(st['bytes_in']):>11s}  out {format_size(st['bytes_out']):>11s}"
                         f"  peak {format_size(st['peak']):>11s} of {format_size(st['budget'])}")
        return "\n".join(lines)

    def close(self, restore_weights: bool = True) -> None:
        """Put the trained weights back into the model's parameters (in their original dtype and
        device; a collective with several ranks), remove hooks, stop fetch workers and delete this
        run's NVMe files. Idempotent. restore_weights=False leaves the parameters empty: for
        models too large for the memory they came from (the checkpoint holds the weights)."""
        if self.closed:
            return
        stop.unregister(self)
        broken = self.window.broken
        self.window.close()  # updates in flight waited; every training call refused from here
        # Gradients and optimizer staging are not needed any more: their memory goes first (once), so
        # putting the weights back does not stack on top of it (a model near RAM's size).
        self.grads.close()
        self.unit_optimizer.close()
        self.host_pool.trim()
        self.surface.disown()  # plain parameters again ([Note: the parameter surface])
        self.weights.give_back(restore_weights, broken)
        self.hooks.remove()
        if getattr(self.module, "_zerotier_engine", None) is not None:
            del self.module._zerotier_engine
        self.window.shutdown()  # the optimizer thread
        self.params.close()  # the gradient store and the optimizer were closed above, before give_back
        self.device_tier.close()  # copies still on its streams finish before their buffers go
        self.sharding.close()  # after the last collective (give_back's gathers)
        try:
            if self.profiler is not None:
                self.profiler.close()  # writes profile.trace_path, if set
        finally:  # a trace that cannot be written must not keep the run's NVMe files (#13)
            if self.store is not None:
                self.store.close()
                self.store = None
            self.host_pool.close()
            self.checkpoint_locks.release()  # other runs may save into its roots now
            trim_heap()  # [Note: heap trimming]

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        # after an error, ranks may not all reach close(): no collective then
        self.close(restore_weights=exc_type is None or not self.sharding.active)
