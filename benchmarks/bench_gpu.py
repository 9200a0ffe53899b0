"""zerotier against its peers on one GPU: a Llama-style bf16 model, step time, TFLOPS, MFU, overlap,
and zerotier's prediction beside every measured figure.

    python benchmarks/bench_gpu.py --out OUT                      # every case at 1.3B (CUDA)
    python benchmarks/bench_gpu.py --size 7b --cases zt-opt-host,zt-opt-host-early,ds-z2-offload,torchao-offload-grads
    python benchmarks/bench_gpu.py --size 20b --cases zt-compact-auto
    python benchmarks/bench_gpu.py --tiny --out OUT               # CPU smoke run: tiny model, zerotier only

Issues 14 and 36 (docs/benchmarks.md). Sizes (gpu_model.py, which says which shapes): `1.3b`
fits all on one 80 GB GPU (plain torch is the reference), `2.7b` the largest whose NVMe cases
fit a 64 GiB drive, `7b` / `13b` (Llama-2's shapes), `20b` and `30b` (LLaMA-33B's) do not fit
the GPU with their optimizer state. The workload, the same tokens per step in every case of a
size, and why: [Note: the workload] in gpu_model.py. The cases and the order they run in under
`--time-limit`: gpu_case_list.py; how each builds its model (zerotier from the meta device, unit
by unit; DeepSpeed stage 3 under deepspeed.zero.Init; all from the same per-name seeded weights):
gpu_cases.py. A peer that is not importable gives the row "n/a (not installed)"; a case that
cannot fit says so with the bytes it would need on each tier (zerotier: its plan, before any
byte is placed; peers: their byte counts in gpu_cases.peer_needs).

Every case runs in its own process with its own time limit (a stuck peer cannot eat the
run): `--warmup` untimed steps, then `--steps` timed ones (wall clock, device synchronized
after each), then on CUDA (unless --no-profile) two steps under torch.profiler and one with the
CUDA sync debug mode on (both untimed). Setup (model build, DeepSpeed's JIT op builds, pinning)
is timed apart and kept out of every figure. Same model, init, data, seed, hyperparameters,
clipping, accumulation and CPU threads in every case: bf16 compute, fp32 master weights (the
compact cases: bf16 master, int8 moments).

Figures per case: median step time, tokens/s, TFLOPS by the Megatron formula (gpu_model.
model_flops_per_token: 6 x matmul parameters + attention, per token) and MFU against the bf16
matmul peak measured in the same run; the ratio of the step time to plain torch and to
DeepSpeed ZeRO-Offload (stage 2) of the same size; zerotier's own overlap per link (its
profiler: the share of each link's transfer time hidden under compute) and, on CUDA,
torch.profiler's: the share of HtoD / DtoH memcpy time concurrent with a kernel, and the
GPU's kernel-busy share; host syncs per step; peak device memory (allocated / reserved), peak
RSS, pinned host bytes, NVMe bytes on disk; zerotier's plan need per tier; the loss after the
last step and the largest |loss - reference loss| over the steps; for zerotier's cases (issue 34),
where the plan put each unit's update (optimizer.step_on), the optimizer's exposed time and the
bytes that crossed PCIe each way, per timed step (gpu_table.py: the derived figures and the tables). For zerotier's cases a
second table sets predict_table.py's prediction (the committed node rates of this GPU,
this machine's budgets) beside the measured step, TFLOPS, peak RSS, pinned pool, device peak
and NVMe bytes per step.
`--out DIR` writes DIR/bench_gpu.json, DIR/bench_gpu.md and DIR/cases.log (each case's
output), rewritten after every case, so a run stopped half-way keeps what it measured.
On a CPU (`--tiny`) this is a smoke test of the script, never a result.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import importlib.util
import json
import math
import os
import platform
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import gpu_model as gm  # noqa: E402 - benchmarks/ is on sys.path when this runs as a script
from gpu_case_list import CASES  # noqa: E402
from gpu_cases import PEER_MODULE, NotApplicable, setup  # noqa: E402
from gpu_table import derive, write  # noqa: E402

PROFILED_STEPS = 2   # CUDA: steps under torch.profiler, after the timed ones
GiB = 1 << 30
SIZES = gm.SIZES


def run_case(case: str, args) -> dict:
    import torch
    torch.set_num_threads(args.threads)
    device = torch.device("cuda", 0) if torch.cuda.is_available() and not args.tiny else torch.device("cpu")
    cuda = device.type == "cuda"
    out = {"case": case, "size": args.size, "device": str(device)}
    profiled = cuda and args.profile
    data = gm.batches(args.size, args.warmup + args.steps + (PROFILED_STEPS + 1 if profiled else 0), args.accum)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t0 = time.perf_counter()
    step, close, engine = setup(case, args, device, out)
    out["setup_s"] = time.perf_counter() - t0

    store = engine.store if engine is not None else None
    losses, times = [], []
    for i, micro in enumerate(data[:args.warmup + args.steps]):
        if i == args.warmup and store is not None:
            io_before = store.stats()
        t0 = time.perf_counter()
        loss = step(micro)
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))   # after the clock stopped: .item() would sync it
    out.update(step_s=statistics.median(times[args.warmup:]), step_times_s=times, losses=losses)
    if store is not None:  # zerotier's swap traffic per timed step, and its rate over the timed steps
        io_after, timed_s = store.stats(), sum(times[args.warmup:])
        moved = {"written": io_after["bytes_in"] - io_before["bytes_in"],
                 "read": io_after["bytes_out"] - io_before["bytes_out"]}
        out["nvme_traffic"] = {k: v / args.steps for k, v in moved.items()}
        out["nvme_GBps"] = {k: v / timed_s / 1e9 for k, v in moved.items()}
    if not all(math.isfinite(v) for v in losses):
        raise RuntimeError(f"non-finite loss: {losses}")
    if engine is not None:  # before any untimed step: the trace's last steps are the timed ones
        out.update(_optimizer_exposure(engine.profiler.trace(), args.steps))
        out["zt_step_on"] = dict(collections.Counter(engine.plan.optimizer_step_on))

    if profiled:  # untimed: torch.profiler's view of the copies, then the host syncs of one step
        out["torch_profiler"] = _torch_profiler(step, data[args.warmup + args.steps:][:PROFILED_STEPS], sync)
        out["host_syncs_per_step"] = _count_syncs(step, data[-1], sync)
    if cuda:
        out["peak_device_allocated"] = torch.cuda.max_memory_allocated(device)
        out["peak_device_reserved"] = torch.cuda.max_memory_reserved(device)
        with contextlib.suppress(Exception):  # torch's pinned (caching host) allocator
            stats = torch.cuda.host_memory_stats()
            out["torch_pinned_peak"] = stats.get("allocated_bytes.all.peak", stats.get("allocated_bytes.peak"))
    if engine is not None:
        report = engine.report()
        out["zt_overlap_pct"] = report.overlap_pct
        out["zt_link_overlap_pct"] = _link_overlap(engine.profiler.trace())
        out["zt_verdict"] = report.verdict
        out["zt_links"] = [{"link": k.link, "bytes": k.bytes, "GBps": k.gbps, "pct_of_peak": k.pct_of_peak}
                           for k in report.links]   # achieved bandwidth per link vs `zerotier bench`
        pool = engine.host_pool.stats()
        out["zt_pool_peak"] = pool["peak"]
        out["zt_pinned_peak"] = pool["peak"] if pool["pinned"] else 0
    out["nvme_bytes"] = _disk_bytes(args.nvme_path)
    close()
    out["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out["status"] = "ok"
    return out


def _link_overlap(trace: dict) -> dict[str, float]:
    """Per link (src->dst), the share of its transfer time hidden under compute on another
    thread: the summary's own rule ([Note: verdict] in zerotier/profiler/verdict.py), split by link."""
    from zerotier.profiler import intervals
    from zerotier.profiler.spans import busy_time
    from zerotier.profiler.trace import read_trace
    data = read_trace(trace)
    _, hidden_under = busy_time(data)
    total, hidden = defaultdict(float), defaultdict(float)
    for t in data.transfers:
        link = f"{t['src']}->{t['dst']}"
        total[link] += t["dur"]
        hidden[link] += intervals.overlap(t["ts"], t["ts"] + t["dur"], hidden_under(t["stream"]))
    return {link: 100.0 * hidden[link] / d for link, d in sorted(total.items()) if d > 0}


