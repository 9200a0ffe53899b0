"""Models built on the meta device ([Note: meta-device models] in zerotier/materialize.py):
materialized unit by unit into their tiers, deterministically whatever the placement."""
from __future__ import annotations

import threading
import time

import pytest
import torch

import zerotier
from zerotier.errors import ConfigError
from zerotier.models import TinyGPT, batches, init_tiny_gpt

# close() of an engine over a meta-built model warns that it keeps the weights (docs: models larger than
# RAM); asserted once below (test_meta_model_trains_like_a_normal_build_...), incidental everywhere else here
META_NOT_PUT_BACK = "parameters of a model built on the meta device are not put back into it"
pytestmark = pytest.mark.filterwarnings(f"ignore:zerotier close\\(\\). \\d+ {META_NOT_PUT_BACK}:RuntimeWarning")

PLACEMENTS = {
    "device": {"params": "device", "gradients": "device", "optimizer": "device"},
    "params-host": {"params": "host", "gradients": "host", "optimizer": "host"},
    "params-nvme": {"params": "nvme", "gradients": "host", "optimizer": "nvme"},
}


def meta_model():
    with torch.device("meta"):
        return TinyGPT(vocab=64, dim=32, layers=2, heads=2, seq=16)


def weights_after_training(placement, tmp_path, steps=3):
    torch.manual_seed(7)
    cfg = {"offload": PLACEMENTS[placement], "tiers": {"nvme_path": str(tmp_path)}}
    model = meta_model()
    with zerotier.initialize(model, cfg, init_fn=init_tiny_gpt) as engine:
        initial = engine.parameters_fp32()
        for x, y in batches(64, 16, 2, steps):
            engine.backward(engine(x, y))
            engine.step()
        return initial, engine.parameters_fp32(), model


def test_meta_model_materializes_the_same_weights_under_every_placement(tmp_path):
    runs = {name: weights_after_training(name, tmp_path) for name in PLACEMENTS}
    first_init, first_trained, _ = runs["device"]
    assert all(t.abs().sum() > 0 for n, t in first_init.items() if not n.endswith("bias")), "left uninitialized"
    for name, (initial, trained, _) in runs.items():
        for key in first_init:
            assert torch.equal(initial[key], first_init[key]), (name, key)
            torch.testing.assert_close(trained[key], first_trained[key], rtol=1e-5, atol=1e-6, msg=f"{name} {key}")


@pytest.mark.pins("design#models-larger-than-ram")
def test_meta_model_trains_like_a_normal_build_of_the_same_weights(tmp_path):
    """The materialized model trains exactly like the same weights loaded into a normally built model."""
    with pytest.warns(RuntimeWarning, match=META_NOT_PUT_BACK):
        initial, trained, model = weights_after_training("params-host", tmp_path)
    assert all(not p.is_meta for p in model.parameters())  # materialized (close() warns it keeps them)
    ref = TinyGPT(vocab=64, dim=32, layers=2, heads=2, seq=16)
    ref.load_state_dict(initial, strict=False)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    for x, y in batches(64, 16, 2, 3):
        ref(x, y).backward()
        opt.step()
        opt.zero_grad()
    for key, value in trained.items():
        torch.testing.assert_close(value, dict(ref.named_parameters())[key].detach(), rtol=1e-5, atol=1e-6,
                                   msg=key)


def test_init_fn_initializes_modules_without_reset_parameters():
    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.empty(8))

        def forward(self, x):
            return (x * self.w).square().mean()

    with torch.device("meta"):
        model = Scale()
    with pytest.raises(ConfigError, match=r"module '<root>' \(Scale\) was built on the meta device and has no "
                                          r"reset_parameters\(\): pass .*init_fn"):
        zerotier.initialize(model)

    def init_fn(module):
        if isinstance(module, Scale):
            module.w.fill_(0.5)
    with torch.device("meta"):
        model = Scale()
    with zerotier.initialize(model, init_fn=init_fn) as engine:
        assert torch.equal(engine.parameters_fp32()["w"], torch.full((8,), 0.5))
        engine.backward(engine(torch.ones(2, 8)))
        engine.step()


