"""The Plan: where each kind of state goes, each tier's need, the predicted step, and its text
(`zerotier plan`) and JSON (`zerotier plan --json`) forms."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..optim.rules import AdamW
from ..optim.state_layout import StateLayout
from ..state import DTYPES, TIER_NAMES as TIERS, Location
from ..tiers.host import RSS_OUTSIDE_BUDGETS
from ..units import format_duration, format_size
from .sizes import KINDS, sharding_words


@dataclass(frozen=True)
class Plan:
    placement: dict[str, Location]      # kind -> tier
    # [Note: needs per component] in planner.py: component -> tier -> bytes (model state + working sets)
    needs: dict[str, dict[str, int]]
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
    # [Note: speculation in the plan]: train.overlap's speculation resolved, the rollback rate the expected
    # step assumes (its allowance per tier and the NVMe units' shadow files: needs["speculation"]),
    # which units the prediction speculates (by unit index), the step's commit /
    # rollback / expected / without-speculation seconds, and why speculation is on or off
    speculative: bool = False
    rollback_rate: float = 0.01
    speculation_units: tuple[bool, ...] = ()
    speculation_step_s: dict[str, float] = field(default_factory=dict)
    speculation_note: str = ""
    # [Note: the plan against the machine] in machine_fit.py: what the node lacks for `need` ("": it has room)
    machine_note: str = ""
    # [Note: activation memory] in activations.py: where one micro-batch's saved activations
    # (needs["activations"]) come from ("": not counted)
    activation_source: str = ""
    # [Note: where the update runs] in step_on.py: "cpu" / "device" per trainable unit, in unit index order;
    # the host/NVMe units on each side: side -> (units, params per rank, predicted optimizer seconds);
    # optimizer.step_on as asked
    optimizer_step_on: tuple[str, ...] = ()
    optimizer_step_sides: dict[str, tuple[int, int, float]] = field(default_factory=dict)
    optimizer_step_request: str = "auto"

    @property
    def need(self) -> dict[str, int]:
        """Tier -> bytes this plan uses there: every component's term summed ([Note: needs per component])."""
        return {t: sum(term.get(t, 0) for term in self.needs.values()) for t in TIERS}

    @property
    def speculation_undo_bytes(self) -> dict[str, int]:
        """The speculated units' allowance on host and device ([Note: speculation in the plan])."""
        term = self.needs.get("speculation", {})
        return {"host": term.get("host", 0), "device": term.get("device", 0)}

    @property
    def speculation_nvme_bytes(self) -> int:
        """The NVMe units' shadow state files ([Note: speculation in the plan])."""
        return self.needs.get("speculation", {}).get("nvme", 0)

    @property
    def activation_bytes(self) -> int:
        """One micro-batch's saved activations on the device ([Note: activation memory])."""
        return self.needs.get("activations", {}).get("device", 0)

    @property
    def per_rank_bytes(self) -> int:
        """Model-state bytes per rank (the ZeRO paper's figure; working sets excluded)."""
        return sum(self.state_bytes.values())

    @property
    def rates_measured(self) -> bool:
        """True when the prediction uses at least one rate measured by `zerotier bench` (or passed in)."""
        return any(src in ("measured", "given") for src in self.rate_sources.values())

    def summary(self) -> str:
        sharding = f", {sharding_words(self.stage, self.world_size)}" if self.world_size > 1 or self.stage else ""
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
        if self.optimizer_step_sides:
            lines.append(self._step_on_line())
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

    def _step_on_line(self) -> str:
        """Where the host/NVMe units' updates run ([Note: where the update runs] in step_on.py)."""
        sides = "; ".join(f"{side} {units} units, {params / 1e6:,.1f}M params, {format_duration(s)}"
                          for side, (units, params, s) in self.optimizer_step_sides.items())
        staged = self.needs.get("device_step", {}).get("device", 0)
        return (f"  optimizer step on (optimizer.step_on = {self.optimizer_step_request}): {sides}"
                + (f"; staged on the device {format_size(staged)} (in needed)" if staged else ""))

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
            "needs": {c: dict(term) for c, term in self.needs.items()},
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
            "optimizer_step_on": list(self.optimizer_step_on),
            "optimizer_step_sides": {side: {"units": u, "params": p, "seconds": sec}
                                     for side, (u, p, sec) in self.optimizer_step_sides.items()},
        }


_STATE_CHOICES = (("fp32", "fp32"), ("bf16", "bf16"), ("bf16", "int8"))  # what `plan` compares


def _state_dtypes_line(layout: StateLayout) -> str:
    """The optimizer state's B/param and what each precision.master_dtype / moment_dtype choice saves."""
    def bpp(master, moments):
        return replace(layout, master=master, moments=moments).bytes_per_param
    choices = " -> ".join(f"{m}/{v} {bpp(m, v):.4g}" for m, v in _STATE_CHOICES)
    saved = 1 - layout.bytes_per_param / bpp("fp32", "fp32")
    adamw = layout.keys == AdamW.state_keys
    return (f"  optimizer state{'' if adamw else ' (' + ', '.join(layout.keys) + ')'}: master {layout.master}, "
            f"moments {layout.moments}: {layout.bytes_per_param:.4g} B/param"
            + (f" ({saved:.0%} less than fp32)" if saved else " (exact: torch AdamW's state)" if adamw else " (fp32)")
            + f"; master/moments B/param: {choices} (precision.master_dtype, precision.moment_dtype)")


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
