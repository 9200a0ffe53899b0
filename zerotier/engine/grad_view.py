"""Gradients as torch shows them: `p.grad` of a parameter zerotier manages reads and writes the
accumulation window's gradient (the parameter surface routes `.grad` here, surface.py), so
p.grad, p.grad = None and p.grad.mul_() work as in torch between backward and step."""
from __future__ import annotations

import torch

from ..errors import ZerotierError
from ..state import GradState


def sparse_gradient(module, p: torch.Tensor) -> ZerotierError:
    """A sparse gradient (F.embedding(..., sparse=True) on a parameter of a dense module) reached
    `module`'s parameter `p` (the window's grad hook): the store sums dense flats and AdamW steps
    dense ones, as torch's AdamW refuses it."""
    name = next((n for n, q in module.named_parameters() if q is p), "?")
    return ZerotierError(
        f"parameter '{name}' got a sparse gradient (F.embedding(..., sparse=True) makes one), "
        "which zerotier's AdamW does not take (nor does torch.optim.AdamW: \"Adam does not support sparse "
        "gradients\"). Call it with sparse=False (the default; the training is the same, with a dense "
        "gradient), then engine.zero_grad() and go on: this backward's gradients were not applied")


def _refuse_access(window, what: str) -> None:
    if window.rt.sharding.active:
        raise ZerotierError(f"{what} of a parameter zerotier manages with several ranks: a parameter's "
                            "gradient is reduced into shards, no rank holds torch's .grad; use "
                            "engine.zero_grad() to drop the window and engine.grad_norm() for its norm")
    if window.in_backward:
        raise ZerotierError(f"{what} of a parameter zerotier manages during backward (a hook): the gradient "
                            "is final once backward has returned; read or change it between backward and step")


def grad_get(window, p) -> "torch.Tensor | None":
    """What `p.grad` shows the user: None when the parameter has no gradient in this window, else
    its gradient as it will be applied (before the loss scale's and the clipping's factors).
    Gradients on the device or host: a view of the accumulator, so p.grad.zero_() or .mul_()
    reach the window, as in torch; on NVMe (or once its unit was updated early): a copy."""
    e = window.rt
    slot = window.slot(p)
    if slot is None or window.closed:
        return None
    unit, k = slot
    if not e.grads.has(unit, k):
        return None
    _refuse_access(window, "reading p.grad")
    grad = e.grads.read_param(unit, k)
    if e.scaler.scale != 1.0:
        grad = grad / e.scaler.scale
    elif e.grads.state[unit.index] is GradState.STEPPED:
        grad = grad.clone()
    return grad


def grad_set(window, p, value) -> None:
    """User code assigned `p.grad = value`: None drops the parameter's gradient from this window
    (it is not stepped, as torch skips a .grad of None); a tensor replaces it."""
    e = window.rt
    slot = window.slot(p)
    if slot is None:
        raise ZerotierError("p.grad set on a parameter this engine does not manage")
    window.refuse_if_closed("setting p.grad")
    unit, k = slot
    if value is None and not e.grads.has(unit, k):
        return
    _refuse_access(window, "setting p.grad")
    window.overlap.cancel()  # [Note: speculative step]: the window's update is made again at step()
    window.refuse_if_started("setting p.grad")
    window.refuse_after_grad_norm("setting p.grad")
    if value is not None:
        if not isinstance(value, torch.Tensor) or value.shape != p.shape:
            raise RuntimeError(f"assigned grad has data of a different size ({tuple(getattr(value, 'shape', ()))}"
                               f" vs {tuple(p.shape)})")
        value = value.detach() * e.scaler.scale if e.scaler.scale != 1.0 else value.detach()
    e.grads.set_param(unit, k, value)
    if value is not None:
        window.gradient_assigned()
