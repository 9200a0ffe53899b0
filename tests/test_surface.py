"""[Note: the parameter surface]: every ordinary touch of a managed parameter works as in torch
(reads fetch, writes reach the fp32 master) or is refused clearly; never freed memory.

Each case runs the same model from the same weights under plain torch + AdamW and under
zerotier with parameters on the device, on the host and on NVMe, and compares."""
import copy

import pytest
import torch
from torch import nn

import zerotier
from zerotier.errors import ConfigError, ZerotierError

LR = 1e-2


class Block(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class Net(nn.Module):
    def __init__(self, dim=8, depth=3):
        super().__init__()
        self.blocks = nn.ModuleList([Block(dim) for _ in range(depth)])
        self.head = nn.Linear(dim, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).pow(2).mean()


PLACEMENTS = ["device", "host", "nvme"]


def config(where, tmp_path, **train):
    cfg = {"optimizer": {"lr": LR, "weight_decay": 0.0}, "train": dict(train)}
    if where == "nvme":
        cfg.update(offload={"params": "nvme", "optimizer": "nvme"}, tiers={"nvme_path": str(tmp_path)})
    else:
        cfg["offload"] = {"params": where}
    return cfg


def pair(seed=0, cls=Net):
    torch.manual_seed(seed)
    model = cls()
    ref = copy.deepcopy(model)
    return model, ref


def data(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 8, generator=g) for _ in range(n)]


def torch_steps(model, opt, xs):
    for x in xs:
        model(x).backward()
        opt.step()
        opt.zero_grad()


def engine_steps(engine, xs):
    for x in xs:
        engine.backward(engine(x))
        engine.step()


def assert_same(engine, ref, atol=1e-6):
    got = engine.parameters_fp32()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name], p.detach().float(), atol=atol, rtol=1e-5, msg=name)


@pytest.mark.parametrize("where", PLACEMENTS)
def test_reading_a_parameter_between_steps_gives_its_value(where, tmp_path):
    """print(w), w.norm(), w.clone(), w.numpy() of a released parameter: the trained value."""
    model, ref = pair()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0)
    with zerotier.initialize(model, config(where, tmp_path)) as engine:
        xs = data(2)
        engine_steps(engine, xs)
        torch_steps(ref, opt, xs)
        w, w_ref = model.blocks[1].lin.weight, ref.blocks[1].lin.weight.detach()
        assert w.shape == w_ref.shape and w.dtype == w_ref.dtype
        torch.testing.assert_close(w.norm(), w_ref.norm(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(w.clone(), w_ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.from_numpy(w.detach().numpy().copy()), w_ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(w.data.sum(), w_ref.sum(), rtol=1e-5, atol=1e-5)
        assert str(w).startswith("Parameter containing:\ntensor(")
        kept = w.detach().numpy()  # shares a copy's memory, never the unit's released storage
        engine_steps(engine, data(1, seed=5))
        assert kept.shape == tuple(w_ref.shape) and bool(torch.isfinite(torch.from_numpy(kept)).all())
        torch_steps(ref, opt, data(1, seed=5))
        assert_same(engine, ref)  # the reads did not disturb training


@pytest.mark.parametrize("where", PLACEMENTS)
def test_load_state_dict_and_inplace_writes_reach_the_master(where, tmp_path):
    """model.load_state_dict, p.copy_ / p.mul_ under no_grad and p.data.copy_ on the live model
    are what the next steps train from (on the device too: not overwritten from the master)."""
    model, ref = pair()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0)
    torch.manual_seed(7)
    new_weights = {k: torch.randn_like(v) for k, v in ref.state_dict().items()}
    with zerotier.initialize(model, config(where, tmp_path)) as engine:
        xs = data(6)
        engine_steps(engine, xs[:2])
        torch_steps(ref, opt, xs[:2])
        model.load_state_dict(new_weights)
        ref.load_state_dict(new_weights)
        assert_same(engine, ref)
        engine_steps(engine, xs[2:4])
        torch_steps(ref, opt, xs[2:4])
        assert_same(engine, ref)
        with torch.no_grad():
            model.blocks[0].lin.weight.mul_(0.5)
            ref.blocks[0].lin.weight.mul_(0.5)
            model.head.bias.fill_(0.25)
            ref.head.bias.fill_(0.25)
        model.blocks[2].lin.weight.data.copy_(torch.ones(8, 8) * 0.1)
        ref.blocks[2].lin.weight.data.copy_(torch.ones(8, 8) * 0.1)
        nn.init.zeros_(model.blocks[1].lin.bias)
        nn.init.zeros_(ref.blocks[1].lin.bias)
        assert_same(engine, ref)
        engine_steps(engine, xs[4:])
        torch_steps(ref, opt, xs[4:])
        assert_same(engine, ref)
        sd = model.state_dict()
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(sd[name], value, rtol=1e-5, atol=1e-6)


def test_inplace_write_with_grad_enabled_is_torchs_error(tmp_path):
    model, _ = pair()
    with zerotier.initialize(model, config("host", tmp_path)) as engine:
        with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
            model.head.weight.mul_(2)
        engine_steps(engine, data(1))


@pytest.mark.parametrize("where", ["host", "nvme"])
def test_model_to_another_dtype_is_refused_and_changes_nothing(where, tmp_path):
    model, ref = pair()
    with zerotier.initialize(model, config(where, tmp_path)) as engine:
        with pytest.raises(ConfigError, match="precision.param_dtype"):
            model.to(torch.float64)
        with pytest.raises(ConfigError, match="engine.close"):
            model.half()
        assert all(p.dtype == torch.float32 for p in model.parameters())
        assert all(b.dtype == torch.float32 for b in model.buffers())
        model.to("cpu")  # nothing to change: fine, as HF Trainer and accelerate call it
        model.float()
        assert_same(engine, ref)
        engine_steps(engine, data(1))


def test_load_state_dict_assign_is_refused(tmp_path):
    model, ref = pair()
    with zerotier.initialize(model, config("host", tmp_path)):
        with pytest.raises(ZerotierError, match="assign=False"):
            model.load_state_dict(ref.state_dict(), assign=True)


class ReturnsItsWeight(nn.Module):
    """DeepSpeed's test_ext_param_return: a unit module returns its own parameter."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8) * 0.1)

    def forward(self, x):
        return x @ self.weight, self.weight


class UsesReturnedWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([ReturnsItsWeight() for _ in range(2)])

    def forward(self, x):
        for block in self.blocks:
            x, w = block(x)
            x = x + w.sum(0)  # the returned weight is used after its module's forward
        return x.pow(2).mean()


class ParentReadsChild(nn.Module):
    """A parent reads a (released) child's weight directly, with the default wrap."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(3)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return (x @ self.blocks[0].lin.weight).pow(2).mean()  # like a tied head


@pytest.mark.parametrize("cls", [UsesReturnedWeight, ParentReadsChild])
@pytest.mark.parametrize("where", PLACEMENTS)
def test_parameters_used_outside_their_module_train_like_torch(cls, where, tmp_path):
    model, ref = pair(cls=cls)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0)
    with zerotier.initialize(model, config(where, tmp_path)) as engine:
        xs = data(3)
        engine_steps(engine, xs)
        torch_steps(ref, opt, xs)
        assert_same(engine, ref)


@pytest.mark.parametrize("where", PLACEMENTS)
def test_weight_regularizer_outside_forward(where, tmp_path):
    """loss + lambda * sum(p^2) over model.parameters() after the forward: gradients reach every weight."""
    model, ref = pair()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0)
    with zerotier.initialize(model, config(where, tmp_path)) as engine:
        for x in data(3):
            loss = engine(x) + 1e-2 * sum(p.pow(2).sum() for p in model.parameters())
            engine.backward(loss)
            engine.step()
            loss_ref = ref(x) + 1e-2 * sum(p.pow(2).sum() for p in ref.parameters())
            loss_ref.backward()
            opt.step()
            opt.zero_grad()
        assert_same(engine, ref)


