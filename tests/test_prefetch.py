"""The prefetch scheduler's decisions, on their own (the engine tests cover it in use)."""
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
