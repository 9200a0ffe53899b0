"""A home per tier: where one piece of state lives at rest, and its two moves.

[Note: homes]
A store keeps each unit's state (its low-precision parameters, its gradient accumulator) in a
`Home` of the tier the plan placed it on, and moves it with the same verbs whatever the tier:

  reserve(key, numel, dtype, tiers)   take the room on the tier (counted against its budget)
  read_into(dst, after) -> ticket     the home's bytes into `dst` (a device tensor; on NVMe a
                                      pool block too): a fetch, or a staging for a gather
  write_from(src) -> ticket | None    `src` (a device tensor or a pool block) into the home;
                                      None when it was copied on the spot
  view() -> tensor | None             the state itself, to update in place; None on NVMe
  release()                           give the room back to its tier
  undoable() -> Undo                  keep what undoes the next update (an undo copy on the home's
                                      tier, or for a file the update's write diverted to its twin)
  nbytes, blocks_at_rest, blocks_per_move    its own byte and host-pool block counts
  plan_bytes(numel, itemsize)         (on the class) the bytes per tier one home takes: the
                                      planner's figure, by the code reserve() sizes with

So a store chooses the home's class once (`HOMES[location]`) and never branches on the tier
again; what differs is a home's capability (`in_memory`: `view()` is the state, else None for a
file; `on_device` for a home compute reads where it is; `memory_tier` for the tier its bytes in
flight are held on; `checked_at_read` for a write the next
read checks; `read_rate`/`write_rate` for the rate key of the drive a move crosses beyond the
host, which the planner's step prediction reads). Each move is
bracketed by its tiers' accounting (Gemini's `chunk.shard_move`): a read from NVMe takes a
pool block, reads the file into it, copies it to the device and gives the block back behind
the copy's ticket ([Note: deferred free] in host.py); a write from the device stages through
a pool block the same way. A move's other end is a device tensor, a pool block, or `HostBytes` (a
host tensor the move reads or writes as it is: the optimizer's staging sets, checkpoint buffers).
A new tier is a `Home` subclass here and one `HOMES` entry.
"""
from __future__ import annotations

import torch

from typing import NamedTuple

from ..io.ticket import CompletedTicket
from ..state import Location
from ..tier_names import TIER_NAMES


class Tiers:
    """The tiers a home may move through: the device tier, the host pool, the NVMe store (or None)."""

    __slots__ = ("device", "host", "nvme")

    def __init__(self, device, host, nvme=None) -> None:
        self.device, self.host, self.nvme = device, host, nvme


class HostBytes(NamedTuple):
    """A host tensor a move reads into or writes from as it is (not a device tensor to copy over
    the link): file I/O on it is zero-copy when it is aligned and `padded` (its storage has room
    for the aligned length after it, the mover's to overwrite: [Note: NVMe layout] in nvme.py)."""

    tensor: torch.Tensor
    padded: bool = False


