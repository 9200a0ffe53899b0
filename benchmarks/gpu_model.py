"""The model, its weights, its data and its FLOPs, for every case of bench_gpu.py and predict_table.py.

Shapes (untied head, SwiGLU, RMSNorm, rotary; vocab 32000):
  tiny   dim 64, 2 layers                      the CPU rehearsal (--tiny)
  1.3b   dim 2048, 24 layers, ffn 5504         issue 14's size: fits all on one 80 GB GPU
  2.7b   dim 2560, 32 layers, ffn 6912         the largest whose fp32 optimizer state fits a 64 GiB drive
  7b     Llama-2-7B:  dim 4096, 32 layers, 32 heads, ffn 11008   (6.74B)
  13b    Llama-2-13B: dim 5120, 40 layers, 40 heads, ffn 13824   (13.0B)
  20b    dim 6144, 44 layers, 48 heads, ffn 16384 (head dim 128, ffn 8/3 dim rounded up to 1024
         as Llama's are; 20.3B): no public Llama has 20B, this is a Llama-2 shape between 13B and 33B
  30b    LLaMA-33B ("30B"): dim 6656, 60 layers, 52 heads, ffn 17920  (32.5B)

[Note: the workload] Every case of a size trains the same tokens per optimizer step: one
micro-batch of `batch` x 2048 tokens (accumulation 1), with activation checkpointing per decoder
layer at 7b and up (and in the tiny rehearsal). Why one micro-batch: torchao's
CPUOffloadOptimizer with offload_gradients=True cannot accumulate gradients, and it is one of the
two peers 7B is judged against. Why 8 x 2048 = 16,384 tokens: at 7B the CPU Adam of 6.74B fp32
parameters takes 1.6 s at the 4.27 Gparam/s measured on the H200's host, while 2 x 2048 tokens
are ~0.4 s of compute; 16,384 tokens are 0.67 PFLOP (6 N per token + attention), ~1.6 s at
420 TFLOPS, as long as the optimizer: the step then shows how much of the CPU optimizer a case
hides under compute (early step, delayed update) instead of the CPU optimizer alone, and still
fits beside fp32 parameters on an 80 GB GPU (torchao's method; 16 x 2048 would not: its logits
and checkpoints add ~19 GB more). Checkpointing, the same in every case, is what lets one
micro-batch carry them; it costs one more forward per layer, in the hardware FLOPs the
prediction uses but not in the reported TFLOPS (model FLOPs, the Megatron formula).

[Note: the same weights everywhere] `init_tensor(name, shape)` is a parameter's initial value,
from a generator seeded by its name (crc32), on one generator device per run (CUDA when the
run has a GPU, else the CPU): the same bytes whether a case builds the model on the device
(torch, torchao, DeepSpeed stage 2), fills it under deepspeed.zero.Init one gathered parameter
at a time (stage 3), or materializes it unit by unit from the meta device (zerotier's
init_fn), so the losses of all cases are comparable. Matrices are normal(0, 0.02), norms ones.
"""
from __future__ import annotations

import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

VOCAB, SEQ = 32000, 2048
# dim, layers, heads, ffn; batch = sequences per micro-batch; ckpt = activation checkpointing per layer
SIZES = {
    "tiny": dict(vocab=256, dim=64, layers=2, heads=4, ffn=176, seq=32, batch=4, ckpt=True),
    "1.3b": dict(vocab=VOCAB, dim=2048, layers=24, heads=16, ffn=5504, seq=SEQ, batch=8, ckpt=False),
    "2.7b": dict(vocab=VOCAB, dim=2560, layers=32, heads=20, ffn=6912, seq=SEQ, batch=4, ckpt=False),
    "7b": dict(vocab=VOCAB, dim=4096, layers=32, heads=32, ffn=11008, seq=SEQ, batch=8, ckpt=True),
    "13b": dict(vocab=VOCAB, dim=5120, layers=40, heads=40, ffn=13824, seq=SEQ, batch=8, ckpt=True),
    "20b": dict(vocab=VOCAB, dim=6144, layers=44, heads=48, ffn=16384, seq=SEQ, batch=8, ckpt=True),
    "30b": dict(vocab=VOCAB, dim=6656, layers=60, heads=52, ffn=17920, seq=SEQ, batch=8, ckpt=True),
}
INIT_STD = 0.02


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * self.weight


