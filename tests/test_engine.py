"""The engine against plain PyTorch + torch.optim.AdamW on the same data.

Tolerance: fp32 master paths match within 1e-5 relative (plus 1e-6 absolute for
weights near zero) in losses and final weights after 20 optimizer steps with
gradient accumulation 2 and clipping at 1.0. bf16 parameters: losses within 2e-2
relative of the fp32 reference (bf16 has 8 mantissa bits).
"""
import pytest
import torch

import zerotier
from zerotier.errors import BudgetError, ConfigError, ZerotierError
from zerotier.models import TinyGPT, batches

import reference_runs

STEPS, ACCUM, CLIP, LR = 20, 2, 1.0, 3e-3
VOCAB, SEQ, BATCH = 128, 16, 4


def make_model(seed=0, layers=2, **kw):
    torch.manual_seed(seed)
    return TinyGPT(vocab=VOCAB, dim=32, layers=layers, heads=2, seq=SEQ, **kw)


def reference_run(model, steps=STEPS):
    """torch.optim.AdamW on the engine runs' data: each step's mean loss, the final weights."""
    losses, weights = reference_runs.adamw_reference(model, batches(VOCAB, SEQ, BATCH, steps * ACCUM), LR, ACCUM,
                                                     clip=CLIP)
    return reference_runs.step_means(losses, ACCUM), weights


def engine_run(model, config, steps=STEPS):
    cfg = {"optimizer": {"lr": LR, "weight_decay": 0.01},
           "train": {"grad_accum_steps": ACCUM, "max_grad_norm": CLIP}}
    for section, values in config.items():
        cfg.setdefault(section, {}).update(values)
    losses = []
    data = batches(VOCAB, SEQ, BATCH, steps * ACCUM)
    with zerotier.initialize(model, cfg) as engine:
        for _ in range(steps):
            total = 0.0
            for _ in range(ACCUM):
                x, y = next(data)
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
                total += float(loss.detach())
            losses.append(total / ACCUM)
        weights = engine.parameters_fp32()
        placement = {k: v.value for k, v in engine.plan.placement.items()}
    return losses, weights, placement


PLACEMENTS = {
    **reference_runs.PLACEMENTS,
    # the new parameters go home through a pool block (it crashed at step 1: issue 26 item 3)
    "params-nvme-optimizer-device": {"params": "nvme", "gradients": "device", "optimizer": "device"},
    "auto-small-device": "auto",  # the planner decides, under a device budget of ~3 B/param
}


@pytest.mark.parametrize("name", PLACEMENTS)
def test_matches_torch_adamw(name, tmp_path):
    layers = 6 if PLACEMENTS[name] == "auto" else 2  # streaming 2 of 6 blocks saves device memory
    ref_losses, ref_weights = reference_run(make_model(layers=layers))
    tiers = {"nvme_path": str(tmp_path)}
    if PLACEMENTS[name] == "auto":
        tiers["device"] = 3 * sum(p.numel() for p in set(make_model(layers=layers).parameters()))
        offload = {}
    else:
        offload = PLACEMENTS[name]
    losses, weights, placement = engine_run(make_model(layers=layers), {"offload": offload, "tiers": tiers})
    if offload:
        assert placement == offload
    else:
        assert placement["params"] != "device", placement  # the small budget forced offload
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert weights.keys() == ref_weights.keys()
    atol = 1e-6 if layers == 2 else 3e-6  # 6 layers: all-device differs from torch by 1.8e-6 too (sum order)
    for key in ref_weights:
        torch.testing.assert_close(weights[key], ref_weights[key], rtol=1e-5, atol=atol, msg=key)
    assert list(tmp_path.iterdir()) == [], "the NVMe run directory must be removed on close"


def test_activation_checkpointing_with_offloaded_params(tmp_path):
    ref_losses, ref_weights = reference_run(make_model(checkpointing=True), steps=5)
    losses, weights, _ = engine_run(make_model(checkpointing=True),
                                    {"offload": PLACEMENTS["params-nvme"], "tiers": {"nvme_path": str(tmp_path)}},
                                    steps=5)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    for key in ref_weights:
        torch.testing.assert_close(weights[key], ref_weights[key], rtol=1e-5, atol=1e-6)


