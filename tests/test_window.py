"""Gradients are torch's until step (issue 21, item 3): the accumulation window against plain
torch + torch.optim.AdamW on the same data, with params/gradients/optimizer on the device,
the host and NVMe. Nothing the engine does is visible before step(): zero_grad(), p.grad =
None, clip_grad_norm_, zero_grad(set_to_none=False), two backward() calls, no_sync(),
requires_grad changed after initialize, and every call after close()."""
from __future__ import annotations

import contextlib

import pytest
import torch

import zerotier
from zerotier.engine import grad_view
from zerotier.errors import ZerotierError
from zerotier.models import TinyGPT, batches

LR = 3e-3
PLACEMENTS = {
    "device": {"params": "device", "gradients": "device", "optimizer": "device"},
    "host": {"params": "host", "gradients": "host", "optimizer": "host"},
    "nvme": {"params": "nvme", "gradients": "nvme", "optimizer": "nvme"},
}


def gpt():
    torch.manual_seed(0)
    return TinyGPT(vocab=64, dim=32, layers=2, heads=2, seq=16)


def data(n=6):
    return list(batches(64, 16, 4, n))


def cfg(placement, tmp_path, **train):
    return {"offload": PLACEMENTS[placement], "tiers": {"nvme_path": str(tmp_path)},
            "optimizer": {"lr": LR, "weight_decay": 0.01}, "train": train}


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)


def weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_matches(ours, reference, what=""):
    assert ours.keys() == reference.keys()
    for name in reference:
        torch.testing.assert_close(ours[name], reference[name], rtol=1e-5, atol=1e-6, msg=f"{what} {name}")


# ---------------------------------------------------------------- row 1: zero_grad before step


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_zero_grad_between_backward_and_step_drops_the_batch(placement, tmp_path):
    """engine.zero_grad() after a backward drops that batch exactly, and nothing (weights,
    optimizer state) changed before step(): the early step is opt-in (train.early_step)."""
    batches_ = data(6)
    m = gpt()
    opt = adamw(m)
    for i in range(0, 6, 2):
        m(*batches_[i]).backward()
        opt.zero_grad()
        m(*batches_[i + 1]).backward()
        opt.step()
        opt.zero_grad()
    reference = weights(m)

    with zerotier.initialize(gpt(), cfg(placement, tmp_path)) as engine:
        for i in range(0, 6, 2):
            before = engine.parameters_fp32()
            applied = engine.unit_optimizer.applied
            engine.backward(engine(*batches_[i]))
            assert engine.unit_optimizer.applied == applied, "an update started before step()"
            for name, w in engine.parameters_fp32().items():
                assert torch.equal(w, before[name]), f"{name} changed before step()"
            engine.zero_grad()
            engine.backward(engine(*batches_[i + 1]))
            assert engine.step()
        assert_matches(engine.parameters_fp32(), reference, placement)


@pytest.mark.parametrize("placement", ["host", "nvme"])
def test_model_zero_grad_and_grad_none_in_the_plain_loop(placement, tmp_path):
    """model.zero_grad() drops the window; p.grad = None drops one parameter's gradient (it is
    not stepped, as torch.optim.AdamW skips it); p.grad shows torch's gradient."""
    batches_ = data(4)

    def loop(m, opt, seen):
        for i in range(0, 4, 2):
            m(*batches_[i]).backward()
            m.zero_grad()
            m(*batches_[i + 1]).backward()
            seen.append({n: p.grad.detach().float().clone() for n, p in m.named_parameters()})
            m.blocks[0].fc.weight.grad = None
            m.tok.weight.grad = None
            opt.step()
            opt.zero_grad()

    m, torch_grads = gpt(), []
    loop(m, adamw(m), torch_grads)
    reference = weights(m)

    m, grads = gpt(), []
    with zerotier.initialize(m, cfg(placement, tmp_path)) as engine:
        loop(m, engine.optimizer, grads)
        ours = engine.parameters_fp32()
    for seen, expected in zip(grads, torch_grads):
        assert_matches(seen, expected, "p.grad")
    assert_matches(ours, reference, placement)


