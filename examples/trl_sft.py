"""TRL's SFTTrainer over zerotier: supervised fine-tuning on text, LoRA adapters on a streamed base.

Written for: one NVIDIA L4 24 GB, 128 GB of RAM, NVMe at /mnt/nvme; an 8B base.

    pip install trl
    python examples/trl_sft.py --model /path/to/llama-3-8b --dataset trl-lib/Capybara
    python examples/trl_sft.py --model /path/to/llama-3-8b --dataset trl-lib/Capybara --full   # no LoRA
    python examples/trl_sft.py --tiny                                                          # CI size, any CPU

SFTTrainer is a transformers Trainer: ZerotierSFTTrainer below puts ZerotierTrainer first in its
bases, so the engine is the optimizer, the model is never moved by the Trainer, and SFTConfig's
optimizer, clipping, accumulation and bf16 values fill the config's "auto" keys (hf_trainer.toml:
the same node). SFTTrainer tokenizes the text (or applies the chat template) as without zerotier.
LoRA goes to zerotier (peft_config= of from_pretrained, the base streamed to its tier), not to
SFTTrainer, whose get_peft_model would need the base in RAM.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import trl
from datasets import Dataset

from zerotier.integrations.transformers import ZerotierTrainer

from recipe_common import arguments, resolve, zerotier_config


class ZerotierSFTTrainer(ZerotierTrainer, trl.SFTTrainer):
    """SFTTrainer's data handling, zerotier's engine (ZerotierTrainer's methods come first)."""


def tiny_tokenizer(model_dir: str):
    """A word-level tokenizer over the tiny model's vocabulary (nothing downloaded)."""
    import tokenizers
    import transformers

    words = ["<pad>", "<unk>", "<s>", "</s>", *(f"w{i}" for i in range(124))]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                                      bos_token="<s>", eos_token="</s>")
    tokenizer.save_pretrained(model_dir)
    return tokenizer


def main(argv=None) -> dict:
    parser = arguments(__doc__.splitlines()[0], "hf_trainer.toml")
    parser.add_argument("--dataset", default="trl-lib/Capybara", help="a dataset name or path for datasets.load_dataset")
    parser.add_argument("--full", action="store_true", help="full fine-tune instead of LoRA adapters")
    args = resolve(parser.parse_args(argv))
    if args.tiny:
        tokenizer = tiny_tokenizer(args.model)
        gen = torch.Generator().manual_seed(0)
        texts = [" ".join(f"w{int(i)}" for i in torch.randint(0, 124, (12,), generator=gen)) for _ in range(32)]
        dataset = Dataset.from_dict({"text": texts})
    else:
        import datasets
        import transformers
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
        dataset = datasets.load_dataset(args.dataset, split="train")
    sft = trl.SFTConfig(
        output_dir=str(Path(args.workdir or ".") / "sft"), per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=1 if args.tiny else 8, max_steps=args.steps, learning_rate=2e-4,
        weight_decay=0.0, max_grad_norm=1.0, bf16=True, gradient_checkpointing=True, max_length=args.seq,
        logging_steps=1, save_strategy="no" if args.tiny else "steps", save_steps=100, report_to=[],
        use_cpu=not torch.cuda.is_available(), seed=0)
    peft_config = None
    if not args.full:
        import peft
        peft_config = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear")
    trainer = ZerotierSFTTrainer.from_pretrained(args.model, sft, zerotier_config=zerotier_config(args),
                                                 peft_config=peft_config, train_dataset=dataset,
                                                 processing_class=tokenizer)
    try:
        result = trainer.train()
        trainer.engine.save_checkpoint(args.output)  # fp32 masters + Adam state; `zerotier export` writes safetensors
        return {"loss": result.training_loss, "steps": trainer.engine.global_steps, "cfg": trainer.engine.cfg,
                "frozen": sum(u.numel for u in trainer.engine.frozen_units)}
    finally:
        trainer.engine.close(restore_weights=False)  # the checkpoint holds the weights: exit fast


if __name__ == "__main__":
    main(sys.argv[1:])
