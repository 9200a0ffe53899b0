"""Hugging Face loops over a zerotier-managed model: transformers' Trainer and accelerate drive
engine.optimizer through the plain PyTorch loop ([Note: the plain PyTorch loop] in window.py)
and train exactly like the same loop without zerotier."""
from __future__ import annotations

import tempfile

import pytest
import torch

import zerotier

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

ZT = {"offload": {"params": "host", "gradients": "host", "optimizer": "host"},
      "optimizer": {"lr": 3e-3, "weight_decay": 0.0}, "train": {"max_grad_norm": 1.0}}

# close() of an engine zerotier.from_pretrained built on the meta device: the weights stay in the engine
META_NOT_PUT_BACK = "parameters of a model built on the meta device are not put back into it"


def gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    return transformers.GPT2LMHeadModel(cfg)


class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        gen = torch.Generator().manual_seed(1)
        self.ids = [torch.randint(0, 64, (16,), generator=gen) for _ in range(32)]

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def trainer_losses(model, optimizer=None):
    args = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, gradient_accumulation_steps=2,
        max_grad_norm=1.0, learning_rate=3e-3, weight_decay=0.0, num_train_epochs=1, logging_steps=1,
        report_to=[], use_cpu=True, save_strategy="no", lr_scheduler_type="constant", seed=0, data_seed=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(),
                                   optimizers=(optimizer, None) if optimizer is not None else (None, None))
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_trainer_with_engine_optimizer_matches_plain_trainer():
    expected = trainer_losses(gpt2())
    model = gpt2()
    with zerotier.initialize(model, ZT) as engine:
        losses = trainer_losses(model, engine.optimizer)
        assert engine.global_steps == 4  # 32 samples / (4 x 2 accumulation)
    assert len(losses) == 4
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6)


