"""zerotier.plan(model, config, inputs=...) and `zerotier plan --model --inputs`: the whole step,
measured compute, auto placement by predicted time, another node's rates (issue 24)."""
import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import zerotier
from zerotier.bench import save
from zerotier.config import OffloadConfig, PrecisionConfig, PrefetchConfig, TiersConfig, ZeroConfig
from zerotier.errors import ConfigError
from zerotier.planner.messages import PlanDoesNotFit
from zerotier.planner.inputs import ModelFacts, Node, PlanConfig
from zerotier.planner.planner import make_plan
from zerotier.planner.predict import UnitCompute
from zerotier.models import TinyGPT
from zerotier.optim.state_layout import StateLayout

RATES = {"io": {"read_GBps": 1.0, "overwrite_GBps": 0.5, "write_GBps": 0.5, "o_direct": True},
         "adam": {"fp32_params_per_s": 1e9}, "mem": {"copy_GBps": 8.0, "inplace_GBps": 8.0},
         "compute": {"fp32_flops": 4e10, "bf16_flops": 2e10}}


@pytest.fixture
def bench_file(tmp_path, monkeypatch):
    path = tmp_path / "bench.json"
    save(RATES, path)
    monkeypatch.setenv("ZEROTIER_BENCH_FILE", str(path))
    return path


def tiny(device="cpu"):
    with torch.device(device):
        return TinyGPT(vocab=128, dim=32, layers=3, heads=4, seq=16)


def batch():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 128, (2, 16), generator=g), torch.randint(0, 128, (2, 16), generator=g)


def test_plan_measures_every_unit_of_a_meta_model_and_predicts_the_whole_step(bench_file, tmp_path):
    model = tiny("meta")
    cfg = {"tiers": {"device": "1MiB", "host": "1GiB", "nvme": "1GiB", "nvme_path": str(tmp_path)},
           "train": {"grad_accum_steps": 2, "max_grad_norm": 1.0}}
    plan = zerotier.plan(model, cfg, inputs=batch, repeat=1)
    assert all(p.is_meta for p in model.parameters())  # measured one unit at a time, given back
    assert plan.compute_measured and plan.breakdown["forward"] > 0 and plan.breakdown["backward"] > 0
    assert plan.breakdown["grad_norm"] > 0  # clipping: the norm's pass is in the schedule
    assert plan.predicted_step_s == pytest.approx(sum(plan.critical.values()))
    assert plan.critical["forward"] == pytest.approx(plan.breakdown["forward"])  # compute is serial: all on it
    assert plan.rate_sources["cpu_adam"] == "measured"
    assert len(plan.alternatives) > 1 and sum(r["chosen"] for r in plan.alternatives) == 1
    best = min(r["predicted_step_s"] for r in plan.alternatives)
    assert plan.predicted_step_s == best


def test_auto_takes_the_fastest_placement_that_fits_not_the_first():
    """The device holds the parameters only; the host holds the optimizer state and either the
    gradients' NVMe staging or part of the gradients. Fastest tier first puts the gradients on host
    and splits the optimizer state over host and NVMe (12 B/param read and written for the NVMe
    part); gradients on NVMe with the whole optimizer state on host move 8 B/param."""
    numels = [100_000] * 16
    n = sum(numels)
    budgets = {"device": 4 * n + 1000, "host": 24_000_000, "nvme": 10**9}
    compute = UnitCompute((0.01,) * 16, (0.02,) * 16, (False,) * 16)
    plan = make_plan(ModelFacts.of_sizes(numels, compute=compute), PlanConfig(),
                     Node(torch.device("cpu"), budgets=budgets,
                          rates={"nvme_read": 1e9, "nvme_write": 1e9, "cpu_adam": 1e9, "mem_copy": 1e10}))
    first_fit = [r for r in plan.alternatives if r["placement"] == {"params": "device", "gradients": "host",
                                                                     "optimizer": "split"}]
    assert first_fit, plan.alternatives
    assert (plan.placement["gradients"].value, plan.placement["optimizer"].value) == ("nvme", "host")
    assert plan.predicted_step_s < first_fit[0]["predicted_step_s"]
    assert plan.predicted_step_s == min(r["predicted_step_s"] for r in plan.alternatives)
    assert all(r["tiers"]["host"] <= budgets["host"] for r in plan.alternatives)  # only what fits


