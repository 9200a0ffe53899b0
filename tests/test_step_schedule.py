"""[Note: the step schedule] pinned by hand: three units whose schedules are worked out on paper
below, so any change to what waits for what shows up as a different step time."""
import dataclasses

import pytest

from zerotier.planner.step_model import StepShape, UnitWork, simulate

# A: parameters on the device, gradients there, a CPU optimizer (gradient shards staged d2h),
# the new parameters copied back. forward 1, 2, 3 s; backward 2, 4, 6 s.
DEVICE_PARAMS = [UnitWork(forward_s=f, backward_s=b, adam_s=1, grad_stage_s=0.5, copyback_s=0.25)
                 for f, b in ((1, 2), (2, 4), (3, 6))]


def test_device_params_host_optimizer():
    # forward 0-6, backward (units 2, 1, 0) 6-18. Optimizer in unit order after backward:
    # d2h0 18-18.5, d2h1 18.5-19 (link busy), adam0 18.5-19.5, copy0 19.5-19.75,
    # adam1 19.5-20.5, d2h2 (one unit ahead: after adam0) 19.5-20, copy1 20.5-20.75,
    # adam2 20.5-21.5, copy2 21.5-21.75 -> 21.75 s (a serial sum is 23.25 s)
    s = simulate(DEVICE_PARAMS, StepShape())
    assert s.step_s == 21.75
    assert sum(s.critical.values()) == pytest.approx(21.75)
    assert s.critical["forward"] == 6 and s.critical["backward"] == 12 and s.critical["optimizer"] == 3
    assert s.seconds["grads_d2h"] == 1.5 and s.critical["grads_d2h"] == 0.5  # two of three copies hidden


def test_device_params_host_optimizer_clipped():
    # the global norm (1 s on compute) after backward 18-19 gates the optimizer:
    # d2h0 19-19.5, d2h1 19.5-20, adam0 19.5-20.5, d2h2 20.5-21, adam1 20.5-21.5, adam2 21.5-22.5,
    # copy2 22.5-22.75
    s = simulate(DEVICE_PARAMS, StepShape(clip=True, norm_s=1.0))
    assert s.step_s == 22.75 and s.critical["grad_norm"] == 1.0


def test_device_params_host_optimizer_accumulation_2():
    # two passes of 18 s, then the same 3.75 s of optimizer: 39.75 s
    s = simulate(DEVICE_PARAMS, StepShape(accum_steps=2))
    assert s.step_s == 39.75 and s.critical["forward"] == 12 and s.critical["backward"] == 24


# B: parameters streamed from host (1 s per fetch, lookahead 1), optimizer state on NVMe
# (read 2 s, write 2 s per unit, 3 staging sets), Adam 1 s. forward 1 s, backward 2 s each.
STREAMED = [UnitWork(forward_s=1, backward_s=2, adam_s=1, fetch_h2d_s=1, state_read_s=2, state_write_s=2)
            for _ in range(3)]
B = dict(lookahead=1, state_on_nvme=True, streamed=True)


def test_streamed_params_nvme_optimizer():
    # fetch0 0-1 (demand) and fetch1 1-2 (prefetched at the same demand); fwd0 1-2; fetch2 2-3
    # (issued at unit 1's demand); fwd1 2-3; fwd2 3-4. Backward 2, 1, 0: unit 2 was in use, so its
    # fetch is a demand 4-5, unit 1's prefetch 5-6; bwd2 5-7; fetch0 7-8; bwd1 7-9; bwd0 9-11.
    # State reads start as gradients are final: read2 7-9, read1 9-11, read0 11-13 (3 sets free);
    # adam2 11-12, adam1 12-13, adam0 13-14; writes queue behind read0: 13-15, 15-17, 17-19.
    s = simulate(STREAMED, StepShape(**B))
    assert s.step_s == 19.0
    assert s.critical["optimizer_nvme"] == 8.0  # the drive after backward: read0 and three writes
    assert sum(s.critical.values()) == pytest.approx(19.0)


def test_streamed_params_nvme_optimizer_early_step():
    # early step: each unit is its own step([unit]) on the optimizer thread, reading its state
    # when taken up (no read-ahead): read2 7-9, adam2 9-10, write2 10-12; read1 (after adam2)
    # 12-14, adam1 14-15, write1 15-17; read0 17-19, adam0 19-20, write0 20-22 -> 22 s: slower
    # than without it here (the drive serializes every unit behind the previous write)
    s = simulate(STREAMED, StepShape(early_step=True, **B))
    assert s.step_s == 22.0


def test_streamed_params_nvme_optimizer_clipped():
    # the norm (3 s) 11-14 gates Adam, not the reads: adam2 14-15, write2 15-17, adam1 15-16,
    # write1 17-19, adam0 16-17, write0 19-21
    s = simulate(STREAMED, StepShape(clip=True, norm_s=3.0, **B))
    assert s.step_s == 21.0
    assert simulate(STREAMED, StepShape(clip=True, early_step=True, norm_s=3.0, **B)).step_s == 21.0  # no early step


