"""What `train.overlap = "early"` (Adam during the window's last backward, [Note: early step]) saves.

    python benchmarks/bench_early_step.py [--dim 512 --layers 6 --steps 6 --rounds 5]
    python benchmarks/bench_early_step.py --interleaved --steps 12   # one process, steps alternating

Off is the default since issue 21 (the update must not be visible before step(), so that
zero_grad() / p.grad = None / clip_grad_norm_ between backward and step are exact). Each
case (placement x early_step) runs in its own process; cases alternate in rounds so drift
on a shared machine hits them alike; the figure is the median over rounds of each
process's median step time (backward + step), no clipping.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time

PLACEMENTS = {
    "optimizer on host": {"params": "device", "gradients": "host", "optimizer": "host"},
    "optimizer on NVMe": {"params": "device", "gradients": "host", "optimizer": "nvme"},
    "params+optimizer on NVMe": {"params": "nvme", "gradients": "host", "optimizer": "nvme"},
}


def one_case(args) -> None:
    import torch
    import zerotier
    from zerotier.models import TinyGPT, batches
    torch.manual_seed(0)
    model = TinyGPT(vocab=4096, dim=args.dim, layers=args.layers, heads=8, seq=128)
    cfg = {"offload": PLACEMENTS[args.case], "tiers": {"nvme_path": args.nvme_path},
           "train": {"overlap": "early" if args.early else "auto"}}
    times = []
    with zerotier.initialize(model, cfg) as engine:
        for i, (x, y) in enumerate(batches(4096, 128, 4, args.steps + 1)):
            loss = engine(x, y)
            start = time.perf_counter()
            engine.backward(loss)
            engine.step()
            if i:
                times.append(time.perf_counter() - start)
    print(json.dumps({"median": statistics.median(times)}))


def interleaved(args) -> None:
    """Both engines in one process, steps alternating off/on: drift hits them alike."""
    import torch
    import zerotier
    from zerotier.models import TinyGPT, batches
    for case, offload in PLACEMENTS.items():
        engines = []
        for early in (False, True):
            torch.manual_seed(0)
            model = TinyGPT(vocab=4096, dim=args.dim, layers=args.layers, heads=8, seq=128)
            engines.append(zerotier.initialize(model, {"offload": offload, "tiers": {"nvme_path": args.nvme_path},
                                                       "train": {"overlap": "early" if early else "auto", "handle_signals": False}}))
        times = ([], [])
        for i, (x, y) in enumerate(batches(4096, 128, 4, args.steps + 1)):
            for k in ((0, 1) if i % 2 else (1, 0)):
                loss = engines[k](x, y)
                start = time.perf_counter()
                engines[k].backward(loss)
                engines[k].step()
                if i:
                    times[k].append(time.perf_counter() - start)
        for engine in engines:
            engine.close()
        off, on = statistics.median(times[0]), statistics.median(times[1])
        print(f"{case:26s} early_step off {off * 1e3:8.1f} ms   on {on * 1e3:8.1f} ms   off/on {off / on:.3f}"
              f"   (interleaved, {args.steps} steps each)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--nvme-path", default=None)
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--early", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--interleaved", action="store_true",
                    help="one process, off/on steps alternating (less drift than process rounds on a busy box)")
    args = ap.parse_args()
    if args.nvme_path is None:
        args.nvme_path = tempfile.mkdtemp()
    if args.case:
        return one_case(args)
    if args.interleaved:
        return interleaved(args)
    results: dict[tuple[str, bool], list[float]] = {}
    for _ in range(args.rounds):
        for case in PLACEMENTS:
            for early in (False, True):
                cmd = [sys.executable, __file__, "--case", case, "--dim", str(args.dim), "--layers",
                       str(args.layers), "--steps", str(args.steps), "--nvme-path", args.nvme_path] + \
                      (["--early"] if early else [])
                out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                results.setdefault((case, early), []).append(json.loads(out.strip().splitlines()[-1])["median"])
    for case in PLACEMENTS:
        off, on = statistics.median(results[(case, False)]), statistics.median(results[(case, True)])
        print(f"{case:26s} early_step off {off * 1e3:8.1f} ms   on {on * 1e3:8.1f} ms   off/on {off / on:.3f}"
              f"   (rounds off {[round(t * 1e3) for t in results[(case, False)]]}, "
              f"on {[round(t * 1e3) for t in results[(case, True)]]})")


if __name__ == "__main__":
    main()
