"""CPU Adam throughput: zerotier native vs torch fused/foreach AdamW, DeepSpeedCPUAdam, roofline.

Every figure in a run is measured in that run (this machine is noisy; compare
ratios, not absolutes across runs). Throughput is millions of parameters updated
per second, median of --repeats timed steps after one warm-up, the implementations
alternating within each round. The machine's load average is printed before and after:
on a shared 2-core VM another process's load slows whichever implementation it overlaps,
so a ratio measured at load > cores is only an indication.

    python benchmarks/bench_cpu_adam.py            # full: 100M, 500M, 200x1M, mixed 100M, state dtypes 50M
    python benchmarks/bench_cpu_adam.py --quick    # 10M flat, 20x1M, mixed 10M, state dtypes 10M
    python benchmarks/bench_cpu_adam.py --states-only --repeats 11   # the state-dtype table alone

State dtypes (issue 27): one row per master/moment dtype pair (fp32 grads, [Note: compact
optimizer state] and [Note: 8-bit moments] in zerotier/optim/kernel_math.py) against torch's
fused AdamW with fp32 state in the same rounds, each with the bytes it moves per parameter,
its GB/s and that as a share of the host's memory bandwidth (issue 36 item 5): a STREAM-style
copy (c = a: 8 B per element) and triad (a = b + s c: 12 B per element), timed in the same
rounds with the same threads over arrays of at least 32M fp32 elements (128 MiB each, beyond
the caches) -- at the memory bound a kernel's GB/s approaches the triad's.

Roofline: an in-place `mul_` over 28 B per parameter, timed in the same round-robin
as the kernels (the VM's memory bandwidth drifts): the bytes a one-pass kernel moves per
parameter, fp32 (read p,m,v,g; write p,m,v) or mixed (read bf16 g, p,m,v; write p,m,v, bf16 p).
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

import torch

import zerotier.optim as zo
from zerotier.optim import _kernels, kernel_math

HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def interleaved(fns: dict, repeats: int) -> dict:
    """Median seconds per callable, timed round-robin: memory bandwidth on a shared VM
    drifts by 1.5x over seconds, so every implementation is sampled under the same drift."""
    for fn in fns.values():
        fn()  # warm-up: page faults, optimizer state creation, thread start
    samples = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(v) * getattr(fns[name], "scale", 1.0) for name, v in samples.items()}


def case_fns(sizes, levels, threads, mixed: bool):
    """Callables for one case. All share one set of params/grads to fit 500M in RAM:
    each call is one step on the same data (values drift; timing does not care)."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(n, generator=gen) for n in sizes]
    grads = [torch.randn(n, generator=gen) for n in sizes]
    fns = {}
    step = [0]

    moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]  # shared by the SIMD levels

    def zerotier_fn(level, grads_in, outs):
        buffers = [(p, m, v, g, o) for p, g, (m, v), o in zip(params, grads_in, moments, outs)]

        def run():
            step[0] += 1
            zo.adam_step_multi(buffers, step=step[0], lr=HYPER["lr"], beta1=0.9, beta2=0.999, eps=1e-8,
                               weight_decay=0.01, simd=level, threads=threads)
        return run

    if mixed:
        grads_lp = [g.bfloat16() for g in grads]
        outs = [torch.empty(p.numel(), dtype=torch.bfloat16) for p in params]
        for level in levels:
            fns[f"zerotier {level} bf16->bf16"] = zerotier_fn(level, grads_lp, outs)
        # torch needs two conversions around its fused fp32 kernel
        for p, g in zip(params, grads):
            p.grad = g
        opt = torch.optim.AdamW(params, **HYPER, fused=True)

        def torch_mixed():
            for p, g_lp in zip(params, grads_lp):
                p.grad.copy_(g_lp)
            opt.step()
            for o, p in zip(outs, params):
                o.copy_(p)
        fns["torch fused+conversions"] = torch_mixed
    else:
        for level in levels:
            fns[f"zerotier {level}"] = zerotier_fn(level, grads, [None] * len(params))
        for p, g in zip(params, grads):
            p.grad = g
        fns["torch fused"] = torch.optim.AdamW(params, **HYPER, fused=True).step
        fns["torch foreach"] = torch.optim.AdamW(params, **HYPER, foreach=True).step
        ds = deepspeed_step(params)
        if ds is not None:
            fns["DeepSpeedCPUAdam"] = ds
    # The roofline, sampled in the same rounds: an in-place pass over a 1 GiB buffer (read +
    # write = 2 GiB moved), scaled to the 28 B/param a one-pass kernel moves.
    roof = torch.ones((1 << 30) // 4)
    scale = 28 * sum(sizes) / (2 * roof.numel() * 4)
    fns["roofline (in-place mul_)"] = _Scaled(lambda: roof.mul_(1.0), scale)
    return fns


class _Scaled:
    """A callable whose measured time is multiplied by `scale` (see interleaved())."""

    def __init__(self, fn, scale):
        self.fn, self.scale = fn, scale

    def __call__(self):
        self.fn()


STATE_PAIRS = [("fp32", "fp32"), ("bf16", "bf16"), ("fp32", "int8"), ("bf16", "int8")]


def state_fns(n: int, threads: int) -> dict:
    """One flat buffer of n parameters per state dtype pair, stepped by the best native kernel,
    and torch fused AdamW (fp32 state) on its own copy: the same gradient for all."""
    gen = torch.Generator().manual_seed(0)
    master = torch.randn(n, generator=gen)
    grad = torch.randn(n, generator=gen) * 1e-3
    fns = {}
    step = [0]
    for master_dtype, moment_dtype in STATE_PAIRS:
        buffers = [master.to(_kernels._DTYPE_NAMES[master_dtype])]
        for signed in (True, False):
            if moment_dtype == "int8":
                codes, absmax = kernel_math.quantize_blockwise(torch.zeros(n), signed)
                buffers += [codes, absmax]
            else:
                buffers += [torch.zeros(n, dtype=_kernels._DTYPE_NAMES[moment_dtype]), None]
        p, m, m_absmax, v, v_absmax = buffers

        def run(p=p, m=m, v=v, m_absmax=m_absmax, v_absmax=v_absmax):
            step[0] += 1
            zo.adam_step(p, m, v, grad, step=step[0], lr=HYPER["lr"], beta1=0.9, beta2=0.999, eps=1e-8,
                         weight_decay=0.01, exp_avg_absmax=m_absmax, exp_avg_sq_absmax=v_absmax,
                         sr_seed=step[0] << 32 if p.dtype == torch.bfloat16 else None, threads=threads)
        run.bytes_per_param = 4 + 2 * _kernels.state_bytes_per_param(master_dtype, moment_dtype)  # grad + state r/w
        fns[f"zerotier {master_dtype} master, {moment_dtype} moments"] = run
    param = master.clone().requires_grad_(True)
    param.grad = grad.clone()
    opt = torch.optim.AdamW([param], **HYPER, fused=True)

    def torch_step():
        opt.step()
    torch_step.bytes_per_param = 28
    fns["torch fused (fp32 state)"] = torch_step
    fns.update(stream_fns(max(n, STREAM_MIN_ELEMENTS), n))
    return fns


STREAM_MIN_ELEMENTS = 32 << 20


def stream_fns(elements: int, n: int) -> dict:
    """STREAM's copy and triad over `elements` fp32 elements with torch's threads (single-pass
    kernels), as callables whose bytes_per_param make report_states' GB/s the bytes they move
    (STREAM's count: reads + writes, no write-allocate) over the n parameters of the table."""
    a, b, c = (torch.full((elements,), v) for v in (1.0, 2.0, 0.5))

    def copy():
        c.copy_(a)

    def triad():
        torch.add(b, c, alpha=3.0, out=a)
    copy.bytes_per_param = 8 * elements / n
    triad.bytes_per_param = 12 * elements / n
    return {STREAM[0]: copy, STREAM[1]: triad}


STREAM = ("stream copy", "stream triad")


def report_states(rows: dict, n: int, bytes_per_param: dict, threads: int) -> dict:
    """Print the state-dtype table; return {label: GB/s} (the kernels' and the STREAM rows')."""
    print(f"\n== state dtypes ({n / 1e6:.0f}M params, fp32 grads, {threads} threads) ==")
    gbps = {label: bytes_per_param[label] * n / seconds / 1e9 for label, seconds in rows.items()}
    triad = gbps[STREAM[1]]
    base = rows["torch fused (fp32 state)"]
    print(f"  {'implementation':40s} {'Gparam/s':>9s} {'vs torch fused':>15s} {'B/param moved':>14s} {'GB/s':>6s} "
          f"{'of triad':>9s}")
    for label, seconds in rows.items():
        if label in STREAM:
            continue
        print(f"  {label:40s} {n / seconds / 1e9:9.3f} {base / seconds:14.2f}x {bytes_per_param[label]:14.2f} "
              f"{gbps[label]:6.1f} {100 * gbps[label] / triad:8.0f}%")
    print(f"  memory bandwidth, same rounds and threads (STREAM-style, {STREAM_MIN_ELEMENTS >> 20}M+ fp32 elements): "
          f"copy {gbps[STREAM[0]]:.1f} GB/s, triad {triad:.1f} GB/s")
    return gbps


def load() -> str:
    """The 1/5/15-minute load averages and the cores, as `uptime` shows them."""
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f} on {os.cpu_count()} cores"


