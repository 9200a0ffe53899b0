"""The engine's own host time per unit: `zerotier bench engine`, the planner's engine_forward_s and
engine_backward_s.

[Note: the engine's own time]
The planner's compute is each unit's forward and backward run as a plain module ([Note: measuring
units] in planner/unit_timing.py). The engine adds its own host work around them: the module hooks
(fetch, release, the outputs wrapped for backward), the parameter surface's `__torch_function__`,
and in backward a hook per parameter handing each gradient to its store. On a CPU device that work
takes the same cores as compute, so the step is longer by it: plain torch and the engine (device
placement, profiler on, both under the pinned heap) timed in turn in one process, quick GPT-2 of
bench_planner: forward 26.2 vs 27.9 ms, backward 54.1 vs 58.2 ms over five units (1 ms a unit).

`measure` times it the same way, on a small TinyGPT whose compute is little beside it: the
engine's forward and backward against plain torch's on the same weights and batch, in turn (the
machine's drift cancels), medians, the difference per unit. Clipping is on so no update runs in the
engine's backward (an early step would be timed as backward). Here: 0.09 ms (forward) and 0.33 ms
(backward) a unit, quiet; the quick GPT-2's units (dim 256) showed about 1 ms, of which the gradient's
copy into its store (about 0.5 ms, counted apart: [Note: a CPU device's copies take its cores]) and
some that grows with the unit. The step model adds the figures to
each unit's forward and backward on a CPU device (planner/predict.py). On a CUDA device the hooks
run ahead of the device's queue, under its kernels when the step is the device's: not added there.
"""
from __future__ import annotations

import statistics
import time
import warnings
from typing import Any, Callable

LAYERS = 8  # units: the blocks and the root


def measure(rounds: int = 15, tick: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """[Note: the engine's own time] Seconds the engine adds per unit to a forward and a backward."""
    import torch

    from ..models import TinyGPT
    from ..tiers.host import bound_heap
    from .engine import initialize

    bound_heap()  # as the engine's pool will: both sides pay the same for their temporaries

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return TinyGPT(vocab=64, dim=32, layers=LAYERS, heads=4, seq=16)

    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    plain = model()
    cfg = {"offload": {"params": "device", "gradients": "device", "optimizer": "device"},
           "train": {"handle_signals": False, "max_grad_norm": 1.0, "device": "cpu"}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # initialize's notes on a toy model
        engine = initialize(model(), cfg)
    try:
        units = len(engine.units)

        def timed(forward, backward, clear) -> tuple[float, float]:
            t0 = time.perf_counter()
            loss = forward()
            t1 = time.perf_counter()
            backward(loss)
            t2 = time.perf_counter()
            clear()
            return t1 - t0, t2 - t1

        def plain_pass() -> tuple[float, float]:
            return timed(lambda: plain(x, x), lambda loss: loss.backward(), lambda: plain.zero_grad(set_to_none=True))

        def engine_pass() -> tuple[float, float]:
            return timed(lambda: engine(x, x), engine.backward, engine.zero_grad)

        for _ in range(3):  # warm-up: first calls, allocator
            plain_pass()
            engine_pass()
        got: dict[str, list[float]] = {"pf": [], "pb": [], "ef": [], "eb": []}
        for _ in range(rounds):
            for key, (f, b) in (("p", plain_pass()), ("e", engine_pass())):
                got[key + "f"].append(f)
                got[key + "b"].append(b)
        tick("engine: its own time per unit")
    finally:
        engine.close(restore_weights=False)
    med = {k: statistics.median(v) for k, v in got.items()}
    return {"units": units, "threads": torch.get_num_threads(),
            "forward_per_unit_s": max(0.0, (med["ef"] - med["pf"]) / units),
            "backward_per_unit_s": max(0.0, (med["eb"] - med["pb"]) / units),
            "plain_forward_s": med["pf"], "plain_backward_s": med["pb"]}
