"""Budgets + model -> placement: does the run fit, where does each kind of state go,
and roughly how long will a step take.

[Note: bytes per parameter]
Per rank, with N = world size, Psi = trainable parameters, L = bytes of the param dtype,
G = bytes per gradient element:

  kind        bytes            sharded over the N ranks from   (ZeRO paper, Rajbhandari et al.)
  params      L * Psi          stage 3                          "P_os+g+p"
  gradients   G * Psi          stage 2                          "P_os+g"
  optimizer  12 * Psi          stage 1 (fp32 master + m + v)    "P_os", K = 12

`model_state_bytes` is that table summed; a sharded kind holds ceil(Psi / N) elements on
the largest rank. G has two accountings:
  engine (default)  G = bytes of precision.grad_dtype: what the gradient store allocates for
                    its accumulators (fp32 by default: exact over micro-batches; bf16 halves it);
  paper             G = L: the ZeRO paper's fp16 gradients (2 + 2 + K bytes per parameter),
                    for comparing with published figures (`grad_bytes=` / `--accounting paper`).

Working sets come on top of the model state, on the tier that pays for them:
  params off the device, or sharded (stage 3): the lookahead + 2 largest units on the device
      (the gathered full units being computed and prefetched, the last one not yet released)
      plus the units enclosing a fetched one (`state.nested_numel`: resident for their
      module's whole forward), at most the whole model; params on NVMe: host-pool
      blocks for the fetches and write-backs in flight, `ParamStore.host_staging_bytes`
  optimizer on NVMe: `optimizer.pipeline_depth` host staging sets of 12 x largest unit
      shard, `UnitOptimizer.staging_bytes`
  gradients on NVMe: the fresh gradients being filled and the read-modify-writes in flight,
      `GradStore.nvme_staging_bytes`, and the optimizer's two gradient read blocks
      (`UnitOptimizer.grad_staging_bytes`, as for device gradients read by a host optimizer)
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
      and the optimizer on a CUDA device: the fused kernel's gradient chunk (`fused_temp_bytes`)
These are the functions the stores size their allocations with, so the plan cannot drift
from the code.

`auto` fills the fastest tier first, by access frequency: parameters (read in
forward and backward) before gradients (written in backward) before optimizer
state (touched once per step). A plan that does not fit raises PlanDoesNotFit (a
BudgetError) at initialize(), naming what does not fit and how much more of which
tier helps, then the whole shortfall and its cheapest fixes ([Note: the whole shortfall]
in planner/report.py).

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

[Note: speculation in the plan]
train.speculative_step ([Note: speculative step] in overlap/speculative.py) resolved per placement:
`auto` is on with clipping (train.max_grad_norm) or a dynamic loss scale, when the NVMe
budget left by the rest of the plan holds the NVMe units' shadow state files
(`overlap.speculative.shadow_bytes`, every NVMe unit: the pre-step files stay until the step is
validated) and at least one unit's hold fits; otherwise off, and `Plan.speculation_note`
says why (`true` raises PlanDoesNotFit instead). What a speculated unit holds until the check
(UndoLog.speculate): a host (device) unit its undo copy (`overlap.speculative.undo_bytes`:
state and low-precision shard) on that tier, an NVMe unit its new low-precision shard on host.
Each tier gets an allowance, min(all its units' holds, the tier budget minus the rest of
the plan's need), counted in `need` (`Plan.speculation_undo_bytes`); the engine speculates a
unit, in the order gradients become final, when its hold fits in what is left of the
allowance, and the prediction follows it (`Plan.speculation_units`). The step is predicted twice, validated (commit) and
rolled back ([Note: speculation in the schedule]); `Plan.predicted_step_s` and the
breakdown are (1 - r) x commit + r x rollback at the rollback rate r (`rollback_rate`,
default 1%: `zerotier.plan(..., rollback_rate=)`, `zerotier plan --rollback-rate`; the
profiler measures it), `Plan.speculation_step_s` has both cases, the expected step and the
step without speculation.

The step time: [Note: step-time prediction] in predict.py, the schedule it lays out in
planner/step_model.py. `auto` placement: among the placements (and the optimizer split) that
fit, the one with the lowest predicted step; ties keep the fastest-tier-first order above
(`Plan.alternatives` lists every candidate considered).
"""
from __future__ import annotations

import dataclasses
import itertools

import shutil
from pathlib import Path
from dataclasses import dataclass, field

import torch

from ..config import OffloadConfig, PrecisionConfig, PrefetchConfig, TiersConfig, ZeroConfig
from ..device import local_world_size
from ..envinfo import usable_memory
from ..errors import BudgetError, ConfigError
from ..dist.buckets import GradBucketer, ParamGatherer
from ..dist.partition import Partition, partition_units
from ..grads import GradStore
from .machine_fit import Machine, shortfall
from .report import whole_shortfall
from ..io.memory import round_up
from ..optim.offload import UnitOptimizer, fused_temp_bytes
from ..optim.state_layout import OPTIMIZER_BYTES, StateLayout
from ..overlap.speculative import shadow_bytes, undo_bytes
from ..params import ParamStore
from .predict import COMPONENTS, DEFAULT_RATES, StepOptions, UnitCompute, bound_by, predict
from .step_model import Schedule
from ..state import DTYPES, TIER_NAMES as TIERS, Location
from ..tiers.host import RSS_OUTSIDE_BUDGETS
from ..units import format_duration, format_size

KINDS = ("params", "gradients", "optimizer")  # in auto-placement priority order
SHARDED_FROM_STAGE = {"params": 3, "gradients": 2, "optimizer": 1}
_SHARD_ALIGN = 32  # elements: the alignment Sharding.assign partitions units with


class PlanDoesNotFit(BudgetError):
    """A BudgetError with the shortfall as data (for `zerotier plan --json`).

    kind: the first kind of state that fits nowhere; options: one dict per tier it could
    go to, {"tier": where, "more": {tier: bytes short}}; placement: the kinds placed
    before it; per_rank_bytes: model-state bytes per rank (placement-independent).
    """

    def __init__(self, message: str, kind: str, options: list[dict], placement: dict[str, Location],
                 per_rank_bytes: int):
        super().__init__(message)
        self.kind, self.options, self.placement, self.per_rank_bytes = kind, options, placement, per_rank_bytes
        self.explain = None  # () -> the whole shortfall's text and table ([Note: the whole shortfall] in planner/report.py)
        self.whole: dict | None = None  # that table: the cheapest placement, needed / budget / missing per tier

    def explained(self) -> "PlanDoesNotFit":
        """This error with the whole shortfall appended to its message (computed only for the error
        make_plan raises: the placements `auto` tries and drops need none)."""
        if self.explain is not None:
            text, self.whole = self.explain()
            self.args = (self.args[0] + text,)
            self.explain = None
        return self


