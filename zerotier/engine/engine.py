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
from ..errors import ConfigError, ZerotierError
from ..grads import GradStore, refuse_sparse_gradients
from ..materialize import Materializer, is_meta, pool_bytes as materialize_pool_bytes
from ..optim.offload import UnitOptimizer
from ..optim.state_layout import StateLayout
from ..planner.predict import StepOptions
from ..optim.torch_optimizer import EngineOptimizer, Loop, exempt_from_decay
from ..integrations.plain_trainer import check_plain_trainer
from ..params import ParamStore
from ..planner.machine_fit import refuse_over as refuse_over_machine
from ..planner import plan_check
from ..planner.planner import make_plan
from ..profiler import Profiler
from .restore import UserWeights
from ..scaler import LossScaler
from ..schedule import PrefetchScheduler
from .hooks import ModuleHooks
from ..state import DTYPES, Location, build_units, nested_numel
from .surface import ParamSurface
from .runtime import Runtime
from .window import Window, WindowState
from ..overlap import policy_for
from . import clip, stop
from ..carried import Carried
from ..checkpoint_lock import RootLocks
from ..tiers.base import Charged
from ..tiers.lagging import make_device_tier
from ..tiers.host import HostPool, trim_heap
from ..units import format_size


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
        self.cfg = cfg
        self.module = model
        self._init_fn = init_fn
        # [Note: choosing the device] in device.py: before anything allocates or a group exists
        self.device = choose_device(cfg.train.device)
        refuse_sparse_gradients(model)
        units = build_units(model, cfg.train.wrap if wrap is None else wrap)
        if not any(not u.frozen for u in units):
            raise ConfigError("the model has no trainable parameters (all are frozen or there are none); "
                              "there is nothing for zerotier to train")
        self.lp_dtype = DTYPES[cfg.precision.param_dtype]
        # [Note: the user's model stays the truth] in restore.py: what each parameter was before we took it
        self._user_form = {id(p): (p.dtype, p.device) for u in units for p in u.params}
        self.weights = UserWeights(self, self._user_form)
        self.rank, self.world_size = init_distributed(cfg.zero, self.device)
        self.sharding = Sharding(cfg.zero, self.rank, self.world_size)
        # [Note: frozen units] in state.py: the stepped units, then the frozen ones (indices go on)
        self.param_units = self.sharding.assign(units)
        self.units = [u for u in self.param_units if not u.frozen]
        self.frozen_units = self.param_units[len(self.units):]
        self.plan = make_plan([u.numel for u in self.units], cfg.tiers, cfg.offload, cfg.precision,
                              cfg.prefetch, self.device, world_size=self.world_size, stage=cfg.zero.stage, zero=cfg.zero,
                              pipeline_depth=cfg.optimizer.pipeline_depth,
                              nested_numel=nested_numel(self.param_units), alignment=cfg.io.alignment,
                              frozen_numels=[u.numel for u in self.frozen_units],
                              unit_names=[u.name for u in self.units + self.frozen_units],
                              step=StepOptions.of(cfg),  # clipping, accumulation, speculation
                              materialize_bytes=materialize_pool_bytes(self.param_units, self.lp_dtype,
                                                                       cfg.io.alignment))
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
                                  pin=self.device.type == "cuda")
        # None when profiling is off: every call site is one `if prof is not None:` (zero cost).
        self.profiler = Profiler.from_config(cfg.profile, self._residency, device=self.device,
                                             unit_names={u.key: u.name for u in self.param_units},
                                             planned_rollback_rate=self.plan.rollback_rate if self.plan.speculative
                                             else None)
        self.scaler = LossScaler(cfg.precision)
        self._check_plan = plan_check.enabled()  # [Note: the plan against the run's peaks]
        tiers = lambda component: (Charged(self.device_tier, component), Charged(self.host_pool, component)) \
            if self._check_plan else (self.device_tier, self.host_pool)  # noqa: E731
        optimizer_loc = self.plan.optimizer_units or placement["optimizer"]  # a tier, or one per unit (a split)
        self.unit_optimizer = UnitOptimizer(self.units, cfg.optimizer, optimizer_loc, *tiers("optimizer"),
                                            self.store, self.profiler, StateLayout.of(cfg.precision))
        no_decay = exempt_from_decay(model, self.units, cfg.optimizer.no_weight_decay)  # checked before placing
        self.params = ParamStore(self.param_units, placement["params"], self.lp_dtype, *tiers("params"),
                                 self.store, self.sharding, placement["optimizer"],
                                 cfg.prefetch.lookahead if cfg.prefetch.enabled else 0, self.profiler)
        self.params.master_of = lambda unit: self.window.overlap.master_of(unit)  # [Note: a failed write-back]
        self.grads = GradStore(self.units, placement["gradients"], DTYPES[cfg.precision.accumulator_dtype],
                               *tiers("gradients"), self.sharding, cfg.zero.reduce_bucket_size,
                               self.store, self.profiler)
        # [Note: the runtime record] in runtime.py: what the collaborators below receive instead of the engine
        self.runtime = Runtime(model, self.device, self.lp_dtype, self.plan, self.sharding, self.scaler,
                               self.profiler, self.param_units, self.units, self.frozen_units, self.params,
                               self.grads, self.unit_optimizer, self.device_tier, self.host_pool, self.store)
        self.checkpoint_locks = RootLocks()  # the roots it saves into ([Note: the checkpoint root lock])
        self._stop_code = 0  # [Note: graceful stop] in stop.py
        try:
            self._place_all()
        except BaseException:
            self._undo_place()  # [Note: a failed initialize]
            self.sharding.close()
            raise
        self.window = Window(self)  # the loop's state ([Note: the plain PyTorch loop] in window.py)
        # over the placed parameters ([Note: param groups]); the HF Trainer check: integrations/plain_trainer.py
        self.optimizer = EngineOptimizer(self.runtime, cfg.optimizer, self._optimizer_loop(), no_decay,
                                         on_first_train=check_plain_trainer)
        self.carried = Carried(self.optimizer)  # [Note: what a checkpoint carries] in carried.py
        self.scheduler = PrefetchScheduler(
            cfg.prefetch, [u.numel * self.lp_dtype.itemsize for u in self.param_units],
            [u.name for u in self.param_units],
            self.params.prefetch, self.params.inflight_bytes)
        self.hooks = ModuleHooks(self)  # [Note: fetch and release] in hooks.py
        self.hooks.register([u for u in self.param_units if self.params.streamed[u.index]])
        if cfg.train.handle_signals:
            stop.register(self)
        model._zerotier_engine = weakref.ref(self)  # the model does not keep the engine alive
        self.hooks.handles.append(self.weights.install_state_dict_hook(model))
        # [Note: the parameter surface] in surface.py: reads and writes of managed parameters
        self._surface = ParamSurface(self)
        self._surface.adopt()
        self.hooks.guard_root_methods()
        trim_heap()  # the user's tensors and placement temporaries ([Note: heap trimming])

    # ------------------------------------------------------------ placement

    def _place_all(self) -> None:
        """Every rank starts from rank 0's weights; each store takes its part of every unit.
        The user's tensors are dropped (the parameters become views of the engine's flats)."""
        sharding = self.sharding
        # [Note: meta-device models]; [Note: materialization in the host pool]
        materializer = self._materializer = Materializer(self.module, self._init_fn, self.host_pool)
        for i, unit in enumerate(self.param_units):
            if is_meta(unit):  # the stores hold these lists: they see the rebuilt unit
                unit = self.param_units[i] = materializer.unit(unit)
                (self.frozen_units if unit.frozen else self.units)[i - len(self.units) * unit.frozen] = unit
                self._user_form.update({id(p): (p.dtype, torch.device("meta")) for p in unit.params})
            pooled = materializer.flat(unit)  # the materialized unit's flat in the host pool, or None
            if unit.frozen:  # [Note: frozen units]: its low-precision bytes only
                full = materializer.cast(unit, pooled, self.lp_dtype) if pooled is not None else \
                    torch.cat([p.detach().reshape(-1).to(self.lp_dtype).cpu() for p in unit.params])
                sharding.broadcast(full)
                self._swapped = i + 1
                self.params.place(unit, full if not sharding.gathered(unit) else sharding.shard_of(unit, full))
                del pooled, full  # the last views of the unit's pool blocks: they go back to the system now
                materializer.release(unit)
                continue
            if pooled is not None:
                full = pooled.float()  # the pool block itself when fp32
            elif len(unit.params) > 1:
                full = torch.cat([p.detach().reshape(-1).float().cpu() for p in unit.params])
            else:  # the parameter itself (no copy) unless the broadcast below writes into it
                full = unit.params[0].detach().reshape(-1).float().cpu()
                full = full.clone() if sharding.active else full
            sharding.broadcast(full)
            master = sharding.shard_of(unit, full)  # fp32 master of this rank's shard (all of it on one rank)
            self.unit_optimizer.place(unit, master)
            self._swapped = i + 1  # the user's tensors of units[:i + 1] may be dropped ([Note: a failed initialize])
            lp = materializer.cast(unit, master if sharding.gathered(unit) else full, self.lp_dtype)
            self.params.place(unit, lp)
            self.grads.place(unit)
            del pooled, full, master, lp  # the last views of the unit's pool blocks: they go back to the system now
            materializer.release(unit)
        self.unit_optimizer.finish_place()
        self.params.finish_place()
        materializer.rest()
        self._move_unmanaged_to_device()

    def _undo_place(self) -> None:
        """[Note: a failed initialize]
        A failing _place_all (an init_fn raising, a tier refusing a write, Ctrl-C) leaves the model
        as the user built it, so initialize can be called again: modules materialized from the meta
        device get their meta tensors back; units whose parameters were already swapped to the
        engine's flats get their weights back from the fp32 masters (one rank; with several the
        masters are shards). Where a unit cannot be given back, the model is marked and the next
        initialize refuses it with a ConfigError naming what happened, instead of reading freed
        memory; its parameters become meta tensors (a read raises, never crashes)."""
        materializer = getattr(self, "_materializer", None)
        materialized = {id(p) for p in materializer.replaced.values()} if materializer is not None else set()
        lost = []
        for unit in self.param_units[:getattr(self, "_swapped", 0)]:
            if all(id(p) in materialized for p in unit.params):
                continue
            try:
                if self.sharding.active:
                    raise ZerotierError("the fp32 masters are sharded over ranks")
                master = self.weights.frozen_value(unit) if unit.frozen else \
                    self.unit_optimizer.read_state(unit, ("master",))["master"].cpu()
                for p, view in unit.views(master):
                    dtype, device = self._user_form[id(p)]
                    p.data = view.to(device=device, dtype=dtype, copy=True)
            except Exception:  # noqa: BLE001 - the original error is what the user sees
                lost.append(unit)
        if materializer is not None:
            materializer.undo()
        gone = {id(p) for unit in lost for p in unit.params}
        for module in self.module.modules():  # new meta Parameters: a CPU one's data cannot become meta
            for name, p in module._parameters.items():
                if p is not None and id(p) in gone:
                    module._parameters[name] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                                                  requires_grad=p.requires_grad)
        lost = [unit.name or "<root>" for unit in lost]
        if lost:
            self.module._zerotier_lost = (
                f"an earlier zerotier.initialize on this model failed part-way and could not give the weights of "
                f"{len(lost)} unit(s) back ({', '.join(lost[:3])}{', ...' if len(lost) > 3 else ''}): build or load "
                "the model again")
        if self.store is not None:  # its run directory goes with it
            try:
                self.store.close()
            except Exception:  # noqa: BLE001
                pass
            self.store = None

    def _residency(self) -> dict[str, tuple[int, int]]:
        tiers = {"device": self.device_tier, "host": self.host_pool}
        if self.store is not None:
            tiers["nvme"] = self.store
        return {name: (t.used, t.budget) for name, t in tiers.items()}

    def _move_unmanaged_to_device(self) -> None:
        """Parameters no unit holds (non-floating frozen ones) and buffers go to the compute device.

        [Note: buffers and inputs in low precision]
        Under a bf16/fp16 precision.param_dtype, compute sees the model as `model.to(dtype)` would
        make it, as FSDP2's MixedPrecisionPolicy does: the floating buffers of a module that owns
        managed parameters (BatchNorm's running stats) take param_dtype (back to their dtype at
        close), and floating tensors passed to the root's forward are cast to it
        (cast_forward_inputs); integer inputs (token ids, labels) are left alone. Buffers of
        modules without parameters (rotary inv_freq) keep their dtype: their module casts."""
        managed = {id(p) for u in self.param_units for p in u.params}
        low = self.lp_dtype if self.lp_dtype != torch.float32 else None
        self._buffer_dtypes = []  # (module, name, the user's dtype) of buffers cast to param_dtype
        for module in self.module.modules():
            owns = any(p is not None and id(p) in managed for p in module._parameters.values())
            for name, p in module._parameters.items():
                if p is not None and id(p) not in managed:
                    p.data = p.data.to(self.device)
            for name, b in module._buffers.items():
                if b is not None:
                    cast = low is not None and owns and b.is_floating_point() and b.dtype != low
                    if cast:
                        self._buffer_dtypes.append((module, name, b.dtype))
                    module._buffers[name] = b.to(self.device, low if cast else b.dtype)

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
            plan_check.check_peaks(self.plan.needs, {"device": self.device_tier, "host": self.host_pool})
        if self.global_steps != steps:
            self.carried.stepped()  # the engine's lr scheduler, before a checkpoint may be written
        if ends_window:
            self._maybe_stop()
        return updated

    def _optimizer_loop(self) -> Loop:
        """engine.optimizer's calls into the loop, through weak references: the optimizer (which an lr
        scheduler or the user may hold) keeps no engine alive."""
        ref = weakref.ref(self)

        def weak(name):
            def call(*args):
                engine = ref()
                return None if engine is None else getattr(engine, name)(*args)
            return call
        return Loop(step=weak("_plain_step"), zero_grad=weak("zero_grad"), synchronize=weak("synchronize"),
                    closed=lambda: ref() is None or ref().closed)

    def _plain_step(self) -> None:
        """engine.optimizer.step() of the plain PyTorch loop ([Note: the plain PyTorch loop] in window.py)."""
        steps = self.global_steps
        applied = self.window.optimizer_step()
        if self._check_plan:  # [Note: the plan against the run's peaks]
            plan_check.check_peaks(self.plan.needs, {"device": self.device_tier, "host": self.host_pool})
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
        self.unit_optimizer.drop_prefetched()
        self.params.synchronize()

    # ------------------------------------------------------------ graceful stop ([Note: graceful stop])

    @property
    def closed(self) -> bool:
        return self.window.state is WindowState.CLOSED

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
        raise stop.TrainingStopped(message, stop.exit_status(code), saved)


    def gathered(self, params=None):
        """Context manager: the units of `params` (default: every managed parameter) stay resident
        inside, so many reads of them fetch each unit once (FSDP's summon_full_params). Reads and
        writes outside it work too, one fetch per call ([Note: the parameter surface])."""
        wanted = None if params is None else {id(p) for p in params}
        units = [u for u in self.param_units if wanted is None or any(id(p) in wanted for p in u.params)]
        return self._surface.fetched(units)

    def parameters_fp32(self) -> dict[str, torch.Tensor]:
        """Full-precision weights by parameter name (copies; reads NVMe-resident masters).
        With several ranks this is a collective: every rank must call it."""
        trained = {id(p): view.clone() for unit, views in self.weights.trained_units() for p, view in views}
        return {n: trained[id(p)] for n, p in self.module.named_parameters() if id(p) in trained}

    def raw_state_dict(self) -> dict:
        """`module.state_dict(keep_vars=True)` as torch makes it, without the trained weights (restore.py)."""
        return self.weights.raw_state_dict()

    # ------------------------------------------------------------ checkpoints (zerotier/checkpoint.py)

    def save_checkpoint(self, root, *, lr_scheduler=None, client_state=None, keep: int | None = 2):
        """Save the training state under `root` as root/ckpt-<global_steps> (collective; only at an
        optimizer-step boundary). Keeps this run's newest `keep` checkpoints (None: all); never
        deletes anything it did not write. Returns the checkpoint directory. See docs/checkpoint.md."""
        from .. import checkpoint
        self.window.refuse_if_broken("engine.save_checkpoint()")
        try:
            return checkpoint.save(self, root, lr_scheduler=lr_scheduler, client_state=client_state, keep=keep)
        finally:
            trim_heap()  # the streaming buffers ([Note: heap trimming])

    def load_checkpoint(self, root, *, lr_scheduler=None, trust_pickle: bool = False):
        """Load root/latest (or a ckpt-N directory) into this engine, whatever its placement, stage or
        world size (collective). Returns the saved client_state. See checkpoint.load for RNG rules."""
        from .. import checkpoint
        self.window.refuse_if_closed("engine.load_checkpoint()")
        self.window.refuse_before_backward("engine.load_checkpoint()")
        self.window.quiesce()
        versions = list(self.params.version)  # a commit bumps them: did the load change anything?
        try:
            client_state = checkpoint.load(self, root, lr_scheduler=lr_scheduler, trust_pickle=trust_pickle)
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
        return export.consolidated_state_dict(self, dtype)

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
        self._surface.disown()  # plain parameters again ([Note: the parameter surface])
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
