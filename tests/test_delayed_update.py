"""The delayed parameter update ([Note: delayed update] in zerotier/overlap/delayed.py, issue 25 item 3):
each window's update runs during the next window, whose forward and backward read the weights one
update behind. Not the same training as without it, so the reference is plain torch doing the same
delayed math: the gradients of window k are kept, and applied (clip_grad_norm_ on them, then
AdamW) at the step that ends window k+1, after that window's gradients were computed. The engine
must match it within 1e-6 under each placement, with clipping and accumulation, and differ from
the undelayed run (the forward really reads stale weights)."""
from __future__ import annotations

import re

import pytest
import torch

import zerotier
from zerotier import export
from zerotier.overlap import delayed
from zerotier.units import format_setting
from zerotier.errors import ConfigError, TierIOError, ZerotierError
from zerotier.models import TinyGPT, batches

from injected_faults import fail_nth_write

STEPS, ACCUM, CLIP, LR = 6, 2, 1.0, 3e-3
VOCAB, SEQ, BATCH = 128, 16, 4


def make_model(seed=0):
    torch.manual_seed(seed)
    return TinyGPT(vocab=VOCAB, dim=32, layers=2, heads=2, seq=SEQ)


def reference_run(model, steps=STEPS, accum=ACCUM, clip=CLIP, delay=True, flush_after=None, device="cpu"):
    """Plain torch. delay: apply each window's gradients one window late; flush_after: after that
    window's step, apply the pending gradients at once (what engine.synchronize() does)."""
    model.to(device)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.01)

    def apply(grads):
        for p, g in zip(params, grads):
            p.grad = g
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        opt.zero_grad()

    losses, pending = [], None
    data = batches(VOCAB, SEQ, BATCH, steps * accum)
    for step in range(steps):
        total = 0.0
        for _ in range(accum):
            x, y = next(data)
            loss = model(x.to(device), y.to(device))
            (loss / accum).backward()
            total += float(loss.detach())
        losses.append(total / accum)
        grads = [p.grad.clone() for p in params]
        opt.zero_grad()
        if not delay:
            apply(grads)
            continue
        if pending is not None:
            apply(pending)
        pending = grads
        if flush_after == step:
            apply(pending)
            pending = None
    if pending is not None:  # the engine's parameters_fp32() publishes the last update too
        apply(pending)
    return losses, {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def config(tmp_path, offload=None, accum=ACCUM, clip=CLIP, **train):
    return {"optimizer": {"lr": LR, "weight_decay": 0.01}, "offload": offload or {},
            "tiers": {"nvme_path": str(tmp_path)},
            "train": {"grad_accum_steps": accum, "max_grad_norm": clip, "overlap": "delayed", **train}}


def train(engine, data, steps, accum=ACCUM):
    losses = []
    for _ in range(steps):
        total = 0.0
        for _ in range(accum):
            x, y = next(data)
            loss = engine(x.to(engine.device), y.to(engine.device))
            engine.backward(loss)
            engine.step()
            total += float(loss.detach())
        losses.append(total / accum)
    return losses


def engine_run(tmp_path, offload=None, steps=STEPS, accum=ACCUM, clip=CLIP, device="cpu"):
    cfg = config(tmp_path, offload, accum, clip)
    cfg["train"]["device"] = device
    with zerotier.initialize(make_model(), cfg) as engine:
        assert isinstance(engine.window.overlap, delayed.Delayed)
        losses = train(engine, batches(VOCAB, SEQ, BATCH, steps * accum), steps, accum)
        placement = {k: v.value for k, v in engine.plan.placement.items()}
        return losses, engine.parameters_fp32(), placement


def assert_close(ours, ref, atol=1e-6, rtol=1e-6):
    (losses, weights), (ref_losses, ref_weights) = ours, ref
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=rtol, atol=atol)
    assert weights.keys() == ref_weights.keys()
    for key in ref_weights:
        torch.testing.assert_close(weights[key], ref_weights[key], rtol=rtol, atol=atol, msg=key)


