"""Where each unit's optimizer update runs ([Note: where the update runs] in planner/step_on.py):
`optimizer.step_on` -> `Plan.optimizer_step_on`, one "cpu" / "device" per trainable unit."""
from pathlib import Path

import pytest
import torch

from zerotier.config import OffloadConfig, PrecisionConfig, ZeroConfig
from zerotier.errors import ConfigError
from zerotier.planner.inputs import ModelFacts, Node, PlanConfig
from zerotier.planner.messages import PlanDoesNotFit
from zerotier.planner.planner import make_plan
from zerotier.planner.predict import StepOptions, UnitCompute
from zerotier.optim.rules import AdamW, Lion
from zerotier.optim.state_layout import StateLayout
from zerotier.optim.device_staging import DeviceStaging
from zerotier.planner.step_on import UpdateCosts, choose, cpu_out_scale, cpu_rate_key, device_rate_key, staging_bytes_of, steps_on
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
# fp32 AdamW state (12 B/param), gradients and parameters on the device (one rank: the new shard is
# written in its home in place): 12 B staged in and out, the kernel 28 B. Rates chosen so each is 1 s
# per 1e4 params: CPU Adam 1e4 params/s, h2d = d2h = 12e4 B/s, device_adam 28e4 B/s. The device side
# of units S: 1 s/1e4 x params(S) (its slowest stage) + 2 s/1e4 x its largest unit (the other two
# stages: fill and drain).
RATES = {"cpu_adam": 1e4, "h2d": 12e4, "d2h": 12e4, "device_adam": 28e4, "mem_copy": 1e12, "mem_read": 1e12,
         "nvme_read": 1e12, "nvme_write": 1e12}
COSTS = UpdateCosts.of(RATES, 12, 4, 4, cuda=True, grads_on_device=True, params_on_device=True)
SHARDS = [2000, 4000, 1000, 3000]  # unit index order; by size: units 1, 3, 0, 2
# the engine's staging of the device units: fp32 state (three 4 B keys), a 2 B output, gradients on the device
STAGING = staging_bytes_of([(4 * n,) * 3 for n in SHARDS], SHARDS, lp_itemsize=2, grad_itemsize=0)


def test_the_cpu_rate_counts_the_new_parameters_bytes():
    """[Note: the CPU rate's new parameters]: the bench's rate is of the kernel writing the new parameters in
    the master's dtype; the engine writes them in the parameters'. fp32 AdamW: 2 x 12 B of state + 4 B of
    gradient + 4 B out = 32 B; bf16 parameters 30 B: 30/32 of the time. bf16 master and moments (6 B), bf16
    parameters: as measured."""
    assert COSTS.cpu == pytest.approx(1e-4)
    bf16_params = UpdateCosts.of(RATES, 12, 4, 2, cuda=True, grads_on_device=True, params_on_device=True)
    assert bf16_params.cpu == pytest.approx(1e-4 * 30 / 32)
    compact = UpdateCosts.of(RATES, 6, 4, 2, cuda=True, grads_on_device=True, params_on_device=True, master_bytes=2)
    assert compact.cpu == pytest.approx(1e-4)
    assert cpu_out_scale(12, 4, 2, 4) == pytest.approx(30 / 32)
    # a bench file from before (cpu_params_out 0: timed without them): fp32 parameters move 32 of 28 B
    before = UpdateCosts.of({**RATES, "cpu_params_out": 0.0}, 12, 4, 4, cuda=True, grads_on_device=True,
                            params_on_device=True)
    assert before.cpu == pytest.approx(1e-4 * 32 / 28)


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


def cuda_plan(step_on, device=BIG, optimizer="host", rates=RATES):
    offload = OffloadConfig(params="device", gradients="device", optimizer=optimizer)
    return make_plan(ModelFacts.of_sizes(SHARDS), PlanConfig(offload=offload, alignment=1,
                                                             step=StepOptions(step_on=step_on)),
                     Node(torch.device("cuda"), budgets={"device": device, "host": BIG, "nvme": BIG}, rates=rates))


@pytest.fixture
def two_sets(monkeypatch):
    """The engine's two staging sets ([Note: the device step in the schedule]): the schedules below
    are worked out for DeviceStaging.SETS = 2, whatever the engine's value when they run."""
    monkeypatch.setattr(DeviceStaging, "SETS", 2)


# the links at 16e4 B/s: per 1e4 params a device unit's 12 B of state in 0.75 s and out 0.75 s (the new
# shard written in its device home in place), its kernel 1 s; a CPU unit's gradient staged out 0.25 s
# (d2h), its update 1 s, its new parameters' commit 0.25 s (h2d)
LINKS_16 = {**RATES, "h2d": 16e4, "d2h": 16e4}


