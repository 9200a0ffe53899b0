"""The module hooks: a wrapped module's forward fetches its units and releases them after, its
backward fetches them again, and the first hook of a backward the engine did not start enters
the plain PyTorch loop. The hooks own no bytes (the stores do) and no loop state (window.py).

[Note: fetch and release]
Parameters placed on host or NVMe (or gathered at ZeRO-3) are *released* outside
their module's use: their device flat has no storage. A forward pre-hook fetches
the module's units (waiting on a prefetch if one is in flight); the forward
post-hook releases them and wraps the module's outputs in `_FetchOnBackward`,
whose backward fetches them again just before autograd needs them. A
post-accumulate-grad hook (window.py) hands each gradient to the gradient store and,
once every parameter of the unit has its gradient, releases the unit. Autograd's
saved references are the Parameter objects (or views of the same flat), so
refilling the flat before their backward runs is what makes this correct.

[Note: autocast and streamed parameters]
Under torch.autocast, an op casts a full-precision parameter to the autocast dtype,
keeps the copy in autocast's cache until the autocast region ends, and autograd saves
it for backward. For a parameter zerotier streams (released after its module's
forward), that copy would stay on the device for the whole step: no device memory
saved, and none of it in any budget. So a module whose streamed parameters are not
already in the autocast dtype refuses to run under autocast, with the fix in the
message: `precision.param_dtype = "bf16"` (low-precision compute copies, fp32 master),
or parameters kept on the device, where autocast works as in plain PyTorch.

[Note: torch.func over the inputs]
torch.func.grad / vjp / jacrev / jvp / jacfwd (and vmap over them) with respect to a
model's inputs run its forward and their own backward inside transform levels, which
refuse in-place writes to the tensors the function captures: a unit's fetch and release
write its storage. So under a differentiating transform the hooks fetch and release below
every level (`_outside_transforms`), start no training pass or prefetch, and wrap the
module's inputs in `_ReleaseAfterBackward` as for frozen units: the transform's backward
fetches each unit through `_FetchOnBackward` (a transform's backward opens no accumulation
window: it computes no parameter gradient) and releases it once the module's input
gradient is out. The autograd.Functions are in setup_context form so transforms can apply
them. Two things cannot work with parameters streamed, as with create_graph=True: reverse
mode over reverse mode (jacrev(jacrev(f)); refused at the module's forward, forward mode
over reverse, torch.func.hessian, works) and a later backward through the gradient a
transform returned (a gradient penalty: `_NotDifferentiatedAgain` refuses it). vmap alone
runs the hooks as a plain forward does. Transforms over the parameters themselves
(functional_call) are refused by _refuse_unmanaged_grads.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools

import torch
from torch._C._functorch import TransformType
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters, temporarily_clear_interpreter_stack

from ..errors import ConfigError, ZerotierError


def _in_transform() -> bool:
    """A differentiating torch.func transform (grad, vjp, jacrev, jvp, jacfwd; under vmap too) is running
    ([Note: torch.func over the inputs]); vmap alone runs the hooks as a plain forward does."""
    return torch._C._are_functorch_transforms_active() and any(
        i.key() in (TransformType.Grad, TransformType.Jvp) for i in retrieve_all_functorch_interpreters())


@contextlib.contextmanager
def _outside_transforms():
    """[Note: torch.func over the inputs] Fetches and releases write the units' storage in place, which
    a transform refuses for the tensors it captures: they run below every transform level."""
    if torch._C._are_functorch_transforms_active():
        with temporarily_clear_interpreter_stack():
            yield
    else:
        yield


class _FetchOnBackward(torch.autograd.Function):
    """Identity in forward; in backward, fetch the units before their module's gradients run.
    In setup_context form, so that torch.func transforms over the inputs can apply it."""

    generate_vmap_rule = True

    @staticmethod
    def forward(hooks, units, *tensors):
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.hooks, ctx.units = inputs[0], inputs[1]
        ctx.transformed = _in_transform()  # a transform's vjp function may run after the transform returned

    @staticmethod
    def backward(ctx, *grads):
        if ctx.transformed:  # a transform's own backward, not a training one: no window, no prefetch
            with _outside_transforms():
                for unit in ctx.units:
                    ctx.hooks.rt.params.demand(unit)
        else:
            ctx.hooks.enter_backward()
            for unit in ctx.units:
                ctx.hooks.demand(unit)
        return (None, None, *grads)

    @staticmethod
    def jvp(ctx, hooks, units, *tangents):
        return tangents


class _ReleaseAfterBackward(torch.autograd.Function):
    """Identity in forward on a module's inputs; in backward, release the module's units (frozen
    ones: [Note: releasing frozen units after backward]; every one under a torch.func transform)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(params, units, tensor):
        return tensor.detach()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.params, ctx.units = inputs[0], inputs[1]

    @staticmethod
    def backward(ctx, grad):
        with _outside_transforms():
            for unit in ctx.units:
                ctx.params.release(unit)
        levels = [i.key() for i in retrieve_all_functorch_interpreters()] \
            if torch._C._are_functorch_transforms_active() else ()
        if TransformType.Grad in levels and TransformType.Jvp not in levels:  # (forward mode over it: hessian)
            grad = _NotDifferentiatedAgain.apply(ctx.units, grad)  # the gradient a reverse transform returns
        return None, None, grad

    @staticmethod
    def jvp(ctx, params, units, tangent):
        return tangent


