"""The async file I/O engine (zerotier.io) on every backend: io_uring, threads, aiofiles.

Data goes through real files with O_DIRECT where the filesystem supports it (pytest's
tmp_path, else a directory under the repo's build/ area, else buffered with a note).
"""
from __future__ import annotations

import concurrent.futures
import errno
import gc
import os
import threading
import uuid
import warnings
from pathlib import Path

import pytest
import torch

import zerotier.io as zio
from zerotier import _native
from zerotier.config import IOConfig
from zerotier.errors import ConfigError, TierIOError, ZerotierError
from zerotier.io import aligned_empty, open_direct, open_engine, probe_io_uring
from zerotier.io.ticket import wait_each

REPO = Path(__file__).resolve().parents[1]
BACKENDS = ["io_uring", "threads", "aiofiles"]
# Small blocks and a shallow queue so modest buffers still split into many chunks and
# the queue-depth limit is exercised.
SMALL = dict(block_size=64 << 10, queue_depth=4, threads=3)


def _kernel_version() -> tuple[int, int]:
    major, minor = os.uname().release.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def _io_uring_sysctl() -> int | None:
    try:
        return int(Path("/proc/sys/kernel/io_uring_disabled").read_text())
    except (OSError, ValueError):
        return None


def _require_backend(backend: str) -> None:
    """Skip only for an explicit, printed reason: native disabled/missing, or io_uring
    refused by this kernel (the probe says why)."""
    if backend == "aiofiles":
        return
    if not zio.native_available():
        pytest.skip(f"native library unavailable: {_native.status()['_zt_io']}")
    if backend == "io_uring":
        ok, why = probe_io_uring()
        if not ok:
            print(f"io_uring unusable here: {why}")
            pytest.skip(f"io_uring unusable here: {why}")


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    _require_backend(request.param)
    return request.param


@pytest.fixture
def engine(backend):
    with open_engine(IOConfig(backend=backend, **SMALL)) as eng:
        assert eng.backend == backend
        yield eng


@pytest.fixture
def data_dir(tmp_path) -> tuple[Path, bool]:
    """(directory, o_direct_supported)."""
    if zio.supports_o_direct(tmp_path):
        yield tmp_path, True
        return
    alt = REPO / "build" / "pytest-io" / uuid.uuid4().hex
    alt.mkdir(parents=True)
    try:
        if zio.supports_o_direct(alt):
            yield alt, True
        else:
            print(f"no O_DIRECT under {tmp_path} nor {alt}: testing buffered I/O")
            yield tmp_path, False
    finally:
        for p in alt.iterdir():
            p.unlink()
        alt.rmdir()


def _open(data_dir, name="f", flags=os.O_RDWR | os.O_CREAT) -> tuple[int, str]:
    d, direct_ok = data_dir
    path = str(d / name)
    fd, direct = open_direct(path, flags)
    assert direct == direct_ok
    return fd, path


def _rand(nbytes: int, seed: int) -> torch.Tensor:
    buf = aligned_empty(nbytes)
    g = torch.Generator().manual_seed(seed)
    buf.copy_(torch.randint(0, 256, (buf.numel(),), dtype=torch.uint8, generator=g))
    return buf


def _slow_read(eng_backend: str, data_dir, nbytes: int = 16 << 20):
    """An engine plus a read that takes many ms (nbytes in sequential 4 KiB chunks)."""
    eng = open_engine(IOConfig(backend=eng_backend, block_size=4096, queue_depth=1, threads=1))
    fd, path = _open(data_dir, "slow")
    os.ftruncate(fd, nbytes)
    buf = aligned_empty(nbytes)
    return eng, fd, path, buf


# --- probing and selection -------------------------------------------------------------

def test_probe_io_uring_shape_and_expectation():
    ok, why = probe_io_uring()
    assert isinstance(ok, bool) and isinstance(why, str) and why
    print(f"probe_io_uring() -> {ok}, {why!r}")
    # Where nothing should stop io_uring, a failing probe is a bug, not a skip —
    # unless a seccomp filter (containers) forbids it, which the reason then says.
    if (_native.native_enabled() and zio.native_available()
            and _io_uring_sysctl() == 0 and _kernel_version() >= (5, 6)):
        assert ok or "not permitted" in why, why


