"""The engine's parts as its collaborators receive them.

[Note: the runtime record]
`Runtime` is what one engine is made of: the stores, the tiers, the sharding, the scaler, the
profiler, the model and its units, and the config. initialize builds it once, right after the
stores, and hands it to each collaborator (the window and its overlap policy, the hooks, the
parameter surface, the user's weights, engine.optimizer, checkpoints, export) instead of the
`Engine`: a collaborator reads the parts it was given and never the façade, so a call walk
follows a gradient from one part to the next, and a new collaborator's constructor says what it
touches. The record is frozen (its fields never change; the parts they hold do). The config is
read through `settings`, a `Settings` cell: ZerotierTrainer reconciles a live engine's train keys
by assigning engine.cfg ([Note: TrainingArguments and the zerotier config]), whose setter puts
the new Config in that one cell, so what reads `rt.settings.cfg` at run time (the window's
accumulation and clipping keys) sees it at the next call. The step counts live in `steps`
(steps.py), written by the window and restored by a checkpoint load.
"""
from __future__ import annotations

import dataclasses

import torch

from .steps import StepCounter


class Settings:
    """The engine's live Config, one cell: engine.cfg reads and assigns `cfg` ([Note: the runtime record])."""

    __slots__ = ("cfg",)

    def __init__(self, cfg):
        self.cfg = cfg


@dataclasses.dataclass(frozen=True, eq=False)
class Runtime:
    module: torch.nn.Module
    device: torch.device
    lp_dtype: torch.dtype        # precision.param_dtype: the compute copies
    plan: object                 # planner.Plan: the placement and budgets it was built with
    sharding: object             # dist.sharding.Sharding (rank, world, collectives)
    scaler: object               # scaler.LossScaler
    profiler: object             # profiler.Profiler, or None when profiling is off
    param_units: list            # every unit: the stepped ones, then the frozen ones ([Note: frozen units])
    units: list                  # the stepped units (param_units' head)
    frozen_units: list           # the frozen units (param_units' tail)
    params: object               # params.ParamStore
    grads: object                # grads.GradStore
    unit_optimizer: object       # optim.offload.UnitOptimizer: fp32 masters and the update rule's state
    device_tier: object          # tiers.device.DeviceTier
    host_pool: object            # tiers.host.HostPool
    store: object                # tiers.nvme.NVMeStore, or None when no placement uses NVMe
    settings: Settings           # the live config: settings.cfg
    steps: StepCounter = dataclasses.field(default_factory=StepCounter)
