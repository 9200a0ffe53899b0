"""The engine's optimizer: AdamW over units whose state lives on device, host or NVMe.

[Note: NVMe optimizer pipeline]
NVMe-resident units are stepped through three host staging sets (master,
exp_avg, exp_avg_sq each): while Adam runs on unit i, unit i+1 is being read
and unit i-1 written back. Before reading unit i+1 into a set, the write that
last used that set (unit i-2) must have completed. Tickets keep the staging
tensors alive until their I/O finishes.

Each unit keeps its own step count (like torch's per-parameter `step`): a unit
that received no gradient in an optimizer step is not updated at all, exactly
as torch.optim.AdamW skips parameters whose `.grad` is None.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from ..config import OptimizerConfig
from ..errors import ConfigError
from ..io import aligned_empty
from ..state import Location, Unit
from . import _kernels

STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")


class _Profiled:
    """An I/O ticket plus what the profiler needs to record it once it has completed.
    The end time is when the waiter saw completion (an upper bound of the I/O's end)."""

    def __init__(self, ticket, name, role, src, dst, nbytes, reason, start_ns):
        self.ticket, self.name, self.role, self.src, self.dst = ticket, name, role, src, dst
        self.nbytes, self.reason, self.start_ns = nbytes, reason, start_ns
        self.recorded = False

    def wait(self):
        return self.ticket.wait()

    def record(self, prof) -> None:
        if not self.recorded:
            self.recorded = True
            prof.record(self.name, self.role, self.src, self.dst, self.nbytes, self.reason, self.start_ns,
                        time.perf_counter_ns(), stream="nvme-io")


class UnitOptimizer:
    """Adam(W) step over units, wherever their state lives.

    `fused_out(unit)` returns a bf16/fp16 CPU tensor the kernel should write the
    new low-precision parameters into (param-copyback fused into the Adam pass),
    or None; `write_params(unit, master, fused)` then completes the copy-back.
    """

    def __init__(self, units: list[Unit], cfg: OptimizerConfig, store,
                 fused_out: Callable[[Unit], torch.Tensor | None],
                 write_params: Callable[[Unit, torch.Tensor, bool], None], profiler=None):
        if cfg.delayed_update:
            raise ConfigError("optimizer.delayed_update = true is not implemented yet; the exact update "
                              "already overlaps backward where possible. Remove the key or set it to false")
        self.units = units
        self.cfg = cfg
        self.store = store
        self.fused_out = fused_out
        self.write_params = write_params
        self.profiler = profiler  # None when profiling is off
        self.threads = None if cfg.threads == "auto" else int(cfg.threads)
        self._staging: list[dict[str, torch.Tensor]] = []  # allocated on the first NVMe step

    # ------------------------------------------------------------------ init

    def init_state(self, unit: Unit, master: torch.Tensor, alloc: Callable[[int, str], torch.Tensor]) -> None:
        """Place fp32 master weights (a copy of the initial params) and zero moments.

        `alloc(numel, what)` returns an fp32 tensor on the optimizer's tier (device/host)."""
        if unit.optim_loc is Location.NVME:
            zeros = torch.zeros(master.numel())
            for key, src in (("master", master), ("exp_avg", zeros), ("exp_avg_sq", zeros)):
                self.store.write(f"{unit.key}.{key}", src).wait()
            return
        for key in STATE_KEYS:
            t = alloc(master.numel(), f"{unit.key}.{key}")
            t.copy_(master) if key == "master" else t.zero_()
            setattr(unit, key, t)

    # ------------------------------------------------------------------ step

    def step(self, units: list[Unit], lr: float, grad_scale: float) -> None:
        """Update `units` (those with gradients, not already stepped early)."""
        for unit in units:
            if unit.optim_loc is not Location.NVME:
                self.step_unit(unit, lr, grad_scale)
        self._step_nvme([u for u in units if u.optim_loc is Location.NVME], lr, grad_scale)

    def step_unit(self, unit: Unit, lr: float, grad_scale: float) -> None:
        """Update one unit now (also used during backward, on the optimizer thread)."""
        if unit.optim_loc is Location.NVME:
            self._step_nvme([unit], lr, grad_scale)
            return
        self._adam(unit, unit.master, unit.exp_avg, unit.exp_avg_sq, lr, grad_scale)

    def _adam(self, unit: Unit, master, exp_avg, exp_avg_sq, lr, grad_scale) -> None:
        unit.step += 1
        grad = unit.grad_shard
        if grad.device != master.device:
            grad = grad.to(master.device)
        beta1, beta2 = self.cfg.betas
        kwargs = dict(step=unit.step, lr=lr, beta1=beta1, beta2=beta2, eps=self.cfg.eps,
                      weight_decay=self.cfg.weight_decay, decoupled=self.cfg.type == "adamw",
                      bias_correction=self.cfg.bias_correction, grad_scale=grad_scale)
        out = self.fused_out(unit) if master.device.type == "cpu" else None
        prof = self.profiler
        span = prof.compute_begin("optimizer" if master.device.type == "cpu" else "device-optimizer",
                                  label=unit.key, numel=unit.numel) if prof is not None else None
        if master.device.type == "cpu":
            _kernels.adam_step(master, exp_avg, exp_avg_sq, grad, param_out=out, simd=self.cfg.simd,
                               threads=self.threads, **kwargs)
        else:  # optimizer state on the accelerator: the same math in torch ops
            _kernels.adam_step_reference(master, exp_avg, exp_avg_sq, grad, **kwargs)
        if span is not None:
            prof.compute_end(span)
        self.write_params(unit, master, out is not None)

    def _step_nvme(self, units: list[Unit], lr: float, grad_scale: float) -> None:
        if not units:
            return
        largest = max(u.part.shard_numel for u in units)
        if not self._staging or self._staging[0]["master"].numel() < largest:
            # [Note: NVMe optimizer pipeline]: 3 sets sized for the largest unit shard
            largest = max(u.part.shard_numel for u in self.units if u.optim_loc is Location.NVME)
            self._staging = [{k: aligned_empty(4 * largest).view(torch.float32) for k in STATE_KEYS}
                             for _ in range(3)]
        writes: list[list] = [[], [], []]  # per staging set: tickets of its last write-back

        def read(i: int):
            slot = i % 3
            self._wait(writes[slot])  # the set's previous write-back (unit i-3) must land first
            writes[slot] = []
            bufs = {k: v[: units[i].part.shard_numel] for k, v in self._staging[slot].items()}
            return bufs, self._io(units[i], bufs, "optimizer-read")

        pending = read(0)
        for i, unit in enumerate(units):
            bufs, tickets = pending
            if i + 1 < len(units):
                pending = read(i + 1)  # overlaps the Adam math below
            self._wait(tickets)
            self._adam(unit, bufs["master"], bufs["exp_avg"], bufs["exp_avg_sq"], lr, grad_scale)
            writes[i % 3] = self._io(unit, bufs, "optimizer-write")
        for slot in writes:
            self._wait(slot)

    def _io(self, unit: Unit, bufs: dict[str, torch.Tensor], reason: str) -> list:
        """Submit reads or writes of a unit's three state tensors; tickets carry profiler info."""
        submit = self.store.read if reason == "optimizer-read" else self.store.write
        tickets = [submit(f"{unit.key}.{k}", bufs[k]) for k in STATE_KEYS]
        if self.profiler is None:
            return tickets
        start = time.perf_counter_ns()
        src, dst = ("nvme", "host") if reason == "optimizer-read" else ("host", "nvme")
        return [_Profiled(t, f"{unit.key}.{k}", k, src, dst, bufs[k].numel() * 4, reason, start)
                for t, k in zip(tickets, STATE_KEYS)]

    def _wait(self, tickets: list) -> None:
        prof = self.profiler
        token = prof.wait_begin(tickets[0].name) if prof is not None and tickets else None
        for t in tickets:
            t.wait()
            if prof is not None:
                t.record(prof)
        if token is not None:
            prof.wait_end(token)

    # ------------------------------------------------------------------ access

    def read_state(self, unit: Unit) -> dict[str, torch.Tensor]:
        """fp32 master/exp_avg/exp_avg_sq of a unit (copies on the CPU when on NVMe)."""
        if unit.optim_loc is not Location.NVME:
            return {k: getattr(unit, k) for k in STATE_KEYS}
        out = {k: torch.empty(unit.part.shard_numel) for k in STATE_KEYS}
        for k in STATE_KEYS:
            self.store.read(f"{unit.key}.{k}", out[k]).wait()
        return out

    def write_state(self, unit: Unit, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """Replace a unit's master/exp_avg/exp_avg_sq (CPU tensors of the shard's size, padding
        zero) wherever they live; returns the master as the optimizer holds it now."""
        if unit.optim_loc is Location.NVME:
            for k in STATE_KEYS:
                self.store.write(f"{unit.key}.{k}", state[k]).wait()
            return state["master"]
        for k in STATE_KEYS:
            getattr(unit, k).copy_(state[k])
        return unit.master
