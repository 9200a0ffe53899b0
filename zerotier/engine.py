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

See docs/design.md for a unit's bytes through one step.

[Note: fetch and release]
Parameters placed on host or NVMe (or gathered at ZeRO-3) are *released* outside
their module's use: their device flat has no storage. A forward pre-hook fetches
the module's units (waiting on a prefetch if one is in flight); the forward
post-hook releases them and wraps the module's outputs in `_FetchOnBackward`,
whose backward fetches them again just before autograd needs them. A
post-accumulate-grad hook hands each gradient to the gradient store and, once
every parameter of the unit has its gradient, releases the unit. Autograd's
saved references are the Parameter objects (or views of the same flat), so
refilling the flat before their backward runs is what makes this correct.

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

[Note: the user's model stays the truth]
zerotier swaps every managed parameter's `.data` for a view of its own flat (released
between uses), so the user's tensors are gone after initialize. The model still tells
the truth: `model.state_dict()` returns the trained weights (the fp32 masters, in each
parameter's original dtype), and `close()` puts them back into the parameters, where
the parameters were, so the model trains or saves like any PyTorch model afterwards.
A model already managed by a live engine is refused by initialize().

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

[Note: autocast and streamed parameters]
Under torch.autocast, an op casts a full-precision parameter to the autocast dtype,
keeps the copy in autocast's cache until the autocast region ends, and autograd saves
it for backward. For a parameter zerotier streams (released after its module's
forward), that copy would stay on the device for the whole step: no device memory
saved, and none of it in any budget. So a module whose streamed parameters are not
already in the autocast dtype refuses to run under autocast, with the fix in the
message: `precision.param_dtype = "bf16"` (low-precision compute copies, fp32 master),
or parameters kept on the device, where autocast works as in plain PyTorch.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
import secrets
import sys
import warnings
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .config import Config, format_size
from .device import choose as choose_device, enter as enter_device
from .dist import init_distributed
from .dist.sharding import Sharding
from .errors import ConfigError, ZerotierError
from .grads import make_grad_store
from .materialize import Materializer, is_meta, pool_bytes as materialize_pool_bytes
from .optim.offload import StateLayout, UnitOptimizer
from .optim.torch_optimizer import EngineOptimizer, exempt_from_decay
from .params import ParamStore
from .planner import make_plan
from .profiler import Profiler
from .scaler import LossScaler
from .schedule import PrefetchScheduler
from .state import DTYPES, GradState, Location, ParamState, build_units, nested_numel
from .surface import ParamSurface, internal
from . import clip, stop, threads
from .tiers.device import DeviceTier
from .tiers.host import HostPool, trim_heap


def initialize(model: torch.nn.Module, config=None, *, wrap=None, init_fn=None) -> "Engine":
    """Wrap `model` for training under `config` (dict, file path or Config). `wrap`: a callable
    (module name, module) -> bool choosing the modules that are units; overrides train.wrap
    ([Note: units] in state.py). A model built on the meta device is materialized unit by unit,
    by each module's reset_parameters() or `init_fn(module)` ([Note: meta-device models])."""
    engine = Engine(model, Config.coerce(config).auto_to_defaults(), wrap, init_fn)  # [Note: keys a trainer fills]
    clip.install(engine)  # torch.nn.utils.clip_grad_norm_ on its parameters ([Note: the user's clipping])
    return engine


class _FetchOnBackward(torch.autograd.Function):
    """Identity in forward; in backward, fetch the units before their module's gradients run."""

    @staticmethod
    def forward(ctx, engine, units, *tensors):
        ctx.engine, ctx.units = engine, units
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.engine._ensure_backward()
        for unit in ctx.units:
            ctx.engine._demand(unit)
        return (None, None, *grads)


class _ReleaseAfterBackward(torch.autograd.Function):
    """Identity in forward on a module's inputs; in backward, release the module's frozen units
    ([Note: releasing frozen units after backward])."""

    @staticmethod
    def forward(ctx, engine, units, tensor):
        ctx.engine, ctx.units = engine, units
        return tensor.detach()

    @staticmethod
    def backward(ctx, grad):
        for unit in ctx.units:
            ctx.engine.params.release(unit)
        return None, None, grad


def _autocast_dtype(device_type: str) -> "torch.dtype | None":
    """The dtype torch.autocast casts to on `device_type` now, or None when it is off."""
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def _map_tensors(obj, fn):
    """`obj` with fn applied to every tensor in it (tuples, lists, dicts, dataclasses, nested)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type) and not isinstance(obj, dict):
        out = copy.copy(obj)
        for f in dataclasses.fields(obj):
            object.__setattr__(out, f.name, _map_tensors(getattr(obj, f.name), fn))
        return out
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_map_tensors(o, fn) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(o, fn) for o in obj)
    if isinstance(obj, dict):
        out = copy.copy(obj)
        for k in obj:
            out[k] = _map_tensors(obj[k], fn)
        return out
    return obj


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
        units = build_units(model, cfg.train.wrap if wrap is None else wrap)
        if not any(not u.frozen for u in units):
            raise ConfigError("the model has no trainable parameters (all are frozen or there are none); "
                              "there is nothing for zerotier to train")
        self.lp_dtype = DTYPES[cfg.precision.param_dtype]
        # [Note: the user's model stays the truth]: what each parameter was before we took it
        self._user_form = {id(p): (p.dtype, p.device) for u in units for p in u.params}
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
                              materialize_bytes=materialize_pool_bytes(self.param_units, self.lp_dtype,
                                                                       cfg.io.alignment))
        placement = self.plan.placement
        self.store = None
        if Location.NVME in placement.values():
            from .tiers.nvme import NVMeStore  # only runs that use NVMe open a run directory
            self.store = NVMeStore(cfg.tiers, cfg.io, budget=self.plan.budgets["nvme"])
        # Every byte the engine keeps on the compute device is counted by the device tier,
        # every host byte is a block of the pinned aligned host pool (tiers.host).
        self.device_tier = DeviceTier(self.plan.budgets["device"], self.device, timing=cfg.profile.enabled)
        self.host_pool = HostPool(self.plan.budgets["host"], alignment=cfg.io.alignment,
                                  pin=self.device.type == "cuda")
        # None when profiling is off: every call site is one `if prof is not None:` (zero cost).
        self.profiler = Profiler.from_config(cfg.profile, self._residency, device=self.device)
        self.scaler = LossScaler(cfg.precision)
        optimizer_loc = self.plan.optimizer_units or placement["optimizer"]  # a tier, or one per unit (a split)
        self.unit_optimizer = UnitOptimizer(self.units, cfg.optimizer, optimizer_loc, self.device_tier,
                                            self.host_pool, self.store, self.profiler, StateLayout.of(cfg.precision))
        no_decay = exempt_from_decay(model, self.units, cfg.optimizer.no_weight_decay)  # checked before placing
        self.params = ParamStore(self.param_units, placement["params"], self.lp_dtype, self.device_tier,
                                 self.host_pool, self.store, self.sharding, placement["optimizer"],
                                 cfg.prefetch.lookahead if cfg.prefetch.enabled else 0, self.profiler)
        self.params.master_of = lambda unit: self.unit_optimizer.read_state(unit, ("master",))["master"]
        self.grads = make_grad_store(self.units, placement["gradients"], DTYPES[cfg.precision.accumulator_dtype],
                                     self.device_tier, self.host_pool, self.sharding, cfg.zero.reduce_bucket_size,
                                     self.store, self.profiler)
        # The "optimizer stream": one thread running early Adam updates during backward.
        self._optim_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zerotier-optim",
                                                initializer=enter_device, initargs=(self.device,))
        self._early: list[Future] = []
        self._broken: str | None = None    # [Note: a step is all or nothing]
        self._state_dict_hook_on = True    # off: module.state_dict() as torch makes it (checkpoint.py)
        self._plain_backward = False         # [Note: the plain PyTorch loop]: inside one now
        self._plain_grads = False            # gradients from plain loss.backward() calls wait for a step
        self._applying = False               # inside _apply_window (optimizer.step() only counts then)
        self._window_norm: float | None = None  # grad_norm() of the current window, once computed
        self._user_clip = 1.0                # this window's clip_grad_norm_ factor ([Note: the user's clipping])
        self._no_sync = False                # inside engine.no_sync()
        self._last_loss = None               # weakref to the last engine.backward(loss)'s loss
        self._slots: dict[int, tuple] | None = None  # id(param) -> (unit, index): _grad_get / _grad_set
        self._partial: str | None = None   # a backward failed half-way: its gradients are partial
        self.micro_steps = 0
        self.global_steps = 0
        self.run_id = secrets.token_hex(8)  # names this run's checkpoints ([Note: checkpoint retention])
        self._backward_since_step = False
        self._in_backward = False
        self._early_step_ok = False
        self._prefetch_state = False
        self._reduce_now = False
        try:
            self._place_all()
        except BaseException:
            self._undo_place()  # [Note: a failed initialize]
            self.sharding.close()
            raise
        self._window_applied = self.unit_optimizer.applied  # unit updates before this window
        self.optimizer = EngineOptimizer(self, no_decay)  # over the placed parameters ([Note: param groups])
        self.scheduler = PrefetchScheduler(
            cfg.prefetch, [u.numel * self.lp_dtype.itemsize for u in self.param_units],
            [u.name for u in self.param_units],
            self.params.prefetch, self.params.inflight_bytes)
        self._hooks = []
        self._register_hooks([u for u in self.param_units if self.params.streamed[u.index]])
        self._stop_code = 0  # [Note: graceful stop] in stop.py
        if cfg.train.handle_signals:
            stop.register(self)
        model._zerotier_engine = owner = weakref.ref(self)  # the model does not keep the engine alive

        def trained_state_dict(module, state_dict, prefix, local_metadata):
            engine = owner()
            if engine is not None:
                engine._trained_state_dict(module, state_dict, prefix)
        self._hooks.append(model.register_state_dict_post_hook(trained_state_dict))
        # [Note: the parameter surface] in surface.py: reads and writes of managed parameters
        self._surface = ParamSurface(self)
        self._surface.adopt()
        self._guard_root_methods()
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
                master = self._frozen_value(unit) if unit.frozen else \
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
        self._optim_thread.shutdown(wait=False)
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

    # ------------------------------------------------------------ fetch

    def _demand(self, unit) -> None:
        """Compute needs `unit` now: make it resident. Its own fetch (if not prefetched) is issued
        before the prefetches of the units after it, so on CUDA it is first on the copy stream."""
        if torch.is_grad_enabled() and self.module.training or self._in_backward:
            self.params.demand(unit, then=lambda: self.scheduler.on_demand(unit.index))
        else:
            self.params.demand(unit)

    # ------------------------------------------------------------ hooks

    def _register_hooks(self, streamed: list) -> None:
        """[Note: compiled units]
        torch.compile works on a zerotier model the way FSDP2's recipe uses it: compile each wrapped
        block (`block.compile()` or `torch.compile(block)`, before or after initialize). The module
        hooks below are `torch.compiler.disable`d, so dynamo never traces a fetch or a release (locks,
        storage resizes, worker threads): each is a graph break that runs eagerly, and the unit is
        resident before the compiled code reads it and released after. Inside a compiled region
        ManagedParameter's sorting is skipped (surface.py): the parameters are plain resident tensors
        there, and dynamo guards on nothing of zerotier's, so the block code compiles once, not once
        per unit. A compiled region that reads another unit's parameters without that unit's module
        running (none of the usual models do) reads released storage: keep such reads in eager code.
        tests/test_compile.py pins all of this."""
        by_module: dict[str, list] = {}
        for unit in streamed:
            for name in unit.modules:
                by_module.setdefault(name, []).append(unit)
        root = self.module
        if self.device.type == "cuda" or self.lp_dtype != torch.float32:  # inputs follow the model, as FSDP does
            self._hooks.append(root.register_forward_pre_hook(torch.compiler.disable(self._inputs_to_device),
                                                              with_kwargs=True))
        for name, module in self.module.named_modules():
            units = by_module.get(name, [])
            if units or module is root:
                self._hooks.append(module.register_forward_pre_hook(self._pre_forward(module is root, units)))
            if units:
                self._hooks.append(module.register_forward_hook(self._post_forward(units)))
            frozen = [u for u in units if u.frozen]
            if frozen and module is not root:
                self._hooks.append(module.register_forward_pre_hook(self._release_frozen_after_backward(frozen),
                                                                    with_kwargs=True))
        for unit in self.units:
            for i, p in enumerate(unit.params):
                self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_hook(unit, i)))

    def _guard_root_methods(self) -> None:
        """[Note: the parameter surface] model.load_state_dict batches its writes per unit and
        refuses assign=True (it would swap managed parameters for new ones); model.to()/half()/
        cuda() that would convert a managed parameter are refused before anything changes.
        Instance attributes on the root, removed by close()."""
        model, surface = self.module, self._surface
        load, apply = model.load_state_dict, model._apply

        @functools.wraps(load)
        def load_state_dict(state_dict, strict: bool = True, assign: bool = False):
            if assign:
                raise ZerotierError("model.load_state_dict(..., assign=True) after zerotier.initialize would replace "
                                    "the parameters zerotier manages with new tensors it does not see: call it "
                                    "with assign=False (the values go into the fp32 masters), or before initialize")
            with surface.batch():
                return load(state_dict, strict=strict)

        @functools.wraps(apply)
        def _apply(fn, *args, **kwargs):
            surface.check_apply(fn)
            return apply(fn, *args, **kwargs)
        model.load_state_dict, model._apply = load_state_dict, _apply

    def gathered(self, params=None):
        """Context manager: the units of `params` (default: every managed parameter) stay resident
        inside, so many reads of them fetch each unit once (FSDP's summon_full_params). Reads and
        writes outside it work too, one fetch per call ([Note: the parameter surface])."""
        wanted = None if params is None else {id(p) for p in params}
        units = [u for u in self.param_units if wanted is None or any(id(p) in wanted for p in u.params)]
        return self._surface.fetched(units)

    def _inputs_to_device(self, module, args, kwargs):
        """The root's inputs on the compute device, floating ones in param_dtype
        ([Note: buffers and inputs in low precision])."""
        low = self.lp_dtype if self.lp_dtype != torch.float32 else None

        def move(t):
            t = t.to(self.device, non_blocking=True) if t.device != self.device else t
            return t.to(low) if low is not None and t.is_floating_point() and t.dtype != low else t
        return _map_tensors(args, move), _map_tensors(kwargs, move)

    def _pre_forward(self, is_root: bool, units: list):
        def hook(module, args):
            if is_root and self._plain_backward:  # a plain loss.backward() died half-way: its end never ran
                self._end_plain_backward()
                self._partial = "a loss.backward() failed half-way through its gradients"
            if is_root and torch.is_grad_enabled() and not self._in_backward:
                self._refuse_unmanaged_grads()
            if is_root and torch.is_grad_enabled() and module.training and not self._in_backward:
                if self._stop_code and not self.sharding.active and not self._backward_since_step \
                        and self.micro_steps % self.cfg.train.grad_accum_steps == 0:
                    self._stop()  # a new window would begin: stop before it ([Note: graceful stop])
                self.scheduler.begin_pass()
            amp = _autocast_dtype(self.device.type) if units else None
            if amp not in (None, self.lp_dtype):
                self._refuse_autocast(units[0], amp)
            for unit in units:
                self._demand(unit)
        return torch.compiler.disable(hook)  # [Note: compiled units]

    def _refuse_autocast(self, unit, amp: torch.dtype) -> None:
        """[Note: autocast and streamed parameters]: the casts would pin a copy of every
        streamed parameter on the device until backward, outside every budget."""
        lp, amp_name = str(self.lp_dtype).replace("torch.", ""), str(amp).replace("torch.", "")
        raise ConfigError(
            f"module '{unit.name or '<root>'}' runs under torch.autocast({amp_name}) while its {lp} parameters "
            f"are streamed from {self.params.loc.value}: autocast keeps a {amp_name} copy of every such "
            "parameter on the device until backward, so offloading them would save no device memory. Set "
            f"precision.param_dtype = \"{'bf16' if amp is torch.bfloat16 else 'fp16'}\" and drop autocast "
            "(zerotier keeps the fp32 master and updates it in fp32), or keep the parameters on the device "
            "(offload.params = \"device\")")

    def _release_frozen_after_backward(self, frozen: list):
        """[Note: releasing frozen units after backward]
        A trainable unit is released by its last gradient hook; a frozen unit has none, yet the
        module's backward refetches it (_FetchOnBackward: its weights carry the gradient to the
        module's inputs). Like FSDP2's post-backward, each input that requires grad passes through
        _ReleaseAfterBackward, whose backward runs once the gradient of that input is complete: every
        node of the module that feeds it has run (all created after it, so autograd ran them first),
        and a later output gradient refetches through _FetchOnBackward. A module whose inputs need
        no gradient (the first block over frozen embeddings) keeps its frozen unit until backward ends."""
        def hook(module, args, kwargs):
            if not torch.is_grad_enabled():
                return None

            def wrap(t):
                return _ReleaseAfterBackward.apply(self, frozen, t) if t.requires_grad else t
            return _map_tensors(args, wrap), _map_tensors(kwargs, wrap)
        return torch.compiler.disable(hook)  # [Note: compiled units]

    def _post_forward(self, units: list):
        def hook(module, args, output):
            if torch.is_grad_enabled():
                wrapped, seen = [], []

                def wrap(t):
                    seen.append(t)
                    if not t.requires_grad:
                        return t
                    wrapped.append(t)
                    return _FetchOnBackward.apply(self, units, t)[0]
                output = _map_tensors(output, wrap)
                no_backward = seen and all(u.frozen for u in units)  # frozen layers under frozen inputs
                if not wrapped and output is not None and not no_backward:
                    # Outputs zerotier cannot see into (a plain object, a generator): nothing would
                    # refetch the units before their backward, so they stay resident until their
                    # gradients are in (the grad hook releases them) or backward ends.
                    return output
            for unit in units:
                self.params.release(unit)
            return output
        return torch.compiler.disable(hook)  # [Note: compiled units]

    def _grad_hook(self, unit, i: int):
        def hook(p: torch.Tensor) -> None:
            try:
                self._ensure_backward()
            except BaseException:
                with internal():
                    p.grad = None  # never a silent accumulation a later step would apply
                raise
            with internal():
                complete = self.grads.accumulate(unit, i, p.grad)
                p.grad = None
            if not complete:
                return
            self.params.release(unit)
            if self._reduce_now:
                self.grads.reduce(unit)  # bucketed reduce-scatter, overlapping the rest of backward
            elif self._early_step_ok:
                self._start_early_step(unit)
            elif self._prefetch_state:
                self.unit_optimizer.prefetch(unit)  # NVMe state reads start now
        return hook

    def _ensure_backward(self) -> None:
        """[Note: the plain PyTorch loop] The first hook of a backward the engine did not start
        (a plain loss.backward(): the user's loop, accelerate, HF Trainer) begins it here and
        queues its end with autograd. Where a plain backward cannot be right, it raises at once."""
        if torch.is_grad_enabled():  # grad mode is on inside a backward only with create_graph=True
            raise ZerotierError(
                "a backward with create_graph=True (torch.autograd.grad(..., create_graph=True) for a gradient "
                "penalty or a Hessian-vector product, loss.backward(create_graph=True)) reached parameters zerotier "
                "streams (offload.params host/nvme, or ZeRO-3): the gradient's own backward would read parameters "
                "released after the first. Keep the parameters on the device: offload.params = \"device\" with "
                "zero.stage 1 or 2, where double backward trains as in torch")
        if self._in_backward:
            return
        self._refuse_if_broken("loss.backward()")
        self._refuse_after_grad_norm("loss.backward()")
        why = None
        if self.scaler.dynamic or self.scaler.scale != 1.0:
            why = "the loss scale (precision.loss_scale) must multiply the loss before backward"
        elif self.sharding.active:
            why = "with several ranks the engine's backward decides when gradients are reduced"
        elif self._backward_since_step:
            why = "engine.backward(loss) was used in this window: one loop style per window"
        if why is not None:
            raise ZerotierError(f"a plain loss.backward() cannot be exact here ({why}): call engine.backward(loss) "
                                "and engine.step() after every micro-batch instead")
        self._in_backward = self._plain_backward = True
        self._reduce_now = self._early_step_ok = self._prefetch_state = False
        torch.autograd.Variable._execution_engine.queue_callback(self._end_plain_backward)

    def _end_plain_backward(self) -> None:
        """The end of a plain loss.backward() (queued by _ensure_backward)."""
        self._in_backward = self._plain_backward = False
        for unit in self.param_units:
            self.params.release(unit)
        self.grads.end_backward(reduced=False)
        self._plain_grads = True

    def _optimizer_step(self) -> None:
        """engine.optimizer.step() in the plain PyTorch loop: apply the gradients that loss.backward()
        accumulated (any number of them: the loop divides its loss for accumulation itself), then
        drop them ([Note: the plain PyTorch loop])."""
        self._refuse_if_closed("optimizer.step()")
        self._refuse_if_broken("optimizer.step()")
        if self._backward_since_step:
            raise ZerotierError("engine.optimizer.step() after engine.backward(loss): call engine.step() in that "
                                "loop (optimizer.step() belongs to the plain loss.backward() loop)")
        if not self._plain_grads:
            return  # no gradients: torch's optimizers do nothing either
        try:
            self._apply_window()
        except BaseException as exc:
            self._failed("optimizer.step()", exc)
            raise
        self._drop_window()
        self._maybe_stop()

    def _start_early_step(self, unit) -> None:
        """[Note: early step] update `unit` on the optimizer thread while backward goes on. The
        unit's gradient is handed over whole: the optimizer thread waits for its host adds
        (`grads.ready` -> settle), so backward never blocks on the host per unit (GPU review N8)."""
        self.grads.hand_over(unit)
        if self.device.type == "cuda":  # the gradient add above was queued on the compute stream
            done = torch.cuda.Event()
            done.record()
        else:
            done = None
        hyper_of, scale = self.optimizer.hyper_of(), 1.0 / self.scaler.scale

        def run():
            if done is not None:
                done.synchronize()
            self.grads.ready(unit)
            # step() waits for the writes; the window's norm reads this gradient again
            self._update([unit], hyper_of, scale, drain=False, keep_grads=True)
        threads.hand(threads.OPTIMIZER, self.grads, self.params, self.unit_optimizer)  # [Note: thread ownership]
        self._early.append(self._optim_thread.submit(run))

    def _update(self, units: list, hyper_of, grad_scale: float, drain: bool = True, keep_grads: bool = False) -> None:
        """Adam on `units`; each one's new parameters are committed as soon as it is done."""
        for unit in self.unit_optimizer.step(units, self.grads.shard, self.params.out_buffer, hyper_of, grad_scale,
                                             drain, got_of=self.grads.got, keep_grads=keep_grads):
            self.grads.stepped(unit)
            self.params.commit(unit)

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
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ZerotierError("engine.backward(loss) needs the scalar loss tensor of this micro-batch")
        self._refuse_if_closed("engine.backward()")
        self._refuse_if_broken("engine.backward()")
        if self._plain_grads:
            raise ZerotierError("engine.backward(loss) after a plain loss.backward() in the same window: use one "
                                "loop style per window (call engine.optimizer.step() or engine.zero_grad() first)")
        self._refuse_after_grad_norm("engine.backward()")
        if self._backward_since_step and self._last_loss is not None and self._last_loss() is loss:
            raise ZerotierError("engine.backward(loss) twice with the same loss tensor: the first backward freed its "
                                "graph (torch raises 'Trying to backward through the graph a second time'); compute "
                                "the loss again, or call engine.step() after each micro-batch's backward")
        if self._window_updated():  # a second backward of this micro-batch (torch accumulates it)
            raise ZerotierError("engine.backward() again after a backward whose update already started "
                                "(train.early_step = true applies the window's update during its last "
                                "backward): call engine.step() first, or leave train.early_step off (the "
                                "default) to accumulate several backward() calls into one micro-batch as torch does")
        scale = self.scaler.scale / self.cfg.train.grad_accum_steps
        last_micro = (self.micro_steps + 1) % self.cfg.train.grad_accum_steps == 0
        # engine.no_sync(): no reduce before the window's last micro-batch (the accumulator keeps the sum)
        self._reduce_now = self.sharding.reduces_now(last_micro) and \
            (last_micro or not self._no_sync or not self.grads.defers_reduce)
        self._early_step_ok = (self.cfg.train.early_step and self.cfg.train.max_grad_norm is None
                               and not self.scaler.dynamic and last_micro and not self.sharding.active)
        self._prefetch_state = last_micro and not self.sharding.active
        self._in_backward = True
        span = self.profiler.compute_begin("backward") if self.profiler is not None else None
        try:
            try:
                (loss * scale).backward()
            finally:
                if span is not None:
                    self.profiler.compute_end(span)
                self._in_backward = False
                self._early_step_ok = self._prefetch_state = False
                for unit in self.param_units:
                    self.params.release(unit)
            self.grads.end_backward(reduced=self._reduce_now)
        except BaseException as exc:
            self._failed("engine.backward()", exc)
            raise
        finally:
            self._reduce_now = False
        self._backward_since_step = True
        self._last_loss = weakref.ref(loss)

    def step(self) -> bool:
        """Call after every micro-batch's backward. Returns True when the parameters were updated.

        [Note: a step is all or nothing] If step() raises before any unit was updated, nothing
        changed: the gradients are intact and step() may be called again. Once a unit was
        updated (here or during backward) an error leaves the engine *broken*: some units hold
        the new weights, others the old; step(), backward() and save_checkpoint() then refuse,
        naming load_checkpoint(). No update runs after the error has reached the caller."""
        self._refuse_if_closed("engine.step()")
        self._refuse_if_broken("engine.step()")
        if self._plain_grads:
            raise ZerotierError("engine.step() after a plain loss.backward(): call engine.optimizer.step() in that "
                                "loop, or engine.backward(loss) then engine.step()")
        if not self._backward_since_step:
            raise ZerotierError("engine.step() called before engine.backward(loss): there are no gradients "
                                "to apply")
        if (self.micro_steps + 1) % self.cfg.train.grad_accum_steps:
            self.micro_steps += 1
            self._backward_since_step = False
            return False
        try:
            updated = self._apply_window()
        except BaseException as exc:
            self._failed("engine.step()", exc)
            raise
        self.micro_steps += 1
        self._drop_window()
        self._maybe_stop()
        return updated

    # ------------------------------------------------------------ graceful stop ([Note: graceful stop])

    @property
    def closed(self) -> bool:
        return not self._hooks

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


    def grad_norm(self) -> float:
        """The global norm (before clipping, loss scale removed) of the gradients the next update
        will apply; computed once per window (a collective with several ranks). What HF Trainer
        logs as grad_norm (zerotier.integrations.transformers). Read when this window has no
        gradient yet (after a step), it is the last update's norm and closes nothing."""
        self._refuse_if_closed("engine.grad_norm()")
        if self._window_norm is None and not self._window_has_grads():
            return getattr(self, "last_grad_norm", 0.0)
        if self._window_norm is None:
            self._wait_early_steps()
            self.grads.ready_all()
            local = self.grads.sumsq([u for u in self.units if self.sharding.local_sumsq_share(u)])
            self._window_norm = math.sqrt(self.sharding.global_sum(local)) / self.scaler.scale
        return self._window_norm

    def _apply_window(self) -> bool:
        """The update at the end of an accumulation window (see step())."""
        total_norm = self.grad_norm()
        pending = self.grads.ready_all()  # units stepped early are STEPPED already
        inv_scale = 1.0 / self.scaler.scale
        overflow = not math.isfinite(total_norm)
        if overflow and self.scaler.dynamic:
            self.scaler.update(overflow=True)
            self.unit_optimizer.drop_prefetched()
            return False
        clip = self._user_clip  # [Note: the user's clipping], then train.max_grad_norm on what it left
        if self.cfg.train.max_grad_norm is not None:
            clip *= min(1.0, self.cfg.train.max_grad_norm / (total_norm * clip + 1e-6))
        self.last_grad_norm = total_norm
        self._applying = True  # the optimizer's step() counts for lr schedulers, and does nothing more
        try:
            self.optimizer.step()
        finally:
            self._applying = False
        self._update(pending, self.optimizer.hyper_of(), clip * inv_scale)
        self.params.finish_commits()  # ZeRO-1/2: the new parameter shards reach every rank
        self.scaler.update(overflow=False)
        self.global_steps += 1
        return True

    def _failed(self, what: str, exc: BaseException) -> None:
        """An error (or Ctrl-C) inside backward() or step(): stop the background updates before it
        reaches the caller; break the engine if any unit was updated in this window
        ([Note: a step is all or nothing]); a backward that stopped half-way leaves partial
        gradients, which must be dropped (zero_grad) before training goes on."""
        self._quiesce()
        if self.unit_optimizer.applied != self._window_applied:
            n = self.unit_optimizer.applied - self._window_applied
            self._broken = (f"{what} failed ({type(exc).__name__}: {exc}) after {n} of the window's unit "
                            "updates were applied, so some units hold new weights and others old ones")
        elif what == "engine.backward()":
            self._partial = (f"{what} failed ({type(exc).__name__}: {exc}) after part of this micro-batch's "
                             "gradients were accumulated")

    def _quiesce(self) -> None:
        """Wait for every update started during backward, whatever it raises (a second Ctrl-C
        included): none may still run once an error has reached the caller."""
        early, self._early = self._early, []
        for future in early:
            while True:
                try:
                    future.exception()
                    break
                except KeyboardInterrupt:
                    continue
        self._take_back_update()
        try:
            self.unit_optimizer.finish()
        except BaseException:  # noqa: BLE001 - the error being raised already tells the story
            pass
        self.unit_optimizer.drop_prefetched()  # a retry reads afresh, never a stale failure (#24)

    def _refuse_after_grad_norm(self, what: str) -> None:
        if self._window_norm is not None:
            raise ZerotierError(f"{what} after engine.grad_norm(): the norm closed this accumulation window; "
                                "call the step (engine.step() / engine.optimizer.step()) or zero_grad() first")

    def _refuse_if_broken(self, what: str) -> None:
        if self._broken is not None:
            raise ZerotierError(f"{what} refused: {self._broken}. Load a checkpoint "
                                "(engine.load_checkpoint(root)) to continue from a consistent state")
        if self._partial is not None and what != "engine.save_checkpoint()":
            raise ZerotierError(f"{what} refused: {self._partial}. Call engine.zero_grad() to drop this "
                                "accumulation window's gradients (or load a checkpoint), then go on")

    def _wait_early_steps(self) -> None:
        """Wait for the updates started during backward and for their NVMe write-backs (left in
        flight so each unit's read overlapped the previous writes); re-raise the first error."""
        early, self._early = self._early, []
        waits = [future.result for future in early] + ([self._take_back_update] if early else []) + \
            ([self.unit_optimizer.finish] if early else [])
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
        threads.hand(threads.COMPUTE, self.grads, self.params, self.unit_optimizer)

    def synchronize(self) -> None:
        """Finish the work in flight: Adam updates started during backward, parameter fetches
        issued but not consumed (e.g. before loading new weights), write-backs."""
        self._wait_early_steps()
        self.unit_optimizer.drop_prefetched()
        self.params.synchronize()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients of the current accumulation window (and a failed backward's partial ones).
        set_to_none=False follows torch: parameters that had a gradient keep a zero one, which Adam
        still steps ([Note: zero gradients that still step] in grads.py)."""
        self._refuse_if_closed("engine.zero_grad()")
        if self._window_updated() and self._broken is None:
            raise ZerotierError("zero_grad() after a backward whose update already started (train.early_step = "
                                "true applies the window's update during its last backward, so its gradients "
                                "cannot be dropped any more): call engine.step() first, or leave "
                                "train.early_step off (the default) to drop a window's gradients before step()")
        self._drop_window(set_to_none)

    def _drop_window(self, set_to_none: "bool | None" = None) -> None:
        """The window ends: its gradients are dropped (after a step: set_to_none None keeps the
        user's last zero_grad choice)."""
        self.grads.zero(set_to_none)
        self._user_clip = 1.0
        self._window_norm = None
        self._backward_since_step = self._plain_grads = False
        self._partial = None
        self._window_applied = self.unit_optimizer.applied

    # ---- gradients as torch shows them

    def _slot(self, p) -> "tuple | None":
        """(unit, index in unit) of a managed parameter; None for any other tensor."""
        if self._slots is None:
            self._slots = {id(q): (unit, k) for unit in self.units for k, q in enumerate(unit.params)}
        return self._slots.get(id(p))

    def _window_has_grads(self) -> bool:
        return self._backward_since_step or self._plain_grads or \
            any(self.grads.has(u, k) for u in self.units for k in range(len(u.params)))

    def _window_updated(self) -> bool:
        """Some unit's update of this window already started (train.early_step, [Note: early step])."""
        return bool(self._early) or self.unit_optimizer.applied != self._window_applied

    def _refuse_grad_access(self, what: str) -> None:
        if self.sharding.active:
            raise ZerotierError(f"{what} of a parameter zerotier manages with several ranks: a parameter's "
                                "gradient is reduced into shards, no rank holds torch's .grad; use "
                                "engine.zero_grad() to drop the window and engine.grad_norm() for its norm")
        if self._in_backward:
            raise ZerotierError(f"{what} of a parameter zerotier manages during backward (a hook): the gradient "
                                "is final once backward has returned; read or change it between backward and step")

    def _grad_get(self, p) -> "torch.Tensor | None":
        """What `p.grad` shows the user: None when the parameter has no gradient in this window, else
        its gradient as it will be applied (before the loss scale's and the clipping's factors).
        Gradients on the device or host: a view of the accumulator, so p.grad.zero_() or .mul_()
        reach the window, as in torch; on NVMe (or once its unit was updated early): a copy."""
        slot = self._slot(p)
        if slot is None or self.closed:
            return None
        unit, k = slot
        if not self.grads.has(unit, k):
            return None
        self._refuse_grad_access("reading p.grad")
        grad = self.grads.read_param(unit, k)
        if self.scaler.scale != 1.0:
            grad = grad / self.scaler.scale
        elif self.grads.state[unit.index] is GradState.STEPPED:
            grad = grad.clone()
        return grad

    def _grad_set(self, p, value) -> None:
        """User code assigned `p.grad = value`: None drops the parameter's gradient from this window
        (it is not stepped, as torch skips a .grad of None); a tensor replaces it."""
        slot = self._slot(p)
        if slot is None:
            raise ZerotierError("p.grad set on a parameter this engine does not manage")
        self._refuse_if_closed("setting p.grad")
        unit, k = slot
        if value is None and not self.grads.has(unit, k):
            return
        self._refuse_grad_access("setting p.grad")
        if self._window_updated():
            raise ZerotierError("p.grad set after a backward whose update already started (train.early_step = "
                                "true applies the window's update during its last backward): call "
                                "engine.step() first, or leave train.early_step off (the default)")
        self._refuse_after_grad_norm("setting p.grad")
        if value is not None:
            if not isinstance(value, torch.Tensor) or value.shape != p.shape:
                raise RuntimeError(f"assigned grad has data of a different size ({tuple(getattr(value, 'shape', ()))}"
                                   f" vs {tuple(p.shape)})")
            value = value.detach() * self.scaler.scale if self.scaler.scale != 1.0 else value.detach()
        self.grads.set_param(unit, k, value)
        if value is not None and not (self._backward_since_step or self._in_backward):
            self._plain_grads = True  # a window with a gradient: optimizer.step() applies it

    def _clip_grad_norm(self, max_norm: float, others: list, error_if_nonfinite: bool, foreach) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over this engine's parameters (and `others`, unmanaged ones
        with a gradient): [Note: the user's clipping] in clip.py."""
        self._refuse_if_closed("clip_grad_norm_")
        if self._window_updated():
            raise ZerotierError("clip_grad_norm_ after a backward whose update already started (train.early_step = "
                                "true applies the window's update during its last backward, unclipped): set "
                                "train.max_grad_norm instead, or leave train.early_step off (the default)")
        if not self._window_has_grads() and not others:
            return torch.tensor(0.0)  # torch: no gradients, norm 0
        managed = self.grad_norm() * self._user_clip if self._window_has_grads() else 0.0
        total, factor = clip.total_and_factor(managed, [p.grad for p in others], max_norm)
        if error_if_nonfinite and not math.isfinite(total):
            raise RuntimeError(f"The total norm of order 2.0 for gradients from `parameters` is non-finite, so it "
                               "cannot be clipped. To disable this error and scale the gradients by the "
                               "non-finite norm anyway, set `error_if_nonfinite=False`")
        self._user_clip *= factor
        with torch.no_grad():
            for p in others:
                p.grad.mul_(factor)
        return torch.tensor(total, dtype=torch.float32)

    def _refuse_if_closed(self, what: str) -> None:
        if self.closed:
            raise ZerotierError(f"{what} after engine.close(): this engine no longer trains the model (close() "
                                "put the weights back into it). Call zerotier.initialize(model, config) again "
                                "to go on training")

    def _refuse_unmanaged_grads(self) -> None:
        """A parameter frozen (or absent) at initialize that now requires grad would get a .grad that
        no update ever applies: refuse at the forward, naming it."""
        if self._slots is None:
            self._slot(None)
        for name, p in self.module.named_parameters():
            if not isinstance(p, torch.nn.Parameter) and p.requires_grad:
                raise ZerotierError(
                    f"parameter '{name}' is replaced by a plain tensor in this forward (torch.func.functional_call, or "
                    "a torch.func transform such as grad/jacrev over the model's parameters): zerotier cannot fetch, "
                    "train or release tensors it does not hold. Run torch.func on a model zerotier does not manage: "
                    "engine.close() first (the model then holds the trained weights), or load "
                    "engine.parameters_fp32() into a copy")
            if id(p) not in self._slots and p.requires_grad and id(p) not in self._user_form:
                raise ZerotierError(
                    f"parameter '{name}' requires grad but was added to the model after zerotier.initialize (an "
                    "adapter: peft.get_peft_model(engine.module, ...) after initialize or zerotier.from_pretrained), "
                    "so zerotier would never train it. Add adapters first: model = peft.get_peft_model(model, "
                    "lora_config), then engine = zerotier.initialize(model, config); the frozen base is then "
                    "offloaded like any parameter (offload.params). From a Hugging Face directory: "
                    "zerotier.from_pretrained(dir, config, peft_config=lora_config) streams the base under the "
                    "adapters (or load it with transformers, apply peft, then initialize: the base is in RAM once)")
            if id(p) not in self._slots and p.requires_grad:
                raise ZerotierError(
                    f"parameter '{name}' requires grad but zerotier does not train it: it was frozen (or not yet "
                    "registered) when zerotier.initialize ran. Set requires_grad before initialize, or call "
                    "engine.close() and zerotier.initialize(model, config) again")

    def no_sync(self):
        """Like DDP's and FSDP's no_sync(): backward() calls inside accumulate their gradients on
        this rank without the reduce-scatter; the window's last micro-batch always reduces (the
        accumulator holds the sum, so the update is the same). One rank: nothing to skip.
        Gradients on NVMe at ZeRO-2/3 reduce each micro-batch anyway (their accumulator is the
        reduced shard's file)."""
        self._refuse_if_closed("engine.no_sync()")
        return self._no_sync_context()

    @contextlib.contextmanager
    def _no_sync_context(self):
        before, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = before

    def parameters_fp32(self) -> dict[str, torch.Tensor]:
        """Full-precision weights by parameter name (copies; reads NVMe-resident masters).
        With several ranks this is a collective: every rank must call it."""
        trained = {id(p): view.clone() for unit, views in self._trained_units() for p, view in views}
        return {n: trained[id(p)] for n, p in self.module.named_parameters() if id(p) in trained}

    def raw_state_dict(self) -> dict:
        """`module.state_dict(keep_vars=True)` as torch makes it: the live tensors, managed parameters
        included as they are now (released views), without the trained-weights hook. For code that
        wants the frozen parameters and buffers (checkpoint, export)."""
        self._state_dict_hook_on = False
        try:
            return self.module.state_dict(keep_vars=True)
        finally:
            self._state_dict_hook_on = True

    def _trained_units(self):
        """(unit, [(parameter, fp32 view of its full master)]) one unit at a time, so a caller that
        converts as it goes holds one unit in fp32 at most. Collective with several ranks."""
        self.sharding.sync_point(self.global_steps, self.micro_steps,
                                 "gathering the trained weights")  # [Note: ranks out of step]
        self.synchronize()  # updates and NVMe writes in flight land first
        for unit in self.units:
            master = self.sharding.gather_full(unit, self.unit_optimizer.read_state(unit, ("master",))["master"].cpu())
            yield unit, list(unit.views(master))

    def _frozen_value(self, unit) -> torch.Tensor:
        """[Note: frozen units] A frozen unit's full flat as its home holds it (param dtype, on the CPU,
        a copy): fetched and released again unless resident. A collective when it is gathered."""
        resident = self.params.state[unit.index] is ParamState.RESIDENT
        if not resident:
            self.params.demand(unit)
        try:
            return self.params.device_flat[unit.index][: unit.numel].to("cpu", copy=True)
        finally:
            if not resident:
                self.params.release(unit)

    def _trained_state_dict(self, module, state_dict, prefix) -> None:
        """[Note: the user's model stays the truth] model.state_dict() holds the trained weights
        (from the fp32 masters, in each parameter's original dtype), never the released buffers
        zerotier swaps under the parameters. With several ranks model.state_dict() is then a
        collective, like FSDP's full state dict: call it on every rank."""
        if not self._state_dict_hook_on:
            return
        names: dict[int, list[str]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            if prefix + name in state_dict:
                names.setdefault(id(p), []).append(prefix + name)
        for unit, views in self._trained_units():
            for p, view in views:
                value = view.to(self._user_form[id(p)][0], copy=True)
                for key in names.get(id(p), ()):
                    state_dict[key] = value
        for unit in self.frozen_units:  # [Note: frozen units]: their home's values (safetensors reads raw memory)
            for p, view in unit.views(self._frozen_value(unit)):
                value = view.to(self._user_form[id(p)][0], copy=True)
                for key in names.get(id(p), ()):
                    state_dict[key] = value

    # ------------------------------------------------------------ checkpoints (zerotier/checkpoint.py)

    def save_checkpoint(self, root, *, lr_scheduler=None, client_state=None, keep: int | None = 2):
        """Save the training state under `root` as root/ckpt-<global_steps> (collective; only at an
        optimizer-step boundary). Keeps this run's newest `keep` checkpoints (None: all); never
        deletes anything it did not write. Returns the checkpoint directory. See docs/checkpoint.md."""
        from . import checkpoint
        self._refuse_if_broken("engine.save_checkpoint()")
        try:
            return checkpoint.save(self, root, lr_scheduler=lr_scheduler, client_state=client_state, keep=keep)
        finally:
            trim_heap()  # the streaming buffers ([Note: heap trimming])

    def load_checkpoint(self, root, *, lr_scheduler=None, trust_pickle: bool = False):
        """Load root/latest (or a ckpt-N directory) into this engine, whatever its placement, stage or
        world size (collective). Returns the saved client_state. See checkpoint.load for RNG rules."""
        from . import checkpoint
        self._quiesce()
        versions = list(self.params.version)  # a commit bumps them: did the load change anything?
        try:
            client_state = checkpoint.load(self, root, lr_scheduler=lr_scheduler, trust_pickle=trust_pickle)
        except BaseException as exc:
            if self.params.version != versions:
                self._broken = f"engine.load_checkpoint() failed half-way ({type(exc).__name__}: {exc})"
            raise
        self._broken = None  # a consistent state again ([Note: a step is all or nothing])
        self._drop_window()  # (an early-stepped window's too)
        trim_heap()  # the streaming buffers ([Note: heap trimming])
        return client_state

    def consolidated_state_dict(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """Plain model weights by state_dict name (trained params from the fp32 master, plus frozen
        params and buffers), for model.load_state_dict. Collective with several ranks."""
        from . import export
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
        if not self._hooks:
            return
        stop.unregister(self)
        self._quiesce()
        # Gradients and optimizer staging are not needed any more: their memory goes first, so
        # putting the weights back does not stack on top of it (a model near RAM's size).
        self.grads.close()
        self.unit_optimizer.close()
        self.host_pool.trim()
        self._surface.disown()  # plain parameters again ([Note: the parameter surface])
        if restore_weights and self._broken is not None:
            warnings.warn(f"zerotier close(): the trained weights are not put back into the model: {self._broken}. "
                          "Load the last checkpoint to recover a consistent state", RuntimeWarning, stacklevel=2)
        elif restore_weights:
            try:
                self._restore_weights()
            except Exception as exc:  # noqa: BLE001 - still free everything below; say what is lost
                warnings.warn(f"zerotier close(): the trained weights could not be put back into the model "
                              f"({type(exc).__name__}: {exc}); its parameters are left empty. Load the last "
                              "checkpoint to recover them", RuntimeWarning, stacklevel=2)
        self._leave_no_released_storage()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for name in ("load_state_dict", "_apply"):  # _guard_root_methods
            self.module.__dict__.pop(name, None)
        if getattr(self.module, "_zerotier_engine", None) is not None:
            del self.module._zerotier_engine
        self._optim_thread.shutdown(wait=True)
        self.params.close()
        self.grads.close()
        self.unit_optimizer.close()
        self.device_tier.close()  # copies still on its streams finish before their buffers go
        self.sharding.close()  # after the last collective (_restore_weights' gathers)
        try:
            if self.profiler is not None:
                self.profiler.close()  # writes profile.trace_path, if set
        finally:  # a trace that cannot be written must not keep the run's NVMe files (#13)
            if self.store is not None:
                self.store.close()
                self.store = None
            self.host_pool.close()
            trim_heap()  # [Note: heap trimming]

    def _leave_no_released_storage(self) -> None:
        """Parameters not put back (restore_weights=False, a broken engine, a meta-built model)
        are left empty (0 elements, their dtype and device), never views of freed memory."""
        for unit in self.param_units:
            for p in unit.params:
                if p.numel() and p.untyped_storage().nbytes() < p.numel() * p.element_size():
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def _restore_weights(self) -> None:
        """[Note: the user's model stays the truth]"""
        left = 0
        for unit, views in self._trained_units():
            for p, view in views:
                dtype, device = self._user_form[id(p)]
                if device.type != "meta":
                    p.data = view.to(device=device, dtype=dtype, copy=True)
                else:
                    left += 1
        for unit in self.frozen_units:  # [Note: frozen units]: their home holds them
            value = self._frozen_value(unit)
            for p, view in unit.views(value):
                dtype, device = self._user_form[id(p)]
                if device.type != "meta":
                    p.data = view.to(device=device, dtype=dtype, copy=True)
                else:
                    left += 1
        for module, name, dtype in getattr(self, "_buffer_dtypes", ()):  # [Note: buffers and inputs in low precision]
            if module._buffers.get(name) is not None:
                module._buffers[name] = module._buffers[name].to(dtype)
        if left:  # [Note: meta-device models]: such a model may not fit where it would go back to
            warnings.warn(f"zerotier close(): {left} parameters of a model built on the meta device are not put "
                          "back into it (it may not fit in RAM); save a checkpoint or `zerotier export` before "
                          "close() to keep the trained weights", RuntimeWarning, stacklevel=3)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        # after an error, ranks may not all reach close(): no collective then
        self.close(restore_weights=exc_type is None or not self.sharding.active)