def _optimizer_exposure(trace: dict, steps: int) -> dict:
    """Per timed step (the trace's last `steps`), issue 34's figures: the optimizer's exposed time (its
    CPU and device updates and its state's transfers while no forward or backward ran: what the step
    waits for) and the bytes that crossed PCIe each way (every host <-> device transfer)."""
    from zerotier.profiler import intervals
    from zerotier.profiler.spans import step_times
    from zerotier.profiler.trace import read_trace
    data, timed = read_trace(trace), step_times(trace)[-steps:]
    start_us = data.meta["window_us"][0]
    a, b = start_us + 1e6 * timed[0].start_s, start_us + 1e6 * (timed[-1].start_s + timed[-1].wall_s)
    model = intervals.union((s, e) for s, e, kind, *_ in data.computes if kind in ("forward", "backward"))
    optimizer = intervals.union([(s, e) for s, e, kind, *_ in data.computes if kind in ("optimizer", "device-optimizer")]
                                + [(t["ts"], t["ts"] + t["dur"]) for t in data.transfers
                                   if t["reason"].startswith("optimizer")])
    pcie = {"h2d": 0, "d2h": 0}
    for t in data.transfers:
        if a <= t["ts"] < b and {t["src"], t["dst"]} == {"host", "device"}:
            pcie["h2d" if t["dst"] == "device" else "d2h"] += t["bytes"]
    return {"zt_optimizer_exposed_s": intervals.overlap(a, b, intervals.subtract(optimizer, model)) / 1e6 / len(timed),
            "zt_pcie_bytes_per_step": {k: v / len(timed) for k, v in pcie.items()}}


