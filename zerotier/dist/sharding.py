"""How the engine shards units across data-parallel ranks (ZeRO stages 0-3).

[Note: sharding]
Every unit gets a `Partition` (dist/partition.py): a balanced, padded, contiguous
split of its flat by element count. Rank r owns chunk r: `unit.shard_lo/hi` are
its real elements, `part.shard_numel` its (padded) size. Per stage:

  stage  optimizer state   gradients                              parameters
  0      whole (replicated) all-reduced at the window end          whole
  1      own shard          reduce-scattered at the window end     whole; all-gathered after the step
  2      own shard          reduce-scattered every micro-batch,    whole; all-gathered after the step
                            in buckets during backward
  3      own shard          as stage 2                             own shard; all-gathered per module
                                                                   before use (prefetched), freed after

Units below `zero.persistence_threshold` elements are replicated at stage 3
(never gathered). With one rank every unit is replicated and nothing here
communicates. All ranks issue the same collectives in the same order: the
engine issues them from the thread running forward/backward only.
"""
from __future__ import annotations

import dataclasses
import itertools
from datetime import timedelta

import torch

from ..config import ZeroConfig
from ..state import Unit
from .buckets import ParamGatherer
from .comm import MAX, SUM, CollectiveError, Comm
from ..errors import ZerotierError

_FP_MOD = 2 ** 61 - 1  # gather fingerprints stay within int64, and so does their negation
_SYNC_POINTS = itertools.count()  # this process's sync points, in the order every rank reaches them
from .partition import stage_partitions


