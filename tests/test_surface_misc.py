"""Issue 21, the rows outside the parameter surface: ordinary PyTorch models and loops that
zerotier refused with the wrong message or a raw torch error (ModuleDict blocks, BatchNorm and
fp32 inputs under bf16, autograd.grad(create_graph=True), torch.func, a Ctrl-C inside an I/O
callback). Each row of docs/errors.md names its test here."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import zerotier
from zerotier.errors import ZerotierError

HOST = {"params": "host", "gradients": "host", "optimizer": "host"}
NVME = {"params": "nvme", "gradients": "host", "optimizer": "nvme"}


def config(tmp_path, offload=HOST, **sections):
    return {"offload": offload, "tiers": {"nvme_path": str(tmp_path)}, "optimizer": {"lr": 1e-2, "weight_decay": 0.0},
            **sections}


class Block(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.ln = torch.nn.LayerNorm(dim)
        self.fc = torch.nn.Linear(dim, dim)

    def forward(self, h):
        return h + torch.tanh(self.fc(self.ln(h)))


class DictNet(torch.nn.Module):
    """Repeated blocks in a ModuleDict, called in an order other than registration."""

    def __init__(self, dim=64, blocks=4):
        super().__init__()
        self.inp = torch.nn.Linear(8, dim)
        self.blocks = torch.nn.ModuleDict({f"b{i}": Block(dim) for i in range(blocks)})
        self.head = torch.nn.Linear(dim, 1)

    def forward(self, x):
        h = self.inp(x)
        for name in reversed(list(self.blocks)):
            h = self.blocks[name](h)
        return self.head(h).square().mean()


def torch_reference(model_fn, data, lr=1e-2):
    torch.manual_seed(0)
    model = model_fn()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    for x in data:
        model(x).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ---------------------------------------------------------------- ModuleDict blocks

@pytest.mark.parametrize("offload", [HOST, NVME], ids=["host", "nvme"])
def test_moduledict_blocks_are_units_and_fit_where_modulelist_blocks_fit(offload, tmp_path):
    """Issue 21: blocks in a ModuleDict were not units under the default wrap, so the whole model
    was one unit, and a device budget that holds one block was refused as 'needs more device'.
    They are units as a ModuleList's are ([Note: units]); the run trains like torch."""
    data = [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    ref = torch_reference(DictNet, data)
    torch.manual_seed(0)
    cfg = config(tmp_path, offload, tiers={"nvme_path": str(tmp_path), "device": "160KiB"})
    with zerotier.initialize(DictNet(), cfg) as engine:
        assert [u.name for u in engine.units] == ["", "blocks.b0", "blocks.b1", "blocks.b2", "blocks.b3"]
        for x in data:
            engine.backward(engine(x))
            engine.step()
        got = engine.parameters_fp32()
    for name, value in ref.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)
