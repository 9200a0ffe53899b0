"""bench_gpu.py's figures that need more than one case, and its two tables (markdown) and json.

derive: throughput, Megatron-formula TFLOPS, MFU, ratios to the references of the same size,
|loss - reference loss|, predicted over measured. table: every case's row; predicted_table:
zerotier's cases, predict_table.py's prediction beside the measured figures; step_on_table:
zerotier's cases, where the update ran, the optimizer's exposed time and PCIe bytes. write: both files.
"""
from __future__ import annotations

import json
import os

import gpu_model as gm
from gpu_case_list import CASES, HPARAMS

REFERENCES = ("torch", "ds-z2-offload")   # step-time ratios and |Δloss| against the first that ran
GiB = 1 << 30
SIZES = gm.SIZES


def derive(results: list[dict], env: dict, args) -> None:
    """Figures that need more than one case: throughput, MFU, ratios, loss against the reference."""
    peak = env.get("matmul_peak_tflops")
    for r in results:
        if r.get("status") != "ok":
            continue
        ok = {o["case"]: o for o in results if o.get("status") == "ok" and o["size"] == r["size"]}
        ref = next((ok[c] for c in REFERENCES if c in ok), None)
        s = SIZES[r["size"]]
        tokens = s["batch"] * s["seq"] * args.accum
        r["tokens_per_step"] = tokens
        r["tokens_per_s"] = tokens / r["step_s"]
        r["tflops"] = gm.model_flops_per_token(r["size"]) * tokens / r["step_s"] / 1e12
        r["mfu_pct"] = 100.0 * r["tflops"] / peak if peak else None
        for base in REFERENCES:
            r[f"x_{base}"] = r["step_s"] / ok[base]["step_s"] if base in ok else None
        if ref is not None:
            n = min(len(ref["losses"]), len(r["losses"]))
            r["reference"] = ref["case"]
            r["max_abs_dloss"] = max(abs(a - b) for a, b in zip(r["losses"][:n], ref["losses"][:n]))
        pred = r.get("predicted")
        if pred and pred.get("predicted_step_s"):
            pred["step_over_measured"] = pred["predicted_step_s"] / r["step_s"]
            pred["rss_over_measured"] = pred["peak_rss"] / r["peak_rss"]


LINK = {"host->device": "H2D", "device->host": "D2H", "nvme->host": "N2H", "host->nvme": "H2N",
        "nvme->device": "N2D", "device->nvme": "D2N"}


