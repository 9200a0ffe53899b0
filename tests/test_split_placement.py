"""The optimizer state split between host and NVMe unit by unit (planner/sizes.py [Note: optimizer
split], optim/state_store.py [Note: units on different tiers]): explicit fractions and `auto`, bitwise
equal training and checkpoints, the plan's figures and `zerotier plan` output, bad fractions."""
import os
import subprocess
import sys

import pytest
import torch

import zerotier
from zerotier.bench import save
from zerotier.config import Config, OffloadConfig, PrecisionConfig
from zerotier.errors import ConfigError
from zerotier.models import TinyGPT, batches
from zerotier.planner.messages import PlanDoesNotFit
from zerotier.planner.inputs import ModelFacts, Node, PlanConfig
from zerotier.planner.planner import make_plan
from zerotier.state import Location

VOCAB, SEQ, BATCH, ACCUM, LR = 64, 16, 4, 2, 3e-3
SPLIT = {"host": 0.5, "nvme": 0.5}
CPU = torch.device("cpu")
BIG = 10**15


@pytest.fixture(autouse=True)
def _no_saved_rates(tmp_path, monkeypatch):
    """No bench results: predictions use DEFAULT_RATES."""
    monkeypatch.setenv("ZEROTIER_BENCH_FILE", str(tmp_path / "no-bench.json"))


def make_model():
    torch.manual_seed(0)
    return TinyGPT(vocab=VOCAB, dim=32, layers=4, heads=2, seq=SEQ)


def config(optimizer, nvme_dir, clip=1.0, **tiers):
    nvme_dir.mkdir(parents=True, exist_ok=True)
    return {"optimizer": {"lr": LR, "weight_decay": 0.01},
            "offload": {"params": "device", "gradients": "host", "optimizer": optimizer},
            "tiers": {"nvme_path": str(nvme_dir), **tiers},
            # the split, not speculation: its allowance would move the plans' host needs
            "train": {"grad_accum_steps": ACCUM, "max_grad_norm": clip, "overlap": "early" if clip is None else "none"}}


def train(engine, start_step, steps):
    data = list(batches(VOCAB, SEQ, BATCH, (start_step + steps) * ACCUM, seed=3))[start_step * ACCUM:]
    for x, y in data:
        engine.backward(engine(x, y))
        engine.step()


def trained(optimizer, root, steps=4, clip=1.0, **tiers):
    with zerotier.initialize(make_model(), config(optimizer, root, clip, **tiers)) as engine:
        train(engine, 0, steps)
        return engine.parameters_fp32(), engine.plan, list(engine.unit_optimizer.state.locs)


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# --- training: bitwise equal to one tier -------------------------------------------------------------

@pytest.mark.parametrize("clip", [1.0, None], ids=["clipped", "early-updates"])
def test_explicit_split_trains_bitwise_like_all_host_and_all_nvme(tmp_path, clip):
    """Host units step in memory, NVMe units through the pipeline (with clipping: reads prefetched
    during backward; without: each unit updated during backward): the same numbers either way."""
    split, plan, locs = trained(SPLIT, tmp_path / "split", clip=clip)
    assert Location.HOST in locs and Location.NVME in locs
    assert locs == list(plan.optimizer_units)
    first_nvme = locs.index(Location.NVME)
    assert all(at is Location.HOST for at in locs[:first_nvme]) and all(at is Location.NVME for at in locs[first_nvme:])
    host, _, _ = trained("host", tmp_path / "host", clip=clip)
    nvme, _, _ = trained("nvme", tmp_path / "nvme", clip=clip)
    assert_same(split, host)
    assert_same(split, nvme)