def test_grad_set_drops_or_replaces_one_parameter(tmp_path):
    """grad_view.grad_set / grad_get directly (what the parameter surface calls)."""
    x, y = data(1)[0]
    m = gpt()
    opt = adamw(m)
    m(x, y).backward()
    m.blocks[1].out.weight.grad = None
    m.pos.grad = torch.full_like(m.pos, 0.5)
    opt.step()
    reference = weights(m)

    m = gpt()
    with zerotier.initialize(m, cfg("host", tmp_path)) as engine:
        engine.backward(engine(x, y))
        grad_view.grad_set(engine.window, m.blocks[1].out.weight, None)
        assert grad_view.grad_get(engine.window, m.blocks[1].out.weight) is None
        grad_view.grad_set(engine.window, m.pos, torch.full_like(m.pos, 0.5))
        assert torch.equal(grad_view.grad_get(engine.window, m.pos), torch.full_like(m.pos, 0.5))
        engine.step()
        assert_matches(engine.parameters_fp32(), reference)


@pytest.mark.pins("design#the-early-step-is-opt-in-train-overlap-early-issue-21", "design#the-overlap-seam")
def test_early_step_is_opt_in_and_refuses_what_it_cannot_honour(tmp_path):
    x, y = data(1)[0]
    with zerotier.initialize(gpt(), cfg("host", tmp_path, overlap="early")) as engine:
        engine.backward(engine(x, y))
        assert engine.unit_optimizer.applied > 0 or engine.window.overlap.early, "train.early_step: updates during backward"
        with torch.no_grad():
            engine(x, y)  # a read after the last backward waits for its updates: never a home being written
        assert not engine.window.overlap.early
        with pytest.raises(ZerotierError, match=r"^zero_grad\(\) after a backward whose update already started "
                                                r"\(train\.overlap = 'early' .*set train\.overlap = 'auto'"):
            engine.zero_grad()
        with pytest.raises(ZerotierError, match=r"^clip_grad_norm_ after a backward whose update already "
                                                r"started .*set train\.max_grad_norm instead"):
            torch.nn.utils.clip_grad_norm_(engine.module.parameters(), 1.0)
        with pytest.raises(ZerotierError, match=r"^engine\.backward\(\) again after a backward whose update "
                                                r"already started .*train\.overlap = 'early'"):
            engine.backward(engine(x, y))
        with pytest.raises(ZerotierError, match=r"^p\.grad set after a backward whose update already started"):
            engine.module.pos.grad = None
        assert engine.step()
        engine.backward(engine(x, y))  # the loop goes on
        assert engine.step()


# ---------------------------------------------------------------- row 2: the user's clipping


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_clip_grad_norm_on_the_model_is_honoured(placement, tmp_path):
    """torch.nn.utils.clip_grad_norm_(model.parameters(), c) in the plain loop returns torch's
    norm and clips the update (train.max_grad_norm unset)."""
    batches_ = data(6)

    def loop(m, opt):
        norms = []
        for i, (x, y) in enumerate(batches_):
            (m(x, y) / 2).backward()
            if i % 2:
                norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)))
                opt.step()
                opt.zero_grad()
        return norms

    m = gpt()
    expected = loop(m, adamw(m))
    reference = weights(m)
    assert min(expected) > 0.05, "the clip must act"
    m = gpt()
    with zerotier.initialize(m, cfg(placement, tmp_path)) as engine:
        norms = loop(m, engine.optimizer)
        ours = engine.parameters_fp32()
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    assert_matches(ours, reference, placement)


