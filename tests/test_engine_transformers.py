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
