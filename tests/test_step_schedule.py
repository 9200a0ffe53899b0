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
    # State reads start as gradients are final, each unit taking a whole set: read2 7-9 and, at
    # that first final, unit 0's (final last in the previous window: [Note: the last final unit's
    # read]) 9-11, read1 11-13 (3 sets); step() in issue order: adam2 11-12, adam0 12-13, adam1
    # 13-14; writes queue behind read1: 13-15, 15-17, 17-19. The drive is busy from 7 to 19.
    s = simulate(STREAMED, StepShape(**B))
    assert s.step_s == 19.0
    assert s.critical["optimizer_nvme"] == 12.0  # the drive 7-19: three reads and three writes
    assert sum(s.critical.values()) == pytest.approx(19.0)


def test_streamed_params_nvme_optimizer_early_step():
    # early step: each unit is its own step([unit]) on the optimizer thread, reading its state
    # when taken up (no read-ahead): read2 7-9, adam2 9-10, write2 10-12; read1 (after adam2)
    # 12-14, adam1 14-15, write1 15-17; read0 17-19, adam0 19-20, write0 20-22 -> 22 s: slower
    # than without it here (the drive serializes every unit behind the previous write)
    s = simulate(STREAMED, StepShape(early_step=True, **B))
    assert s.step_s == 22.0


def test_streamed_params_nvme_optimizer_clipped():
    # the norm (3 s) 11-14 gates Adam, not the reads (read2 7-9, read0 9-11, read1 11-13): adam2
    # 14-15, write2 15-17, adam0 15-16, write0 17-19, adam1 16-17, write1 19-21
    s = simulate(STREAMED, StepShape(clip=True, norm_s=3.0, **B))
    assert s.step_s == 21.0
    assert simulate(STREAMED, StepShape(clip=True, early_step=True, norm_s=3.0, **B)).step_s == 21.0  # no early step


def test_streamed_params_nvme_optimizer_accumulation_2():
    # the second pass starts at 11: fetch0 11-12, fetch1 12-13, fwd 12-15, fetch (demand) 15-16,
    # prefetch 16-17, bwd2 16-18, fetch0 18-19, bwd1 18-20, bwd0 20-22; reads (2, then 0 at unit
    # 2's final, then 1) 18-20, 20-22, 22-24; adam 22-23, 23-24, 24-25; writes 24-26, 26-28, 28-30
    # -> 30 s
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
    # 18-18.25; d2h0 18-18.5, undo0 18.5-19, adam0 19-20, copy0 20-20.25; the norm after the speculated
    # updates (the policy's wait() before it) 20-21 on compute -> 21 s (22.75 s without speculation:
    # test_device_params_host_optimizer_clipped)
    s = simulate(SPECULATED, StepShape(**SPEC))
    assert s.step_s == 21.0
    assert s.critical["speculation"] == 1.0 and s.critical["optimizer"] == 2.0  # undo0 + undo1 / adam1 + adam0
    assert s.critical["grad_norm"] == 1.0 and sum(s.critical.values()) == pytest.approx(21.0)


def test_speculation_rollback_redoes_every_unit_after_the_norm():
    # the speculative work as above, the norm after it 20-21, then in unit order after the norm: d2h0
    # 21-21.5, restore0 21.5-22, adam0 22-23, copy0 23-23.25; d2h1 21.5-22, restore1 23-23.5, adam1
    # 23.5-24.5, copy1 24.5-24.75; d2h2 (after adam0) 23-23.5, restore2 24.5-25, adam2 25-26, copy2
    # 26-26.25 -> 26.25 s
    s = simulate(SPECULATED, StepShape(rollback=True, **SPEC))
    assert s.step_s == 26.25
    assert s.seconds["optimizer"] == 6.0 and s.seconds["speculation"] == 3.0  # each Adam twice, undo + restore
    assert sum(s.critical.values()) == pytest.approx(26.25)


def test_speculation_of_the_units_within_the_allowance_only():
    # only unit 2 speculated (its undo copy fits, the others' do not): undo2 12.5-13, adam2 13-14,
    # copy2 14-14.25; units 0, 1 after the norm (18-19): d2h0 19-19.5, adam0 19.5-20.5, copy0
    # 20.5-20.75; d2h1 19.5-20, adam1 20.5-21.5, copy1 21.5-21.75 -> 21.75 s
    units = DEVICE_PARAMS[:2] + SPECULATED[2:]
    assert simulate(units, StepShape(**SPEC)).step_s == 21.75
    assert simulate(SPECULATED, StepShape(clip=True, norm_s=1.0)).step_s == 22.75  # off: the flags are ignored


