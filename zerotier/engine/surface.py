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

from ..state import ParamState

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

    def __init__(self, surface, unit: int, k: int, param):  # surface: param_surface.ParamSurface
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
    layout ([Note: compiled code and the hook layout] in param_surface.py)."""
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
