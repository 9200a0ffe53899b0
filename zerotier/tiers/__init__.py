"""Storage tiers: device (budget + host<->device copies), host (pinned aligned block pool) and
NVMe (swap files). See docs/tiers.md. Their tickets are zerotier.io's."""
from .base import BudgetedTier
from .device import DeviceTier, EventTicket
from .host import HostBuffer, HostPool
from .lagging import make_device_tier
from .nvme import NVMeStore, RunDir, scan_stale
from .nvme_files import NVMeEntry

__all__ = [
    "BudgetedTier", "DeviceTier", "EventTicket", "HostBuffer", "HostPool",
    "NVMeEntry", "NVMeStore", "RunDir", "make_device_tier", "scan_stale",
]