def test_streamed_params_nvme_optimizer_accumulation_2():
    # the second pass starts at 11: fetch0 11-12, fetch1 12-13, fwd 12-15, fetch (demand) 15-16,
    # prefetch 16-17, bwd2 16-18, fetch0 18-19, bwd1 18-20, bwd0 20-22; reads 18-20, 20-22, 22-24;
    # adam 22-23, 23-24, 24-25; writes 24-26, 26-28, 28-30 -> 30 s
    s = simulate(STREAMED, StepShape(accum_steps=2, **B))
    assert s.step_s == 30.0


def test_write_backs_in_flight_carry_into_the_next_step():
    # parameters on NVMe: each unit's write-back (3 s) is left in flight when step() returns; the
    # next step's fetch of that unit waits for it. One unit, fwd 1, bwd 1, adam 1, read 1:
    # step 1 ends at 5 (fetch 0-1, fwd 1-2, fetch 2-3, bwd 3-4, adam 4-5), its write 5-8; step 2's
    # fetch waits for the write: 8-9, fwd 9-10, fetch 10-11, bwd 11-12, adam 12-13 -> 8 s
    unit = [UnitWork(forward_s=1, backward_s=1, adam_s=1, fetch_nvme_s=1, copyback_s=3, copyback_on="nvme")]
    s = simulate(unit, StepShape(lookahead=0, streamed=True))
    assert s.step_s == 8.0 and s.critical["params_copyback"] == 3.0


# [Note: speculation in the schedule]: A with clipping (norm 1 s), every unit speculated, each
# host unit's undo copy and restore 0.5 s on the optimizer thread.
SPECULATED = [dataclasses.replace(u, speculate=True, undo_s=0.5, restore_s=0.5) for u in DEVICE_PARAMS]
SPEC = dict(clip=True, norm_s=1.0, speculative=True)


def test_speculation_commit_updates_under_backward_like_an_early_step():
    # backward 6-18: bwd2 6-12, bwd1 12-16, bwd0 16-18. As each gradient is final: d2h2 12-12.5,
    # undo2 12.5-13, adam2 13-14, copy2 14-14.25; d2h1 16-16.5, undo1 16.5-17, adam1 17-18, copy1
    # 18-18.25; d2h0 18-18.5, undo0 18.5-19, adam0 19-20, copy0 20-20.25; the norm 18-19 on compute
    # -> 20.25 s (22.75 s without speculation: test_device_params_host_optimizer_clipped)
    s = simulate(SPECULATED, StepShape(**SPEC))
    assert s.step_s == 20.25
    assert s.critical["speculation"] == 1.0 and s.critical["optimizer"] == 2.0  # undo0 + undo1 / adam1 + adam0
    assert sum(s.critical.values()) == pytest.approx(20.25)


def test_speculation_rollback_redoes_every_unit_after_the_norm():
    # the speculative work as above ends at 20.25 (copy0), then in unit order after it: d2h0
    # 20.25-20.75, restore0 20.75-21.25, adam0 21.25-22.25, copy0 22.25-22.5; d2h1 20.75-21.25,
    # restore1 22.25-22.75, adam1 22.75-23.75, copy1 23.75-24; d2h2 (after adam0) 22.25-22.75,
    # restore2 23.75-24.25, adam2 24.25-25.25, copy2 25.25-25.5 -> 25.5 s
    s = simulate(SPECULATED, StepShape(rollback=True, **SPEC))
    assert s.step_s == 25.5
    assert s.seconds["optimizer"] == 6.0 and s.seconds["speculation"] == 3.0  # each Adam twice, undo + restore
    assert sum(s.critical.values()) == pytest.approx(25.5)


def test_speculation_of_the_units_within_the_allowance_only():
    # only unit 2 speculated (its undo copy fits, the others' do not): undo2 12.5-13, adam2 13-14,
    # copy2 14-14.25; units 0, 1 after the norm (18-19): d2h0 19-19.5, adam0 19.5-20.5, copy0
    # 20.5-20.75; d2h1 19.5-20, adam1 20.5-21.5, copy1 21.5-21.75 -> 21.75 s
    units = DEVICE_PARAMS[:2] + SPECULATED[2:]
    assert simulate(units, StepShape(**SPEC)).step_s == 21.75
    assert simulate(SPECULATED, StepShape(clip=True, norm_s=1.0)).step_s == 22.75  # off: the flags are ignored


