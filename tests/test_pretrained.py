"""Pretrained weights streamed into the tiers ([Note: streamed pretrained loading] in
zerotier/pretrained.py): a Hugging Face directory written by save_pretrained (or by
`zerotier export`) loads through zerotier.from_pretrained and computes what transformers'
own from_pretrained computes on the same directory; bad directories are clear errors.

transformers and safetensors are in the `test` extra, so CI always runs this; the
importorskip only spares users who run the suite without the extra."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import zerotier
from zerotier.errors import ConfigError
from zerotier.params import ParamStore
from zerotier.pretrained import _SafetensorsFiles

transformers = pytest.importorskip("transformers", reason="pip install transformers (part of .[test])")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="pip install safetensors (part of .[test])")

VOCAB = 64
CONFIGS = {  # tiny, no dropout (logits compare exactly); GPT-2 and Qwen2 tie the head to the embedding
    "gpt2": lambda: transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
                                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                            bos_token_id=0, eos_token_id=0),
    "llama": lambda: transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                              max_position_embeddings=64, tie_word_embeddings=False),
    "qwen2": lambda: transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                              max_position_embeddings=64, tie_word_embeddings=True),
}
PLACEMENTS = {
    "host": {"params": "host", "gradients": "host", "optimizer": "host"},
    "nvme": {"params": "nvme", "gradients": "host", "optimizer": "nvme"},
}
IDS = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))


def saved(name, path, sharded=False, cls=None):
    """A model of `name` with random weights, written by save_pretrained to `path`."""
    torch.manual_seed(0)
    model = (cls or transformers.AutoModelForCausalLM).from_config(CONFIGS[name]())
    model.save_pretrained(path, max_shard_size="20KB" if sharded else "5GB")
    assert (path / "model.safetensors.index.json").is_file() == sharded
    return path


def zt_config(placement, tmp_path):
    (tmp_path / "nvme").mkdir(exist_ok=True)
    return {"offload": PLACEMENTS[placement], "tiers": {"nvme_path": str(tmp_path / "nvme")},
            "optimizer": {"lr": 1e-3, "weight_decay": 0.01}}


def logits(model, **kw):
    model.eval()
    with torch.no_grad():
        out = model(input_ids=IDS, **kw)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def step_matches_torch(engine, ref):
    """One training step of the engine against torch's AdamW on transformers' load of the same directory."""
    engine.module.train()
    ref.train()
    engine.backward(engine(input_ids=IDS, labels=IDS).loss)
    engine.step()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    ref(input_ids=IDS, labels=IDS).loss.backward()
    opt.step()
    trained = engine.parameters_fp32()
    for key, p in ref.named_parameters():
        torch.testing.assert_close(trained[key], p.detach(), rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "sharded"])
@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_from_pretrained_computes_what_transformers_loads_and_trains_like_it(name, placement, sharded, tmp_path):
    path = saved(name, tmp_path / "hf", sharded)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path)
    engine = zerotier.from_pretrained(path, zt_config(placement, tmp_path))
    try:
        torch.testing.assert_close(logits(engine.module), logits(ref), rtol=0, atol=1e-6)
        step_matches_torch(engine, ref)
    finally:
        engine.close(restore_weights=False)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.pins("design#models-larger-than-ram")
def test_zerotier_export_round_trips_through_from_pretrained(name, tmp_path):
    """Train one step, save a checkpoint, `zerotier export --to DIR`: from_pretrained(DIR)
    computes what the engine's model computed after the step."""
    with zerotier.from_pretrained(saved(name, tmp_path / "hf"), zt_config("host", tmp_path)) as engine:
        engine.backward(engine(input_ids=IDS, labels=IDS).loss)
        engine.step()
        engine.save_checkpoint(tmp_path / "ck")
        want = logits(engine.module)
        engine.close(restore_weights=False)
    out = tmp_path / "exported"
    subprocess.run([sys.executable, "-m", "zerotier.cli", "export", str(tmp_path / "ck"), "--to", str(out)],
                   check=True, capture_output=True)
    engine = zerotier.from_pretrained(out, zt_config("nvme", tmp_path))
    try:
        assert not torch.equal(want, logits(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")))
        torch.testing.assert_close(logits(engine.module), want, rtol=0, atol=1e-6)
    finally:
        engine.close(restore_weights=False)


@pytest.mark.parametrize("ahead", [0, 1])
@pytest.mark.pins("design#models-larger-than-ram")
def test_tensors_are_read_unit_by_unit_as_each_unit_is_placed(ahead, tmp_path, monkeypatch):
    """[Note: streamed pretrained loading] Only the tensors of the unit being placed have been
    read when it is placed (serially), and of the next AHEAD units at most while the next one is
    materialized meanwhile ([Note: materializing ahead]): the files are never read whole (a model
    larger than RAM loads)."""
    import zerotier.materialize as materialize
    monkeypatch.setattr(materialize, "AHEAD", ahead)
    events = []
    read, place = _SafetensorsFiles.read, ParamStore.place
    monkeypatch.setattr(_SafetensorsFiles, "read", lambda self, n: events.append(("read", n)) or read(self, n))
    monkeypatch.setattr(ParamStore, "place", lambda self, unit, lp: events.append(("place", unit)) or
                        place(self, unit, lp))
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # materializing ahead shares torch's threads: it needs two
    try:
        engine = zerotier.from_pretrained(saved("llama", tmp_path / "hf", sharded=True), zt_config("nvme", tmp_path))
    finally:
        torch.set_num_threads(before)
    try:
        names = {id(p): n for n, p in engine.module.named_parameters()}
        assert len(engine.units) >= 3  # the layers and the root
        placed = [sorted(names[id(p)] for p in what.params) for kind, what in events if kind == "place"]
        reads: list[str] = []
        k = 0  # units placed so far
        for kind, what in events:
            if kind == "read":
                reads.append(what)
                continue
            if not ahead:  # the reads since the previous unit's placement are this unit's parameters, once each
                assert sorted(reads) == sorted(names[id(p)] for p in what.params), what.name
                reads = []
                continue
            # all of the units placed so far have been read, each parameter once, and of the next at most
            done, upto = sum(placed[:k + 1], []), sum(placed[:k + 1 + ahead], [])
            assert set(done) <= set(reads) <= set(upto) and len(reads) == len(set(reads)), what.name
            k += 1
        if ahead:
            assert sorted(reads) == sorted(sum(placed, []))
        else:
            assert reads == []  # the model's only buffers (rotary inv_freq) are computed, not read
    finally:
        engine.close(restore_weights=False)


def test_base_model_checkpoint_loads_into_the_task_model_and_back(tmp_path):
    """By base_model_prefix, as transformers loads them: GPT2Model's file (`h.0...`) into
    GPT2LMHeadModel (`transformer.h.0...`, the head tied to it), and the LM's file into
    GPT2Model (a model class, not an Auto class: built by its _from_config)."""
    base = saved("gpt2", tmp_path / "base", cls=transformers.AutoModel)
    with zerotier.from_pretrained(base, zt_config("host", tmp_path)) as engine:
        want = logits(transformers.AutoModelForCausalLM.from_pretrained(base))
        torch.testing.assert_close(logits(engine.module), want, rtol=0, atol=1e-6)
        engine.close(restore_weights=False)
    lm = saved("gpt2", tmp_path / "lm")
    with zerotier.from_pretrained(lm, zt_config("host", tmp_path), model_cls=transformers.GPT2Model) as engine:
        assert type(engine.module).__name__ == "GPT2Model"
        torch.testing.assert_close(logits(engine.module), logits(transformers.AutoModel.from_pretrained(lm)),
                                   rtol=0, atol=1e-6)
        engine.close(restore_weights=False)


# ------------------------------------------------------------------ bad directories (docs/errors.md)

def rewrite_weights(path, edit):
    file = path / "model.safetensors"
    tensors = safetensors_torch.load_file(file)
    edit(tensors)
    safetensors_torch.save_file(tensors, file, metadata={"format": "pt"})


def test_checkpoint_missing_a_tensor(tmp_path):
    path = saved("llama", tmp_path / "hf")
    rewrite_weights(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ConfigError, match=r"hf: does not fit the LlamaForCausalLM built from its config.json: "
                                          r"the model's tensors 'model.layers.1.mlp.up_proj.weight' are not in "
                                          r"the checkpoint$"):
        zerotier.from_pretrained(path, zt_config("nvme", tmp_path))
    assert list((tmp_path / "nvme").iterdir()) == []  # refused before anything was allocated


def test_checkpoint_with_a_tensor_the_model_lacks(tmp_path):
    path = saved("qwen2", tmp_path / "hf")
    rewrite_weights(path, lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(3)}))
    with pytest.raises(ConfigError, match=r"the checkpoint's tensors 'model.layers.0.extra.weight' are not in "
                                          r"the model$"):
        zerotier.from_pretrained(path, zt_config("host", tmp_path))


