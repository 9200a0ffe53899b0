"""zerotier's predictions for bench_gpu.py's zerotier cases, before any GPU run (issue 36 item 4).

    python benchmarks/predict_table.py                       # the table, for the H200 (markdown)
    python benchmarks/predict_table.py --write docs/benchmarks.md   # replace the table there
    python benchmarks/predict_table.py --json

For each size and zerotier case: the planner's predicted step time, peak host RSS, pinned bytes,
device peak and NVMe bytes per step, with another node's rates: what `zerotier plan --model
... --rates benchmarks/nodes/h200.json` computes, plus the compute it cannot measure here.

[Note: predicting a GPU step on a CPU]
  plan       make_plan as Engine.__init__ calls it (the meta model's units, the case's config,
             materialization's pool bytes, the step options), with the node file's rates and
             the node's `auto` budgets (device 0.9 x free - 15 % of total, host 0.8 x available
             RAM, NVMe 0.9 x free disk: resolve_budgets' rules over NODES' figures)
  compute    zerotier.plan measures each unit on the device it runs on; a CPU cannot stand in
             for an H200, so each unit's forward is its FLOPs (gpu_model.unit_forward_flops)
             over the node's bf16 matmul rate x EFFICIENCY, backward twice that, plus one more
             forward for checkpointed layers. EFFICIENCY is the one compute figure measured on
             that GPU: plain torch at 1.3B (docs/benchmarks.md, First GPU run), its FLOPs per
             second over the matmul peak of the same run
  host RSS   the plan's host need (the pinned pool) + CUDA_RSS, the process outside the pool
             (torch's CUDA runtime): plain torch's peak RSS in that run; with the delayed update it has
             the plan's `delayed` term (overlap.delayed.host_bytes: its gradient copies and staged parameters)
  pinned     the host pool: the plan's host need (the delayed update's copies included)
  device     the plan's device need + gpu_model.activation_bytes (an estimate, not planned)
  NVMe/step  bytes read + written per step as the schedule moves them: parameters on NVMe
             read per forward and backward and written once, gradients written and read once,
             optimizer state read and written once
Not modeled: the delayed update's overlap (predicted as the plain step), collectives (one GPU).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

import gpu_model as gm
from gpu_case_list import CASES, ZEROTIER_CASES, zerotier_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NODE_DIR = os.path.join(ROOT, "benchmarks", "nodes")
GiB = 1 << 30
# The machines a lent device is: memory as nvidia-smi / free report it. disk_free_gib is assumed
# (a 64 GiB disk less the image, the repo and the venv), not measured there.
NODES = {
    "h200": dict(rates="h200.json", device_gib=139.8, ram_gib=126.0, ram_available_gib=120.0, disk_free_gib=50.0),
    "h100": dict(rates="h200.json", device_gib=79.2, ram_gib=126.0, ram_available_gib=120.0, disk_free_gib=50.0),
}
# The H200's plain torch 1.3B row (docs/benchmarks.md): tokens/s and MFU (6 N, N = all parameters).
H200_TORCH_1P3B = {"tokens_per_s": 40181, "mfu_pct": 42.1, "peak_rss_gib": 1.4}
CUDA_RSS = int(H200_TORCH_1P3B["peak_rss_gib"] * GiB)
SIZES = ("2.7b", "7b", "13b", "20b", "30b")  # 2.7b: the largest named size whose NVMe cases fit the disk


def matmul_peak_from_run() -> float:
    """The bf16 matmul peak of the H200 run, from its torch row: 6 N tokens/s over MFU."""
    r = H200_TORCH_1P3B
    return 6 * gm.param_count("1.3b") * r["tokens_per_s"] / (r["mfu_pct"] / 100)


def efficiency() -> float:
    """[Note: predicting a GPU step on a CPU] plain torch's FLOPs/s at 1.3B over the matmul peak."""
    return gm.model_flops_per_token("1.3b") * H200_TORCH_1P3B["tokens_per_s"] / matmul_peak_from_run()


def node_rates(node: str) -> dict[str, float]:
    from zerotier.bench import rates_from_file
    rates = rates_from_file(os.path.join(NODE_DIR, NODES[node]["rates"]))
    if rates is None:
        raise SystemExit(f"{NODES[node]['rates']}: no zerotier bench results in it")
    return rates


def node_budgets(node: str) -> dict[str, int]:
    """resolve_budgets' `auto` rules over the node's figures (planner.resolve_budgets)."""
    n = NODES[node]
    total = n["device_gib"] * GiB
    return {"device": int(0.9 * (total - 0.5 * GiB) - 0.15 * total), "host": int(0.8 * n["ram_available_gib"] * GiB),
            "nvme": int(0.9 * n["disk_free_gib"] * GiB)}


