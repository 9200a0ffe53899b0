"""A DeepSpeed ZeRO-Infinity config, migrated: the same ds_config.json drives zerotier.

Written for: one NVIDIA A100 40 GB, 256 GB of RAM, NVMe at /mnt/nvme (the node ds_config.json
was tuned for: parameters on the CPU, optimizer state on NVMe).

    zerotier convert examples/ds_config.json --to zerotier.toml   # once: a TOML to read and edit
    python examples/deepspeed_migrate.py --model /path/to/llama-13b
    python examples/deepspeed_migrate.py --tiny                    # CI size, any CPU

Two ways: pass the JSON directly (zerotier.Config.from_deepspeed("ds_config.json")), or convert
it once and keep the TOML. Both give the same config; keys with no zerotier meaning (DeepSpeed's
bucket sizes, aio tuning) are listed in one warning. deepspeed.initialize(model, config=ds) +
model_engine.backward(loss) + model_engine.step() become zerotier.initialize(model, cfg) (or
zerotier.from_pretrained(dir, cfg)) + engine.backward(loss) + engine.step().
"""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import zerotier
from zerotier.cli import main as zerotier_cli

from recipe_common import arguments, resolve, train_loop, zerotier_config


def main(argv=None) -> dict:
    parser = arguments(__doc__.splitlines()[0], "ds_config.json")
    args = resolve(parser.parse_args(argv))
    toml = Path(args.workdir or ".") / "zerotier.toml"
    assert zerotier_cli(["convert", args.config, "--to", str(toml)]) == 0  # `zerotier convert`
    with warnings.catch_warnings(record=True) as unused:
        warnings.simplefilter("always")
        direct = zerotier.Config.from_deepspeed(args.config)             # or the JSON directly
    for w in unused:
        print(f"note: {w.message}")
    if zerotier.Config.load(toml) != direct:
        raise SystemExit(f"{toml} and {args.config} differ")
    args.config = str(toml)
    with zerotier.from_pretrained(args.model, zerotier_config(args)) as engine:
        losses = train_loop(engine, args)
        engine.save_checkpoint(args.output)  # fp32 masters + Adam state; `zerotier export` writes safetensors
        result = {"losses": losses, "steps": engine.global_steps, "cfg": engine.cfg, "direct": direct}
        engine.close(restore_weights=False)  # the checkpoint holds the weights: exit fast
        return result


if __name__ == "__main__":
    main(sys.argv[1:])
