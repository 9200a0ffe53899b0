"""zerotier against its peers on one GPU: a Llama-style bf16 model, step time, tokens/s, MFU, overlap.

    python benchmarks/bench_gpu.py --out OUT                      # every case at 1.3B (CUDA)
    python benchmarks/bench_gpu.py --size 7b --cases zt-opt-host,ds-z2-offload,torchao-offload
    python benchmarks/bench_gpu.py --size 2.7b --cases zt-opt-nvme,zt-params-nvme,ds-infinity
    python benchmarks/bench_gpu.py --tiny --out OUT               # CPU smoke run: tiny model, zerotier only

Issue 14's table (docs/benchmarks.md). Sizes: `1.3b` fits all on one 80 GB GPU (plain torch is
the reference), `7b` needs its fp32 optimizer state (~81 GB) on host (the reference is then
DeepSpeed ZeRO-Offload), `2.7b` is the largest whose optimizer state fits a 64 GiB drive.

Cases (`--cases`, in this order, which is also their priority under `--time-limit`):
  torch                  plain torch, fp32 params under bf16 autocast, AdamW(fused=True), all on the GPU
  zt-opt-host            zerotier: optimizer on host (params on device, gradients on host)
  ds-z2-offload          DeepSpeed ZeRO-Offload stage 2: offload_optimizer cpu, pinned, DeepSpeedCPUAdam
  zt-opt-host-early      zt-opt-host with train.early_step (Adam during the last backward)
  zt-opt-host-spec       zt-opt-host with train.speculative_step = true (Adam during the last backward,
                         undone when --clip fires: issue 25); the other zerotier cases keep its default, auto
  zt-params-host         zerotier: params + optimizer on host
  ds-z3-offload          DeepSpeed stage 3: offload_param + offload_optimizer cpu, pinned
  torchao-offload        torchao CPUOffloadOptimizer(AdamW, fused), offload_gradients=False
  torchao-offload-grads  the same, offload_gradients=True
  ds-zenflow             DeepSpeed ZenFlow over ZeRO-Offload stage 2
  zt-opt-nvme            zerotier: optimizer on NVMe (params on device, gradients on host)
  zt-params-nvme         zerotier: params + optimizer on NVMe
  ds-infinity            DeepSpeed ZeRO-Infinity: offload_param + offload_optimizer nvme (needs async_io)
A peer that is not importable gives the row "n/a (not installed)"; one that cannot run
here (async_io not buildable, a model that does not fit) says why.

Every case runs in its own process with its own time limit (a stuck peer cannot eat the
run): `--warmup` untimed steps, then `--steps` timed ones (wall clock, device synchronized
after each), then on CUDA two steps under torch.profiler and one with the CUDA sync debug
mode on (both untimed). Setup (model build, DeepSpeed's JIT op builds, pinning) is timed
apart and kept out of every figure. Same model, init, data, seed, hyperparameters,
clipping, accumulation and CPU threads in every case: bf16 compute, fp32 master weights.

Figures per case: median step time, tokens/s, TFLOPS = 6 N tokens / step and MFU against
the bf16 matmul peak measured in the same run (N = all trainable parameters); the ratio of
the step time to plain torch and to DeepSpeed ZeRO-Offload (stage 2) of the same size;
zerotier's own overlap per link (its profiler: the share of each link's transfer time
hidden under compute) and, on CUDA, torch.profiler's: the share of HtoD / DtoH memcpy
time concurrent with a kernel, and the GPU's kernel-busy share; host syncs per step; peak
device memory (allocated / reserved), peak RSS, pinned host bytes, NVMe bytes on disk;
zerotier's plan (need per tier, predicted optimizer+swap seconds per step vs the measured
step); the loss after the last step and the largest |loss - reference loss| over the steps.
`--out DIR` writes DIR/bench_gpu.json, DIR/bench_gpu.md and DIR/cases.log (each case's
output), rewritten after every case, so a run stopped half-way keeps what it measured.
On a CPU (`--tiny`) this is a smoke test of the script, never a result.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import platform
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> (framework, settings). Order = priority under --time-limit.
CASES = {
    "torch": ("torch", {}),
    "zt-opt-host": ("zerotier", {"offload": {"params": "device", "gradients": "host", "optimizer": "host"}}),
    "ds-z2-offload": ("deepspeed", {"stage": 2, "offload_optimizer": "cpu"}),
    "zt-opt-host-early": ("zerotier", {"offload": {"params": "device", "gradients": "host", "optimizer": "host"},
                                       "early_step": True}),
    "zt-opt-host-spec": ("zerotier", {"offload": {"params": "device", "gradients": "host", "optimizer": "host"},
                                      "speculative_step": True}),
    "zt-params-host": ("zerotier", {"offload": {"params": "host", "gradients": "host", "optimizer": "host"}}),
    "ds-z3-offload": ("deepspeed", {"stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"}),
    "torchao-offload": ("torchao", {"offload_gradients": False}),
    "torchao-offload-grads": ("torchao", {"offload_gradients": True}),
    "ds-zenflow": ("deepspeed", {"stage": 2, "offload_optimizer": "cpu", "zenflow": True}),
    "zt-opt-nvme": ("zerotier", {"offload": {"params": "device", "gradients": "host", "optimizer": "nvme"}}),
    "zt-params-nvme": ("zerotier", {"offload": {"params": "nvme", "gradients": "host", "optimizer": "nvme"}}),
    "ds-infinity": ("deepspeed", {"stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme"}),
}
PEER_MODULE = {"deepspeed": "deepspeed", "torchao": "torchao"}
REFERENCES = ("torch", "ds-z2-offload")   # step-time ratios and |Δloss| against the first that ran

# Llama-style shapes (untied head, SwiGLU, RMSNorm, rotary); batch x seq tokens per micro-batch.
SIZES = {
    "tiny": dict(vocab=256, dim=64, layers=2, heads=4, ffn=176, seq=32, batch=4),
    "1.3b": dict(vocab=32000, dim=2048, layers=24, heads=16, ffn=5504, seq=2048, batch=8),
    "2.7b": dict(vocab=32000, dim=2560, layers=32, heads=20, ffn=6912, seq=2048, batch=4),
    "7b": dict(vocab=32000, dim=4096, layers=32, heads=32, ffn=11008, seq=2048, batch=2),
}
HPARAMS = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
PROFILED_STEPS = 2   # CUDA: steps under torch.profiler, after the timed ones
GiB = 1 << 30


# ---------------------------------------------------------------------------------------------
# The model and the data (every case builds exactly these)


def llama(size: str, device):
    """A Llama-style decoder in fp32 on `device`, initialized from seed 0 (normal(0, 0.02) weights,
    unit norms): identical in every case of a run, since the build order and the device are."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    s = SIZES[size]

    class RMSNorm(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(dim))

        def forward(self, x):
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * self.weight

    def rotate(x, cos, sin):
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            d, self.heads = s["dim"], s["heads"]
            self.attn_norm, self.mlp_norm = RMSNorm(d), RMSNorm(d)
            self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
            self.gate, self.up = nn.Linear(d, s["ffn"], bias=False), nn.Linear(d, s["ffn"], bias=False)
            self.down = nn.Linear(s["ffn"], d, bias=False)

        def forward(self, x, cos, sin):
            b, t, d = x.shape
            h = self.attn_norm(x)
            q, k, v = (proj(h).view(b, t, self.heads, -1).transpose(1, 2) for proj in (self.q, self.k, self.v))
            y = F.scaled_dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v, is_causal=True)
            x = x + self.o(y.transpose(1, 2).reshape(b, t, d))
            h = self.mlp_norm(x)
            return x + self.down(F.silu(self.gate(h)) * self.up(h))

    class Llama(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(s["vocab"], s["dim"])
            self.layers = nn.ModuleList(Layer() for _ in range(s["layers"]))
            self.norm = RMSNorm(s["dim"])
            self.head = nn.Linear(s["dim"], s["vocab"], bias=False)

        def forward(self, idx, targets):
            x = self.embed(idx)
            half = s["dim"] // s["heads"] // 2
            inv_freq = 10000.0 ** (-torch.arange(half, device=idx.device, dtype=torch.float32) / half)
            angles = torch.outer(torch.arange(idx.shape[1], device=idx.device, dtype=torch.float32), inv_freq)
            cos, sin = (torch.cat((f, f), dim=-1).to(x.dtype) for f in (angles.cos(), angles.sin()))
            for layer in self.layers:
                x = layer(x, cos, sin)
            logits = self.head(self.norm(x))
            return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    torch.manual_seed(0)
    with torch.device(device):
        model = Llama()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
    return model


def batches(size: str, n: int, accum: int):
    """`n` steps of `accum` micro-batches of learnable sequences (token t = a + b t mod vocab, a and b
    random per sequence), on the CPU, from seed 0: the loss falls, so its curves can be compared."""
    import torch
    s = SIZES[size]
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n * accum):
        a = torch.randint(0, s["vocab"], (s["batch"], 1), generator=gen)
        b = torch.randint(1, 17, (s["batch"], 1), generator=gen)
        seq = (a + b * torch.arange(s["seq"] + 1)) % s["vocab"]
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return [out[i * accum:(i + 1) * accum] for i in range(n)]


