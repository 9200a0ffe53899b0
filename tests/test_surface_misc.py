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


# ---------------------------------------------------------------- bf16: BatchNorm, fp32 inputs

class NormNet(torch.nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(dim if i else 8, dim),
                                                              torch.nn.BatchNorm1d(dim), torch.nn.ReLU())
                                          for i in range(2))
        self.head = torch.nn.Linear(dim, 1)

    def forward(self, x, target):
        for block in self.blocks:
            x = block(x)
        return F.mse_loss(self.head(x).squeeze(-1), target)


def bf16_reference(data, lr=1e-2):
    """What FSDP2 with MixedPrecisionPolicy(param_dtype=bf16) computes: fp32 masters stepped by
    AdamW, a bf16 copy of the model (buffers included) for compute, inputs cast to bf16."""
    torch.manual_seed(0)
    master = NormNet()
    compute = NormNet().to(torch.bfloat16)
    opt = torch.optim.AdamW(master.parameters(), lr=lr, weight_decay=0.0)
    for x, target in data:
        with torch.no_grad():
            for p_c, p_m in zip(compute.parameters(), master.parameters()):
                p_c.copy_(p_m)
        compute(x.bfloat16(), target.bfloat16()).backward()
        for p_c, p_m in zip(compute.parameters(), master.parameters()):
            p_m.grad = p_c.grad.float()
            p_c.grad = None
        opt.step()
        opt.zero_grad()
    return master, compute


@pytest.mark.parametrize("offload", [HOST, NVME], ids=["host", "nvme"])
def test_batchnorm_and_fp32_inputs_under_bf16_compute_like_fsdp_mixed_precision(offload, tmp_path):
    """Issue 21: under precision.param_dtype = bf16, BatchNorm's fp32 running stats and fp32 inputs
    failed with torch's 'expected scalar type BFloat16 but found Float'. As FSDP2's mixed precision
    does, floating inputs are cast to bf16 and a module's running stats follow its parameters
    ([Note: buffers and inputs in low precision] in engine.py); close() gives the stats back in
    fp32, and the model then runs in plain fp32."""
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 8, generator=gen), torch.randn(16, generator=gen)) for _ in range(4)]
    master, compute = bf16_reference(data)
    torch.manual_seed(0)
    model = NormNet()
    with zerotier.initialize(model, config(tmp_path, offload, precision={"param_dtype": "bf16"})) as engine:
        for x, target in data:  # fp32 inputs, as the user's data loader gives them
            engine.backward(engine(x, target))
            engine.step()
        got = engine.parameters_fp32()
        stats = {n: b.float().clone() for n, b in model.named_buffers() if b.is_floating_point()}
    for name, p in master.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=1e-2, atol=1e-3, msg=name)
    for name, b in compute.named_buffers():
        if b.is_floating_point():
            assert b.abs().sum() > 0 and torch.equal(stats[name], b.float()), name  # bf16 stats, updated alike
    assert all(b.dtype == torch.float32 for n, b in model.named_buffers() if "running" in n)
    model.eval()
    model(data[0][0], data[0][1])  # plain fp32 PyTorch again


# ---------------------------------------------------------------- double backward, torch.func

class TanhNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x).square().mean()


def penalty_run(model, step, wrt):
    """Three steps of loss + |d loss / d wrt|^2 (a gradient penalty: WGAN-GP on the input, or on the
    parameters), the gradient taken with create_graph=True."""
    for i in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i)).requires_grad_()
        loss = model(x)
        grads = torch.autograd.grad(loss, [x] if wrt == "input" else list(model.parameters()), create_graph=True)
        step(loss + sum(g.square().sum() for g in grads))


@pytest.mark.parametrize("wrt", ["input", "params"])
def test_gradient_penalty_with_params_on_the_device_trains_like_torch(wrt, tmp_path):
    """The fix the refusal below names: with parameters on the device (not streamed), a double
    backward trains exactly as in torch."""
    torch.manual_seed(0)
    ref = TanhNet()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)

    def torch_step(loss):
        loss.backward()
        opt.step()
        opt.zero_grad()
    penalty_run(ref, torch_step, wrt)
    torch.manual_seed(0)
    model = TanhNet()
    device = {"params": "device", "gradients": "device", "optimizer": "device"}
    with zerotier.initialize(model, config(tmp_path, device)) as engine:
        def engine_step(loss):
            engine.backward(loss)
            engine.step()
        penalty_run(model, engine_step, wrt)
        got = engine.parameters_fp32()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)


DOUBLE_BACKWARD = (r"a backward with create_graph=True \(torch.autograd.grad\(..., create_graph=True\) for a gradient "
                   r"penalty .*\) reached parameters zerotier streams .*Keep the parameters on the device: "
                   r"offload.params = \"device\" with zero.stage 1 or 2")