def table(results: list[dict], env: dict, args) -> str:
    def f(v, fmt="{:.1f}", scale=1.0):
        return "-" if v is None else fmt.format(v / scale)

    sizes = list(dict.fromkeys(size for _, size, _ in args.runs))
    models = [f"- model {size}: Llama-style {gm.param_count(size) / 1e9:.2f}B params, dim {s['dim']}, {s['layers']} "
              f"layers, {s['heads']} heads, ffn {s['ffn']}, vocab {s['vocab']}, checkpointing "
              f"{'per layer' if s['ckpt'] else 'off'}; batch {s['batch']} x seq {s['seq']} x accum {args.accum} = "
              f"{s['batch'] * s['seq'] * args.accum} tokens/step; {gm.model_flops_per_token(size) / 1e9:.1f} GFLOP "
              "per token" for size, s in ((size, SIZES[size]) for size in sizes)]
    head = [
        f"# bench_gpu: {', '.join(sizes)}, "
        f"{'CPU smoke run (not a result)' if args.tiny else env.get('gpu', 'no GPU')}",
        "", *models,
        f"- bf16 compute, fp32 master (compact cases: bf16 master, int8 moments); clip {args.clip}; AdamW {HPARAMS}",
        f"- steps: median of {args.steps} after {args.warmup} warm-up; setup (model build, JIT builds, pinning) "
        f"excluded from every figure",
        f"- machine: GPU {env.get('gpu')} ({f(env.get('gpu_memory_gib'))} GiB, sm_{env.get('sm')}), driver "
        f"{env.get('driver')}; torch {env.get('torch')}, CUDA {env.get('cuda')}, NCCL {env.get('nccl')}; "
        f"CPU {env.get('cpu_model')}, {env.get('cpus_usable')}/{env.get('cpus')} cores usable, "
        f"{env.get('threads_used')} threads used; RAM {f(env.get('ram_gib'))} GiB; disk free "
        f"{f(env.get('disk_free_gib'))} GiB",
        f"- peers: deepspeed {env.get('deepspeed')}, torchao {env.get('torchao')}; zerotier {env.get('zerotier')} "
        f"({env.get('zerotier_commit')}), native {env.get('zerotier_native')}, "
        f"bench rates {'measured' if env.get('zerotier_rates') else 'none (plan uses default rates)'}",
        f"- bf16 matmul peak (this run): {f(env.get('matmul_peak_tflops'))} TFLOPS; TFLOPS = the Megatron formula's "
        "FLOPs per token (6 x matmul params + attention; no recompute) x tokens / step; MFU = TFLOPS / peak",
        "",
        "| case | status | setup s | step ms | tokens/s | TFLOPS | MFU % | x torch | x DS-Offload | zt overlap % per link "
        "| torch.prof H2D/D2H overlap % | GPU busy % | host syncs/step | peak dev alloc/resv GiB | peak RSS GiB "
        "| pinned GiB | NVMe GB on disk (swap GB/s) | plan need dev/host/nvme GB | loss@K | max abs dloss |",
        "|" + "---|" * 20,
    ]
    rows = []
    for r in results:
        if r.get("status") != "ok":
            rows.append(f"| {r['label']} | {r.get('status')} ({r.get('reason', '')}) |" + " - |" * 18)
            continue
        links = ", ".join(f"{LINK.get(k, k)} {v:.0f}" for k, v in (r.get("zt_link_overlap_pct") or {}).items()) or "-"
        tp = r.get("torch_profiler") or {}
        plan = r.get("plan") or {}
        need = plan.get("need")
        pinned = r.get("zt_pinned_peak") if r.get("zt_pinned_peak") is not None else r.get("torch_pinned_peak")
        io = r.get("nvme_GBps")
        nvme_io = f" (w {io['written']:.1f} / r {io['read']:.1f} GB/s)" if io else ""
        rows.append(
            f"| {r['label']} | ok | {setup_text(r)} | {r['step_s'] * 1e3:.1f} | {r['tokens_per_s']:,.0f} | {r['tflops']:.3g} "
            f"| {f(r.get('mfu_pct'), '{:.3g}')} | {f(r.get('x_torch'), '{:.2f}')} | {f(r.get('x_ds-z2-offload'), '{:.2f}')} "
            f"| {links} | {f(tp.get('h2d_pct'), '{:.0f}')}/{f(tp.get('d2h_pct'), '{:.0f}')} "
            f"| {f(tp.get('gpu_busy_pct'), '{:.0f}')} | {f(r.get('host_syncs_per_step'), '{:.0f}')} "
            f"| {f(r.get('peak_device_allocated'), '{:.1f}', GiB)}/{f(r.get('peak_device_reserved'), '{:.1f}', GiB)} "
            f"| {f(r.get('peak_rss'), '{:.1f}', GiB)} | {f(pinned, '{:.1f}', GiB)} | {f(r.get('nvme_bytes'), '{:.1f}', 1e9)}"
            f"{nvme_io} "
            f"| {'/'.join(f'{need[t] / 1e9:.1f}' for t in ('device', 'host', 'nvme')) if need else '-'} "
            f"| {r['losses'][-1]:.4f} | {f(r.get('max_abs_dloss'), '{:.4f}')} |")
    notes = ["", "x torch / x DS-Offload: step time over that case's (lower is faster). "
             "max abs dloss: against the first of torch, ds-z2-offload that ran (bf16: within 2e-2 expected)."]
    return "\n".join(head + rows + notes + predicted_table(results) + step_on_table(results)) + "\n"


def setup_text(r: dict) -> str:
    """Set-up seconds; zerotier's: (initialize, of which drawing the initial weights)."""
    split = r.get("setup_split_s")
    return f"{r['setup_s']:.1f}" + (f" (init {split['initialize']:.1f}, weights {split['of which drawing weights']:.1f})"
                                    if split else "")


