"""The parameter surface: what the user's code sees when it touches a parameter zerotier manages.

[Note: the parameter surface]
zerotier keeps a unit's parameters as views of one device flat whose storage is
released outside the unit's use ([Note: fetch and release] in hooks.py), and the
truth of each weight is its fp32 master in the optimizer's tier. A plain Parameter
over released storage would hand the user freed memory (`print(w)` segfaults,
`w.numpy()` is garbage) and an in-place edit would reach only the low-precision copy,
which the next step overwrites from the master. So at initialize every managed
parameter's class becomes `ManagedParameter` (a subclass of the parameter's own class,
so isinstance checks hold), whose `__torch_function__` sorts each call that touches it:

  metadata      shape, dtype, device, requires_grad, data_ptr, hooks ...: as torch, no bytes read
  read          any other op. Unit resident: as torch. Released: the unit is fetched, the
                op runs on a copy of the parameter, the unit is released again (print, norm,
                clone, numpy, an EMA). With grad enabled the copy is the output of `_Fetched`,
                whose backward hands the gradient to the parameter, so autograd sees every
                use (a parent reading a child's weight, a weight regularizer, a submodule
                called outside the root forward, a module returning its weight) and no unit
                stays resident beyond the op
  write         an in-place op, `__setitem__`, `out=`, `p.data = t` (copy_, load_state_dict,
                nn.init under no_grad): runs on the fp32 master value of the parameter and
                stores it as the new master *and* low-precision copy, on every placement
                ([Note: writes reach the master] below)
  conversion    `to/float/half/cuda/...` that changes nothing returns the parameter (torch
                returns self too); one that changes dtype or device is a read (a copy)
  .data/detach  a `ManagedView`: an alias that goes through the same sorting, so
                `p.data.copy_(x)` is a write and `p.detach().numpy()` a read
  .grad         grad_view.py's `grad_get` / `grad_set` ("gradients as torch shows them")

`model.to(dtype or device)` that would change a managed parameter is refused before
anything changes (the engine keeps fp32 masters; precision.param_dtype and
train.device choose the compute copies). With several ranks a read of a released
ZeRO-3 parameter gathers it and a write stores every rank's shard: do them on every
rank, as with FSDP's summon_full_params.

[Note: writes reach the master]
A write runs on an fp32 copy of the parameter's current master value (placed on the
parameter's device), then the unit's master is replaced, its Adam moments and step
counts kept (as torch keeps optimizer state across model.load_state_dict), and the new
low-precision copy is committed home exactly as after an optimizer step (version
bumped: a prefetch of the old bytes is never used). For a bf16 parameter the master
keeps the written value in fp32 (`p.copy_(x)` stores x exactly; torch would round it to
bf16, and so does the compute copy). `model.load_state_dict` batches the writes of each
unit: one master read and one write per unit, not per parameter.
"""
from __future__ import annotations

import contextlib
import threading
import weakref

import torch
from torch._C import DisableTorchFunctionSubclass

from ..errors import ConfigError, ZerotierError
from ..state import ParamState
from . import grad_view

_local = threading.local()


@contextlib.contextmanager
def internal():
    """zerotier's own code touching managed parameters: torch's behaviour, no sorting."""
    prev = getattr(_local, "internal", False)
    _local.internal = True
    try:
        yield
    finally:
        _local.internal = prev


def _plain(func, args, kwargs):
    with DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


_T = torch.Tensor


def _existing(*objs):
    return {o for o in objs if o is not None}


def _getter(name):
    attr = getattr(_T, name, None)
    return getattr(attr, "__get__", None)


def _setter(name):
    attr = getattr(_T, name, None)
    return getattr(attr, "__set__", None)


