"""The update rule seam: what one optimizer algorithm is, apart from where its state lives.

An `UpdateRule` names its state (`state_keys`: "master" first, then its moments, one buffer
and one NVMe file each per unit, [Note: optimizer state layout] in state_layout.py), its bytes
per parameter, the hyper-parameters of a param group, and `apply`: a native CPU variant over
(pieces of) a unit's shard through optim/_kernels.py, and a device variant. The state store
(optim/state_store.py) places, reads and writes whatever keys the rule names; the driver
(optim/offload.py) hands each unit's state views to the rule. A new optimizer is one module
here and one line in `RULES` (rules/__init__.py).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Sequence

import torch

from ...errors import ZerotierError
from .. import _kernels
from ..kernel_math import dequantize_blockwise, quantize_blockwise

HyperOf = Callable[[Any], Sequence[NamedTuple]]  # a unit -> each of its parameters' hyper-parameters


class UpdateRule:
    """One optimizer algorithm. Subclasses set the class attributes and implement `hyper`,
    `group_defaults`, `cpu_pieces` and `apply_device`."""

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

    def apply_device(self, master: torch.Tensor, moments: dict, grad: torch.Tensor, out, *, step: int, hyper,
                     grad_scale: float, bias_correction: bool, keep_grad: bool) -> None:
        """The update of fp32 state on an accelerator (or the CPU device tier), one slice."""
        raise NotImplementedError

    def device_temp_bytes(self) -> int:
        """Device bytes `apply_device` allocates at most beside the state (the planner counts them)."""
        raise NotImplementedError

    def apply_cpu(self, unit_index: int, shard_lo: int, master, moments: dict, grad, out, ranges, *, layout,
                  grad_scale: float, bias_correction: bool, simd: str, threads: int) -> None:
        """The native CPU update over the slices [a, b) of a unit's shard in `ranges` ((a, b,
        step, hyper) each), in one native call. `master` and each of `moments` (by key) are
        `layout.typed` pairs of the unit's layout (`StateLayout.for_unit`); `out` is host memory
        too. A bf16 master is rounded stochastically, seeded by [Note: stochastic rounding seed]
        (kernel_math.py; the unit, the step, and the element's offset in the unit: `shard_lo` +
        the piece's first element). int8 moments go to the kernel one run at a time (codes,
        block scales) and one fp32 range at a time ([Note: small parameters keep fp32 moments]).
        Their blocks start at each run's first element, which parameter slices do not follow:
        when every run a range touches is covered whole, the pieces go to the kernel as they are;
        otherwise (the rare case of [Note: parameters without a gradient] in offload.py) the
        ranges are updated on fp32 copies of the moments (4 B per element and moment), and the
        runs they touch re-quantized once after (a run no range touches keeps its bytes)."""
        master, _ = master
        n, keys = master.numel(), list(moments)
        step_args = dict(master=master, grad=grad, out=out, unit_index=unit_index, shard_lo=shard_lo,
                         grad_scale=grad_scale, bias_correction=bias_correction, simd=simd, threads=threads)
        if all(tail is None for _, tail in moments.values()):  # fp32 / bf16 moments
            self.cpu_pieces([(a, b, step, h, {k: (v[a:b], None) for k, (v, _) in moments.items()})
                             for a, b, step, h in ranges], **step_args)
            return
        slices = {k: layout.pieces(n, values, tail) for k, (values, tail) in moments.items()}
        first = slices[keys[0]]  # every moment has the same runs and fp32 ranges
        whole = all(a <= sa and sb <= b for a, b, _, _ in ranges for sa, sb, _, absmax in first
                    if absmax is not None and max(a, sa) < min(b, sb))
        if whole:
            pieces = []
            for a, b, step, h in ranges:
                for j, (sa, sb, _, _) in enumerate(first):
                    x, y = max(a, sa), min(b, sb)
                    if x < y:  # a whole run, or a part of an fp32 range
                        pieces.append((x, y, step, h, {k: (slices[k][j][2][x - sa: y - sa], slices[k][j][3])
                                                       for k in keys}))
            self.cpu_pieces(pieces, **step_args)
            return
        wide = {}  # the moments as fp32 copies
        for k in keys:
            values = torch.empty(n)
            for a, b, part, absmax in slices[k]:
                values[a:b] = part if absmax is None else dequantize_blockwise(part, absmax, signed=layout.signed(k))
            wide[k] = values
        self.cpu_pieces([(a, b, step, h, {k: (wide[k][a:b], None) for k in keys}) for a, b, step, h in ranges],
                        **step_args)
        for k in keys:
            for a, b, part, absmax in slices[k]:
                if not any(max(a, x) < min(b, y) for x, y, _, _ in ranges):
                    continue  # no range touches it: its bytes stay as they are
                if absmax is None:
                    part.copy_(wide[k][a:b])
                    continue
                codes, scales = quantize_blockwise(wide[k][a:b], signed=layout.signed(k))
                part.copy_(codes)
                absmax.copy_(scales)
