"""Gradients off the host (issue 12 item 3): `precision.grad_dtype = "bf16"` accumulators and
`offload.gradients = "nvme"` ([Note: gradients on NVMe] in zerotier/grads.py).

- bf16 accumulators, wherever they live, equal a reference written out here: plain PyTorch
  whose accumulated gradient is rounded to bf16 after every micro-batch, as the engine's
  accumulator is (tolerance of tests/test_engine.py: only the norm's and Adam's summation
  order differ); the fp32 reference is measurably different, so the rounding is tested.
- gradients on NVMe give bitwise the weights of gradients on host: fp32 and bf16, with and
  without accumulation and clipping (and the updates during backward that run without it),
  parameters without a gradient in some micro-batches, the plain PyTorch loop, every ZeRO
  stage on 2 gloo ranks, and a resume from a checkpoint.
- host RAM held for gradients on NVMe does not grow with the model (the staging only), and
  stays within what the planner counted; the planner places, counts and shows them.
- a failed gradient write or read ends as every other failure of a step ([Note: a step is
  all or nothing] in engine.py).
"""
from __future__ import annotations

import errno

import pytest
import torch

import zerotier
from zerotier.config import OffloadConfig, PrecisionConfig, ZeroConfig
from zerotier.dist import spawn
from zerotier.dist.partition import stage_partitions
from zerotier.errors import TierIOError, ZerotierError
from zerotier.grads import GradFile, GradStore
from zerotier.models import TinyGPT, batches
from zerotier.optim.grad_staging import StagedGrads
from zerotier.planner.inputs import ModelFacts, Node, PlanConfig
from zerotier.planner.planner import make_plan
from zerotier.state import Location

VOCAB, SEQ, BATCH, LR, CLIP = 128, 16, 4, 3e-3, 1.0


def tiny_gpt(seed=0, vocab=VOCAB):
    torch.manual_seed(seed)
    return TinyGPT(vocab=vocab, dim=32, layers=2, heads=2, seq=SEQ)


def config(tmp_path, gradients, grad_dtype="fp32", accum=1, clip=CLIP, optimizer="host", params="host"):
    return {"offload": {"params": params, "gradients": gradients, "optimizer": optimizer},
            "tiers": {"nvme_path": str(tmp_path)}, "precision": {"grad_dtype": grad_dtype},
            "optimizer": {"lr": LR, "weight_decay": 0.01},
            "train": {"grad_accum_steps": accum, "max_grad_norm": clip}}


def train(model, cfg, data):
    """engine.backward / engine.step over `data`; the losses and the trained fp32 weights."""
    losses = []
    with zerotier.initialize(model, cfg) as engine:
        assert engine.plan.placement["gradients"].value == cfg["offload"]["gradients"]
        for x, y in data:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        return losses, engine.parameters_fp32()


