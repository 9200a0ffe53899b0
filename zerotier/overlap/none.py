"""`train.overlap = "none"`: nothing of a window's update runs before engine.step() (the NVMe
state reads of the window's last backward still start early: [Note: NVMe optimizer pipeline])."""
from __future__ import annotations

from .base import OverlapPolicy


class NoOverlap(OverlapPolicy):
    """The update runs in the step, after the window's norm ([Note: overlap policies] in base.py)."""

    name = "none"
