"""`zerotier` command line: one small function pair per subcommand, registered in COMMANDS.

Adding a subcommand:

    def _plan_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--config", help="...")   # every option gets a help text

    def _run_plan(args: argparse.Namespace) -> int:
        from zerotier.planner import ...              # heavy imports inside, so --help stays fast
        ...
        return 0

    COMMANDS = [..., Command("plan", "one-line summary", _plan_arguments, _run_plan)]

A ZerotierError raised by a command is printed as `zerotier <command>: error: <message>`
(exit status 1), without a traceback.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from zerotier import __version__
from zerotier.errors import ZerotierError


@dataclass(frozen=True)
class Command:
    name: str
    summary: str                                           # one line, shown in `zerotier --help`
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]               # returns the exit status


# ---------------------------------------------------------------------------------------------
# zerotier env


def _env_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true",
                        help="print the report as one JSON object (sizes in bytes) instead of text")
    parser.add_argument("--nvme-path", default=".", metavar="PATH",
                        help="directory where NVMe swap files would go; its free space and filesystem "
                             "are reported (default: the current directory)")


def _run_env(args: argparse.Namespace) -> int:
    from zerotier import envinfo

    report = envinfo.collect(args.nvme_path)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_rows(_env_rows(report))
    return 0


def _env_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    from zerotier.config import format_size

    rows: list[tuple[str, str]] = []
    versions = report["versions"]
    if "error" in versions:
        rows.append(("versions", versions["error"]))
    else:
        rows += [("zerotier", versions["zerotier"]), ("torch", versions["torch"]),
                 ("python", versions["python"]), ("platform", versions["platform"])]

    cuda = report["cuda"]
    if "error" in cuda:
        rows.append(("cuda", cuda["error"]))
    elif not cuda["devices"]:
        built = cuda["torch_cuda_version"]
        rows.append(("cuda devices", f"none visible (torch built with CUDA {built})" if built
                     else "none (this torch build has no CUDA)"))
    for dev in cuda.get("devices", ()):
        rows.append((f"cuda:{dev['index']}", f"{dev['name']} (sm {dev['capability']}), "
                     f"{format_size(dev['total_bytes'])} total, {format_size(dev['free_bytes'])} free"))

    cpu = report["cpu"]
    if "error" in cpu:
        rows.append(("cpu", cpu["error"]))
    else:
        rows.append(("cpu", f"{cpu['model']} ({cpu['arch']}), "
                     f"{cpu['physical_cores']} physical / {cpu['logical_cores']} logical cores"))
        have = [flag for flag, present in cpu["simd_flags"].items() if present]
        missing = [flag for flag, present in cpu["simd_flags"].items() if not present]
        listed = " ".join(have) or "none of interest"
        rows.append(("cpu simd flags", listed + (f" (missing: {' '.join(missing)})" if missing else "")))

    memory = report["memory"]
    rows.append(("ram", memory.get("error") or f"{format_size(memory['total_bytes'])} total, "
                 f"{format_size(memory['available_bytes'])} available"))

    native = report["native"]
    rows += [(f"native {name}", state) for name, state in native.items()]
    rows.append(("simd in use", report["simd_level"]))

    io_uring = report["io_uring"]
    if io_uring["usable"] is None:  # the probe itself is unavailable; its reason says why
        rows.append(("io_uring", io_uring["reason"]))
    else:
        usable = "usable" if io_uring["usable"] else "not usable"
        rows.append(("io_uring", f"{usable}: {io_uring['reason']}" if io_uring["reason"] else usable))

    disk = report["nvme_path"]
    if "error" in disk:
        rows.append(("nvme path", f"error: {disk['error']}"))
    else:
        mount = f" ({disk['filesystem']} on {disk['device']})" if "filesystem" in disk else ""
        rows.append(("nvme path", f"{disk['path']}: {format_size(disk['free_bytes'])} free of "
                     f"{format_size(disk['total_bytes'])}{mount}"))
    return rows


# ---------------------------------------------------------------------------------------------

# ---------------------------------------------------------------------------------------------
# zerotier plan


def _plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", required=True, metavar="N",
                        help="trainable parameters of the model, e.g. 7B, 350M or 1200000")
    parser.add_argument("--layers", type=int, default=32,
                        help="transformer layers; the model is treated as 4 equal units per layer (default 32)")
    parser.add_argument("--config", metavar="FILE",
                        help="zerotier config (TOML/JSON/YAML) giving tiers, offload, precision and prefetch")
    parser.add_argument("--device", metavar="SIZE", help="device budget, e.g. 24GiB (overrides the config)")
    parser.add_argument("--host", metavar="SIZE", help="host budget, e.g. 200GiB (overrides the config)")
    parser.add_argument("--nvme", metavar="SIZE", help="NVMe budget, e.g. 2TiB (overrides the config)")
    parser.add_argument("--nvme-path", metavar="DIR", help="NVMe directory (overrides the config)")


def _count(text: str) -> int:
    scale = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
    text = text.strip().upper()
    try:
        if text[-1] in scale:
            return int(float(text[:-1]) * scale[text[-1]])
        return int(text)
    except (ValueError, IndexError):
        raise ZerotierError(f"--params: cannot read {text!r}; use a count like 7B, 350M or 1200000") from None


def _run_plan(args: argparse.Namespace) -> int:
    import torch

    from zerotier.config import Config
    from zerotier.planner import make_plan

    cfg = Config.coerce(args.config).to_dict()
    for key in ("device", "host", "nvme", "nvme_path"):
        value = getattr(args, key)
        if value is not None:
            cfg["tiers"][key] = value
    cfg = Config.from_dict(cfg)
    total, units = _count(args.params), 4 * args.layers
    numels = [total // units] * units
    numels[-1] += total - sum(numels)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    plan = make_plan(numels, cfg.tiers, cfg.offload, cfg.precision, cfg.prefetch, device)
    print(plan.summary())
    return 0


# ---------------------------------------------------------------------------------------------
# zerotier demo


def _demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps to train (default 20)")
    parser.add_argument("--nvme-path", metavar="DIR", default=None,
                        help="directory for the optimizer's swap files (default: the system temp dir)")
    parser.add_argument("--params", choices=["device", "host", "nvme"], default="host",
                        help="tier for the model's parameters between uses (default host)")
    parser.add_argument("--optimizer", choices=["device", "host", "nvme"], default="nvme",
                        help="tier for fp32 master weights and Adam moments (default nvme)")


def _run_demo(args: argparse.Namespace) -> int:
    from zerotier import demo

    demo.run(steps=args.steps, nvme_path=args.nvme_path, params=args.params, optimizer=args.optimizer)
    return 0


COMMANDS: list[Command] = [
    Command("env", "report versions, devices, CPU features, RAM, native code, io_uring and disk space",
            _env_arguments, _run_env),
    Command("plan", "predict where each kind of training state goes, whether it fits, and swap time per step",
            _plan_arguments, _run_plan),
    Command("demo", "train a small GPT with parameters on host and optimizer state on NVMe",
            _demo_arguments, _run_demo),
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


def _print_rows(rows: list[tuple[str, str]]) -> None:
    width = max(len(key) for key, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


if __name__ == "__main__":
    sys.exit(main())
