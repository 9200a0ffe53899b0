"""`zerotier bench`: measure this node's rates and save them for the planner.

Sections (each a function returning a dict of figures; GB = 1e9 bytes):
  mem   memory bandwidth: in-place `mul_` on a large fp32 buffer (read + write bytes) and a
        buffer-to-buffer `copy_` (read + write bytes)
  pcie  with CUDA: host->device and device->host copies from pinned and pageable memory
  io    NVMe write of one fresh file, overwrites of it and reads through zerotier's own engine
        (`open_engine(IOConfig())`, O_DIRECT, aligned buffers), in a temp subdir removed after;
        the overwrite is what training's step writes do (recycled swap files, [Note: NVMe file
        recycling]) and is the planner's and the profiler's nvme_write peak
  adam  CPU Adam throughput (params/s) of `zerotier.optim.adam_step`: fp32 grads, and the
        mixed form (bf16 grads in, bf16 params out)
  compute  the compute device's dense matmul rate (flop/s, fp32 and bf16): what `zerotier plan
        --rates FILE` scales measured unit times by ([Note: another node's rates] in planning.py)

Results are merged into a JSON file, per host (a home directory may be shared by nodes):

    {"format": 1, "hostname": <last writer>, "timestamp": <last save>,
     "hosts": {"<hostname>": {"timestamp": ..., "mem": {..., "timestamp": ...}, "io": {...}, ...}}}

at `--save PATH`, else $ZEROTIER_BENCH_FILE, else ~/.cache/zerotier/bench.json.
`load_rates()` maps this host's figures to the planner's rate keys (zerotier.planner.predict.DEFAULT_RATES).

Only `load_rates`/`load`/`bench_file` run at import-light cost: the planner calls them on every
`initialize()`; torch and the engine are imported inside the measuring functions.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from .errors import ConfigError

FORMAT = 1
SECTIONS = ("mem", "pcie", "io", "adam", "compute")
# default / --quick sizes: bytes for mem, pcie, io; parameters for adam; matrix side for compute
SIZES = {"mem": 1 << 30, "pcie": 512 << 20, "io": 1 << 30, "adam": 50_000_000, "compute": 4096}
QUICK_SIZES = {"mem": 256 << 20, "pcie": 64 << 20, "io": 64 << 20, "adam": 8_000_000, "compute": 1024}
ADAM_BYTES_PER_PARAM = 16  # fp32 master, exp_avg, exp_avg_sq, grad: what one Adam pass streams
STEPS = {"mem": 2, "pcie": 4, "io": 3, "adam": 2, "compute": 2}  # progress-bar ticks per section (pcie: CUDA only)

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


# ---------------------------------------------------------------------------------------------
# measurements


def bench_memory(nbytes: int, repeat: int = 5, tick: Tick = _noop) -> dict[str, Any]:
    """In-place `mul_` and `copy_` bandwidth over `nbytes` buffers, all torch threads."""
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
    # the node's RAM, for plans made elsewhere with this file ([Note: the plan against the machine])
    return {"bytes": 4 * n, "threads": torch.get_num_threads(),
            "inplace_GBps": inplace / 1e9, "copy_GBps": copy / 1e9, "total_bytes": usable_memory().total}


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
            "read_GBps": nbytes / read_s / 1e9, "crc32c_GBps": crc_gbps}


def _check_transfer(got: int, want: int, op: str, path: str) -> None:
    if got != want:
        raise RuntimeError(f"zerotier bench io: short {op} of {path}: {got} of {want} bytes")


def bench_adam(numel: int, repeat: int = 3, tick: Tick = _noop) -> dict[str, Any]:
    """Params/s of `adam_step` on fp32 buffers, and with bf16 grads in / bf16 params out."""
    import torch

    from .optim._kernels import adam_step, default_threads, simd_level

    gen = torch.Generator().manual_seed(0)
    master = torch.randn(numel, generator=gen)
    exp_avg, exp_avg_sq = torch.zeros(numel), torch.zeros(numel)
    grad = torch.randn(numel, generator=gen) * 1e-3
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    out: dict[str, Any] = {"numel": numel, "simd": simd_level(), "threads": default_threads()}
    step = [0]

    def run(g, param_out=None) -> None:
        step[0] += 1
        adam_step(master, exp_avg, exp_avg_sq, g, step=step[0], param_out=param_out, **hyper)

    run(grad)
    out["fp32_params_per_s"] = numel / _best_seconds(lambda: run(grad), repeat)
    tick("adam: fp32")
    grad_bf16 = grad.to(torch.bfloat16)
    param_bf16 = torch.empty(numel, dtype=torch.bfloat16)
    run(grad_bf16, param_bf16)
    out["bf16_params_per_s"] = numel / _best_seconds(lambda: run(grad_bf16, param_bf16), repeat)
    tick("adam: bf16 grads, bf16 params out")
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


# ---------------------------------------------------------------------------------------------
# driver


class Progress:
    """bench's progress on stderr, drawn by tqdm: a bar on a terminal; elsewhere (a log, CI) the
    same text as one line per step, without the carriage returns a redrawn bar leaves in a file."""

    def __init__(self, total: int, stream=None):
        from tqdm import tqdm

        self.stream = stream if stream is not None else sys.stderr
        self.total, self.done, self.t0 = max(total, 1), 0, time.perf_counter()
        tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.bar = tqdm(total=self.total, file=self.stream, desc="zerotier bench", unit="step") if tty else None

    def __call__(self, label: str) -> None:
        from tqdm import tqdm

        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(label, refresh=False)
            self.bar.update()
            if self.done >= self.total:
                self.bar.close()
            return
        self.stream.write(tqdm.format_meter(self.done, self.total, time.perf_counter() - self.t0, ncols=100,
                                            prefix="zerotier bench", unit="step", postfix=label, ascii=True) + "\n")
        self.stream.flush()


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


def run(sections: tuple[str, ...] = SECTIONS, *, size: int | None = None, params: int | None = None,
        quick: bool = False, path: str | os.PathLike = ".", progress: Tick | None = None) -> dict[str, Any]:
    """Measure `sections`; returns {section: figures} (pcie: None without CUDA).

    size: bytes for mem/pcie/io (default SIZES, or QUICK_SIZES with quick); params: Adam numel.
    """
    import torch

    table = QUICK_SIZES if quick else SIZES
    # a CPU-only node has no PCIe link to measure: its section is skipped without a bar
    ticking = [s for s in sections if s != "pcie" or torch.cuda.is_available()]
    tick = progress or Progress(sum(STEPS[s] for s in ticking))
    results: dict[str, Any] = {}
    for section in sections:
        if section == "mem":
            results["mem"] = bench_memory(size or table["mem"], repeat=3 if quick else 5, tick=tick)
        elif section == "pcie":
            results["pcie"] = bench_pcie(size or table["pcie"], repeat=3 if quick else 5, tick=tick)
        elif section == "io":
            results["io"] = bench_io(path, size or table["io"], tick=tick)
        elif section == "adam":
            results["adam"] = bench_adam(params or adam_numel(table["adam"]), repeat=3, tick=tick)
        elif section == "compute":
            results["compute"] = bench_compute(table["compute"], repeat=3, tick=tick)
        else:
            raise ValueError(f"unknown bench section {section!r}; choose from {', '.join(SECTIONS)}")
    return results


def format_table(results: dict[str, Any]) -> str:
    """The measured figures as aligned text rows."""
    from .units import format_size

    rows: list[tuple[str, str]] = []
    mem = results.get("mem")
    if mem:
        note = f"({format_size(mem['bytes'])} buffer, {mem['threads']} threads; read+write bytes)"
        rows += [("memory in-place mul_", f"{mem['inplace_GBps']:7.2f} GB/s  {note}"),
                 ("memory copy_", f"{mem['copy_GBps']:7.2f} GB/s")]
    if "pcie" in results:
        pcie = results["pcie"]
        if pcie is None:
            rows.append(("pcie", "skipped: no CUDA device (CPU-only node)"))
        else:
            for key in ("h2d_pinned", "d2h_pinned", "h2d_pageable", "d2h_pageable"):
                rows.append((f"{key.replace('_', ' ')}", f"{pcie[key + '_GBps']:7.2f} GB/s  ({pcie['device']})"))
    io = results.get("io")
    if io:
        how = f"({format_size(io['bytes'])}, {io['backend']}, " + ("O_DIRECT" if io["o_direct"] else
                                                                 "buffered: no O_DIRECT here") + f", {io['path']})"
        rows.append(("nvme write, fresh file", f"{io['write_GBps']:7.2f} GB/s  {how}"))
        if io.get("overwrite_GBps"):
            rows.append(("nvme overwrite", f"{io['overwrite_GBps']:7.2f} GB/s  (a step's swap writes)"))
        rows.append(("nvme read", f"{io['read_GBps']:7.2f} GB/s"))
        if io.get("crc32c_GBps"):  # the checksum of every swap file, on the writing/reading thread
            rate = io.get("overwrite_GBps") or io["write_GBps"]   # a step's swap writes are overwrites
            rows.append(("swap checksum crc32c", f"{io['crc32c_GBps']:7.2f} GB/s  (one core; "
                                                 f"+{100 * rate / io['crc32c_GBps']:.0f}% to a swap write's time "
                                                 f"at {rate:.2f} GB/s)"))
    adam = results.get("adam")
    if adam:
        note = f"({adam['numel'] / 1e6:.0f}M params, {adam['simd']}, {adam['threads']} threads)"
        rows += [("cpu adam fp32", f"{adam['fp32_params_per_s'] / 1e9:7.2f} G params/s  {note}"),
                 ("cpu adam bf16 grad+out", f"{adam['bf16_params_per_s'] / 1e9:7.2f} G params/s")]
    compute = results.get("compute")
    if compute:
        note = f"({compute['side']}^2 matmul on {compute['device']})"
        rows += [("matmul fp32", f"{compute['fp32_flops'] / 1e12:7.3f} TFLOP/s  {note}"),
                 ("matmul bf16", f"{compute['bf16_flops'] / 1e12:7.3f} TFLOP/s")]
    width = max((len(k) for k, _ in rows), default=0)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


# ---------------------------------------------------------------------------------------------
# saved results


def bench_file(path: str | os.PathLike | None = None) -> Path:
    """Where results are saved: `path`, else $ZEROTIER_BENCH_FILE, else ~/.cache/zerotier/bench.json."""
    if path:
        return Path(path).expanduser()
    env = os.environ.get("ZEROTIER_BENCH_FILE")
    if env:
        return Path(env).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "zerotier" / "bench.json"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        warnings.warn(f"{path}: cannot read saved zerotier bench results ({exc}); ignoring them",
                      RuntimeWarning, stacklevel=3)
        return None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("hosts"), dict):
        warnings.warn(f"{path}: not a zerotier bench file of format {FORMAT}; ignoring it",
                      RuntimeWarning, stacklevel=3)
        return None
    return data


def save(results: dict[str, Any], path: str | os.PathLike | None = None) -> Path:
    """Merge `results` into this host's entry of the bench file (atomically); returns its path."""
    target = bench_file(path)
    data = _read(target) or {"format": FORMAT, "hosts": {}}
    host, now = socket.gethostname(), _now()
    entry = data["hosts"].setdefault(host, {})
    for section, figures in results.items():
        entry[section] = {**figures, "timestamp": now} if figures is not None else {"skipped": True,
                                                                                   "timestamp": now}
    entry["timestamp"] = now
    data.update(hostname=host, timestamp=now)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, target)
    return target


