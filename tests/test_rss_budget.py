"""The host budget is a cap on the process (issue 23 item 5; docs/tiers.md § RSS beyond the
budgets): a run's RSS grows by no more than tiers.host + tiers.device (RAM here: no CUDA)
+ 256 MiB, and unit-sized memory freed outside the pool goes back to the OS. Each in a
fresh process, so RSS is that run's alone."""
import json
import platform
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from zerotier.errors import BudgetError
from zerotier.io import FutureTicket
from zerotier.tiers.host import HostPool

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))  # the benchmarks import their siblings
import bench_rss_budget as bench  # noqa: E402

MiB = 1 << 20
PAGE = 4096

_RETENTION = r"""
import gc, json, psutil, torch
from zerotier.tiers.host import HostPool
pool = HostPool(1 << 30, pin=False)  # [Note: heap bound]: pins the threshold
proc = psutil.Process()
torch.empty(16 << 20, dtype=torch.uint8).fill_(1)  # a freed 16 MiB mapping: glibc's threshold rises to it
base = proc.memory_info().rss
held, kept = [], []
for _ in range(20):  # unit-sized temporaries, each with a small long-lived allocation after it on the heap
    held.append(torch.empty(8 << 20, dtype=torch.uint8).fill_(1))
    kept.append(torch.empty(200_000, dtype=torch.uint8))  # (past the small-chunk caches: from the heap's top)
del held
gc.collect()
print(json.dumps({"retained": proc.memory_info().rss - base}))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_freed_unit_sized_memory_leaves_the_process():
    """[Note: heap bound] 160 MiB of 8 MiB tensors freed after a 16 MiB one: without the pinned
    mmap threshold glibc serves them from the heap and keeps them (RSS +160 MiB)."""
    out = subprocess.run([sys.executable, "-c", _RETENTION], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    retained = json.loads(out.stdout.strip().splitlines()[-1])["retained"]
    assert retained < 8 * MiB, retained  # 159 MiB without the pin


def test_the_planners_unit_timing_runs_under_the_engines_allocator():
    """[Note: units timed under the engine's allocator] Measuring the units of a CPU plan pins glibc's
    mmap threshold as the engine's host pool will: the same freed temporaries leave the process."""
    setup = ("import torch\nfrom zerotier.models import TinyGPT\nfrom zerotier.planner import unit_timing\n"
             "x = torch.randint(0, 64, (2, 8))\n"
             "unit_timing.measure(TinyGPT(vocab=64, dim=32, layers=1, seq=8), (x, x), torch.device('cpu'), "
             "torch.float32, repeat=1)\n")
    script = setup + _RETENTION.replace("pool = HostPool(1 << 30, pin=False)  # [Note: heap bound]: pins the threshold",
                                        "")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1])["retained"] < 8 * MiB


def test_run_rss_growth_within_budgets(tmp_path):
    """A meta-built TinyGPT (dim 256, 2 layers), params, gradients and optimizer state on NVMe,
    host 256 MiB, device 128 MiB: initialize and two steps grow the process by at most the two
    budgets + 256 MiB, and what lies beyond the pool and the device tier's peaks (torch's
    runtime, compute temporaries) is under 256 MiB."""
    r = bench.run(dim=256, layers=[2], nvme_path=str(tmp_path), host="256MiB", device="128MiB")
    (run,) = r["runs"]
    assert run["device_type"] == "cpu"
    budgets = run["host_budget"] + run["device_budget"]
    assert run["peak_growth"] <= budgets + 256 * MiB, run
    last = run["rows"][-1]
    assert run["peak_growth"] - last["host_peak"] - last["device_peak"] < 256 * MiB, run
    assert not list(tmp_path.iterdir()), "run directories left behind"


