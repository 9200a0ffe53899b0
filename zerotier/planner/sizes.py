"""Bytes per kind of state and tier: what each placement holds, counted by the functions the
stores size their allocations with.

[Note: bytes per parameter]
Per rank, with N = world size, Psi = trainable parameters, L = bytes of the param dtype,
G = bytes per gradient element:

  kind        bytes            sharded over the N ranks from   (ZeRO paper, Rajbhandari et al.)
  params      L * Psi          stage 3                          "P_os+g+p"
  gradients   G * Psi          stage 2                          "P_os+g"
  optimizer  12 * Psi          stage 1 (fp32 master + m + v)    "P_os", K = 12

`model_state_bytes` is that table summed; in the paper a sharded kind holds ceil(Psi / N)
elements on the largest rank. The stores' terms count each unit's shard as the partition makes
it (`Sizes.held_shards`: padded to SHARD_ALIGN x N elements, whole where replicated). The optimizer's term counts each unit's state buffers as the store allocates
them (`Sizes.state_units`, [Note: the optimizer's bytes per unit] in optim/state_terms.py):
K per element on average, more where int8 blocks are padded, small parameters keep fp32
moments, or a shard is padded to its partition's alignment. G has two accountings:
  engine (default)  G = bytes of precision.grad_dtype: what the gradient store allocates for
                    its accumulators (fp32 by default: exact over micro-batches; bf16 halves it);
  paper             G = L: the ZeRO paper's fp16 gradients (2 + 2 + K bytes per parameter),
                    for comparing with published figures (`grad_bytes=` / `--accounting paper`).

Working sets come on top of the model state, on the tier that pays for them:
  params off the device, or sharded (stage 3): the lookahead + 2 largest units on the device
      (the gathered full units being computed and prefetched, the last one not yet released;
      at ZeRO-3 each padded to its partition's padded_numel, `Sizes.device_flats`)
      plus the units enclosing a fetched one (`state.nested_numel`: resident for their
      module's whole forward), at most the whole model; params on NVMe: host-pool
      blocks for the fetches and write-backs in flight, `ParamStore.host_staging_bytes`
  optimizer on NVMe: `optimizer.pipeline_depth` host staging sets, each key's block the
      largest NVMe unit's buffer of that key, `OptStateStore.staging_bytes`
  gradients on NVMe: the fresh gradients being filled and the read-modify-writes in flight,
      `GradStore.nvme_staging_bytes`, and the optimizer's two gradient read blocks
      (`StagedGrads.staging_bytes`, as for device gradients read by a host optimizer)
  gradients on host with a CUDA device: the per-parameter D2H staging blocks in flight,
      2 x the largest unit's gradient, `GradStore.offload_staging_bytes` (GPU review N6)
  ZeRO-1/2 with several ranks: every unit's updated low-precision shard, on the optimizer's
      side until the step's all-gathers finish, `ParamStore.writeback_bytes`
  transient device buffers (GPU review N13), allocated from the device tier: with several
      ranks the gradient reduce buckets (`GradBucketer.buffer_bytes`; gradients off the device
      add a unit cast there, `GradBucketer.conversion_bytes`, and the reduced shards landing in
      the host pool, `GradBucketer.staging_bytes`), at ZeRO-1/2 the commits' gather buckets,
      counted in the tier where the parameters live (`ParamGatherer.buffer_bytes`), at ZeRO-3
      with params off the device each fetch's shard staged for its gather
      (`ParamStore.gather_staging_bytes`), NVMe gradients cast to grad_dtype on a CUDA device
      at stages 2-3 (`GradStore.nvme_conversion_bytes`),
      and the optimizer on a CUDA device: the update rule's device temporaries
      (`device_temp_bytes`: the fused kernel's gradient chunk, the torch ops' chunk temporaries)
These are the functions the stores size their allocations with, so the plan cannot drift
from the code: each kind's term is its store's `plan_terms(home, sizes)` (ParamStore,
GradStore, OptStateStore), given the class of the home
its tier keeps it in (tiers/homes.py: `HOMES[tier]`), and `bytes_for` adds the host-pool
rounding and the NVMe rewrites. A new tier is a Home class; nothing here names a tier.


[Note: optimizer split]
The optimizer state (12 B/param, the largest kind) may be split between host and NVMe unit
by unit; parameters and gradients keep one tier each. Explicit: `offload.optimizer =
{host = 0.6, nvme = 0.4}`, fractions of this rank's optimizer elements; units are taken in
unit order and a unit goes to the tier whose share of the elements holds its midpoint (whole
units: the split is as close to the fractions as the unit sizes allow). `auto`: when the
whole state fits on no tier faster than NVMe, the first units go to host, as many as the
host budget holds with the NVMe units' staging sets, the rest to NVMe; chosen only when its
predicted step time is lower than the one-tier placement that fits (if any). The plan
records each unit's tier (`Plan.optimizer_units`) and counts each part as its tier does
(host: the state; NVMe: the files, their rewrites and the staging sets of the largest
NVMe unit), the gradient staging once. `placement["optimizer"]` is then NVMe (the
slowest tier in the split: the NVMe store is opened, updates land in host memory).

"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from ..config import ZeroConfig
from ..dist.buckets import GradBucketer, ParamGatherer
from ..dist.partition import Partition, stage_partitions
from ..errors import ConfigError
from ..grads import GradStore
from ..optim.grad_staging import StagedGrads
from ..optim.rules import AdamW, UpdateRule
from ..optim.state_layout import StateLayout
from ..optim.state_store import OptStateStore
from ..optim.state_terms import UnitBytes
from ..params import ParamStore
from ..state import Location
from ..tiers.homes import HOMES, Home

KINDS = ("params", "gradients", "optimizer")  # in auto-placement priority order
SHARDED_FROM_STAGE = {"params": 3, "gradients": 2, "optimizer": 1}


def check_sharding(stage: int, world_size: int) -> None:
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
    if world_size < 1:
        raise ConfigError(f"world size must be >= 1, got {world_size}")


def shard_numel(numel: int, kind: str, stage: int, world_size: int) -> int:
    """Elements of `kind` one rank holds: ceil(numel / N) where the stage shards it, else numel."""
    if stage >= SHARDED_FROM_STAGE[kind]:
        return -(-numel // world_size)
    return numel


def model_state_bytes(numel: int, stage: int, world_size: int, param_bytes: int = 2, grad_bytes: int = 2,
                      k: float = AdamW().bytes_per_param()) -> int:
    """Model-state bytes per rank for mixed-precision Adam under ZeRO `stage` over `world_size`.

    The ZeRO paper's formulas (defaults: 2 + 2 + K bytes per parameter, K = 12):
    stage 0 (2+2+K)Psi; 1: 2Psi + 2Psi + K Psi/N; 2: 2Psi + (2+K)Psi/N; 3: (2+2+K)Psi/N.
    See [Note: bytes per parameter].
    """
    check_sharding(stage, world_size)
    per_element = {"params": param_bytes, "gradients": grad_bytes, "optimizer": k}
    return round(sum(b * shard_numel(numel, kind, stage, world_size) for kind, b in per_element.items()))


def sharding_words(stage: int, world_size: int) -> str:
    """'ZeRO stage 3 over 4 ranks'; at one rank a stage shards nothing, and the words say so."""
    if world_size > 1:
        return f"ZeRO stage {stage} over {world_size} ranks"
    return f"ZeRO stage {stage} on one rank: nothing to shard"


def tier_holds(kind: str, loc: Location, cuda: bool, layout: StateLayout) -> bool:
    """Whether `auto` may put `kind` on `loc`: compact optimizer state (precision.master_dtype /
    moment_dtype other than fp32) is updated by the CPU kernel, never on a GPU (UnitOptimizer refuses it)."""
    return not (kind == "optimizer" and HOMES[loc].on_device and cuda and not layout.exact)


@dataclass(frozen=True)
class Sizes:
    """What `bytes_for` needs besides the kind and tier (see [Note: bytes per parameter])."""
    numels: tuple[int, ...]  # every unit's numel (full), largest first
    lp_bytes: int
    grad_bytes: int
    lookahead: int
    stage: int
    world_size: int
    pipeline_depth: int = 3
    engine_buffers: bool = True  # count the engine's transient buffers (False: the ZeRO paper's pure model state)
    grads_on_gpu: bool = False   # gradients placed on a CUDA device (a host optimizer stages them)
    cuda: bool = False           # the compute device is CUDA: host gradients arrive through D2H staging
    grads_on_nvme: bool = False  # gradients placed on NVMe (the optimizer stages them, on any tier)
    reduce_bucket: int = ZeroConfig().reduce_bucket_size     # zero.reduce_bucket_size
    gather_bucket: int = ZeroConfig().allgather_bucket_size  # zero.allgather_bucket_size
    persistence: int = ZeroConfig().persistence_threshold    # zero.persistence_threshold
    nested: int = 0              # elements of enclosing units resident around a fetch (state.nested_numel)
    alignment: int = 4096        # io.alignment: host-pool blocks are rounded up to it
    unit_order: tuple[int, ...] = ()  # every unit's numel in unit order ([Note: optimizer split])
    unit_params: tuple[tuple[int, ...], ...] = ()  # every unit's parameters' numels, in unit order (state_units)
    state: StateLayout = StateLayout()  # the optimizer state's keys and dtypes: state.bytes_per_param B/param
    rule: UpdateRule = AdamW()          # optimizer.type: its device variant's temporaries
    frozen: tuple[int, ...] = ()      # frozen units' numels: parameters only ([Note: frozen units] in state.py)

    def with_frozen(self) -> "Sizes":
        """The sizes the parameter store holds: trainable and frozen units together."""
        if not self.frozen:
            return self
        return dataclasses.replace(self, numels=tuple(sorted(self.numels + self.frozen, reverse=True)), frozen=())

    @property
    def numel(self) -> int:
        return sum(self.numels)

    @property
    def largest(self) -> int:
        return self.numels[0] if self.numels else 0

    def rank_numel(self, kind: str) -> int:
        return shard_numel(self.numel, kind, self.stage, self.world_size)

    def held_shards(self, kind: str) -> list[int]:
        """Every unit's elements of `kind` one rank's store allocates (numels order): `held_shard`."""
        return [self.held_shard(n, kind) for n in self.numels]

    def held_shard(self, numel: int, kind: str) -> int:
        """The elements of `kind` one rank's store allocates for a unit of `numel`: the partition's
        padded shard where the stage shards `kind` (`Partition.shard_numel`: SHARD_ALIGN x ranks
        padding, the whole unit where it is replicated), else the whole unit. ceil(numel / N)
        understates it by up to 32 x N - 1 elements per unit, and by all but 1/N of a replicated one.
        Without the engine's buffers (the ZeRO paper's accounting) the paper's ceil(numel / N)."""
        if not self.engine_buffers:
            return shard_numel(numel, kind, self.stage, self.world_size)
        if self.stage < SHARDED_FROM_STAGE[kind]:
            return numel
        return stage_partitions([numel], self.world_size, self.stage, self.persistence)[0].shard_numel

    def held_numel(self, kind: str) -> int:
        """This rank's elements of `kind` as its store allocates them (the paper's without engine buffers)."""
        return sum(self.held_shards(kind)) if self.engine_buffers else self.rank_numel(kind)

    def held_largest(self, kind: str) -> int:
        return max(self.held_shards(kind), default=0)

    def device_flats(self) -> list[int]:
        """Every unit's fetched full flat on the device, largest first, as ParamStore.place allocates
        it: padded to the partition's padded_numel where ZeRO-3 gathers it (the all-gather fills it
        in place), else the unit's numel (the paper's accounting: numel)."""
        if not self.engine_buffers or self.stage < 3:
            return list(self.numels)
        return sorted((p.padded_numel for p in self.partitions()), reverse=True)

    def shard_numels(self) -> list[int]:
        """Every unit's shard buffer of its partition (numels order): what a rank's store allocates
        for a sharded kind, or for the reduced gradient beside a full one."""
        return [p.shard_numel for p in self.partitions()]

    def partitions(self) -> list[Partition]:
        """Every unit's partition over the ranks, as Sharding.assign makes them (stage 0 replicates
        every unit, stage 3 those below zero.persistence_threshold)."""
        return stage_partitions(self.numels, self.world_size, self.stage, self.persistence)

    @functools.cached_property
    def state_units(self) -> tuple[UnitBytes, ...]:
        """Every unit's optimizer state buffers, bytes per key, in unit order: what the store
        allocates ([Note: the optimizer's bytes per unit] in optim/state_terms.py)."""
        numels = [sum(p) for p in self.unit_params]
        assert sorted(numels, reverse=True) == list(self.numels), "Sizes: unit_params must be the units of numels"
        parts = stage_partitions(numels, self.world_size, self.stage, self.persistence)
        return tuple(OptStateStore.key_bytes(self.state, p, part) for p, part in zip(self.unit_params, parts))


