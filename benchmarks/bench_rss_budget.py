"""Where a run's RSS goes beyond the host pool (issue 23 item 5), phase by phase.

    python benchmarks/bench_rss_budget.py                          # dim 512, 2 and 8 layers (~1 min)
    python benchmarks/bench_rss_budget.py --dim 1024 --layers 4 16  # ~70M and ~0.27B parameters
    python benchmarks/bench_rss_budget.py --trim-phases            # malloc_trim(0) at each phase end
    python benchmarks/bench_rss_budget.py --child 512 4 NVME_DIR   # one run, JSON (what the parent spawns)

Each size runs in a fresh process. A TinyGPT is built on the meta device, parameters and
optimizer state on NVMe (gradients in their default home), `tiers.host` and `tiers.device`
as given; on a machine without CUDA the device tier is RAM too, so the budget the process
should keep to is host + device. After `import torch` the RSS is the base; at each phase
end (zerotier imported, meta build, initialize, then forward / backward / step of two
steps) the row records RSS over the base, the host pool's and the device tier's bytes
held, glibc's free-but-retained heap (mallinfo2: fordblks), and the bytes autograd saved
for backward (saved_tensors_hooks, one count per storage). A sampler thread records the
peak RSS inside each phase. With --trim-phases each phase ends with malloc_trim(0): the
RSS it gives back is allocator retention, not live memory.

The peak growth minus (host + device) is the part no budget covers; fitting it over two
model sizes splits it into a fixed part and a per-parameter part.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

from least_squares import fit  # benchmarks/ is on sys.path when this runs as a script

MiB = 1 << 20


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                  "fsmblks", "uordblks", "fordblks", "keepcost")]


def _libc():
    try:
        libc = ctypes.CDLL(None)
        libc.mallinfo2.restype = _Mallinfo2
        libc.malloc_trim.restype = ctypes.c_int
        return libc
    except (OSError, AttributeError):
        return None  # not glibc >= 2.33: heap figures are left out


class PhaseRSS:
    """Peak RSS per phase label, sampled every `interval` s by a thread."""

    def __init__(self, interval: float = 0.01):
        import psutil
        self.proc, self.interval = psutil.Process(), interval
        self.phase, self.peaks = "start", {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            rss, phase = self.proc.memory_info().rss, self.phase
            self.peaks[phase] = max(self.peaks.get(phase, 0), rss)
            self._stop.wait(self.interval)

    def start(self):
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def child(dim: int, layers: int, nvme_dir: str, host: str, device: str, trim_phases: bool,
          grads: str, steps: int = 2) -> dict:
    import psutil
    proc = psutil.Process()
    import torch  # noqa: F401  (the base: the runtime every torch program pays)
    libc = _libc()
    base = proc.memory_info().rss
    sampler = PhaseRSS().start()
    rows, engine, saved = [], None, {"bytes": 0, "peak": 0, "ptrs": set()}

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.device.type)
        if key not in saved["ptrs"] and t.device.type == "cpu":
            saved["ptrs"].add(key)
            saved["bytes"] += t.untyped_storage().nbytes()
            saved["peak"] = max(saved["peak"], saved["bytes"])
        return t

    def end(phase: str) -> None:
        rss = proc.memory_info().rss
        row = {"phase": phase, "rss": rss - base,
               "peak_rss": max(sampler.peaks.get(phase, 0), rss) - base}
        if engine is not None:
            h, d = engine.host_pool.stats(), engine.device_tier.stats()
            row.update(host=h["current"], host_peak=h["peak"], device=d["current"], device_peak=d["peak"])
        if saved["peak"]:
            row["saved_for_backward_peak"] = saved["peak"]
        if libc is not None:
            mi = libc.mallinfo2()
            row.update(heap_arena=mi.arena, heap_free=mi.fordblks, heap_mmapped=mi.hblkhd)
            if trim_phases:
                t = time.perf_counter()
                gave = libc.malloc_trim(0)
                row.update(trim_ms=(time.perf_counter() - t) * 1e3, trim_returned=bool(gave),
                           trimmed=rss - proc.memory_info().rss)
        rows.append(row)
        sampler.phase = f"after {phase}"

    sampler.phase = "import zerotier"
    import zerotier
    from zerotier.models import TinyGPT, batches, init_tiny_gpt
    end("import zerotier")
    sampler.phase = "meta build"
    with torch.device("meta"):
        model = TinyGPT(vocab=256, dim=dim, layers=layers, heads=max(1, dim // 128), seq=16, checkpointing=True)
    numel = sum(p.numel() for p in set(model.parameters()))
    end("meta build")
    cfg = {"tiers": {"host": host, "device": device, "nvme_path": nvme_dir},
           "offload": {"params": "nvme", "gradients": grads, "optimizer": "nvme"},
           "precision": {"param_dtype": "bf16", "grad_dtype": "bf16"}, "prefetch": {"lookahead": 1},
           "optimizer": {"lr": 1e-4}, "train": {"wrap": ["Linear", "Embedding"]}}
    sampler.phase = "initialize"
    engine = zerotier.initialize(model, cfg, init_fn=init_tiny_gpt)
    end("initialize")
    step_s = []
    for i, (x, y) in enumerate(batches(256, 16, 4, steps)):
        t = time.perf_counter()
        saved.update(bytes=0, peak=0, ptrs=set())
        sampler.phase = f"forward {i}"
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = engine(x, y)
        end(f"forward {i}")
        sampler.phase = f"backward {i}"
        engine.backward(loss)
        del loss
        end(f"backward {i}")
        sampler.phase = f"step {i}"
        engine.step()
        end(f"step {i}")
        step_s.append(time.perf_counter() - t)
    sampler.stop()
    budgets = engine.plan.budgets
    out = {"dim": dim, "layers": layers, "numel": numel, "host_budget": budgets["host"],
           "device_budget": budgets["device"], "device_type": engine.device.type, "rows": rows,
           "peak_growth": max(r["peak_rss"] for r in rows), "step_s": step_s,
           "load1": os.getloadavg()[0]}
    engine.close(restore_weights=False)
    return out


def over_budget(r: dict) -> int:
    """Peak RSS growth beyond what the budgets allow: host, plus device where the device is RAM."""
    return r["peak_growth"] - r["host_budget"] - (r["device_budget"] if r["device_type"] == "cpu" else 0)


def run(dim: int, layers: list[int], nvme_path: str | None, host: str = "1GiB", device: str = "512MiB",
        trim_phases: bool = False, grads: str = "nvme", env: dict | None = None, steps: int = 2) -> dict:
    rows = []
    for n in layers:
        with tempfile.TemporaryDirectory(prefix="zt-rss-", dir=nvme_path) as tmp:
            cmd = [sys.executable, os.path.abspath(__file__), "--child", str(dim), str(n), tmp, "--host", host,
                   "--device", device, "--grads", grads, "--steps", str(steps)] + (["--trim-phases"] if trim_phases else [])
            out = subprocess.run(cmd, capture_output=True, text=True, check=False,
                                 env={**os.environ, **(env or {})})
            if out.returncode != 0:
                raise RuntimeError(f"the run with {n} layers failed:\n{out.stderr[-4000:]}")
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    slope, fixed = fit([r["numel"] for r in rows], [over_budget(r) for r in rows])
    return {"runs": rows, "over_budget_B_per_param": slope, "over_budget_fixed": fixed}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--host", default="1GiB")
    ap.add_argument("--device", default="512MiB", help="tiers.device (RAM on a machine without CUDA)")
    ap.add_argument("--grads", default="nvme", help="offload.gradients")
    ap.add_argument("--steps", type=int, default=2, help="training steps after initialize (0: initialize only)")
    ap.add_argument("--nvme-path", default=None)
    ap.add_argument("--trim-phases", action="store_true", help="malloc_trim(0) at each phase end")
    ap.add_argument("--child", nargs=3, metavar=("DIM", "LAYERS", "NVME_DIR"), help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(int(args.child[0]), int(args.child[1]), args.child[2], args.host, args.device,
                               args.trim_phases, args.grads, args.steps)))
        return 0
    r = run(args.dim, args.layers, args.nvme_path, args.host, args.device, args.trim_phases, args.grads,
            steps=args.steps)
    if args.json:
        print(json.dumps(r, indent=1))
        return 0
    for run_ in r["runs"]:
        print(f"\n{run_['numel'] / 1e6:.1f}M parameters (dim {run_['dim']}, {run_['layers']} layers), host "
              f"{run_['host_budget'] / MiB:.0f} MiB, device ({run_['device_type']}) "
              f"{run_['device_budget'] / MiB:.0f} MiB, load {run_['load1']:.1f}")
        print(f"{'phase':>16s} {'RSS':>8s} {'peak':>8s} {'pool':>8s} {'device':>8s} {'heap free':>9s} "
              f"{'saved':>8s} {'trimmed':>8s}")
        for row in run_["rows"]:
            f = lambda k: f"{row[k] / MiB:7.0f}M" if k in row else f"{'-':>8s}"  # noqa: E731
            print(f"{row['phase']:>16s} {f('rss')} {f('peak_rss')} {f('host')} {f('device')} {f('heap_free'):>9s} "
                  f"{f('saved_for_backward_peak')} {f('trimmed')}")
        print(f"peak growth {run_['peak_growth'] / MiB:.0f} MiB, over host+device budgets "
              f"{over_budget(run_) / MiB:.0f} MiB")
    from zerotier.tiers.host import RSS_OUTSIDE_BUDGETS
    print(f"\nover budget: fixed {r['over_budget_fixed'] / MiB:.0f} MiB + "
          f"{r['over_budget_B_per_param']:.4f} B/parameter; growth beyond the pool and device peaks: "
          + ", ".join(f"{(x['peak_growth'] - x['rows'][-1]['host_peak'] - x['rows'][-1]['device_peak']) / MiB:.0f}"
                      for x in r["runs"]) + f" MiB (zerotier plan says ~{RSS_OUTSIDE_BUDGETS / MiB:.0f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
