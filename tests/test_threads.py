"""Threading rules ([Note: thread ownership] in zerotier/threads.py, docs/design.md "Threads"):
each store's state has one owner thread, handoffs go through a ticket, future or queue, and
ZEROTIER_CHECK_THREADS=1 asserts the owner on every mutating call."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import zerotier
from zerotier import threads
from zerotier.models import TinyGPT, batches

DATA = list(batches(64, 16, 2, 3))


def model():
    torch.manual_seed(0)
    return TinyGPT(vocab=64, dim=32, layers=2, heads=2, seq=16)


def plain_step(engine, x, y):
    engine.backward(engine(x, y))
    engine.step()


def train(early_step: bool, step=plain_step):
    cfg = {"offload": {"params": "host", "gradients": "host", "optimizer": "host"}, "optimizer": {"lr": 3e-3},
           "train": {"max_grad_norm": None, "overlap": "early" if early_step else "auto"}}
    with zerotier.initialize(model(), cfg) as engine:
        for x, y in DATA:
            step(engine, x, y)
        return engine.parameters_fp32()


@pytest.mark.pins("design#syncs")
def test_early_step_backward_never_waits_for_a_units_host_adds():
    """GPU review N8: a unit's early step settles its gradient (waits for its host adds) on the
    optimizer thread, never on the autograd thread. Each optimizer-thread settle here blocks
    until backward has returned: backward must still finish, and no unit handed to the optimizer
    may be settled by the compute thread during backward."""
    gate = threading.Event()

    def step_with_slow_adds(engine, x, y):
        calls, settle = [], engine.grads.settle

        def slow_settle(unit):
            calls.append((threads.role(), unit.index, engine.window.in_backward))
            if threads.role() == threads.OPTIMIZER:
                assert gate.wait(timeout=60), "backward never returned while an early step settled"
            settle(unit)
        engine.grads.settle = slow_settle
        gate.clear()
        try:
            engine.backward(engine(x, y))
            assert engine.window.overlap.early, "with no clipping, units are updated during backward"
            assert not any(f.done() for f in engine.window.overlap.early), "the optimizer thread waits for the gate"
            handed = {i for i, slot in enumerate(engine.grads.slots) if slot.handed}
            on_compute = {i for role, i, in_backward in calls if role == threads.COMPUTE and in_backward}
            assert handed and not handed & on_compute, f"units {sorted(handed & on_compute)} settled in backward"
        finally:
            gate.set()
        engine.step()
        assert {i for role, i, _ in calls if role == threads.OPTIMIZER} == handed
        del engine.grads.settle

    ours = train(early_step=True, step=step_with_slow_adds)
    ref = train(early_step=False)
    for name in ref:
        torch.testing.assert_close(ours[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)


_CHECKED = textwrap.dedent("""
    import threading
    import torch
    import zerotier
    from zerotier import threads
    from zerotier.models import TinyGPT, batches
    from zerotier.params import ParamStore

    assert threads.CHECK and hasattr(ParamStore.commit, "__wrapped__")
    torch.manual_seed(0)
    cfg = {"offload": {"params": "host", "gradients": "host", "optimizer": "host"},
           "train": {"max_grad_norm": None, "overlap": "early"}}
    with zerotier.initialize(TinyGPT(vocab=64, dim=32, layers=2, heads=2, seq=16), cfg) as engine:
        early = 0
        for x, y in batches(64, 16, 2, 2):  # early steps hand the updater's state over and back
            engine.backward(engine(x, y))
            early += len(engine.window.overlap.early)
            engine.step()
        assert early > 0
        unit = engine.units[0]
        caught = []

        def worker():  # a fetch worker must hand its result back, never mutate the store
            try:
                engine.params.release(unit)
            except threads.ThreadOwnershipError as exc:
                caught.append(exc)
        t = threading.Thread(target=worker, name="zerotier-fetch-test")
        t.start()
        t.join()
        assert caught and "zerotier-fetch-test" in str(caught[0]), caught
        threads.hand(threads.OPTIMIZER, engine.params)  # as during an early step
        try:
            engine.params.commit(unit)
        except threads.ThreadOwnershipError as exc:
            assert "updater (now optimizer)" in str(exc), exc
        else:
            raise AssertionError("the compute thread committed while the optimizer thread owned the write-back")
        threads.hand(threads.COMPUTE, engine.params)
    print("CHECKED")
""")


def _python(code: str, check: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, ZEROTIER_CHECK_THREADS=check)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_check_threads_switch_asserts_the_owner():
    """ZEROTIER_CHECK_THREADS=1: early steps pass (their handoffs are recorded), a worker mutating a
    store and a compute-thread commit while the optimizer owns the write-back both raise."""
    out = _python(_CHECKED, "1")
    assert out.returncode == 0 and "CHECKED" in out.stdout, out.stdout + out.stderr


def test_check_threads_switch_off_costs_nothing():
    """Off, the stores' methods are the undecorated functions (the env var is read once, at import)."""
    out = _python("from zerotier import threads; from zerotier.params import ParamStore; "
                  "from zerotier.grads import GradStore; from zerotier.optim.offload import UnitOptimizer; "
                  "assert not threads.CHECK; "
                  "assert not any(hasattr(f, '__wrapped__') for f in "
                  "(ParamStore.commit, ParamStore.demand, GradStore.accumulate, GradStore.ready, UnitOptimizer.step))",
                  "0")
    assert out.returncode == 0, out.stderr


