"""The native layer's error contract, load-time ABI check and behaviour after fork().

See [Note: native error contract] in native/zt_api.h, [Note: pool after fork] in
native/cpu/threadpool.h and [Note: engines after fork] in native/io/io_engine.cpp.

Forked children report back through a pipe and are killed, failing the test, if they do
not exit within CHILD_TIMEOUT seconds: a hang is the failure most of these tests exist to
catch. benchmarks/sanitize.sh runs this file under AddressSanitizer and UBSan.
"""
import ctypes
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import threading
import time
import traceback
from pathlib import Path

import pytest
import torch

import zerotier
import zerotier.optim as zo
from zerotier import _native
from zerotier.config import IOConfig, TiersConfig
from zerotier.errors import NativeError, NativeUnavailableError, TierIOError
from zerotier.io import aligned_empty, native as io_native, open_direct, open_engine, probe_io_uring
from zerotier.models import TinyGPT, batches
from zerotier.optim import _kernels
from zerotier.tiers.nvme import NVMeStore

NATIVE = Path(__file__).resolve().parent.parent / "native"
CHILD_TIMEOUT = 60
N_POOLED = 1 << 18  # elements: 4 slices of the kernel's minimum per thread, so threads=2 wakes a worker
# ASan's operator new aborts on failure instead of throwing std::bad_alloc (and its thread
# bookkeeping dies the same way), so the memory-limit tests cannot run under it.
UNDER_ASAN = bool(os.environ.get("ZT_SANITIZE_FLAGS"))


def _loaded(load):
    if not _native.native_enabled():
        pytest.skip("ZEROTIER_NATIVE=0: these tests drive the native library itself")
    lib = load()
    assert lib is not None, _native.status()
    return lib


@pytest.fixture
def cpu_lib():
    return _loaded(_kernels._lib)


@pytest.fixture
def io_lib():
    return _loaded(io_native.library)


