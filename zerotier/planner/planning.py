"""`zerotier.plan(model, config, inputs=...)`: will it fit, and how long will a step take.

The same Plan as `zerotier plan --model MODULE:FACTORY --inputs MODULE:FACTORY` (both call
`plan_model`): the units of `model` as the engine builds them, each unit's forward and
backward measured on the device ([Note: measuring units] in unit_timing.py), and the
planner's schedule over this node's `zerotier bench` rates ([Note: step-time prediction]).

[Note: another node's rates]
`rates=` a bench file written on another node (`zerotier plan --rates FILE`) plans for that
machine: its memory, PCIe, NVMe and CPU Adam rates replace this node's, and each unit's
measured compute is scaled by (this node's matmul rate) / (that node's), from the
`compute` sections of the two bench results, in precision.param_dtype. The assumption: a
unit's time scales with the device's dense matmul rate, true where matmuls dominate
(transformer blocks at useful batch sizes); memory-bound parts (norms, attention at short
sequences, small batches) scale with memory bandwidth instead, so a faster-compute node is
predicted too fast there. Without a compute section on either side the times are not
scaled, and the plan's `rate_sources` says `compute_scale: default`.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from .activations import estimate
from ..config import Config
from ..errors import ConfigError
from .machine_fit import recorded_machine, this_machine
from .inputs import ModelFacts, Node, PlanConfig
from .planner import make_plan
from .predict import StepOptions
from .record import Plan
from ..state import DTYPES, build_units


def plan(model: torch.nn.Module, config=None, inputs=None, *, rates: str | os.PathLike | dict | None = None,
         device: torch.device | str | None = None, world_size: int = 1, ranks_per_node: int | None = None,
         repeat: int = 3, rollback_rate: float | None = None) -> Plan:
    """Where each kind of state goes, whether it fits, and the predicted step of `model` with
    `config`. inputs: one micro-batch's positional arguments (a tuple, or a callable returning
    it); without them forward/backward are left out of the prediction. rates: a `zerotier
    bench` file from another node ([Note: another node's rates]) or a dict of rate keys; None:
    this node's saved results, measured now (`zerotier bench --quick`) when none are saved.
    rollback_rate: the share of speculated steps rolled back the expected step assumes (default
    1%; [Note: speculation in the plan] in planner/speculation_plan.py; `zerotier profile` measures it)."""
    cfg = Config.coerce(config).auto_to_defaults()
    device = torch.device(device) if device is not None else \
        torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return plan_model(model, cfg, inputs, rates=rates, device=device, world_size=world_size,
                      ranks_per_node=ranks_per_node, repeat=repeat, rollback_rate=rollback_rate)


def plan_model(model, cfg: Config, inputs, *, rates, device: torch.device, world_size: int = 1,
               ranks_per_node: int | None = None, repeat: int = 3, grad_bytes: int | None = None,
               rollback_rate: float | None = None) -> Plan:
    units = build_units(model, cfg.train.wrap)
    dtype = DTYPES[cfg.precision.param_dtype]
    rate_dict, elsewhere = _rates(rates, cfg)
    compute = None
    if inputs is not None:
        from .unit_timing import measure

        compute = measure(model, inputs, device, dtype, cfg.train.wrap, repeat=repeat)
        if elsewhere:
            compute = compute.scaled(_compute_scale(rate_dict, cfg.precision.param_dtype, device))
    if elsewhere and "h2d" in rate_dict and device.type != "cuda":  # planning a GPU node from a CPU one
        if cfg.tiers.device == "auto":
            raise ConfigError("rates: that node has a GPU (its bench measured PCIe) and this one does not: set "
                              "tiers.device to the GPU memory per rank there")
        device = torch.device("cuda")
    activations = (compute.activation_bytes, "measured: what one micro-batch of the inputs saves for backward") \
        if compute is not None else estimate(model, dtype.itemsize)
    return make_plan(ModelFacts.of(units, compute=compute, activations=activations),
                     PlanConfig.of(cfg, StepOptions.of(cfg, rollback_rate), grad_bytes),
                     Node(device, rates=rate_dict, world_size=world_size, ranks_per_node=ranks_per_node,
                          machine=recorded_machine(rates, device.type) if elsewhere else this_machine(device)))


def _rates(rates, cfg: Config) -> tuple[dict[str, float] | None, bool]:
    """The rates to plan with (given, another node's file, or this node's, measured now if none are
    saved) and whether they are another node's."""
    from .. import bench

    if isinstance(rates, dict):
        return dict(rates), False
    if rates is not None:
        return bench.rates_from_file(rates), True
    if bench.load_rates() is None:
        path = cfg.tiers.nvme_path if cfg.tiers.nvme_path and Path(cfg.tiers.nvme_path).is_dir() else "."
        print("zerotier plan: no saved `zerotier bench` results on this node: measuring them now (quick)",
              file=sys.stderr)
        bench.save(bench.run(bench.SECTIONS, quick=True, path=path))
    return None, False  # make_plan reads this node's saved results and labels them measured


def _compute_scale(rates: dict[str, float], param_dtype: str, device: torch.device) -> float:
    """[Note: another node's rates] This node's matmul rate over the planned node's (1 here)."""
    from .. import bench, measure

    key = f"compute_{'fp32' if param_dtype == 'fp32' else 'bf16'}"
    there = rates.get(key)
    if not there:
        return 1.0
    here = (bench.load_rates() or {}).get(key)
    if not here:
        here = measure.bench_compute(quick=True, device=device)[f"{key.split('_')[1]}_flops"]
    return here / there