def bytes_for(kind: str, loc: Location, s: Sizes) -> dict[str, int]:
    """The bytes per tier `kind` takes placed on `loc`: its store's term (the store's own sizing
    functions, with the home class of `loc`), and with the engine's buffers each host-pool block
    rounded up to io.alignment and the NVMe files' rewrites."""
    home = HOMES[loc]
    if kind == "params":
        s = s.with_frozen()
    need = STORE_TERMS[kind](home, s)
    if s.engine_buffers:  # each host-pool block is rounded up to io.alignment: count the worst case
        need["host"] += _host_blocks(kind, home, s) * (s.alignment - 1)
        if not home.in_memory:
            need["nvme"] += _nvme_rewrites(kind, s)
    return need


def _nvme_rewrites(kind: str, s: Sizes) -> int:
    """NVMe bytes beyond the state itself: every swap file is rounded up to io.alignment, and a
    rewrite goes to a second file until it commits (NVMeStore.write), so the writes that may be in
    flight at once need their room too: the optimizer's `pipeline_depth` staging sets (a file per
    state key of the largest units' each, as the store sizes them: `Sizes.state_units`), the
    parameters' `lookahead + 2` write-backs (ParamStore.writes_in_flight)."""
    shards = sorted(s.held_shards(kind), reverse=True)
    if kind == "params":
        files, inflight = 1, ParamStore.writes_in_flight(s.lookahead)
        rewrite = s.lp_bytes * sum(shards[:inflight])
    elif kind == "gradients":  # [Note: gradients on NVMe]: the folds in flight, each a rewrite
        files, inflight = 1, GradStore.nvme_writes_in_flight()
        if s.world_size > 1 and s.stage == 1:  # the full sums and the reduced shards: a file each
            files, shards = 2, sorted(s.numels, reverse=True)
        rewrite = s.grad_bytes * sum(shards[:inflight])
    else:
        files, inflight = len(s.state.keys), s.pipeline_depth
        rewrite = sum(sorted((sum(unit) for unit in s.state_units), reverse=True)[:inflight])
    return rewrite + files * (len(shards) + min(inflight, len(shards))) * (s.alignment - 1)