def test_checkpoint_tensor_of_the_wrong_shape(tmp_path):
    path = saved("gpt2", tmp_path / "hf")
    rewrite_weights(path, lambda t: t.update({"transformer.h.0.mlp.c_fc.weight": torch.zeros(32, 64)}))
    with pytest.raises(ConfigError, match=r"'transformer.h.0.mlp.c_fc.weight' has shape \[32, 64\] in the "
                                          r"checkpoint but \[32, 128\] in the model$"):
        zerotier.from_pretrained(path, zt_config("host", tmp_path))


def test_directory_without_config_json_or_weights(tmp_path):
    path = saved("llama", tmp_path / "hf")
    (path / "config.json").rename(tmp_path / "config.json")
    with pytest.raises(ConfigError, match=r"hf: no config.json; a Hugging Face model directory holds config.json "
                                          r"and model.safetensors"):
        zerotier.from_pretrained(path)
    (tmp_path / "config.json").rename(path / "config.json")
    (path / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"hf: no model.safetensors or model.safetensors.index.json next to "
                                          r"config.json$"):
        zerotier.from_pretrained(path)
    (path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"; pytorch_model.bin is not read \(a pickle\): load it with "
                                          r"transformers once and save_pretrained\(dir\) writes safetensors$"):
        zerotier.from_pretrained(path)