@pytest.mark.parametrize("where", ["host", "nvme"])
def test_deepcopy_and_gathered(where, tmp_path):
    model, ref = pair()
    with zerotier.initialize(model, config(where, tmp_path)) as engine:
        ema = copy.deepcopy(model)  # plain parameters holding the current values
        assert all(type(p) is nn.Parameter for p in ema.parameters())
        for (name, p), q in zip(ref.named_parameters(), ema.parameters()):
            torch.testing.assert_close(q.detach(), p.detach(), msg=name)
        with engine.gathered():
            norms = [float(p.detach().norm()) for p in model.parameters()]
            assert all(engine.params.state[u.index].value == "resident" for u in engine.units)
        assert norms == pytest.approx([float(p.detach().norm()) for p in ref.parameters()])
        assert all(engine.params.state[u.index].value == "released" for u in engine.units)


def test_close_without_restore_leaves_empty_parameters(tmp_path):
    model, _ = pair()
    engine = zerotier.initialize(model, config("host", tmp_path))
    engine_steps(engine, data(1))
    engine.close(restore_weights=False)
    w = model.blocks[0].lin.weight
    assert type(w) is nn.Parameter and w.numel() == 0 and w.dtype == torch.float32
    assert w.detach().numpy().shape == (0,)  # never a view of released storage


@pytest.mark.parametrize("where", ["host", "nvme"])
def test_close_restores_plain_parameters(where, tmp_path):
    model, ref = pair()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0)
    xs = data(2)
    with zerotier.initialize(model, config(where, tmp_path)) as engine:
        engine_steps(engine, xs)
    torch_steps(ref, opt, xs)
    assert all(type(p) is nn.Parameter for p in model.parameters())
    assert "load_state_dict" not in model.__dict__ and "_apply" not in model.__dict__
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.detach(), p.detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_data_assignment_of_another_shape_is_refused(tmp_path):
    model, ref = pair()
    with zerotier.initialize(model, config("host", tmp_path)) as engine:
        with pytest.raises(ZerotierError, match=r"parameter 'head.weight': `.data =` a tensor of another shape"):
            model.head.weight.data = torch.zeros(3)
        model.head.weight.data = torch.full((1, 8), 0.5)  # same shape: a write of its values
        with torch.no_grad():
            ref.head.weight.fill_(0.5)
        assert_same(engine, ref)


class Trunk(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("wrap", ["auto", ("Block", "Linear")])
@pytest.mark.parametrize("where", PLACEMENTS)
def test_submodule_called_outside_the_root_forward(wrap, where, tmp_path):
    """FSDP's chunked loss: the head runs on chunks of the trunk's output, outside model.forward."""
    model, ref = pair(cls=Trunk)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0)
    cfg = config(where, tmp_path, wrap=wrap)
    with zerotier.initialize(model, cfg) as engine:
        for x in data(3):
            h = engine(x)
            engine.backward(sum(model.head(c).pow(2).mean() for c in h.chunk(2)))
            engine.step()
            h = ref(x)
            sum(ref.head(c).pow(2).mean() for c in h.chunk(2)).backward()
            opt.step()
            opt.zero_grad()
        assert_same(engine, ref)
