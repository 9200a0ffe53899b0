"""`zerotier demo`: train a small GPT with parameters on host and optimizer state on NVMe.

Reads as a list of steps: report the node, plan, train with a progress line,
report what moved. Everything runs on the CPU when there is no GPU.
"""
from __future__ import annotations

import sys
import tempfile
import time

import torch

import zerotier
from zerotier.config import format_size
from zerotier.models import TinyGPT, batches


def _progress(step: int, total: int, loss: float, seconds: float) -> None:
    width = 30
    done = int(width * step / total)
    sys.stdout.write(f"\r  [{'#' * done}{'.' * (width - done)}] step {step}/{total}  loss {loss:.4f}  "
                     f"{seconds * 1e3:.0f} ms/step")
    sys.stdout.flush()


def run(steps: int = 20, nvme_path: str | None = None, params: str = "host", optimizer: str = "nvme",
        dim: int = 256, layers: int = 4) -> dict:
    from zerotier import envinfo

    env = envinfo.collect(nvme_path or ".")
    print(f"zerotier {zerotier.__version__} | torch {torch.__version__} | "
          f"native {env['native']} | simd {env['simd_level']} | io_uring {env['io_uring']}")

    torch.manual_seed(0)
    vocab, seq, batch = 512, 64, 8
    model = TinyGPT(vocab=vocab, dim=dim, layers=layers, heads=8, seq=seq, checkpointing=True)
    with tempfile.TemporaryDirectory(prefix="zerotier-demo-", dir=nvme_path) as swap_dir:
        config = {
            "offload": {"params": params, "gradients": "host", "optimizer": optimizer},
            "tiers": {"nvme_path": swap_dir, "nvme": "auto"},
            "optimizer": {"lr": 1e-3, "weight_decay": 0.01},
            "train": {"grad_accum_steps": 2, "max_grad_norm": 1.0},
        }
        with zerotier.initialize(model, config) as engine:
            print(engine.plan.summary())
            print(f"training {steps} steps (grad accumulation 2, clipping 1.0, activation checkpointing):")
            data = batches(vocab, seq, batch, steps * 2)
            first = last = None
            for step in range(1, steps + 1):
                t0 = time.perf_counter()
                for _ in range(2):
                    x, y = next(data)
                    loss = engine(x, y)
                    engine.backward(loss)
                    engine.step()
                last = float(loss.detach())
                first = last if first is None else first
                _progress(step, steps, last, time.perf_counter() - t0)
            print()
            nvme = engine.store.stats() if engine.store is not None else {}
            summary = {"first_loss": first, "last_loss": last, "nvme": nvme,
                       "prefetch_divergences": engine.scheduler.divergences}
        if nvme:
            print(f"NVMe traffic: {format_size(nvme.get('bytes_in', 0))} written, "
                  f"{format_size(nvme.get('bytes_out', 0))} read; peak {format_size(nvme.get('peak', 0))}")
        print(f"loss {first:.4f} -> {last:.4f}")
    return summary
