"""Data-parallel sharding for ZeRO stages 1-3: partitions, collectives, buckets, launch.

    rank, world = init_distributed(cfg.zero)             # torchrun env -> process group
    comm = Comm.from_config(cfg.zero)                    # collectives: async handles, byte counters
    parts = partition_units([u.numel for u in units], world)
    bucketer = GradBucketer(cfg.zero.reduce_bucket_size, on_grad_shard, comm=comm)
    bucketer.allocate_from(device_tier, parts, host_pool)  # buffers from the tiers ([Note: bucket memory])

See docs/dist.md for the protocol per stage.
"""
from .buckets import GradBucketer, ParamGatherer  # noqa: F401
from .comm import AVG, SUM, CollectiveError, Comm, Handle, ring_bytes  # noqa: F401
from .launch import SpawnError, init_distributed, spawn  # noqa: F401
from .partition import (Partition, is_persistent, padded_numel, partition_units, shard_numel,  # noqa: F401
                        shard_range)
