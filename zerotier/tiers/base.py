"""Budgeted byte accounting shared by the device, host and NVMe tiers.

[Note: tier accounting]
Every tier counts *real* bytes it holds against its budget: the host pool counts
aligned blocks (live + cached for reuse), the NVMe store counts file sizes rounded
up to the I/O alignment, the device tier counts the bytes of the tensors it handed
out. `reserve()` is the single place a budget is enforced, so every BudgetError
carries the same facts: tier, requested bytes, free bytes, and what to change.

The tickets the tiers hand back are zerotier.io.ticket's (see [Note: tickets] there).

[Note: peaks per component]
Under ZEROTIER_CHECK_PLAN=1 the engine hands each store (params, gradients, optimizer) its
tiers through `Charged(tier, component)`: every call goes to the tier, and what a call
allocates is charged to that component (a host-pool buffer carries its component to its
free, charged its request rounded up to the alignment: [Note: a reused block's slack is the
cache's] in host.py; a device tensor's is kept by its address, a storage refilled through the view is charged
to it and given back by it; an NVMe file to the component writing its key, from the write's
issue, a rewrite's second file too while in flight, until the file is replaced or its write
fails: a replaced file kept for reuse, [Note: NVMe file recycling] in nvme_files.py, is charged
to nobody, a cache the store trims before it refuses a write, not room the plan must hold).
`component_peaks()` is each component's peak of live bytes, which
the plan's check compares with its term ([Note: needs per component] in planner/planner.py).
Without the check no view exists and nothing is charged.
"""
from __future__ import annotations

import threading

from ..units import format_setting, format_size
from ..errors import BudgetError
from ..tier_names import TIER_NAMES


_charging = threading.local()  # the component the calling thread allocates for, inside a Charged call


def charging() -> str | None:
    """The component this thread's current tier call allocates for ([Note: peaks per component])."""
    return getattr(_charging, "component", None)


class Charged:
    """A tier as one component of the plan uses it ([Note: peaks per component])."""

    def __init__(self, tier: "BudgetedTier", component: str) -> None:
        self._tier, self.component = tier, component

    def __getattr__(self, name: str):
        attr = getattr(self._tier, name)
        if not callable(attr) or name.startswith("__"):
            return attr

        def call(*args, **kwargs):
            outer = charging()
            _charging.component = self.component
            try:
                return attr(*args, **kwargs)
            finally:
                _charging.component = outer
        return call


class BudgetedTier:
    """Thread-safe byte accounting against a fixed budget (see [Note: tier accounting]).

    Subclasses call `reserve()` before they take memory/disk and `release()` after
    they give it back, and `count_in()` / `count_out()` for bytes moved into / out of
    the tier. `hint` is the remedy printed in BudgetError messages.
    """

    def __init__(self, name: str, budget: int, hint: str) -> None:
        if name not in TIER_NAMES:
            raise ValueError(f"tier name must be one of {TIER_NAMES}, got {name!r}")
        if not isinstance(budget, int) or budget < 0:
            raise ValueError(f"{name} tier budget must be a non-negative int of bytes, got {budget!r}")
        self.name = name
        self._budget = budget
        self._hint = hint
        self._acct_lock = threading.Lock()
        self._used = 0
        self._peak = 0
        self._bytes_in = 0
        self._bytes_out = 0
        self._allocations = 0
        self._component_used: dict[str, int] = {}  # [Note: peaks per component]
        self._component_peak: dict[str, int] = {}

    @property
    def budget(self) -> int:
        return self._budget

    @property
    def used(self) -> int:
        return self._used

    @property
    def peak(self) -> int:
        return self._peak

    @property
    def free_bytes(self) -> int:
        return max(self._budget - self._used, 0)

    def reserve(self, nbytes: int, what: str = "") -> None:
        """Account nbytes against the budget or raise BudgetError (nothing is reserved then)."""
        if nbytes < 0:
            raise ValueError(f"{self.name} tier: cannot reserve a negative size ({nbytes})")
        with self._acct_lock:
            if self._used + nbytes > self._budget:
                raise BudgetError(self._budget_message(nbytes, what))
            self._used += nbytes
            self._peak = max(self._peak, self._used)
            self._allocations += 1

    def try_reserve(self, nbytes: int) -> bool:
        """reserve() that answers False instead of raising (no message is built)."""
        with self._acct_lock:
            if self._used + nbytes > self._budget:
                return False
            self._used += nbytes
            self._peak = max(self._peak, self._used)
            self._allocations += 1
            return True

    def release(self, nbytes: int) -> None:
        with self._acct_lock:
            if nbytes < 0 or nbytes > self._used:
                raise AssertionError(
                    f"{self.name} tier accounting error: releasing {nbytes} B with {self._used} B in use")
            self._used -= nbytes

    def charge(self, component: str | None, nbytes: int) -> None:
        """Count `nbytes` (negative: given back) to `component`'s live bytes ([Note: peaks per component])."""
        if component is None:
            return
        with self._acct_lock:
            used = self._component_used.get(component, 0) + nbytes
            self._component_used[component] = used
            if used > self._component_peak.get(component, 0):
                self._component_peak[component] = used

    def component_peaks(self) -> dict[str, int]:
        """Each charged component's peak of live bytes on this tier."""
        with self._acct_lock:
            return dict(self._component_peak)

    def count_in(self, nbytes: int) -> None:
        with self._acct_lock:
            self._bytes_in += nbytes

    def count_out(self, nbytes: int) -> None:
        with self._acct_lock:
            self._bytes_out += nbytes

    def stats(self) -> dict[str, int]:
        """Plain numbers a profiler can sample: current, peak, budget, bytes_in, bytes_out, allocations."""
        with self._acct_lock:
            return {
                "current": self._used,
                "peak": self._peak,
                "budget": self._budget,
                "bytes_in": self._bytes_in,
                "bytes_out": self._bytes_out,
                "allocations": self._allocations,
            }

    def _budget_message(self, nbytes: int, what: str) -> str:
        subject = f" for {what}" if what else ""
        free = self._budget - self._used
        return (
            f"{self.name} tier budget exceeded: requested {_both(nbytes)}{subject}, "
            f"free {_both(free)} of budget {format_size(self._budget)} "
            f"(in use {format_size(self._used)}: this needs a budget of at least "
            f"{format_setting(self._used + nbytes)}). {self._hint}"
        )


def _both(nbytes: int) -> str:
    """'1.50 MiB (1572864 B)': human size plus exact bytes (just '12 B' when small)."""
    human = format_size(nbytes)
    return human if nbytes < 1024 else f"{human} ({nbytes} B)"
