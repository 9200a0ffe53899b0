"""The measurements of `zerotier bench`: one function a section, each returning a dict of figures.

  bench_memory   memory bandwidth: in-place `mul_` and buffer-to-buffer `copy_` (read + write bytes)
  bench_pcie     with CUDA: host->device and device->host copies from pinned and pageable memory
  bench_io       NVMe write, overwrites and reads through zerotier's own I/O engine
  bench_adam     CPU Adam throughput (params/s) of `zerotier.optim.adam_step`, and of each update
                 rule's native variant per state dtype pair (`bench_state_rates`)
  bench_device_step  with CUDA: each update rule's device variant per state dtype pair (bytes/s)
  bench_compute  the compute device's dense matmul rate (flop/s, fp32 and bf16)

bench.py runs them, prints them and saves them (its docstring says what each figure means to the
planner). Torch and the engine are imported inside the functions: importing this module is light.
`PeakRSS` measures a block's peak resident memory (the RSS benchmarks and tests use it).
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable

# default / --quick sizes: bytes for mem, pcie, io; parameters for adam; matrix side for compute
SIZES = {"mem": 1 << 30, "pcie": 512 << 20, "io": 1 << 30, "adam": 50_000_000, "compute": 4096}
QUICK_SIZES = {"mem": 256 << 20, "pcie": 64 << 20, "io": 64 << 20, "adam": 8_000_000, "compute": 1024}
DEVICE_STEP_SIZES = {"full": 64_000_000, "quick": 16_000_000}  # parameters of the device step's shard
# The optimizer state's dtype pairs (precision.master_dtype x precision.moment_dtype, config.py's
# Literals) and the update rules (the rule's `name`: optimizer.type "adam" runs AdamW's kernel)
# whose rates bench measures: `cpu_<rule>_<master>_<moments>` / `device_<rule>_<master>_<moments>`.
STATE_PAIRS = tuple((m, mo) for m in ("fp32", "bf16") for mo in ("fp32", "bf16", "int8"))
STEP_RULES = ("adamw", "lion")
ADAM_BYTES_PER_PARAM = 16  # fp32 master, exp_avg, exp_avg_sq, grad: what one Adam pass streams

Tick = Callable[[str], None]


class PeakRSS:
    """`with PeakRSS() as m: ...`: the process's peak resident set size while inside
    (`m.peak`, bytes; `m.growth` over the start), sampled by a thread every `interval` s.
    Run it in a fresh process where the figure must be that work's alone."""

    def __init__(self, interval: float = 0.02):
        import psutil

        self.proc, self.interval = psutil.Process(), interval
        self.base = self.peak = self.growth = 0

    def __enter__(self) -> "PeakRSS":
        import threading

        self.base = self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="zerotier-peak-rss", daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            self._stop.wait(self.interval)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)
        self.growth = self.peak - self.base


def _noop(_label: str) -> None:
    pass


