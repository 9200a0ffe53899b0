"""torch.compile per block on a zerotier model vs eager, with plain torch beside it (issue 26 item 4).

Each case runs in its own process (compile caches and allocator state do not leak between cases),
the cases alternate over --rounds, and the figure is the median step time after --warmup steps
(the first compiled steps pay for compilation: reported separately as "first step").

    python benchmarks/bench_compile.py --dim 256 --layers 4 --steps 8 --rounds 2

Cases: torch eager, torch compiled blocks, zerotier eager, zerotier compiled blocks, for
params on host (zerotier) with gradients and optimizer on host. Compile is FSDP2's recipe:
`block.compile()` per wrapped block ([Note: compiled units] in zerotier/engine/engine.py).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, tempfile, time, torch
import zerotier
from zerotier.models import TinyGPT, batches
case, dim, layers, steps, warmup = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
torch.manual_seed(0)
model = TinyGPT(vocab=512, dim=dim, layers=layers, heads=4, seq=128)
compiled = case.endswith("compiled")
if compiled:
    for block in model.blocks:
        block.compile()
times = []
data = list(batches(512, 128, 8, steps))
if case.startswith("torch"):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for x, y in data:
        t = time.perf_counter()
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t)
else:
    cfg = {"offload": {"params": "host", "gradients": "host", "optimizer": "host"}, "optimizer": {"lr": 1e-4}}
    with zerotier.initialize(model, cfg) as engine:
        for x, y in data:
            t = time.perf_counter()
            engine.backward(engine(x, y))
            engine.step()
            times.append(time.perf_counter() - t)
print(json.dumps({"first": times[0], "steady": times[warmup:]}))
"""

CASES = ("torch-eager", "torch-compiled", "zerotier-eager", "zerotier-compiled")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dim", type=int, default=256, help="TinyGPT width (default 256)")
    ap.add_argument("--layers", type=int, default=4, help="TinyGPT blocks (default 4)")
    ap.add_argument("--steps", type=int, default=8, help="steps per process, warm-up included (default 8)")
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the median (default 3)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds of all cases (default 2)")
    args = ap.parse_args(argv)
    if args.steps <= args.warmup:
        ap.error("--steps must exceed --warmup")
    steady = {c: [] for c in CASES}
    first = {c: [] for c in CASES}
    for _ in range(args.rounds):
        for case in CASES:
            out = subprocess.run([sys.executable, "-c", CHILD, case, str(args.dim), str(args.layers), str(args.steps),
                                  str(args.warmup)], capture_output=True, text=True, check=True,
                                 cwd=tempfile.gettempdir())
            result = json.loads(out.stdout.strip().splitlines()[-1])
            steady[case] += result["steady"]
            first[case].append(result["first"])
    print(f"TinyGPT dim {args.dim} x {args.layers} blocks, batch 8 x 128, {args.rounds} rounds, "
          f"median of steps {args.warmup + 1}-{args.steps}")
    print(f"{'case':<20}{'step ms':>10}{'first step s':>14}{'vs torch eager':>16}")
    base = statistics.median(steady["torch-eager"])
    for case in CASES:
        med = statistics.median(steady[case])
        print(f"{case:<20}{med * 1e3:>10.1f}{statistics.median(first[case]):>14.1f}{med / base:>15.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
