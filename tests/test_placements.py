"""Every placement combination trains (issue 26 item 3): params x gradients x optimizer over
{device, host, nvme}, plus the optimizer split across host and NVMe, on a small transformers
GPT-2, each 3 clipped AdamW steps equal to plain PyTorch + torch.optim.AdamW on the same data.

None is refused today: a combination that some day cannot be honoured must be refused at
initialize with a ConfigError naming the offload key, which this test then has to list.
"""
from __future__ import annotations

import itertools

import pytest
import torch

import zerotier

transformers = pytest.importorskip("transformers")

TIERS = ("device", "host", "nvme")
OPTIMIZER = {"device": "device", "host": "host", "nvme": "nvme", "split": {"host": 0.5, "nvme": 0.5}}
STEPS, LR, WD, CLIP = 3, 1e-3, 0.01, 1.0


def gpt2():
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def data():
    return [torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(STEPS)]


@pytest.fixture(scope="module")
def reference():
    """Plain torch: (losses, final weights by name)."""
    model = gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses = []
    for x in data():
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("params,gradients,optimizer", list(itertools.product(TIERS, TIERS, OPTIMIZER)))
def test_every_placement_trains_like_torch(params, gradients, optimizer, reference, tmp_path):
    offload = {"params": params, "gradients": gradients, "optimizer": OPTIMIZER[optimizer]}
    cfg = {"offload": offload, "tiers": {"nvme_path": str(tmp_path)}, "train": {"max_grad_norm": CLIP},
           "optimizer": {"lr": LR, "weight_decay": WD}}
    losses = []
    with zerotier.initialize(gpt2(), cfg) as engine:
        placed = {k: v.value for k, v in engine.plan.placement.items()}
        for x in data():
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        weights = engine.parameters_fp32()
    for key in ("params", "gradients"):
        assert placed[key] == offload[key], f"{offload}: the plan placed {key} on {placed[key]}"
    ref_losses, ref_weights = reference
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6,
                               msg=lambda m: f"{offload}: per-step losses vs torch AdamW: {m}")
    assert weights.keys() <= ref_weights.keys()
    for name, w in weights.items():
        torch.testing.assert_close(w, ref_weights[name], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{offload}: weight {name} after {STEPS} steps: {m}")