def test_auto_picks_io_uring_when_probe_ok():
    _require_backend("io_uring")
    with open_engine(IOConfig(backend="auto")) as eng:
        assert eng.backend == "io_uring"
        assert "io_uring" in eng.describe()


def test_native_disabled_selects_aiofiles(monkeypatch):
    monkeypatch.setenv("ZEROTIER_NATIVE", "0")
    assert probe_io_uring() == (False, "native engine disabled")
    with open_engine(IOConfig(backend="auto")) as eng:
        assert eng.backend == "aiofiles"
    with pytest.warns(RuntimeWarning, match="ZEROTIER_NATIVE=0"):
        zio._warned.discard("forced")
        with open_engine(IOConfig(backend="threads")) as eng:
            assert eng.backend == "aiofiles"
    buf = aligned_empty(100)  # pure torch: works without native code
    assert buf.data_ptr() % 4096 == 0 and buf.numel() == 4096


def test_io_limits_are_the_config_rules_only():
    """The I/O limits are checked once, by IOConfig's rules (issue 23): an IOConfig that exists
    is one open_engine can open, and the limits io/__init__.py used to check again still hold."""
    for bad, why in [({"block_size": 4096 + 512}, r"io\.block_size: must be a multiple of io\.alignment"),
                     ({"block_size": 2 << 30}, r"io\.block_size: must be in \(0, 1 GiB\]"),
                     ({"queue_depth": 0}, r"io\.queue_depth: must be in \[1, 4096\]"),
                     ({"queue_depth": 4097}, r"io\.queue_depth: must be in \[1, 4096\]"),
                     ({"threads": 1025}, r"io\.threads: must be in \[1, 1024\]"),
                     ({"backend": "libaio"}, r"io\.backend: must be one of")]:
        with pytest.raises(ConfigError, match=why):
            IOConfig(**bad)
    assert not hasattr(zio, "_validate")
    with open_engine(IOConfig(queue_depth=4096, threads=1)):  # the upper bound opens
        pass


# --- aligned buffers and O_DIRECT ---------------------------------------------------------

@pytest.mark.parametrize("nbytes,alignment", [(0, 4096), (1, 4096), (4096, 4096),
                                              (5000, 512), (123_457, 65536)])