def test_speculation_with_nvme_state_commit_and_rollback():
    # B, clipped (norm 3 s, 11-14), every unit speculated. The optimizer thread takes unit 2 up at
    # its final (7): prefetch(2) and, the window's first, unit 0's read (final last in the previous
    # window, 7a33d74): read2 7-9, read0 9-11; adam2 9-10, write2 11-13; unit 1 (final 9) taken up
    # at 10, a set free: read1 13-15 (behind write2, issued first), adam1 15-16, write1 16-18;
    # unit 0 (final 11): its state was read, adam0 16-17, write0 18-20; the norm after the speculated
    # updates and their writes (the policy's wait()) 20-23 -> 23 s (25 s with unit 0 read when taken
    # up, as test_streamed_params_nvme_optimizer_early_step).
    # Rollback: the norm ends at 23; the pre-step files are read again, in unit order, one ahead:
    # read0 and read1 issued at 23 (23-25, 25-27), adam0 25-26, write0 27-29; at 26 read2 (a set
    # free) 29-31; adam1 27-28, write1 31-33; adam2 31-32, write2 33-35 -> 35 s
    units = [dataclasses.replace(u, speculate=True) for u in STREAMED]
    shape = StepShape(clip=True, norm_s=3.0, speculative=True, **B)
    assert simulate(units, shape).step_s == 23.0
    s = simulate(units, dataclasses.replace(shape, rollback=True))
    assert s.step_s == 35.0 and s.seconds["optimizer_nvme"] == 24.0  # state read and written twice


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


# D: [Note: the device step in the schedule]: units 0 and 2 updated on the device (staged in 1 s,
# kernel 1 s, staged out 1 s), units 1 and 3 on the CPU (2 s); forward 1 s, backward 1 s each.
DEVICE = dict(adam_s=1, adam_on="compute", device_step=True, stage_in_s=1, stage_out_s=1)
SPLIT = [UnitWork(forward_s=1, backward_s=1, **(DEVICE if i % 2 == 0 else dict(adam_s=2))) for i in range(4)]


@pytest.mark.pins("design#the-update-runs-where-the-plan-says-the-state-stays-home")
def test_device_units_run_beside_the_cpus_on_a_cuda_device():
    # forward 0-4, backward 4-8. The thread issues unit 0 at 8 and goes on: in 8-9 (h2d), kernel 9-10
    # (compute), out 10-11 (d2h). Unit 1 on the CPU 8-10; the thread looks at unit 0 after it: not out
    # yet (11). Unit 2 issued at 10 (one set in use of two): in 10-11, kernel 11-12, out 12-13. Unit 3
    # on the CPU 10-12; after it unit 0 (out at 11) is retired at 12, unit 2 (13) not. The step's end
    # retires unit 2 at 13 -> 13 s. On the critical path: the CPU's unit 1, then unit 2's three stages.
    s = simulate(SPLIT, StepShape())
    assert s.step_s == 13.0
    assert s.critical == {"forward": 4.0, "backward": 4.0, "optimizer": 2.0 + 1.0, "optimizer_staging": 2.0}
    assert s.busy["cpu"] == 4.0 and s.busy["h2d"] == 2.0 and s.busy["d2h"] == 2.0
    # every unit on the CPU: 8 + 4 x 2 = 16 s
    assert simulate([UnitWork(forward_s=1, backward_s=1, adam_s=2)] * 4, StepShape()).step_s == 16.0


