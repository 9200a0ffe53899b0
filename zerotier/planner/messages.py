"""PlanDoesNotFit and the words of a refusal: what does not fit, and how much more of which
tier would place it."""
from __future__ import annotations

from ..errors import BudgetError
from ..state import Location
from ..units import format_size
from .sizes import Sizes, bytes_for, sharding_words


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


def split_does_not_fit(units_on: tuple[Location, ...], short: dict[str, int], s: Sizes,
                        budgets: dict[str, int]) -> str:
    parts = {loc: units_on.count(loc) for loc in dict.fromkeys(units_on)}
    shown = ", ".join(f"{loc.value} {k} of {len(units_on)} units" for loc, k in parts.items())
    more = " and ".join(f"{format_size(b)} more {t} (tiers.{t} is {format_size(budgets[t])})"
                        for t, b in short.items())
    return (f"the optimizer of {s.numel:,} parameters split as offload.optimizer asks ({shown}) does not fit "
            f"within the tier budgets; it would take {more}, or a split with more of it on another tier")


def does_not_fit(kind: str, candidates: list[Location], s: Sizes, free: dict[str, int],
                  budgets: dict[str, int], nvme_off: str) -> tuple[str, list[dict]]:
    texts, options = [], []
    for loc in candidates:
        want = bytes_for(kind, loc, s)
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
        per_rank = f" ({s.rank_numel(kind):,} per rank: {sharding_words(s.stage, s.world_size)}; budgets are per rank)"
    message = (f"the {kind} of {s.numel:,} parameters{per_rank} {'does' if kind == 'optimizer' else 'do'} not fit within the tier budgets; "
               f"it would take: " + "; or ".join(texts))
    return message, options


def device_step_does_not_fit(staging: int, free: int, budget: int) -> str:
    """optimizer.step_on = "device" without device room for the staged units ([Note: the device step's
    staging memory] in step_on.py)."""
    return (f"optimizer.step_on = 'device' stages the state of the units it updates on the device: "
            f"{format_size(staging)} of device memory for its staging sets (the largest such unit's state, output "
            f"and staged gradient), and {format_size(max(free, 0))} of tiers.device ({format_size(budget)}) is left "
            f"after the rest of the plan: raise tiers.device by {format_size(staging - free)}, or set "
            f"optimizer.step_on = 'auto' (it keeps units on the CPU where the device lacks room) or 'cpu'")