def test_bf16_params_with_fp32_master_track_fp32_reference():
    ref_losses, _ = reference_run(make_model(), steps=10)
    losses, _, _ = engine_run(make_model(), {"precision": {"param_dtype": "bf16"},
                                             "offload": PLACEMENTS["params-host"]}, steps=10)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=2e-2, atol=0)


def test_fp16_dynamic_loss_scaling_skips_overflow_steps():
    model = make_model()
    cfg = {"precision": {"param_dtype": "fp16", "loss_scale": "dynamic", "initial_scale_power": 40,
                         "hysteresis": 1}, "offload": PLACEMENTS["optimizer-host"]}
    with zerotier.initialize(model, cfg) as engine:
        data = batches(VOCAB, SEQ, BATCH, 40)
        updated = []
        for x, y in data:
            engine.backward(engine(x, y).float())
            updated.append(engine.step())
        # 2**40 overflows fp16 gradients: steps are skipped and the scale halves until they fit
        assert not updated[0] and any(updated)
        assert engine.scaler.scale < 2.0 ** 40
        assert engine.scaler.skipped_steps == updated.index(True)


def test_prefetch_order_change_warns_once_and_keeps_training():
    class Branchy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = (torch.nn.Linear(8, 8) for _ in range(3))

        def forward(self, x, flip=False):
            first, second = (self.b, self.a) if flip else (self.a, self.b)
            return self.c(second(first(x))).square().mean()

    torch.manual_seed(0)
    engine = zerotier.initialize(Branchy(), {"offload": {"params": "host"}, "train": {"wrap": ["Linear"]}})
    x = torch.randn(4, 8)
    for flip in (False, False):
        engine.backward(engine(x, flip))
        engine.step()
    assert engine.scheduler.trace is not None
    with pytest.warns(RuntimeWarning, match="module order changed at 'b'"):
        engine.backward(engine(x, True))
    engine.step()
    assert engine.scheduler.divergences == 1
    with pytest.warns(RuntimeWarning, match="module order changed at 'a'"):
        engine.backward(engine(x, False))  # the re-recorded order differs again: warns, never raises
    engine.step()
    assert engine.scheduler.divergences == 2
    engine.close()


def test_prefetch_hits_after_first_step():
    engine = zerotier.initialize(make_model(), {"offload": PLACEMENTS["params-host"]})
    for x, y in batches(VOCAB, SEQ, BATCH, 3):
        engine.backward(engine(x, y))
        engine.step()
    assert engine.scheduler.trace and engine.scheduler.divergences == 0
    engine.close()


def test_too_small_budget_fails_at_initialize_with_what_is_missing():
    model = make_model()
    n = sum(p.numel() for p in set(model.parameters()))
    # params + grads fit on the device (8 B/param), the 12 B/param optimizer state fits nowhere
    with pytest.raises(BudgetError, match=r"the optimizer of .* does not fit.*more device.*more host"
                                          r".*enable the nvme tier"):
        zerotier.initialize(model, {"tiers": {"device": 9 * n, "host": "1KiB"}})


def test_auto_placement_prefers_device_then_host():
    model = make_model()
    n = sum(p.numel() for p in set(model.parameters()))
    # room for params + grads on device (8 B/param) but not the 12 B/param optimizer state
    engine = zerotier.initialize(model, {"tiers": {"device": 10 * n, "host": "1GiB"}})
    placement = {k: v.value for k, v in engine.plan.placement.items()}
    assert placement == {"params": "device", "gradients": "device", "optimizer": "host"}
    engine.close()


def test_step_before_backward_is_an_error():
    engine = zerotier.initialize(make_model(), {})
    with pytest.raises(ZerotierError, match="before engine.backward"):
        engine.step()
    engine.close()  # an engine left open keeps the signal handlers installed for the tests after it


