"""Step time of the offload engine vs plain PyTorch, on a GPT-style model (CPU run).

    python benchmarks/bench_engine.py                  # ~150M params, 3 timed steps per case
    python benchmarks/bench_engine.py --quick          # ~20M params, smoke run

Cases: plain torch + AdamW(fused=True) with everything in RAM; zerotier with the
optimizer on host; optimizer on NVMe; parameters and optimizer on NVMe. For each:
median step time, ratio to plain torch, and overlap efficiency = step time /
max(compute, NVMe I/O, optimizer), where compute is plain torch's forward+backward
time, NVMe I/O is this step's NVMe bytes / the NVMe bandwidth measured in this
run, and optimizer is the native Adam time for all parameters measured in this run.
Targets (issue #4): optimizer on host <= 1.05x plain torch; NVMe placements <= 1.15x
max(compute, NVMe I/O).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

import zerotier
from zerotier.models import TinyGPT, batches
from zerotier.optim import adam_step

VOCAB, SEQ = 1024, 64


def model_for(args):
    torch.manual_seed(0)
    return TinyGPT(vocab=VOCAB, dim=args.dim, layers=args.layers, heads=16, seq=SEQ)


def time_steps(step_fn, data, warmup=1):
    times = []
    for i, (x, y) in enumerate(data):
        t0 = time.perf_counter()
        step_fn(x, y)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def plain_torch(args, data):
    model = model_for(args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    fwd_bwd = []

    def step(x, y):
        t0 = time.perf_counter()
        model(x, y).backward()
        fwd_bwd.append(time.perf_counter() - t0)
        opt.step()
        opt.zero_grad()

    total = time_steps(step, data)
    return total, statistics.median(fwd_bwd[1:])


def zerotier_case(args, data, offload, nvme_dir):
    model = model_for(args)
    cfg = {"offload": offload, "tiers": {"nvme_path": nvme_dir}, "optimizer": {"lr": 1e-4}}
    with zerotier.initialize(model, cfg) as engine:
        io_bytes = []

        def step(x, y):
            before = engine.store.stats() if engine.store else {"bytes_in": 0, "bytes_out": 0}
            engine.backward(engine(x, y))
            engine.step()
            after = engine.store.stats() if engine.store else {"bytes_in": 0, "bytes_out": 0}
            io_bytes.append(after["bytes_in"] + after["bytes_out"] - before["bytes_in"] - before["bytes_out"])

        seconds = time_steps(step, data)
    return seconds, statistics.median(io_bytes[1:])


def nvme_bandwidth(nvme_dir, nbytes=512 << 20):
    """Rewrite then read nbytes through the store in 16 MiB shards (after one untimed first
    write: the engine rewrites existing swap files every step); GB/s both ways combined."""
    from zerotier.config import IOConfig, TiersConfig
    from zerotier.tiers.nvme import NVMeStore

    shard = torch.ones(16 << 20, dtype=torch.uint8)
    n = nbytes // shard.numel()
    with NVMeStore(TiersConfig(nvme_path=nvme_dir), IOConfig()) as store:
        for t in [store.write(f"s{i}", shard) for i in range(n)]:
            t.wait()
        t0 = time.perf_counter()
        for t in [store.write(f"s{i}", shard) for i in range(n)]:
            t.wait()
        for i in range(n):
            store.read(f"s{i}", shard).wait()
        return 2 * nbytes / (time.perf_counter() - t0)


def optimizer_seconds(numel):
    p, m, v, g = (torch.rand(numel) for _ in range(4))
    adam_step(p, m, v, g, step=1, lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    t0 = time.perf_counter()
    adam_step(p, m, v, g, step=2, lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    return time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="~20M parameters, for a smoke run")
    ap.add_argument("--dim", type=int, default=None, help="model width (default 1024; quick 384)")
    ap.add_argument("--layers", type=int, default=None, help="blocks (default 12; quick 8)")
    ap.add_argument("--batch", type=int, default=4, help="sequences per step")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per case (after one warm-up)")
    ap.add_argument("--nvme-path", default=None, help="directory for swap files (default: temp dir)")
    args = ap.parse_args(argv)
    args.dim = args.dim or (384 if args.quick else 1024)
    args.layers = args.layers or (8 if args.quick else 12)

    numel = sum(p.numel() for p in set(model_for(args).parameters()))
    data = list(batches(VOCAB, SEQ, args.batch, args.steps + 1))
    print(f"model: {numel / 1e6:.0f}M params, batch {args.batch}x{SEQ}, torch threads {torch.get_num_threads()}")
    with tempfile.TemporaryDirectory(prefix="zt-bench-", dir=args.nvme_path) as nvme_dir:
        nvme_bw = nvme_bandwidth(nvme_dir)
        opt_s = optimizer_seconds(numel)
        base, compute = plain_torch(args, data)
        print(f"measured: NVMe {nvme_bw / 1e9:.2f} GB/s (write+read), native Adam {opt_s * 1e3:.0f} ms, "
              f"plain torch fwd+bwd {compute:.2f} s, step {base:.2f} s")
        cases = {
            "optimizer on host": {"params": "device", "gradients": "host", "optimizer": "host"},
            "optimizer on NVMe": {"params": "device", "gradients": "host", "optimizer": "nvme"},
            "params+optimizer on NVMe": {"params": "nvme", "gradients": "host", "optimizer": "nvme"},
        }
        print(f"\n  {'case':26s} {'step s':>8s} {'vs torch':>9s} {'NVMe GB':>8s} {'I/O s':>7s} "
              f"{'bound s':>8s} {'step/bound':>11s} target")
        print(f"  {'plain torch fused AdamW':26s} {base:8.2f} {1.0:8.2f}x")
        for name, offload in cases.items():
            seconds, io = zerotier_case(args, data, offload, nvme_dir)
            io_s = io / nvme_bw
            bound = max(compute, io_s, opt_s)
            if "host" in name:
                target, ok = "<= 1.05x torch", seconds <= 1.05 * base
            else:
                target, ok = "<= 1.15x bound", seconds <= 1.15 * max(compute, io_s)
            print(f"  {name:26s} {seconds:8.2f} {seconds / base:8.2f}x {io / 1e9:8.2f} {io_s:7.2f} "
                  f"{bound:8.2f} {seconds / bound:10.2f}x {target}: {'PASS' if ok else 'MISS'}")


if __name__ == "__main__":
    main()
