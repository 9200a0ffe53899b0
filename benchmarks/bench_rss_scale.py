"""Peak RSS against model size with everything off RAM: the slope must be < 0.1 B/parameter.

    python benchmarks/bench_rss_scale.py                      # 0.25B, 0.5B, 1B, 2B (~15 min, ~40 GB of disk)
    python benchmarks/bench_rss_scale.py --dim 256 --layers 2 4 8 16   # seconds (the CI version's sizes)
    python benchmarks/bench_rss_scale.py --child 2048 40 NVME_DIR     # one run, JSON (what the parent spawns)

Each size runs in a fresh process (so its peak RSS is its own): a GPT built on the meta device
(zerotier.models.TinyGPT: dim fixed, layers varied, so the largest unit and the staging it
needs stay the same), bf16 parameters, gradients (bf16) and optimizer state all on NVMe, one
unit per Linear/Embedding, host budget 4 GiB, 2 optimizer steps of a few tokens, malloc's
mmap threshold pinned (see soak.py: freed buffers go back to the OS). A sampler thread
records the peak RSS; the host pool's peak comes from the engine. The slope of peak
RSS over parameters (least squares) is what grows with the model; the intercept is the fixed
part: the Python/torch runtime, staging for the largest unit and the prefetch window.
Issue 12 asks for < 0.1 B/parameter.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from least_squares import fit  # benchmarks/ is on sys.path when this runs as a script

LIMIT = 0.1  # bytes of RSS per parameter


def child(dim: int, layers: int, nvme_dir: str, host: str) -> dict:
    import torch

    import zerotier
    from zerotier.measure import PeakRSS
    from zerotier.models import TinyGPT, batches, init_tiny_gpt

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from soak import pin_malloc

    pin_malloc()  # glibc's dynamic mmap threshold swings RSS by 100+ MiB run to run ([pinning malloc] in soak.py)
    with PeakRSS() as rss:
        with torch.device("meta"):
            model = TinyGPT(vocab=256, dim=dim, layers=layers, heads=max(1, dim // 128), seq=16, checkpointing=True)
        numel = sum(p.numel() for p in set(model.parameters()))
        cfg = {"tiers": {"host": host, "device": "2GiB", "nvme_path": nvme_dir},
               "offload": {"params": "nvme", "gradients": "nvme", "optimizer": "nvme"},
               "precision": {"param_dtype": "bf16", "grad_dtype": "bf16"}, "prefetch": {"lookahead": 1},
               "optimizer": {"lr": 1e-4}, "train": {"wrap": ["Linear", "Embedding"]}}
        t0 = time.perf_counter()
        engine = zerotier.initialize(model, cfg, init_fn=init_tiny_gpt)
        init_s = time.perf_counter() - t0
        steps = []
        for x, y in batches(256, 4, 1, 2):
            t = time.perf_counter()
            engine.backward(engine(x, y))
            engine.step()
            steps.append(time.perf_counter() - t)
        host_peak = engine.host_pool.stats()["peak"]
        nvme_moved = engine.store.stats()["bytes_in"] + engine.store.stats()["bytes_out"]
        engine.close(restore_weights=False)
    return {"dim": dim, "layers": layers, "numel": numel, "peak_rss": rss.peak, "host_pool_peak": host_peak,
            "init_s": init_s, "step_s": steps, "nvme_bytes_moved": nvme_moved}


def run(dim: int, layers: list[int], nvme_path: str | None, host: str) -> dict:
    rows = []
    for n in layers:
        with tempfile.TemporaryDirectory(prefix="zt-rss-", dir=nvme_path) as tmp:
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", str(dim), str(n), tmp,
                                  "--host", host], capture_output=True, text=True, check=False)
            if out.returncode != 0:
                raise RuntimeError(f"the run with {n} layers failed:\n{out.stderr[-4000:]}")
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    slope, intercept = fit([r["numel"] for r in rows], [r["peak_rss"] for r in rows])
    pool_slope, _ = fit([r["numel"] for r in rows], [r["host_pool_peak"] for r in rows])
    return {"rows": rows, "rss_slope_B_per_param": slope, "rss_intercept": intercept,
            "host_pool_slope_B_per_param": pool_slope, "pass": slope < LIMIT}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--layers", type=int, nargs="+", default=[5, 10, 20, 40],
                    help="layer counts (default: ~0.25B, 0.5B, 1B, 2B parameters at dim 2048)")
    ap.add_argument("--nvme-path", default=None, help="parent of the swap directories (default: $TMPDIR)")
    ap.add_argument("--host", default="4GiB", help="tiers.host of each run")
    ap.add_argument("--child", nargs=3, metavar=("DIM", "LAYERS", "NVME_DIR"), help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(int(args.child[0]), int(args.child[1]), args.child[2], args.host)))
        return 0
    r = run(args.dim, args.layers, args.nvme_path, args.host)
    print(json.dumps(r, indent=1) if args.json else report(r))
    return 0 if r["pass"] else 1


def report(r: dict) -> str:
    """`run`'s result as a table, a row per size, then the slopes and the verdict."""
    lines = [f"{'params':>10s} {'peak RSS':>10s} {'host pool':>10s} {'init':>7s} {'step':>8s}  NVMe moved/step"]
    lines += [f"{row['numel'] / 1e9:9.3f}B {row['peak_rss'] / 2**30:8.2f}Gi {row['host_pool_peak'] / 2**30:8.2f}Gi "
              f"{row['init_s']:6.1f}s {max(row['step_s']):7.1f}s  {row['nvme_bytes_moved'] / 2 / 1e9:.1f} GB"
              for row in r["rows"]]
    lines.append(f"peak RSS slope: {r['rss_slope_B_per_param']:.4f} B/parameter (limit {LIMIT}), fixed part "
                 f"{r['rss_intercept'] / 2**30:.2f} GiB; host pool slope {r['host_pool_slope_B_per_param']:.4f} "
                 "B/parameter")
    lines.append(f"verdict: {'PASS' if r['pass'] else 'FAIL'}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
