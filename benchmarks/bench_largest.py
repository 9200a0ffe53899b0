"""The largest model this node trains: a Llama-style model, everything off RAM, peak RSS bounded.

    python benchmarks/bench_largest.py                         # ~4.0B params, host 6 GiB, 3 steps (~65 GB of disk)
    python benchmarks/bench_largest.py --layers 4 --steps 1    # a quick look (~0.6B)

A transformers LlamaForCausalLM (hidden 3072, SwiGLU 8192, 24 heads / 8 KV heads, vocab 32000;
`--layers` sets the size) is built on the meta device and materialized unit by unit by its own
`_init_weights`; bf16 parameters, bf16 gradients and fp32 Adam state all live on NVMe, one
unit per Linear/Embedding, `tiers.host` caps the host pool. It trains `--steps` steps of a
few tokens. Printed: parameters, peak RSS (sampled every 20 ms) against the bound, the
host pool's peak, initialize time, and per step its time next to the NVMe bytes moved that
step divided by the drive's bandwidth (zerotier bench io, measured first in the same run):
what the step would take if it only moved bytes at the drive's rates.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

import torch

import zerotier
from zerotier.bench import PeakRSS, bench_io

GiB = 1 << 30


def llama(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=3072, intermediate_size=8192, num_hidden_layers=layers, num_attention_heads=24,
                      num_key_value_heads=8, vocab_size=32000, max_position_embeddings=256,
                      tie_word_embeddings=False, torch_dtype="float32")
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


def run(layers: int, steps: int, host: str, nvme_path: str | None, rss_bound: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="zt-largest-", dir=nvme_path) as tmp:
        roof = bench_io(tmp, 1 << 30)
        with PeakRSS() as rss:
            model = llama(layers)
            numel = sum(p.numel() for p in model.parameters())
            cfg = {"tiers": {"host": host, "device": "2GiB", "nvme_path": tmp, "nvme": "auto"},
                   "offload": {"params": "nvme", "gradients": "nvme", "optimizer": "nvme"},
                   "precision": {"param_dtype": "bf16", "grad_dtype": "bf16"}, "prefetch": {"lookahead": 1},
                   "optimizer": {"lr": 1e-5}, "train": {"wrap": ["Linear", "Embedding"]}}
            t0 = time.perf_counter()
            engine = zerotier.initialize(model, cfg, init_fn=model._init_weights)
            init_s = time.perf_counter() - t0
            print(f"initialized {numel / 1e9:.2f}B parameters in {init_s:.0f} s; plan:\n{engine.plan.summary()}",
                  file=sys.stderr, flush=True)
            gen = torch.Generator().manual_seed(0)
            rows = []
            for step in range(steps):
                ids = torch.randint(0, 32000, (1, 8), generator=gen)
                before = engine.store.stats()
                t = time.perf_counter()
                loss = engine(input_ids=ids, labels=ids).loss
                engine.backward(loss)
                engine.step()
                seconds = time.perf_counter() - t
                after = engine.store.stats()
                written, read = after["bytes_in"] - before["bytes_in"], after["bytes_out"] - before["bytes_out"]
                io_s = written / (roof["write_GBps"] * 1e9) + read / (roof["read_GBps"] * 1e9)
                rows.append({"step_s": seconds, "loss": float(loss.detach().float()), "nvme_written": written,
                             "nvme_read": read, "io_bound_s": io_s})
                print(f"step {step + 1}: {seconds:.0f} s, loss {rows[-1]['loss']:.3f}, NVMe {written / 1e9:.1f} GB "
                      f"written + {read / 1e9:.1f} GB read = {io_s:.0f} s at the drive's rates", file=sys.stderr,
                      flush=True)
            host_peak = engine.host_pool.stats()["peak"]
            nvme_peak = engine.store.stats()["peak"]
            engine.close(restore_weights=False)
    return {"params": numel, "layers": layers, "host": host, "peak_rss": rss.peak, "rss_bound": rss_bound,
            "host_pool_peak": host_peak, "nvme_peak": nvme_peak, "init_s": init_s, "steps": rows,
            "write_GBps": roof["write_GBps"], "read_GBps": roof["read_GBps"], "pass": rss.peak <= rss_bound}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=38, help="decoder layers (38: ~4.0B parameters)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--host", default="6GiB", help="tiers.host")
    ap.add_argument("--rss-bound", default="8GiB", help="the peak RSS this run must stay under")
    ap.add_argument("--nvme-path", default=None, help="directory on the NVMe drive (default: $TMPDIR)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    r = run(args.layers, args.steps, args.host, args.nvme_path, zerotier.config.parse_size(args.rss_bound))
    if args.json:
        print(json.dumps(r, indent=1))
    else:
        print(f"Llama-style {r['params'] / 1e9:.2f}B parameters ({r['layers']} layers), everything on NVMe, "
              f"tiers.host {r['host']}: peak RSS {r['peak_rss'] / GiB:.2f} GiB (bound {r['rss_bound'] / GiB:.2f}), "
              f"host pool peak {r['host_pool_peak'] / GiB:.2f} GiB, NVMe peak {r['nvme_peak'] / 1e9:.1f} GB, "
              f"initialize {r['init_s']:.0f} s; drive {r['write_GBps']:.2f} GB/s write, {r['read_GBps']:.2f} read")
        for i, s in enumerate(r["steps"], 1):
            print(f"  step {i}: {s['step_s']:6.0f} s   NVMe {(s['nvme_written'] + s['nvme_read']) / 1e9:6.1f} GB "
                  f"moved / drive bandwidth = {s['io_bound_s']:5.0f} s")
        print(f"verdict: {'PASS' if r['pass'] else 'FAIL'}")
    return 0 if r["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