def _check_sharding(stage: int, world_size: int) -> None:
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
                      k: int = OPTIMIZER_BYTES) -> int:
    """Model-state bytes per rank for mixed-precision Adam under ZeRO `stage` over `world_size`.

    The ZeRO paper's formulas (defaults: 2 + 2 + K bytes per parameter, K = 12):
    stage 0 (2+2+K)Psi; 1: 2Psi + 2Psi + K Psi/N; 2: 2Psi + (2+K)Psi/N; 3: (2+2+K)Psi/N.
    See [Note: bytes per parameter].
    """
    _check_sharding(stage, world_size)
    per_element = {"params": param_bytes, "gradients": grad_bytes, "optimizer": k}
    return round(sum(b * shard_numel(numel, kind, stage, world_size) for kind, b in per_element.items()))


@dataclass(frozen=True)
class Plan:
    placement: dict[str, Location]      # kind -> tier
    need: dict[str, int]                # tier -> bytes this plan uses there (model state + working sets)
    budgets: dict[str, int]             # tier -> budget (auto resolved)
    predicted_step_s: float
    breakdown: dict[str, float]         # seconds per component of the prediction
    numel: int
    world_size: int = 1
    stage: int = 0
    state_bytes: dict[str, int] = field(default_factory=dict)    # kind -> model-state bytes per rank
    rate_sources: dict[str, str] = field(default_factory=dict)   # rate key used -> measured | default | given
    grad_bytes: int = 4
    param_bytes: int = 4
    grad_dtype: str = "fp32"            # precision.accumulator_dtype (the engine's accumulators)
    # [Note: optimizer split]: each unit's optimizer tier by unit index (None: all on placement["optimizer"]),
    # and the optimizer-state bytes and unit count per tier of the split
    optimizer_units: tuple[Location, ...] | None = None
    optimizer_split: dict[str, tuple[int, int]] = field(default_factory=dict)  # tier -> (bytes, units)
    # [Note: frozen units] in state.py: parameters with no gradient or optimizer state, held on
    # placement["params"] with the trainable ones (their bytes are in state_bytes["params"])
    frozen_numel: int = 0
    frozen_param_bytes: int = 0         # per rank
    # [Note: step-time prediction]: seconds of each component on the critical path (they sum to
    # predicted_step_s), the resource group with the most of them, whether forward/backward were
    # measured (zerotier.plan) or left out (make_plan alone), and the placements `auto` compared
    critical: dict[str, float] = field(default_factory=dict)
    bound_by: str = ""
    compute_measured: bool = False
    alternatives: tuple[dict, ...] = ()
    state_layout: StateLayout = StateLayout()  # precision.master_dtype / moment_dtype
    # [Note: speculation in the plan]: train.speculative_step resolved, the rollback rate the expected
    # step assumes, the speculated units' allowance per tier (undo copies, staged parameters; in `need`),
    # the NVMe units' shadow files (in need["nvme"]), which units the prediction speculates (by unit
    # index), the step's commit /
    # rollback / expected / without-speculation seconds, and why speculation is on or off
    speculative: bool = False
    rollback_rate: float = 0.01
    speculation_undo_bytes: dict[str, int] = field(default_factory=lambda: {"host": 0, "device": 0})
    speculation_nvme_bytes: int = 0
    speculation_units: tuple[bool, ...] = ()
    speculation_step_s: dict[str, float] = field(default_factory=dict)
    speculation_note: str = ""
    # [Note: the plan against the machine] in machine_fit.py: what the node lacks for `need` ("": it has room)
    machine_note: str = ""
    # [Note: activation memory] in activations.py: one micro-batch's saved activations, in need["device"],
    # and where the figure comes from ("": not counted)
    activation_bytes: int = 0
    activation_source: str = ""

    @property
    def per_rank_bytes(self) -> int:
        """Model-state bytes per rank (the ZeRO paper's figure; working sets excluded)."""
        return sum(self.state_bytes.values())

    @property
    def rates_measured(self) -> bool:
        """True when the prediction uses at least one rate measured by `zerotier bench` (or passed in)."""
        return any(src in ("measured", "given") for src in self.rate_sources.values())

    def summary(self) -> str:
        sharding = f", {_sharding(self.stage, self.world_size)}" if self.world_size > 1 or self.stage else ""
        frozen = f" + {self.frozen_numel / 1e6:,.1f}M frozen" if self.frozen_numel else ""
        lines = [f"zerotier plan: {self.numel / 1e6:,.1f}M trainable parameters{frozen}{sharding}",
                 f"  {'state':10s} {'tier':6s} {'bytes/rank':>12s} {'GB':>9s}"]
        for kind in KINDS:
            b = self.state_bytes.get(kind, 0)
            tier = "split" if kind == "optimizer" and self.optimizer_units else self.placement[kind].value
            lines.append(f"  {kind:10s} {tier:6s} {format_size(b):>12s} {b / 1e9:9.2f}")
            if kind == "params" and self.frozen_numel:
                for part, pb in (("trainable", b - self.frozen_param_bytes), ("frozen", self.frozen_param_bytes)):
                    lines.append(f"    {part:10s} {format_size(pb):>11s} {pb / 1e9:9.2f}")
        for tier, (b, units) in self.optimizer_split.items():
            lines.append(f"    on {tier:6s} {format_size(b):>12s} {b / 1e9:9.2f}   ({units} of "
                         f"{len(self.optimizer_units)} units)")
        total = self.per_rank_bytes
        lines.append(f"  {'total':10s} {'':6s} {format_size(total):>12s} {total / 1e9:9.2f}"
                     f"   ({total / max(self.numel + self.frozen_numel, 1):.2f} B per model parameter; "
                     f"gradients {self.grad_bytes} B/param"
                     + (f": the engine's {self.grad_dtype} accumulators)"
                        if self.grad_bytes == DTYPES[self.grad_dtype].itemsize else ")"))
        lines.append(_state_dtypes_line(self.state_layout))
        lines.append(f"  {'tier':8s} {'needed':>12s} {'budget':>12s}   (needed includes working sets)")
        for tier in TIERS:
            lines.append(f"  {tier:8s} {format_size(self.need[tier]):>12s} {format_size(self.budgets[tier]):>12s}")
        lines.append(f"  activations: {format_size(self.activation_bytes)} on the device per micro-batch, in needed "
                     f"({self.activation_source})" if self.activation_source else
                     "  activations: not counted (plan with the model, and its inputs to measure them)")
        lines.append(self._speculation_line())
        lines.append(f"  outside the budgets: ~{format_size(RSS_OUTSIDE_BUDGETS)} of RSS, fixed in model size (torch's "
                     "runtime and compute temporaries: docs/tiers.md § RSS beyond the budgets)")
        lines.append(f"  fits the budgets, not the machine: {self.machine_note}" if self.machine_note else
                     "  fits: yes")
        if not self.rates_measured:
            lines.append("  step time: run `zerotier bench` for a step-time prediction")
            return "\n".join(lines)
        what = "step" if self.compute_measured else "swap + optimizer time per step (no forward/backward measured)"
        expected = f" (expected at rollback rate {self.rollback_rate:.1%})" if self.speculative else ""
        lines.append(f"  predicted {what}{expected}: {format_duration(self.predicted_step_s)}, bound by "
                     f"{self.bound_by} (critical path of the engine's schedule)")
        if self.speculative and self.speculation_step_s:
            t = self.speculation_step_s
            gain = t["without"] - t["expected"]
            lines.append(f"  speculative step: commit {format_duration(t['commit'])}, rollback "
                         f"{format_duration(t['rollback'])}, expected {format_duration(t['expected'])}; without "
                         f"speculation {format_duration(t['without'])} ("
                         + (f"{gain / t['without']:.0%} saved)" if gain > 0 else "no gain predicted here)"))
            lines.append(f"  rollback rate {self.rollback_rate:.1%} assumed (clipping rarely firing); a fresh model or a "
                         "warm-up that clips every step rolls back up to 100%: `zerotier profile` measures it; "
                         "plan at that rate with --rollback-rate (zerotier.plan(..., rollback_rate=))")
        lines.append(f"  {'component':16s} {'seconds':>9s} {'on critical path':>17s}")
        for k, v in self.breakdown.items():
            if v > 0:
                lines.append(f"  {k:16s} {v:9.3f} {self.critical.get(k, 0.0):17.3f}")
        lines.append("  rates: " + ", ".join(f"{k} {src}" for k, src in self.rate_sources.items()))
        if len(self.alternatives) > 1:
            lines.append(alternatives_table(self.alternatives))
        return "\n".join(lines)

    def _speculation_line(self) -> str:
        """Whether the speculative step is on, why, and the memory it holds ([Note: speculation in the plan])."""
        if not self.speculative:
            return f"  speculative step: {self.speculation_note}"
        undo = self.speculation_undo_bytes
        return (f"  speculative step: {self.speculation_note}; {sum(self.speculation_units)} of "
                f"{len(self.speculation_units)} units speculated; allowance host {format_size(undo['host'])}, device "
                f"{format_size(undo['device'])}; NVMe shadow files {format_size(self.speculation_nvme_bytes)} "
                "(all in needed)")

    def to_dict(self) -> dict:
        """Plain JSON-able description (bytes as ints); predicted_step_s is None without measured rates."""
        measured = self.rates_measured
        return {
            "numel": self.numel, "world_size": self.world_size, "stage": self.stage,
            "param_bytes": self.param_bytes, "grad_bytes": self.grad_bytes, "grad_dtype": self.grad_dtype,
            "placement": {k: v.value for k, v in self.placement.items()},
            "optimizer_split": ({t: {"bytes": b, "units": u} for t, (b, u) in self.optimizer_split.items()}
                                if self.optimizer_units else None),
            "per_rank_bytes": self.per_rank_bytes, "state_bytes": dict(self.state_bytes),
            "frozen_numel": self.frozen_numel, "frozen_param_bytes": self.frozen_param_bytes,
            "tiers": dict(self.need), "budgets": dict(self.budgets),
            "fits": True, "missing": None, "machine_note": self.machine_note or None,
            "activation_bytes": self.activation_bytes, "activation_source": self.activation_source or None,
            "predicted_step_s": self.predicted_step_s if measured else None,
            "breakdown_s": dict(self.breakdown) if measured else None,
            "critical_path_s": dict(self.critical) if measured else None,
            "bound_by": self.bound_by if measured else None, "compute_measured": self.compute_measured,
            "alternatives": list(self.alternatives),
            "rate_sources": dict(self.rate_sources),
            "speculative": self.speculative, "rollback_rate": self.rollback_rate,
            "speculation_undo_bytes": dict(self.speculation_undo_bytes),
            "speculation_nvme_bytes": self.speculation_nvme_bytes,
            "speculation_step_s": dict(self.speculation_step_s) if measured and self.speculative else None,
            "speculation_note": self.speculation_note,
        }


