"""Loss scaling for fp16 training: static, or dynamic (skip a step on overflow)."""
from __future__ import annotations

from .config import PrecisionConfig


class LossScaler:
    """Dynamic: start at 2**initial_scale_power; after `hysteresis` overflows halve
    the scale (not below min_loss_scale); after `loss_scale_window` good steps double it.
    Static: a constant (1.0 = no scaling)."""

    def __init__(self, cfg: PrecisionConfig):
        self.dynamic = cfg.loss_scale == "dynamic"
        self.scale = float(2 ** cfg.initial_scale_power) if self.dynamic else float(cfg.loss_scale)
        self.cfg = cfg
        self._good_steps = 0
        self._hysteresis = cfg.hysteresis
        self.skipped_steps = 0

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            self.skipped_steps += 1
            self._good_steps = 0
            self._hysteresis -= 1
            if self._hysteresis <= 0:
                self.scale = max(self.scale / 2, self.cfg.min_loss_scale)
                self._hysteresis = self.cfg.hysteresis
            return
        self._good_steps += 1
        if self._good_steps % self.cfg.loss_scale_window == 0:
            self.scale *= 2
            self._hysteresis = self.cfg.hysteresis

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self._good_steps, "hysteresis": self._hysteresis,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = state["scale"]
        self._good_steps = state["good_steps"]
        self._hysteresis = state["hysteresis"]
        self.skipped_steps = state["skipped_steps"]