def param_count(size: str) -> int:
    s = SIZES[size]
    d, f, v = s["dim"], s["ffn"], s["vocab"]
    return s["layers"] * (4 * d * d + 3 * d * f + 2 * d) + 2 * v * d + d


# ---------------------------------------------------------------------------------------------
# One case, in its own process


class NotApplicable(Exception):
    """The case cannot run here; the message says why (the row reads n/a (message))."""


def fits(framework: str, settings: dict, args, numel: int, device) -> None:
    """Refuse up front what cannot fit (rough byte counts, printed in the reason), so a 7B run
    does not spend minutes finding out. zerotier cases are left to zerotier's planner."""
    import torch
    s = SIZES[args.size]
    act = 34 * s["batch"] * s["seq"] * s["dim"] * s["layers"] + 12 * s["batch"] * s["seq"] * s["vocab"]
    dev = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    disk = shutil.disk_usage(args.nvme_path).free
    need = []
    if framework == "torch":
        need.append(("device", 16 * numel + act, dev, "fp32 params, grads and Adam moments + activations"))
    elif framework == "torchao":
        need.append(("device", 8 * numel + act, dev, "fp32 params and grads + activations"))
        need.append(("host", 16 * numel, ram, "fp32 params, grads and Adam moments"))
    elif framework == "deepspeed":
        if settings["offload_optimizer"] == "cpu":
            need.append(("host", 18 * numel, ram, "fp32 master, moments and grads + bf16 copy"))
        else:
            need.append(("disk", 16 * numel, disk, "fp32 master, moments, grads and bf16 params"))
    for where, nbytes, have, what in need:
        if have is not None and nbytes > 0.9 * have:
            raise NotApplicable(f"does not fit: ~{nbytes / GiB:.0f} GiB of {where} ({what}), "
                                f"{have / GiB:.0f} GiB here")


