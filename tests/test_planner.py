"""The planner: ZeRO-paper model-state figures, fit / does-not-fit, auto placement order,
and `zerotier plan` end to end (subprocess)."""
import json
import re
import subprocess
import sys

import pytest
import torch

from zerotier.config import OffloadConfig, PrecisionConfig, PrefetchConfig, ZeroConfig
from zerotier.errors import BudgetError, ConfigError
from zerotier.planner.inputs import ModelFacts, Node, PlanConfig
from zerotier.planner.messages import PlanDoesNotFit
from zerotier.planner.planner import make_plan
from zerotier.planner.sizes import model_state_bytes, shard_numel
from zerotier.state import Location, build_units

CPU = torch.device("cpu")
BIG = 10**15  # a budget nothing in these tests exceeds


@pytest.fixture(autouse=True)
def _no_saved_rates(tmp_path, monkeypatch):
    """No bench results unless a test saves some: predictions use DEFAULT_RATES."""
    monkeypatch.setenv("ZEROTIER_BENCH_FILE", str(tmp_path / "no-bench.json"))


def plan(numels, device=BIG, host=BIG, nvme=0, offload=None, dtype="bf16", grad_dtype="fp32", alignment=1,
         world_size=1, stage=0, grad_bytes=None, rates=None, nested_numel=0, unit_names=()):
    """The byte counts below are for fp32 gradient accumulators (chosen: bf16 is the default under bf16).
    alignment 1: no block rounding, the formulas below are exact."""
    precision = PrecisionConfig(param_dtype=dtype, grad_dtype=grad_dtype)
    return make_plan(ModelFacts.of_sizes(numels, nested=nested_numel, names=tuple(unit_names)),
                     PlanConfig(offload=OffloadConfig(**(offload or {})), precision=precision,
                                zero=ZeroConfig(stage=stage), alignment=alignment, grad_bytes=grad_bytes),
                     Node(CPU, budgets={"device": device, "host": host, "nvme": nvme}, rates=rates,
                          world_size=world_size))


def test_host_blocks_are_counted_rounded_up_to_the_alignment():
    """Each host-pool block is rounded up to io.alignment; the plan counts the worst case per block."""
    exact = plan([1000, 1000], offload={"params": "host", "gradients": "host", "optimizer": "host"})
    rounded = plan([1000, 1000], offload={"params": "host", "gradients": "host", "optimizer": "host"},
                   alignment=4096)
    blocks = 2 + 2 + 3 * 2  # params, gradients, optimizer (master, m, v) per unit
    assert rounded.need["host"] - exact.need["host"] == blocks * 4095


def test_streamed_params_count_the_enclosing_units_and_never_more_than_the_model():
    base = plan([100, 100, 100, 100, 100], offload={"params": "host"})
    nested = plan([100, 100, 100, 100, 100], offload={"params": "host"}, nested_numel=100)
    assert nested.need["device"] - base.need["device"] == 100 * 2  # bf16
    assert plan([100, 100], offload={"params": "host", "gradients": "host", "optimizer": "host"},
                nested_numel=100).need["device"] == 200 * 2  # the whole model at most


ALL_DEVICE = {"params": "device", "gradients": "device", "optimizer": "device"}


# --- the ZeRO paper, Figure 1: Psi = 7.5B, N = 64, K = 12, fp16 params and grads --------------