PLACEMENTS = {
    "optimizer-host": {"params": "device", "gradients": "device", "optimizer": "host"},
    "optimizer-nvme": {"params": "device", "gradients": "host", "optimizer": "nvme"},
    "params-host": {"params": "host", "gradients": "host", "optimizer": "host"},
    "params-nvme": {"params": "nvme", "gradients": "host", "optimizer": "nvme"},
    "optimizer-split": {"params": "host", "gradients": "host", "optimizer": {"host": 0.5, "nvme": 0.5}},
}


@pytest.mark.parametrize("name", PLACEMENTS)
@pytest.mark.pins("design#delayed-parameter-update")
def test_matches_the_delayed_reference(name, tmp_path):
    """Clipping at 1.0 and accumulation over 2 micro-batches; 6 windows."""
    ref = reference_run(make_model())
    losses, weights, placement = engine_run(tmp_path, PLACEMENTS[name])
    if not isinstance(PLACEMENTS[name]["optimizer"], dict):
        assert placement == PLACEMENTS[name]
    assert_close((losses, weights), ref)
    undelayed = reference_run(make_model(), delay=False)
    assert losses[0] == pytest.approx(undelayed[0][0], rel=1e-6)  # the first window reads the initial weights
    assert abs(losses[2] - undelayed[0][2]) > 1e-4, "the forward read fresh weights: the update was not delayed"
    assert list(tmp_path.iterdir()) == [], "the NVMe run directory must be removed on close"


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["optimizer-host", "optimizer-nvme", "params-host"])
def test_matches_the_delayed_reference_on_gpu(name, tmp_path):
    """On CUDA (TF32 off, the reference on the GPU too): the gradient copy is a D2H copy, the update
    runs on the CPU while the GPU computes the next window."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        ref = reference_run(make_model(), device="cuda")
        losses, weights, placement = engine_run(tmp_path, PLACEMENTS[name], device="cuda")
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
    assert placement == PLACEMENTS[name]
    assert_close((losses, weights), ref)


def test_one_micro_batch_without_clipping(tmp_path):
    ref = reference_run(make_model(), accum=1, clip=None)
    losses, weights, _ = engine_run(tmp_path, PLACEMENTS["optimizer-host"], accum=1, clip=None)
    assert_close((losses, weights), ref)


def test_a_checkpoint_ends_the_delay_and_resumes_exactly(tmp_path):
    """save_checkpoint publishes the pending update (the next window reads fresh weights), so the
    run that saved and a run loaded from its checkpoint go on identically; both match the reference
    that applies the pending gradients at the save."""
    offload, split = PLACEMENTS["optimizer-nvme"], 3
    root = tmp_path / "ckpt"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    data = batches(VOCAB, SEQ, BATCH, STEPS * ACCUM)
    with zerotier.initialize(make_model(), config(tmp_path / "a", offload)) as engine:
        losses = train(engine, data, split)
        engine.save_checkpoint(root)
        assert not engine.window.overlap.pending
        losses += train(engine, data, STEPS - split)
        saved_run = losses, engine.parameters_fp32()
    data = batches(VOCAB, SEQ, BATCH, STEPS * ACCUM)
    for _ in range(split * ACCUM):
        next(data)
    with zerotier.initialize(make_model(seed=1), config(tmp_path / "b", offload)) as engine:
        engine.load_checkpoint(root)
        resumed = train(engine, data, STEPS - split), engine.parameters_fp32()
    assert resumed[0] == saved_run[0][split:]
    for key, value in saved_run[1].items():
        assert torch.equal(resumed[1][key], value), key
    assert_close(saved_run, reference_run(make_model(), flush_after=split - 1))


def test_an_overflowed_window_launches_nothing(tmp_path):
    """fp16 with a dynamic scale of 2**40: the first windows overflow and are skipped; the update
    pending from before an overflow is still published by it."""
    cfg = config(tmp_path, {"params": "host", "optimizer": "host"}, accum=1, clip=None)
    cfg["precision"] = {"param_dtype": "fp16", "loss_scale": "dynamic", "initial_scale_power": 40, "hysteresis": 1}
    data = batches(VOCAB, SEQ, BATCH, 40)
    with zerotier.initialize(make_model(), cfg) as engine:
        applied = []
        for x, y in data:
            engine.backward(engine(x, y).float())
            applied.append(engine.step())
            assert engine.window.overlap.pending == applied[-1]
            if len(applied) > 1 and applied[-2] and not applied[-1]:
                break
        assert not applied[0] and any(applied), applied
        engine.synchronize()
        assert engine.unit_optimizer.applied == applied.count(True) * len(engine.units)


# ------------------------------------------------------------------ what it refuses (docs/errors.md)

@pytest.mark.parametrize("train_keys,match", [
    ({"early_step": True}, r"train\.overlap = 'delayed' cannot run here: train\.early_step = true"),
    ({"speculative_step": True}, r"train\.overlap = 'delayed' cannot run here: train\.speculative_step = true"),
])
def test_delayed_update_refuses_updates_during_backward(train_keys, match, tmp_path):
    with pytest.raises(ConfigError, match=match):
        zerotier.initialize(make_model(), config(tmp_path, **train_keys))


def test_delayed_update_refuses_gradients_on_nvme_and_optimizer_on_device(tmp_path):
    model = make_model()
    with pytest.raises(ConfigError, match=r"train\.overlap = 'delayed' cannot run here: the gradients are on "
                                          r"nvme \(offload\.gradients\)"):
        zerotier.initialize(model, config(tmp_path, {"params": "nvme", "gradients": "nvme", "optimizer": "nvme"}))
    with pytest.raises(ConfigError, match=r"train\.overlap = 'delayed' cannot run here: the optimizer state is "
                                          r"on the device \(offload\.optimizer\)"):
        zerotier.initialize(model, config(tmp_path, {"params": "device", "optimizer": "device"}))
    with zerotier.initialize(model, config(tmp_path, PLACEMENTS["params-host"], accum=1)) as engine:  # model intact
        x, y = next(batches(VOCAB, SEQ, BATCH, 1))
        engine.backward(engine(x, y))
        assert engine.step()


def test_delayed_update_refuses_several_ranks(tmp_path):
    with zerotier.initialize(make_model(), config(tmp_path, PLACEMENTS["params-host"])) as engine:
        cfg, plan = engine.cfg, engine.plan
    with pytest.raises(ConfigError, match=r"train\.overlap = 'delayed' cannot run here: 2 ranks"):
        delayed.Delayed.refuse(cfg, plan, world_size=2)


@pytest.mark.parametrize("clip_by", ["config", "user"])
def test_the_plain_loop(clip_by, tmp_path):
    """loss.backward() / engine.optimizer.step() / zero_grad() (what transformers' Trainer runs): the
    optimizer's step() ends the window as engine.step() does; clipping by train.max_grad_norm or by
    the loop's own clip_grad_norm_ ([Note: the user's clipping])."""
    ref = reference_run(make_model())
    cfg = config(tmp_path, PLACEMENTS["optimizer-nvme"], accum=1, clip=CLIP if clip_by == "config" else None)
    data = batches(VOCAB, SEQ, BATCH, STEPS * ACCUM)
    with zerotier.initialize(make_model(), cfg) as engine:
        losses = []
        for _ in range(STEPS):
            total = 0.0
            for _ in range(ACCUM):
                x, y = next(data)
                loss = engine(x, y)
                (loss / ACCUM).backward()
                total += float(loss.detach())
            if clip_by == "user":
                torch.nn.utils.clip_grad_norm_(engine.module.parameters(), CLIP)
            engine.optimizer.step()
            engine.optimizer.zero_grad()
            losses.append(total / ACCUM)
        assert engine.window.overlap.pending
        assert_close((losses, engine.parameters_fp32()), ref)


# ------------------------------------------------------------------ reads of the weights (issue 37 row 1)

def _read(engine, how, name, root):
    """The weight `name` as one read path returns it, between windows."""
    model = engine.module
    p = dict(model.named_parameters())[name]
    if how == "clone":
        return p.clone()
    if how == "detach":
        return p.detach().clone()
    if how == "data":
        return p.data.clone()
    if how == "gathered":
        with engine.gathered([p]):
            return p.clone()
    if how == "state_dict":
        return model.state_dict()[name]
    if how == "parameters_fp32":
        return engine.parameters_fp32()[name]
    if how == "consolidated":
        return engine.consolidated_state_dict()[name]
    if how == "export":
        ckpt = engine.save_checkpoint(root)
        return torch.load(export.export(ckpt, root / "w.pt"))[name]
    assert how == "forward"
    x, y = next(batches(VOCAB, SEQ, BATCH, 1, seed=7))
    with torch.no_grad():
        return engine(x, y)


READS = ["clone", "detach", "data", "gathered", "state_dict", "parameters_fp32", "consolidated", "export", "forward"]


@pytest.mark.parametrize("how", READS)
@pytest.mark.parametrize("placement", ["optimizer-host", "params-nvme"])
@pytest.mark.pins("design#delayed-parameter-update")
def test_a_read_between_windows_publishes_the_update(how, placement, tmp_path):
    """[Note: delayed update] Every read of the weights between windows (the parameter surface, a
    forward without grad, engine.gathered(), state_dict, parameters_fp32, export) publishes the
    pending update first, so all return the same weights at that moment: the reference's after the
    pending gradients are applied; the forward after it reads them (the delay ended there, as after
    engine.synchronize()), and training goes on as the reference that flushed at that step."""
    name, split = "blocks.0.qkv.weight", 2
    published = reference_run(make_model(), steps=split)[1]
    ref = reference_run(make_model(), steps=STEPS, flush_after=split - 1)
    (tmp_path / "run").mkdir()
    data = batches(VOCAB, SEQ, BATCH, STEPS * ACCUM)
    with zerotier.initialize(make_model(), config(tmp_path / "run", PLACEMENTS[placement])) as engine:
        losses = train(engine, data, split)
        assert engine.window.overlap.pending
        value = _read(engine, how, name, tmp_path)
        assert not engine.window.overlap.pending
        if how == "forward":
            model = make_model()
            model.load_state_dict(published, strict=False)  # head.weight is tok.weight
            x, y = next(batches(VOCAB, SEQ, BATCH, 1, seed=7))
            expected = model(x, y)
        else:
            expected = published[name]
        torch.testing.assert_close(value.float(), expected, rtol=1e-6, atol=1e-6)
        losses += train(engine, data, STEPS - split)
        assert_close((losses, engine.parameters_fp32()), ref)


@pytest.mark.parametrize("placement", ["optimizer-host", "params-nvme"])
def test_a_read_within_a_window_returns_its_weights(placement, tmp_path):
    """From a window's training forward to its step(), the window computes with the weights one update
    behind: a parameter read returns exactly those (what its forward and backward use) and publishes
    nothing; what would publish (state_dict, parameters_fp32, checkpoints) is refused. The run then
    goes on as the reference that was never read."""
    name = "blocks.0.qkv.weight"
    in_force = reference_run(make_model(), steps=1)[1][name]  # window 2 reads window 0's update only
    ref = reference_run(make_model())
    (tmp_path / "run").mkdir()
    data = batches(VOCAB, SEQ, BATCH, STEPS * ACCUM)
    with zerotier.initialize(make_model(), config(tmp_path / "run", PLACEMENTS[placement])) as engine:
        losses = train(engine, data, 2)
        p = dict(engine.module.named_parameters())[name]
        total = 0.0
        for micro in range(ACCUM):
            x, y = next(data)
            loss = engine(x, y)
            for value in (p.clone(), p.detach().clone(), p.data.clone()):
                torch.testing.assert_close(value.float(), in_force, rtol=1e-6, atol=1e-6)
            with engine.gathered([p]):
                torch.testing.assert_close(p.clone().float(), in_force, rtol=1e-6, atol=1e-6)
            for publish in (engine.module.state_dict, engine.parameters_fp32):
                with pytest.raises(ZerotierError, match=r"between a training forward and engine\.step\(\)"):
                    publish()
            assert engine.window.overlap.pending
            engine.backward(loss)
            engine.step()
            total += float(loss.detach())
        losses.append(total / ACCUM)
        losses += train(engine, data, STEPS - 3)
        assert_close((losses, engine.parameters_fp32()), ref)


def test_a_failed_parameter_write_back_refuses_the_retry_and_a_checkpoint_resumes_exactly(tmp_path):
    """Params on NVMe (issue 37 row 11): each parameter write-back of the run fails in turn (ENOSPC in
    flight). Its unit's next fetch raises the write's error; the retry it invites (zero_grad, the
    forward again) would rewrite the file from the fp32 master, which the pending delayed update has
    moved on ([Note: a failed write-back] in params_writes.py): it is refused and the engine broken (it
    trained 2e-4 to 1.5e-3 off before, no error); load_checkpoint then resumes bitwise as the run that
    never failed. A write of the last synchronize() that fails leaves no update pending: retried, the
    weights are read from the masters, exact."""
    offload = {"params": "nvme", "gradients": "host", "optimizer": "nvme"}
    data = list(batches(VOCAB, SEQ, BATCH, 6))

    def run(engine, part):
        for x, y in part:
            engine.backward(engine(x, y))
            engine.step()
    (tmp_path / "run").mkdir()
    with zerotier.initialize(make_model(), config(tmp_path / "run", offload, accum=1)) as engine:
        run(engine, data[:2])
        engine.save_checkpoint(tmp_path / "ckpt")  # it publishes: the faulted runs resume from here
    with zerotier.initialize(make_model(), config(tmp_path / "run", offload, accum=1)) as engine:
        engine.load_checkpoint(tmp_path / "ckpt")
        store_write, clean = engine.store.write, []

        def recorded(key, buf, *args, **kwargs):
            clean.append(key)
            return store_write(key, buf, *args, **kwargs)
        engine.store.write = recorded
        run(engine, data[2:])
        expected = engine.parameters_fp32()
    writes = sum(key.endswith(".param") for key in clean)
    ways = set()
    for n in range(1, writes + 1):
        with zerotier.initialize(make_model(), config(tmp_path / "run", offload, accum=1)) as engine:
            engine.load_checkpoint(tmp_path / "ckpt")
            seen = fail_nth_write(engine, n, suffix=".param")
            i, errors = 2, []
            while i < len(data):
                try:
                    run(engine, data[i:i + 1])
                    i += 1
                    continue
                except ZerotierError as exc:
                    errors.append(exc)
                if engine.window.broken is None:
                    assert isinstance(errors[-1], TierIOError) and "No space left" in str(errors[-1])
                    ways.add("fetch")
                    engine.zero_grad()  # the retry the error invites
                    continue
                if isinstance(errors[-1], TierIOError):  # the write failed under the next step's publish
                    ways.add("step")
                else:
                    assert re.search(r"failed \(.*No space left.*\) while the delayed update \(train\.overlap = 'delayed'"
                                     r"\) moved its fp32 master on.*\(engine\.load_checkpoint", str(errors[-1]))
                    ways.add("refused")
                engine.load_checkpoint(tmp_path / "ckpt")
                i = 2
            try:
                got = engine.parameters_fp32()
            except TierIOError as exc:
                errors.append(exc)
                if engine.window.broken is None:  # a write-back of this publish failed: nothing is pending now
                    assert not engine.window.overlap.pending
                    ways.add("synchronize")
                else:  # the last step's write failed under this publish
                    ways.add("step")
                    engine.load_checkpoint(tmp_path / "ckpt")
                    run(engine, data[2:])
                got = engine.parameters_fp32()
            assert errors, f"write-back {n} ({seen[n - 1]}) failed without an error"
            for name, value in expected.items():
                assert torch.equal(got[name], value), f"write-back {n} ({seen[n - 1]}) failed: {name} differs"
    assert {"fetch", "refused", "synchronize"} <= ways, ways


def test_delayed_update_refuses_synchronize_between_forward_and_step(tmp_path):
    with zerotier.initialize(make_model(), config(tmp_path, PLACEMENTS["params-host"], accum=1)) as engine:
        data = batches(VOCAB, SEQ, BATCH, 3)
        x, y = next(data)
        engine.backward(engine(x, y))
        engine.step()  # window 0's update is pending
        x, y = next(data)
        loss = engine(x, y)
        with pytest.raises(ZerotierError, match=r"engine\.synchronize\(\) between a training forward and "
                                                r"engine\.step\(\) with train\.overlap = 'delayed'"):
            engine.save_checkpoint(tmp_path / "ckpt")
        engine.backward(loss)  # the window goes on, untouched
        assert engine.step()
        engine.synchronize()  # between windows: the delay ends
        assert not engine.window.overlap.pending


def test_the_key_is_off_by_default():
    assert zerotier.config.Config().train.overlap == "auto"  # the delayed update is opt-in


def test_zerotier_trainer_trains_and_saves_with_it(tmp_path):
    """transformers' Trainer (the plain loop, a linear lr schedule, clipping, checkpoints every 2
    steps): it runs, each save publishes the pending update, and the first window's loss is the
    undelayed run's (both read the initial weights)."""
    transformers = pytest.importorskip("transformers")
    from zerotier.integrations.transformers import ZerotierTrainer

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return 32

        def __getitem__(self, i):
            ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    def run(delayed_update):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64,
                                                                     n_positions=32))
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / f"out-{delayed_update}"), per_device_train_batch_size=4,
            gradient_accumulation_steps=2, max_grad_norm=0.5, learning_rate=3e-3, weight_decay=0.1,
            num_train_epochs=1, logging_steps=1, report_to=[], use_cpu=True, save_strategy="steps", save_steps=2,
            lr_scheduler_type="linear", seed=0, data_seed=0)
        trainer = ZerotierTrainer(model=model, args=args, train_dataset=Tokens(), zerotier_config={
            "offload": {"params": "host", "gradients": "host", "optimizer": "host"},
            "train": {"overlap": "delayed" if delayed_update else "auto"}})
        trainer.train()
        engine = trainer.engine
        assert engine.global_steps == 4 and not (delayed_update and engine.window.overlap.pending)
        engine.close()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    ours, undelayed = run(True), run(False)
    assert len(ours) == 4 and ours[0] == pytest.approx(undelayed[0], rel=1e-6)
    assert abs(ours[1] - undelayed[1]) > 1e-5, "the second window read fresh weights: the update was not delayed"