class Sharding:
    def __init__(self, zero_cfg: ZeroConfig, rank: int, world_size: int):
        self.stage = zero_cfg.stage
        self.rank, self.world = rank, world_size
        self.active = world_size > 1
        self.comm = Comm.from_config(zero_cfg) if self.active else None
        if self.active:
            self.gatherer = ParamGatherer(zero_cfg.allgather_bucket_size, self._params_gathered, comm=self.comm)
        self._gather_done: dict[int, callable] = {}
        self._keep: list[torch.Tensor] = []  # lp shards that must live until their gather completes
        self._persistence = zero_cfg.persistence_threshold
        self._gather_fp = 0  # fingerprint of the ZeRO-3 gathers since the last agree()
        self.stop_code = 0    # this rank's stop request, sent with agree() ([Note: graceful stop])
        self.agreed_stop = 0  # the largest stop request of any rank at the last agree()

    # ------------------------------------------------------------ layout

    def assign(self, units: list[Unit]) -> list[Unit]:
        """The units with their partition and this rank's range of it (Unit is frozen after this)."""
        parts = stage_partitions([u.numel for u in units], self.world, self.stage, self._persistence)
        return [dataclasses.replace(unit, part=part, shard_lo=part.shard_range(self.rank)[0],
                                    shard_hi=part.shard_range(self.rank)[1]) for unit, part in zip(units, parts)]

    def gathered(self, unit: Unit) -> bool:
        """Stage 3: only this rank's parameter shard is stored; the full flat is gathered per use."""
        return self.stage == 3 and not unit.part.replicated

    def shard_of(self, unit: Unit, full: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of a full flat, zero-padded to shard_numel: `full` itself when the
        unit is not sharded (callers copy what they keep)."""
        part = unit.part
        if part.replicated:
            return full
        out = torch.zeros(part.shard_numel, dtype=full.dtype, device=full.device)
        lo, hi = unit.shard_lo, unit.shard_hi
        out[: hi - lo] = full[lo:hi]
        return out

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Every rank starts from rank 0's initial weights."""
        if self.active:
            self.comm.broadcast(tensor, src=0).wait()

    # ------------------------------------------------------------ gradients (reduced by grads.GradStore)

    def reduces_now(self, last_micro_batch: bool) -> bool:
        """Whether gradients are reduced in this backward (stage >= 2: every micro-batch)."""
        return self.active and (self.stage >= 2 or last_micro_batch)

    def global_sum(self, value: "float | torch.Tensor") -> float:
        """Sum over ranks of a float or a 0-d fp64 tensor (grad-norm squares: clipping and
        overflow agree everywhere). A device tensor is all-reduced where it is (NCCL) and
        read once: the step's one device sync."""
        if isinstance(value, torch.Tensor):
            t = value.reshape(1)
        elif not self.active:
            return value
        else:
            t = torch.tensor([value], dtype=torch.float64)
        if self.active:
            self.comm.all_reduce(t, SUM).wait()
        return float(t[0])

    def agree(self, used: list[bool]) -> list[bool]:
        """End of a window, with several ranks: which units got a gradient on any rank (one
        all-reduce(MAX) of flags; see [Note: the same collectives on every rank] in grads.py).
        The same collective checks that every rank gathered the same ZeRO-3 units since the
        last call: mismatched gathers mix different units' shards, so training must stop. It also
        carries the ranks' stop requests: one rank's SIGTERM stops all ([Note: graceful stop])."""
        fp = self._gather_fp
        t = torch.tensor([fp, -fp, self.stop_code] + [int(u) for u in used], dtype=torch.int64)  # host
        self.comm.all_reduce(t, MAX).wait()
        values = t.tolist()
        self._gather_fp = 0
        self.agreed_stop = values[2]
        if values[0] != fp or values[1] != -fp:
            raise CollectiveError(
                f"rank {self.rank}: the ranks gathered different ZeRO-3 parameter units since the last step "
                "(data-dependent module routing, e.g. MoE experts chosen per rank?). At zero.stage = 3 every "
                "rank must run the same modules in the same order; use zero.stage <= 2 (units unused on a "
                "rank are then reduced as zeros) or run every expert on every rank")
        return [bool(v) for v in values[3:]]

    def sync_point(self, steps: int, micro_steps: int, what: str) -> None:
        """[Note: ranks out of step]
        Every collective inside a window pairs with the same one on the other ranks even when a
        rank skipped a batch the others trained on: the ranks then only drift by one window, which
        shows where the training ends. A rank that finishes first (parameters_fp32, state_dict,
        close) would pair its weights' gathers with the other ranks' next forward, and end with
        exit 0 on weights from mismatched collectives. So before those gathers every rank posts
        its step and micro-batch counts in the process group's key-value store (outside the
        collective stream, which another rank may be using for other work) and compares them with
        every other rank's, waiting up to zero.timeout_s: a difference or a rank that never gets
        there is a ZerotierError on this rank; the others then fail in their pending collective."""
        if not self.active:
            return
        import torch.distributed as dist
        try:
            store = dist.distributed_c10d._get_default_store()
        except (AttributeError, RuntimeError, ValueError):  # no default group (a custom one): no check
            return
        k = next(_SYNC_POINTS)
        mine = f"step {steps} (micro-batch {micro_steps})"
        store.set(f"zerotier/sync{k}/{self.rank}", mine)
        timeout_s = self.comm.timeout_s or 600.0
        fix = ("every rank must run the same number of micro-batches (forward, backward, step): a rank that "
               "skips a batch must skip it on every rank, e.g. decide with an all-reduce of the skip flag")
        for r in range(self.world):
            if r == self.rank:
                continue
            key = f"zerotier/sync{k}/{r}"
            try:
                store.wait([key], timedelta(seconds=timeout_s))
            except Exception as exc:  # noqa: BLE001 - the store's timeout (DistStoreError, RuntimeError)
                raise ZerotierError(f"rank {self.rank}: {what} after {mine}, but rank {r} did not get there within "
                                    f"{timeout_s:g} s (zero.timeout_s): it is still training, or failed; {fix}") from exc
            theirs = store.get(key).decode()
            if theirs != mine:
                raise ZerotierError(f"rank {self.rank}: {what} after {mine}, but rank {r} after {theirs}: the ranks "
                                    f"trained on different numbers of micro-batches, so their collectives paired "
                                    f"different work and the weights cannot be trusted; {fix}")

    def close(self) -> None:
        """Free the collectives' resources (the gloo group for host tensors, if one was made); local."""
        if self.comm is not None:
            self.comm.close()

    def local_sumsq_share(self, unit: Unit) -> bool:
        """Replicated units hold identical gradients on every rank: count them on rank 0 only."""
        return not unit.part.replicated or self.rank == 0

    # ------------------------------------------------------------ parameters

    def gather_params(self, unit: Unit, lp_shard: torch.Tensor, out_flat, done=None) -> None:
        """Stages 1-2: all-gather the updated low-precision shard into the full flat `out_flat` (or
        a function returning it when the gather lands: ParamGatherer.add); then `done(out_flat)`."""
        self._keep.append(lp_shard)
        if done is not None:
            self._gather_done[unit.index] = done
        self.gatherer.add(unit.index, lp_shard, unit.part, out_flat)

    def _params_gathered(self, index: int, out_flat: torch.Tensor) -> None:
        done = self._gather_done.pop(index, None)
        if done is not None:
            done(out_flat)

    def finish_gather(self) -> None:
        if self.active:
            self.gatherer.flush()
            self.gatherer.wait()
            self._keep.clear()

    def all_gather(self, unit: Unit, out_padded: torch.Tensor, shard: torch.Tensor):
        """Stage 3 fetch: returns the handle of the all-gather of `shard` into `out_padded`."""
        self._gather_fp = (self._gather_fp * 1_000_003 + unit.index + 1) % _FP_MOD  # checked by agree()
        return self.comm.all_gather(out_padded, shard)

    def gather_full(self, unit: Unit, shard: torch.Tensor) -> torch.Tensor:
        """The full flat of a sharded tensor (e.g. fp32 master for export); blocking."""
        if unit.part.replicated:
            return shard[: unit.numel]
        out = torch.empty(unit.part.padded_numel, dtype=shard.dtype, device=shard.device)
        self.comm.all_gather(out, shard.contiguous()).wait()
        return out[: unit.numel]