def norm_s(rates) -> float:
    """The global norm every window computes before the update (predict.py: the device gradients' 4 B
    per param read at device_adam bytes/s): every schedule below starts after it."""
    return 4 * sum(SHARDS) / rates["device_adam"]


def test_the_plan_prints_and_predicts_the_device_step_and_auto_weighs_the_schedule(two_sets):
    """[Note: the device step in the schedule], by hand (no compute: the step is the update), LINKS_16,
    every time below after the global norm (`norm_s`).
    The balanced split (device, cpu, device, cpu): unit 0 in 0-0.15, kernel 0.15-0.35, out 0.35-0.5;
    unit 1's gradient 0-0.1, CPU 0.1-0.5, after which unit 0 (out at 0.5) is retired and unit 1's held
    commit goes 0.5-0.6; unit 2 (issued at 0.5) in 0.6-0.675, kernel 0.675-0.775, out 0.775-0.85; unit
    3's gradient 0.5-0.575, CPU 0.575-0.875, unit 2 retired then, unit 3's commit 0.875-0.95 -> 0.95 s.
    Every unit on the CPU: the first gradient 0.05, 1.0 s of updates, the last commit 0.075: 1.125 s.
    Every unit on the device: unit 2 waits for unit 0's set (0.5), unit 3 for unit 1's (out 0.85-1.15):
    in 1.15-1.375, kernel 1.375-1.675, out 1.675-1.9 -> 1.9 s. `auto` takes the split."""
    auto, cpu, dev = (cuda_plan(on, rates=LINKS_16) for on in ("auto", "cpu", "device"))
    assert auto.optimizer_step_on == ("device", "cpu", "device", "cpu")
    assert dev.optimizer_step_on == ("device",) * 4
    norm = norm_s(LINKS_16)
    assert auto.predicted_step_s == pytest.approx(0.95 + norm)
    assert cpu.predicted_step_s == pytest.approx(1.125 + norm) and dev.predicted_step_s == pytest.approx(1.9 + norm)
    # the engine's staging sets of the largest device unit (unit 1): 12 B of state x 4000 (the parameters'
    # device home takes the new shard in place: ParamStore.device_out)
    staged = DeviceStaging.SETS * 12 * 4000
    assert dev.needs["device_step"]["device"] == staged and auto.needs["device_step"]["device"] == staged / 2
    assert dev.need["device"] - cpu.need["device"] == staged
    # every unit's state crosses the link each way: 12 B x 10000 params at 16e4 B/s, in and out
    assert dev.breakdown["optimizer_staging"] == pytest.approx(2 * 0.75)
    assert cpu.breakdown["optimizer_staging"] == 0
    # [Note: the new shard's way home]: written in place by a device step, copied back after a CPU update
    assert dev.breakdown["params_copyback"] == 0 and cpu.breakdown["params_copyback"] == pytest.approx(0.25)
    text = dev.summary()
    assert "optimizer step on (optimizer.step_on = device):" in text
    assert "device 4 units" in text and f"staged on the device {staged / 1024:.2f} KiB (in needed)" in text
    assert dev.to_dict()["optimizer_step_sides"]["device"]["params"] == 10000


