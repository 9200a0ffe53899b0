"""Which process group and backend run a collective ([Note: which group runs a collective]).

GPU review N9: a group made by the user (or accelerate) as NCCL-only has no CPU backend, and
every host-tensor collective (the initial weight broadcast, host-parameter gathers at ZeRO-1/2,
the grad-norm sum of host gradients, gather_full) failed at initialize. On the CPU the same
group is a "cuda:gloo" one: a CPU tensor on it fails with torch's "No backend type associated
with device type cpu", exactly as on an NCCL-only group. N10: the backend is read per device
from the group, never guessed from its name ("undefined", a plugin's).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _world

import zerotier
from zerotier.dist import AVG, Comm, spawn
from zerotier.dist.comm import backends_by_device
from zerotier.models import TinyGPT

WORLD = 2


@pytest.fixture
def one_rank(tmp_path):
    """init_process_group(backend) as the only rank; destroyed after the test."""
    def init(backend):
        dist.init_process_group(backend, init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


def _plugin(name: str, devices: list[str] | None) -> str:
    """A third-party backend named `name` for `devices` (gloo underneath, as a plugin would wrap
    its own library): torch knows it only by name."""
    dist.Backend.register_backend(name, lambda store, rank, size, timeout: dist.ProcessGroupGloo(
        store, rank, size, timeout), devices=devices)
    return name


# ------------------------------------------------------------------------------------------------
# N10: the backend per device, from the group


def test_backend_is_read_per_device_from_the_group_not_its_name(one_rank):
    one_rank(None)  # no backend: torch picks per device; its name is "undefined"
    assert str(dist.get_backend()) == "undefined"
    assert backends_by_device()["cpu"] == "gloo"
    assert "undefined" not in backends_by_device().values()
    dist.destroy_process_group()

    one_rank(_plugin("ztplugcuda", ["cuda"]))  # a plugin registered for CUDA only
    assert backends_by_device() == {"cuda": "ztplugcuda"}
    dist.destroy_process_group()

    one_rank("cuda:gloo")
    assert backends_by_device() == {"cuda": "gloo"}
    with pytest.raises(ValueError, match=r"collective on a meta tensor, but the process group \(cuda:gloo\) "
                                         "has no backend for that device"):
        Comm().all_reduce(torch.ones(4, device="meta"))


def test_reduce_scatter_auto_emulates_wherever_gloo_runs_it(one_rank):
    """"auto" takes the all-reduce emulation (measured faster) where gloo runs the collective,
    also on a group named "undefined" (the name used to mean 'native')."""
    one_rank(None)
    comm = Comm()
    out = torch.empty(4)
    comm.reduce_scatter(out, torch.arange(4.0), op=AVG).wait()
    assert torch.equal(out, torch.arange(4.0))
    assert comm.stats(detail=True)["reduce_scatter"]["emulated"] == 1


def test_device_tensors_are_probed_on_no_backend():
    """Only host refusals are probed (they are raised alike on every rank); a device probe that
    failed on one rank only (out of memory) would make the ranks diverge. NCCL: always native; any
    other backend on a device: the emulations, without a try."""
    comm = Comm()
    calls = []

    def native():
        calls.append(1)
        return "work"

    assert comm._try_native(("ztplugin", "cuda", "all_gather", torch.float32), native) is None
    assert comm._try_native(("gloo", "cuda", "all_gather", torch.float32), native) is None
    assert calls == []
    assert comm._try_native(("nccl", "cuda", "all_gather", torch.float32), native) == "work"
    assert comm._try_native(("ztplugin", "cpu", "all_gather", torch.float32), native) == "work"
    assert len(calls) == 2


# ------------------------------------------------------------------------------------------------
# N9: host tensors on a group with no CPU backend


def host_collectives(comm: Comm, t: torch.Tensor) -> torch.Tensor:
    """The host tensor `t` through broadcast, all_reduce and all_gather (one rank); the gathered copy."""
    comm.broadcast(t).wait()
    comm.all_reduce(t).wait()
    full = torch.empty_like(t)
    comm.all_gather(full, t).wait()
    return full


def test_host_tensors_on_a_device_only_world_run_on_one_gloo_group(one_rank):
    one_rank(_plugin("ztplugcuda", ["cuda"]))
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
        dist.all_reduce(torch.ones(2))  # what the engine's CPU collectives met before
    groups = len(_world.pg_map)
    comm = Comm()
    host_collectives(comm, torch.ones(3))
    comm.check_all_ranks(True, "step 1")
    host_group, backend = comm.route(torch.device("cpu"))
    assert backend == "gloo" and host_group is not dist.group.WORLD
    assert comm.route(torch.device("cpu"))[0] is host_group  # made once
    assert len(_world.pg_map) == groups + 1
    comm.close()
    comm.close()
    assert len(_world.pg_map) == groups


def test_host_tensor_on_a_device_only_subgroup_is_a_clear_error(one_rank):
    one_rank("gloo")
    sub = dist.new_group(backend="cuda:gloo")
    with pytest.raises(ValueError, match="gloo group for host tensors only on the world group.*cpu:gloo"):
        Comm(sub).all_reduce(torch.ones(2))


# ------------------------------------------------------------------------------------------------
# N9 end to end: initialize and train on a device-only world, host placement (every CPU path)

VOCAB, SEQ, GLOBAL_BATCH, STEPS, ACCUM = 64, 16, 4, 2, 2


def _train_host_placement(rank: int, world_size: int) -> dict:
    """Stages 1-3 with params, gradients and optimizer on host: the initial broadcast, host-param
    gathers, global_sum of host gradients (clipping), gather_full (parameters_fp32, close) are all
    CPU collectives. Returns {stage: (losses, weights, whether a host group was made)}."""
    out = {}
    half = GLOBAL_BATCH // world_size
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        model = TinyGPT(vocab=VOCAB, dim=32, layers=2, heads=2, seq=SEQ)
        cfg = {"zero": {"stage": stage, "persistence_threshold": 200, "reduce_bucket_size": 4096},
               "offload": {"params": "host", "gradients": "host", "optimizer": "host"},
               "optimizer": {"lr": 3e-3, "weight_decay": 0.01},
               "train": {"grad_accum_steps": ACCUM, "max_grad_norm": 1.0}}
        groups = len(_world.pg_map)
        gen = torch.Generator().manual_seed(1)
        losses = []
        with zerotier.initialize(model, cfg) as engine:
            for _ in range(STEPS * ACCUM):
                data = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=gen)[rank * half:(rank + 1) * half]
                loss = engine(data[:, :-1], data[:, 1:])
                engine.backward(loss)
                engine.step()
                losses.append(float(loss.detach()))
            weights = engine.parameters_fp32()
            made = len(_world.pg_map) > groups  # a gloo group for host tensors
        assert len(_world.pg_map) == groups, "close() leaves no process group behind"
        out[stage] = (losses, weights, made)
    return out


def test_device_only_world_trains_exactly_like_a_gloo_world():
    gloo = spawn(_train_host_placement, WORLD, timeout_s=300)
    device_only = spawn(_train_host_placement, WORLD, timeout_s=300, backend="cuda:gloo")
    for rank in range(WORLD):
        for stage in (1, 2, 3):
            losses, weights, made = device_only[rank][stage]
            ref_losses, ref_weights, ref_made = gloo[rank][stage]
            assert made and not ref_made  # CPU collectives went to zerotier's gloo group
            assert losses == ref_losses, (rank, stage)
            assert weights.keys() == ref_weights.keys()
            for name in weights:
                assert torch.equal(weights[name], ref_weights[name]), (rank, stage, name)


# ------------------------------------------------------------------------------------------------
# CUDA: a real NCCL-only world (one rank: the lent machine has one GPU). Two ranks and
# `accelerate launch` need two GPUs (GPU review, checks to run, item 8).


@pytest.mark.cuda
@pytest.mark.pins("design#device-and-group-first")
def test_nccl_only_world_routes_host_tensors_to_gloo_and_device_tensors_to_nccl(one_rank):
    torch.cuda.set_device(0)
    one_rank("nccl")
    assert backends_by_device() == {"cuda": "nccl"}
    comm = Comm()
    assert torch.equal(host_collectives(comm, torch.arange(4.0)), torch.arange(4.0))
    assert comm.route(torch.device("cpu"))[1] == "gloo"
    device = torch.arange(8.0, device="cuda")
    shard = torch.empty(8, device="cuda")
    comm.reduce_scatter(shard, device, op=AVG).wait()  # "auto": NCCL's own, AVG included
    assert torch.equal(shard.cpu(), torch.arange(8.0))
    assert comm.route(torch.device("cuda")) == (None, "nccl")
    assert comm.stats(detail=True)["reduce_scatter"]["emulated"] == 0
    comm.close()