def test_checkpoint_with_a_split_loads_into_all_host_and_back(tmp_path):
    with zerotier.initialize(make_model(), config(SPLIT, tmp_path / "a")) as engine:
        train(engine, 0, 3)
        engine.save_checkpoint(tmp_path / "ck-split")
        train(engine, 3, 3)
        expected = engine.parameters_fp32()
    with zerotier.initialize(make_model(), config("host", tmp_path / "b")) as engine:
        engine.load_checkpoint(tmp_path / "ck-split")
        train(engine, 3, 3)
        assert_same(engine.parameters_fp32(), expected)
    with zerotier.initialize(make_model(), config("host", tmp_path / "c")) as engine:
        train(engine, 0, 3)
        engine.save_checkpoint(tmp_path / "ck-host")
    with zerotier.initialize(make_model(), config(SPLIT, tmp_path / "d")) as engine:
        assert len(set(engine.unit_optimizer.state.locs)) == 2
        engine.load_checkpoint(tmp_path / "ck-host")
        train(engine, 3, 3)
        assert_same(engine.parameters_fp32(), expected)


def test_auto_splits_when_the_host_budget_holds_part_of_the_optimizer_state(tmp_path):
    """The device holds the params only and host the gradients plus about half the optimizer
    state: auto puts the first units on host and the rest on NVMe, and trains like all-host."""
    host_run, host_plan, _ = trained("host", tmp_path / "host")
    _, nvme_plan, _ = trained("nvme", tmp_path / "nvme")
    budget = (host_plan.need["host"] + nvme_plan.need["host"]) // 2
    device = host_plan.need["device"]  # no room for the optimizer state there
    split, plan, locs = trained("auto", tmp_path / "auto", device=device, host=budget)
    assert plan.placement["optimizer"] is Location.NVME and plan.optimizer_units is not None
    assert locs[0] is Location.HOST and locs[-1] is Location.NVME
    assert plan.need["host"] <= budget
    assert plan.optimizer_split["host"][1] + plan.optimizer_split["nvme"][1] == len(locs)
    assert_same(split, host_run)


# --- the planner -------------------------------------------------------------------------------------

def plan(numels, host=BIG, nvme=BIG, optimizer="auto", device=None, **kw):
    """Params and gradients on host; the device budget holds the fetched params only (none of the
    optimizer state) unless `device` is given."""
    kw.setdefault("alignment", 1)
    offload = OffloadConfig(params="host", gradients="host", optimizer=optimizer)
    if device is None:
        device = plan(numels, BIG, BIG, optimizer="host" if optimizer == "auto" else optimizer, device=BIG,
                      **kw).need["device"]
    precision = PrecisionConfig(param_dtype="bf16", grad_dtype="fp32")  # the byte counts below: fp32 gradients
    return make_plan(ModelFacts.of_sizes(numels), PlanConfig(offload=offload, precision=precision, **kw),
                     Node(CPU, budgets={"device": device, "host": host, "nvme": nvme}))


def test_explicit_fractions_take_whole_units_in_unit_order():
    p = plan([1000] * 10, optimizer={"host": 0.6, "nvme": 0.4})
    assert p.optimizer_units == (Location.HOST,) * 6 + (Location.NVME,) * 4
    assert p.optimizer_split == {"host": (12 * 6000, 6), "nvme": (12 * 4000, 4)}
    # host: params, gradients, 6 units of state, 3 staging sets of the largest NVMe unit
    assert p.need["host"] == (2 + 4) * 10000 + 12 * 6000 + 3 * 12 * 1000
    assert p.need["nvme"] == 12 * 4000 + 3 * 12 * 1000  # the state + the rewrites in flight
    one_tier = plan([1000, 1000], optimizer={"host": 0.9, "nvme": 0.1})  # both midpoints within host's 90%
    assert one_tier.optimizer_units is None and one_tier.placement["optimizer"] is Location.HOST


def test_auto_prefers_one_tier_when_it_fits_and_a_faster_split_otherwise():
    numels = [1000] * 10
    assert plan(numels).placement["optimizer"] is Location.HOST and plan(numels).optimizer_units is None
    whole_nvme = plan(numels, optimizer="nvme")
    host = (2 + 4) * 10000 + 12 * 5000 + 3 * 12 * 1000  # five units on host
    p = plan(numels, host=host)
    assert p.optimizer_units == (Location.HOST,) * 5 + (Location.NVME,) * 5
    assert p.predicted_step_s < whole_nvme.predicted_step_s
    assert p.breakdown["optimizer_nvme"] == pytest.approx(whole_nvme.breakdown["optimizer_nvme"] / 2)
    assert plan(numels, host=host - 1).optimizer_units.count(Location.HOST) == 4


