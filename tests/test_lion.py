"""The Lion update rule in the engine (optimizer.type = "lion", optim/rules/lion.py): against a
reference Lion written here from the paper's formulas on a plain in-memory model, on every
optimizer tier; its state (one moment: "exp_avg") in engine.optimizer's state_dict, in checkpoints
(resumed bitwise) and in the plan's bytes; compact state (bf16 master, bf16 / int8 moment)."""
import warnings

import pytest
import torch

import zerotier
from zerotier.checkpoint_read import CheckpointError
from zerotier.errors import ConfigError
from zerotier.models import batches
from zerotier.optim import _kernels
from zerotier.planner.inputs import ModelFacts, Node, PlanConfig
from zerotier.planner.planner import make_plan
from zerotier.planner.predict import StepOptions

from reference_runs import PLACEMENTS as ALL_PLACEMENTS, adamw_reference, step_means, tiny_gpt as make_model

VOCAB, SEQ, BATCH, STEPS, ACCUM = 64, 16, 4, 8, 2
LR, WD = 1e-3, 0.1
PLACEMENTS = {name: ALL_PLACEMENTS[name] for name in ("all-device", "optimizer-host", "optimizer-nvme", "params-nvme")}


class ReferenceLion(torch.optim.Optimizer):
    """Lion from the formulas: c = b1*m + (1-b1)*g; p = p*(1 - lr*wd) - lr*sign(c); m = b2*m + (1-b2)*g."""

    def __init__(self, params, lr, betas, wd):
        super().__init__(params, {"lr": lr, "betas": betas, "wd": wd})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr, (b1, b2), wd = group["lr"], group["betas"], group["wd"]
            for p in group["params"]:
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                c = b1 * m + (1 - b1) * p.grad
                p.copy_(p * (1 - lr * wd) - lr * torch.sign(c))
                m.copy_(b2 * m + (1 - b2) * p.grad)


def reference_lion_run(model, steps=STEPS, lr=LR, betas=(0.9, 0.99), wd=WD):
    """ReferenceLion over a plain torch model: each step's mean loss and the final weights."""
    losses, weights = adamw_reference(model, batches(VOCAB, SEQ, BATCH, steps * ACCUM, seed=5), lr, ACCUM, clip=None,
                                      optimizer=lambda params: ReferenceLion(params, lr, betas, wd))
    return step_means(losses, ACCUM), weights


def assert_bitwise(got, expected):
    for k in expected:
        assert torch.equal(got[k], expected[k]), k


def adamw_engine_after_one_step(tmp_path):
    """An engine of the default rule (AdamW) on optimizer-host, after one step."""
    cfg = {"offload": PLACEMENTS["optimizer-host"], "tiers": {"nvme_path": str(tmp_path)}}
    engine = zerotier.initialize(make_model(), cfg)
    train(engine, 0, 1)
    return engine


def config(offload, nvme_dir, **optimizer):
    nvme_dir.mkdir(parents=True, exist_ok=True)
    return {"optimizer": {"type": "lion", "lr": LR, "weight_decay": WD, **optimizer}, "offload": offload,
            "tiers": {"nvme_path": str(nvme_dir)}, "train": {"grad_accum_steps": ACCUM}}


def train(engine, start, steps):
    data = list(batches(VOCAB, SEQ, BATCH, (start + steps) * ACCUM, seed=5))[start * ACCUM:]
    losses = []
    for i in range(steps):
        total = 0.0
        for x, y in data[i * ACCUM: (i + 1) * ACCUM]:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            total += float(loss.detach())
        losses.append(total / ACCUM)
    return losses


def train_with_a_checkpoint_after_3_steps(engine, path):
    """6 steps, saving a checkpoint to `path` after the third: the final weights."""
    train(engine, 0, 3)
    engine.save_checkpoint(path)
    train(engine, 3, 3)
    return engine.parameters_fp32()


