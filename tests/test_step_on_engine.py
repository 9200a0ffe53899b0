"""A unit's update on the device while its state stays home ([Note: device staging] in
optim/device_staging.py, [Note: where the update runs] in planner/step_on.py): the device path
against the CPU path, split checkpoints, the profile. Here the "device" is the CPU and the suite's
lagging device copies late ([Note: the lagging device]): the staging runs through its own copies
and the rule's device variant, so a missing join or wait fails."""
import pytest
import torch

import zerotier
import zerotier.planner.step_on as planner_step_on
from zerotier.models import TinyGPT, batches
from zerotier.optim.device_staging import DeviceStaging
from zerotier.optim.state_terms import OptStateSizing

VOCAB, SEQ, BATCH, LR = 64, 16, 4, 3e-3


@pytest.fixture(autouse=True)
def _no_saved_rates(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEROTIER_BENCH_FILE", str(tmp_path / "no-bench.json"))


def force(monkeypatch, where):
    """Make the plan's optimizer_step_on `where(n)` for n trainable units (a test's per-unit assignment)."""
    monkeypatch.setattr(planner_step_on, "steps_on", lambda requested, homes: tuple(where(len(homes))))


def config(root, optimizer, step_on="cpu", profile=False, precision=None, gradients="host", loop=None,
           optimizer_cfg=None):
    root.mkdir(parents=True, exist_ok=True)
    return {"optimizer": {"lr": LR, "weight_decay": 0.01, "step_on": step_on, **(optimizer_cfg or {})},
            "offload": {"params": "device", "gradients": gradients, "optimizer": optimizer},
            "tiers": {"nvme_path": str(root)}, "precision": precision or {},
            "train": loop or {"max_grad_norm": 1.0, "overlap": "none"}, "profile": {"enabled": profile}}


def make_model():
    torch.manual_seed(0)
    return TinyGPT(vocab=VOCAB, dim=32, layers=3, heads=2, seq=SEQ)


def train(engine, start, steps):
    for x, y in list(batches(VOCAB, SEQ, BATCH, start + steps, seed=5))[start:]:
        engine.backward(engine(x, y))
        engine.step()


def stored(engine) -> dict:
    """Every unit's stored optimizer state bytes ([Note: optimizer state layout]) and step counts."""
    state = engine.unit_optimizer.state
    return {u.key: (state.read_state(u, encoded=True), list(state.steps[u.index])) for u in engine.units}


def assert_close(a: dict, b: dict, rel: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for k in a:
        err = (a[k].double() - b[k].double()).norm() / b[k].double().norm().clamp_min(1e-30)
        assert err <= rel, (k, float(err))


def variants_run(engine) -> dict:
    """Count the update rule's calls by variant ("cpu_pieces" / "device_pieces") from now on."""
    rule, calls = engine.unit_optimizer.rule, {"cpu_pieces": 0, "device_pieces": 0}
    for name in calls:
        def counted(*args, _name=name, _run=getattr(rule, name), **kwargs):
            calls[_name] += 1
            return _run(*args, **kwargs)
        setattr(rule, name, counted)
    return calls


def run(root, optimizer, step_on, precision=None, gradients="host", loop=None,
        optimizer_cfg=None) -> tuple[dict, dict, dict]:
    """fp32 parameters, every unit's stored state (encoded bytes) and the variants' call counts
    after 3 steps."""
    cfg = config(root, optimizer, step_on, precision=precision, gradients=gradients, loop=loop,
                 optimizer_cfg=optimizer_cfg)
    with zerotier.initialize(make_model(), cfg) as engine:
        assert engine.plan.optimizer_step_on == (step_on,) * len(engine.units)
        assert (engine.unit_optimizer.device_staging is not None) == (step_on == "device")
        calls = variants_run(engine)
        train(engine, 0, 3)
        return engine.parameters_fp32(), stored(engine), calls


@pytest.mark.pins("design#the-update-runs-where-the-plan-says-the-state-stays-home")
@pytest.mark.parametrize("optimizer, gradients", [("host", "host"), ("nvme", "host"), ("nvme", "nvme")])
def test_device_step_equals_the_cpu_step_on_fp32_state(tmp_path, optimizer, gradients):
    """Every unit's update on the device (its state staged H2D and back, the rule's device variant,
    never the native kernel) equals the native CPU update within fp32 rounding, 1e-6 relative,
    parameters, master and moments, with the state on host and on NVMe (and gradients read from NVMe)."""
    cpu, cpu_state, cpu_calls = run(tmp_path / "cpu", optimizer, "cpu", gradients=gradients)
    dev, dev_state, dev_calls = run(tmp_path / "device", optimizer, "device", gradients=gradients)
    assert cpu_calls["device_pieces"] == 0 and cpu_calls["cpu_pieces"] > 0
    assert dev_calls["cpu_pieces"] == 0 and dev_calls["device_pieces"] == cpu_calls["cpu_pieces"]
    assert_close(dev, cpu)
    assert dev_state.keys() == cpu_state.keys()
    for key, (state, steps) in cpu_state.items():
        assert dev_state[key][1] == steps
        assert_close({k: v.view(torch.float32) for k, v in dev_state[key][0].items()},
                     {k: v.view(torch.float32) for k, v in state.items()})


@pytest.mark.pins("design#the-update-runs-where-the-plan-says-the-state-stays-home")
@pytest.mark.parametrize("groups", [False, True], ids=["one-group", "two-groups"])
@pytest.mark.parametrize("optimizer", ["host", "nvme"])
def test_device_step_on_compact_state_is_bitwise_the_cpu_step(tmp_path, optimizer, groups):
    """bf16 master (stochastic rounding) and int8 blockwise moments, updated on the device: the same
    rounding map and seeds as the native kernel, so on this machine the stored bytes are the CPU
    run's exactly; also with two param groups in a unit (norms and biases without decay: the update
    runs per parameter slice, [Note: parameters without a gradient] in offload.py)."""
    precision = {"master_dtype": "bf16", "moment_dtype": "int8"}
    decay = {"no_weight_decay": ["*.bias", "*ln*"]} if groups else None
    cpu, cpu_state, _ = run(tmp_path / "cpu", optimizer, "cpu", precision, optimizer_cfg=decay)
    dev, dev_state, calls = run(tmp_path / "device", optimizer, "device", precision, optimizer_cfg=decay)
    assert calls["cpu_pieces"] == 0 and calls["device_pieces"] > 0
    for key, (state, steps) in cpu_state.items():
        assert dev_state[key][1] == steps
        for k, raw in state.items():
            assert torch.equal(dev_state[key][0][k], raw), (key, k)
    for k in cpu:
        assert torch.equal(dev[k], cpu[k]), k


@pytest.mark.parametrize("overlap", [
    {"max_grad_norm": None, "overlap": "early"},          # each unit updated during backward
    {"max_grad_norm": 1.0, "overlap": "speculative"},     # updated during backward, undone if clipped
    {"max_grad_norm": 1e-4, "overlap": "speculative"},    # clipped every step: every window rolled back
], ids=["early", "speculative", "rolled-back"])
def test_device_step_under_the_overlap_policies_equals_the_cpu_step(tmp_path, overlap):
    """Updates started during backward (early, speculative, and speculation rolled back: the NVMe twin
    files, the host undo copies) give the CPU path's result with the update on the device."""
    precision = {"master_dtype": "bf16", "moment_dtype": "int8"}  # bitwise between the two variants
    for optimizer in ("host", "nvme"):
        cpu, cpu_state, _ = run(tmp_path / f"cpu-{optimizer}", optimizer, "cpu", precision, loop=dict(overlap))
        dev, dev_state, calls = run(tmp_path / f"dev-{optimizer}", optimizer, "device", precision, loop=dict(overlap))
        assert calls["device_pieces"] > 0 and calls["cpu_pieces"] == 0
        assert all(torch.equal(dev_state[u][0][k], cpu_state[u][0][k]) and dev_state[u][1] == cpu_state[u][1]
                   for u in cpu_state for k in cpu_state[u][0])
        for k in cpu:
            assert torch.equal(dev[k], cpu[k]), (optimizer, k)


def alternate(first: str):
    other = "device" if first == "cpu" else "cpu"
    return lambda n: [first if i % 2 == 0 else other for i in range(n)]


@pytest.mark.pins("design#the-update-runs-where-the-plan-says-the-state-stays-home")
@pytest.mark.parametrize("optimizer", ["host", "nvme"])
def test_a_split_checkpoint_resumes_into_another_split_and_all_cpu_bitwise_on_what_is_stored(
        tmp_path, monkeypatch, optimizer):
    """Saved from a run whose units alternate cpu/device, a checkpoint loads into the other
    alternation and into all-cpu with its stored state bitwise as saved, and training goes on."""
    force(monkeypatch, alternate("cpu"))
    with zerotier.initialize(make_model(), config(tmp_path / "a", optimizer)) as engine:
        assert set(engine.plan.optimizer_step_on) == {"cpu", "device"}
        train(engine, 0, 3)
        engine.save_checkpoint(tmp_path / "ck")
        saved = stored(engine)
        train(engine, 3, 2)
        expected = engine.parameters_fp32()
    for name, where in (("other-split", alternate("device")), ("all-cpu", lambda n: ["cpu"] * n)):
        force(monkeypatch, where)
        with zerotier.initialize(make_model(), config(tmp_path / name, optimizer)) as engine:
            assert list(engine.plan.optimizer_step_on) == where(len(engine.units))
            engine.load_checkpoint(tmp_path / "ck")
            loaded = stored(engine)
            assert loaded.keys() == saved.keys()
            for key, (state, steps) in saved.items():
                assert loaded[key][1] == steps
                for k, raw in state.items():
                    assert torch.equal(loaded[key][0][k], raw), (name, key, k)
            train(engine, 3, 2)
            assert_close(engine.parameters_fp32(), expected)
@pytest.mark.pins("design#the-update-runs-where-the-plan-says-the-state-stays-home")
@pytest.mark.pins("design#a-device-update-does-not-hold-the-optimizer-thread")
@pytest.mark.parametrize("params", ["device", "host"])
def test_the_profile_shows_where_each_update_ran_and_the_staging_traffic(tmp_path, monkeypatch, params):
    """Each unit's update is a "device-optimizer" span where it ran on the device and an "optimizer"
    span where it ran on the CPU; each device update's staging is host->device and device->host
    transfers of its state's bytes, and its new parameters: written in place where their home is on the
    device (no transfer, no copy back: ParamStore.device_out), sent back to a host home."""
    force(monkeypatch, alternate("device"))
    steps = 2
    cfg = config(tmp_path, "host", profile=True)
    cfg["offload"]["params"] = params
    with zerotier.initialize(make_model(), cfg) as engine:
        train(engine, 0, steps)
        trace = engine.profiler.trace()
        where = dict(zip((u.key for u in engine.units), engine.plan.optimizer_step_on))
        state = engine.unit_optimizer.state
        state_bytes = {u.key: sum(v.numel() for v in state.read_state(u, encoded=True).values()) for u in engine.units}
        lp = {u.key: u.shard_numel * engine.lp_dtype.itemsize for u in engine.units}
    events = trace["traceEvents"]
    kinds = {}
    for e in events:
        if e.get("cat") == "compute" and e["args"]["kind"] in ("optimizer", "device-optimizer"):
            kinds.setdefault(e["name"], set()).add(e["args"]["kind"])
    for key, on in where.items():
        assert kinds[key] == {"device-optimizer" if on == "device" else "optimizer"}, (key, kinds)
    moved, copied_back = {}, {}
    for e in events:
        a = e.get("args", {})
        if e.get("cat") == "transfer" and a["reason"] in ("optimizer-read", "optimizer-write"):
            unit = a["tensor"].split(".")[0]
            moved[(unit, a["src"], a["dst"])] = moved.get((unit, a["src"], a["dst"]), 0) + a["bytes"]
        if e.get("cat") == "transfer" and a["reason"] == "param-copyback":
            unit = a["tensor"].split(".")[0]
            copied_back[unit] = copied_back.get(unit, 0) + a["bytes"]
    for key, on in where.items():
        if on == "device":
            assert moved[(key, "host", "device")] == steps * state_bytes[key]
            back = lp[key] if params == "host" else 0  # a device home is written in place
            assert moved[(key, "device", "host")] == steps * (state_bytes[key] + back)
            assert key not in copied_back  # a host home gets the copy out itself; a device home the kernel's write
        else:
            assert (key, "host", "device") not in moved and (key, "device", "host") not in moved
@pytest.mark.pins("design#the-update-runs-where-the-plan-says-the-state-stays-home")
@pytest.mark.parametrize("params", ["device", "host"])
@pytest.mark.parametrize("gradients", ["device", "host"])
def test_staging_is_reserved_from_the_device_tier_and_sized_by_its_term(tmp_path, params, gradients):
    """The staging set is device-tier memory ([Note: device staging]): what the run reserves for it is
    `DeviceStaging.SETS x DeviceStaging.set_bytes` of the staged units, exactly the plan's device_step
    term ([Note: the device step's staging memory]), wherever the parameters and gradients live."""
    cfg = config(tmp_path, "host", "device", gradients=gradients)
    cfg["offload"]["params"] = params
    with zerotier.initialize(make_model(), cfg) as engine:
        train(engine, 0, 1)
        staging = engine.unit_optimizer.device_staging
        held = staging.nbytes  # both sets made: the model has more device-stepped units than SETS
        state = engine.unit_optimizer.state
        state_set = OptStateSizing.staging_set(tuple(state.slots[u.index].layout.nbytes(k, u.shard_numel)
                                                     for k in state.layout.keys) for u in engine.units)
        largest = max(u.shard_numel for u in engine.units)
        # here the "device" is the CPU: the update reads host gradients where they are (no gradient staged)
        # a device home takes the new parameters in place: no output buffer (ParamStore.device_out)
        lp = engine.lp_dtype.itemsize if params == "host" else 0
        assert 0 < held == DeviceStaging.SETS * DeviceStaging.set_bytes(state_set, largest, lp)
        assert held == engine.plan.needs["device_step"]["device"]  # the plan counts what the engine reserves
        before = engine.device_tier.stats()["current"]
        staging.close()
        assert engine.device_tier.stats()["current"] == before - held


class _Watched:
    """Every device update issued in a test ([Note: the asynchronous device step] in offload.py), and
    whether each is retired, so a test can ask what was still in flight at a given moment."""

    def __init__(self, monkeypatch):
        import zerotier.optim.offload as offload
        self.updates = []
        watched = self

        class Watched(offload.InFlight):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                self.retired = False
                watched.updates.append(self)

            def retire(self):
                super().retire()
                self.retired = True

        monkeypatch.setattr("zerotier.optim.offload.InFlight", Watched)

    def copying_out(self) -> int:
        """Device updates whose copies out are still running now."""
        return sum(not u.retired and not u.done() for u in self.updates)

    def in_flight(self) -> int:
        return sum(not u.retired for u in self.updates)


@pytest.mark.pins("design#a-device-update-does-not-hold-the-optimizer-thread")
@pytest.mark.parametrize("optimizer", ["host", "nvme"])
def test_cpu_units_update_while_device_updates_are_in_flight_and_leave_in_order(tmp_path, monkeypatch, optimizer):
    """[Note: the asynchronous device step]: with one unit of four on the CPU, the native update of the
    CPU unit runs while the previous device unit's copies out are still running (the lagging device
    completes each copy 100 ms late here, longer than the units between), never more than
    DeviceStaging.SETS device updates are in flight, and the parameter store commits the units in the order the optimizer took them up; the result
    equals the all-CPU run within fp32 rounding."""
    where = lambda n: ["cpu" if i == 1 else "device" for i in range(n)]  # noqa: E731 - 3 device units of 4
    force(monkeypatch, where)
    monkeypatch.setenv("ZEROTIER_LAGGING_DEVICE_MS", "100")
    watched = _Watched(monkeypatch)
    overlapped, most = [], [0]
    taken, committed = [], []
    with zerotier.initialize(make_model(), config(tmp_path / "split", optimizer)) as engine:
        opt, rule = engine.unit_optimizer, engine.unit_optimizer.rule
        cpu_pieces, device_pieces = rule.cpu_pieces, rule.device_pieces

        def on_cpu(*args, **kwargs):
            overlapped.append(watched.copying_out())
            return cpu_pieces(*args, **kwargs)

        def on_device(*args, **kwargs):
            most[0] = max(most[0], watched.in_flight() + 1)  # this one is being issued
            return device_pieces(*args, **kwargs)

        rule.cpu_pieces, rule.device_pieces = on_cpu, on_device
        update, commit = opt._update, engine.params.commit
        opt._update = lambda unit, *a, **k: (taken.append(unit.index), update(unit, *a, **k))[1]
        engine.params.commit = lambda unit: (committed.append(unit.index), commit(unit))[1]
        train(engine, 0, 3)
        split = engine.parameters_fp32()
    assert any(overlapped), overlapped  # a CPU update ran beside a device update's copies out
    assert 1 < most[0] <= DeviceStaging.SETS
    assert committed == taken and len(taken) == 3 * len(engine.units)
    force(monkeypatch, lambda n: ["cpu"] * n)
    with zerotier.initialize(make_model(), config(tmp_path / "cpu", optimizer)) as engine:
        train(engine, 0, 3)
        assert_close(split, engine.parameters_fp32())


@pytest.mark.cuda
@pytest.mark.parametrize("precision", [None, {"master_dtype": "bf16", "moment_dtype": "int8"}], ids=["fp32", "compact"])
@pytest.mark.parametrize("optimizer", ["host", "nvme"])
def test_a_split_step_on_cuda_equals_the_cpu_step(tmp_path, monkeypatch, optimizer, precision):
    """On a GPU ([Note: the asynchronous device step]): three units of four updated on the device, their
    copies and kernels on the streams while the optimizer thread runs the native update of the fourth,
    give the all-CPU run's result: fp32 parameters and state within 1e-6 relative (the two kernels'
    rounding); compact state within bf16's resolution (the device variant's maps and seeds are the
    CPU's: tests/test_device_pieces.py holds them to the native kernel's bytes)."""
    results = {}
    for name, where in (("split", lambda n: ["cpu" if i == 1 else "device" for i in range(n)]),
                        ("cpu", lambda n: ["cpu"] * n)):
        force(monkeypatch, where)
        with zerotier.initialize(make_model(), config(tmp_path / name, optimizer, precision=precision)) as engine:
            assert engine.device.type == "cuda"
            assert list(engine.plan.optimizer_step_on) == where(len(engine.units))
            calls = variants_run(engine)
            train(engine, 0, 3)
            results[name] = engine.parameters_fp32(), stored(engine), calls
    (split, split_state, calls), (cpu, cpu_state, _) = results["split"], results["cpu"]
    assert calls["device_pieces"] > 0 and calls["cpu_pieces"] > 0
    assert_close(split, cpu, rel=1e-6 if precision is None else 2e-2)
    if precision is None:
        for key, (state, steps) in cpu_state.items():
            assert split_state[key][1] == steps
            assert_close({k: v.view(torch.float32) for k, v in split_state[key][0].items()},
                         {k: v.view(torch.float32) for k, v in state.items()})


def test_a_gradient_block_a_device_copy_reads_is_given_back_only_once_that_copy_is_done():
    """[Note: device gradients, host optimizer] under [Note: the asynchronous device step]: a unit
    updated on the device copies its staged gradient block H2D and the thread does not wait; the block
    goes back to the pool (where the next unit's read may take it) only after that copy is done."""
    from types import SimpleNamespace

    from zerotier.optim.grad_staging import StagedGrads
    from zerotier.tiers import HostPool
    from zerotier.tiers.device import DeviceTier

    class Copy:  # a device copy still running until the test lets it finish
        def __init__(self):
            self.finished = False

        def done(self):
            return self.finished

        def wait(self, timeout=None):
            self.finished = True
            return 0

    units = [SimpleNamespace(index=i, key=f"u{i}") for i in range(3)]
    grads = {u.index: torch.full((1000,), float(u.index)) for u in units}
    pool = HostPool(1 << 20, pin=False)
    freed = []
    free = pool.free
    pool.free = lambda block, *a, **k: (freed.append((block.what, copy.finished)), free(block, *a, **k))[1]
    staged = StagedGrads(units, lambda u: grads[u.index], DeviceTier(1 << 20, "cpu"), pool)
    assert torch.equal(staged(units[0]), grads[0])
    copy = Copy()
    staged.read_by(units[0], copy)
    assert torch.equal(staged(units[1]), grads[1])  # unit 0's block goes back: after its copy
    assert freed == [("u0.grad staging", True)]
    staged.close()