def run_in_child(fn):
    """fn() in an os.fork() child; returns what it returned (JSON-able). The child's failure,
    death by signal, or hang (CHILD_TIMEOUT) fails the test."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        code = 1
        try:
            os.close(r)
            torch.set_num_threads(1)  # as DataLoader workers do: torch's own pool is not fork-safe
            out = {"ok": fn()}
            code = 0
        except BaseException:  # noqa: BLE001 - reported to the parent
            out = {"error": traceback.format_exc()[-4000:]}
        try:
            os.write(w, json.dumps(out).encode())
        finally:
            os._exit(code)
    os.close(w)
    deadline = time.monotonic() + CHILD_TIMEOUT
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(r)
            pytest.fail(f"the forked child hung (killed after {CHILD_TIMEOUT} s)")
        time.sleep(0.02)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    if os.WIFSIGNALED(status):
        pytest.fail(f"the forked child died of signal {os.WTERMSIG(status)}")
    result = json.loads(data)
    if "error" in result:
        pytest.fail(f"the forked child failed:\n{result['error']}")
    return result["ok"]


HEADROOM = 16 << 20  # address space left to a call under with_address_space_limit


def with_address_space_limit(fn):
    """fn() with RLIMIT_AS at the current address-space size + HEADROOM (only in a child)."""
    with open("/proc/self/status") as f:
        vm_size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (vm_size + HEADROOM, hard))
    try:
        return fn()
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def thread_stacks_larger_than_headroom():
    """Make new threads' default stack 16 x HEADROOM (only in a child), so that under
    with_address_space_limit no thread can start, whatever `ulimit -s` is."""
    libc = ctypes.CDLL(None)
    attr = ctypes.create_string_buffer(256)  # pthread_attr_t is 56 bytes on x86-64 glibc
    assert libc.pthread_attr_init(attr) == 0
    assert libc.pthread_attr_setstacksize(attr, ctypes.c_size_t(16 * HEADROOM)) == 0
    assert libc.pthread_setattr_default_np(attr) == 0


def adam_buffers(seed: int, n: int = N_POOLED):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g), torch.zeros(n), torch.zeros(n), torch.randn(n, generator=g)


def adam_once(master, exp_avg, exp_avg_sq, grad, threads=2):
    return zo.adam_step(master, exp_avg, exp_avg_sq, grad, step=1, lr=1e-2, beta1=0.9, beta2=0.999,
                        eps=1e-8, weight_decay=0.01, threads=threads)


def adam_once_from(seed):
    bufs = adam_buffers(seed)
    adam_once(*bufs)
    return bufs


# ------------------------------------------------------------------ the error contract

@pytest.mark.pins("design#no-c-exception-crosses-the-c-abi")
def test_every_export_is_guarded_or_noexcept():
    """[Note: native error contract] as a rule on the sources: every ZT_API function either
    runs its body through zt::guard (directly or via on_engine) or is declared noexcept."""
    exports = {}
    for src in sorted(NATIVE.glob("*/*.cpp")):
        text = src.read_text()
        for m in re.finditer(r"^ZT_API [^;{]*?\b(zt_\w+)\(([^)]*)\)\s*(noexcept)?\s*\{", text, re.M):
            depth, end = 1, m.end()
            while depth:  # the body runs to the matching brace
                depth += {"{": 1, "}": -1}.get(text[end], 0)
                end += 1
            exports[m.group(1)] = (m.group(3) == "noexcept", text[m.end():end])
    assert {"zt_adam_step_multi", "zt_grad_sumsq", "zt_io_create", "zt_io_submit",
            "zt_io_destroy", "zt_cpu_last_error", "zt_io_last_error"} <= exports.keys(), exports.keys()
    unguarded = [name for name, (noexcept, body) in exports.items()
                 if not noexcept and not re.search(r"\b(zt::guard|on_engine)<", body)]
    assert unguarded == [], f"exports that can let a C++ exception cross the C ABI: {unguarded}"


def test_guard_and_pool_contract_in_cpp(tmp_path):
    """native/tests/contract_check.cpp: zt::guard maps every exception kind to the failure
    value and message; a job that throws on a worker or the calling thread reaches run()'s
    caller after all threads finished, and the pool keeps working."""
    cxx = shutil.which(os.environ.get("CXX", "c++"))
    if cxx is None:
        pytest.skip("no C++ compiler on PATH (set CXX)")
    exe = tmp_path / "contract_check"
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}  # the compiler runs unsanitized
    build = subprocess.run(
        [cxx, "-std=c++17", "-O1", "-g", "-pthread", *os.environ.get("ZT_SANITIZE_FLAGS", "").split(),
         "-I", str(NATIVE), str(NATIVE / "tests" / "contract_check.cpp"), str(NATIVE / "cpu" / "threadpool.cpp"),
         "-o", str(exe)], capture_output=True, text=True, env=env)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=CHILD_TIMEOUT)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr


@pytest.mark.pins("design#no-c-exception-crosses-the-c-abi")
def test_native_failure_codes_carry_the_function_and_reason(cpu_lib, io_lib):
    """Status codes plus the thread-local message become a NativeError naming the function."""
    bad = (_kernels.ZtAdamArgs * 1)()
    bad[0].n = -5
    rc = cpu_lib.zt_adam_step_multi(bad, 1)
    assert rc == _native.ERR_ARGS
    err = _native.error(cpu_lib.zt_cpu_last_error, "zt_adam_step_multi", rc)
    assert str(err) == "native call zt_adam_step_multi failed: args[0].n = -5 < 0 [ZT_ERR_ARGS]"

    out = ctypes.c_double()
    rc = cpu_lib.zt_grad_sumsq(None, 7, 10, 1.0, 1, -1, ctypes.byref(out))
    assert rc == _native.ERR_ARGS and b"dtype 7" in cpu_lib.zt_cpu_last_error()
    rc = cpu_lib.zt_grad_sumsq(ctypes.byref(out), 0, 1, 1.0, 1, 99, ctypes.byref(out))
    assert rc == _native.ERR_SIMD and b"SIMD level 99 is not supported" in cpu_lib.zt_cpu_last_error()

    with pytest.raises(NativeError, match=r"^native call zt_io_inflight failed: NULL engine handle .*\[ZT_ERR_HANDLE\]$"):
        io_native._checked(io_lib, "zt_io_inflight", io_lib.zt_io_inflight(None))
    assert not io_lib.zt_io_create(1, 0, 1, 4096)
    assert io_lib.zt_io_last_error() == b"zt_io_create: queue_depth must be in [1, 4096], got 0"


@pytest.mark.skipif(UNDER_ASAN, reason="ASan aborts where the library would see bad_alloc/EAGAIN")
def test_adam_worker_thread_that_cannot_start_is_a_native_error(cpu_lib):
    """A worker thread that cannot be created (here: no address space for its stack) raises
    NativeError naming zt_adam_step_multi and the remedy; nothing was updated; the same call
    works once threads can start. Before: std::system_error crossed the C ABI (terminate)."""
    def child():
        bufs = adam_buffers(0)
        before = [t.clone() for t in bufs]
        thread_stacks_larger_than_headroom()  # a forked child starts with no pool workers
        with pytest.raises(NativeError) as ei:
            with_address_space_limit(lambda: adam_once(*bufs))
        msg = str(ei.value)
        assert msg.startswith("native call zt_adam_step_multi failed: cannot start CPU worker thread 1 of 1"), msg
        assert "use fewer threads (optimizer.threads" in msg and msg.endswith("[ZT_ERR_EXCEPTION]"), msg
        assert all(torch.equal(a, b) for a, b in zip(bufs, before)), "a failed call changed the state"
        adam_once(*bufs)  # the limit is lifted: the worker starts
        ref = [t.clone() for t in before]
        zo.adam_step_reference(*ref, step=1, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
        torch.testing.assert_close(bufs[0], ref[0], rtol=1e-6, atol=1e-7)
        return True
    assert run_in_child(child)


@pytest.mark.skipif(UNDER_ASAN, reason="ASan aborts where the library would see bad_alloc")
@pytest.mark.pins("design#no-c-exception-crosses-the-c-abi")
def test_io_request_that_cannot_be_allocated_fails_alone(io_lib, tmp_path):
    """bad_alloc while building a request fails that request (TierIOError ENOMEM naming the
    file), leaks nothing (no request left in the engine) and the engine keeps working.
    The request is submitted below the public read() (which bounds it by its buffer): 1 TiB
    in 512-byte chunks needs a 64 GiB chunk table, more than malloc can have kept from
    earlier tests, and the address-space limit makes sure it is never built."""
    path = tmp_path / "f.bin"

    def child():
        fd, _ = open_direct(path, os.O_RDWR | os.O_CREAT)
        eng = open_engine(IOConfig(backend="threads", block_size=512, alignment=512))
        buf = aligned_empty(4096)  # never touched: the request fails before any I/O
        with pytest.raises(TierIOError) as ei:
            with_address_space_limit(lambda: eng._submit("read", fd, buf, 1 << 40, 0, str(path)).wait())
        assert ei.value.errno == 12 and str(path) in str(ei.value), str(ei.value)
        assert io_lib.zt_io_last_error() == b"zt_io_submit: out of memory for a request of 1099511627776 bytes"
        assert eng.pending() == 0
        src = aligned_empty(8192).fill_(7)
        eng.write(fd, src, 0, str(path)).wait()
        dst = aligned_empty(8192).zero_()
        assert eng.read(fd, dst, 0, str(path)).wait() == 8192 and torch.equal(dst, src)
        eng.close()
        os.close(fd)
        return True
    assert run_in_child(child)


# ------------------------------------------------------------------ fork

@pytest.mark.pins("design#after-fork")
def test_forked_children_run_cpu_adam_while_the_parent_steps():
    """Children forked while a parent thread is inside the Adam pool get a fresh pool (the
    inherited one has no threads) and compute the same bits; the parent goes on."""
    expected = adam_buffers(0)
    adam_once(*expected)  # the parent's pool now has a worker
    stop = threading.Event()

    def parent_steps():
        bufs = adam_buffers(1)
        while not stop.is_set():
            adam_once(*bufs)

    stepper = threading.Thread(target=parent_steps)
    stepper.start()
    try:
        for _ in range(3):
            assert run_in_child(lambda: all(torch.equal(a, b) for a, b in
                                            zip(adam_once_from(0), expected)))
    finally:
        stop.set()
        stepper.join()
    again = adam_buffers(0)
    adam_once(*again)
    assert all(torch.equal(a, b) for a, b in zip(again, expected))


@pytest.mark.parametrize("backend", ["io_uring", "threads"])
@pytest.mark.pins("design#after-fork")
def test_forked_child_cannot_use_the_parents_io_engine_but_can_open_its_own(io_lib, tmp_path, backend):
    """In a forked child the parent's engine (its requests included) raises NativeError at
    once, from Python and from C; close() only forgets it; a new engine works. The parent's
    engine is untouched."""
    if backend == "io_uring" and not probe_io_uring()[0]:
        pytest.skip(f"io_uring unusable here: {probe_io_uring()[1]}")
    cfg = IOConfig(backend=backend)
    path = tmp_path / "data.bin"
    fd, _ = open_direct(path, os.O_RDWR | os.O_CREAT)
    src = aligned_empty(1 << 20)
    src.copy_(torch.randint(0, 256, (1 << 20,), dtype=torch.uint8))
    eng = open_engine(cfg)
    try:
        eng.write(fd, src, 0, str(path)).wait()
        in_flight = eng.read(fd, aligned_empty(1 << 20), 0, str(path))  # not waited before the fork

        def child():
            with pytest.raises(NativeError, match=r"forked child .* open a new engine in the child"):
                eng.read(fd, aligned_empty(4096), 0, str(path))
            with pytest.raises(NativeError, match=r"zt_io_wait failed: .*belongs to process .*\[ZT_ERR_FORKED\]"):
                in_flight.wait()
            assert io_lib.zt_io_inflight(eng._h) == _native.ERR_FORKED  # the C side refuses it too
            eng.close()
            own = open_engine(cfg)
            dst = aligned_empty(1 << 20)
            assert own.read(fd, dst, 0, str(path)).wait() == 1 << 20 and torch.equal(dst, src)
            own.close()
            return True

        assert run_in_child(child)
        assert in_flight.wait() == 1 << 20
        dst = aligned_empty(1 << 20)
        assert eng.read(fd, dst, 0, str(path)).wait() == 1 << 20 and torch.equal(dst, src)
    finally:
        eng.close()
        os.close(fd)


def test_forked_child_exiting_leaves_the_parents_nvme_store_alone(tmp_path):
    """A forked child that exits normally runs the store's finalizer (weakref.finalize at
    interpreter exit) while the parent has a request in flight: the child must neither wait
    for it (it would never complete there) nor delete the parent's run directory."""
    store = NVMeStore(TiersConfig(device=256 << 20, host=256 << 20, nvme=1 << 30, nvme_path=str(tmp_path)),
                      IOConfig())
    pipe_r, pipe_w = os.pipe()
    in_flight = None
    try:
        if store.engine.backend != "io_uring":
            pytest.skip(f"needs io_uring to hold a read of a pipe in flight (engine: {store.engine.backend})")
        x = torch.randn(100_000)
        store.write("w", x).wait()
        held = aligned_empty(4096)
        in_flight = store.engine.read(pipe_r, held, 0, "<pipe>")  # completes when the parent writes
        assert run_in_child(lambda: store._finalizer() or True)  # what interpreter exit runs
        assert not in_flight.done()
        os.write(pipe_w, b"z" * 4096)
        assert in_flight.wait() == 4096
        in_flight = None
        assert store.run_dir.is_dir()
        y = torch.empty_like(x)
        store.read("w", y).wait()
        assert torch.equal(x, y)
    finally:
        if in_flight is not None:  # a failure above: let the read finish, or close() waits for it
            os.write(pipe_w, b"z" * 4096)
        store.close()
        os.close(pipe_r)
        os.close(pipe_w)


