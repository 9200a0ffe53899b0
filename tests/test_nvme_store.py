"""NVMeStore: run directory lifecycle, one-file-per-shard layout, round trips, budget."""
from __future__ import annotations

import errno
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from zerotier.config import IOConfig, TiersConfig
from zerotier.errors import BudgetError, ConfigError, TierIOError
from zerotier.tiers import HostPool, NVMeStore, scan_stale
from zerotier.tiers.rundir import MAGIC

from concurrency import run_threads

SIZES = [1, 7, 4095, 4097, (1 << 20) + 3]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8]


def rand(n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    return torch.randint(0, 127 if dtype == torch.uint8 else 1 << 40, (n,), generator=g, dtype=dtype)


def cfgs(path, nvme=1 << 30, **io):
    return TiersConfig(nvme=nvme, nvme_path=str(path)), IOConfig(**io)


@pytest.fixture
def store(tmp_path):
    s = NVMeStore(*cfgs(tmp_path, checksum="crc32c"))
    yield s
    s.close()


def swap_file(store, key):
    """[Note: NVMe layout]: `<key>.swp` in the run directory, '/' escaped as %2F."""
    return store.run_dir / (key.replace("/", "%2F") + ".swp")


def run_dirs(parent):
    return sorted(p for p in parent.iterdir() if p.name.startswith("zerotier-"))


# ------------------------------------------------------------------ layout / run dir

def test_run_dir_layout_and_cleanup(tmp_path):
    s = NVMeStore(*cfgs(tmp_path))
    rd = s.run_dir
    assert rd.parent == tmp_path and rd.name.startswith(f"zerotier-{os.getpid()}-")
    assert stat.S_IMODE(os.stat(rd).st_mode) == 0o700
    owner = json.loads((rd / "owner.json").read_text())
    assert owner["magic"] == MAGIC and owner["pid"] == os.getpid()
    assert owner["hostname"] == socket.gethostname()
    s.write("layer.0/w", torch.arange(10.0)).wait()
    f = swap_file(s, "layer.0/w")
    assert f.parent == rd and f.name.endswith(".swp") and "/" not in f.name
    assert stat.S_IMODE(os.stat(f).st_mode) == 0o600
    assert os.stat(f).st_size == 4096  # 40 B rounded up to io.alignment
    s.close()
    assert not rd.exists() and list(tmp_path.iterdir()) == []
    s.close()  # idempotent


def test_context_manager_cleans_up_on_exception(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with NVMeStore(*cfgs(tmp_path)) as s:
            s.write("a", torch.ones(100)).wait()
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_live_run_dir_is_left_alone(tmp_path):
    tiers, io = cfgs(tmp_path)
    first = NVMeStore(tiers, io)
    x = rand(5000, torch.bfloat16)
    first.write("x", x).wait()
    # a scan by another store must not touch a live, locked run dir, and says so quietly
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        other = NVMeStore(tiers, io)
    assert first.run_dir in scan_stale(tmp_path)["kept"] and first.run_dir.exists()
    assert other.run_dir != first.run_dir
    other.close()
    y = torch.empty_like(x)
    assert first.read("x", y).wait() == x.nbytes and torch.equal(x, y)
    first.close()
    assert not first.run_dir.exists()


def test_needs_nvme_path(tmp_path):
    with pytest.raises(ConfigError, match="tiers.nvme_path"):
        NVMeStore(TiersConfig(nvme=1 << 20, nvme_path=None), IOConfig())


# ----------------------------------------------------------------------- stale dirs

def _fake_run_dir(parent, name, owner=None, lock=True):
    d = parent / name
    d.mkdir(mode=0o700)
    if lock:
        (d / ".lock").touch()
    if owner is not None:
        (d / "owner.json").write_text(json.dumps(owner))
    (d / "shard.swp").write_bytes(b"x" * 4096)
    return d


def _dead_pid():
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def _owner(**kw):
    o = {"magic": MAGIC, "pid": _dead_pid(), "hostname": socket.gethostname(),
         "boot_id": open("/proc/sys/kernel/random/boot_id").read().strip(), "pid_start": 1,
         "start_time": 0.0}
    o.update(kw)
    return o


def test_stale_dir_with_dead_pid_and_marker_is_removed(tmp_path):
    dead = _fake_run_dir(tmp_path, "zerotier-1-dead", _owner())
    with pytest.warns(RuntimeWarning, match="removed stale run directory"):
        s = NVMeStore(*cfgs(tmp_path))
    assert not dead.exists()
    s.close()


def test_stale_dirs_not_provably_ours_are_kept(tmp_path):
    no_marker = _fake_run_dir(tmp_path, "zerotier-2-nomarker", owner=None)
    foreign = _fake_run_dir(tmp_path, "zerotier-3-foreign", {"magic": "something else", "pid": 1})
    other_host = _fake_run_dir(tmp_path, "zerotier-4-otherhost", _owner(hostname="not-" + socket.gethostname()))
    alien = _fake_run_dir(tmp_path, "zerotier-5-alien", _owner())
    (alien / "notes.txt").write_text("user data")  # a file zerotier never creates
    with pytest.warns(RuntimeWarning) as rec:
        report = scan_stale(tmp_path)
    text = "\n".join(str(w.message) for w in rec)
    assert "no zerotier owner marker" in text and str(no_marker) in text
    assert str(foreign) in text and "on host not-" in text
    assert "did not create" in text and "notes.txt" in text
    for d in (no_marker, foreign, other_host):
        assert d.exists() and (d / "shard.swp").exists()
    assert (alien / "notes.txt").read_text() == "user data"
    assert set(report["kept"]) == {no_marker, foreign, other_host, alien}
    assert report["removed"] == []


def test_killed_run_is_detected_and_removed_by_next_store(tmp_path):
    """A real SIGKILLed process: no atexit ran, its locked dir is left; the next store
    sees the lock free and the pid dead, and removes it."""
    code = textwrap.dedent(f"""
        import os, signal, torch
        from zerotier.config import IOConfig, TiersConfig
        from zerotier.tiers import NVMeStore
        s = NVMeStore(TiersConfig(nvme=1 << 30, nvme_path={str(tmp_path)!r}), IOConfig())
        s.write("w", torch.ones(1000)).wait()
        print(s.run_dir, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == -signal.SIGKILL, out.stderr
    left = run_dirs(tmp_path)
    assert [str(p) for p in left] == [out.stdout.strip()]
    with pytest.warns(RuntimeWarning, match="removed stale"):
        s = NVMeStore(*cfgs(tmp_path))
    assert run_dirs(tmp_path) == [s.run_dir]
    s.close()


def test_unclosed_store_is_cleaned_at_exit(tmp_path):
    code = textwrap.dedent(f"""
        import torch
        from zerotier.config import IOConfig, TiersConfig
        from zerotier.tiers import NVMeStore
        s = NVMeStore(TiersConfig(nvme=1 << 30, nvme_path={str(tmp_path)!r}), IOConfig())
        s.write("w", torch.ones(1000)).wait()
        print(s.run_dir, flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(str(tmp_path)) and list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------ round trips

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_sizes(store, dtype):
    tickets, srcs = [], {}
    for n in SIZES:
        srcs[n] = rand(n, dtype, seed=n)
        tickets.append(store.write(f"{dtype}/{n}", srcs[n]))
    assert [t.wait() for t in tickets] == [srcs[n].nbytes for n in SIZES]
    for n in SIZES:  # each file holds the bytes rounded up to io.alignment
        size = os.path.getsize(swap_file(store, f"{dtype}/{n}"))
        assert size % 4096 == 0 and 0 <= size - srcs[n].nbytes < 4096
    dsts = {n: torch.empty(n, dtype=dtype) for n in SIZES}
    reads = [store.read(f"{dtype}/{n}", dsts[n]) for n in SIZES]
    for t in reads:
        t.wait()
    for n in SIZES:
        assert torch.equal(dsts[n], srcs[n])


def test_sources_of_every_kind(store, tmp_path):
    base = rand(3 * 4096, torch.float32)
    cases = {
        "noncontig": base.view(3, 4096)[:, ::3],              # staged (not contiguous)
        "offset": base[1:1001],                               # staged (unaligned data_ptr)
        "aligned_exact": base[:4096],                         # zero copy, no padding needed
        "scalar": torch.tensor(3.5, dtype=torch.float64),     # 0-dim
        "empty": torch.empty(0, dtype=torch.float16),
        "2d": rand(77 * 13, torch.bfloat16).view(77, 13),
    }
    for k, src in cases.items():
        before = src.clone()
        assert store.write(k, src).wait() == src.nbytes
        assert torch.equal(src, before)  # sources are only ever read
        dst = torch.empty(src.shape, dtype=src.dtype)
        assert store.read(k, dst).wait() == src.nbytes
        assert torch.equal(dst, src.contiguous()), k
    # reading into a uint8 byte view and into a non-contiguous destination
    raw = torch.empty(cases["2d"].nbytes, dtype=torch.uint8)
    store.read("2d", raw).wait()
    assert torch.equal(raw.view(torch.bfloat16).view(77, 13), cases["2d"])
    nc = torch.empty(13, 77, dtype=torch.bfloat16).t()
    store.read("2d", nc).wait()
    assert torch.equal(nc, cases["2d"])


def test_host_buffer_zero_copy(store, monkeypatch):
    """Pool blocks are aligned and padded to the alignment: the store writes and reads
    them in place, never through a staging buffer."""
    import zerotier.tiers.nvme_files as nvme_mod

    def no_staging(*a, **k):
        raise AssertionError("NVMeStore made a staging copy")

    pool = HostPool(64 << 20, alignment=4096, pin=False)
    buf = pool.alloc(4097 * 2, torch.bfloat16)  # not a multiple of the alignment
    buf.tensor.copy_(rand(4097, torch.bfloat16))
    out = pool.alloc(4097 * 2, torch.bfloat16)
    monkeypatch.setattr(nvme_mod, "aligned_empty", no_staging)
    store.write("hb", buf).wait()
    store.read("hb", out).wait()
    assert torch.equal(out.tensor, buf.tensor)
    pool.free(buf)
    pool.free(out)


def test_rewrite_replaces_and_recycles_the_old_file(store):
    a, b = rand(10_000, torch.float32, 1), rand(20_000, torch.float32, 2)
    store.write("k", a).wait()
    assert store.used == 40960 and store.stats()["files"] == 1
    assert store.write("k", b).wait() == b.nbytes == store.nbytes("k")
    assert store.used == 40960 + 81920 and store.stats()["files"] == 1
    # the old version's file is kept for reuse and still counted
    names = sorted(p.name for p in store.run_dir.glob("*.swp"))
    assert len(names) == 2 and names[0].startswith("%free-") and names[1] == "k.swp"
    assert store.stats()["recycled"] == 40960
    out = torch.empty_like(b)
    store.read("k", out).wait()
    assert torch.equal(out, b)
    store.write("k2", a).wait()  # same file size as the recycled file: reused, not allocated
    assert store.stats()["reuses"] == 1 and store.stats()["recycled"] == 0
    assert store.used == 40960 + 81920 and store.stats()["files"] == 2
    store.read("k2", out[:10_000]).wait()
    assert torch.equal(out[:10_000], a)
    assert store.stats()["peak"] >= 40960 + 81920
    with pytest.raises(KeyError, match="no shard 'k3'"):
        store.read("k3", out)
    run_dir = store.run_dir
    store.close()
    assert store.used == 0 and not run_dir.exists()


def test_read_destination_checked(store):
    store.write("v", torch.ones(100)).wait()
    with pytest.raises(ValueError, match="holds 400 B"):
        store.read("v", torch.empty(99))
    with pytest.raises(ValueError, match="is torch.float32"):
        store.read("v", torch.empty(200, dtype=torch.float16))


def test_budget_enforced_on_aligned_size(tmp_path):
    s = NVMeStore(*cfgs(tmp_path, nvme=3 * 4096))
    s.write("a", torch.ones(1)).wait()         # 4 B -> 4096 B on disk
    s.write("b", torch.ones(1025)).wait()      # 4100 B -> 8192 B
    with pytest.raises(BudgetError) as ei:
        s.write("c", torch.ones(1))
    msg = str(ei.value)
    assert "nvme tier" in msg and "requested" in msg and "(4096 B)" in msg and "free 0 B" in msg
    assert "tiers.nvme" in msg and str(tmp_path) in msg
    assert s.stats()["files"] == 2 and s.used == 3 * 4096 and list(s.run_dir.glob("c*")) == []
    s.close()


def test_many_tickets_in_flight(store):
    srcs = [rand(50_000 + i, torch.float32, i) for i in range(64)]
    writes = [store.write(f"t{i}", x) for i, x in enumerate(srcs)]
    assert sum(t.wait() for t in writes) == sum(x.nbytes for x in srcs)
    dsts = [torch.empty_like(x) for x in srcs]
    reads = [store.read(f"t{i}", d) for i, d in enumerate(dsts)]
    assert all(t.wait() == x.nbytes for t, x in zip(reads, srcs))
    assert all(torch.equal(a, b) for a, b in zip(srcs, dsts))
    assert store.stats()["files"] == 64 and store.stats()["inflight"] == 0


def test_buffered_mode(tmp_path):
    with NVMeStore(*cfgs(tmp_path, o_direct=False, checksum="crc32c")) as s:
        x = rand(4097, torch.int64)
        s.write("b", x).wait()
        y = torch.empty_like(x)
        s.read("b", y).wait()
        assert torch.equal(x, y)


def test_read_waits_for_pending_write(store):
    x = rand((1 << 20) + 3, torch.float32)
    store.write("p", x)  # no wait: read must still see the complete data
    y = torch.empty_like(x)
    store.read("p", y).wait()
    assert torch.equal(x, y)


@pytest.mark.parametrize("backend", ["io_uring", "threads", "aiofiles"])
def test_every_io_backend(tmp_path, backend):
    import errno

    from zerotier import _native
    from zerotier.io import probe_io_uring
    if backend != "aiofiles" and _native.load("_zt_io") is None:
        pytest.skip("native I/O engine not built or disabled (ZEROTIER_NATIVE=0)")
    if backend == "io_uring" and not probe_io_uring()[0]:
        pytest.skip(f"io_uring unusable here: {probe_io_uring()[1]}")
    with NVMeStore(*cfgs(tmp_path, backend=backend, checksum="crc32c", block_size=1 << 16)) as s:
        assert s.engine.backend == backend
        xs = [rand(n, torch.bfloat16, n) for n in SIZES]
        for t in [s.write(f"k{i}", x) for i, x in enumerate(xs)]:
            t.wait()
        ys = [torch.empty_like(x) for x in xs]
        for t in [s.read(f"k{i}", y) for i, y in enumerate(ys)]:
            t.wait()
        assert all(torch.equal(x, y) for x, y in zip(xs, ys))
        s.engine.inject_fault(op="write", errno=errno.ENOSPC)
        with pytest.raises(TierIOError, match="No space left"):
            s.write("full", xs[-1]).wait()
        assert s.stats()["files"] == len(xs) and list(s.run_dir.glob("full*")) == []


def test_no_fd_or_disk_leak(tmp_path):
    """Hundreds of writes/reads/rewrites, including failures, leave no fd and no file behind."""
    import errno
    fds_before = len(os.listdir("/proc/self/fd"))
    with NVMeStore(*cfgs(tmp_path, checksum="crc32c")) as s:
        fds_open = len(os.listdir("/proc/self/fd"))  # + lock file and the engine's own
        x = rand(3000, torch.float32)
        y = torch.empty_like(x)
        for i in range(200):
            if i % 20 == 0:
                s.engine.inject_fault(op="write" if i % 40 else "read", errno=errno.EIO)
            try:
                s.write(f"k{i % 7}", x).wait()
                s.read(f"k{i % 7}", y).wait()
            except TierIOError:
                pass
        assert len(os.listdir("/proc/self/fd")) == fds_open
        st = s.stats()
        assert len(list(s.run_dir.glob("*.swp"))) == st["files"] + st["recycled_files"]
        assert not list(s.run_dir.glob("*.tmp"))
        assert s.used == (st["files"] + st["recycled_files"]) * 12288 and st["reuses"] > 50
    assert len(os.listdir("/proc/self/fd")) <= fds_before
    assert list(tmp_path.iterdir()) == []


def test_concurrent_writes_of_one_key(store):
    """Writes of one key from many threads commit one at a time; the last commit wins whole."""
    xs = [torch.full((20_000,), float(i)) for i in range(8)]
    errors = []

    def writer(i):
        try:
            for _ in range(5):
                store.write("same", xs[i]).wait()
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    run_threads(writer, 8)
    assert errors == []
    y = torch.empty(20_000)
    store.read("same", y).wait()
    assert bool((y == y[0]).all())  # one writer's data, not a mix
    st = store.stats()
    assert st["files"] == 1 and st["recycled_files"] <= 1 and st["reuses"] >= 38
    assert store.used == (1 + st["recycled_files"]) * 81920
    assert sorted(p.name for p in store.run_dir.glob("*.swp*") if not p.name.startswith("%free-")) == ["same.swp"]


def test_recycling_never_touches_a_file_being_read(store):
    x, z = rand(5000, torch.float32, 1), rand(5000, torch.float32, 2)
    store.write("a", x).wait()
    y = torch.empty_like(x)
    reading = store.read("a", y)  # not waited: its file must not be recycled
    store.write("a", z).wait()    # the rewrite's old version is unlinked, not kept for reuse
    assert store.stats()["recycled_files"] == 0 and store.used == 20480
    store.write("b", z).wait()    # same size, but a fresh file
    assert store.stats()["reuses"] == 0
    reading.wait()
    assert torch.equal(y, x)


def test_budget_unlinks_recycled_files_first(tmp_path):
    with NVMeStore(*cfgs(tmp_path, nvme=4 * 4096)) as s:
        s.write("a", torch.ones(2048)).wait()   # 2 pages
        s.write("a", torch.ones(1024)).wait()   # 1 page; the old 2 are recycled: still counted
        assert s.used == 12288 and s.stats()["recycled"] == 8192
        s.write("b", torch.ones(3072)).wait()   # 3 pages: the recycled file is unlinked first
        st = s.stats()
        assert st["recycled"] == 0 and s.used == 16384 and len(list(s.run_dir.glob("*.swp"))) == 2


def test_nvme_auto_budget_is_the_planners_per_rank_share(tmp_path, monkeypatch):
    """tiers.nvme = "auto" is resolved once, by planner.resolve_budgets (issue 23 item 4): the store
    holds the plan's per-rank budget. The store used to resolve it again without dividing by the
    node's ranks (2 here), so it would have held twice the plan's 90%-of-free share."""
    import shutil

    import zerotier
    from zerotier.models import TinyGPT

    free = 64 << 30
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr("shutil.disk_usage", lambda path: type(usage)(usage.total, usage.used, free))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    cfg = {"offload": {"params": "host", "optimizer": "nvme"}, "tiers": {"nvme_path": str(tmp_path), "nvme": "auto"}}
    with zerotier.initialize(TinyGPT(vocab=32, dim=16, layers=1, heads=2, seq=8), cfg) as engine:
        assert engine.plan.budgets["nvme"] == int(free * 0.9) // 2
        assert engine.store.budget == engine.plan.budgets["nvme"]
    with pytest.raises(ValueError, match=r"tiers\.nvme = 'auto' is resolved by planner\.resolve_budgets"):
        NVMeStore(TiersConfig(nvme="auto", nvme_path=str(tmp_path)), IOConfig())


# ---------------------------------- the write path's order ([Note: new swap files are preallocated],
# ----------------------------------                            [Note: the checksum beside the write])

def _on_submit(store, record):
    """Wrap the engine's write: `record(fd)` runs as each request is submitted."""
    submit = store.engine.write

    def write(fd, buf, offset, path=""):
        record(fd)
        return submit(fd, buf, offset, path)

    store.engine.write = write


def test_a_new_file_has_its_blocks_before_its_write_is_submitted(store):
    """A new file written as it grows is written one request at a time (io_uring hands writes
    past the end of a file to its io-wq workers, one at a time per file); fallocate'd, it is
    written inside the file. The rewrite of a key goes to a new file too, the third write of it
    to the recycled one (already allocated)."""
    seen = []
    _on_submit(store, lambda fd: seen.append((os.fstat(fd).st_size, os.fstat(fd).st_blocks * 512)))
    x = rand(10_000, torch.float32)  # 40000 B -> a 40960 B file
    for _ in range(3):
        store.write("k", x).wait()
    assert seen == [(40960, 40960)] * 3
    out = torch.empty_like(x)
    store.read("k", out).wait()
    assert torch.equal(out, x) and store.stats()["reuses"] == 1


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EOPNOTSUPP])
def test_preallocation_refused(store, monkeypatch, tmp_path, code):
    """A disk too full for a new file fails its write before any data goes out, naming the file,
    and leaves the old version; a filesystem that cannot preallocate has the file grow as written."""
    import ctypes

    import zerotier.tiers.nvme_files as nvme_mod

    old, new = rand(3000, torch.float32, 1), rand(3000, torch.float32, 2)
    store.write("k", old).wait()

    def refuse(fd, mode, offset, length):
        ctypes.set_errno(code)
        return -1

    monkeypatch.setattr(nvme_mod, "_FALLOCATE", refuse)
    submitted = []
    _on_submit(store, submitted.append)
    out = torch.empty_like(old)
    if code == errno.EOPNOTSUPP:
        store.write("k", new).wait()
        store.read("k", out).wait()
        assert torch.equal(out, new) and len(submitted) == 1
        return
    with pytest.raises(TierIOError, match="No space left") as ei:
        store.write("k", new)
    assert ".tmp" in str(ei.value) and f"free space on {tmp_path}" in str(ei.value)
    assert submitted == [] and store.used == 12288
    store.read("k", out).wait()
    assert torch.equal(out, old)
    assert sorted(p.name for p in store.run_dir.iterdir() if p.suffix != ".json") == [".lock", "k.swp"]


def test_the_checksum_is_taken_while_the_write_is_in_flight(store, monkeypatch):
    """The write is submitted first, its checksum taken beside it; the index keeps that checksum
    (a zeroed file fails its next read) even when another thread sees the write complete first."""
    import threading

    import crc32c

    order = []
    _on_submit(store, lambda fd: order.append("submit"))
    started, release = threading.Event(), threading.Event()

    def slow_crc(data):
        order.append("checksum")
        started.set()
        release.wait(10)
        return crc32c.crc32c(data)

    monkeypatch.setattr(store, "_checksum", slow_crc)
    x = rand(10_000, torch.float32)
    tickets = []
    writer = threading.Thread(target=lambda: tickets.append(store.write("k", x)))
    writer.start()
    assert started.wait(10)
    assert order == ["submit", "checksum"]
    seen = []
    waiter = threading.Thread(target=lambda: seen.append(store.nbytes("k")))  # waits for the write
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive() and seen == []  # the write is done on disk, its commit waits for the checksum
    release.set()
    writer.join(10)
    waiter.join(10)
    assert seen == [x.nbytes] and tickets[0].wait() == x.nbytes
    swap_file(store, "k").write_bytes(bytes(40960))
    with pytest.raises(TierIOError, match="checksum mismatch"):
        store.read("k", torch.empty_like(x)).wait()


def test_a_checksum_interrupted_discards_its_write(store, monkeypatch):
    """A Ctrl-C while the checksum is taken: the write in flight is discarded (never committed
    without its checksum), the old version stays and the store stays usable."""
    old = rand(3000, torch.float32, 1)
    store.write("k", old).wait()

    def interrupted(data):
        raise KeyboardInterrupt

    monkeypatch.setattr(store, "_checksum", interrupted)
    with pytest.raises(KeyboardInterrupt):
        store.write("k", rand(3000, torch.float32, 2))
    monkeypatch.undo()
    out = torch.empty_like(old)
    store.read("k", out).wait()  # waits for the discarded write, then reads the old version
    assert torch.equal(out, old) and store.used == 12288 and store.stats()["errors"] == 1
    assert sorted(p.name for p in store.run_dir.iterdir() if p.suffix != ".json") == [".lock", "k.swp"]
    still = rand(5000, torch.float32, 3)
    store.write("k", still).wait()
    out = torch.empty_like(still)
    store.read("k", out).wait()
    assert torch.equal(out, still)
