"""`zerotier plan`: where each kind of training state goes, whether it fits, and the step time.

Heavy modules are imported when the command runs, so `--help` stays fast (no torch).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from zerotier.cli.values import parameter_count
from zerotier.errors import ZerotierError


def plan_arguments(parser: argparse.ArgumentParser) -> None:
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
                        help="share of speculated steps rolled back (train.overlap), 0..1: the expected "
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


def _factory_units(spec: str, wrap="auto", dtype_bytes: int = 4):
    """Build `module:factory` and return what the plan knows of it (planner/inputs.py ModelFacts):
    its units as zerotier.state.build_units groups them ([Note: frozen units]) and the activations
    estimated from the model's config ([Note: activation memory])."""
    from zerotier.planner.activations import estimate
    from zerotier.planner.inputs import ModelFacts
    from zerotier.state import build_units

    model = _build_model(spec)
    units = build_units(model, wrap)
    if all(unit.frozen for unit in units):
        raise ZerotierError(f"--model: {spec} has no trainable parameters")
    return ModelFacts.of(units, activations=estimate(model, dtype_bytes))


def run_plan(args: argparse.Namespace) -> int:
    import torch

    from zerotier.config import Config
    from zerotier.planner.inputs import ModelFacts, Node, PlanConfig
    from zerotier.planner.machine_fit import recorded_machine, this_machine
    from zerotier.planner.messages import PlanDoesNotFit
    from zerotier.planner.planner import make_plan
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
        model = _factory_units(args.model, cfg.train.wrap, DTYPES[cfg.precision.param_dtype].itemsize)
    else:  # units known by their sizes: one parameter each
        model = ModelFacts.of_sizes(_equal_units(parameter_count(args.params), 4 * max(args.layers, 1)),
                                    _equal_units(parameter_count(args.frozen_params, "--frozen-params"),
                                                 4 * max(args.layers, 1)) if args.frozen_params is not None else ())
    grad_bytes = DTYPES[cfg.precision.param_dtype].itemsize if args.accounting == "paper" else None
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    rates = None
    if args.rates:
        from zerotier.bench import rates_from_file

        rates = rates_from_file(args.rates)  # ConfigError naming the file and key when it is not one
        device = _planned_device(rates, cfg, device)
    machine = recorded_machine(args.rates, device.type) if args.rates else this_machine(device)
    try:
        plan = make_plan(model, PlanConfig.of(cfg, StepOptions.of(cfg, args.rollback_rate), grad_bytes),
                         Node(device, rates=rates, world_size=args.world_size, ranks_per_node=args.ranks_per_node,
                              machine=machine))
    except PlanDoesNotFit as exc:
        if args.json:  # the object on stdout, the message on stderr (by main), exit status 1
            print(json.dumps({"numel": sum(model.numels), "world_size": args.world_size, "stage": cfg.zero.stage,
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