def _host_blocks(kind: str, home: type[Home], s: Sizes) -> int:
    """How many host-pool blocks `kind` in homes of class `home` holds at most at once (for the rounding)."""
    units = len(s.numels)
    if kind == "params":
        return ParamStore.host_blocks(home.location, s.lookahead, units)
    if kind == "gradients":
        return GradStore.host_blocks(home.location, units, s.world_size, s.stage)
    return OptStateStore.host_blocks(home.location, units, s.pipeline_depth,
                                     grads_staged=s.grads_on_nvme or (s.grads_on_gpu and not home.on_device),
                                     writeback=s.world_size > 1 and s.stage in (1, 2) and not home.on_device,
                                     layout=s.state)


STORE_TERMS = {"params": ParamStore.plan_terms, "gradients": GradStore.plan_terms,
               "optimizer": OptStateStore.plan_terms}
"""Each kind's term: (home class, Sizes) -> bytes per tier, from the store that holds it."""


def held_shards_in_order(s: Sizes) -> list[int]:
    """Every unit's optimizer shard as this rank's store allocates it (`Sizes.held_shard`), in unit order."""
    return [s.held_shard(n, "optimizer") for n in s.unit_order]


def split_units(fractions: dict[str, float], s: Sizes) -> tuple[Location, ...]:
    """[Note: optimizer split] Each unit's tier for explicit fractions (fastest tier first, as
    config.py orders them): the tier whose share of this rank's held elements holds the unit's midpoint."""
    shards = held_shards_in_order(s)
    total, before, out = max(sum(shards), 1), 0, []
    for n in shards:
        mid, bound = (before + n / 2) / total, 0.0
        for tier, fraction in fractions.items():
            bound += fraction
            if mid < bound:
                break
        out.append(Location(tier))  # the last tier when rounding left `mid` just past the sum
        before += n
    return tuple(out)


