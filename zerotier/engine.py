"""The offload engine: hooks a model's forward/backward and drives tiers, prefetch and the optimizer.

    engine = zerotier.initialize(model, config)
    loss = engine(batch)          # forward (the module's own hooks fetch parameters)
    engine.backward(loss)         # scaled, accumulated; grads stream to their tier
    engine.step()                 # every micro-batch; updates at accumulation boundaries

The engine does no math and no I/O of its own: placement comes from the planner,
bytes move through the NVMe store, the optimizer is `UnitOptimizer`, the order of
fetches from `PrefetchScheduler`. See docs/design.md.

[Note: fetch and release]
Parameters placed on host or NVMe are *released* outside their module's use:
`p.data` is an empty tensor. A forward pre-hook fetches the module's units
(waiting on a prefetch if one is in flight); the forward post-hook releases
them and wraps the module's outputs in `_FetchOnBackward`, whose backward
fetches them again just before autograd needs them. A post-accumulate-grad
hook moves each gradient into its unit's fp32 `grad_flat` and, once every
parameter of the unit has its gradient, releases the unit. Autograd's saved
references are the Parameter objects themselves, so swapping `p.data` back in
before their backward runs is what makes this correct.

[Note: early step]
When no global operation stands between a gradient and its update — no
clipping, no dynamic loss scale (whose overflow check needs every gradient),
and this backward ends an accumulation window — a unit's Adam update starts on
the optimizer thread as soon as all its gradients are final (its last
post-accumulate-grad hook), overlapping the rest of backward. It is exact: the
update uses the same gradient, lr and step count as it would after backward,
and no later part of this backward reads the unit's parameters (autograd runs a
leaf's AccumulateGrad once, after every use). engine.step() waits for these
updates, then steps the remaining units.
"""
from __future__ import annotations

import copy
import math
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .config import Config, format_size
from .dist import init_distributed
from .dist.sharding import Sharding
from .errors import ConfigError, ZerotierError
from .optim import _kernels
from .optim.offload import UnitOptimizer
from .planner import make_plan
from .scaler import LossScaler
from .schedule import PrefetchScheduler
from .schedule.fetch import ParamFetcher
from .state import DTYPES, Location, Unit, build_units
from .profiler import Profiler
from .tiers.base import BudgetedTier
from .tiers.device import DeviceTier


def initialize(model: torch.nn.Module, config=None) -> "Engine":
    """Wrap `model` for training under `config` (dict, file path or Config)."""
    return Engine(model, Config.coerce(config))


class _LRHolder(torch.optim.Optimizer):
    """Holds lr in `param_groups` so torch.optim.lr_scheduler works with `engine.optimizer`."""

    def __init__(self, lr: float):
        super().__init__([torch.zeros(0, requires_grad=True)], {"lr": lr})

    def step(self, closure=None):  # the update itself is the engine's
        return None


class _FetchOnBackward(torch.autograd.Function):
    """Identity in forward; in backward, fetch the units before their module's gradients run."""

    @staticmethod
    def forward(ctx, engine, units, *tensors):
        ctx.engine, ctx.units = engine, units
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        for unit in ctx.units:
            ctx.engine._demand(unit)
        return (None, None, *grads)