def test_on_a_cpu_device_the_thread_waits_for_each_device_unit():
    # StepShape.cpu_device: the "device" kernel and copies run on the thread's cores (compute), so the
    # thread waits for each device unit's staging out: unit 0 8-11, unit 1 11-13, unit 2 13-16, unit 3
    # 16-18 -> 18 s, serial as before the engine issued device units without waiting
    s = simulate(SPLIT, StepShape(cpu_device=True))
    assert s.step_s == 18.0
    assert s.critical["optimizer_staging"] == 4.0 and s.critical["optimizer"] == 2 + 2 + 2
    # an early step (each unit its own step([unit]) as its gradient is final) waits for each too, on a
    # CUDA device: finals 3 at 5, 2 at 6, 1 at 7, 0 at 8; unit 3 (CPU) 5-7, unit 2 7-10 (in 7-8, kernel
    # 8-9, out 9-10), unit 1 10-12, unit 0 12-15 -> 15 s (beside the thread it would end at 14)
    assert simulate(SPLIT, StepShape(early_step=True)).step_s == 15.0


def test_the_staging_sets_bound_the_device_units_in_flight():
    # three device units (in 1 s, kernel 1 s, out 1 s), forward 0-3, backward 3-6. Two sets: unit 0
    # in 6-7, kernel 7-8, out 8-9; unit 1 issued at 6 too, in 7-8 (the link), kernel 8-9, out 9-10;
    # unit 2 needs unit 0's set: the thread waits for unit 0's staging out (9), then in 9-10, kernel
    # 10-11, out 11-12 -> 12 s. Three sets: unit 2 in 8-9, kernel 9-10, out 10-11 -> 11 s. One set:
    # each unit after the last one's staging out, 6-9, 9-12, 12-15 -> 15 s.
    units = [UnitWork(forward_s=1, backward_s=1, **DEVICE) for _ in range(3)]
    assert simulate(units, StepShape(device_sets=2)).step_s == 12.0
    assert simulate(units, StepShape(device_sets=3)).step_s == 11.0
    assert simulate(units, StepShape(device_sets=1)).step_s == 15.0


def test_a_cpu_units_commit_waits_for_the_device_unit_before_it():
    # unit 0 on the device (in 1 s, kernel 1 s, out 2 s), unit 1 on the CPU (1 s), each with a 0.5 s
    # copy of its new parameters home (h2d). Forward 0-2, backward 2-4. Unit 0 in 4-5, kernel 5-6, out
    # 6-8; unit 1 on the CPU 4-5, but its commit is held until unit 0 is retired (the step's end, 8):
    # unit 0's commit 8-8.5 first (unit order), then unit 1's 8.5-9 -> 9 s (8.5 s if it went at 5)
    units = [UnitWork(forward_s=1, backward_s=1, copyback_s=0.5, **{**DEVICE, "stage_out_s": 2}),
             UnitWork(forward_s=1, backward_s=1, adam_s=1, copyback_s=0.5)]
    s = simulate(units, StepShape())
    assert s.step_s == 9.0 and s.critical["params_copyback"] == 1.0
    # in the other order nothing is held: unit 0 (CPU) 4-5, its commit 5-5.5 takes the link first, so
    # unit 1 (issued at 5) stages in 5.5-6.5, kernel 6.5-7.5, out 7.5-9.5; its commit after its
    # retirement 9.5-10 -> 10 s
    flipped = [dataclasses.replace(units[1]), dataclasses.replace(units[0])]
    assert simulate(flipped, StepShape()).step_s == 10.0


# D: [Note: the pipeline in the schedule]: one large unit (unit 0, final last: a model's root) and six
# small ones, optimizer state on NVMe, 3 staging sets each the large unit's 4 MiB. forward 1 s,
# backward 4 s, Adam 1 s each; the large unit's state read and write 4 s, a small one's 1 s.
MiB = 1 << 20
PACKED = [UnitWork(forward_s=1, backward_s=4, adam_s=1, state_read_s=4 if i == 0 else 1,
                   state_write_s=4 if i == 0 else 1, state_bytes=((4 if i == 0 else 1) * MiB,))
          for i in range(7)]


