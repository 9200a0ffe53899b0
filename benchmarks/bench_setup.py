"""How long zerotier.initialize takes, phase by phase, beside this machine's bounds (issue 36 item 6).

    python benchmarks/bench_setup.py --quick                                  # CI-sized: a 30M model, 3 placements
    python benchmarks/bench_setup.py --size 1.3b --placement opt-host nvme compact-nvme --nvme-path DIR
    python benchmarks/bench_setup.py --size 350m --ahead 0 1                  # serial against materializing ahead

One process per run (a fresh RSS peak, a fresh host pool). Each run builds a Llama-shaped model
(benchmarks/gpu_model.py's shapes, plus the small ones below) on the meta device and times
`zerotier.initialize(model, config, init_fn=...)` with bench_gpu.py's config of the placement's case
(gpu_case_list.py) and bench_gpu's per-name seeded init ([Note: the same weights everywhere] in
gpu_model.py; drawn on the CPU here, on CUDA where there is one). Printed per phase ([Note:
initialize's phases] in zerotier/setup_times.py: the engine's own timers, on the thread that ran
each phase): seconds, elements, the bytes it moves (estimated per element, BYTES below) as GB/s,
and its bound measured in the same run:
  memory   torch copy_ read + write GB/s with all torch threads (zerotier bench's mem figure)
  touch    filling freshly allocated memory (page faults included): what the NaN fill and a
           fresh block's first write cost
  rng      torch's CPU normal_ in elements/s: serial (one generator, one thread)
  drive    zerotier's own sequential write rate on --nvme-path (fresh files, fsync), NVMe runs only
plus the NVMe bytes written, the host pool's peak, the process's peak RSS and the host pool's pinning
time (CUDA only).

Extrapolation (`--node FILE`, default benchmarks/nodes/h200.json: a 16-core GPU host's rates) to
that node's thread count and to every size of gpu_model.py, from the per-element times measured
here. What it assumes, phase by phase:
  fill, check, cast, optimizer, params, grads, rest   memory-bound: time x (memory here / the node's
           memory copy GB/s, measured with its threads); they scale with threads only as far as
           the memory bandwidth does. Optimistic where a phase writes fresh memory (the optimizer's
           state, the gradients, a block of a new size): here that runs at the first-touch rate
           (page faults), which is assumed to scale as the copy rate does (madvise(MADV_HUGEPAGE)
           made fresh blocks slower here: 0.2 against 0.9 GB/s, so the pool keeps 4 KiB pages)
  init     on the CPU: serial (torch's generator draws each tensor on one thread), the same time per
           element as here (the same per-core speed assumed); bench_gpu on the node draws on CUDA,
           so there it is the copy into the unit's block: 4 B per element over the node's D2H rate
  NVMe     drive-bound: the bytes written over the node's drive write rate; the writes are in
           flight while the next units are placed, so they overlap placement
  other    initialize outside placement (plan, pools, stores, hooks): per unit, not per element
           (x the target's units over the run's)
  pinning  not measured without CUDA: the bytes the node's pool would pin are printed, at
           --pin-GBps when given (cudaHostRegister's rate)
and the set-up = other + max(worker, caller, NVMe, memory) with materializing ahead ([Note:
materializing ahead] in zerotier/materialize.py: fill, init and check on the worker; memory: both
threads' memory-bound phases share the node's bandwidth), other + worker + max(caller, NVMe) serially. Never a result on this shared 2-core machine: run it alone.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import gpu_model as gm  # noqa: E402
from gpu_case_list import zerotier_config  # noqa: E402

# small Llama shapes beside gpu_model's (head dim 64, ffn 8/3 dim rounded up to 256)
SMALL = {
    "30m": dict(vocab=8000, dim=512, layers=4, heads=8, ffn=1536, seq=256, batch=1, ckpt=False),
    "125m": dict(vocab=gm.VOCAB, dim=768, layers=12, heads=12, ffn=2048, seq=2048, batch=1, ckpt=False),
    "350m": dict(vocab=gm.VOCAB, dim=1024, layers=24, heads=16, ffn=2816, seq=2048, batch=1, ckpt=False),
    # 0.94B: the largest whose optimizer-on-host cases fit a 24 GiB machine (18 B per parameter on the host)
    "1b": dict(vocab=gm.VOCAB, dim=2048, layers=16, heads=16, ffn=5504, seq=2048, batch=1, ckpt=False),
}
SHAPES = {**SMALL, **gm.SIZES}
PLACEMENTS = {"opt-host": "zt-opt-host", "nvme": "zt-params-nvme", "compact-nvme": "zt-compact-nvme",
              "compact-host": "zt-compact-host", "compact-auto": "zt-compact-auto"}
WORKER = ("fill", "init", "check")  # [Note: materializing ahead]: on the worker thread when ahead
CALLER = ("cast", "optimizer", "params", "grads", "rest", "nvme drain")
# bytes read + written per element, by phase (estimates; lp = the parameters' dtype, state = the
# optimizer layout's bytes per parameter, acc = the gradient accumulator's)
BYTES = {"fill": lambda lp, state, acc: 4, "init": lambda lp, state, acc: 12, "check": lambda lp, state, acc: 4,
         "cast": lambda lp, state, acc: 4 + lp, "optimizer": lambda lp, state, acc: 4 + state,
         "params": lambda lp, state, acc: 2 * lp, "grads": lambda lp, state, acc: acc}
GiB = 1 << 30


def param_count(shape: dict) -> int:
    d, f, v = shape["dim"], shape["ffn"], shape["vocab"]
    return shape["layers"] * (4 * d * d + 3 * d * f + 2 * d) + 2 * v * d + d


def bounds(nvme_path: str | None, quick: bool) -> dict:
    """This machine's bounds, measured now with the run's thread count."""
    import torch

    from zerotier.io import aligned_empty
    from zerotier.measure import bench_io, bench_memory
    nbytes = (64 if quick else 512) << 20
    out = {"threads": torch.get_num_threads(), "memory_GBps": bench_memory(nbytes, repeat=3)["copy_GBps"]}
    best = float("inf")
    for _ in range(3):  # fresh memory each time: the page faults are the point
        t0 = time.perf_counter()
        aligned_empty(nbytes, 4096).view(torch.float32).fill_(float("nan"))
        best = min(best, time.perf_counter() - t0)
    out["touch_GBps"] = nbytes / best / 1e9
    x = torch.empty(nbytes // 8, dtype=torch.float32)
    t0 = time.perf_counter()
    x.normal_(0.0, 0.02)
    out["rng_Gelem_s"] = x.numel() / (time.perf_counter() - t0) / 1e9
    if nvme_path is not None:
        out["drive_write_GBps"] = bench_io(nvme_path, nbytes, repeat=1)["write_GBps"]
    return out


def one_run(size: str, placement: str, ahead: int, nvme_path: str, threads: int) -> dict:
    """initialize once (in this process) and its figures."""
    import torch

    import zerotier
    import zerotier.materialize as materialize
    import zerotier.state
    from zerotier.measure import PeakRSS
    torch.set_num_threads(threads)
    materialize.AHEAD = ahead
    shape = SHAPES[size]
    with torch.device("meta"):
        model = gm.Llama(shape)
    gen = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = zerotier_config(PLACEMENTS[placement], nvme_path, threads, None, 1, device)
    cfg["profile"] = {"enabled": False}
    with PeakRSS() as rss:
        t0 = time.perf_counter()
        engine = zerotier.initialize(model, cfg, init_fn=gm.zerotier_init_fn(model, gen))
        wall = time.perf_counter() - t0
    pool = engine.host_pool.stats()
    plan = engine.plan
    out = {"size": size, "placement": placement, "ahead": ahead, "threads": threads, "numel": param_count(shape),
           "units": len(engine.param_units), "initialize_s": wall, "phases": engine._placement.times.summary(),
           "lp_bytes": engine.lp_dtype.itemsize, "state_bytes_per_param": plan.state_layout.bytes_per_param,
           "acc_bytes": zerotier.state.DTYPES[engine.cfg.precision.accumulator_dtype].itemsize,
           "nvme_written": engine.store.stats()["bytes_in"] if engine.store is not None else 0,
           "host_pool_peak": pool["peak"], "materialize_bound": plan.needs.get("materialization", {}).get("host", 0),
           "pin_s": pool["pin_ns"] / 1e9, "pinned_bytes": pool["pinned_bytes"], "peak_rss_growth": rss.growth}
    engine.close(restore_weights=False)
    return out


def main_thread_s(run: dict) -> float:
    phases = run["phases"]
    mine = CALLER + ("wait",) + (() if run["ahead"] else WORKER)
    return sum(phases[p]["seconds"] for p in mine)


def extrapolate(run: dict, here: dict, node: dict, sizes) -> dict:
    """[module docstring] The run's per-element times on the node, at every size in `sizes`."""
    phases, numel = run["phases"], run["numel"]
    mem_scale = here["memory_GBps"] / node["mem"]["copy_GBps"]
    other = max(0.0, run["initialize_s"] - main_thread_s(run))
    per_elem = {p: phases[p]["seconds"] / numel * (1.0 if p == "init" else mem_scale)
                for p in WORKER + CALLER}
    out = {"node_threads": node["mem"].get("threads"), "memory_scale": mem_scale, "other_s": other, "sizes": {}}
    per_unit = other / run["units"]
    drive = node.get("io", {}).get("write_GBps")
    d2h = node.get("pcie", {}).get("d2h_pinned_GBps")
    for size in sizes:
        n = param_count(SHAPES[size])
        t = {p: per_elem[p] * n for p in per_elem}
        if d2h:  # bench_gpu draws on CUDA: the draw is the copy into the unit's block
            t["init"] = 4 * n / (d2h * 1e9)
        worker = sum(t[p] for p in WORKER)
        caller = sum(t[p] for p in CALLER)
        memory = sum(t[p] for p in WORKER + CALLER if p != "init")  # one memory bus for both threads
        nvme = run["nvme_written"] / numel * n / (drive * 1e9) if drive and run["nvme_written"] else 0.0
        rest = per_unit * (SHAPES[size]["layers"] + 1)  # wrap "auto": a unit per layer + the root
        out["sizes"][size] = {"phases_s": t, "nvme_s": nvme, "other_s": rest,
                              "ahead_s": rest + max(worker, caller, nvme, memory),
                              "serial_s": rest + worker + max(caller, nvme),
                              "pinned_bytes": run["pinned_bytes"] / numel * n if run["pinned_bytes"] else None}
    return out


