"""The user's model stays the truth ([Note: the user's model stays the truth] in restore.py):
model.state_dict() during training and the model after close() hold the trained weights, and a
model already managed by a live engine is refused."""
from __future__ import annotations

import pytest
import torch

import zerotier
from zerotier.errors import ConfigError
from zerotier.models import batches

from reference_runs import tiny_gpt

PLACEMENTS = {
    "device": {"params": "device", "gradients": "device", "optimizer": "device"},
    "params-host": {"params": "host", "gradients": "host", "optimizer": "host"},
    "params-nvme": {"params": "nvme", "gradients": "host", "optimizer": "nvme"},
}


def train(engine, steps=3):
    for x, y in batches(64, 16, 4, steps):
        engine.backward(engine(x, y))
        engine.step()


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.pins("design#the-user-s-model-stays-the-truth")
def test_state_dict_during_training_and_after_close_holds_the_trained_weights(placement, tmp_path):
    m = tiny_gpt()
    initial = {k: v.clone() for k, v in m.state_dict().items()}
    cfg = {"offload": PLACEMENTS[placement], "tiers": {"nvme_path": str(tmp_path)},
           "precision": {"param_dtype": "bf16"}}
    engine = zerotier.initialize(m, cfg)
    train(engine)
    trained = engine.parameters_fp32()
    during = m.state_dict()
    assert during.keys() == initial.keys()
    for name, value in trained.items():
        assert during[name].dtype == torch.float32, (name, during[name].dtype)  # the model's own dtype
        assert torch.equal(during[name], value), name
    assert torch.equal(during["head.weight"], trained["tok.weight"])  # tied: both names
    assert not torch.equal(during["tok.weight"], initial["tok.weight"]), "training changed nothing?"
    torch.save(during, tmp_path / "sd.pt")
    engine.close()
    assert list(p for p in tmp_path.iterdir() if p.name != "sd.pt") == [], "run directory left behind"
    after = m.state_dict()
    for name, value in trained.items():
        assert torch.equal(after[name], value), name
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in m.parameters())
    # the plain model now trains and evaluates like any PyTorch model
    x, y = next(batches(64, 16, 4, 1))
    m(x, y).backward()
    assert all(p.grad is not None for p in m.parameters())


@pytest.mark.pins("design#the-user-s-model-stays-the-truth")
def test_initialize_twice_is_a_clear_error_until_close():
    m = tiny_gpt()
    engine = zerotier.initialize(m)
    with pytest.raises(ConfigError, match="already managed by a zerotier engine.*close"):
        zerotier.initialize(m)
    train(engine, 1)
    engine.close()
    with zerotier.initialize(m) as again:  # the model holds its trained weights again
        train(again, 1)
