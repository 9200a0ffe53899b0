"""The engine's side of the parameter surface ([Note: the parameter surface] in surface.py):
the fetches for reads of managed parameters, the writes that reach the fp32 master ([Note: writes
reach the master] in surface.py), and the model-level guards (model.to(), load_state_dict).
surface.py holds the parameters' classes and the sorting of each call; this module what a
sorted call does to the engine's parts.
"""
from __future__ import annotations

import contextlib
import weakref

import torch

from ..errors import ConfigError, ZerotierError
from ..state import ParamState
from . import grad_view
from .surface import (_ALIAS, _CONVERSIONS, _DATA_SET, _ESCAPES, _GRAD_GET, _GRAD_SET, _T, ManagedView, ParamRef,
                      _Fetched, _is_write, _managed, _managed_class, _plain, _replaced, internal)


class ParamSurface:
    """The engine's side of [Note: the parameter surface]: fetches for reads, writes to the master.
    `rt`: the engine's parts ([Note: the runtime record] in runtime.py); `window` for the gradients
    and the reads that publish an update; `weights` for frozen units' values; `synchronize`: the
    engine's (updates and write-backs in flight land). Held weakly: the parameters hold the surface,
    and the surface keeps no engine alive."""

    def __init__(self, rt, window, weights, synchronize):
        self._rt = weakref.ref(rt)
        self._window = weakref.ref(window)
        self._weights = weakref.ref(weights)
        self._synchronize = synchronize
        self.live = False
        self.state: list = []  # every unit's ParamState (the engine's params.state)
        self._batch: dict[int, torch.Tensor] | None = None  # unit index -> full fp32 master being edited
        self._classes: dict[int, type] = {}                  # id(param) -> its class before adopt()
        self.publish_first = False  # a delayed update waits: a read publishes it first (Delayed.before_read)

    # ------------------------------------------------------------------ adopt / disown

    def adopt(self) -> None:
        """[Note: compiled code and the hook layout]
        torch.compile's dynamo does not guard on module hooks (torch._dynamo.config.
        skip_nnmodule_hook_guards), and it caches compiled code per code object, so a model compiled
        whole under one engine (params on the device: no fetch hooks) would run its cached code under
        a later engine of the same model class whose hooks fetch and release units (params on host or
        NVMe): no fetch, released storage read ("data is not allocated yet"). Dynamo does guard on a
        parameter's exact class, so the managed class is one per hook layout (the modules whose hooks
        fetch units): code traced under another layout recompiles, and engines of the same layout
        share their compiled code (one graph per block code, not per unit: [Note: compiled units])."""
        rt = self._rt()
        self.state = rt.params.state  # ParamStore's list: transition() writes it in place
        hooked = tuple(sorted({name for unit in rt.param_units if rt.params.streamed[unit.index]
                               for name in unit.modules}))
        for unit in rt.param_units:
            for k, p in enumerate(unit.params):
                self._classes[id(p)] = type(p)
                p.__class__ = _managed_class(type(p), hooked)
                p._zt = ParamRef(self, unit.index, k, p)
        self.live = True

    def disown(self) -> None:
        """The parameters become what they were (close())."""
        rt = self._rt()
        self.live = False
        for unit in rt.param_units:
            for p in unit.params:
                if id(p) in self._classes:
                    p.__class__ = self._classes[id(p)]
                    p.__dict__.pop("_zt", None)
        self._classes.clear()

    # ------------------------------------------------------------------ sorting

    def dispatch(self, func, args, kwargs, found):
        target = args[0] if args else None
        if func in _GRAD_GET or func in _GRAD_SET:  # "gradients as torch shows them": grad_view.py
            if isinstance(target, ManagedView):  # p.data / p.detach(): no gradient of its own, as in torch
                return _plain(func, args, kwargs)
            return grad_view.grad_get(self._window(), target) if func in _GRAD_GET else \
                grad_view.grad_set(self._window(), target, args[1])
        if func == _DATA_SET:  # a method-wrapper: equal, not identical, from one access to the next
            return self._assign(target, args[1])
        if func in _ALIAS:
            view = _plain(func, args, kwargs).as_subclass(ManagedView)
            view._zt = target._zt
            return view
        if func in _CONVERSIONS and target is not None and hasattr(target, "_zt") \
                and self._converts_nothing(func, target, args, kwargs):
            return target
        if self.publish_first:  # [Note: delayed update] in overlap/delayed.py: a read between windows sees the update
            self._window().overlap.before_read()
        written = self._written(func, args, kwargs)
        if written is not None:
            return self._write(func, args, kwargs, written)
        return self._read(func, args, kwargs, found)

    @staticmethod
    def _converts_nothing(func, t, args, kwargs) -> bool:
        if func is _T.to:
            if kwargs.get("copy") or (len(args) > 1 and isinstance(args[1], _T)):
                return False
            device, dtype, _non_blocking, fmt = torch._C._nn._parse_to(*args[1:], **kwargs)
        elif func in (_T.cpu, _T.cuda):
            device = torch.device("cpu") if func is _T.cpu else torch.device("cuda", torch.cuda.current_device())
            if func is _T.cuda and len(args) > 1 and args[1] is not None:
                device = torch.device("cuda", args[1]) if isinstance(args[1], int) else torch.device(args[1])
            dtype, fmt = None, None
        else:
            device, dtype, fmt = None, _CONVERSIONS[func], None
        with internal():
            same_device = device is None or (device.type == t.device.type
                                             and (device.index is None or device.index == t.device.index))
            return same_device and (dtype is None or dtype == t.dtype) and fmt in (None, torch.preserve_format)

    @staticmethod
    def _written(func, args, kwargs):
        """The managed tensor this call writes into, or None for a read."""
        out = kwargs.get("out")
        if isinstance(out, _T) and hasattr(out, "_zt"):
            return out
        if args and _is_write(func):
            first = args[0]
            if isinstance(first, (list, tuple)):  # a foreach op writes its first list
                return next((t for t in first if isinstance(t, _T) and hasattr(t, "_zt")), None)
            if isinstance(first, _T) and hasattr(first, "_zt"):
                return first
        return None

    # ------------------------------------------------------------------ reads

    def _resident(self, t) -> bool:
        return self._rt().params.state[t._zt.unit] is ParamState.RESIDENT

    def _read(self, func, args, kwargs, found):
        rt = self._rt()
        params = rt.params
        if func in _ESCAPES:  # numpy() & co. of a streamed unit: a copy, even while it is resident
            away = {t._zt.unit for t in found if params.streamed[t._zt.unit]}
        else:
            away = {t._zt.unit for t in found if not self._resident(t)}
        if not away:
            if func is _T.__repr__:  # printed as the tensor it is, not as zerotier's class
                return _plain(func, (_plain(_T.as_subclass, (args[0], _T), {}),), {})
            return _plain(func, args, kwargs)
        units = [rt.param_units[i] for i in sorted(away)]
        with self.fetched(units):
            copies = {id(t): _plain(_T.clone, (t,), {}) for t in found if t._zt.unit in away}
        if torch.is_grad_enabled():  # the copy's gradient reaches the parameter
            with internal():
                for t in found:
                    if id(t) in copies and t.requires_grad:
                        copies[id(t)] = _Fetched.apply(t, copies[id(t)])
        return _plain(func, *_replaced(args, kwargs, copies))

    @contextlib.contextmanager
    def fetched(self, units):
        """The units resident for the block; those it fetched are released after."""
        rt = self._rt()
        if self.publish_first:  # engine.gathered(): the units are fetched with the update published
            self._window().overlap.before_read()
        fetched = []
        try:
            for unit in units:
                if rt.params.state[unit.index] is not ParamState.RESIDENT:
                    rt.params.demand(unit)
                    fetched.append(unit)
            yield
        finally:
            for unit in fetched:
                rt.params.release(unit)

    # ------------------------------------------------------------------ writes ([Note: writes reach the master])

    def _assign(self, target, value):
        """`p.data = value`: the same tensor (model.to() that changes nothing) or a write of its values."""
        if value is target or (hasattr(value, "_zt") and value._zt.param() is target._zt.param()):
            return None
        if not isinstance(value, _T):
            raise TypeError(f"p.data = {type(value).__name__}: expected a tensor")
        with internal():
            same = value.shape == target.shape and value.dtype == target.dtype and value.device == target.device
        if not same:
            raise ZerotierError(self._name(target) + ": `.data =` a tensor of another shape, dtype or device "
                                "after zerotier.initialize: zerotier keeps this parameter's fp32 master and "
                                "computes with precision.param_dtype on train.device; copy values in with "
                                "p.copy_(t) under torch.no_grad(), or call engine.close() first")
        self._write(_T.copy_, (target, value), {}, target, assign=True)
        return None

    def _write(self, func, args, kwargs, target, assign: bool = False):
        with internal():
            needs_grad = torch.is_grad_enabled() and target.requires_grad and isinstance(target, torch.nn.Parameter)
        if needs_grad and not assign:  # torch allows `p.data = t` with grad enabled, not `p.mul_(2)`
            raise RuntimeError("a leaf Variable that requires grad is being used in an in-place operation.")
        if args and isinstance(args[0], (list, tuple)):  # a foreach op writes every tensor of its first list
            targets = [t for t in args[0] if isinstance(t, _T) and hasattr(t, "_zt")]
        else:
            targets = [target]
        written = {id(t) for t in targets}
        with torch.no_grad():
            values = {}
            for t in targets:
                with internal():
                    values[id(t)] = self.master_value(t).to(t.device)
            for t in _managed(args, kwargs):  # managed tensors the op only reads (p.copy_(q))
                if id(t) not in written:
                    values[id(t)] = self._read(_T.clone, (t,), {}, [t])
            _plain(func, *_replaced(args, kwargs, values))
            for t in targets:
                self.store_value(t, values[id(t)])
        return target if kwargs.get("out") is target else args[0]

    def master_value(self, t) -> torch.Tensor:
        """The fp32 master of the parameter `t` aliases, full (gathered) on the CPU; a copy. A frozen
        parameter has no master: its value at home, in fp32 ([Note: frozen units] in state.py)."""
        rt = self._rt()
        ref = t._zt
        unit = rt.param_units[ref.unit]
        full = self._unit_master(unit)
        off, shape = unit.offsets[ref.k], unit.shapes[ref.k]
        return full[off: off + shape.numel()].view(shape).clone()

    def store_value(self, t, value: torch.Tensor) -> None:
        rt = self._rt()
        ref = t._zt
        unit = rt.param_units[ref.unit]
        full = self._unit_master(unit)
        off, shape = unit.offsets[ref.k], unit.shapes[ref.k]
        full[off: off + shape.numel()].copy_(value.reshape(-1))
        if self._batch is None:
            self._store_unit(unit, full)

    def _unit_master(self, unit) -> torch.Tensor:
        if self._batch is not None and unit.index in self._batch:
            return self._batch[unit.index]
        rt = self._rt()
        self._synchronize()  # updates and write-backs in flight land first
        if unit.frozen:
            full = self._weights().frozen_value(unit).float()
        else:
            shard = rt.unit_optimizer.state.read_state(unit, ("master",))["master"]
            full = rt.sharding.gather_full(unit, shard.cpu()).clone()
        if self._batch is not None:
            self._batch[unit.index] = full
        return full

    def _store_unit(self, unit, full: torch.Tensor) -> None:
        """The unit's new fp32 master (full, CPU): master shard, moments kept, low-precision copy home.
        A frozen unit's value goes home only ([Note: frozen units] in state.py)."""
        rt = self._rt()
        shard = torch.zeros(unit.shard_numel)
        lo, hi = unit.shard_lo, unit.shard_hi
        shard[: hi - lo] = full[lo:hi]
        if not unit.frozen:
            opt = rt.unit_optimizer.state
            state = opt.read_state(unit)
            opt.write_state(unit, {**state, "master": shard}, list(opt.steps[unit.index]))
        rt.params.load(unit, shard)
        rt.params.finish_commits()
        i = unit.index
        if rt.params.streamed[i] and rt.params.state[i] is ParamState.RESIDENT:
            rt.params.device_flat[i][: unit.numel].copy_(full.to(rt.lp_dtype))  # the compute copy too
            slot = rt.params.slots[i]
            slot.fetched = slot.version  # it holds the new version: no refetch ([Note: parameter versions])

    @contextlib.contextmanager
    def batch(self):
        """Writes inside are collected per unit and stored once at the end (load_state_dict)."""
        if self._batch is not None:
            yield
            return
        self._batch = {}
        try:
            yield
        finally:
            edited, self._batch = self._batch, None
            rt = self._rt()
            for i, full in sorted(edited.items()):
                self._store_unit(rt.param_units[i], full)

    # ------------------------------------------------------------------ module-level guards

    def check_apply(self, fn) -> None:
        """model.to()/half()/cuda(): refused before anything changes if it would convert a managed parameter."""
        rt = self._rt()
        forms = {}
        with internal():
            for unit in rt.param_units:
                for p in unit.params:
                    forms.setdefault((p.dtype, p.device), p)
            for (dtype, device), p in forms.items():
                try:
                    probe = fn(torch.empty(0, dtype=dtype, device=device))
                except Exception:  # noqa: BLE001 - not a conversion zerotier can judge: let torch run it
                    continue
                if isinstance(probe, _T) and (probe.dtype != dtype or probe.device != device):
                    raise ConfigError(
                        f"model conversion to {probe.dtype} on {probe.device} after zerotier.initialize: the "
                        f"engine keeps the trained parameters as fp32 masters and computes with {dtype} copies on "
                        f"{device}. Choose the compute dtype with precision.param_dtype and the device with "
                        "train.device before initialize, or call engine.close() first (it puts the weights back "
                        "into the model)")

    def _name(self, t) -> str:
        rt = self._rt()
        p = t._zt.param()
        for name, q in rt.module.named_parameters(remove_duplicate=False):
            if q is p:
                return f"parameter '{name}'"
        return "a parameter zerotier manages"