_METADATA = _existing(
    *(_getter(n) for n in ("shape", "dtype", "device", "requires_grad", "is_leaf", "grad_fn", "ndim", "layout",
                           "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_mkldnn", "is_nested",
                           "is_xpu", "is_mps", "names", "name", "itemsize", "nbytes", "_version", "output_nr",
                           "retains_grad", "_backward_hooks", "_post_accumulate_grad_hooks", "_cdata", "_base")),
    _setter("requires_grad"), _setter("_backward_hooks"), _setter("_post_accumulate_grad_hooks"),
    *(getattr(_T, n, None) for n in ("size", "dim", "numel", "nelement", "stride", "storage_offset", "is_contiguous",
                                     "element_size", "data_ptr", "untyped_storage", "is_floating_point",
                                     "is_complex", "get_device", "requires_grad_", "register_hook",
                                     "register_post_accumulate_grad_hook", "retain_grad", "ndimension", "is_shared",
                                     "is_inference", "_is_view", "is_pinned", "__hash__", "has_names",
                                     "__len__", "is_signed", "_has_compatible_shallow_copy_type",
                                     "__dlpack_device__", "_typed_storage", "storage", "is_set_to")),
    torch._has_compatible_shallow_copy_type,
)
_GRAD_GET = _existing(_getter("grad"), _getter("_grad"))
_GRAD_SET = _existing(_setter("grad"), _setter("_grad"))
_DATA_GET, _DATA_SET = _getter("data"), _setter("data")
_ALIAS = _existing(_DATA_GET, _T.detach)
_CONVERSIONS = {_T.to: None, _T.float: torch.float32, _T.double: torch.float64, _T.half: torch.float16,
                _T.bfloat16: torch.bfloat16, _T.cpu: None, _T.cuda: None}
# reads whose result shares the tensor's memory outside torch (it would outlive a release)
_ESCAPES = _existing(*(getattr(_T, n, None) for n in ("numpy", "__array__", "__dlpack__")))
_INPLACE_DUNDERS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
                    "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"}


_RESIDENT = ParamState.RESIDENT
_KINDS: dict = {}  # func -> "metadata" / "read" / "other" (see _kind), filled as calls come


def _kind(func) -> str:
    """"metadata" never reads bytes; "read" may take the hot path when every unit is resident;
    "other" (grad, data, alias, conversion, escape, repr, write) always goes through dispatch()."""
    if func in _METADATA:
        return "metadata"
    special = func in _GRAD_GET or func in _GRAD_SET or func == _DATA_SET or func in _ALIAS \
        or func in _CONVERSIONS or func in _ESCAPES or func is _T.__repr__
    return "other" if special or _is_write(func) else "read"


def _is_write(func) -> bool:
    name = getattr(func, "__name__", "")
    return name in _INPLACE_DUNDERS or (name.endswith("_") and not name.endswith("__"))


def _managed(args, kwargs) -> list:
    """The managed tensors among a call's arguments (one level into lists and tuples: foreach ops)."""
    found = []
    for a in (*args, *kwargs.values()) if kwargs else args:
        if hasattr(a, "_zt"):
            found.append(a)
        elif type(a) in (list, tuple):
            found.extend(t for t in a if hasattr(t, "_zt"))
    return found


def _replace(obj, subst: dict):
    if isinstance(obj, _T):
        return subst.get(id(obj), obj)
    if type(obj) in (list, tuple):  # the containers _managed looks into
        return type(obj)(_replace(o, subst) for o in obj)
    return obj


def _replaced(args, kwargs, subst):
    return tuple(_replace(a, subst) for a in args), {k: _replace(v, subst) for k, v in kwargs.items()}


class _Fetched(torch.autograd.Function):
    """A released parameter read with grad enabled: the op reads `value` (a fetched copy), and
    the gradient goes to the parameter's AccumulateGrad like any other use of it."""

    @staticmethod
    def forward(ctx, param, value):
        return value

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ParamRef:
    """Where a managed parameter (or an alias of it) lives: its surface, unit index and place in the unit."""

    __slots__ = ("surface", "unit", "k", "param")

    def __init__(self, surface: "ParamSurface", unit: int, k: int, param):
        self.surface, self.unit, self.k, self.param = surface, unit, k, weakref.ref(param)


