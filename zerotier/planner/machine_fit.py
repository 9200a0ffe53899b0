"""Does a plan that fits its budgets fit the machine it runs on?

[Note: the plan against the machine]
Budgets are what the user allows, not what the node has: a 200 GiB tiers.host on a 23.5 GiB
machine plans "fits" and is OOM-killed mid-run. So the plan's need is checked against the
memory of the node it is for:

  RAM     (host need + the CPU "device" pool when the compute device is the CPU
           + RSS_OUTSIDE_BUDGETS) x ranks on the node   <=  usable_memory().total
  device  device need                                    <=  the GPU's total memory

`usable_memory` caps RAM by the process's cgroup limits ([Note: cgroup memory] in envinfo.py).
With another node's bench file (`zerotier plan --rates FILE`, [Note: another node's rates] in
planning.py) the figures are the ones `zerotier bench` recorded there (`mem.total_bytes`,
`pcie.device_total_bytes`); a file saved before they were recorded is not checked.

The need, not the budget, is compared: an over-committed budget the plan does not use is the
user's business (auto budgets are themselves fractions of what is free). `zerotier plan` says
"fits the budgets, not the machine"; initialize() refuses with a BudgetError before anything is
placed, since the run would be OOM-killed once the state reaches that size (hours in, perhaps).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..units import format_size
from ..envinfo import usable_memory
from ..errors import BudgetError
from ..tiers.host import RSS_OUTSIDE_BUDGETS


@dataclass(frozen=True)
class Machine:
    """A node's memory: RAM as this process may use it, the compute device's (None: the CPU)."""
    ram: int
    device: int | None
    where: str  # "this machine" | "the node of FILE"


def this_machine(device: torch.device) -> Machine:
    gpu = torch.cuda.mem_get_info(device)[1] if device.type == "cuda" else None
    return Machine(usable_memory().total, gpu, "this machine")


def recorded_machine(path: str | Path, device_type: str) -> Machine | None:
    """The memory `zerotier bench` recorded in another node's file (its newest entry, as
    bench.rates_from_file picks it); None when it recorded none."""
    data = json.loads(Path(path).expanduser().read_text())  # rates_from_file has checked it
    entry = max(data["hosts"].values(), key=lambda e: str(e.get("timestamp", "")))
    ram = (entry.get("mem") or {}).get("total_bytes")
    gpu = (entry.get("pcie") or {}).get("device_total_bytes")
    if not isinstance(ram, int) or (device_type == "cuda" and not isinstance(gpu, int)):
        return None
    return Machine(ram, gpu if device_type == "cuda" else None, f"the node of {path}")


def shortfall(need: dict[str, int], machine: Machine, ranks_per_node: int = 1) -> str:
    """[Note: the plan against the machine] What of the plan's need the machine lacks ("" when it
    has room): 'needs 52.6 GiB of RAM, this machine has 23.5 GiB'."""
    ram = (need["host"] + (need["device"] if machine.device is None else 0) + RSS_OUTSIDE_BUDGETS) * ranks_per_node
    over = []
    if ram > machine.ram:
        ranks = f" ({ranks_per_node} ranks)" if ranks_per_node > 1 else ""
        over.append(f"needs {format_size(ram)} of RAM{ranks}, {machine.where} has {format_size(machine.ram)}")
    if machine.device is not None and need["device"] > machine.device:
        over.append(f"needs {format_size(need['device'])} of device memory, {machine.where}'s GPU has "
                    f"{format_size(machine.device)}")
    return "; ".join(over)


def refuse_over(plan_need: dict[str, int], device: torch.device) -> None:
    """initialize(): a BudgetError when this machine lacks memory for the plan's need
    ([Note: the plan against the machine])."""
    from ..device import local_world_size

    short = shortfall(plan_need, this_machine(device), local_world_size())
    if short:
        raise BudgetError(f"the plan fits the budgets, not this machine: it {short}. Lower tiers.host (and "
                          "tiers.device) to what the machine has, with tiers.nvme_path set, so the planner puts "
                          "the rest on NVMe (`zerotier plan` shows where each kind goes)")
