"""`zerotier` command line: one small function pair per subcommand, registered in COMMANDS.

Adding a subcommand:

    def _plan_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--config", help="...")   # every option gets a help text

    def _run_plan(args: argparse.Namespace) -> int:
        from zerotier.planner.planner import ...              # heavy imports inside, so --help stays fast
        ...
        return 0

    COMMANDS = [..., Command("plan", "one-line summary", _plan_arguments, _run_plan)]

A ZerotierError raised by a command is printed as `zerotier <command>: error: <message>`
(exit status 1), without a traceback.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
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
    from zerotier.units import format_size

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
    if memory.get("cgroup_limit_bytes") is not None:  # the RAM above is already capped by it
        rows.append(("cgroup memory limit", f"{format_size(memory['cgroup_limit_bytes'])} ({memory['cgroup']})"))

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
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--params", metavar="N",
                       help="trainable parameters of the model, e.g. 7B, 350M, 7.5e9 or 1200000")
    model.add_argument("--model", metavar="MODULE:FACTORY",
                       help="a callable returning an nn.Module, e.g. zerotier.models:TinyGPT; built on the "
                            "meta device if it takes a `device` keyword, else normally; its trainable and "
                            "frozen (requires_grad=False) parameters and per-module units are counted as the "
                            "engine does")
    parser.add_argument("--frozen-params", metavar="N",
                        help="with --params: frozen parameters besides the trainable ones (a LoRA base), "
                             "placed by offload.params with no gradient or optimizer state, e.g. 7B")
    parser.add_argument("--layers", type=int, default=32,
                        help="with --params: transformer layers; the model is treated as 4 equal units per "
                             "layer (default 32)")
    parser.add_argument("--config", metavar="FILE",
                        help="zerotier config (TOML/JSON/YAML) giving tiers, offload, precision and prefetch")
    parser.add_argument("--world-size", type=int, default=1, metavar="N",
                        help="data-parallel ranks; budgets are per rank (default 1)")
    parser.add_argument("--ranks-per-node", type=int, metavar="N",
                        help="ranks sharing this node's CPU and NVMe, for the step-time prediction "
                             "(default: the world size, i.e. one node)")
    parser.add_argument("--stage", type=int, choices=(0, 1, 2, 3),
                        help="ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 also parameters "
                             "(default: zero.stage of the config, 0)")
    parser.add_argument("--param-dtype", choices=("fp32", "bf16", "fp16"),
                        help="dtype of the training parameters (default: precision.param_dtype of the config)")
    parser.add_argument("--accounting", choices=("engine", "paper"), default="engine",
                        help="gradient bytes: 'engine' counts zerotier's fp32 gradient accumulators "
                             "(4 B/param, what it allocates), 'paper' the ZeRO paper's param-dtype gradients "
                             "(2+2+12 B/param in bf16/fp16) (default engine)")
    parser.add_argument("--offload", action="append", default=[], metavar="KIND=TIER",
                        help="place a kind of state (params, gradients, optimizer) on a tier (auto, device, "
                             "host, nvme); repeatable, overrides the config")
    parser.add_argument("--device", metavar="SIZE", help="device budget per rank, e.g. 24GiB (overrides the config)")
    parser.add_argument("--host", metavar="SIZE", help="host budget per rank, e.g. 200GiB (overrides the config)")
    parser.add_argument("--nvme", metavar="SIZE", help="NVMe budget per rank, e.g. 2TiB (overrides the config)")
    parser.add_argument("--nvme-path", metavar="DIR", help="NVMe directory (overrides the config)")
    parser.add_argument("--inputs", metavar="MODULE:FACTORY",
                        help="with --model: a callable returning one micro-batch's positional arguments (a tuple); "
                             "each distinct unit's forward and backward is then measured on this machine's device, "
                             "one unit's parameters at a time, and the prediction is the whole step (what "
                             "zerotier.plan(model, config, inputs=...) returns)")
    parser.add_argument("--rates", metavar="FILE",
                        help="plan for another node: a `zerotier bench --save FILE` result written there; its rates "
                             "replace this node's and measured unit times scale by the ratio of the two nodes' "
                             "matmul rates (bench compute)")
    parser.add_argument("--rollback-rate", type=float, metavar="R",
                        help="share of speculated steps rolled back (train.speculative_step), 0..1: the expected "
                             "step is (1 - R) x commit + R x rollback (default 0.01; `zerotier profile` measures it)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object: per_rank_bytes, tiers (bytes needed per tier), placement, "
                             "fits, missing, predicted_step_s (null without `zerotier bench` results), "
                             "breakdown_s, critical_path_s, bound_by, alternatives")


def _equal_units(total: int, units: int) -> list[int]:
    """`total` elements as `units` equal units (the last takes the remainder)."""
    units = min(units, total)
    numels = [total // units] * units
    numels[-1] += total - sum(numels)
    return numels


MAX_PARAMS = 10**15


def _count(text: str, flag: str = "--params") -> int:
    from decimal import Decimal, InvalidOperation

    scale = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
    given, text = text, text.strip().upper().replace("_", "")
    try:
        value = Decimal(text[:-1]) * scale[text[-1]] if text and text[-1] in scale else Decimal(text)
    except InvalidOperation:
        value = Decimal(-1)
    if not value.is_finite() or value < 1 or value != value.to_integral_value():
        raise ZerotierError(f"{flag}: cannot read {given!r}; use a whole count like 7B, 350M, 7.5e9 or 1200000")
    if value > MAX_PARAMS:  # the planner's byte counts and times are floats: far past any model, they overflow
        raise ZerotierError(f"{flag}: {given} is more than 10^15 parameters (1000T), the most zerotier plans "
                            "for; use a count like 7B, 350M, 7.5e9 or 1200000")
    return int(value)


def _load_factory(spec: str, flag: str):
    """The callable `module:attr` names (from the current directory too, as python -m finds modules)."""
    import importlib

    module_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    if not module_name or not attr:
        raise ZerotierError(f"{flag}: expected MODULE:FACTORY (e.g. zerotier.models:TinyGPT), got {spec!r}")
    try:
        factory = importlib.import_module(module_name)
        for part in attr.split("."):
            factory = getattr(factory, part)
    except (ImportError, AttributeError) as exc:
        raise ZerotierError(f"{flag}: cannot load {spec!r}: {exc}") from None
    return factory


def _build_model(spec: str):
    """Build `module:factory`, on the meta device when it takes `device=`."""
    import inspect

    import torch

    factory = _load_factory(spec, "--model")
    try:
        takes_device = "device" in inspect.signature(factory).parameters
    except (TypeError, ValueError):  # builtins without a signature
        takes_device = False
    model = factory(device="meta") if takes_device else factory()
    if not isinstance(model, torch.nn.Module):
        raise ZerotierError(f"--model: {spec} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def _factory_units(spec: str, wrap="auto", dtype_bytes: int = 4) -> tuple[list[int], list[int], int, tuple | None]:
    """Build `module:factory` and return the numel of each trainable unit and of each frozen one
    as zerotier.state.build_units groups them ([Note: frozen units]), their nested_numel, and the
    activations estimated from the model's config ([Note: activation memory])."""
    from zerotier.planner.activations import estimate
    from zerotier.state import build_units, nested_numel

    model = _build_model(spec)
    units = build_units(model, wrap)
    trainable = [unit.numel for unit in units if not unit.frozen]
    if not trainable:
        raise ZerotierError(f"--model: {spec} has no trainable parameters")
    return trainable, [unit.numel for unit in units if unit.frozen], nested_numel(units), estimate(model, dtype_bytes)