def test_modules_reset_parameters_initialize_a_meta_model():
    """Without init_fn every module with meta parameters must have reset_parameters(): a stack of
    torch layers needs nothing more."""
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 1))
    torch.manual_seed(0)
    with zerotier.initialize(model, {"offload": PLACEMENTS["params-host"]}) as engine:
        weights = engine.parameters_fp32()
        assert weights["1.weight"].eq(1).all() and weights["1.bias"].eq(0).all()  # LayerNorm's reset
        assert weights["0.weight"].abs().max() <= 1 / 8 ** 0.5 + 1e-6  # Linear's kaiming_uniform bound
        engine.backward(engine(torch.randn(4, 8)).square().mean())
        engine.step()


def _linear_only_init(module):
    """An init_fn that covers nn.Linear only, leaving LayerNorm and Embedding to their own reset."""
    if isinstance(module, torch.nn.Linear):
        torch.nn.init.normal_(module.weight, std=0.02)  # bias left to the module


@pytest.mark.parametrize("placement", ["params-host", "params-nvme"])
def test_init_fn_covering_some_modules_leaves_no_undefined_memory(placement, tmp_path):
    """Issue 21: tensors init_fn did not set in full get the module's reset_parameters(), as a model
    built on the CPU would have them before the user's init ran ([Note: meta-device models])."""
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 4))
    torch.manual_seed(0)
    cfg = {"offload": PLACEMENTS[placement], "tiers": {"nvme_path": str(tmp_path)}}
    with zerotier.initialize(model, cfg, init_fn=_linear_only_init) as engine:
        w = engine.parameters_fp32()
        assert w["1.weight"].eq(1).all() and w["1.bias"].eq(0).all()  # LayerNorm's reset_parameters
        assert w["0.weight"].isfinite().all() and w["0.weight"].std() > 0.5  # Embedding: normal(0, 1)
        assert w["2.weight"].std() < 0.05  # init_fn's normal(0, 0.02) kept, not reset over
        bound = 1 / 8 ** 0.5 + 1e-6
        assert w["2.bias"].isfinite().all() and w["2.bias"].abs().max() <= bound  # Linear's own bias init
        x = torch.randint(0, 16, (4, 3))
        engine.backward(engine(x).square().mean())
        engine.step()
        assert all(t.isfinite().all() for t in engine.parameters_fp32().values())


