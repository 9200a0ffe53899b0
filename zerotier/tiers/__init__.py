"""Storage tiers: device (budget + host<->device copies), host (pinned aligned block pool) and
NVMe (swap files). See docs/tiers.md. Their tickets are zerotier.io's."""
from .base import BudgetedTier
from .device import DeviceTier, EventTicket
from .host import HostBuffer, HostPool
from .nvme import NVMeEntry, NVMeStore, RunDir, scan_stale

__all__ = [
    "BudgetedTier", "DeviceTier", "EventTicket", "HostBuffer", "HostPool",
    "NVMeEntry", "NVMeStore", "RunDir", "scan_stale",
]
