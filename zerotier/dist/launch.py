"""Joining the data-parallel group (`init_distributed`) and spawning ranks for tests (`spawn`).

In production the launcher is torchrun (`torchrun --nproc-per-node 2 train.py`), which sets
RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT for every process;
`init_distributed` reads them. `spawn` plays torchrun's role in tests: N local processes
on gloo, rendezvous through a FileStore in a temporary directory (no port to race for).
"""
from __future__ import annotations

import inspect
import os
import pickle
import queue
import shutil
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..errors import ZerotierError

_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def init_distributed(zero_cfg=None, device: torch.device | None = None) -> tuple[int, int]:
    """Join the default process group if a launcher asked for one; return (rank, world_size).

    - already initialized (by the user or an earlier call): its rank and size, untouched; a
      group with no CPU backend (NCCL-only) is fine: host tensors' collectives then run on a
      gloo group the engine's Comm makes ([Note: which group runs a collective] in comm.py);
    - torchrun-style environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): init with
      `timeout = zero_cfg.timeout_s` for every collective. On a CUDA `device` (default:
      what train.device = "cuda" picks when CUDA is available) the group is "cpu:gloo,cuda:nccl" bound to
      that device: NCCL for device tensors, gloo for the CPU ones (scalars, host shards,
      checkpoint helpers); on the CPU it is gloo;
    - no launcher environment: (0, 1) and nothing is initialized; the collectives in
      comm.py then act locally.
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    missing = [name for name in _LAUNCHER_ENV if name not in os.environ]
    if len(missing) == len(_LAUNCHER_ENV):
        return 0, 1
    if missing:
        raise ZerotierError(f"distributed launch environment incomplete: {', '.join(missing)} not set "
                            f"(launch with torchrun --nproc-per-node N, which sets them all)")
    if not dist.is_available():
        raise ZerotierError("RANK/WORLD_SIZE are set but this torch build has no torch.distributed")
    timeout_s = 600.0 if zero_cfg is None else zero_cfg.timeout_s
    kwargs: dict[str, Any] = {"timeout": timedelta(seconds=timeout_s)}
    if device is None and torch.cuda.is_available():
        from ..device import choose
        device = choose("cuda")
    if device is not None and device.type == "cuda":
        backend = "cpu:gloo,cuda:nccl"
        torch.cuda.set_device(device)
        if "device_id" in inspect.signature(dist.init_process_group).parameters:
            kwargs["device_id"] = device  # eager NCCL init, bound to this rank's GPU
    else:
        backend = "gloo"
    dist.init_process_group(backend, **kwargs)
    return dist.get_rank(), dist.get_world_size()


class SpawnError(ZerotierError):
    """One or more spawned ranks failed, exited abnormally or timed out.

    `failures` maps rank -> its formatted traceback (or what happened to it).
    """

    def __init__(self, failures: dict[int, str]):
        self.failures = dict(sorted(failures.items()))
        lines = []
        for rank, text in self.failures.items():
            last = (text.strip().splitlines() or ["?"])[-1]
            lines.append(f"  rank {rank}: {last}")
        details = "\n\n".join(f"--- rank {r} ---\n{t}" for r, t in self.failures.items())
        super().__init__(f"{len(self.failures)} rank(s) failed:\n" + "\n".join(lines) + "\n\n" + details)


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0,
          collective_timeout_s: float = 30.0, backend: str = "gloo") -> list[Any]:
    """Run fn(rank, world_size, *args) in `world_size` fresh processes joined in one process group.

    Returns the per-rank return values (must be picklable). Every rank runs to its end even
    when another fails (its collectives then fail within `collective_timeout_s`, or at once
    when the peer's connection closes); ranks still alive after `timeout_s` are killed.
    Raises SpawnError naming every rank that raised, died or was killed. `fn` must be
    importable by name (a module-level function), as for any 'spawn' start method.
    """
    ctx = mp.get_context("spawn")
    tmpdir = tempfile.mkdtemp(prefix="zerotier-spawn-")
    results: queue.Queue = ctx.Queue()
    procs = [ctx.Process(target=_child, name=f"zerotier-rank{rank}", daemon=True,
                         args=(fn, rank, world_size, args, os.path.join(tmpdir, "store"), backend,
                               collective_timeout_s, results))
             for rank in range(world_size)]
    outcomes: dict[int, tuple[bool, Any]] = {}
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        while len(outcomes) < world_size and time.monotonic() < deadline:
            try:
                rank, ok, payload = results.get(timeout=0.05)
                outcomes[rank] = (ok, payload)
                continue
            except queue.Empty:
                pass
            for rank, p in enumerate(procs):  # died without reporting (segfault, os._exit, OOM kill)
                if rank not in outcomes and p.exitcode is not None:
                    try:  # its message may still be in the pipe
                        r, ok, payload = results.get(timeout=0.5)
                        outcomes[r] = (ok, payload)
                    except queue.Empty:
                        outcomes[rank] = (False, f"exited with code {p.exitcode} without reporting a result")
    finally:
        for rank, p in enumerate(procs):
            if p.is_alive():
                p.terminate()
                p.join(2.0)
                if p.is_alive():
                    p.kill()
                    p.join(2.0)
                if rank not in outcomes:
                    outcomes[rank] = (False, f"killed after the {timeout_s:g} s spawn timeout")
            else:
                p.join(1.0)
        results.close()
        shutil.rmtree(tmpdir, ignore_errors=True)
    failures = {rank: payload for rank, (ok, payload) in outcomes.items() if not ok}
    if failures:
        raise SpawnError(failures)
    return [pickle.loads(outcomes[rank][1]) for rank in range(world_size)]


def _child(fn, rank, world_size, args, store_path, backend, collective_timeout_s, results) -> None:
    try:
        dist.init_process_group(backend, init_method=f"file://{store_path}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=collective_timeout_s))
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
