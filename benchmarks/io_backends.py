"""The `backends` form of bench_io.py (`python benchmarks/bench_io.py backends ...`): write-then-read
throughput of zerotier's I/O engine backends vs fio, in one run. For each shard size, `--total`
bytes are written as one file per shard (like one swap file per tensor shard) and read back, with
O_DIRECT (no page cache), by:

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
import resource
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from queue import SimpleQueue

import torch

from zerotier.config import IOConfig
from zerotier.io import aligned_empty, open_direct, open_engine, probe_io_uring

# benchmarks/ is on sys.path when this runs as a script
from io_measure import Result, cpu_seconds, fmt_size, parse_size, settle


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
