"""Each tier's budget for this rank: "auto" budgets resolved on this node, and what to change
when the NVMe tier has none."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from ..config import TiersConfig
from ..device import local_world_size
from ..envinfo import usable_memory
from ..units import format_size


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


def nvme_off(tiers: TiersConfig) -> str:
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