def test_parameters_nothing_initializes_are_named():
    """A module with no reset_parameters() whose parameters init_fn leaves unset is a ConfigError
    naming them, never uninitialized memory."""
    class Pair(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Parameter(torch.empty(4))
            self.b = torch.nn.Parameter(torch.empty(4, 4))

        def forward(self, x):
            return (x * self.a) @ self.b

    def init_a_only(module):
        if isinstance(module, Pair):
            module.a.fill_(1.0)
            module.b[0].fill_(1.0)  # one row of b: b is still not set in full

    with torch.device("meta"):
        model = torch.nn.Sequential(Pair(), torch.nn.Linear(4, 1))
    with pytest.raises(ConfigError, match=r"module '0' \(Pair\): init_fn left b unset \(or not set in full\) "
                                          r"and Pair has no reset_parameters\(\): set them in init_fn"):
        zerotier.initialize(model, {"offload": PLACEMENTS["params-host"]}, init_fn=init_a_only)


def _failing_after(n):
    """init_tiny_gpt that raises at the n-th nn.Linear it initializes (a unit part-way through)."""
    seen = {"linear": 0}

    def init_fn(module):
        init_tiny_gpt(module)
        if isinstance(module, torch.nn.Linear):
            seen["linear"] += 1
            if seen["linear"] == n:
                raise RuntimeError("init_fn failed on purpose")
    return init_fn


@pytest.mark.parametrize("placement", ["params-host", "params-nvme"])
def test_initialize_again_after_a_failing_init_fn(placement, tmp_path):
    """Issue 21 ([Note: a failed initialize] in engine.py): a failing init_fn left the model half
    swapped to freed engine memory and the next initialize segfaulted. It now leaves the model as
    built (meta), and initialize again gives the weights a fresh model gets."""
    cfg = {"offload": PLACEMENTS[placement], "tiers": {"nvme_path": str(tmp_path)}}
    with torch.device("meta"):
        model = TinyGPT(vocab=64, dim=32, layers=3, heads=2, seq=16)
    torch.manual_seed(7)
    with pytest.raises(RuntimeError, match="init_fn failed on purpose"):
        zerotier.initialize(model, cfg, init_fn=_failing_after(6))  # in the second block
    assert all(p.is_meta for p in model.parameters()) and all(b.is_meta for b in model.buffers())
    assert not list(tmp_path.iterdir())  # the failed engine's run directory is gone
    torch.manual_seed(7)
    with zerotier.initialize(model, cfg, init_fn=init_tiny_gpt) as engine:
        again = engine.parameters_fp32()
        for x, y in batches(64, 16, 2, 2):
            engine.backward(engine(x, y))
            engine.step()
    initial, _, _ = weights_after_training(placement, tmp_path, steps=0)  # a fresh meta model, same seed
    for key, value in initial.items():
        assert torch.equal(again[key], value), key


@pytest.mark.parametrize("placement", ["params-host", "params-nvme"])
def test_failed_initialize_gives_placed_weights_back(placement, tmp_path):
    """Units placed before the failure (built normally) get their weights back, bit for bit."""
    cfg = {"offload": PLACEMENTS[placement], "tiers": {"nvme_path": str(tmp_path)}}
    torch.manual_seed(3)
    model = TinyGPT(vocab=64, dim=32, layers=3, heads=2, seq=16)
    with torch.device("meta"):
        model.blocks[2] = TinyGPT(vocab=64, dim=32, layers=1, heads=2, seq=16).blocks[0]  # built on meta
    before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.is_meta}
    with pytest.raises(RuntimeError, match="init_fn failed on purpose"):
        zerotier.initialize(model, cfg, init_fn=_failing_after(2))  # in blocks.2, after blocks 0 and 1
    for name, p in model.named_parameters():
        if name.startswith("blocks.2."):
            assert p.is_meta, name
        else:
            assert torch.equal(p.detach(), before[name]), name
    with zerotier.initialize(model, cfg, init_fn=init_tiny_gpt) as engine:
        engine.backward(engine(*next(iter(batches(64, 16, 2, 1)))))
        engine.step()


