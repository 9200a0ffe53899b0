"""make_plan's inputs, one record per place they come from.

[Note: the plan's inputs]
  ModelFacts  the model: its units as build_units makes them (each trainable unit's parameters'
              element counts, the frozen units' sizes, their names, the enclosing units' elements)
              and what a micro-batch holds beside the state (measured compute, activations, the
              materialization's pool bytes). `ModelFacts.of(units)`; `of_sizes(numels)` for a
              model known by its unit sizes alone (`zerotier plan --params`).
  PlanConfig  the config sections the plan reads: tiers, offload, precision, prefetch, zero,
              optimizer.pipeline_depth, io.alignment, the step's options (StepOptions) and the
              accounting (`grad_bytes`: the ZeRO paper's, None for the engine's). `PlanConfig.of(cfg)`.
  Node        the node planned for: its compute device, the per-rank budgets (None: resolved from
              tiers), the rates (None: this node's saved `zerotier bench`), its ranks and memory.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..config import OffloadConfig, PrecisionConfig, PrefetchConfig, TiersConfig, ZeroConfig
from ..state import Unit, nested_numel
from .machine_fit import Machine
from .predict import StepOptions, UnitCompute


@dataclass(frozen=True)
class ModelFacts:
    """[Note: the plan's inputs] What the plan knows of the model."""

    units: tuple[tuple[int, ...], ...]  # each trainable unit's parameters' numels, its flat's order, in unit order
    frozen: tuple[int, ...] = ()        # each frozen unit's numel ([Note: frozen units] in state.py)
    names: tuple[str, ...] = ()         # each unit's module name: the trainable units', then the frozen ones'
    nested: int = 0                     # elements of enclosing units resident around a fetch (state.nested_numel)
    compute: UnitCompute | None = None  # each unit's measured forward/backward (zerotier.plan); None: left out
    activations: tuple[int, str] | None = None  # a micro-batch's activation bytes and their source; None: left out
    materialize_bytes: int = 0          # host-pool bytes a meta model's materialization holds (materialize.pool_bytes)

    @classmethod
    def of(cls, units: Sequence[Unit], **extra) -> "ModelFacts":
        """The facts of build_units' units (trainable and frozen); `extra`: compute, activations,
        materialize_bytes."""
        trainable, frozen = [u for u in units if not u.frozen], [u for u in units if u.frozen]
        return cls(tuple(tuple(s.numel() for s in u.shapes) for u in trainable), tuple(u.numel for u in frozen),
                   tuple(u.name for u in trainable + frozen), nested_numel(list(units)), **extra)

    @classmethod
    def of_sizes(cls, numels: Sequence[int], frozen: Sequence[int] = (), **extra) -> "ModelFacts":
        """A model known by its units' sizes alone: each unit one parameter."""
        return cls(tuple((n,) for n in numels), tuple(frozen), **extra)

    @property
    def numels(self) -> list[int]:
        """Each trainable unit's numel, in unit order."""
        return [sum(params) for params in self.units]


@dataclass(frozen=True)
class PlanConfig:
    """[Note: the plan's inputs] The config sections the plan reads."""

    tiers: TiersConfig = TiersConfig()
    offload: OffloadConfig = OffloadConfig()
    precision: PrecisionConfig = PrecisionConfig()
    prefetch: PrefetchConfig = PrefetchConfig()
    zero: ZeroConfig = ZeroConfig()  # the stage and the collectives' bucket sizes
    pipeline_depth: int = 3          # optimizer.pipeline_depth
    alignment: int = 4096            # io.alignment: host-pool blocks and swap files are rounded up to it
    step: StepOptions = StepOptions()  # accumulation, clipping, overlap, the update rule
    grad_bytes: int | None = None    # the ZeRO paper's accounting: bytes per gradient; None: the engine's buffers

    @classmethod
    def of(cls, cfg, step: StepOptions | None = None, grad_bytes: int | None = None) -> "PlanConfig":
        """The plan's sections of a Config (its "auto" trainer keys already filled); `step`: its
        StepOptions.of(cfg) unless given."""
        return cls(cfg.tiers, cfg.offload, cfg.precision, cfg.prefetch, cfg.zero, cfg.optimizer.pipeline_depth,
                   cfg.io.alignment, StepOptions.of(cfg) if step is None else step, grad_bytes)


@dataclass(frozen=True)
class Node:
    """[Note: the plan's inputs] The node planned for."""

    device: torch.device = torch.device("cpu")  # the compute device
    budgets: dict[str, int] | None = None   # per-rank bytes per tier; None: resolved from tiers (resolve_budgets)
    rates: dict[str, float] | None = None   # None: this node's `zerotier bench` results where saved, else defaults
    world_size: int = 1
    ranks_per_node: int | None = None       # None: world_size
    machine: Machine | None = None          # the memory the plan's need is checked against; None: not checked
