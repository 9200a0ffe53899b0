"""A small GPT-style decoder used by the demo, the examples and the tests."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        # No qkv bias (as in LLaMA): the key bias has an exactly-zero gradient, which
        # makes Adam amplify rounding noise and comparisons with a reference meaningless.
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """Token + position embeddings, `layers` pre-norm blocks, a head tied to the embedding."""

    def __init__(self, vocab: int = 256, dim: int = 64, layers: int = 2, heads: int = 4, seq: int = 32,
                 tie_weights: bool = True, checkpointing: bool = False):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tie_weights:
            self.head.weight = self.tok.weight
        self.checkpointing = checkpointing
        for module in self.modules():  # GPT-2 initialisation: small weights, sane initial loss
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx, targets=None):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointing else block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def batches(vocab: int, seq: int, batch: int, n: int, seed: int = 0):
    """Deterministic random token batches (inputs, next-token targets)."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        data = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
        yield data[:, :-1], data[:, 1:]


def init_tiny_gpt(module: nn.Module) -> None:
    """TinyGPT's initialisation of one module, for `zerotier.initialize(meta_model, init_fn=init_tiny_gpt)`
    ([Note: meta-device models]): GPT-2 style normal(0, 0.02) weights, zero biases, default norms."""
    if isinstance(module, TinyGPT):
        nn.init.normal_(module.pos, std=0.02)
    elif isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    elif hasattr(module, "reset_parameters"):
        module.reset_parameters()