def test_initialize_materializes_a_large_unit_in_the_pool(tmp_path):
    """[Note: materialization in the host pool] A meta-built TinyGPT (dim 2048: a 2048 x 8192
    Linear is 64 MiB in fp32), params and optimizer state on NVMe: initialize's RSS peak is the
    pool's peak plus little, not the unit's fp32 tensors, their concatenation and its bf16 cast
    on the heap (166 MiB beyond the pool before; it grew with the largest unit)."""
    r = bench.run(dim=2048, layers=[1], nvme_path=str(tmp_path), host="2GiB", device="512MiB", steps=0)
    (run,) = r["runs"]
    rows = {row["phase"]: row for row in run["rows"]}
    init = rows["initialize"]
    assert init["host_peak"] > 2 * 64 * MiB, run  # the pool saw the fp32 unit and its cast
    assert init["peak_rss"] - rows["meta build"]["rss"] - init["host_peak"] < 48 * MiB, run
    assert not list(tmp_path.iterdir()), "run directories left behind"


def test_meta_units_are_materialized_in_pool_blocks_and_given_back(tmp_path, monkeypatch):
    """Each meta unit's parameters are views of one pool block of the unit's size, freed once
    the stores have their copies: initialize ends with no materialization block in use."""
    import zerotier
    from zerotier.materialize import Materializer
    from zerotier.models import TinyGPT, init_tiny_gpt

    seen = []
    unit_of = Materializer.unit

    def unit(self, u):
        out = unit_of(self, u)
        flat = self.flat(out)
        seen.append((out.numel, flat.numel() if flat is not None else None,
                     all(flat is not None and p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
                         for p in out.params)))
        return out
    monkeypatch.setattr(Materializer, "unit", unit)
    with torch.device("meta"):
        model = TinyGPT(vocab=64, dim=64, layers=2, heads=2, seq=16)
    cfg = {"offload": {"params": "nvme", "optimizer": "nvme"}, "tiers": {"nvme_path": str(tmp_path)},
           "train": {"wrap": ["Linear", "Embedding"]}}
    engine = zerotier.initialize(model, cfg, init_fn=init_tiny_gpt)
    try:
        assert seen and all(numel == flat and viewed for numel, flat, viewed in seen), seen
        assert not engine._placement.materializer._blocks  # every block given back
    finally:
        engine.close(restore_weights=False)


@pytest.mark.parametrize("ahead, slow_worker", [(0, False), (1, False), (1, True)])
def test_units_of_one_size_reuse_their_materialization_blocks(ahead, slow_worker, tmp_path, monkeypatch):
    """[Note: materialization in the host pool] A model's layers are units of one size: the next
    one reuses the blocks the last one released (their pages mapped, on CUDA registered), so the
    pool allocates a flat and a cast per size (and per unit materialized ahead), not per unit;
    initialize gives every block back. slow_worker: the worker is late to take a spare, so the
    caller releases two units before it allocates (a loaded machine: .ci/run found 5 flats);
    both spares are kept, none allocated again."""
    if slow_worker:
        from zerotier.materialize import Materializer
        unit_of = Materializer.unit

        def late(self, unit):  # every other unit: the one before it is ready when the caller releases
            if threading.current_thread().name == "zerotier-materialize" and unit.name.endswith(("2", "4")):
                time.sleep(0.3)  # between taking its room and allocating the unit's flat
            return unit_of(self, unit)
        monkeypatch.setattr(Materializer, "unit", late)
    import zerotier
    import zerotier.materialize as materialize
    from zerotier.models import TinyGPT, init_tiny_gpt

    monkeypatch.setattr(materialize, "AHEAD", ahead)
    allocs, alloc = [], HostPool.alloc

    def counting(self, nbytes, dtype=torch.uint8, what=""):
        allocs.append(what)
        return alloc(self, nbytes, dtype, what)
    monkeypatch.setattr(HostPool, "alloc", counting)
    with torch.device("meta"):
        model = TinyGPT(vocab=64, dim=64, layers=6, heads=2, seq=16)
    cfg = {"offload": {"params": "host", "gradients": "host", "optimizer": "host"},
           "precision": {"param_dtype": "bf16"}}
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine = zerotier.initialize(model, cfg, init_fn=init_tiny_gpt)
    finally:
        torch.set_num_threads(before)
    try:
        sizes = {u.numel for u in engine.param_units}
        assert len(engine.param_units) == 7 and len(sizes) == 2  # six blocks, the root
        flats = [w for w in allocs if w.startswith("materializing")]
        casts = [w for w in allocs if " as torch.bfloat16" in w]
        assert len(flats) <= len(sizes) + ahead + 1 and len(casts) <= len(sizes) + 1, (flats, casts)
        assert not engine._placement.materializer._blocks
        assert not any(engine._placement.materializer._spares.values())
    finally:
        engine.close(restore_weights=False)