def report(run: dict, here: dict) -> str:
    lp, state, acc = run["lp_bytes"], run["state_bytes_per_param"], run["acc_bytes"]
    lines = [f"{run['size']} ({run['numel'] / 1e9:.2f}B params, {run['units']} units), {run['placement']}, "
             f"ahead={run['ahead']}, {run['threads']} threads: initialize {run['initialize_s']:.2f} s "
             f"(the caller's thread {main_thread_s(run):.2f} s)",
             f"  {'phase':<11} {'s':>8} {'Melem':>9} {'GB/s':>8}  bound"]
    for name, ph in run["phases"].items():
        if not ph["seconds"]:
            continue
        gbps = BYTES[name](lp, state, acc) * ph["numel"] / ph["seconds"] / 1e9 \
            if name in BYTES and ph["numel"] and ph["seconds"] > 0.01 else None
        bound = {"fill": f"touch {here['touch_GBps']:.1f} GB/s", "init": f"rng {here['rng_Gelem_s']:.2f} Gelem/s "
                 f"(this phase: {ph['numel'] / ph['seconds'] / 1e9:.2f})"}.get(name, f"memory {here['memory_GBps']:.1f} GB/s")
        if name in ("optimizer", "params") and run["nvme_written"]:  # it waits for its oldest writes in flight
            bound = f"drive {here.get('drive_write_GBps', float('nan')):.2f} GB/s (NVMe writes in flight)"
        if name in ("wait", "nvme drain", "rest"):
            bound = "drive" if name == "nvme drain" else ""
        lines.append(f"  {name:<11} {ph['seconds']:>8.2f} {ph['numel'] / 1e6:>9.1f} "
                     f"{'' if gbps is None else f'{gbps:.1f}':>8}  {bound}")
    if run["nvme_written"]:
        lines.append(f"  NVMe: {run['nvme_written'] / 1e9:.2f} GB written, {run['nvme_written'] / run['initialize_s'] / 1e9:.2f}"
                     f" GB/s over initialize; drive {here.get('drive_write_GBps', float('nan')):.2f} GB/s")
    lines.append(f"  host pool peak {run['host_pool_peak'] / GiB:.2f} GiB (materialization's share planned: "
                 f"{run['materialize_bound'] / GiB:.3f} GiB), peak RSS growth "
                 f"{run['peak_rss_growth'] / GiB:.2f} GiB, pinned {run['pinned_bytes'] / GiB:.2f} GiB in {run['pin_s']:.2f} s")
    return "\n".join(lines)


