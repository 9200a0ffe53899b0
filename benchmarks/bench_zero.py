"""ZeRO communication volume per step vs the paper's formulas, and stage-3 step time vs stage 2.

    python benchmarks/bench_zero.py            # 2 gloo ranks on this machine, ~3M-param GPT

Bytes are counted per rank as sent by a ring algorithm ((N-1)/N of the flat per
reduce-scatter or all-gather, 2(N-1)/N per all-reduce); the formulas (ZeRO paper,
section 7): stages 1-2 send 2Ψ(N-1)/N per step (reduce-scatter + all-gather),
stage 3 3Ψ(N-1)/N (all-gather in forward and again in backward, reduce-scatter),
Ψ = gradient bytes. The measurement uses gloo's native reduce-scatter; zerotier's
default on gloo is the all-reduce emulation (faster here, twice the bytes: docs/dist.md).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import zerotier
from zerotier.dist import spawn
from zerotier.dist import comm as comm_mod
from zerotier.models import TinyGPT, batches


def _native_reduce_scatter_comm(cls, zero_cfg, group=None):
    return cls(group, overlap=zero_cfg.overlap_comm, timeout_s=zero_cfg.timeout_s, reduce_scatter="native")


def run_rank(rank, world, dim, layers, steps, cases):
    # Count the paper's reduce-scatter bytes, not the all-reduce emulation's (see module doc).
    comm_mod.Comm.from_config = classmethod(_native_reduce_scatter_comm)
    out = {}
    for stage, prefetch in cases:
        torch.manual_seed(0)
        model = TinyGPT(vocab=512, dim=dim, layers=layers, heads=8, seq=64)
        cfg = {"zero": {"stage": stage, "persistence_threshold": 0}, "prefetch": {"enabled": prefetch}}
        with zerotier.initialize(model, cfg) as engine:
            numel = sum(u.part.padded_numel for u in engine.units)
            times, sent = [], []
            for i, (x, y) in enumerate(batches(512, 64, 4, steps + 1, seed=rank)):
                engine.sharding.comm.reset_stats()
                t0 = time.perf_counter()
                engine.backward(engine(x, y))
                engine.step()
                if i > 0:  # the first step records the prefetch trace
                    times.append(time.perf_counter() - t0)
                    sent.append(engine.sharding.comm.stats())
            out[(stage, prefetch)] = (statistics.median(times), sent[-1], 4 * numel)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per case (after one warm-up)")
    args = ap.parse_args(argv)
    world = 2
    cases = [(1, True), (2, True), (3, True), (3, False), (2, False)]
    result = spawn(run_rank, world, args.dim, args.layers, args.steps, cases, timeout_s=1200)[0]
    psi = result[(1, True)][2]
    factor = (world - 1) / world
    print(f"2 gloo ranks, Ψ = {psi / 1e6:.1f} MB of fp32 gradients (padded)\n")
    print(f"  {'stage':>5s} {'reduce-scatter':>15s} {'all-gather':>12s} {'all-reduce':>11s} {'total MB':>9s} "
          f"{'formula MB':>11s} {'ratio':>6s}")
    for stage in (1, 2, 3):
        _, sent, _ = result[(stage, True)]
        total = sent["reduce_scatter"] + sent["all_gather"] + sent["all_reduce"]
        formula = (3 if stage == 3 else 2) * psi * factor
        print(f"  {stage:5d} {sent['reduce_scatter'] / 1e6:15.2f} {sent['all_gather'] / 1e6:12.2f} "
              f"{sent['all_reduce'] / 1e6:11.3f} {total / 1e6:9.2f} {formula / 1e6:11.2f} {total / formula:6.2f}")
    s2, s3 = result[(2, True)][0], result[(3, True)][0]
    s2n, s3n = result[(2, False)][0], result[(3, False)][0]
    print(f"\n  step time: stage 2 {s2 * 1e3:.0f} ms, stage 3 {s3 * 1e3:.0f} ms with prefetch "
          f"({s3 / s2:.2f}x), {s3n * 1e3:.0f} ms without ({s3n / s2n:.2f}x of stage 2 without)")


if __name__ == "__main__":
    main()
