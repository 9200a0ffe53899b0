"""`zerotier demo` and `zerotier profile`: run the demo, and read a run's swap-traffic trace.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from zerotier.errors import ZerotierError
from zerotier.tier_names import TIER_NAMES


# ---------------------------------------------------------------------------------------------
# zerotier demo


def demo_arguments(parser: argparse.ArgumentParser) -> None:
    from zerotier.demo import DURATION, DURATION_BUSY, DURATION_LONG

    parser.add_argument("--steps", type=int,
                        help=f"optimizer steps to train (default 60: {DURATION}; {DURATION_BUSY})")
    parser.add_argument("--long", action="store_true",
                        help=f"the longer demo: 120 steps of a 6-layer model, batch 16 ({DURATION_LONG})")
    parser.add_argument("--nvme-path", metavar="DIR", default=None,
                        help="directory for the optimizer's swap files (default: the system temp dir)")
    parser.add_argument("--device-budget", default="24MiB", metavar="SIZE",
                        help="tiers.device; the default is smaller than the model's training state")
    parser.add_argument("--optimizer-tier", choices=["auto", *TIER_NAMES], default="nvme",
                        help="offload.optimizer: where fp32 master weights and Adam moments live (default nvme)")
    parser.add_argument("--trace", metavar="FILE", default=None,
                        help="also write a Perfetto/Chrome trace of the swap traffic (see `zerotier profile`)")


def run_demo(args: argparse.Namespace) -> int:
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


def profile_arguments(parser: argparse.ArgumentParser) -> None:
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


def run_profile(args: argparse.Namespace) -> int:
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
