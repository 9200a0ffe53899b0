"""zerotier.dist: partitions (pure), collectives and buckets on 2 spawned gloo ranks, failures.

Spawned ranks run the module-level `_rank_*` functions below; they check with
torch.testing (no pytest assertion rewriting in children) and any failure comes back as
a SpawnError carrying the child's traceback.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from zerotier.config import ZeroConfig
from zerotier.dist import (AVG, SUM, CollectiveError, Comm, GradBucketer, ParamGatherer, Partition,
                           SpawnError, init_distributed, is_persistent, padded_numel, partition_units,
                           ring_bytes, shard_numel, shard_range, spawn)
from zerotier.errors import ZerotierError
from zerotier.tiers import HostPool, make_device_tier

WORLD = 2


def _tiered(bucketer, parts, host_pool=None, device="cpu"):
    """The bucketer with its buffers from a device tier ([Note: bucket memory]), as the engine's."""
    bucketer.allocate_from(make_device_tier(1 << 30, device), [p for p in parts if not p.replicated]
                           if isinstance(bucketer, ParamGatherer) else parts, host_pool)
    return bucketer

# ------------------------------------------------------------------------------------------------
# Partition: pure


@pytest.mark.parametrize("numel, world_size, align, expected", [
    # numel, world, align -> every rank's real [start, end)
    (10, 4, 1, [(0, 3), (3, 6), (6, 9), (9, 10)]),        # uneven last shard
    (8, 4, 1, [(0, 2), (2, 4), (4, 6), (6, 8)]),          # even
    (1, 2, 1, [(0, 1), (1, 1)]),                          # numel = 1
    (3, 4, 1, [(0, 1), (1, 2), (2, 3), (3, 3)]),          # numel < world size
    (5, 4, 1, [(0, 2), (2, 4), (4, 5), (5, 5)]),          # last rank holds only padding
    (0, 2, 1, [(0, 0), (0, 0)]),                          # empty unit
    (7, 1, 1, [(0, 7)]),                                  # world size 1
    (13, 2, 4, [(0, 8), (8, 13)]),                        # prime, aligned: shard 8
    (100, 4, 64, [(0, 64), (64, 100), (100, 100), (100, 100)]),  # alignment over balance
])
def test_shard_ranges_table(numel, world_size, align, expected):
    assert [shard_range(numel, r, world_size, align) for r in range(world_size)] == expected
    part = Partition(numel, world_size, align)
    assert [part.shard_range(r) for r in range(world_size)] == expected
    assert part.padded_numel == padded_numel(numel, world_size, align)
    assert part.shard_numel == shard_numel(numel, world_size, align) == part.padded_numel // world_size


