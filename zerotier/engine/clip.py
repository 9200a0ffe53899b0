"""torch.nn.utils clipping on parameters zerotier manages.

[Note: the user's clipping]
`torch.nn.utils.clip_grad_norm_(model.parameters(), c)` — directly, through accelerate's
`Accelerator.clip_grad_norm_` or HF Trainer's `max_grad_norm` — must see the gradients the
next update applies, which live in the engine's accumulators (host, device or NVMe), not
in `p.grad` storage torch could scale in place. So zerotier.initialize wraps the function
once, process-wide (torch.nn.utils and torch.nn.utils.clip_grad): when the parameters
include ones a live engine manages it

  - takes the norm of those from `engine.grad_norm()` (the global norm, every rank
    agreeing) and of the others from their `.grad`, combined as torch combines them;
  - scales the others' `.grad` in place, as torch does, and records the factor
    min(1, max_norm / (norm + 1e-6)) in the engine, whose update multiplies the
    window's gradient by it (after it, train.max_grad_norm clips what is left);
  - returns the total norm as a 0-d tensor, as torch does.

norm_type 2 only (the engine keeps sums of squares); other norm types are refused, as is
`clip_grad_value_` on managed parameters (an element-wise clamp of gradients that may sit
on NVMe; train.max_grad_norm is the supported form). Parameters no engine manages go to
torch's own functions untouched. Where the update already started (train.overlap = "early",
[Note: early step] in overlap/early.py) the clip is refused: it could not be honoured.
"""
from __future__ import annotations

import functools
import math
import weakref

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad

from ..errors import ZerotierError

_engines: "weakref.WeakSet" = weakref.WeakSet()  # live engines (closed ones are skipped)
_installed = False


def install(engine) -> None:
    """Route torch.nn.utils clipping of `engine`'s parameters to it (the wrap happens once)."""
    global _installed
    _engines.add(engine)
    if _installed:
        return
    _installed = True
    norm, value = torch.nn.utils.clip_grad.clip_grad_norm_, torch.nn.utils.clip_grad.clip_grad_value_
    wrapped_norm, wrapped_value = _wrap_norm(norm), _wrap_value(value)
    for module in (torch.nn.utils, torch.nn.utils.clip_grad):
        module.clip_grad_norm_, module.clip_grad_value_ = wrapped_norm, wrapped_value


def _split(parameters) -> tuple:
    """(the engine managing some of `parameters` or None, its parameters, the others)."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    owners = {}
    for engine in list(_engines):
        if not engine.closed:
            owners.update({id(p): engine for p in params if engine.window.slot(p) is not None})
    engines = {id(e): e for e in owners.values()}
    if len(engines) > 1:
        raise ZerotierError("clip_grad_norm_ over the parameters of several zerotier engines at once: clip each "
                            "engine's model separately")
    engine = next(iter(engines.values()), None)
    return engine, params, [p for p in params if id(p) not in owners]


def _wrap_norm(clip_grad_norm_):
    @functools.wraps(clip_grad_norm_)
    def clip_grad_norm(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        engine, params, others = _split(parameters)
        if engine is None:
            return clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)
        if float(norm_type) != 2.0:
            raise ZerotierError(f"clip_grad_norm_(norm_type={norm_type}) on parameters zerotier manages: only "
                                "norm_type=2 is supported (or set train.max_grad_norm)")
        return _clip_window(engine.window, float(max_norm), [p for p in others if p.grad is not None],
                            error_if_nonfinite)
    return clip_grad_norm


def _clip_window(window, max_norm: float, others: list, error_if_nonfinite: bool) -> torch.Tensor:
    """clip_grad_norm_ over an engine's parameters (and `others`, unmanaged ones with a gradient):
    the factor is recorded in the window (window.py), whose update applies it."""
    window.refuse_if_closed("clip_grad_norm_")
    window.refuse_if_started("clip_grad_norm_")
    if not window.has_grads() and not others:
        return torch.tensor(0.0)  # torch: no gradients, norm 0
    managed = window.grad_norm() * window.user_clip if window.has_grads() else 0.0
    total, factor = total_and_factor(managed, [p.grad for p in others], max_norm)
    if error_if_nonfinite and not math.isfinite(total):
        raise RuntimeError(f"The total norm of order 2.0 for gradients from `parameters` is non-finite, so it "
                           "cannot be clipped. To disable this error and scale the gradients by the "
                           "non-finite norm anyway, set `error_if_nonfinite=False`")
    window.user_clip *= factor
    with torch.no_grad():
        for p in others:
            p.grad.mul_(factor)
    return torch.tensor(total, dtype=torch.float32)


def _wrap_value(clip_grad_value_):
    @functools.wraps(clip_grad_value_)
    def clip_grad_value(parameters, clip_value, foreach=None):
        engine, params, _ = _split(parameters)
        if engine is not None:
            raise ZerotierError("clip_grad_value_ on parameters zerotier manages is not supported (their gradients "
                                "may live on the host or NVMe): clip by the global norm instead, with "
                                "train.max_grad_norm or torch.nn.utils.clip_grad_norm_")
        return clip_grad_value_(params, clip_value, foreach)
    return clip_grad_value


def total_and_factor(managed_norm: float, other_grads: list, max_norm: float) -> tuple[float, float]:
    """torch's arithmetic: the 2-norm over both groups and the clip factor it gives."""
    other = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.detach().float())
                                                        for g in other_grads]))) if other_grads else 0.0
    total = math.sqrt(managed_norm ** 2 + other ** 2)
    return total, min(1.0, max_norm / (total + 1e-6))
