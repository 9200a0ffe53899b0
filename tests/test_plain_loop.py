"""The plain PyTorch loop ([Note: the plain PyTorch loop] in window.py): loss.backward(),
engine.optimizer.step(), engine.optimizer.zero_grad() train exactly like engine.backward/step,
and like torch.optim.AdamW, under every placement; lr schedulers drive engine.optimizer."""
from __future__ import annotations

import pytest
import torch

import zerotier
from zerotier.errors import ZerotierError
from zerotier.models import batches

from reference_runs import tiny_gpt

STEPS, ACCUM, CLIP, LR = 6, 2, 1.0, 3e-3
PLACEMENTS = {
    "all-device": {"params": "device", "gradients": "device", "optimizer": "device"},
    "optimizer-nvme": {"params": "device", "gradients": "host", "optimizer": "nvme"},
    "params-host": {"params": "host", "gradients": "host", "optimizer": "host"},
    "params-nvme": {"params": "nvme", "gradients": "host", "optimizer": "nvme"},
}


def data():
    return list(batches(64, 16, 4, STEPS * ACCUM))


def torch_reference():
    m = tiny_gpt()
    opt = torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
    for i, (x, y) in enumerate(data()):
        (m(x, y) / ACCUM).backward()
        if (i + 1) % ACCUM == 0:
            torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
            sched.step()
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def cfg(placement, tmp_path, accum=1):
    return {"offload": PLACEMENTS[placement], "tiers": {"nvme_path": str(tmp_path)},
            "optimizer": {"lr": LR, "weight_decay": 0.01}, "train": {"max_grad_norm": CLIP, "grad_accum_steps": accum}}


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_plain_loop_matches_the_engine_loop_and_torch(placement, tmp_path):
    m = tiny_gpt()
    engine = zerotier.initialize(m, cfg(placement, tmp_path))
    opt = engine.optimizer
    assert isinstance(opt, torch.optim.Optimizer)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
    for i, (x, y) in enumerate(data()):
        loss = m(x, y)  # the plain module call: the engine's hooks are on it
        (loss / ACCUM).backward()
        if (i + 1) % ACCUM == 0:
            opt.step()
            opt.zero_grad()
            sched.step()
    assert engine.global_steps == STEPS
    plain = engine.parameters_fp32()
    engine.close()

    with zerotier.initialize(tiny_gpt(), cfg(placement, tmp_path, accum=ACCUM)) as engine:
        sched = torch.optim.lr_scheduler.StepLR(engine.optimizer, 2, gamma=0.5)
        for x, y in data():
            engine.backward(engine(x, y))
            if engine.step():
                sched.step()
        ours = engine.parameters_fp32()
    reference = torch_reference()
    for name in reference:
        assert torch.equal(plain[name], ours[name]), f"{name}: plain loop differs from the engine loop"
        torch.testing.assert_close(plain[name], reference[name], rtol=1e-5, atol=1e-6, msg=name)


def test_mixing_loop_styles_in_a_window_is_refused(tmp_path):
    m = tiny_gpt()
    with zerotier.initialize(m, cfg("params-host", tmp_path)) as engine:
        x, y = data()[0]
        m(x, y).backward()
        with pytest.raises(ZerotierError, match="call engine.optimizer.step"):
            engine.step()
        with pytest.raises(ZerotierError, match="one loop style per window"):
            engine.backward(m(x, y))
        engine.optimizer.step()
        engine.backward(engine(x, y))
        with pytest.raises(ZerotierError, match="call engine.step"):
            engine.optimizer.step()
        assert engine.step()


def test_plain_backward_that_dies_half_way_is_dropped_not_applied(tmp_path):
    m = tiny_gpt()
    with zerotier.initialize(m, cfg("params-host", tmp_path)) as engine:
        x, y = data()[0]
        armed = [True]

        def boom(module, grad_output):
            if armed[0]:
                raise RuntimeError("injected")
        handle = m.blocks[0].register_full_backward_pre_hook(boom)
        with pytest.raises(RuntimeError, match="injected"):
            m(x, y).backward()
        armed[0] = False
        with pytest.raises(ZerotierError, match="zero_grad"):
            m(x, y).backward()
        engine.optimizer.zero_grad()
        m(x, y).backward()
        engine.optimizer.step()
        assert engine.global_steps == 1
        handle.remove()