def load(path: str | os.PathLike | None = None) -> dict[str, Any] | None:
    """This host's saved entry ({section: figures, "timestamp": ...}), or None."""
    data = _read(bench_file(path))
    if data is None:
        return None
    entry = data["hosts"].get(socket.gethostname())
    return entry if isinstance(entry, dict) else None


def load_rates(path: str | os.PathLike | None = None) -> dict[str, float] | None:
    """This host's saved figures as the planner's rates (None when nothing usable is saved)."""
    return entry_rates(load(path))


def rates_from_file(path: str | os.PathLike) -> dict[str, float]:
    """The rates of a bench file written on another node ([Note: another node's rates] in
    planning.py): its one host's entry, or the most recently saved one. The user named this file,
    so unlike this node's cache it is checked strictly: ConfigError naming the file and the key."""
    path = Path(path).expanduser()
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read it as a zerotier bench file ({exc}); write one with "
                          "`zerotier bench --save FILE` on the node to plan for") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("hosts"), dict):
        raise ConfigError(f"{path}: not a zerotier bench file (expected a JSON object with format {FORMAT} and a "
                          "hosts object); write one with `zerotier bench --save FILE` on the node to plan for")
    for host, entry in data["hosts"].items():
        _check_entry(path, host, entry)
    entries = list(data["hosts"].values())
    rates = entry_rates(max(entries, key=lambda e: str(e.get("timestamp", "")), default=None))
    if rates is None:
        raise ConfigError(f"{path}: no zerotier bench results in it (write one with `zerotier bench --save FILE` "
                          "on the node to plan for)")
    return rates