def test_packed_staging_sets_read_every_unit_under_backward():
    # forward 0-7; backward 6..0, 4 s each: unit k's gradient final at 11 + 4 (6 - k). Unit 6 takes
    # set A (1 of 4 MiB), and at that first final unit 0 (final last in the previous window) an
    # empty set B (4 of 4); 5, 4, 3 fit in A, 2 and 1 in C. Drive: read6 11-12, read0 12-16, read5
    # 16-17, read4 19-20, read3 23-24, read2 27-28, read1 31-32: every read under backward (7-35).
    # step() in issue order 6, 0, 5, 4, 3, 2, 1: Adam 35-42, writes w6 36-37, w0 37-41, w5 41-42,
    # w4 42-43, w3 43-44, w2 44-45, w1 45-46 -> 46 s; on its critical path the drive only from w0
    s = simulate(PACKED, StepShape(state_on_nvme=True))
    assert s.step_s == 46.0
    assert s.critical == {"forward": 7.0, "backward": 28.0, "optimizer": 2.0, "optimizer_nvme": 9.0}
    # the same with the norm (0.5 s, 35-35.5) before the update: every read was issued, so only
    # the update and the writes are after it: 46.5 s
    assert simulate(PACKED, StepShape(state_on_nvme=True, clip=True, norm_s=0.5)).step_s == 46.5


def test_whole_staging_sets_leave_reads_for_step():
    # D's units without their bytes take a whole set each (the pipeline before packing): under
    # backward only read6 11-12, read0 12-16 (its hint) and read5 16-17; 1, 2, 3, 4 find no room.
    # step() in order 6, 0, 5, then 1, 2, 3, 4 (unit order), each read one ahead waiting for the
    # oldest write: adam6 35-36, w6 36-37; adam0 36-37, w0 37-41; at 37 read1 waits w6 (37): drive
    # 41-42; adam5 37-38, w5 42-43; at 38 read2 waits w0 (41): 43-44; adam1 42-43, w1 44-45; at 43
    # read3 waits w5 (43): 45-46; adam2 44-45, w2 46-47; at 45 read4 waits w1 (45): 47-48; adam3
    # 46-47, w3 48-49; adam4 48-49, w4 49-50 -> 50 s: 4 s more than packed
    whole = [dataclasses.replace(u, state_bytes=()) for u in PACKED]
    assert simulate(whole, StepShape(state_on_nvme=True)).step_s == 50.0


def test_a_read_without_room_holds_the_optimizer_thread():
    # three units (whole sets, 2 of them), read and write 1 s, Adam 2 s; forward 0-3, backward
    # 3-6 (finals: 2 at 4, 1 at 5, 0 at 6). Under backward read2 4-5 and, its hint, read0 5-6;
    # unit 1 finds no room. step() (order 2, 0, 1): adam2 6-8, w2 8-9; before unit 0 the thread
    # reads one ahead, unit 1: no room, so it waits for the oldest write, w2 (9): read1 9-10 and
    # adam0 9-11 (not 8-10), w0 11-12; adam1 11-13, w1 13-14 -> 14 s (13 s if the thread went on)
    units = [UnitWork(forward_s=1, backward_s=1, adam_s=2, state_read_s=1, state_write_s=1) for _ in range(3)]
    assert simulate(units, StepShape(state_on_nvme=True, pipeline_depth=2)).step_s == 14.0


def test_a_blocking_read_retires_the_device_units_first():
    # optimizer state on NVMe, one staging set (read 1 s, write 1 s); unit 0 on the CPU (1 s), unit 1
    # on the device. Forward 0-2, backward 2-4: unit 1 final at 3, its read 3-4 takes the set (unit
    # 0, final at 4, finds no room). step() takes unit 1 first (read first): issued at 4, in 4-5,
    # kernel 5-6, out 6-7. Unit 0's read needs a set: the thread first retires unit 1 (its staging
    # out, 7), whose write-back 7-8 gives the set back; unit 0 read 8-9, CPU 9-10, write 10-11 -> 11 s
    units = [UnitWork(forward_s=1, backward_s=1, adam_s=1, state_read_s=1, state_write_s=1),
             UnitWork(forward_s=1, backward_s=1, state_read_s=1, state_write_s=1, **DEVICE)]
    s = simulate(units, StepShape(state_on_nvme=True, pipeline_depth=1))
    assert s.step_s == 11.0
    # on the critical path: write1, read0, write0 (unit 1's read ends with backward, at 4: the walk takes
    # backward through the global norm, 0 s here), the staging in and out
    assert s.critical["optimizer_nvme"] == 1.0 + 1.0 + 1.0 and s.critical["optimizer_staging"] == 2.0


