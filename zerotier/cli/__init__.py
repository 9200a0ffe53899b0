"""`zerotier` command line: one small function pair per subcommand, registered in COMMANDS; a
module per family of subcommands (node_commands: env, bench; plan_command: plan; run_commands:
demo, profile; file_commands: export, convert).

Adding a subcommand:

    def plan_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--config", help="...")   # every option gets a help text

    def run_plan(args: argparse.Namespace) -> int:
        from zerotier.planner.planner import ...              # heavy imports inside, so --help stays fast
        ...
        return 0

    COMMANDS = [..., Command("plan", "one-line summary", plan_arguments, run_plan)]

A ZerotierError raised by a command is printed as `zerotier <command>: error: <message>`
(exit status 1), without a traceback.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Callable, Sequence

from zerotier import __version__
from zerotier.cli.file_commands import convert_arguments, export_arguments, run_convert, run_export
from zerotier.cli.node_commands import bench_arguments, env_arguments, run_bench, run_env
from zerotier.cli.plan_command import plan_arguments, run_plan
from zerotier.cli.run_commands import demo_arguments, profile_arguments, run_demo, run_profile
from zerotier.errors import ZerotierError


@dataclass(frozen=True)
class Command:
    name: str
    summary: str                                           # one line, shown in `zerotier --help`
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]               # returns the exit status


COMMANDS: list[Command] = [
    Command("env", "report versions, devices, CPU features, RAM, native code, io_uring and disk space",
            env_arguments, run_env),
    Command("plan", "predict where each kind of training state goes, whether it fits, and swap time per step",
            plan_arguments, run_plan),
    Command("bench", "measure this node's memory, PCIe, NVMe and CPU Adam rates; saved for `zerotier plan`",
            bench_arguments, run_bench),
    Command("demo", "train a small GPT (examples/train_gpt.py) with optimizer state on NVMe; ends with the swap table",
            demo_arguments, run_demo),
    Command("profile", "summarize a saved swap-traffic trace; --plot draws it", profile_arguments, run_profile),
    Command("export", "write a checkpoint's model weights to .safetensors or .pt (no model code needed)",
            export_arguments, run_export),
    Command("convert", "turn a DeepSpeed JSON config into a zerotier TOML config (unused keys listed)",
            convert_arguments, run_convert),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zerotier",
        description="Train models larger than GPU memory on one node: ZeRO sharding with "
                    "device / host / NVMe tiers. Run `zerotier COMMAND --help` for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"zerotier {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        sub = commands.add_parser(command.name, help=command.summary, description=command.summary)
        command.add_arguments(sub)
        sub.set_defaults(run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except ZerotierError as exc:
        print(f"zerotier {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `zerotier ... | head`: the reader left; no traceback
        try:  # flushing stdout at exit must not fail again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (AttributeError, OSError, ValueError):
            pass
        return 0
