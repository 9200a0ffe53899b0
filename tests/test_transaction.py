"""A step is all or nothing ([Note: a step is all or nothing] in engine.py; issue 15 item 2).

Every failure inside engine.step() or engine.backward() ends one of two ways, both tested here
against a run that never saw the failed batch:
  - nothing was updated: the gradients are intact (step() may be retried) or, after a backward
    that stopped half-way, dropped by zero_grad(); training then continues bitwise as if the
    failure had not happened (retry) or as if the batch had been skipped;
  - some units were updated: the engine refuses step(), backward() and save_checkpoint() with a
    message naming load_checkpoint(); after loading the last checkpoint, training continues
    bitwise as if the failed batch had never been seen.
No update runs on the optimizer thread once the error has reached the caller.
"""
from __future__ import annotations

import errno

import pytest
import torch

import zerotier
from zerotier.errors import TierIOError, ZerotierError
from zerotier.models import TinyGPT, batches

from injected_faults import fail_nth_write

DATA = list(batches(64, 16, 2, 8))


def model():
    torch.manual_seed(0)
    return TinyGPT(vocab=64, dim=32, layers=2, heads=2, seq=16)


def cfg(tmp_path, clip=1.0):
    return {"offload": {"params": "host", "gradients": "host", "optimizer": "nvme"},
            "tiers": {"nvme_path": str(tmp_path / "swap")}, "optimizer": {"lr": 3e-3},
            "train": {"max_grad_norm": clip, "overlap": "early" if clip is None else "none"}}  # speculated failures: tests/test_speculation.py


def run(engine, data):
    for x, y in data:
        engine.backward(engine(x, y))
        engine.step()


def reference(tmp_path, clip, skip=None):
    """Weights after training on DATA (without batch `skip`)."""
    with zerotier.initialize(model(), cfg(tmp_path, clip)) as engine:
        run(engine, [b for i, b in enumerate(DATA) if i != skip])
        return engine.parameters_fp32()


def same(a, b, what):
    for name in b:
        assert torch.equal(a[name], b[name]), f"{what}: {name} differs"


def assert_broken(engine):
    for call in (engine.step, lambda: engine.save_checkpoint("unused"),
                 lambda: engine.backward(engine(*DATA[0]))):
        with pytest.raises(ZerotierError, match="load_checkpoint"):
            call()


@pytest.fixture
def swap(tmp_path):
    (tmp_path / "swap").mkdir()
    return tmp_path


@pytest.mark.parametrize("clip", [1.0, None], ids=["step", "during-backward"])
@pytest.mark.pins("design#a-step-is-all-or-nothing")
def test_failed_write_at_every_unit_refuses_then_resumes_exactly(swap, clip):
    """ENOSPC at each of the step's 9 optimizer-state writes (3 units x master, m, v): with clipping
    in step(), without it in the updates that run during backward."""
    expected = reference(swap, clip)
    for n in range(1, 10):
        engine = zerotier.initialize(model(), cfg(swap, clip))
        run(engine, DATA[:3])
        engine.save_checkpoint(swap / "ckpt")
        fail_nth_write(engine, n)
        with pytest.raises(TierIOError, match="No space left|ENOSPC|space"):
            run(engine, DATA[3:4])
        assert not engine.window.overlap.early, "an update still queued after the error reached the caller"
        assert_broken(engine)
        engine.store.write = type(engine.store).write.__get__(engine.store)  # the disk is fixed
        engine.load_checkpoint(swap / "ckpt")
        run(engine, DATA[3:])
        same(engine.parameters_fp32(), expected, f"write {n} failed, resumed")
        engine.close()


@pytest.mark.pins("design#a-step-is-all-or-nothing")
def test_failed_read_before_any_update_leaves_the_step_retryable(swap):
    expected = reference(swap, 1.0)
    with zerotier.initialize(model(), cfg(swap)) as engine:
        run(engine, DATA[:3])
        x, y = DATA[3]
        engine.backward(engine(x, y))
        engine.unit_optimizer.state.drop_prefetched()  # the step's first read is then issued by step()
        engine.store.engine.inject_fault(op="read", errno=errno.EIO)
        with pytest.raises(TierIOError):
            engine.step()
        assert engine.window.broken is None, engine.window.broken
        assert engine.step()  # the same gradients, applied now
        run(engine, DATA[4:])
        same(engine.parameters_fp32(), expected, "retried step")


class Boom(Exception):
    pass


@pytest.mark.parametrize("clip", [1.0, None], ids=["clip", "updates-during-backward"])
@pytest.mark.parametrize("error", [Boom, KeyboardInterrupt])
@pytest.mark.pins("design#a-step-is-all-or-nothing")
# the injecting hooks sit on every module, the embedding too (no input needs a gradient): torch warns of that
@pytest.mark.filterwarnings("ignore:Full backward hook is firing when gradients are computed with respect to module "
                            "outputs:UserWarning")
