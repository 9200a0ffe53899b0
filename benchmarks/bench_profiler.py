"""Profiler overhead: step time with profiling on vs off (target: at most 2% more).

    python benchmarks/bench_profiler.py [--steps 12]

One engine trains a model with parameters on host and optimizer state on NVMe (every
kind of transfer is recorded); its profiler is switched on and off on alternate steps
(exactly what profile.enabled = false does: `engine.profiler is None`), so both arms
share the same state and the VM's drift hits them alike. Prints the median step times,
the overhead and the number of events recorded per step.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

import zerotier
from zerotier.models import TinyGPT, batches


def make_engine(nvme_dir: str):
    torch.manual_seed(0)
    model = TinyGPT(vocab=512, dim=384, layers=6, heads=8, seq=64)
    return zerotier.initialize(model, {
        "offload": {"params": "host", "gradients": "host", "optimizer": "nvme"},
        "tiers": {"nvme_path": nvme_dir}, "profile": {"enabled": True}})


def set_profiling(engine, profiler) -> None:
    engine.profiler = engine.unit_optimizer.profiler = engine.fetcher.profiler = profiler


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12, help="timed steps per engine (after 2 warm-up steps)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        engine = make_engine(d)
        profiler = engine.profiler
        times = {"off": [], "on": []}
        for i, (x, y) in enumerate(batches(512, 64, 4, 2 * args.steps + 2)):
            arm = "on" if i % 4 in (0, 3) else "off"  # on, off, off, on, ...: cancels linear drift
            set_profiling(engine, profiler if arm == "on" else None)
            t0 = time.perf_counter()
            engine.backward(engine(x, y))
            engine.step()
            if i >= 2:
                times[arm].append(time.perf_counter() - t0)
        set_profiling(engine, profiler)
        events = profiler.snapshot()
        n_events = sum(len(v) for v in events.values() if isinstance(v, list))
        engine.close()
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    print(f"step time: profiling off {off * 1e3:.1f} ms, on {on * 1e3:.1f} ms -> overhead "
          f"{(on / off - 1) * 100:+.2f}% (target <= +2%: {'PASS' if on <= 1.02 * off else 'MISS'}); "
          f"{n_events / len(times['on']):.0f} events recorded per profiled step")


if __name__ == "__main__":
    main()