def test_model_without_trainable_parameters_is_an_error():
    model = torch.nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ConfigError, match="no trainable parameters"):
        zerotier.initialize(model, {})


def test_frozen_parameters_are_left_alone():
    model = make_model()
    model.blocks[0].requires_grad_(False)
    frozen = {n: p.detach().clone() for n, p in model.blocks[0].named_parameters()}
    engine = zerotier.initialize(model, {"offload": {"params": "host"}})
    for x, y in batches(VOCAB, SEQ, BATCH, 2):
        engine.backward(engine(x, y))
        engine.step()
    for n, p in model.blocks[0].named_parameters():
        assert torch.equal(p, frozen[n])
    engine.close()


def test_lr_scheduler_drives_engine_lr():
    engine = zerotier.initialize(make_model(), {"optimizer": {"lr": 1.0}})
    sched = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=1, gamma=0.1)
    for x, y in batches(VOCAB, SEQ, BATCH, 2):
        engine.backward(engine(x, y))
        engine.step()
        sched.step()
    assert engine.optimizer.param_groups[0]["lr"] == pytest.approx(0.01)
    engine.close()


def run_without_clipping(model, config=None, steps=6, accum=2):
    """Plain loop or engine run with clipping off (the early-step path's precondition)."""
    data = list(batches(VOCAB, SEQ, BATCH, steps * accum))
    if config is None:
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
        for i, (x, y) in enumerate(data):
            (model(x, y) / accum).backward()
            if (i + 1) % accum == 0:
                opt.step()
                opt.zero_grad()
        return {n: p.detach().clone() for n, p in model.named_parameters()}, 0
    cfg = {"optimizer": {"lr": LR, "weight_decay": 0.01}, "train": {"grad_accum_steps": accum, "overlap": "early"},
           **config}
    early = 0
    with zerotier.initialize(model, cfg) as engine:
        for x, y in data:
            engine.backward(engine(x, y))
            early += len(engine.window.overlap.early)  # updates started on the optimizer thread during this backward
            engine.step()
        return engine.parameters_fp32(), early


@pytest.mark.parametrize("name", ["optimizer-host", "params-host", "params-nvme"])
def test_update_during_backward_is_exact(name, tmp_path):
    ref, _ = run_without_clipping(make_model())
    ours, early = run_without_clipping(make_model(), {"offload": PLACEMENTS[name],
                                                      "tiers": {"nvme_path": str(tmp_path)}})
    assert early > 0, "with no clipping and static loss scale, units must be stepped during backward"
    for key in ref:
        torch.testing.assert_close(ours[key], ref[key], rtol=1e-5, atol=1e-6, msg=key)


def test_parameter_without_gradient_is_not_updated():
    """Like torch.optim.AdamW skipping params whose .grad is None: no decay, no moment update, even
    when other parameters of its unit (here the root's) got one."""
    class TwoHeads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.used(x).square().mean()

    torch.manual_seed(0)
    model = TwoHeads()
    before = model.unused.weight.detach().clone()
    with zerotier.initialize(model, {"optimizer": {"weight_decay": 0.1}}) as engine:
        engine.backward(engine(torch.randn(2, 4)))
        engine.step()
        assert torch.equal(engine.parameters_fp32()["unused.weight"], before)
        assert engine.unit_optimizer.state.steps[0] == [1, 1, 0, 0]  # used.weight/bias stepped, unused.* not


@pytest.mark.pins("design#one-memory-system-for-a-one-rank-step")
def test_device_tier_peak_stays_within_budget(tmp_path):
    model = make_model(layers=6)  # streaming 6 blocks, a few at a time, saves device memory
    n = sum(p.numel() for p in set(model.parameters()))
    budget = 3 * n  # well below the 16 B/param of training state: params, grads and optimizer go off-device
    with zerotier.initialize(model, {"tiers": {"device": budget, "host": "1GiB", "nvme_path": str(tmp_path)},
                                     "prefetch": {"lookahead": 2}}) as engine:
        assert engine.plan.placement["params"].value != "device"
        for x, y in batches(VOCAB, SEQ, BATCH, 4):
            engine.backward(engine(x, y))
            engine.step()
        stats = engine.device_tier.stats()
        assert 0 < stats["peak"] <= stats["budget"] == budget
        assert stats["current"] == 0  # nothing resident between steps


