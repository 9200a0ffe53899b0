"""The plain-PyTorch runs the engine's runs are held against (not a test module: the tests import it).

`adamw_reference` is torch.optim.AdamW (weight decay 0.01) over micro-batches, gradients
accumulated `accum` to a step and clipped to norm 1.0. `tiny_gpt` is the small seeded model the
tests train, PLACEMENTS the offload sections they train under. The data-parallel case
(tests/test_engine_dist.py on gloo ranks, tests/test_cuda_dist.py on two GPUs) shares tiny_gpt
and its global batches: each rank trains on its half of every global batch, the reference on
the whole batch.
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator

import torch

from zerotier.models import TinyGPT

VOCAB, SEQ, GLOBAL_BATCH, STEPS, ACCUM, LR = 64, 16, 4, 4, 2, 3e-3  # the data-parallel case
# offload sections: the engine's runs under each are held against the reference
PLACEMENTS = {name: {"params": params, "gradients": gradients, "optimizer": optimizer}
              for name, (params, gradients, optimizer) in {
                  "all-device": ("device", "device", "device"),
                  "optimizer-host": ("device", "device", "host"),
                  "optimizer-nvme": ("device", "host", "nvme"),
                  "params-host": ("host", "host", "host"),
                  "params-nvme": ("nvme", "host", "nvme"),
              }.items()}


def tiny_gpt():
    """TinyGPT with vocab 64, dim 32, 2 layers, 2 heads and sequence 16, from seed 0."""
    torch.manual_seed(0)
    return TinyGPT(vocab=VOCAB, dim=32, layers=2, heads=2, seq=SEQ)


def global_batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS * ACCUM):
        data = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=gen)
        yield data[:, :-1], data[:, 1:]


def adamw_reference(model: torch.nn.Module, micro_batches: Iterable, lr: float, accum: int,
                    loss_of: Callable | None = None, clip: float | None = 1.0, optimizer: Callable | None = None
                    ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train `model` on `micro_batches`: a micro-batch's loss is `loss_of(model, batch)`, by default
    `model(*batch)` for a tuple and `model(batch)` else; `clip` None: no clipping; `optimizer(params)`
    replaces AdamW (another rule's reference, e.g. test_lion.py's). Returns each micro-batch's loss
    and the final weights by name (float32 copies, on the CPU)."""
    opt = (optimizer or (lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=0.01)))(model.parameters())
    losses = []
    for i, batch in enumerate(micro_batches):
        if loss_of is not None:
            loss = loss_of(model, batch)
        else:
            loss = model(*batch) if isinstance(batch, tuple) else model(batch)
        (loss / accum).backward()
        losses.append(float(loss.detach()))
        if (i + 1) % accum == 0:
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
    return losses, {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}


def step_means(losses: list[float], accum: int) -> list[float]:
    """Each optimizer step's mean loss over its `accum` micro-batches (summed in order)."""
    return [sum(losses[i:i + accum]) / accum for i in range(0, len(losses), accum)]
