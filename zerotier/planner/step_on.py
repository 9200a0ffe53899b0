"""Where each unit's optimizer update runs: on the CPU or on the device (`Plan.optimizer_step_on`).

[Note: where the update runs]
A unit's optimizer state keeps its home (tiers/homes.py); where its update runs is a second,
separate choice, one per trainable unit in unit index order:

  "cpu"      the native CPU kernel updates the state where it lives (host memory, or an NVMe
             staging set)
  "device"   the state is on the device, or is staged to it, updated there and written back

`optimizer.step_on` chooses: "cpu" or "device" put every host/NVMe unit there; state homed on
the device is updated where it lives whatever the key says ("device"). "auto" puts every
host/NVMe unit on the CPU until the planner weighs the split from the node's rates.
"""
from __future__ import annotations

from collections.abc import Sequence

from ..errors import ConfigError
from ..state import Location
from ..tiers.homes import HOMES

STEP_ON = ("cpu", "device", "auto")  # optimizer.step_on's values (config.py's Literal)


def steps_on(requested: str, homes: Sequence[Location]) -> tuple[str, ...]:
    """Each unit's "cpu" / "device" for `optimizer.step_on = requested`, given each unit's optimizer
    home in unit index order ([Note: where the update runs])."""
    if requested not in STEP_ON:
        raise ConfigError(f"optimizer.step_on: must be one of {', '.join(map(repr, STEP_ON))}, got {requested!r}")
    off_device = "device" if requested == "device" else "cpu"
    return tuple("device" if HOMES[home].on_device else off_device for home in homes)
