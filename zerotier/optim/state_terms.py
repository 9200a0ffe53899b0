"""The optimizer state store's sizing: what its state and working sets take on each tier, run before
the store exists. The store sizes its allocations with these functions, and the planner's optimizer
term is `plan_terms` ([Note: bytes per parameter] in planner/sizes.py), so the plan cannot drift
from the code.

[Note: the optimizer's bytes per unit]
The store allocates one buffer per state key per unit, `layout.for_unit(unit).nbytes(key,
shard_numel)` ([Note: optimizer state layout] in state_layout.py): int8 codes padded to whole
QUANT_BLOCK runs and 4 bytes, fp32 block scales, fp32 moments for the parameters below
FP32_MOMENT_NUMEL elements ([Note: small parameters keep fp32 moments]), on a shard padded to the
partition's alignment. An average bytes-per-parameter times the elements understates that (a
small model with int8 moments held 204,800 B where 149,085 B were planned), so the plan counts
each unit's buffers as the store sizes them: `key_bytes` builds the unit's layout with
`StateLayout.for_params` from its parameters' element counts and each rank's range of its
partition, and keeps each key's largest over the ranks (every rank plans with the same figures).
"""
from __future__ import annotations

import functools
import itertools
from typing import Iterable

from ..dist.partition import Partition
from ..params_terms import ParamSizing
from ..state import Location
from ..tiers.homes import HOMES, Home
from .grad_staging import StagedGrads
from .state_layout import StateLayout

UnitBytes = tuple[int, ...]  # one unit's buffer bytes per state key, in the layout's key order


class OptStateSizing:
    """OptStateStore's static sizing half (OptStateStore is one)."""

    @staticmethod
    @functools.lru_cache(maxsize=4096)  # a model's repeated blocks share one entry
    def key_bytes(layout: StateLayout, param_numels: tuple[int, ...], part: Partition) -> UnitBytes:
        """[Note: the optimizer's bytes per unit] The bytes of each of a unit's state buffers as
        place() allocates them, on the rank whose buffer is the largest: the unit's parameters hold
        `param_numels` elements, in its flat's order; `part` is its partition over the ranks."""
        offsets = tuple(itertools.accumulate(param_numels, initial=0))[:-1]
        ranges = [part.shard_range(r) for r in range(1 if part.replicated else part.world_size)]
        layouts = [layout.for_params(param_numels, offsets, lo, hi) for lo, hi in ranges]
        return tuple(max(lay.nbytes(k, part.shard_numel) for lay in layouts) for k in layout.keys)

    @staticmethod
    def staging_set(units: Iterable[UnitBytes]) -> UnitBytes:
        """The state buffers of one staging set, per key the largest of the staged units' buffers
        (`units`: their key_bytes): the NVMe pipeline's host-pool blocks ([Note: NVMe optimizer
        pipeline] in state_store.py) and the device step's device buffers ([Note: device staging] in
        device_staging.py)."""
        return tuple(max(column) for column in zip(*units))

    @staticmethod
    def staging_bytes(depth: int, units: Iterable[UnitBytes]) -> int:
        """Host-pool bytes of the NVMe pipeline's `depth` staging sets (the planner counts exactly this)."""
        return depth * sum(OptStateSizing.staging_set(units))

    @staticmethod
    def host_blocks(loc: Location, units: int, depth: int, grads_staged: bool, writeback: bool,
                    layout: StateLayout = StateLayout()) -> int:
        """Host-pool blocks the optimizer holds at most at once (the planner rounds each up to
        io.alignment): a block per state key per unit on host (place), a set of them per pipeline
        slot on NVMe (StagingSets), two gradient shards staged (grad_staging.StagedGrads) and, at
        ZeRO-1/2 over several ranks, each unit's updated shard until the gather (ParamStore.writeback_bytes)."""
        keys, home = len(layout.keys), HOMES[loc]
        blocks = keys * (home.blocks_at_rest * units + home.blocks_per_move * depth)
        return blocks + 2 * grads_staged + units * writeback

    @staticmethod
    def plan_terms(home: type[Home], s) -> dict[str, int]:
        """The optimizer state's bytes per tier in homes of class `home` ([Note: bytes per parameter]
        in planner/sizes.py; `s`: the planner's Sizes): every unit's state buffers ([Note: the
        optimizer's bytes per unit]), the update rule's device temporaries on a CUDA device, the NVMe
        pipeline's staging sets, the gradient read blocks, and at ZeRO-1/2 the updated low-precision
        shards waiting for the all-gather on the optimizer's side. Without the engine's buffers (the
        ZeRO paper's accounting) the state is the paper's K bytes per element of the rank's share."""
        units = s.state_units
        if s.engine_buffers:
            need = home.plan_bytes(sum(map(sum, units)), 1)
        else:
            need = home.plan_bytes(s.rank_numel("optimizer"), s.state.bytes_per_param)
        if home.on_device and s.cuda and s.engine_buffers:
            need["device"] += s.rule.device_temp_bytes()
        if not home.in_memory and units:
            need["host"] += OptStateSizing.staging_bytes(s.pipeline_depth, units)
        if s.engine_buffers and (s.grads_on_nvme or s.grads_on_gpu and not home.on_device):
            need["host"] += StagedGrads.staging_bytes(s.held_largest("optimizer"), s.grad_bytes)
        if s.engine_buffers and s.world_size > 1 and s.stage in (1, 2):
            # the updated low-precision shards wait on the optimizer's side for the all-gather
            need["device" if home.on_device else "host"] += ParamSizing.writeback_bytes(
                s.held_numel("optimizer"), s.lp_bytes)
        return need
