"""ZEROTIER_CHECK_PLAN=1: the run's peaks against the plan's terms, after every step.

[Note: the plan against the run's peaks]
The plan sizes each component ([Note: needs per component] in planner.py) with the functions
the stores size their allocations with; this check keeps that true where it runs. The engine
hands the parameter, gradient and optimizer stores their tiers charged to them ([Note: peaks
per component] in tiers/base.py) and, after each step, compares every component's peak of live
bytes on the device and host tiers and on NVMe (its files, with the rewrites in flight) with its
term; a peak above it raises PlanTermExceeded, naming the component, the tier, the term and the
peak. The speculative step's and the delayed update's held blocks are allocated by those stores
(a speculated NVMe unit's new parameters and its state's second files, the delayed update's
staged ones), so their terms on the tier are allowed on top. CI runs the
engine tests with it (.ci/run).
"""
from __future__ import annotations

import os

from ..errors import ZerotierError

ENV = "ZEROTIER_CHECK_PLAN"
CHARGED = ("params", "gradients", "optimizer")  # the stores the engine charges ([Note: peaks per component])
BORROWED = ("speculation", "delayed")           # policies whose held blocks those stores allocate
# terms a store allocates under its own name: the device step's staged state is the optimizer's
# ([Note: the device step's staging memory] in planner/step_on.py)
PART_OF = {"optimizer": ("device_step",)}


class PlanTermExceeded(ZerotierError):
    """A component's peak in a tier above its term in the plan (ZEROTIER_CHECK_PLAN=1)."""

    def __init__(self, message: str, component: str, tier: str, term: int, peak: int):
        super().__init__(message)
        self.component, self.tier, self.term, self.peak = component, tier, term, peak


def enabled() -> bool:
    return os.environ.get(ENV) == "1"


def check_peaks(needs: dict[str, dict[str, int]], **tiers) -> None:
    """[Note: the plan against the run's peaks] Raise PlanTermExceeded for the first component whose
    peak on a tier (`tiers`: name=a BudgetedTier, or None where the run has no such tier) is above
    its term in `needs` (Plan.needs)."""
    for tier_name, tier in tiers.items():
        if tier is None:
            continue
        peaks = tier.component_peaks()
        borrowed = sum(needs.get(c, {}).get(tier_name, 0) for c in BORROWED)
        for component in CHARGED:
            peak = peaks.get(component, 0)
            term = sum(needs.get(c, {}).get(tier_name, 0) for c in (component, *PART_OF.get(component, ())))
            if peak > term + borrowed:
                also = f" (+ {borrowed:,} B the speculative step and the delayed update may hold there)" \
                    if borrowed else ""
                raise PlanTermExceeded(
                    f"{ENV}=1: the {component} held {peak:,} B on the {tier_name} tier, above their planned term "
                    f"of {term:,} B{also}: the plan understates Plan.needs[{component!r}][{tier_name!r}] "
                    f"([Note: needs per component] in zerotier/planner/planner.py); report it with the config, "
                    f"or run without {ENV}", component, tier_name, term, peak)
