"""The parameter store's sizing: what its homes and working sets take on each tier, run before
the store exists. The store sizes its allocations with these functions, and the planner's
parameter term is `plan_terms` ([Note: bytes per parameter] in planner/sizes.py), so the plan
cannot drift from the code."""
from __future__ import annotations

from .dist.buckets import ParamGatherer
from .params_gather import ShardGathers
from .params_writes import WriteBacks
from .state import Location
from .tiers.homes import HOMES, Home


class ParamSizing:
    """ParamStore's static sizing half (ParamStore is one)."""

    writes_in_flight = staticmethod(WriteBacks.in_flight)
    gather_staging_bytes = staticmethod(ShardGathers.staging_bytes)

    @staticmethod
    def host_blocks(loc: Location, lookahead: int, units: int) -> int:
        """Host-pool blocks the parameters hold at most at once: a home's own (a home per unit on the
        host) and a block per move in flight (from NVMe: a fetch per `lookahead` prefetch + the demand,
        a write-back per `writes_in_flight`), as host_staging_bytes counts their bytes."""
        home = HOMES[loc]
        moves = lookahead + 1 + ParamSizing.writes_in_flight(lookahead)
        return units * home.blocks_at_rest + moves * home.blocks_per_move

    @staticmethod
    def host_staging_bytes(lookahead: int, shard_numels: list[int], lp_itemsize: int) -> int:
        """Pool bytes NVMe-resident params need at most: a block per fetch in flight (`lookahead`
        prefetches + the demand: distinct units) plus one per write-back in flight (at most
        `writes_in_flight(lookahead)` distinct units, see WriteBacks.track), so the largest units'
        sizes. `shard_numels`: every unit's rank shard. The planner counts exactly this."""
        top = sorted(shard_numels, reverse=True)
        return (sum(top[:lookahead + 1]) + sum(top[:ParamSizing.writes_in_flight(lookahead)])) * lp_itemsize

    @staticmethod
    def writeback_bytes(rank_numel: int, lp_itemsize: int) -> int:
        """ZeRO-1/2 over several ranks: bytes of the out buffers of one step (this rank's new shard
        of every unit), alive until finish_commits() (the all-gathers read them). Planner's term."""
        return rank_numel * lp_itemsize

    @staticmethod
    def plan_terms(home: type[Home], s) -> dict[str, int]:
        """The parameters' bytes per tier with homes of class `home` ([Note: bytes per parameter]);
        `s` is the planner's Sizes, frozen units included. The shards at rest, the fetched full units
        on the device, the pool blocks of moves through the host, and the collectives' buffers."""
        need = home.plan_bytes(s.held_numel("params"), s.lp_bytes)
        if not home.on_device or s.stage >= 3:
            # fetched full units: the one computing, the one just done, the lookahead, and the
            # units enclosing them (resident for their module's whole forward/backward)
            flats = s.device_flats()  # ZeRO-3: padded for the gather (Sizes.device_flats)
            need["device"] += min(sum(flats[:s.lookahead + 2]) + s.nested, sum(flats)) * s.lp_bytes
        if home.blocks_per_move:  # each fetch and write-back goes through a pool block (NVMe)
            need["host"] += ParamSizing.host_staging_bytes(s.lookahead, s.held_shards("params"), s.lp_bytes)
        if s.engine_buffers and s.world_size > 1:
            sharded = [p for p in s.partitions() if not p.replicated]
            if s.stage >= 3 and not home.on_device:
                need["device"] += ParamSizing.gather_staging_bytes(s.lookahead, [p.shard_numel for p in sharded],
                                                                   s.lp_bytes)
            if s.stage in (1, 2):  # the gather buckets live with the parameters ([Note: bucket memory])
                need["device" if home.on_device else "host"] += ParamGatherer.buffer_bytes(
                    s.gather_bucket, s.lp_bytes, sharded, alignment=1 if home.on_device else s.alignment)
        return need
