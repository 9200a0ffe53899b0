"""The NVMe optimizer pipeline's staging sets ([Note: NVMe optimizer pipeline] in state_store.py), packed.

[Note: packed staging sets]
The pipeline holds `optimizer.pipeline_depth` staging sets, each a host-pool block per state key
sized to the largest NVMe unit's buffer of that key (the planner counts exactly these blocks and
bytes: OptStateSizing.staging_bytes / host_blocks). A unit takes a *range* of a set, per key its
buffer's bytes rounded up to the pool's alignment at an aligned offset (so every read and write
stays zero-copy and may use its padding), not the whole set: beside a large unit (a model's
embedding, often several times a block) the sets hold several small ones at once. A unit is
placed in the first set already in use that has room after its last range, else in an empty
set; a set's ranges come back together, when its last unit's I/O has ended (its write landed or
its read was dropped). So during the last backward the state reads of every unit that fits start
as its gradient becomes final, where whole sets let `depth` units read and the rest waited for
engine.step(), their reads on the step's critical path with the writes: on bench_planner's gpt2
(a 38.7M-parameter root unit, six 7.1M blocks, depth 3) the backward issued 255 MB of state reads
and step() 719 MB; packed, the backward issues all 975 MB and step() only writes (the root unit's
464 MB read at the backward's start: [Note: the last final unit's read] in state_store.py;
tools/drive_idle.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..io.memory import round_up


@dataclass(eq=False)
class Lease:
    """One unit's ranges in a staging set: `views` maps each state key to its buffer (exactly the
    unit's bytes; the storage after them, up to the aligned length, is the unit's padding)."""

    set_index: int
    views: dict[str, torch.Tensor]


class StagingSets:
    """`depth` staging sets of host-pool blocks, one per key of `set_bytes` (key -> bytes), handed
    out as packed ranges ([Note: packed staging sets])."""

    def __init__(self, host_pool, set_bytes: dict[str, int], depth: int) -> None:
        self.host_pool, self.alignment = host_pool, host_pool.alignment
        self.blocks = [{k: host_pool.alloc(nbytes, torch.uint8, f"optimizer staging {k}")
                        for k, nbytes in set_bytes.items()} for _ in range(depth)]
        self._fill = [dict.fromkeys(set_bytes, 0) for _ in range(depth)]  # per set: bytes handed out per key
        self._users = [0] * depth  # per set: leases not given back

    def take(self, nbytes: dict[str, int]) -> Lease | None:
        """Ranges for a unit whose buffers take `nbytes` (key -> bytes), or None if no set has room."""
        need = {k: round_up(n, self.alignment) for k, n in nbytes.items()}
        in_use = [s for s in range(len(self.blocks)) if self._users[s]]
        empty = [s for s in range(len(self.blocks)) if not self._users[s]]
        for s in in_use + empty:
            fill = self._fill[s]
            if all(fill[k] + need[k] <= self.blocks[s][k].capacity for k in need):
                views = {k: self.blocks[s][k].block[fill[k]: fill[k] + nbytes[k]] for k in nbytes}
                for k in need:
                    fill[k] += need[k]
                self._users[s] += 1
                return Lease(s, views)
        return None

    def give_back(self, lease: Lease) -> None:
        """The lease's I/O has ended: its set is empty again once every lease in it is given back."""
        s = lease.set_index
        self._users[s] -= 1
        if not self._users[s]:
            self._fill[s] = dict.fromkeys(self._fill[s], 0)

    def close(self) -> None:
        blocks, self.blocks = self.blocks, []
        for staging in blocks:
            for block in staging.values():
                self.host_pool.free(block)