def test_aligned_empty(nbytes, alignment):
    t = aligned_empty(nbytes, alignment)
    assert t.dtype == torch.uint8 and t.device.type == "cpu" and t.is_contiguous()
    assert t.numel() == -(-nbytes // alignment) * alignment
    assert t.data_ptr() % alignment == 0
    assert zio.is_aligned(t, alignment)
    if nbytes:  # torch asks the driver about the storage's first byte: it must be the aligned one
        assert t.untyped_storage().data_ptr() == t.data_ptr()  # [Note: the storage starts at ...]
    with pytest.raises(ValueError):
        aligned_empty(10, 3000)


def test_aligned_empty_keeps_its_allocation_alive():
    import gc
    t = aligned_empty(1 << 20)
    gc.collect()
    filler = [torch.full((1 << 18,), 7, dtype=torch.int32) for _ in range(8)]  # reuse freed memory
    t.fill_(3)
    assert int(t.sum()) == 3 << 20 and all(int(f[0]) == 7 for f in filler)


def test_open_direct_real(data_dir):
    fd, _ = _open(data_dir, "d")  # asserts direct == what the probe found
    os.close(fd)


def test_open_direct_falls_back_once_per_filesystem(tmp_path, monkeypatch):
    real_open = os.open

    def no_direct_open(path, flags, mode=0o777, *, dir_fd=None):
        if flags & os.O_DIRECT:
            if flags & os.O_CREAT:  # like kernels that create the file, then refuse
                os.close(real_open(path, (flags & ~os.O_DIRECT) | os.O_CREAT, mode, dir_fd=dir_fd))
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "open", no_direct_open)
    monkeypatch.setattr(zio, "_no_direct_fs", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fd1, direct1 = open_direct(tmp_path / "a", os.O_RDWR | os.O_CREAT | os.O_EXCL)
        fd2, direct2 = open_direct(tmp_path / "b", os.O_RDWR | os.O_CREAT | os.O_EXCL)
    os.close(fd1), os.close(fd2)
    assert (direct1, direct2) == (False, False)
    msgs = [str(w.message) for w in caught if "O_DIRECT" in str(w.message)]
    assert len(msgs) == 1, msgs
    assert oct(os.stat(tmp_path / "a").st_mode & 0o777) == oct(0o600)


def test_open_direct_refuses_symlinks(tmp_path):
    (tmp_path / "target").write_bytes(b"x")
    os.symlink(tmp_path / "target", tmp_path / "link")
    with pytest.raises(OSError) as exc:
        open_direct(tmp_path / "link", os.O_RDONLY)
    assert exc.value.errno == errno.ELOOP


# --- round trips ------------------------------------------------------------------------

SIZES = [4096, 8192, 60 << 10, 64 << 10, (64 << 10) + 4096, 3 * (64 << 10) + 12288, 1 << 20]
OFFSETS = [0, 4096, 1 << 20, (5 << 20) + 8192]


def test_roundtrip_sizes_offsets(engine, data_dir):
    fd, path = _open(data_dir)
    try:
        cases = [(n, o, _rand(n, seed=i)) for i, (n, o) in
                 enumerate((n, o) for n in SIZES for o in OFFSETS)]
        for n, o, src in cases:  # write one at a time: overlapping ranges, last one wins
            assert engine.write(fd, src, o, path).wait() == n
            dst = aligned_empty(n)
            dst.fill_(0xAB)
            assert engine.read(fd, dst, o, path).wait() == n
            assert torch.equal(src, dst), (n, o)
    finally:
        os.close(fd)


def test_roundtrip_typed_tensors(engine, data_dir):
    fd, path = _open(data_dir)
    try:
        for i, dtype in enumerate([torch.float32, torch.bfloat16, torch.int64]):
            n_elem = (256 << 10) // torch.tensor([], dtype=dtype).element_size()
            src = aligned_empty(256 << 10).view(dtype)
            src.copy_(torch.randn(n_elem).to(dtype))
            assert engine.write(fd, src, i << 20, path).wait() == 256 << 10
            dst = aligned_empty(256 << 10).view(dtype)
            assert engine.read(fd, dst, i << 20, path).wait() == 256 << 10
            assert torch.equal(src.view(torch.uint8), dst.view(torch.uint8))
    finally:
        os.close(fd)


def test_many_in_flight(engine, data_dir):
    fd, path = _open(data_dir)
    n, count = 160 << 10, 64  # 3 chunks each: 192 chunks behind queue depth 4
    try:
        srcs = [_rand(n, seed=100 + i) for i in range(count)]
        writes = [engine.write(fd, s, i * n, path) for i, s in enumerate(srcs)]
        assert [t.wait(timeout=30) for t in writes] == [n] * count
        dsts = [aligned_empty(n) for _ in range(count)]
        reads = [engine.read(fd, d, i * n, path) for i, d in enumerate(dsts)]
        # done() only moves False -> True, and gets there without wait().
        seen_done = [False] * count
        while not all(seen_done):
            for i, t in enumerate(reads):
                d = t.done()
                assert d or not seen_done[i]
                seen_done[i] = d
        assert all(t.wait(0) == n for t in reads)
        for s, d in zip(srcs, dsts):
            assert torch.equal(s, d)
    finally:
        os.close(fd)


def test_concurrent_submitters(engine, data_dir):
    fd, path = _open(data_dir)
    n, per_thread, nthreads = 64 << 10, 16, 4
    errors: list[BaseException] = []

    def worker(k: int):
        try:
            for j in range(per_thread):
                off = (k * per_thread + j) * n
                src = _rand(n, seed=off)
                assert engine.write(fd, src, off, path).wait() == n
                dst = aligned_empty(n)
                assert engine.read(fd, dst, off, path).wait() == n
                assert torch.equal(src, dst)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(nthreads)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    os.close(fd)
    assert not errors, errors


# --- errors, short transfers, faults ----------------------------------------------------

def test_bad_fd_raises_ebadf(engine):
    buf = aligned_empty(8192)
    for op in (engine.read, engine.write):
        t = op(-1, buf, 4096, "/nowhere/shard.bin")
        with pytest.raises(TierIOError) as exc:
            t.wait()
        e = exc.value
        assert e.errno == errno.EBADF and isinstance(e, OSError)
        assert e.filename == "/nowhere/shard.bin"
        assert "offset 4096" in str(e) and op.__name__ in str(e)
        assert t.done()
        with pytest.raises(TierIOError):  # the failure is sticky
            t.wait()


def test_write_to_readonly_fd_fails(engine, data_dir):
    fd, path = _open(data_dir)
    os.close(fd)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(TierIOError) as exc:
            engine.write(fd, aligned_empty(4096), 0, path).wait()
        assert exc.value.errno == errno.EBADF
    finally:
        os.close(fd)


def test_short_read_past_eof(engine, data_dir):
    fd, path = _open(data_dir)
    size = 3 * (64 << 10) + 4096  # file ends inside the 4th chunk
    try:
        assert engine.write(fd, _rand(size, seed=7), 0, path).wait() == size
        buf = aligned_empty(8 * (64 << 10))
        assert engine.read(fd, buf, 0, path).wait() == size
        assert engine.read(fd, buf, 8192, path).wait() == size - 8192
        assert engine.read(fd, buf, size, path).wait() == 0
        assert engine.read(fd, buf, 1 << 30, path).wait() == 0
        os.ftruncate(fd, size + 100)  # unaligned EOF: O_DIRECT returns a partial block
        assert engine.read(fd, buf, 0, path).wait() == size + 100
    finally:
        os.close(fd)


def test_misaligned_direct_io_is_einval_with_hint(engine, data_dir):
    if not data_dir[1]:
        pytest.skip("no O_DIRECT filesystem available")
    fd, path = _open(data_dir)
    try:
        with pytest.raises(TierIOError) as exc:
            engine.write(fd, aligned_empty(8192)[1:4097], 0, path).wait()
        assert exc.value.errno == errno.EINVAL and "aligned" in str(exc.value)
    finally:
        os.close(fd)


def test_injected_faults(engine, data_dir):
    fd, path = _open(data_dir)
    n = 256 << 10
    try:
        src = _rand(n, seed=3)
        engine.inject_fault(op="write", errno=errno.ENOSPC)
        with pytest.raises(TierIOError) as exc:
            engine.write(fd, src, 0, path).wait()
        assert exc.value.errno == errno.ENOSPC and exc.value.filename == path
        assert engine.write(fd, src, 0, path).wait() == n  # only the next one failed

        engine.inject_fault(op="read", errno=errno.EIO, count=2)
        dst = aligned_empty(n)
        for _ in range(2):
            with pytest.raises(TierIOError) as exc:
                engine.read(fd, dst, 0, path).wait()
            assert exc.value.errno == errno.EIO
        assert engine.read(fd, dst, 0, path).wait() == n

        engine.inject_fault(op="read", short=True)
        dst.zero_()
        assert engine.read(fd, dst, 0, path).wait() == n // 2
        assert torch.equal(dst[: n // 2], src[: n // 2])
        assert not dst[n // 2:].any()

        engine.inject_fault(op="any", errno=errno.EIO, count=5)
        engine.clear_faults()
        assert engine.read(fd, dst, 0, path).wait() == n
    finally:
        os.close(fd)


def test_done_and_timeout_on_a_slow_request(backend, data_dir):
    eng, fd, path, buf = _slow_read(backend, data_dir, 64 << 20)  # 16384 chunks at QD 1: tens of ms
    try:
        t = eng.read(fd, buf, 0, path)
        with pytest.raises(TimeoutError):
            t.wait(timeout=0)  # checked first, right after submission
        assert t.wait(timeout=30) == 64 << 20
        assert t.done()
    finally:
        eng.close()
        os.close(fd)


# --- lifetime and shutdown --------------------------------------------------------------

def test_close_waits_and_is_idempotent(backend, data_dir):
    eng, fd, path, buf = _slow_read(backend, data_dir)
    t = eng.read(fd, buf, 0, path)
    eng.close()
    assert t.done() and t.wait() == 16 << 20
    eng.close()
    with pytest.raises(ZerotierError, match="closed"):
        eng.read(fd, buf, 0, path)
    os.close(fd)


def test_close_cancel(backend, data_dir):
    eng, fd, path, buf = _slow_read(backend, data_dir)
    t = eng.read(fd, buf, 0, path)
    eng.close(cancel=True)
    with pytest.raises(TierIOError) as exc:
        t.wait()
    assert exc.value.errno == errno.ECANCELED
    os.close(fd)


def test_dropped_ticket_keeps_buffer_alive(engine, data_dir):
    fd, path = _open(data_dir)
    n = 1 << 20
    try:
        engine.write(fd, _rand(n, seed=11), 0, path)  # ticket and buffer dropped at once
        gc.collect()
        junk = [torch.full((n,), 0x5A, dtype=torch.uint8) for _ in range(8)]  # reuse memory
        del junk
        dst = aligned_empty(n)
        for _ in range(2):  # a later submit sweeps the orphan
            engine.read(fd, dst, n, path).wait()
        engine.close()
        if hasattr(engine, "_inflight"):
            assert not engine._inflight
        check = open_engine(IOConfig(backend="aiofiles"))
        assert check.read(fd, dst, 0, path).wait() == n
        check.close()
        assert torch.equal(dst, _rand(n, seed=11))
    finally:
        os.close(fd)


def test_zero_byte_request(engine, data_dir):
    fd, path = _open(data_dir)
    try:
        empty = aligned_empty(0)
        assert engine.write(fd, empty, 0, path).wait() == 0
        assert engine.read(fd, empty, 0, path).wait() == 0
    finally:
        os.close(fd)


def test_rejects_bad_buffers(engine):
    with pytest.raises(ValueError, match="contiguous"):
        engine.read(0, aligned_empty(8192).view(2, 4096).t(), 0)
    with pytest.raises(ValueError, match=">= 0"):
        engine.read(0, aligned_empty(4096), -4096)
    with pytest.raises(TypeError):
        engine.read(0, bytearray(4096), 0)  # type: ignore[arg-type]


# --- the ticket family (zerotier.io.ticket) ----------------------------------------------

def test_completed_and_future_tickets():
    assert zio.CompletedTicket(42, "read", 0, 42, 0).wait() == 42
    assert zio.CompletedTicket(0).done() and zio.CompletedTicket(0).wait() == 0
    with pytest.raises(TierIOError) as exc:
        zio.CompletedTicket(-errno.EIO, "write", 5, 4096, 8192, "/x").wait()
    assert exc.value.errno == errno.EIO and "offset 8192" in str(exc.value)

    fut = concurrent.futures.Future()
    seen = []
    t = zio.FutureTicket(fut, keepalive=object())
    t.add_done_callback(lambda tk: seen.append(tk))
    assert not t.done()
    with pytest.raises(TimeoutError):
        t.wait(0.01)
    fut.set_result(7)
    assert seen == [t] and t.done() and t.wait() == 7 and t.wait(0) == 7

    bad = concurrent.futures.Future()
    t = zio.FutureTicket(bad)
    bad.set_exception(ValueError("copy failed"))
    assert t.done()  # never raises
    for _ in range(2):  # the work's own exception, every time
        with pytest.raises(ValueError, match="copy failed"):
            t.wait()

    gone = concurrent.futures.Future()
    gone.cancel()
    with pytest.raises(TierIOError) as exc:
        zio.FutureTicket(gone, "read", 3, 10, 0).wait()
    assert exc.value.errno == errno.ECANCELED


def test_chain_ticket_runs_finish_once_and_caches_errors():
    calls = []
    fut = concurrent.futures.Future()
    t = zio.ChainTicket(zio.FutureTicket(fut), lambda r: calls.append(r) or r * 2)
    assert not t.done()
    with pytest.raises(TimeoutError):
        t.wait(0.01)
    fut.set_result(21)
    assert t.done() and t.wait() == 42 and t.wait() == 42 and calls == [21]

    def boom(r):
        raise ValueError(f"bad {r}")
    bad = zio.ChainTicket(zio.CompletedTicket(3), boom)
    for _ in range(2):
        with pytest.raises(ValueError, match="bad 3"):
            bad.wait()
    # finish sees the inner failure and decides the outcome
    failed = zio.ChainTicket(zio.CompletedTicket(-errno.ENOSPC, "write", 1, 8, 0),
                             lambda r: -1 if isinstance(r, TierIOError) else r)
    assert failed.wait() == -1


def test_wait_all_waits_for_every_ticket_then_raises_the_first_error():
    slow = concurrent.futures.Future()
    ok = zio.FutureTicket(slow)
    tickets = [zio.CompletedTicket(1), zio.CompletedTicket(-errno.EIO, "read", 1, 4, 0), ok,
               zio.CompletedTicket(-errno.ENOSPC, "write", 1, 4, 0)]
    threading.Timer(0.05, slow.set_result, args=(3,)).start()
    with pytest.raises(TierIOError) as exc:
        zio.wait_all(tickets)
    assert exc.value.errno == errno.EIO and ok.done()  # waited past the first failure
    assert zio.wait_all([zio.CompletedTicket(2), ok]) == [2, 3]
    pending = zio.FutureTicket(concurrent.futures.Future())
    with pytest.raises(TimeoutError):
        zio.wait_all([zio.CompletedTicket(2), pending], timeout=0.05)


def test_wait_each_calls_every_wait_even_after_a_ctrl_c_then_raises_the_first():
    """[Note: wait for all, raise the first]: a KeyboardInterrupt in the second wait still lets
    the third run (its work would write into buffers the caller drops), and it is what is raised."""
    called = []

    def wait(i, exc=None):
        called.append(i)
        if exc is not None:
            raise exc
        return i * 10

    assert wait_each([lambda: wait(1), lambda: wait(2)]) == [10, 20]
    called.clear()
    with pytest.raises(KeyboardInterrupt):
        wait_each([lambda: wait(1), lambda: wait(2, KeyboardInterrupt()), lambda: wait(3, OSError("later")),
                   lambda: wait(4)])
    assert called == [1, 2, 3, 4]


class _CountingEngine(zio.IOEngine):
    """The smallest backend: counts the base close()'s calls of its hooks."""

    backend = "counting"

    def __init__(self):
        super().__init__(IOConfig())
        self.stops, self.joins = [], 0
        self._closed = False

    def _stop(self, cancel):
        assert self._lock.locked()  # the hook runs under the engine's lock, _join after it
        self.stops.append(cancel)
        self._closed = True

    def _join(self):
        assert not self._lock.locked()
        self.joins += 1


def test_close_is_idempotent_and_a_forked_child_only_forgets_the_engine():
    eng = _CountingEngine()
    eng.close(cancel=True)
    eng.close()
    assert eng.stops == [True] and eng.joins == 1
    child = _CountingEngine()
    child._pid = os.getpid() + 1  # as seen from a forked child: the parent owns it
    with child:
        pass
    assert child._closed and child.stops == [] and child.joins == 0


def test_python_engine_in_a_forked_child_fails_clearly_instead_of_hanging(tmp_path):
    """The aiofiles engine's threads stay with the parent: a forked child's submit raises at
    once (it used to wait forever on a pool with no threads), and close() there only forgets."""
    with open_engine(IOConfig(backend="aiofiles")) as eng:
        eng.write(os.open(tmp_path / "warm", os.O_RDWR | os.O_CREAT, 0o600), aligned_empty(4096), 0).wait()
        pid = os.fork()
        if pid == 0:  # child: report through the exit status only
            code = 1
            try:
                fd = os.open(tmp_path / "child", os.O_RDWR | os.O_CREAT, 0o600)
                eng.write(fd, aligned_empty(4096), 0)
            except ZerotierError as exc:
                code = 0 if "forked child" in str(exc) else 2
            eng.close()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