@pytest.mark.parametrize("name", [n for n in PLACEMENTS if n != "auto-small-device"])
def test_parameter_unused_on_some_steps_matches_torch(name, tmp_path):
    """A module owning p1 and p2, p2 used only on some micro-batches: windows where p2 got no
    gradient leave it (and its step count) untouched, as torch.optim.AdamW does; later windows
    use its own bias correction. Accumulation 2, clipping, 6 optimizer steps."""
    class Sometimes(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.p1 = torch.nn.Parameter(torch.randn(40))
            self.p2 = torch.nn.Parameter(torch.randn(40))

        def forward(self, x, use_p2):
            y = x * self.p1
            return ((y + self.p2) if use_p2 else y).square().mean()

    uses = [False, False, True, False, False, False, True, True, False, False, False, True]
    gen = torch.Generator().manual_seed(4)
    data = [torch.randn(40, generator=gen) for _ in uses]
    torch.manual_seed(0)
    ref = Sometimes()
    ours_model = Sometimes()
    ours_model.load_state_dict(ref.state_dict())
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1)
    for i, (x, use) in enumerate(zip(data, uses)):
        (ref(x, use) / 2).backward()
        if i % 2:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
            opt.step()
            opt.zero_grad(set_to_none=True)
    cfg = {"offload": PLACEMENTS[name], "tiers": {"nvme_path": str(tmp_path)},
           "optimizer": {"lr": LR, "weight_decay": 0.1}, "train": {"grad_accum_steps": 2, "max_grad_norm": CLIP}}
    with zerotier.initialize(ours_model, cfg) as engine:
        for x, use in zip(data, uses):
            engine.backward(engine(x, use))
            engine.step()
        ours = engine.parameters_fp32()
        assert engine.unit_optimizer.state.steps[0] == [6, 3]  # p2 had a gradient in 3 of the 6 windows
    torch.testing.assert_close(ours["p1"], ref.p1.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours["p2"], ref.p2.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["all-device", "params-nvme"])
def test_no_weight_decay_matches_torch_param_groups(name, tmp_path):
    """optimizer.no_weight_decay exempts parameters by name glob, like a torch param group with
    weight_decay 0 (biases and norm weights, the usual recipe)."""
    model = make_model()
    exempt = [p for n, p in model.named_parameters() if n.endswith(".bias") or "ln" in n]
    decayed = [p for p in model.parameters() if all(p is not q for q in exempt)]
    opt = torch.optim.AdamW([{"params": decayed}, {"params": exempt, "weight_decay": 0.0}], lr=LR, weight_decay=0.1)
    data = list(batches(VOCAB, SEQ, BATCH, 8))
    for x, y in data:
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    cfg = {"offload": PLACEMENTS[name], "tiers": {"nvme_path": str(tmp_path)},
           "optimizer": {"lr": LR, "weight_decay": 0.1, "no_weight_decay": ["*.bias", "*ln*"]}}
    with zerotier.initialize(make_model(), cfg) as engine:
        for x, y in data:
            engine.backward(engine(x, y))
            engine.step()
        ours = engine.parameters_fp32()
    for n, p in model.named_parameters():
        torch.testing.assert_close(ours[n], p.detach(), rtol=1e-5, atol=1e-6, msg=n)


def test_no_weight_decay_pattern_matching_nothing_is_an_error():
    with pytest.raises(ConfigError, match=r"no_weight_decay: \['\*\.gamma'\] match no trainable parameter"):
        zerotier.initialize(make_model(), {"optimizer": {"no_weight_decay": ["*.gamma"]}})