def test_a_cpu_devices_units_carry_the_engines_own_time():
    """[Note: the engine's own time]: `zerotier bench engine`'s seconds per unit are added to each unit's
    forward and backward on a CPU device (the hooks take compute's cores there), not on a CUDA device.
    Two units of 10 + 20 ms, all on the device: 2 x (1 + 2) ms more compute, the step 6 ms longer."""
    numels = [100_000] * 2
    compute = UnitCompute((0.01,) * 2, (0.02,) * 2, (False,) * 2)
    rates = {"cpu_adam": 1e12, "mem_copy": 1e15, "mem_read": 1e15}
    offload = OffloadConfig(params="device", gradients="device", optimizer="device")

    def plan(device, **extra):
        return make_plan(ModelFacts.of_sizes(numels, compute=compute), PlanConfig(offload=offload),
                         Node(torch.device(device), budgets={"device": 10**9, "host": 10**9, "nvme": 0},
                              rates={**rates, **extra}))
    plain = plan("cpu")
    own = plan("cpu", engine_forward_s=0.001, engine_backward_s=0.002)
    assert own.breakdown["forward"] == pytest.approx(plain.breakdown["forward"] + 0.002)
    assert own.breakdown["backward"] == pytest.approx(plain.breakdown["backward"] + 0.004)
    assert own.predicted_step_s == pytest.approx(plain.predicted_step_s + 0.006)
    assert own.rate_sources["engine_forward_s"] == "given" and "engine_forward_s" not in plain.rate_sources
    cuda = plan("cuda", engine_forward_s=0.001, engine_backward_s=0.002)
    assert cuda.predicted_step_s == pytest.approx(plan("cuda").predicted_step_s)  # hidden under the device's queue