def resolve_budgets(tiers: TiersConfig, device: torch.device) -> dict[str, int]:
    """Turn "auto" budgets into bytes for this rank. RAM and the swap drive are shared by
    the ranks of a node: their auto budgets are this node's share divided among its ranks
    (LOCAL_WORLD_SIZE); a GPU's free memory is its own rank's."""
    ranks = local_world_size()
    available = usable_memory().available // ranks  # capped by a cgroup's limit ([Note: cgroup memory])
    if tiers.device != "auto":
        dev = int(tiers.device)
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        reserve = int(total * 0.15) if tiers.device_reserve == "auto" else int(tiers.device_reserve)
        dev = max(0, int(free * 0.9) - reserve)
    else:  # the CPU "device" pool and the host tier share RAM: split what is free
        dev = int(available * 0.4)
    if tiers.host != "auto":
        host = int(tiers.host)
    else:
        host = int(available * (0.4 if device.type == "cpu" else 0.8))
    if tiers.nvme_path is None or tiers.nvme == 0:
        nvme = 0
    elif tiers.nvme == "auto":
        from ..tiers.rundir import _check_parent  # the store's own check: a clear TierIOError

        _check_parent(Path(tiers.nvme_path))
        nvme = int(shutil.disk_usage(tiers.nvme_path).free * 0.9) // ranks
    else:
        nvme = int(tiers.nvme)
    return {"device": dev, "host": host, "nvme": nvme}


def _tier_holds(kind: str, loc: Location, cuda: bool, layout: StateLayout) -> bool:
    """Whether `auto` may put `kind` on `loc`: compact optimizer state (precision.master_dtype /
    moment_dtype other than fp32) is updated by the CPU kernel, never on a GPU (UnitOptimizer refuses it)."""
    return not (kind == "optimizer" and loc is Location.DEVICE and cuda and not layout.exact)


_STATE_CHOICES = (("fp32", "fp32"), ("bf16", "bf16"), ("bf16", "int8"))  # what `plan` compares