def deepspeed_config(settings: dict, args, model) -> dict:
    s = SIZES[args.size]
    zero = {"stage": settings["stage"], "contiguous_gradients": True, "overlap_comm": True,
            "reduce_bucket_size": 5e8,
            "offload_optimizer": {"device": settings["offload_optimizer"], "pin_memory": True}}
    if settings.get("offload_param"):
        largest = max(p.numel() for p in model.parameters())
        zero["offload_param"] = {"device": settings["offload_param"], "pin_memory": True}
        if settings["offload_param"] == "nvme":
            zero["offload_param"].update(nvme_path=args.nvme_path, buffer_count=5, buffer_size=max(int(1e8), largest))
    if settings["offload_optimizer"] == "nvme":
        zero["offload_optimizer"].update(nvme_path=args.nvme_path, buffer_count=4)
    if settings.get("zenflow"):  # deepspeed.ai/tutorials/zenflow's settings
        zero["zenflow"] = {"topk_ratio": 0.05, "select_strategy": "auto", "select_interval": "auto",
                           "update_interval": 4, "full_warm_up_rounds": 0, "overlap_step": True}
    beta1, beta2 = HPARAMS["betas"]
    return {
        "train_micro_batch_size_per_gpu": s["batch"], "gradient_accumulation_steps": args.accum,
        "train_batch_size": s["batch"] * args.accum,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": HPARAMS["lr"], "betas": [beta1, beta2],
                                                  "eps": HPARAMS["eps"], "weight_decay": HPARAMS["weight_decay"]}},
        "zero_optimization": zero,
        "gradient_clipping": args.clip or 0.0,
        "aio": {"block_size": 1 << 20, "queue_depth": 32, "thread_count": 1, "single_submit": False,
                "overlap_events": True},
        "steps_per_print": 10**9, "wall_clock_breakdown": False,
    }


def zerotier_config(settings: dict, args, device) -> dict:
    return {
        "offload": settings["offload"],
        "tiers": {"nvme_path": args.nvme_path},
        "precision": {"param_dtype": "bf16"},
        "optimizer": {**HPARAMS, "betas": list(HPARAMS["betas"]), "threads": args.threads},
        "train": {"max_grad_norm": args.clip, "grad_accum_steps": args.accum,
                  "early_step": bool(settings.get("early_step")),
                  "speculative_step": settings.get("speculative_step", "auto"),
                  "handle_signals": False, "device": str(device)},
        "profile": {"enabled": True},
    }


