"""How long initialize's placement spends in each phase ([Note: initialize's phases]).

[Note: initialize's phases]
`initialize` gives a meta-built model its bytes and places every unit in its tiers
(engine/placement.py, materialize.py). Each phase adds the seconds it took, on the thread that
ran it, and the elements it covered, to one SetupTimes:
  fill          the unit's host-pool block allocated and set to NaN (the unset marker)
  init          init_fn / reset_parameters drawing the weights
  check         the materialized tensors searched for elements left unset
  cast          the fp32 flat for the optimizer and the low-precision copy for the parameters
  optimizer     the optimizer state: the master copied into its layout, the moments zeroed,
                NVMe writes issued
  params        the low-precision parameters to their home (a copy, or an NVMe write issued)
  grads         the gradient buffers
  nvme drain    waiting for the initial NVMe writes still in flight at the end
  wait          the placing thread waiting for the next materialized unit
                ([Note: materializing ahead] in materialize.py)
  rest          modules no unit covers, and buffers to the compute device
fill, init and check run on the materializing thread, the others on the caller's, so the
phases' sum may exceed the wall time: the difference is what ran at the same time.
benchmarks/bench_setup.py prints them beside this machine's bounds.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Iterator

PHASES = ("fill", "init", "check", "cast", "optimizer", "params", "grads", "nvme drain", "wait", "rest")


class SetupTimes:
    """Seconds and elements per phase of initialize's placement, from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.numel = dict.fromkeys(PHASES, 0)

    @contextmanager
    def phase(self, name: str, numel: int = 0) -> Iterator[None]:
        if name not in self.seconds:
            raise ValueError(f"setup phase {name!r} is not one of {', '.join(PHASES)}")
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            with self._lock:
                self.seconds[name] += dt
                self.numel[name] += numel

    def summary(self) -> dict[str, dict[str, float]]:
        with self._lock:
            return {name: {"seconds": self.seconds[name], "numel": self.numel[name]} for name in PHASES}