def unit_compute(size: str, units, flops_per_s: float):
    """Each unit's forward/backward seconds from its FLOPs (layers by name, the root the rest)."""
    from zerotier.planner.predict import UnitCompute
    layer, rest = gm.unit_forward_flops(size)
    recompute = 1.0 if gm.SIZES[size]["ckpt"] else 0.0
    fwd, bwd = [], []
    for u in units:
        f = (layer if u.name.startswith("layers.") else rest if u.name == "" else 0.0) / flops_per_s
        fwd.append(f)
        bwd.append((2.0 + (recompute if u.name.startswith("layers.") else 0.0)) * f)
    return UnitCompute(tuple(fwd), tuple(bwd), tuple(u.name == "" for u in units))


def nvme_bytes_per_step(plan, units) -> int:
    from zerotier.state import Location
    numels = [u.numel for u in units if not u.frozen]
    opt = plan.optimizer_units or (plan.placement["optimizer"],) * len(numels)
    total = 0
    for n, where in zip(numels, opt):
        if plan.placement["params"] is Location.NVME:
            total += 3 * plan.param_bytes * n          # read for forward and backward, written once
        if plan.placement["gradients"] is Location.NVME:
            total += 2 * plan.grad_bytes * n           # written, read by the optimizer
        if where is Location.NVME:
            total += 2 * plan.state_layout.bytes_per_param * n
    return int(total)


def predict(size: str, case: str, rates: dict, budgets: dict, compute_flops: float | None,
            config: dict | None = None) -> dict:
    """One row: the plan of `case` at `size` for a node with these rates and budgets, or why it
    does not fit (with what it would need on each tier). config: the case's engine config as
    bench_gpu runs it (default: gpu_case_list.zerotier_config without clipping or accumulation)."""
    from zerotier.overlap import policy_for
    from zerotier.config import Config
    from zerotier.errors import ZerotierError
    from zerotier.materialize import pool_bytes
    from zerotier.planner.messages import PlanDoesNotFit
    from zerotier.planner.inputs import ModelFacts, Node, PlanConfig
    from zerotier.planner.planner import make_plan
    from zerotier.state import build_units

    config = config or zerotier_config(case, "/nonexistent/nvme", 16, None, 1, "cuda")
    cfg = Config.coerce(config).auto_to_defaults()
    units = build_units(gm.llama(size, "meta"), cfg.train.wrap)
    compute = unit_compute(size, units, compute_flops) if compute_flops else None

    def plan_with(budget):
        return make_plan(ModelFacts.of(units, compute=compute,
                                       materialize_bytes=pool_bytes(units, torch.bfloat16, cfg.io.alignment)),
                         PlanConfig.of(cfg), Node(torch.device("cuda"), budgets=budget, rates=rates))

    row = {"size": size, "case": case, "numel": gm.param_count(size), "budgets": budgets}

    try:
        plan = plan_with(budgets)  # the delayed update's copies are its `delayed` term ([Note: needs per component])
        policy_for(cfg).refuse(cfg, plan, 1)
    except (PlanDoesNotFit, ZerotierError) as exc:
        row.update(fits=False, reason=str(exc).splitlines()[0])
        if "auto" in (cfg.offload.params, cfg.offload.gradients, cfg.offload.optimizer):
            return row  # no one placement to size: the planner's shortfall per tier says it
        try:  # what its placement would need, with no budget in the way
            unlimited = plan_with({t: 1 << 60 for t in budgets})
            row["need"] = dict(unlimited.need)
            row["reason"] = ("needs " + ", ".join(f"{t} {row['need'][t] / GiB:.1f} GiB (has {budgets[t] / GiB:.1f})"
                                                  for t in ("device", "host", "nvme")))
        except ZerotierError:
            pass
        return row
    host = plan.need["host"]
    step = plan.predicted_step_s if plan.rates_measured else None
    tokens = gm.SIZES[size]["batch"] * gm.SIZES[size]["seq"]
    row.update(fits=True, placement={k: v.value for k, v in plan.placement.items()},
               optimizer_split={t: b for t, (b, _) in plan.optimizer_split.items()} or None,
               need=dict(plan.need), predicted_step_s=step, bound_by=plan.bound_by,
               peak_rss=host + CUDA_RSS, pinned=host, device_peak=plan.need["device"] + gm.activation_bytes(size),
               nvme_bytes_per_step=nvme_bytes_per_step(plan, units),
               tflops=gm.model_flops_per_token(size) * tokens / step / 1e12 if step else None)
    return row


