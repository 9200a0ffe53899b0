"""The engine on a Hugging Face transformers model built from a config (no downloads).

transformers is in the `test` extra, so CI always runs this; the importorskip only
spares users who run the suite without the extra.
"""
import pytest
import torch

import zerotier

transformers = pytest.importorskip("transformers", reason="pip install transformers (part of .[test])")


def make_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(config).float()


def data(steps):
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (2, 16), generator=gen) for _ in range(steps)]


@pytest.mark.parametrize("params", ["device", "host", "nvme"])
def test_llama_matches_torch_adamw(params, tmp_path):
    ref = make_llama()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    ref_losses = []
    for ids in data(6):
        loss = ref(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        ref_losses.append(float(loss.detach()))

    model = make_llama()
    cfg = {"offload": {"params": params, "gradients": "host", "optimizer": "nvme" if params == "nvme" else "host"},
           "tiers": {"nvme_path": str(tmp_path)}, "optimizer": {"lr": 1e-3, "weight_decay": 0.01},
           "train": {"max_grad_norm": 1.0}}
    losses = []
    with zerotier.initialize(model, cfg) as engine:
        for ids in data(6):
            out = engine(input_ids=ids, labels=ids)  # a ModelOutput passes through the hooks intact
            engine.backward(out.loss)
            engine.step()
            losses.append(float(out.loss.detach()))
        weights = engine.parameters_fp32()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)


def make_t5():
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                   decoder_start_token_id=0, pad_token_id=0)
    return transformers.T5ForConditionalGeneration(config)


def make_bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=32)
    return transformers.BertForMaskedLM(config)


@pytest.mark.parametrize("params", ["device", "host", "nvme"])
@pytest.mark.parametrize("name, factory", [("t5", make_t5), ("bert", make_bert)])
def test_bf16_parameters_present_their_dtype_and_train(name, factory, params, tmp_path):
    """After initialize every managed parameter presents the configured dtype and its shape, even
    while released, so models that inspect `weight.dtype` before a layer runs (T5's feed-forward
    casts its input to `self.wo.weight.dtype`) work in bf16 under every placement; the user's fp32
    tensors are freed. Losses train like plain PyTorch in bf16 (within bf16 rounding)."""
    def batch(i):
        gen = torch.Generator().manual_seed(i)
        ids = torch.randint(1, 64, (2, 12), generator=gen)
        if name == "t5":
            return {"input_ids": ids, "labels": torch.randint(1, 64, (2, 6), generator=gen)}
        return {"input_ids": ids, "labels": ids}

    ref = factory().to(torch.bfloat16)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    ref_losses = []
    for i in range(4):
        loss = ref(**batch(i)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(float(loss.detach().float()))

    model = factory()
    shapes = {n: p.shape for n, p in model.named_parameters()}
    cfg = {"offload": {"params": params, "gradients": "host" if params != "device" else "device",
                       "optimizer": "host"},
           "tiers": {"nvme_path": str(tmp_path)}, "precision": {"param_dtype": "bf16"}, "optimizer": {"lr": 1e-3}}
    with zerotier.initialize(model, cfg) as engine:
        for n, p in model.named_parameters():
            assert p.dtype == torch.bfloat16 and p.shape == shapes[n], (n, p.dtype, p.shape)
        losses = []
        for i in range(4):
            loss = engine(**batch(i)).loss
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach().float()))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=3e-2, atol=0.0)
