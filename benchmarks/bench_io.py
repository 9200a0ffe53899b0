"""zerotier's NVMe store against fio on the same drive, and the I/O engine's backends.

    python benchmarks/bench_io.py --dir DIR_ON_THE_DRIVE                 # the store vs fio
    python benchmarks/bench_io.py backends --dir DIR_ON_THE_DRIVE        # backends vs fio

The store against fio (the default form): fio and zerotier's NVMeStore (its write/read path as
the engine uses it: host pool blocks, the default IOConfig, checksums on) move the same bytes
in rounds, back to back, the order alternating, and the table gives each round's ratio
store/fio per direction and the median of those ratios ([Note: store vs fio rounds]). Each
option below changes one knob of the store and fio alike where fio has it (block, qd, files,
prealloc) or of the store alone (checksum, source), to measure what each costs:

    python benchmarks/bench_io.py --rounds 8 --total 1GiB --checksum none --json runs.jsonl
    python benchmarks/bench_io.py --summary runs.jsonl      # medians over batches, per setting

Without fio on PATH it measures the store alone and says "fio: n/a (why)".

The `backends` form: write-then-read throughput of zerotier's I/O engine backends vs fio, in
one run. For each shard size, `--total` bytes are written as one file per shard (like one swap
file per tensor shard) and read back, with O_DIRECT (no page cache), by:

  io_uring  zerotier native engine, io_uring backend
  threads   zerotier native engine, pthread pool of pread/pwrite
  aiofiles  zerotier pure-Python fallback
  pythreads plain Python: os.pwrite / os.preadv of aligned buffers from a ThreadPoolExecutor
            (`--threads` workers, one shard file per task, `--py-chunk` bytes per call)
  fio       fio --ioengine=io_uring --direct=1, same block size and file sizes, best of
            `--fio-qd` queue depths (default 1, 8 and 32), per direction

and reports GB/s (1e9 bytes/s) and CPU-seconds per GB (process user+system time, all
threads; fio: its child processes less their start-up), plus ratios measured in the same
run and PASS/MISS against the targets for the native engine (each native backend):
  GB/s  >= 0.95 x best fio       (write and read)
  GB/s  >= 1.0  x aiofiles       (write and read)
  CPU-s/GB <= 0.5 x aiofiles'    (write and read)
Each timed phase starts after os.sync(), so one run's deferred filesystem work (journal,
discards of deleted files) is not billed to the next.

    python benchmarks/bench_io.py backends --total 1GiB --dir /mnt/nvme/tmp
    python benchmarks/bench_io.py backends --quick
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from queue import SimpleQueue

import torch

from zerotier.config import IOConfig
from zerotier.io import aligned_empty, open_direct, open_engine, probe_io_uring, round_up

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 1000, "m": 1 << 20, "mib": 1 << 20,
          "mb": 10**6, "g": 1 << 30, "gib": 1 << 30, "gb": 10**9, "t": 1 << 40, "tib": 1 << 40}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4GiB, 512MiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def fmt_size(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return f"{n}B"


def cpu_seconds(who=resource.RUSAGE_SELF) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def settle() -> None:
    """Flush dirty metadata and let the filesystem finish freeing deleted files (with
    `-o discard`, ext4 issues the discards at journal commit) so that work is not billed
    to whichever run comes next."""
    os.sync()


@dataclass
class Result:
    gbps: float
    cpu_per_gb: float


def run_engine(backend: str, cfg: IOConfig, directory: str, total: int, shard: int,
               verify: bool) -> tuple[Result, Result]:
    """Write `total` bytes as `total // shard` files, then read them back."""
    n_shards = total // shard
    # Enough shards in flight to keep the queue full across shard boundaries.
    window = max(2, -(-2 * cfg.queue_depth * cfg.block_size // shard))
    window = min(window, n_shards)
    bufs = [aligned_empty(shard, cfg.alignment) for _ in range(window)]
    for i, b in enumerate(bufs):
        b.copy_(torch.randint(0, 256, (shard,), dtype=torch.uint8,
                              generator=torch.Generator().manual_seed(i)))
    paths = [os.path.join(directory, f"{backend}.{i}") for i in range(n_shards)]
    results = []
    with open_engine(cfg) as eng:
        assert eng.backend == backend, (eng.backend, backend)
        for op in ("write", "read"):
            flags = (os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if op == "write" else os.O_RDONLY
            inflight: list[tuple[int, object]] = []  # (fd, ticket), FIFO
            settle()
            t0, c0 = time.perf_counter(), cpu_seconds()
            for i, path in enumerate(paths):
                if len(inflight) == window:
                    fd, t = inflight.pop(0)
                    assert t.wait() == shard
                    os.close(fd)
                fd, direct = open_direct(path, flags)
                buf = bufs[i % window]
                t = eng.write(fd, buf, 0, path) if op == "write" else eng.read(fd, buf, 0, path)
                inflight.append((fd, t))
            for fd, t in inflight:
                assert t.wait() == shard
                os.close(fd)
            wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
            gb = total / 1e9
            results.append(Result(gb / wall, cpu / gb))
    if verify:  # the last `window` shards were read into the buffers: check one
        i = n_shards - 1
        expect = torch.randint(0, 256, (shard,), dtype=torch.uint8,
                               generator=torch.Generator().manual_seed(i % window))
        assert torch.equal(bufs[i % window], expect), f"{backend}: read-back mismatch"
    for p in paths:
        os.unlink(p)
    settle()
    return results[0], results[1]


def run_pythreads(cfg: IOConfig, directory: str, total: int, shard: int, chunk: int,
                  verify: bool) -> tuple[Result, Result]:
    """Plain Python: a ThreadPoolExecutor of `cfg.threads` workers, one task per shard file,
    os.pwrite / os.preadv of `chunk` bytes at a time on O_DIRECT fds, aligned buffers."""
    n_shards = total // shard
    workers = min(cfg.threads, n_shards)
    step = min(chunk, shard)
    bufs = [aligned_empty(shard, cfg.alignment) for _ in range(workers)]
    for i, b in enumerate(bufs):
        b.copy_(torch.randint(0, 256, (shard,), dtype=torch.uint8,
                              generator=torch.Generator().manual_seed(i)))
    sums = [int(b.sum(dtype=torch.int64)) for b in bufs]
    views = [memoryview(b.numpy()) for b in bufs]
    free: SimpleQueue[int] = SimpleQueue()  # read buffers: one per running task
    for i in range(workers):
        free.put(i)
    paths = [os.path.join(directory, f"pythreads.{i}") for i in range(n_shards)]

    def write(i: int) -> None:  # shard i holds pattern i % workers; concurrent readers of it are fine
        fd, _ = open_direct(paths[i], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            mv = views[i % workers]
            for off in range(0, shard, step):
                if os.pwrite(fd, mv[off:off + step], off) != step:
                    raise OSError(f"short write to {paths[i]} at {off}")
        finally:
            os.close(fd)

    def read(i: int) -> None:
        b = free.get()
        try:
            fd, _ = open_direct(paths[i], os.O_RDONLY)
            try:
                mv = views[b]
                for off in range(0, shard, step):
                    if os.preadv(fd, [mv[off:off + step]], off) != step:
                        raise OSError(f"short read of {paths[i]} at {off}")
            finally:
                os.close(fd)
            if verify and i == n_shards - 1:
                assert int(bufs[b].sum(dtype=torch.int64)) == sums[i % workers], "pythreads: read-back mismatch"
        finally:
            free.put(b)

    results = []
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="bench-py") as pool:
        for fn in (write, read):
            settle()
            t0, c0 = time.perf_counter(), cpu_seconds()
            for f in [pool.submit(fn, i) for i in range(n_shards)]:
                f.result()
            wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
            results.append(Result(total / 1e9 / wall, cpu / (total / 1e9)))
    for p in paths:
        os.unlink(p)
    settle()
    return results[0], results[1]


def _fio(cfg: IOConfig, directory: str, rw: str, total: int, shard: int) -> tuple[dict, float]:
    """Run one fio job; (its JSON stats for `rw`, CPU seconds of the fio processes)."""
    cmd = ["fio", "--name=ztbench", f"--directory={directory}", "--ioengine=io_uring",
           "--direct=1", f"--rw={rw}", f"--bs={cfg.block_size}", f"--iodepth={cfg.queue_depth}",
           f"--size={total}", f"--nrfiles={total // shard}", f"--filesize={shard}",
           "--fallocate=none", "--output-format=json"]
    settle()
    c0 = cpu_seconds(resource.RUSAGE_CHILDREN)
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    cpu = cpu_seconds(resource.RUSAGE_CHILDREN) - c0
    return json.loads(out[out.index("{"):])["jobs"][0][rw], cpu


def fio_startup_cpu(cfg: IOConfig, directory: str) -> float:
    """CPU seconds fio spends outside the transfer (start-up, parsing, reporting): the
    cheapest of a few one-block jobs. Subtracted from fio's figures so CPU/GB compares
    the transfer itself, as our numbers (taken inside one running process) do."""
    best = min(_fio(cfg, directory, "write", cfg.block_size, cfg.block_size)[1] for _ in range(3))
    os.unlink(os.path.join(directory, "ztbench.0.0"))
    return best


def run_fio_best(cfg: IOConfig, directory: str, total: int, shard: int, startup_cpu: float,
                 depths: list[int]) -> tuple[Result, Result, str]:
    """fio at each queue depth in `depths`; the best GB/s per direction (with its CPU/GB)."""
    best_w = best_r = None
    qd_w = qd_r = 0
    for qd in depths:
        w, r = run_fio(dataclasses.replace(cfg, queue_depth=qd), directory, total, shard, startup_cpu)
        print(f"  {fmt_size(shard):>6} fio qd{qd:<5d} write {w.gbps:6.2f} GB/s {w.cpu_per_gb:6.3f} CPU-s/GB | "
              f"read {r.gbps:6.2f} GB/s {r.cpu_per_gb:6.3f} CPU-s/GB", flush=True)
        if best_w is None or w.gbps > best_w.gbps:
            best_w, qd_w = w, qd
        if best_r is None or r.gbps > best_r.gbps:
            best_r, qd_r = r, qd
    return best_w, best_r, f"write qd{qd_w}, read qd{qd_r}"


def run_fio(cfg: IOConfig, directory: str, total: int, shard: int,
            startup_cpu: float) -> tuple[Result, Result]:
    n_shards = total // shard
    results = []
    for rw in ("write", "read"):
        job, cpu = _fio(cfg, directory, rw, total, shard)
        gb = job["io_bytes"] / 1e9
        results.append(Result(job["bw_bytes"] / 1e9, max(0.0, cpu - startup_cpu) / gb))
    for i in range(n_shards):
        try:
            os.unlink(os.path.join(directory, f"ztbench.0.{i}"))
        except FileNotFoundError:
            pass
    settle()
    return results[0], results[1]


# Targets for the native engine (see the module docstring): (name, figure, ref backend, op, bound)
TARGETS = [("wr>=0.95xfio", "gbps", "fio", 0, 0.95), ("rd>=0.95xfio", "gbps", "fio", 1, 0.95),
           ("wr>=1.0xaio", "gbps", "aiofiles", 0, 1.0), ("rd>=1.0xaio", "gbps", "aiofiles", 1, 1.0),
           ("wrCPU<=0.5xaio", "cpu", "aiofiles", 0, 0.5), ("rdCPU<=0.5xaio", "cpu", "aiofiles", 1, 0.5)]


def print_table(rows, ref_name: str) -> None:
    """GB/s, CPU/GB and ratios against `ref_name` measured in the same run."""
    if not any(ref_name in found for _, found in rows):
        print(f"(no {ref_name} figures: ratios against it left out)")
        return
    ref = ref_name[:5]
    hdr = (f"{'shard':>6} {'backend':9s} {'wr GB/s':>8} {'wr CPU/GB':>9} {'rd GB/s':>8} {'rd CPU/GB':>9}"
           f" {'wr/' + ref:>9} {'rd/' + ref:>9} {'wrCPU/' + ref:>11} {'rdCPU/' + ref:>11}")
    print(f"\nratios vs {ref_name}:")
    print(hdr)
    print("-" * len(hdr))
    for shard, found in rows:
        base = found.get(ref_name)
        for b, (w, r) in found.items():
            line = (f"{fmt_size(shard):>6} {b:9s} {w.gbps:8.2f} {w.cpu_per_gb:9.3f} {r.gbps:8.2f} "
                    f"{r.cpu_per_gb:9.3f}")
            if base is not None:
                fw, fr = base
                line += (f" {w.gbps / fw.gbps:9.2f} {r.gbps / fr.gbps:9.2f}"
                         f" {_ratio(w.cpu_per_gb, fw.cpu_per_gb):>11} {_ratio(r.cpu_per_gb, fr.cpu_per_gb):>11}")
            print(line)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b > 0 else "-"


def print_targets(rows) -> None:
    """PASS/MISS per native backend, shard size and target; a summary line per backend."""
    natives = [b for b in ("io_uring", "threads") if any(b in found for _, found in rows)]
    if not natives:
        return
    print("\ntargets for the native engine (ratio, PASS/MISS; fio = best queue depth, aio = aiofiles):")
    hdr = f"{'shard':>6} {'backend':9s} " + " ".join(f"{name:>15s}" for name, *_ in TARGETS)
    print(hdr)
    print("-" * len(hdr))
    misses: dict[str, list[str]] = {b: [] for b in natives}
    checked: dict[str, int] = {b: 0 for b in natives}
    for shard, found in rows:
        for b in natives:
            if b not in found:
                continue
            cells = []
            for name, figure, ref_name, op, bound in TARGETS:
                if ref_name not in found:
                    cells.append(f"{'n/a':>15s}")
                    continue
                mine, ref = found[b][op], found[ref_name][op]
                if figure == "gbps":
                    ratio = mine.gbps / ref.gbps
                    ok = ratio >= bound
                else:
                    ratio = mine.cpu_per_gb / ref.cpu_per_gb if ref.cpu_per_gb > 0 else float("inf")
                    ok = ratio <= bound
                checked[b] += 1
                if not ok:
                    misses[b].append(f"{fmt_size(shard)} {name} ({ratio:.3f})")
                cells.append(f"{ratio:9.3f} {'PASS' if ok else 'MISS':>5s}")
            print(f"{fmt_size(shard):>6} {b:9s} " + " ".join(cells))
    print()
    for b in natives:
        if not checked[b]:
            continue
        verdict = "PASS" if not misses[b] else f"MISS ({len(misses[b])} of {checked[b]}): " + "; ".join(misses[b])
        print(f"{b}: {verdict}")


def backends_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bench_io.py backends", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--total", type=parse_size, default=parse_size("4GiB"), help="bytes per phase")
    ap.add_argument("--dir", default=None, help="directory on the drive to test (default: a temp dir)")
    ap.add_argument("--sizes", default="1,4,16,64", help="shard sizes in MiB, comma separated")
    ap.add_argument("--block", type=parse_size, default=IOConfig().block_size, help="I/O block size")
    ap.add_argument("--qd", type=int, default=IOConfig().queue_depth, help="queue depth")
    ap.add_argument("--threads", type=int, default=IOConfig().threads, help="threads backend workers")
    ap.add_argument("--backends", default="io_uring,threads,aiofiles,pythreads,fio")
    ap.add_argument("--fio-qd", default="1,8,32", help="fio queue depths; the best per direction is kept")
    ap.add_argument("--py-chunk", type=parse_size, default=parse_size("16MiB"),
                    help="pythreads: bytes per os.pwrite/os.preadv call (default 16MiB)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per backend; best figure kept")
    ap.add_argument("--quick", action="store_true", help="tiny smoke run (64 MiB, 1,4 MiB shards)")
    return ap


def main_backends(argv) -> int:
    """The engine's backends, aiofiles, plain Python threads and fio: one table, best of repeats."""
    args = backends_parser().parse_args(argv)
    if args.quick:
        args.total, args.sizes = 64 << 20, "1,4"

    sizes = [int(s) << 20 for s in args.sizes.split(",") if s.strip()]
    fio_depths = [int(q) for q in args.fio_qd.split(",") if q.strip()]
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    ok, why = probe_io_uring()
    if "io_uring" in backends and not ok:
        print(f"note: skipping io_uring backend: {why}")
        backends.remove("io_uring")
    if "fio" in backends and shutil.which("fio") is None:
        print("note: fio not found on PATH; install it for the reference numbers "
              "(Debian/Ubuntu: `apt-get install fio`, Fedora: `dnf install fio`)")
        backends.remove("fio")

    base = args.dir or tempfile.gettempdir()
    directory = tempfile.mkdtemp(prefix="zt-bench-io-", dir=base)
    probe_fd, direct = open_direct(os.path.join(directory, "probe"), os.O_RDWR | os.O_CREAT)
    os.close(probe_fd)
    os.unlink(os.path.join(directory, "probe"))
    print(f"dir={directory} o_direct={direct} total={fmt_size(args.total)} block={fmt_size(args.block)} "
          f"qd={args.qd} threads={args.threads} cpus={os.cpu_count()}")
    if not direct:
        print("warning: no O_DIRECT here, numbers include the page cache")

    rows = []
    fio_cpu0 = None
    fio_best: dict[int, str] = {}
    try:
        for shard in sizes:
            if args.total % shard:
                print(f"skip shard {fmt_size(shard)}: does not divide --total")
                continue
            found: dict[str, tuple[Result, Result]] = {}
            for rep in range(args.repeat):  # backends interleaved: drift hits all alike
                for b in backends:
                    cfg = IOConfig(backend=b if b in ("io_uring", "threads", "aiofiles") else "auto", block_size=args.block,
                                   queue_depth=args.qd, threads=args.threads)
                    if b == "fio":
                        if fio_cpu0 is None:
                            fio_cpu0 = fio_startup_cpu(cfg, directory)
                            print(f"  fio start-up CPU (subtracted): {fio_cpu0:.3f} s")
                        w, r, which = run_fio_best(cfg, directory, args.total, shard, fio_cpu0, fio_depths)
                        fio_best[shard] = which
                    elif b == "pythreads":
                        w, r = run_pythreads(cfg, directory, args.total, shard, args.py_chunk, verify=True)
                    else:
                        w, r = run_engine(b, cfg, directory, args.total, shard, verify=True)
                    print(f"  {fmt_size(shard):>6} {b:9s} write {w.gbps:6.2f} GB/s "
                          f"{w.cpu_per_gb:6.3f} CPU-s/GB | read {r.gbps:6.2f} GB/s "
                          f"{r.cpu_per_gb:6.3f} CPU-s/GB", flush=True)
                    if b in found:  # keep the best of the repeats, per figure
                        w0, r0 = found[b]
                        w = Result(max(w.gbps, w0.gbps), min(w.cpu_per_gb, w0.cpu_per_gb))
                        r = Result(max(r.gbps, r0.gbps), min(r.cpu_per_gb, r0.cpu_per_gb))
                    found[b] = (w, r)
            rows.append((shard, found))
    finally:
        shutil.rmtree(directory, ignore_errors=True)

    print()
    print_table(rows, "fio")
    print_table(rows, "aiofiles")
    if fio_best:
        print("\nfio = best of queue depths " + ",".join(map(str, fio_depths)) + ": "
              + "; ".join(f"{fmt_size(k)} {v}" for k, v in fio_best.items()))
    print("\nGB = 1e9 bytes; CPU/GB = process user+sys CPU seconds per GB moved (fio: its child"
          " processes, less their start-up CPU). Writes go to fresh files (no preallocation),"
          " reads are O_DIRECT." + (f" Best of {args.repeat} runs." if args.repeat > 1 else ""))
    print_targets(rows)
    return 0


