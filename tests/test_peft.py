"""peft LoRA on a transformers Llama with the frozen base offloaded ([Note: frozen units] in
zerotier/state.py): the adapters train as with peft alone, the base lives in the parameter
store on host or NVMe (released between uses, no gradient or optimizer state), and the order
that would train nothing (adapters added after initialize) is refused with the working order;
`zerotier.from_pretrained(dir, config, peft_config=)` streams the base under the adapters.

peft and transformers are in the `test` extra, so CI always runs this; the importorskip only
spares users who run the suite without the extra."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

import zerotier
from zerotier.errors import ConfigError, ZerotierError
from zerotier.state import ParamState

transformers = pytest.importorskip("transformers", reason="pip install transformers (part of .[test])")
peft = pytest.importorskip("peft", reason="pip install peft (part of .[test])")

VOCAB, STEPS, LR = 64, 4, 1e-2
IDS = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
# close() of an engine zerotier.from_pretrained built on the meta device warns that the weights stay in it
# (asserted in tests/test_meta_init.py); incidental here
pytestmark = pytest.mark.filterwarnings("ignore:zerotier close\\(\\). \\d+ parameters of a model built on the meta "
                                        "device are not put back into it:RuntimeWarning")


def lora_model(seed=0):
    """A tiny Llama with LoRA adapters (random B, so the adapters change the output from step 0)."""
    torch.manual_seed(seed)
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False))
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                             lora_dropout=0.0, init_lora_weights=False)
    return peft.get_peft_model(base, config)


def adapters(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def train_alone(model):
    """STEPS of torch AdamW on the model's trainable (adapter) parameters: (losses, adapters)."""
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.01)
    losses = []
    for _ in range(STEPS):
        loss = model(input_ids=IDS, labels=IDS).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, adapters(model)


def train_engine(engine, model, after_step=None):
    """STEPS through the engine on train_alone's data: the losses. `after_step()` runs after each step."""
    model.train()
    losses = []
    for _ in range(STEPS):
        loss = model(input_ids=IDS, labels=IDS).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
        if after_step is not None:
            after_step()
    return losses


def peft_alone():
    return train_alone(lora_model())


def zt_config(params, tmp_path):
    (tmp_path / "nvme").mkdir(exist_ok=True)
    return {"offload": {"params": params, "gradients": "host", "optimizer": "host"},
            "tiers": {"nvme_path": str(tmp_path / "nvme")}, "optimizer": {"lr": LR, "weight_decay": 0.01}}