def _state_dtypes_line(layout: StateLayout) -> str:
    """The optimizer state's B/param and what each precision.master_dtype / moment_dtype choice saves."""
    def bpp(master, moments):
        return StateLayout(master, moments).bytes_per_param
    choices = " -> ".join(f"{m}/{v} {bpp(m, v):.4g}" for m, v in _STATE_CHOICES)
    saved = 1 - layout.bytes_per_param / OPTIMIZER_BYTES
    return (f"  optimizer state: master {layout.master}, moments {layout.moments}: {layout.bytes_per_param:.4g} B/param"
            + (f" ({saved:.0%} less than fp32)" if saved else " (exact: torch AdamW's state)")
            + f"; master/moments B/param: {choices} (precision.master_dtype, precision.moment_dtype)")


@dataclass(frozen=True)
class _Sizes:
    """What `_bytes_for` needs besides the kind and tier (see [Note: bytes per parameter])."""
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
    state: StateLayout = StateLayout()  # the optimizer state's dtypes: state.bytes_per_param B/param
    frozen: tuple[int, ...] = ()      # frozen units' numels: parameters only ([Note: frozen units] in state.py)

    def with_frozen(self) -> "_Sizes":
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

    def rank_largest(self, kind: str) -> int:
        return shard_numel(self.largest, kind, self.stage, self.world_size)

    def rank_shards(self, kind: str) -> list[int]:
        return [shard_numel(n, kind, self.stage, self.world_size) for n in self.numels]

    def partitions(self) -> list[Partition]:
        """Every unit's partition over the ranks, as Sharding.assign makes them (stage 0 replicates
        every unit, stage 3 those below zero.persistence_threshold)."""
        threshold = {0: 2 ** 63, 3: self.persistence}.get(self.stage, 0)
        return partition_units(self.numels, self.world_size, align=_SHARD_ALIGN, persistence_threshold=threshold)


def _bytes_for(kind: str, loc: Location, s: _Sizes) -> dict[str, int]:
    if kind == "params":
        s = s.with_frozen()
    need = _state_and_buffers(kind, loc, s)
    if s.engine_buffers:  # each host-pool block is rounded up to io.alignment: count the worst case
        need["host"] += _host_blocks(kind, loc, s) * (s.alignment - 1)
        if loc is Location.NVME:
            need["nvme"] += _nvme_rewrites(kind, s)
    return need


def _nvme_rewrites(kind: str, s: _Sizes) -> int:
    """NVMe bytes beyond the state itself: every swap file is rounded up to io.alignment, and a
    rewrite goes to a second file until it commits (NVMeStore.write), so the writes that may be in
    flight at once need their room too: the optimizer's `pipeline_depth` staging sets (3 files of
    the largest units each), the parameters' `lookahead + 2` write-backs (ParamStore.max_writes)."""
    shards = sorted(s.rank_shards(kind), reverse=True)
    if kind == "params":
        files, inflight = 1, ParamStore.writes_in_flight(s.lookahead)
        rewrite = s.lp_bytes * sum(shards[:inflight])
    elif kind == "gradients":  # [Note: gradients on NVMe]: the folds in flight, each a rewrite
        files, inflight = 1, GradStore.nvme_writes_in_flight()
        if s.world_size > 1 and s.stage == 1:  # the full sums and the reduced shards: a file each
            files, shards = 2, sorted(s.numels, reverse=True)
        rewrite = s.grad_bytes * sum(shards[:inflight])
    else:
        files, inflight = 3, s.pipeline_depth
        rewrite = round(s.state.bytes_per_param * sum(shards[:inflight]))
    return rewrite + files * (len(shards) + min(inflight, len(shards))) * (s.alignment - 1)


def _host_blocks(kind: str, loc: Location, s: _Sizes) -> int:
    """How many host-pool blocks `kind` on `loc` holds at most at once (for the rounding)."""
    units = len(s.numels)
    if kind == "params":
        return ParamStore.host_blocks(loc, s.lookahead, units)
    if kind == "gradients":
        return GradStore.host_blocks(loc, units, s.world_size, s.stage)
    blocks = {Location.HOST: 3 * units, Location.NVME: 3 * s.pipeline_depth}.get(loc, 0)
    if s.grads_on_nvme or (s.grads_on_gpu and loc is not Location.DEVICE):
        blocks += 2
    if s.world_size > 1 and s.stage in (1, 2) and loc is not Location.DEVICE:
        blocks += units
    return blocks