def _rotate(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Layer(nn.Module):
    def __init__(self, s):
        super().__init__()
        d, self.heads = s["dim"], s["heads"]
        self.attn_norm, self.mlp_norm = RMSNorm(d), RMSNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(d, s["ffn"], bias=False), nn.Linear(d, s["ffn"], bias=False)
        self.down = nn.Linear(s["ffn"], d, bias=False)

    def forward(self, x, cos, sin):
        b, t, d = x.shape
        h = self.attn_norm(x)
        q, k, v = (proj(h).view(b, t, self.heads, -1).transpose(1, 2) for proj in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(_rotate(q, cos, sin), _rotate(k, cos, sin), v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, d))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    def __init__(self, s):
        super().__init__()
        self.s = s
        self.embed = nn.Embedding(s["vocab"], s["dim"])
        self.layers = nn.ModuleList(Layer(s) for _ in range(s["layers"]))
        self.norm = RMSNorm(s["dim"])
        self.head = nn.Linear(s["dim"], s["vocab"], bias=False)

    def forward(self, idx, targets):
        s = self.s
        x = self.embed(idx)
        half = s["dim"] // s["heads"] // 2
        inv_freq = 10000.0 ** (-torch.arange(half, device=idx.device, dtype=torch.float32) / half)
        angles = torch.outer(torch.arange(idx.shape[1], device=idx.device, dtype=torch.float32), inv_freq)
        cos, sin = (torch.cat((f, f), dim=-1).to(x.dtype) for f in (angles.cos(), angles.sin()))
        for layer in self.layers:
            x = checkpoint(layer, x, cos, sin, use_reentrant=False) if s["ckpt"] else layer(x, cos, sin)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def llama(size: str, device="meta") -> Llama:
    """The model in fp32 on `device`; on a real device its parameters are NOT initialized yet
    (call init_model): on "meta" it holds no bytes, for zerotier's materialization or planning."""
    with torch.device(device):
        return Llama(SIZES[size])


def init_device(tiny: bool) -> torch.device:
    """The one device every case of a run draws initial weights on ([Note: the same weights everywhere])."""
    return torch.device("cuda") if torch.cuda.is_available() and not tiny else torch.device("cpu")


def init_tensor(name: str, shape, gen_device: torch.device) -> torch.Tensor:
    """A parameter's initial fp32 value, from its name alone ([Note: the same weights everywhere])."""
    if len(shape) < 2:
        return torch.ones(shape, device=gen_device)
    gen = torch.Generator(device=gen_device).manual_seed(zlib.crc32(name.encode()))
    return torch.empty(shape, device=gen_device).normal_(0.0, INIT_STD, generator=gen)


@torch.no_grad()
def init_model(model: nn.Module, gen_device: torch.device) -> nn.Module:
    """Fill every parameter of a model built on a real device (meta: use to_empty first)."""
    for name, p in model.named_parameters():
        p.copy_(init_tensor(name, p.shape, gen_device))
    return model


def build(size: str, device: torch.device, gen_device: torch.device) -> Llama:
    """The model with its initial weights on `device`, never a second copy beside it."""
    return init_model(llama(size, "meta").to_empty(device=device), gen_device)


def zerotier_init_fn(model: nn.Module, gen_device: torch.device):
    """init_fn for zerotier.initialize(meta_model, ..., init_fn=...): each module materialized
    unit by unit gets its parameters by their names in `model` ([Note: meta-device models])."""
    names = {id(m): prefix for prefix, m in model.named_modules()}

    @torch.no_grad()
    def init_fn(module: nn.Module) -> None:
        prefix = names[id(module)]
        for local, p in module.named_parameters(recurse=False):
            p.copy_(init_tensor(f"{prefix}.{local}" if prefix else local, p.shape, gen_device))
    return init_fn


def deepspeed_init(model: nn.Module, gen_device: torch.device) -> None:
    """Fill a model built under deepspeed.zero.Init (partitioned): one gathered parameter at a time."""
    import deepspeed
    for name, p in model.named_parameters():
        with deepspeed.zero.GatheredParameters([p], modifier_rank=0), torch.no_grad():
            p.copy_(init_tensor(name, p.shape, gen_device))


def batches(size: str, n: int, accum: int):
    """`n` steps of `accum` micro-batches of learnable sequences (token t = a + b t mod vocab, a and b
    random per sequence), on the CPU, from seed 0: the loss falls, so its curves can be compared."""
    s = SIZES[size]
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n * accum):
        a = torch.randint(0, s["vocab"], (s["batch"], 1), generator=gen)
        b = torch.randint(1, 17, (s["batch"], 1), generator=gen)
        seq = (a + b * torch.arange(s["seq"] + 1)) % s["vocab"]
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return [out[i * accum:(i + 1) * accum] for i in range(n)]


def param_count(size: str) -> int:
    s = SIZES[size]
    d, f, v = s["dim"], s["ffn"], s["vocab"]
    return s["layers"] * (4 * d * d + 3 * d * f + 2 * d) + 2 * v * d + d


def layer_matmul_params(size: str) -> int:
    s = SIZES[size]
    return 4 * s["dim"] ** 2 + 3 * s["dim"] * s["ffn"]


def model_flops_per_token(size: str) -> float:
    """[Note: the workload] The Megatron formula's FLOPs per token of a training step (forward +
    backward, no recompute): 6 x the matmul parameters (every Linear and the head; the embedding is
    a lookup) + attention's 12 x seq x dim per layer (QK^T and AV; causal masking not subtracted)."""
    s = SIZES[size]
    matmul = s["layers"] * layer_matmul_params(size) + s["vocab"] * s["dim"]
    return 6.0 * matmul + 12.0 * s["layers"] * s["seq"] * s["dim"]


def unit_forward_flops(size: str) -> tuple[float, float]:
    """Forward FLOPs of one micro-batch: (one decoder layer, the rest: head + norms), the split the
    planner's units have with wrap="auto" (each layer a unit, the root holds embedding and head)."""
    s = SIZES[size]
    tokens = s["batch"] * s["seq"]
    layer = tokens * (2.0 * layer_matmul_params(size) + 4.0 * s["seq"] * s["dim"])
    return layer, tokens * 2.0 * s["vocab"] * s["dim"]


def activation_bytes(size: str) -> int:
    """A rough device working set of one micro-batch's forward and backward (what is on the device
    besides parameters, gradients and optimizer state): with checkpointing, each layer's fp32 input
    kept + one layer's recomputed activations (bf16) + the logits (bf16, their fp32 copy for the loss
    and its gradient); without, ~34 bytes per token and dim per layer (Megatron's estimate)."""
    s = SIZES[size]
    tokens = s["batch"] * s["seq"]
    logits = 12 * tokens * s["vocab"]
    if not s["ckpt"]:
        return 34 * tokens * s["dim"] * s["layers"] + logits
    return 4 * tokens * s["dim"] * s["layers"] + 2 * tokens * (16 * s["dim"] + 6 * s["ffn"]) + logits