def report_extrapolation(ext: dict, node_name: str, pin_gbps: float | None) -> str:
    lines = [f"  on {node_name} ({ext['node_threads']} threads; memory-bound phases x {ext['memory_scale']:.3f}, "
             f"init drawn on CUDA, other {ext['other_s']:.2f} s here, per unit there):"]
    for size, row in ext["sizes"].items():
        pin = ""
        if row["pinned_bytes"]:
            pin = f", + pinning {row['pinned_bytes'] / GiB:.0f} GiB" + \
                (f" = {row['pinned_bytes'] / pin_gbps / 1e9:.0f} s" if pin_gbps else " (rate unknown here)")
        lines.append(f"    {size:>5}: set-up {row['ahead_s']:7.1f} s ahead, {row['serial_s']:7.1f} s serial "
                     f"(NVMe {row['nvme_s']:.1f} s){pin}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", nargs="+", default=None, choices=list(SHAPES))
    ap.add_argument("--placement", nargs="+", default=None, choices=list(PLACEMENTS))
    ap.add_argument("--ahead", nargs="+", type=int, default=None,
                    help="units materialized ahead ([Note: materializing ahead]); 0 = serial. Default: the engine's")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all of this machine's)")
    ap.add_argument("--nvme-path", default=None, help="directory for the NVMe tier (default: a temp dir)")
    ap.add_argument("--node", default=os.path.join(ROOT, "benchmarks", "nodes", "h200.json"),
                    help="a zerotier bench file of the node to extrapolate to")
    ap.add_argument("--to", nargs="+", default=["7b", "20b", "30b"], choices=list(SHAPES),
                    help="sizes to extrapolate to")
    ap.add_argument("--pin-GBps", type=float, default=None, help="cudaHostRegister's rate on the node, if known")
    ap.add_argument("--quick", action="store_true", help="CI-sized: 30m, every placement but compact-host")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: one run, JSON to stdout
    args = ap.parse_args(argv)
    if args.one:
        size, placement, ahead, nvme, threads = json.loads(args.one)
        print(json.dumps(one_run(size, placement, ahead, nvme, threads)))
        return 0
    import torch

    from zerotier.materialize import AHEAD
    sizes = args.size or (["30m"] if args.quick else ["350m"])
    placements = args.placement or (["opt-host", "nvme", "compact-nvme"] if args.quick else list(PLACEMENTS))
    threads = args.threads or torch.get_num_threads()
    work = tempfile.mkdtemp(prefix="zt-setup-", dir=args.nvme_path)
    try:
        torch.set_num_threads(threads)
        here = bounds(work if any("nvme" in p for p in placements) else None, args.quick)
        print(f"this machine, {threads} threads: memory {here['memory_GBps']:.1f} GB/s, touch {here['touch_GBps']:.1f}"
              f" GB/s, rng {here['rng_Gelem_s']:.2f} Gelem/s" +
              (f", drive write {here['drive_write_GBps']:.2f} GB/s" if "drive_write_GBps" in here else ""))
        with open(args.node) as f:
            node_file = json.load(f)
        node_name, node = next(iter(node_file["hosts"].items()))
        runs = []
        for size in sizes:
            for placement in placements:
                for ahead in args.ahead or [AHEAD]:
                    one = json.dumps([size, placement, ahead, work, threads])
                    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", one],
                                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
                    if proc.returncode:
                        print(proc.stdout + proc.stderr, file=sys.stderr)
                        raise SystemExit(f"{size} {placement} ahead={ahead}: failed (above)")
                    run = json.loads(proc.stdout.strip().splitlines()[-1])
                    run["extrapolated"] = extrapolate(run, here, node, args.to)
                    runs.append(run)
                    print(report(run, here))
                    print(report_extrapolation(run["extrapolated"], node_name, args.pin_GBps))
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"here": here, "node": node_name, "runs": runs}, f, indent=1)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
