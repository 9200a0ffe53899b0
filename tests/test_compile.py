"""torch.compile on a zerotier model (issue 26 item 4; [Note: compiled units] in zerotier/engine/hooks.py).

FSDP2's recipe, per wrapped block: `block.compile()` (or `torch.compile(block)`) before or after
zerotier.initialize. The engine's hooks run eagerly (a graph break at each), so every unit is
fetched before the compiled code reads it and released after; inside the compiled region a
managed parameter is a plain one. Checked at 1e-5 against plain torch with the same blocks compiled
(Inductor's fused kernels round differently from eager, and Adam's first steps turn a near-zero
gradient's ulps into a visible weight difference, so eager is compared on the losses only), with
parameters on host and on NVMe, and for recompilation: one graph per block code, not one per unit.
"""
from __future__ import annotations

import pytest
import torch

import zerotier
from zerotier.models import TinyGPT, batches

STEPS, LAYERS, LR, CLIP = 3, 3, 1e-3, 1.0


def tiny(freeze=False):
    """freeze: each block's MLP frozen (a frozen unit beside the trainable one in the same block)."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, dim=32, layers=LAYERS, heads=2, seq=16)
    if freeze:
        for block in model.blocks:
            block.fc.requires_grad_(False)
    return model


def run(params, tmp_path, compile_blocks=None, when="after", freeze=False):
    """Losses and fp32 weights of STEPS clipped AdamW steps; compile_blocks(model) compiles its blocks
    before or after initialize."""
    tmp_path.mkdir(exist_ok=True)
    model = tiny(freeze)
    if compile_blocks and when == "before":
        compile_blocks(model)
    cfg = {"offload": {"params": params, "gradients": "host", "optimizer": "host"},
           "tiers": {"nvme_path": str(tmp_path)}, "train": {"max_grad_norm": CLIP}, "optimizer": {"lr": LR}}
    losses = []
    with zerotier.initialize(model, cfg) as engine:
        if compile_blocks and when == "after":
            compile_blocks(engine.module)
        for x, y in batches(64, 16, 4, STEPS):
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses, engine.parameters_fp32()


def torch_run(compile_blocks, freeze=False):
    """The same loop in plain torch + torch.optim.AdamW."""
    model = tiny(freeze)
    compile_blocks(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for x, y in batches(64, 16, 4, STEPS):
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def compile_each_block(backend):
    def compile_blocks(model):
        for block in model.blocks:
            block.compile(backend=backend)
    return compile_blocks


@pytest.fixture(autouse=True)
def fresh_dynamo():
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def assert_close(ours, ref, what, weights=True):
    torch.testing.assert_close(torch.tensor(ours[0]), torch.tensor(ref[0]), rtol=1e-5, atol=1e-6,
                               msg=lambda m: f"{what}: losses: {m}")
    for name, w in ours[1].items() if weights else ():  # the trained ones (parameters_fp32)
        torch.testing.assert_close(w, ref[1][name], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{what}: weight {name}: {m}")


@pytest.mark.parametrize("params,backend,when", [("nvme", "inductor", "after"), ("host", "aot_eager", "after"),
                                                 ("nvme", "aot_eager", "before")])
def test_compiled_blocks_train_like_eager(params, backend, when, tmp_path):
    compiled = run(params, tmp_path / "compiled", compile_each_block(backend), when)
    what = f"params on {params}, blocks compiled ({backend}) {when} initialize"
    assert_close(compiled, torch_run(compile_each_block(backend)), f"{what}, vs torch with the same blocks compiled")
    assert_close(compiled, run(params, tmp_path / "eager"), f"{what}, vs zerotier eager", weights=False)


def test_compiled_blocks_with_frozen_layers_train_like_torch(tmp_path):
    """A block holding a frozen unit (LoRA's shape): its release-after-backward hook runs eagerly too."""
    compiled = run("nvme", tmp_path, compile_each_block("aot_eager"), freeze=True)
    assert_close(compiled, torch_run(compile_each_block("aot_eager"), freeze=True),
                 "frozen MLPs on NVMe, blocks compiled (aot_eager)")


def test_compiled_blocks_do_not_recompile_per_unit(tmp_path):
    """The surface's sorting and the engine's hooks are not traced: without that, dynamo guards on
    each parameter's unit index and recompiles the shared block code once per unit (18 graphs here
    before [Note: compiled units], 1 after)."""
    from torch._dynamo.utils import counters
    run("host", tmp_path, compile_each_block("eager"))
    graphs = counters["stats"]["unique_graphs"]
    assert graphs < LAYERS, (f"{graphs} graphs compiled for {LAYERS} identical blocks over {STEPS} steps: the block "
                         f"code recompiles per unit (dynamo traced zerotier's hooks or parameter surface)")


@pytest.mark.parametrize("first,then", [("device", "host"), ("device", "nvme"), ("host", "device")])
def test_whole_model_compiled_under_another_placement_earlier_trains_like_torch(first, then, tmp_path):
    """Issue 37: the whole model compiled (model.compile()) under an engine with params on the device,
    then the same model class under an engine with params on host or NVMe, in the same process: the
    second reran the first's cached code, which fetches nothing ("data is not allocated yet"). Code
    traced under one hook layout recompiles under another ([Note: compiled code and the hook layout]
    in zerotier/engine/surface.py); both engines train like torch."""
    def whole(model):
        model.compile(backend="aot_eager")
    reference = torch_run(whole)
    assert_close(run(first, tmp_path / "first", whole), reference, f"whole model compiled, params on {first}")
    assert_close(run(then, tmp_path / "then", whole), reference,
                 f"whole model compiled, params on {then} after an engine with params on {first}")


def test_engines_of_one_layout_share_compiled_code(tmp_path):
    """Two engines with params on host compile the whole model once: the layout's class is shared."""
    from torch._dynamo.utils import counters

    def whole(model):
        model.compile(backend="eager")
    run("host", tmp_path / "a", whole)
    graphs = counters["stats"]["unique_graphs"]
    run("host", tmp_path / "b", whole)
    assert counters["stats"]["unique_graphs"] == graphs, "the second engine of the same layout recompiled"