@pytest.mark.parametrize("offload", [HOST, NVME], ids=["host", "nvme"])
@pytest.mark.parametrize("how", ["autograd.grad", "backward"])
@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True will create a reference cycle:UserWarning")
def test_double_backward_through_streamed_params_is_refused(offload, how, tmp_path):
    """Issue 21: autograd.grad(create_graph=True) over streamed parameters was blamed on 'a plain
    loss.backward() in the same window' (or raised torch's 'not used in the graph'). It is a
    ZerotierError naming the fix, raised where the double backward starts."""
    torch.manual_seed(0)
    with zerotier.initialize(TanhNet(), config(tmp_path, offload)) as engine:
        x = torch.randn(4, 8).requires_grad_()
        loss = engine(x)
        with pytest.raises(ZerotierError, match=DOUBLE_BACKWARD):
            if how == "autograd.grad":
                torch.autograd.grad(loss, x, create_graph=True)
            else:
                loss.backward(create_graph=True)
        engine.backward(engine(torch.randn(4, 8)))  # the engine still trains
        assert engine.step()


def test_torch_func_over_managed_params_is_refused_and_vmap_over_the_model_works(tmp_path):
    """Issue 21: torch.func.grad over functional_call(model, params) was blamed on 'frozen when
    zerotier.initialize ran'. It is a ZerotierError naming what to do; torch.func.vmap over the
    model (its own parameters) computes what a loop computes."""
    from torch.func import functional_call, grad, vmap
    torch.manual_seed(0)
    model = TanhNet()
    with zerotier.initialize(model, config(tmp_path, HOST)) as engine:
        x = torch.randn(4, 8)
        params = {name: p.detach().clone() for name, p in engine.parameters_fp32().items()}
        with pytest.raises(ZerotierError, match=r"parameter 'blocks.0.weight' is replaced by a plain tensor in this "
                                                r"forward \(torch.func.functional_call, .*engine.close\(\) first"):
            grad(lambda p: functional_call(model, p, (x,)))(params)
        with torch.no_grad():
            batched = vmap(lambda row: engine(row[None]))(x)
            looped = torch.stack([engine(row[None]) for row in x])
        torch.testing.assert_close(batched, looped)
        engine.backward(engine(x))
        assert engine.step()


INPUT_TRANSFORMS = {
    "grad": lambda f, x: torch.func.grad(f)(x),
    "jacrev": lambda f, x: torch.func.jacrev(f)(x),
    "vmap(grad)": lambda f, x: torch.func.vmap(torch.func.grad(lambda row: f(row[None])))(x),
    "vjp": lambda f, x: torch.func.vjp(f, x)[1](torch.tensor(1.0))[0],
    "jvp": lambda f, x: torch.func.jvp(f, (x,), (torch.ones_like(x),))[1],
    "jacfwd": lambda f, x: torch.func.jacfwd(f)(x),
    "hessian": lambda f, x: torch.func.hessian(f)(x[0]),
}


@pytest.mark.parametrize("offload", [HOST, NVME, {"params": "device"}], ids=["host", "nvme", "device"])
def test_torch_func_over_the_inputs_matches_torch_and_training_goes_on(offload, tmp_path):
    """Issue 37: torch.func.grad / jacrev / vmap(grad) with respect to the inputs, params on host, failed
    with functorch's in-place error from the unit fetch. Every transform over the inputs equals plain
    torch's, leaves no unit resident, and the engine trains like torch.optim.AdamW afterwards
    ([Note: torch.func over the inputs] in zerotier/engine/hooks.py)."""
    torch.manual_seed(0)
    reference, model = TanhNet(), TanhNet()
    model.load_state_dict(reference.state_dict())
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0)
    x = torch.randn(4, 8)
    with zerotier.initialize(model, config(tmp_path, offload)) as engine:
        streamed = [u.index for u in engine.param_units if engine.params.streamed[u.index]]
        assert bool(streamed) == (offload["params"] != "device")
        for name, transform in INPUT_TRANSFORMS.items():
            torch.testing.assert_close(transform(model, x), transform(reference, x), rtol=1e-6, atol=1e-7,
                                       msg=lambda m, name=name: f"{name}: {m}")
            assert all(engine.params.state[i].name == "RELEASED" for i in streamed), f"{name} left units resident"
            assert all(p.grad is None for p in model.parameters()), f"{name} gave the parameters gradients"
        for _ in range(2):
            engine.backward(engine(x))
            assert engine.step()
            reference(x).backward()
            opt.step()
            opt.zero_grad()
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.detach(), dict(reference.named_parameters())[name].detach(),
                                       rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("offload", [HOST, NVME], ids=["host", "nvme"])
