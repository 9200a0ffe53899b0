"""Where each unit's optimizer update runs ([Note: where the update runs] in planner/step_on.py):
`optimizer.step_on` -> `Plan.optimizer_step_on`, one "cpu" / "device" per trainable unit."""
from pathlib import Path

import pytest
import torch

from zerotier.config import OffloadConfig, PrecisionConfig
from zerotier.errors import ConfigError
from zerotier.planner.inputs import ModelFacts, Node, PlanConfig
from zerotier.planner.messages import PlanDoesNotFit
from zerotier.planner.planner import make_plan
from zerotier.planner.predict import StepOptions, UnitCompute
from zerotier.optim.rules import AdamW, Lion
from zerotier.optim.state_layout import StateLayout
from zerotier.optim.device_staging import DeviceStaging
from zerotier.planner.step_on import UpdateCosts, choose, cpu_rate_key, device_rate_key, staging_bytes_of, steps_on
from zerotier.state import Location

CPU = torch.device("cpu")
BIG = 10**15


@pytest.fixture(autouse=True)
def _no_saved_rates(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEROTIER_BENCH_FILE", str(tmp_path / "no-bench.json"))


def plan(numels, optimizer, step_on):
    offload = OffloadConfig(params="host", gradients="host", optimizer=optimizer)
    return make_plan(ModelFacts.of_sizes(numels), PlanConfig(offload=offload, alignment=1,
                                                             step=StepOptions(step_on=step_on)),
                     Node(CPU, budgets={"device": BIG, "host": BIG, "nvme": BIG}))


@pytest.mark.parametrize("optimizer", ["host", "nvme"])
@pytest.mark.parametrize("step_on, expect", [("cpu", "cpu"), ("device", "device"), ("auto", "cpu")])
def test_step_on_puts_every_host_or_nvme_unit_where_the_key_says(optimizer, step_on, expect):
    p = plan([3000, 2000, 1000], optimizer, step_on)
    assert p.optimizer_step_on == (expect,) * 3
    assert p.to_dict()["optimizer_step_on"] == [expect] * 3


@pytest.mark.parametrize("step_on", ["cpu", "device", "auto"])
def test_state_on_the_device_is_updated_there_whatever_the_key(step_on):
    assert plan([3000, 2000], "device", step_on).optimizer_step_on == ("device", "device")


def test_a_split_gives_each_unit_its_own_entry_in_unit_order():
    p = plan([1000] * 4, {"host": 0.5, "nvme": 0.5}, "device")
    assert p.optimizer_units == (Location.HOST,) * 2 + (Location.NVME,) * 2
    assert p.optimizer_step_on == ("device",) * 4
    assert steps_on("cpu", (Location.DEVICE, Location.HOST, Location.NVME)) == ("device", "cpu", "cpu")


def test_an_unknown_step_on_is_a_config_error_naming_the_choices():
    with pytest.raises(ConfigError, match=r"optimizer\.step_on: must be one of 'cpu', 'device', 'auto', got 'gpu'"):
        steps_on("gpu", (Location.HOST,))


# --- [Note: choosing where each update runs], hand-computed ---------------------------------------
# fp32 AdamW state (12 B/param), fp32 parameters (4 B) and gradients on the device: 12 B of state
# staged in and 4 B of new parameters committed to their device home (h2d), 12 B of state and the
# 4 B new shard staged out (d2h), the kernel 28 B. Rates chosen so each is 1 s per 1e4 params: CPU
# Adam 1e4 params/s, h2d = d2h = 16e4 B/s, device_adam 28e4 B/s. The device side of units S: 1 s/1e4
# x params(S) (its slowest stage) + 2 s/1e4 x its largest unit (the other two stages: fill and drain).
RATES = {"cpu_adam": 1e4, "h2d": 16e4, "d2h": 16e4, "device_adam": 28e4, "mem_copy": 1e12, "mem_read": 1e12,
         "nvme_read": 1e12, "nvme_write": 1e12}
COSTS = UpdateCosts.of(RATES, 12, 4, 4, cuda=True, grads_on_device=True, params_on_device=True)
SHARDS = [2000, 4000, 1000, 3000]  # unit index order; by size: units 1, 3, 0, 2
# the engine's staging of the device units: fp32 state (three 4 B keys), a 2 B output, gradients on the device
STAGING = staging_bytes_of([(4 * n,) * 3 for n in SHARDS], SHARDS, lp_itemsize=2, grad_itemsize=0)


def test_the_greedy_split_by_hand():
    # unit 1 (4000): cpu 0.4 s vs device 0.4 + 0.8 = 1.2 s -> cpu (0.4)
    # unit 3 (3000): cpu 0.7 vs max(0.4, 0.3 + 0.6 = 0.9) -> cpu (0.7)
    # unit 0 (2000): cpu 0.9 vs max(0.7, 0.2 + 0.4 = 0.6) = 0.7 -> device (0.6)
    # unit 2 (1000): cpu max(0.8, 0.6) = 0.8 vs max(0.7, 0.3 + 0.4 = 0.7) = 0.7 -> device
    # both sides finish at 0.7 s; every unit on the CPU takes 1.0 s
    assert COSTS.device_stage == pytest.approx(1e-4) and COSTS.device_fill == pytest.approx(2e-4)
    s = choose("auto", (Location.HOST,) * 4, SHARDS, COSTS, cuda=True, staging=STAGING)
    assert s.units == ("device", "cpu", "device", "cpu")
    assert s.sides["cpu"][:2] == (2, 7000) and s.sides["cpu"][2] == pytest.approx(0.7)
    assert s.sides["device"][:2] == (2, 3000) and s.sides["device"][2] == pytest.approx(0.7)
    # the engine's staging sets of the largest device unit (unit 0): 12 B of state + 2 B of output x 2000
    assert s.staging_bytes == DeviceStaging.SETS * (12 + 2) * 2000


def test_forced_sides_and_device_homed_units():
    cpu = choose("cpu", (Location.HOST,) * 4, SHARDS, COSTS, cuda=True, staging=STAGING)
    assert cpu.units == ("cpu",) * 4 and cpu.sides == {"cpu": (4, 10000, pytest.approx(1.0))}
    assert cpu.staging_bytes == 0
    dev = choose("device", (Location.NVME,) * 4, SHARDS, COSTS, cuda=True, staging=STAGING)
    assert dev.units == ("device",) * 4 and dev.sides["device"][2] == pytest.approx(1.0 + 0.8)
    assert dev.staging_bytes == DeviceStaging.SETS * (12 + 2) * 4000
    # state homed on the device is no choice: updated there, outside the split's sides
    mixed = choose("auto", (Location.DEVICE, Location.HOST, Location.HOST, Location.HOST), SHARDS, COSTS, True, STAGING)
    assert mixed.units[0] == "device" and sum(n for n, _, _ in [mixed.sides[k] for k in mixed.sides]) == 3


def test_without_cuda_auto_keeps_the_cpu():
    s = choose("auto", (Location.HOST,) * 4, SHARDS, COSTS, cuda=False, staging=STAGING)
    assert s.units == ("cpu",) * 4 and s.staging_bytes == 0


def test_the_greedy_is_within_one_unit_of_the_balanced_optimum():
    """[Note: choosing where each update runs]: at most one unit's update above the point where the
    two sides would meet if units could be cut (a bound no split beats), here on many unequal units."""
    costs = UpdateCosts.of(RATES, 12, 4, 4, cuda=True, grads_on_device=True, params_on_device=True)
    shards = [1000 + 37 * i % 900 for i in range(40)]
    s = choose("auto", (Location.HOST,) * 40, shards, costs, cuda=True,
               staging=staging_bytes_of([(4 * n,) * 3 for n in shards], shards, 2, 0))
    total = sum(shards)
    # cut units: cpu x = stage (total - x) + fill x largest: the meeting point is a lower bound
    bound = (costs.device_stage * total) * costs.cpu / (costs.cpu + costs.device_stage)
    worst = max(s.sides["cpu"][2], s.sides["device"][2])
    assert bound <= worst <= bound + costs.device_fill * max(shards) + costs.cpu * max(shards)


def cuda_plan(step_on, device=BIG, optimizer="host"):
    offload = OffloadConfig(params="device", gradients="device", optimizer=optimizer)
    return make_plan(ModelFacts.of_sizes(SHARDS), PlanConfig(offload=offload, alignment=1,
                                                             step=StepOptions(step_on=step_on)),
                     Node(torch.device("cuda"), budgets={"device": device, "host": BIG, "nvme": BIG}, rates=RATES))


@pytest.fixture
def two_sets(monkeypatch):
    """The engine's two staging sets ([Note: the device step in the schedule]): the schedules below
    are worked out for DeviceStaging.SETS = 2, whatever the engine's value when they run."""
    monkeypatch.setattr(DeviceStaging, "SETS", 2)


def test_the_plan_prints_and_predicts_the_device_step_and_auto_weighs_the_schedule(two_sets):
    """[Note: the device step in the schedule], by hand (no compute: the step is the update). Per 1e4
    params: the CPU 1 s; a device unit in 0.75 s (its 12 B of state), kernel 1 s, out 1 s (state and
    shard), then its commit 0.25 s (h2d); a CPU unit's gradient staged out 0.25 s (d2h), its commit 0.25 s.
    The balanced split (device, cpu, device, cpu): unit 0 in 0-0.15, kernel 0.15-0.35, out 0.35-0.55;
    unit 1's gradient 0-0.1, CPU 0.1-0.5 (unit 0 not out yet); unit 2 in 0.5-0.575, kernel 0.575-0.675,
    out 0.675-0.775; unit 3's gradient after unit 0's out 0.55-0.625, CPU 0.625-0.925; only then are
    units 0 and 2 retired, and every commit waits for it: 0.925 + 0.05 + 0.1 + 0.025 + 0.075 = 1.175 s.
    Every unit on the CPU: its gradients hidden but the first (0.05), 1.0 s of updates, unit 3's commit
    0.075 s: 1.125 s. Every unit on the device: 2.25 s (its two sets: unit 2 waits for unit 0's out at
    0.55, unit 3 for unit 1's at 1.25; unit 3 in 1.35-1.575, kernel 1.575-1.875, out 1.875-2.175,
    commit 2.175-2.25). `auto` keeps the CPU: its commits are not held."""
    auto, cpu, dev = cuda_plan("auto"), cuda_plan("cpu"), cuda_plan("device")
    assert choose("auto", (Location.HOST,) * 4, SHARDS, COSTS, True, STAGING).units == ("device", "cpu", "device", "cpu")
    assert auto.optimizer_step_on == ("cpu",) * 4 and auto.predicted_step_s == cpu.predicted_step_s
    assert dev.optimizer_step_on == ("device",) * 4
    # the engine's staging sets of the largest device unit (unit 1): 12 B of state x 4000 (the parameters'
    # device home takes the new shard in place: ParamStore.device_out)
    staged = DeviceStaging.SETS * 12 * 4000
    assert dev.needs["device_step"]["device"] == staged and auto.needs["device_step"]["device"] == 0
    assert dev.need["device"] - cpu.need["device"] == staged
    # every unit's state crosses the link each way, and the new shard out: 10000 params x 12 B in, 16 B out
    assert dev.breakdown["optimizer_staging"] == pytest.approx((12 + 16) * 10000 / 16e4)
    assert cpu.breakdown["optimizer_staging"] == 0
    # the new shard comes back to the device home after a device step as after a CPU update: 4 B x 10000
    assert dev.breakdown["params_copyback"] == pytest.approx(0.25) == cpu.breakdown["params_copyback"]
    assert dev.predicted_step_s == pytest.approx(2.25) and cpu.predicted_step_s == pytest.approx(1.125)
    text = dev.summary()
    assert "optimizer step on (optimizer.step_on = device):" in text
    assert "device 4 units" in text and f"staged on the device {staged / 1024:.2f} KiB (in needed)" in text
    assert dev.to_dict()["optimizer_step_sides"]["device"]["params"] == 10000


@pytest.mark.pins("design#the-update-runs-where-the-plan-says-the-state-stays-home")
def test_auto_takes_the_balanced_split_beside_a_faster_device(two_sets):
    """A device path 10x faster (each stage 0.1 s / 1e4 params): the greedy split (device, device, cpu,
    device). Unit 0 in 0-0.015, kernel 0.015-0.035, out 0.035-0.055; unit 1 issued at once: in
    0.015-0.045, kernel 0.045-0.085, out 0.085-0.125; unit 2's gradient 0.015-0.0175, CPU 0.0175-0.1175,
    after which unit 0 is retired (its commit 0.1175-0.1225); unit 3 takes unit 0's set: in
    0.1225-0.145, kernel 0.145-0.175, out 0.175-0.205; the step's end retires units 1 (0.125) and 3
    (0.205), unit 3's commit 0.205-0.2125 -> 0.2125 s. Every unit on the device: 0.225 s, on the CPU:
    1.0125 s. `auto` takes the split."""
    rates = {**RATES, "h2d": 160e4, "d2h": 160e4, "device_adam": 280e4}
    costs = UpdateCosts.of(rates, 12, 4, 4, cuda=True, grads_on_device=True, params_on_device=True)
    assert choose("auto", (Location.HOST,) * 4, SHARDS, costs, True, STAGING).units == \
        ("device", "device", "cpu", "device")
    node = Node(torch.device("cuda"), budgets={"device": BIG, "host": BIG, "nvme": BIG}, rates=rates)
    plans = {on: make_plan(ModelFacts.of_sizes(SHARDS),
                           PlanConfig(offload=OffloadConfig(params="device", gradients="device", optimizer="host"),
                                      alignment=1, step=StepOptions(step_on=on)), node)
             for on in ("auto", "cpu", "device")}
    assert plans["auto"].optimizer_step_on == ("device", "device", "cpu", "device")
    assert plans["auto"].predicted_step_s == pytest.approx(0.2125)
    assert plans["device"].predicted_step_s == pytest.approx(0.225)
    assert plans["cpu"].predicted_step_s == pytest.approx(1.0125)


def seven_b_plans(**step) -> dict:
    """A 7B-like model (32 layers of 202M parameters and a 262M root: embedding and head; bf16 parameters
    on the device, gradients and optimizer on host) at 4k tokens, with benchmarks/nodes/h200.json's rates
    (CPU Adam 4.27 Gparam/s, PCIe 52 GB/s each way, the device's Adam at the default 50 GB/s: not
    measured there): its plan for each optimizer.step_on."""
    from zerotier.bench import rates_from_file
    rates = rates_from_file(Path(__file__).resolve().parents[1] / "benchmarks" / "nodes" / "h200.json")
    numels = [202_000_000] * 32 + [262_000_000]
    compute = UnitCompute((0.02,) * 32 + (0.03,), (0.06,) * 32 + (0.06,), (False,) * 32 + (True,))
    node = Node(torch.device("cuda"), budgets={"device": BIG, "host": BIG, "nvme": BIG}, rates=rates)
    return {on: make_plan(ModelFacts.of_sizes(numels, compute=compute),
                          PlanConfig(offload=OffloadConfig(params="device", gradients="host", optimizer="host"),
                                     precision=PrecisionConfig(param_dtype="bf16"),
                                     step=StepOptions(step_on=on, **step)), node)
            for on in ("auto", "cpu", "device")}


def test_auto_splits_a_7b_model_on_the_h200s_rates(two_sets):
    """Without overlap every unit on the CPU puts 1.58 s of updates after backward; the device's units
    beside the CPU's shorten the step, so `auto` takes a real split."""
    plans = seven_b_plans(overlap="none", speculative=False)
    auto = plans["auto"]
    on_device = auto.optimizer_step_on.count("device")
    assert 0 < on_device < len(auto.optimizer_step_on)  # a real split
    assert auto.predicted_step_s < plans["cpu"].predicted_step_s < plans["device"].predicted_step_s
    assert auto.critical["optimizer"] < plans["cpu"].critical["optimizer"]  # the CPU's updates, fewer of them
    assert auto.breakdown["optimizer_staging"] > 0 and plans["cpu"].breakdown["optimizer_staging"] == 0


def test_auto_weighs_the_step_the_plan_reports_speculation_included(two_sets):
    """With train.overlap = "speculative" each speculated unit updates under backward in its own step
    call, so a device unit there holds the thread and takes compute from backward: the split that
    shortens the plain step lengthens this one. `auto` compares the candidates' speculative steps (the
    plan's), not their plain ones, so it is never slower than a forced side (here: the CPU)."""
    plans = seven_b_plans(overlap="speculative", speculative=True)
    assert plans["auto"].speculative and plans["cpu"].speculative
    assert plans["auto"].predicted_step_s == min(p.predicted_step_s for p in plans.values())
    assert plans["auto"].optimizer_step_on == plans["cpu"].optimizer_step_on


def test_device_without_room_for_its_staging_is_refused_and_auto_keeps_the_cpu():
    room = cuda_plan("cpu").need["device"]
    kib = DeviceStaging.SETS * 12 * 4000 / 1024  # the sets of the largest unit: its state (output in place)
    with pytest.raises(PlanDoesNotFit, match=rf"optimizer\.step_on = 'device' stages the state of the units it updates "
                                             rf"on the device: {kib:.2f} KiB of device memory .* raise tiers\.device by "
                                             rf"{kib:.2f} KiB"):
        cuda_plan("device", device=room)
    assert cuda_plan("auto", device=room).optimizer_step_on == ("cpu",) * 4


def test_the_staging_counts_compact_state_as_the_store_allocates_it():
    """[Note: the device step's staging memory]: a unit's staged state is its allocated bytes (int8
    moments' scales and rounding included: Sizes.state_units), not bytes_per_param x params."""
    precision = PrecisionConfig(param_dtype="bf16", master_dtype="bf16", moment_dtype="int8")
    plan = make_plan(ModelFacts.of_sizes([5000]),
                     PlanConfig(offload=OffloadConfig(params="device", gradients="device", optimizer="nvme"),
                                precision=precision, alignment=1, step=StepOptions(step_on="device")),
                     Node(torch.device("cuda"), budgets={"device": BIG, "host": BIG, "nvme": BIG}, rates=RATES))
    one_unit = plan.needs["optimizer"]["nvme"] // 2  # the NVMe term: the state and its one rewrite in flight
    # one staging set per DeviceStaging.SETS: the state (gradients on the device, the output in place)
    assert plan.needs["device_step"]["device"] == DeviceStaging.SETS * one_unit
    assert one_unit != round(plan.state_layout.bytes_per_param * 5000)


@pytest.mark.parametrize("params", ["device", "host"])
@pytest.mark.parametrize("gradients", ["device", "host"])
def test_the_staging_term_is_the_engines_sets_whatever_the_params_and_gradients_homes(params, gradients):
    """[Note: the device step's staging memory] on a CUDA node: the output is staged unless the
    parameters' device home takes it in place (one rank), the gradient only from off the device."""
    p = make_plan(ModelFacts.of_sizes(SHARDS),
                  PlanConfig(offload=OffloadConfig(params=params, gradients=gradients, optimizer="host"),
                             alignment=1, step=StepOptions(step_on="device")),
                  Node(torch.device("cuda"), budgets={"device": BIG, "host": BIG, "nvme": BIG}, rates=RATES))
    grad = 4 if gradients == "host" else 0  # fp32 gradients staged H2D beside the state
    out = 4 if params == "host" else 0  # fp32 output staged out to a host home, written in place on the device
    assert p.needs["device_step"]["device"] == DeviceStaging.SETS * (12 + out + grad) * 4000


# --- the update's rates per rule and state dtype (issue 34 item 3) -----------------------------
# `zerotier bench` writes cpu_<rule>_<master>_<moments> (params/s) and device_<rule>_<master>_<moments>
# (kernel bytes/s); the planner reads the pair of its rule and state, else cpu_adam / device_adam.

def test_a_slower_cpu_rate_for_the_state_moves_units_to_the_device(two_sets):
    # cpu_adamw_fp32_fp32 half of cpu_adam: 2 s / 1e4 params on the CPU; the device as before
    # (stage 1 s / 1e4, fill 2 s / 1e4 x the largest device unit). Greedy, largest first:
    # unit 1 (4000): cpu 0.8 vs device 1.2 -> cpu (0.8)
    # unit 3 (3000): cpu 1.4 vs max(0.8, 0.3 + 0.6) = 0.9 -> device
    # unit 0 (2000): cpu max(1.2, 0.9) = 1.2 vs max(0.8, 0.5 + 0.6) = 1.1 -> device
    # unit 2 (1000): cpu max(1.0, 1.1) = 1.1 vs max(0.8, 0.6 + 0.6) = 1.2 -> cpu
    rates = {**RATES, "cpu_adamw_fp32_fp32": 0.5e4}
    costs = UpdateCosts.of(rates, 12, 4, 4, cuda=True, grads_on_device=True, params_on_device=True,
                           cpu_key=cpu_rate_key(rates, AdamW(), StateLayout()))
    s = choose("auto", (Location.HOST,) * 4, SHARDS, costs, True, STAGING)
    assert s.units == ("device", "cpu", "cpu", "device")  # with cpu_adam alone: unit 2, not 3
    assert s.sides["cpu"] == (2, 5000, pytest.approx(1.0))
    assert s.sides["device"] == (2, 5000, pytest.approx(1.1))
    assert choose("auto", (Location.HOST,) * 4, SHARDS, COSTS, True, STAGING).units == ("device", "cpu", "device", "cpu")
    # the plan reads the rate of its rule and state, and its schedule ([Note: the device step in the
    # schedule], two staging sets) runs the device's units beside the CPU's: unit 0 in 0-0.15, kernel
    # 0.15-0.35, out 0.35-0.55; unit 1's gradient 0-0.1, CPU 0.1-0.9 (unit 0 retired after it); unit 2's
    # gradient 0.1-0.125, CPU 0.9-1.1; commits 0, 1 0.9-1.05 and 2 1.1-1.125 (h2d); unit 3 in
    # 1.125-1.35, kernel 1.35-1.65, out 1.65-1.95, commit 1.95-2.025 -> 2.025 s; every unit on the CPU
    # 2.125 s (0.05 + 2.0 + its last commit 0.075), on the device 2.25 s: `auto` takes the split
    p = make_plan(ModelFacts.of_sizes(SHARDS),
                  PlanConfig(offload=OffloadConfig(params="device", gradients="device", optimizer="host"),
                             alignment=1, step=StepOptions(step_on="auto")),
                  Node(torch.device("cuda"), budgets={"device": BIG, "host": BIG, "nvme": BIG}, rates=rates))
    assert p.rate_sources["cpu_adamw_fp32_fp32"] == "given" and "cpu_adam" not in p.rate_sources
    assert p.optimizer_step_on == ("device", "cpu", "cpu", "device")
    assert p.predicted_step_s == pytest.approx(2.025)


def test_a_slower_device_rate_for_the_state_keeps_more_units_on_the_cpu():
    # device_adamw_fp32_fp32 half of device_adam: the kernel 2 s / 1e4 params, the links 1 s each:
    # stage 2 s / 1e4, fill 2 s / 1e4. The CPU 1 s / 1e4.
    # unit 1 (4000): cpu 0.4 vs 1.6 -> cpu;  unit 3 (3000): cpu 0.7 vs max(0.4, 1.2) -> cpu
    # unit 0 (2000): cpu 0.9 vs max(0.7, 0.4 + 0.4) = 0.8 -> device
    # unit 2 (1000): cpu max(0.8, 0.8) = 0.8 vs max(0.7, 0.6 + 0.4) = 1.0 -> cpu
    rates = {**RATES, "device_adamw_fp32_fp32": 14e4}
    costs = UpdateCosts.of(rates, 12, 4, 4, cuda=True, grads_on_device=True, params_on_device=True,
                           device_key=device_rate_key(rates, AdamW(), StateLayout()))
    s = choose("auto", (Location.HOST,) * 4, SHARDS, costs, cuda=True, staging=STAGING)
    assert s.units == ("device", "cpu", "cpu", "cpu")
    assert s.sides["cpu"][2] == pytest.approx(0.8) and s.sides["device"][2] == pytest.approx(0.8)


def test_the_rate_keys_follow_the_rule_and_the_state_dtypes():
    compact = StateLayout("bf16", "int8")
    rates = {"cpu_adam": 1.0, "device_adam": 1.0, "cpu_adamw_bf16_int8": 2.0, "device_lion_bf16_int8": 3.0}
    assert cpu_rate_key(rates, AdamW(), compact) == "cpu_adamw_bf16_int8"
    assert cpu_rate_key(rates, AdamW(), StateLayout()) == "cpu_adam"        # not measured: fp32 Adam's rate
    assert cpu_rate_key(rates, Lion(), compact) == "cpu_adam"
    assert device_rate_key(rates, Lion(), compact) == "device_lion_bf16_int8"
    assert device_rate_key(rates, AdamW(), compact) == "device_adam"
    # the plan reads its state's key: bf16 master + int8 moments at 1e4 params/s, 1 s for 1e4 params
    precision = PrecisionConfig(param_dtype="bf16", master_dtype="bf16", moment_dtype="int8")
    p = make_plan(ModelFacts.of_sizes([10**4]), PlanConfig(offload=OffloadConfig(optimizer="host"), precision=precision,
                                                           alignment=1, step=StepOptions(step_on="cpu")),
                  Node(CPU, budgets={"device": BIG, "host": BIG, "nvme": BIG},
                       rates={"cpu_adam": 1e9, "cpu_adamw_bf16_int8": 1e4}))
    assert p.rate_sources["cpu_adamw_bf16_int8"] == "given" and "cpu_adam" not in p.rate_sources
    assert p.breakdown["optimizer"] == pytest.approx(1.0)
