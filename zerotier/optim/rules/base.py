"""The update rule seam: what one optimizer algorithm is, apart from where its state lives.

An `UpdateRule` names its state (`state_keys`: "master" first, then its moments, one buffer
and one NVMe file each per unit, [Note: optimizer state layout] in state_layout.py), its bytes
per parameter, the hyper-parameters of a param group, and the update: a native CPU variant over
pieces of a unit's shard through optim/_kernels.py (`cpu_pieces`, which the layout cuts:
`StateLayout.step_pieces`), and a device variant over the same pieces in torch ops (`device_pieces`,
[Note: the update in torch ops] in kernel_math.py), in the same format. The state store
(optim/state_store.py) places, reads and writes whatever keys the rule names; the driver
(optim/offload.py) hands each unit's state views to the rule. A new optimizer is one module
here and one line in `RULES` (rules/__init__.py).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple

import torch

from ...errors import ZerotierError
from .. import _kernels

class HyperTable(NamedTuple):
    """One step's hyper-parameters, as data ([Note: param groups] in torch_optimizer.py): built once
    per step by `engine.optimizer`, read by the driver without calling back. `groups[g]`: group g's
    (the rule's `hyper`); `unit_groups[i]`: the group of each parameter of unit i. Immutable: a
    snapshot stays what it was when an lr scheduler changes the groups afterwards."""

    groups: tuple[NamedTuple, ...]
    unit_groups: tuple[tuple[int, ...], ...]

    def of(self, index: int) -> list[NamedTuple]:
        """Each parameter's hyper-parameters of the unit at `index`."""
        return [self.groups[g] for g in self.unit_groups[index]]


class UpdateRule:
    """One optimizer algorithm. Subclasses set the class attributes and implement `hyper`,
    `group_defaults`, `cpu_pieces` and `device_pieces`."""

    name: str = ""
    state_keys: tuple[str, ...] = ("master",)   # "master" first, then the moments
    nonnegative: frozenset[str] = frozenset()   # moments that hold no negative value (unsigned 8-bit map)
    title: str = ""                             # in messages ("Adam(W)")
    state_title: str = ""                       # whose state a state dict holds, in messages ("Adam")

    @property
    def moment_keys(self) -> tuple[str, ...]:
        return self.state_keys[1:]

    def bytes_per_param(self, master: str = "fp32", moments: str = "fp32") -> float:
        """State bytes per parameter in these dtypes, int8 block scales included."""
        return _kernels.state_bytes_per_param(master, moments, len(self.moment_keys))

    def group_defaults(self, cfg, given: Callable[[str], bool]) -> dict:
        """engine.optimizer's param-group defaults from the optimizer config section."""
        raise NotImplementedError

    hyper_type: type = tuple                     # NamedTuple of one parameter's hyper-parameters
    refused: tuple[str, ...] = ("maximize",)     # param-group flags the rule runs without
    group_keys: str = ""                         # the group's keys, for messages

    def hyper(self, group: Mapping, index: int) -> NamedTuple:
        """A param group's hyper-parameters (`hyper_type`'s fields: beta1 / beta2 from "betas",
        decoupled from "decoupled_weight_decay", the others by name), or a ZerotierError for what
        the rule cannot run."""
        for key in self.refused:
            if group.get(key):
                raise ZerotierError(f"engine.optimizer.param_groups[{index}]['{key}'] = True: zerotier's "
                                    f"{self.title} runs without {key}; set it to False")
        try:
            beta1, beta2 = group["betas"]
            named = {"beta1": beta1, "beta2": beta2}
            return self.hyper_type(*(bool(group["decoupled_weight_decay"]) if f == "decoupled"
                                     else float(named[f] if f in named else group[f]) for f in self.hyper_type._fields))
        except (KeyError, TypeError, ValueError) as exc:
            raise ZerotierError(f"engine.optimizer.param_groups[{index}]: {self.group_keys} must be numbers "
                                f"({type(exc).__name__}: {exc})") from exc

    def cpu_pieces(self, pieces, *, master, grad, out, unit_index: int, shard_lo: int, grad_scale: float,
                   bias_correction: bool, simd: str, threads: int) -> None:
        """One native call over (a, b, step, hyper, {moment key: (values, absmax)}) pieces of a
        shard: master[a:b] and the moments updated in place, out[a:b] the new parameters."""
        raise NotImplementedError

    def device_pieces(self, pieces, *, master, grad, out, unit_index: int, shard_lo: int, grad_scale: float,
                      bias_correction: bool, keep_grad: bool = True) -> None:
        """`cpu_pieces` on tensors of any device (the CPU included), in torch ops: the same pieces, the same
        result in the same format (the int8 maps and block scales, the bf16 master's stochastic rounding
        bits from sr_seed(unit_index, step) + shard_lo + a + i), so that a checkpoint does not care where a
        unit was stepped. The gradient is read, never written, unless `keep_grad` is False (then a
        kernel may leave it scaled: [Note: the fused kernel reads the gradient in place])."""
        raise NotImplementedError

    def device_temp_bytes(self) -> int:
        """Device bytes `device_pieces` allocates at most beside the state (the planner counts them)."""
        raise NotImplementedError
