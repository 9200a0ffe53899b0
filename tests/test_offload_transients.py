"""GPU review N13: transient device buffers are either not made or counted by the plan.

The optimizer-on-device path calls torch's fused Adam(W) kernel; its arguments are checked on
the CPU, where the same kernel exists (torch >= 2.4)."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import zerotier
from zerotier.optim.rules import adamw
from zerotier.optim.rules.adamw import _fused_adam

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)


class NewTensors(TorchDispatchMode):
    """Records the size of every tensor an op returns in fresh memory (not one of its inputs)."""

    def __init__(self):
        super().__init__()
        self.sizes: list[tuple[str, int]] = []
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append(str(func))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.sizes.append((str(func), t.numel()))
        return out

    def largest(self) -> int:
        return max((n for _, n in self.sizes), default=0)


@pytest.mark.parametrize("fused_ref", [False, True])
def test_fused_adam_matches_torch_adamw_with_clipping_and_loss_scale(fused_ref):
    """Loss-scaled gradients, unscaled and clipped as the engine does it (one grad_scale =
    clip / loss scale, handed to the kernel, which divides), against torch: GradScaler-style
    unscale, clip_grad_norm_, AdamW. The moments match torch's too, so the scale is applied
    once and the right way round; the gradient is left scaled in place (no copy)."""
    n, loss_scale, max_norm = 1000, 1024.0, 0.5
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(n, generator=gen)
    ref = p0.clone().requires_grad_(True)
    opt = torch.optim.AdamW([ref], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                            weight_decay=HYPER["weight_decay"], fused=fused_ref)
    master, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=torch.bfloat16)
    clipped = 0
    for step in range(1, 6):
        scaled = torch.randn(n, generator=gen) * (1 + step) * loss_scale  # what backward of loss * scale gives
        ref.grad = scaled / loss_scale
        torch.nn.utils.clip_grad_norm_([ref], max_norm)
        opt.step()
        norm = scaled.double().norm().item() / loss_scale  # the engine's grad_norm()
        clip = min(1.0, max_norm / (norm + 1e-6))
        clipped += clip < 1.0
        grad = scaled.clone()
        _fused_adam(master, m, v, grad, out, step=step, decoupled=True, bias_correction=True,
                    grad_scale=clip / loss_scale, **HYPER)
        torch.testing.assert_close(grad, ref.grad, rtol=1e-6, atol=0)  # read in place, left unscaled + clipped
    assert clipped == 5
    state = opt.state[ref]
    torch.testing.assert_close(m, state["exp_avg"], rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(v, state["exp_avg_sq"], rtol=1e-5, atol=1e-10)
    torch.testing.assert_close(master, ref.detach(), rtol=1e-6, atol=1e-7)
    assert torch.equal(out, master.to(torch.bfloat16))


def test_fused_adam_makes_no_copy_of_an_fp32_gradient():
    """No tensor of the gradient's size is created: the scale travels to the kernel (before,
    `grad.float() * grad_scale` made a full fp32 copy on the device whenever clipping or a
    loss scale was on)."""
    n = 4096
    master, m, v, grad = torch.randn(n), torch.zeros(n), torch.zeros(n), torch.randn(n)
    out = torch.empty(n, dtype=torch.bfloat16)
    with NewTensors() as seen:
        _fused_adam(master, m, v, grad, out, step=1, decoupled=True, bias_correction=True, grad_scale=0.25,
                    **HYPER)
    assert "aten._fused_adamw_.default" in seen.ops
    assert seen.largest() <= 1, seen.sizes  # the step count and the divisor only


@pytest.mark.parametrize("case", ["bf16-gradient", "kept-fp32-gradient"])
def test_a_gradient_the_kernel_cannot_consume_is_copied_a_chunk_at_a_time(case, monkeypatch):
    """A bf16 gradient (the kernel reads fp32) or one read again after the update (an early
    step's: keep_grad) is cast or scaled CAST_CHUNK elements at a time, so the device holds at
    most fused_temp_bytes() more; the result is bitwise the one-piece copy's, and a kept
    gradient is unchanged."""
    n = 1000
    gen = torch.Generator().manual_seed(1)
    grad = torch.randn(n, generator=gen)
    if case == "bf16-gradient":
        grad, keep = grad.bfloat16(), False
    else:
        keep = True
    before = grad.clone()
    results = []
    for chunk in (n, 256):
        monkeypatch.setattr(adamw, "CAST_CHUNK", chunk)
        master, m, v = torch.randn(n, generator=torch.Generator().manual_seed(2)), torch.zeros(n), torch.zeros(n)
        with NewTensors() as seen:
            for step in (1, 2):
                _fused_adam(master, m, v, grad, None, step=step, decoupled=True, bias_correction=True,
                            grad_scale=0.125, keep_grad=keep, **HYPER)
        assert seen.largest() <= chunk and adamw.fused_temp_bytes() == 4 * chunk
        results.append((master, m, v))
        assert torch.equal(grad, before)
    for a, b in zip(*results):
        assert torch.equal(a, b)


# --- the plan's device term covers the transient buffers (2 gloo ranks) ---------------------------

PLACEMENTS = {
    "zero3-params-nvme": (3, {"params": "nvme", "gradients": "host", "optimizer": "host"}),
    "zero3-params-host": (3, {"params": "host", "gradients": "device", "optimizer": "device"}),
    "zero2-device": (2, {"params": "device", "gradients": "device", "optimizer": "device"}),
    "zero1-params-host": (1, {"params": "host", "gradients": "host", "optimizer": "host"}),
}


def exact_device_budget_rank(rank, world_size, nvme_dir):
    """Each placement trains with tiers.device set to exactly the plan's device need; returns the
    names of the device-tier allocations made while training, the need and the tier's peak."""
    from zerotier.models import TinyGPT, batches

    out = {}
    for name, (stage, offload) in PLACEMENTS.items():
        cfg = {"zero": {"stage": stage, "persistence_threshold": 200, "reduce_bucket_size": 4096,
                        "allgather_bucket_size": 4096},
               "offload": offload, "tiers": {"nvme_path": nvme_dir}, "prefetch": {"lookahead": 2},
               "train": {"max_grad_norm": 1.0}}
        torch.manual_seed(0)
        with zerotier.initialize(TinyGPT(vocab=64, dim=32, layers=3, heads=2, seq=16), cfg) as engine:
            need = engine.plan.need["device"]
        cfg["tiers"]["device"] = need
        torch.manual_seed(0)
        with zerotier.initialize(TinyGPT(vocab=64, dim=32, layers=3, heads=2, seq=16), cfg) as engine:
            tier, names = engine.device_tier, set()
            real_alloc = tier.alloc

            def alloc(shape, dtype, what=""):
                names.add(what)
                return real_alloc(shape, dtype, what)
            tier.alloc = alloc
            for x, y in batches(64, 16, 2, 3, seed=rank):
                engine.backward(engine(x, y))
                engine.step()
            out[name] = (sorted(names), need, tier.peak)
    return out


def test_the_plans_device_term_covers_the_transient_buffers(tmp_path):
    """GPU review N13(b): the collectives' bucket buffers and the ZeRO-3 shards staged for their
    gather are allocated from the device tier (before: plain torch.empty, outside tiers.device),
    and the plan counts them: with tiers.device at exactly the plan's need every placement trains.
    (On the CPU suite's lagging device the ZeRO-3 shard is copied to a device buffer as on a GPU.)"""
    from zerotier.dist import spawn

    for results in spawn(exact_device_budget_rank, 2, str(tmp_path), timeout_s=600):
        for name, (names, need, peak) in results.items():
            assert peak <= need, name
            assert "collective bucket" in names, (name, names)
            if name.startswith("zero3-"):
                assert any(n.endswith(" shard") for n in names), (name, names)


def test_the_plan_counts_the_cuda_only_transients():
    """The terms that exist only with a CUDA device (the CPU computes in host memory): the fused
    Adam kernel's gradient chunk with the optimizer on the device, and the casts of fresh NVMe
    gradients to grad_dtype at ZeRO-2 with several ranks. Each is exactly the store's own figure,
    and a device budget one byte short of the plan does not fit."""
    from zerotier.config import OffloadConfig, PrecisionConfig, ZeroConfig
    from zerotier.grads import GradStore
    from zerotier.planner.inputs import ModelFacts, Node, PlanConfig
    from zerotier.planner.messages import PlanDoesNotFit
    from zerotier.planner.planner import make_plan

    numels, big = [5000, 3000, 1000], 1 << 40

    def plan(device, offload, dev_budget=big, world_size=1, stage=0):
        return make_plan(ModelFacts.of_sizes(numels),
                         PlanConfig(offload=OffloadConfig(**offload), zero=ZeroConfig(stage=stage), alignment=4096,
                                    precision=PrecisionConfig(param_dtype="bf16", grad_dtype="fp32")),
                         Node(torch.device(device), budgets={"device": dev_budget, "host": big, "nvme": big},
                              world_size=world_size))
    on_device = {"params": "device", "gradients": "device", "optimizer": "device"}
    nvme_grads = {"params": "device", "gradients": "nvme", "optimizer": "host"}
    cases = [(on_device, {}, adamw.fused_temp_bytes()),
             (nvme_grads, dict(world_size=2, stage=2), GradStore.nvme_conversion_bytes(5000, 2, 4, 2, 2))]
    for placement, kw, term in cases:
        assert term > 0
        cuda = plan("cuda", placement, **kw)
        assert cuda.need["device"] - plan("cpu", placement, **kw).need["device"] == term
        plan("cuda", placement, cuda.need["device"], **kw)
        with pytest.raises(PlanDoesNotFit):
            plan("cuda", placement, cuda.need["device"] - 1, **kw)