def memcpy_overlap(trace: dict) -> dict:
    """From a torch.profiler (Kineto) chrome trace: the share of HtoD and DtoH memcpy time during
    which a kernel ran, and the share of the window the GPU ran kernels."""
    from zerotier.profiler import intervals
    kernels, copies = [], {"h2d": [], "d2h": []}
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or "dur" not in e:
            continue
        span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        if e.get("cat") == "kernel":
            kernels.append(span)
        elif e.get("cat") == "gpu_memcpy":
            name = e.get("name", "")
            key = "h2d" if "HtoD" in name else "d2h" if "DtoH" in name else None
            if key:
                copies[key].append(span)
    busy = intervals.union(kernels)
    out = {}
    for key, spans in copies.items():
        dur = sum(e - s for s, e in spans)
        out[f"{key}_pct"] = 100.0 * sum(intervals.overlap(s, e, busy) for s, e in spans) / dur if dur else None
        out[f"{key}_bytes_events"] = len(spans)
    everything = kernels + copies["h2d"] + copies["d2h"]
    if everything:
        window = max(e for _, e in everything) - min(s for s, _ in everything)
        out["gpu_busy_pct"] = 100.0 * intervals.length(busy) / window if window > 0 else None
    return out


def _torch_profiler(step, data, sync) -> dict:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for micro in data:
            step(micro)
            sync()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return memcpy_overlap(json.load(f))


def _count_syncs(step, micro, sync) -> int:
    """Host syncs in one step as the CUDA sync debug mode sees them (the calls torch instruments:
    .item(), nonzero, blocking copies to the host...), from every thread of the process."""
    import torch
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step(micro)
            sync()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def _disk_bytes(path: str) -> int:
    total = 0
    for d, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(d, f)).st_blocks * 512
    return total


def environment(args) -> dict:
    """Machine, versions and the bf16 matmul peak, measured in its own process like a case."""
    import torch
    cuda = torch.cuda.is_available() and not args.tiny
    env = {"host": socket.gethostname(), "python": platform.python_version(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "cpu_model": _cpu_model(), "cpus": os.cpu_count(),
           "cpus_usable": len(os.sched_getaffinity(0)), "threads_used": args.threads,
           "ram_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB,
           "disk_free_gib": shutil.disk_usage(args.nvme_path).free / GiB}
    for name in ("deepspeed", "torchao", "transformers", "zerotier"):
        try:
            from importlib.metadata import version
            env[name] = version(name)
        except Exception:  # noqa: BLE001 - not installed
            env[name] = None
    with contextlib.suppress(Exception):
        env["zerotier_commit"] = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                                                capture_output=True, text=True, timeout=10).stdout.strip() or None
    with contextlib.suppress(Exception):
        from zerotier import _native
        env["zerotier_native"] = _native.status()
    with contextlib.suppress(Exception):
        from zerotier.bench import load_rates
        env["zerotier_rates"] = load_rates()
    if cuda:
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, gpu_memory_gib=p.total_memory / GiB, sm=f"{p.major}{p.minor}")
        with contextlib.suppress(Exception):
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        with contextlib.suppress(Exception):
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=30).stdout.strip()
    env["matmul_peak_tflops"] = _matmul_peak(torch.device("cuda" if cuda else "cpu"))
    return env


