"""zerotier on the oldest torch that pyproject.toml admits (torch>=2.4), checked on CI's torch.

Where torch 2.4 lacks an API zerotier uses on newer torch, zerotier takes a version-guarded
path; each test here removes the newer API for the duration of the test, so CI runs the 2.4
path too."""
import torch
from torch import nn

import zerotier


class Net(nn.Module):
    def __init__(self, dim=8, depth=3):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(dim, dim) for _ in range(depth)])
        self.head = nn.Linear(dim, 1)

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x).pow(2).mean()


def test_state_dict_holds_trained_weights_without_the_public_post_hook(monkeypatch):
    """torch 2.4 has nn.Module.register_state_dict_post_hook only as the private
    _register_state_dict_hook (public from 2.5): initialize still works, and model.state_dict()
    still holds the trained weights, not the released buffers under host-resident parameters."""
    monkeypatch.delattr(nn.Module, "register_state_dict_post_hook")
    torch.manual_seed(0)
    model = Net()
    cfg = {"optimizer": {"lr": 1e-2, "weight_decay": 0.0}, "offload": {"params": "host"}}
    with zerotier.initialize(model, cfg) as engine:
        for _ in range(2):
            engine.backward(engine(torch.randn(4, 8)))
            engine.step()
        trained = engine.parameters_fp32()
        state_dict = model.state_dict()
    assert trained.keys() == state_dict.keys()
    for name, value in trained.items():
        torch.testing.assert_close(state_dict[name], value, rtol=0, atol=0)