def _best_seconds(fn: Callable[[], None], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best



def bench_memory(nbytes: int, repeat: int = 5, tick: Tick = _noop) -> dict[str, Any]:
    """In-place `mul_` and `copy_` bandwidth over `nbytes` buffers, all torch threads, and the rate of
    the engine's gradient sum of squares (the global norm's read pass: `optim._kernels.grad_sumsq`)."""
    import torch

    from .envinfo import usable_memory

    n = max(1, nbytes // 4)
    buf = torch.ones(n, dtype=torch.float32)  # first touch outside the timing

    def scale() -> None:  # x2 then x0.5: values stay exact and normal (no denormal slow path)
        buf.mul_(2.0)
        buf.mul_(0.5)

    scale()
    inplace = 2 * (2 * 4 * n) / _best_seconds(scale, repeat)  # two passes, each reads + writes 4n bytes
    tick("memory: in-place mul_")
    dst = torch.empty_like(buf)
    dst.copy_(buf)
    copy = 2 * 4 * n / _best_seconds(lambda: dst.copy_(buf), repeat)
    tick("memory: copy_")
    from .optim import _kernels  # the engine's global-norm pass: one read of every gradient
    sumsq = 4 * n / _best_seconds(lambda: _kernels.grad_sumsq(buf), repeat)
    tick("memory: gradient sum of squares")
    # the node's RAM, for plans made elsewhere with this file ([Note: the plan against the machine])
    return {"bytes": 4 * n, "threads": torch.get_num_threads(),
            "inplace_GBps": inplace / 1e9, "copy_GBps": copy / 1e9, "sumsq_GBps": sumsq / 1e9,
            "total_bytes": usable_memory().total}


def bench_pcie(nbytes: int, repeat: int = 5, tick: Tick = _noop) -> dict[str, Any] | None:
    """H2D / D2H copy bandwidth, pinned and pageable host memory; None without CUDA."""
    import torch

    if not torch.cuda.is_available():  # nothing to measure, no progress to show
        return None
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out: dict[str, Any] = {"bytes": nbytes, "device": torch.cuda.get_device_name(),
                           "device_total_bytes": torch.cuda.mem_get_info()[1]}  # [Note: the plan against the machine]
    for kind, pinned in (("pinned", True), ("pageable", False)):
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        host.fill_(1)  # touch every page before timing
        for direction, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
            def copy(dst=dst, src=src) -> None:
                dst.copy_(src, non_blocking=pinned)
                torch.cuda.synchronize()
            copy()
            out[f"{direction}_{kind}_GBps"] = nbytes / _best_seconds(copy, repeat) / 1e9
            tick(f"pcie: {direction} {kind}")
        del host
    return out


def bench_io(directory: str | os.PathLike, nbytes: int, cfg=None, tick: Tick = _noop,
             repeat: int = 3) -> dict[str, Any]:
    """Write `nbytes` of one fresh file in a temp subdir of `directory` with zerotier's engine
    (`write_GBps`: allocation and fsync included, what initialize's first writes cost), then
    overwrite it and read it back `repeat` times each, keeping the best (`overwrite_GBps`,
    `read_GBps`). An overwrite, like the store's, is timed to its completion without fsync:
    training rewrites recycled swap files, measured here 2-4x faster than a fresh file, so a
    fresh-file figure is no peak for a step's writes (the profiler showed 154-277% of it).
    O_DIRECT where the filesystem allows (else the page cache is dropped with fadvise before
    each read, and `o_direct` is False in the result)."""
    import shutil
    import tempfile

    import torch

    from .config import IOConfig
    from .io import aligned_empty, open_direct, open_engine, round_up

    cfg = cfg if cfg is not None else IOConfig()
    nbytes = round_up(max(nbytes, cfg.alignment), cfg.alignment)
    chunk = min(nbytes, round_up(64 << 20, cfg.alignment))
    window = min(4, -(-nbytes // chunk))  # chunks in flight: a few requests of queue_depth blocks
    bufs = [aligned_empty(chunk, cfg.alignment) for _ in range(window)]
    gen = torch.Generator().manual_seed(0)
    for b in bufs:  # incompressible, distinct per buffer
        b.copy_(torch.randint(0, 256, (chunk,), dtype=torch.uint8, generator=gen))
    sums = [int(b.sum(dtype=torch.int64)) for b in bufs]
    pieces = [(off, min(chunk, nbytes - off)) for off in range(0, nbytes, chunk)]

    tmp = tempfile.mkdtemp(prefix="zt-bench-", dir=os.fspath(directory))
    path = os.path.join(tmp, "bench.dat")
    try:
        with open_engine(cfg) as eng:
            fd, direct = open_direct(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, direct=cfg.o_direct)
            try:
                def transfer(op: str) -> float:
                    inflight = []
                    t0 = time.perf_counter()
                    for i, (off, length) in enumerate(pieces):
                        if len(inflight) == window:
                            ticket, want = inflight.pop(0)
                            _check_transfer(ticket.wait(), want, op, path)
                        buf = bufs[i % window][:length]
                        ticket = eng.read(fd, buf, off, path) if op == "read" else eng.write(fd, buf, off, path)
                        inflight.append((ticket, length))
                    for ticket, want in inflight:
                        _check_transfer(ticket.wait(), want, op, path)
                    if op == "write":
                        os.fsync(fd)  # the data and the file's size are on the disk
                    return time.perf_counter() - t0

                def read() -> float:
                    if not direct:  # keep the read honest: out of the page cache
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    return transfer("read")

                write_s = transfer("write")
                tick("io: write (fresh file)")
                overwrite_s = min(transfer("overwrite") for _ in range(repeat))
                tick("io: overwrite")
                read_s = min(read() for _ in range(repeat))
                tick("io: read")
                cpu_share = _drive_cpu_share(eng, fd, path, nbytes, cfg)
                tick("io: the drive's CPU share")
            finally:
                os.close(fd)
        last = len(pieces) - 1  # the last `window` chunks are in the buffers: check full ones
        for i in range(max(0, last - window + 1), last + 1):
            if pieces[i][1] == chunk and int(bufs[i % window].sum(dtype=torch.int64)) != sums[i % window]:
                raise RuntimeError(f"zerotier bench io: read-back mismatch in {path} at offset {pieces[i][0]}")
        backend = eng.backend
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    import crc32c  # the swap files' checksum (io.checksum = "crc32c", the default): what it costs here

    data = bufs[0].numpy()
    t0 = time.perf_counter()
    for _ in range(3):
        crc32c.crc32c(data)
    crc_gbps = 3 * data.nbytes / (time.perf_counter() - t0) / 1e9
    return {"path": os.path.abspath(os.fspath(directory)), "bytes": nbytes, "backend": backend,
            "o_direct": direct, "block_size": cfg.block_size, "queue_depth": cfg.queue_depth,
            "write_GBps": nbytes / write_s / 1e9, "overwrite_GBps": nbytes / overwrite_s / 1e9,
            "read_GBps": nbytes / read_s / 1e9, "crc32c_GBps": crc_gbps, "cpu_share": cpu_share}


# [Note: the drive's CPU share]
# Moving data over the drive costs CPU: the kernel's side of each request (on this VM's virtual disk,
# the interrupts and completions), and the checksum zerotier computes over every swap file
# (io.checksum, on the I/O thread). Measured on the 2-core VM in 2026-11: plain torch forward +
# backward of a small GPT took 84.5 ms alone and 106-107 ms while the drive read (1.6 GB/s) or wrote
# (2.5 GB/s) without pause in another thread: 26% slower, reading or writing alike. So `cpu_share` is
# the fraction by which all-core CPU work (compute on a CPU device, CPU Adam on a GPU node) slows
# while the drive moves data at its rate: a probe of all-core matmuls timed alone and beside a stream
# of alternating reads and writes (checksummed as the store's are), in turn, the median of the pairs'
# ratios; 0 where no slowdown shows. Matmuls and the quick GPT-2's forward + backward as the probe
# agree here (0.27 and 0.26 without checksums, 0.34 and 0.36 with them). The step model charges it
# ([Note: the drive's share of the cores] in planner/task_graph.py).


def _drive_cpu_share(eng, fd: int, path: str, nbytes: int, cfg, rounds: int = 7) -> float:
    """[Note: the drive's CPU share] Slowdown of all-core matmuls while reads and writes stream."""
    import statistics
    import threading

    import crc32c
    import torch

    from .io import aligned_empty

    crc = crc32c.crc32c if cfg.checksum == "crc32c" else None  # as the store's files (tiers/nvme_files.py)
    a, out = torch.randn(256, 256), torch.empty(256, 256)
    runs = 1
    while True:  # calibrate: a probe of about 0.1 s
        t0 = time.perf_counter()
        for _ in range(runs):
            torch.mm(a, a, out=out)
        took = time.perf_counter() - t0
        if took >= 0.02 or runs >= 1 << 20:
            break
        runs *= 4
    runs = max(1, int(runs * 0.1 / max(took, 1e-9)))

    def probe() -> float:
        t0 = time.perf_counter()
        for _ in range(runs):
            torch.mm(a, a, out=out)
        return time.perf_counter() - t0

    stop = threading.Event()
    piece = min(4 << 20, nbytes)  # the store's requests: a few MB, several in flight (nbytes: aligned)
    slots = [aligned_empty(piece, cfg.alignment) for _ in range(4)]
    span = nbytes - piece + cfg.alignment

    def stream() -> None:  # reads and writes in turn over the file, four requests in flight
        k, inflight = 0, []
        while not stop.is_set():
            buf = slots[k % len(slots)]
            off = (k * piece) % span // cfg.alignment * cfg.alignment
            if len(inflight) == 4:
                inflight.pop(0).wait()
            if k % 2:
                inflight.append(eng.read(fd, buf, off, path))
            else:
                if crc is not None:
                    crc(buf.numpy())
                inflight.append(eng.write(fd, buf, off, path))
            k += 1
        for ticket in inflight:
            ticket.wait()

    alone, beside = [], []
    for _ in range(rounds):
        alone.append(probe())
        stop.clear()
        worker = threading.Thread(target=stream, name="zerotier-bench-io-stream", daemon=True)
        worker.start()
        time.sleep(0.01)  # the stream under way
        beside.append(probe())
        stop.set()
        worker.join()
    # each round's pair is seconds apart: the median of their ratios, not the ratio of medians taken
    # over a minute in which the machine's speed moves ([Note: rounds, not one run] in bench_planner.py)
    return max(0.0, statistics.median(b / a for a, b in zip(alone, beside)) - 1.0)


def _check_transfer(got: int, want: int, op: str, path: str) -> None:
    if got != want:
        raise RuntimeError(f"zerotier bench io: short {op} of {path}: {got} of {want} bytes")


def bench_adam(numel: int, repeat: int = 3, tick: Tick = _noop) -> dict[str, Any]:
    """Params/s of `adam_step` on fp32 buffers writing the new fp32 parameters out, as the engine's
    update does ([Note: the CPU rate's new parameters] in planner/step_on.py), and with bf16 grads in /
    bf16 params out."""
    import torch

    from .optim._kernels import adam_step, default_threads, simd_level

    gen = torch.Generator().manual_seed(0)
    master = torch.randn(numel, generator=gen)
    exp_avg, exp_avg_sq = torch.zeros(numel), torch.zeros(numel)
    grad = torch.randn(numel, generator=gen) * 1e-3
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    out: dict[str, Any] = {"numel": numel, "simd": simd_level(), "threads": default_threads(),
                           "params_out": True}  # [Note: the CPU rate's new parameters]: timed writing them
    step = [0]

    def run(g, param_out=None) -> None:
        step[0] += 1
        adam_step(master, exp_avg, exp_avg_sq, g, step=step[0], param_out=param_out, **hyper)

    param_fp32 = torch.empty(numel)
    run(grad, param_fp32)
    out["fp32_params_per_s"] = numel / _best_seconds(lambda: run(grad, param_fp32), repeat)
    tick("adam: fp32")
    grad_bf16 = grad.to(torch.bfloat16)
    param_bf16 = torch.empty(numel, dtype=torch.bfloat16)
    run(grad_bf16, param_bf16)
    out["bf16_params_per_s"] = numel / _best_seconds(lambda: run(grad_bf16, param_bf16), repeat)
    tick("adam: bf16 grads, bf16 params out")
    return out


def _unit_state(rule, master_dtype: str, moment_dtype: str, numel: int, device):
    """One flat shard of `numel` parameters in the rule's state layout for these dtypes, on `device`,
    as the state store holds it ([Note: optimizer state layout]: raw bytes, zero moments): the layout,
    the master's and the moments' typed views, and the step's (a, b, step, hyper) range."""
    import torch

    from .config import OptimizerConfig
    from .optim.state_layout import StateLayout

    layout = StateLayout(master_dtype, moment_dtype, keys=rule.state_keys, nonnegative=rule.nonnegative)
    raw = {k: torch.zeros(layout.nbytes(k, numel), dtype=torch.uint8, device=device) for k in layout.keys}
    master = layout.typed("master", raw["master"], numel)
    master[0].copy_(torch.randn(numel, generator=torch.Generator().manual_seed(0)))
    moments = {k: layout.typed(k, raw[k], numel) for k in layout.moment_keys}
    hyper = rule.hyper(rule.group_defaults(OptimizerConfig(), lambda _key: False), 0)
    return layout, master[0], moments, hyper


def _timed_steps(step_once, repeat: int, sync=None) -> float:
    """Best seconds of `step_once(step)` over `repeat` calls after one warm-up (steps 1, 2, ...)."""
    count = [0]

    def one() -> None:
        count[0] += 1
        step_once(count[0])
        if sync is not None:
            sync()
    one()
    return _best_seconds(one, repeat)


def bench_state_rates(numel: int, repeat: int = 3, tick: Tick = _noop, threads: int | None = None) -> dict[str, Any]:
    """Params/s of each rule's native CPU variant (`UpdateRule.cpu_pieces` through
    `StateLayout.step_pieces`, the engine's call) per state dtype pair of STATE_PAIRS, fp32 gradients
    in, the new parameters out in the master's dtype ([Note: the CPU rate's new parameters] in
    planner/step_on.py), at the engine's thread count (`optimizer.threads = "auto"`: the cores over the node's ranks):
    `<rule>_<master>_<moments>_params_per_s`, the planner's `cpu_<rule>_<master>_<moments>`."""
    import torch

    from .device import local_world_size
    from .optim._kernels import default_threads
    from .optim.rules import make_rule

    threads = threads or max(1, default_threads() // local_world_size())
    grad = torch.randn(numel, generator=torch.Generator().manual_seed(1)) * 1e-3
    out: dict[str, Any] = {"state_numel": numel, "state_threads": threads}
    for name in STEP_RULES:
        rule = make_rule(name)
        for master_dtype, moment_dtype in STATE_PAIRS:
            layout, master, moments, hyper = _unit_state(rule, master_dtype, moment_dtype, numel, "cpu")
            params_out = torch.empty_like(master)

            def step_once(step: int) -> None:
                layout.step_pieces(rule.cpu_pieces, master, moments, [(0, numel, step, hyper)], grad=grad, out=params_out,
                                   unit_index=0, shard_lo=0, grad_scale=1.0, bias_correction=True, simd="auto",
                                   threads=threads)
            seconds = _timed_steps(step_once, repeat)
            out[f"{name}_{master_dtype}_{moment_dtype}_params_per_s"] = numel / seconds
            del layout, master, moments, params_out
        tick(f"adam: {name} per state dtype")
    return out


def device_step_bytes(rule, master_dtype: str, moment_dtype: str) -> float:
    """Bytes per parameter the device step's kernel moves, as the planner counts them
    (planner/step_on.py, UpdateCosts.kernel_bytes): the state read and written, an fp32 gradient read."""
    return 2 * rule.bytes_per_param(master_dtype, moment_dtype) + 4


def bench_device_step(numel: int, device=None, repeat: int = 3, tick: Tick = _noop) -> dict[str, Any] | None:
    """Bytes/s of each rule's device variant (`UpdateRule.device_pieces` through
    `StateLayout.step_pieces`, what a unit stepped on the device runs) on state staged on `device`,
    per state dtype pair of STATE_PAIRS, fp32 gradients: `<rule>_<master>_<moments>_GBps`, the
    planner's `device_<rule>_<master>_<moments>` (and AdamW's fp32 pair its `device_adam`), in the
    kernel's bytes (`device_step_bytes`). None without CUDA when `device` is not given: a CPU-only node's
    "device" is the CPU, whose update the planner keeps on the native kernel. `device="cpu"` runs the
    same path on the CPU (tests)."""
    import torch

    from .optim.rules import make_rule

    if device is None:
        if not torch.cuda.is_available():
            return None
        device = "cuda"
    device = torch.device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    grad = torch.randn(numel, generator=torch.Generator().manual_seed(1)).mul_(1e-3).to(device)
    out: dict[str, Any] = {"numel": numel, "device": torch.cuda.get_device_name(device) if device.type == "cuda"
                           else "cpu"}
    for name in STEP_RULES:
        rule = make_rule(name)
        for master_dtype, moment_dtype in STATE_PAIRS:
            layout, master, moments, hyper = _unit_state(rule, master_dtype, moment_dtype, numel, device)

            def step_once(step: int) -> None:
                layout.step_pieces(rule.device_pieces, master, moments, [(0, numel, step, hyper)], grad=grad, out=None,
                                   unit_index=0, shard_lo=0, grad_scale=1.0, bias_correction=True)
            seconds = _timed_steps(step_once, repeat, sync)
            out[f"{name}_{master_dtype}_{moment_dtype}_GBps"] = \
                device_step_bytes(rule, master_dtype, moment_dtype) * numel / seconds / 1e9
            del layout, master, moments
        tick(f"device step: {name} per state dtype")
    return out


def bench_compute(side: int | None = None, repeat: int = 3, tick: Tick = _noop, quick: bool = False,
                  device=None) -> dict[str, Any]:
    """Dense matmul flop/s (2 side^3 per product) on the compute device, fp32 and bf16; CPU: side
    at most 2048 (a GPU-sized product takes minutes there)."""
    import torch

    device = torch.device(device) if device is not None else \
        torch.device("cuda" if torch.cuda.is_available() else "cpu")
    side = side or (QUICK_SIZES if quick else SIZES)["compute"]
    if device.type == "cpu":
        side = min(side, 2048)
    out: dict[str, Any] = {"side": side, "device": torch.cuda.get_device_name(device) if device.type == "cuda"
                           else "cpu", "threads": torch.get_num_threads()}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a = torch.randn(side, side, device=device).to(dtype)
        b = torch.randn(side, side, device=device).to(dtype)

        def product() -> None:
            a @ b
            if device.type == "cuda":
                torch.cuda.synchronize()
        product()
        out[f"{name}_flops"] = 2 * side ** 3 / _best_seconds(product, repeat)
        tick(f"compute: {name} matmul")
    return out



def adam_numel(at_least: int) -> int:
    """Parameters for the Adam measurement: at least `at_least`, and a working set of at least four
    times the last-level cache, so the figure is the memory-bound rate training sees, not the
    cache's (the quick size alone fits in the L3 of a large server CPU)."""
    try:
        import cpuinfo

        l3 = int(cpuinfo.get_cpu_info().get("l3_cache_size") or 0)
    except Exception:  # noqa: BLE001 - no cache size known: the minimum it is
        l3 = 0
    return max(at_least, 4 * l3 // ADAM_BYTES_PER_PARAM)
