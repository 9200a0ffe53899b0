"""Train a small character-level GPT with zerotier — the README's demo.

    python examples/train_gpt.py           # ~20 s on a quiet 2-core CPU (much longer on a busy one)
    python examples/train_gpt.py --long    # 120 steps, 6 layers, batch 16: ~1.5 min on a quiet 2-core CPU
    python examples/train_gpt.py --steps 300 --dim 384 --device-budget 64MiB --nvme-path /mnt/nvme
    torchrun --nproc-per-node 2 examples/train_gpt.py --zero-stage 3     # data parallel, ZeRO-3

A plain PyTorch training loop with three lines changed (marked "zerotier:").
By default the device budget is smaller than the model's training state, so the
planner moves gradients to host memory and the fp32 master weights and Adam
moments to NVMe files (a temporary directory); the run ends with a swap summary.
"""
from __future__ import annotations

import argparse
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

import zerotier
from zerotier.units import format_size
from zerotier.planner.sizes import model_state_bytes

# Embedded training text: the model learns to continue it, so the loss visibly falls.
TEXT = """\
A tier is a place where training state can live: the accelerator's own memory, the
host's memory, or files on a fast drive. Memory on the accelerator is quick and
small, host memory is larger and slower to reach, and the drive is the largest and
slowest of all. A model that does not fit on the accelerator can still be trained
when each kind of state goes to the tier that suits it: the weights that every layer
reads twice per step stay close, the gradients stream out as soon as they are ready,
and the optimizer's moments, touched once per step, wait on the drive until their
turn. The trick is to move the next thing while the current thing is being used, so
that the copies hide behind the arithmetic and nobody waits. When the copies cannot
hide, a good profiler says which link was the bottleneck and by how much.
""" * 4


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(d, 2))
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.Sequential(*(Block(dim, heads) for _ in range(layers)))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        logits = self.head(self.ln_f(self.blocks(x)))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batches(data: torch.Tensor, seq: int, batch: int, gen: torch.Generator):
    while True:
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
        chunk = torch.stack([data[s: s + seq + 1] for s in starts])
        yield chunk[:, :-1], chunk[:, 1:]


# The default run and --long: the short one still has a training state larger than the device
# budget, Adam state on NVMe and a loss that falls (3.6 -> ~1.4 in 60 steps), in a third of the
# long one's compute per step and half its steps.
SHORT = {"steps": 60, "layers": 4, "batch": 8}
LONG = {"steps": 120, "layers": 6, "batch": 16}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--long", action="store_true",
                    help=f"the longer demo: defaults {LONG} instead of {SHORT}")
    ap.add_argument("--steps", type=int, help=f"optimizer steps (default {SHORT['steps']}, --long {LONG['steps']})")
    ap.add_argument("--dim", type=int, default=256, help="model width (default 256)")
    ap.add_argument("--layers", type=int,
                    help=f"transformer blocks (default {SHORT['layers']}, --long {LONG['layers']})")
    ap.add_argument("--batch", type=int,
                    help=f"sequences per micro-batch (default {SHORT['batch']}, --long {LONG['batch']})")
    ap.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step (default 2)")
    ap.add_argument("--device-budget", default="24MiB", help="tiers.device: accelerator budget (default 24MiB)")
    ap.add_argument("--host-budget", default="auto", help="tiers.host: host memory budget (default auto)")
    ap.add_argument("--nvme-path", default=None, help="directory for NVMe swap files (default: a temp dir)")
    ap.add_argument("--optimizer-tier", default="nvme", choices=["auto", "device", "host", "nvme"],
                    help="offload.optimizer (default nvme)")
    ap.add_argument("--zero-stage", type=int, default=0, choices=[0, 1, 2, 3],
                    help="ZeRO stage when launched with torchrun on several ranks (default 0)")
    ap.add_argument("--trace", default=None, help="write a Perfetto/Chrome trace of all swap traffic here "
                                                  "(read it with `zerotier profile TRACE.json`)")
    args = ap.parse_args(argv)
    for key, value in (LONG if args.long else SHORT).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv=None):
    args = parse_args(argv)
    chars = sorted(set(TEXT))
    data = torch.tensor([chars.index(c) for c in TEXT])
    seq = 64
    torch.manual_seed(0)
    model = GPT(len(chars), args.dim, args.layers, heads=8, seq=seq)
    numel = sum(p.numel() for p in model.parameters())
    state = model_state_bytes(numel, 0, 1, param_bytes=4, grad_bytes=4)  # the plan's accounting: 20 B/param
    print(f"GPT: {numel / 1e6:.1f}M parameters, training state ~{format_size(state)} "
          f"(device budget {args.device_budget})")

    with tempfile.TemporaryDirectory(prefix="zerotier-demo-", dir=args.nvme_path) as swap_dir:
        config = {
            "tiers": {"device": args.device_budget, "host": args.host_budget, "nvme_path": swap_dir},
            "offload": {"optimizer": args.optimizer_tier},
            "optimizer": {"lr": 3e-3, "weight_decay": 0.01},
            "train": {"grad_accum_steps": args.accum, "max_grad_norm": 1.0},
            "profile": {"enabled": True, "trace_path": args.trace},
            "zero": {"stage": args.zero_stage},
        }
        engine = zerotier.initialize(model, config)                  # zerotier: instead of the optimizer
        main_rank = engine.rank == 0
        if main_rank:
            print(engine.plan.summary())
        gen = torch.Generator().manual_seed(engine.rank)  # each data-parallel rank sees its own batches
        stream = batches(data, seq, args.batch, gen)
        start = time.perf_counter()
        first = None
        bar = tqdm(range(args.steps), desc="train", unit="step", disable=not main_rank)
        for _ in bar:
            for _ in range(args.accum):
                x, y = next(stream)
                loss = engine(x.to(engine.device), y.to(engine.device))  # zerotier: engine(...)
                engine.backward(loss)                                 # zerotier: instead of loss.backward()
                engine.step()                                         #   and optimizer.step()/zero_grad()
            first = first if first is not None else loss.item()
            bar.set_postfix(loss=f"{loss.item():.3f}")
        elapsed = time.perf_counter() - start
        if main_rank:
            print(f"loss {first:.3f} -> {loss.item():.3f} in {elapsed:.1f} s"
                  + (f" ({engine.world_size} ranks, ZeRO stage {args.zero_stage})" if engine.world_size > 1 else ""))
            print(engine.swap_summary())
        engine.close()


if __name__ == "__main__":
    main()
