"""What the recipes share: their arguments, the --tiny stand-ins for a real model and data, and a
config file with the node's budgets swapped for "auto" at the tiny size.

--tiny (or ZEROTIER_RECIPE_TINY=1) is the CI size: a 2-layer Llama built from a transformers
LlamaConfig and saved with save_pretrained into the work directory, random tokens for data,
three steps, tier budgets "auto" and NVMe files in the work directory. Nothing is downloaded.
"""
from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def arguments(description: str, config: str, steps: int = 100) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", metavar="DIR", help="a Hugging Face model directory (config.json + safetensors)")
    parser.add_argument("--config", default=str(HERE / config), help=f"zerotier config (default: {config})")
    parser.add_argument("--steps", type=int, default=steps, help=f"optimizer steps (default {steps})")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per sample (default 2048)")
    parser.add_argument("--batch", type=int, default=1, help="samples per micro-batch (default 1)")
    parser.add_argument("--tiny", action="store_true", default=os.environ.get("ZEROTIER_RECIPE_TINY") == "1",
                        help="the CI size: a tiny Llama saved to --workdir, 3 steps, budgets auto")
    parser.add_argument("--workdir", help="where --tiny writes its model and NVMe files (default: a temporary dir)")
    parser.add_argument("--output", default="checkpoints/zerotier", help="engine checkpoint written at the end")
    return parser


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """--tiny: a tiny Llama directory as --model, 3 steps of 2 x 16 tokens, a work directory."""
    if not args.tiny:
        if not args.model:
            raise SystemExit("--model DIR is required (a Hugging Face model directory), or --tiny for the CI size")
        return args
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="zerotier-recipe-")
    args.model = str(tiny_llama(Path(args.workdir) / "tiny-llama"))
    args.steps, args.seq, args.batch = 3, 16, 2
    args.output = str(Path(args.workdir) / "checkpoint")
    return args


def tiny_llama(path: Path, vocab: int = 128) -> Path:
    import transformers

    if not (path / "config.json").is_file():
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)).save_pretrained(path)
    return path


def checkpointing(model) -> None:
    """Activation checkpointing per decoder layer (one layer's activations at a time in backward)."""
    model.config.use_cache = False
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()


def zerotier_config(args: argparse.Namespace):
    """The recipe's config file; at the tiny size its node budgets become "auto" (this machine's
    memory) and its NVMe directory the work directory."""
    import zerotier

    cfg = zerotier.Config.load(args.config)
    if args.tiny:
        nvme = Path(args.workdir) / "nvme"
        nvme.mkdir(parents=True, exist_ok=True)
        cfg = cfg.with_values({"tiers.device": "auto", "tiers.host": "auto", "tiers.nvme": "auto",
                               "tiers.nvme_path": str(nvme)})
    return cfg


def vocab_size(model_dir: str) -> int:
    import json

    return json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]


def token_batches(args: argparse.Namespace, vocab: int):
    """Random token batches: stand-ins for your data loader."""
    gen = torch.Generator().manual_seed(0)
    while True:
        ids = torch.randint(0, vocab, (args.batch, args.seq), generator=gen)
        yield {"input_ids": ids, "labels": ids}


class TokenDataset(torch.utils.data.Dataset):
    """Random token samples for Trainer: stand-ins for your tokenized dataset."""

    def __init__(self, args: argparse.Namespace, vocab: int, samples: int):
        gen = torch.Generator().manual_seed(0)
        self.ids = [torch.randint(0, vocab, (args.seq,), generator=gen) for _ in range(samples)]

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def train_loop(engine, args: argparse.Namespace) -> list[float]:
    """The plain PyTorch loop, with engine.backward / engine.step: args.steps optimizer steps of
    train.grad_accum_steps micro-batches each. Returns each micro-batch's loss."""
    model, losses = engine.module, []
    model.train()
    batches = token_batches(args, vocab_size(args.model))
    while engine.global_steps < args.steps:
        batch = {k: v.to(engine.device) for k, v in next(batches).items()}
        loss = model(**batch).loss
        engine.backward(loss)
        if engine.step():  # True at the end of an accumulation window
            print(f"step {engine.global_steps}/{args.steps}: loss {float(loss.detach()):.4f}", flush=True)
        losses.append(float(loss.detach()))
    return losses