def node_for_gpu(name: str | None) -> str:
    """The committed node file closest to the GPU here: h100 for an H100 when one is committed."""
    if name and "H100" in name and os.path.exists(os.path.join(NODE_DIR, "h100.json")):
        return "h100"
    return "h200"


def predict_here(size: str, case: str, cfg: dict, device: torch.device) -> dict:
    """bench_gpu's prediction for the machine it runs on: this machine's `auto` budgets, the rates of
    the committed node file of its GPU (h200.json until an H100's is committed), the same compute model.
    On a CPU (the rehearsal) the budgets are the H200's: the figures are the path's, not a result."""
    from zerotier.config import Config
    from zerotier.planner.budgets import resolve_budgets
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    node = node_for_gpu(gpu)
    rates = node_rates(node)
    budgets = (resolve_budgets(Config.coerce(cfg).auto_to_defaults().tiers, device) if device.type == "cuda"
               else node_budgets(node))
    row = predict(size, case, rates, budgets, rates["compute_bf16"] * efficiency(), config=cfg)
    row["node"] = node
    return row


def table(rows: list[dict], node: str) -> str:
    def gib(v):
        return "-" if v is None else f"{v / GiB:.1f}"
    lines = [
        f"| size | case | placement (params / grads / optimizer) | predicted step s | TFLOPS | bound by "
        f"| peak host RSS GiB | pinned GiB | device peak GiB | NVMe GB/step |",
        "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r["fits"]:
            lines.append(f"| {r['size']} | {r['case']} | n/a: {r['reason']} | - | - | - | - | - | - | - |")
            continue
        p = r["placement"]
        opt = ("split " + " / ".join(f"{t} {b / GiB:.0f} GiB" for t, b in r["optimizer_split"].items())
               if r["optimizer_split"] else p["optimizer"])
        lines.append(
            f"| {r['size']} | {r['case']} | {p['params']} / {p['gradients']} / {opt} "
            f"| {r['predicted_step_s']:.2f} | {r['tflops']:.0f} | {r['bound_by']} | {gib(r['peak_rss'])} "
            f"| {gib(r['pinned'])} | {gib(r['device_peak'])} | {r['nvme_bytes_per_step'] / 1e9:.1f} |")
    b = node_budgets(node)
    lines += ["", f"Node {node}: budgets device {b['device'] / GiB:.1f} GiB, host {b['host'] / GiB:.1f} GiB, "
              f"NVMe {b['nvme'] / GiB:.1f} GiB (`auto` over NODES in predict_table.py); rates "
              f"benchmarks/nodes/{NODES[node]['rates']}; compute at {efficiency():.1%} of the bf16 matmul peak "
              f"{node_rates(node)['compute_bf16'] / 1e12:.0f} TFLOPS."]
    return "\n".join(lines) + "\n"


def markers(node: str) -> tuple[str, str]:
    return f"<!-- predict_table {node}: begin -->", f"<!-- predict_table {node}: end -->"


def rows_for(node: str, sizes=SIZES, cases=ZEROTIER_CASES) -> list[dict]:
    rates = node_rates(node)
    return [predict(size, case, rates, node_budgets(node), rates["compute_bf16"] * efficiency())
            for size in sizes for case in cases]


def replace_between(doc: str, node: str, text: str, path: str) -> str:
    begin, end = markers(node)
    if begin not in doc or end not in doc:
        raise SystemExit(f"{path}: no {begin} ... {end} markers")
    head, rest = doc.split(begin, 1)
    return head + begin + "\n" + text + end + rest.split(end, 1)[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--node", choices=sorted(NODES), action="append",
                    help="the node(s) to plan for (default: every node in NODES)")
    ap.add_argument("--sizes", default=",".join(SIZES))
    ap.add_argument("--cases", default=",".join(ZEROTIER_CASES))
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--write", metavar="MD", help="replace each node's table between its markers in this file "
                    "(<!-- predict_table NODE: begin --> ... <!-- predict_table NODE: end -->)")
    args = ap.parse_args(argv)
    unknown = [c for c in args.cases.split(",") if CASES.get(c, ("",))[0] != "zerotier"]
    if unknown:
        raise SystemExit(f"not zerotier cases: {unknown}")
    nodes = args.node or list(NODES)
    rows = {node: rows_for(node, args.sizes.split(","), args.cases.split(",")) for node in nodes}
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    texts = {node: table(r, node) for node, r in rows.items()}
    if args.write:
        with open(args.write) as f:
            doc = f.read()
        for node, text in texts.items():
            doc = replace_between(doc, node, text, args.write)
        with open(args.write, "w") as f:
            f.write(doc)
    for node, text in texts.items():
        print(f"{node}:\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