def test_accelerate_backward_trains_like_plain_torch():
    def run(use_zerotier):
        model = gpt2()
        engine = zerotier.initialize(model, ZT) if use_zerotier else None
        opt = engine.optimizer if use_zerotier else torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
        accelerator = accelerate.Accelerator(cpu=True)
        model, opt = accelerator.prepare(model, opt)
        data = Tokens()
        for i in range(8):
            batch = data[i]
            loss = model(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss
            accelerator.backward(loss)
            if not use_zerotier:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        weights = engine.parameters_fp32() if use_zerotier else {n: p.detach().clone()
                                                                for n, p in model.named_parameters()}
        if engine is not None:
            engine.close()
        return weights
    ours, ref = run(True), run(False)
    for name in ref:
        if name.endswith("attn.c_attn.bias"):
            # its key third has a gradient of exactly 0 in exact arithmetic (softmax ignores a shift):
            # rounding noise there, which Adam normalizes to steps of size lr, differs run to run
            continue
        torch.testing.assert_close(ours[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)


def trainer_logs(trainer):
    trainer.train()
    history = trainer.state.log_history
    return [h["loss"] for h in history if "loss" in h], [h["grad_norm"] for h in history if "grad_norm" in h]


def test_zerotier_trainer_logs_the_true_gradient_norm_and_matches_plain_trainer():
    from zerotier.integrations.transformers import ZerotierTrainer

    def args():
        return transformers.TrainingArguments(
            output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, gradient_accumulation_steps=2,
            max_grad_norm=0.5, learning_rate=3e-3, weight_decay=0.1, num_train_epochs=1, logging_steps=1,
            report_to=[], use_cpu=True, save_strategy="no", lr_scheduler_type="linear", seed=0, data_seed=0)
    expected_losses, expected_norms = trainer_logs(transformers.Trainer(model=gpt2(), args=args(),
                                                                        train_dataset=Tokens()))
    trainer = ZerotierTrainer(model=gpt2(), args=args(), train_dataset=Tokens(),
                              zerotier_config={"offload": {"params": "host", "gradients": "host", "optimizer": "host"}})
    losses, norms = trainer_logs(trainer)
    assert trainer.engine.global_steps == 4 and trainer.engine.cfg.train.max_grad_norm == 0.5
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(expected_norms), rtol=1e-5, atol=1e-6)
    assert min(norms) > 0
    trainer.engine.close()


def test_zerotier_trainer_resumes_from_its_checkpoints_exactly(tmp_path):
    from zerotier.integrations.transformers import ZerotierTrainer
    zt = {"offload": {"params": "nvme", "gradients": "host", "optimizer": "nvme"},
          "tiers": {"nvme_path": str(tmp_path)}}

    def trainer(out):
        args = transformers.TrainingArguments(
            output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=2, max_grad_norm=1.0,
            learning_rate=3e-3, weight_decay=0.0, max_steps=4, save_steps=2, logging_steps=1, report_to=[],
            use_cpu=True, lr_scheduler_type="linear", seed=0, data_seed=0)
        return ZerotierTrainer(model=gpt2(), args=args, train_dataset=Tokens(), zerotier_config=zt)

    whole = trainer(tmp_path / "whole")
    whole.train()
    expected = whole.engine.parameters_fp32()
    whole.engine.close()
    assert (tmp_path / "whole" / "checkpoint-2" / "zerotier" / "latest").exists()

    resumed = trainer(tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-2"))
    assert resumed.engine.global_steps == 4
    got = resumed.engine.parameters_fp32()
    resumed.engine.close()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def test_a_trainer_checkpoint_with_the_engine_state_of_another_step_is_refused(tmp_path):
    """Issue 37 row 14: checkpoint-2 whose zerotier/ is checkpoint-4's resumed silently (the weights of
    step 4 trained on with step 2's schedule and data). Refused before anything loads, naming both steps."""
    import shutil

    from zerotier.integrations.transformers import ZerotierTrainer

    def trainer(out):
        args = transformers.TrainingArguments(
            output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=1, max_grad_norm=1.0,
            learning_rate=3e-3, weight_decay=0.0, max_steps=4, save_steps=2, report_to=[], use_cpu=True,
            lr_scheduler_type="linear", seed=0, data_seed=0)
        return ZerotierTrainer(model=gpt2(), args=args, train_dataset=Tokens(), zerotier_config=ZT)

    whole = trainer(tmp_path / "whole")
    whole.train()
    whole.engine.close()
    grafted = tmp_path / "whole" / "checkpoint-2"
    shutil.rmtree(grafted / "zerotier")
    shutil.copytree(tmp_path / "whole" / "checkpoint-4" / "zerotier", grafted / "zerotier")
    resumed = trainer(tmp_path / "resumed")
    before = resumed.engine.parameters_fp32()
    with pytest.raises(zerotier.ZerotierError, match=r"checkpoint-2: its trainer_state.json is at step 2 but "
                                                     r"the engine's checkpoint .*checkpoint-2/zerotier/ckpt-4 is at "
                                                     r"step 4: .*nothing was loaded"):
        resumed.train(resume_from_checkpoint=str(grafted))
    assert resumed.engine.global_steps == 0
    after = resumed.engine.parameters_fp32()
    assert all(torch.equal(before[n], after[n]) for n in before)
    resumed.engine.close()


def test_export_writes_a_directory_from_pretrained_loads(tmp_path):
    """zerotier export --to DIR: model.safetensors + the model's config.json; transformers'
    from_pretrained loads it and computes what the trained engine computes."""
    import subprocess
    import sys

    model = gpt2()
    ids = Tokens()[0]["input_ids"][None]
    with zerotier.initialize(model, dict(ZT, tiers={"nvme_path": str(tmp_path)})) as engine:
        for i in range(4):
            batch = Tokens()[i]
            engine.backward(model(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss)
            engine.step()
        engine.save_checkpoint(tmp_path / "ck")
    model.eval()  # close() put the trained weights back into the model
    with torch.no_grad():
        want = model(input_ids=ids).logits
    out = tmp_path / "hf"
    subprocess.run([sys.executable, "-m", "zerotier.cli", "export", str(tmp_path / "ck"), "--to", str(out)],
                   check=True, capture_output=True)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    loaded.eval()
    with torch.no_grad():
        got = loaded(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def best_model_weights(model, optimizer=None):
    """A Trainer that evaluates and saves every 2 steps and loads the best checkpoint at the end
    (model.load_state_dict on the live model: [Note: the parameter surface])."""
    args = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, gradient_accumulation_steps=1,
        max_grad_norm=1.0, learning_rate=3e-3, weight_decay=0.0, num_train_epochs=1, report_to=[], use_cpu=True,
        eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2, load_best_model_at_end=True,
        metric_for_best_model="loss", greater_is_better=True, lr_scheduler_type="constant", seed=0, data_seed=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(), eval_dataset=Tokens(),
                                   optimizers=(optimizer, None) if optimizer is not None else (None, None))
    trainer.train()
    assert trainer.state.best_model_checkpoint is not None
    assert not trainer.state.best_model_checkpoint.endswith(f"checkpoint-{trainer.state.global_step}")
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_trainer_load_best_model_at_end_loads_into_the_engine():
    """greater_is_better=True on the eval loss picks an early checkpoint, so the final weights are
    the loaded ones, not the last step's."""
    expected = best_model_weights(gpt2())
    model = gpt2()
    with zerotier.initialize(model, ZT) as engine:
        best_model_weights(model, engine.optimizer)
        got = engine.parameters_fp32()
    for name, value in expected.items():  # atol: the attention key bias's true gradient is ~0 (Adam steps on noise)
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-5, msg=name)


# --- from a directory to Trainer (issue 26 item 2) ---------------------------------------------

def hf_args(**kw):
    values = dict(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                  max_grad_norm=0.5, learning_rate=3e-3, weight_decay=0.1, num_train_epochs=1, logging_steps=1,
                  report_to=[], use_cpu=True, save_strategy="no", lr_scheduler_type="linear", seed=0, data_seed=0)
    return transformers.TrainingArguments(**{**values, **kw})


def exempt_names(trainer, model):
    """Names of the parameters in the trainer's optimizer groups with weight_decay 0."""
    name = {id(p): n for n, p in model.named_parameters()}
    return sorted(name[id(p)] for g in trainer.optimizer.param_groups if g["weight_decay"] == 0 for p in g["params"])


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    """Plain Trainer on the saved model: its losses, final weights and weight-decay exemptions."""
    directory = tmp_path_factory.mktemp("gpt2")
    gpt2().save_pretrained(directory)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    trainer = transformers.Trainer(model=model, args=hf_args(), train_dataset=Tokens())
    losses, _ = trainer_logs(trainer)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return directory, losses, weights, exempt_names(trainer, model)


@pytest.mark.parametrize("params", ["host", "nvme"])
@pytest.mark.parametrize("how", ["ZerotierTrainer.from_pretrained", "zerotier.from_pretrained then ZerotierTrainer"])
def test_a_directory_to_zerotier_trainer_trains_like_plain_trainer(plain_run, tmp_path, how, params):
    """No optimizer keys in the zerotier config: TrainingArguments fill them (lr, weight decay with
    Trainer's exemptions, clipping), on the engine before it is built or on the live one."""
    from zerotier.integrations.transformers import ZerotierTrainer

    directory, expected_losses, expected, expected_exempt = plain_run
    zt = {"offload": {"params": params, "gradients": "host", "optimizer": "host"},
          "tiers": {"nvme_path": str(tmp_path)}}
    if how == "ZerotierTrainer.from_pretrained":
        trainer = ZerotierTrainer.from_pretrained(directory, hf_args(), train_dataset=Tokens(), zerotier_config=zt)
    else:
        engine = zerotier.from_pretrained(directory, zt)
        trainer = ZerotierTrainer(model=engine.module, args=hf_args(), train_dataset=Tokens())
        assert trainer.engine is engine
    assert len(expected_exempt) > 0 and exempt_names(trainer, trainer.engine.module) == expected_exempt
    losses, _ = trainer_logs(trainer)
    assert trainer.engine.global_steps == len(losses) == 4
    cfg = trainer.engine.cfg
    assert (cfg.optimizer.lr, cfg.optimizer.weight_decay, cfg.train.max_grad_norm) == (3e-3, 0.1, 0.5)
    got = trainer.engine.parameters_fp32()
    with pytest.warns(RuntimeWarning, match=META_NOT_PUT_BACK):  # built on the meta device by from_pretrained
        trainer.engine.close()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=1e-5, atol=1e-6)
    for name, value in expected.items():  # atol: the attention key bias's true gradient is ~0 (Adam steps on noise)
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-5, msg=name)


