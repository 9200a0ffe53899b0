"""CPU Adam kernels and CPUAdamW against torch.optim.AdamW / Adam.

Tolerance (stated once, used everywhere): after 100 steps at lr=1e-2 on N(0,1)
parameters, |ours - torch| <= 1e-5*|torch| + 5e-6. The kernels compute the same
formula as torch's fused CPU AdamW; differences come from FMA contraction and
operation order (a few ulp of the per-step update, accumulated). The gradient
sum of squares (grad_sumsq, the global norm's pass): 1e-6 relative to the double sum.
"""
import math

import pytest
import torch

import zerotier.optim as zo
from zerotier.errors import ZerotierError
from zerotier.optim import _kernels

RTOL, ATOL = 1e-5, 5e-6
LEVELS = zo.simd_levels_available() + ["python"]
SIZES = [1, 15, 17, 1023, 10**6 + 3]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def test_native_library_and_simd_paths_present():
    """CI runs on x86-64 with AVX2 at least: the scalar and a SIMD path must both be exercised."""
    assert zo.native_available(), "native _zt_cpu did not load; was the package built?"
    assert "scalar" in LEVELS and ("avx2" in LEVELS or "avx512" in LEVELS), LEVELS


@pytest.fixture
def use_level(monkeypatch):
    """Return a function that makes adam_step use one SIMD level (or the Python oracle)."""
    def use(level):
        if level == "python":
            monkeypatch.setattr(_kernels, "_lib", lambda: None)
            return "auto"
        return level
    return use


