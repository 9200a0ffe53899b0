"""Compact optimizer state in the CPU Adam kernel (issue 27): a bf16 master with stochastic
rounding, bf16 moments, and 8-bit blockwise-quantized moments ([Note: compact optimizer
state], [Note: 8-bit moments] in zerotier/optim/kernel_math.py).

The pure-torch reference `adam_step_reference` defines the math; these tests pin the
reference's quantization and rounding, the interface's errors, and that the native kernels
equal the reference bit for bit on odd sizes and block tails.
"""
import pytest
import torch

import zerotier.optim as zo
from zerotier.errors import ZerotierError
from zerotier.optim import kernel_math
from zerotier.optim._kernels import state_bytes_per_param
from zerotier.optim.kernel_math import QUANT_BLOCK, dequantize_blockwise, quantize_blockwise

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_quantize_picks_the_nearest_code_per_block(signed):
    gen = torch.Generator().manual_seed(0)
    n = 5 * QUANT_BLOCK + 37  # a partial last block
    x = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-20, 4, (n,), generator=gen).float())
    if not signed:
        x = x.abs()
    codes, absmax = quantize_blockwise(x, signed)
    assert codes.dtype == torch.uint8 and codes.shape == (n,) and absmax.shape == (-(-n // QUANT_BLOCK),)
    blocks = torch.nn.functional.pad(x, (0, absmax.numel() * QUANT_BLOCK - n)).view(-1, QUANT_BLOCK)
    assert torch.equal(absmax, blocks.abs().amax(dim=1))
    qmap = kernel_math.QMAPS[0 if signed else 2]
    xn = x / absmax.repeat_interleave(QUANT_BLOCK)[:n]
    nearest = (xn[:, None] - qmap[None, :]).abs().argmin(dim=1)  # ties (measure zero here) aside
    assert torch.equal(codes.long(), nearest)
    back = dequantize_blockwise(codes, absmax, signed)
    # the dynamic map's widest gap is its top decade: 0.9/64 (signed), 0.9/128 (unsigned)
    half_gap = 0.9 / (64 if signed else 128) / 2
    assert bool(((back - x).abs() <= half_gap * absmax.repeat_interleave(QUANT_BLOCK)[:n] * 1.001).all())


def test_dynamic_maps_are_bitsandbytes_tree_maps():
    signed, unsigned = kernel_math.QMAPS[0], kernel_math.QMAPS[2]
    for qmap in (signed, unsigned):
        assert qmap.numel() == 256 and qmap[-1] == 1.0 and bool((qmap[1:] > qmap[:-1]).all())
    assert (signed < 0).sum() == 127 and (signed == 0).sum() == 1 and unsigned[0] == 0
    # the smallest non-zero magnitudes, means of the first decade: 1e-6 * (0.1 + 1) / 2, 1e-6 * (0.1 + 0.55) / 2
    assert torch.isclose(signed[128], torch.tensor(0.55e-6)) and torch.isclose(unsigned[1], torch.tensor(0.325e-6))


def test_zero_and_nan_blocks_are_defined():
    x = torch.zeros(2 * QUANT_BLOCK)
    x[QUANT_BLOCK + 3] = float("nan")
    codes, absmax = quantize_blockwise(x, signed=True)
    assert absmax[0] == 0 and torch.isnan(absmax[1])
    back = dequantize_blockwise(codes, absmax, signed=True)
    assert torch.equal(back[:QUANT_BLOCK], torch.zeros(QUANT_BLOCK))  # zero bytes, zero scale: zero moments
    assert bool(torch.isnan(back[QUANT_BLOCK:]).all())  # a NaN poisons its block, visibly


def test_stochastic_rounding_is_unbiased_reproducible_and_between_neighbours():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(20000, generator=gen) * 1e-3
    a = kernel_math.to_bf16_stochastic(x, 12345)
    assert torch.equal(a.view(torch.int16), kernel_math.to_bf16_stochastic(x, 12345).view(torch.int16))
    assert not torch.equal(a, kernel_math.to_bf16_stochastic(x, 12346))
    down = (x.view(torch.int32) & ~0xFFFF).view(torch.float32)  # truncation toward zero
    up = ((x.view(torch.int32) & ~0xFFFF) + 0x10000).view(torch.float32)
    af = a.float()
    assert bool(((af == down) | (af == up)).all())
    mean = torch.stack([kernel_math.to_bf16_stochastic(x, s).float() for s in range(0, 400 * 7919, 7919)]).mean(0)
    rne_err = (x.bfloat16().float() - x).abs().mean()
    assert (mean - x).abs().mean() < rne_err / 8  # 400 draws: ~1/20 of a rounding error left
    assert (mean - x).mean().abs() < rne_err / 50  # and no bias


def test_stochastic_rounding_keeps_specials():
    x = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0])
    y = kernel_math.to_bf16_stochastic(x, 7).float()
    assert y[0] == float("inf") and y[1] == float("-inf") and torch.isnan(y[2])
    assert torch.equal(y[3:].view(torch.int32), x[3:].view(torch.int32))