def test_a_write_back_checked_by_two_threads_fails_both():
    """ParamStore's NVMe write-back tickets are shared by the compute thread (a fetch checks the
    unit's last write) and the updater (WriteBacks.track waits for the oldest). While one thread waits
    on a failing write, the other checking the same unit must see the failure too, not find the
    ticket gone and read the file's previous weights ([Note: a failed write-back])."""
    from zerotier.params import ParamSlot
    from zerotier.params_writes import WriteBacks

    store = WriteBacks([ParamSlot() for _ in range(4)], threading.Lock(), max_writes=2)  # ParamStore.writes
    waiting, release = threading.Event(), threading.Event()

    class FailingWrite:  # a write that fails with ENOSPC once `release` is set
        def wait(self, timeout=None):
            waiting.set()
            assert release.wait(timeout=30)
            raise OSError(28, "No space left on device")

        def done(self):
            return release.is_set()

    store.tickets[3] = FailingWrite()
    seen = []

    def optimizer_thread():
        try:
            store.check([3])
        except OSError as exc:
            seen.append(exc)
    t = threading.Thread(target=optimizer_thread, name="zerotier-optim_test")
    t.start()
    assert waiting.wait(timeout=30)
    threading.Timer(0.2, release.set).start()  # fails while the compute thread checks the same unit
    try:
        store.check([3])
    except OSError:
        pass
    else:
        raise AssertionError("the compute thread found no write to check while the optimizer thread waited on it")
    t.join(timeout=30)
    assert seen and isinstance(store.slots[3].failed_write, OSError) and not store.tickets


def test_gradient_staging_in_flight_is_bounded():
    """GPU review N6: per-parameter D2H staging blocks wait for the oldest adds once STAGED_UNITS x
    the largest unit's bytes are in flight (an adder that lags must not grow them to the model's
    gradient bytes). The bound on its own, with futures standing in for the adder's adds."""
    from concurrent.futures import Future

    from zerotier.grads_memory import _StagingBound

    bound = _StagingBound(limit=2 * 4096, alignment=4096)
    adds = [Future(), Future(), Future()]
    for add in adds[:2]:
        bound.add(add, bound.admit(3000))  # each counted as its aligned pool block: 4096
    admitted = threading.Event()

    def third():
        bound.add(adds[2], bound.admit(10))
        admitted.set()
    t = threading.Thread(target=third, daemon=True)  # never left blocked past a failed assert
    t.start()
    try:
        assert not admitted.wait(timeout=0.3), "a third block was staged past the bound"
    finally:
        adds[0].set_result(None)  # the oldest add ran and freed its block
    assert admitted.wait(timeout=30)
    t.join(timeout=30)
    assert bound.bytes == 2 * 4096 and bound.peak == 2 * 4096
    adds[1].set_result(None)
    adds[2].set_result(None)
    big = bound.admit(5 * 4096)  # one block larger than the bound is admitted alone
    assert big == 5 * 4096 and bound.bytes <= 4096


def test_planner_counts_the_gradient_staging_on_cuda():
    """GPU review N6, "plans that fit, run": with host gradients on a CUDA device the plan counts
    the staging the store may hold (GradStore.offload_staging_bytes), and a host budget one byte
    short of it does not fit. On the CPU there is no staging (the gradient is host memory)."""
    from zerotier.config import OffloadConfig, PrecisionConfig
    from zerotier.grads import GradStore
    from zerotier.planner.inputs import ModelFacts, Node, PlanConfig
    from zerotier.planner.messages import PlanDoesNotFit
    from zerotier.planner.planner import make_plan

    numels, big = [5000, 3000, 1000], 1 << 40
    offload = OffloadConfig(params="device", gradients="host", optimizer="host")

    def plan(device, host=big):
        return make_plan(ModelFacts.of_sizes(numels),
                         PlanConfig(offload=offload, precision=PrecisionConfig(param_dtype="bf16"), alignment=4096),
                         Node(torch.device(device), budgets={"device": big, "host": host, "nvme": 0}))
    cpu, cuda = plan("cpu"), plan("cuda")
    staging = GradStore.offload_staging_bytes(5000, 2, 4096)
    assert staging == 2 * 12288
    assert cuda.need["host"] - cpu.need["host"] == staging
    plan("cuda", host=cuda.need["host"])  # exactly the budget: fits
    try:
        plan("cuda", host=cuda.need["host"] - 1)
    except PlanDoesNotFit:
        pass
    else:
        raise AssertionError("a host budget without room for the gradient staging was planned")
