"""Activation memory on the compute device: what one micro-batch's forward keeps for backward.

[Note: activation memory]
The plan's device need holds the model state placed there and the working sets; the
activations the forward saves for backward come on top, on the compute device, one
micro-batch at a time (gradient accumulation runs the micro-batches one after another). The
planner counts them in need["device"] (`Plan.activation_bytes`) from one of:

  measured   `zerotier plan --inputs` / `zerotier.plan(inputs=)`: the bytes of every tensor
             autograd saves for backward in the timed forward of each block and of the root
             (`SavedBytes`, torch.autograd.graph.saved_tensors_hooks; parameters excluded,
             storages counted once), summed over the blocks ([Note: measuring units]);
  estimated  a transformer's config (hidden size h, layers l, heads a, max positions s,
             micro-batch b = 1): `transformer_activation_bytes`;
  none       `--params` alone: nothing to count from, and the summary says so.
"""
from __future__ import annotations

import torch


def transformer_activation_bytes(hidden: int, layers: int, heads: int, seq: int, micro_batch: int = 1, *,
                                 vocab: int = 0, dtype_bytes: int = 2, checkpointed: bool = False,
                                 fused_attention: bool = False) -> int:
    """Bytes a transformer's forward keeps for backward, for one micro-batch.

    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
    (§4.1, eq. 1, 16-bit activations, no tensor or sequence parallelism), per layer:

        s·b·h·(34 + 5·a·s/h)  =  34·s·b·h + 5·a·s²·b   bytes without recomputation,
        2·s·b·h                                         with full activation checkpointing (the
                                                        layer's input), plus one layer's full
                                                        activations while it is recomputed.

    5·a·s²·b is the attention scores, their softmax and its dropout mask; a fused attention
    kernel (SDPA, FlashAttention: Hugging Face's default `sdpa`) never materializes them, so it is
    left out there. Other dtypes scale the 16-bit figure by dtype_bytes / 2. The head's logits
    come on top: s·b·V in the param dtype and their fp32 copy for the loss (s·b·V·(L + 4)).
    """
    per_layer = 34 * seq * micro_batch * hidden + (0 if fused_attention else 5 * heads * seq * seq * micro_batch)
    if checkpointed:
        total = layers * 2 * seq * micro_batch * hidden + per_layer
    else:
        total = layers * per_layer
    return total * dtype_bytes // 2 + seq * micro_batch * vocab * (dtype_bytes + 4)


def estimate(model: torch.nn.Module, dtype_bytes: int, micro_batch: int = 1) -> tuple[int, str] | None:
    """[Note: activation memory] The estimate from a Hugging Face-style config (hidden size,
    layers, heads, max positions, vocab), at its longest sequence; None without one."""
    cfg = getattr(model, "config", None)

    def first(*names):
        return next((getattr(cfg, n) for n in names if isinstance(getattr(cfg, n, None), int)), None)
    hidden, layers = first("hidden_size", "n_embd", "d_model"), first("num_hidden_layers", "n_layer")
    heads, seq = first("num_attention_heads", "n_head"), first("max_position_embeddings", "n_positions")
    if None in (hidden, layers, heads, seq):
        return None
    flag = "is_activation_checkpointing"  # transformers 5; is_gradient_checkpointing before (deprecated there)
    checkpointed = bool(getattr(model, flag if hasattr(type(model), flag) else "is_gradient_checkpointing", False))
    fused = getattr(cfg, "_attn_implementation", None) in ("sdpa", "flash_attention_2", "flex_attention")
    nbytes = transformer_activation_bytes(hidden, layers, heads, seq, micro_batch, vocab=first("vocab_size") or 0,
                                          dtype_bytes=dtype_bytes, checkpointed=checkpointed, fused_attention=fused)
    how = ("full checkpointing: 2sbh per layer + one layer" if checkpointed else
           "34sbh per layer" + ("" if fused else " + 5as²b") + ", no recomputation")
    return nbytes, (f"estimated from the config: seq {seq:,}, micro-batch {micro_batch}, {how} (Korthikanti et al. "
                    "2022); pass --inputs to measure them")


class SavedBytes:
    """[Note: activation memory] Counts the bytes of the tensors autograd saves for backward
    inside the `with` (each storage once, `exclude`'s tensors, the parameters, not at all)."""

    def __init__(self, exclude=()):
        self.skip = {t.untyped_storage().data_ptr() for t in exclude}
        self.seen: dict[int, int] = {}
        self.bytes = 0

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.skip and ptr not in self.seen:
            self.seen[ptr] = storage.nbytes()
        return t

    def __enter__(self) -> "SavedBytes":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        self.bytes = sum(self.seen.values())