def test_state_bytes_per_param():
    assert state_bytes_per_param("fp32", "fp32") == 12.0
    assert state_bytes_per_param("bf16", "bf16") == 6.0
    assert state_bytes_per_param("fp32", "bf16") == 8.0
    assert state_bytes_per_param("bf16", "int8") == 2 + 2 * (1 + 4 / QUANT_BLOCK)
    assert state_bytes_per_param(torch.bfloat16, torch.uint8) == state_bytes_per_param("bf16", "int8")
    with pytest.raises(ZerotierError, match="master dtype"):
        state_bytes_per_param("int8", "fp32")
    with pytest.raises(ZerotierError, match="moment dtype"):
        state_bytes_per_param("fp32", "fp16")


def make_state(n, master_dtype, moment_dtype, seed=0):
    """Random but realistic state: a master, moments from a few fp32 steps, then stored in the dtypes."""
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=gen)
    m = torch.randn(n, generator=gen) * 1e-2 * torch.exp2(torch.randint(-8, 2, (n,), generator=gen).float())
    v = m * m * torch.rand(n, generator=gen) * 3 + 1e-9
    state = {"master": master.to(master_dtype), "exp_avg_absmax": None, "exp_avg_sq_absmax": None}
    for key, value, signed in (("exp_avg", m, True), ("exp_avg_sq", v, False)):
        if moment_dtype == torch.uint8:
            state[key], state[key + "_absmax"] = quantize_blockwise(value, signed)
        else:
            state[key] = value.to(moment_dtype)
    grad = torch.randn(n, generator=gen) * 1e-2
    return state, grad


def test_compact_state_errors_say_what_to_pass():
    n = 3 * QUANT_BLOCK
    state, grad = make_state(n, torch.bfloat16, torch.uint8)
    kw = dict(step=1, **HYPER)
    with pytest.raises(ZerotierError, match="pass sr_seed"):
        zo.adam_step(state["master"], state["exp_avg"], state["exp_avg_sq"], grad, exp_avg_absmax=state["exp_avg_absmax"],
                     exp_avg_sq_absmax=state["exp_avg_sq_absmax"], **kw)
    with pytest.raises(ZerotierError, match="pass exp_avg_sq_absmax"):
        zo.adam_step(state["master"], state["exp_avg"], state["exp_avg_sq"], grad, exp_avg_absmax=state["exp_avg_absmax"],
                     sr_seed=1, **kw)
    with pytest.raises(ZerotierError, match="exp_avg_absmax has 2 elements, expected 3"):
        zo.adam_step(state["master"], state["exp_avg"], state["exp_avg_sq"], grad, exp_avg_absmax=state["exp_avg_absmax"][:2],
                     exp_avg_sq_absmax=state["exp_avg_sq_absmax"], sr_seed=1, **kw)
    a = 100  # a sub-range starting inside block 0
    with pytest.raises(ZerotierError, match="must start on a block boundary"):
        zo.adam_step(state["master"][a:], state["exp_avg"][a:], state["exp_avg_sq"][a:], grad[a:],
                     exp_avg_absmax=state["exp_avg_absmax"][:3], exp_avg_sq_absmax=state["exp_avg_sq_absmax"][:3],
                     sr_seed=1, **kw)
    with pytest.raises(ZerotierError, match="block scales belong to uint8 codes"):
        zo.adam_step(torch.zeros(n), torch.zeros(n), torch.zeros(n), grad, exp_avg_absmax=torch.zeros(3), **kw)
    with pytest.raises(ZerotierError, match="tuples of 5"):
        zo.adam_step_multi([(state["master"], state["exp_avg"], state["exp_avg_sq"], grad, None, None)], step=1, **HYPER)