@pytest.mark.parametrize("numel", [0, 1, 2, 3, 7, 13, 97, 101, 4099, 65537, 1_000_003])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("align", [1, 32])
def test_partition_invariants(numel, world_size, align):
    part = Partition(numel, world_size, align)
    padded, shard = part.padded_numel, part.shard_numel
    assert padded % (world_size * align) == 0 and numel <= padded < numel + world_size * align
    assert shard * world_size == padded and shard % align == 0
    ranges = [part.shard_range(r) for r in range(world_size)]
    # contiguous, in rank order, covering exactly [0, numel)
    assert ranges[0][0] == 0 and ranges[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    # balanced by element count: every rank's shard starts at rank * shard; full shards first
    for r, (start, end) in enumerate(ranges):
        assert end - start == part.local_numel(r) == max(0, min(shard, numel - r * shard))
    counts = [end - start for start, end in ranges]
    assert counts == sorted(counts, reverse=True)  # the uneven part sits in the tail
    if align == 1:
        assert padded - numel < world_size and max(counts) == -(-numel // world_size)


def test_persistence_and_replicated_units():
    assert is_persistent(99, 100) and not is_persistent(100, 100) and not is_persistent(5, 0)
    parts = partition_units([10, 99, 100, 100_003], 4, align=2, persistence_threshold=100)
    assert [p.replicated for p in parts] == [True, True, False, False]
    small = parts[1]
    assert small.padded_numel == small.shard_numel == 99
    assert [small.shard_range(r) for r in range(4)] == [(0, 99)] * 4
    assert parts[3].shard_numel == 25_002 and parts[3].padded_numel == 100_008


@pytest.mark.parametrize("call", [
    lambda: shard_range(-1, 0, 2),
    lambda: shard_range(10, 2, 2),
    lambda: padded_numel(10, 0),
    lambda: Partition(10, 2, align=0),
    lambda: Partition(10, 2).shard_range(-1),
])
def test_partition_rejects_bad_arguments(call):
    with pytest.raises(ValueError):
        call()


def test_ring_bytes_formulas():
    assert ring_bytes("reduce_scatter", 800, 8) == 700
    assert ring_bytes("all_gather", 800, 8) == 700
    assert ring_bytes("all_reduce", 800, 8) == 1400
    assert ring_bytes("all_reduce", 800, 1) == 0
    assert ring_bytes("broadcast", 800, 4) == 600
    with pytest.raises(ValueError):
        ring_bytes("all_to_all", 8, 2)


# ------------------------------------------------------------------------------------------------
# Without a process group: world size 1, local copies (the engine's single-process path)


def test_local_world_without_process_group():
    assert not dist.is_initialized()
    comm = Comm()
    assert (comm.rank(), comm.world_size()) == (0, 1)
    flat = torch.arange(6.0)
    shard = torch.empty(6)
    comm.reduce_scatter(shard, flat).wait()
    assert_close(shard, flat)
    full = torch.empty(6)
    h = comm.all_gather(full, shard)
    assert h.done()
    h.wait()
    assert_close(full, flat)
    comm.all_reduce(flat).wait()
    assert_close(flat, torch.arange(6.0))
    comm.broadcast(flat).wait()
    assert comm.stats() == {"reduce_scatter": 0, "all_gather": 0, "all_reduce": 0, "broadcast": 0}
    with pytest.raises(ValueError, match="expected world_size"):
        comm.reduce_scatter(torch.empty(5), flat)
    comm.check_all_ranks(True, "step 1")
    with pytest.raises(CollectiveError, match=r"rank\(s\) 0 failed"):
        comm.check_all_ranks(False, "step 1")


def test_local_buckets_pack_padding_and_order():
    got = {}
    parts = [Partition(n, 1, align=4) for n in (5, 3, 9)]
    b = _tiered(GradBucketer(64, lambda k, s: got.__setitem__(k, s.clone()), comm=Comm()), parts)
    grads = [torch.arange(p.numel, dtype=torch.float32) + 10 * i for i, p in enumerate(parts)]
    for i, (g, p) in enumerate(zip(grads, parts)):
        b.add(i, g, p)
    b.wait()
    assert b.buckets_launched == 2  # 8 + 4 elements (48 B), then 12 more would pass 64 B
    for i, (g, p) in enumerate(zip(grads, parts)):
        assert_close(got[i], torch.cat([g, torch.zeros(p.padded_numel - p.numel)]))
    # the next backward reuses the bucket buffers (no fresh, page-faulting allocation per bucket)
    storages = []
    b.on_ready = lambda k, s: storages.append(s.untyped_storage().data_ptr())
    for _ in range(2):
        for i, (g, p) in enumerate(zip(grads, parts)):
            b.add(i, g, p)
        b.wait()
    assert set(storages[3:]) == set(storages[:3]) and len(set(storages)) <= b.max_inflight + 1


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_host_gradients_cross_by_the_device_tiers_copies(device):
    """[Note: bucket memory]: host gradients (host-pool blocks, fp32 and bf16) reach their device
    bucket by the device tier's H2D copies and the reduced shards come back by its D2H copy into
    a host-pool block, every byte counted; the buckets are device-tier memory, the landing blocks
    host-pool memory within GradBucketer.staging_bytes. On the lagging device (the suite's CPU),
    and on a GPU's copy streams, a copy not joined before the collective or not waited before
    delivery reads NaN or stale bytes."""
    parts = [Partition(n, 1, align=4) for n in (5, 3, 9, 40)]
    pool, tier = HostPool(1 << 24), make_device_tier(1 << 30, device)
    got = {}
    b = GradBucketer(64, lambda k, s: got.__setitem__(k, s.clone()), comm=Comm(), reduce_dtype=torch.float32)
    b.allocate_from(tier, parts, pool)
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.float32]
    blocks = [pool.alloc(p.numel * d.itemsize, d) for p, d in zip(parts, dtypes)]
    for i, (blk, p) in enumerate(zip(blocks, parts)):
        blk.tensor.copy_(torch.arange(p.numel) + 10 * i)
    for i, (blk, p) in enumerate(zip(blocks, parts)):
        b.add(i, blk.tensor, p)
    b.wait()
    for i, p in enumerate(parts):
        assert_close(got[i], torch.cat([torch.arange(p.numel, dtype=torch.float32) + 10 * i,
                                        torch.zeros(p.padded_numel - p.numel)]))
    stats = tier.stats()
    assert stats["bytes_in"] == sum(p.numel * d.itemsize for p, d in zip(parts, dtypes))
    assert stats["bytes_out"] == 4 * sum(p.shard_numel for p in parts)
    landing = pool.stats()["in_use"] - sum(blk.capacity for blk in blocks)  # kept for the next backward
    assert 0 < landing <= GradBucketer.staging_bytes(64, 4, parts, alignment=pool.alignment)
    rounding = 512 if device == "cuda" else 1  # the CUDA tier counts allocator blocks of 512 B
    assert stats["current"] <= GradBucketer.buffer_bytes(64, 4, parts, alignment=rounding)  # only the buckets stay
    tier.close()


def test_host_parameter_gathers_use_host_pool_buckets():
    """[Note: bucket memory]: a gatherer of host-resident parameters packs into host-pool blocks,
    counted in the host budget (the planner's ParamGatherer.buffer_bytes there), none on the device."""
    parts = [Partition(n, 1, align=4) for n in (5, 3, 9)]
    pool, tier = HostPool(1 << 24), make_device_tier(1 << 30, "cpu")
    g = ParamGatherer(32, comm=Comm())
    g.allocate_from(tier, parts, pool)
    shards = [torch.arange(p.shard_numel, dtype=torch.float32) + 10 * i for i, p in enumerate(parts)]
    outs = [torch.full((p.numel,), float("nan")) for p in parts]
    for i, p in enumerate(parts):
        g.add(i, shards[i], p, outs[i])
    g.wait()
    for i, p in enumerate(parts):
        assert_close(outs[i], shards[i][:p.numel])
    assert tier.stats()["peak"] == 0
    assert 0 < pool.stats()["current"] <= ParamGatherer.buffer_bytes(32, 4, parts, alignment=pool.alignment)
    tier.close()


def test_init_distributed_without_launcher(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert init_distributed(ZeroConfig()) == (0, 1)
    assert not dist.is_initialized()
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ZerotierError, match="WORLD_SIZE"):
        init_distributed(ZeroConfig())


def test_init_distributed_from_launcher_env(monkeypatch):
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(k, v)
    try:
        assert init_distributed(ZeroConfig(timeout_s=7)) == (0, 1)
        # init_distributed makes "cpu:gloo,cuda:nccl" where CUDA exists (GPU review N2)
        assert dist.is_initialized() and dist.get_backend() in ("cpu:gloo,cuda:nccl", "gloo")
        assert init_distributed(ZeroConfig()) == (0, 1)  # already initialized: left as it is
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_collectives_carry_profiler_labels():
    comm = Comm()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        comm.reduce_scatter(torch.empty(4), torch.ones(4)).wait()
        comm.all_gather(torch.empty(4), torch.ones(4)).wait()
        comm.all_reduce(torch.ones(4)).wait()
    names = {e.name for e in prof.events()}
    assert {"zerotier::reduce_scatter", "zerotier::all_gather", "zerotier::all_reduce",
            "zerotier::all_reduce.wait"} <= names


# ------------------------------------------------------------------------------------------------
# Two gloo ranks

SIZES = [1, 2, 3, 7, 64, 1001, 4099]  # shard sizes; the flats are WORLD x these


def _data(rank: int, numel: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + numel)
    return torch.randn(numel, generator=g).to(dtype)


def _check_collectives(rank: int, ws: int, comm: Comm) -> None:
    for shard_n in SIZES:
        n = ws * shard_n
        for dtype in (torch.float32, torch.bfloat16):
            tol = {} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
            total = sum(_data(r, n).double() for r in range(ws))
            for op, expected in ((SUM, total), (AVG, total / ws)):
                out = torch.empty(shard_n, dtype=dtype)
                flat = _data(rank, n, dtype)
                before = flat.clone()
                comm.reduce_scatter(out, flat, op=op).wait()
                assert_close(out.double(), expected[rank * shard_n:(rank + 1) * shard_n], **tol)
                assert torch.equal(flat, before)  # the input flat is left unchanged
                red = _data(rank, n, dtype)
                comm.all_reduce(red, op).wait()
                assert_close(red.double(), expected, **tol)
            full = torch.empty(n, dtype=dtype)
            comm.all_gather(full, _data(rank, shard_n, dtype)).wait()
            assert torch.equal(full, torch.cat([_data(r, shard_n, dtype) for r in range(ws)]))


def _check_counters(rank: int, ws: int, comm: Comm, emulated: bool) -> None:
    comm.reset_stats()
    flat = torch.ones(1024 * ws)              # B = 8 KiB for ws = 2
    nbytes = flat.numel() * 4
    shard = torch.empty(flat.numel() // ws)
    comm.reduce_scatter(shard, flat).wait()
    comm.all_gather(flat, shard).wait()
    comm.all_reduce(flat).wait()
    comm.broadcast(flat, src=1).wait()
    rs_cost = ring_bytes("all_reduce" if emulated else "reduce_scatter", nbytes, ws)
    assert comm.stats() == {"reduce_scatter": rs_cost, "all_gather": (ws - 1) * nbytes // ws,
                            "all_reduce": 2 * (ws - 1) * nbytes // ws, "broadcast": (ws - 1) * nbytes // ws}
    detail = comm.stats(detail=True)
    assert detail["reduce_scatter"]["emulated"] == int(emulated)
    assert detail["all_gather"]["emulated"] == int(emulated)


def _check_buckets(rank: int, ws: int, comm: Comm) -> dict:
    numels = [10, 100, 7, 300, 50, 1, 2000]  # padded (ws 2): 10 100 8 300 50 2 2000 -> x4 bytes
    parts = partition_units(numels, ws, persistence_threshold=5)  # the 1-element unit is replicated
    grads = {i: _data(rank, n) for i, n in enumerate(numels)}
    expected = {i: sum(_data(r, n) for r in range(ws)) / ws for i, n in enumerate(numels)}
    got: dict[int, torch.Tensor] = {}
    comm.reset_stats()
    bucketer = _tiered(GradBucketer(1024, lambda k, s: got.__setitem__(k, s.clone()), comm=comm), parts)
    for i in range(len(numels)):
        bucketer.add(i, grads[i], parts[i])
    bucketer.flush()
    bucketer.wait()
    # reduce-scatter buckets: [40+400+32 B] [1200 B] [200 B] [8000 B]; all-reduce bucket: [1 elem]
    assert bucketer.buckets_launched == 5
    detail = comm.stats(detail=True)
    assert detail["reduce_scatter"]["calls"] == 4 and detail["all_reduce"]["calls"] == 1
    for i, p in enumerate(parts):
        assert got[i].numel() == p.shard_numel
        start, end = p.shard_range(rank)
        assert_close(got[i][:end - start], expected[i][start:end])
        assert torch.all(got[i][end - start:] == 0)  # padding stays zero
    # the parameter all-gather inverts it: every rank rebuilds every full flat
    shards = {i: torch.nn.functional.pad(expected[i], (0, p.padded_numel - p.numel))
              [rank * p.shard_numel:(rank + 1) * p.shard_numel].clone() for i, p in enumerate(parts)
              if not p.replicated}
    shards.update({i: expected[i].clone() for i, p in enumerate(parts) if p.replicated})
    outs = {i: torch.full((p.padded_numel if i == 6 else p.numel,), float("nan")) for i, p in enumerate(parts)}
    ready = []
    gatherer = _tiered(ParamGatherer(1024, lambda k, flat: ready.append(k), comm=comm), parts)
    for i, p in enumerate(parts):
        gatherer.add(i, shards[i], p, outs[i])
    gatherer.wait()
    assert sorted(ready) == list(range(len(numels)))
    for i, p in enumerate(parts):
        assert_close(outs[i][:p.numel], expected[i])
    return comm.stats(detail=True)


def _zero_step_bytes(rank: int, ws: int, comm: Comm, stage: int) -> dict:
    """The collectives of one step of `stage` over fp32 units; returns this rank's byte counts."""
    numels = [4096, 1000, 333, 65536]
    parts = partition_units(numels, ws)
    comm.reset_stats()
    if stage == 0:  # plain data parallel
        for n in numels:
            comm.all_reduce(torch.ones(n), AVG).wait()
        return comm.stats()
    gatherer = _tiered(ParamGatherer(1 << 20, comm=comm), parts)
    for _ in range(2 if stage == 3 else 1):  # stage 3: forward and backward gathers
        for i, p in enumerate(parts):
            gatherer.add(i, torch.ones(p.shard_numel), p, torch.empty(p.padded_numel))
        gatherer.wait()
    bucketer = _tiered(GradBucketer(1 << 20, lambda k, s: None, comm=comm), parts)
    for i, p in enumerate(parts):
        bucketer.add(i, torch.ones(p.numel), p)
    bucketer.wait()
    return comm.stats()


def _check_refusing_backend(rank: int, ws: int) -> dict:
    """An older backend: no reduce_scatter/all_gather into tensors, no AVG. Each refusal is probed
    once, cached, and the emulation gives the same results."""
    probes = {"reduce_scatter": 0, "all_gather": 0, "all_reduce_avg": 0}
    saved = {name: getattr(dist, name) for name in ("reduce_scatter_single", "reduce_scatter_tensor",
                                                    "all_gather_single", "all_gather_into_tensor", "all_reduce")
             if hasattr(dist, name)}

    def refuse(kind, message):
        def fn(*args, **kwargs):
            probes[kind] += 1
            raise RuntimeError(message)
        return fn

    def all_reduce(tensor, op=SUM, **kwargs):
        if op == AVG:
            probes["all_reduce_avg"] += 1
            raise RuntimeError("Cannot use ReduceOp.AVG with Gloo")
        return saved["all_reduce"](tensor, op=op, **kwargs)

    for name in saved:
        if name.startswith("reduce_scatter"):
            setattr(dist, name, refuse("reduce_scatter", "ProcessGroupGloo does not support reduce_scatter"))
        elif name.startswith("all_gather"):
            setattr(dist, name, refuse("all_gather", "ProcessGroupGloo does not support allgather_into_tensor"))
    dist.all_reduce = all_reduce
    try:
        comm = Comm(reduce_scatter="native")
        for shard_n in (3, 1001):
            n = ws * shard_n
            expected = sum(_data(r, n) for r in range(ws)) / ws
            out = torch.empty(shard_n)
            comm.reduce_scatter(out, _data(rank, n), op=AVG).wait()
            assert_close(out, expected[rank * shard_n:(rank + 1) * shard_n])
            red = _data(rank, n)
            comm.all_reduce(red, AVG).wait()
            assert_close(red, expected)
            full = torch.empty(n)
            comm.all_gather(full, _data(rank, shard_n)).wait()
            assert torch.equal(full, torch.cat([_data(r, shard_n) for r in range(ws)]))
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
    return {"probes": probes, "stats": comm.stats(detail=True)}


def _rank_main(rank: int, ws: int) -> dict:
    out = {"refusing": _check_refusing_backend(rank, ws)}
    for emulated in (False, True):
        comm = Comm(reduce_scatter="all_reduce" if emulated else "native",
                    all_gather="list" if emulated else "native")
        _check_collectives(rank, ws, comm)
        _check_counters(rank, ws, comm, emulated)
        out[f"buckets_emulated={emulated}"] = _check_buckets(rank, ws, comm)
    # "auto" on gloo: the all-reduce emulation (measured faster than gloo's reduce-scatter)
    auto = Comm()
    auto.reduce_scatter(torch.empty(4), torch.ones(4 * ws)).wait()
    out["auto_emulated"] = auto.stats(detail=True)["reduce_scatter"]["emulated"]
    comm = Comm(timeout_s=5, reduce_scatter="native")
    out["zero_steps"] = {stage: _zero_step_bytes(rank, ws, comm, stage) for stage in (0, 1, 3)}
    # broadcast: every rank ends with rank 0's initial weights
    weights = _data(rank, 33)
    comm.broadcast(weights, src=0).wait()
    assert torch.equal(weights, _data(0, 33))
    # no overlap: complete when issued
    sync = Comm(overlap=False)
    h = sync.all_reduce(torch.ones(3))
    assert h.done()
    # async: a handle may be polled, then waited
    big = torch.ones(1 << 20)
    h = comm.all_reduce(big)
    while not h.done():
        time.sleep(0.001)
    h.wait()
    assert torch.all(big == ws)
    # a sync point where one rank reports a failure stops every rank with a clear error
    comm.check_all_ranks(True, "before step 1")
    try:
        comm.check_all_ranks(rank != 1, "before step 2")
    except CollectiveError as exc:
        out["check_all_ranks"] = str(exc)
    return out


def test_collectives_buckets_and_counters_on_two_ranks():
    results = spawn(_rank_main, WORLD, timeout_s=90)
    for rank, res in enumerate(results):
        # a backend refusal is probed once (AVG, then SUM for reduce-scatter), then emulated
        assert res["refusing"]["probes"] == {"reduce_scatter": 2, "all_gather": 1, "all_reduce_avg": 1}
        emulated_calls = {k: v["emulated"] for k, v in res["refusing"]["stats"].items()}
        assert emulated_calls == {"reduce_scatter": 2, "all_gather": 2, "all_reduce": 2, "broadcast": 0}
        # the emulated reduce-scatter moves twice the bytes of the native one (all-reduce of the flat)
        native, emulated = res["buckets_emulated=False"], res["buckets_emulated=True"]
        assert emulated["reduce_scatter"]["bytes"] == 2 * native["reduce_scatter"]["bytes"]
        assert emulated["all_gather"]["bytes"] == native["all_gather"]["bytes"]
        # ZeRO paper: DP all-reduce 2 Psi, ZeRO-1/2 reduce-scatter + all-gather 2 Psi, ZeRO-3 3 Psi
        # (x (N-1)/N per rank, Psi = padded fp32 bytes of the model)
        steps = res["zero_steps"]
        psi = sum(p.padded_numel * 4 for p in partition_units([4096, 1000, 333, 65536], WORLD))
        per_rank = psi * (WORLD - 1) // WORLD
        assert steps[1] == {"reduce_scatter": per_rank, "all_gather": per_rank, "all_reduce": 0, "broadcast": 0}
        assert steps[3] == {"reduce_scatter": per_rank, "all_gather": 2 * per_rank, "all_reduce": 0,
                            "broadcast": 0}
        assert steps[0]["all_reduce"] == 2 * (4096 + 1000 + 333 + 65536) * 4 * (WORLD - 1) // WORLD
        assert res["auto_emulated"] == 1
        assert res["check_all_ranks"] == f"rank {rank}: before step 2: rank(s) 1 failed; see their log"


# ------------------------------------------------------------------------------------------------
# Failures: a rank that dies or stops must not leave the others hanging

COLLECTIVE_TIMEOUT_S = 3.0


def _rank_dies(rank: int, ws: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 broke before the all-reduce")
    buf = torch.ones(1024)
    Comm(timeout_s=COLLECTIVE_TIMEOUT_S).all_reduce(buf).wait()


def test_dead_rank_makes_the_other_raise_a_clear_error():
    start = time.monotonic()
    with pytest.raises(SpawnError) as info:
        spawn(_rank_dies, WORLD, timeout_s=60, collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    failures = info.value.failures
    assert "ValueError: rank 1 broke before the all-reduce" in failures[1]
    assert "CollectiveError: rank 0: collective all_reduce" in failures[0]
    assert "another rank probably failed" in failures[0]
    assert time.monotonic() - start < 30  # spawn start-up + at most the collective timeout


def _rank_stalls(rank: int, ws: int, marker: str) -> None:
    if rank == 1:  # alive but never joins the collective, until rank 0 has given up
        deadline = time.monotonic() + 30
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        return
    try:
        Comm(timeout_s=COLLECTIVE_TIMEOUT_S).reduce_scatter(torch.empty(8), torch.ones(16)).wait()
    finally:
        Path(marker).touch()


def test_stalled_rank_times_out_with_a_clear_error(tmp_path):
    start = time.monotonic()
    with pytest.raises(SpawnError) as info:
        spawn(_rank_stalls, WORLD, str(tmp_path / "rank0-gave-up"), timeout_s=60,
              collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    assert list(info.value.failures) == [0]
    msg = info.value.failures[0]
    assert f"rank 0: collective reduce_scatter timed out after {COLLECTIVE_TIMEOUT_S:g} s" in msg
    assert time.monotonic() - start < 30


def _rank_hangs_forever(rank: int, ws: int) -> None:
    time.sleep(3600)


def test_spawn_kills_ranks_past_its_timeout():
    start = time.monotonic()
    with pytest.raises(SpawnError, match="killed after the 4 s spawn timeout") as info:
        spawn(_rank_hangs_forever, WORLD, timeout_s=4)
    assert sorted(info.value.failures) == [0, 1]
    assert time.monotonic() - start < 15


# ------------------------------------------------------------------------------------------------
# CUDA (NCCL, one rank: the lent machine has one GPU): the comm stream path


@pytest.mark.cuda
@pytest.mark.parametrize("emulate", [False, True])
def test_cuda_collectives_on_comm_stream(monkeypatch, emulate):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(k, v)
    assert init_distributed(ZeroConfig(timeout_s=30)) == (0, 1)
    try:
        assert "cuda:nccl" in dist.get_backend()  # "cpu:gloo,cuda:nccl" (GPU review N2)
        comm = Comm(reduce_scatter="all_reduce" if emulate else "native",
                    all_gather="list" if emulate else "native")
        x = torch.randn(1 << 20, device="cuda")
        y = x * 2                                   # queued on the compute stream
        shard = torch.empty_like(y)
        h = comm.reduce_scatter(shard, y, op=AVG)   # on comm.stream, after y is ready
        h.wait()
        assert comm.stream is not None
        assert torch.equal(shard, x * 2)
        full = torch.empty_like(shard)
        comm.all_gather(full, shard).wait()
        assert torch.equal(full, x * 2)
        got = []
        b = _tiered(GradBucketer(1 << 16, lambda k, s: got.append(s.clone()), comm=comm), [Partition(y.numel(), 1)],
                    device="cuda")
        b.add(0, y, Partition(y.numel(), 1))
        b.wait()
        assert torch.equal(got[0], x * 2)
    finally:
        dist.destroy_process_group()