def test_trainer_exempts_the_same_parameters_from_weight_decay():
    """Biases and LayerNorm weights (Trainer's get_decay_parameter_names) get weight_decay 0, the
    rest TrainingArguments' weight_decay, in ZerotierTrainer's optimizer as in plain Trainer's."""
    from zerotier.integrations.transformers import ZerotierTrainer

    model = gpt2()
    trainer = ZerotierTrainer(model=model, args=hf_args(weight_decay=0.05), train_dataset=Tokens(),
                              zerotier_config={"offload": {"params": "host", "gradients": "host", "optimizer": "host"}})
    decayed = set(trainer.get_decay_parameter_names(model))
    exempt = exempt_names(trainer, model)
    assert exempt == sorted(n for n, _ in model.named_parameters() if n not in decayed)
    assert any(n.endswith(".bias") for n in exempt) and any(".ln_" in n for n in exempt)
    assert [g["weight_decay"] for g in trainer.optimizer.param_groups] == [0.05, 0.0]
    trainer.engine.close()


def test_conflicting_settings_are_refused_naming_both_values(tmp_path):
    from zerotier.integrations.transformers import ZerotierTrainer

    with pytest.raises(zerotier.ConfigError, match=r"optimizer\.lr = 0\.0001 in the zerotier config but "
                                                   r"TrainingArguments' learning_rate gives 0\.003"):
        ZerotierTrainer(model=gpt2(), args=hf_args(), zerotier_config={"optimizer": {"lr": 1e-4}})
    with pytest.raises(zerotier.ConfigError, match=r"train\.max_grad_norm = 2\.0 .* max_grad_norm gives 0\.5"):
        ZerotierTrainer(model=gpt2(), args=hf_args(), zerotier_config={"train": {"max_grad_norm": 2.0}})
    with pytest.raises(zerotier.ConfigError, match=r"optimizer\.no_weight_decay = \['\*\.bias'\] exempts"):
        ZerotierTrainer(model=gpt2(), args=hf_args(), zerotier_config={"optimizer": {"no_weight_decay": ["*.bias"]}})
    # "auto" and the keys left out are TrainingArguments' to fill
    trainer = ZerotierTrainer(model=gpt2(), args=hf_args(), zerotier_config={"optimizer": {"lr": "auto"}})
    assert trainer.engine.cfg.optimizer.lr == 3e-3
    trainer.engine.close()

    gpt2().save_pretrained(tmp_path / "gpt2")
    engine = zerotier.from_pretrained(tmp_path / "gpt2", {"optimizer": {"betas": [0.9, 0.95]}})
    with pytest.raises(zerotier.ConfigError, match=r"optimizer\.betas = \(0\.9, 0\.95\) in the zerotier config "
                                                   r"but TrainingArguments' \(adam_beta1, adam_beta2\) gives "
                                                   r"\(0\.9, 0\.999\).*The engine is built already"):
        ZerotierTrainer(model=engine.module, args=hf_args())
    with pytest.warns(RuntimeWarning, match=META_NOT_PUT_BACK):
        engine.close()
    engine = zerotier.from_pretrained(tmp_path / "gpt2")
    with pytest.raises(zerotier.ConfigError, match=r"precision\.param_dtype = 'fp32' .* bf16 / fp16 gives 'bf16'"):
        ZerotierTrainer(model=engine.module, args=hf_args(bf16=True))
    assert engine.optimizer.param_groups[0]["lr"] == 1e-3  # a refused trainer changed nothing
    with pytest.raises(TypeError, match="managed by an engine already"):
        ZerotierTrainer(model=engine.module, args=hf_args(), zerotier_config={})
    with pytest.warns(RuntimeWarning, match=META_NOT_PUT_BACK):
        engine.close()


def test_plain_trainer_over_engine_optimizer_refuses_decay_on_exempt_parameters():
    """Trainer builds its weight-decay exemptions only into an optimizer it makes: over
    engine.optimizer with weight decay on biases and norms, its first step is refused with the fix."""
    model = gpt2()
    with zerotier.initialize(model, dict(ZT, optimizer={"lr": 3e-3, "weight_decay": 0.1})) as engine:
        trainer = transformers.Trainer(model=model, args=hf_args(), train_dataset=Tokens(),
                                       optimizers=(engine.optimizer, None))
        with pytest.raises(zerotier.ZerotierError, match=r"parameters Trainer exempts from weight decay .*"
                                                         r"Use ZerotierTrainer\(model=engine.module"):
            trainer.train()
        assert engine.global_steps == 0
