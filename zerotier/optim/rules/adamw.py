"""AdamW (and Adam with L2 decay): the first update rule, torch.optim.AdamW's math and state.

The CPU variant is the native kernel (native/cpu/adam.cpp through optim/_kernels.py); the
device variant is the same kernel in torch ops (kernel_math.adam_update), or, for fp32 state with
bias correction, torch's fused Adam(W) kernel (`_fused_adam`), which is faster: one pass where the
torch ops take about twenty, within a few fp32 ulps of the native kernel (it divides by the bias
correction where the native kernel multiplies by its reciprocal)."""
from __future__ import annotations

from typing import NamedTuple

import torch

from .. import _kernels
from .. import kernel_math
from ..kernel_math import adam_update, sr_seed
from .base import UpdateRule


class Hyper(NamedTuple):
    """One parameter's Adam(W) hyper-parameters for one step: its param group's values."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool  # AdamW's decay of the weights (True) or Adam's L2 term in the gradient


class AdamW(UpdateRule):
    """torch.optim.AdamW (`decoupled`) or torch.optim.Adam (L2 weight decay in the gradient)."""

    name = "adamw"
    state_keys = ("master", "exp_avg", "exp_avg_sq")
    nonnegative = frozenset({"exp_avg_sq"})
    title, state_title = "Adam(W)", "Adam"  # in messages
    hyper_type = Hyper
    refused = ("amsgrad", "maximize")
    group_keys = "lr, betas (two numbers), eps, weight_decay and decoupled_weight_decay"

    def __init__(self, decoupled: bool = True):
        self.decoupled = decoupled

    def group_defaults(self, cfg, given) -> dict:
        return dict(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay,
                    amsgrad=False, maximize=False, foreach=None, capturable=False, differentiable=False,
                    fused=None, decoupled_weight_decay=self.decoupled)

    def cpu_pieces(self, pieces, *, master, grad, out, unit_index, shard_lo, grad_scale, bias_correction, simd,
                   threads) -> None:
        if not pieces:
            return
        bf16_master = master.dtype == torch.bfloat16
        buffers = [(master[a:b], m["exp_avg"][0], m["exp_avg_sq"][0], grad[a:b], None if out is None else out[a:b],
                    m["exp_avg"][1], m["exp_avg_sq"][1], sr_seed(unit_index, step) + shard_lo + a if bf16_master else None)
                   for a, b, step, _, m in pieces]
        hs = [p[3] for p in pieces]
        _kernels.adam_step_multi(buffers, step=[p[2] for p in pieces], lr=[h.lr for h in hs],
                                 beta1=[h.beta1 for h in hs], beta2=[h.beta2 for h in hs],
                                 eps=[h.eps for h in hs], weight_decay=[h.weight_decay for h in hs],
                                 decoupled=[h.decoupled for h in hs], simd=simd, threads=threads,
                                 bias_correction=bias_correction, grad_scale=grad_scale)

    def device_pieces(self, pieces, *, master, grad, out, unit_index, shard_lo, grad_scale, bias_correction,
                      keep_grad=True) -> None:
        bf16_master = master.dtype == torch.bfloat16
        for a, b, step, h, m in pieces:
            (m_values, m_absmax), (v_values, v_absmax) = m["exp_avg"], m["exp_avg_sq"]
            kwargs = dict(step=step, lr=h.lr, beta1=h.beta1, beta2=h.beta2, eps=h.eps, weight_decay=h.weight_decay,
                          decoupled=h.decoupled, bias_correction=bias_correction, grad_scale=grad_scale)
            piece_out = None if out is None else out[a:b]
            if bias_correction and master.device.type in FUSED_DEVICES and \
                    master.dtype == m_values.dtype == v_values.dtype == torch.float32:
                _fused_adam(master[a:b], m_values, v_values, grad[a:b], piece_out, keep_grad=keep_grad, **kwargs)
            else:
                adam_update(master[a:b], m_values, v_values, grad[a:b], param_out=piece_out, exp_avg_absmax=m_absmax,
                            exp_avg_sq_absmax=v_absmax,
                            sr_seed=sr_seed(unit_index, step) + shard_lo + a if bf16_master else None, **kwargs)

    def device_temp_bytes(self) -> int:
        return max(fused_temp_bytes(), kernel_math.TORCH_TEMP_BYTES_PER_ELEMENT * kernel_math.TORCH_CHUNK)


FUSED_DEVICES = ("cpu", "cuda")  # where torch has _fused_adamw_ (torch >= 2.4 on the CPU)


# [Note: the fused kernel reads the gradient in place]
# torch's fused Adam(W) kernel takes the gradient scale as a tensor it *divides* by, and
# writes the quotient back into the gradient. So zerotier passes 1 / grad_scale and the
# fp32 gradient shard is read in place, with no scaled copy on the device (GPU review N13;
# torch.optim.AdamW(fused=True) under a GradScaler does the same). found_inf stays None:
# the engine skips an overflowed step before calling the optimizer. The shard then holds
# grad x grad_scale, which is harmless where the step consumes it (the window's gradients
# are dropped after it); an early step's gradient is read again (the window's norm, p.grad),
# so there `keep_grad` makes a scaled copy instead. A copy (that one, or the fp32 cast of a
# low-precision gradient, which the kernel cannot read) is made CAST_CHUNK elements at a
# time: at most `fused_temp_bytes()` on the device, which the planner counts.
CAST_CHUNK = 1 << 22  # elements of a gradient cast or scaled at once: 16 MiB of fp32


def fused_temp_bytes() -> int:
    """Device bytes `_fused_adam` allocates at most (one fp32 chunk); the planner counts exactly this."""
    return 4 * CAST_CHUNK


def _fused_adam(master, exp_avg, exp_avg_sq, grad, out, *, step, lr, beta1, beta2, eps, weight_decay,
                decoupled, bias_correction, grad_scale, keep_grad=False) -> None:
    """Adam(W) with torch's fused kernel (what torch.optim.AdamW(fused=True) runs): one kernel
    over the shard, no host sync (the step count is filled on the device, not copied). An fp32
    `grad` is read in place and left scaled by `grad_scale`; see [Note: the fused kernel reads
    the gradient in place] for when a bounded copy is made instead."""
    step_t = torch.full((), float(step), dtype=torch.float32, device=master.device)
    fused = torch._fused_adamw_ if decoupled else torch._fused_adam_
    kwargs = dict(amsgrad=False, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
                  maximize=False, found_inf=None)
    if grad.dtype == torch.float32 and not (keep_grad and grad_scale != 1.0):
        divisor = None if grad_scale == 1.0 else torch.full((), 1.0 / grad_scale, dtype=torch.float32,
                                                             device=master.device)
        fused([master], [grad], [exp_avg], [exp_avg_sq], [], [step_t], grad_scale=divisor, **kwargs)
    else:
        for a in range(0, master.numel(), CAST_CHUNK):
            b = min(a + CAST_CHUNK, master.numel())
            chunk = grad[a:b].float() if grad.dtype != torch.float32 else grad[a:b].clone()
            if grad_scale != 1.0:
                chunk.mul_(grad_scale)
            fused([master[a:b]], [chunk], [exp_avg[a:b]], [exp_avg_sq[a:b]], [], [step_t], grad_scale=None,
                  **kwargs)
    if out is not None and out.data_ptr() != master.data_ptr():
        out.copy_(master)