@pytest.mark.parametrize("params", ["host", "nvme"])
@pytest.mark.pins("design#frozen-parameters-are-placed-like-any-other-state")
def test_lora_with_the_base_offloaded_trains_as_peft(params, tmp_path):
    ref_losses, ref_adapters = peft_alone()
    model = lora_model()
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    base_bytes = sum(t.numel() * 4 for t in base.values())
    engine = zerotier.initialize(model, zt_config(params, tmp_path))
    try:
        # every base weight is in a frozen unit; the adapters are the only trained parameters
        frozen = {id(p) for u in engine.frozen_units for p in u.params}
        assert frozen == {id(p) for n, p in model.named_parameters() if n in base}
        assert sum(u.numel for u in engine.units) == sum(t.numel() for t in ref_adapters.values())
        plan = engine.plan
        assert plan.frozen_numel * 4 == base_bytes and plan.frozen_param_bytes == base_bytes
        assert "frozen" in plan.summary()
        if params == "host":
            homes = [engine.params.slots[u.index].home.block for u in engine.frozen_units]
            assert sum(b.capacity for b in homes) >= base_bytes  # the base's home is the host pool
        else:  # each frozen unit's file holds its parameters
            assert sum(engine.store.read(u.param_key, torch.empty(u.numel, dtype=engine.lp_dtype)).wait()
                       for u in engine.frozen_units) >= base_bytes

        def base_released():  # between steps the base holds no compute bytes
            for unit in engine.frozen_units:
                assert engine.params.state[unit.index] is ParamState.RELEASED, unit.name
                assert all(p.untyped_storage().nbytes() == 0 for p in unit.params), unit.name

        losses = train_engine(engine, model, after_step=base_released)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        trained = adapters(model)
        assert trained.keys() == ref_adapters.keys()
        for name, ref in ref_adapters.items():
            torch.testing.assert_close(trained[name], ref, rtol=1e-5, atol=1e-6, msg=name)
        moved = max(float((trained[n] - lora_model_value).abs().max())
                    for n, lora_model_value in adapters(lora_model()).items())
        assert moved > 1e-3  # the adapters did train
        sd = model.state_dict()
        for name, value in base.items():  # the base did not move
            assert torch.equal(sd[name], value), name
    finally:
        engine.close()


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_lora_with_gradient_checkpointing_and_the_base_on_nvme_trains_as_peft(reentrant, tmp_path):
    """HF's gradient checkpointing recomputes each layer's forward inside backward: its frozen unit is
    fetched again for the recompute and released after the layer's backward, as without it."""
    def run(engine_for):
        model = lora_model()
        if hasattr(model, "activation_checkpointing_enable"):  # transformers 5 (the old name is deprecated there)
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        if reentrant:
            model.enable_input_require_grads()  # peft's recipe: the frozen embeddings' output requires grad
        model.train()
        engine = engine_for(model)
        opt = None if engine else torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR,
                                                    weight_decay=0.01)
        losses = []
        for _ in range(3):
            loss = model(input_ids=IDS, labels=IDS).loss
            if engine:
                engine.backward(loss)
                engine.step()
            else:
                loss.backward()
                opt.step()
                opt.zero_grad()
            losses.append(float(loss.detach()))
        trained = adapters(model)
        if engine:
            engine.close()
        return losses, trained

    ref_losses, ref_adapters = run(lambda model: None)
    losses, trained = run(lambda model: zerotier.initialize(model, zt_config("nvme", tmp_path)))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    for name, ref in ref_adapters.items():
        torch.testing.assert_close(trained[name], ref, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.pins("design#frozen-parameters-are-placed-like-any-other-state")
def test_adapters_added_after_initialize_are_refused_with_the_working_order(tmp_path):
    """zerotier.from_pretrained (or initialize) then peft.get_peft_model(engine.module): the adapters are
    parameters zerotier never saw, so nothing would train (issue 26: 4 steps, LoRA weights moved 0.0)."""
    torch.manual_seed(0)
    hf = tmp_path / "hf"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64)).save_pretrained(hf)
    engine = zerotier.from_pretrained(hf, zt_config("host", tmp_path))
    try:
        model = peft.get_peft_model(engine.module, peft.LoraConfig(r=4, target_modules=["q_proj"]))
        with pytest.raises(ZerotierError, match=r"added to the model after zerotier.initialize .*peft.get_peft_model"
                                                r"\(model, lora_config\), then engine = zerotier.initialize.*"
                                                r"zerotier.from_pretrained\(dir, config, peft_config=lora_config\)"):
            model(input_ids=IDS, labels=IDS)
    finally:
        engine.close()


def base_on_nvme_peaks(layers, tmp_path, streamed=False):
    """(frozen base bytes, host-pool peak, compute-tier peak) over 2 LoRA steps of a 128-wide Llama:
    peft applied before initialize, or (streamed) from_pretrained(dir, peft_config=) from its files."""
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64))
    if streamed:
        base.save_pretrained(tmp_path / f"hf{layers}")
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj"]))
    base_bytes = sum(p.numel() * 4 for p in model.parameters() if not p.requires_grad)
    (tmp_path / str(layers)).mkdir()
    cfg = {"offload": {"params": "nvme", "gradients": "host", "optimizer": "host"},
           "tiers": {"nvme_path": str(tmp_path / str(layers))}}
    if streamed:
        del base, model
        engine = zerotier.from_pretrained(tmp_path / f"hf{layers}", cfg,
                                          peft_config=peft.LoraConfig(r=4, target_modules=["q_proj"]))
        model = engine.module
    else:
        engine = zerotier.initialize(model, cfg)
    with engine:
        model.train()
        for _ in range(2):
            engine.backward(model(input_ids=IDS, labels=IDS).loss)
            engine.step()
        largest_unit = max(u.numel for u in engine.frozen_units) * 4
        window = (engine.params.writes.max_writes + 1) * largest_unit
        return base_bytes, engine.host_pool.stats()["peak"], engine.device_tier.stats()["peak"], window


@pytest.mark.parametrize("streamed", [False, True], ids=["peft-then-initialize", "from_pretrained-peft_config"])
def test_memory_with_the_base_on_nvme_is_flat_in_base_size(streamed, tmp_path):
    """The host pool (NVMe staging, the adapters' state) and the compute tier (the fetched units:
    on the CPU it is RAM) do not grow with the base (2 and 10 layers): the base is in its files,
    only the units in flight are in memory; streamed from a directory, loading included.
    The pool's peak is placement's NVMe writes in flight: at most ParamStore.writes.max_writes units
    (plus the one being filled), whatever the base; how many are in flight at once depends on the
    drive's timing, so it is checked against that window, which does not grow with the base.
    (The process's RSS on the CPU also holds glibc's retained heap: [Note: heap bound].)"""
    small, large = base_on_nvme_peaks(2, tmp_path, streamed), base_on_nvme_peaks(10, tmp_path, streamed)
    added = large[0] - small[0]
    assert added > 3 * small[0]
    assert small[3] == large[3] < added, (small, large)  # the window: a few units, not the base
    adapters = 1 << 20  # the adapters' Adam state and gradients on host, and rounding
    assert small[1] <= small[3] + adapters and large[1] <= large[3] + adapters, (small, large)
    assert large[2] == small[2], (small, large)
    assert large[2] < large[0] / 2  # a few units, not the base