@pytest.mark.parametrize("stage, gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_model_state_bytes_reproduce_zero_paper_figure_1(stage, gb):
    assert round(model_state_bytes(7_500_000_000, stage, 64) / 1e9, 1) == gb


@pytest.mark.parametrize("stage, gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_make_plan_per_rank_accounting_is_the_paper_formula(stage, gb):
    numels = [7_500_000_000 // 1000] * 1000  # 1000 equal units of 7.5M
    p = plan(numels, offload=ALL_DEVICE, world_size=64, stage=stage, grad_bytes=2)
    assert p.per_rank_bytes == model_state_bytes(7_500_000_000, stage, 64, 2, 2, 12)
    assert round(p.per_rank_bytes / 1e9, 1) == gb
    # with no offload, the device holds exactly the model state; stage 3 adds the
    # gathered working set of (lookahead + 2) full units
    working = 0 if stage < 3 else (PrefetchConfig().lookahead + 2) * 7_500_000 * 2
    assert p.need == {"device": p.per_rank_bytes + working, "host": 0, "nvme": 0}
    assert round(p.need["device"] / 1e9, 1) == gb


def test_formula_terms_per_stage():
    psi, n = 1_000_000 * 64, 64
    assert model_state_bytes(psi, 0, n) == 16 * psi
    assert model_state_bytes(psi, 1, n) == 2 * psi + 2 * psi + 12 * psi // n
    assert model_state_bytes(psi, 2, n) == 2 * psi + 14 * psi // n
    assert model_state_bytes(psi, 3, n) == 16 * psi // n
    assert shard_numel(10, "optimizer", 1, 3) == 4  # the largest rank holds ceil(psi / N)
    with pytest.raises(ConfigError, match="stage"):
        model_state_bytes(psi, 4, n)


def test_engine_accounting_counts_the_gradient_accumulators():
    p = plan([1000], offload=ALL_DEVICE)
    assert p.grad_bytes == 4 and p.grad_dtype == "fp32"  # precision.grad_dtype = "fp32" given
    assert p.state_bytes == {"params": 2000, "gradients": 4000, "optimizer": 12000}
    assert p.per_rank_bytes == model_state_bytes(1000, 0, 1, grad_bytes=4)
    p = plan([1000], offload=ALL_DEVICE, grad_dtype="auto")  # the default: bf16 under bf16 parameters
    assert p.grad_bytes == 2 and p.grad_dtype == "bf16" and p.state_bytes["gradients"] == 2000
    assert plan([1000], offload=ALL_DEVICE, dtype="fp32", grad_dtype="auto").grad_bytes == 4


# --- fits / does not fit ---------------------------------------------------------------------

def test_fits_exactly_at_the_budget_and_not_one_byte_less():
    n = 1_000_000
    need = 2 * n + 4 * n + 12 * n
    assert plan([n], device=need, host=0, offload=ALL_DEVICE).need["device"] == need
    with pytest.raises(PlanDoesNotFit, match=r"the optimizer of 1,000,000 parameters does not fit.*"
                                             r"1 B more device \(tiers.device is ") as ei:
        plan([n], device=need - 1, host=0, offload=ALL_DEVICE)
    assert isinstance(ei.value, BudgetError)
    assert ei.value.kind == "optimizer"
    assert ei.value.options == [{"tier": "device", "more": {"device": 1}}]
    assert {k: v.value for k, v in ei.value.placement.items()} == {"params": "device", "gradients": "device"}


def test_does_not_fit_names_every_alternative_with_bytes():
    n = 1 << 20
    with pytest.raises(PlanDoesNotFit) as ei:
        plan([n], device=6 * n, host=1024)  # params + grads fill the device; 12 B/param nowhere
    msg = str(ei.value)
    assert "the optimizer of 1,048,576 parameters does not fit" in msg
    assert "12.00 MiB more device (tiers.device is 6.00 MiB) to place it on device" in msg
    assert "more host (tiers.host is 1.00 KiB) to place it on host" in msg
    assert "enable the nvme tier (set tiers.nvme_path; needs 24.00 MiB)" in msg  # + a rewrite in flight
    assert ei.value.options[1] == {"tier": "host", "more": {"host": 12 * n - 1024}}


def test_sharded_message_says_per_rank():
    buckets = 1280 * (4 + 2)  # a bucket of the one unit (5 x its 256-element padded shard): fp32 reduce, bf16 gather
    with pytest.raises(PlanDoesNotFit, match=r"\(250 per rank: ZeRO stage 1 over 4 ranks; budgets are per rank\)"):
        plan([1000], device=8000 + buckets, host=0, nvme=0, offload=ALL_DEVICE, world_size=4, stage=1)
    # ...and sharding is what makes it fit (device: 9000 B of model state, the 1000 B full gradient
    # kept beside its reduced shard, the 512 B updated bf16 shard awaiting its all-gather, the buckets;
    # every shard is the partition's 256-element padded one, as the stores allocate it: the optimizer's
    # state 72 B more than 250 elements' ([Note: the optimizer's bytes per unit]), the reduced fp32
    # gradient 24 B more, the bf16 shard 12 B more (Sizes.held_shards))
    assert plan([1000], device=10608 + buckets, host=0, offload=ALL_DEVICE, world_size=4,
                stage=1).per_rank_bytes == 9000
    with pytest.raises(PlanDoesNotFit):
        plan([1000], device=10607 + buckets, host=0, offload=ALL_DEVICE, world_size=4, stage=1)


def test_nvme_optimizer_needs_host_staging():
    n = 1000
    p = plan([n], device=BIG, host=BIG, nvme=BIG, offload={"optimizer": "nvme"})
    assert p.placement["optimizer"] is Location.NVME
    assert p.need["nvme"] == 12 * n + 12 * n  # the state, and room for its rewrite in flight
    assert p.need["host"] == 3 * 12 * n  # optimizer.pipeline_depth = 3 staging sets of master, m, v


# --- auto placement order: params, then gradients, then optimizer; fastest tier first ---------

@pytest.mark.parametrize("device, expect", [
    (18, ("device", "device", "device")),
    (17, ("device", "device", "host")),   # optimizer (12 B) is the first to leave the device
    (5, ("device", "host", "host")),      # then gradients (4 B)
    (1, ("host", "host", "host")),        # params (2 B) last; the device keeps their working set
])
def test_auto_placement_fills_the_fastest_tier_by_access_frequency(device, expect):
    units = [1000] * 100
    n = sum(units)
    p = plan(units, device=device * n, host=BIG)
    assert tuple(p.placement[k].value for k in ("params", "gradients", "optimizer")) == expect


def test_auto_uses_nvme_when_host_is_short():
    n = 1000
    p = plan([n] * 10, device=6 * 10 * n, host=3 * 12 * n + 4 * n, nvme=BIG)
    assert [p.placement[k] for k in ("params", "gradients", "optimizer")] == \
        [Location.DEVICE, Location.DEVICE, Location.NVME]


# --- step-time prediction depends on the rates --------------------------------------------------

def test_prediction_scales_with_rates_and_labels_them():
    # the hook copies each fresh gradient (2 MB of bf16) into the gradients' accumulator at mem_copy (2e12
    # B/s: 1 us; a CPU device's "device" gradients too), and the global norm reads 4 MB of fp32 gradients at
    # mem_read (4e12 B/s: 1 us) before the update; the update writes bf16 parameters: 30 of the 32 B/param its
    # rate is measured at ([Note: the CPU rate's new parameters])
    given = {"mem_read": 4e12, "mem_copy": 2e12}
    slow = plan([10**6], offload={"optimizer": "host"}, rates={"cpu_adam": 1e6, **given})
    fast = plan([10**6], offload={"optimizer": "host"}, rates={"cpu_adam": 1e9, **given})
    assert slow.predicted_step_s == pytest.approx(30 / 32 + 2e-6)
    assert fast.predicted_step_s == pytest.approx(30 / 32 * 1e-3 + 2e-6)
    assert slow.rate_sources == {"mem_copy": "given", "cpu_adam": "given", "mem_read": "given"}
    unmeasured = plan([10**6], offload={"optimizer": "host"})
    assert unmeasured.rate_sources == {"mem_copy": "default", "cpu_adam": "default", "mem_read": "default"}
    assert not unmeasured.rates_measured
    assert unmeasured.to_dict()["predicted_step_s"] is None
    assert "run `zerotier bench` for a step-time prediction" in unmeasured.summary()


# --- zerotier plan (subprocess) ------------------------------------------------------------------

def run_cli(*args, env_file=None, tmp_path=None):
    import os
    env = dict(os.environ, ZEROTIER_BENCH_FILE=str(env_file or (tmp_path / "none.json")))
    return subprocess.run([sys.executable, "-m", "zerotier.cli", "plan", *args], capture_output=True, text=True,
                          env=env, timeout=60)


def test_cli_plan_json_has_per_rank_bytes_and_tiers(tmp_path):
    r = run_cli("--params", "7.5e9", "--world-size", "64", "--stage", "2", "--param-dtype", "bf16",
                "--accounting", "paper", "--device", "80GB", "--host", "1TB", "--json", tmp_path=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert round(out["per_rank_bytes"] / 1e9, 1) == 16.6
    assert set(out["tiers"]) == {"device", "host", "nvme"} and out["tiers"]["device"] == out["per_rank_bytes"]
    assert out["fits"] is True and out["missing"] is None and out["predicted_step_s"] is None
    assert out["placement"] == {"params": "device", "gradients": "device", "optimizer": "device"}


def test_cli_plan_does_not_fit_exits_1_with_the_shortfall(capsys):
    from zerotier.cli import main  # in-process: the subprocess path is covered above

    assert main(["plan", "--params", "7B", "--device", "10GiB", "--host", "10GiB", "--json"]) == 1
    r = capsys.readouterr()
    assert "zerotier plan: error: the" in r.err and "more host" in r.err
    out = json.loads(r.out)
    assert out["fits"] is False and out["missing"]["options"]
    whole = out["missing"]["whole"]  # [Note: the whole shortfall]: the cheapest placement's table
    assert set(whole["placement"]) == {"params", "gradients", "optimizer"}
    assert all(t["missing"] == max(0, t["needed"] - t["budget"]) for t in whole["tiers"].values())
    assert whole["tiers"]["host"]["budget"] == 10 << 30 and any(t["missing"] for t in whole["tiers"].values())
    assert out["per_rank_bytes"] == 7 * 10**9 * (4 + 4 + 12)  # fp32 params (the config default)


def test_cli_plan_factory_model_counts_units_like_the_engine(tmp_path):
    from zerotier.models import TinyGPT

    numels = [u.numel for u in build_units(TinyGPT())]
    r = run_cli("--model", "zerotier.models:TinyGPT", "--json", "--device", "1GiB", "--host", "1GiB",
                tmp_path=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["numel"] == sum(numels)  # the tied head is counted once
    assert out["per_rank_bytes"] == sum(numels) * (4 + 4 + 12)


def test_cli_plan_text_and_bad_input(capsys):
    from zerotier.cli import main

    assert main(["plan", "--params", "350M", "--device", "20GiB", "--host", "20GiB"]) == 0
    out = capsys.readouterr().out
    assert "fits: yes" in out and "run `zerotier bench` for a step-time prediction" in out
    assert main(["plan", "--params", "lots"]) == 1
    assert "--params: cannot read" in capsys.readouterr().err


# --- [Note: the whole shortfall] (issue 35 item 2) -----------------------------------------------------
GiB = 1 << 30
LLAMA_70B = [2_100_000_000] + [850_000_000] * 80  # the root (embeddings + head), then 80 layers
NAMES = [""] + [f"model.layers.{i}" for i in range(80)]


def _settings(fix: str) -> dict[str, int]:
    from zerotier.units import parse_size

    return {t: parse_size(v) for t, v in re.findall(r'tiers\.(\w+) = "([^"]+)"', fix)}


def test_does_not_fit_gives_the_whole_shortfall_the_cheapest_way_and_one_round_fixes_it():
    """A 70B plan: one message has every tier's need / budget / missing for the cheapest complete
    placement (NVMe, not the device route), its settings fix it in one round, and compact optimizer
    state is offered with what it saves."""
    budgets = dict(device=80 * GiB, host=200 * GiB, nvme=1024 * GiB)
    with pytest.raises(PlanDoesNotFit) as ei:
        plan(LLAMA_70B, **budgets, unit_names=NAMES, alignment=4096)
    msg = str(ei.value)
    assert msg.startswith("the optimizer of 70,100,000,000 parameters does not fit within the tier budgets; ")
    assert "The whole plan, placed the cheapest way (params on nvme, gradients on nvme, optimizer on nvme):" in msg
    table = re.search(r"tier +needed +budget +missing\n((?:  \w+ .*\n){3})", msg).group(1)
    rows = {line.split()[0]: line for line in table.splitlines()}
    assert rows["nvme"].split()[-2:] != ["0", "B"] and rows["device"].split()[-2:] == ["0", "B"]
    fixes = re.findall(r"^  \d\. (.*)$", msg.split("Cheapest fixes, in order:")[1], re.M)
    assert fixes[0].startswith('tiers.nvme = "') and "more nvme" in fixes[0]
    assert re.match(r'compact optimizer state \(precision.master_dtype = "bf16", precision.moment_dtype = "int8": '
                    r"12 -> 4.031 B/param\) saves [\d.]+ GiB; then it fits", fixes[1])
    fixed = {**budgets, **_settings(fixes[0])}
    assert plan(LLAMA_70B, **fixed, alignment=4096).placement["optimizer"] is Location.NVME  # one round
    assert "One unit alone" not in msg


def test_does_not_fit_names_the_unit_larger_than_its_tier():
    with pytest.raises(PlanDoesNotFit, match=r"One unit alone does not fit: the root unit \(the model's own "
                                             r"parameters outside its blocks: embeddings, head\) has 2,100,000,000 "
                                             r"parameters, 3.91 GiB, more than the whole device budget \(3.00 GiB\)"):
        plan(LLAMA_70B, device=3 * GiB, host=200 * GiB, nvme=1024 * GiB, unit_names=NAMES, alignment=4096)


@pytest.mark.parametrize("kind, verb", [("params", "do"), ("gradients", "do"), ("optimizer", "does")])
def test_does_not_fit_grammar(kind, verb):
    n = 1000
    fits = {"params": 0, "gradients": 2 * n, "optimizer": 6 * n}[kind]
    with pytest.raises(PlanDoesNotFit, match=rf"^the {kind} of 1,000 parameters {verb} not fit within"):
        plan([n], device=fits, host=0, offload=ALL_DEVICE)


@pytest.mark.parametrize("world_size", [3, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_sharded_terms_count_the_partitions_padded_shards_as_the_stores_allocate_them(stage, world_size):
    """Silently wrong before: the params and gradients terms (and the optimizer's updated shards)
    counted ceil(numel / N) elements per rank, while the stores allocate each unit's partition
    shard (padded to SHARD_ALIGN x N elements; the whole unit where stage 3 replicates it), up to
    32 x N - 1 elements per unit more. The allocations below follow the stores' own rules:
    ParamStore keeps its ZeRO-3 shard, MemoryGrads.place the full sum and (unless whole) the
    reduced shard, ParamStore.out_shard the updated low-precision shard at ZeRO-1/2, ParamStore.place
    a ZeRO-3 unit's device flat padded for its gather."""
    from zerotier.dist.buckets import GradBucketer
    from zerotier.dist.partition import stage_partitions

    numels = [150_001, 100_003, 1_000, 77]  # none a multiple of 32 x N; stage 3 replicates the two small
    zero = ZeroConfig(stage=stage)
    parts = stage_partitions(numels, world_size, stage, zero.persistence_threshold)
    p = plan(numels, world_size=world_size, stage=stage,
             offload={"params": "host", "gradients": "host", "optimizer": "host"})
    held = p.needs
    if stage == 3:  # the parameters' homes: each unit's shard, on the host; the fetched units on the
        # device padded for their all-gather (ParamStore.place: the partition's padded_numel)
        assert held["params"]["host"] >= 2 * sum(part.shard_numel for part in parts)
        from zerotier.params_terms import ParamSizing
        lookahead = PrefetchConfig().lookahead
        flats = sorted((part.padded_numel for part in parts), reverse=True)
        staged = ParamSizing.gather_staging_bytes(lookahead, [q.shard_numel for q in parts if not q.replicated], 2)
        assert held["params"]["device"] - staged >= 2 * sum(flats[:lookahead + 2])
    grads = sum(part.numel + (0 if part.replicated and stage <= 1 else part.shard_numel) for part in parts)
    landing = GradBucketer.staging_bytes(zero.reduce_bucket_size, 4, parts, alignment=1)
    assert held["gradients"]["host"] - landing >= 4 * grads  # fp32 accumulators and reduced shards
    if stage in (1, 2):  # the updated bf16 shard of every unit waits for its all-gather beside the state
        from zerotier.optim.state_layout import StateLayout
        from zerotier.optim.state_terms import OptStateSizing
        state = sum(sum(OptStateSizing.key_bytes(StateLayout(), (n,), part)) for n, part in zip(numels, parts))
        assert held["optimizer"]["host"] >= state + 2 * sum(part.shard_numel for part in parts)
