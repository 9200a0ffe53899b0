"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), the second update
rule: one moment, so 8 B of fp32 state per parameter where AdamW keeps 12.

    c = b1*m + (1-b1)*g;   p = p*(1 - lr*wd) - lr*sign(c);   m = b2*m + (1-b2)*g

DeepSpeed ships it as a CPU optimizer beside Adam and Adagrad. The CPU variant is the native
kernel (_kernels.lion_step_multi, whose docstring names its C source; every state dtype of [Note: optimizer
state layout]); the device variant is the same kernel in torch ops (kernel_math.lion_update; torch has
no fused Lion kernel), bitwise equal to it. The state dict's layout is lion-pytorch's: `{"step", "exp_avg"}` per parameter.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .. import _kernels
from .. import kernel_math
from ..kernel_math import lion_update, sr_seed
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

    def device_pieces(self, pieces, *, master, grad, out, unit_index, shard_lo, grad_scale, bias_correction,
                      keep_grad=True) -> None:
        bf16_master = master.dtype == torch.bfloat16
        for a, b, step, h, m in pieces:
            values, absmax = m["exp_avg"]
            lion_update(master[a:b], values, grad[a:b], lr=h.lr, beta1=h.beta1, beta2=h.beta2,
                        weight_decay=h.weight_decay, grad_scale=grad_scale, param_out=None if out is None else out[a:b],
                        exp_avg_absmax=absmax, sr_seed=sr_seed(unit_index, step) + shard_lo + a if bf16_master else None)

    def device_temp_bytes(self) -> int:
        return kernel_math.TORCH_TEMP_BYTES_PER_ELEMENT * kernel_math.TORCH_CHUNK