def predicted_table(results: list[dict]) -> list[str]:
    """zerotier's cases: predict_table.py's prediction (committed node rates, this machine's budgets)
    beside the measured figure. Targets: step within 10 %, peak host RSS within 5 %."""
    def pair(pred, meas, scale=1.0, fmt="{:.2f}"):
        show = lambda v: "-" if v is None else fmt.format(v / scale)  # noqa: E731
        ratio = f" ({pred / meas:.2f}x)" if pred and meas else ""
        return f"{show(pred)} / {show(meas)}{ratio}"

    lines = ["", "## Predicted / measured (zerotier; predict_table.py with the committed node rates)", "",
             "| case | node rates | placement | step s | TFLOPS | peak host RSS GiB | pinned (pool) GiB "
             "| device peak GiB | NVMe GB/step | plan bound by |", "|" + "---|" * 10]
    for r in results:
        p = r.get("predicted")
        if r.get("status") != "ok" or not p or not p.get("fits"):
            continue
        traffic = r.get("nvme_traffic")
        place = "/".join(p["placement"].values()) + (" (split)" if p.get("optimizer_split") else "")
        ran = (r.get("plan") or {}).get("placement")
        if ran and ran != p["placement"]:  # `auto` kinds: the engine plans without compute, so it may differ
            place += f" (ran {'/'.join(ran.values())})"
        lines.append(
            f"| {r['label']} | {p.get('node')} | {place} | {pair(p['predicted_step_s'], r['step_s'])} "
            f"| {pair(p['tflops'], r['tflops'], fmt='{:.0f}')} | {pair(p['peak_rss'], r['peak_rss'], GiB, '{:.1f}')} "
            f"| {pair(p['pinned'], r.get('zt_pool_peak'), GiB, '{:.1f}')} "
            f"| {pair(p['device_peak'], r.get('peak_device_allocated'), GiB, '{:.1f}')} "
            f"| {pair(p['nvme_bytes_per_step'], sum(traffic.values()) if traffic else None, 1e9, '{:.1f}')} "
            f"| {p['bound_by']} |")
    return lines if len(lines) > 5 else []


def step_on_table(results: list[dict]) -> list[str]:
    """zerotier's cases (issue 34): optimizer.step_on, where the plan put each unit's update, the
    optimizer's exposed time per step (target: at most 20 % of the step with `auto` at 7B) and the
    bytes that crossed PCIe per step."""
    lines = ["", "## Where the update runs (zerotier; optimizer.step_on)", "",
             "| case | step_on | units updated on cpu / device | step ms | optimizer exposed ms (% of step) "
             "| PCIe GB/step H2D / D2H |", "|" + "---|" * 6]
    for r in results:
        if r.get("status") != "ok" or "zt_optimizer_exposed_s" not in r:
            continue
        on, pcie, exposed = r.get("zt_step_on") or {}, r["zt_pcie_bytes_per_step"], r["zt_optimizer_exposed_s"]
        lines.append(
            f"| {r['label']} | {CASES[r['case']][1].get('step_on', 'auto')} | {on.get('cpu', 0)} / {on.get('device', 0)} "
            f"| {r['step_s'] * 1e3:.1f} | {exposed * 1e3:.1f} ({100 * exposed / r['step_s']:.0f} %) "
            f"| {pcie['h2d'] / 1e9:.2f} / {pcie['d2h'] / 1e9:.2f} |")
    return lines if len(lines) > 5 else []


def write(results, env, args) -> str:
    text = table(results, env, args)
    if args.out:
        with open(os.path.join(args.out, "bench_gpu.md"), "w") as f:
            f.write(text)
        with open(os.path.join(args.out, "bench_gpu.json"), "w") as f:
            json.dump({"env": env, "settings": {k: v for k, v in vars(args).items() if k not in ("case_nvme",)},
                       "sizes": {size: dict(SIZES[size], numel=gm.param_count(size))
                                 for size in dict.fromkeys(size for _, size, _ in args.runs)},
                       "cases": results}, f, indent=1)
    return text