def _cpu_model() -> str | None:
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return platform.processor() or None


def _matmul_peak(device) -> float:
    """bf16 matmul TFLOPS: the best of 10 timed products after 3 warm-ups (8192^3 on CUDA)."""
    import torch
    n = 8192 if device.type == "cuda" else 256
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    best = float("inf")
    for i in range(13):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            a @ b
            end.record()
            end.synchronize()
            t = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            a @ b
            t = time.perf_counter() - t0
        if i >= 3:
            best = min(best, t)
    return 2 * n ** 3 / best / 1e12


def _die_with_parent() -> None:
    """[Note: case processes]: a case runs in its own session, out of reach of the signals
    gpu_run.sh's step limit sends to the parent's group; the parent kills it when it stops, and
    this makes the kernel kill it too if the parent is killed outright (SIGKILL after the limit)."""
    import ctypes
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the parent died before prctl
        os._exit(1)


def child(args) -> None:
    """--child CASE: run one case (or `env`) and write its result to --result, whatever happens."""
    _die_with_parent()
    try:
        result = environment(args) if args.child == "env" else run_case(args.child, args)
    except NotApplicable as exc:
        result = {"case": args.child, "status": "n/a", "reason": str(exc)}
    except Exception as exc:  # noqa: BLE001 - the row says what failed; the log has the traceback
        import traceback
        traceback.print_exc()
        oom = "out of memory" in str(exc).lower() or type(exc).__name__ == "OutOfMemoryError"
        result = {"case": args.child, "status": "n/a" if oom else "failed",
                  "reason": f"{'OOM: ' if oom else ''}{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
                  if str(exc).strip() else type(exc).__name__}
    with open(args.result, "w") as f:
        json.dump(result, f)


# ---------------------------------------------------------------------------------------------
# The parent: one process per case, under time limits; the table