class Home:
    """One piece of state at rest on one tier ([Note: homes])."""

    location: Location
    in_memory = False       # view() is the state itself (device or host memory); else a file
    on_device = False       # compute reads it where it is (no copy to the device)
    memory_tier = Location.HOST  # the tier its bytes in flight (staging, an update's new output) are held on
    checked_at_read = False  # a write into it is checked by the next read, not joined by compute
    blocks_at_rest = 0      # host-pool blocks one home holds
    blocks_per_move = 0     # host-pool blocks one read or write holds while it is in flight
    read_rate: "str | None" = None   # the rate key of a read beyond the host (a drive), for the step prediction
    write_rate: "str | None" = None  # the same for a write

    def __init__(self, key: str, numel: int, dtype: torch.dtype, tiers: Tiers) -> None:
        self.key, self.numel, self.dtype, self.tiers = key, numel, dtype, tiers

    @property
    def name(self) -> str:
        """The tier's name ("device", "host", "nvme")."""
        return self.location.value

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @staticmethod
    def state_bytes(numel: int, itemsize: float) -> int:
        """Bytes of `numel` elements of `itemsize` bytes (a float for a mixed state: rounded)."""
        return round(numel * itemsize)

    @classmethod
    def plan_bytes(cls, numel: int, itemsize: float) -> dict[str, int]:
        """The bytes per tier a home of `numel` elements takes, as reserve() sizes it (the host pool
        rounds a block up to io.alignment: the planner counts that per block)."""
        need = dict.fromkeys(TIER_NAMES, 0)
        need[cls.location.value] = cls.state_bytes(numel, itemsize)
        return need

    @classmethod
    def reserve(cls, key: str, numel: int, dtype: torch.dtype, tiers: Tiers) -> "Home":
        raise NotImplementedError

    def view(self) -> "torch.Tensor | None":
        return None

    def padded_view(self) -> "torch.Tensor | None":
        """The state as an aligned host tensor with its padding (a pool block's: file I/O on it is
        zero-copy), or None where it is not one."""
        return None

    def read_into(self, dst, after=None):
        raise NotImplementedError

    def write_from(self, src):
        raise NotImplementedError

    def release(self) -> None:
        """Give the home's room back to its tier (the state is gone)."""

    def undoable(self) -> "Undo":
        """Keep what undoes the next update of this state ([Note: speculative step] in
        overlap/speculative.py), until the Undo's commit() or restore()."""
        raise NotImplementedError


class Undo:
    """What undoes one home's update: `held` bytes on the home's `memory_tier` while it lives."""

    held = 0

    def commit(self) -> None:
        """The update stands: what undoes it goes."""

    def restore(self) -> int:
        """The update is undone: the home holds its state from before it. Returns the bytes copied."""
        return 0


def tensor_of(buf) -> torch.Tensor:
    """The tensor of a pool block (HostBuffer), of HostBytes, or a device tensor."""
    return buf if isinstance(buf, torch.Tensor) else buf.tensor


class _MemoryHome(Home):
    """A home in memory (device or host): `view()` is the state; moves are copies."""

    in_memory = True

    def __init__(self, key: str, tensor: torch.Tensor, tiers: Tiers, block=None) -> None:
        super().__init__(key, tensor.numel(), tensor.dtype, tiers)
        self.tensor, self.block = tensor, block

    def view(self) -> torch.Tensor:
        return self.tensor

    def undoable(self) -> "Undo":
        """An undo copy of the state, reserved on the home's own tier."""
        copy = type(self).reserve(f"{self.key} undo", self.numel, self.dtype, self.tiers)
        copy.tensor.copy_(self.tensor)
        return _CopyUndo(self, copy)

    def write_from(self, src):
        """On the home's side of the host/device link a copy on the spot (None), else over the link."""
        src = tensor_of(src)
        if self.tensor.device.type == src.device.type:
            self.tensor.copy_(src)
            return None
        link = self.tiers.device.copy_h2d if self.tensor.device.type != "cpu" else self.tiers.device.copy_d2h
        return link(self.tensor, src)


class _CopyUndo(Undo):
    """A memory home's undo: a copy of its state from before the update, on its tier."""

    def __init__(self, home: _MemoryHome, copy: _MemoryHome) -> None:
        self.home, self.copy, self.held = home, copy, copy.nbytes

    def commit(self) -> None:
        self.copy.release()

    def restore(self) -> int:
        self.home.tensor.copy_(self.copy.tensor)
        self.copy.release()
        return self.copy.nbytes


class DeviceHome(_MemoryHome):
    """A budgeted tensor on the device tier."""

    location = Location.DEVICE
    on_device = True
    memory_tier = Location.DEVICE

    @classmethod
    def reserve(cls, key: str, numel: int, dtype: torch.dtype, tiers: Tiers) -> "DeviceHome":
        return cls(key, tiers.device.alloc((numel,), dtype, key), tiers)

    def read_into(self, dst, after=None):
        """Into another device tensor (a copy on the compute stream) or into HostBytes (a copy now)."""
        tensor_of(dst).copy_(self.tensor)
        return CompletedTicket(self.nbytes)

    def release(self) -> None:
        self.tiers.device.free(self.tensor)