def _state_and_buffers(kind: str, loc: Location, s: _Sizes) -> dict[str, int]:
    need = {"device": 0, "host": 0, "nvme": 0}
    n = s.rank_numel(kind)
    if kind == "params":
        need[loc.value] += s.lp_bytes * n
        if loc is not Location.DEVICE or s.stage >= SHARDED_FROM_STAGE["params"]:
            # fetched full units: the one computing, the one just done, the lookahead, and the
            # units enclosing them (resident for their module's whole forward/backward)
            need["device"] += min(sum(s.numels[:s.lookahead + 2]) + s.nested, s.numel) * s.lp_bytes
        if loc is Location.NVME:
            need["host"] += ParamStore.host_staging_bytes(s.lookahead, s.rank_shards(kind), s.lp_bytes)
        if s.engine_buffers and s.world_size > 1:
            sharded = [p for p in s.partitions() if not p.replicated]
            if s.stage >= 3 and loc is not Location.DEVICE:
                need["device"] += ParamStore.gather_staging_bytes(s.lookahead, [p.shard_numel for p in sharded],
                                                                  s.lp_bytes)
            if s.stage in (1, 2):  # the gather buckets live with the parameters ([Note: bucket memory])
                on_device = loc is Location.DEVICE
                need["device" if on_device else "host"] += ParamGatherer.buffer_bytes(
                    s.gather_bucket, s.lp_bytes, sharded, alignment=1 if on_device else s.alignment)
    elif kind == "gradients":
        need[loc.value] += s.grad_bytes * n
        if loc is Location.HOST and s.cuda and s.engine_buffers:  # GPU review N6: the D2H staging in flight
            need["host"] += GradStore.offload_staging_bytes(s.largest, s.lp_bytes, s.alignment)
        if loc is Location.NVME:  # [Note: gradients on NVMe]: the full gradient is staging only
            if s.engine_buffers:
                need["host"] += GradStore.nvme_staging_bytes(s.largest, s.rank_largest(kind), s.lp_bytes,
                                                            s.grad_bytes, s.world_size, s.stage)
            if s.engine_buffers and s.world_size > 1 and s.stage == 1:  # the reduced shards' files too
                need["nvme"] += s.grad_bytes * (s.numel // s.world_size)
        elif s.engine_buffers and s.world_size > 1 and s.stage >= 1:
            # The engine keeps both the full gradient (the reduce-scatter input; freeing
            # it per bucket is future work) and this rank's reduced shard, on the gradient
            # tier. Stages >= 2 counted the shard above, stage 1 the full flat.
            need[loc.value] += s.grad_bytes * (s.numel if n < s.numel else s.numel // s.world_size)
        if s.engine_buffers and s.world_size > 1:  # the reduce buckets: fp32, on the device
            need["device"] += GradBucketer.buffer_bytes(s.reduce_bucket, 4, s.partitions())
            if loc is not Location.DEVICE:  # [Note: bucket memory]: host gradients cross by the tier's copies
                need["host"] += GradBucketer.staging_bytes(s.reduce_bucket, 4, s.partitions(), alignment=s.alignment)
                need["device"] += GradBucketer.conversion_bytes(s.largest, s.grad_bytes)
            if loc is Location.NVME and s.cuda:
                need["device"] += GradStore.nvme_conversion_bytes(s.largest, s.lp_bytes, s.grad_bytes, s.world_size,
                                                                 s.stage)
    else:
        need[loc.value] += round(s.state.bytes_per_param * n)
        if loc is Location.DEVICE and s.cuda and s.engine_buffers:
            need["device"] += fused_temp_bytes()
        if loc is Location.NVME:
            need["host"] += UnitOptimizer.staging_bytes(s.pipeline_depth, s.rank_largest(kind), s.state)
        if s.engine_buffers and (s.grads_on_nvme or s.grads_on_gpu and loc is not Location.DEVICE):
            need["host"] += UnitOptimizer.grad_staging_bytes(s.rank_largest(kind), s.grad_bytes)
        if s.engine_buffers and s.world_size > 1 and s.stage in (1, 2):
            # the updated low-precision shards wait on the optimizer's side for the all-gather
            side = "device" if loc is Location.DEVICE else "host"
            need[side] += ParamStore.writeback_bytes(n, s.lp_bytes)
    return need


def make_plan(unit_numels: list[int], tiers: TiersConfig, offload: OffloadConfig, precision: PrecisionConfig,
              prefetch: PrefetchConfig, device: torch.device, budgets: dict[str, int] | None = None,
              rates: dict[str, float] | None = None, *, world_size: int = 1, stage: int = 0,
              zero: ZeroConfig | None = None,
              grad_bytes: int | None = None, ranks_per_node: int | None = None, pipeline_depth: int = 3,
              nested_numel: int = 0, alignment: int = 4096, frozen_numels: list[int] = (),
              compute: UnitCompute | None = None, step: StepOptions = StepOptions(),
              materialize_bytes: int = 0, machine: Machine | None = None,
              activations: tuple[int, str] | None = None, unit_names: list[str] = ()) -> Plan:
    """Choose a tier for each kind of state within the per-rank budgets, or raise PlanDoesNotFit.

    world_size/stage shard each kind's bytes as ZeRO does ([Note: bytes per parameter]);
    grad_bytes defaults to the engine's accumulators (precision.grad_dtype), pass the param dtype's size
    for the ZeRO paper's accounting. rates=None uses this node's `zerotier bench` results
    where saved, else DEFAULT_RATES ([Note: step-time prediction]). compute: each unit's measured
    forward/backward (zerotier.plan measures them); step: accumulation, clipping, early step.
    materialize_bytes: host-pool bytes a meta-built model's materialization holds during initialize
    (materialize.pool_bytes), counted in tiers.host beside everything else.
    machine: the node's memory the chosen plan's need is checked against (`Plan.machine_note`;
    [Note: the plan against the machine] in machine_fit.py); None: not checked.
    activations: one micro-batch's activation bytes on the device and where the figure comes from
    ([Note: activation memory] in activations.py), counted in need["device"]; None: not counted.
    unit_names: each unit's module name (unit_numels', then frozen_numels'), for a refusal that
    names the largest unit ([Note: the whole shortfall] in planner/report.py).
    `auto` kinds: every tier choice (and the optimizer split) that fits is predicted and the
    fastest taken, ties to the fastest-tier-first choice; all are in `Plan.alternatives`.
    """
    _check_sharding(stage, world_size)
    if not 0.0 <= step.rollback_rate <= 1.0:
        raise ConfigError(f"rollback_rate must be in [0, 1] (a share of the speculated steps), got {step.rollback_rate}")
    budgets = budgets or resolve_budgets(tiers, device)
    resolved = _resolve_rates(rates)
    args = (unit_numels, tiers, precision, prefetch, device, budgets, resolved)
    kw = dict(world_size=world_size, stage=stage, zero=zero, grad_bytes=grad_bytes, ranks_per_node=ranks_per_node,
              pipeline_depth=pipeline_depth, nested_numel=nested_numel, alignment=alignment,
              frozen_numels=frozen_numels, compute=compute, step=step, materialize_bytes=materialize_bytes,
              activation_bytes=activations[0] if activations else 0,
              unit_names={n: name for n, name in reversed(list(zip([*unit_numels, *frozen_numels], unit_names)))})
    autos = [k for k in KINDS if getattr(offload, k) == "auto"]
    try:
        first, error = _place(offload, *args, **kw), None
    except PlanDoesNotFit as exc:
        first, error = None, exc
    if not autos:
        if error is not None:
            raise error.explained()
        return _on(machine, first, ranks_per_node, activations)
    tried = [first] if first is not None else []
    layout = StateLayout.of(precision)
    choices = [[loc.value for loc in Location if _tier_holds(k, loc, device.type == "cuda", layout)]
               + (["auto"] if k == "optimizer" else []) for k in autos]
    for combo in itertools.product(*choices):  # "auto" optimizer: a split where one is faster
        try:
            plan = _place(dataclasses.replace(offload, **dict(zip(autos, combo))), *args, **kw)
        except PlanDoesNotFit:
            continue
        if all((p.placement, p.optimizer_units) != (plan.placement, plan.optimizer_units) for p in tried):
            tried.append(plan)
    if not tried:
        raise error.explained()
    best = tried[0]
    for plan in tried[1:]:
        if plan.predicted_step_s < best.predicted_step_s * (1 - 1e-9):
            best = plan
    rows = tuple(sorted((_alternative(p, p is best) for p in tried), key=lambda r: r["predicted_step_s"]))
    return _on(machine, dataclasses.replace(best, alternatives=rows), ranks_per_node, activations)


def _on(machine: Machine | None, plan: Plan, ranks_per_node: int | None, activations: tuple[int, str] | None) -> Plan:
    """The plan with what `machine` lacks for it ([Note: the plan against the machine]) and where its
    activation figure comes from ([Note: activation memory])."""
    if activations:
        plan = dataclasses.replace(plan, activation_bytes=activations[0], activation_source=activations[1])
    if machine is None:
        return plan
    return dataclasses.replace(plan, machine_note=shortfall(plan.need, machine, ranks_per_node or plan.world_size))


def _alternative(plan: Plan, chosen: bool) -> dict:
    """One row of the alternatives table."""
    where = {k: ("split" if k == "optimizer" and plan.optimizer_units else v.value)
             for k, v in plan.placement.items()}
    return {"placement": where, "optimizer_split": {t: b for t, (b, _) in plan.optimizer_split.items()} or None,
            "tiers": dict(plan.need), "predicted_step_s": plan.predicted_step_s, "bound_by": plan.bound_by,
            "chosen": chosen}


def alternatives_table(rows: tuple[dict, ...]) -> str:
    """The placements `auto` compared: tier per kind, bytes per tier, predicted step, bound by."""
    lines = ["  alternatives that fit (auto takes the fastest):",
             f"    {'params':7s} {'grads':7s} {'optimizer':10s} {'device':>10s} {'host':>10s} {'nvme':>10s} "
             f"{'step':>10s}  bound by"]
    for r in rows:
        p, t = r["placement"], r["tiers"]
        lines.append(f"  {'*' if r['chosen'] else ' '} {p['params']:7s} {p['gradients']:7s} {p['optimizer']:10s} "
                     f"{format_size(t['device']):>10s} {format_size(t['host']):>10s} {format_size(t['nvme']):>10s} "
                     f"{format_duration(r['predicted_step_s']):>10s}  {r['bound_by']}")
    return "\n".join(lines)


def _place(offload: OffloadConfig, unit_numels: list[int], tiers: TiersConfig, precision: PrecisionConfig,
           prefetch: PrefetchConfig, device: torch.device, budgets: dict[str, int],
           resolved: tuple[dict[str, float], dict[str, str]], *, world_size: int, stage: int,
           zero: ZeroConfig | None, grad_bytes: int | None, ranks_per_node: int | None, pipeline_depth: int,
           nested_numel: int, alignment: int, frozen_numels: list[int], compute: UnitCompute | None,
           step: StepOptions, materialize_bytes: int, activation_bytes: int, unit_names: dict[int, str]) -> Plan:
    """One placement: `auto` kinds take the fastest tier that fits, in KINDS order."""
    rates, rate_sources = resolved
    lp_bytes = DTYPES[precision.param_dtype].itemsize
    sizes = _Sizes(numels=tuple(sorted(unit_numels, reverse=True)), lp_bytes=lp_bytes,
                   grad_bytes=DTYPES[precision.accumulator_dtype].itemsize if grad_bytes is None else grad_bytes,
                   lookahead=prefetch.lookahead if prefetch.enabled else 0, stage=stage, world_size=world_size,
                   pipeline_depth=pipeline_depth, engine_buffers=grad_bytes is None, nested=nested_numel,
                   alignment=alignment, cuda=device.type == "cuda", frozen=tuple(frozen_numels),
                   state=StateLayout.of(precision))
    state_bytes = {kind: round(b * (sizes.with_frozen() if kind == "params" else sizes).rank_numel(kind)) for kind, b
                   in (("params", lp_bytes), ("gradients", sizes.grad_bytes),
                       ("optimizer", sizes.state.bytes_per_param))}
    frozen_bytes = state_bytes["params"] - lp_bytes * sizes.rank_numel("params")  # [Note: frozen units]
    assert sum(state_bytes.values()) - frozen_bytes == model_state_bytes(sizes.numel, stage, world_size, lp_bytes,
                                                                         sizes.grad_bytes, sizes.state.bytes_per_param)
    sizes = dataclasses.replace(sizes, unit_order=tuple(unit_numels))
    if zero is not None:  # the collectives' bucket sizes (zero.*_bucket_size; default: ZeroConfig's)
        sizes = dataclasses.replace(sizes, reduce_bucket=zero.reduce_bucket_size,
                                    gather_bucket=zero.allgather_bucket_size, persistence=zero.persistence_threshold)
    local = ranks_per_node or world_size
    free = dict(budgets)
    base_sizes, base = sizes, {"device": activation_bytes, "host": materialize_bytes, "nvme": 0}
    need = dict(base)  # [Note: materialization in the
    free["host"] -= materialize_bytes                                      # host pool], [Note: activation memory]
    free["device"] -= activation_bytes
    placement: dict[str, Location] = {}
    units_on: tuple[Location, ...] | None = None  # [Note: optimizer split]
    for kind in KINDS:
        requested = getattr(offload, kind)
        if isinstance(requested, dict):  # an explicit optimizer split (config.py allows it there only)
            units_on = _split_units(requested, sizes)
            want = _split_bytes(units_on, sizes)
            short = {t: want[t] - free[t] for t in want if want[t] > free[t]}
            if short:
                raise PlanDoesNotFit(_split_does_not_fit(units_on, short, sizes, budgets), kind,
                                     [{"tier": "split", "more": short}], placement, sum(state_bytes.values()))
            chosen = Location.NVME
        else:
            candidates = [Location(requested)] if requested != "auto" else \
                [loc for loc in Location if _tier_holds(kind, loc, sizes.cuda, sizes.state)]
            chosen = None
            for loc in candidates:
                want = _bytes_for(kind, loc, sizes)
                if all(want[t] <= free[t] for t in want):
                    chosen = loc
                    break
            if kind == "optimizer" and requested == "auto" and chosen in (None, Location.NVME):
                units_on = _auto_split(sizes, free)
                if units_on is not None and chosen is Location.NVME:  # the split only where it is faster
                    whole = predict({**placement, kind: chosen}, sizes, device.type, rates, local, None, compute,
                                    step)[0]
                    split = predict({**placement, kind: chosen}, sizes, device.type, rates, local, units_on,
                                    compute, step)[0]
                    units_on = units_on if split.step_s < whole.step_s else None
                chosen = Location.NVME if units_on is not None else chosen
        if units_on is not None and len(set(units_on)) == 1:  # fractions rounded to whole units: one tier
            chosen, units_on = units_on[0], None
        if chosen is None:
            message, options = _does_not_fit(kind, candidates, sizes, free, budgets, _nvme_off(tiers))
            error = PlanDoesNotFit(message, kind, options, placement, sum(state_bytes.values()))
            error.explain = lambda: whole_shortfall(  # [Note: the whole shortfall], built if it is raised
                offload, base_sizes, base, budgets, sizes.cuda, _nvme_off(tiers), unit_names)
            raise error
        placement[kind] = chosen
        want = _split_bytes(units_on, sizes) if kind == "optimizer" and units_on else _bytes_for(kind, chosen, sizes)
        for t, b in want.items():
            free[t] -= b
            need[t] += b
        if kind == "gradients":
            sizes = dataclasses.replace(sizes, grads_on_gpu=device.type == "cuda" and chosen is Location.DEVICE,
                                        grads_on_nvme=chosen is Location.NVME)
    spec = _speculation(step, placement, units_on, sizes, free, compute, sum(state_bytes.values()))
    for t, b in (*spec.undo.items(), ("nvme", spec.nvme)):
        need[t] += b
    schedule, used, spec_s = _predict_step(placement, sizes, device.type, rates, local, units_on, compute, step,
                                           spec.units if spec.on else None)
    breakdown = {c: schedule.seconds.get(c, 0.0) for c in COMPONENTS}
    split: dict[str, tuple[int, int]] = {}
    for loc, n in zip(units_on or (), _rank_shards_in_order(sizes)):
        b, k = split.get(loc.value, (0, 0))
        split[loc.value] = (b + round(sizes.state.bytes_per_param * n), k + 1)
    return Plan(placement, need, budgets, schedule.step_s, breakdown, sizes.numel, world_size, stage,
                state_bytes, {k: rate_sources[k] for k in used}, sizes.grad_bytes, lp_bytes, precision.accumulator_dtype,
                units_on, split, sum(frozen_numels), frozen_bytes,
                {c: schedule.critical.get(c, 0.0) for c in COMPONENTS},
                bound_by(schedule.critical, device.type, placement["optimizer"] is Location.DEVICE), compute is not None,
                state_layout=sizes.state, speculative=spec.on, rollback_rate=step.rollback_rate,
                speculation_undo_bytes=spec.undo, speculation_nvme_bytes=spec.nvme,
                speculation_units=spec.units if spec.on else (), speculation_step_s=spec_s,
                speculation_note=spec.note)


@dataclass(frozen=True)
class _Speculation:
    """[Note: speculation in the plan] for one placement."""
    on: bool
    note: str                                   # why on or off (the plan text)
    undo: dict[str, int] = field(default_factory=lambda: {"host": 0, "device": 0})
    nvme: int = 0
    units: tuple[bool, ...] = ()                # speculated, by unit index


def _speculation(step: StepOptions, placement: dict[str, Location], units_on: tuple[Location, ...] | None,
                 s: _Sizes, free: dict[str, int], compute: UnitCompute | None, per_rank: int) -> _Speculation:
    """[Note: speculation in the plan] train.speculative_step resolved for this placement, with the
    memory it takes from what the rest of the plan left `free`."""
    wanted = step.speculative
    why = "clipping" if step.clip else "a dynamic loss scale" if step.dynamic_scale else None
    if wanted is False:
        return _Speculation(False, "off (train.speculative_step = false)")
    if s.world_size > 1:  # the engine speculates at one rank only ([Note: speculative step] in overlap/speculative.py)
        return _Speculation(False, f"off ({s.world_size} ranks: the reduced gradient shards land at the end of "
                                   "backward, so nothing can be speculated during it)")
    if wanted == "auto" and why is None:
        return _Speculation(False, "off (auto: no clipping and no dynamic loss scale, nothing waits for the "
                                   "whole gradient)")
    setting = "on (train.speculative_step = true)" if wanted is True else f"on (auto: {why})"
    shards = _rank_shards_in_order(s)
    tiers = units_on or (placement["optimizer"],) * len(shards)
    nvme = sum(shadow_bytes(n, s.alignment, s.state) for n, at in zip(shards, tiers)
               if at is Location.NVME)
    if nvme > free["nvme"]:
        short = nvme - free["nvme"]
        if wanted == "auto":
            return _Speculation(False, f"off (auto: the NVMe budget lacks {format_size(short)} for the NVMe units' "
                                       f"shadow state files, {format_size(nvme)})")
        raise PlanDoesNotFit(f"train.speculative_step = true: the NVMe units' shadow state files take "
                             f"{format_size(nvme)} beside the plan's NVMe files; {format_size(short)} more nvme "
                             f"(tiers.nvme) or train.speculative_step = \"auto\"", "optimizer",
                             [{"tier": "nvme", "more": {"nvme": short}}], placement, per_rank)
    # what a speculated unit holds until the check (UndoLog.speculate): a host or device unit its
    # undo copy on its tier, an NVMe unit its new low-precision shard (ParamStore.staged_out_bytes) on host
    # auto copies no state: host/device units are speculated with `true` only (UndoLog.copies)
    held = [("host", max(round_up(n * s.lp_bytes, s.alignment), s.alignment)) if at is Location.NVME else
            (at.value, undo_bytes(n, s.lp_bytes, s.state)) if wanted is True else (None, 0)
            for n, at in zip(shards, tiers)]
    if not any(t for t, _ in held):
        return _Speculation(False, "off (auto: no optimizer state on NVMe; host or device state would need undo "
                                   "copies, which cost more than they hide: train.speculative_step = true)")
    allowance = {t: min(sum(b for at, b in held if at == t), max(0, free[t])) for t in ("host", "device")}
    # each unit as its gradient becomes final (backward order, enclosing units last), if what it holds fits
    encloses = compute.encloses if compute is not None else (False,) * len(shards)
    order = [i for i in reversed(range(len(shards))) if not encloses[i]] + \
            [i for i in range(len(shards)) if encloses[i]]
    left, units = dict(allowance), [False] * len(shards)
    for i in order:
        t, b = held[i]
        if t is not None and b <= left[t]:
            units[i], left[t] = True, left[t] - b
    if not any(units):
        room = " and ".join(f"{format_size(max(0, free[t]))} {t} left, the smallest takes "
                            f"{format_size(min(b for at, b in held if at == t))}"
                            for t in ("host", "device") if any(at == t for at, _ in held))
        if wanted == "auto":
            return _Speculation(False, f"off (auto: no unit's undo copy fits: {room})")
        raise PlanDoesNotFit(f"train.speculative_step = true: no unit's undo copy fits ({room}); raise the "
                             f"budgets or set train.speculative_step = \"auto\"", "optimizer", [], placement,
                             per_rank)
    return _Speculation(True, setting, allowance, nvme, tuple(units))


def _predict_step(placement: dict[str, Location], s: _Sizes, device_type: str, rates: dict[str, float], local: int,
                  units_on: tuple[Location, ...] | None, compute: UnitCompute | None, step: StepOptions,
                  speculated: tuple[bool, ...] | None):
    """The schedule the plan reports, the rate keys used and, with speculation, its cases' seconds:
    the expected step (1 - r) commit + r rollback, each component weighted alike ([Note:
    speculation in the plan])."""
    without, used = predict(placement, s, device_type, rates, local, units_on, compute, step)
    if speculated is None:
        return without, used, {}
    commit, used_c = predict(placement, s, device_type, rates, local, units_on, compute, step, speculated)
    rollback, used_r = predict(placement, s, device_type, rates, local, units_on, compute, step, speculated,
                               rollback=True)
    r = step.rollback_rate
    mix = lambda a, b: {k: (1 - r) * a.get(k, 0.0) + r * b.get(k, 0.0) for k in {**a, **b}}  # noqa: E731
    expected = Schedule((1 - r) * commit.step_s + r * rollback.step_s, mix(commit.seconds, rollback.seconds),
                        mix(commit.critical, rollback.critical), mix(commit.busy, rollback.busy))
    seconds = {"commit": commit.step_s, "rollback": rollback.step_s, "expected": expected.step_s,
               "without": without.step_s}
    return expected, tuple(dict.fromkeys(used + used_c + used_r)), seconds


def _rank_shards_in_order(s: _Sizes) -> list[int]:
    return [shard_numel(n, "optimizer", s.stage, s.world_size) for n in s.unit_order]


def _split_units(fractions: dict[str, float], s: _Sizes) -> tuple[Location, ...]:
    """[Note: optimizer split] Each unit's tier for explicit fractions (fastest tier first, as
    config.py orders them): the tier whose share of the elements holds the unit's midpoint."""
    shards = _rank_shards_in_order(s)
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


def _split_bytes(units_on: tuple[Location, ...], s: _Sizes) -> dict[str, int]:
    """Bytes per tier of the optimizer split `units_on` ([Note: optimizer split]): each tier's
    units counted as that tier holds them, the gradient staging (shared) once."""
    need = {"device": 0, "host": 0, "nvme": 0}
    plain = dataclasses.replace(s, grads_on_gpu=False, grads_on_nvme=False)
    for loc in set(units_on):
        numels = tuple(sorted((n for n, at in zip(s.unit_order, units_on) if at is loc), reverse=True))
        for t, b in _bytes_for("optimizer", loc, dataclasses.replace(plain, numels=numels)).items():
            need[t] += b
    if s.engine_buffers and (s.grads_on_nvme or s.grads_on_gpu):  # a split holds no unit on the device
        need["host"] += UnitOptimizer.grad_staging_bytes(s.rank_largest("optimizer"), s.grad_bytes)
        need["host"] += 2 * (s.alignment - 1)
    return need


def _auto_split(s: _Sizes, free: dict[str, int]) -> tuple[Location, ...] | None:
    """[Note: optimizer split] The first units on host, as many as fit, the rest on NVMe; None
    when no split with at least one unit on each fits."""
    count = len(s.unit_order)
    if free["nvme"] <= 0:
        return None
    for on_host in range(count - 1, 0, -1):
        units_on = (Location.HOST,) * on_host + (Location.NVME,) * (count - on_host)
        want = _split_bytes(units_on, s)
        if all(want[t] <= free[t] for t in want):
            return units_on
    return None


def _split_does_not_fit(units_on: tuple[Location, ...], short: dict[str, int], s: _Sizes,
                        budgets: dict[str, int]) -> str:
    parts = {loc: units_on.count(loc) for loc in dict.fromkeys(units_on)}
    shown = ", ".join(f"{loc.value} {k} of {len(units_on)} units" for loc, k in parts.items())
    more = " and ".join(f"{format_size(b)} more {t} (tiers.{t} is {format_size(budgets[t])})"
                        for t, b in short.items())
    return (f"the optimizer of {s.numel:,} parameters split as offload.optimizer asks ({shown}) does not fit "
            f"within the tier budgets; it would take {more}, or a split with more of it on another tier")


def _resolve_rates(rates: dict[str, float] | None) -> tuple[dict[str, float], dict[str, str]]:
    """Rates for the prediction and where each came from."""
    if rates is not None:
        source, given = "given", rates
    else:
        from ..bench import load_rates  # light: json + os only
        source, given = "measured", load_rates() or {}
    merged = {**DEFAULT_RATES, **given}
    return merged, {k: (source if k in given else "default") for k in merged}


def _nvme_off(tiers: TiersConfig) -> str:
    """What to change when the nvme budget is 0 (hostile trial #9: never "set tiers.nvme_path"
    when it is set)."""
    if tiers.nvme_path is None:
        return "set tiers.nvme_path"
    if tiers.nvme != "auto":
        return f"raise tiers.nvme (it is {format_size(int(tiers.nvme))})"
    try:
        free = format_size(shutil.disk_usage(tiers.nvme_path).free)
    except OSError as exc:
        free = f"no usable space ({exc.strerror})"
    return (f"tiers.nvme = 'auto' found {free} free in tiers.nvme_path {tiers.nvme_path}: free space there "
            f"or point tiers.nvme_path at a writable drive with room")


def _does_not_fit(kind: str, candidates: list[Location], s: _Sizes, free: dict[str, int],
                  budgets: dict[str, int], nvme_off: str) -> tuple[str, list[dict]]:
    texts, options = [], []
    for loc in candidates:
        want = _bytes_for(kind, loc, s)
        short = {t: want[t] - free[t] for t in want if want[t] > free[t]}
        options.append({"tier": loc.value, "more": short})
        if loc is Location.NVME and budgets["nvme"] == 0:
            others = "".join(f" and {format_size(b)} more {t}" for t, b in short.items() if t != "nvme")
            texts.append(f"enable the nvme tier ({nvme_off}; needs {format_size(want['nvme'])})" + others)
            continue
        texts.append(" and ".join(f"{format_size(b)} more {t} (tiers.{t} is {format_size(budgets[t])})"
                                  for t, b in short.items()) + f" to place it on {loc.value}")
    per_rank = ""
    if s.world_size > 1:
        per_rank = f" ({s.rank_numel(kind):,} per rank: {_sharding(s.stage, s.world_size)}; budgets are per rank)"
    message = (f"the {kind} of {s.numel:,} parameters{per_rank} {'does' if kind == 'optimizer' else 'do'} not fit within the tier budgets; "
               f"it would take: " + "; or ".join(texts))
    return message, options


def _sharding(stage: int, world_size: int) -> str:
    """'ZeRO stage 3 over 4 ranks'; at one rank a stage shards nothing, and the words say so."""
    if world_size > 1:
        return f"ZeRO stage {stage} over {world_size} ranks"
    return f"ZeRO stage {stage} on one rank: nothing to shard"
