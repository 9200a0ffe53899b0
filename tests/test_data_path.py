"""Properties of the one data path (docs/design.md), pinned on the engine's live path:

- no NVMe read or write of a training step goes through a staging copy;
- a step's copies and NVMe bytes are exactly what the design says, and after the first
  step the host pool makes no new blocks;
- a prefetch issued before an optimizer step is never used after it (parameter versions);
- the host pool's bytes are what the planner predicted;
- bf16 gradient accumulation halves the gradient bytes and still trains.

The first two also run on 2 gloo ranks at ZeRO stages 1-3, where the reduce buckets and the
parameter gathers add their copies ([Note: buckets] in dist/buckets.py).
"""
import pytest
import torch

import zerotier
import zerotier.tiers.nvme_files as nvme_mod  # where the store makes its staging copies
from zerotier.dist import spawn
from zerotier.models import TinyGPT, batches

VOCAB, SEQ, BATCH, LR = 128, 16, 4, 3e-3

NVME = {
    "optimizer-nvme": {"params": "device", "gradients": "host", "optimizer": "nvme"},
    "params-nvme": {"params": "nvme", "gradients": "host", "optimizer": "nvme"},
}


def tiny_gpt():
    torch.manual_seed(0)
    return TinyGPT(vocab=VOCAB, dim=32, layers=2, heads=2, seq=SEQ)  # units of 64, 1056, 4128... elements