def test_a_model_whose_weights_cannot_be_given_back_is_refused(monkeypatch):
    """Where a failed initialize cannot give a placed unit's weights back (here: reading its master
    fails too), its parameters become meta tensors (a read raises, never reads freed memory) and the
    next initialize is a ConfigError saying so."""
    from zerotier.optim.state_store import OptStateStore

    def unreadable(self, unit, keys=()):
        raise OSError("master unreadable")
    monkeypatch.setattr(OptStateStore, "read_state", unreadable)
    model = TinyGPT(vocab=64, dim=32, layers=3, heads=2, seq=16)
    with torch.device("meta"):
        model.blocks[2] = TinyGPT(vocab=64, dim=32, layers=1, heads=2, seq=16).blocks[0]
    with pytest.raises(RuntimeError, match="init_fn failed on purpose"):
        zerotier.initialize(model, {"offload": PLACEMENTS["params-host"]}, init_fn=_failing_after(2))
    assert model.blocks[0].qkv.weight.is_meta and model.blocks[1].fc.weight.is_meta
    with pytest.raises(ConfigError, match=r"an earlier zerotier.initialize on this model failed part-way and could "
                                          r"not give the weights of 3 unit\(s\) back \(<root>, blocks.0, blocks.1\): "
                                          r"build or load the model again"):
        zerotier.initialize(model, {"offload": PLACEMENTS["params-host"]}, init_fn=init_tiny_gpt)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_meta_built_transformers_model_gets_its_own_init_weights(arch):
    """[Note: meta-device models] With no init_fn, a transformers PreTrainedModel built on meta is
    initialized by its _init_weights (RMSNorm and GPT-2's Conv1D have no reset_parameters(): refused
    before): what transformers' init makes deterministic (norms, biases, rotary inv_freq) equals a
    normal build's, and the random weights have its std (initializer_range, GPT-2's scaled c_proj),
    not nn.Linear's kaiming bound."""
    transformers = pytest.importorskip("transformers")
    std = 0.02
    if arch == "llama":
        config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                          initializer_range=std)
        build = transformers.LlamaForCausalLM
    else:
        config = transformers.GPT2Config(vocab_size=256, n_embd=128, n_layer=2, n_head=4, n_positions=64,
                                         initializer_range=std)
        build = transformers.GPT2LMHeadModel
    torch.manual_seed(0)
    normal = build(config)
    with torch.device("meta"):
        model = build(config)
    with zerotier.initialize(model, {"offload": PLACEMENTS["params-host"]}) as engine:
        got = {n: t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}
        assert not any(t.is_meta for t in got.values())
        engine.close(restore_weights=False)  # read above: a meta-built model's weights are not put back
    for name, expected in [*normal.named_parameters(), *normal.named_buffers()]:
        expected = expected.detach()
        t = got[name]
        if expected.dim() < 2:  # norms, biases, inv_freq: deterministic in transformers' init
            assert torch.equal(t, expected), name
        else:
            assert abs(float(t.std()) - float(expected.std())) < 0.15 * float(expected.std()), name
            assert not torch.equal(t, expected), name
    assert any(abs(float(t.std()) - std) < 0.003 for n, t in got.items() if t.dim() == 2)


class _TiedStack(torch.nn.Module):
    """Linear layers whose first and third share a weight: the unit that comes first materializes
    the shared weight and the other owner's bias, so the order units are materialized in matters."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(32, 32) for _ in range(3))
        self.norm = torch.nn.LayerNorm(32)
        self.c.weight = self.a.weight

    def forward(self, x):
        return self.c(self.norm(self.b(self.a(x)))).square().mean()


@pytest.fixture
def two_threads():
    """[Note: materializing ahead] runs only where torch has a thread to share."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _initial_weights(ahead, monkeypatch, tmp_path, init_fn, placement="params-host"):
    """The initial fp32 weights of a meta-built _TiedStack with `ahead` units materialized ahead,
    the names of the threads that materialized its units, and torch's thread count after."""
    import zerotier.materialize as materialize
    monkeypatch.setattr(materialize, "AHEAD", ahead)
    threads, unit_of = [], materialize.Materializer.unit

    def unit(self, u):
        threads.append(threading.current_thread().name)
        return unit_of(self, u)
    monkeypatch.setattr(materialize.Materializer, "unit", unit)
    with torch.device("meta"):
        model = _TiedStack()
    torch.manual_seed(11)
    cfg = {"offload": PLACEMENTS[placement], "tiers": {"nvme_path": str(tmp_path)}, "train": {"wrap": ["Linear"]}}
    with zerotier.initialize(model, cfg, init_fn=init_fn) as engine:
        return engine.parameters_fp32(), list(threads), torch.get_num_threads()  # (a later run patches over this one)


