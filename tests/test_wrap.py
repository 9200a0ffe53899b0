"""Units follow use ([Note: units] in zerotier/state.py): models that read parameters outside
the module owning them train exactly like plain PyTorch under every placement.

Each model is trained 5 optimizer steps (accumulation 2, clipping 1.0) through the engine and
through torch.optim.AdamW; losses and final weights agree within 1e-5 relative (+1e-6).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import zerotier
from zerotier.errors import ConfigError

from reference_runs import adamw_reference

STEPS, ACCUM, LR = 5, 2, 3e-3
PLACEMENTS = {
    "device": {"params": "device", "gradients": "device", "optimizer": "device"},
    "params-host": {"params": "host", "gradients": "host", "optimizer": "host"},
    "params-nvme": {"params": "nvme", "gradients": "host", "optimizer": "nvme"},
}


class MHA(torch.nn.Module):
    """nn.MultiheadAttention reads out_proj.weight directly (out_proj's forward never runs)."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        # no biases: the key bias's true gradient is 0 (softmax ignores a constant shift), so its
        # rounding noise, which Adam normalizes to steps of size lr, would differ run to run
        self.attn = torch.nn.MultiheadAttention(16, 2, bias=False, batch_first=True)
        self.out = torch.nn.Linear(16, 1)

    def forward(self, x):
        h = self.inp(x)
        return self.out(self.attn(h, h, h, need_weights=False)[0]).square().mean()


class Encoder(torch.nn.Module):
    """nn.TransformerEncoder: a ModuleList of TransformerEncoderLayer (auto-wrapped), each with
    a MultiheadAttention inside."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        layer = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True,
                                                 bias=False)  # see MHA
        self.enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.out = torch.nn.Linear(16, 1)

    def forward(self, x):
        return self.out(self.enc(self.inp(x))).square().mean()


class ParentReadsChildWeight(torch.nn.Module):
    """The root multiplies by its child's weight (`h @ self.emb.weight.T`): a tied output head."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2))

    def forward(self, x):
        h = self.emb(x[..., 0].long().abs() % 32)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return (h @ self.emb.weight.T).logsumexp(-1).mean()


@dataclasses.dataclass
class BlockOut:
    hidden: torch.Tensor
    aux: torch.Tensor


class DataclassBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, h):
        y = torch.tanh(self.lin(h))
        return BlockOut(hidden=y, aux=y.square().mean())


class Opaque:
    """An output zerotier cannot see into."""

    def __init__(self, tensor):
        self._tensor = tensor

    def get(self):
        return self._tensor


class OpaqueBlock(DataclassBlock):
    def forward(self, h):
        return Opaque(torch.tanh(self.lin(h)))


class ReturnsObjects(torch.nn.Module):
    """Blocks returning a dataclass and a plain object."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.blocks = torch.nn.ModuleList([DataclassBlock(), DataclassBlock()])
        self.opaque = torch.nn.ModuleList([OpaqueBlock(), OpaqueBlock()])
        self.out = torch.nn.Linear(16, 1)

    def forward(self, x):
        h, aux = self.inp(x), 0.0
        for block in self.blocks:
            o = block(h)
            h, aux = o.hidden, aux + o.aux
        for block in self.opaque:
            h = block(h).get()
        return self.out(h).square().mean() + aux


def per_module(name, module):
    """A unit per module owning parameters: nn.MultiheadAttention then reads out_proj.weight while
    out_proj's unit is released (out_proj's own forward never runs): the read fetches it ([Note: the
    parameter surface]; refused before the surface existed)."""
    return any(p is not None for p in module._parameters.values())


MODELS = {"multihead-attention": (MHA, "auto"), "multihead-attention-per-module": (MHA, per_module),
          "multihead-attention-wrapped": (MHA, ("MultiheadAttention",)),
          "transformer-encoder": (Encoder, "auto"), "parent-reads-child-weight": (ParentReadsChildWeight, "auto"),
          "returns-objects": (ReturnsObjects, "auto")}


def data():
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(4, 6, 8, generator=gen) for _ in range(STEPS * ACCUM)]


def reference(factory):
    torch.manual_seed(0)
    return adamw_reference(factory(), data(), LR, ACCUM)


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("name", MODELS)
def test_parameters_read_outside_their_module_train_like_torch(name, placement, tmp_path):
    factory, wrap = MODELS[name]
    ref_losses, ref_weights = reference(factory)
    torch.manual_seed(0)
    cfg = {"offload": PLACEMENTS[placement], "tiers": {"nvme_path": str(tmp_path)},
           "optimizer": {"lr": LR, "weight_decay": 0.01},
           "train": {"grad_accum_steps": ACCUM, "max_grad_norm": 1.0}}
    if not callable(wrap):
        cfg["train"]["wrap"] = wrap
    losses = []
    with zerotier.initialize(factory(), cfg, wrap=wrap if callable(wrap) else None) as engine:
        for x in data():
            loss = engine(x)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        weights = engine.parameters_fp32()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    for key in ref_weights:
        torch.testing.assert_close(weights[key], ref_weights[key], rtol=1e-5, atol=1e-6, msg=key)


def test_auto_wrap_makes_units_of_repeated_blocks():
    units = zerotier.state.build_units(Encoder())
    assert [u.name for u in units] == ["", "enc.layers.0", "enc.layers.1"]
    mha_units = zerotier.state.build_units(MHA(), ("MultiheadAttention",))
    assert [u.name for u in mha_units] == ["", "attn"]
    assert sum(u.numel for u in mha_units) == sum(p.numel() for p in MHA().parameters())


def test_wrap_naming_a_class_the_model_lacks_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"train.wrap names \['LlamaDecoderLayer'\].*its classes: .*Linear"):
        zerotier.initialize(MHA(), {"train": {"wrap": ["LlamaDecoderLayer"]}})


def test_a_module_shared_by_two_blocks_is_fetched_by_both():
    """A layer shared by two repeated blocks (blocks[2].lin is blocks[0].lin): both blocks are users of
    the owning unit, so each one's forward fetches it (named_modules() lists a shared module once)."""
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, h):
            return h + torch.tanh(self.lin(h))

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(Block() for _ in range(3))

    net = Net()
    net.blocks[2].lin = net.blocks[0].lin
    units = {u.name: u for u in zerotier.state.build_units(net)}
    assert units["blocks.0"].modules == ("blocks.0", "blocks.2")
    assert "blocks.2" not in units  # its only parameters belong to blocks.0's unit
