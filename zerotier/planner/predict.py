"""The planner's step-time prediction: a placement, unit sizes, rates and measured compute ->
the schedule of one step ([Note: the step schedule] in planner/step_model.py) and its time.

[Note: step-time prediction]
Each unit's work is sized from its bytes and this node's rates, then laid out as the engine
runs it; the critical path of that schedule is `Plan.predicted_step_s`. Per unit:

  forward_s / backward_s   measured (zerotier.planner.unit_timing), zero when no compute was given
                           (make_plan at initialize: then it is the swap + optimizer path)
  params fetched           per use (forward and backward): NVMe read (ranks per node share the
                           drive) then the host->device copy; on a CPU device the "link" is a
                           memory copy at `mem_copy` on compute's cores ([Note: a CPU device's
                           copies take its cores] in step_model.py)
  gradients                off the device: the fresh gradient (param dtype) copied out (d2h, on
                           a CPU device a memory copy: its device tier is a pool of its own);
                           NVMe: grad_bytes written per micro-batch, read back per later one and
                           once by the optimizer; device gradients with a CPU optimizer: the
                           shard staged d2h
  optimizer                CPU Adam at `cpu_adam` params/s over the node's ranks, or the rule's
                           and state dtypes' measured `cpu_<rule>_<master>_<moments>` (on a CPU
                           device it runs on the cores compute uses; scaled by the new
                           parameters' bytes: [Note: the CPU rate's new parameters] in
                           step_on.py); on a CUDA device
                           28 B/param at `device_adam`
  update on the device     a host/NVMe unit the planner steps on the device (StepOptions.on_device,
                           [Note: choosing where each update runs] in step_on.py): its state (and
                           gradient, when off the device) staged in, the kernel, its state and,
                           unless written in their device home in place, its new parameters staged
                           out, `optimizer_staging`; a device home not written in place gets them
                           back by the commit (`params_copyback`: [Note: the new shard's way home]
                           in step_on.py)
  optimizer state on NVMe  each unit's state buffers read and written per step, as the store
                           allocates them (`Sizes.state_units`: 12 B/param for fp32 AdamW)
  new parameters home      host->device copy when they live on a CUDA device (after a CPU update,
                           or a device step not written in place), an NVMe write when on NVMe;
                           none when the home is the optimizer's memory
  global norm              every window (engine.step() always computes it: the clip factor, the
                           overflow check, engine.grad_norm()), one read of every gradient: host
                           or CPU device at `mem_read` (the engine's sum-of-squares kernel),
                           CUDA device gradients at device_adam bytes/s (its Adam kernel's stream
                           rate; it was divided by 28 B/param before, a unit slip), NVMe gradients none (their sums of squares are kept as folded)
  speculative step         a speculated host (device) unit's undo copy, `overlap.speculative.undo_bytes`,
                           copied at `mem_copy` (read and written at `device_adam` bytes/s on a
                           CUDA device) before its update, and back on a rollback; NVMe units
                           none (their pre-step files stay). Commit and rollback are each a
                           schedule ([Note: speculation in the schedule]); the plan's step is
                           (1 - rollback_rate) x commit + rollback_rate x rollback

Rates come from `zerotier bench` results saved on this node (`zerotier.bench.load_rates()`)
where present, else DEFAULT_RATES; the Plan records which (`rate_sources`). The CPU, its
memory bus and the NVMe drive are shared by the ranks on one node (`ranks_per_node`): their
per-rank time is the node's work over the node's rate; host<->device copies are per GPU.
Collectives (several ranks) are not in the schedule; over several ranks no overlap policy sees a
unit final during backward (overlap/base.py: `sharding.active`), so the schedule has no early
step and no state read before step() there (`StepShape.unit_final`).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..grads import GradStore
from ..optim.device_staging import DeviceStaging
from ..overlap import policy_for
from ..overlap.speculative import undo_bytes
from ..params import ParamStore
from .step_on import UpdateCosts, cpu_rate_key, device_rate_key, shard_in_place
from .step_model import Schedule, StepShape, UnitWork, simulate
from ..state import Location
from ..tiers.homes import HOMES

# Rates assumed when none were measured on this node (bytes/s, params/s, flop/s);
# `zerotier bench` measures the real ones. Figures: GUIDE.md section 3 and PCIe 4 x16.
DEFAULT_RATES = {"h2d": 20e9, "d2h": 20e9, "nvme_read": 7e9, "nvme_write": 4.5e9, "cpu_adam": 1.9e9,
                 "device_adam": 50e9, "mem_copy": 5e9, "mem_read": 10e9,
                 "nvme_cpu_share": 0.0}  # a fraction, not a rate ([Note: the drive's CPU share]): unmeasured, none
DEVICE_ADAM_BYTES = 28  # fp32 master, m, v read and written, the gradient read: bytes per param per step

COMPONENTS = ("forward", "backward", "params_h2d", "params_nvme", "grads_d2h", "grads_nvme", "grad_norm", "optimizer",
              "optimizer_nvme", "optimizer_staging", "params_copyback", "speculation",
              "nvme_cpu")  # Plan.breakdown's keys; nvme_cpu: [Note: the drive's share of the cores]
# bound-by groups of the alternatives table: component -> resource a user can change
BOUND_BY = {"forward": "compute", "backward": "compute", "grad_norm": "compute",
            "params_h2d": "PCIe", "grads_d2h": "PCIe", "params_copyback": "PCIe",
            "optimizer_staging": "PCIe", "params_nvme": "NVMe", "grads_nvme": "NVMe", "optimizer_nvme": "NVMe", "optimizer": "CPU Adam",
            "speculation": "CPU Adam", "nvme_cpu": "NVMe"}


@dataclass(frozen=True)
class UnitCompute:
    """Measured seconds of each unit's forward and backward for one micro-batch, by unit index
    (frozen units after the trainable ones, as build_units lists them), and which units enclose
    the others (the root: resident for the whole pass)."""
    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    encloses: tuple[bool, ...]
    activation_bytes: int = 0  # what one micro-batch's forward saves for backward ([Note: activation memory])
    backward_tail_s: tuple[float, ...] = ()  # of an enclosing unit's backward, the part after every block's
                                             # ([Note: the root's backward comes in two parts] in step_model.py)

    def scaled(self, factor: float) -> "UnitCompute":
        return UnitCompute(tuple(t * factor for t in self.forward_s), tuple(t * factor for t in self.backward_s),
                           self.encloses, self.activation_bytes, tuple(t * factor for t in self.backward_tail_s))


@dataclass(frozen=True)
class StepOptions:
    """What of train.* and precision.* shapes the schedule (defaults: the engine's).

    early_step, speculative: what the overlap policy `overlap` (train.overlap) does: the exact early
    step; speculation (True, False or "auto": on with clipping or a dynamic loss scale), resolved by
    the planner ([Note: speculation in the plan] in speculation_plan.py);
    rollback_rate: the share of speculated steps rolled back, for the expected step;
    optimizer: optimizer.type, the update rule whose state the plan counts (optim/rules/);
    step_on: optimizer.step_on, where host/NVMe units' updates run ([Note: where the update runs]), and
    on_device the planner's resolution of it per unit (planner.py fills it)."""
    accum_steps: int = 1
    clip: bool = False
    early_step: bool = False
    dynamic_scale: bool = False      # precision.loss_scale = "dynamic": no early step (every gradient checked)
    speculative: bool | str = "auto"
    rollback_rate: float = 0.01
    overlap: str | None = None       # the train.overlap value (None: the one `speculative` stands for)
    optimizer: str = "adamw"
    step_on: str = "auto"
    on_device: tuple[bool, ...] = ()  # the planner's choice: units whose update runs on the device ([Note: where
                                      # the update runs]); their state is off the device. Empty: none

    @classmethod
    def of(cls, cfg, rollback_rate: float | None = None) -> "StepOptions":
        """The options of a Config (its "auto" trainer keys already filled); what overlaps the update is
        its overlap policy's, the one the engine runs ([Note: overlap policies])."""
        train, policy = cfg.train, policy_for(cfg)
        return cls(accum_steps=train.grad_accum_steps, clip=train.max_grad_norm is not None,
                   early_step=policy.early_step, dynamic_scale=cfg.precision.loss_scale == "dynamic",
                   speculative=policy.speculates, overlap=policy.name,
                   rollback_rate=cls.rollback_rate if rollback_rate is None else rollback_rate,
                   optimizer=cfg.optimizer.type, step_on=cfg.optimizer.step_on)


def predict(placement: dict[str, Location], s, device_type: str, rates: dict[str, float], local_ranks: int,
            optimizer_units: tuple[Location, ...] | None = None, compute: UnitCompute | None = None,
            options: StepOptions = StepOptions(), speculated: tuple[bool, ...] | None = None,
            rollback: bool = False) -> tuple[Schedule, tuple[str, ...]]:
    """[Note: step-time prediction] The step's schedule and the rate keys it used. `s` is the
    planner's Sizes (sizes.py: unit_order, frozen, lp_bytes, grad_bytes, lookahead, pipeline_depth, stage,
    world_size); optimizer_units: each unit's optimizer tier ([Note: optimizer split]).
    speculated: the speculative step is on and these trainable units (by index) update under
    backward; rollback: the step whose check disagreed ([Note: speculation in the schedule])."""
    used: list[str] = []

    def secs(nbytes: float, key: str) -> float:
        if nbytes <= 0:
            return 0.0
        if key not in used:
            used.append(key)
        return nbytes / rates[key]

    cuda = device_type == "cuda"
    link_in, link_out = ("h2d", "d2h") if cuda else ("mem_copy", "mem_copy")
    # each kind's home class ([Note: homes] in tiers/homes.py): what it crosses, at which rate key
    params_at, grads_at, opt_at = (HOMES[placement[kind]] for kind in ("params", "gradients", "optimizer"))
    streamed = not params_at.on_device or s.stage >= 3
    trainable = list(s.unit_order)
    numels = trainable + list(s.frozen)
    works: list[UnitWork] = []
    norm_bytes = 0
    cpu_key, device_key = cpu_rate_key(rates, s.rule, s.state), device_rate_key(rates, s.rule, s.state)
    in_place = shard_in_place(params_at.on_device, s.world_size, s.stage)
    staged = UpdateCosts.of(rates, s.state.bytes_per_param, s.grad_bytes, s.lp_bytes, cuda=cuda,
                            grads_on_device=grads_at.on_device, params_on_device=params_at.on_device,
                            params_in_place=in_place, local_ranks=local_ranks, master_bytes=s.state.master_itemsize,
                            cpu_key=cpu_key, device_key=device_key)
    # [Note: the engine's own time] (engine/overhead.py): its hooks' host time per unit, on a CPU device's cores
    engine_f, engine_b = (0.0, 0.0) if cuda or not compute else \
        (rates.get("engine_forward_s", 0.0), rates.get("engine_backward_s", 0.0))
    for key, value in (("engine_forward_s", engine_f), ("engine_backward_s", engine_b)):
        if value > 0:
            used.append(key)
    for i, n in enumerate(numels):
        is_trainable = i < len(trainable)
        p_shard, g_shard, o_shard = (s.held_shard(n, kind) for kind in ("params", "gradients", "optimizer"))
        unit_opt = HOMES[optimizer_units[i]] if optimizer_units and is_trainable else opt_at
        device_step = is_trainable and i < len(options.on_device) and options.on_device[i] and not unit_opt.on_device
        w = dict(forward_s=compute.forward_s[i] + engine_f if compute else 0.0,
                 backward_s=compute.backward_s[i] + engine_b if compute else 0.0,
                 encloses=bool(compute and compute.encloses[i]), trainable=is_trainable,
                 backward_tail_s=compute.backward_tail_s[i] if compute and compute.backward_tail_s else 0.0)
        if streamed:
            w["fetch_h2d_s"] = secs(s.lp_bytes * n, link_in)
            if params_at.read_rate:  # from a drive (ranks per node share it), then over the link
                w["fetch_nvme_s"] = secs(s.lp_bytes * p_shard * local_ranks, params_at.read_rate)
        if is_trainable:
            if not grads_at.on_device or not cuda:  # the fresh gradient leaves the device (a CPU device: a copy,
                w["grad_d2h_s"] = secs(s.lp_bytes * n, link_out)  # into device gradients' accumulator too)
            if grads_at.write_rate:
                w["grad_write_s"] = secs(s.grad_bytes * g_shard * local_ranks, grads_at.write_rate)
                w["grad_read_s"] = secs(s.grad_bytes * g_shard * local_ranks, grads_at.read_rate)
            elif grads_at.on_device and cuda and not unit_opt.on_device and not device_step:
                w["grad_stage_s"] = secs(s.grad_bytes * o_shard, "d2h")
            norm_bytes += s.grad_bytes * g_shard if grads_at.in_memory else 0  # a file's sums are kept as folded
            if device_step:  # [Note: choosing where each update runs]: staged in, stepped, staged out
                w["device_step"], w["adam_on"] = True, "compute"
                w["adam_s"] = (secs(staged.kernel_bytes * o_shard, device_key) if cuda else
                               secs(o_shard * local_ranks, cpu_key) * staged.cpu_scale)
                w["stage_in_s"] = secs(staged.in_bytes * o_shard, link_in)
                w["stage_out_s"] = secs(staged.out_bytes * o_shard, link_out)
            elif unit_opt.on_device and cuda:
                w["adam_s"], w["adam_on"] = secs(DEVICE_ADAM_BYTES * o_shard, "device_adam"), "compute"
            else:
                w["adam_s"] = secs(o_shard * local_ranks, cpu_key) * staged.cpu_scale  # [Note: the CPU rate's new parameters]
                w["adam_on"] = "cpu" if cuda else "compute"  # a CPU device's compute is the same cores
            if unit_opt.read_rate:  # the unit's state buffers as the store allocates them (Sizes.state_units)
                state = sum(s.state_units[i])
                w["state_read_s"] = secs(state * local_ranks, unit_opt.read_rate)
                w["state_write_s"] = secs(state * local_ranks, unit_opt.write_rate)
                w["state_bytes"] = s.state_units[i]  # its ranges of the packed staging sets
            if speculated and speculated[i] and unit_opt.in_memory:  # the undo copy, and its restore
                undo = undo_bytes(sum(s.state_units[i]), o_shard, s.lp_bytes)
                if unit_opt.on_device and cuda:  # read and written on the device
                    w["undo_s"] = secs(2 * undo, "device_adam")
                else:
                    w["undo_s"] = secs(undo * local_ranks, "mem_copy")
                w["restore_s"] = w["undo_s"]
            w["speculate"] = bool(speculated and speculated[i])
            if params_at.write_rate:
                w["copyback_s"], w["copyback_on"] = secs(s.lp_bytes * o_shard * local_ranks, params_at.write_rate), "nvme"
            elif cuda and not unit_opt.on_device and params_at.on_device and not (device_step and in_place):
                w["copyback_s"] = secs(s.lp_bytes * o_shard, "h2d")  # [Note: the new shard's way home]
        works.append(UnitWork(**w))
    if grads_at.on_device and cuda:  # the global norm: every window, clipping or not (engine/window.py)
        norm_s, norm_on = secs(norm_bytes, "device_adam"), "compute"  # read at the Adam kernel's stream rate
    else:
        norm_s = secs(norm_bytes * local_ranks, "mem_read")  # the node's memory bus
        norm_on = "cpu" if cuda else "compute"
    io_share = rates.get("nvme_cpu_share", 0.0)  # [Note: the drive's share of the cores]
    if io_share > 0 and any(u.fetch_nvme_s or u.grad_write_s or u.state_read_s or u.copyback_on == "nvme" for u in works):
        used.append("nvme_cpu_share")
    shape = StepShape(lookahead=s.lookahead, pipeline_depth=s.pipeline_depth, accum_steps=options.accum_steps,
                      grad_writes=GradStore.nvme_writes_in_flight(), param_writes=ParamStore.writes_in_flight(s.lookahead),
                      clip=options.clip, unit_final=s.world_size == 1,  # overlap/base.py: not sharding.active
                      early_step=options.early_step and not options.dynamic_scale and s.world_size == 1,
                      speculative=speculated is not None, rollback=rollback,
                      state_on_nvme=any(u.state_read_s for u in works), alignment=s.alignment,
                      norm_s=norm_s, norm_on=norm_on,
                      streamed=streamed, cpu_device=not cuda, device_sets=DeviceStaging.SETS, io_share=io_share)
    return simulate(works, shape), tuple(used)


def bound_by(critical: dict[str, float], device_type: str, optimizer_on_device: bool = False) -> str:
    """The resource group with the most seconds on the critical path (the alternatives table)."""
    groups: dict[str, float] = {}
    for component, seconds in critical.items():
        group = BOUND_BY.get(component, component)
        if group == "PCIe" and device_type != "cuda":
            group = "RAM copy"  # a CPU device's host<->device link is a memory copy
        if component == "optimizer" and optimizer_on_device and device_type == "cuda":
            group = "compute"
        groups[group] = groups.get(group, 0.0) + seconds
    return max(groups, key=lambda g: groups[g]) if groups and max(groups.values()) > 0 else "nothing"