class _Batches(torch.utils.data.Dataset):
    """Batches whose workers also run zerotier's native code: each item's features are
    checked with the native sum of squares on two threads (the worker's inherited pool)."""

    def __init__(self, items):
        self.items = items
        self.features = torch.randn(N_POOLED)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        assert zo.grad_sumsq(self.features, threads=2) > 0
        return self.items[i]


def test_dataloader_fork_workers_while_optimizer_state_is_on_nvme(tmp_path):
    """The issue's scenario: DataLoader(num_workers=2) with fork workers started between
    steps of an engine whose optimizer state is on NVMe (write-backs may be in flight) and
    whose Adam pool has workers (units of 200k parameters, 2 threads), its batches feeding
    steps, then more steps. Losses are exactly those of feeding the same batches without
    workers."""
    data = list(batches(64, 16, 2, 8))
    cfg = {"offload": {"params": "host", "gradients": "host", "optimizer": "nvme"},
           "optimizer": {"threads": 2}, "train": {"max_grad_norm": 1.0}}

    def train(use_loader: bool, nvme_path: Path) -> list[float]:
        torch.manual_seed(0)
        model = TinyGPT(vocab=64, dim=128, layers=2, heads=2, seq=16)
        losses = []
        with zerotier.initialize(model, {**cfg, "tiers": {"nvme_path": str(nvme_path)}}) as engine:
            def step(x, y):
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
                losses.append(float(loss.detach()))
            step(*data[0])
            middle = data[1:6]
            if use_loader:
                middle = torch.utils.data.DataLoader(
                    _Batches(middle), batch_size=None, num_workers=2, multiprocessing_context="fork",
                    timeout=CHILD_TIMEOUT)
            for x, y in middle:
                step(x, y)
            for x, y in data[6:]:
                step(x, y)
        return losses

    (tmp_path / "plain").mkdir()
    (tmp_path / "loader").mkdir()
    expected = train(False, tmp_path / "plain")
    assert train(True, tmp_path / "loader") == expected