def test_the_plan_counts_materialization_in_tiers_host():
    """[Note: materialization in the host pool] With everything on host the plan has no staging to
    spare: a meta-built model's host need is the normal build's plus its largest unit in fp32 and
    bf16 (and two alignment pads), and the next largest in fp32 (and its pad), materialized while
    the largest is placed ([Note: materializing ahead]); exactly that budget initializes, one byte
    less is refused by the planner (before, initialize failed at that budget with a BudgetError part-way)."""
    from zerotier.materialize import AHEAD
    import zerotier
    from zerotier.errors import BudgetError
    from zerotier.models import TinyGPT, init_tiny_gpt

    def build(device):
        with torch.device(device):
            return TinyGPT(vocab=64, dim=256, layers=2, heads=2, seq=16)
    cfg = {"offload": {"params": "host", "gradients": "host", "optimizer": "host"},
           "train": {"wrap": ["Linear", "Embedding"]}, "tiers": {"host": "64MiB"},
           "precision": {"param_dtype": "bf16"}}
    engine = zerotier.initialize(build("cpu"), cfg)
    normal = engine.plan.need["host"]
    engine.close()
    engine = zerotier.initialize(build("meta"), cfg, init_fn=init_tiny_gpt)
    need = engine.plan.need["host"]
    engine.close(restore_weights=False)
    # the 256 x 1024 Linear and its bias; ahead, the other one (the two layers' fc)
    assert need - normal == (256 + 1) * 1024 * (4 + 2) + 2 * 4096 + AHEAD * ((256 + 1) * 1024 * 4 + 4096)
    cfg["tiers"]["host"] = str(need)
    zerotier.initialize(build("meta"), cfg, init_fn=init_tiny_gpt).close(restore_weights=False)
    cfg["tiers"]["host"] = str(need - 1)
    with pytest.raises(BudgetError, match="1 B more host"):
        zerotier.initialize(build("meta"), cfg, init_fn=init_tiny_gpt)


def test_a_full_pool_waits_for_blocks_parked_behind_writes():
    """[Note: a full pool waits] With the budget taken and one block parked behind a write still
    in flight, an alloc waits for that write and reuses the block (it raised BudgetError before);
    with nothing parked the refusal says what the budget would need."""
    pool = HostPool(2 * PAGE, alignment=PAGE, pin=False)
    a, b = pool.alloc(PAGE), pool.alloc(PAGE)
    fut = Future()
    pool.free(a, after=FutureTicket(fut))  # an NVMe write still reads it
    threading.Timer(0.2, fut.set_result, (PAGE,)).start()
    c = pool.alloc(PAGE, what="a unit's staging")
    assert fut.done() and c.block.data_ptr() == a.block.data_ptr()
    with pytest.raises(BudgetError, match=r"for a unit's cast.*needs a budget of at least 12 KiB"):
        pool.alloc(PAGE, what="a unit's cast")
    pool.free(b)
    pool.free(c)
    pool.close()


def test_plan_names_the_fixed_part(capsys):
    from zerotier.cli import main
    from zerotier.tiers.host import RSS_OUTSIDE_BUDGETS

    assert main(["plan", "--params", "350M", "--device", "20GiB", "--host", "20GiB"]) == 0
    assert f"outside the budgets: ~{RSS_OUTSIDE_BUDGETS >> 20}.00 MiB of RSS, fixed in model size" in \
        capsys.readouterr().out