def split_bytes(units_on: tuple[Location, ...], s: Sizes) -> dict[str, int]:
    """Bytes per tier of the optimizer split `units_on` ([Note: optimizer split]): each tier's
    units counted as that tier holds them, the gradient staging (shared) once."""
    need = {"device": 0, "host": 0, "nvme": 0}
    plain = dataclasses.replace(s, grads_on_gpu=False, grads_on_nvme=False)
    for loc in set(units_on):
        mine = [i for i, at in enumerate(units_on) if at is loc]
        part = dataclasses.replace(plain, numels=tuple(sorted((s.unit_order[i] for i in mine), reverse=True)),
                                   unit_order=tuple(s.unit_order[i] for i in mine),
                                   unit_params=tuple(s.unit_params[i] for i in mine))
        for t, b in bytes_for("optimizer", loc, part).items():
            need[t] += b
    if s.engine_buffers and (s.grads_on_nvme or s.grads_on_gpu):  # a split holds no unit on the device
        need["host"] += StagedGrads.staging_bytes(s.held_largest("optimizer"), s.grad_bytes)
        need["host"] += 2 * (s.alignment - 1)
    return need


def auto_split(s: Sizes, free: dict[str, int]) -> tuple[Location, ...] | None:
    """[Note: optimizer split] The first units on host, as many as fit, the rest on NVMe; None
    when no split with at least one unit on each fits."""
    count = len(s.unit_order)
    if free["nvme"] <= 0:
        return None
    for on_host in range(count - 1, 0, -1):
        units_on = (Location.HOST,) * on_host + (Location.NVME,) * (count - on_host)
        want = split_bytes(units_on, s)
        if all(want[t] <= free[t] for t in want):
            return units_on
    return None