def _map_tensors(obj, fn):
    if isinstance(obj, torch.Tensor):
        return fn(obj)
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
    def __init__(self, model: torch.nn.Module, cfg: Config):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"zerotier.initialize expects an nn.Module, got {type(model).__name__}")
        self.cfg = cfg
        self.module = model
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        self.units = build_units(model)
        if not self.units:
            raise ConfigError("the model has no trainable parameters (all are frozen or there are none); "
                              "there is nothing for zerotier to train")
        self.lp_dtype = DTYPES[cfg.precision.param_dtype]
        self.rank, self.world_size = init_distributed(cfg.zero)
        self.sharding = Sharding(cfg.zero, self.rank, self.world_size)
        self.sharding.assign(self.units)
        self.plan = make_plan([u.numel for u in self.units], cfg.tiers, cfg.offload, cfg.precision,
                              cfg.prefetch, self.device, world_size=self.world_size, stage=cfg.zero.stage)
        self.store = None
        if Location.NVME in self.plan.placement.values():
            from .tiers.nvme import NVMeStore  # only runs that use NVMe open a run directory
            self.store = NVMeStore(cfg.tiers, cfg.io)
        # Every tensor the engine keeps on the compute device is counted here (tiers.device).
        self.device_tier = DeviceTier(self.plan.budgets["device"], self.device)
        self.host_tier = BudgetedTier("host", self.plan.budgets["host"],
                                      hint="Raise tiers.host, or move optimizer state to nvme.")
        # None when profiling is off: every call site is one `if prof is not None:` (zero cost).
        self.profiler = Profiler.from_config(cfg.profile, self._residency)
        self.scaler = LossScaler(cfg.precision)
        self.optimizer = _LRHolder(cfg.optimizer.lr)
        self.unit_optimizer = UnitOptimizer(self.units, cfg.optimizer, self.store, self._fused_out,
                                            self._write_params, self.profiler)
        # The "optimizer stream": one thread running early Adam updates during backward.
        self._optim_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zerotier-optim")
        self._early: list[Future] = []
        self.micro_steps = 0
        self.global_steps = 0
        self._backward_since_step = False
        self._in_backward = False
        self._early_step_ok = False
        self._reduce_now = False
        self.fetcher = ParamFetcher(self.device, self.lp_dtype, self.device_tier, self.store, self.sharding,
                                    self.profiler)
        self.fetcher.units = self.units
        for unit in self.units:
            self._place(unit)
        self._move_unmanaged_to_device()
        streamed = [u for u in self.units if u.streamed]
        self.scheduler = PrefetchScheduler(
            cfg.prefetch, [u.numel * self.lp_dtype.itemsize for u in self.units], [u.name for u in self.units],
            self.fetcher.prefetch, self.fetcher.inflight_bytes)
        self._hooks = []
        self._register_hooks(streamed)

    # ------------------------------------------------------------ placement

    def _place(self, unit: Unit) -> None:
        placement = self.plan.placement
        unit.param_loc, unit.grad_loc, unit.optim_loc = placement["params"], placement["gradients"], \
            placement["optimizer"]
        sharding = self.sharding
        full = torch.cat([p.detach().reshape(-1).float().cpu() for p in unit.params])
        sharding.broadcast(full)  # every rank starts from rank 0's weights
        master = sharding.shard_of(unit, full)  # fp32 master of this rank's shard (all of it on one rank)
        self.unit_optimizer.init_state(unit, master, lambda n, what: self._alloc(unit.optim_loc, n, torch.float32,
                                                                                 what))
        unit.streamed = unit.param_loc is not Location.DEVICE or sharding.gathered(unit)
        lp = (master if sharding.gathered(unit) else full).to(self.lp_dtype)  # what this rank stores
        if sharding.gathered(unit) and unit.param_loc is not Location.NVME:
            unit.param_shard = self._alloc(unit.param_loc, lp.numel(), self.lp_dtype, unit.param_key).copy_(lp)
        elif unit.param_loc is Location.DEVICE:
            unit.device_flat = self.device_tier.alloc((unit.numel,), self.lp_dtype, unit.param_key)
            unit.device_flat.copy_(lp)
            for p, view in unit.views(unit.device_flat):
                p.data = view
        elif unit.param_loc is Location.HOST:
            self.host_tier.reserve(unit.numel * self.lp_dtype.itemsize, unit.param_key)
            unit.host_param = lp.pin_memory() if self.device.type == "cuda" else lp
        else:
            self.store.write(unit.param_key, lp).wait()
        if unit.streamed:
            self.fetcher.release(unit)
        # The full fp32 gradient is the input of the reduce-scatter: NCCL needs it on the GPU;
        # gloo reduces wherever the gradient tier is.
        full_grad_loc = Location.DEVICE if sharding.active and self.device.type == "cuda" else unit.grad_loc
        unit.grad_flat = self._alloc(full_grad_loc, unit.numel, torch.float32, f"{unit.key}.grad").zero_()
        # The reduced gradient of this rank's shard. One rank, or a replicated unit whose
        # gradient is reduced once per window (stages 0-1): the full flat itself.
        aliased = not sharding.active or (unit.part.replicated and sharding.stage <= 1)
        unit.grad_shard = unit.grad_flat if aliased else \
            self._alloc(unit.grad_loc, unit.part.shard_numel, torch.float32, f"{unit.key}.grad_shard").zero_()

    def _alloc(self, loc: Location, numel: int, dtype: torch.dtype, what: str) -> torch.Tensor:
        if loc is Location.DEVICE:
            return self.device_tier.alloc((numel,), dtype, what)
        self.host_tier.reserve(numel * dtype.itemsize, what)  # freed only at close(): lives for the run
        return torch.empty(numel, dtype=dtype, pin_memory=self.device.type == "cuda")

    def _residency(self) -> dict[str, tuple[int, int]]:
        tiers = {"device": self.device_tier, "host": self.host_tier}
        if self.store is not None:
            tiers["nvme"] = self.store
        return {name: (t.used, t.budget) for name, t in tiers.items()}

    def _move_unmanaged_to_device(self) -> None:
        managed = {id(p) for u in self.units for p in u.params}
        for module in self.module.modules():
            for name, p in module._parameters.items():
                if p is not None and id(p) not in managed:
                    p.data = p.data.to(self.device)
            for name, b in module._buffers.items():
                if b is not None:
                    module._buffers[name] = b.to(self.device)

    def _fused_out(self, unit: Unit) -> torch.Tensor | None:
        """Where the Adam kernel can write new bf16/fp16 params directly (same pass), if anywhere."""
        if self.lp_dtype == torch.float32 or not unit.part.replicated:
            return None
        if unit.param_loc is Location.HOST:
            return unit.host_param
        if unit.param_loc is Location.DEVICE and self.device.type == "cpu":
            return unit.device_flat
        return None

    def _write_params(self, unit: Unit, master: torch.Tensor, fused: bool) -> None:
        """param-copyback: the updated fp32 master (this rank's shard) becomes low-precision params."""
        prof = self.profiler
        src = "device" if master.device.type != "cpu" else "host"
        dst = unit.param_loc.value
        nbytes = master.numel() * self.lp_dtype.itemsize
        token = prof.begin(unit.param_key, "param", src, dst, nbytes, "param-copyback") \
            if prof is not None and src != dst else None
        sharding = self.sharding
        if fused:
            pass  # the Adam kernel already wrote the new low-precision params
        elif sharding.gathered(unit):  # stage 3: only the shard is stored
            if unit.param_loc is Location.NVME:
                self.store.write(unit.param_key, master.to(self.lp_dtype)).wait()
            else:
                unit.param_shard.copy_(master)
        elif not unit.part.replicated:  # stages 1-2: all-gather the new shard into the full params
            lp_shard = master.to(self.lp_dtype, copy=True)  # master may be a reused NVMe staging slot
            if unit.param_loc is Location.NVME:
                out = torch.empty(unit.numel, dtype=self.lp_dtype)
                sharding.gather_params(unit, lp_shard, out,
                                       lambda flat: self.store.write(unit.param_key, flat).wait())
            else:
                sharding.gather_params(unit, lp_shard, unit.device_flat if unit.param_loc is Location.DEVICE
                                       else unit.host_param)
        elif unit.param_loc is Location.DEVICE:
            unit.device_flat.copy_(master)
        elif unit.param_loc is Location.HOST:
            unit.host_param.copy_(master)
        else:
            self.store.write(unit.param_key, master.to(self.lp_dtype)).wait()
        if src != dst and unit.param_loc is Location.DEVICE:
            self.device_tier.count_in(nbytes)
        if token is not None:
            prof.end(token)

    # ------------------------------------------------------------ fetch / release

    def _demand(self, unit: Unit) -> None:
        """Compute needs `unit` now: record it for prefetch, then make it resident."""
        if torch.is_grad_enabled() and self.module.training or self._in_backward:
            self.scheduler.on_demand(unit.index)
        self.fetcher.demand(unit)

    # ------------------------------------------------------------ hooks

    def _register_hooks(self, offloaded: list[Unit]) -> None:
        by_module: dict[str, list[Unit]] = {}
        for unit in offloaded:
            for name in unit.modules:
                by_module.setdefault(name, []).append(unit)
        root = self.module
        for name, module in self.module.named_modules():
            units = by_module.get(name, [])
            if units or module is root:
                self._hooks.append(module.register_forward_pre_hook(self._pre_forward(module is root, units)))
            if units:
                self._hooks.append(module.register_forward_hook(self._post_forward(units)))
        for unit in self.units:
            for i, p in enumerate(unit.params):
                self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_hook(unit, i)))

    def _pre_forward(self, is_root: bool, units: list[Unit]):
        def hook(module, args):
            if is_root and torch.is_grad_enabled() and module.training and not self._in_backward:
                self.scheduler.begin_pass()
            for unit in units:
                self._demand(unit)
        return hook

    def _post_forward(self, units: list[Unit]):
        def hook(module, args, output):
            if torch.is_grad_enabled():
                def wrap(t):
                    return _FetchOnBackward.apply(self, units, t)[0] if t.requires_grad else t
                output = _map_tensors(output, wrap)
            for unit in units:
                self.fetcher.release(unit)
            return output
        return hook

    def _grad_hook(self, unit: Unit, i: int):
        offset, numel = unit.offsets[i], unit.shapes[i].numel()

        def hook(p: torch.Tensor) -> None:
            # grad-offload: fold the fresh gradient into the unit's fp32 accumulator.
            prof = self.profiler
            offload = unit.grad_loc is Location.HOST
            token = prof.begin(unit.key + ".grad", "grad", "device", "host", numel * p.grad.element_size(),
                               "grad-offload") if prof is not None and offload else None
            unit.grad_flat[offset: offset + numel].add_(p.grad.reshape(-1).to(unit.grad_flat.device))
            if offload:
                self.device_tier.count_out(numel * p.grad.element_size())
            if token is not None:
                prof.end(token)
            p.grad = None
            unit.has_grad = not self.sharding.active  # sharded: set when the reduced shard arrives
            unit.grads_seen += 1
            if unit.grads_seen >= len(unit.params):
                self.fetcher.release(unit)
                if self._reduce_now:
                    self.sharding.reduce(unit)  # bucketed reduce-scatter, overlapping the rest of backward
                elif self._early_step_ok:
                    self._start_early_step(unit)
        return hook

    def _start_early_step(self, unit: Unit) -> None:
        """[Note: early step] update `unit` on the optimizer thread while backward goes on."""
        unit.stepped_early = True
        if self.device.type == "cuda":  # the gradient add above was queued on the compute stream
            done = torch.cuda.Event()
            done.record()
        else:
            done = None

        def run():
            if done is not None:
                done.synchronize()
            self.unit_optimizer.step_unit(unit, self.optimizer.param_groups[0]["lr"], 1.0 / self.scaler.scale)
        self._early.append(self._optim_thread.submit(run))

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
        if self._backward_since_step:  # each step() consumes exactly one backward (the same loss twice too)
            raise ZerotierError("engine.backward() called twice without engine.step() in between: call "
                                "engine.step() after every micro-batch's backward (it applies the update only "
                                "every train.grad_accum_steps calls)")
        scale = self.scaler.scale / self.cfg.train.grad_accum_steps
        last_micro = (self.micro_steps + 1) % self.cfg.train.grad_accum_steps == 0
        self._reduce_now = self.sharding.reduces_now(last_micro)
        self._early_step_ok = (self.cfg.train.max_grad_norm is None and not self.scaler.dynamic and last_micro
                               and not self.sharding.active)
        self._in_backward = True
        span = self.profiler.compute_begin("backward") if self.profiler is not None else None
        try:
            (loss * scale).backward()
        finally:
            if span is not None:
                self.profiler.compute_end(span)
            self._in_backward = False
            self._early_step_ok = False
            for unit in self.units:
                unit.grads_seen = 0
                self.fetcher.release(unit)
        if self._reduce_now:
            self.sharding.finish_backward()
            if self.sharding.stage >= 2:  # the micro-batch's sum now lives in the shards
                for unit in self.units:
                    unit.grad_flat.zero_()
        self._reduce_now = False
        self._backward_since_step = True

    def step(self) -> bool:
        """Call after every micro-batch's backward. Returns True when the parameters were updated."""
        if not self._backward_since_step:
            raise ZerotierError("engine.step() called before engine.backward(loss): there are no gradients "
                                "to apply")
        self._backward_since_step = False
        self.micro_steps += 1
        if self.micro_steps % self.cfg.train.grad_accum_steps:
            return False
        self._wait_early_steps()
        inv_scale = 1.0 / self.scaler.scale
        local = sum(self._grad_sumsq(u) for u in self.units if self.sharding.local_sumsq_share(u))
        total_norm = math.sqrt(self.sharding.global_sum(local)) * inv_scale
        overflow = not math.isfinite(total_norm)
        if overflow and self.scaler.dynamic:
            self.scaler.update(overflow=True)
            self.zero_grad()
            return False
        clip = 1.0
        if self.cfg.train.max_grad_norm is not None:
            clip = min(1.0, self.cfg.train.max_grad_norm / (total_norm + 1e-6))
        self.last_grad_norm = total_norm
        self.optimizer.step()
        pending = [u for u in self.units if u.has_grad and not u.stepped_early]
        self.unit_optimizer.step(pending, self.optimizer.param_groups[0]["lr"], grad_scale=clip * inv_scale)
        self.sharding.finish_gather()  # stages 1-2: the new parameter shards reach every rank
        self.scaler.update(overflow=False)
        self.global_steps += 1
        self.zero_grad()
        return True

    @staticmethod
    def _grad_sumsq(unit: Unit) -> float:
        grad = unit.grad_shard  # padding is zero: it adds nothing
        if grad.device.type == "cpu":
            return _kernels.grad_sumsq(grad)
        return float(grad.double().square().sum())

    def _wait_early_steps(self) -> None:
        early, self._early = self._early, []
        for future in early:
            future.result()  # re-raises an error from the optimizer thread

    def synchronize(self) -> None:
        """Finish the work in flight: wait for Adam updates started during backward and
        drop parameter fetches issued but not yet consumed (e.g. before loading new weights)."""
        self._wait_early_steps()
        self.fetcher.drop_inflight()

    def zero_grad(self) -> None:
        for unit in self.units:
            unit.grad_flat.zero_()
            if unit.grad_shard is not unit.grad_flat:
                unit.grad_shard.zero_()
            unit.has_grad = unit.stepped_early = False
            for p in unit.params:
                p.grad = None
        self._backward_since_step = False

    def parameters_fp32(self) -> dict[str, torch.Tensor]:
        """Full-precision weights by parameter name (copies; reads NVMe-resident masters).
        With several ranks this is a collective: every rank must call it."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        out = {}
        for unit in self.units:
            master = self.sharding.gather_full(unit, self.unit_optimizer.read_state(unit)["master"].cpu())
            for p, view in unit.views(master):
                out[names[id(p)]] = view.clone()
        return out

    # ------------------------------------------------------------ checkpoints (zerotier/checkpoint.py)

    def save_checkpoint(self, root, *, lr_scheduler=None, client_state=None):
        """Save the training state under `root` as root/ckpt-<global_steps> (collective; only at an
        optimizer-step boundary). Returns the checkpoint directory. See docs/checkpoint.md."""
        from . import checkpoint
        return checkpoint.save(self, root, lr_scheduler=lr_scheduler, client_state=client_state)

    def load_checkpoint(self, root, *, lr_scheduler=None):
        """Load root/latest (or a ckpt-N directory) into this engine, whatever its placement, stage or
        world size (collective). Returns the saved client_state. See checkpoint.load for RNG rules."""
        from . import checkpoint
        return checkpoint.load(self, root, lr_scheduler=lr_scheduler)

    def consolidated_state_dict(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """Plain model weights by state_dict name (trained params from the fp32 master, plus frozen
        params and buffers), for model.load_state_dict. Collective with several ranks."""
        from . import checkpoint
        return checkpoint.consolidated_state_dict(self, dtype)

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
        tiers = [self.device_tier] + ([self.store] if self.store is not None else [])
        for tier in tiers:
            st = tier.stats()
            lines.append(f"  {tier.name:7s} in {format_size(st['bytes_in']):>11s}  out {format_size(st['bytes_out']):>11s}"
                         f"  peak {format_size(st['peak']):>11s} of {format_size(st['budget'])}")
        return "\n".join(lines)

    def close(self) -> None:
        """Remove hooks, stop fetch workers and delete this run's NVMe files. Idempotent."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.fetcher.close()
        self._optim_thread.shutdown(wait=True)
        if self.profiler is not None:
            self.profiler.close()  # writes profile.trace_path, if set
        if self.store is not None:
            self.store.close()
            self.store = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