def test_clip_grad_norm_with_unmanaged_parameters_and_in_the_engine_loop(tmp_path):
    """A model with a frozen part clipped together with a plain tensor; and the engine loop
    (engine.backward / clip / engine.step)."""
    x, y = data(1)[0]
    extra = torch.nn.Parameter(torch.ones(3))

    def run(m, backward, step):
        extra.grad = torch.full((3,), 2.0)
        backward(m(x, y))
        norm = torch.nn.utils.clip_grad_norm_(list(m.parameters()) + [extra], 0.1)
        step()
        return float(norm), extra.grad.clone()

    m = gpt()
    opt = adamw(m)
    norm, extra_grad = run(m, lambda loss: loss.backward(), opt.step)
    reference = weights(m)
    m = gpt()
    with zerotier.initialize(m, cfg("host", tmp_path)) as engine:
        ours, ours_extra = run(m, engine.backward, engine.step)
        assert_matches(engine.parameters_fp32(), reference)
    assert ours == pytest.approx(norm, rel=1e-5)
    torch.testing.assert_close(ours_extra, extra_grad)


def test_unsupported_clipping_is_refused(tmp_path):
    x, y = data(1)[0]
    with zerotier.initialize(gpt(), cfg("host", tmp_path)) as engine:
        engine.backward(engine(x, y))
        with pytest.raises(ZerotierError, match=r"^clip_grad_value_ on parameters zerotier manages is not "
                                                r"supported .*train\.max_grad_norm"):
            torch.nn.utils.clip_grad_value_(engine.module.parameters(), 0.1)
        with pytest.raises(ZerotierError, match=r"^clip_grad_norm_\(norm_type=1\.0\) on parameters zerotier "
                                                r"manages: only norm_type=2"):
            torch.nn.utils.clip_grad_norm_(engine.module.parameters(), 0.1, norm_type=1.0)
    plain = torch.nn.Linear(2, 2)  # parameters no engine manages: torch's own functions
    plain.weight.grad = torch.full((2, 2), 3.0)
    torch.nn.utils.clip_grad_value_(plain.parameters(), 1.0)
    assert torch.equal(plain.weight.grad, torch.ones(2, 2))


transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")


def gpt2():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64,
                                                                n_positions=32))


class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        gen = torch.Generator().manual_seed(1)
        self.ids = [torch.randint(0, 64, (16,), generator=gen) for _ in range(16)]

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def hf_weights(model, engine):
    if engine is not None:
        return engine.parameters_fp32()
    return weights(model)


def assert_hf_matches(ours, reference):
    for name in reference:
        if name.endswith("attn.c_attn.bias"):  # key third: zero true gradient, rounding noise (test_hf_loops)
            continue
        torch.testing.assert_close(ours[name], reference[name], rtol=1e-5, atol=1e-6, msg=name)


def test_accelerate_clip_grad_norm_is_honoured(tmp_path):
    def run(use_zerotier):
        model = gpt2()
        # gradients on NVMe: p.grad is a copy there, so only the clipping integration can clip them
        engine = zerotier.initialize(model, cfg("nvme", tmp_path)) if use_zerotier else None
        opt = engine.optimizer if engine is not None else adamw(model)
        accelerator = accelerate.Accelerator(cpu=True)
        model, opt = accelerator.prepare(model, opt)
        norms = []
        for batch in list(Tokens())[:6]:
            accelerator.backward(model(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss)
            norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 0.2)))
            opt.step()
            opt.zero_grad()
        out = hf_weights(model, engine)
        if engine is not None:
            engine.close()
        return norms, out

    (norms, ours), (expected, reference) = run(True), run(False)
    assert min(expected) > 0.2
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    assert_hf_matches(ours, reference)


