"""The Lion update rule's kernels: native (scalar, AVX2, AVX-512) vs the pure-torch oracle
(kernel_math.lion_step_reference) vs a reference Lion written here from the paper's formulas
(Chen et al. 2023):

    c = beta1*m + (1-beta1)*g;   p = p*(1 - lr*wd) - lr*sign(c);   m = beta2*m + (1-beta2)*g

fp32 state is bit for bit the formulas (every fp32 operation rounds once, as torch's ops on
fp32 tensors with Python-float scalars); compact state (bf16 master with stochastic rounding,
bf16 or int8 moment) is bit for bit the oracle at every SIMD level."""
import pytest
import torch

from zerotier.errors import ZerotierError
from zerotier.optim import _kernels, kernel_math
from zerotier.optim.rules import RULES, make_rule
from zerotier.optim.rules.lion import Lion, LionHyper
from zerotier.optim.state_layout import StateLayout

LEVELS = _kernels.simd_levels_available()
HYPER = dict(lr=3e-3, beta1=0.9, beta2=0.99, weight_decay=0.1)
SIZES = [1, 15, 17, 255, 257, 3 * 256 + 13, 70001]


def reference_lion(p, m, g, *, lr, beta1, beta2, weight_decay, grad_scale=1.0):
    """Lion from the paper's formulas, in fp32 torch ops (no shared code with zerotier)."""
    g = g * grad_scale
    c = beta1 * m + (1 - beta1) * g
    p = p * (1 - lr * weight_decay) - lr * torch.sign(c)
    m = beta2 * m + (1 - beta2) * g
    return p, m


def test_native_lion_is_present():
    assert _kernels.native_available() and "scalar" in LEVELS and len(LEVELS) >= 2, LEVELS


@pytest.mark.parametrize("level", ["python"] + LEVELS)
@pytest.mark.parametrize("n", SIZES)
def test_fp32_lion_equals_the_paper_formulas_bitwise_over_steps(level, n):
    g = torch.Generator().manual_seed(n)
    p0, m0 = torch.randn(n, generator=g), torch.zeros(n)
    p, m, out = p0.clone(), m0.clone(), torch.empty(n)
    ref_p, ref_m = p0.clone(), m0.clone()
    for step in range(5):
        grad = torch.randn(n, generator=g)
        if level == "python":
            bad = kernel_math.lion_step_reference(p, m, grad, param_out=out, grad_scale=0.5, **HYPER)
        else:
            bad = _kernels.lion_step_multi([(p, m, grad, out, None, None)], grad_scale=0.5, simd=level, threads=2,
                                           **HYPER)
        ref_p, ref_m = reference_lion(ref_p, ref_m, grad, grad_scale=0.5, **HYPER)
        assert bad == 0
        assert torch.equal(p, ref_p) and torch.equal(m, ref_m) and torch.equal(out, ref_p), (level, step)
    assert not torch.equal(p, p0)


def _state(md, mt, n, seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=g).to(md)
    m32 = torch.randn(n, generator=g) * 1e-2
    if mt == torch.uint8:
        m, absmax = kernel_math.quantize_blockwise(m32, signed=True)
    else:
        m, absmax = m32.to(mt).clone(), None
    return p, m, absmax, [torch.randn(n, generator=g) for _ in range(3)]


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("md", [torch.float32, torch.bfloat16], ids=["m-fp32", "m-bf16"])
@pytest.mark.parametrize("mt", [torch.float32, torch.bfloat16, torch.uint8], ids=["fp32", "bf16", "int8"])
@pytest.mark.parametrize("n", [17, 3 * 256 + 13, 70001])
def test_native_lion_equals_the_oracle_bitwise_for_every_state_dtype(level, md, mt, n):
    seed = 2**40 + 7 if md == torch.bfloat16 else None
    runs = {}
    for who in ("oracle", level):
        p, m, absmax, grads = _state(md, mt, n, seed=n)
        out = torch.empty(n, dtype=torch.bfloat16)
        for grad in grads:
            if who == "oracle":
                kernel_math.lion_step_reference(p, m, grad, param_out=out, exp_avg_absmax=absmax, sr_seed=seed,
                                                grad_scale=0.25, **HYPER)
            else:
                _kernels.lion_step_multi([(p, m, grad, out, absmax, seed)], grad_scale=0.25, simd=level, threads=3,
                                         **HYPER)
        runs[who] = [t.view(torch.uint8) if t.dtype != torch.uint8 else t for t in (p, m, out)] + \
            ([] if absmax is None else [absmax])
    for a, b in zip(runs["oracle"], runs[level]):
        assert torch.equal(a, b)


