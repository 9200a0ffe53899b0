"""ZeRO stages 0-3 on 2 GPUs (torchrun, NCCL) against one plain-PyTorch process on the GPU.

The CUDA twin of tests/test_engine_dist.py::test_two_ranks_match_single_process: each rank
trains on its half of every global batch (train.device = "cuda": zerotier.initialize picks
cuda:LOCAL_RANK and joins a cpu:gloo,cuda:nccl group); the reference trains on the whole
batch with torch.optim.AdamW on cuda:0. 4 optimizer steps, accumulation 2, clipping 1.0,
TF32 off everywhere. Tolerance 1e-4 relative (+1e-5 absolute): gradient averaging across
ranks and half-size batches change the GPU reduction order.

One torchrun per placement runs the four stages; each rank saves its results after every
stage, so a failing stage still leaves the earlier ones to compare.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from reference_runs import ACCUM, LR, adamw_reference, global_batches, tiny_gpt

TESTS = os.path.dirname(os.path.abspath(__file__))  # the workers import reference_runs from here
STAGES = (0, 1, 2, 3)
RTOL, ATOL = 1e-4, 1e-5
TORCHRUN_TIMEOUT_S = 180
PLACEMENTS = {
    "optimizer-host": {"params": "device", "gradients": "device", "optimizer": "host"},
    "params-host": {"params": "host", "gradients": "host", "optimizer": "host"},
}

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(torch.cuda.device_count() < 2,
                       reason=f"needs >= 2 CUDA devices (found {torch.cuda.device_count()})"),
]

WORKER = r"""
import json, os, sys, traceback
import torch
import torch.distributed as dist
import zerotier

offload, out_dir = json.loads(sys.argv[1]), sys.argv[2]
sys.path.insert(0, sys.argv[3])  # tests/
from reference_runs import ACCUM, GLOBAL_BATCH, LR, global_batches, tiny_gpt
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

results = {}
path = os.path.join(out_dir, f"rank{rank}.pt")
half = GLOBAL_BATCH // world
for stage in (0, 1, 2, 3):
    cfg = {"zero": {"stage": stage, "persistence_threshold": 200, "reduce_bucket_size": 4096, "timeout_s": 60},
           "offload": offload, "optimizer": {"lr": LR, "weight_decay": 0.01},
           "train": {"grad_accum_steps": ACCUM, "max_grad_norm": 1.0, "device": "cuda"}}
    try:
        losses = []
        with zerotier.initialize(tiny_gpt(), cfg) as engine:
            device = engine.device
            assert device == torch.device("cuda", int(os.environ["LOCAL_RANK"])), (device, os.environ["LOCAL_RANK"])
            for x, y in global_batches():
                xs, ys = x[rank * half:(rank + 1) * half].to(device), y[rank * half:(rank + 1) * half].to(device)
                loss = engine(xs, ys)
                engine.backward(loss)
                engine.step()
                t = loss.detach().float().clone()
                dist.all_reduce(t)  # the global loss of the micro-batch: mean of the ranks' means
                losses.append(float(t) / world)
            weights = {k: v.detach().cpu() for k, v in engine.parameters_fp32().items()}
        results[stage] = {"losses": losses, "weights": weights, "device": str(device)}
    except BaseException:
        results[stage] = {"error": traceback.format_exc()}
        torch.save(results, path)
        raise
    torch.save(results, path)
dist.barrier()
dist.destroy_process_group()
print(f"rank {rank} done")
"""


def reference():
    """One process on cuda:0: the whole global batch, torch.optim.AdamW (mirrors test_engine_dist)."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        return adamw_reference(tiny_gpt().cuda(), ((x.cuda(), y.cuda()) for x, y in global_batches()), LR, ACCUM)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _text(out) -> str:
    """TimeoutExpired carries bytes (or None) even for text=True runs."""
    if out is None:
        return ""
    return out.decode(errors="replace") if isinstance(out, bytes) else out


def _tail(text, n=6000):
    return text[-n:] if text else "<empty>"


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """placement -> (CompletedProcess, [rank0 results, rank1 results]); one torchrun each, on first use."""
    cache = {}

    def launch(name):
        if name not in cache:
            out_dir = tmp_path_factory.mktemp(f"torchrun-{name}")
            script = out_dir / "worker.py"
            script.write_text(WORKER)
            env = {k: v for k, v in os.environ.items()
                   if k not in ("ZEROTIER_DEVICE", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                "MASTER_ADDR", "MASTER_PORT")}
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   str(script), json.dumps(PLACEMENTS[name]), str(out_dir), TESTS]
            try:
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TORCHRUN_TIMEOUT_S)
            except subprocess.TimeoutExpired as exc:
                proc = subprocess.CompletedProcess(cmd, returncode=f"timeout after {TORCHRUN_TIMEOUT_S} s",
                                                   stdout=_text(exc.stdout), stderr=_text(exc.stderr))
            ranks = []
            for r in range(2):
                path = out_dir / f"rank{r}.pt"
                ranks.append(torch.load(path) if path.exists() else {})
            cache[name] = (proc, ranks)
        return cache[name]

    return launch


@pytest.fixture(scope="module")
def ref():
    return reference()


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("name", list(PLACEMENTS))
@pytest.mark.pins("design#device-and-group-first")
def test_two_gpus_match_single_process(launches, ref, name, stage):
    proc, ranks = launches(name)
    ref_losses, ref_weights = ref
    for rank, results in enumerate(ranks):
        what = f"{name}, ZeRO stage {stage}, rank {rank}"
        got = results.get(stage)
        assert got is not None, (f"{what}: no result (torchrun exit {proc.returncode}; stages done: "
                                 f"{sorted(results)}).\nstdout:\n{_tail(proc.stdout)}\nstderr:\n{_tail(proc.stderr)}")
        assert "error" not in got, f"{what}: the rank raised:\n{got['error']}\nstderr:\n{_tail(proc.stderr)}"
        assert got["device"] == f"cuda:{rank}", f"{what}: computed on {got['device']}, expected cuda:{rank}"
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref_losses), rtol=RTOL, atol=1e-6,
                                   msg=lambda m: f"{what}: per-micro-batch global losses vs one process: {m}")
        assert got["weights"].keys() == ref_weights.keys(), \
            f"{what}: parameter names {sorted(got['weights'])} vs reference {sorted(ref_weights)}"
        for key in ref_weights:
            torch.testing.assert_close(got["weights"][key], ref_weights[key], rtol=RTOL, atol=ATOL,
                                       msg=lambda m, key=key: f"{what}: final weight {key!r} vs one process: {m}")
    assert proc.returncode == 0, (f"{name}: torchrun exited with {proc.returncode} after every stage matched.\n"
                                  f"stderr:\n{_tail(proc.stderr)}")
