"""Full fine-tune of a 7B on one 80 GB GPU (exact), or of a 13B-20B (compact optimizer state).

Written for: one NVIDIA H100 80 GB, 256 GB of RAM, an NVMe drive at /mnt/nvme.

    zerotier plan --params 7B --layers 32 --config examples/finetune_7b_exact.toml     # fits?
    python examples/finetune_full.py --model /path/to/llama-2-7b                         # exact
    python examples/finetune_full.py --model /path/to/llama-2-13b --config examples/finetune_20b_compact.toml
    python examples/finetune_full.py --tiny                                              # CI size, any CPU

Exact (finetune_7b_exact.toml): bf16 weights on the GPU (14 GB for 7B), fp32 gradient
accumulators and the fp32 master weights + Adam moments (12 B/param, 84 GB) on the host, where
the native CPU AdamW updates them: bitwise torch AdamW's update. Compact
(finetune_20b_compact.toml): bf16 master weights with stochastic rounding and int8 moments, 4 B
instead of 12 B per parameter, so a 20B's optimizer state (80 GB) fits the same host
(docs/config.md § precision; the exact 20B does not: examples/plan_fix.py).
The weights stream from the safetensors files unit by unit: the model is never whole in RAM.
"""
from __future__ import annotations

import sys

import zerotier

from recipe_common import arguments, checkpointing, resolve, train_loop, zerotier_config


def main(argv=None) -> dict:
    args = resolve(arguments(__doc__.splitlines()[0], "finetune_7b_exact.toml").parse_args(argv))
    with zerotier.from_pretrained(args.model, zerotier_config(args)) as engine:
        checkpointing(engine.module)
        losses = train_loop(engine, args)
        engine.save_checkpoint(args.output)  # fp32 masters + Adam state; `zerotier export` writes safetensors
        result = {"losses": losses, "steps": engine.global_steps, "cfg": engine.cfg}
        engine.close(restore_weights=False)  # the checkpoint holds the weights: exit fast
        return result


if __name__ == "__main__":
    main(sys.argv[1:])
