"""CPU Adam throughput: zerotier native vs torch fused/foreach AdamW, DeepSpeedCPUAdam, roofline.

Every figure in a run is measured in that run (this machine is noisy; compare
ratios, not absolutes across runs). Throughput is millions of parameters updated
per second, median of --repeats timed steps after one warm-up.

    python benchmarks/bench_cpu_adam.py            # full: 100M, 500M, 200x1M, mixed 100M
    python benchmarks/bench_cpu_adam.py --quick    # 10M flat, 20x1M, mixed 10M

Roofline: in-place memory bandwidth (`x.mul_(1.0)`, read+write) divided by the
bytes a one-pass kernel must move per parameter: 28 B for fp32 (read p,m,v,g;
write p,m,v) and 28 B for mixed precision (read bf16 g + p,m,v; write p,m,v + bf16 p).
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

import zerotier.optim as zo

HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def timed(fn, repeats: int) -> float:
    fn()  # warm-up: page faults, thread start
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def inplace_bandwidth(nbytes: int, repeats: int) -> float:
    x = torch.ones(nbytes // 4)
    seconds = timed(lambda: x.mul_(1.0), repeats)
    return 2 * nbytes / seconds  # read + write


def make_state(sizes, grad_dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(n, generator=gen) for n in sizes]
    grads = [torch.randn(n, generator=gen).to(grad_dtype) for n in sizes]
    return params, grads


def bench_torch(sizes, repeats, **flags):
    params, grads = make_state(sizes)
    for p, g in zip(params, grads):
        p.grad = g
    opt = torch.optim.AdamW(params, **HYPER, **flags)
    return timed(opt.step, repeats)


def bench_zerotier(sizes, repeats, simd, threads, grad_dtype=torch.float32, out_dtype=None):
    params, grads = make_state(sizes, grad_dtype)
    moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]
    outs = [torch.empty(p.numel(), dtype=out_dtype) if out_dtype else None for p in params]
    step = [0]

    def run():
        step[0] += 1
        for p, g, (m, v), o in zip(params, grads, moments, outs):
            zo.adam_step(p, m, v, g, step=step[0], lr=HYPER["lr"], beta1=0.9, beta2=0.999, eps=1e-8,
                         weight_decay=0.01, param_out=o, simd=simd, threads=threads)

    return timed(run, repeats)


def bench_torch_mixed(n, repeats):
    """What torch needs for bf16 grads in / bf16 params out: two conversions around fused AdamW."""
    params, grads = make_state([n], torch.bfloat16)
    master, grad_lp = params[0], grads[0]
    master.grad = torch.empty(n)
    param_lp = torch.empty(n, dtype=torch.bfloat16)
    opt = torch.optim.AdamW([master], **HYPER, fused=True)

    def run():
        master.grad.copy_(grad_lp)
        opt.step()
        param_lp.copy_(master)

    return timed(run, repeats)


def bench_deepspeed(sizes, repeats):
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as exc:  # noqa: BLE001 - any import/JIT-build failure means "not available"
        return None, f"DeepSpeedCPUAdam unavailable ({type(exc).__name__}: {str(exc)[:80]}); pip install deepspeed to compare"
    params, grads = make_state(sizes)
    for p, g in zip(params, grads):
        p.grad = g
    opt = DeepSpeedCPUAdam(params, **HYPER, adamw_mode=True)
    return timed(opt.step, repeats), ""


def report(name, rows, n_total, baseline_key, roof_params_s):
    print(f"\n== {name} ({n_total / 1e6:.0f}M params) ==")
    base = rows.get(baseline_key)
    print(f"  {'implementation':34s} {'Mparams/s':>10s} {'vs ' + baseline_key:>22s} {'of roofline':>12s}")
    for label, seconds in rows.items():
        if seconds is None:
            continue
        rate = n_total / seconds
        ratio = f"{base / seconds:.2f}x" if base else "-"
        print(f"  {label:34s} {rate / 1e6:10.0f} {ratio:>22s} {rate / roof_params_s:11.2f}")


def free():
    gc.collect()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes for a smoke run (CI)")
    ap.add_argument("--repeats", type=int, default=5, help="timed steps per case; the median is reported")
    ap.add_argument("--threads", type=int, default=None, help="threads for zerotier and torch (default: all cores)")
    args = ap.parse_args(argv)

    threads = args.threads or zo._kernels.default_threads()
    torch.set_num_threads(threads)
    levels = zo.simd_levels_available()
    if not levels:
        raise SystemExit("native library unavailable (ZEROTIER_NATIVE=0 or not built): nothing to benchmark")
    scale = 10 if args.quick else 1
    flat_sizes = [10_000_000] if args.quick else [100_000_000, 500_000_000]
    bw = inplace_bandwidth((256 << 20) // scale * 4, args.repeats)
    print(f"threads={threads}  simd levels={levels}  torch {torch.__version__}")
    print(f"in-place memory bandwidth: {bw / 1e9:.1f} GB/s  -> fp32 Adam roofline "
          f"{bw / 28 / 1e6:.0f} Mparams/s (28 B/param)")

    cases = [(f"fp32 flat {n // 1_000_000}M", [n]) for n in flat_sizes]
    cases.append((f"fp32 {200 // scale} tensors x 1M", [1_000_000] * (200 // scale)))
    for name, sizes in cases:
        rows = {}
        for level in levels:
            rows[f"zerotier {level}"] = bench_zerotier(sizes, args.repeats, level, threads)
            free()
        rows["torch fused"] = bench_torch(sizes, args.repeats, fused=True)
        free()
        rows["torch foreach"] = bench_torch(sizes, args.repeats, foreach=True)
        free()
        rows["DeepSpeedCPUAdam"], note = bench_deepspeed(sizes, args.repeats)
        free()
        report(name, rows, sum(sizes), "torch fused", bw / 28)
        if note:
            print("  note:", note)

    n = flat_sizes[0]
    rows = {}
    for level in levels:
        rows[f"zerotier {level} bf16->bf16"] = bench_zerotier([n], args.repeats, level, threads,
                                                              grad_dtype=torch.bfloat16, out_dtype=torch.bfloat16)
        free()
    rows["torch fused+conversions"] = bench_torch_mixed(n, args.repeats)
    free()
    report(f"mixed precision: bf16 grad in, bf16 param out, fp32 master/moments", rows, n,
           "torch fused+conversions", bw / 28)


if __name__ == "__main__":
    main()