# The figures entry_rates reads, by section, with the factor to the rate's unit (bytes, flop or params /s).
_FIGURES = {"pcie": {"h2d_pinned_GBps": 1e9, "d2h_pinned_GBps": 1e9},
            "io": {"read_GBps": 1e9, "overwrite_GBps": 1e9, "write_GBps": 1e9},
            "mem": {"copy_GBps": 0.5e9, "inplace_GBps": 1e9}, "adam": {"fp32_params_per_s": 1.0},
            "compute": {"fp32_flops": 1.0, "bf16_flops": 1.0}}
# A figure is a number whose rate lies in this range (1 to 10^18 per second): outside it a
# prediction is 0 s or overflows.
_RATE_RANGE = (1.0, 1e18)


def _is_rate(value: Any, factor: float) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and _RATE_RANGE[0] <= value * factor <= _RATE_RANGE[1])


def _check_entry(path: Path, host: str, entry: Any) -> None:
    where = f"{path}: hosts.{host}"
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: expected an object of bench sections, got {type(entry).__name__}")
    for section, fields in _FIGURES.items():
        figures = entry.get(section)
        if figures is None:
            continue
        if not isinstance(figures, dict):
            raise ConfigError(f"{where}.{section}: expected an object of figures, got {type(figures).__name__}")
        for field, factor in fields.items():
            value = figures.get(field)
            if value is None:
                continue
            if not _is_rate(value, factor):
                raise ConfigError(f"{where}.{section}.{field}: expected a measured rate, a number from "
                                  f"{_RATE_RANGE[0] / factor:g} to {_RATE_RANGE[1] / factor:g}, got {value!r}")
        if section == "io" and not isinstance(figures.get("o_direct", False), bool):
            raise ConfigError(f"{where}.io.o_direct: expected true or false, got {figures['o_direct']!r}")


