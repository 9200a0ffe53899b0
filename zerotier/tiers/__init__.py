"""Storage tiers: device, host (pinned pool) and NVMe (swap files), and the manager
that moves shards between them. See docs/tiers.md for the design."""
from .base import (BudgetedTier, ChainTicket, DoneTicket, FutureTicket, Tier, TicketLike,
                   align_up, wait_all)
from .device import DeviceTier, EventTicket
from .host import HostBuffer, HostPool
from .manager import LOCATIONS, Shard, TierManager, resolve_budget
from .nvme import NVMeEntry, NVMeStore, RunDir, scan_stale

__all__ = [
    "Tier", "BudgetedTier", "TicketLike", "ChainTicket", "DoneTicket", "FutureTicket", "EventTicket",
    "align_up", "wait_all",
    "DeviceTier", "HostBuffer", "HostPool", "NVMeEntry", "NVMeStore", "RunDir", "scan_stale",
    "LOCATIONS", "Shard", "TierManager", "resolve_budget",
]
