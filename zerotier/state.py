"""Records of what zerotier manages: one `Unit` per module that owns trainable parameters.

[Note: units]
A unit is the set of trainable parameters a module owns *directly*
(`module._parameters`), flattened in registration order. It is the grain of
everything: fetched/released together (ZeRO-3 style), one optimizer sub-group,
one set of NVMe files. Where each kind of its state lives:

  kind          tensor attribute       Location.DEVICE       Location.HOST          Location.NVME
  low-prec p    `p.data` / flats       module's own params   `host_param` (flat)    file `param_key`
  fp32 grad     `grad_flat`            device tensor         host tensor            (never)
  master/m/v    `master`, `exp_avg`..  device tensors        host tensors           files `<key>.master` ...

A parameter whose data lives off the device is *released* between uses:
`p.data` is an empty tensor and `device_flat` is None. It is *resident* while
a fetch has put a view of `device_flat` into every `p.data`.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch


class Location(enum.Enum):
    DEVICE = "device"
    HOST = "host"
    NVME = "nvme"


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(eq=False)
class Unit:
    index: int
    name: str                                  # qualified module name ("" = root)
    params: list[torch.nn.Parameter]
    shapes: list[torch.Size]
    offsets: list[int]                         # element offset of each param in the flat
    numel: int
    param_loc: Location = Location.DEVICE
    grad_loc: Location = Location.DEVICE
    optim_loc: Location = Location.HOST
    # low-precision parameters (see the table in [Note: units])
    host_param: torch.Tensor | None = None     # flat, param dtype, when param_loc is HOST
    device_flat: torch.Tensor | None = None    # flat on the compute device while resident
    # fp32 gradient accumulated over micro-batches
    grad_flat: torch.Tensor | None = None
    grads_seen: int = 0                        # post-accumulate hooks fired this backward
    has_grad: bool = False                     # received a gradient since the last optimizer step
    stepped_early: bool = False                # updated during backward (see engine [Note: early step])
    step: int = 0                              # optimizer steps applied (torch's per-param `step`)
    # optimizer state when not on NVMe
    master: torch.Tensor | None = None
    exp_avg: torch.Tensor | None = None
    exp_avg_sq: torch.Tensor | None = None
    modules: list[str] = field(default_factory=list)  # every module using these params (ties)
    # data-parallel sharding (see [Note: sharding] in dist/sharding.py); one rank: the whole flat
    part: object = None                        # dist.partition.Partition
    shard_lo: int = 0                          # this rank's real elements: [shard_lo, shard_hi)
    shard_hi: int = 0
    grad_shard: torch.Tensor | None = None     # reduced fp32 gradient of this rank's shard (optimizer input)
    param_shard: torch.Tensor | None = None    # stage 3: this rank's low-precision shard (device/host)
    streamed: bool = False                     # params released between uses (offloaded or stage-3 gathered)

    @property
    def key(self) -> str:
        """Stem of this unit's NVMe keys."""
        return f"u{self.index:05d}"

    @property
    def param_key(self) -> str:
        return f"{self.key}.param"

    def views(self, flat: torch.Tensor):
        """(param, view of flat shaped like the param) pairs."""
        for p, shape, off in zip(self.params, self.shapes, self.offsets):
            yield p, flat[off: off + shape.numel()].view(shape)


def build_units(model: torch.nn.Module) -> list[Unit]:
    """One unit per module owning trainable parameters, in module registration order.

    A parameter shared by several modules (tied weights) belongs to the first
    module that registers it; later modules using it are listed in `modules`.
    Frozen parameters (requires_grad=False) are not managed: they stay where
    the model put them.
    """
    units: list[Unit] = []
    owner: dict[int, Unit] = {}
    for mod_name, module in model.named_modules():
        own = [p for p in module._parameters.values() if p is not None and p.requires_grad]
        fresh = [p for p in own if id(p) not in owner]
        for p in own:
            if id(p) in owner and mod_name not in owner[id(p)].modules:
                owner[id(p)].modules.append(mod_name)
        if not fresh:
            continue
        offsets, total = [], 0
        for p in fresh:
            offsets.append(total)
            total += p.numel()
        unit = Unit(index=len(units), name=mod_name, params=fresh, shapes=[p.shape for p in fresh],
                    offsets=offsets, numel=total, modules=[mod_name])
        for p in fresh:
            owner[id(p)] = unit
        units.append(unit)
    return units
