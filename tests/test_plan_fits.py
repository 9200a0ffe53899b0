"""Plans that fit, run (issue 15 item 5): with every tier's budget set to exactly what the plan
says it needs, training runs — the planner and the stores share one accounting (nesting, each
block's and file's rounding, NVMe rewrites in flight, the prefetch window)."""
from __future__ import annotations

import pytest
import torch

import zerotier
from zerotier.models import TinyGPT, batches

PLACEMENTS = {
    "all-device": {"params": "device", "gradients": "device", "optimizer": "device"},
    "optimizer-host": {"params": "device", "gradients": "device", "optimizer": "host"},
    "optimizer-nvme": {"params": "device", "gradients": "host", "optimizer": "nvme"},
    "params-host": {"params": "host", "gradients": "host", "optimizer": "host"},
    "params-nvme": {"params": "nvme", "gradients": "host", "optimizer": "nvme"},
}


class Nested(torch.nn.Module):
    """8 modules nested in each other, each owning a parameter (hostile trial #16)."""

    def __init__(self, depth=8):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(16, 16) / 4)
        self.inner = Nested(depth - 1) if depth > 1 else None

    def forward(self, x):
        x = torch.tanh(x @ self.w)
        return self.inner(x) if self.inner is not None else x


class NestedModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(Nested(4) for _ in range(3))

    def forward(self, x, y):
        for layer in self.layers:
            x = layer(x)
        return (x - y).square().mean()


def tiny_gpt():
    return TinyGPT(vocab=64, dim=32, layers=3, heads=2, seq=16)


def data(name):
    if name == "gpt":
        return list(batches(64, 16, 2, 3))
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 16, generator=gen), torch.randn(4, 16, generator=gen)) for _ in range(3)]


MODELS = {"gpt": tiny_gpt, "nested": NestedModel, "nested-each-module": NestedModel}
WRAP = {"nested-each-module": ["Nested"]}  # every nesting level its own unit


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("name", MODELS)
def test_budgets_at_exactly_the_plans_need_train(name, placement, tmp_path):
    cfg = {"offload": PLACEMENTS[placement], "tiers": {"nvme_path": str(tmp_path)},
           "train": {"max_grad_norm": 1.0, "wrap": WRAP.get(name, "auto")}, "prefetch": {"lookahead": 2}}
    torch.manual_seed(0)
    with zerotier.initialize(MODELS[name](), cfg) as engine:
        need = dict(engine.plan.need)
    cfg["tiers"].update({tier: max(need[tier], 1) for tier in ("device", "host")})
    if need["nvme"]:
        cfg["tiers"]["nvme"] = need["nvme"]
    torch.manual_seed(0)
    with zerotier.initialize(MODELS[name](), cfg) as engine:
        for x, y in data("gpt" if name == "gpt" else "nested"):
            engine.backward(engine(x, y))
            engine.step()
        assert engine.global_steps == 3