def test_sharded_checkpoint_missing_a_shard_or_holding_a_tensor_twice(tmp_path):
    path = saved("llama", tmp_path / "hf", sharded=True)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    (path / shards[1]).rename(tmp_path / shards[1])
    with pytest.raises(ConfigError, match=rf"model.safetensors.index.json lists the shard '{shards[1]}', which "
                                          r"is not in .*hf$"):
        zerotier.from_pretrained(path)
    (tmp_path / shards[1]).rename(path / shards[1])
    (path / "copy.safetensors").write_bytes((path / shards[0]).read_bytes())
    index["weight_map"]["copied"] = "copy.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match=r"tensor '.*' is in more than one shard"):
        zerotier.from_pretrained(path)


def test_unreadable_safetensors_file(tmp_path):
    path = saved("gpt2", tmp_path / "hf")
    (path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(ConfigError, match=r"model.safetensors: not a readable safetensors file \("):
        zerotier.from_pretrained(path)


def test_config_json_the_model_class_cannot_build(tmp_path):
    path = saved("gpt2", tmp_path / "hf")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(transformers.T5Config(
        vocab_size=VOCAB, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2).to_dict(),
        architectures=config["architectures"])))
    with pytest.raises(ConfigError, match=r"AutoModelForCausalLM cannot build this 't5' model \(Unrecognized "
                                          r"configuration class .*\); pass model_cls=, the class to build"):
        zerotier.from_pretrained(path)
    with pytest.raises(ConfigError, match=r"model_cls=<class 'torch.nn.modules.linear.Linear'> is not a "
                                          r"transformers model class \(it has no from_config\)"):
        zerotier.from_pretrained(path, model_cls=torch.nn.Linear)


def test_non_persistent_buffer_the_model_does_not_compute(tmp_path, monkeypatch):
    """Never uninitialized memory: a computed buffer (rotary inv_freq) that the model's
    _init_weights leaves alone is an error, not garbage."""
    path = saved("llama", tmp_path / "hf")
    monkeypatch.setattr(transformers.LlamaPreTrainedModel, "_init_weights", lambda self, module: None)
    with pytest.raises(ConfigError, match=r"model.rotary_emb.inv_freq, model.rotary_emb.original_inv_freq: "
                                          r"non-persistent buffers that LlamaForCausalLM._init_weights\(module\) "
                                          r"does not set"):
        zerotier.from_pretrained(path, zt_config("host", tmp_path))