def setup(case: str, args, device, out: dict):
    """Build the model and the case's training step. Returns (step(micro_batches) -> loss, close, engine)."""
    import torch
    framework, settings = CASES[case]
    numel = param_count(args.size)
    fits(framework, settings, args, numel, device)
    if framework == "torchao" and args.clip is not None:
        raise NotApplicable("CPUOffloadOptimizer copies gradients to the host during backward: "
                            "clipping them afterwards is not supported (run with --clip none)")
    if settings.get("offload_gradients") and args.accum > 1:
        raise NotApplicable("offload_gradients=True does not accumulate gradients (--accum 1)")
    if settings.get("early_step") and args.clip is not None:
        raise NotApplicable("train.early_step steps each unit before the window's norm is known: "
                            "it runs without clipping (--clip none)")
    model = llama(args.size, device)
    params = list(model.parameters())
    to_dev = lambda t: t.to(device, non_blocking=True)  # noqa: E731

    if framework == "torch":
        opt = torch.optim.AdamW(params, **HPARAMS, fused=True)
        return _autocast_step(model, params, opt, args, device, to_dev), lambda: None, None

    if framework == "torchao":
        try:
            from torchao.optim import CPUOffloadOptimizer
        except ImportError:
            from torchao.prototype.low_bit_optim import CPUOffloadOptimizer
        opt = CPUOffloadOptimizer(params, torch.optim.AdamW, offload_gradients=settings["offload_gradients"],
                                  fused=True, **HPARAMS)
        return _autocast_step(model, params, opt, args, device, to_dev), lambda: None, None

    if framework == "deepspeed":
        import deepspeed
        if settings["offload_optimizer"] == "nvme":
            from deepspeed.accelerator import get_accelerator
            if not get_accelerator().create_op_builder("AsyncIOBuilder").is_compatible(verbose=True):
                raise NotApplicable("DeepSpeed's async_io op cannot build here: libaio's headers or .so not found "
                                    "(gpu_wheels.sh carries them in wheels/libaio; gpu_run.sh sets CFLAGS/LDFLAGS)")
        engine, *_ = deepspeed.initialize(model=model, model_parameters=params,
                                          config=deepspeed_config(settings, args, model))

        def ds_step(micro):
            total = 0.0
            for x, y in micro:
                loss = engine(to_dev(x), to_dev(y))
                engine.backward(loss)
                engine.step()
                total += loss.detach().float()
            return total / len(micro)
        return ds_step, lambda: None, None

    import zerotier
    engine = zerotier.initialize(model, zerotier_config(settings, args, device))
    out["plan"] = {"need": dict(engine.plan.need), "predicted_step_s": engine.plan.predicted_step_s,
                   "rates_measured": engine.plan.rates_measured,
                   "placement": {k: v.value for k, v in engine.plan.placement.items()}}

    def zt_step(micro):
        total = 0.0
        for x, y in micro:
            loss = engine(to_dev(x), to_dev(y))
            engine.backward(loss)
            total += loss.detach().float()
        engine.step()
        return total / len(micro)
    return zt_step, engine.close, engine