def _run_plan(args: argparse.Namespace) -> int:
    import torch

    from zerotier.config import Config
    from zerotier.planner.machine_fit import recorded_machine, this_machine
    from zerotier.planner.planner import PlanDoesNotFit, make_plan
    from zerotier.planner.predict import StepOptions
    from zerotier.state import DTYPES

    cfg = Config.coerce(args.config).to_dict()
    for key in ("device", "host", "nvme", "nvme_path"):
        value = getattr(args, key)
        if value is not None:
            cfg["tiers"][key] = value
    for item in args.offload:
        kind, sep, tier = item.partition("=")
        if not sep or kind not in cfg["offload"]:
            raise ZerotierError(f"--offload: expected KIND=TIER with KIND one of {', '.join(cfg['offload'])}, "
                                f"got {item!r}")
        cfg["offload"][kind] = tier
    if args.param_dtype:
        cfg["precision"]["param_dtype"] = args.param_dtype
    if args.stage is not None:
        cfg["zero"]["stage"] = args.stage
    note = None
    path = cfg["tiers"].get("nvme_path")
    if path is not None and not Path(path).exists() and cfg["tiers"]["nvme"] == "auto":
        # planning for another machine: its drive is not here to measure
        cfg["tiers"]["nvme"] = 1 << 60
        note = (f"note: {path} does not exist on this machine, so its free space is unknown: planned with an "
                "unlimited NVMe budget (pass --nvme SIZE to plan with that machine's)")
    cfg = Config.from_dict(cfg).auto_to_defaults()  # [Note: keys a trainer fills]
    if args.world_size < 1:
        raise ZerotierError(f"--world-size: must be >= 1, got {args.world_size}")
    if args.inputs and not args.model:
        raise ZerotierError("--inputs goes with --model: the micro-batch is measured through that model")
    if args.model and args.inputs:  # the whole step, measured: zerotier.plan's path
        return _plan_measured(args, cfg)
    if args.model:
        if args.frozen_params is not None:
            raise ZerotierError("--frozen-params goes with --params; with --model the model's own "
                                "requires_grad=False parameters are the frozen ones")
        numels, frozen_numels, nested, activations = _factory_units(args.model, cfg.train.wrap,
                                                                    DTYPES[cfg.precision.param_dtype].itemsize)
    else:
        nested, activations = 0, None
        numels = _equal_units(_count(args.params), 4 * max(args.layers, 1))
        frozen_numels = (_equal_units(_count(args.frozen_params, "--frozen-params"), 4 * max(args.layers, 1))
                         if args.frozen_params is not None else [])
    grad_bytes = DTYPES[cfg.precision.param_dtype].itemsize if args.accounting == "paper" else None
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    rates = None
    if args.rates:
        from zerotier.bench import rates_from_file

        rates = rates_from_file(args.rates)  # ConfigError naming the file and key when it is not one
        device = _planned_device(rates, cfg, device)
    try:
        plan = make_plan(numels, cfg.tiers, cfg.offload, cfg.precision, cfg.prefetch, device, rates=rates,
                         world_size=args.world_size, stage=cfg.zero.stage, zero=cfg.zero, grad_bytes=grad_bytes,
                         ranks_per_node=args.ranks_per_node, nested_numel=nested, frozen_numels=frozen_numels,
                         pipeline_depth=cfg.optimizer.pipeline_depth, step=StepOptions.of(cfg, args.rollback_rate),
                         machine=recorded_machine(args.rates, device.type) if args.rates else this_machine(device),
                         activations=activations)
    except PlanDoesNotFit as exc:
        if args.json:  # the object on stdout, the message on stderr (by main), exit status 1
            print(json.dumps({"numel": sum(numels), "world_size": args.world_size, "stage": cfg.zero.stage,
                              "per_rank_bytes": exc.per_rank_bytes, "tiers": None,
                              "placement": {k: v.value for k, v in exc.placement.items()},
                              "fits": False, "missing": {"kind": exc.kind, "options": exc.options, "whole": exc.whole},
                              "predicted_step_s": None}, indent=2))
        raise
    print(json.dumps(plan.to_dict(), indent=2) if args.json else plan.summary())
    if note is not None:
        print(note, file=sys.stderr)
    return 0