def test_from_pretrained_without_safetensors_installed(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors", None)  # import safetensors raises ImportError
    with pytest.raises(ConfigError, match=r"zerotier.from_pretrained needs transformers and safetensors \(.*\): "
                                          r"pip install 'zerotier-offload\[hf\]'"):
        zerotier.from_pretrained(tmp_path)


@pytest.mark.parametrize("name, head, embed", [("gpt2", "lm_head.weight", "transformer.wte.weight"),
                                                ("qwen2", "lm_head.weight", "model.embed_tokens.weight")])
def test_tied_head_that_differs_in_the_checkpoint_is_loaded_untied(name, head, embed, tmp_path):
    """Issue 21: a config that ties the head to the embedding, with a checkpoint holding both under
    different values, was loaded tied and the head dropped. transformers warns and does not tie
    them; zerotier does the same, and computes and trains as transformers' load does."""
    path = saved(name, tmp_path / "hf")
    own_head = torch.randn(VOCAB, 32, generator=torch.Generator().manual_seed(5))
    rewrite_weights(path, lambda t: t.update({head: own_head}))
    ref = transformers.AutoModelForCausalLM.from_pretrained(path)
    assert ref.get_parameter(head) is not ref.get_parameter(embed)  # transformers unties
    with pytest.warns(UserWarning, match=rf"ties {head} to {embed}, but the checkpoint holds both with different "
                                         r"values: they are loaded untied, as transformers does"):
        engine = zerotier.from_pretrained(path, zt_config("host", tmp_path))
    try:
        assert engine.module.get_parameter(head) is not engine.module.get_parameter(embed)
        weights = engine.parameters_fp32()
        assert torch.equal(weights[head], own_head)
        torch.testing.assert_close(logits(engine.module), logits(ref), rtol=0, atol=1e-6)
        step_matches_torch(engine, ref)
    finally:
        engine.close(restore_weights=False)


def test_tied_head_equal_in_the_checkpoint_stays_tied(tmp_path):
    """Both names present with equal values (torch .bin-style files): tied, no warning."""
    path = saved("qwen2", tmp_path / "hf")
    rewrite_weights(path, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        engine = zerotier.from_pretrained(path, zt_config("host", tmp_path))
    try:
        assert engine.module.lm_head.weight is engine.module.model.embed_tokens.weight
    finally:
        engine.close(restore_weights=False)


@pytest.mark.parametrize("change, message", [
    ({"intermediate_size": -64}, r"config.json: intermediate_size = -64: a model size must be a whole number > 0"),
    ({"num_hidden_layers": 0}, r"config.json: num_hidden_layers = 0: a model size"),
    ({"hidden_size": "32"}, r"config.json: hidden_size = '32': a model size"),
    ({"vocab_size": 64.0}, r"config.json: vocab_size = 64.0: a model size"),
    ({"num_attention_heads": True}, r"config.json: num_attention_heads = True: a model size"),
    ({"text_config": {"hidden_size": -1}}, r"config.json: text_config.hidden_size = -1: a model size"),
    ({"num_attention_heads": 5}, r"config.json: transformers refuses it \(.*hidden size \(32\) is not a multiple"),
    ({"hidden_act": "nope"}, r"config.json: building AutoModelForCausalLM from it failed \(KeyError: 'nope'\)"),
])
def test_config_json_with_impossible_sizes_names_the_file_and_key(tmp_path, change, message):
    """Issue 37 row 16: a negative intermediate_size reached torch as an error naming no file."""
    path = saved("llama", tmp_path / "hf")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ConfigError, match=message) as raised:
        zerotier.from_pretrained(path, zt_config("host", tmp_path))
    assert str(raised.value).startswith(str(path / "config.json"))


@pytest.mark.parametrize("text", ["{not json", "[1, 2]"])
def test_config_json_that_is_not_a_json_object(tmp_path, text):
    path = saved("gpt2", tmp_path / "hf")
    (path / "config.json").write_text(text)
    with pytest.raises(ConfigError, match=r"hf/config.json: (cannot read it as JSON|expected a JSON object)"):
        zerotier.from_pretrained(path)