def save_llama(path, seed=0):
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)).save_pretrained(path)
    return path


def lora_config(**kw):
    return peft.LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"],
                              "lora_dropout": 0.0, **kw})


def test_from_pretrained_with_peft_config_trains_as_transformers_and_peft(tmp_path):
    """[Note: LoRA on a streamed base] from_pretrained(dir, peft_config=) with the base on NVMe trains the
    adapters as transformers.from_pretrained + peft.get_peft_model + torch's AdamW do. The reference's
    adapters are loaded into the engine before training (equal under the same seed: the test below)."""
    hf = save_llama(tmp_path / "hf")
    reference = peft.get_peft_model(transformers.LlamaForCausalLM.from_pretrained(hf), lora_config())
    start = adapters(reference)
    ref_losses, _ = train_alone(reference)
    base = {n: t for n, t in reference.state_dict().items() if "lora_" not in n}

    with zerotier.from_pretrained(hf, zt_config("nvme", tmp_path), peft_config=lora_config()) as engine:
        model = engine.module
        assert isinstance(model, peft.PeftModel)
        assert sum(u.numel for u in engine.frozen_units) == sum(t.numel() for t in base.values())
        assert all(engine.params.slots[u.index].home.name == "nvme" and engine.params.slots[u.index].home.key
                   == u.param_key for u in engine.frozen_units)  # on NVMe
        loaded = model.state_dict()
        for name, value in base.items():  # the base streamed from the files under peft's names
            assert torch.equal(loaded[name], value), name
        assert not model.load_state_dict(start, strict=False).unexpected_keys
        losses = train_engine(engine, model)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        trained, expected = adapters(model), adapters(reference)
        assert trained.keys() == expected.keys()
        for name, ref in expected.items():
            torch.testing.assert_close(trained[name], ref, rtol=1e-5, atol=1e-6, msg=name)
        assert max(float((trained[n] - start[n]).abs().max()) for n in start) > 1e-3  # the adapters trained


@pytest.mark.parametrize("init", [True, "gaussian", False])
def test_from_pretrained_with_peft_config_initializes_adapters_as_peft(init, tmp_path):
    """[Note: LoRA on a streamed base] Under the same seed, the streamed adapters equal those
    peft.get_peft_model draws on the base in RAM (lora_A kaiming-uniform or normal, lora_B zeros;
    init_lora_weights=False: nn.Linear's init for both; embedding adapters from torch.randn), and the
    random stream after from_pretrained is where peft leaves it. A modules_to_save copy starts from the
    checkpoint's head."""
    hf = save_llama(tmp_path / "hf")
    config = dict(init_lora_weights=init, modules_to_save=["lm_head"],
                  target_modules=["embed_tokens", "q_proj", "v_proj", "down_proj"])
    base = transformers.LlamaForCausalLM.from_pretrained(hf)
    head = base.lm_head.weight.detach().clone()
    torch.manual_seed(7)
    reference = peft.get_peft_model(base, lora_config(**config)).state_dict()
    after_reference = torch.rand(4)
    torch.manual_seed(7)
    with zerotier.from_pretrained(hf, zt_config("host", tmp_path), peft_config=lora_config(**config)) as engine:
        after = torch.rand(4)
        sd = engine.module.state_dict()
        engine.close(restore_weights=False)  # read above: a meta-built model's weights are not put back
    assert torch.equal(sd["base_model.model.lm_head.modules_to_save.default.weight"], head)
    assert torch.equal(sd["base_model.model.lm_head.original_module.weight"], head)
    lora = [n for n in reference if "lora_" in n]
    assert len(lora) == 14 and sorted(lora) == sorted(n for n in sd if "lora_" in n)
    for name in lora:
        assert torch.equal(sd[name], reference[name]), name
    assert len({tuple(reference[n].flatten()[:4].tolist()) for n in lora if ".lora_A." in n}) == 6  # drawn apart
    assert torch.equal(after, after_reference)


