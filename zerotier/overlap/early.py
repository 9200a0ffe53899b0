"""`train.overlap = "early"`: a unit's Adam update during the window's last backward, as soon as
its gradient is final, where that is exact; elsewhere as "auto" (speculated).

[Note: early step]
Opt-in (`train.overlap = "early"`): the update becomes visible before step(), so
zero_grad(), p.grad = ..., a user's clip_grad_norm_ or a second backward between the
window's last backward and step() cannot be honoured and are refused (base.STARTED). Off
(the default), nothing changes before step() and the window can be dropped exactly;
measured cost of off on CPU in docs/design.md. With it on:
when no global operation stands between a gradient and its update — no
clipping, no dynamic loss scale (whose overflow check needs every gradient),
and this backward ends an accumulation window — a unit's Adam update starts on
the optimizer thread as soon as all its gradients are final (its last
post-accumulate-grad hook), overlapping the rest of backward. It is exact: the
update uses the same gradient, lr and step count as it would after backward,
and no later part of this backward reads the unit's parameters (autograd runs a
leaf's AccumulateGrad once, after every use). engine.step() waits for these
updates, then steps the remaining units. Otherwise the window speculates as
"auto" does ([Note: speculative step] in speculative.py), or, with optimizer state
on NVMe, the unit's state reads start at that moment instead (they do not depend
on the gradient norm): see [Note: NVMe optimizer pipeline].
"""
from __future__ import annotations

from .speculative import AutoSpeculative


class EarlyStep(AutoSpeculative):
    """[Note: early step]"""

    name = "early"
    early_step = True

    def on_unit_final(self, last_micro: bool):
        e = self.rt
        if e.settings.cfg.train.max_grad_norm is None and not e.scaler.dynamic and last_micro and not e.sharding.active:
            return self._start_early
        return super().on_unit_final(last_micro)

    def _start_early(self, unit) -> None:
        """Update `unit` on the optimizer thread while backward goes on."""
        e, scale = self.rt, 1.0 / self.rt.scaler.scale

        def update(hypers):
            # step() waits for the writes; the window's norm reads this gradient again
            e.unit_optimizer.update([unit], e.grads, e.params, hypers, scale, drain=False, keep_grads=True)
        self.on_optimizer_thread(unit, update)
