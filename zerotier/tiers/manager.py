"""TierManager: owns the device, host and NVMe tiers and moves shards between them.

[Note: shard moves]
`move(shard, dst)` issues the transfer and returns a ticket at once; the shard's
`location` keeps naming the tier that holds valid bytes until the transfer has
completed, and only then is the source released (host block back to the pool,
device bytes back to the budget, swap file unlinked). If the transfer fails the
destination is released instead and the shard stays where it was, intact; the
error (a TierIOError naming file and tier) surfaces from the ticket's wait().
NVMe <-> device moves are staged through a host block from the HostPool, held
for the duration of the move; a stager thread waits for the first hop and issues
the second. Bytes in flight are bounded by io.max_inflight_bytes: move() blocks
until enough earlier moves have completed (a single shard larger than the bound
still moves, alone). Completion bookkeeping runs once, in whichever thread first
observes it (the caller's wait()/done(), or move() while throttling).
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import psutil
import torch

from ..config import IOConfig, TiersConfig
from ..errors import BudgetError, ZerotierError
from .base import ChainTicket, DoneTicket, FutureTicket, align_up, wait_all
from .device import DeviceTier
from .host import HostBuffer, HostPool
from .nvme import NVMeStore

log = logging.getLogger(__name__)

LOCATIONS = ("device", "host", "nvme")
_AUTO_INFLIGHT = 1 << 30


@dataclass(eq=False)
class Shard:
    """One tensor shard and where its bytes live.

    Exactly one of device_tensor / host_buf / nvme_key is set, the one `location`
    names — except while a move is in flight (`pending` is its ticket), when the
    destination's is being filled and the source's still holds valid bytes.
    """

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    location: str
    device_tensor: torch.Tensor | None = None
    host_buf: HostBuffer | None = None
    nvme_key: str | None = None
    pending: object | None = field(default=None, repr=False)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def resolve_budget(tier: str, value, device: torch.device) -> int:
    """An int budget for tiers.<tier>; "auto" becomes a share of what this node has:
    device: 90% of GPU memory (CPU device: 25% of RAM); host: 50% of available RAM.
    (nvme "auto" is resolved by NVMeStore: 90% of free disk at tiers.nvme_path.)"""
    if value != "auto":
        return int(value)
    if tier == "device":
        if device.type == "cuda":
            return int(torch.cuda.get_device_properties(device).total_memory * 0.9)
        return int(psutil.virtual_memory().total * 0.25)
    if tier == "host":
        return int(psutil.virtual_memory().available * 0.5)
    raise ValueError(f"no auto budget rule for tier {tier!r}")


class TierManager:
    """The three tiers plus move(shard, dst) between any two of them (see [Note: shard moves])."""

    def __init__(self, tiers_cfg: TiersConfig, io_cfg: IOConfig,
                 device: torch.device | str | None = None) -> None:
        dev = torch.device(device) if device is not None else \
            torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.device = DeviceTier(resolve_budget("device", tiers_cfg.device, dev), dev)
        self.host = HostPool(resolve_budget("host", tiers_cfg.host, dev), alignment=io_cfg.alignment,
                             pin=self.device.is_cuda)
        self.nvme: NVMeStore | None = None
        if tiers_cfg.nvme != 0:
            try:
                self.nvme = NVMeStore(tiers_cfg, io_cfg)
            except BaseException:
                self.host.close()
                self.device.close()
                raise
        self.max_inflight_bytes = _AUTO_INFLIGHT if io_cfg.max_inflight_bytes == "auto" \
            else int(io_cfg.max_inflight_bytes)
        self._alignment = io_cfg.alignment
        # Stager: waits for hop 1 of an nvme<->device move and issues hop 2.
        self._stager = ThreadPoolExecutor(max_workers=2, thread_name_prefix="zt-stage")
        self._cond = threading.Condition()
        self._inflight: deque = deque()       # tickets of moves in flight, oldest first
        self._inflight_bytes = 0
        self._issue_lock = threading.Lock()
        self._shards: dict[str, Shard] = {}
        self._moved: dict[str, dict[str, int]] = {}  # "src->dst" -> {"bytes", "count"}
        self._closed = False

    # --------------------------------------------------------------- shards

    def tier(self, name: str):
        if name not in LOCATIONS:
            raise ValueError(f"unknown tier {name!r}; tiers are {LOCATIONS}")
        t = getattr(self, name)
        if t is None:
            raise BudgetError("nvme tier is disabled (tiers.nvme = 0): set tiers.nvme and tiers.nvme_path "
                              "to offload to NVMe")
        return t

    def place(self, key: str, tensor: torch.Tensor, at: str = "host") -> Shard:
        """Register a new shard holding a copy of `tensor` on tier `at` (synchronous)."""
        if key in self._shards:
            raise ValueError(f"tier manager: shard {key!r} already exists")
        tier = self.tier(at)
        shard = Shard(key=key, shape=tuple(tensor.shape), dtype=tensor.dtype, location=at)
        if at == "device":
            shard.device_tensor = tier.alloc(shard.shape, shard.dtype, what=f"shard '{key}'")
            shard.device_tensor.copy_(tensor)
        elif at == "host":
            shard.host_buf = tier.alloc(shard.nbytes, shard.dtype, what=f"shard '{key}'")
            shard.host_buf.view(shard.shape).copy_(tensor)
            tier.count_in(shard.nbytes)
        else:
            tier.write(key, tensor).wait()
            shard.nvme_key = key
        self._shards[key] = shard
        return shard

    def get(self, shard: Shard) -> torch.Tensor:
        """The shard's tensor where it lives now (device or host); waits for a pending move."""
        self.wait(shard)
        if shard.location == "device":
            return shard.device_tensor
        if shard.location == "host":
            return shard.host_buf.view(shard.shape)
        raise ValueError(f"shard {shard.key!r} is on nvme: move it to host or device first")

    def wait(self, shard: Shard) -> None:
        """Wait for the shard's move in flight, if any (its error is raised)."""
        pending = shard.pending
        if pending is not None:
            pending.wait()

    def drop(self, shard: Shard) -> None:
        """Forget the shard and free its bytes wherever they are."""
        _quiet_wait(shard.pending)
        if shard.location == "device":
            self.device.free(shard.device_tensor)
            shard.device_tensor = None
        elif shard.location == "host":
            self.host.free(shard.host_buf)
            shard.host_buf = None
        elif shard.nvme_key is not None:
            self.nvme.free(shard.nvme_key)
            shard.nvme_key = None
        self._shards.pop(shard.key, None)

    # ---------------------------------------------------------------- moves

    def move(self, shard: Shard, dst: str):
        """Start moving shard to tier `dst`; returns a ticket (wait() -> bytes moved).

        Raises BudgetError now if the destination (or the host staging block) cannot
        hold it; blocks while io.max_inflight_bytes are in flight.
        """
        if dst not in LOCATIONS:
            raise ValueError(f"unknown tier {dst!r}; tiers are {LOCATIONS}")
        if self._closed:
            raise ZerotierError("tier manager is closed")
        self.tier(dst)
        nbytes = shard.nbytes
        while True:
            _quiet_wait(shard.pending)  # one move per shard at a time
            if shard.location == dst:
                return DoneTicket(0)
            self._admit(nbytes)
            with self._issue_lock:
                if shard.pending is not None:  # another thread won the race: retry
                    self._retire(None, nbytes)
                    continue
                try:
                    ticket = self._issue(shard, dst, nbytes)
                except BaseException:
                    self._retire(None, nbytes)
                    raise
                shard.pending = ticket
                with self._cond:
                    self._inflight.append(ticket)
                return ticket

    def synchronize(self) -> None:
        """Wait for every move in flight; raise the first failure."""
        with self._cond:
            tickets = list(self._inflight)
        wait_all(tickets)

    def _admit(self, nbytes: int) -> None:
        """Block until nbytes more fit under max_inflight_bytes (or nothing is in flight)."""
        while True:
            with self._cond:
                if self._inflight_bytes == 0 or self._inflight_bytes + nbytes <= self.max_inflight_bytes:
                    self._inflight_bytes += nbytes
                    return
                oldest = self._inflight[0] if self._inflight else None
                if oldest is None:  # admitted by another thread, not yet issued
                    self._cond.wait(0.01)
                    continue
            _quiet_wait(oldest)  # runs its bookkeeping, which frees in-flight bytes

    def _retire(self, ticket, nbytes: int) -> None:
        with self._cond:
            self._inflight_bytes -= nbytes
            if ticket is not None:
                try:
                    self._inflight.remove(ticket)
                except ValueError:
                    pass
            self._cond.notify_all()

    def _issue(self, shard: Shard, dst: str, nbytes: int) -> ChainTicket:
        src = shard.location
        inner, on_ok, on_fail = getattr(self, f"_{src}_to_{dst}")(shard)

        def finish(outcome: int | BaseException) -> int:
            try:
                if isinstance(outcome, BaseException):
                    on_fail()
                    if hasattr(outcome, "add_note"):
                        outcome.add_note(f"while moving shard {shard.key!r} from {src} to {dst}; "
                                         f"the shard is intact on {src}")
                    raise outcome
                on_ok()
                shard.location = dst
                if src == "host":
                    self.host.count_out(nbytes)
                if dst == "host":
                    self.host.count_in(nbytes)
                with self._cond:
                    rec = self._moved.setdefault(f"{src}->{dst}", {"bytes": 0, "count": 0})
                    rec["bytes"] += nbytes
                    rec["count"] += 1
                return nbytes
            finally:
                shard.pending = None
                self._retire(ticket, nbytes)

        ticket = ChainTicket(inner, finish)
        return ticket

    # Each _<src>_to_<dst> allocates the destination, issues the transfer and returns
    # (ticket, on_ok, on_fail). Allocation errors (BudgetError) raise before any I/O.

    def _host_to_device(self, s: Shard):
        dev = self.device.alloc(s.shape, s.dtype, what=f"shard '{s.key}'")
        try:
            t = self.device.copy_h2d(dev, s.host_buf.view(s.shape))
        except BaseException:
            self.device.free(dev)
            raise

        def ok():
            self.host.free(s.host_buf)
            s.host_buf, s.device_tensor = None, dev
        return t, ok, lambda: self.device.free(dev)

    def _device_to_host(self, s: Shard):
        hb = self.host.alloc(s.nbytes, s.dtype, what=f"shard '{s.key}'")
        try:
            t = self.device.copy_d2h(hb.view(s.shape), s.device_tensor)
        except BaseException:
            self.host.free(hb)
            raise

        def ok():
            self.device.free(s.device_tensor)
            s.device_tensor, s.host_buf = None, hb
        return t, ok, lambda: self.host.free(hb)

    def _host_to_nvme(self, s: Shard):
        t = self.nvme.write(s.key, s.host_buf.view(s.shape))  # zero copy: pool blocks are aligned

        def ok():
            self.host.free(s.host_buf)
            s.host_buf, s.nvme_key = None, s.key
        return t, ok, _nothing

    def _nvme_to_host(self, s: Shard):
        hb = self.host.alloc(s.nbytes, s.dtype, what=f"shard '{s.key}'")
        try:
            t = self.nvme.read(s.nvme_key, hb)
        except BaseException:
            self.host.free(hb)
            raise

        def ok():
            self.nvme.free(s.nvme_key)
            s.nvme_key, s.host_buf = None, hb
        return t, ok, lambda: self.host.free(hb)

    def _nvme_to_device(self, s: Shard):
        hb = self.host.alloc(s.nbytes, s.dtype, what=f"staging shard '{s.key}' nvme->device")
        try:
            dev = self.device.alloc(s.shape, s.dtype, what=f"shard '{s.key}'")
        except BaseException:
            self.host.free(hb)
            raise
        try:
            read = self.nvme.read(s.nvme_key, hb)
        except BaseException:
            self.host.free(hb)
            self.device.free(dev)
            raise

        def stage() -> int:  # stager thread: hop 1 done -> issue hop 2
            read.wait()
            return self.device.copy_h2d(dev, hb.view(s.shape)).wait()

        def ok():
            self.host.free(hb)
            self.nvme.free(s.nvme_key)
            s.nvme_key, s.device_tensor = None, dev

        def fail():
            self.host.free(hb)
            self.device.free(dev)
        return FutureTicket(self._stager.submit(stage), keepalive=(hb, dev)), ok, fail

    def _device_to_nvme(self, s: Shard):
        # Fail now, not on the stager thread, if the NVMe budget cannot hold the shard.
        need = align_up(s.nbytes, self._alignment)
        self.nvme.reserve(need, f"shard '{s.key}'")
        self.nvme.release(need)
        hb = self.host.alloc(s.nbytes, s.dtype, what=f"staging shard '{s.key}' device->nvme")
        try:
            copy = self.device.copy_d2h(hb.view(s.shape), s.device_tensor)
        except BaseException:
            self.host.free(hb)
            raise

        def stage() -> int:
            copy.wait()
            self.nvme.write(s.key, hb.view(s.shape)).wait()
            return s.nbytes

        def ok():
            self.host.free(hb)
            self.device.free(s.device_tensor)
            s.device_tensor, s.nvme_key = None, s.key
        return FutureTicket(self._stager.submit(stage), keepalive=hb), ok, lambda: self.host.free(hb)

    # ---------------------------------------------------------------- stats

    def stats(self) -> dict:
        """Per tier figures (current, peak, budget, bytes_in, bytes_out, ...) plus bytes
        moved per "src->dst" pair and the in-flight bound."""
        with self._cond:
            moved = {k: dict(v) for k, v in self._moved.items()}
            inflight = self._inflight_bytes
        return {
            "device": self.device.stats(),
            "host": self.host.stats(),
            "nvme": self.nvme.stats() if self.nvme is not None else None,
            "moved": moved,
            "inflight_bytes": inflight,
            "max_inflight_bytes": self.max_inflight_bytes,
        }

    def close(self) -> None:
        """Wait for moves in flight, then close every tier (removes the NVMe run dir)."""
        if self._closed:
            return
        self._closed = True
        with self._cond:
            tickets = list(self._inflight)
        for t in tickets:
            _quiet_wait(t)
        self._stager.shutdown(wait=True)
        try:
            if self.nvme is not None:
                self.nvme.close()
        finally:
            self.host.close()
            self.device.close()

    def __enter__(self) -> "TierManager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _nothing() -> None:
    pass


def _quiet_wait(ticket) -> None:
    if ticket is None:
        return
    try:
        ticket.wait()
    except Exception:  # noqa: BLE001 - reported to the move's own caller
        pass