def test_plain_trainer_max_grad_norm_is_honoured(tmp_path):
    import tempfile

    def run(model, optimizer):
        args = transformers.TrainingArguments(
            output_dir=tempfile.mkdtemp(dir=tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2,
            max_grad_norm=0.2, learning_rate=LR, weight_decay=0.0, num_train_epochs=1, logging_steps=1,
            report_to=[], use_cpu=True, save_strategy="no", lr_scheduler_type="constant", seed=0, data_seed=0)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(),
                                       optimizers=(optimizer, None) if optimizer is not None else (None, None))
        trainer.train()
        return [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]

    reference_model = gpt2()
    expected = run(reference_model, None)
    model = gpt2()
    # weight decay 0: Trainer's own AdamW exempts biases and norms, a matter of param groups, not clipping
    engine = zerotier.initialize(model, {"offload": PLACEMENTS["nvme"], "tiers": {"nvme_path": str(tmp_path)},
                                         "optimizer": {"lr": LR, "weight_decay": 0.0}})
    norms = run(model, engine.optimizer)
    ours = engine.parameters_fp32()
    engine.close()
    assert min(expected) > 0.2
    # after the first update the key biases' rounding noise (assert_hf_matches) moves the norm a little
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(expected), rtol=1e-4, atol=1e-6)
    assert_hf_matches(ours, weights(reference_model))


# ---------------------------------------------------------------- row 3: zero_grad(set_to_none=False)