def test_reference_bf16_moments_are_the_rounded_fp32_moments():
    """With bf16 moments and an fp32 master the update is the fp32 one from the widened
    moments; the stored moments are its round-to-nearest-even."""
    n = 1000
    state, grad = make_state(n, torch.float32, torch.bfloat16)
    m32, v32, p32 = state["exp_avg"].float(), state["exp_avg_sq"].float(), state["master"].clone()
    zo.adam_step_reference(state["master"], state["exp_avg"], state["exp_avg_sq"], grad, step=3, **HYPER)
    zo.adam_step_reference(p32, m32, v32, grad, step=3, **HYPER)
    assert torch.equal(state["master"], p32)
    assert torch.equal(state["exp_avg"], m32.bfloat16()) and torch.equal(state["exp_avg_sq"], v32.bfloat16())


def test_reference_stochastic_master_pieces_equal_one_call():
    """Stepping a shard in pieces with the piece's offset added to sr_seed rounds exactly as
    one call over the shard (what the engine does with sub-ranges)."""
    n, cut, seed = 2 * QUANT_BLOCK + 11, QUANT_BLOCK, 2**40 + 5
    whole, grad = make_state(n, torch.bfloat16, torch.uint8, seed=3)
    pieces = {k: (v.clone() if v is not None else None) for k, v in whole.items()}
    zo.adam_step_reference(whole["master"], whole["exp_avg"], whole["exp_avg_sq"], grad, step=2, sr_seed=seed,
                           exp_avg_absmax=whole["exp_avg_absmax"], exp_avg_sq_absmax=whole["exp_avg_sq_absmax"],
                           **HYPER)
    for a, b in ((0, cut), (cut, n)):
        blocks = slice(a // QUANT_BLOCK, -(-b // QUANT_BLOCK))
        zo.adam_step_reference(pieces["master"][a:b], pieces["exp_avg"][a:b], pieces["exp_avg_sq"][a:b], grad[a:b],
                               step=2, sr_seed=seed + a, exp_avg_absmax=pieces["exp_avg_absmax"][blocks],
                               exp_avg_sq_absmax=pieces["exp_avg_sq_absmax"][blocks], **HYPER)
    for key in whole:
        assert torch.equal(whole[key].view(torch.uint8), pieces[key].view(torch.uint8)), key


NATIVE_LEVELS = zo.simd_levels_available()
MASTER_DTYPES = [torch.float32, torch.bfloat16]
MOMENT_DTYPES = [torch.float32, torch.bfloat16, torch.uint8]
# odd sizes, a block's tail, a block and one, several blocks plus a partial one
BITWISE_SIZES = [1, 15, 17, 255, QUANT_BLOCK + 1, 3 * QUANT_BLOCK + 13, 70001]


def step_state(state, grad, level, *, seed, step=3, out_dtype=torch.bfloat16, **hyper):
    out = torch.empty(grad.numel(), dtype=out_dtype)
    kw = dict(HYPER, step=step, param_out=out, exp_avg_absmax=state["exp_avg_absmax"],
              exp_avg_sq_absmax=state["exp_avg_sq_absmax"], sr_seed=seed if state["master"].dtype == torch.bfloat16
              else None)
    kw.update(hyper)
    if level == "python":
        n_bad = zo.adam_step_reference(state["master"], state["exp_avg"], state["exp_avg_sq"], grad, **kw)
    else:
        n_bad = zo.adam_step(state["master"], state["exp_avg"], state["exp_avg_sq"], grad, simd=level, **kw)
    return dict(state, out=out), n_bad


def assert_same_bits(ours, ref):
    for key, value in ref.items():
        if value is not None:
            assert torch.equal(ours[key].view(torch.uint8), value.view(torch.uint8)), \
                f"{key}: {(ours[key].view(torch.uint8) != value.view(torch.uint8)).sum()} bytes differ"


@pytest.mark.parametrize("level", NATIVE_LEVELS)
@pytest.mark.parametrize("moment_dtype", MOMENT_DTYPES, ids=str)
@pytest.mark.parametrize("master_dtype", MASTER_DTYPES, ids=str)
@pytest.mark.parametrize("size", BITWISE_SIZES)
def test_native_kernel_equals_reference_bitwise(level, master_dtype, moment_dtype, size):
    """Every state dtype combination (fp32/fp32 included), every native kernel: master,
    moments, block scales and param_out bit for bit equal to adam_step_reference."""
    ref, grad = make_state(size, master_dtype, moment_dtype, seed=size)
    ours = {k: (v.clone() if v is not None else None) for k, v in ref.items()}
    seed = 2**32 - 5  # the counters' low word wraps inside the first vector
    ref, ref_bad = step_state(ref, grad, "python", seed=seed)
    ours, our_bad = step_state(ours, grad, level, seed=seed)
    assert our_bad == ref_bad
    assert_same_bits(ours, ref)


@pytest.mark.parametrize("level", NATIVE_LEVELS)
@pytest.mark.parametrize("moment_dtype", MOMENT_DTYPES, ids=str)
def test_native_adam_l2_fp16_grads_and_outputs_bitwise(level, moment_dtype):
    """The other branches: Adam with L2 decay, fp16/bf16 gradients, fp32/fp16 param_out,
    grad_scale, no bias correction, non-finite gradients counted."""
    size = 2 * QUANT_BLOCK + 77
    for grad_dtype, out_dtype in ((torch.float16, torch.float16), (torch.bfloat16, torch.float32)):
        ref, grad = make_state(size, torch.bfloat16, moment_dtype, seed=9)
        grad = (grad * 100).to(grad_dtype)
        grad[5] = float("inf")
        ours = {k: (v.clone() if v is not None else None) for k, v in ref.items()}
        hyper = dict(decoupled=False, weight_decay=0.1, grad_scale=0.5, bias_correction=False, out_dtype=out_dtype)
        ref, ref_bad = step_state(ref, grad, "python", seed=77, **hyper)
        ours, our_bad = step_state(ours, grad, level, seed=77, **hyper)
        assert our_bad == ref_bad == 1
        # the inf gradient poisons its 8-bit block (NaN absmax) the same way in both
        assert_same_bits(ours, ref)


@pytest.mark.parametrize("moment_dtype", MOMENT_DTYPES, ids=str)
def test_native_threads_and_multi_call_do_not_change_bits(moment_dtype):
    """Threads split at block boundaries and a multi-tensor call equals one call per tensor."""
    sizes = [3 * QUANT_BLOCK + 5, 1, 10**5 + 17]
    states = [make_state(n, torch.bfloat16, moment_dtype, seed=n) for n in sizes]
    results = []
    for threads in (1, 2, 3):
        copies = [({k: (v.clone() if v is not None else None) for k, v in s.items()}, g) for s, g in states]
        buffers = [(s["master"], s["exp_avg"], s["exp_avg_sq"], g, None, s["exp_avg_absmax"], s["exp_avg_sq_absmax"],
                    1000 * t) for t, (s, g) in enumerate(copies)]
        zo.adam_step_multi(buffers, step=2, threads=threads, **HYPER)
        results.append([s for s, _ in copies])
    singles = []
    for t, (s, g) in enumerate(states):
        s = {k: (v.clone() if v is not None else None) for k, v in s.items()}
        singles.append(step_state(s, g, "auto", seed=1000 * t, step=2, threads=1)[0])
    for other in results[1:] + [singles]:
        for a, b in zip(results[0], other):
            assert_same_bits(b, a)


def int8_step_by_python_and_native(grad, blocks, level):
    """One step of int8 moments from zero state with beta1 = beta2 = 0 (the new exp_avg is `grad`,
    exp_avg_sq is grad*grad), lr and weight decay 0, by the Python reference and by the native
    kernel at `level`: asserts the two states bit-equal and returns the reference's."""
    n = grad.numel()
    results = []
    for lvl in ("python", level):
        state = {"master": torch.zeros(n), "exp_avg_absmax": torch.zeros(blocks), "exp_avg_sq_absmax": torch.zeros(blocks),
                 "exp_avg": torch.zeros(n, dtype=torch.uint8), "exp_avg_sq": torch.zeros(n, dtype=torch.uint8)}
        results.append(step_state(state, grad, lvl, seed=0, beta1=0.0, beta2=0.0, lr=0.0, weight_decay=0.0)[0])
    assert_same_bits(results[1], results[0])
    return results[0]


@pytest.mark.parametrize("level", NATIVE_LEVELS)
@pytest.mark.parametrize("signed", [True, False], ids=["exp_avg", "exp_avg_sq"])
def test_native_quantization_at_the_map_midpoints(level, signed):
    """The kernel's code search ([Note: 8-bit code search] in native/cpu) picks the same code
    as the reference at every midpoint of the map and one ulp either side (ties round down).
    With beta1 = 0 and zero moments the new exp_avg is the gradient itself; with beta2 = 0 the
    new exp_avg_sq is g*g, so these gradients put the values where they are wanted."""
    mid = kernel_math.QMAPS[1 if signed else 3][:255]
    targets = torch.cat([mid, torch.nextafter(mid, torch.tensor(2.0)), torch.nextafter(mid, torch.tensor(-2.0))])
    targets = targets[(targets.abs() <= 1) & (targets >= (-1 if signed else 0))]
    per_block = QUANT_BLOCK - 1  # the last element of each block is 1.0: absmax 1, x / absmax = x
    blocks = -(-targets.numel() // per_block)
    values = torch.cat([targets, torch.zeros(blocks * per_block - targets.numel())]).view(blocks, per_block)
    values = torch.cat([values, torch.ones(blocks, 1)], dim=1).view(-1)
    grad = values if signed else values.sqrt()  # g*g lands within an ulp or so of the target
    reference = int8_step_by_python_and_native(grad, blocks, level)
    if signed:  # the reference's codes are the nearest, ties down: spot-check against quantize_blockwise
        assert torch.equal(reference["exp_avg"], quantize_blockwise(values, True)[0])



@pytest.mark.parametrize("level", NATIVE_LEVELS)
@pytest.mark.parametrize("signed", [True, False], ids=["exp_avg", "exp_avg_sq"])
def test_native_quantization_near_the_midpoints_at_any_block_scale(level, signed):
    """[Note: 8-bit code search]: the kernels take the code of x * (1/absmax) and redo a
    vector with the division only where a value lies within a few bit patterns of a midpoint.
    Blocks with absmax from 2^-60 to 2^60 (and one subnormal, where 1/absmax overflows) hold
    values within +-12 patterns of midpoint * absmax: every code equals the reference's."""
    gen = torch.Generator().manual_seed(5)
    mid = kernel_math.QMAPS[1 if signed else 3][:255]
    blocks = 96
    scales = torch.exp2(torch.randint(-60, 61, (blocks,), generator=gen).float()) * (1 + torch.rand(blocks, generator=gen))
    scales[0] = 1e-40  # subnormal absmax
    picks = mid[torch.randint(0, 255, (blocks, QUANT_BLOCK - 1), generator=gen)]
    values = (picks * scales[:, None]).contiguous()
    offsets = torch.randint(-12, 13, values.shape, generator=gen, dtype=torch.int32)
    values = (values.view(torch.int32) + offsets * (values.abs() > 1e-30)).view(torch.float32)  # no sign flips
    values = torch.maximum(torch.minimum(values, scales[:, None]), -scales[:, None])
    last = scales if not signed else torch.where(torch.rand(blocks, generator=gen) < 0.5, -scales, scales)
    values = torch.cat([values, last[:, None]], dim=1).view(-1)  # each block's absmax is its scale
    if not signed:
        values = values.abs()
    grad = values if signed else values.sqrt()  # beta2 = 0: v = g*g, within an ulp or so of the value
    codes = int8_step_by_python_and_native(grad, blocks, level)["exp_avg" if signed else "exp_avg_sq"]
    assert codes.unique().numel() > 200  # the values cover the map


# [Note: small parameters keep fp32 moments]: a unit of parameters of 300, 64, 5000, 10 and
# 4133 elements: fp32 moments for [0, 364) and [5364, 5374), two int8 runs with block tails
SMALL_AND_LARGE = [300, 64, 5000, 10, 4096 + 37]


def unit_state(layout, n, seed):
    g = torch.Generator().manual_seed(seed)
    raw = {}
    for key, values in (("exp_avg", torch.randn(n, generator=g) * 1e-2),
                        ("exp_avg_sq", torch.rand(n, generator=g) * 1e-4)):
        raw[key] = torch.zeros(layout.nbytes(key, n), dtype=torch.uint8)
        layout.encode(key, values, raw[key])
    master = torch.randn(n, generator=g).bfloat16()
    return master, raw, torch.randn(n, generator=g) * 1e-2


@pytest.mark.parametrize("level", NATIVE_LEVELS)
@pytest.mark.parametrize("split", [False, True, "partial"], ids=["whole-runs", "run-split", "run-split-partial"])
def test_unit_layout_steps_like_the_reference_per_piece(level, split):
    """A unit's int8 moments with fp32 ranges for its small parameters: the kernel steps each run
    (codes and block scales from the run's start) and each fp32 range (fp32 moments), bit for bit
    as adam_step_reference on each piece with the piece's seed offset. A range that splits a run
    (parameters without a gradient) is stepped on fp32 copies, re-encoded after: bit for bit the
    reference's fp32 math then the layout's encode; a run no range touches keeps its bytes."""
    from zerotier.optim.kernel_math import sr_seed
    from zerotier.optim.rules.adamw import AdamW, Hyper
    from zerotier.optim.state_layout import StateLayout
    numels = SMALL_AND_LARGE
    n, offsets = sum(numels), [sum(numels[:i]) for i in range(len(numels))]
    layout = StateLayout("bf16", "int8").for_params(numels, offsets, 0, n)
    assert layout.fp32_ranges == ((0, 364), (5364, 5374))
    unit_index, shard_lo, step = 3, 1000, 4
    h = Hyper(HYPER["lr"], HYPER["beta1"], HYPER["beta2"], HYPER["eps"], HYPER["weight_decay"], True)
    cut = 364 + 2500 if split else n  # inside the first run
    ranges = [(0, cut, step, h)] + ([(cut, n, step, h)] if split is True else [])
    master, raw, grad = unit_state(layout, n, seed=5)
    ref_master, ref_raw = master.clone(), {k: v.clone() for k, v in raw.items()}
    out, ref_out = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    kw = dict(HYPER, step=step)
    if not split:
        m_pieces = layout.pieces(n, *layout.typed("exp_avg", ref_raw["exp_avg"], n))
        v_pieces = layout.pieces(n, *layout.typed("exp_avg_sq", ref_raw["exp_avg_sq"], n))
        assert [p[3] is None for p in m_pieces] == [True, False, True, False]
        for (a, b, m, m_absmax), (_, _, v, v_absmax) in zip(m_pieces, v_pieces):
            zo.adam_step_reference(ref_master[a:b], m, v, grad[a:b], param_out=ref_out[a:b], exp_avg_absmax=m_absmax,
                                   exp_avg_sq_absmax=v_absmax, sr_seed=sr_seed(unit_index, step) + shard_lo + a, **kw)
    else:
        m, v = layout.decode("exp_avg", ref_raw["exp_avg"], n), layout.decode("exp_avg_sq", ref_raw["exp_avg_sq"], n)
        for a, b, _, _ in ranges:
            zo.adam_step_reference(ref_master[a:b], m[a:b], v[a:b], grad[a:b], param_out=ref_out[a:b],
                                   sr_seed=sr_seed(unit_index, step) + shard_lo + a, **kw)
        layout.encode("exp_avg", m, ref_raw["exp_avg"])
        layout.encode("exp_avg_sq", v, ref_raw["exp_avg_sq"])
        if split == "partial":  # [5374, n) is in no range: its codes and scales as they were
            for key in ref_raw:
                (_, _, codes, absmax), = [p for p in layout.pieces(n, *layout.typed(key, ref_raw[key], n))
                                          if p[0] == 5374]
                (_, _, old_codes, old_absmax), = [p for p in layout.pieces(n, *layout.typed(key, raw[key], n))
                                                  if p[0] == 5374]
                codes.copy_(old_codes)
                absmax.copy_(old_absmax)
    layout.step_pieces(AdamW().cpu_pieces, master, {k: layout.typed(k, raw[k], n) for k in ("exp_avg", "exp_avg_sq")},
                       ranges, grad=grad, out=out, unit_index=unit_index, shard_lo=shard_lo, grad_scale=1.0,
                       bias_correction=True, simd=level, threads=2)
    assert torch.equal(master.view(torch.int16), ref_master.view(torch.int16))
    assert torch.equal(out.view(torch.int16), ref_out.view(torch.int16))
    for key in raw:
        assert torch.equal(raw[key], ref_raw[key]), key
