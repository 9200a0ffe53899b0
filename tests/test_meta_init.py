"""Models built on the meta device ([Note: meta-device models] in zerotier/materialize.py):
materialized unit by unit into their tiers, deterministically whatever the placement."""
from __future__ import annotations

import pytest
import torch

import zerotier
from zerotier.errors import ConfigError
from zerotier.models import TinyGPT, batches, init_tiny_gpt

PLACEMENTS = {
    "device": {"params": "device", "gradients": "device", "optimizer": "device"},
    "params-host": {"params": "host", "gradients": "host", "optimizer": "host"},
    "params-nvme": {"params": "nvme", "gradients": "host", "optimizer": "nvme"},
}


def meta_model():
    with torch.device("meta"):
        return TinyGPT(vocab=64, dim=32, layers=2, heads=2, seq=16)


def weights_after_training(placement, tmp_path, steps=3):
    torch.manual_seed(7)
    cfg = {"offload": PLACEMENTS[placement], "tiers": {"nvme_path": str(tmp_path)}}
    model = meta_model()
    with zerotier.initialize(model, cfg, init_fn=init_tiny_gpt) as engine:
        initial = engine.parameters_fp32()
        for x, y in batches(64, 16, 2, steps):
            engine.backward(engine(x, y))
            engine.step()
        return initial, engine.parameters_fp32(), model


def test_meta_model_materializes_the_same_weights_under_every_placement(tmp_path):
    runs = {name: weights_after_training(name, tmp_path) for name in PLACEMENTS}
    first_init, first_trained, _ = runs["device"]
    assert all(t.abs().sum() > 0 for n, t in first_init.items() if not n.endswith("bias")), "left uninitialized"
    for name, (initial, trained, _) in runs.items():
        for key in first_init:
            assert torch.equal(initial[key], first_init[key]), (name, key)
            torch.testing.assert_close(trained[key], first_trained[key], rtol=1e-5, atol=1e-6, msg=f"{name} {key}")


def test_meta_model_trains_like_a_normal_build_of_the_same_weights(tmp_path):
    """The materialized model trains exactly like the same weights loaded into a normally built model."""
    initial, trained, model = weights_after_training("params-host", tmp_path)
    assert all(not p.is_meta for p in model.parameters())  # materialized (close() warns it keeps them)
    ref = TinyGPT(vocab=64, dim=32, layers=2, heads=2, seq=16)
    ref.load_state_dict(initial, strict=False)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    for x, y in batches(64, 16, 2, 3):
        ref(x, y).backward()
        opt.step()
        opt.zero_grad()
    for key, value in trained.items():
        torch.testing.assert_close(value, dict(ref.named_parameters())[key].detach(), rtol=1e-5, atol=1e-6,
                                   msg=key)


def test_init_fn_initializes_modules_without_reset_parameters():
    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.empty(8))

        def forward(self, x):
            return (x * self.w).square().mean()

    with torch.device("meta"):
        model = Scale()
    with pytest.raises(ConfigError, match=r"module '<root>' \(Scale\) was built on the meta device and has no "
                                          r"reset_parameters\(\): pass .*init_fn"):
        zerotier.initialize(model)

    def init_fn(module):
        if isinstance(module, Scale):
            module.w.fill_(0.5)
    with torch.device("meta"):
        model = Scale()
    with zerotier.initialize(model, init_fn=init_fn) as engine:
        assert torch.equal(engine.parameters_fp32()["w"], torch.full((8,), 0.5))
        engine.backward(engine(torch.ones(2, 8)))
        engine.step()


def test_modules_reset_parameters_initialize_a_meta_model():
    """Without init_fn every module with meta parameters must have reset_parameters(): a stack of
    torch layers needs nothing more."""
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 1))
    torch.manual_seed(0)
    with zerotier.initialize(model, {"offload": PLACEMENTS["params-host"]}) as engine:
        weights = engine.parameters_fp32()
        assert weights["1.weight"].eq(1).all() and weights["1.bias"].eq(0).all()  # LayerNorm's reset
        assert weights["0.weight"].abs().max() <= 1 / 8 ** 0.5 + 1e-6  # Linear's kaiming_uniform bound
        engine.backward(engine(torch.randn(4, 8)).square().mean())
        engine.step()


def _linear_only_init(module):
    """An init_fn that covers nn.Linear only, leaving LayerNorm and Embedding to their own reset."""
    if isinstance(module, torch.nn.Linear):
        torch.nn.init.normal_(module.weight, std=0.02)  # bias left to the module


@pytest.mark.parametrize("placement", ["params-host", "params-nvme"])
def test_init_fn_covering_some_modules_leaves_no_undefined_memory(placement, tmp_path):
    """Issue 21: tensors init_fn did not set in full get the module's reset_parameters(), as a model
    built on the CPU would have them before the user's init ran ([Note: meta-device models])."""
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 4))
    torch.manual_seed(0)
    cfg = {"offload": PLACEMENTS[placement], "tiers": {"nvme_path": str(tmp_path)}}
    with zerotier.initialize(model, cfg, init_fn=_linear_only_init) as engine:
        w = engine.parameters_fp32()
        assert w["1.weight"].eq(1).all() and w["1.bias"].eq(0).all()  # LayerNorm's reset_parameters
        assert w["0.weight"].isfinite().all() and w["0.weight"].std() > 0.5  # Embedding: normal(0, 1)
        assert w["2.weight"].std() < 0.05  # init_fn's normal(0, 0.02) kept, not reset over
        bound = 1 / 8 ** 0.5 + 1e-6
        assert w["2.bias"].isfinite().all() and w["2.bias"].abs().max() <= bound  # Linear's own bias init
        x = torch.randint(0, 16, (4, 3))
        engine.backward(engine(x).square().mean())
        engine.step()
        assert all(t.isfinite().all() for t in engine.parameters_fp32().values())


def test_parameters_nothing_initializes_are_named():
    """A module with no reset_parameters() whose parameters init_fn leaves unset is a ConfigError
    naming them, never uninitialized memory."""
    class Pair(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Parameter(torch.empty(4))
            self.b = torch.nn.Parameter(torch.empty(4, 4))

        def forward(self, x):
            return (x * self.a) @ self.b

    def init_a_only(module):
        if isinstance(module, Pair):
            module.a.fill_(1.0)
            module.b[0].fill_(1.0)  # one row of b: b is still not set in full

    with torch.device("meta"):
        model = torch.nn.Sequential(Pair(), torch.nn.Linear(4, 1))
    with pytest.raises(ConfigError, match=r"module '0' \(Pair\): init_fn left b unset \(or not set in full\) "
                                          r"and Pair has no reset_parameters\(\): set them in init_fn"):
        zerotier.initialize(model, {"offload": PLACEMENTS["params-host"]}, init_fn=init_a_only)
