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

The `backends` form (io_backends.py): write-then-read throughput of zerotier's I/O engine
backends and fio, in one run.

    python benchmarks/bench_io.py backends --total 1GiB --dir /mnt/nvme/tmp
    python benchmarks/bench_io.py backends --quick
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import torch

from zerotier.config import IOConfig
from zerotier.io import round_up

from io_backends import main_backends  # benchmarks/ is on sys.path when this runs as a script
from io_measure import Result, cpu_seconds, fmt_size, parse_size, settle


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