class _NotDifferentiatedAgain(torch.autograd.Function):
    """[Note: torch.func over the inputs] Identity on an input gradient a transform computed through
    streamed units; a later backward through it (a gradient penalty: loss.backward() of a loss that
    uses it) would read their parameters, released after the transform's backward: refused, as the
    double backward of ModuleHooks.enter_backward is."""

    generate_vmap_rule = True

    @staticmethod
    def forward(units, tensor):
        return tensor.detach()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.units = inputs[0]

    @staticmethod
    def backward(ctx, grad):
        raise ZerotierError(
            f"a gradient torch.func computed over the inputs of module '{ctx.units[0].name or '<root>'}' (grad, vjp, "
            "jacrev) is differentiated again (a gradient penalty trained through loss.backward()), and that module's "
            "parameters are streamed (offload.params host/nvme, or ZeRO-3): the second backward would read "
            "parameters released after the first. Keep the parameters on the device: offload.params = \"device\" "
            "with zero.stage 1 or 2, where double backward trains as in torch")

    @staticmethod
    def jvp(ctx, units, tangent):
        return tangent


def autocast_dtype(device_type: str) -> "torch.dtype | None":
    """The dtype torch.autocast casts to on `device_type` now, or None when it is off."""
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def map_tensors(obj, fn):
    """`obj` with fn applied to every tensor in it (tuples, lists, dicts, dataclasses, nested)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type) and not isinstance(obj, dict):
        out = copy.copy(obj)
        for f in dataclasses.fields(obj):
            object.__setattr__(out, f.name, map_tensors(getattr(obj, f.name), fn))
        return out
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(map_tensors(o, fn) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(o, fn) for o in obj)
    if isinstance(obj, dict):
        out = copy.copy(obj)
        for k in obj:
            out[k] = map_tensors(obj[k], fn)
        return out
    return obj


class ModuleHooks:
    """The hooks of one engine's model; `handles` are every hook it registered (removed at close).
    `rt`: the engine's parts ([Note: the runtime record] in runtime.py); `window`: the loop the
    hooks enter; `scheduler`: the prefetch trace; `surface`: the parameter surface; `user_form`:
    the managed parameters as initialize found them (restore.py); `stop_before_window`: called when
    a training forward would begin a new window ([Note: graceful stop] in stop.py)."""

    def __init__(self, rt, window, scheduler, surface, user_form: dict, stop_before_window):
        self.rt, self.window, self.scheduler, self.surface = rt, window, scheduler, surface
        self.user_form = user_form
        self.stop_before_window = stop_before_window
        self.handles: list = []

    def register(self, streamed: list) -> None:
        """[Note: compiled units]
        torch.compile works on a zerotier model the way FSDP2's recipe uses it: compile each wrapped
        block (`block.compile()` or `torch.compile(block)`, before or after initialize). The module
        hooks below are `torch.compiler.disable`d, so dynamo never traces a fetch or a release (locks,
        storage resizes, worker threads): each is a graph break that runs eagerly, and the unit is
        resident before the compiled code reads it and released after. Inside a compiled region
        ManagedParameter's sorting is skipped (surface.py): the parameters are plain resident tensors
        there, and dynamo guards on nothing of zerotier's but the parameters' class (one per hook
        layout: [Note: compiled code and the hook layout] in param_surface.py), so the block code compiles
        once, not once per unit. A compiled region that reads another unit's parameters without that unit's module
        running (none of the usual models do) reads released storage: keep such reads in eager code.
        tests/test_compile.py pins all of this."""
        rt = self.rt
        by_module: dict[str, list] = {}
        for unit in streamed:
            for name in unit.modules:
                by_module.setdefault(name, []).append(unit)
        root = rt.module
        if rt.device.type == "cuda" or rt.lp_dtype != torch.float32:  # inputs follow the model, as FSDP does
            self.handles.append(root.register_forward_pre_hook(torch.compiler.disable(self._inputs_to_device),
                                                               with_kwargs=True))
        self.handles.append(root.register_forward_hook(torch.compiler.disable(self._root_returned)))
        for name, module in root.named_modules():
            units = by_module.get(name, [])
            if units or module is root:
                self.handles.append(module.register_forward_pre_hook(self._pre_forward(module is root, units)))
            if units:
                self.handles.append(module.register_forward_hook(self._post_forward(units)))
            frozen = [u for u in units if u.frozen]
            if frozen and module is not root:
                self.handles.append(module.register_forward_pre_hook(self._release_frozen_after_backward(frozen),
                                                                     with_kwargs=True))
        for unit in rt.units:
            for i, p in enumerate(unit.params):
                hook = self.window.grad_hook(unit, i, self.enter_backward)
                self.handles.append(p.register_post_accumulate_grad_hook(hook))

    def guard_root_methods(self) -> None:
        """[Note: the parameter surface] model.load_state_dict batches its writes per unit and
        refuses assign=True (it would swap managed parameters for new ones); model.to()/half()/
        cuda() that would convert a managed parameter are refused before anything changes.
        Instance attributes on the root, removed by remove()."""
        model, surface = self.rt.module, self.surface
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

    def remove(self) -> None:
        """Every hook and the guarded root methods gone: the model is plain torch again."""
        for h in self.handles:
            h.remove()
        self.handles = []
        for name in ("load_state_dict", "_apply"):  # guard_root_methods
            self.rt.module.__dict__.pop(name, None)

    def demand(self, unit) -> None:
        """Compute needs `unit` now: make it resident. Its own fetch (if not prefetched) is issued
        before the prefetches of the units after it, so on CUDA it is first on the copy stream."""
        params, scheduler = self.rt.params, self.scheduler
        if torch.is_grad_enabled() and self.rt.module.training or self.window.in_backward:
            params.demand(unit, then=lambda: scheduler.on_demand(unit.index))
        else:
            params.demand(unit)

    def enter_backward(self) -> None:
        """[Note: the plain PyTorch loop] in window.py: the first hook of a backward the engine did
        not start (a plain loss.backward(): the user's loop, accelerate, HF Trainer) begins it here
        and queues its end with autograd. Where a plain backward cannot be right, it raises at once."""
        if torch.is_grad_enabled():  # grad mode is on inside a backward only with create_graph=True
            raise ZerotierError(
                "a backward with create_graph=True (torch.autograd.grad(..., create_graph=True) for a gradient "
                "penalty or a Hessian-vector product, loss.backward(create_graph=True)) reached parameters zerotier "
                "streams (offload.params host/nvme, or ZeRO-3): the gradient's own backward would read parameters "
                "released after the first. Keep the parameters on the device: offload.params = \"device\" with "
                "zero.stage 1 or 2, where double backward trains as in torch")
        window = self.window
        if window.in_backward:
            return
        window.begin_plain_backward()
        torch.autograd.Variable._execution_engine.queue_callback(window.end_plain_backward)

    def _inputs_to_device(self, module, args, kwargs):
        """The root's inputs on the compute device, floating ones in param_dtype
        ([Note: buffers and inputs in low precision] in placement.py)."""
        device, lp_dtype = self.rt.device, self.rt.lp_dtype
        low = lp_dtype if lp_dtype != torch.float32 else None

        def move(t):
            t = t.to(device, non_blocking=True) if t.device != device else t
            return t.to(low) if low is not None and t.is_floating_point() and t.dtype != low else t
        return map_tensors(args, move), map_tensors(kwargs, move)

    def _pre_forward(self, is_root: bool, units: list):
        rt, window = self.rt, self.window

        def hook(module, args):
            transformed = _in_transform()
            if is_root:
                window.on_root_forward()  # a plain loss.backward() that died half-way ends here
            if is_root and torch.is_grad_enabled() and not window.in_backward:
                self._refuse_unmanaged_grads()
            if is_root and torch.is_grad_enabled() and module.training and not window.in_backward and not transformed:
                self.stop_before_window()  # a new window would begin: stop before it ([Note: graceful stop])
                self.scheduler.begin_pass()
            if self.surface.publish_first or window.overlap.early:  # a read: [Note: delayed update], [Note: early step]
                window.overlap.before_read()
            amp = autocast_dtype(rt.device.type) if units else None
            if amp not in (None, rt.lp_dtype):
                self._refuse_autocast(units[0], amp)
            if transformed and units:  # [Note: torch.func over the inputs]
                self._refuse_nested_reverse_transforms(units)
                with _outside_transforms():
                    for unit in units:
                        rt.params.demand(unit)
                if torch.is_grad_enabled():
                    return map_tensors(args, lambda t: _ReleaseAfterBackward.apply(rt.params, units, t)
                                       if t.requires_grad else t)
                return None
            for unit in units:
                self.demand(unit)
        return torch.compiler.disable(hook)  # [Note: compiled units]

    def _root_returned(self, module, args, output) -> None:
        if torch.is_grad_enabled():  # a graph for a backward (Window.refuse_before_backward)
            self.window.forward_returned()

    def _refuse_nested_reverse_transforms(self, units: list) -> None:
        """[Note: torch.func over the inputs] Reverse mode over reverse mode (jacrev(jacrev(f)), grad(grad(f)))
        differentiates the inner backward, which read parameters released after it."""
        levels = [i for i in retrieve_all_functorch_interpreters() if i.key() == TransformType.Grad]
        if len(levels) > 1:
            raise ZerotierError(
                f"module '{units[0].name or '<root>'}' runs under {len(levels)} nested reverse-mode torch.func "
                "transforms (grad/vjp/jacrev inside grad/vjp/jacrev) while its parameters are streamed from "
                f"{self.rt.params.loc.value}: the outer backward would read parameters released after the inner "
                "one. Use forward mode outside (torch.func.hessian, jacfwd(jacrev(f))), or keep the parameters on "
                "the device: offload.params = \"device\" with zero.stage 1 or 2")

    def _refuse_autocast(self, unit, amp: torch.dtype) -> None:
        """[Note: autocast and streamed parameters]: the casts would pin a copy of every
        streamed parameter on the device until backward, outside every budget."""
        lp, amp_name = str(self.rt.lp_dtype).replace("torch.", ""), str(amp).replace("torch.", "")
        raise ConfigError(
            f"module '{unit.name or '<root>'}' runs under torch.autocast({amp_name}) while its {lp} parameters "
            f"are streamed from {self.rt.params.loc.value}: autocast keeps a {amp_name} copy of every such "
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
        params = self.rt.params

        def hook(module, args, kwargs):
            if not torch.is_grad_enabled():
                return None

            def wrap(t):
                return _ReleaseAfterBackward.apply(params, frozen, t) if t.requires_grad else t
            return map_tensors(args, wrap), map_tensors(kwargs, wrap)
        return torch.compiler.disable(hook)  # [Note: compiled units]

    def _post_forward(self, units: list):
        params = self.rt.params

        def hook(module, args, output):
            if torch.is_grad_enabled():
                wrapped, seen = [], []

                def wrap(t):
                    seen.append(t)
                    if not t.requires_grad:
                        return t
                    wrapped.append(t)
                    return _FetchOnBackward.apply(self, units, t)[0]
                output = map_tensors(output, wrap)
                # frozen layers under frozen inputs; under a transform, outputs that need no gradient at its level
                no_backward = seen and (all(u.frozen for u in units) or _in_transform())
                if not wrapped and output is not None and not no_backward:
                    # Outputs zerotier cannot see into (a plain object, a generator): nothing would
                    # refetch the units before their backward, so they stay resident until their
                    # gradients are in (the grad hook releases them) or backward ends.
                    return output
            with _outside_transforms():
                for unit in units:
                    params.release(unit)
            return output
        return torch.compiler.disable(hook)  # [Note: compiled units]

    def _refuse_unmanaged_grads(self) -> None:
        """A parameter frozen (or absent) at initialize that now requires grad would get a .grad that
        no update ever applies: refuse at the forward, naming it."""
        module = self.rt.module
        for name, p in module.named_parameters():
            if not isinstance(p, torch.nn.Parameter) and p.requires_grad:
                raise ZerotierError(
                    f"parameter '{name}' is replaced by a plain tensor in this forward (torch.func.functional_call, or "
                    "a torch.func transform such as grad/jacrev over the model's parameters): zerotier cannot fetch, "
                    "train or release tensors it does not hold. Run torch.func on a model zerotier does not manage: "
                    "engine.close() first (the model then holds the trained weights), or load "
                    "engine.parameters_fp32() into a copy")
            trained = self.window.slot(p) is not None
            if not trained and p.requires_grad and id(p) not in self.user_form:
                raise ZerotierError(_added_after_initialize(module, name))
            if not trained and p.requires_grad:
                raise ZerotierError(
                    f"parameter '{name}' requires grad but zerotier does not train it: it was frozen (or not yet "
                    "registered) when zerotier.initialize ran. Set requires_grad before initialize, or call "
                    "engine.close() and zerotier.initialize(model, config) again")


def _added_after_initialize(model: torch.nn.Module, name: str) -> str:
    """The refusal of a trainable parameter that joined the model after initialize: a peft adapter
    (a module of peft's around it) gets the working order of peft and zerotier; any other module
    or parameter attached to engine.module gets what happened and how to attach it."""
    parts = name.split(".")
    adapter = any(type(model.get_submodule(".".join(parts[:k]))).__module__.startswith("peft.")
                  for k in range(len(parts)))
    if adapter:
        return (f"parameter '{name}' requires grad but was added to the model after zerotier.initialize (an "
                "adapter: peft.get_peft_model(engine.module, ...) after initialize or zerotier.from_pretrained), "
                "so zerotier would never train it. Add adapters first: model = peft.get_peft_model(model, "
                "lora_config), then engine = zerotier.initialize(model, config); the frozen base is then "
                "offloaded like any parameter (offload.params). From a Hugging Face directory: "
                "zerotier.from_pretrained(dir, config, peft_config=lora_config) streams the base under the "
                "adapters (or load it with transformers, apply peft, then initialize: the base is in RAM once)")
    return (f"parameter '{name}' requires grad but was attached to the model after zerotier.initialize (a module "
            "or parameter assigned to engine.module afterwards): zerotier holds no fp32 master and no optimizer "
            "state for it, so it would never be trained (as with a torch optimizer built before it was attached). "
            "Attach it before zerotier.initialize, or call engine.close() (the model then holds the trained "
            "weights), attach it and zerotier.initialize(model, config) again; to use it untrained, freeze it "
            "with requires_grad_(False)")
