"""`zerotier export` and `zerotier convert`: a checkpoint into plain weights, a DeepSpeed config into
a zerotier one.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


# ---------------------------------------------------------------------------------------------
# zerotier export


def export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CKPT",
                        help="a checkpoint root (its `latest` is used) or a ckpt-N directory")
    parser.add_argument("--to", required=True, metavar="OUT",
                        help="output: NAME.safetensors or NAME.pt (plain weights by parameter name), or a "
                             "directory (model.safetensors + config.json: a Hugging Face model directory)")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"],
                        help="dtype of the exported floating-point tensors (default fp32, the master weights)")
    parser.add_argument("--trust-pickle", action="store_true",
                        help="read an old checkpoint's pickled parts (they can run code: only for checkpoints "
                             "you wrote yourself); checkpoints of this version need no such trust")


def run_export(args: argparse.Namespace) -> int:
    from zerotier.export import export

    out = export(args.checkpoint, args.to, args.dtype, trust_pickle=args.trust_pickle)
    print(f"weights written to {out}")
    return 0


# ---------------------------------------------------------------------------------------------
# zerotier convert


def convert_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("ds_config", metavar="DS_CONFIG", help="a DeepSpeed JSON config (ds_config.json)")
    parser.add_argument("--to", metavar="OUT", default=None,
                        help="write the zerotier config here (.toml); default: print it")


def run_convert(args: argparse.Namespace) -> int:
    from zerotier import config_files, deepspeed_config
    from zerotier.config import Config

    converted = deepspeed_config.load(args.ds_config)
    sections, unmapped, by_trainer = converted.sections, converted.unmapped, converted.by_trainer
    Config.from_converted(converted)  # the result must be a valid zerotier config
    text = config_files.to_toml(sections)
    for line in by_trainer:  # [Note: keys a trainer fills] in config.py
        print(f"zerotier convert: auto (filled by the trainer): {line}", file=sys.stderr)
    for key in unmapped:
        print(f"zerotier convert: not used (no zerotier meaning): {key}", file=sys.stderr)
    if args.to:
        Path(args.to).write_text(text, encoding="utf-8")  # TOML is UTF-8
        print(f"zerotier config written to {args.to}")
    else:
        print(text, end="")
    return 0
