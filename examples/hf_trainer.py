"""Hugging Face Trainer over zerotier: ZerotierTrainer.from_pretrained, TrainingArguments as usual.

Written for: one NVIDIA L4 24 GB, 128 GB of RAM, NVMe at /mnt/nvme; an 8B model, parameters on
host between uses, optimizer state on NVMe.

    python examples/hf_trainer.py --model /path/to/llama-3-8b
    python examples/hf_trainer.py --model /path/to/llama-3-8b --lora   # LoRA, the base streamed
    python examples/hf_trainer.py --tiny                               # CI size, any CPU

hf_trainer.toml leaves the optimizer, clipping, accumulation and precision keys "auto":
TrainingArguments fill them (learning_rate, weight_decay with Trainer's exemptions for biases and
norms, max_grad_norm, gradient_accumulation_steps, bf16), as HF's DeepSpeed integration does; a
key set to another value than the Trainer's is refused, naming both. Checkpoints (save_steps)
carry the engine's state in checkpoint-N/zerotier/, and resume_from_checkpoint resumes it exactly.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import transformers

from zerotier.integrations.transformers import ZerotierTrainer

from recipe_common import TokenDataset, arguments, resolve, vocab_size, zerotier_config


def main(argv=None) -> dict:
    parser = arguments(__doc__.splitlines()[0], "hf_trainer.toml")
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters (peft), the base frozen")
    args = resolve(parser.parse_args(argv))
    training = transformers.TrainingArguments(
        output_dir=str(Path(args.workdir or ".") / "trainer"), per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=1 if args.tiny else 8, max_steps=args.steps, learning_rate=2e-5,
        weight_decay=0.1, max_grad_norm=1.0, lr_scheduler_type="cosine", warmup_steps=0 if args.tiny else 20,
        bf16=True, gradient_checkpointing=True, logging_steps=1, save_strategy="no" if args.tiny else "steps",
        save_steps=100, report_to=[], use_cpu=not torch.cuda.is_available(), seed=0)
    peft_config = None
    if args.lora:
        import peft
        peft_config = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear")
    trainer = ZerotierTrainer.from_pretrained(
        args.model, training, zerotier_config=zerotier_config(args), peft_config=peft_config,
        train_dataset=TokenDataset(args, vocab_size(args.model), samples=args.steps * args.batch * 8))
    try:
        result = trainer.train()
        trainer.engine.save_checkpoint(args.output)  # fp32 masters + Adam state; `zerotier export` writes safetensors
        return {"loss": result.training_loss, "steps": trainer.engine.global_steps, "cfg": trainer.engine.cfg}
    finally:
        trainer.engine.close(restore_weights=False)  # the checkpoint holds the weights: exit fast


if __name__ == "__main__":
    main(sys.argv[1:])
