"""Which elements of a unit's flat buffer each data-parallel rank owns.

[Note: partition layout]
A unit's flat (see [Note: units] in state.py) of `numel` elements is padded with
zeros to `padded_numel`, a multiple of `world_size * align`, and cut into
`world_size` contiguous chunks of `shard_numel = padded_numel / world_size`
elements; rank r owns chunk r. Every rank's shard has the same size, so one
reduce-scatter / all-gather of the padded flat moves equal chunks (what the
collectives require). Only the real elements of a chunk are state: the last
ranks' chunks may hold fewer real elements, or none when numel is small
("uneven last shard").

    numel=10, world_size=4, align=1 -> padded 12, shard 3
    rank 0: [0, 3)   rank 1: [3, 6)   rank 2: [6, 9)   rank 3: [9, 10) + 2 padding

Partitioning is by element count, never by parameter count: one huge
embedding and many small biases still split evenly. `align` (elements) makes
every shard start on an aligned element (e.g. 32: 64-byte shards for bf16,
128-byte for fp32); it costs at most `world_size * align - 1` padding elements
per unit.

A *replicated* unit (fewer elements than `zero.persistence_threshold`, see
`is_persistent`) is not partitioned: every rank's "shard" is the whole flat.
Code that loops over "my shard of each unit" then needs no special case; the
collectives in comm.py all-reduce such units instead of reduce-scattering them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


def _check(numel: int, world_size: int, align: int) -> None:
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")


def padded_numel(numel: int, world_size: int, align: int = 1) -> int:
    """`numel` rounded up to a multiple of `world_size * align` (0 stays 0)."""
    _check(numel, world_size, align)
    grain = world_size * align
    return -(-numel // grain) * grain


def shard_numel(numel: int, world_size: int, align: int = 1) -> int:
    """Elements in every rank's (padded) shard: `padded_numel / world_size`."""
    return padded_numel(numel, world_size, align) // world_size


def shard_range(numel: int, rank: int, world_size: int, align: int = 1) -> tuple[int, int]:
    """[start, end) of the *real* elements of the flat that `rank` owns (end - start may be 0).

    The padded shard of `rank` is [rank * shard_numel, (rank + 1) * shard_numel); this is
    that range clipped to `numel`.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    shard = shard_numel(numel, world_size, align)
    return min(rank * shard, numel), min((rank + 1) * shard, numel)


def is_persistent(numel: int, threshold: int) -> bool:
    """True when a unit this small is replicated on every rank instead of partitioned."""
    return numel < threshold


@dataclass(frozen=True)
class Partition:
    """How one unit's flat is split across `world_size` ranks ([Note: partition layout])."""

    numel: int
    world_size: int
    align: int = 1
    replicated: bool = False

    def __post_init__(self) -> None:
        _check(self.numel, self.world_size, self.align)

    @property
    def padded_numel(self) -> int:
        """Length of the flat the collectives move (the full flat itself when replicated)."""
        return self.numel if self.replicated else padded_numel(self.numel, self.world_size, self.align)

    @property
    def shard_numel(self) -> int:
        """Length of every rank's shard buffer, padding included."""
        return self.numel if self.replicated else self.padded_numel // self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        """[start, end) of the real elements `rank` owns; the whole flat when replicated."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        if self.replicated:
            return 0, self.numel
        return shard_range(self.numel, rank, self.world_size, self.align)

    def local_numel(self, rank: int) -> int:
        """Real (non-padding) elements in `rank`'s shard."""
        start, end = self.shard_range(rank)
        return end - start


def partition_units(numels: Sequence[int], world_size: int, align: int = 1,
                    persistence_threshold: int = 0) -> list[Partition]:
    """One Partition per unit; units with fewer than `persistence_threshold` elements are replicated."""
    return [Partition(n, world_size, align, replicated=is_persistent(n, persistence_threshold)) for n in numels]


SHARD_ALIGN = 32  # elements: every sharded unit's shards start on this boundary


def stage_partitions(numels: Sequence[int], world_size: int, stage: int, persistence_threshold: int
                     ) -> list[Partition]:
    """Each unit's partition as the engine assigns them at ZeRO `stage` ([Note: sharding] in
    sharding.py; the planner sizes with the same): with one rank every unit is whole; over several,
    stage 0 replicates every unit, stage 3 those below `persistence_threshold` elements, and the
    rest are partitioned with SHARD_ALIGN."""
    if world_size == 1:
        return [Partition(n, 1, replicated=True) for n in numels]
    threshold = {0: 2 ** 63, 3: persistence_threshold}.get(stage, 0)
    return partition_units(numels, world_size, align=SHARD_ALIGN, persistence_threshold=threshold)