def test_the_thread_retires_a_device_unit_after_the_first_cpu_update_it_outlasts():
    # unit 0 on the device (in 1 s, kernel 1 s, out 1 s), units 1-3 on the CPU (2 s each), unit 1 with
    # a 3 s commit. Forward 0-4, backward 4-8. Unit 0 in 8-9, kernel 9-10, out 10-11; units 1-3 on the
    # CPU 8-10, 10-12, 12-14. The thread looks after each: at 10 unit 0 is not out yet, at 12 it is:
    # retired at 12, so unit 1's held commit runs 12-15 -> 15 s (retired the moment it was out, 11:
    # 14 s; only at the step's end, 14: 17 s)
    units = [UnitWork(forward_s=1, backward_s=1, **DEVICE),
             UnitWork(forward_s=1, backward_s=1, adam_s=2, copyback_s=3),
             UnitWork(forward_s=1, backward_s=1, adam_s=2),
             UnitWork(forward_s=1, backward_s=1, adam_s=2)]
    assert simulate(units, StepShape()).step_s == 15.0


def test_a_speculated_device_units_undo_copy_is_the_threads_host_copy():
    # speculation: unit 1 (final first, at 3) updated on the device under backward (its own step([unit]):
    # the thread waits for it), after its undo copy (2 s) of its host state, which the optimizer thread
    # makes (cpu), beside unit 0's backward (3-4): undo 3-5, in 5-6, kernel 6-7, out 7-8. Unit 0 (CPU,
    # not speculated) after backward and the speculated work: 8-9 -> 9 s (10 s if the copy took compute)
    units = [UnitWork(forward_s=1, backward_s=1, adam_s=1),
             UnitWork(forward_s=1, backward_s=1, speculate=True, undo_s=2, restore_s=2, **DEVICE)]
    s = simulate(units, StepShape(speculative=True))
    assert s.step_s == 9.0 and s.busy["cpu"] == 2.0 + 1.0


def test_over_several_ranks_no_state_read_starts_under_backward():
    # B's units with `unit_final` off (Sharding.active: no policy sees a unit final during backward, so
    # prefetch() never runs): backward ends at 11 as in B, then step() reads in unit order, one ahead:
    # read0 11-13, read1 13-15; adam0 13-14, its write (issued at 14, before unit 1's read ahead of
    # unit 2) 15-17, read2 17-19; adam1 15-16, write1 19-21; adam2 19-20, write2 21-23 -> 23 s (19 s
    # with B's reads under backward)
    assert simulate(STREAMED, StepShape(**B, unit_final=False)).step_s == 23.0
    # nor does an early step run: the same 23 s
    assert simulate(STREAMED, StepShape(**B, unit_final=False, early_step=True)).step_s == 23.0


def test_a_retired_device_units_commit_goes_before_the_cpu_commits_it_held():
    # one staging set, no parameter write-back left in flight (param_writes=0: before each unit the
    # thread waits for the newest); NVMe parameter homes. Unit 0 on the device (in 1 s, kernel 1 s, out
    # 1 s, its write-back 1 s), unit 1 on the CPU (1 s, write-back 2 s), unit 2 on the device. Forward
    # 0-3, backward 3-6. Unit 0 in 6-7, kernel 7-8, out 8-9; unit 1 on the CPU 6-7, its commit held.
    # Unit 2 needs the set: the thread retires unit 0 at 9; the write-backs go in unit order, unit 0's
    # 9-10, then unit 1's 10-12, the newest, which unit 2 waits for: in 12-13, kernel 13-14, out 14-15
    # -> 15 s (13 s if unit 1's had gone first and unit 2 waited for unit 0's)
    nvme = dict(copyback_on="nvme")
    units = [UnitWork(forward_s=1, backward_s=1, copyback_s=1, **nvme, **DEVICE),
             UnitWork(forward_s=1, backward_s=1, adam_s=1, copyback_s=2, **nvme),
             UnitWork(forward_s=1, backward_s=1, **DEVICE)]
    assert simulate(units, StepShape(device_sets=1, param_writes=0)).step_s == 15.0