def deepspeed_step(params):
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception:  # noqa: BLE001 - any import/JIT-build failure means "not available"
        return None
    return DeepSpeedCPUAdam(params, **HYPER, adamw_mode=True).step


def report(name, rows, n_total, baseline_key):
    print(f"\n== {name} ({n_total / 1e6:.0f}M params) ==")
    base = rows[baseline_key]
    roof = rows.pop("roofline (in-place mul_)")
    print(f"  {'implementation':34s} {'Mparams/s':>10s} {'vs ' + baseline_key:>26s} {'of roofline':>12s}")
    for label, seconds in rows.items():
        rate = n_total / seconds
        print(f"  {label:34s} {rate / 1e6:10.0f} {base / seconds:25.2f}x {roof / seconds:11.2f}")
    print(f"  {'roofline (28 B/param at in-place bandwidth)':34s} {n_total / roof / 1e6:10.0f}"
          f"   ({28 * n_total / roof / 1e9:.0f} GB/s)")


def free():
    gc.collect()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes for a smoke run (CI)")
    ap.add_argument("--repeats", type=int, default=5, help="timed steps per case; the median is reported")
    ap.add_argument("--threads", type=int, default=None, help="threads for zerotier and torch (default: all cores)")
    ap.add_argument("--states-only", action="store_true", help="only the state-dtype table")
    ap.add_argument("--state-size", type=int, default=None,
                    help="parameters of the state-dtype table (default 50M, 10M with --quick)")
    args = ap.parse_args(argv)

    threads = args.threads or zo._kernels.default_threads()
    torch.set_num_threads(threads)
    levels = zo.simd_levels_available()
    if not levels:
        raise SystemExit("native library unavailable (ZEROTIER_NATIVE=0 or not built): nothing to benchmark")
    scale = 10 if args.quick else 1
    flat_sizes = [10_000_000] if args.quick else [100_000_000, 500_000_000]
    print(f"threads={threads}  simd levels={levels}  torch {torch.__version__}  "
          f"median of {args.repeats} round-robin samples")
    print(f"before: {load()}")
    try:
        import deepspeed  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        print(f"note: DeepSpeedCPUAdam not compared ({type(exc).__name__}); to add it: pip install deepspeed")

    cases = [(f"fp32 flat {n // 1_000_000}M", [n], False) for n in flat_sizes]
    cases.append((f"fp32 {200 // scale} tensors x 1M", [1_000_000] * (200 // scale), False))
    cases.append((f"mixed precision {flat_sizes[0] // 1_000_000}M: bf16 grad in, bf16 param out, fp32 master/moments",
                  [flat_sizes[0]], True))
    for name, sizes, mixed in cases if not args.states_only else []:
        rows = interleaved(case_fns(sizes, levels, threads, mixed), args.repeats)
        report(name, rows, sum(sizes), "torch fused+conversions" if mixed else "torch fused")
        free()
    n = args.state_size or (10_000_000 if args.quick else 50_000_000)
    fns = state_fns(n, threads)
    report_states(interleaved(fns, args.repeats), n, {k: f.bytes_per_param for k, f in fns.items()}, threads)
    print(f"after: {load()}")


if __name__ == "__main__":
    main()