def test_explicit_fractions_count_the_elements_each_rank_holds():
    """[Note: optimizer split] over 8 ranks (ZeRO-1): each unit's share is its optimizer shard as the
    store allocates it (Sizes.held_shard: padded to 32 x 8 elements), not ceil(numel / 8). Units of 1, 1
    and 512 elements hold 32, 32 and 64 per rank: midpoints 16/128, 48/128 and 96/128, so with 30% on
    host only the first is there (by ceil: 1, 1, 64, midpoints 0.5/66 and 1.5/66 put both small ones there)."""
    from zerotier.planner.sizes import Sizes, split_units
    s = Sizes(numels=(512, 1, 1), lp_bytes=2, grad_bytes=4, lookahead=0, stage=1, world_size=8,
              unit_order=(1, 1, 512), unit_params=((1,), (1,), (512,)))
    assert split_units({"host": 0.3, "nvme": 0.7}, s) == (Location.HOST, Location.NVME, Location.NVME)


def test_a_split_that_does_not_fit_names_the_missing_bytes():
    with pytest.raises(PlanDoesNotFit, match=r"split as offload.optimizer asks \(host 5 of 10 units, nvme 5 of "
                                             r"10 units\) does not fit.*more host") as ei:
        plan([1000] * 10, host=60000 + 12 * 4000, optimizer=SPLIT)
    assert ei.value.options == [{"tier": "split", "more": {"host": 12 * 1000 + 3 * 12 * 1000}}]
    with pytest.raises(PlanDoesNotFit, match=r"the optimizer .* does not fit.*more host.*more nvme"):
        plan([1000] * 10, host=60000 + 1000, nvme=1000)  # auto: no split fits either


@pytest.mark.parametrize("fractions,message", [
    ({"host": 0.6, "nvme": 0.3}, "must sum to 1, they sum to 0.9"),
    ({"host": 1.0, "nvme": 0.0}, r"each fraction must be in \(0, 1\]"),
    ({"host": 0.5, "disk": 0.5}, "expected 'auto' or 'device' or 'host' or 'nvme' or a table"),
    ({"device": 0.5, "host": 0.5}, "a split spans host and nvme only"),
    ({}, "an empty table"),
])
def test_bad_optimizer_fractions_are_config_errors(fractions, message):
    with pytest.raises(ConfigError, match=message):
        Config.from_dict({"offload": {"optimizer": fractions}, "tiers": {"nvme_path": "/tmp"}})


def test_a_split_on_nvme_needs_nvme_path():
    with pytest.raises(ConfigError, match=r"offload.optimizer = \{host = 0.5, nvme = 0.5\} needs tiers.nvme_path"):
        Config.from_dict({"offload": {"optimizer": SPLIT}})


def test_cli_plan_shows_the_split_and_the_predicted_time(tmp_path):
    cfg = tmp_path / "zt.toml"
    cfg.write_text(f'[offload]\noptimizer = {{host = 0.6, nvme = 0.4}}\n[tiers]\nnvme_path = "{tmp_path}"\n')
    bench = tmp_path / "bench.json"  # measured rates: the plan prints a predicted time
    save({"io": {"read_GBps": 7.0, "write_GBps": 4.5, "o_direct": True}, "adam": {"fp32_params_per_s": 1.9e9}},
         bench)
    env = dict(os.environ, ZEROTIER_BENCH_FILE=str(bench))
    r = subprocess.run([sys.executable, "-m", "zerotier.cli", "plan", "--params", "1B", "--layers", "10",
                        "--config", str(cfg), "--nvme-path", str(tmp_path), "--nvme", "1TiB", "--host", "1TiB",
                        "--device", "1TiB"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "optimizer  split" in r.stdout
    assert "on host" in r.stdout and "(24 of 40 units)" in r.stdout
    assert "on nvme" in r.stdout and "(16 of 40 units)" in r.stdout
    assert "predicted swap + optimizer time per step" in r.stdout and "optimizer_nvme" in r.stdout