# ------------------------------------------------------------------ the ABI check at load

@pytest.fixture
def fresh_loader(monkeypatch):
    """_native with nothing loaded yet (restored afterwards)."""
    if not _native.native_enabled():
        pytest.skip("ZEROTIER_NATIVE=0: nothing is loaded")
    monkeypatch.setattr(_native, "_cache", {})
    monkeypatch.setattr(_native, "_load_errors", {})


@pytest.mark.pins("design#the-abi-is-checked-at-load")
def test_cpu_library_of_another_abi_version_is_refused(fresh_loader, monkeypatch):
    """A stale _zt_cpu is refused at load with a warning; status says why; Adam runs the
    pure-Python path and still computes the update."""
    built = _kernels._ABI_VERSION
    monkeypatch.setattr(_kernels, "_ABI_VERSION", 999)
    with pytest.warns(RuntimeWarning, match=rf"native library _zt_cpu refused: .* its ABI version is {built}, "
                                            r"these bindings need 999; rebuild it"):
        assert _native.load("_zt_cpu") is None
    assert _native.status()["_zt_cpu"].startswith("refused: _zt_cpu"), _native.status()
    assert zo.simd_level() == "python"
    bufs = adam_buffers(0, n=1000)
    ref = [t.clone() for t in bufs]
    adam_once(*bufs)
    zo.adam_step_reference(*ref, step=1, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    assert all(torch.equal(a, b) for a, b in zip(bufs, ref))


@pytest.mark.pins("design#the-abi-is-checked-at-load")
def test_adam_struct_size_mismatch_is_refused(fresh_loader, monkeypatch):
    """The ctypes mirror of ZtAdamArgs and the C struct must have the same size."""
    class Grown(ctypes.Structure):
        _fields_ = _kernels.ZtAdamArgs._fields_ + [("extra", ctypes.c_int64)]

    monkeypatch.setattr(_kernels, "ZtAdamArgs", Grown)
    size = ctypes.sizeof(Grown)
    with pytest.warns(RuntimeWarning, match=rf"sizeof\(ZtAdamArgs\) is {size - 8} bytes in the library but "
                                            rf"{size} in its ctypes mirror"):
        assert _native.load("_zt_cpu") is None
    assert not zo.native_available()


def test_io_library_of_another_abi_version_is_refused(fresh_loader, monkeypatch):
    """A stale _zt_io: io.backend='auto' falls back to the Python engine with a warning; a
    backend that needs the library raises NativeUnavailableError saying why."""
    monkeypatch.setattr(io_native, "_ABI_VERSION", 999)
    monkeypatch.setattr("zerotier.io._warned", set())
    with pytest.warns(RuntimeWarning, match=r"native I/O engine unavailable \(refused: .*using the slower aiofiles backend"), \
            pytest.warns(RuntimeWarning, match="native library _zt_io refused"):
        eng = open_engine(IOConfig(backend="auto"))
    try:
        assert eng.backend == "aiofiles"
    finally:
        eng.close()
    with pytest.raises(NativeUnavailableError, match=r"native library _zt_io is unavailable: refused: .* its ABI "
                                                     r"version is 3, these bindings need 999; rebuild it"):
        open_engine(IOConfig(backend="threads"))
