"""Storage tiers: device (budget + async copies), host (pinned aligned block pool) and
NVMe (swap files). See docs/tiers.md."""
from .base import (BudgetedTier, ChainTicket, DoneTicket, FutureTicket, Tier, TicketLike,
                   align_up, wait_all)
from .device import DeviceTier, EventTicket
from .host import HostBuffer, HostPool
from .nvme import NVMeEntry, NVMeStore, RunDir, scan_stale

__all__ = [
    "Tier", "BudgetedTier", "TicketLike", "ChainTicket", "DoneTicket", "FutureTicket", "EventTicket",
    "align_up", "wait_all",
    "DeviceTier", "HostBuffer", "HostPool", "NVMeEntry", "NVMeStore", "RunDir", "scan_stale",
]
