"""The profiler wired into the engine: its bytes equal the tiers' own accounting."""
import json

import pytest
import torch

import zerotier
from zerotier.models import TinyGPT, batches

PLACEMENTS = {
    "optimizer-host": {"params": "device", "gradients": "host", "optimizer": "host"},
    "optimizer-nvme": {"params": "device", "gradients": "host", "optimizer": "nvme"},
    "params-host": {"params": "host", "gradients": "host", "optimizer": "host"},
    "params-nvme": {"params": "nvme", "gradients": "host", "optimizer": "nvme"},
}


def pair_bytes(summary, src, dst):
    return sum(link.bytes for link in summary.links if link.link == f"{src}->{dst}")


@pytest.mark.parametrize("name", PLACEMENTS)
def test_profiler_bytes_equal_tier_accounting(name, tmp_path):
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, dim=32, layers=2, heads=2, seq=16)
    trace = tmp_path / "trace.json"
    cfg = {"offload": PLACEMENTS[name], "tiers": {"nvme_path": str(tmp_path)},
           "profile": {"enabled": True, "trace_path": str(trace)}, "train": {"max_grad_norm": 1.0}}
    engine = zerotier.initialize(model, cfg)
    store0 = engine.store.stats() if engine.store else {"bytes_in": 0, "bytes_out": 0}
    for x, y in batches(64, 16, 2, 3):
        engine.backward(engine(x, y))
        engine.step()
    engine.synchronize()  # parameter write-backs to NVMe stay in flight after step(); the store counts them on completion
    summary = engine.report()
    dev = engine.device_tier.stats()
    assert pair_bytes(summary, "device", "host") == dev["bytes_out"] > 0  # gradients offloaded
    assert sum(pair_bytes(summary, s, "device") for s in ("host", "nvme")) == dev["bytes_in"]
    if engine.store is not None:
        st = engine.store.stats()
        assert pair_bytes(summary, "host", "nvme") == st["bytes_in"] - store0["bytes_in"] > 0
        assert pair_bytes(summary, "nvme", "host") + pair_bytes(summary, "nvme", "device") \
            == st["bytes_out"] - store0["bytes_out"] > 0
    assert "verdict" in summary.table().lower()
    engine.close()
    saved = json.loads(trace.read_text())
    assert saved["traceEvents"], "close() writes the trace to profile.trace_path"


def test_profiling_off_allocates_no_profiler():
    engine = zerotier.initialize(TinyGPT(vocab=64, dim=32, layers=1, heads=2, seq=16), {})
    assert engine.profiler is None
    with pytest.raises(zerotier.ZerotierError, match="profile.enabled"):
        engine.report()
    assert "swap summary" in engine.swap_summary()
    engine.close()


def test_links_are_named_for_this_machine():
    """On a CPU-only run the "device" is RAM: its copies are not called PCIe (issue 13 item 7)."""
    torch.manual_seed(0)
    cfg = {"offload": {"params": "host", "gradients": "host", "optimizer": "host"}, "profile": {"enabled": True}}
    with zerotier.initialize(TinyGPT(vocab=64, dim=32, layers=2, heads=2, seq=16), cfg) as engine:
        for x, y in batches(64, 16, 2, 3):
            engine.backward(engine(x, y))
            engine.step()
        report = engine.report()
    assert report.device == "cpu"
    table = report.table()
    assert "RAM copy" in table and "PCIe" not in table, table
    # [Note: same memory]: host<->device on the CPU is no link: no bandwidth printed for it (issue 35 item 8)
    rows = {k.link: k for k in report.links}
    assert rows["host->device"].same_memory and rows["host->device"].gbps is None
    assert rows["device->host"].same_memory and rows["device->host"].gbps is None
    row = next(line for line in table.splitlines() if line.startswith("  host->device (same memory)"))
    assert row.split()[-3:] == ["-", "-", "-"], row
    assert "not a link, so they have no GB/s" in table
    assert report.verdict != "PCIe-bound"


def test_the_profile_names_each_unit_by_its_module(tmp_path):
    """The engine gives the profiler its units' module paths: the table and the trace say `blocks.1 (u00002).param`,
    not only `u00002.param` (issue 35 item 8)."""
    torch.manual_seed(0)
    cfg = {"offload": {"params": "host", "gradients": "host", "optimizer": "host"}, "profile": {"enabled": True}}
    with zerotier.initialize(TinyGPT(vocab=64, dim=32, layers=2, heads=2, seq=16), cfg) as engine:
        names = {u.key: u.name for u in engine.param_units}
        for x, y in batches(64, 16, 2, 2):
            engine.backward(engine(x, y))
            engine.step()
        trace = engine.profiler.trace()
        table = engine.report().table()
    assert sorted(names.values()) == ["", "blocks.0", "blocks.1"]
    block = next(key for key, name in names.items() if name == "blocks.1")
    assert f"blocks.1 ({block}).param" in table and "<root> (" in table, table
    fetches = [e for e in trace["traceEvents"] if e.get("cat") == "transfer" and e["args"]["tensor"] == f"{block}.param"]
    assert fetches and all(e["args"]["module"] == "blocks.1" and f"blocks.1 ({block}).param" in e["name"]
                           for e in fetches)
    assert trace["zerotier"]["unit_names"] == names


def test_a_fresh_model_that_rolls_back_every_step_is_told_the_plan_assumed_one_percent():
    """Clipping that fires every step rolls back every speculated window: the profile says 100% against the
    plan's 1% and what to do (issue 35 item 8: 3 of 3 on a fresh model)."""
    torch.manual_seed(0)
    cfg = {"offload": {"params": "device", "gradients": "host", "optimizer": "host"}, "profile": {"enabled": True},
           "train": {"max_grad_norm": 1e-6, "overlap": "speculative"}}
    with zerotier.initialize(TinyGPT(vocab=64, dim=32, layers=2, heads=2, seq=16), cfg) as engine:
        for x, y in batches(64, 16, 2, 3):
            engine.backward(engine(x, y))
            engine.step()
        report = engine.report()
    assert report.planned_rollback_rate == engine.plan.rollback_rate == 0.01
    assert report.speculation_windows == report.rolled_back_windows == 3
    table = report.table()
    assert "rollback rate 100.0% (the plan assumed 1.0%)" in table, table
    assert "warning: 100.0% of the speculated windows rolled back (3 of 3), 100.0x the 1.0% the plan assumed" in table
    assert "train.overlap = 'none'" in table
