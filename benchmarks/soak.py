"""Soak test: train for many steps and check that nothing grows per step.

    python benchmarks/soak.py --steps 500            # ~45 s on 2 CPU cores
    python benchmarks/soak.py --steps 500 --json     # machine-readable result
    python benchmarks/soak.py --steps 1000 --all     # everything on (issue 16): see below

Trains zerotier.models.TinyGPT (dim 128, 4 layers, seq 64, batch 8: ~0.9M
parameters, one step ~50-100 ms on two CPU cores) with the optimizer state on
the NVMe tier and the parameters on the host tier, and every `--every` steps
samples the metrics below. `--all` turns everything on at once: parameters on NVMe
too, gradient accumulation (2 micro-batches), clipping, the profiler (its record
buffers capped by profile.max_events, so they fill during the warm-up and the soak
sees leaks, not the trace window), and a checkpoint every 100 steps keeping the last
2, then a final resume from the last checkpoint that must be bitwise equal to
continuing (5 more steps both ways). Metrics:

    rss_bytes        process resident set size (psutil)
    heap_in_use      bytes glibc malloc has handed out (mallinfo2: uordblks + hblkhd)
    open_fds         entries of /proc/self/fd
    swap_dir_bytes   sum of the file sizes under the engine's NVMe run directory
    swap_dir_files   number of files there
    device_used      DeviceTier.used   (bytes the engine holds on the compute device)
    host_used        host tier `used`  (bytes reserved on the host tier)
    nvme_used        NVMeStore.used    (logical bytes of the NVMe shards)
    ckpt_dir_bytes   bytes under the checkpoint root (with --checkpoint-every)

After a warm-up (the first 10% of the steps, and at least 20: first-touch of
buffers, the prefetch trace, NVMe file recycling and allocator arenas settle
there) it fits a least-squares line to each metric against the step number and
judges the slope:

    rss_bytes, heap_in_use   < 4 KiB/step
    swap_dir_bytes, nvme_used  never above the plan's NVMe need (engine.plan.need["nvme"])
    ckpt_dir_bytes   never above keep x (the first checkpoint's size + 1%): retention works
    everything else          == 0 exactly (every sample after the warm-up is equal)

Why the NVMe metrics are bounded, not flat: a rewrite of a shard goes to a second file
until it commits, and the old version is kept for the next rewrite of that size
(NVMeStore), so the swap directory grows to the most rewrites that were ever in flight
at once. That number depends on the drive's and the CPU's timing, and can first be
reached late in a run on a busy machine; the planner counts its ceiling (the optimizer's
staging sets, the parameter write-backs: `_nvme_rewrites` in planner/sizes.py). A leak passes
that ceiling; timing does not.

Why 4 KiB/step. The leak to catch is "one small tensor kept per step":
a 1024-element fp32 tensor is 4 KiB of storage plus ~0.3-0.5 KiB of TensorImpl,
Python object and malloc header, so heap_in_use (which counts bytes) grows by
more than 4 KiB/step and fails; RSS counts whole pages and reads such a leak
within ~15% of its size (an 8.6 KiB/step leak measured 7.3-9.3 KiB/step), so it
catches anything from ~5 KiB/step up in a fresh process. In a process whose
heap already has free holes (e.g. late in a pytest session) a leak fills those
first and RSS under-reads it (measured: 3.1 KiB/step for an 8.6 KiB/step leak);
heap_in_use does not, which is why the verdict needs both. The `tests/test_soak.py` leak test keeps
a 2048-element tensor (8 KiB + overhead) so that both fail by a wide margin.
What passes is allocator noise, which after the warm-up is not a slope but a
slow settling of heap fragmentation: RSS creeps by ~1 KiB/step for the first
~100 steps and is flat after. Measured here (500 steps, 2 cores): RSS slope
177 B/step, heap_in_use 26 B/step, i.e. >20x below the threshold; the 80-step
CI run (smaller model) stays under ~2.5 KiB/step.

[pinning malloc] glibc's *dynamic* mmap threshold makes RSS useless for this
without help: after a large (e.g. 1 MiB) buffer is freed, the threshold rises
to its size and later buffers of that size come from the heap, whose top is
trimmed only past a threshold that also moves, so RSS swings by several MiB
from one sample to the next (measured: +-3 MiB, i.e. a +-40 KiB/step fitted
slope over 80 steps). `pin_malloc()` fixes the mmap threshold at 64 KiB (and
the trim threshold at 256 KiB): buffers above it are mmapped and unmapped on
free, exactly, and a small leaked tensor still lands on the heap and shows.
The cost is ~30% slower steps (page faults on every big buffer); the setting
is process-wide and stays after run_soak returns (harmless for other tests). heap_in_use does not depend on any of this: it counts bytes in
use, not pages, and is the sharper of the two where glibc >= 2.33 has mallinfo2
(elsewhere it reads 0 and passes trivially). Python garbage is collected
(`gc.collect()`) before each sample, so only what is really still referenced
counts. File descriptors, the swap directory and the tiers' `used` counters
have no noise at all: the engine opens and frees the same things every step,
so any growth is a leak and the threshold is exactly zero.

`on_step(step, engine)` (from `run_soak`) runs after each optimizer step; the
tests use it to inject a deliberate leak and check that the verdict fails.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import sys
import tempfile
import time
from typing import Callable

import psutil
import torch

import zerotier
from zerotier.models import TinyGPT, batches

from least_squares import fit  # benchmarks/ is on sys.path when this runs as a script

KiB = 1024
RSS_SLOPE_LIMIT = 4 * KiB          # bytes per step; see the module docstring
SLOPE_METRICS = ("rss_bytes", "heap_in_use")   # judged against RSS_SLOPE_LIMIT
BOUNDED_METRICS = ("swap_dir_bytes", "nvme_used")  # judged against the plan's NVMe need
EXACT_METRICS = ("open_fds", "device_used", "host_used")
METRICS = SLOPE_METRICS + BOUNDED_METRICS + EXACT_METRICS + ("swap_dir_files", "ckpt_dir_bytes")
MMAP_THRESHOLD = 64 * KiB          # see [pinning malloc] in the module docstring


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]


def _libc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        return libc
    except (OSError, AttributeError):  # not glibc, or glibc < 2.33
        return None


_LIBC = _libc()


def pin_malloc() -> bool:
    """Fix glibc's mmap threshold (disables its dynamic adjustment); False where not glibc."""
    if _LIBC is None:
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)  # kept by HostPool ([Note: heap bound])
    return bool(_LIBC.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and \
        bool(_LIBC.mallopt(M_TRIM_THRESHOLD, 4 * MMAP_THRESHOLD))


def heap_in_use() -> int:
    """Bytes malloc has handed out and not had back (heap chunks + mmapped chunks); 0 if unknown."""
    if _LIBC is None:
        return 0
    info = _LIBC.mallinfo2()
    return info.uordblks + info.hblkhd

MODEL = dict(vocab=256, dim=128, layers=4, heads=4, seq=64)
BATCH = 8


def swap_dir_usage(path) -> tuple[int, int]:
    """(total bytes, file count) of the regular files under `path`, recursively."""
    total = files = 0
    for root, _dirs, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
                files += 1
            except FileNotFoundError:  # removed while we looked
                pass
    return total, files


def sample(engine, proc: psutil.Process) -> dict[str, int]:
    engine.synchronize()  # write-backs still in flight hold a file descriptor each: not a leak
    gc.collect()
    swap_bytes, swap_files = swap_dir_usage(engine.store.run_dir)
    return {
        "rss_bytes": proc.memory_info().rss,
        "heap_in_use": heap_in_use(),
        "open_fds": len(os.listdir("/proc/self/fd")),
        "swap_dir_bytes": swap_bytes,
        "swap_dir_files": swap_files,
        "device_used": engine.device_tier.used,
        "host_used": engine.host_pool.used,
        "nvme_used": engine.store.used,
    }


def judge(samples: list[dict], warmup_steps: int, rss_limit: float = RSS_SLOPE_LIMIT,
          nvme_bound: int | None = None, ckpt_bound: int | None = None) -> dict:
    """Slopes per metric over the samples after `warmup_steps`, and the verdict for each."""
    kept = [s for s in samples if s["step"] >= warmup_steps]
    steps = [s["step"] for s in kept]
    result = {}
    for name in METRICS:
        values = [s[name] for s in kept]
        fitted, _ = fit(steps, values)
        if name in SLOPE_METRICS:
            ok, limit = fitted < rss_limit, f"< {rss_limit:.0f} B/step"
        elif name in BOUNDED_METRICS and nvme_bound is not None:
            ok, limit = max(values, default=0) <= nvme_bound, f"<= {nvme_bound:,} B"
        elif name == "ckpt_dir_bytes" and ckpt_bound is not None:
            ok, limit = max(values, default=0) <= ckpt_bound, f"<= {ckpt_bound:,} B"
        elif name in EXACT_METRICS:
            ok, limit = len(set(values)) <= 1, "flat (== 0)"
        else:  # swap_dir_files, or a bounded metric without its bound
            ok, limit = True, "(reported)"
        result[name] = {"slope_per_step": fitted, "first": values[0] if values else None,
                        "last": values[-1] if values else None, "limit": limit, "pass": bool(ok)}
    return result


def run_soak(steps: int = 500, every: int | None = None, warmup: int | None = None,
             nvme_path: str | None = None, model: dict | None = None, batch: int = BATCH,
             on_step: Callable[[int, "zerotier.engine.engine.Engine"], None] | None = None,
             rss_limit: float = RSS_SLOPE_LIMIT, seed: int = 0, *, params: str = "host", accum: int = 1,
             clip: float | None = None, profile: bool = False, checkpoint_every: int = 0,
             keep: int = 2) -> dict:
    """Train `steps` optimizer steps, sampling every `every` steps; returns samples, slopes and the
    verdict. With checkpoint_every, a checkpoint every that many steps (keeping `keep`), and at the
    end a resume from the last one compared bitwise with continuing (5 more steps)."""
    every = every or max(1, steps // 100)
    warmup = max(20, steps // 10) if warmup is None else warmup
    model_kw = dict(MODEL, **(model or {}))
    pinned = pin_malloc()
    torch.manual_seed(seed)
    net = TinyGPT(**model_kw)
    n_params = sum(p.numel() for p in set(net.parameters()))
    extra = 5 if checkpoint_every else 0
    data = list(batches(model_kw["vocab"], model_kw["seq"], batch, (steps + extra) * accum, seed=seed))
    windows = [data[i * accum:(i + 1) * accum] for i in range(steps + extra)]

    def train(engine, window):
        for x, y in window:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
        return loss

    with tempfile.TemporaryDirectory(prefix="zt-soak-", dir=nvme_path) as tmp:
        swap, ckpt = os.path.join(tmp, "swap"), os.path.join(tmp, "ckpt")
        os.mkdir(swap)
        cfg = {"offload": {"params": params, "gradients": "host", "optimizer": "nvme"},
               "tiers": {"nvme_path": swap}, "optimizer": {"lr": 1e-3},
               "train": {"grad_accum_steps": accum, "max_grad_norm": clip},
               "profile": {"enabled": profile, "max_events": 2000}}
        proc = psutil.Process()
        samples, times = [], []
        ckpt_bound = resumed_equal = None
        with zerotier.initialize(net, cfg) as engine:
            for step in range(1, steps + 1):
                t0 = time.perf_counter()
                loss = train(engine, windows[step - 1])
                times.append(time.perf_counter() - t0)
                if checkpoint_every and step % checkpoint_every == 0:
                    engine.save_checkpoint(ckpt, keep=keep)
                    if ckpt_bound is None:
                        ckpt_bound = int(keep * swap_dir_usage(ckpt)[0] * 1.01)
                if on_step is not None:
                    on_step(step, engine)
                if step % every == 0 or step == steps:
                    row = {"step": step, "loss": float(loss.detach()), **sample(engine, proc),
                           "ckpt_dir_bytes": swap_dir_usage(ckpt)[0] if checkpoint_every else 0}
                    samples.append(row)
            placement = {k: v.value for k, v in engine.plan.placement.items()}
            nvme_bound = engine.plan.need["nvme"]
            if checkpoint_every:
                for window in windows[steps:]:
                    train(engine, window)
                continued = engine.parameters_fp32()
        if checkpoint_every:
            torch.manual_seed(seed)
            with zerotier.initialize(TinyGPT(**model_kw), cfg) as engine:
                engine.load_checkpoint(ckpt)
                last = engine.global_steps
                for window in windows[last:]:
                    train(engine, window)
                resumed = engine.parameters_fp32()
            resumed_equal = all(torch.equal(resumed[k], continued[k]) for k in continued)
    verdict = judge(samples, warmup, rss_limit, nvme_bound, ckpt_bound)
    times.sort()
    ok = all(m["pass"] for m in verdict.values()) and resumed_equal is not False
    return {
        "steps": steps, "every": every, "warmup_steps": warmup, "model": model_kw, "batch": batch,
        "params": n_params, "placement": placement, "malloc_pinned": pinned, "accum": accum, "clip": clip,
        "profile": profile, "checkpoint_every": checkpoint_every, "keep": keep,
        "resume_bitwise": resumed_equal,
        "step_ms_median": 1e3 * times[len(times) // 2] if times else None,
        "metrics": verdict, "pass": ok, "samples": samples,
    }


def format_report(result: dict) -> str:
    lines = [f"soak: {result['steps']} steps of TinyGPT ({result['params']:,} params, placement "
             f"{result['placement']}, accumulation {result['accum']}, clip {result['clip']}, profiler "
             f"{'on' if result['profile'] else 'off'}, checkpoint every {result['checkpoint_every'] or '-'} "
             f"keeping {result['keep']}), median step {result['step_ms_median']:.1f} ms, sampled every "
             f"{result['every']} steps, warm-up {result['warmup_steps']} steps",
             f"  {'metric':15s} {'slope/step':>14s} {'first':>14s} {'last':>14s}  limit            verdict"]
    for name, m in result["metrics"].items():
        lines.append(f"  {name:15s} {m['slope_per_step']:14.2f} {m['first']:14,d} {m['last']:14,d}  "
                     f"{m['limit']:16s} {'PASS' if m['pass'] else 'FAIL'}")
    if result["resume_bitwise"] is not None:
        lines.append(f"  resume from the last checkpoint, 5 more steps: "
                     f"{'bitwise equal to continuing' if result['resume_bitwise'] else 'DIFFERS from continuing'}")
    lines.append(f"verdict: {'PASS' if result['pass'] else 'FAIL'}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--every", type=int, default=None, help="sample every N steps (default steps/100)")
    ap.add_argument("--warmup", type=int, default=None, help="steps left out of the fit (default 10%%)")
    ap.add_argument("--nvme-path", default=None, help="parent directory of the swap dir (default: $TMPDIR)")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    ap.add_argument("--all", action="store_true", help="everything on: params on NVMe, accumulation 2, clipping, "
                                                       "profiler, a checkpoint every 100 steps keeping 2, final resume")
    args = ap.parse_args(argv)
    opts = dict(params="nvme", accum=2, clip=1.0, profile=True, checkpoint_every=100, keep=2) if args.all else {}
    result = run_soak(args.steps, args.every, args.warmup, args.nvme_path, **opts)
    print(json.dumps(result, indent=1) if args.json else format_report(result))
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