def test_torch_func_over_the_inputs_differentiated_again_is_refused_with_params_streamed(offload, tmp_path):
    """What would read parameters released after a transform's backward is refused, naming the fix:
    reverse mode over reverse mode (jacrev(jacrev)), and a loss.backward() through a gradient a
    transform returned (a gradient penalty). The engine trains on afterwards."""
    torch.manual_seed(0)
    model = TanhNet()
    with zerotier.initialize(model, config(tmp_path, offload)) as engine:
        x = torch.randn(4, 8)
        with pytest.raises(ZerotierError, match=r"runs under 2 nested reverse-mode torch.func transforms .*"
                                                r"torch.func.hessian.*offload.params = \"device\""):
            torch.func.jacrev(torch.func.jacrev(model))(x[0])
        with pytest.raises(ZerotierError, match=r"a gradient torch.func computed over the inputs of module .* is "
                                                r"differentiated again .*offload.params = \"device\""):
            (model(x) + torch.func.grad(model)(x).square().sum()).backward()
        engine.optimizer.zero_grad()
        engine.backward(engine(x))
        assert engine.step()


# ---------------------------------------------------------------- sparse gradients (issue 37 row 5)

class SparseEmbeddingNet(torch.nn.Module):
    def __init__(self, cls=torch.nn.Embedding):
        super().__init__()
        self.emb = cls(12, 8, sparse=True)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, ids):
        h = self.emb(ids) if isinstance(self.emb, torch.nn.Embedding) else self.emb(ids, torch.tensor([0, 2]))
        return self.head(h).square().mean()


@pytest.mark.parametrize("cls", [torch.nn.Embedding, torch.nn.EmbeddingBag])
def test_sparse_embedding_is_refused_at_initialize_naming_the_module(cls, tmp_path):
    """Issue 37: nn.Embedding(sparse=True) failed in the first backward inside the gradient store
    ("reshape is not implemented for sparse tensors"). torch's AdamW refuses sparse gradients at
    its step; zerotier refuses at initialize, naming the module, and leaves the model as built.
    A frozen sparse embedding (no gradient) trains."""
    ids = torch.tensor([1, 5, 5, 7])
    torch.manual_seed(0)
    reference = SparseEmbeddingNet(cls)
    reference(ids).backward()
    with pytest.raises(RuntimeError, match="Adam does not support sparse gradients"):
        torch.optim.AdamW(reference.parameters()).step()
    torch.manual_seed(0)
    model = SparseEmbeddingNet(cls)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ZerotierError, match=rf"module 'emb' \({cls.__name__}\) was built with sparse=True: .*"
                                            r"Build it with sparse=False .*or freeze its weight"):
        zerotier.initialize(model, config(tmp_path, HOST))
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) and type(p) is torch.nn.Parameter
    model.emb.weight.requires_grad_(False)
    with zerotier.initialize(model, config(tmp_path, HOST)) as engine:
        engine.backward(engine(ids))
        assert engine.step()


class FunctionalSparseNet(torch.nn.Module):
    """A dense nn.Embedding read through the functional F.embedding(..., sparse=...)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(12, 8)
        self.head = torch.nn.Linear(8, 1)
        self.sparse = True

    def forward(self, ids):
        return self.head(F.embedding(ids, self.emb.weight, sparse=self.sparse)).square().mean()


@pytest.mark.parametrize("loop", ["engine", "plain"])
def test_functional_sparse_gradient_is_refused_naming_the_parameter(loop, tmp_path):
    """Issue 37 follow-up: F.embedding(..., sparse=True) on a dense module's weight (not caught at
    initialize) failed inside the gradient store ("reshape is not implemented for sparse tensors").
    The gradient hook refuses it, naming the parameter, before it enters the store; after
    zero_grad(), dense training matches torch's AdamW on the same steps."""
    ids = torch.tensor([1, 5, 5, 7])
    data = [torch.tensor([0, 3, 3, 9]), torch.tensor([2, 5, 11, 5])]
    torch.manual_seed(0)
    reference = FunctionalSparseNet()
    reference.sparse = False
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0)
    for x in data:
        reference(x).backward()
        opt.step()
        opt.zero_grad()
    torch.manual_seed(0)
    model = FunctionalSparseNet()
    with zerotier.initialize(model, config(tmp_path, HOST)) as engine:
        with pytest.raises(ZerotierError, match=r"parameter 'emb.weight' got a sparse gradient .*"
                                                r"Adam does not support sparse gradients.*sparse=False"):
            if loop == "engine":
                engine.backward(engine(ids))
            else:
                model(ids).backward()
        engine.zero_grad()
        model.sparse = False
        for x in data:
            if loop == "engine":
                engine.backward(engine(x))
                assert engine.step()
            else:
                model(x).backward()
                engine.optimizer.step()
                engine.optimizer.zero_grad()
        trained = engine.parameters_fp32()
    for n, p in reference.named_parameters():
        torch.testing.assert_close(trained[n], p.detach(), rtol=1e-5, atol=1e-6)