def _autocast_step(model, params, opt, args, device, to_dev):
    import torch

    def step(micro):
        total = 0.0
        for x, y in micro:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(to_dev(x), to_dev(y))
            (loss / len(micro)).backward()
            total += loss.detach().float()
        if args.clip is not None:
            torch.nn.utils.clip_grad_norm_(params, args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total / len(micro)
    return step


def run_case(case: str, args) -> dict:
    import torch
    torch.set_num_threads(args.threads)
    device = torch.device("cuda", 0) if torch.cuda.is_available() and not args.tiny else torch.device("cpu")
    cuda = device.type == "cuda"
    out = {"case": case, "size": args.size, "device": str(device)}
    data = batches(args.size, args.warmup + args.steps + (PROFILED_STEPS + 1 if cuda else 0), args.accum)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t0 = time.perf_counter()
    step, close, engine = setup(case, args, device, out)
    out["setup_s"] = time.perf_counter() - t0

    store = engine.store if engine is not None else None
    losses, times = [], []
    for i, micro in enumerate(data[:args.warmup + args.steps]):
        if i == args.warmup and store is not None:
            io_before = store.stats()
        t0 = time.perf_counter()
        loss = step(micro)
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))   # after the clock stopped: .item() would sync it
    out.update(step_s=statistics.median(times[args.warmup:]), step_times_s=times, losses=losses)
    if store is not None:  # zerotier's swap traffic per timed step, and its rate over the timed steps
        io_after, timed_s = store.stats(), sum(times[args.warmup:])
        moved = {"written": io_after["bytes_in"] - io_before["bytes_in"],
                 "read": io_after["bytes_out"] - io_before["bytes_out"]}
        out["nvme_traffic"] = {k: v / args.steps for k, v in moved.items()}
        out["nvme_GBps"] = {k: v / timed_s / 1e9 for k, v in moved.items()}
    if not all(math.isfinite(v) for v in losses):
        raise RuntimeError(f"non-finite loss: {losses}")

    if cuda:  # untimed: torch.profiler's view of the copies, then the host syncs of one step
        out["torch_profiler"] = _torch_profiler(step, data[args.warmup + args.steps:][:PROFILED_STEPS], sync)
        out["host_syncs_per_step"] = _count_syncs(step, data[-1], sync)
        out["peak_device_allocated"] = torch.cuda.max_memory_allocated(device)
        out["peak_device_reserved"] = torch.cuda.max_memory_reserved(device)
        with contextlib.suppress(Exception):  # torch's pinned (caching host) allocator
            stats = torch.cuda.host_memory_stats()
            out["torch_pinned_peak"] = stats.get("allocated_bytes.all.peak", stats.get("allocated_bytes.peak"))
    if engine is not None:
        report = engine.report()
        out["zt_overlap_pct"] = report.overlap_pct
        out["zt_link_overlap_pct"] = _link_overlap(engine.profiler.trace())
        out["zt_verdict"] = report.verdict
        out["zt_links"] = [{"link": k.link, "bytes": k.bytes, "GBps": k.gbps, "pct_of_peak": k.pct_of_peak}
                           for k in report.links]   # achieved bandwidth per link vs `zerotier bench`
        pool = engine.host_pool.stats()
        out["zt_pinned_peak"] = pool["peak"] if pool["pinned"] else 0
    out["nvme_bytes"] = _disk_bytes(args.nvme_path)
    close()
    out["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out["status"] = "ok"
    return out


def _link_overlap(trace: dict) -> dict[str, float]:
    """Per link (src->dst), the share of its transfer time hidden under compute on another
    thread: the summary's own rule ([Note: verdict] in zerotier/profiler/summary.py), split by link."""
    from zerotier.profiler import intervals
    from zerotier.profiler.summary import _busy
    from zerotier.profiler.trace import read_trace
    data = read_trace(trace)
    _, hidden_under = _busy(data)
    total, hidden = defaultdict(float), defaultdict(float)
    for t in data.transfers:
        link = f"{t['src']}->{t['dst']}"
        total[link] += t["dur"]
        hidden[link] += intervals.overlap(t["ts"], t["ts"] + t["dur"], hidden_under(t["stream"]))
    return {link: 100.0 * hidden[link] / d for link, d in sorted(total.items()) if d > 0}


def memcpy_overlap(trace: dict) -> dict:
    """From a torch.profiler (Kineto) chrome trace: the share of HtoD and DtoH memcpy time during
    which a kernel ran, and the share of the window the GPU ran kernels."""
    from zerotier.profiler import intervals
    kernels, copies = [], {"h2d": [], "d2h": []}
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or "dur" not in e:
            continue
        span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        if e.get("cat") == "kernel":
            kernels.append(span)
        elif e.get("cat") == "gpu_memcpy":
            name = e.get("name", "")
            key = "h2d" if "HtoD" in name else "d2h" if "DtoH" in name else None
            if key:
                copies[key].append(span)
    busy = intervals.union(kernels)
    out = {}
    for key, spans in copies.items():
        dur = sum(e - s for s, e in spans)
        out[f"{key}_pct"] = 100.0 * sum(intervals.overlap(s, e, busy) for s, e in spans) / dur if dur else None
        out[f"{key}_bytes_events"] = len(spans)
    everything = kernels + copies["h2d"] + copies["d2h"]
    if everything:
        window = max(e for _, e in everything) - min(s for s, _ in everything)
        out["gpu_busy_pct"] = 100.0 * intervals.length(busy) / window if window > 0 else None
    return out


def _torch_profiler(step, data, sync) -> dict:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for micro in data:
            step(micro)
            sync()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return memcpy_overlap(json.load(f))


def _count_syncs(step, micro, sync) -> int:
    """Host syncs in one step as the CUDA sync debug mode sees them (the calls torch instruments:
    .item(), nonzero, blocking copies to the host...), from every thread of the process."""
    import torch
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step(micro)
            sync()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def _disk_bytes(path: str) -> int:
    total = 0
    for d, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(d, f)).st_blocks * 512
    return total


def environment(args) -> dict:
    """Machine, versions and the bf16 matmul peak, measured in its own process like a case."""
    import torch
    cuda = torch.cuda.is_available() and not args.tiny
    env = {"host": socket.gethostname(), "python": platform.python_version(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "cpu_model": _cpu_model(), "cpus": os.cpu_count(),
           "cpus_usable": len(os.sched_getaffinity(0)), "threads_used": args.threads,
           "ram_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB,
           "disk_free_gib": shutil.disk_usage(args.nvme_path).free / GiB}
    for name in ("deepspeed", "torchao", "transformers", "zerotier"):
        try:
            from importlib.metadata import version
            env[name] = version(name)
        except Exception:  # noqa: BLE001 - not installed
            env[name] = None
    with contextlib.suppress(Exception):
        env["zerotier_commit"] = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                                                capture_output=True, text=True, timeout=10).stdout.strip() or None
    with contextlib.suppress(Exception):
        from zerotier import _native
        env["zerotier_native"] = _native.status()
    with contextlib.suppress(Exception):
        from zerotier.bench import load_rates
        env["zerotier_rates"] = load_rates()
    if cuda:
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, gpu_memory_gib=p.total_memory / GiB, sm=f"{p.major}{p.minor}")
        with contextlib.suppress(Exception):
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        with contextlib.suppress(Exception):
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=30).stdout.strip()
    env["matmul_peak_tflops"] = _matmul_peak(torch.device("cuda" if cuda else "cpu"))
    return env