def test_the_global_norm_runs_every_window_clipping_or_not():
    # engine.step() computes the global norm every window (engine/window.py: the clip factor, the
    # overflow check, engine.grad_norm()), after the updates started during backward (the policy's
    # wait()). One unit, forward 0-1, backward 1-2, norm 2 s, Adam 1 s on the CPU:
    #   no clipping: the norm 2-4, then Adam 4-5 -> 5 s (3 s if the norm ran only with clipping)
    #   early step: Adam as the gradient is final, 2-3; the norm after it 3-5 -> 5 s
    unit = [UnitWork(forward_s=1, backward_s=1, adam_s=1)]
    s = simulate(unit, StepShape(norm_s=2.0, norm_on="compute"))
    assert s.step_s == 5.0 and s.critical["grad_norm"] == 2.0
    early = simulate(unit, StepShape(norm_s=2.0, norm_on="compute", early_step=True))
    assert early.step_s == 5.0 and early.critical["optimizer"] == 1.0 and early.critical["grad_norm"] == 2.0


def test_the_drive_takes_a_share_of_the_cores():
    """[Note: the drive's share of the cores]: an NVMe task of s seconds brings io_share x s seconds on
    the cores (compute on a CPU device), ready at the transfer's end; work that becomes ready while it
    runs waits behind it. A read 0-2 s, compute A 0-3 s (ready at once), compute B after the read:
    without the share B runs 3-4; with 0.5 the read's 1 s on the cores runs 3-4 and B 4-5."""
    from zerotier.planner.task_graph import TaskGraph

    for share, b_start in ((0.0, 3.0), (0.5, 4.0)):
        g = TaskGraph(cpu_device=True, io_share=share)
        read = g.add("optimizer_nvme", "nvme", 2.0)
        g.add("forward", "compute", 3.0)
        b = g.add("backward", "compute", 1.0, (read,))
        start, end, _ = g.run()
        assert start[b] == b_start and max(end) == b_start + 1.0


def test_the_drives_share_is_absorbed_where_the_cores_wait_for_it():
    """The streamed case of B on a CUDA device is drive-bound (the drive busy 7-19 s): the share of its
    12 s (6 s at 0.5) lands on the CPU Adam's cores between its updates and the step stays 19 s; on a
    CPU device, where compute and the updates share those cores, the step grows by 2 s (22 -> 24)."""
    for cpu_device, before, after in ((False, 19.0, 19.0), (True, 22.0, 24.0)):
        plain = simulate(STREAMED, StepShape(**B, cpu_device=cpu_device))
        shared = simulate(STREAMED, StepShape(**B, cpu_device=cpu_device, io_share=0.5))
        assert (plain.step_s, shared.step_s) == (before, after)
        assert shared.seconds["nvme_cpu"] == 6.0 and "nvme_cpu" not in plain.seconds
        assert sum(shared.critical.values()) == pytest.approx(after)


# E: [Note: the root's backward comes in two parts]: a root (forward 1, backward 4 of which the
# embeddings' tail 2; state read 2, write 1) and two blocks (forward 1, backward 1; read 1, write 1),
# Adam 0.5 each, optimizer state on NVMe (3 staging sets, one unit each).
def _root_and_blocks(tail: float) -> list[UnitWork]:
    root = UnitWork(forward_s=1, backward_s=4, backward_tail_s=tail, encloses=True, adam_s=0.5, state_read_s=2,
                    state_write_s=1)
    block = UnitWork(forward_s=1, backward_s=1, adam_s=0.5, state_read_s=1, state_write_s=1)
    return [root, block, block]


def test_the_roots_backward_tail_runs_after_the_blocks():
    # forward 0-3; the root's head 3-5, block 2 5-6 (final: its read 6-7, and at the window's first final
    # the root's, final last before: 7-9), block 1 6-7 (read 9-10), the root's tail 7-9, backward's end.
    # step(): units in read order: adam2 9-9.5, write2 10-11; adam0 9.5-10, write0 11-12; adam1 10-10.5,
    # write1 12-13 -> 13 s.
    # Without the tail the root's 4 s come first (3-7): block 2 7-8 (read 8-9, the root's 9-11), block 1 8-9
    # (read 11-12); adam2 9-9.5, adam0 11-11.5, adam1 12-12.5; writes 12-13, 13-14, 14-15 -> 15 s.
    split = simulate(_root_and_blocks(2), StepShape(state_on_nvme=True))
    assert split.step_s == 13.0 and split.critical["backward"] == 3.0
    assert simulate(_root_and_blocks(0), StepShape(state_on_nvme=True)).step_s == 15.0