def test_cli_plan_with_inputs_prints_the_step_and_the_alternatives(bench_file, tmp_path):
    (tmp_path / "tinyplan.py").write_text(textwrap.dedent("""
        import torch
        from zerotier.models import TinyGPT

        def model(device=None):
            with torch.device(device or "cpu"):
                return TinyGPT(vocab=128, dim=32, layers=3, heads=4, seq=16)

        def inputs():
            g = torch.Generator().manual_seed(0)
            return torch.randint(0, 128, (2, 16), generator=g), torch.randint(0, 128, (2, 16), generator=g)
        """))
    env = dict(os.environ, ZEROTIER_BENCH_FILE=str(bench_file))
    base = [sys.executable, "-m", "zerotier.cli", "plan", "--model", "tinyplan:model", "--inputs", "tinyplan:inputs",
            "--device", "1MiB", "--host", "1GiB", "--nvme", "1GiB", "--nvme-path", str(tmp_path)]
    r = subprocess.run(base, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "predicted step:" in r.stdout and "alternatives that fit" in r.stdout and "bound by" in r.stdout
    r = subprocess.run(base + ["--json"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    out = json.loads(r.stdout)
    api = zerotier.plan(tiny("meta"), {"tiers": {"device": "1MiB", "host": "1GiB", "nvme": "1GiB",
                                                 "nvme_path": str(tmp_path)}}, inputs=batch, repeat=1)
    assert out["placement"] == {k: v.value for k, v in api.placement.items()} and out["tiers"] == api.need
    assert [r["placement"] for r in out["alternatives"]] and out["compute_measured"] is True
    assert {json.dumps(r["placement"]) for r in out["alternatives"]} == \
        {json.dumps(r["placement"]) for r in api.alternatives}


def hf_causal_lm(kind, device="cpu"):
    """A stock Hugging Face causal LM built from a tiny config, use_cache left at its default (True);
    eager attention, so each attention call returns its weights (queries x keys)."""
    transformers = pytest.importorskip("transformers", reason="pip install transformers (part of .[test])")
    with torch.device(device):
        if kind == "llama":
            config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                              max_position_embeddings=32, attn_implementation="eager")
            return transformers.LlamaForCausalLM(config)
        config = transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                         bos_token_id=0, eos_token_id=0, attn_implementation="eager")
        return transformers.GPT2LMHeadModel(config)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_plan_measures_a_stock_hf_causal_lm_with_its_kv_cache_on(kind, bench_file):
    """[Note: a block's inputs, fresh per run]: the model's KV cache is among a block's captured inputs.
    Reused, the block's second run backs through the first one's freed graph (a RuntimeError), and
    its attention runs over the capture's keys plus its own: every attention must see 16 keys."""
    model = hf_causal_lm(kind)
    assert model.config.use_cache
    keys = []
    for module in model.modules():
        if type(module).__name__.endswith("Attention"):
            module.register_forward_hook(lambda mod, a, out: keys.append(out[1].shape[-1]))
    plan = zerotier.plan(model, {"tiers": {"device": "1GiB", "host": "1GiB", "nvme": 0}},
                         inputs=lambda: (batch()[0],), repeat=2)
    assert plan.compute_measured and plan.breakdown["forward"] > 0 and plan.breakdown["backward"] > 0
    assert len(keys) >= 2 + 3 and set(keys) == {16}  # the capture's 2 layers, then a timed block's 3 runs


def test_cli_plan_with_inputs_on_a_meta_built_stock_hf_model(bench_file, tmp_path):
    """`zerotier plan --model M:F --inputs M:F` on LlamaForCausalLM built on the meta device."""
    (tmp_path / "hfplan.py").write_text(textwrap.dedent("""
        import torch
        import transformers

        def model(device=None):
            config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                              max_position_embeddings=32)
            with torch.device(device or "cpu"):
                return transformers.LlamaForCausalLM(config)

        def inputs():
            ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
            return (ids,)
        """))
    pytest.importorskip("transformers", reason="pip install transformers (part of .[test])")
    env = dict(os.environ, ZEROTIER_BENCH_FILE=str(bench_file))
    r = subprocess.run([sys.executable, "-m", "zerotier.cli", "plan", "--model", "hfplan:model", "--inputs",
                        "hfplan:inputs", "--device", "1GiB", "--host", "1GiB", "--nvme", "0", "--json"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["compute_measured"] is True and out["breakdown_s"]["forward"] > 0


def test_another_nodes_rates_scale_the_measured_compute(bench_file, tmp_path):
    """[Note: another node's rates]: a node with twice this one's matmul rate runs each unit in half."""
    from zerotier.planner.planning import _compute_scale
    from zerotier.bench import rates_from_file

    there = tmp_path / "other.json"
    save({**RATES, "compute": {"fp32_flops": 8e10, "bf16_flops": 4e10}}, there)
    rates = rates_from_file(there)
    assert rates["compute_fp32"] == 8e10 and rates["nvme_read"] == 1e9 and rates["mem_copy"] == 4e9
    assert _compute_scale(rates, "fp32", torch.device("cpu")) == pytest.approx(0.5)
    assert _compute_scale(rates, "bf16", torch.device("cpu")) == pytest.approx(0.5)
    plan = zerotier.plan(tiny("meta"), {"tiers": {"device": "1GiB", "host": "1GiB", "nvme": 0}}, inputs=batch,
                         rates=there, repeat=1)
    assert plan.rate_sources["cpu_adam"] == "given"


def test_bench_compute_section_times_a_matmul():
    from zerotier.bench import format_table
    from zerotier.measure import bench_compute

    out = bench_compute(64, repeat=1)
    assert out["fp32_flops"] > 0 and out["bf16_flops"] > 0 and out["side"] == 64
    assert "matmul fp32" in format_table({"compute": out})


def test_the_optimizers_reads_count_where_the_plan_counts_them():
    """[Note: measured against the plan]: the optimizer's read of a gradient file is the plan's grads_nvme
    (gradients on NVMe: bench_planner's grads-nvme case showed 18-24 ms of optimizer_nvme against a
    plan of none), and the device step's host<->device copies are its optimizer_staging."""
    from zerotier.profiler.versus_plan import _component

    def t(role, src, dst, reason="optimizer-read"):
        return {"role": role, "src": src, "dst": dst, "reason": reason}
    assert _component(t("grad", "nvme", "host")) == "grads_nvme"
    assert _component(t("exp_avg", "nvme", "host")) == "optimizer_nvme"
    assert _component(t("exp_avg", "host", "nvme", "optimizer-write")) == "optimizer_nvme"
    assert _component(t("exp_avg", "host", "device")) == "optimizer_staging"
    assert _component(t("grad", "host", "device")) == "optimizer_staging"
    assert _component(t("exp_avg", "device", "host", "optimizer-write")) == "optimizer_staging"


def test_profile_puts_each_component_beside_the_plan_and_names_the_furthest(tmp_path):
    """[Note: measured against the plan]: a crafted step of forward 10 ms, backward 20 ms, an NVMe
    optimizer-state read of 3 ms and write of 4 ms around 3 ms of Adam; the plan expected the drive
    to take 1 ms: optimizer_nvme is 6 ms off, the others match."""
    from zerotier import cli
    from zerotier.config import ProfileConfig
    from zerotier.profiler import Profiler
    from zerotier.profiler.versus_plan import plan_comparison

    prof = Profiler(ProfileConfig(enabled=True, record_function=False), peak_rates={})
    ms = 1_000_000

    def span(kind, a, b):
        prof.record_compute(kind, prof.t0_ns + a * ms, prof.t0_ns + b * ms)
    span("forward", 0, 10)
    span("backward", 10, 30)
    prof.record("u00000.master", "master", "nvme", "host", 1 << 20, "optimizer-read", prof.t0_ns + 30 * ms,
                prof.t0_ns + 33 * ms, stream="io")
    span("optimizer", 33, 36)
    prof.record("u00000.master", "master", "host", "nvme", 1 << 20, "optimizer-write", prof.t0_ns + 36 * ms,
                prof.t0_ns + 40 * ms, stream="io")
    trace_path = tmp_path / "trace.json"
    prof.save(str(trace_path))
    plan = {"predicted_step_s": 0.035, "breakdown_s": {"forward": 0.010, "backward": 0.020, "optimizer": 0.003,
                                                        "optimizer_nvme": 0.001, "grad_norm": 0.0}}
    rows, line = plan_comparison(prof.trace(), plan)
    measured = {name: m for name, _, m in rows}
    assert measured["forward"] == pytest.approx(0.010, abs=1e-6)
    assert measured["optimizer_nvme"] == pytest.approx(0.007, abs=1e-6)
    assert "furthest from the plan: optimizer_nvme" in line
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(plan))
    assert cli.main(["profile", str(trace_path), "--plan", str(plan_path)]) == 0


def test_cli_plans_a_gpu_node_from_its_bench_file(tmp_path, capsys):
    """--rates from a node whose bench measured PCIe: planned as a CUDA device (host gradients cross
    PCIe there), and its GPU memory must be given, since this machine cannot see it."""
    from zerotier import cli

    there = tmp_path / "gpu-node.json"
    save({**RATES, "pcie": {"h2d_pinned_GBps": 25.0, "d2h_pinned_GBps": 25.0}}, there)
    base = ["plan", "--params", "1B", "--layers", "8", "--rates", str(there), "--host", "64GiB",
            "--offload", "gradients=host", "--offload", "optimizer=host", "--json"]
    if not torch.cuda.is_available():  # (a GPU machine plans with its own device budget)
        assert cli.main(base) == 1
        assert "pass --device SIZE" in capsys.readouterr().err
    assert cli.main(base + ["--device", "80GiB"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["breakdown_s"]["grads_d2h"] == pytest.approx(4e9 / 25e9)  # 1B fp32 gradients at 25 GB/s
    assert out["rate_sources"]["d2h"] == "given"


# [Note: speculation in the plan]: two units of 1000 parameters on a CUDA device, parameters and
# gradients on it, fp32 optimizer state on host, clipping. Rates give round seconds: Adam 1 s per unit,
# a gradient shard's d2h staging 0.5 s, the copy-back 0.25 s, the norm 1 s, an undo copy (12 + 4 B per
# parameter: 16 kB) 0.5 s. Forward 1 s and backward 2 s per unit. The schedules, as
# tests/test_step_schedule.py works them out:
#   without speculation  fwd 0-2, bwd 2-6, norm 6-7, d2h0 7-7.5, adam0 7.5-8.5, adam1 8.5-9.5, copy1 -> 9.75
#   commit               d2h1 4-4.5, undo1 4.5-5, adam1 5-6, copy1 6-6.25; d2h0 6-6.5, undo0 6.5-7,
#                        adam0 7-8, copy0 8-8.25, the norm after the speculated updates (the policy's
#                        wait() before it) 8-9 -> 9
#   rollback             the above, then from the norm's end, 9: d2h0 -9.5, restore0 -10, adam0 -11,
#                        copy0 -11.25; d2h1 9.5-10, restore1 11-11.5, adam1 -12.5, copy1 -12.75 -> 12.75
#   one unit's undo fits (unit 1: its gradient is final first): unit 1 as in commit, the norm after it
#                        6-7, unit 0 after the norm: d2h0 7-7.5, adam0 7.5-8.5, copy0 -8.75 -> 8.75
SPEC_RATES = {"cpu_adam": 1000.0, "d2h": 8000.0, "h2d": 16000.0, "device_adam": 8000.0, "mem_copy": 32000.0}
SPEC_UNITS = [1000, 1000]
SPEC_COMPUTE = UnitCompute((1.0, 1.0), (2.0, 2.0), (False, False))


def spec_plan(host=10**6, nvme=0, offload=None, world_size=1, **step):
    from zerotier.planner.predict import StepOptions

    offload = offload or OffloadConfig(params="device", gradients="device", optimizer="host")
    return make_plan(ModelFacts.of_sizes(SPEC_UNITS, compute=SPEC_COMPUTE),
                     PlanConfig(offload=offload, zero=ZeroConfig(stage=2 if world_size > 1 else 0),
                                step=StepOptions(**{"clip": True, "speculative": True, **step})),
                     Node(torch.device("cuda"), budgets={"device": 10**6, "host": host, "nvme": nvme}, rates=SPEC_RATES,
                          world_size=world_size))


def test_speculation_plan_predicts_commit_rollback_and_the_expected_step():
    from zerotier.overlap.speculative import shadow_bytes, undo_bytes

    plan = spec_plan(rollback_rate=0.25)
    assert plan.speculative and plan.speculation_units == (True, True)
    # speculating both units gains nothing at a 25% rollback rate: the norm waits for their updates
    assert plan.speculation_step_s == {"commit": 9.0, "rollback": 12.75, "expected": 0.75 * 9.0 + 0.25 * 12.75,
                                       "without": 9.75}
    assert plan.predicted_step_s == pytest.approx(9.9375) and plan.rollback_rate == 0.25
    assert sum(plan.critical.values()) == pytest.approx(plan.predicted_step_s)  # the weighted critical path
    undo = undo_bytes(StateLayout().state_bytes(1000), 1000, 4)
    assert undo == 16_000 and plan.speculation_undo_bytes == {"host": 2 * undo, "device": 0}
    off = spec_plan(speculative=False)
    assert not off.speculative and off.predicted_step_s == 9.75 and "train.overlap = 'none'" in \
        off.speculation_note
    assert plan.need["host"] - off.need["host"] == 2 * undo and plan.need["device"] == off.need["device"]
    text = plan.summary()
    assert "speculative step: on (train.overlap = 'speculative'); 2 of 2 units speculated; allowance host 31.25 KiB" \
        in text
    assert "predicted step (expected at rollback rate 25.0%): 9.94 s" in text
    assert "commit 9.00 s, rollback 12.75 s, expected 9.94 s; without speculation 9.75 s (no gain predicted here)" in text
    # the rate is an assumption, and a fresh model breaks it (issue 35 item 8): the plan says so
    assert ("rollback rate 25.0% assumed (clipping rarely firing); a fresh model or a warm-up that clips every step "
            "rolls back up to 100%: `zerotier profile` measures it; plan at that rate with --rollback-rate") in text
    d = plan.to_dict()
    assert d["speculative"] is True and d["rollback_rate"] == 0.25 and d["speculation_step_s"]["rollback"] == 12.75


def test_speculation_takes_only_the_undo_copies_the_host_budget_leaves_room_for():
    off = spec_plan(speculative=False)
    plan = spec_plan(host=off.need["host"] + 16_100)  # room for one undo copy (16 kB), not two
    assert plan.speculation_undo_bytes["host"] == 16_100 and plan.need["host"] == plan.budgets["host"]
    assert plan.speculation_units == (False, True)  # unit 1's gradient is final first
    assert plan.speculation_step_s["commit"] == 8.75
    none = spec_plan(host=off.need["host"] + 100, speculative="auto")
    assert not none.speculative and "no optimizer state on NVMe" in none.speculation_note
    with pytest.raises(PlanDoesNotFit, match="no unit's undo copy fits"):
        spec_plan(host=off.need["host"] + 100, speculative=True)


def test_speculation_is_off_with_several_ranks():
    """The engine speculates at one rank only (its reduced shards land at the end of backward)."""
    plan = spec_plan(world_size=2, speculative=True)
    assert not plan.speculative and "2 ranks" in plan.speculation_note
    assert plan.speculation_undo_bytes == {"host": 0, "device": 0}


def test_speculation_auto_follows_clipping_and_the_dynamic_scale():
    nvme = OffloadConfig(params="device", gradients="device", optimizer="nvme")
    auto = dict(nvme=10**7, offload=nvme, speculative="auto")
    assert not spec_plan(clip=False, **auto).speculative
    assert "no clipping and no dynamic loss scale" in spec_plan(clip=False, **auto).speculation_note
    dynamic = spec_plan(clip=False, dynamic_scale=True, **auto)
    assert dynamic.speculative and "a dynamic loss scale" in dynamic.speculation_note
    assert spec_plan(clip=False, speculative=True).speculative


def test_speculation_auto_makes_no_undo_copies():
    """auto speculates NVMe-state units only (their undo is the old files); host or device state
    needs `true` (an undo copy of 12 B/param: on an H200 it cost more than it hid)."""
    plan = spec_plan(speculative="auto")
    assert not plan.speculative and "train.overlap = 'speculative'" in plan.speculation_note
    assert plan.speculation_undo_bytes == {"host": 0, "device": 0}
    with pytest.raises(ConfigError, match="rollback_rate"):
        spec_plan(rollback_rate=1.5)


def test_speculation_counts_the_nvme_units_shadow_files_and_auto_turns_off_without_room():
    from zerotier.overlap.speculative import shadow_bytes, undo_bytes

    nvme = OffloadConfig(params="device", gradients="device", optimizer="nvme")
    off = spec_plan(nvme=10**7, offload=nvme, speculative=False)
    plan = spec_plan(nvme=10**7, offload=nvme, speculative="auto")
    shadow = shadow_bytes([4000] * 3, 4096)
    assert shadow == 3 * 4096 and plan.speculation_nvme_bytes == 2 * shadow
    assert plan.need["nvme"] - off.need["nvme"] == 2 * shadow
    # no undo copy: the pre-step files stay; the new parameters (4 kB each, a 4 KiB pool block) wait
    # on host until the check
    assert plan.speculation_undo_bytes == {"host": 2 * 4096, "device": 0}
    assert plan.need["host"] - off.need["host"] == 2 * 4096
    assert plan.speculative and plan.speculation_units == (True, True)
    short = spec_plan(nvme=off.need["nvme"] + shadow, offload=nvme, speculative="auto")
    assert not short.speculative and "NVMe budget lacks" in short.speculation_note
    assert "NVMe budget lacks" in short.summary()
    with pytest.raises(PlanDoesNotFit, match="shadow state files"):
        spec_plan(nvme=off.need["nvme"] + shadow, offload=nvme, speculative=True)


def test_cli_plan_rollback_rate(tmp_path, capsys):
    from zerotier import cli

    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"train": {"max_grad_norm": 1.0, "overlap": "speculative"},
                               "tiers": {"device": "1GiB", "host": "4GiB"}}))
    base = ["plan", "--params", "10M", "--layers", "2", "--config", str(cfg), "--json"]
    assert cli.main(base + ["--rollback-rate", "0.2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["speculative"] is True and out["rollback_rate"] == 0.2
    assert cli.main(base + ["--rollback-rate", "2"]) == 1
    assert "rollback_rate must be in [0, 1]" in capsys.readouterr().err


def test_plan_api_takes_the_rollback_rate_and_the_config_speculative_step():
    cfg = {"train": {"max_grad_norm": 1.0, "overlap": "speculative"},
           "tiers": {"device": "1GiB", "host": "1GiB", "nvme": 0}}
    plan = zerotier.plan(tiny("meta"), cfg, rates={"cpu_adam": 1e9}, rollback_rate=0.05)
    assert plan.speculative and plan.rollback_rate == 0.05 and sum(plan.speculation_undo_bytes.values()) > 0
    cfg["train"]["overlap"] = "none"
    assert not zerotier.plan(tiny("meta"), cfg, rates={"cpu_adam": 1e9}).speculative


def _bench_entry(change):
    def edit(data):
        change(next(iter(data["hosts"].values())))
    return edit


# Crafted `zerotier plan --rates` files (issue 37 row 16): (name, edit of a good file's JSON or raw text, what
# the one-line error names). Each was a traceback, or was silently dropped from the prediction.
CRAFTED_RATES = [
    ("not JSON", "{not json", "cannot read it as a zerotier bench file"),
    ("empty", "", "cannot read it as a zerotier bench file"),
    ("a list", "[1, 2]", "not a zerotier bench file"),
    ("no format", lambda d: d.pop("format"), "not a zerotier bench file"),
    ("hosts a list", lambda d: d.update(hosts=[1]), "not a zerotier bench file"),
    ("an entry a list", lambda d: d["hosts"].update({next(iter(d["hosts"])): [1]}), "expected an object of bench"),
    ("a section a list", _bench_entry(lambda e: e.update(io=[1])), r"\.io: expected an object of figures"),
    ("a string rate", _bench_entry(lambda e: e["adam"].update(fp32_params_per_s="fast")),
     r"\.adam\.fp32_params_per_s: expected a measured rate, a number from 1 to 1e\+18, got 'fast'"),
    ("a negative rate", _bench_entry(lambda e: e["adam"].update(fp32_params_per_s=-1)), r"fp32_params_per_s.*got -1"),
    ("a zero rate", _bench_entry(lambda e: e["mem"].update(copy_GBps=0)), r"\.mem\.copy_GBps.*got 0"),
    ("a NaN rate", _bench_entry(lambda e: e["mem"].update(copy_GBps=float("nan"))), r"copy_GBps.*got nan"),
    ("an infinite rate", _bench_entry(lambda e: e["io"].update(read_GBps=float("inf"))), r"read_GBps.*got inf"),
    ("a rate past 10^18/s", _bench_entry(lambda e: e["io"].update(read_GBps=1e308)), r"read_GBps.*got 1e\+308"),
    ("a rate below 1/s", _bench_entry(lambda e: e["adam"].update(fp32_params_per_s=1e-300)), r"got 1e-300"),
    ("a bool as a rate", _bench_entry(lambda e: e["adam"].update(fp32_params_per_s=True)), r"got True"),
    ("o_direct not a bool", _bench_entry(lambda e: e["io"].update(o_direct="yes")), r"io\.o_direct: expected true"),
    ("no figures", _bench_entry(lambda e: [e.pop(k) for k in list(RATES)]), "no zerotier bench results in it"),
]


@pytest.mark.parametrize("name, corruption, message", CRAFTED_RATES, ids=[c[0] for c in CRAFTED_RATES])
def test_a_crafted_rates_file_is_refused_naming_the_file_and_key(tmp_path, capsys, name, corruption, message):
    """Issue 37 row 16: a damaged --rates file is one ConfigError line naming the file and the key (exit 1,
    as every ZerotierError of the CLI), never a traceback nor a rate silently left out of the prediction;
    zerotier.plan(rates=FILE) raises the same ConfigError."""
    import re

    from zerotier import cli
    from zerotier.bench import rates_from_file

    path = tmp_path / "there.json"
    save(RATES, path)
    if callable(corruption):
        data = json.loads(path.read_text())
        corruption(data)
        path.write_text(json.dumps(data))
    else:
        path.write_text(corruption)
    with pytest.raises(ConfigError, match=message) as raised:
        rates_from_file(path)
    assert str(raised.value).startswith(f"{path}: ")
    assert cli.main(["plan", "--params", "1B", "--rates", str(path), "--host", "64GiB", "--device", "80GiB"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(message, err) and err.startswith("zerotier plan: error: "), err
    with pytest.raises(ConfigError, match=message):
        zerotier.plan(tiny("meta"), {"tiers": {"device": "1GiB", "host": "1GiB", "nvme": 0}}, rates=path)


# --- [Note: activation memory] (issue 35 item 4) --------------------------------------------------------
def test_activation_formula_is_korthikanti_eq_1():
    """34·s·b·h + 5·a·s²·b bytes per layer in 16-bit; 2·s·b·h per layer (+ one layer) checkpointed."""
    from zerotier.planner.activations import transformer_activation_bytes as act

    s, b, h, a, layers = 4096, 1, 8192, 64, 80
    per_layer = 34 * s * b * h + 5 * a * s * s * b
    assert act(h, layers, a, s, b) == layers * per_layer
    assert act(h, layers, a, s, b, dtype_bytes=4) == 2 * layers * per_layer
    assert act(h, layers, a, s, b, fused_attention=True) == layers * 34 * s * b * h
    assert act(h, layers, a, s, b, checkpointed=True) == layers * 2 * s * b * h + per_layer
    assert act(h, layers, a, s, b, vocab=1000) - act(h, layers, a, s, b) == s * b * 1000 * (2 + 4)


def test_a_device_plan_counts_the_activations_it_leaves_room_for():
    """A 20B-like plan whose params and gradients fill the device: with the activations counted the
    same budgets no longer fit there, and the device need grows by exactly them."""
    cfg = PlanConfig(tiers=TiersConfig(device=80 << 30, host=1 << 40, nvme=0), precision=PrecisionConfig(
        param_dtype="bf16", grad_dtype="bf16", master_dtype="bf16", moment_dtype="int8"), prefetch=PrefetchConfig(),
        offload=OffloadConfig(params="device", gradients="device", optimizer="host"))
    node, units = Node(torch.device("cpu"), rates={}), [250_000_000] * 80
    bare = make_plan(ModelFacts.of_sizes(units), cfg, node)
    act = 6 << 30
    given = ModelFacts.of_sizes(units, activations=(act, "given"))
    with_act = make_plan(given, dataclasses.replace(cfg, tiers=TiersConfig(
        device=bare.need["device"] + act, host=1 << 40, nvme=0)), node)
    assert with_act.need["device"] == bare.need["device"] + act and with_act.activation_bytes == act
    assert "activations: 6.00 GiB on the device per micro-batch, in needed (given)" in with_act.summary()
    with pytest.raises(PlanDoesNotFit):
        make_plan(given, dataclasses.replace(cfg, tiers=TiersConfig(
            device=bare.need["device"] + act - 1, host=1 << 40, nvme=0)), node)


def test_plan_measures_the_activations_of_its_inputs_and_estimates_them_without(bench_file):
    """--inputs: the tensors saved for backward, growing with the micro-batch; no inputs: the
    config's shapes (Korthikanti), at the model's longest sequence."""
    from zerotier.planner.activations import transformer_activation_bytes

    model = hf_causal_lm("llama", "meta")
    tiers = {"tiers": {"device": "1GiB", "host": "1GiB", "nvme": 0}}
    ids = lambda n: (torch.randint(0, 128, (n, 16), generator=torch.Generator().manual_seed(0)),)  # noqa: E731
    one, four = (zerotier.plan(model, tiers, inputs=lambda n=n: ids(n), repeat=1) for n in (1, 4))
    assert one.activation_bytes > 2 * 16 * 32 * 4 * 2  # more than every layer's input, fp32
    assert 3 * one.activation_bytes < four.activation_bytes <= 4 * one.activation_bytes
    assert "measured" in one.activation_source and one.to_dict()["activation_bytes"] == one.activation_bytes
    guessed = zerotier.plan(model, tiers)
    assert guessed.activation_bytes == transformer_activation_bytes(32, 2, 4, 32, vocab=128, dtype_bytes=4)
    assert "estimated from the config: seq 32, micro-batch 1" in guessed.summary()


def test_nvme_state_read_and_write_time_counts_the_units_buffers_as_the_store_allocates_them():
    """Silently wrong before: the NVMe optimizer's read/write time took the layout's average bytes
    per parameter (4.03 B with a bf16 master and int8 moments), while a unit of parameters below
    FP32_MOMENT_NUMEL keeps fp32 moments: hand-computed, 2 x 1000 elements x (2 B bf16 master +
    4 B exp_avg + 4 B exp_avg_sq) = 20,000 B read and written, as Sizes.state_units counts them."""
    from zerotier.planner.predict import DEFAULT_RATES, predict
    from zerotier.planner.sizes import Sizes
    from zerotier.state import Location

    layout = StateLayout(master="bf16", moments="int8")
    s = Sizes(numels=(2000,), lp_bytes=2, grad_bytes=4, lookahead=0, stage=0, world_size=1, unit_order=(2000,),
              unit_params=((1000, 1000),), state=layout)
    placement = {"params": Location.DEVICE, "gradients": Location.DEVICE, "optimizer": Location.NVME}
    schedule, used = predict(placement, s, "cpu", DEFAULT_RATES, local_ranks=1)
    assert {"nvme_read", "nvme_write"} <= set(used)
    expected = 20_000 / DEFAULT_RATES["nvme_read"] + 20_000 / DEFAULT_RATES["nvme_write"]
    assert schedule.seconds["optimizer_nvme"] == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_predict_sizes_each_ranks_io_and_update_by_the_shard_the_stores_allocate(world_size, monkeypatch):
    """Silently wrong before: predict took ceil(numel / N) elements per rank, while the stores
    allocate the partition's shard (Sizes.held_shard): padded to SHARD_ALIGN x N, and the whole
    unit where ZeRO-3 replicates it (below zero.persistence_threshold). Hand-computed for a unit of
    200,001 (sharded) and one of 1,000 (replicated) elements at ZeRO-3 with params, gradients on
    NVMe and the optimizer on host: each rank reads, writes and updates its padded shard."""
    import zerotier.planner.predict as predict_module
    from zerotier.planner.predict import DEFAULT_RATES, predict
    from zerotier.planner.sizes import Sizes
    from zerotier.state import Location

    works = []
    monkeypatch.setattr(predict_module, "simulate", lambda w, shape: works.extend(w))
    s = Sizes(numels=(200_001, 1000), lp_bytes=2, grad_bytes=4, lookahead=0, stage=3, world_size=world_size,
              unit_order=(200_001, 1000), unit_params=((200_001,), (1000,)))
    placement = {"params": Location.NVME, "gradients": Location.NVME, "optimizer": Location.HOST}
    predict(placement, s, "cpu", DEFAULT_RATES, local_ranks=1)
    grain = 32 * world_size
    held = [-(-200_001 // grain) * grain // world_size, 1000]
    assert held[0] != -(-200_001 // world_size)  # where ceil(numel / N) and the store differ
    assert [s.held_shard(n, "optimizer") for n in s.numels] == held == s.held_shards("params")
    cpu = predict_module.cpu_rate_key(DEFAULT_RATES, s.rule, s.state)
    for w, n in zip(works, held):
        assert w.fetch_nvme_s == pytest.approx(2 * n / DEFAULT_RATES["nvme_read"], rel=1e-12)
        assert w.grad_write_s == pytest.approx(4 * n / DEFAULT_RATES["nvme_write"], rel=1e-12)
        # bf16 parameters out: 30 of the 32 B/param the rate is of ([Note: the CPU rate's new parameters])
        assert w.adam_s == pytest.approx(n / DEFAULT_RATES[cpu] * 30 / 32, rel=1e-12)
        assert w.copyback_s == pytest.approx(2 * n / DEFAULT_RATES["nvme_write"], rel=1e-12)


@pytest.mark.parametrize("world_size", [1, 2])
def test_over_several_ranks_the_schedule_has_no_per_unit_work_under_backward(world_size, monkeypatch):
    """The overlap policies hand a unit to the optimizer thread during backward only at one rank
    (overlap/base.py, early.py, speculative.py: `not sharding.active`): over several ranks predict's
    shape has no early step and no state reads under backward (`StepShape.unit_final`)."""
    import zerotier.planner.predict as predict_module
    from zerotier.planner.predict import DEFAULT_RATES, StepOptions, predict
    from zerotier.planner.sizes import Sizes
    from zerotier.state import Location

    shapes = []
    monkeypatch.setattr(predict_module, "simulate", lambda w, shape: shapes.append(shape))
    s = Sizes(numels=(4000, 4000), lp_bytes=2, grad_bytes=4, lookahead=0, stage=2, world_size=world_size,
              unit_order=(4000, 4000), unit_params=((4000,), (4000,)))
    placement = {"params": Location.DEVICE, "gradients": Location.HOST, "optimizer": Location.NVME}
    predict(placement, s, "cuda", DEFAULT_RATES, local_ranks=1, options=StepOptions(early_step=True))
    (shape,) = shapes
    assert shape.unit_final == (world_size == 1) and shape.early_step == (world_size == 1)


def test_small_blocks_are_timed_over_enough_runs_for_a_median_that_holds(monkeypatch):
    """[Note: timing small units] in planner/unit_timing.py: a block of a fraction of a millisecond (and
    the root's own work) is timed until its runs last MIN_TIMED_S together (at most MAX_RUNS), not
    `repeat` times; with that floor at 0 each is timed `repeat` times after its warm-up, as a large
    block is."""
    from zerotier.models import TinyGPT
    from zerotier.planner import unit_timing

    enough = unit_timing._enough

    def timed_runs(floor: float) -> list[int]:
        monkeypatch.setattr(unit_timing, "MIN_TIMED_S", floor)
        runs = []

        def counted(fwd, bwd, repeat):
            done = enough(fwd, bwd, repeat)
            if done:
                runs.append(len(fwd))
            return done
        monkeypatch.setattr(unit_timing, "_enough", counted)
        torch.manual_seed(0)
        model = TinyGPT(vocab=32, dim=16, layers=2, heads=2, seq=8)  # two blocks of one signature: timed once
        unit_timing.measure(model, (torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8))),
                            torch.device("cpu"), torch.float32, repeat=2)
        return runs  # the block's, then the root's

    assert timed_runs(0.0) == [2, 2]
    assert all(n >= 10 for n in timed_runs(0.25)), "a sub-millisecond block timed only `repeat` times"


class _SlowBackward(torch.autograd.Function):
    """Identity forward; its backward sleeps `seconds`."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        import time
        time.sleep(ctx.seconds)
        return grad, None


def test_the_roots_backward_tail_is_timed_apart():
    """[Note: the root's backward comes in two parts] in planner/step_model.py: of the root's backward,
    unit_timing times apart what runs after the first block's input has its gradient (the embeddings').
    Here the head's backward sleeps 60 ms and the embeddings' 30 ms: the tail is the 30 ms, not 0 and not
    the whole; the blocks have none."""
    from zerotier.models import TinyGPT
    from zerotier.planner import unit_timing

    torch.manual_seed(0)
    model = TinyGPT(vocab=32, dim=16, layers=2, heads=2, seq=8)
    tok, head = model.tok.forward, model.head.forward
    model.tok.forward = lambda idx: _SlowBackward.apply(tok(idx), 0.03)
    model.head.forward = lambda x: _SlowBackward.apply(head(x), 0.06)
    compute = unit_timing.measure(model, (torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8))),
                                  torch.device("cpu"), torch.float32, repeat=2)
    root = compute.encloses.index(True)
    assert compute.backward_s[root] >= 0.09
    assert 0.03 <= compute.backward_tail_s[root] < 0.06
    assert all(t == 0 for i, t in enumerate(compute.backward_tail_s) if i != root)
