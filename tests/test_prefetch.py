"""The prefetch scheduler's decisions, on their own (the engine tests cover it in use)."""
import pytest
import torch

from zerotier.config import PrefetchConfig
from zerotier.schedule import PrefetchScheduler


def make(max_bytes, unit_bytes):
    issued, inflight = [], []
    sched = PrefetchScheduler(PrefetchConfig(lookahead=2, max_bytes=max_bytes), unit_bytes,
                              [f"u{i}" for i in range(len(unit_bytes))], lambda i: (issued.append(i), inflight.append(i)),
                              lambda: sum(unit_bytes[i] for i in inflight))
    for i in range(len(unit_bytes)):  # record the trace
        sched.on_demand(i)
    sched.begin_pass()
    return sched, issued, inflight


def test_unit_larger_than_max_bytes_is_prefetched_when_nothing_is_in_flight():
    sched, issued, inflight = make(100, [10, 500, 500, 10])
    sched.on_demand(0)
    assert issued == [1], "the next unit alone exceeds max_bytes but must still be prefetched"
    inflight.clear()
    sched.on_demand(1)
    assert issued == [1, 2]


def test_max_bytes_limits_what_is_in_flight():
    sched, issued, _ = make(100, [10, 60, 60, 10])
    sched.on_demand(0)
    assert issued == [1], "the second lookahead unit would pass max_bytes"


@pytest.mark.pins("design#streams")
def test_prefetch_copies_wait_for_compute_as_of_their_issue(monkeypatch):
    """GPU review N7, checked on the CPU: a prefetch's host->device copy runs on a fetch worker, and
    must wait for the compute work enqueued when the fetch was *issued* (an event marked on the
    compute thread), not for whatever the worker's current stream holds when it runs."""
    import threading

    import zerotier
    from zerotier.models import TinyGPT, batches
    from zerotier.tiers.device import DeviceTier
    from zerotier.tiers.lagging import LaggingDeviceTier, _lag_from_env

    # the class make_device_tier builds here (the lagging one under the suite's conftest), whose
    # mark() the engine calls: patching DeviceTier alone would miss LaggingDeviceTier's override
    tier_cls = LaggingDeviceTier if _lag_from_env() is not None else DeviceTier
    marks, copies = [], []
    mark, copy_h2d = tier_cls.mark, tier_cls.copy_h2d

    def marking(self):
        token = ("mark", threading.current_thread().name, mark(self))
        marks.append(token)
        return token

    def copying(self, dst, src, after=None):
        copies.append((threading.current_thread().name, after))
        return copy_h2d(self, dst, src, after=None if after is None else after[2])

    monkeypatch.setattr(tier_cls, "mark", marking)
    monkeypatch.setattr(tier_cls, "copy_h2d", copying)
    torch.manual_seed(0)
    with zerotier.initialize(TinyGPT(vocab=64, dim=32, layers=4, heads=2, seq=16),
                             {"offload": {"params": "host"}, "prefetch": {"lookahead": 2}}) as engine:
        for x, y in batches(64, 16, 2, 3):
            engine.backward(engine(x, y))
            engine.step()
    on_workers = [after for thread, after in copies if thread.startswith("zerotier-fetch")]
    assert on_workers, "no prefetch ran on a fetch worker: the test checks nothing"
    assert all(after is not None and after[1] == threading.main_thread().name for after in on_workers)
    assert all(thread == threading.main_thread().name for _, thread, _ in marks)


def test_a_pass_stopped_part_way_keeps_the_trace():
    """A forward that raised after unit 1 (a failed read, say) changed no module order: the retry
    follows the trace without a warning and is prefetched, rather than the truncated order
    becoming the trace and the retry warning 'module order changed' (issue 35 item 6)."""
    import warnings

    sched, issued, inflight = make(1000, [10, 10, 10, 10])
    sched.on_demand(0)
    sched.on_demand(1)  # ... and the forward raises here
    sched.begin_pass()
    issued.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(4):
            sched.on_demand(i)
    assert sorted(set(issued)) == [1, 2, 3], "the retry must be prefetched along the recorded trace"
    assert sched.divergences == 0


def test_a_first_pass_stopped_part_way_is_extended_without_a_warning():
    """The engine's first pass failed after unit 1, so the trace is [0, 1]: the next (whole) pass runs
    past its end, which is no changed order; the pass after that is prefetched along all 4 units. Past
    the end of a trace a pass has followed whole, a longer pass still warns."""
    import warnings

    import pytest

    issued, inflight, unit_bytes = [], [], [10, 10, 10, 10]
    sched = PrefetchScheduler(PrefetchConfig(lookahead=2, max_bytes=1000), unit_bytes, [f"u{i}" for i in range(4)],
                              lambda i: (issued.append(i), inflight.append(i)), lambda: 0)
    sched.on_demand(0)
    sched.on_demand(1)  # ... and the first pass raises here
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            sched.begin_pass()
            issued.clear()
            for i in range(4):
                sched.on_demand(i)
    assert sched.trace == [0, 1, 2, 3] and sorted(set(issued)) == [1, 2, 3] and sched.divergences == 0
    sched.begin_pass()
    with pytest.warns(RuntimeWarning, match="module order changed at 'u0' .trace expected 'end of trace'"):
        for i in (0, 1, 2, 3, 0):
            sched.on_demand(i)
    assert sched.divergences == 1
