"""Frozen parameters are placed like any other state ([Note: frozen units] in zerotier/state.py).

A TinyGPT with its embeddings and first block frozen trains under zerotier as under torch
AdamW, on every parameter placement; the frozen weights live in the parameter store (released
between uses, never given a gradient or optimizer state), the plan counts them apart, and
state_dict, writes, checkpoints and close() see their values."""
import pytest
import torch

import zerotier
from zerotier.errors import ZerotierError
from zerotier.models import TinyGPT, batches
from zerotier.state import ParamState

STEPS, LR = 4, 3e-3
VOCAB, SEQ, BATCH = 128, 16, 4
FROZEN = ("tok", "pos", "blocks.0.")  # embeddings and the first block


def make_model(seed=0):
    torch.manual_seed(seed)
    model = TinyGPT(vocab=VOCAB, dim=32, layers=3, heads=2, seq=SEQ)
    for name, p in model.named_parameters():
        if name.startswith(FROZEN):
            p.requires_grad_(False)
    return model


def frozen_names(model):
    return [n for n, p in model.named_parameters() if not p.requires_grad]


def reference_run(model):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.01)
    losses = []
    for x, y in batches(VOCAB, SEQ, BATCH, STEPS):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def config(params, tmp_path, **extra):
    cfg = {"optimizer": {"lr": LR, "weight_decay": 0.01},
           "offload": {"params": params, "gradients": "host" if params != "device" else "device",
                       "optimizer": "host"},
           "tiers": {"nvme_path": str(tmp_path)}}
    for section, values in extra.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


def engine_steps(engine, check=None):
    losses = []
    for x, y in batches(VOCAB, SEQ, BATCH, STEPS):
        loss = engine(x, y)
        if check is not None:  # the frozen first block's output needs no backward: released at once
            check(engine)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
        if check is not None:
            check(engine)
    return losses


def assert_frozen_released(engine):
    """Between steps every streamed unit, frozen ones included, holds no device bytes."""
    assert engine.frozen_units
    for unit in engine.frozen_units:
        assert engine.params.state[unit.index] is ParamState.RELEASED, unit.name
        assert all(p.untyped_storage().nbytes() == 0 for p in unit.params)


@pytest.mark.parametrize("params", ["device", "host", "nvme"])
@pytest.mark.pins("design#frozen-parameters-are-placed-like-any-other-state")
def test_frozen_layers_match_torch(params, tmp_path):
    ref_losses, ref_weights = reference_run(make_model())
    model = make_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    engine = zerotier.initialize(model, config(params, tmp_path))
    try:
        frozen = {id(p) for u in engine.frozen_units for p in u.params}
        assert frozen == {id(p) for n, p in model.named_parameters() if n in before}
        assert not any(u.frozen for u in engine.units)  # gradients and optimizer see trainable units only
        assert engine.grads.units is engine.units or list(engine.grads.units) == engine.units
        losses = engine_steps(engine, assert_frozen_released if params != "device" else None)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        sd = model.state_dict()  # frozen ones read from the store through the surface
        for name, ref in ref_weights.items():
            torch.testing.assert_close(sd[name].float(), ref, rtol=1e-5, atol=1e-6, msg=name)
        for name, value in before.items():  # frozen: not one bit moved, a plain tensor (safetensors-safe)
            assert torch.equal(sd[name], value) and type(sd[name]) is torch.Tensor, name
    finally:
        engine.close()
    for name, value in before.items():  # close() puts them back as plain tensors
        p = model.get_parameter(name)
        assert type(p) is torch.nn.Parameter and not p.requires_grad and torch.equal(p, value), name


@pytest.mark.pins("design#frozen-parameters-are-placed-like-any-other-state")
def test_plan_lists_frozen_bytes_apart(tmp_path):
    model = make_model()
    n_frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    n_trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    with zerotier.initialize(model, config("nvme", tmp_path, precision={"param_dtype": "bf16"})) as engine:
        plan = engine.plan
        assert plan.numel == n_trained and plan.frozen_numel == n_frozen
        assert plan.frozen_param_bytes == 2 * n_frozen
        assert plan.state_bytes["params"] == 2 * (n_frozen + n_trained)
        assert plan.state_bytes["gradients"] == plan.grad_bytes * n_trained  # none for the frozen ones
        assert plan.state_bytes["optimizer"] == 12 * n_trained
        text = plan.summary()
        assert "M frozen" in text and "frozen" in text.split("params")[1].split("gradients")[0]
        assert_frozen_released(engine)