def _planned_device(rates: dict, cfg, here):
    """[Note: another node's rates] in planning.py: a node whose bench measured PCIe has a GPU."""
    import torch

    if "h2d" not in rates or here.type == "cuda":
        return here
    if cfg.tiers.device == "auto":
        raise ZerotierError("--rates: that node has a GPU (its bench measured PCIe) and this one does not: pass "
                            "--device SIZE, the GPU memory per rank there")
    return torch.device("cuda")


def _plan_measured(args: argparse.Namespace, cfg) -> int:
    """`zerotier plan --model M:F --inputs M:F`: the Plan zerotier.plan(model, config, inputs=...) returns."""
    import torch

    from zerotier.planner.planning import plan_model
    from zerotier.state import DTYPES

    model = _build_model(args.model)
    inputs = _load_factory(args.inputs, "--inputs")
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    grad_bytes = DTYPES[cfg.precision.param_dtype].itemsize if args.accounting == "paper" else None
    plan = plan_model(model, cfg, inputs, rates=args.rates, device=device, world_size=args.world_size,
                      ranks_per_node=args.ranks_per_node, grad_bytes=grad_bytes, rollback_rate=args.rollback_rate)
    print(json.dumps(plan.to_dict(), indent=2) if args.json else plan.summary())
    return 0


# ---------------------------------------------------------------------------------------------
# zerotier bench