class TwoBranch(torch.nn.Module):
    """Branch b gets a gradient in the first window only."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x, use_b):
        h = self.a(x)
        return (self.b(h) if use_b else h).square().mean()


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_zero_grad_set_to_none_false_keeps_stepping_with_zero_gradients(placement, tmp_path):
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(4, 8, generator=gen) for _ in range(4)]
    m = TwoBranch()
    opt = adamw(m)
    for i, x in enumerate(xs):
        m(x, i == 0).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    reference = weights(m)

    m = TwoBranch()
    with zerotier.initialize(m, cfg(placement, tmp_path)) as engine:
        for i, x in enumerate(xs):
            engine.backward(engine(x, i == 0))
            engine.step()
            engine.zero_grad(set_to_none=False)
            assert torch.equal(m.b.weight.grad, torch.zeros(8, 8))  # present, zero: as torch shows it
        ours = engine.parameters_fp32()
        engine.zero_grad()  # set_to_none=True: b has no gradient again
        assert m.b.weight.grad is None
    assert_matches(ours, reference, placement)
    assert not torch.equal(reference["b.weight"], TwoBranch().b.weight.detach()), "b moved on zero gradients"


def test_zero_grad_set_to_none_false_through_the_optimizer(tmp_path):
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(4, 8, generator=gen) for _ in range(3)]

    def loop(m, opt):
        for i, x in enumerate(xs):
            m(x, i == 0).backward()
            opt.step()
            opt.zero_grad(set_to_none=False)

    m = TwoBranch()
    loop(m, adamw(m))
    reference = weights(m)
    m = TwoBranch()
    with zerotier.initialize(m, cfg("host", tmp_path)) as engine:
        loop(m, engine.optimizer)
        assert_matches(engine.parameters_fp32(), reference)


# ---------------------------------------------------------------- row 4: backward twice


@pytest.mark.parametrize("accum", [1, 2])
def test_backward_twice_before_step_accumulates_like_torch(accum, tmp_path):
    batches_ = data(4 * accum)
    m = gpt()
    opt = adamw(m)
    for i in range(0, len(batches_), 2):
        (m(*batches_[i]) / accum).backward()
        (m(*batches_[i + 1]) / accum).backward()
        if (i // 2 + 1) % accum == 0:
            opt.step()
            opt.zero_grad()
    reference = weights(m)
    with zerotier.initialize(gpt(), cfg("host", tmp_path, grad_accum_steps=accum)) as engine:
        for i in range(0, len(batches_), 2):
            engine.backward(engine(*batches_[i]))
            engine.backward(engine(*batches_[i + 1]))
            engine.step()
        assert engine.global_steps == 2
        assert_matches(engine.parameters_fp32(), reference)


# ---------------------------------------------------------------- row 5: no_sync


def test_no_sync_with_one_rank_is_the_same_run(tmp_path):
    batches_ = data(4)
    out = []
    for use in (False, True):
        with zerotier.initialize(gpt(), cfg("host", tmp_path, grad_accum_steps=2)) as engine:
            for i, b in enumerate(batches_):
                if use and i % 2 == 0:
                    with engine.no_sync():
                        engine.backward(engine(*b))
                else:
                    engine.backward(engine(*b))
                engine.step()
            out.append(engine.parameters_fp32())
    for name in out[0]:
        assert torch.equal(out[0][name], out[1][name]), name


def _no_sync_rank(rank, world_size, nvme_dir):
    """Each stage x placement twice: the first micro-batch of each window inside no_sync() or not."""
    out = {}
    for stage in (0, 1, 2, 3):
        for placement in ("host", "nvme"):
            config = {"zero": {"stage": stage, "persistence_threshold": 200, "reduce_bucket_size": 4096},
                      "offload": PLACEMENTS[placement], "tiers": {"nvme_path": nvme_dir},
                      "optimizer": {"lr": LR, "weight_decay": 0.01}, "train": {"grad_accum_steps": 2}}
            for use in (False, True):
                with zerotier.initialize(gpt(), config) as engine:
                    sent = []
                    for i, (x, y) in enumerate(data(4)):
                        x, y = x[rank * 2:(rank + 1) * 2], y[rank * 2:(rank + 1) * 2]
                        before = engine.sharding.comm.stats().get("reduce_scatter", 0)
                        with engine.no_sync() if use and i % 2 == 0 else contextlib.nullcontext():
                            engine.backward(engine(x, y))
                        engine.step()
                        sent.append(engine.sharding.comm.stats().get("reduce_scatter", 0) - before)
                    out[(stage, placement, use)] = (engine.parameters_fp32(), sent)
                    engine.backward(engine(x, y))
                    try:
                        engine.module.pos.grad
                        out[(stage, placement, "p.grad")] = "no error"
                    except ZerotierError as exc:
                        out[(stage, placement, "p.grad")] = str(exc)
    return out


def test_no_sync_on_two_ranks_matches_one_process(tmp_path):
    """The first micro-batch of each window inside no_sync(): the same update as without it (up
    to summation order), and as one process with torch; at ZeRO-2/3 that backward reduce-scatters nothing.
    Also: p.grad of a managed parameter with several ranks is refused, naming what to use."""
    from zerotier.dist import spawn
    m = gpt()
    opt = adamw(m)
    for i, (x, y) in enumerate(data(4)):
        (m(x, y) / 2).backward()
        if i % 2:
            opt.step()
            opt.zero_grad()
    reference = weights(m)
    results = spawn(_no_sync_rank, 2, str(tmp_path), timeout_s=600)
    for rank_result in results:
        for stage in (0, 1, 2, 3):
            for placement in ("host", "nvme"):
                what = f"stage {stage} {placement}"
                assert rank_result[(stage, placement, "p.grad")].startswith(
                    "reading p.grad of a parameter zerotier manages with several ranks: "), what
                (synced, sent_synced), (ours, sent) = (rank_result[(stage, placement, use)] for use in (False, True))
                for name in reference:
                    torch.testing.assert_close(ours[name], synced[name], rtol=1e-5, atol=1e-5, msg=f"{what} {name}")
                    # without clipping Adam turns rounding noise in near-zero gradients into steps
                    # of up to lr: 1e-4 still catches a lost micro-batch (test_window's runs: 2e-5)
                    torch.testing.assert_close(ours[name], reference[name], rtol=1e-5, atol=1e-4,
                                               msg=f"{what} {name}")
                if stage >= 2 and placement == "host":
                    assert sent[0] == 0 < sent_synced[0], f"{what}: no_sync's backward still reduced ({sent})"


# ---------------------------------------------------------------- row 6: grad_norm after a step


def test_grad_norm_after_a_step_is_the_last_norm_and_the_loop_goes_on(tmp_path):
    batches_ = data(3)
    with zerotier.initialize(gpt(), cfg("host", tmp_path)) as engine:
        engine.backward(engine(*batches_[0]))
        norm = engine.grad_norm()
        assert engine.step()
        assert engine.grad_norm() == norm  # the last update's norm
        engine.backward(engine(*batches_[1]))  # not refused
        assert engine.step()
        loss = engine(*batches_[2])
        loss.backward()  # the plain loop too
        engine.optimizer.step()


# ---------------------------------------------------------------- row 7: after close


def test_every_training_call_after_close_is_refused(tmp_path):
    x, y = data(1)[0]
    m = gpt()
    engine = zerotier.initialize(m, cfg("host", tmp_path))
    engine.backward(engine(x, y))
    engine.step()
    engine.close()
    refused = r"after engine\.close\(\): this engine no longer trains the model .*zerotier\.initialize"
    for call in (engine.step, engine.zero_grad, engine.grad_norm, engine.optimizer.step, engine.no_sync,
                 lambda: engine.backward(m(x, y))):
        with pytest.raises(ZerotierError, match=refused):
            call()
    m(x, y).backward()  # the model is a plain torch model again
    assert m.blocks[1].out.weight.grad is not None


def test_close_twice_is_a_no_op_and_closes_each_store_once(tmp_path, monkeypatch):
    """close() frees the gradient store and the optimizer's staging once (review f3f88fe §5: it
    closed both twice), and a second close() does nothing at all."""
    x, y = data(1)[0]
    m = gpt()
    engine = zerotier.initialize(m, cfg("host", tmp_path))
    engine.backward(engine(x, y))
    engine.step()
    calls = []
    for store in (engine.grads, engine.unit_optimizer, engine.params, engine.host_pool):
        close = store.close
        monkeypatch.setattr(store, "close", lambda close=close, store=store: (calls.append(type(store).__name__),
                                                                                close())[1])
    engine.close()
    assert sorted(calls) == sorted(["GradStore", "UnitOptimizer", "ParamStore", "HostPool"]), calls
    weight = m.blocks[1].out.weight.detach().clone()
    engine.close()
    assert len(calls) == 4, "a second close() must do nothing"
    assert engine.closed and torch.equal(m.blocks[1].out.weight, weight)


# ---------------------------------------------------------------- row 8: requires_grad after initialize


def test_parameter_unfrozen_after_initialize_is_refused_at_the_forward(tmp_path):
    x, y = data(1)[0]
    m = gpt()
    m.pos.requires_grad_(False)
    with zerotier.initialize(m, cfg("host", tmp_path)) as engine:
        engine.backward(engine(x, y))
        engine.step()
        m.pos.requires_grad_(True)
        with pytest.raises(ZerotierError, match=r"^parameter 'pos' requires grad but zerotier does not train it: "
                                                r"it was frozen .* Set requires_grad before initialize, or call "
                                                r"engine\.close\(\) and zerotier\.initialize"):
            engine(x, y)
        with torch.no_grad():
            engine.eval()(x, y)  # evaluation is fine
        engine.train()
        m.pos.requires_grad_(False)
        engine.backward(engine(x, y))
        assert engine.step()


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_parameter_frozen_after_initialize_stops_training_like_torch(placement, tmp_path):
    batches_ = data(4)

    def loop(m, backward, step):
        for i, b in enumerate(batches_):
            if i == 2:
                m.blocks[1].qkv.weight.requires_grad_(False)
                m.tok.weight.requires_grad_(False)
            backward(m(*b))
            step()

    m = gpt()
    opt = adamw(m)

    def torch_step():
        opt.step()
        opt.zero_grad()
    loop(m, lambda loss: loss.backward(), torch_step)
    reference = weights(m)
    m = gpt()
    with zerotier.initialize(m, cfg(placement, tmp_path)) as engine:
        loop(m, engine.backward, engine.step)
        assert_matches(engine.parameters_fp32(), reference, placement)