def test_write_to_frozen_reaches_the_store(tmp_path):
    model = make_model()
    with zerotier.initialize(model, config("host", tmp_path)) as engine:
        w = next(p for n, p in model.named_parameters() if n.startswith("blocks.0.") and p.dim() == 2)
        with torch.no_grad():
            w.mul_(2.0)
            expected = w.detach().clone()
        assert engine.params.state[engine.frozen_units[0].index] is not ParamState.RESIDENT
        with engine.gathered([w]):
            assert torch.equal(w.detach().clone(), expected)
        engine_steps(engine)  # still trains with the edited frozen weight
        assert torch.equal(w.detach().clone(), expected)


def test_unfreezing_after_initialize_is_refused(tmp_path):
    model = make_model()
    with zerotier.initialize(model, config("host", tmp_path)) as engine:
        frozen_name = frozen_names(model)[0]
        model.get_parameter(frozen_name).requires_grad_(True)
        x, y = next(batches(VOCAB, SEQ, BATCH, 1))
        with pytest.raises(ZerotierError, match=f"'{frozen_name}' requires grad but zerotier does not train it"):
            engine(x, y)


def test_checkpoint_round_trips_frozen_weights(tmp_path):
    model = make_model()
    (tmp_path / "swap").mkdir()
    with zerotier.initialize(model, config("nvme", tmp_path / "swap")) as engine:
        engine_steps(engine)
        saved = {n: t.clone() for n, t in model.state_dict().items()}
        engine.save_checkpoint(tmp_path / "ckpt")
        name = frozen_names(model)[0]
        with torch.no_grad():
            model.get_parameter(name).zero_()
        assert not model.state_dict()[name].any()
        engine.load_checkpoint(tmp_path / "ckpt")
        for n, t in model.state_dict().items():
            assert torch.equal(t, saved[n]), n


def _two_rank_frozen(rank, world_size, nvme_dir):
    """ZeRO-2 and ZeRO-3 (frozen units sharded and gathered like trainable ones) with the frozen
    layers on host and NVMe; each rank trains on its half of every batch."""
    from zerotier.models import batches as make_batches
    results = {}
    for stage in (2, 3):
        for params in ("host", "nvme"):
            cfg = config(params, nvme_dir, zero={"stage": stage, "persistence_threshold": 200})
            model = make_model()
            losses = []
            with zerotier.initialize(model, cfg) as engine:
                for x, y in make_batches(VOCAB, SEQ, BATCH, STEPS):
                    half = BATCH // world_size
                    loss = engine(x[rank * half:(rank + 1) * half], y[rank * half:(rank + 1) * half])
                    engine.backward(loss)
                    engine.step()
                    t = loss.detach().clone()
                    torch.distributed.all_reduce(t)
                    losses.append(float(t) / world_size)
                state = {n: t.clone() for n, t in model.state_dict().items()}  # a collective
            results[stage, params] = losses, state
    return results


@pytest.mark.pins("design#frozen-parameters-are-placed-like-any-other-state")
def test_two_ranks_with_frozen_layers_match_single_process(tmp_path):
    from zerotier.dist import spawn
    ref_losses, ref_weights = reference_run(make_model())
    for rank_results in spawn(_two_rank_frozen, 2, str(tmp_path), timeout_s=600):
        for key, (losses, state) in rank_results.items():
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6,
                                       msg=str(key))
            for name, ref in ref_weights.items():
                torch.testing.assert_close(state[name], ref, rtol=1e-5, atol=1e-6, msg=f"{key} {name}")


def test_consolidated_state_dict_holds_frozen_values_not_released_views(tmp_path):
    """engine.consolidated_state_dict() (what `zerotier export` writes) copies the frozen weights out
    of their home: a released view would hand safetensors freed memory."""
    model = make_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    with zerotier.initialize(model, config("host", tmp_path)) as engine:
        engine_steps(engine)
        out = engine.consolidated_state_dict()
        for name, value in before.items():
            assert type(out[name]) is torch.Tensor and torch.equal(out[name], value), name