def _bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("what", nargs="?", default="all", choices=("all", "mem", "pcie", "io", "adam", "compute"),
                        help="what to measure: all (default), mem (memory bandwidth), pcie (host<->GPU "
                             "copies), io (NVMe read/write with zerotier's engine), adam (CPU Adam), compute "
                             "(matmul rate of the compute device: `zerotier plan --rates` scales unit times by it)")
    parser.add_argument("--path", "--nvme-path", dest="path", default=".", metavar="DIR",
                        help="directory on the drive to test; a temp subdir is made and removed "
                             "(default: the current directory)")
    parser.add_argument("--size", metavar="SIZE",
                        help="bytes per measurement for mem, pcie and io, e.g. 2GiB "
                             "(default 1GiB, pcie 512MiB; with --quick 256MiB mem, 64MiB pcie and io)")
    parser.add_argument("--params", metavar="N", help="parameters for the adam measurement (default 50M; --quick 2M)")
    parser.add_argument("--quick", action="store_true", help="small sizes: a rough figure in a few seconds")
    parser.add_argument("--json", action="store_true",
                        help="print the results as JSON (one section: its object, e.g. read_GBps/write_GBps)")
    parser.add_argument("--save", metavar="FILE",
                        help="merge the results into FILE (default $ZEROTIER_BENCH_FILE, else "
                             "~/.cache/zerotier/bench.json), where `zerotier plan` reads them")
    parser.add_argument("--no-save", action="store_true", help="do not save the results")


def _run_bench(args: argparse.Namespace) -> int:
    from zerotier import bench
    from zerotier.units import parse_size

    sections = bench.SECTIONS if args.what == "all" else (args.what,)
    size = parse_size(args.size, "--size") if args.size is not None else None
    if size == 0:
        raise ZerotierError("--size: must be > 0")
    params = _count(args.params) if args.params is not None else None
    if "io" in sections:
        _check_writable_dir(args.path, "--path/--nvme-path")
    results = bench.run(sections, size=size, params=params, quick=args.quick, path=args.path)
    if args.json:
        print(json.dumps(results[args.what] if args.what != "all" else results, indent=2))
    else:
        print(bench.format_table(results))
    if not args.no_save:
        where = bench.save(results, args.save)
        print(f"saved to {where}" + (" (`zerotier plan` uses it)" if not args.json else ""), file=sys.stderr)
    return 0


def _check_writable_dir(path: str, option: str) -> None:
    """`path` is a directory a file can be made in (what bench io does), else a one-line error."""
    import tempfile

    if not os.path.isdir(path):
        raise ZerotierError(f"{option} {path}: not an existing directory; give a directory on the drive to measure")
    try:
        tempfile.TemporaryDirectory(prefix="zt-bench-", dir=path).cleanup()
    except OSError as exc:
        raise ZerotierError(f"{option} {path}: cannot create files there ({exc.strerror or exc}); give a writable "
                            "directory on the drive to measure") from None


# ---------------------------------------------------------------------------------------------
# zerotier demo


def _demo_arguments(parser: argparse.ArgumentParser) -> None:
    from zerotier.demo import DURATION, DURATION_BUSY, DURATION_LONG

    parser.add_argument("--steps", type=int,
                        help=f"optimizer steps to train (default 60: {DURATION}; {DURATION_BUSY})")
    parser.add_argument("--long", action="store_true",
                        help=f"the longer demo: 120 steps of a 6-layer model, batch 16 ({DURATION_LONG})")
    parser.add_argument("--nvme-path", metavar="DIR", default=None,
                        help="directory for the optimizer's swap files (default: the system temp dir)")
    parser.add_argument("--device-budget", default="24MiB", metavar="SIZE",
                        help="tiers.device; the default is smaller than the model's training state")
    parser.add_argument("--optimizer-tier", choices=["auto", "device", "host", "nvme"], default="nvme",
                        help="offload.optimizer: where fp32 master weights and Adam moments live (default nvme)")
    parser.add_argument("--trace", metavar="FILE", default=None,
                        help="also write a Perfetto/Chrome trace of the swap traffic (see `zerotier profile`)")