def entry_rates(entry: dict[str, Any] | None) -> dict[str, float] | None:
    """One host's figures as the planner's rates: h2d, d2h, nvme_read, nvme_write, mem_copy,
    mem_read (bytes/s), cpu_adam (params/s, fp32 grads: what the engine's fp32 accumulators feed),
    compute_fp32 / compute_bf16 (matmul flop/s); only the keys measured. NVMe figures taken
    without O_DIRECT (page cache) are left out. nvme_write is the overwrite rate (a step's
    writes), the fresh-file rate only in files saved before it was measured. The memory
    figures count read + write bytes: a copy of B bytes moves 2B (mem_copy is half of copy_),
    a read pass moves B (mem_read is the in-place rate)."""
    if not entry:
        return None
    rates: dict[str, float] = {}
    sections = {name: entry.get(name) if isinstance(entry.get(name), dict) else {} for name in _FIGURES}
    pcie, io, adam, mem, compute = (sections[name] for name in ("pcie", "io", "adam", "mem", "compute"))
    for key, (section, field, factor) in {
            "h2d": (pcie, "h2d_pinned_GBps", 1e9), "d2h": (pcie, "d2h_pinned_GBps", 1e9),
            "nvme_read": (io, "read_GBps", 1e9),
            "nvme_write": (io, "overwrite_GBps" if "overwrite_GBps" in io else "write_GBps", 1e9),
            "mem_copy": (mem, "copy_GBps", 0.5e9), "mem_read": (mem, "inplace_GBps", 1e9),
            "cpu_adam": (adam, "fp32_params_per_s", 1.0),
            "compute_fp32": (compute, "fp32_flops", 1.0), "compute_bf16": (compute, "bf16_flops", 1.0)}.items():
        value = section.get(field)
        if _is_rate(value, factor) and (section is not io or io.get("o_direct")):
            rates[key] = float(value) * factor
    return rates or None