@pytest.mark.pins("design#the-update-runs-where-the-plan-says-the-state-stays-home")
def test_auto_puts_every_unit_on_a_faster_device_rather_than_the_balanced_split(two_sets):
    """A device path 10x faster (in 0.075 s, kernel 0.1 s, out 0.075 s per 1e4 params): the greedy split
    (device, device, cpu, device). Its schedule: unit 0 in 0-0.015, kernel 0.015-0.035, out 0.035-0.05;
    unit 1 issued at once: in 0.015-0.045, kernel 0.045-0.085, out 0.085-0.115; unit 2's gradient
    0.015-0.0175, CPU 0.0175-0.1175, units 0 and 1 retired after it, its commit 0.1175-0.12; unit 3
    (unit 0's set) in 0.12-0.1425, kernel 0.1425-0.1725, out 0.1725-0.195 -> 0.195 s. Every unit on the
    device: unit 2 waits for unit 0's set (0.05), in 0.05-0.0575, kernel 0.085-0.095, out 0.115-0.1225;
    unit 3 for unit 1's (0.115): in 0.115-0.1375, kernel 0.1375-0.1675, out 0.1675-0.19 -> 0.19 s, no
    commit on the link. Every unit on the CPU: 1.0125 s. `auto` takes every unit on the device. (Every
    time after the global norm, `norm_s`.)"""
    rates = {**RATES, "h2d": 160e4, "d2h": 160e4, "device_adam": 280e4}
    costs = UpdateCosts.of(rates, 12, 4, 4, cuda=True, grads_on_device=True, params_on_device=True)
    assert choose("auto", (Location.HOST,) * 4, SHARDS, costs, True, STAGING).units == \
        ("device", "device", "cpu", "device")
    plans = {on: cuda_plan(on, rates=rates) for on in ("auto", "cpu", "device")}
    assert plans["auto"].optimizer_step_on == ("device",) * 4
    norm = norm_s(rates)
    assert plans["auto"].predicted_step_s == plans["device"].predicted_step_s == pytest.approx(0.19 + norm)
    assert plans["cpu"].predicted_step_s == pytest.approx(1.0125 + norm)


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


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_the_staging_term_sizes_each_ranks_shard_as_the_store_allocates_it(world_size):
    """[Note: the device step's staging memory] over several ranks (ZeRO-2, everything on the host, a CUDA
    node): each set holds the unit's state, its fp32 output and its fp32 gradient for this rank's shard,
    the partition's padded shard (Sizes.held_shard, as the engine's staging allocates it). Silently
    wrong before: the output and the gradient were sized by ceil(numel / N). Hand-computed for a unit of
    4,000 elements: padded to a multiple of 32 x N."""
    p = make_plan(ModelFacts.of_sizes([4000]),
                  PlanConfig(offload=OffloadConfig(params="host", gradients="host", optimizer="host"),
                             alignment=1, zero=ZeroConfig(stage=2), step=StepOptions(step_on="device")),
                  Node(torch.device("cuda"), budgets={"device": BIG, "host": BIG, "nvme": BIG}, rates=RATES,
                       world_size=world_size))
    held = -(-4000 // (32 * world_size)) * 32
    assert held != -(-4000 // world_size)  # where ceil(numel / N) and the store differ
    assert p.needs["device_step"]["device"] == DeviceStaging.SETS * (12 + 4 + 4) * held


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
    # schedule], two staging sets, LINKS_16: the greedy split is the same) runs the device's units beside
    # the CPU's: unit 0 in 0-0.15, kernel 0.15-0.35, out 0.35-0.5; unit 1's gradient 0-0.1, CPU 0.1-0.9
    # (unit 0 retired after it), its commit 0.9-1.0; unit 2's gradient 0.15-0.175, CPU 0.9-1.1, its
    # commit 1.1-1.125; unit 3 (issued at 1.1) in 1.125-1.35, kernel 1.35-1.65, out 1.65-1.875 -> 1.875 s;
    # every unit on the CPU 2.125 s (0.05 + 2.0 + its last commit 0.075), on the device 1.9 s; every
    # time after the global norm (norm_s)
    p, cpu, dev = (cuda_plan(on, rates={**LINKS_16, "cpu_adamw_fp32_fp32": 0.5e4}) for on in ("auto", "cpu", "device"))
    assert p.rate_sources["cpu_adamw_fp32_fp32"] == "given" and "cpu_adam" not in p.rate_sources
    assert p.optimizer_step_on == ("device", "cpu", "cpu", "device")
    norm = norm_s(LINKS_16)
    assert p.predicted_step_s == pytest.approx(1.875 + norm)
    assert cpu.predicted_step_s == pytest.approx(2.125 + norm) and dev.predicted_step_s == pytest.approx(1.9 + norm)


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


@pytest.mark.parametrize("world_size, stage, in_place", [(1, 0, True), (2, 0, True), (2, 2, False), (2, 3, True)])
def test_a_device_steps_new_shard_goes_home_in_place_or_by_the_commit(world_size, stage, in_place, monkeypatch):
    """[Note: the new shard's way home], predict as the engine runs it (ParamStore.device_out): with the
    parameters on the device and each home holding exactly the rank's shard (one rank, ZeRO-0, ZeRO-3)
    the device step writes it in place: only the 12 B of state go out, no commit; at ZeRO-1/2 over
    several ranks the 2 B shard goes out too and the commit brings it back (h2d), as after a CPU update."""
    import zerotier.planner.predict as predict_module
    from zerotier.planner.sizes import Sizes
    works = []
    monkeypatch.setattr(predict_module, "simulate", lambda w, shape: works.extend(w))
    s = Sizes(numels=(64_000,), lp_bytes=2, grad_bytes=4, lookahead=0, stage=stage, world_size=world_size,
              unit_order=(64_000,), unit_params=((64_000,),))
    placement = {"params": Location.DEVICE, "gradients": Location.DEVICE, "optimizer": Location.HOST}
    predict_module.predict(placement, s, "cuda", RATES, local_ranks=1, options=StepOptions(on_device=(True,)))
    (w,) = works
    n = s.held_shard(64_000, "optimizer")
    assert w.device_step and w.stage_in_s == pytest.approx(12 * n / RATES["h2d"])
    assert w.stage_out_s == pytest.approx((12 if in_place else 12 + 2) * n / RATES["d2h"])
    assert w.copyback_s == (0 if in_place else pytest.approx(2 * n / RATES["h2d"]))