def test_from_pretrained_with_peft_config_and_each_adapter_its_own_unit(tmp_path):
    """[Note: LoRA on a streamed base] wrap= puts lora_A and lora_B in units of their own: lora_A is
    placed (a released view) when lora_B is materialized, and peft's init for lora_B must not write
    it (it did: a segmentation fault with the base on NVMe)."""
    hf = save_llama(tmp_path / "hf")
    with zerotier.from_pretrained(hf, zt_config("nvme", tmp_path), wrap=("LlamaDecoderLayer", "Linear"),
                                  peft_config=lora_config()) as engine:
        assert any(u.name.endswith("q_proj.lora_B.default") for u in engine.units)
        sd = engine.module.state_dict()
        engine.module.train()
        engine.backward(engine.module(input_ids=IDS, labels=IDS).loss)
        engine.step()
    for name, t in sd.items():
        if ".lora_A." in name:
            assert bool(t.ne(0).all()) and float(t.abs().max()) <= 1 / t.shape[1] ** 0.5, name
        elif ".lora_B." in name:
            assert bool(t.eq(0).all()), name


def test_from_pretrained_refuses_peft_configs_it_cannot_stream(tmp_path):
    """Inits that read the base weights, and tuners other than LoRA, name the order that works."""
    hf = save_llama(tmp_path / "hf")
    for config, what in [(lora_config(init_lora_weights="pissa"), "init_lora_weights='pissa'"),
                         (lora_config(use_dora=True), "use_dora=True"),
                         (peft.IA3Config(target_modules=["q_proj"], feedforward_modules=[]), "IA3Config")]:
        with pytest.raises(ConfigError, match=re.escape(what) + r".*apply peft.get_peft_model"):
            zerotier.from_pretrained(hf, zt_config("host", tmp_path), peft_config=config)


class _Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        ids = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def test_zerotier_trainer_trains_a_peft_model_like_trainer(tmp_path):
    """HF Trainer's loop (clipping, linear schedule) on a peft model: ZerotierTrainer with the base on
    host gives the adapters plain transformers.Trainer gives them."""
    from zerotier.integrations.transformers import ZerotierTrainer

    def args(out):
        return transformers.TrainingArguments(
            output_dir=str(tmp_path / out), per_device_train_batch_size=4, max_steps=3, learning_rate=LR,
            weight_decay=0.0, max_grad_norm=1.0, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
            seed=0, data_seed=0)
    plain = transformers.Trainer(model=lora_model(), args=args("plain"), train_dataset=_Tokens())
    plain.train()
    trainer = ZerotierTrainer(model=lora_model(), args=args("zt"), train_dataset=_Tokens(),
                              zerotier_config={"offload": {"params": "host", "gradients": "host", "optimizer": "host"}})
    trainer.train()
    try:
        assert trainer.engine.frozen_units
        trained, expected = adapters(trainer.model), adapters(plain.model)
        for name, ref in expected.items():
            torch.testing.assert_close(trained[name], ref, rtol=1e-5, atol=1e-6, msg=name)
    finally:
        trainer.engine.close()


def test_zerotier_trainer_from_pretrained_with_peft_config_trains_like_trainer(tmp_path):
    """ZerotierTrainer.from_pretrained(dir, args, peft_config=) in one step (peft_config went to
    Trainer.__init__: a TypeError): TrainingArguments fill the config's "auto" keys, and under the same
    seed the adapters start as plain Trainer's over transformers + peft.get_peft_model, and train as
    they do (atol: lora_A's first gradients are ~0 while lora_B is 0, Adam steps on noise)."""
    from zerotier.integrations.transformers import ZerotierTrainer

    hf = save_llama(tmp_path / "hf")

    def args(out):
        return transformers.TrainingArguments(
            output_dir=str(tmp_path / out), per_device_train_batch_size=4, max_steps=3, learning_rate=LR,
            weight_decay=0.01, max_grad_norm=1.0, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
            seed=0, data_seed=0)
    torch.manual_seed(5)
    model = peft.get_peft_model(transformers.LlamaForCausalLM.from_pretrained(hf), lora_config())
    start = adapters(model)
    plain = transformers.Trainer(model=model, args=args("plain"), train_dataset=_Tokens())
    plain.train()
    torch.manual_seed(5)
    zt = {**zt_config("nvme", tmp_path), "optimizer": {"lr": "auto", "weight_decay": "auto"}}
    trainer = ZerotierTrainer.from_pretrained(hf, args("zt"), train_dataset=_Tokens(), zerotier_config=zt,
                                              peft_config=lora_config())
    try:
        assert isinstance(trainer.model, peft.PeftModel) and trainer.engine.frozen_units
        assert (trainer.engine.cfg.optimizer.lr, trainer.engine.cfg.optimizer.weight_decay) == (LR, 0.01)
        got = adapters(trainer.model)
        assert got.keys() == start.keys() and all(torch.equal(got[n], start[n]) for n in start)
        trainer.train()
        trained, expected = adapters(trainer.model), adapters(plain.model)
        assert trained.keys() == expected.keys() and len(expected) == 12
        for name, ref in expected.items():
            torch.testing.assert_close(trained[name], ref, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    finally:
        trainer.engine.close(restore_weights=False)  # read above: a meta-built model's weights are not put back