def test_error_in_backward_at_every_module(swap, clip, error):
    """An exception (or Ctrl-C) raised in the backward of each module in turn, on the 4th batch.
    Nothing updated yet: zero_grad() drops the partial window, an emergency checkpoint saves, and
    a resumed run equals one that skipped the batch. Units already updated during backward: the
    engine refuses until the last checkpoint is loaded, then equals one that skipped the batch."""
    skipped = reference(swap, clip, skip=3)
    names = [name for name, m in model().named_modules() if not list(m.children())]
    outcomes = set()
    for target in names:
        engine = zerotier.initialize(model(), cfg(swap, clip))
        armed = [False]

        def hook(module, grad_output, target=target):
            if armed[0] and module is dict(engine.module.named_modules())[target]:
                raise error("injected in backward")
        for m in engine.module.modules():
            m.register_full_backward_pre_hook(hook)
        run(engine, DATA[:3])
        engine.save_checkpoint(swap / "ckpt")
        armed[0] = True
        with pytest.raises(error):
            run(engine, DATA[3:4])
        armed[0] = False
        assert not engine.window.overlap.early, "an update still queued after the error reached the caller"
        if engine.window.broken is not None:
            outcomes.add("refused")
            assert_broken(engine)
            engine.load_checkpoint(swap / "ckpt")
        else:
            outcomes.add("dropped")
            with pytest.raises(ZerotierError, match="zero_grad"):
                engine.step()
            engine.zero_grad()
            engine.save_checkpoint(swap / "emergency")  # at the window boundary again
            engine.close()
            engine = zerotier.initialize(model(), cfg(swap, clip))
            engine.load_checkpoint(swap / "emergency")
        run(engine, DATA[4:])
        same(engine.parameters_fp32(), skipped, f"{error.__name__} in the backward of {target}")
        engine.close()
    expected = {"dropped", "refused"} if clip is None else {"dropped"}
    assert outcomes == expected, outcomes


@pytest.mark.parametrize("n", [1, 2, 3])
def test_ctrl_c_inside_step_between_units(swap, n):
    """Ctrl-C during the n-th unit's commit (after its Adam ran): the step is refused as a whole and
    an emergency save is refused too (it would hold a half-applied step); loading the last
    checkpoint resumes exactly."""
    expected = reference(swap, 1.0)
    engine = zerotier.initialize(model(), cfg(swap))
    run(engine, DATA[:3])
    engine.save_checkpoint(swap / "ckpt")
    commit, calls = engine.params.commit, [0]

    def interrupted(unit):
        calls[0] += 1
        if calls[0] == n:
            raise KeyboardInterrupt
        return commit(unit)
    engine.params.commit = interrupted
    with pytest.raises(KeyboardInterrupt):
        run(engine, DATA[3:4])
    engine.params.commit = commit
    assert_broken(engine)
    engine.load_checkpoint(swap / "ckpt")
    run(engine, DATA[3:])
    same(engine.parameters_fp32(), expected, f"Ctrl-C at unit {n} of the step, resumed")
    engine.close()


@pytest.mark.parametrize("n", [1, 2, 3])
def test_failed_parameter_write_back_is_never_trained_on(swap, n):
    """[Note: a failed write-back] in params_writes.py: the n-th parameter write-back of a step fails
    (ENOSPC). Waited inside step() (units 1-2: the write queue is full), the engine is broken and
    a checkpoint resumes exactly; surfaced by the unit's next fetch after step() returned (unit 3),
    the retry trains from the fp32 master, never from the stale file (it did before: 7e-3 off)."""
    nvme = {"offload": {"params": "nvme", "gradients": "host", "optimizer": "nvme"},
            "tiers": {"nvme_path": str(swap / "swap")}, "optimizer": {"lr": 3e-3}, "prefetch": {"enabled": False}}
    with zerotier.initialize(model(), nvme) as engine:
        run(engine, DATA)
        expected = engine.parameters_fp32()
    with zerotier.initialize(model(), nvme) as engine:
        run(engine, DATA[:3])
        engine.save_checkpoint(swap / "ckpt")
        fail_nth_write(engine, n, suffix=".param")
        raised = []
        for x, y in DATA[3:]:
            for _attempt in range(2):
                try:
                    engine.backward(engine(x, y))
                    engine.step()
                    break
                except TierIOError as exc:
                    raised.append(str(exc))
                    if engine.window.broken is not None:
                        assert_broken(engine)
                        engine.load_checkpoint(swap / "ckpt")
                        run(engine, DATA[3:4])
                        break
                    engine.zero_grad()  # a forward's fetch refused: nothing was updated, retry
        assert len(raised) == 1 and "No space left" in raised[0]
        same(engine.parameters_fp32(), expected, f"parameter write-back {n} failed")
        for name, value in engine.module.state_dict().items():
            if name in expected:
                assert torch.equal(value, expected[name]), name