def run_pair(level_simd, size, grad_dtype, steps=100, weight_decay=1e-2, decoupled=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ours = torch.randn(size, generator=gen)
    ref = ours.clone().requires_grad_(True)
    ours.requires_grad_(True)
    cls, ref_cls = (zo.CPUAdamW, torch.optim.AdamW) if decoupled else (zo.CPUAdam, torch.optim.Adam)
    opt = cls([ours], lr=1e-2, weight_decay=weight_decay, simd=level_simd)
    ref_opt = ref_cls([ref], lr=1e-2, weight_decay=weight_decay)
    for _ in range(steps):
        g = torch.randn(size, generator=gen).to(grad_dtype)
        ours.grad = g.float() if grad_dtype == torch.float32 else None
        if grad_dtype != torch.float32:
            # The kernel reads the low-precision gradient directly.
            _step_with_grad(opt, ours, g)
        else:
            opt.step()
        ref.grad = g.float()
        ref_opt.step()
    return ours.detach(), ref.detach(), opt, ref_opt


def _step_with_grad(opt, p, grad):
    group = opt.param_groups[0]
    state = opt._init_state(p)
    state["step"] += 1
    zo.adam_step(p.data, state["exp_avg"], state["exp_avg_sq"], grad, step=int(state["step"]),
                 lr=group["lr"], beta1=group["betas"][0], beta2=group["betas"][1], eps=group["eps"],
                 weight_decay=group["weight_decay"], decoupled=opt.decoupled, simd=opt.simd)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("grad_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("size", SIZES)
def test_adamw_matches_torch(level, grad_dtype, size, use_level):
    ours, ref, opt, ref_opt = run_pair(use_level(level), size, grad_dtype)
    torch.testing.assert_close(ours, ref, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(opt.state[next(iter(opt.state))]["exp_avg_sq"],
                               ref_opt.state[next(iter(ref_opt.state))]["exp_avg_sq"], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam-l2"])
def test_weight_decay_modes_match_torch(level, weight_decay, decoupled, use_level):
    ours, ref, _, _ = run_pair(use_level(level), 4099, torch.float32, weight_decay=weight_decay, decoupled=decoupled)
    torch.testing.assert_close(ours, ref, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("level", [lv for lv in LEVELS if lv != "python"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("size", [1, 17, 1023, 65536 * 3 + 5])
def test_fused_output_is_round_to_nearest_even(level, out_dtype, size):
    """param_out must equal torch's own RNE cast of the updated master, bit for bit,
    across a wide exponent range (including fp16 subnormals and overflow to inf);
    an fp32 param_out is the master itself."""
    gen = torch.Generator().manual_seed(1)
    master = torch.randn(size, generator=gen) * torch.exp2(torch.randint(-30, 18, (size,), generator=gen).float())
    m, v = torch.zeros(size), torch.zeros(size)
    out = torch.empty(size, dtype=out_dtype)
    zo.adam_step(master, m, v, torch.randn(size, generator=gen), step=1, lr=1e-3, beta1=0.9, beta2=0.999,
                 eps=1e-8, weight_decay=0.0, param_out=out, simd=level)
    expected = master.to(out_dtype)
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))  # bits, so NaN/inf compare too


@pytest.mark.parametrize("level", [lv for lv in LEVELS if lv != "python"])
def test_simd_matches_scalar_oracle_and_python_oracle(level):
    size = 70001
    gen = torch.Generator().manual_seed(2)
    bufs = {name: [torch.randn(size, generator=gen).abs() if name == "v" else torch.randn(size, generator=gen)]
            for name in ("p", "m", "v")}
    for name in bufs:
        bufs[name] += [bufs[name][0].clone(), bufs[name][0].clone()]
    g = torch.randn(size, generator=gen).bfloat16()
    kw = dict(step=7, lr=3e-3, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.05, grad_scale=0.5)
    zo.adam_step(bufs["p"][0], bufs["m"][0], bufs["v"][0], g, simd=level, **kw)
    zo.adam_step(bufs["p"][1], bufs["m"][1], bufs["v"][1], g, simd="scalar", **kw)
    zo.adam_step_reference(bufs["p"][2], bufs["m"][2], bufs["v"][2], g, **kw)
    for name in bufs:
        torch.testing.assert_close(bufs[name][0], bufs[name][1], rtol=2e-6, atol=1e-7)
        torch.testing.assert_close(bufs[name][1], bufs[name][2], rtol=2e-6, atol=1e-7)


def test_bias_correction_off_matches_oracle():
    gen = torch.Generator().manual_seed(3)
    p = torch.randn(1000, generator=gen)
    ref = p.clone()
    m, v, mr, vr = (torch.zeros(1000) for _ in range(4))
    for step in range(1, 11):
        g = torch.randn(1000, generator=gen)
        kw = dict(step=step, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, bias_correction=False)
        zo.adam_step(p, m, v, g, **kw)
        zo.adam_step_reference(ref, mr, vr, g, **kw)
    torch.testing.assert_close(p, ref, rtol=1e-6, atol=1e-7)


def test_threads_do_not_change_results():
    size = 10**6 + 3
    gen = torch.Generator().manual_seed(4)
    base = [torch.randn(size, generator=gen) for _ in range(3)]
    base[2].abs_()
    g = torch.randn(size, generator=gen)
    results = []
    for threads in (1, 2, 3):
        p, m, v = (b.clone() for b in base)
        zo.adam_step(p, m, v, g, step=3, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                     threads=threads)
        results.append((p, m, v))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


def test_grad_scale_and_nonfinite_count():
    p, m, v = torch.ones(100), torch.zeros(100), torch.zeros(100)
    g = torch.full((100,), 4.0)
    g[3], g[50], g[99] = float("inf"), float("nan"), float("-inf")
    count = zo.adam_step(p, m, v, g, step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                         grad_scale=0.25)
    assert count == 3
    assert torch.allclose(m[0], torch.tensor(0.1))  # (1 - beta1) * 4 * 0.25


def test_sub_range_update_leaves_rest_untouched():
    p, m, v, g = torch.randn(1000), torch.zeros(1000), torch.zeros(1000), torch.randn(1000)
    before = p.clone()
    zo.adam_step(p[100:300], m[100:300], v[100:300], g[100:300], step=1, lr=1e-2, beta1=0.9, beta2=0.999,
                 eps=1e-8, weight_decay=0.0)
    assert torch.equal(p[:100], before[:100]) and torch.equal(p[300:], before[300:])
    assert not torch.equal(p[100:300], before[100:300])


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_params_keep_fp32_master(param_dtype):
    gen = torch.Generator().manual_seed(5)
    master = torch.randn(5000, generator=gen)
    p = master.to(param_dtype).requires_grad_(True)
    ref = p.detach().float().requires_grad_(True)
    opt, ref_opt = zo.CPUAdamW([p], lr=1e-2), torch.optim.AdamW([ref], lr=1e-2)
    for _ in range(20):
        g = torch.randn(5000, generator=gen).to(param_dtype)
        p.grad, ref.grad = g, g.float()
        opt.step()
        ref_opt.step()
    torch.testing.assert_close(opt.state[p]["master_param"], ref.detach(), rtol=RTOL, atol=ATOL)
    assert torch.equal(p.detach(), opt.state[p]["master_param"].to(param_dtype))


def test_state_dict_round_trips_with_torch_adamw():
    gen = torch.Generator().manual_seed(6)
    w1 = torch.randn(300, generator=gen, requires_grad=True)
    w2 = w1.detach().clone().requires_grad_(True)
    ref = torch.optim.AdamW([w1], lr=1e-2)
    for _ in range(5):
        w1.grad = torch.randn(300, generator=gen)
        ref.step()
    ours = zo.CPUAdamW([w2], lr=1e-2)
    ours.load_state_dict(ref.state_dict())
    w2.data.copy_(w1.detach())
    assert set(ours.state[w2]) == {"step", "exp_avg", "exp_avg_sq"}
    for _ in range(5):
        g = torch.randn(300, generator=gen)
        w1.grad, w2.grad = g, g.clone()
        ref.step()
        ours.step()
    torch.testing.assert_close(w2, w1, rtol=RTOL, atol=ATOL)
    # and back: torch AdamW accepts our state dict
    again = torch.optim.AdamW([w1], lr=1e-2)
    again.load_state_dict(ours.state_dict())
    assert float(again.state[w1]["step"]) == 10.0


def test_lr_scheduler_drives_lr():
    w = torch.zeros(10, requires_grad=True)
    opt = zo.CPUAdamW([w], lr=1.0, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(3):
        w.grad = torch.ones(10)
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.125)
    # Adam's first steps move each weight by ~lr: 1 + 0.5 + 0.25
    assert float(w.detach()[0]) == pytest.approx(-1.75, rel=1e-4)


def test_param_groups_use_their_own_hyperparameters():
    a, b = torch.ones(4, requires_grad=True), torch.ones(4, requires_grad=True)
    opt = zo.CPUAdamW([{"params": [a], "lr": 0.1}, {"params": [b], "lr": 0.0}], weight_decay=0.0)
    a.grad, b.grad = torch.ones(4), torch.ones(4)
    opt.step()
    assert float(a.detach()[0]) == pytest.approx(0.9) and float(b.detach()[0]) == 1.0


@pytest.mark.parametrize("kwargs, match", [
    ({"amsgrad": True}, "amsgrad"),
    ({"maximize": True}, "maximize"),
    ({"fused": True}, "fused"),
    ({"simd": "avx9000"}, "unknown simd"),
])
def test_unsupported_options_are_errors(kwargs, match):
    with pytest.raises((ZerotierError, ValueError), match=match):
        zo.CPUAdamW([torch.zeros(2, requires_grad=True)], **kwargs)


def test_unknown_keyword_is_type_error():
    with pytest.raises(TypeError, match="amsgrd"):
        zo.CPUAdamW([torch.zeros(2, requires_grad=True)], amsgrd=True)


def test_bad_buffers_are_clear_errors():
    p, m, v, g = (torch.zeros(8) for _ in range(4))
    kw = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    with pytest.raises(ZerotierError, match="not contiguous"):
        zo.adam_step(torch.zeros(16)[::2], m, v, g, **kw)
    with pytest.raises(ZerotierError, match="grad has 7 elements"):
        zo.adam_step(p, m, v, torch.zeros(7), **kw)
    with pytest.raises(ZerotierError, match="exp_avg has dtype"):
        zo.adam_step(p, m.double(), v, g, **kw)
    with pytest.raises(ZerotierError, match="step must be >= 1"):
        zo.adam_step(p, m, v, g, **{**kw, "step": 0})
    w_t = torch.zeros(4, 4).t().requires_grad_(True)  # non-contiguous leaf: refuse, never update a copy
    opt = zo.CPUAdamW([w_t])
    w_t.grad = torch.ones(4, 4)
    with pytest.raises(ZerotierError, match="not contiguous"):
        opt.step()


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("size", [0, 1, 7, 4095, 4097, 100_003, 300_007])
def test_grad_sumsq_matches_double_reference_and_propagates_nonfinite(level, dtype, size, use_level):
    """The global norm's sum of squares of grad * scale, at every SIMD level: within 1e-6 of the
    double sum (float partial sums per 4096-element block), over lengths that leave vector and
    scalar tails (300_007 spreads over 4 threads); an inf or a NaN anywhere (first, middle, last
    element: the tail) makes it inf or NaN."""
    simd = use_level(level)
    grad = (torch.randn(size, generator=torch.Generator().manual_seed(size)) * 3).to(dtype)
    scale = 0.37
    expected = float(((grad.double() * scale) ** 2).sum())
    assert zo.grad_sumsq(grad, scale=scale, threads=4, simd=simd) == pytest.approx(expected, rel=1e-6, abs=0)
    for at in sorted({0, size // 2, size - 1} if size else set()):
        bad = grad.clone()
        bad[at] = float("-inf")
        assert zo.grad_sumsq(bad, scale=scale, threads=4, simd=simd) == float("inf"), at
        bad[size - 1 - at] = float("nan")
        assert math.isnan(zo.grad_sumsq(bad, scale=scale, threads=4, simd=simd)), at


@pytest.mark.parametrize("level", [lv for lv in LEVELS if lv != "python"])
def test_multi_tensor_call_equals_one_call_per_tensor_for_any_thread_count(level):
    """One native call over many buffers splits the concatenated range across threads;
    every element must get exactly the arithmetic of a per-tensor call, bit for bit."""
    sizes = [1, 15, 70001, 17, 1023, 200003, 33]
    gen = torch.Generator().manual_seed(7)
    base = [[torch.randn(n, generator=gen) for n in sizes] for _ in range(3)]
    grads = [torch.randn(n, generator=gen).bfloat16() for n in sizes]
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, simd=level)
    expected = [[t.clone() for t in b] for b in base]
    for i in range(len(sizes)):
        zo.adam_step(expected[0][i], expected[1][i], expected[2][i].abs_(), grads[i], step=3, threads=1, **kw)
    for threads in (1, 2, 3, 5):
        got = [[t.clone() for t in b] for b in base]
        for t in got[2]:
            t.abs_()
        outs = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
        zo.adam_step_multi([(got[0][i], got[1][i], got[2][i], grads[i], outs[i]) for i in range(len(sizes))],
                           step=[3] * len(sizes), threads=threads, **kw)
        for e, g in zip(expected, got):
            for a, b in zip(e, g):
                assert torch.equal(a, b), f"threads={threads}"
        for o, p in zip(outs, got[0]):
            assert torch.equal(o, p.bfloat16())


@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_device_optimizer_fused_call_matches_torch_adam(decoupled, grad_dtype):
    """The optimizer-on-GPU path calls torch's fused Adam(W) kernel; its arguments (step count,
    gradient scale, L2 vs decoupled decay, the low-precision output) are checked here on the CPU,
    where the same kernel exists, against torch.optim with the same hyper-parameters."""
    from zerotier.optim.rules.adamw import _fused_adam

    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(1000, generator=gen)
    ref = p0.clone().requires_grad_(True)
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls([ref], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    master, m, v = p0.clone(), torch.zeros(1000), torch.zeros(1000)
    out = torch.empty(1000, dtype=torch.bfloat16)
    for step in range(1, 6):
        g = torch.randn(1000, generator=gen).to(grad_dtype)
        ref.grad = g.float() * 0.5
        opt.step()
        _fused_adam(master, m, v, g, out, step=step, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1,
                    decoupled=decoupled, bias_correction=True, grad_scale=0.5)
    torch.testing.assert_close(master, ref.detach(), rtol=1e-6, atol=1e-7)
    assert torch.equal(out, master.to(torch.bfloat16))
