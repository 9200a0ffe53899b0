"""Overlap policies: what of a window's update runs during its last backward, or during the next
window ([Note: overlap policies] in base.py). A policy is one module here and one entry in
POLICIES; `policy_for` is the one place that chooses it, for the planner and for the engine."""
from __future__ import annotations

from .base import OverlapPolicy
from .delayed import Delayed
from .early import EarlyStep
from .none import NoOverlap
from .speculative import AutoSpeculative, Speculative

POLICIES: dict[str, type[OverlapPolicy]] = {
    "none": NoOverlap,
    "auto": AutoSpeculative,
    "early": EarlyStep,
    "speculative": Speculative,
    "delayed": Delayed,
}


def policy_for(cfg) -> type[OverlapPolicy]:
    """The overlap policy class of a Config: what the planner predicts and the engine runs."""
    return POLICIES[cfg.train.overlap]


def make_policy(rt, window, optimizer) -> OverlapPolicy:
    """The engine's policy object, for its Window: over the runtime record ([Note: the runtime record]
    in engine/runtime.py) and engine.optimizer (the hyper-parameters each update uses)."""
    return policy_for(rt.settings.cfg)(rt, window, optimizer)