def test_lion_counts_nonfinite_gradients_and_refuses_bad_buffers():
    n = 300
    p, m, grad = torch.zeros(n), torch.zeros(n), torch.ones(n)
    grad[7] = float("inf")
    grad[100] = float("nan")
    assert _kernels.lion_step_multi([(p, m, grad, None, None, None)], **HYPER) == 2
    with pytest.raises(ZerotierError, match="pass sr_seed"):
        _kernels.lion_step_multi([(torch.zeros(n, dtype=torch.bfloat16), m, grad, None, None, None)], **HYPER)
    with pytest.raises(ZerotierError, match="exp_avg_absmax"):
        _kernels.lion_step_multi([(p, torch.zeros(n, dtype=torch.uint8), grad, None, None, None)], **HYPER)


def test_lion_rule_steps_int8_units_piecewise_like_whole_pieces():
    """The rule's CPU variant over a unit layout with fp32 ranges (a small parameter) and a range
    that splits an int8 run (a parameter without a gradient): the same bytes as the oracle run
    on fp32 copies and re-encoded, for the runs the ranges touch."""
    numels = [300, 5000]
    n, offsets = sum(numels), [0, 300]
    layout = StateLayout("fp32", "int8", keys=Lion.state_keys, nonnegative=Lion.nonnegative) \
        .for_params(numels, offsets, 0, n)
    assert layout.fp32_ranges == ((0, 300),)
    g = torch.Generator().manual_seed(1)
    master = torch.randn(n, generator=g)
    raw = torch.zeros(layout.nbytes("exp_avg", n), dtype=torch.uint8)
    layout.encode("exp_avg", torch.randn(n, generator=g) * 1e-2, raw)
    grad, h = torch.randn(n, generator=g), LionHyper(1e-3, 0.9, 0.99, 0.0)
    ref_m = layout.decode("exp_avg", raw, n)
    ref_p = master.clone()
    ranges = [(0, 300 + 2000, 1, h)]  # splits the int8 run at 2300
    layout.step_pieces(Lion().cpu_pieces, master, {"exp_avg": layout.typed("exp_avg", raw, n)}, ranges, grad=grad,
                       out=None, unit_index=0, shard_lo=0, grad_scale=1.0, bias_correction=True, simd="auto", threads=2)
    kernel_math.lion_step_reference(ref_p[:2300], ref_m[:2300], grad[:2300], lr=1e-3, beta1=0.9, beta2=0.99,
                                    weight_decay=0.0)
    expect = torch.zeros_like(raw)
    layout.encode("exp_avg", ref_m, expect)
    assert torch.equal(master, ref_p) and torch.equal(raw, expect)


def test_rules_registry_matches_the_config_choices_and_lion_keeps_one_moment():
    import typing

    from zerotier.config import OptimizerConfig
    assert set(RULES) == set(typing.get_args(typing.get_type_hints(OptimizerConfig)["type"]))
    lion, adamw = make_rule("lion"), make_rule("adamw")
    assert lion.state_keys == ("master", "exp_avg") and lion.moment_keys == ("exp_avg",)
    assert lion.bytes_per_param() == 8 and adamw.bytes_per_param() == 12
    assert lion.bytes_per_param("bf16", "bf16") == 4 and adamw.bytes_per_param("bf16", "bf16") == 6
    assert lion.bytes_per_param("bf16", "int8") == 2 + 1 + 4 / kernel_math.QUANT_BLOCK