def test_speculation_with_nvme_state_commit_and_rollback():
    # B, clipped (norm 3 s, 11-14), every unit speculated: the early step's schedule, 22 s
    # (test_streamed_params_nvme_optimizer_early_step), the norm hidden under it. Rollback: the
    # speculative writes end at 22; the pre-step files are read again: read0 22-24, read1 24-26,
    # read2 26-28 (three sets free), adam0 24-25, adam1 26-27, adam2 28-29; writes queue behind
    # the reads: 28-30, 30-32, 32-34 -> 34 s
    units = [dataclasses.replace(u, speculate=True) for u in STREAMED]
    shape = StepShape(clip=True, norm_s=3.0, speculative=True, **B)
    assert simulate(units, shape).step_s == 22.0
    s = simulate(units, dataclasses.replace(shape, rollback=True))
    assert s.step_s == 34.0 and s.seconds["optimizer_nvme"] == 24.0  # state read and written twice


# C: a CPU device ([Note: a CPU device's copies take its cores]): forward 1 s, backward 2 s, the
# gradient's copy into its host accumulator 0.5 s, Adam 1 s on the same cores.
CPU_DEVICE = [UnitWork(forward_s=1, backward_s=2, grad_d2h_s=0.5, adam_s=1, adam_on="compute") for _ in range(2)]


def test_a_cpu_devices_gradient_copies_take_the_compute_cores():
    # as a DMA link: fwd 0-2, bwd1 2-4 (its copy 4-4.5 beside), bwd0 4-6, copy0 6-6.5, adam0 6.5-7.5,
    # adam1 7.5-8.5 -> 8.5 s, one copy hidden
    link = simulate(CPU_DEVICE, StepShape())
    assert link.step_s == 8.5 and link.critical["grads_d2h"] == 0.5
    # on the cores (the copy runs in the backward hook): bwd1 2-4, copy1 4-4.5, bwd0 4.5-6.5,
    # copy0 6.5-7, adam0 7-8, adam1 8-9 -> 9 s, both copies on the critical path
    cores = simulate(CPU_DEVICE, StepShape(cpu_device=True))
    assert cores.step_s == 9.0 and cores.critical["grads_d2h"] == 1.0
    assert sum(cores.critical.values()) == pytest.approx(9.0)


def test_a_cpu_device_plan_puts_its_copies_on_the_critical_path():
    import torch

    from zerotier.config import OffloadConfig
    from zerotier.planner.inputs import ModelFacts, Node, PlanConfig
    from zerotier.planner.planner import make_plan
    from zerotier.planner.predict import UnitCompute

    compute = UnitCompute((0.1, 0.1), (0.2, 0.2), (False, False))
    rates = {"mem_copy": 1e8, "cpu_adam": 1e9}
    plan = make_plan(ModelFacts.of_sizes([1_000_000, 1_000_000], compute=compute),
                     PlanConfig(offload=OffloadConfig(params="host", gradients="host", optimizer="host")),
                     Node(torch.device("cpu"), budgets={"device": 10**12, "host": 10**12, "nvme": 0}, rates=rates))
    # 4 MB of fp32 gradient per unit at 100 MB/s: 0.04 s each, in the backward hook
    assert plan.breakdown["grads_d2h"] == pytest.approx(0.08)
    assert plan.critical["grads_d2h"] == pytest.approx(0.08)
    # host parameters fetched per use (forward and backward) by a copy on the same cores: none hidden
    assert plan.breakdown["params_h2d"] == pytest.approx(4 * 0.04)
    assert plan.critical["params_h2d"] == pytest.approx(4 * 0.04)


# D: [Note: the device step in the schedule]: unit 0 updated on the CPU (2 s), unit 1 on the device
# (staged in 0.5 s, kernel 1 s, staged out 1 s); forward 1 s, backward 2 s each.
SPLIT = [UnitWork(forward_s=1, backward_s=2, adam_s=2),
         UnitWork(forward_s=1, backward_s=2, adam_s=1, adam_on="compute", device_step=True, stage_in_s=0.5,
                  stage_out_s=1)]


@pytest.mark.pins("design#the-update-runs-where-the-plan-says-the-state-stays-home")
def test_a_device_step_runs_after_the_cpus_on_the_optimizer_thread():
    # fwd 0-2, bwd1 2-4, bwd0 4-6. After backward: adam0 on the optimizer thread 6-8; unit 1 in its
    # turn, the thread waiting for its staging out (the engine's one staging set): in 8-8.5 (h2d),
    # kernel 8.5-9.5 (compute), out 9.5-10.5 (d2h) -> 10.5 s (both on the CPU: 10 s)
    s = simulate(SPLIT, StepShape())
    assert s.step_s == 10.5
    assert s.critical["optimizer_staging"] == 1.5 and s.critical["optimizer"] == 2.0 + 1.0
    assert sum(s.critical.values()) == pytest.approx(10.5)
    # unit 1 first in the thread's order: unit 0's CPU update waits for unit 1's staging out
    flipped = simulate(SPLIT[::-1], StepShape())
    assert flipped.step_s == 10.5
    both_cpu = [SPLIT[0], dataclasses.replace(SPLIT[0])]
    assert simulate(both_cpu, StepShape()).step_s == 10.0