def test_the_host_bytes_it_adds_are_checked_at_initialize(tmp_path):
    """The gradient copy and the staged parameters are host-pool blocks beyond the rest of the plan's
    need (delayed.host_bytes), the plan's `delayed` term ([Note: needs per component]): a tiers.host
    without room for them is refused before anything is placed, naming the budget it needs; with
    that budget, training stays within it."""
    offload = PLACEMENTS["optimizer-nvme"]
    cfg = config(tmp_path, offload, accum=1)
    with zerotier.initialize(make_model(), cfg) as engine:
        extra = delayed.host_bytes([u.numel for u in engine.units], 4, 4, engine.cfg.io.alignment)
        assert engine.plan.needs["delayed"] == {"device": 0, "host": extra, "nvme": 0}
        need = engine.plan.need["host"] - extra  # the rest of the plan
    cfg["tiers"]["host"] = need + extra - 4096
    with pytest.raises(zerotier.errors.BudgetError, match=rf"train\.overlap = 'delayed' needs {extra:,} B of host "
                                                          rf"memory beyond the plan's .* raise tiers\.host to at least "
                                                          rf"{format_setting(need + extra)}, ") as ei:
        zerotier.initialize(make_model(), cfg)
    # the advised size as written (issue 37 row 16: '7,356,415 B' is no size the config reads)
    cfg["tiers"]["host"] = str(ei.value).split("raise tiers.host to at least ")[1].split(",")[0]
    with zerotier.initialize(make_model(), cfg) as engine:
        train(engine, batches(VOCAB, SEQ, BATCH, 3), 3, accum=1)
        engine.synchronize()
        assert engine.host_pool.stats()["peak"] <= need + extra