class ManagedTensor:
    """The sorting of [Note: the parameter surface], shared by ManagedParameter and ManagedView."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():  # [Note: compiled units]: the hooks made the unit resident
            with DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        kind = _KINDS.get(func)
        if kind is None:
            kind = _KINDS[func] = _kind(func)
        if kind == "metadata" or getattr(_local, "internal", False):
            with DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        found = _managed(args, kwargs)
        surface = found[0]._zt.surface if found else None
        if surface is None or not surface.live:  # the engine closed: an alias reads its parameter
            subst = {id(t): t._zt.param() for t in found if isinstance(t, ManagedView) and t._zt.param() is not None}
            return _plain(func, *_replaced(args, kwargs, subst))
        if kind == "read" and not surface.publish_first \
                and all(surface.state[t._zt.unit] is _RESIDENT for t in found):
            with DisableTorchFunctionSubclass():  # the hot path: forward's own ops on resident units
                return func(*args, **kwargs)
        return surface.dispatch(func, args, kwargs, found)

    def __deepcopy__(self, memo):
        """A plain parameter holding the current value (copy.deepcopy(model): an EMA model, say)."""
        value = self.detach().clone()
        with internal():
            out = torch.nn.Parameter(value, requires_grad=self.requires_grad) \
                if isinstance(self, torch.nn.Parameter) else value
        memo[id(self)] = out
        return out

    def __reduce_ex__(self, proto):
        """Pickled (torch.save(model)) as a plain tensor/parameter of the current value."""
        value = self.detach().clone()
        with internal():
            if isinstance(self, torch.nn.Parameter):
                return torch._utils._rebuild_parameter, (value, self.requires_grad, {})
            return value.__reduce_ex__(proto)


class ManagedView(ManagedTensor, torch.Tensor):
    """`p.data` / `p.detach()` of a managed parameter: an alias sorted like the parameter itself."""


_CLASSES: dict[tuple, type] = {}


def _managed_class(cls: type, hooked: tuple = ()) -> type:
    """The managed subclass of a parameter class (nn.Parameter, or a user's subclass of it); with
    `hooked` (the names of the modules whose hooks fetch and release units), its subclass for that
    layout ([Note: compiled code and the hook layout])."""
    if issubclass(cls, ManagedTensor):
        cls = next(c for c in cls.__mro__ if not issubclass(c, ManagedTensor))
    key = (cls, hooked)
    if key not in _CLASSES:
        if hooked:
            base = _managed_class(cls)
            _CLASSES[key] = type(base.__name__, (base,), {"__module__": __name__})
        else:
            name = "ManagedParameter" if cls is torch.nn.Parameter else f"Managed{cls.__name__}"
            _CLASSES[key] = type(name, (ManagedTensor, cls), {"__module__": __name__})
    return _CLASSES[key]


ManagedParameter = _managed_class(torch.nn.Parameter)


class ParamSurface:
    """The engine's side of [Note: the parameter surface]: fetches for reads, writes to the master."""

    def __init__(self, engine):
        self._engine = weakref.ref(engine)
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
        engine = self._engine()
        self.state = engine.params.state  # ParamStore's list: transition() writes it in place
        hooked = tuple(sorted({name for unit in engine.param_units if engine.params.streamed[unit.index]
                               for name in unit.modules}))
        for unit in engine.param_units:
            for k, p in enumerate(unit.params):
                self._classes[id(p)] = type(p)
                p.__class__ = _managed_class(type(p), hooked)
                p._zt = ParamRef(self, unit.index, k, p)
        self.live = True

    def disown(self) -> None:
        """The parameters become what they were (close())."""
        engine = self._engine()
        self.live = False
        for unit in engine.param_units:
            for p in unit.params:
                if id(p) in self._classes:
                    p.__class__ = self._classes[id(p)]
                    p.__dict__.pop("_zt", None)
        self._classes.clear()

    # ------------------------------------------------------------------ sorting

    def dispatch(self, func, args, kwargs, found):
        engine = self._engine()
        target = args[0] if args else None
        if func in _GRAD_GET or func in _GRAD_SET:  # "gradients as torch shows them": grad_view.py
            if isinstance(target, ManagedView):  # p.data / p.detach(): no gradient of its own, as in torch
                return _plain(func, args, kwargs)
            return grad_view.grad_get(engine.window, target) if func in _GRAD_GET else \
                grad_view.grad_set(engine.window, target, args[1])
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
            engine.window.overlap.before_read()
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
        return self._engine().params.state[t._zt.unit] is ParamState.RESIDENT

    def _read(self, func, args, kwargs, found):
        engine = self._engine()
        params = engine.params
        if func in _ESCAPES:  # numpy() & co. of a streamed unit: a copy, even while it is resident
            away = {t._zt.unit for t in found if params.streamed[t._zt.unit]}
        else:
            away = {t._zt.unit for t in found if not self._resident(t)}
        if not away:
            if func is _T.__repr__:  # printed as the tensor it is, not as zerotier's class
                return _plain(func, (_plain(_T.as_subclass, (args[0], _T), {}),), {})
            return _plain(func, args, kwargs)
        units = [engine.param_units[i] for i in sorted(away)]
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
        engine = self._engine()
        if self.publish_first:  # engine.gathered(): the units are fetched with the update published
            engine.window.overlap.before_read()
        fetched = []
        try:
            for unit in units:
                if engine.params.state[unit.index] is not ParamState.RESIDENT:
                    engine.params.demand(unit)
                    fetched.append(unit)
            yield
        finally:
            for unit in fetched:
                engine.params.release(unit)

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
        engine = self._engine()
        ref = t._zt
        unit = engine.param_units[ref.unit]
        full = self._unit_master(unit)
        off, shape = unit.offsets[ref.k], unit.shapes[ref.k]
        return full[off: off + shape.numel()].view(shape).clone()

    def store_value(self, t, value: torch.Tensor) -> None:
        engine = self._engine()
        ref = t._zt
        unit = engine.param_units[ref.unit]
        full = self._unit_master(unit)
        off, shape = unit.offsets[ref.k], unit.shapes[ref.k]
        full[off: off + shape.numel()].copy_(value.reshape(-1))
        if self._batch is None:
            self._store_unit(unit, full)

    def _unit_master(self, unit) -> torch.Tensor:
        if self._batch is not None and unit.index in self._batch:
            return self._batch[unit.index]
        engine = self._engine()
        engine.synchronize()  # updates and write-backs in flight land first
        if unit.frozen:
            full = engine.weights.frozen_value(unit).float()
        else:
            shard = engine.unit_optimizer.read_state(unit, ("master",))["master"]
            full = engine.sharding.gather_full(unit, shard.cpu()).clone()
        if self._batch is not None:
            self._batch[unit.index] = full
        return full

    def _store_unit(self, unit, full: torch.Tensor) -> None:
        """The unit's new fp32 master (full, CPU): master shard, moments kept, low-precision copy home.
        A frozen unit's value goes home only ([Note: frozen units] in state.py)."""
        engine = self._engine()
        shard = torch.zeros(unit.shard_numel)
        lo, hi = unit.shard_lo, unit.shard_hi
        shard[: hi - lo] = full[lo:hi]
        if not unit.frozen:
            opt = engine.unit_optimizer
            state = opt.read_state(unit)
            opt.write_state(unit, {"master": shard, "exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]},
                            list(opt.steps[unit.index]))
        engine.params.load(unit, shard)
        engine.params.finish_commits()
        i = unit.index
        if engine.params.streamed[i] and engine.params.state[i] is ParamState.RESIDENT:
            engine.params.device_flat[i][: unit.numel].copy_(full.to(engine.lp_dtype))  # the compute copy too
            slot = engine.params.slots[i]
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
            engine = self._engine()
            for i, full in sorted(edited.items()):
                self._store_unit(engine.param_units[i], full)

    # ------------------------------------------------------------------ module-level guards

    def check_apply(self, fn) -> None:
        """model.to()/half()/cuda(): refused before anything changes if it would convert a managed parameter."""
        engine = self._engine()
        forms = {}
        with internal():
            for unit in engine.param_units:
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
        engine = self._engine()
        p = t._zt.param()
        for name, q in engine.module.named_parameters(remove_duplicate=False):
            if q is p:
                return f"parameter '{name}'"
        return "a parameter zerotier manages"
