"""Where the drive idles during a training step with parameters and optimizer state on NVMe.

    python tools/drive_idle.py                      # bench_planner's gpt2 (768 x 6, vocab 50257), params+opt on NVMe
    python tools/drive_idle.py --quick              # its --quick widths (256 x 4, vocab 8192): a smoke run
    python tools/drive_idle.py --placement opt-nvme --steps 6 --nvme-path /mnt/nvme
    python tools/drive_idle.py --clip 1.0           # clipping on: each unit speculated as it becomes final

Issue 34 item 4: the params+optimizer-on-NVMe step took 1.31x its drive bound (bytes written /
write rate + bytes read / read rate, the rates fio's). A step can only come near that bound if
the drive always has work queued, so this measures the opposite: the time in each step when
NO read and NO write of the engine is in flight. Every request the NVMe store submits to its I/O
engine is timed from its submission to its completion (a sampler thread polls the engine's
tickets every --sample-ms, without running their bookkeeping), and each step is cut into the
phases the training loop sees (forward, backward, step()); the drive's idle time is reported per
phase, with how much of the busy time had only reads, only writes, or both in flight.

The idle seconds move with the machine's load (compute takes longer on a loaded machine, so
does any gap that waits on it); their split by phase, and the idle share of the step, say where
the schedule leaves the drive without work, which is what a change of schedule moves. The
drive bound beside the step uses write and read rates measured through the store at the start of
the run (as bench_engine.py does), so compare it with step times of the same run only.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from zerotier.profiler import intervals as iv  # noqa: E402

PHASES = ("forward", "backward", "step")


class IORecorder:
    """Wraps an NVMe store's I/O engine: each request's (op, bytes, submit ns, completion ns).
    Completion is seen by a sampler thread polling the engine's own tickets (their `done()` caches
    the result only: the store's bookkeeping still runs in the thread that waits for it)."""

    def __init__(self, engine, sample_s: float):
        self.engine, self.sample_s = engine, sample_s
        self.requests: list[list] = []       # [op, nbytes, submit_ns, end_ns | None]
        self._open: list[tuple[object, list]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="drive-idle-sampler", daemon=True)
        self._thread.start()

    def _record(self, op: str, ticket, nbytes: int, path: str):
        kind = "param" if ".param" in path else "grad" if ".grad" in path else "state"
        rec = [op, nbytes, time.perf_counter_ns(), None, kind]
        with self._lock:
            self.requests.append(rec)
            self._open.append((ticket, rec))
        return ticket

    def read(self, fd, buf, offset, path=""):
        return self._record("read", self.engine.read(fd, buf, offset, path), buf.numel() * buf.element_size(), path)

    def write(self, fd, buf, offset, path=""):
        return self._record("write", self.engine.write(fd, buf, offset, path), buf.numel() * buf.element_size(),
                            path)

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def _poll(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                pending = list(self._open)
            now, still = time.perf_counter_ns(), []
            for ticket, rec in pending:
                if ticket.done():
                    rec[3] = now
                else:
                    still.append((ticket, rec))
            with self._lock:
                done = {id(r) for _, r in pending} - {id(r) for _, r in still}
                self._open = [(t, r) for t, r in self._open if id(r) not in done]
            time.sleep(self.sample_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def step_figures(requests, phases: dict[str, tuple[int, int]]) -> dict:
    """One step's drive figures from the requests' [op, nbytes, start_ns, end_ns, kind] and the step's
    phases {name: (start_ns, end_ns)} (contiguous, in PHASES order). Seconds and bytes.

    busy: some request in flight; reads_only / writes_only / both: which kinds were; idle: the
    step's wall time with none, split by phase. A request's bytes count in the step its submission
    falls in."""
    a, b = phases[PHASES[0]][0], phases[PHASES[-1]][1]
    clip = lambda s, e: (max(s, a), min(e, b))  # noqa: E731
    kinds = {op: iv.union(clip(s, e) for o, _, s, e, _ in requests if o == op and e is not None and e > a and s < b)
             for op in ("read", "write")}
    busy = iv.union(kinds["read"] + kinds["write"])
    both = iv.subtract(kinds["read"], iv.subtract(kinds["read"], kinds["write"]))
    idle = iv.subtract([(a, b)], busy)
    out = {"wall_s": (b - a) / 1e9, "busy_s": iv.length(busy) / 1e9, "both_s": iv.length(both) / 1e9,
           "reads_only_s": (iv.length(kinds["read"]) - iv.length(both)) / 1e9,
           "writes_only_s": (iv.length(kinds["write"]) - iv.length(both)) / 1e9,
           "idle_s": iv.length(idle) / 1e9,
           "read_bytes": sum(n for o, n, s, *_ in requests if o == "read" and a <= s < b),
           "write_bytes": sum(n for o, n, s, *_ in requests if o == "write" and a <= s < b)}
    t = phases["step"][0]  # drive work on step()'s critical path: in flight as it starts, or issued in it
    out["step_work_bytes"] = sum(n for _, n, s, e, _ in requests if s < t < (e or b) or t <= s < b)
    for name in PHASES:
        s, e = phases[name]
        for op in ("read", "write"):
            for kind in ("param", "state", "grad"):
                out[f"{name}_{kind}_{op}_bytes"] = sum(n for o, n, t, _, k in requests if o == op and k == kind
                                                       and s <= t < e)
        out[f"idle_{name}_s"] = iv.overlap(s, e, idle) / 1e9
        out[f"{name}_s"] = (e - s) / 1e9
    return out


def run(args) -> dict:
    import torch

    import zerotier
    from bench_engine import drive_bandwidth
    from bench_planner import PLACEMENTS, init_fn, models

    if args.nvme_path is None:
        with tempfile.TemporaryDirectory(prefix="zt-drive-idle-", dir=".") as tmp:
            args.nvme_path = tmp
            return run(args)
    nvme_path = args.nvme_path
    write_bw, read_bw = drive_bandwidth(nvme_path, nbytes=args.probe_mib << 20)
    factory, vocab, seq = models(args.quick)["gpt2"]
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (args.batch, seq), generator=g)
    y = torch.randint(0, vocab, (args.batch, seq), generator=g)
    cfg = {"offload": PLACEMENTS[args.placement], "tiers": {"nvme_path": nvme_path},
           "train": {"handle_signals": False, "max_grad_norm": args.clip}, "optimizer": {"pipeline_depth": args.depth} if args.depth else {}}
    torch.manual_seed(0)
    steps = []
    with zerotier.initialize(factory("meta"), cfg, init_fn=init_fn) as engine:
        rec = IORecorder(engine.store.engine, args.sample_ms / 1e3)
        engine.store.engine = rec
        try:
            for _ in range(args.steps):
                t0 = time.perf_counter_ns()
                loss = engine(x, y)
                t1 = time.perf_counter_ns()
                engine.backward(loss)
                t2 = time.perf_counter_ns()
                engine.step()
                t3 = time.perf_counter_ns()
                steps.append({"forward": (t0, t1), "backward": (t1, t2), "step": (t2, t3)})
            time.sleep(10 * args.sample_ms / 1e3)
        finally:
            rec.close()
            engine.store.engine = rec.engine
        requests = [list(r) for r in rec.requests]
    figures = [step_figures(requests, s) for s in steps]
    return {"placement": args.placement, "quick": args.quick, "write_bw": write_bw, "read_bw": read_bw,
            "steps": figures}


def report(res: dict, skip: int) -> str:
    w, r = res["write_bw"], res["read_bw"]
    rows = res["steps"][skip:] or res["steps"]
    med = {k: statistics.median(f[k] for f in rows) for k in rows[0]}
    bound = med["write_bytes"] / w + med["read_bytes"] / r
    lines = [f"{res['placement']}: drive through the store: write {w / 1e9:.2f} GB/s, read {r / 1e9:.2f} GB/s"]
    lines.append(f"{'step':>4s} {'wall':>6s} {'fwd':>5s} {'bwd':>5s} {'step()':>6s} {'busy':>6s} {'r only':>6s} "
                 f"{'w only':>6s} {'r+w':>5s} {'idle':>5s} {'in fwd':>6s} {'in bwd':>6s} {'in st':>5s}"
                 f" {'GB w/r':>9s} {'bound':>5s}")
    for k, f in enumerate(res["steps"]):
        b = f["write_bytes"] / w + f["read_bytes"] / r
        lines.append(f"{k:4d} {f['wall_s']:6.2f} {f['forward_s']:5.2f} {f['backward_s']:5.2f} {f['step_s']:6.2f} "
                     f"{f['busy_s']:6.2f} {f['reads_only_s']:6.2f} {f['writes_only_s']:6.2f} {f['both_s']:5.2f} "
                     f"{f['idle_s']:5.2f} {f['idle_forward_s']:6.2f} {f['idle_backward_s']:6.2f} "
                     f"{f['idle_step_s']:5.2f} {f['write_bytes'] / 1e9:4.2f}/{f['read_bytes'] / 1e9:4.2f} {b:5.2f}")
    lines.append(f"median of steps {skip}..: step {med['wall_s']:.2f} s, drive bound {bound:.2f} s "
                 f"(step / bound {med['wall_s'] / bound:.2f}x); drive idle {med['idle_s']:.2f} s "
                 f"({100 * med['idle_s'] / med['wall_s']:.0f}% of the step: forward {med['idle_forward_s']:.2f}, "
                 f"backward {med['idle_backward_s']:.2f}, step() {med['idle_step_s']:.2f}); busy with reads and "
                 f"writes together {med['both_s']:.2f} s; drive work left for step() (in flight as it starts or "
                 f"issued in it) {med['step_work_bytes'] / 1e6:.0f} MB")
    lines.append("MB issued per phase (median): " + "; ".join(
        f"{ph}: " + ", ".join(f"{kind} {op} {med[f'{ph}_{kind}_{op}_bytes'] / 1e6:.0f}" for op in ("read", "write")
                              for kind in ("param", "state", "grad") if med[f"{ph}_{kind}_{op}_bytes"])
        for ph in PHASES))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="bench_planner's --quick widths")
    p.add_argument("--placement", default="params+opt-nvme", help="a bench_planner placement (default params+opt-nvme)")
    p.add_argument("--steps", type=int, default=5, help="training steps (default 5); the median skips the first 2")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--clip", type=float, default=None, help="train.max_grad_norm (default off; on: the window's "
                   "NVMe units are speculated during backward, train.overlap auto)")
    p.add_argument("--depth", type=int, default=0, help="optimizer.pipeline_depth (default: the config's)")
    p.add_argument("--sample-ms", type=float, default=1.0, help="completion polling period (default 1 ms)")
    p.add_argument("--probe-mib", type=int, default=512, help="MiB written and read to measure the drive")
    p.add_argument("--nvme-path", default=None, help="directory on the drive (default: a temp dir here)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    res = run(args)
    print(report(res, skip=min(2, args.steps - 1)))
    if args.json:
        print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
