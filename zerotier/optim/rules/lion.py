"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), the second update
rule: one moment, so 8 B of fp32 state per parameter where AdamW keeps 12.

    c = b1*m + (1-b1)*g;   p = p*(1 - lr*wd) - lr*sign(c);   m = b2*m + (1-b2)*g

DeepSpeed ships it as a CPU optimizer beside Adam and Adagrad. The CPU variant is the native
kernel (_kernels.lion_step_multi, whose docstring names its C source; every state dtype of [Note: optimizer
state layout]); the device variant is the same math in torch ops (torch has no fused Lion
kernel). The state dict's layout is lion-pytorch's: `{"step", "exp_avg"}` per parameter.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .. import _kernels
from ..kernel_math import lion_step_reference, sr_seed
from .base import UpdateRule

# The paper's and lion-pytorch's defaults: a learning rate 3-10x below AdamW's, and betas whose
# beta2 sets the moment's memory. They replace AdamW's defaults where the config leaves a key at
# OptimizerConfig's default (docs/config.md, optimizer.type).
DEFAULTS = {"lr": 1e-4, "betas": (0.9, 0.99), "weight_decay": 0.0}


class LionHyper(NamedTuple):
    """One parameter's Lion hyper-parameters for one step: its param group's values."""

    lr: float
    beta1: float
    beta2: float
    weight_decay: float


class Lion(UpdateRule):
    name = "lion"
    state_keys = ("master", "exp_avg")
    nonnegative = frozenset()
    title = state_title = "Lion"  # in messages
    hyper_type = LionHyper
    group_keys = "lr, betas (two numbers) and weight_decay"

    def group_defaults(self, cfg, given) -> dict:
        values = {}
        for key, lion in DEFAULTS.items():
            value = getattr(cfg, key)
            field_default = type(cfg).__dataclass_fields__[key].default
            values[key] = lion if not given(f"optimizer.{key}") and value == field_default else value
        return dict(lr=values["lr"], betas=tuple(values["betas"]), weight_decay=values["weight_decay"],
                    maximize=False, foreach=None)

    def cpu_pieces(self, pieces, *, master, grad, out, unit_index, shard_lo, grad_scale, bias_correction, simd,
                   threads) -> None:
        if not pieces:
            return
        bf16_master = master.dtype == torch.bfloat16
        buffers = [(master[a:b], m["exp_avg"][0], grad[a:b], None if out is None else out[a:b], m["exp_avg"][1],
                    sr_seed(unit_index, step) + shard_lo + a if bf16_master else None)
                   for a, b, step, _, m in pieces]
        hs = [p[3] for p in pieces]
        _kernels.lion_step_multi(buffers, lr=[h.lr for h in hs], beta1=[h.beta1 for h in hs],
                                 beta2=[h.beta2 for h in hs], weight_decay=[h.weight_decay for h in hs],
                                 grad_scale=grad_scale, simd=simd, threads=threads)

    def apply_device(self, master, moments, grad, out, *, step, hyper, grad_scale, bias_correction,
                     keep_grad) -> None:
        """lion_step_reference's torch ops, DEVICE_CHUNK elements at a time (the gradient is read,
        never written): at most `device_temp_bytes()` of temporaries on the device."""
        h, exp_avg = hyper, moments["exp_avg"]
        for a in range(0, master.numel(), DEVICE_CHUNK):
            b = min(a + DEVICE_CHUNK, master.numel())
            lion_step_reference(master[a:b], exp_avg[a:b], grad[a:b], lr=h.lr, beta1=h.beta1, beta2=h.beta2,
                                weight_decay=h.weight_decay, grad_scale=grad_scale,
                                param_out=None if out is None else out[a:b])

    def device_temp_bytes(self) -> int:
        return DEVICE_TEMPS * 4 * DEVICE_CHUNK


DEVICE_CHUNK = 1 << 20  # elements the device variant updates at once
DEVICE_TEMPS = 8        # fp32 temporaries of one chunk alive at once at most (g, p, m, c, sign, products)