class HostHome(_MemoryHome):
    """A host-pool block (pinned and aligned on a CUDA machine)."""

    location = Location.HOST
    blocks_at_rest = 1

    @classmethod
    def reserve(cls, key: str, numel: int, dtype: torch.dtype, tiers: Tiers) -> "HostHome":
        block = tiers.host.alloc(cls.state_bytes(numel, dtype.itemsize), dtype, key)
        return cls(key, block.tensor, tiers, block)

    def padded_view(self) -> torch.Tensor:
        return self.tensor

    def read_into(self, dst, after=None):
        """Into a device tensor, over the link (after `after`, a device_tier.mark()); into HostBytes,
        a copy now."""
        if isinstance(dst, HostBytes):
            dst.tensor.copy_(self.tensor)
            return CompletedTicket(self.nbytes)
        return self.tiers.device.copy_h2d(dst, self.tensor, after=after)

    def release(self) -> None:
        self.tiers.host.free(self.block)


class NVMeHome(Home):
    """The NVMe file `<key>.swp`; every move goes through a host-pool block ([Note: NVMe layout] in
    nvme.py). A write is checked when the home is next read ([Note: a failed write-back] in
    params_writes.py). `writes_to`: the file a write goes to, `key` but while an undoable update
    is in flight its twin `<key>~1` (or back): the state from before stays in `key`."""

    location = Location.NVME
    checked_at_read = True
    blocks_per_move = 1
    read_rate, write_rate = "nvme_read", "nvme_write"

    def __init__(self, key: str, numel: int, dtype: torch.dtype, tiers: Tiers) -> None:
        super().__init__(key, numel, dtype, tiers)
        self.writes_to = key

    @classmethod
    def reserve(cls, key: str, numel: int, dtype: torch.dtype, tiers: Tiers) -> "NVMeHome":
        return cls(key, numel, dtype, tiers)  # the file's room is taken by its first write

    def undoable(self) -> "Undo":
        """The update writes the twin file; the current one is the undo (no copy)."""
        self.writes_to = self.key[:-2] if self.key.endswith("~1") else f"{self.key}~1"
        return _TwinUndo(self)

    def read_into(self, dst, after=None):
        """Into a pool block or HostBytes (the file's bytes, zero-copy where they are aligned), or
        into a device tensor through a pool block: the block goes back to the pool behind the
        copy's ticket."""
        if isinstance(dst, HostBytes):
            return self.tiers.nvme.read(self.key, dst.tensor, padded=dst.padded)
        if not isinstance(dst, torch.Tensor):
            return self.tiers.nvme.read(self.key, dst)
        pool = self.tiers.host
        block = pool.alloc(self.nbytes, self.dtype, self.key)
        try:
            self.tiers.nvme.read(self.key, block).wait()
            ticket = self.tiers.device.copy_h2d(dst, block.tensor, after=after)
        except BaseException:
            pool.free(block)
            raise
        pool.free(block, after=ticket)
        return ticket

    def write_from(self, src):
        """From a pool block or HostBytes (read by the write until its ticket is done), or from a
        device tensor through a pool block (copied out now: the caller may reuse `src` when this
        returns)."""
        if not isinstance(src, torch.Tensor):
            return self.tiers.nvme.write(self.writes_to, tensor_of(src) if isinstance(src, HostBytes) else src)
        pool = self.tiers.host
        block = pool.alloc(self.nbytes, self.dtype, self.key)
        try:
            self.tiers.device.copy_d2h(block.tensor, src).wait()  # the file write reads the block
            ticket = self.tiers.nvme.write(self.writes_to, block)
        except BaseException:
            pool.free(block)
            raise
        pool.free(block, after=ticket)
        return ticket


class _TwinUndo(Undo):
    """An NVMe home's undo: its current file, while the update writes the twin."""

    def __init__(self, home: NVMeHome) -> None:
        self.home = home

    def commit(self) -> None:
        self.home.key = self.home.writes_to  # the update's writes have landed (the caller waited)

    def restore(self) -> int:
        self.home.writes_to = self.home.key
        return 0


HOMES: dict[Location, type[Home]] = {home.location: home for home in (DeviceHome, HostHome, NVMeHome)}