def assert_bitwise(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs"


# ------------------------------------------------------------------ bf16 accumulators


def gradient_read_by_the_optimizer(engine) -> dict[str, torch.Tensor]:
    """Per parameter name, the accumulated gradient the next update reads (in fp32), wherever it
    lives. engine.grad_norm() first: it ends the window, as HF Trainer's norm logging does."""
    engine.grad_norm()
    names = {id(p): n for n, p in engine.module.named_parameters()}
    out = {}
    for unit in engine.units:
        shard = engine.grads.shard(unit)
        if isinstance(shard, GradFile):  # the gradient store reads its file into our tensor
            flat = torch.empty(shard.numel, dtype=shard.dtype)
            shard.read_into(flat).wait()
            shard = flat
        for p, view in unit.views(shard):
            out[names[id(p)]] = view.float()
    return out


@pytest.mark.parametrize("gradients", ["device", "host", "nvme"])
@pytest.mark.pins("design#config-tells-the-truth")
def test_bf16_accumulation_matches_an_explicit_bf16_reference(gradients, tmp_path):
    """Window by window, from the same weights: the engine's bf16 gradient is bitwise the reference's
    (the first micro-batch's gradient rounded to bf16, each later one added in fp32 and the sum
    rounded to bf16 again), and its norm and update are torch's clip_grad_norm_ + AdamW over that
    sum. The weights are re-synced each window: a bf16 rounding flips at one fp32 ulp of
    difference, so free-running runs drift apart by far more than the update's rounding."""
    accum, windows = 3, 4
    data = list(batches(VOCAB, SEQ, BATCH, accum * windows))
    reference = tiny_gpt()
    opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.01)
    double_rounding_differs = False
    with zerotier.initialize(tiny_gpt(), config(tmp_path, gradients, "bf16", accum)) as engine:
        for w in range(windows):
            with torch.no_grad():
                start = engine.parameters_fp32()
                for name, p in reference.named_parameters():
                    p.copy_(start[name])
            acc, twice_rounded = {}, {}
            for k, (x, y) in enumerate(data[w * accum:(w + 1) * accum]):
                engine.backward(engine(x, y))
                (reference(x, y) * (1.0 / accum)).backward()  # scaled as engine.backward scales it
                for name, p in reference.named_parameters():
                    g, p.grad = p.grad, None
                    first = name not in acc
                    acc[name] = g.bfloat16() if first else (acc[name].float() + g).bfloat16()
                    twice_rounded[name] = g.bfloat16() if first else (twice_rounded[name] + g.bfloat16())
                if k < accum - 1:
                    assert not engine.step()  # accumulates only
            ours = gradient_read_by_the_optimizer(engine)
            for name in acc:
                assert torch.equal(ours[name], acc[name].float()), f"window {w}: {name}"
                double_rounding_differs |= not torch.equal(twice_rounded[name], acc[name])
            for name, p in reference.named_parameters():
                p.grad = acc[name].float()
            norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)
            assert engine.grad_norm() == pytest.approx(float(norm), rel=1e-6)
            opt.step()
            opt.zero_grad(set_to_none=True)
            assert engine.step()
            weights = engine.parameters_fp32()
            for name, p in reference.named_parameters():
                torch.testing.assert_close(weights[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)
    assert double_rounding_differs  # the reference's order of rounding is what is tested


# ------------------------------------------------------------------ NVMe == host, bitwise


@pytest.mark.parametrize("grad_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("accum,clip", [(1, None), (3, CLIP)], ids=["updates-during-backward", "accum3-clipped"])
@pytest.mark.parametrize("optimizer", ["host", "nvme"])
def test_nvme_gradients_equal_host_gradients_bitwise(grad_dtype, accum, clip, optimizer, tmp_path):
    data = list(batches(VOCAB, SEQ, BATCH, 4 * accum))
    host = train(tiny_gpt(), config(tmp_path, "host", grad_dtype, accum, clip, optimizer), data)
    nvme = train(tiny_gpt(), config(tmp_path, "nvme", grad_dtype, accum, clip, optimizer), data)
    assert host[0] == nvme[0]
    assert_bitwise(host[1], nvme[1])
    assert list(tmp_path.iterdir()) == [], "the gradient files go with the run directory"


def test_everything_on_nvme_equals_host_gradients_bitwise(tmp_path):
    data = list(batches(VOCAB, SEQ, BATCH, 8))
    host = train(tiny_gpt(), config(tmp_path, "host", "fp32", 2, params="nvme", optimizer="nvme"), data)
    nvme = train(tiny_gpt(), config(tmp_path, "nvme", "fp32", 2, params="nvme", optimizer="nvme"), data)
    assert_bitwise(host[1], nvme[1])


class Gate(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8, 8) / 3)
        self.b = torch.nn.Parameter(torch.randn(8))

    def forward(self, x, use_b: bool):
        y = x @ self.weight
        return y + self.b if use_b else y


class Routed(torch.nn.Module):
    """Two units (Gates); in some micro-batches `b` of each gets no gradient (a unit never complete
    in that backward), in some the whole second unit gets none (a unit left EMPTY)."""

    def __init__(self):
        super().__init__()
        self.first, self.second = Gate(), Gate()

    def forward(self, x, use_b: bool, use_second: bool):
        y = self.first(x, use_b)
        return (self.second(y.tanh(), use_b) if use_second else y).square().mean()


@pytest.mark.filterwarnings("ignore:zerotier prefetch")  # the routing changes the module order
@pytest.mark.parametrize("accum", [1, 2])
def test_parameters_without_a_gradient_read_zero_from_nvme(accum, tmp_path):
    pattern = [(True, True), (False, True), (False, False), (True, False), (False, True), (True, True),
               (False, False), (False, True)]
    gen = torch.Generator().manual_seed(5)
    data = [(torch.randn(4, 8, generator=gen), use_b, use_second) for use_b, use_second in pattern]

    def run(gradients):
        torch.manual_seed(0)
        cfg = config(tmp_path, gradients, accum=accum)
        cfg["train"]["wrap"] = ["Gate"]
        with zerotier.initialize(Routed(), cfg) as engine:
            for x, use_b, use_second in data:
                engine.backward(engine(x, use_b, use_second))
                engine.step()
            return engine.parameters_fp32()

    assert_bitwise(run("host"), run("nvme"))


def test_plain_pytorch_loop_with_nvme_gradients(tmp_path):
    data = list(batches(VOCAB, SEQ, BATCH, 6))

    def run(gradients):
        model = tiny_gpt()
        engine = zerotier.initialize(model, config(tmp_path, gradients, accum=1))
        for i, (x, y) in enumerate(data):
            (model(x, y) / 2).backward()
            if i % 2 == 1:
                engine.optimizer.step()
                engine.optimizer.zero_grad()
        weights = engine.parameters_fp32()
        engine.close()
        return weights

    assert_bitwise(run("host"), run("nvme"))


def test_resume_from_a_checkpoint_with_nvme_gradients(tmp_path):
    """Gradients are not checkpointed (a save is refused inside a window): a resumed run continues
    bitwise as the uninterrupted one."""
    data = list(batches(VOCAB, SEQ, BATCH, 8))
    cfg = config(tmp_path / "swap", "nvme", accum=2, optimizer="nvme")
    (tmp_path / "swap").mkdir()
    with zerotier.initialize(tiny_gpt(), cfg) as engine:
        for i, (x, y) in enumerate(data):
            engine.backward(engine(x, y))
            engine.step()
            if i == 2:
                with pytest.raises(ZerotierError, match="accumulation window"):
                    engine.save_checkpoint(tmp_path / "ckpt")
            if i == 3:
                engine.save_checkpoint(tmp_path / "ckpt")
        straight = engine.parameters_fp32()
    with zerotier.initialize(tiny_gpt(seed=1), cfg) as engine:
        engine.load_checkpoint(tmp_path / "ckpt")
        for x, y in data[4:]:
            engine.backward(engine(x, y))
            engine.step()
        resumed = engine.parameters_fp32()
    assert_bitwise(straight, resumed)


@pytest.mark.cuda
@pytest.mark.parametrize("grad_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("accum,clip", [(1, None), (2, CLIP)], ids=["updates-during-backward", "accum2-clipped"])
@pytest.mark.parametrize("optimizer", ["host", "device"])
def test_nvme_gradients_equal_host_gradients_on_cuda(grad_dtype, accum, clip, optimizer, tmp_path):
    """The GPU paths: gradients copied D2H into the staging block (rounded on the device where the
    fresh gradient is the reduce input), read back for a host or a device optimizer. Within the
    placement tests' tolerance: CUDA's embedding backward sums with atomics."""
    data = [(x.cuda(), y.cuda()) for x, y in batches(VOCAB, SEQ, BATCH, 4 * accum)]
    runs = {}
    for gradients in ("host", "nvme"):
        cfg = config(tmp_path, gradients, grad_dtype, accum, clip, optimizer, params="host")
        cfg["train"]["device"] = "cuda"
        runs[gradients] = train(tiny_gpt(), cfg, data)
    torch.testing.assert_close(torch.tensor(runs["nvme"][0]), torch.tensor(runs["host"][0]), rtol=1e-5, atol=1e-6)
    for name, expected in runs["host"][1].items():
        torch.testing.assert_close(runs["nvme"][1][name], expected, rtol=1e-5, atol=1e-6, msg=name)


# ------------------------------------------------------------------ several ranks


DIST_VOCAB, GLOBAL_BATCH, DIST_STEPS = 64, 4, 3
DIST_CASES = [(stage, "fp32") for stage in (0, 1, 2, 3)] + [(2, "bf16")]


def dist_rank(rank, world_size, nvme_dir):
    """Every (stage, grad dtype) case with gradients on host and on NVMe, on this rank."""
    gen = torch.Generator().manual_seed(1)
    data = []
    for _ in range(DIST_STEPS * 2):
        d = torch.randint(0, DIST_VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=gen)[rank * 2:(rank + 1) * 2]
        data.append((d[:, :-1], d[:, 1:]))
    out = {}
    for stage, grad_dtype in DIST_CASES:
        for gradients in ("host", "nvme"):
            cfg = config(nvme_dir, gradients, grad_dtype, accum=2)
            cfg["zero"] = {"stage": stage, "persistence_threshold": 200, "reduce_bucket_size": 4096}
            out[(stage, grad_dtype, gradients)] = train(tiny_gpt(vocab=DIST_VOCAB), cfg, data)[1]
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return spawn(dist_rank, 2, str(tmp_path_factory.mktemp("nvme")), timeout_s=600)


@pytest.mark.parametrize("stage,grad_dtype", DIST_CASES)
def test_two_ranks_nvme_gradients_equal_host_gradients_bitwise(two_ranks, stage, grad_dtype):
    for rank_results in two_ranks:
        assert_bitwise(rank_results[(stage, grad_dtype, "host")], rank_results[(stage, grad_dtype, "nvme")])
    assert_bitwise(two_ranks[0][(stage, grad_dtype, "nvme")], two_ranks[1][(stage, grad_dtype, "nvme")])


# ------------------------------------------------------------------ host memory and the plan


def mlp(layers, width=256):
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*mods)


def host_peak(layers, gradients, tmp_path):
    """Peak host-pool bytes over a few accumulated, clipped steps (params and optimizer on NVMe),
    and the host bytes the plan counted."""
    cfg = config(tmp_path, gradients, accum=2, params="nvme", optimizer="nvme")
    cfg["train"]["wrap"] = ["Linear"]
    # gradients only: a speculated window holds every unit's new parameters until its check
    cfg["train"]["overlap"] = "none"
    gen = torch.Generator().manual_seed(0)
    with zerotier.initialize(mlp(layers), cfg) as engine:
        for _ in range(4):
            engine.backward(engine(torch.randn(8, 256, generator=gen)).square().mean())
            engine.step()
        return engine.host_pool.stats()["peak"], engine.plan.need["host"]


def test_host_memory_for_nvme_gradients_does_not_grow_with_the_model(tmp_path):
    unit = (256 * 256 + 256) * 4  # one layer's fp32 gradient (and parameter) bytes
    small, small_plan = host_peak(4, "nvme", tmp_path)
    big, big_plan = host_peak(24, "nvme", tmp_path)
    # the plan's host bytes are the largest unit's staging: the same for 4 layers as for 24,
    # and the peak stays within them
    assert small_plan == big_plan and small <= small_plan and big <= big_plan, (small, small_plan, big, big_plan)
    # 20 more layers are 20 more units of gradient: none of it stays in host memory (some
    # blocks of slack: the peak depends on how prefetches and writes overlapped)
    assert big - small < 8 * unit, (small, big)
    host_small, _ = host_peak(4, "host", tmp_path)
    host_big, _ = host_peak(24, "host", tmp_path)
    # the same runs with host gradients do grow: by the 20 units' accumulators, less the part of the
    # small run's peak that was transient staging (initialization keeps a few units' writes in flight)
    assert host_big >= host_small + 15 * unit, (host_small, host_big)


def plan(numels, offload, grad_dtype="fp32", device=10**15, host=10**15, nvme=10**15, world_size=1, stage=0):
    return make_plan(ModelFacts.of_sizes(numels),
                     PlanConfig(offload=OffloadConfig(**offload), precision=PrecisionConfig(grad_dtype=grad_dtype),
                                zero=ZeroConfig(stage=stage), alignment=1),
                     Node(torch.device("cpu"), budgets={"device": device, "host": host, "nvme": nvme},
                          world_size=world_size))


@pytest.mark.parametrize("grad_dtype,grad_bytes", [("fp32", 4), ("bf16", 2)])
def test_plan_counts_nvme_gradients_and_their_staging(grad_dtype, grad_bytes):
    numels = [1000, 3000, 2000]
    on_host = plan(numels, {"params": "device", "gradients": "host", "optimizer": "host"}, grad_dtype)
    on_nvme = plan(numels, {"params": "device", "gradients": "nvme", "optimizer": "host"}, grad_dtype)
    assert on_nvme.placement["gradients"] is Location.NVME
    assert on_nvme.state_bytes["gradients"] == grad_bytes * 6000 == on_host.state_bytes["gradients"]
    staging = (GradStore.nvme_staging_bytes(3000, 3000, 4, grad_bytes, 1, 0)
               + StagedGrads.staging_bytes(3000, grad_bytes))
    assert on_nvme.need["host"] == on_host.need["host"] - grad_bytes * 6000 + staging
    # the files, and room for GRAD_WRITES rewrites in flight (the two largest units)
    assert on_nvme.need["nvme"] == grad_bytes * 6000 + grad_bytes * (3000 + 2000)
    assert on_nvme.breakdown["grads_nvme"] > 0
    assert on_nvme.to_dict()["grad_dtype"] == grad_dtype
    summary = on_nvme.summary()
    assert "gradients  nvme" in summary and f"the engine's {grad_dtype} accumulators" in summary


def test_plan_counts_the_reduced_shard_files_at_stage_1():
    stage1 = plan([4000, 4000], {"params": "device", "gradients": "nvme", "optimizer": "host"},
                  world_size=4, stage=1)
    stage2 = plan([4000, 4000], {"params": "device", "gradients": "nvme", "optimizer": "host"},
                  world_size=4, stage=2)
    shards = 2 * 1024  # each unit's 4000 / 4 ranks, padded to 32 elements as Sharding.assign pads them
    assert [p.shard_numel for p in stage_partitions([4000, 4000], 4, 1, 0)] == [1024, 1024]
    assert stage1.need["nvme"] == 4 * 8000 + 4 * shards + 4 * 8000  # sums, shards, two rewrites
    assert stage2.need["nvme"] == 4 * shards + 4 * shards  # shards, two rewrites


def test_auto_puts_gradients_on_nvme_when_the_host_cannot_hold_them():
    numels = [100_000] * 40  # 16 MB of fp32 parameters, and as much gradient
    offload = {"params": "device", "gradients": "auto", "optimizer": "nvme"}
    device = 20_000_000  # the parameters and their working set, not the gradients
    roomy = plan(numels, offload, device=device, host=10**9)
    assert roomy.placement["gradients"] is Location.HOST
    tight = plan(numels, offload, device=device, host=10_000_000)
    assert tight.placement["gradients"] is Location.NVME
    assert tight.need["host"] <= 10_000_000


def test_zerotier_plan_shows_nvme_gradients(tmp_path, capsys):
    from zerotier.cli import main

    assert main(["plan", "--params", "5B", "--offload", "params=nvme", "--offload", "gradients=nvme",
                 "--offload", "optimizer=nvme", "--nvme-path", str(tmp_path), "--nvme", "1TiB",
                 "--host", "16GiB", "--device", "8GiB"]) == 0
    out = capsys.readouterr().out
    assert "gradients  nvme" in out and "fits: yes" in out


# ------------------------------------------------------------------ failures


def fail_next(engine, op, key_suffix):
    """The next NVMe `op` of a key ending in `key_suffix` fails with EIO (the store's own fault
    injection)."""
    store, armed = engine.store, [True]
    real = getattr(store, op)

    def failing(key, buf, *args, **kwargs):
        if armed[0] and key.endswith(key_suffix):
            armed[0] = False
            store.engine.inject_fault(op=op, errno=errno.EIO)
        return real(key, buf, *args, **kwargs)
    setattr(store, op, failing)


def test_failed_gradient_write_drops_the_window(tmp_path):
    """A gradient file that cannot be written fails engine.backward(); step() then refuses until
    zero_grad() drops the window, and training goes on as if that batch had been skipped."""
    data = list(batches(VOCAB, SEQ, BATCH, 5))
    cfg = config(tmp_path, "nvme")
    _, skipped = train(tiny_gpt(), cfg, data[:2] + data[3:])
    with zerotier.initialize(tiny_gpt(), cfg) as engine:
        for i, (x, y) in enumerate(data):
            if i == 2:
                fail_next(engine, "write", ".grad")
                with pytest.raises(TierIOError, match=r"nvme tier: write of shard 'u\d+\.grad'") as info:
                    engine.backward(engine(x, y))
                assert info.value.errno == errno.EIO
                with pytest.raises(ZerotierError, match="zero_grad"):
                    engine.step()
                engine.zero_grad()
                continue
            engine.backward(engine(x, y))
            engine.step()
        assert_bitwise(engine.parameters_fp32(), skipped)


@pytest.fixture(scope="module")
def accumulated_runs(tmp_path_factory):
    """Weights after 4 windows of 2 micro-batches (gradients on NVMe), and after the same data
    without window 1 (micro-batches 2 and 3)."""
    data = list(batches(VOCAB, SEQ, BATCH, 8))
    cfg = config(tmp_path_factory.mktemp("clean"), "nvme", accum=2)
    return data, train(tiny_gpt(), cfg, data)[1], train(tiny_gpt(), cfg, data[:2] + data[4:])[1]


@pytest.mark.parametrize("then", ["run the window again", "go on with the next window"])
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO], ids=["ENOSPC", "EIO"])
@pytest.mark.parametrize("micro", [2, 3], ids=["first-of-window", "last-of-window"])
@pytest.mark.pins("design#a-step-is-all-or-nothing")
def test_failed_gradient_write_mid_window_restarts_the_window(micro, code, then, accumulated_runs, tmp_path):
    """Issue 37 row 12: a gradient write that fails during a window's micro-batch (grad_accum_steps
    2) fails that backward; zero_grad(), as the refusal says, drops the whole window and its
    micro-batch count starts again at its first micro-batch. Running the window again trains
    bitwise like the run that never failed; going on with the next data, like the run without
    that window. (Kept, the count ended each later window one micro-batch early: 1.3e-2 off.)"""
    data, clean, skipped = accumulated_runs
    armed = [True]
    with zerotier.initialize(tiny_gpt(), config(tmp_path, "nvme", accum=2)) as engine:
        write = engine.store.write

        def failing(key, buf, *args, **kwargs):
            if armed[0] and key.endswith(".grad"):
                armed[0] = False
                engine.store.engine.inject_fault(op="write", errno=code)
            return write(key, buf, *args, **kwargs)
        i = 0
        while i < len(data):
            x, y = data[i]
            if i == micro and armed[0]:
                engine.store.write = failing
                with pytest.raises(TierIOError, match=r"nvme tier: write of shard 'u\d+\.grad'") as info:
                    engine.backward(engine(x, y))
                engine.store.write = write
                assert info.value.errno == code and not armed[0]
                with pytest.raises(ZerotierError, match="the window starts again at its first micro-batch"):
                    engine.step()
                engine.zero_grad()
                i = 2 if then == "run the window again" else 4
                continue
            engine.backward(engine(x, y))
            engine.step()
            i += 1
        assert engine.global_steps == (4 if then == "run the window again" else 3)
        assert_bitwise(engine.parameters_fp32(), clean if then == "run the window again" else skipped)


def test_failed_gradient_read_leaves_the_step_retryable(tmp_path):
    """A gradient file that cannot be read back fails engine.step() before any update: the files
    are intact, and step() again applies the same update."""
    data = list(batches(VOCAB, SEQ, BATCH, 3))
    cfg = config(tmp_path, "nvme", params="device")
    _, straight = train(tiny_gpt(), cfg, data)
    with zerotier.initialize(tiny_gpt(), cfg) as engine:
        for i, (x, y) in enumerate(data):
            engine.backward(engine(x, y))
            if i == 1:
                fail_next(engine, "read", ".grad")
                with pytest.raises(TierIOError, match=r"nvme tier: read of shard 'u\d+\.grad'") as info:
                    engine.step()
                assert info.value.errno == errno.EIO
            engine.step()
        assert_bitwise(engine.parameters_fp32(), straight)
