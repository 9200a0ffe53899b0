"""What the parameter surface ([Note: the parameter surface] in zerotier/engine/surface.py) costs.

Every torch call that touches a managed parameter goes through ManagedParameter.__torch_function__
(a Python call). This prints, measured in one run:
  - one F.linear on a managed parameter vs on a plain one (microseconds per call);
  - a forward+backward of TinyGPT with parameters on the device, the engine's parameters managed
    vs the same engine with the surface switched off (disowned: plain parameters), alternated,
    medians of --repeats rounds; and plain torch for scale.

    python benchmarks/bench_surface.py [--dim 256 --layers 4 --repeats 7]

Last figures (2026-11-26, the 2-core AMD EPYC VM, AVX2, idle, three runs): F.linear((4, 256), (64, 256))
+19.9 / +20.4 / +21.5 us per call on a managed parameter (plain 17.6-17.9 us; a subclass with an empty
__torch_function__ alone costs +8.5 us, so ~12 us is zerotier's sorting); TinyGPT 256 x 4 forward+backward
surface on vs off 1.024x / 1.026x / 1.029x (112.0-112.4 vs 109.2-109.7 ms).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import zerotier
from zerotier.models import TinyGPT, batches


def per_call_us(fn, n=3000) -> float:
    for _ in range(100):
        fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def step_s(run, x, y, n=5) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        run(x, y).backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=256, help="TinyGPT width")
    ap.add_argument("--layers", type=int, default=4, help="TinyGPT depth")
    ap.add_argument("--repeats", type=int, default=7, help="alternated rounds (median reported)")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = TinyGPT(vocab=256, dim=args.dim, layers=args.layers, heads=4, seq=64)
    plain = TinyGPT(vocab=256, dim=args.dim, layers=args.layers, heads=4, seq=64)
    engine = zerotier.initialize(model, {"offload": {"params": "device"}, "optimizer": {"lr": 1e-3}})
    x, y = next(batches(256, 64, 4, 1))

    w = model.blocks[0].mlp[0].weight if hasattr(model.blocks[0], "mlp") else next(model.parameters())
    w_plain = torch.nn.Parameter(w.detach().clone())
    inp = torch.randn(4, w.shape[1])
    with torch.no_grad():
        managed_us = per_call_us(lambda: F.linear(inp, w))
        plain_us = per_call_us(lambda: F.linear(inp, w_plain))
    print(f"F.linear({tuple(inp.shape)}, {tuple(w.shape)}): managed {managed_us:.1f} us, plain {plain_us:.1f} us, "
          f"surface +{managed_us - plain_us:.1f} us per call")

    on, off, ref = [], [], []
    for _ in range(args.repeats):
        on.append(step_s(engine, x, y))
        engine.surface.disown()
        off.append(step_s(engine, x, y))
        engine.surface.adopt()
        ref.append(step_s(plain, x, y))
    on_s, off_s, ref_s = (statistics.median(v) for v in (on, off, ref))
    print(f"TinyGPT dim {args.dim} x {args.layers} layers, forward+backward (median of {args.repeats}): "
          f"surface on {on_s * 1e3:.1f} ms, off {off_s * 1e3:.1f} ms ({on_s / off_s:.3f}x), "
          f"plain torch {ref_s * 1e3:.1f} ms")
    engine.close()


if __name__ == "__main__":
    main()