def mlp(widths=(24, 40, 40, 8)):
    """Linear layers only: every unit used once per pass, so fetch counts are exact."""
    torch.manual_seed(0)
    layers = []
    for a, b in zip(widths, widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def mlp_batches(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        yield torch.randn(8, 24, generator=gen), torch.randn(8, 8, generator=gen)


@pytest.mark.parametrize("clip", [None, 1.0], ids=["early-step", "clipped"])
@pytest.mark.parametrize("name", NVME)
@pytest.mark.pins("design#one-memory-system-for-a-one-rank-step")
def test_training_step_makes_no_staging_copy(name, clip, tmp_path, monkeypatch):
    """Every NVMe read/write of a step is zero-copy into/out of a pool block, whatever the
    unit's size (TinyGPT's units are not multiples of the 4 KiB alignment)."""
    def no_staging(*args, **kwargs):
        raise AssertionError("the NVMe store made a staging copy on the training path")

    cfg = {"offload": NVME[name], "tiers": {"nvme_path": str(tmp_path)},
           "train": {"max_grad_norm": clip, "overlap": "early" if clip is None else "auto"},
           "optimizer": {"lr": LR}}
    with zerotier.initialize(tiny_gpt(), cfg) as engine:
        monkeypatch.setattr(nvme_mod, "aligned_empty", no_staging)
        for x, y in batches(VOCAB, SEQ, BATCH, 3):
            engine.backward(engine(x, y))
            engine.step()
        engine.synchronize()
        assert engine.store.stats()["bytes_out"] > 0
        monkeypatch.undo()  # close() gives the weights back: not the training path


@pytest.mark.parametrize("params", ["host", "nvme"])
def test_copies_and_nvme_bytes_per_step(params, tmp_path):
    """Per step: each streamed unit is fetched twice (forward, backward), one host->device copy
    each; NVMe moves exactly L*Psi per fetch, 12*Psi of optimizer state each way and L*Psi of
    write-back. From the second step on the host pool only reuses blocks."""
    model = mlp()
    numel = sum(p.numel() for p in model.parameters())
    lp = 2  # bf16
    cfg = {"offload": {"params": params, "gradients": "host", "optimizer": "nvme"},
           "tiers": {"nvme_path": str(tmp_path)}, "precision": {"param_dtype": "bf16"},
           "train": {"max_grad_norm": 1.0}}
    with zerotier.initialize(model, cfg) as engine:
        def counters():
            dev, st, pool = engine.device_tier.stats(), engine.store.stats(), engine.host_pool.stats()
            return {"h2d": dev["bytes_in"], "store_in": st["bytes_in"], "store_out": st["bytes_out"],
                    "new_blocks": pool["alloc_calls"] - pool["reuses"]}

        deltas = []
        for x, y in mlp_batches(4):
            engine.synchronize()
            before = counters()
            engine.backward(torch.nn.functional.mse_loss(engine(x.bfloat16()).float(), y))
            engine.step()
            engine.synchronize()  # write-backs in flight are counted when they complete
            deltas.append({k: v - before[k] for k, v in counters().items()})
        for step, d in enumerate(deltas):
            assert d["h2d"] == 2 * lp * numel, (step, d)  # two fetches, one copy each
            param_reads = 2 * lp * numel if params == "nvme" else 0
            param_writes = lp * numel if params == "nvme" else 0
            assert d["store_out"] == 12 * numel + param_reads, (step, d)
            assert d["store_in"] == 12 * numel + param_writes, (step, d)
            if step > 1:  # step 0 has no trace, step 1 the first prefetches: the cache then has what it needs
                assert d["new_blocks"] == 0, (step, d)


STAGES = (1, 2, 3)


def _no_staging(*args, **kwargs):
    raise AssertionError("the NVMe store made a staging copy on the training path")


def _step_counters(engine):
    dev, st = engine.device_tier.stats(), engine.store.stats()
    return {"h2d": dev["bytes_in"], "d2h": dev["bytes_out"], "store_in": st["bytes_in"], "store_out": st["bytes_out"]}


def _data_path_rank(rank, world_size, nvme_dir):
    """On each rank, per stage: TinyGPT steps with every NVMe byte zero-copy (both NVMe placements,
    the staging allocator raising), and the mlp's per-step copy and NVMe byte counts (params on
    host and on NVMe). Returns {("staging", stage, name): NVMe bytes read} and
    {("copies", stage, params): (units as (numel, shard_numel, replicated), per-step deltas,
    {tier: (peak, the plan's need)})}."""
    out = {}
    for stage in STAGES:
        zero = {"stage": stage, "persistence_threshold": 0, "reduce_bucket_size": 4096,
                "allgather_bucket_size": 4096}
        for name, offload in NVME.items():
            cfg = {"zero": zero, "offload": offload, "tiers": {"nvme_path": nvme_dir},
                   "train": {"max_grad_norm": 1.0}, "optimizer": {"lr": LR}}
            with zerotier.initialize(tiny_gpt(), cfg) as engine:
                real = nvme_mod.aligned_empty
                nvme_mod.aligned_empty = _no_staging
                try:
                    for x, y in batches(VOCAB, SEQ, BATCH, 3):
                        half = BATCH // world_size
                        engine.backward(engine(x[rank * half:(rank + 1) * half], y[rank * half:(rank + 1) * half]))
                        engine.step()
                    engine.synchronize()
                finally:
                    nvme_mod.aligned_empty = real
                out[("staging", stage, name)] = engine.store.stats()["bytes_out"]
        for params in ("host", "nvme"):
            cfg = {"zero": zero, "offload": {"params": params, "gradients": "host", "optimizer": "nvme"},
                   "tiers": {"nvme_path": nvme_dir}, "precision": {"param_dtype": "bf16"},
                   "train": {"max_grad_norm": 1.0}}
            with zerotier.initialize(mlp(), cfg) as engine:
                deltas = []
                for x, y in mlp_batches(4, seed=rank):
                    engine.synchronize()
                    before = _step_counters(engine)
                    engine.backward(torch.nn.functional.mse_loss(engine(x.bfloat16()).float(), y))
                    engine.step()
                    engine.synchronize()
                    deltas.append({k: v - before[k] for k, v in _step_counters(engine).items()})
                units = [(u.numel, u.part.shard_numel, u.part.replicated) for u in engine.units]
                peaks = {"host": (engine.host_pool.stats()["peak"], engine.plan.need["host"]),
                         "device": (engine.device_tier.stats()["peak"], engine.plan.need["device"])}
            out[("copies", stage, params)] = (units, deltas, peaks)
    return out


@pytest.fixture(scope="module")
def two_rank_data_path(tmp_path_factory):
    return spawn(_data_path_rank, 2, str(tmp_path_factory.mktemp("nvme")), timeout_s=600)


@pytest.mark.parametrize("name", NVME)
@pytest.mark.parametrize("stage", STAGES)
def test_two_ranks_make_no_staging_copy(two_rank_data_path, stage, name):
    """As test_training_step_makes_no_staging_copy, on 2 gloo ranks: the reduced gradient shards,
    the gathered parameters and the sharded optimizer state move zero-copy too."""
    for rank_result in two_rank_data_path:
        assert rank_result[("staging", stage, name)] > 0


@pytest.mark.parametrize("params", ["host", "nvme"])
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.pins("design#one-memory-system-for-a-one-rank-step")
def test_two_ranks_copies_and_nvme_bytes_per_step(two_rank_data_path, stage, params):
    """As test_copies_and_nvme_bytes_per_step, on 2 gloo ranks, with gradients on the host and
    the reduce buckets on the device ([Note: bucket memory]): per step, host->device are the two
    fetches (the full flat, at stage 3 this rank's shard of it, gathered on the device) and the
    gradient packed into its reduce bucket (G*Psi, bf16 accumulators under bf16 parameters);
    device->host are the gradients autograd delivers (L*Psi) and this rank's reduced shard
    (4*Psi/N: buckets reduce in fp32). Every one of them is a device-tier copy, counted; none is
    a synchronous copy beside the tier. NVMe moves 12*Psi/N of optimizer
    state each way, the fetched bytes and the write-back (the full flat at stages 1-2, where
    each rank's home holds the gathered flat). The bucket buffers and the landing blocks of the
    reduced shards are tier memory the planner counts: neither tier's peak passes the plan's need.
    (Whether the pool makes a block after the first steps depends here on NVMe write timing: the
    ZeRO-1/2 write-back temporaries share block sizes with the parked write blocks.)"""
    lp, grad, reduced = 2, 2, 4  # bf16 parameters and gradient accumulators, fp32 reduce buckets
    for rank_result in two_rank_data_path:
        units, deltas, peaks = rank_result[("copies", stage, params)]
        numel = sum(n for n, _, _ in units)
        shards = sum(s for _, s, _ in units)
        fetched = shards if stage == 3 else numel  # elements one fetch of every unit copies to the device
        for step, d in enumerate(deltas):
            assert d["h2d"] == 2 * lp * fetched + grad * numel, (step, d)
            assert d["d2h"] == lp * numel + reduced * shards, (step, d)
            param_reads = 2 * lp * fetched if params == "nvme" else 0
            param_writes = lp * fetched if params == "nvme" else 0
            assert d["store_out"] == 12 * shards + param_reads, (step, d)
            assert d["store_in"] == 12 * shards + param_writes, (step, d)
        for tier, (peak, need) in peaks.items():
            assert 0 < peak <= need, (tier, peak, need)


class Routed(torch.nn.Module):
    """Data-dependent routing (MoE-style): micro-batch k uses expert k % 2."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2))
        self.out = torch.nn.Linear(16, 1)

    def forward(self, x, route: int):
        return self.out(torch.tanh(self.experts[route](torch.tanh(self.inp(x))))).square().mean()


def routed_run(engine_cfg=None, steps=6, accum=2):
    torch.manual_seed(0)
    model = Routed()
    gen = torch.Generator().manual_seed(1)
    data = [torch.randn(4, 8, generator=gen) for _ in range(steps * accum)]
    if engine_cfg is None:
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        for k, x in enumerate(data):
            (model(x, k % accum) / accum).backward()
            if (k + 1) % accum == 0:
                opt.step()
                opt.zero_grad(set_to_none=True)
        return {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = {"optimizer": {"lr": LR}, "train": {"grad_accum_steps": accum}, **engine_cfg}
    with zerotier.initialize(model, cfg) as engine:
        for k, x in enumerate(data):
            engine.backward(engine(x, k % accum))
            engine.step()
        wasted = engine.params.wasted_prefetches
        return engine.parameters_fp32(), wasted


@pytest.mark.pins("design#versions")
def test_prefetch_from_before_a_step_is_never_used():
    """The trace (step 1) says expert 0 follows `inp`; micro-batch 1 routes to expert 1, so expert
    0 is prefetched and not used; step() then updates expert 0 (gradient from micro-batch 0).
    Using that prefetch in the next forward would train on the pre-step weights."""
    ref = routed_run()
    with pytest.warns(RuntimeWarning, match="zerotier prefetch: module order changed at 'experts"):
        ours, wasted = routed_run({"offload": {"params": "host", "gradients": "host", "optimizer": "host"},
                                   "prefetch": {"lookahead": 2}})
    assert wasted > 0, "the scenario must actually leave a prefetch in flight across a step"
    for key in ref:
        torch.testing.assert_close(ours[key], ref[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.pins("design#versions")
def test_prefetch_issued_just_before_step_is_dropped():
    """Directly: prefetch every unit, step, then compute; the prefetched (old) bytes are discarded."""
    cfg = {"offload": {"params": "host", "gradients": "host", "optimizer": "host"}, "optimizer": {"lr": LR},
           "train": {"max_grad_norm": 1.0}}  # clipping: the update runs in step(), after the prefetches
    ref_model = tiny_gpt()
    opt = torch.optim.AdamW(ref_model.parameters(), lr=LR)
    data = list(batches(VOCAB, SEQ, BATCH, 3))
    with zerotier.initialize(tiny_gpt(), cfg) as engine:
        for x, y in data[:2]:
            engine.backward(engine(x, y))
            for unit in engine.units:
                engine.params.prefetch(unit.index)
            engine.step()
            ref_model(x, y).backward()
            torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        x, y = data[2]
        torch.testing.assert_close(engine(x, y).detach(), ref_model(x, y).detach(), rtol=1e-5, atol=1e-6)
        assert engine.params.wasted_prefetches == 2 * len(engine.units)


@pytest.mark.parametrize("name", ["params-host", "params-nvme", "optimizer-nvme"])
@pytest.mark.pins("design#config-tells-the-truth", "design#one-memory-system-for-a-one-rank-step")
def test_host_pool_bytes_match_the_plan(name, tmp_path):
    """Every host byte the engine holds is a pool block, and the planner's host need is enough:
    with tiers.host set to exactly that need, 3 steps train, and the pool's peak comes within 20%
    of it (the plan counts every fetch and NVMe write-back that may be in flight at once, and each
    block's rounding; how many are in flight depends on the drive's timing)."""
    offload = {"params-host": {"params": "host", "gradients": "host", "optimizer": "host"},
               **NVME}[name]
    # speculation off: its staged parameters are planned as an allowance beside the write-backs
    # they replace (a safe over-count), and clipping here fires at every step
    cfg = {"offload": offload, "tiers": {"nvme_path": str(tmp_path)},
           "train": {"max_grad_norm": 1.0, "overlap": "none"}, "prefetch": {"lookahead": 1}}

    def model():
        torch.manual_seed(0)
        return TinyGPT(vocab=VOCAB, dim=128, layers=2, heads=2, seq=SEQ)  # units >> the 4 KiB block rounding

    with zerotier.initialize(model(), cfg) as engine:
        need = engine.plan.need["host"]
    cfg["tiers"]["host"] = need
    with zerotier.initialize(model(), cfg) as engine:
        for x, y in batches(VOCAB, SEQ, BATCH, 3):
            engine.backward(engine(x, y))
            engine.step()
        engine.synchronize()
        peak = engine.host_pool.stats()["peak"]
    assert 0.8 * need <= peak <= need, (need, peak)


@pytest.mark.pins("design#config-tells-the-truth")
def test_bf16_gradient_accumulation_halves_gradient_bytes_and_trains(tmp_path):
    def run(grad_dtype):
        cfg = {"offload": {"params": "host", "gradients": "host", "optimizer": "host"},
               "precision": {"grad_dtype": grad_dtype}, "optimizer": {"lr": LR},
               "train": {"grad_accum_steps": 2, "max_grad_norm": 1.0}}
        losses = []
        with zerotier.initialize(tiny_gpt(), cfg) as engine:
            accs = [slot.acc for slot in engine.grads.backend.slots]
            assert all(acc.dtype == zerotier.state.DTYPES[grad_dtype] for acc in accs)
            grad_bytes = sum(acc.numel() * acc.element_size() for acc in accs)
            for x, y in list(batches(VOCAB, SEQ, BATCH, 1)) * 16:  # one batch: the loss must fall
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
                losses.append(float(loss.detach()))
        return grad_bytes, losses

    fp32_bytes, fp32_losses = run("fp32")
    bf16_bytes, bf16_losses = run("bf16")
    assert bf16_bytes * 2 == fp32_bytes
    assert bf16_losses[-1] < bf16_losses[0] - 0.1  # it trains
    for a, b in zip(fp32_losses, bf16_losses):
        assert abs(a - b) <= 2e-2 * abs(a), (a, b)  # bf16 has 8 mantissa bits


class TwoParams(torch.nn.Module):
    """One unit with two parameters; `b` is used only when asked."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(64))
        self.b = torch.nn.Parameter(torch.randn(64))

    def forward(self, x, use_b: bool):
        y = x * self.a
        return (y + self.b if use_b else y).square().mean()


def test_parameter_without_gradient_in_a_window_reads_zero():
    """Accumulators are not zeroed between steps ([Note: no zeroing pass] in grads.py): a parameter
    that gets no gradient in a window must count as zero in the clipping norm, not as the last
    window's gradient, and is not updated (torch skips a .grad of None: issue 15 item 3).
    Reference: torch AdamW + clip_grad_norm_ on the same data."""
    uses = [True, False, False, True, False]
    torch.manual_seed(0)
    ref = TwoParams()
    ours_model = TwoParams()
    ours_model.load_state_dict(ref.state_dict())
    opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(3)
    data = [torch.randn(64, generator=gen) for _ in uses]
    with zerotier.initialize(ours_model, {"optimizer": {"lr": LR}, "offload": {"optimizer": "host"},
                                          "train": {"max_grad_norm": 0.5}}) as engine:
        for x, use_b in zip(data, uses):
            ref(x, use_b).backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            opt.step()
            opt.zero_grad(set_to_none=True)
            engine.backward(engine(x, use_b))
            engine.step()
        ours = engine.parameters_fp32()
    torch.testing.assert_close(ours["a"], ref.a.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours["b"], ref.b.detach(), rtol=1e-5, atol=1e-6)