def _cpu_model() -> str | None:
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return platform.processor() or None


def _matmul_peak(device) -> float:
    """bf16 matmul TFLOPS: the best of 10 timed products after 3 warm-ups (8192^3 on CUDA)."""
    import torch
    n = 8192 if device.type == "cuda" else 256
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    best = float("inf")
    for i in range(13):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            a @ b
            end.record()
            end.synchronize()
            t = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            a @ b
            t = time.perf_counter() - t0
        if i >= 3:
            best = min(best, t)
    return 2 * n ** 3 / best / 1e12


def _die_with_parent() -> None:
    """[Note: case processes]: a case runs in its own session, out of reach of the signals
    gpu_run.sh's step limit sends to the parent's group; the parent kills it when it stops, and
    this makes the kernel kill it too if the parent is killed outright (SIGKILL after the limit)."""
    import ctypes
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the parent died before prctl
        os._exit(1)


def child(args) -> None:
    """--child CASE: run one case (or `env`) and write its result to --result, whatever happens."""
    _die_with_parent()
    try:
        result = environment(args) if args.child == "env" else run_case(args.child, args)
    except NotApplicable as exc:
        result = {"case": args.child, "status": "n/a", "reason": str(exc)}
    except Exception as exc:  # noqa: BLE001 - the row says what failed; the log has the traceback
        import traceback
        traceback.print_exc()
        oom = "out of memory" in str(exc).lower() or type(exc).__name__ == "OutOfMemoryError"
        result = {"case": args.child, "status": "n/a" if oom else "failed",
                  "reason": f"{'OOM: ' if oom else ''}{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
                  if str(exc).strip() else type(exc).__name__}
    with open(args.result, "w") as f:
        json.dump(result, f)


# ---------------------------------------------------------------------------------------------
# The parent: one process per case, under time limits; the table


def spawn(name: str, args, limit: float, log) -> dict:
    """Run `--child name` in its own session (so its own children, e.g. ninja, go with it) and
    wait at most `limit` s; the result file is the only channel back ([Note: case processes])."""
    fd, result = tempfile.mkstemp(prefix="bench_gpu.", suffix=".json")
    os.close(fd)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--result", result,
           "--size", args.size, "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--accum", str(args.accum), "--clip", str(args.clip), "--threads", str(args.threads),
           "--nvme-path", args.case_nvme] + (["--tiny"] if args.tiny else [])
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONUNBUFFERED="1")
    if CASES.get(name, ("",))[0] == "deepspeed":  # a one-rank process group without a launcher
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                   LOCAL_WORLD_SIZE="1")
    log.write(f"\n===== {name} (limit {limit:.0f} s): {' '.join(cmd)}\n")
    log.flush()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    t0 = time.perf_counter()
    try:
        proc.wait(timeout=limit)
        with open(result) as f:
            text = f.read()
        res = json.loads(text) if text else {"case": name, "status": "failed",
                                             "reason": f"exit code {proc.returncode}, no result (see cases.log)"}
    except subprocess.TimeoutExpired:
        res = {"case": name, "status": "failed", "reason": f"timed out after {limit:.0f} s"}
    finally:  # a timeout, an interrupt: the case's whole session goes
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        os.unlink(result)
    res["wall_s"] = time.perf_counter() - t0
    return res


def derive(results: list[dict], env: dict, args) -> None:
    """Figures that need more than one case: throughput, MFU, ratios, loss against the reference."""
    s = SIZES[args.size]
    tokens = s["batch"] * s["seq"] * args.accum
    numel = param_count(args.size)
    peak = env.get("matmul_peak_tflops")
    ok = {r["case"]: r for r in results if r.get("status") == "ok"}
    ref = next((ok[c] for c in REFERENCES if c in ok), None)
    for r in results:
        if r.get("status") != "ok":
            continue
        r["tokens_per_step"] = tokens
        r["tokens_per_s"] = tokens / r["step_s"]
        r["tflops"] = 6 * numel * tokens / r["step_s"] / 1e12
        r["mfu_pct"] = 100.0 * r["tflops"] / peak if peak else None
        for base in REFERENCES:
            r[f"x_{base}"] = r["step_s"] / ok[base]["step_s"] if base in ok else None
        if ref is not None:
            n = min(len(ref["losses"]), len(r["losses"]))
            r["reference"] = ref["case"]
            r["max_abs_dloss"] = max(abs(a - b) for a, b in zip(r["losses"][:n], ref["losses"][:n]))
        plan = r.get("plan")
        if plan:
            plan["predicted_over_measured"] = plan["predicted_step_s"] / r["step_s"]


