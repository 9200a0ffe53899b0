"""The largest model this node trains: a Llama-style model, everything off RAM, peak RSS bounded.

    python benchmarks/bench_largest.py                                # ~4.0B params, fp32 state, 3 steps
    python benchmarks/bench_largest.py --state int8 --layers max      # the most layers the drive holds
    python benchmarks/bench_largest.py --state int8 --layers 4 --steps 1   # a quick look (~0.6B)

A transformers LlamaForCausalLM (hidden 3072, SwiGLU 8192, 24 heads / 8 KV heads, vocab 32000;
`--layers` sets the size: ~100.7M parameters per layer + 197M of embeddings) is built on the
meta device and materialized unit by unit by its own `_init_weights`; bf16 parameters, bf16
gradients and the optimizer state (`--state`: precision.master_dtype / moment_dtype) all live on
NVMe, one unit per Linear/Embedding, `tiers.host` caps the host pool.

Before anything is written the planner sizes the run (zerotier.plan, the engine's own
accounting): tiers.nvme is the drive's free space less `--disk-margin`, and a model whose plan
does not fit it is refused with the planner's shortfall and the most layers that fit
(`--layers max` picks those). It then trains `--steps` steps of a few tokens. Printed:
parameters, peak RSS (sampled every 20 ms) against the bound, the host pool's and the drive's
peaks against the plan, initialize time, and per step its time next to the NVMe bytes moved
that step divided by the drive's bandwidth (zerotier bench io, measured first in the same run):
what the step would take if it only moved bytes at the drive's rates.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time

import torch

import zerotier
import zerotier.units
from zerotier.measure import PeakRSS, bench_io
from zerotier.optim.state_layout import StateLayout
from zerotier.planner.messages import PlanDoesNotFit

GiB = 1 << 30
# --state -> (precision.master_dtype, precision.moment_dtype); optimizer state 12, 6, ~4.03 B/param
STATES = {"fp32": ("fp32", "fp32"), "bf16": ("bf16", "bf16"), "int8": ("bf16", "int8")}


def llama(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=3072, intermediate_size=8192, num_hidden_layers=layers, num_attention_heads=24,
                      num_key_value_heads=8, vocab_size=32000, max_position_embeddings=256,
                      tie_word_embeddings=False, torch_dtype="float32")
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


def numel(model) -> int:
    return sum(p.numel() for p in model.parameters())


def engine_config(state: str, host: str, nvme_path: str, nvme_budget: int) -> dict:
    master, moments = STATES[state]
    return {"tiers": {"host": host, "device": "2GiB", "nvme_path": nvme_path, "nvme": nvme_budget},
            "offload": {"params": "nvme", "gradients": "nvme", "optimizer": "nvme"},
            "precision": {"param_dtype": "bf16", "grad_dtype": "bf16", "master_dtype": master,
                          "moment_dtype": moments},
            "prefetch": {"lookahead": 1}, "optimizer": {"lr": 1e-5}, "train": {"wrap": ["Linear", "Embedding"]}}


def plan_for(layers: int, cfg: dict):
    """(model, plan) for `layers`, or (model, PlanDoesNotFit) when the budgets do not hold it."""
    model = llama(layers)
    try:
        return model, zerotier.plan(model, cfg, rates={})  # placement and bytes only: no bench run
    except PlanDoesNotFit as exc:
        return model, exc


def most_layers(cfg: dict, bytes_per_param: float) -> int:
    """The most layers whose plan fits `cfg`'s budgets (0 if none): from an estimate by bytes per
    parameter, down one layer at a time (a plan per try, no bytes written)."""
    fixed, per_layer = numel(llama(0)), numel(llama(1)) - numel(llama(0))
    layers = max(int((cfg["tiers"]["nvme"] / bytes_per_param - fixed) // per_layer) + 1, 0)
    while layers > 0 and isinstance(plan_for(layers, cfg)[1], PlanDoesNotFit):
        layers -= 1
    return layers


def run(model, cfg: dict, plan, steps: int, rss_bound: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="zt-largest-", dir=cfg["tiers"]["nvme_path"]) as tmp:
        cfg = {**cfg, "tiers": {**cfg["tiers"], "nvme_path": tmp}}
        roof = bench_io(tmp, 1 << 30)
        print(f"drive (zerotier bench io, 1 GiB): {roof['write_GBps']:.2f} GB/s write, {roof['read_GBps']:.2f} GB/s "
              "read", file=sys.stderr, flush=True)  # printed now: a run stopped early keeps it
        params = numel(model)  # before close(restore_weights=False) leaves the model empty
        with PeakRSS() as rss:
            t0 = time.perf_counter()
            engine = zerotier.initialize(model, cfg, init_fn=model._init_weights)
            init_s = time.perf_counter() - t0
            print(f"initialized {params / 1e9:.2f}B parameters in {init_s:.0f} s (peak RSS {rss.peak / GiB:.2f} GiB); "
                  f"plan:\n"
                  f"{engine.plan.summary()}", file=sys.stderr, flush=True)
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
                      f"written + {read / 1e9:.1f} GB read = {io_s:.0f} s at the drive's rates; peak RSS so far "
                      f"{rss.peak / GiB:.2f} GiB", file=sys.stderr,
                      flush=True)
            host_peak = engine.host_pool.stats()["peak"]
            nvme_peak = engine.store.stats()["peak"]
            engine.close(restore_weights=False)
    return {"params": params, "layers": model.config.num_hidden_layers, "host": cfg["tiers"]["host"],
            "master_dtype": cfg["precision"]["master_dtype"], "moment_dtype": cfg["precision"]["moment_dtype"],
            "peak_rss": rss.peak, "rss_bound": rss_bound, "host_pool_peak": host_peak, "nvme_peak": nvme_peak,
            "nvme_planned": plan.need["nvme"], "nvme_budget": plan.budgets["nvme"], "init_s": init_s,
            "steps": rows, "write_GBps": roof["write_GBps"], "read_GBps": roof["read_GBps"],
            "pass": rss.peak <= rss_bound}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="38",
                    help="decoder layers (38: ~4.0B parameters; 78: ~8.05B), or 'max': the most the drive holds")
    ap.add_argument("--state", choices=STATES, default="fp32",
                    help="optimizer state: fp32 (fp32 master and moments, 12 B/param), bf16 (bf16 / bf16, "
                         "6 B/param), int8 (bf16 master + int8 moments, ~4.03 B/param)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--host", default="6GiB", help="tiers.host")
    ap.add_argument("--rss-bound", default="8GiB", help="the peak RSS this run must stay under")
    ap.add_argument("--nvme-path", default=None, help="directory on the NVMe drive (default: $TMPDIR)")
    ap.add_argument("--disk-margin", default="6GiB",
                    help="free space the run leaves on the drive: tiers.nvme is the free space less this")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    nvme_path = args.nvme_path or tempfile.gettempdir()
    free = shutil.disk_usage(nvme_path).free
    margin = zerotier.units.parse_size(args.disk_margin)
    cfg = engine_config(args.state, args.host, nvme_path, free - margin)
    if free <= margin:
        print(f"refused before starting: {nvme_path} has {free / GiB:.1f} GiB free, not more than --disk-margin "
              f"{margin / GiB:.1f} GiB", file=sys.stderr)
        return 2
    layers = args.layers
    if layers == "max":
        layers = most_layers(cfg, 4 + StateLayout(*STATES[args.state]).bytes_per_param)
        if layers == 0:
            print(f"refused before starting: not even one layer fits tiers.nvme {free / GiB:.1f} GiB free less "
                  f"{margin / GiB:.1f} GiB margin on {nvme_path}", file=sys.stderr)
            return 2
    model, plan = plan_for(int(layers), cfg)
    if isinstance(plan, PlanDoesNotFit):
        most = most_layers(cfg, plan.per_rank_bytes / numel(model))
        print(f"refused before starting: {numel(model) / 1e9:.2f}B parameters ({layers} layers) with --state "
              f"{args.state} do not fit {nvme_path} ({free / GiB:.1f} GiB free, {margin / GiB:.1f} GiB kept free): "
              f"{plan}. The most that fits: --layers {most} ({numel(llama(most)) / 1e9:.2f}B parameters)",
              file=sys.stderr)
        return 2
    print(f"planned {numel(model) / 1e9:.2f}B parameters ({layers} layers), --state {args.state}: NVMe "
          f"{plan.need['nvme'] / GiB:.2f} GiB of tiers.nvme {plan.budgets['nvme'] / GiB:.2f} GiB "
          f"({free / GiB:.1f} GiB free on {nvme_path})", file=sys.stderr, flush=True)
    r = run(model, cfg, plan, args.steps, zerotier.units.parse_size(args.rss_bound))
    print(json.dumps(r, indent=1) if args.json else report(r))
    return 0 if r["pass"] else 1


def report(r: dict) -> str:
    """`run`'s result as text: the run's peaks against its bound and plan, a line per step, the verdict."""
    lines = [f"Llama-style {r['params'] / 1e9:.2f}B parameters ({r['layers']} layers), everything on NVMe, "
             f"state {r['master_dtype']} master / {r['moment_dtype']} moments, tiers.host {r['host']}: "
             f"peak RSS {r['peak_rss'] / GiB:.2f} GiB (bound {r['rss_bound'] / GiB:.2f}), host pool peak "
             f"{r['host_pool_peak'] / GiB:.2f} GiB, NVMe peak {r['nvme_peak'] / 1e9:.1f} GB (planned "
             f"{r['nvme_planned'] / 1e9:.1f}), initialize {r['init_s']:.0f} s; drive {r['write_GBps']:.2f} GB/s "
             f"write, {r['read_GBps']:.2f} read"]
    lines += [f"  step {i}: {s['step_s']:6.0f} s   NVMe {(s['nvme_written'] + s['nvme_read']) / 1e9:6.1f} GB "
              f"moved / drive bandwidth = {s['io_bound_s']:5.0f} s" for i, s in enumerate(r["steps"], 1)]
    lines.append(f"verdict: {'PASS' if r['pass'] else 'FAIL'}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