@pytest.mark.parametrize("init_fn", [None, _linear_only_init], ids=["reset_parameters", "init_fn"])
@pytest.mark.parametrize("placement", ["params-host", "params-nvme"])
def test_materializing_ahead_gives_the_serial_weights(init_fn, placement, two_threads, monkeypatch, tmp_path):
    """[Note: materializing ahead] The next unit is materialized on a worker thread while one is
    placed: the weights are the serial path's bit for bit (each unit's draws from torch's generator,
    a tied weight materialized by the same unit), and torch's thread budget is the caller's again after."""
    serial, serial_threads, _ = _initial_weights(0, monkeypatch, tmp_path, init_fn, placement)
    ahead, ahead_threads, threads_after = _initial_weights(1, monkeypatch, tmp_path, init_fn, placement)
    assert set(serial_threads) == {threading.current_thread().name}
    assert set(ahead_threads) == {"zerotier-materialize"}, ahead_threads  # the worker did run
    assert threads_after == 2
    assert serial.keys() == ahead.keys()
    for key in serial:
        assert torch.equal(serial[key], ahead[key]), key
    assert not torch.equal(serial["a.bias"], serial["b.bias"])  # seeded per unit


@pytest.mark.parametrize("threads", [2, 8])
def test_materializing_ahead_gives_the_worker_one_thread_and_the_caller_all(threads, monkeypatch, tmp_path):
    """[Note: materializing ahead] The worker draws on one thread while the caller keeps all T of
    torch's threads for its memory-bound phases (not a share: T // 4 to the worker cost 14% at
    T = 2), a thread started meanwhile begins with T, and T is torch's count after."""
    import zerotier.materialize as materialize
    monkeypatch.setattr(materialize, "AHEAD", 1)
    worker, caller, started = [], [], []
    unit_of, take_of = materialize.Materializer.unit, materialize.Ahead.take

    def unit(self, u):
        worker.append((threading.current_thread().name, torch.get_num_threads()))
        return unit_of(self, u)

    def take(self, u):
        caller.append(torch.get_num_threads())
        later = threading.Thread(target=lambda: started.append(torch.get_num_threads()))
        later.start()
        later.join()
        return take_of(self, u)
    monkeypatch.setattr(materialize.Materializer, "unit", unit)
    monkeypatch.setattr(materialize.Ahead, "take", take)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.device("meta"):
            model = _TiedStack()
        with zerotier.initialize(model, {"train": {"wrap": ["Linear"]}}):
            after = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    assert worker and set(worker) == {("zerotier-materialize", 1)}, worker
    assert caller and set(caller) == {threads}, caller
    assert set(started) == {threads}, started
    assert after == threads


def test_materializing_ahead_holds_at_most_two_units(two_threads, monkeypatch, tmp_path):
    """Memory stays bounded by units: while one unit is placed, one more is materialized, never
    more (the plan counts both: materialize.pool_bytes), and every block is given back."""
    import zerotier.materialize as materialize
    held, views_of = [], materialize.Materializer._pool_views

    def pool_views(self, unit):
        out = views_of(self, unit)
        held.append(len(self._blocks))
        return out
    monkeypatch.setattr(materialize.Materializer, "_pool_views", pool_views)
    monkeypatch.setattr(materialize.Materializer, "release",
                        lambda self, unit, release=materialize.Materializer.release: (time.sleep(0.02),
                                                                                      release(self, unit)))
    with torch.device("meta"):
        model = TinyGPT(vocab=64, dim=32, layers=6, heads=2, seq=16)
    cfg = {"offload": PLACEMENTS["params-nvme"], "tiers": {"nvme_path": str(tmp_path)}}
    engine = zerotier.initialize(model, cfg, init_fn=init_tiny_gpt)
    try:
        assert len(held) == len(engine.param_units) and max(held) == 1 + materialize.AHEAD, held
        assert not engine._placement.materializer._blocks
    finally:
        engine.close(restore_weights=False)


def test_infinite_values_an_init_fn_sets_are_set():
    """A tensor holds a NaN iff its sum is NaN, but +inf and -inf also sum to NaN: those tensors are
    searched element-wise, not taken for unset and reset over."""
    def init_fn(module):
        module.weight.copy_(torch.tensor([float("inf"), float("-inf")]).repeat(8).view(4, 4))
        module.bias.fill_(1.0)
    with torch.device("meta"):
        model = torch.nn.Linear(4, 4)
    with zerotier.initialize(model, init_fn=init_fn) as engine:
        assert engine.parameters_fp32()["weight"].isinf().all()