def spawn(name: str, size: str, args, limit: float, log) -> dict:
    """Run `--child name` in its own session (so its own children, e.g. ninja, go with it) and
    wait at most `limit` s; the result file is the only channel back ([Note: case processes])."""
    fd, result = tempfile.mkstemp(prefix="bench_gpu.", suffix=".json")
    os.close(fd)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--result", result,
           "--size", size, "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--accum", str(args.accum), "--clip", str(args.clip), "--threads", str(args.threads),
           "--nvme-path", args.case_nvme] + (["--tiny"] if args.tiny else []) + ([] if args.profile else ["--no-profile"])
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONUNBUFFERED="1")
    if CASES.get(name, ("",))[0] == "deepspeed":  # a one-rank process group without a launcher
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                   LOCAL_WORLD_SIZE="1")
    log.write(f"\n===== {name} (limit {limit:.0f} s): {' '.join(cmd)}\n")
    log.flush()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    t0 = time.perf_counter()
    try:
        proc.wait(timeout=limit)
        with open(result) as f:
            text = f.read()
        res = json.loads(text) if text else {"case": name, "status": "failed",
                                             "reason": f"exit code {proc.returncode}, no result (see cases.log)"}
    except subprocess.TimeoutExpired:
        res = {"case": name, "status": "failed", "reason": f"timed out after {limit:.0f} s"}
    finally:  # a timeout, an interrupt: the case's whole session goes
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        os.unlink(result)
    res["wall_s"] = time.perf_counter() - t0
    return res


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", help="comma-separated case names (default: every case; --tiny: torch and zerotier's)")
    ap.add_argument("--size", choices=sorted(SIZES), help="model size for every case (default 1.3b; --tiny: tiny)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per case (default 10)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps before them (default 3)")
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step (default 1)")
    ap.add_argument("--clip", type=lambda v: None if v.lower() in ("none", "0") else float(v), default=None,
                    help="gradient clipping max norm, or none (default none: train.overlap = 'early' needs none)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="CPU threads for every case: torch, OMP (DeepSpeed's CPU Adam), zerotier's optimizer")
    ap.add_argument("--out", help="directory for bench_gpu.json, bench_gpu.md and cases.log")
    ap.add_argument("--nvme-path", help="directory for swap files (default: a temp dir in the repo root, on disk)")
    ap.add_argument("--case-timeout", type=float, default=300.0, help="seconds per case (default 300)")
    ap.add_argument("--time-limit", type=float, help="seconds for the whole run: cases that would start "
                    "too late are reported as not run")
    ap.add_argument("--min-case-seconds", type=float, default=30.0,
                    help="under --time-limit, a case starts only with this much time left (default 30)")
    ap.add_argument("--no-profile", dest="profile", action="store_false",
                    help="skip the untimed torch.profiler and sync-count steps (CUDA): gpu_run.sh scale's budget")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny model, zerotier and torch only")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.size = args.size or ("tiny" if args.tiny else "1.3b")
    args.runs = runs(args)
    return args


def runs(args) -> list[tuple[str, str, str]]:
    """(label, size, case) per item of --cases: CASE runs at --size, SIZE:CASE at SIZE (a list across
    sizes: gpu_run.sh scale's priority list, one table). --tiny runs every item at the tiny size."""
    items = args.cases.split(",") if args.cases else [
        c for c, (fw, _) in CASES.items() if not args.tiny or fw in ("torch", "zerotier")]
    out = []
    for item in items:
        size, _, case = item.rpartition(":")
        size = size or args.size
        if case not in CASES or size not in SIZES:
            raise SystemExit(f"unknown case {item!r}: [SIZE:]CASE with SIZE one of {', '.join(SIZES)} and "
                             f"CASE one of {', '.join(CASES)}")
        out.append((item, "tiny" if args.tiny else size, case))
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        child(args)
        return 0
    start = time.perf_counter()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    nvme_root = tempfile.mkdtemp(prefix=".bench_gpu_nvme.", dir=args.nvme_path or ROOT)
    results: list[dict] = []
    env: dict = {}
    current = "env"  # the process running when an interrupt came
    log_path = os.path.join(args.out, "cases.log") if args.out else os.devnull
    try:
        with open(log_path, "w") as log:
            def left() -> float:
                return float("inf") if args.time_limit is None else args.time_limit - (time.perf_counter() - start)

            args.case_nvme = nvme_root
            env = spawn("env", "tiny", args, min(120.0, left()), log)
            print(f"env: {env.get('gpu', 'no GPU')}, torch {env.get('torch')}, "
                  f"bf16 matmul peak {env.get('matmul_peak_tflops') or 0:.1f} TFLOPS", flush=True)
            for label, size, name in args.runs:
                current = label
                framework = CASES[name][0]
                if framework in PEER_MODULE and args.tiny:
                    res = {"case": name, "status": "n/a", "reason": "--tiny runs zerotier and torch only"}
                elif framework in PEER_MODULE and importlib.util.find_spec(PEER_MODULE[framework]) is None:
                    res = {"case": name, "status": "n/a", "reason": "not installed"}
                elif min(args.case_timeout, left() - 5) < args.min_case_seconds:
                    res = {"case": name, "status": "not run", "reason": "--time-limit reached"}
                else:
                    args.case_nvme = tempfile.mkdtemp(prefix=f"{name}.", dir=nvme_root)
                    res = spawn(name, size, args, min(args.case_timeout, left() - 5), log)
                    shutil.rmtree(args.case_nvme, ignore_errors=True)
                res.update(label=label, size=size)
                results.append(res)
                derive(results, env, args)
                write(results, env, args)
                print(f"  {label:26s} {res['status']:7s} " + (f"{res['step_s'] * 1e3:9.1f} ms/step"
                      if res["status"] == "ok" else res.get("reason", "")), flush=True)
    except KeyboardInterrupt:  # gpu_run.sh's step limit: keep what was measured
        results.append({"case": current, "label": current, "size": "-", "status": "not run",
                        "reason": "interrupted (SIGINT: the run's time limit)"})
        print(write(results, env, args))
        return 130
    finally:
        shutil.rmtree(nvme_root, ignore_errors=True)
    print()
    print(write(results, env, args))
    return 0 if all(r["status"] in ("ok", "n/a") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