def _run_demo(args: argparse.Namespace) -> int:
    from zerotier import demo

    if args.steps is not None and args.steps < 1:
        raise ZerotierError(f"--steps: must be >= 1, got {args.steps}")
    if args.nvme_path and not os.path.isdir(args.nvme_path):  # the demo makes its swap dir inside it
        raise ZerotierError(f"--nvme-path {args.nvme_path} does not exist: create it (mkdir -p {args.nvme_path}) "
                            "or leave --nvme-path out (the demo then uses the system temp dir)")
    argv = ["--device-budget", args.device_budget, "--optimizer-tier", args.optimizer_tier]
    if args.steps is not None:  # else the example's default, short or --long
        argv += ["--steps", str(args.steps)]
    if args.long:
        argv.append("--long")
    if args.nvme_path:
        argv += ["--nvme-path", args.nvme_path]
    if args.trace:
        argv += ["--trace", args.trace]
    demo.run(argv)
    return 0


# ---------------------------------------------------------------------------------------------
# zerotier profile


def _profile_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", metavar="TRACE.json",
                        help="trace written with profile.trace_path or Profiler.save() (.json or .json.gz)")
    parser.add_argument("--plot", metavar="OUT.png",
                        help="also draw residency per tier and bandwidth per link over time (needs matplotlib); "
                             "with --plan, the planned beside the measured seconds per component")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object instead of a table")
    parser.add_argument("--top", type=int, default=10, metavar="N", help="tensors listed by traffic (default 10)")
    parser.add_argument("--plan", metavar="PLAN.json",
                        help="a `zerotier plan --json` of this run: each component's measured seconds per step "
                             "beside the plan's, the component furthest from it, and the measured rollback rate "
                             "of the speculative step beside the plan's")


def _run_profile(args: argparse.Namespace) -> int:
    from zerotier.profiler import load_trace, plot_trace, summarize
    from zerotier.profiler.plot import load_matplotlib

    if args.plot:
        load_matplotlib()  # before the report, not after it
    trace = load_trace(args.trace)
    summary = summarize(trace, top=args.top)
    comparison = None
    if args.plan:
        from zerotier.profiler.versus_plan import load_plan, plan_comparison, plan_table, speculation_comparison

        plan = load_plan(args.plan)
        comparison = plan_comparison(trace, plan)
        rollbacks = speculation_comparison(trace, plan)
    if args.json:
        out = summary.to_dict()
        if comparison is not None:
            out["plan"] = {"rows": comparison[0], "verdict": comparison[1], "speculation": rollbacks}
        print(json.dumps(out, indent=2))
    else:
        print(summary.table() + ("\n" + plan_table(*comparison) if comparison is not None else "")
              + (f"\n{rollbacks}" if comparison is not None and rollbacks else ""))
    if args.plot:
        print(f"plot written to {plot_trace(trace, args.plot, plan if args.plan else None)}", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------------
# zerotier export


def _export_arguments(parser: argparse.ArgumentParser) -> None:
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


def _run_export(args: argparse.Namespace) -> int:
    from zerotier.export import export

    out = export(args.checkpoint, args.to, args.dtype, trust_pickle=args.trust_pickle)
    print(f"weights written to {out}")
    return 0


# ---------------------------------------------------------------------------------------------
# zerotier convert


def _convert_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("ds_config", metavar="DS_CONFIG", help="a DeepSpeed JSON config (ds_config.json)")
    parser.add_argument("--to", metavar="OUT", default=None,
                        help="write the zerotier config here (.toml); default: print it")


def _run_convert(args: argparse.Namespace) -> int:
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


COMMANDS: list[Command] = [
    Command("env", "report versions, devices, CPU features, RAM, native code, io_uring and disk space",
            _env_arguments, _run_env),
    Command("plan", "predict where each kind of training state goes, whether it fits, and swap time per step",
            _plan_arguments, _run_plan),
    Command("bench", "measure this node's memory, PCIe, NVMe and CPU Adam rates; saved for `zerotier plan`",
            _bench_arguments, _run_bench),
    Command("demo", "train a small GPT (examples/train_gpt.py) with optimizer state on NVMe; ends with the swap table",
            _demo_arguments, _run_demo),
    Command("profile", "summarize a saved swap-traffic trace; --plot draws it", _profile_arguments, _run_profile),
    Command("export", "write a checkpoint's model weights to .safetensors or .pt (no model code needed)",
            _export_arguments, _run_export),
    Command("convert", "turn a DeepSpeed JSON config into a zerotier TOML config (unused keys listed)",
            _convert_arguments, _run_convert),
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


def _print_rows(rows: list[tuple[str, str]]) -> None:
    width = max(len(key) for key, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


if __name__ == "__main__":
    sys.exit(main())