# ------------------------------------------------------------ the store against fio, in rounds

#
# [Note: store vs fio rounds]
# This VM's disk swings by 2x within minutes (other tenants, the host's cache), far more than
# any difference between two ways of writing to it. So fio and the store run back to back in
# each round, on the same bytes, and only the ratio store/fio of one round is trusted; the
# verdict is the median of those ratios over the rounds. The order inside a round alternates
# (fio first in odd rounds, the store first in even ones), so a drive that slows down within a
# round favours neither. Both sides do the same work: `total // shard` files of `shard` bytes,
# `block`-sized requests with `qd` in flight, O_DIRECT, each file written front to back
# (fio's file_service_type=sequential), and every write after the first lands on files that
# already hold their blocks: training rewrites every shard each step and the store recycles
# the old version's file ([Note: NVMe file recycling]); fio overwrites its own files. With
# `--files fresh` both write new files every round instead (fio unlinks its files first, the
# store's recycling is switched off), which is what initialize and the first step cost. New
# files are fallocate'd first on both sides (fio's default, [Note: new swap files are
# preallocated]) unless `--prealloc off`.

STORE_DOC = __doc__.split("The `backends` form")[0]


def fio_unavailable() -> str | None:
    """Why fio cannot be the reference here, or None."""
    if shutil.which("fio") is None:
        return "fio not found on PATH; Debian/Ubuntu: apt-get install fio"
    return None