@pytest.mark.parametrize("name", PLACEMENTS)
def test_lion_matches_a_reference_lion_on_every_tier(name, tmp_path):
    ref_losses, ref_weights = reference_lion_run(make_model())
    with zerotier.initialize(make_model(), config(PLACEMENTS[name], tmp_path / "nvme")) as engine:
        assert {k: v.value for k, v in engine.plan.placement.items()} == PLACEMENTS[name]
        assert engine.unit_optimizer.rule.name == "lion" and engine.unit_optimizer.layout.keys == ("master", "exp_avg")
        losses = train(engine, 0, STEPS)
        weights = engine.parameters_fp32()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert weights.keys() == ref_weights.keys()
    for key in ref_weights:
        torch.testing.assert_close(weights[key], ref_weights[key], rtol=1e-5, atol=1e-6, msg=key)
    assert any(not torch.equal(weights[k], make_model().state_dict()[k]) for k in weights)


def test_lion_defaults_groups_and_state_dict(tmp_path):
    """Left at AdamW's defaults, lr / betas / weight_decay are Lion's; given ones are kept. The state
    dict holds {"step", "exp_avg"} per parameter and loads into a fresh engine bit for bit."""
    host = PLACEMENTS["optimizer-host"]
    cfg = {"optimizer": {"type": "lion"}, "offload": host, "tiers": {"nvme_path": str(tmp_path)}}
    with zerotier.initialize(make_model(), cfg) as engine:
        group = engine.optimizer.param_groups[0]
        assert (group["lr"], tuple(group["betas"]), group["weight_decay"]) == (1e-4, (0.9, 0.99), 0.0)
        assert "eps" not in group and "decoupled_weight_decay" not in group
    with zerotier.initialize(make_model(), config(host, tmp_path, betas=[0.95, 0.98])) as engine:
        group = engine.optimizer.param_groups[0]
        assert (group["lr"], tuple(group["betas"]), group["weight_decay"]) == (LR, (0.95, 0.98), WD)
        train(engine, 0, 2)
        state = engine.optimizer.state_dict()
        model_state = {k: v.clone() for k, v in engine.module.state_dict().items()}
        assert state["state"] and all(set(s) == {"step", "exp_avg"} for s in state["state"].values())
        assert all(float(s["step"]) == 2 for s in state["state"].values())
        train(engine, 2, 2)
        expected = engine.parameters_fp32()
    with zerotier.initialize(make_model(), config(host, tmp_path, betas=[0.95, 0.98])) as engine:
        engine.module.load_state_dict(model_state)
        engine.optimizer.load_state_dict(state)
        train(engine, 2, 2)
        assert_bitwise(engine.parameters_fp32(), expected)


def test_an_adam_state_dict_does_not_load_into_lion(tmp_path):
    host = PLACEMENTS["optimizer-host"]
    with adamw_engine_after_one_step(tmp_path) as engine:
        adam_state = engine.optimizer.state_dict()
    with zerotier.initialize(make_model(), config(host, tmp_path)) as engine:
        train(engine, 0, 1)
        state = engine.optimizer.state_dict()
        assert all(set(s) == {"step", "exp_avg"} for s in state["state"].values())
        adam_state["param_groups"] = state["param_groups"]
        adam_state["state"] = {k: {kk: vv for kk, vv in v.items() if kk != "exp_avg"} for k, v in
                               adam_state["state"].items()}
        with pytest.raises(ValueError, match="is not Lion's: it needs step and exp_avg"):
            engine.optimizer.load_state_dict(adam_state)


