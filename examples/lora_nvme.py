"""LoRA on a large base with the frozen base on NVMe: a 70B on one 24 GB GPU.

Written for: one NVIDIA RTX 4090 24 GB (or any 24 GB+ GPU), 64 GB of RAM, a 2 TB NVMe drive
at /mnt/nvme holding the base's bf16 weights (140 GB for a 70B).

    zerotier plan --params 0.2B --frozen-params 70B --layers 80 --config examples/lora_nvme.toml
    python examples/lora_nvme.py --model /path/to/llama-70b
    python examples/lora_nvme.py --tiny                       # CI size, any CPU

zerotier.from_pretrained(dir, config, peft_config=LoraConfig(...)) builds the model on the meta
device, applies peft, and streams the base from the safetensors files into its NVMe files unit by
unit: the base is never whole in RAM (loading it with transformers first would need 140 GB).
Each layer's base weights are read back from NVMe (prefetched ahead of the compute) for its
forward and backward; only the adapters have gradients and Adam state. Under the same
torch.manual_seed the adapters start as peft.get_peft_model's on the model in RAM.
"""
from __future__ import annotations

import sys

import peft
import torch

import zerotier

from recipe_common import arguments, checkpointing, resolve, train_loop, zerotier_config


def main(argv=None) -> dict:
    args = resolve(arguments(__doc__.splitlines()[0], "lora_nvme.toml").parse_args(argv))
    torch.manual_seed(0)
    lora = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear")
    with zerotier.from_pretrained(args.model, zerotier_config(args), peft_config=lora) as engine:
        checkpointing(engine.module)
        losses = train_loop(engine, args)
        engine.save_checkpoint(args.output)  # fp32 masters + Adam state; `zerotier export` writes safetensors
        frozen = sum(u.numel for u in engine.frozen_units)
        result = {"losses": losses, "steps": engine.global_steps, "cfg": engine.cfg, "frozen": frozen}
        engine.close(restore_weights=False)  # the checkpoint holds the weights: exit fast
        return result


if __name__ == "__main__":
    main(sys.argv[1:])