def fio_phase(cfg: IOConfig, directory: str, rw: str, total: int, shard: int,
              prealloc: bool = True) -> Result:
    """One fio job over the `total // shard` files in `directory` (created by the first write;
    `prealloc`: fallocate'd first, fio's default, as the store does)."""
    cmd = ["fio", "--name=ztstore", f"--directory={directory}", "--ioengine=io_uring", "--direct=1",
           f"--rw={rw}", f"--bs={cfg.block_size}", f"--iodepth={cfg.queue_depth}", f"--size={total}",
           f"--nrfiles={total // shard}", f"--filesize={shard}", "--file_service_type=sequential",
           f"--fallocate={'native' if prealloc else 'none'}", "--output-format=json"]
    settle()
    c0 = cpu_seconds(resource.RUSAGE_CHILDREN)
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    cpu = cpu_seconds(resource.RUSAGE_CHILDREN) - c0
    job = json.loads(out[out.index("{"):])["jobs"][0][rw]
    if job["io_bytes"] != total:
        raise RuntimeError(f"fio {rw} moved {job['io_bytes']} of {total} B: {' '.join(cmd)}")
    return Result(job["bw_bytes"] / 1e9, cpu / (total / 1e9))


def fio_unlink(directory: str) -> None:
    for name in os.listdir(directory):
        os.unlink(os.path.join(directory, name))