@pytest.mark.parametrize("master,moments", [("fp32", "fp32"), ("bf16", "bf16"), ("bf16", "int8")])
@pytest.mark.parametrize("where", ["optimizer-host", "optimizer-nvme"])
def test_lion_checkpoints_resume_bitwise(where, master, moments, tmp_path):
    """Save mid-run, load into a fresh engine, continue: the uninterrupted run's weights, bit for
    bit, compact state included (one moment: Lion's exp_avg, in the layout's dtype)."""
    def cfg(sub):
        out = config(PLACEMENTS[where], tmp_path / sub)
        out["precision"] = {"master_dtype": master, "moment_dtype": moments}
        return out
    with zerotier.initialize(make_model(), cfg("a")) as engine:
        layout = engine.unit_optimizer.layout
        assert layout.keys == ("master", "exp_avg") and layout.moments == moments
        expected = train_with_a_checkpoint_after_3_steps(engine, tmp_path / "ck")
        for unit in engine.units:
            n, unit_layout = unit.shard_numel, layout.for_unit(unit)
            if where == "optimizer-nvme":
                assert engine.store.nbytes(f"{unit.key}.exp_avg") == unit_layout.nbytes("exp_avg", n)
            else:
                assert sorted(engine.unit_optimizer.state.slots[unit.index].homes) == ["exp_avg", "master"]
    with zerotier.initialize(make_model(), cfg("b")) as engine:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            engine.load_checkpoint(tmp_path / "ck")
        train(engine, 3, 3)
        assert_bitwise(engine.parameters_fp32(), expected)


def test_a_checkpoint_of_another_rule_is_refused_before_anything_changes(tmp_path):
    host = PLACEMENTS["optimizer-host"]
    with adamw_engine_after_one_step(tmp_path) as engine:
        engine.save_checkpoint(tmp_path / "adam")
    with zerotier.initialize(make_model(), config(host, tmp_path)) as engine:
        train(engine, 0, 1)
        before = engine.parameters_fp32()
        with pytest.raises(CheckpointError, match=r"holds adamw optimizer state \(master, exp_avg, exp_avg_sq\), "
                                                  r"this engine runs lion \(master, exp_avg\): load it with "
                                                  r"optimizer.type = 'adamw'"):
            engine.load_checkpoint(tmp_path / "adam")
        after = engine.parameters_fp32()
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert engine.global_steps == 1


def test_plan_counts_lions_bytes_per_parameter():
    """One moment: 8 B/param of fp32 state where AdamW keeps 12; 4 with bf16 master and moment."""
    numels = [1_000_000] * 4
    for master, moments, lion, adamw in (("fp32", "fp32", 8, 12), ("bf16", "bf16", 4, 6)):
        cfg = zerotier.Config.from_dict({"precision": {"master_dtype": master, "moment_dtype": moments},
                                         "offload": {"params": "host", "gradients": "host", "optimizer": "host"},
                                         "tiers": {"device": "1GiB", "host": "1GiB", "nvme": 0}})
        sections = (cfg.tiers, cfg.offload, cfg.precision, cfg.prefetch)
        plans = {kind: make_plan(ModelFacts.of_sizes(numels), PlanConfig(*sections, step=StepOptions(optimizer=kind)),
                                 Node()) for kind in ("lion", "adamw")}
        assert plans["lion"].state_bytes["optimizer"] == lion * 4_000_000
        assert plans["adamw"].state_bytes["optimizer"] == adamw * 4_000_000
        assert plans["adamw"].need["host"] - plans["lion"].need["host"] >= (adamw - lion) * 4_000_000
    lion_cfg = zerotier.Config.from_dict({"optimizer": {"type": "lion"}})
    assert StepOptions.of(lion_cfg).optimizer == "lion"
    compact = _kernels.state_bytes_per_param("bf16", "int8", moments=1)
    assert compact == 2 + 1 + 4 / 256
    assert "optimizer state (master, exp_avg): master bf16, moments bf16: 4 B/param (50% less than fp32); " \
        "master/moments B/param: fp32/fp32 8 -> bf16/bf16 4 -> bf16/int8 3.016" in plans["lion"].summary()


def test_optimizer_type_names_its_choices():
    with pytest.raises(ConfigError, match=r"optimizer\.type: must be one of 'adamw', 'adam', 'lion', got 'sgd'"):
        zerotier.Config.from_dict({"optimizer": {"type": "sgd"}})
