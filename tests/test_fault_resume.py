"""An I/O error on a swap file mid-training gives a clear error; training resumes from the
last checkpoint and continues exactly as an uninterrupted run."""
import errno

import pytest
import torch

import zerotier
from zerotier.errors import TierIOError
from zerotier.models import TinyGPT, batches

CFG = {"offload": {"params": "host", "gradients": "host", "optimizer": "nvme"},
       "train": {"grad_accum_steps": 2, "max_grad_norm": 1.0}, "optimizer": {"lr": 3e-3}}


def model():
    torch.manual_seed(0)
    return TinyGPT(vocab=64, dim=32, layers=2, heads=2, seq=16)


def run(engine, data):
    for x, y in data:
        engine.backward(engine(x, y))
        engine.step()


def uninterrupted(cfg, data):
    """The weights after `data` with no fault: what each recovery must reach, bitwise."""
    with zerotier.initialize(model(), cfg) as engine:
        run(engine, data)
        return engine.parameters_fp32()


def test_eio_on_swap_file_then_resume_from_checkpoint(tmp_path):
    data = list(batches(64, 16, 2, 16))
    cfg = {**CFG, "tiers": {"nvme_path": str(tmp_path / "swap")}}
    (tmp_path / "swap").mkdir()

    expected = uninterrupted(cfg, data)

    engine = zerotier.initialize(model(), cfg)
    run(engine, data[:8])
    engine.save_checkpoint(tmp_path / "ckpt")
    engine.store.engine.inject_fault(op="write", errno=errno.EIO, count=1)
    with pytest.raises(TierIOError) as info:
        run(engine, data[8:10])
    assert info.value.errno == errno.EIO and "nvme tier" in str(info.value) and ".swp" in str(info.value)
    with pytest.warns(RuntimeWarning, match=r"not put back into the model: engine\.step\(\) failed"):
        engine.close()

    with zerotier.initialize(model(), cfg) as resumed:
        resumed.load_checkpoint(tmp_path / "ckpt")
        run(resumed, data[8:])
        got = resumed.parameters_fp32()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def test_eio_in_an_update_during_backward_surfaces_in_that_step(tmp_path):
    """Without clipping, units are updated on the optimizer thread during backward and their NVMe
    writes are left in flight; a failed write still raises from the engine.step() of that step.
    One unit: its write is the last of the backward, so nothing but step() itself can see it."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 16)
    cfg = {"offload": {"params": "device", "gradients": "host", "optimizer": "nvme"},
           "tiers": {"nvme_path": str(tmp_path)}, "optimizer": {"lr": 3e-3}, "train": {"overlap": "early"}}
    x = torch.randn(4, 16)
    engine = zerotier.initialize(layer, cfg)
    engine.backward(engine(x).square().mean())
    engine.step()
    engine.store.engine.inject_fault(op="write", errno=errno.EIO, count=1)
    engine.backward(engine(x).square().mean())
    assert engine.window.overlap.early, "the update must have started during backward"
    with pytest.raises(TierIOError) as info:
        engine.step()
    assert info.value.errno == errno.EIO and ".swp" in str(info.value)
    with pytest.warns(RuntimeWarning, match=r"not put back into the model: engine\.step\(\) failed"):
        engine.close()


NVME_ALL = {"offload": {"params": "nvme", "gradients": "host", "optimizer": "nvme"},
            "train": {"grad_accum_steps": 1, "max_grad_norm": 1.0}, "optimizer": {"lr": 3e-3}}


def test_transient_read_error_is_not_raised_again_by_the_next_attempt(tmp_path, monkeypatch):
    """Hostile #24: reads that fail while a permission is wrong (simulated: EACCES on the reads
    of units 1 and 2, both prefetched while unit 0 computes) fail the forward that needs them;
    once the cause is gone, the very next attempt works — the prefetch of unit 2 that failed
    during the first attempt is read afresh, not re-raised — and training is bitwise the run
    that never failed."""
    data = list(batches(64, 16, 2, 6))
    cfg = {**NVME_ALL, "tiers": {"nvme_path": str(tmp_path)}, "prefetch": {"lookahead": 2}}
    expected = uninterrupted(cfg, data)
    with zerotier.initialize(model(), cfg) as engine:
        assert len(engine.units) == 3
        run(engine, data[:3])
        real_read, denied = engine.store.read, {"u00001.param", "u00002.param"}

        def read(key, *a, **k):
            if key in denied:
                raise TierIOError(errno.EACCES, f"nvme tier: read of shard {key!r}: Permission denied")
            return real_read(key, *a, **k)
        monkeypatch.setattr(engine.store, "read", read)
        x, y = data[3]
        with pytest.raises(TierIOError) as info:
            engine.backward(engine(x, y))
        assert info.value.errno == errno.EACCES and "u00001.param" in str(info.value)
        stale = engine.params.slots[2].fetch
        assert stale is not None and isinstance(stale.future.exception(), TierIOError)  # the setup
        denied.clear()                      # the permission is back
        run(engine, data[3:])               # the first retry succeeds
        got = engine.parameters_fp32()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def test_load_checkpoint_after_a_failed_step_is_not_failed_by_a_stale_read(tmp_path):
    """Hostile #24, the documented recovery: the optimizer state reads issued ahead of a step
    that then failed are dropped with their errors; load_checkpoint works at the first try."""
    data = list(batches(64, 16, 2, 6))
    cfg = {**NVME_ALL, "offload": {**NVME_ALL["offload"], "params": "host"}, "tiers": {"nvme_path": str(tmp_path)}}
    expected = uninterrupted(cfg, data)
    with zerotier.initialize(model(), cfg) as engine:
        run(engine, data[:3])
        engine.save_checkpoint(tmp_path / "ckpt")
        x, y = data[3]
        engine.store.engine.inject_fault(op="read", errno=errno.EIO, count=6)
        engine.backward(engine(x, y))  # issues the optimizer state reads ahead of the step
        with pytest.raises(TierIOError):
            engine.step()
        engine.store.engine.clear_faults()
        engine.load_checkpoint(tmp_path / "ckpt")
        run(engine, data[3:])
        got = engine.parameters_fp32()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