class StoreBench:
    """zerotier's NVMeStore driven as the optimizer drives it: shards written from and read into
    host pool blocks (`source="pool"`: zero copy; `"staged"`: unaligned tensors, so every write
    and read goes through the store's aligned staging copy), `inflight` shards in flight, each
    key rewritten every round (recycled files, unless `files="fresh"`)."""

    def __init__(self, cfg: IOConfig, directory: str, total: int, shard: int, inflight: int,
                 source: str = "pool", files: str = "recycled", prealloc: bool = True) -> None:
        from zerotier.config import TiersConfig
        from zerotier.tiers import HostPool, NVMeStore, nvme

        # [Note: new swap files are preallocated] in zerotier/tiers/nvme_files.py; off: new files grow as written
        self._restore = (nvme, "preallocate", getattr(nvme, "preallocate", None))
        if not prealloc:
            nvme.preallocate = lambda fd, nbytes: None

        self.total, self.shard, self.inflight = total, shard, inflight
        self.keys = [f"unit{i}.exp_avg" for i in range(total // shard)]
        self.pool = HostPool(inflight * round_up(shard, cfg.alignment), cfg.alignment, pin=False)
        self.blocks = [self.pool.alloc(shard, torch.uint8, "bench block") for _ in range(inflight)]
        gen = torch.Generator().manual_seed(0)
        for b in self.blocks:  # incompressible, distinct per block
            b.view().copy_(torch.randint(0, 256, (shard,), dtype=torch.uint8, generator=gen))
        self.sums = [int(b.view().sum(dtype=torch.int64)) for b in self.blocks]
        if source == "pool":
            self.buffers = self.blocks
        elif source == "staged":  # one byte off the alignment: the store stages every transfer
            self.buffers = [torch.empty(shard + 1, dtype=torch.uint8)[1:] for _ in range(inflight)]
            for buf, b in zip(self.buffers, self.blocks):
                buf.copy_(b.view())
        else:
            raise ValueError(f"source: 'pool' or 'staged', not {source!r}")
        budget = 3 * total  # the shards, their recycled previous versions, room to spare
        self.store = NVMeStore(TiersConfig(nvme=budget, nvme_path=directory), cfg, budget=budget)
        if files == "fresh":  # recycling off: a rewrite goes to a new file renamed over the old one
            self.store._recycle_name_for = lambda key: None
        elif files != "recycled":
            raise ValueError(f"files: 'recycled' or 'fresh', not {files!r}")
        self.backend = self.store.engine.backend

    def phase(self, op: str) -> Result:
        """Write every key (or read every key back); GB/s and process CPU-s/GB."""
        settle()
        pending: list = []
        t0, c0 = time.perf_counter(), cpu_seconds()
        for i, key in enumerate(self.keys):
            if len(pending) == self.inflight:
                _check(pending.pop(0).wait(), self.shard, op, key)
            buf = self.buffers[i % self.inflight]
            pending.append(self.store.write(key, buf) if op == "write" else self.store.read(key, buf))
        for t in pending:
            _check(t.wait(), self.shard, op, "")
        wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
        if op == "read":  # key i was written from and read into buffer i % inflight
            for buf, want in zip(self.buffers, self.sums):
                data = buf if isinstance(buf, torch.Tensor) else buf.view()
                if int(data.sum(dtype=torch.int64)) != want:
                    raise RuntimeError("store: read-back mismatch")
        return Result(self.total / 1e9 / wall, cpu / (self.total / 1e9))

    def close(self) -> None:
        self.store.close()
        self.pool.close()
        module, name, value = self._restore
        if value is not None:
            setattr(module, name, value)


def _check(got: int, want: int, op: str, key: str) -> None:
    if got != want:
        raise RuntimeError(f"store: short {op} of {key or 'a shard'}: {got} of {want} B")


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


TARGET = 0.9  # issue 27 item 6: the store at >= 0.9x fio, per direction, as a median


def print_rounds(rows: list[dict], fio_why: str | None) -> dict[str, float | None]:
    """The per-round table and its medians; returns the median ratio per direction (None without fio)."""
    print(f"\n{'round':>5} {'order':10s} {'load':>5} | {'fio wr':>7} {'store wr':>8} {'ratio':>6} "
          f"{'CPU/GB':>6} | {'fio rd':>7} {'store rd':>8} {'ratio':>6} {'CPU/GB':>6}")
    print("-" * 94)
    for row in rows:
        cells = []
        for op in ("write", "read"):
            f, s = row.get(f"fio_{op}"), row[f"store_{op}"]
            cells.append(f"{f:7.3f} {s:8.3f} {s / f:6.2f}" if f else f"{'n/a':>7} {s:8.3f} {'-':>6}")
            cells[-1] += f" {row[f'store_{op}_cpu']:6.2f}"
        print(f"{row['round']:>5} {row['order']:10s} {row['load']:5.1f} | {cells[0]} | {cells[1]}")
    print("-" * 94)
    out: dict[str, float | None] = {}
    cells = []
    for op in ("write", "read"):
        s = median([row[f"store_{op}"] for row in rows])
        ratios = [row[f"store_{op}"] / row[f"fio_{op}"] for row in rows if row.get(f"fio_{op}")]
        if ratios:
            f = median([row[f"fio_{op}"] for row in rows if row.get(f"fio_{op}")])
            out[op] = median(ratios)
            cells.append(f"{f:7.3f} {s:8.3f} {out[op]:6.2f}")
        else:
            out[op] = None
            cells.append(f"{'n/a':>7} {s:8.3f} {'-':>6}")
        cells[-1] += f" {median([row[f'store_{op}_cpu'] for row in rows]):6.2f}"
    loads = [row["load"] for row in rows]
    print(f"{'median':>5} {'':10s} {median(loads):5.1f} | {cells[0]} | {cells[1]}")
    print("(ratio = store / fio in the same round; its median is the median of the rounds' ratios, "
          "not the ratio of the medians; load = 1-minute load average at the round's start; "
          "CPU/GB = the store's process CPU-s per GB)")
    if fio_why:
        print(f"fio: n/a ({fio_why})")
    else:
        for op in ("write", "read"):
            r = [row[f"store_{op}"] / row[f"fio_{op}"] for row in rows]
            verdict = "PASS" if out[op] >= TARGET else "MISS"
            print(f"store/fio {op}: median {out[op]:.2f}x over {len(r)} rounds (range {min(r):.2f}-"
                  f"{max(r):.2f}), target >= {TARGET}x: {verdict}")
    return out


def store_parser() -> argparse.ArgumentParser:
    d = IOConfig()
    ap = argparse.ArgumentParser(prog="bench_io.py", description=STORE_DOC,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="directory on the drive to test (default: a temp dir)")
    ap.add_argument("--rounds", type=int, default=8, help="rounds of fio + store, order alternating")
    ap.add_argument("--total", type=parse_size, default=parse_size("1GiB"), help="bytes per phase")
    ap.add_argument("--shard", type=parse_size, default=parse_size("32MiB"), help="bytes per file")
    ap.add_argument("--inflight", type=int, default=None,
                    help="store: shards in flight (default: enough for 2 x qd blocks, at least 3)")
    ap.add_argument("--files", choices=("recycled", "fresh"), default="recycled",
                    help="rewrites land on recycled files (training's steady state) or new ones")
    ap.add_argument("--source", choices=("pool", "staged"), default="pool",
                    help="store: write from / read into host pool blocks, or unaligned tensors (staging copy)")
    ap.add_argument("--prealloc", choices=("on", "off"), default="on",
                    help="new files fallocate'd before their write (fio's default; off: they grow as written)")
    ap.add_argument("--checksum", choices=("none", "crc32c"), default=d.checksum, help="io.checksum")
    ap.add_argument("--block", type=parse_size, default=d.block_size, help="io.block_size (fio's bs too)")
    ap.add_argument("--qd", type=int, default=d.queue_depth, help="io.queue_depth (fio's iodepth too)")
    ap.add_argument("--backend", default=d.backend, help="io.backend")
    ap.add_argument("--threads", type=int, default=d.threads, help="io.threads")
    ap.add_argument("--no-fio", action="store_true", help="the store alone")
    ap.add_argument("--json", default=None, help="append each round as a JSON line to this file")
    ap.add_argument("--summary", nargs="+", default=None, metavar="JSONL",
                    help="no measuring: the table and medians of rounds appended by --json, per setting")
    return ap


def main_store(argv) -> int:
    args = store_parser().parse_args(argv)
    if args.summary:
        return summarize(args.summary)
    cfg = IOConfig(backend=args.backend, block_size=args.block, queue_depth=args.qd, threads=args.threads,
                   checksum=args.checksum)
    if args.shard % cfg.alignment or args.total % args.shard or args.total < args.shard:
        raise SystemExit(f"--shard must be a multiple of {cfg.alignment} B that divides --total")
    inflight = args.inflight or min(args.total // args.shard,
                                    max(3, -(-2 * cfg.queue_depth * cfg.block_size // args.shard)))
    fio_why = "--no-fio" if args.no_fio else fio_unavailable()
    prealloc = args.prealloc == "on"
    setting = (f"backend={args.backend} block={fmt_size(args.block)} qd={args.qd} checksum={args.checksum} "
               f"source={args.source} files={args.files} prealloc={args.prealloc} shard={fmt_size(args.shard)} inflight={inflight} "
               f"total={fmt_size(args.total)}")
    base = args.dir or tempfile.gettempdir()
    top = tempfile.mkdtemp(prefix="zt-bench-io-", dir=base)
    fio_dir, store_dir = os.path.join(top, "fio"), os.path.join(top, "store")
    os.mkdir(fio_dir)
    os.mkdir(store_dir)
    rows: list[dict] = []
    bench = None
    try:
        bench = StoreBench(cfg, store_dir, args.total, args.shard, inflight, args.source, args.files, prealloc)
        print(f"dir={top} {setting} engine={bench.backend} cpus={os.cpu_count()}")
        # Out of the verdict: the writes that make each side's files. The store's second write
        # goes to new files too (nothing is recycled before a key's first rewrite), as a
        # training run's initialize and first step do; from the third on, the files are reused.
        first = [f"store {bench.phase('write').gbps:.3f}"]
        if fio_why is None:
            first.insert(0, f"fio {fio_phase(cfg, fio_dir, 'write', args.total, args.shard, prealloc).gbps:.3f}")
        if args.files == "recycled":
            first.append(f"store's first rewrite {bench.phase('write').gbps:.3f}")
        print("writes of new files (GB/s): " + ", ".join(first) + (f"; fio: n/a ({fio_why})" if fio_why else ""))
        for r in range(args.rounds):
            order = ("fio", "store") if r % 2 == 0 else ("store", "fio")
            row: dict = {"round": r + 1, "order": ",".join(order), "load": os.getloadavg()[0]}
            for op in ("write", "read"):
                for who in order:
                    if who == "store":
                        res = bench.phase(op)
                        row[f"store_{op}"], row[f"store_{op}_cpu"] = res.gbps, res.cpu_per_gb
                    elif fio_why is None:
                        if op == "write" and args.files == "fresh":
                            fio_unlink(fio_dir)
                        row[f"fio_{op}"] = fio_phase(cfg, fio_dir, op, args.total, args.shard, prealloc).gbps
            rows.append(row)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps({"setting": setting, **row}) + "\n")
            print(f"  round {r + 1}/{args.rounds} ({row['order']}, load {row['load']:.1f}): write "
                  + _pair(row, "write") + ", read " + _pair(row, "read"), flush=True)
    finally:
        if bench is not None:
            bench.close()
        shutil.rmtree(top, ignore_errors=True)
    print_rounds(rows, fio_why)
    return 0


def _pair(row: dict, op: str) -> str:
    f, s = row.get(f"fio_{op}"), row[f"store_{op}"]
    return f"fio {f:.3f} store {s:.3f} GB/s ({s / f:.2f}x)" if f else f"store {s:.3f} GB/s"


def summarize(paths: list[str]) -> int:
    """The rounds appended by --json (several batches, several settings), table per setting."""
    by_setting: dict[str, list[dict]] = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                if line.strip():
                    row = json.loads(line)
                    by_setting.setdefault(row.pop("setting"), []).append(row)
    for setting, rows in by_setting.items():
        print(f"\n== {setting}: {len(rows)} rounds")
        for i, row in enumerate(rows):
            row["round"] = i + 1
        print_rounds(rows, None if all(r.get("fio_write") for r in rows) else "not in these rounds")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["backends"]:
        return main_backends(argv[1:])
    return main_store(argv)

if __name__ == "__main__":
    sys.exit(main())
