"""Tier accounting, host pool, device tier and TierManager moves between every tier pair."""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future

import pytest
import torch

from zerotier.config import IOConfig, TiersConfig
from zerotier.errors import BudgetError, ZerotierError
from zerotier.tiers import (BudgetedTier, ChainTicket, DeviceTier, DoneTicket, FutureTicket, HostPool,
                            Tier, TierManager)

SIZES = [1, 7, 4095, 4097, (1 << 20) + 3]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8]
PAGE = 4096


def rand(n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    return torch.randint(0, 127 if dtype == torch.uint8 else 1 << 40, (n,), generator=g, dtype=dtype)


# ------------------------------------------------------------------------ accounting

def test_budgeted_tier_accounting_and_message():
    t = BudgetedTier("host", 10_000, hint="Raise tiers.host or move optimizer state to nvme.")
    assert isinstance(t, Tier)
    t.reserve(6000, "a")
    t.reserve(3000, "b")
    t.release(6000)
    assert (t.used, t.peak, t.free_bytes) == (3000, 9000, 7000)
    with pytest.raises(BudgetError) as ei:
        t.reserve(8000, "optimizer state of layer 3")
    msg = str(ei.value)
    assert msg.startswith("host tier budget exceeded")
    assert "requested 7.81 KiB (8000 B) for optimizer state of layer 3" in msg
    assert "free 6.84 KiB (7000 B)" in msg and "raise tiers.host or move optimizer state to nvme" in msg.lower()
    assert isinstance(ei.value, MemoryError)
    assert t.used == 3000  # a refused reserve takes nothing
    t.count_in(5)
    t.count_out(7)
    assert t.stats() == {"current": 3000, "peak": 9000, "budget": 10_000, "bytes_in": 5,
                         "bytes_out": 7, "allocations": 2}
    with pytest.raises(AssertionError, match="accounting error"):
        t.release(4000)


def test_budgeted_tier_thread_safe():
    t = BudgetedTier("device", 64, hint="")

    def worker():
        for _ in range(2000):
            if t.try_reserve(3):
                t.release(3)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert t.used == 0 and t.peak <= 64


def test_chain_ticket_runs_finish_once_and_caches_errors():
    calls = []
    fut = Future()
    t = ChainTicket(FutureTicket(fut), lambda r: calls.append(r) or r * 2)
    assert not t.done()
    with pytest.raises(TimeoutError):
        t.wait(0.01)
    fut.set_result(21)
    assert t.done() and t.wait() == 42 and t.wait() == 42 and calls == [21]

    def boom(r):
        raise ValueError(f"bad {r}")
    bad = ChainTicket(DoneTicket(3), boom)
    for _ in range(2):
        with pytest.raises(ValueError, match="bad 3"):
            bad.wait()
    assert asyncio.run(_await(ChainTicket(DoneTicket(5), lambda r: r + 1))) == 6


async def _await(t):
    return await t


# ------------------------------------------------------------------------- host pool

def test_host_pool_alignment_views_and_reuse():
    pool = HostPool(1 << 20, alignment=PAGE, pin=False)
    bufs = [pool.alloc(n * 2, torch.bfloat16, what=f"b{n}") for n in (1, 4097, 7)]
    for b in bufs:
        assert b.block.data_ptr() % PAGE == 0 and b.capacity % PAGE == 0
        assert b.tensor.dtype == torch.bfloat16 and b.tensor.numel() == b.nbytes // 2
        assert b.tensor.data_ptr() == b.block.data_ptr()
    assert bufs[1].view((4097, 1)).shape == (4097, 1)
    assert bufs[1].view(dtype=torch.uint8).numel() == 4097 * 2
    held = pool.stats()["current"]
    assert held == PAGE + 3 * PAGE + PAGE
    # repeated alloc/free of the same sizes does not grow the pool
    for _ in range(50):
        for b in bufs:
            pool.free(b)
        bufs = [pool.alloc(n * 2, torch.bfloat16) for n in (1, 4097, 7)]
    st = pool.stats()
    assert st["current"] == held and st["peak"] == held and st["allocations"] == 3
    assert st["reuses"] == 150 and st["in_use"] == held and st["cached"] == 0
    for b in bufs:
        pool.free(b)
    assert pool.stats()["cached"] == held and pool.stats()["in_use"] == 0
    assert pool.trim() == held and pool.stats()["current"] == 0
    with pytest.raises(ValueError, match="whole number"):
        pool.alloc(3, torch.float32)


def test_host_pool_best_fit_and_double_free():
    pool = HostPool(1 << 20, alignment=PAGE, pin=False)
    big = pool.alloc(3 * PAGE)
    pool.free(big)
    small = pool.alloc(2 * PAGE)          # 3 pages <= 2 x 2 pages: best fit reuses it
    assert small.capacity == 3 * PAGE and pool.stats()["reuses"] == 1
    pool.free(small)
    tiny = pool.alloc(1)                  # 3 pages > 2 x 1 page: a new block instead
    assert tiny.capacity == PAGE and pool.stats()["current"] == 4 * PAGE
    pool.free(tiny)
    with pytest.raises(ZerotierError, match="double free"):
        pool.free(tiny)


def test_host_pool_budget_trims_cache_first():
    pool = HostPool(8 * PAGE, alignment=PAGE, pin=False)
    a = pool.alloc(4 * PAGE)
    pool.free(a)                          # cached: 4 pages held
    b = pool.alloc(6 * PAGE + 1)          # needs 7 pages: the cached block is released first
    st = pool.stats()
    assert st["current"] == 7 * PAGE and st["cached"] == 0
    with pytest.raises(BudgetError) as ei:
        pool.alloc(2 * PAGE, what="adam moments")
    msg = str(ei.value)
    assert msg.startswith("host tier") and "(8192 B) for adam moments" in msg and "free 4.00 KiB" in msg
    assert "tiers.host" in msg
    pool.free(b)
    pool.close()
    assert pool.stats()["current"] == 0


def test_host_pool_deferred_free():
    pool = HostPool(1 << 20, alignment=PAGE, pin=False)
    a = pool.alloc(PAGE)
    fut = Future()
    pool.free(a, after=FutureTicket(fut))   # e.g. an async copy still reads it
    b = pool.alloc(PAGE)
    assert b.block.data_ptr() != a.block.data_ptr() and pool.stats()["parked"] == PAGE
    fut.set_result(PAGE)
    c = pool.alloc(PAGE)
    assert c.block.data_ptr() == a.block.data_ptr() and pool.stats()["parked"] == 0


def test_host_pool_threads():
    pool = HostPool(64 << 20, alignment=PAGE, pin=False)

    def worker(seed):
        g = torch.Generator().manual_seed(seed)
        for _ in range(200):
            n = int(torch.randint(1, 5 * PAGE, (1,), generator=g))
            b = pool.alloc(n)
            b.tensor.fill_(seed)
            assert bool((b.tensor == seed).all())
            pool.free(b)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    st = pool.stats()
    assert st["in_use"] == 0 and st["live_buffers"] == 0 and st["current"] == st["cached"]


# ----------------------------------------------------------------------- device tier

def test_device_tier_cpu_alloc_free_and_copies():
    dev = DeviceTier(1 << 20, "cpu")
    assert dev.device.type == "cpu" and not dev.is_cuda
    t = dev.alloc((256, 256), torch.float32, what="w")  # 256 KiB
    assert dev.used == 1 << 18
    with pytest.raises(BudgetError, match="device tier budget exceeded.*tiers.device"):
        dev.alloc((1024, 1024), torch.float32)
    host = rand(256 * 256, torch.float32).view(256, 256)
    dev.copy_h2d(t, host).wait()
    assert torch.equal(t, host)
    back = torch.empty_like(host)
    tk = dev.copy_d2h(back, t)
    assert asyncio.run(_await(tk)) == host.nbytes and torch.equal(back, host)
    with pytest.raises(ValueError, match="differ"):
        dev.copy_h2d(t, host.to(torch.float16))
    with pytest.raises(ZerotierError, match="did not allocate"):
        dev.free(torch.empty(3))
    dev.free(t)
    st = dev.stats()
    assert st["current"] == 0 and st["bytes_in"] == host.nbytes and st["bytes_out"] == host.nbytes
    dev.close()


# --------------------------------------------------------------------------- manager

def make_manager(tmp_path, device="cpu", **io):
    tiers = TiersConfig(device=512 << 20, host=512 << 20, nvme=2 << 30, nvme_path=str(tmp_path))
    return TierManager(tiers, IOConfig(checksum="crc32c", **io), device=device)


def check(m, shard, expect):
    """Compare a shard's bytes with `expect`, wherever the shard lives."""
    if shard.location == "nvme":
        out = torch.empty(shard.shape, dtype=shard.dtype)
        m.nvme.read(shard.nvme_key, out).wait()
    else:
        out = m.get(shard).cpu()
    assert out.dtype == expect.dtype and torch.equal(out, expect), shard.key


def test_round_trips_every_tier_pair(tmp_path):
    """host -> device -> nvme -> host -> nvme -> device -> host: every directed pair
    (nvme<->device staged through host), all sizes x dtypes in flight at once."""
    route = ["device", "nvme", "host", "nvme", "device", "host"]
    with make_manager(tmp_path) as m:
        data = {(n, d): rand(n, d, seed=n) for n in SIZES for d in DTYPES}
        shards = {k: m.place(f"{k[1]}/{k[0]}", v, "host") for k, v in data.items()}
        total = sum(v.nbytes for v in data.values())
        for dst in route:
            tickets = [m.move(s, dst) for s in shards.values()]
            assert sum(t.wait() for t in tickets) == total
            for k, s in shards.items():
                assert s.location == dst and s.pending is None
                check(m, s, data[k])
        st = m.stats()
        pairs = {"host->device", "device->nvme", "nvme->host", "host->nvme", "nvme->device", "device->host"}
        assert set(st["moved"]) == pairs
        assert all(st["moved"][p] == {"bytes": total, "count": len(data)} for p in pairs)
        # everything is back on host: the other tiers hold nothing, staging blocks were returned
        assert st["device"]["current"] == 0 and st["nvme"]["files"] == 0
        # freed swap files are kept for reuse (and counted) until trimmed; the second
        # visit to nvme reused the files the first one left
        assert st["nvme"]["current"] == st["nvme"]["recycled"] and st["nvme"]["reuses"] >= len(data) - 5
        m.nvme.trim()
        assert m.nvme.used == 0 and not list(m.nvme.run_dir.glob("*.swp"))
        assert st["host"]["in_use"] == sum(s.host_buf.capacity for s in shards.values())
        assert st["inflight_bytes"] == 0 and st["device"]["peak"] >= total
        for s in shards.values():
            m.drop(s)
        assert m.host.stats()["in_use"] == 0


def test_move_to_same_tier_and_shard_shapes(tmp_path):
    with make_manager(tmp_path) as m:
        x = rand(6 * 7, torch.float16).view(6, 7)
        s = m.place("w", x, "device")
        assert s.nbytes == x.nbytes and m.move(s, "device").wait() == 0
        m.move(s, "nvme").wait()
        assert m.nvme.entry("w").shape == (6, 7)
        m.move(s, "device").wait()
        assert m.get(s).shape == (6, 7) and torch.equal(m.get(s), x)
        with pytest.raises(ValueError, match="already exists"):
            m.place("w", x, "host")
        with pytest.raises(ValueError, match="unknown tier"):
            m.move(s, "disk")


def test_inflight_bytes_bounded(tmp_path):
    cap = 1 << 20
    with make_manager(tmp_path, max_inflight_bytes=cap) as m:
        xs = [rand(64 * 1024, torch.float32, i) for i in range(24)]  # 256 KiB each
        shards = [m.place(f"s{i}", x, "host") for i, x in enumerate(xs)]
        tickets = []
        for s in shards:
            tickets.append(m.move(s, "nvme"))
            assert m.stats()["inflight_bytes"] <= cap
        for t in tickets:
            t.wait()
        big = m.place("big", rand(1 << 19, torch.float32), "host")  # 2 MiB > cap: moves alone
        m.move(big, "nvme").wait()
        tickets = [m.move(s, "device") for s in shards + [big]]
        for t in tickets:
            t.wait()
        for s, x in zip(shards, xs):
            check(m, s, x)
        assert m.stats()["inflight_bytes"] == 0


def test_moves_from_many_threads_and_async(tmp_path):
    with make_manager(tmp_path) as m:
        xs = [rand(10_000 + i, torch.bfloat16, i) for i in range(32)]
        shards = [m.place(f"t{i}", x, "host") for i, x in enumerate(xs)]

        def worker(part):
            for dst in ("nvme", "device", "host", "nvme"):
                for t in [m.move(s, dst) for s in part]:
                    t.wait()

        threads = [threading.Thread(target=worker, args=(shards[i::4],)) for i in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()

        async def bring_back():
            return await asyncio.gather(*(m.move(s, "device") for s in shards))

        assert asyncio.run(bring_back()) == [x.nbytes for x in xs]
        for s, x in zip(shards, xs):
            check(m, s, x)
        m.synchronize()


def test_nvme_disabled(tmp_path):
    tiers = TiersConfig(device=1 << 20, host=1 << 20, nvme=0)
    with TierManager(tiers, IOConfig(), device="cpu") as m:
        s = m.place("a", torch.ones(4), "host")
        with pytest.raises(BudgetError, match="nvme tier is disabled"):
            m.move(s, "nvme")
        assert m.stats()["nvme"] is None


# ------------------------------------------------------------------------------ CUDA

@pytest.mark.cuda
def test_cuda_pinned_pool_and_event_tickets():
    pool = HostPool(64 << 20, alignment=PAGE, pin=True)
    buf = pool.alloc(4097 * 4, torch.float32)
    assert buf.pinned and buf.tensor.is_pinned()
    assert pool.stats()["current"] == 5 * PAGE  # real bytes, not a power of two
    buf.tensor.copy_(rand(4097, torch.float32))
    dev = DeviceTier(64 << 20, "cuda")
    d = dev.alloc((4097,), torch.float32)
    t = dev.copy_h2d(d, buf.tensor)
    t.wait_on()  # the current stream waits for the copy stream's event
    back = pool.alloc(4097 * 4, torch.float32)
    dev.copy_d2h(back.tensor, d * 1).wait()
    assert torch.equal(back.tensor, buf.tensor)
    pool.free(buf)
    pool.free(back)
    dev.free(d)
    pool.close()
    assert pool.stats()["current"] == 0


@pytest.mark.cuda
def test_cuda_round_trips_every_pair(tmp_path):
    route = ["device", "nvme", "host", "nvme", "device", "host"]
    with make_manager(tmp_path, device="cuda") as m:
        assert m.device.is_cuda and m.host.pin
        data = {(n, d): rand(n, d, seed=n) for n in SIZES for d in DTYPES}
        shards = {k: m.place(f"{k[1]}/{k[0]}", v, "host") for k, v in data.items()}
        for dst in route:
            for t in [m.move(s, dst) for s in shards.values()]:
                t.wait()
            for k, s in shards.items():
                check(m, s, data[k])


def test_manager_nvme_moves_need_no_staging_copy(tmp_path, monkeypatch):
    """Pool blocks are aligned and padded: the store reads/writes them in place."""
    import zerotier.tiers.nvme as nvme_mod

    def no_staging(*a, **k):
        raise AssertionError("NVMeStore made a staging copy")

    with make_manager(tmp_path) as m:
        x = rand(4097, torch.bfloat16).view(17, 241)
        s = m.place("z", x, "host")
        monkeypatch.setattr(nvme_mod, "aligned_empty", no_staging)
        for dst in ("nvme", "host", "device", "nvme", "device"):
            m.move(s, dst).wait()
        check(m, s, x)