LINK = {"host->device": "H2D", "device->host": "D2H", "nvme->host": "N2H", "host->nvme": "H2N",
        "nvme->device": "N2D", "device->nvme": "D2N"}


def table(results: list[dict], env: dict, args) -> str:
    def f(v, fmt="{:.1f}", scale=1.0):
        return "-" if v is None else fmt.format(v / scale)

    s = SIZES[args.size]
    head = [
        f"# bench_gpu: {args.size} Llama-style ({param_count(args.size) / 1e9:.2f}B params), "
        f"{'CPU smoke run (not a result)' if args.tiny else env.get('gpu', 'no GPU')}",
        "",
        f"- model: dim {s['dim']}, {s['layers']} layers, {s['heads']} heads, ffn {s['ffn']}, vocab {s['vocab']}; "
        f"bf16 compute, fp32 master; batch {s['batch']} x seq {s['seq']} x accum {args.accum} "
        f"= {s['batch'] * s['seq'] * args.accum} tokens/step; clip {args.clip}; AdamW {HPARAMS}",
        f"- steps: median of {args.steps} after {args.warmup} warm-up; setup (model build, JIT builds, pinning) "
        f"excluded from every figure",
        f"- machine: GPU {env.get('gpu')} ({f(env.get('gpu_memory_gib'))} GiB, sm_{env.get('sm')}), driver "
        f"{env.get('driver')}; torch {env.get('torch')}, CUDA {env.get('cuda')}, NCCL {env.get('nccl')}; "
        f"CPU {env.get('cpu_model')}, {env.get('cpus_usable')}/{env.get('cpus')} cores usable, "
        f"{env.get('threads_used')} threads used; RAM {f(env.get('ram_gib'))} GiB; disk free "
        f"{f(env.get('disk_free_gib'))} GiB",
        f"- peers: deepspeed {env.get('deepspeed')}, torchao {env.get('torchao')}; zerotier {env.get('zerotier')} "
        f"({env.get('zerotier_commit')}), native {env.get('zerotier_native')}, "
        f"bench rates {'measured' if env.get('zerotier_rates') else 'none (plan uses default rates)'}",
        f"- bf16 matmul peak (this run): {f(env.get('matmul_peak_tflops'))} TFLOPS; MFU = 6 N tokens / step / peak",
        "",
        "| case | status | setup s | step ms | tokens/s | TFLOPS | MFU % | x torch | x DS-Offload | zt overlap % per link "
        "| torch.prof H2D/D2H overlap % | GPU busy % | host syncs/step | peak dev alloc/resv GiB | peak RSS GiB "
        "| pinned GiB | NVMe GB on disk (swap GB/s) | plan need dev/host/nvme GB | plan pred s / meas s | loss@K | max abs dloss |",
        "|" + "---|" * 21,
    ]
    rows = []
    for r in results:
        if r.get("status") != "ok":
            rows.append(f"| {r['case']} | {r.get('status')} ({r.get('reason', '')}) |" + " - |" * 19)
            continue
        links = ", ".join(f"{LINK.get(k, k)} {v:.0f}" for k, v in (r.get("zt_link_overlap_pct") or {}).items()) or "-"
        tp = r.get("torch_profiler") or {}
        plan = r.get("plan") or {}
        need = plan.get("need")
        pinned = r.get("zt_pinned_peak") if r.get("zt_pinned_peak") is not None else r.get("torch_pinned_peak")
        io = r.get("nvme_GBps")
        nvme_io = f" (w {io['written']:.1f} / r {io['read']:.1f} GB/s)" if io else ""
        pred = (f"{plan['predicted_step_s']:.3f}{'' if plan['rates_measured'] else '*'} / {r['step_s']:.3f}"
                if plan else "-")
        rows.append(
            f"| {r['case']} | ok | {r['setup_s']:.1f} | {r['step_s'] * 1e3:.1f} | {r['tokens_per_s']:,.0f} | {r['tflops']:.3g} "
            f"| {f(r.get('mfu_pct'), '{:.3g}')} | {f(r.get('x_torch'), '{:.2f}')} | {f(r.get('x_ds-z2-offload'), '{:.2f}')} "
            f"| {links} | {f(tp.get('h2d_pct'), '{:.0f}')}/{f(tp.get('d2h_pct'), '{:.0f}')} "
            f"| {f(tp.get('gpu_busy_pct'), '{:.0f}')} | {f(r.get('host_syncs_per_step'), '{:.0f}')} "
            f"| {f(r.get('peak_device_allocated'), '{:.1f}', GiB)}/{f(r.get('peak_device_reserved'), '{:.1f}', GiB)} "
            f"| {f(r.get('peak_rss'), '{:.1f}', GiB)} | {f(pinned, '{:.1f}', GiB)} | {f(r.get('nvme_bytes'), '{:.1f}', 1e9)}"
            f"{nvme_io} "
            f"| {'/'.join(f'{need[t] / 1e9:.1f}' for t in ('device', 'host', 'nvme')) if need else '-'} "
            f"| {pred} | {r['losses'][-1]:.4f} | {f(r.get('max_abs_dloss'), '{:.4f}')} |")
    notes = ["", "x torch / x DS-Offload: step time over that case's (lower is faster). "
             "max abs dloss: against the first of torch, ds-z2-offload that ran (bf16: within 2e-2 expected). "
             "plan pred: zerotier's predicted optimizer+swap seconds per step (serial; * = default rates, "
             "no `zerotier bench` results)."]
    return "\n".join(head + rows + notes) + "\n"


def write(results, env, args) -> str:
    text = table(results, env, args)
    if args.out:
        with open(os.path.join(args.out, "bench_gpu.md"), "w") as f:
            f.write(text)
        with open(os.path.join(args.out, "bench_gpu.json"), "w") as f:
            json.dump({"env": env, "settings": {k: v for k, v in vars(args).items() if k not in ("case_nvme",)},
                       "size": SIZES[args.size], "numel": param_count(args.size), "cases": results}, f, indent=1)
    return text


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", help="comma-separated case names (default: every case; --tiny: torch and zerotier's)")
    ap.add_argument("--size", choices=sorted(SIZES), help="model size for every case (default 1.3b; --tiny: tiny)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per case (default 10)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps before them (default 3)")
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step (default 1)")
    ap.add_argument("--clip", type=lambda v: None if v.lower() in ("none", "0") else float(v), default=None,
                    help="gradient clipping max norm, or none (default none: train.early_step needs none)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="CPU threads for every case: torch, OMP (DeepSpeed's CPU Adam), zerotier's optimizer")
    ap.add_argument("--out", help="directory for bench_gpu.json, bench_gpu.md and cases.log")
    ap.add_argument("--nvme-path", help="directory for swap files (default: a temp dir in the repo root, on disk)")
    ap.add_argument("--case-timeout", type=float, default=300.0, help="seconds per case (default 300)")
    ap.add_argument("--time-limit", type=float, help="seconds for the whole run: cases that would start "
                    "too late are reported as not run")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny model, zerotier and torch only")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.size = args.size or ("tiny" if args.tiny else "1.3b")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        child(args)
        return 0
    start = time.perf_counter()
    names = args.cases.split(",") if args.cases else [
        c for c, (fw, _) in CASES.items() if not args.tiny or fw in ("torch", "zerotier")]
    unknown = [c for c in names if c not in CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    nvme_root = tempfile.mkdtemp(prefix=".bench_gpu_nvme.", dir=args.nvme_path or ROOT)
    results: list[dict] = []
    env: dict = {}
    current = "env"  # the process running when an interrupt came
    log_path = os.path.join(args.out, "cases.log") if args.out else os.devnull
    try:
        with open(log_path, "w") as log:
            def left() -> float:
                return float("inf") if args.time_limit is None else args.time_limit - (time.perf_counter() - start)

            args.case_nvme = nvme_root
            env = spawn("env", args, min(120.0, left()), log)
            print(f"env: {env.get('gpu', 'no GPU')}, torch {env.get('torch')}, "
                  f"bf16 matmul peak {env.get('matmul_peak_tflops') or 0:.1f} TFLOPS", flush=True)
            for name in names:
                current = name
                framework = CASES[name][0]
                if framework in PEER_MODULE and args.tiny:
                    res = {"case": name, "status": "n/a", "reason": "--tiny runs zerotier and torch only"}
                elif framework in PEER_MODULE and importlib.util.find_spec(PEER_MODULE[framework]) is None:
                    res = {"case": name, "status": "n/a", "reason": "not installed"}
                elif left() < 30:
                    res = {"case": name, "status": "not run", "reason": "--time-limit reached"}
                else:
                    args.case_nvme = tempfile.mkdtemp(prefix=f"{name}.", dir=nvme_root)
                    res = spawn(name, args, min(args.case_timeout, left() - 5), log)
                    shutil.rmtree(args.case_nvme, ignore_errors=True)
                results.append(res)
                derive(results, env, args)
                write(results, env, args)
                print(f"  {name:22s} {res['status']:7s} " + (f"{res['step_s'] * 1e3:9.1f} ms/step"
                      if res["status"] == "ok" else res.get("reason", "")), flush=True)
    except KeyboardInterrupt:  # gpu_run.sh's step limit: keep what was measured
        results.append({"case": current, "status": "not run", "reason": "interrupted (SIGINT: the run's time limit)"})
        print(write(results, env, args))
        return 130
    finally:
        shutil.rmtree(nvme_root, ignore_errors=True)
    print()
    print(write(results, env, args))
    return 0 if all(r["status"] in ("ok", "n/a") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
