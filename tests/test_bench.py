"""`zerotier bench`: the io form end to end, saving + load_rates round trip, the planner using
the loaded rates. Sizes are tiny: these check plumbing, not the node's figures."""
import json
import math
import os
import socket
import subprocess
import sys

import pytest
import torch

from zerotier import bench, measure
from zerotier.config import OffloadConfig
from zerotier.errors import ConfigError
from zerotier.planner.inputs import ModelFacts, Node, PlanConfig
from zerotier.planner.planner import make_plan


@pytest.fixture
def bench_file(tmp_path, monkeypatch):
    path = tmp_path / "cache" / "bench.json"
    monkeypatch.setenv("ZEROTIER_BENCH_FILE", str(path))
    return path


def test_cli_bench_io_json_no_save(tmp_path):
    target = tmp_path / "bench.json"
    env = dict(os.environ, ZEROTIER_BENCH_FILE=str(target))
    r = subprocess.run([sys.executable, "-m", "zerotier.cli", "bench", "io", "--path", str(tmp_path),
                        "--size", "8MiB", "--json", "--no-save"], capture_output=True, text=True, env=env,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["read_GBps"] > 0 and out["write_GBps"] > 0 and out["bytes"] == 8 << 20
    assert not target.exists()
    assert os.listdir(tmp_path) == []  # the temp subdir and its file are gone


def test_bench_io_odd_size_and_cleanup(tmp_path):
    out = measure.bench_io(tmp_path, 3 * 4096 + 1)  # rounded up to the alignment
    assert out["bytes"] == 4 * 4096 and out["read_GBps"] > 0
    assert os.listdir(tmp_path) == []


def test_nvme_write_peak_is_the_overwrite_a_step_does(tmp_path, bench_file):
    """Issue 26 item 7: "% of peak" read 154-277% because the saved nvme_write peak was a fresh
    file's write (allocation + fsync) while a step's writes overwrite recycled swap files. bench io
    now measures the overwrite too, and it is the rate load_rates gives the planner and profiler."""
    out = measure.bench_io(tmp_path, 1 << 20, repeat=2)
    assert out["overwrite_GBps"] > 0 and out["write_GBps"] > 0 and out["read_GBps"] > 0
    assert "nvme overwrite" in bench.format_table({"io": out})
    bench.save({"io": {**out, "o_direct": True, "write_GBps": 0.2, "overwrite_GBps": 0.8}})
    assert bench.load_rates()["nvme_write"] == pytest.approx(0.8e9)
    bench.save({"io": {"read_GBps": 0.9, "write_GBps": 0.2, "o_direct": True}})  # a file saved before
    assert bench.load_rates()["nvme_write"] == pytest.approx(0.2e9)


def test_the_drives_cpu_share_is_measured_and_becomes_the_planners(tmp_path, bench_file):
    """[Note: the drive's CPU share]: bench io times all-core work beside a stream of reads and writes;
    the slowdown is the planner's nvme_cpu_share (a fraction, checked as one), shown in the table."""
    out = measure.bench_io(tmp_path, 1 << 20, repeat=1)
    assert 0.0 <= out["cpu_share"] <= 10.0
    assert "cpu slowdown under nvme" in bench.format_table({"io": out})
    bench.save({"io": {**out, "o_direct": True, "cpu_share": 0.26}})
    assert bench.load_rates()["nvme_cpu_share"] == pytest.approx(0.26)
    bench.save({"io": {**out, "o_direct": True, "cpu_share": -1.0}})
    assert "nvme_cpu_share" not in bench.load_rates()  # this node's cache: a bad figure is left out
    with pytest.raises(ConfigError, match=r"io\.cpu_share: expected the measured slowdown"):
        bench.rates_from_file(bench_file)  # a file the user names is checked strictly


def test_the_engines_own_time_is_measured_and_becomes_the_planners(bench_file):
    """[Note: the engine's own time]: `bench engine` times the engine's forward and backward against plain
    torch's on a small TinyGPT, per unit; the planner reads them (checked as seconds, 0 to 1)."""
    from zerotier.engine import overhead

    out = bench.run((bench.ENGINE,), engine=overhead.measure, quick=True, progress=lambda _: None)["engine"]
    assert out["units"] == overhead.LAYERS + 1 and out["plain_forward_s"] > 0 and out["plain_backward_s"] > 0
    assert 0.0 <= out["forward_per_unit_s"] < 1.0 and 0.0 <= out["backward_per_unit_s"] < 1.0
    assert "engine backward, per unit" in bench.format_table({"engine": out})
    bench.save({"engine": {**out, "forward_per_unit_s": 0.001, "backward_per_unit_s": 0.002}})
    assert (bench.load_rates()["engine_forward_s"], bench.load_rates()["engine_backward_s"]) == (0.001, 0.002)
    bench.save({"engine": {**out, "backward_per_unit_s": 5.0}})
    with pytest.raises(ConfigError, match=r"engine\.backward_per_unit_s: expected the measured seconds per unit"):
        bench.rates_from_file(bench_file)
    with pytest.raises(ValueError, match="measured by the engine's own function"):
        bench.run((bench.ENGINE,))


def test_save_and_load_rates_round_trip(bench_file):
    assert bench.load_rates() is None
    results = {"io": {"read_GBps": 7.5, "write_GBps": 4.0, "o_direct": True, "path": "/x"},
               "adam": {"fp32_params_per_s": 2.0e9, "bf16_params_per_s": 2.2e9, "params_out": True},
               "pcie": None}  # CPU-only: skipped
    assert bench.save(results) == bench_file
    assert bench.load_rates() == {"nvme_read": 7.5e9, "nvme_write": 4.0e9, "cpu_adam": 2.0e9}
    # a later run of one section merges: the others keep their figures
    bench.save({"pcie": {"h2d_pinned_GBps": 25.0, "d2h_pinned_GBps": 24.0}})
    rates = bench.load_rates()
    assert rates["h2d"] == 25e9 and rates["d2h"] == 24e9 and rates["cpu_adam"] == 2.0e9
    data = json.loads(bench_file.read_text())
    assert data["hostname"] == socket.gethostname() and data["timestamp"]
    assert data["hosts"][socket.gethostname()]["io"]["timestamp"]
    # figures taken through the page cache are not NVMe rates
    bench.save({"io": {"read_GBps": 50.0, "write_GBps": 9.0, "o_direct": False}})
    assert "nvme_read" not in bench.load_rates()


def test_other_hosts_and_bad_files_are_ignored(bench_file):
    bench_file.parent.mkdir(parents=True)
    bench_file.write_text(json.dumps({"format": 1, "hosts": {"elsewhere": {"adam": {"fp32_params_per_s": 1e9}}}}))
    assert bench.load_rates() is None
    bench_file.write_text("{not json")
    with pytest.warns(RuntimeWarning, match="cannot read saved zerotier bench results"):
        assert bench.load_rates() is None


def test_planner_uses_loaded_rates(bench_file):
    def plan():
        return make_plan(ModelFacts.of_sizes([10**7]), PlanConfig(offload=OffloadConfig(optimizer="host")),
                         Node(torch.device("cpu"), budgets={"device": 10**12, "host": 10**12, "nvme": 0}))

    assumed = plan()
    assert assumed.rate_sources == {"mem_copy": "default", "cpu_adam": "default", "mem_read": "default"}
    assert assumed.to_dict()["predicted_step_s"] is None
    bench.save({"adam": {"fp32_params_per_s": 1e7, "params_out": True},
                "mem": {"sumsq_GBps": 40000.0, "copy_GBps": 20000.0}})
    measured = plan()
    assert measured.rate_sources == {"mem_copy": "measured", "cpu_adam": "measured", "mem_read": "measured"}
    # the hook's copy of 40 MB of fresh gradients at mem_copy (1e13 B/s: 4 us), then 1e7 params at 1e7
    # params/s, after the global norm: 40 MB of gradients at 4e13 B/s
    assert measured.predicted_step_s == pytest.approx(1.0 + 5e-6)
    assert measured.to_dict()["predicted_step_s"] == pytest.approx(1.0 + 5e-6)
    assert "cpu_adam measured" in measured.summary()


def test_cli_bench_sections_in_process(bench_file, tmp_path, capsys):
    from zerotier.cli import main

    assert main(["bench", "adam", "--params", "100000", "--quick"]) == 0
    out = capsys.readouterr()
    assert "cpu adam fp32" in out.out and "saved to" in out.err
    assert bench.load_rates()["cpu_adam"] > 0
    assert main(["bench", "mem", "--size", "8MiB", "--json", "--no-save"]) == 0
    mem = json.loads(capsys.readouterr().out)
    assert mem["inplace_GBps"] > 0 and mem["copy_GBps"] > 0 and mem["sumsq_GBps"] > 0
    # the planner's mem_read is the global norm's pass (the engine's sum of squares), else the in-place rate
    assert bench.entry_rates({"mem": mem})["mem_read"] == pytest.approx(mem["sumsq_GBps"] * 1e9)
    assert bench.entry_rates({"mem": {"inplace_GBps": 3.0, "copy_GBps": 2.0}})["mem_read"] == 3e9
    assert bench.entry_rates({"mem": {"copy_GBps": 2.0}})["mem_read"] == 2e9  # a read pass at least matches a copy
    assert main(["bench", "io", "--size", "bogus"]) == 1
    assert "--size: invalid size" in capsys.readouterr().err


def test_progress_bar_counts_to_total():
    import io

    stream = io.StringIO()
    p = bench.Progress(2, stream=stream)
    p("a")
    p("b")
    lines = stream.getvalue().split("\n")
    assert len(lines) == 3 and lines[2] == "" and "\r" not in stream.getvalue()  # a log: a line per step
    assert lines[0].startswith("zerotier bench:  50%|") and "1/2" in lines[0] and lines[0].endswith(", a]")
    assert lines[1].startswith("zerotier bench: 100%|") and "2/2" in lines[1]


def test_each_section_ticks_as_often_as_its_bar_counts(tmp_path):
    """STEPS is each section's share of the bar: a section ticking more (the memory section's third tick,
    the sum of squares, once ran past a bar of 2) draws a bar past 100%."""
    from zerotier.engine import overhead

    for section in ("mem", "io", "adam", "compute", bench.ENGINE):
        ticks = []
        bench.run((section,), size=1 << 20, params=100_000, quick=True, path=tmp_path, progress=ticks.append,
                  engine=overhead.measure)
        assert len(ticks) == bench.STEPS[section], (section, ticks)


def test_progress_bar_on_a_terminal_is_tqdms():
    import io

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    stream = Terminal()
    p = bench.Progress(2, stream=stream)
    assert type(p.bar).__module__.startswith("tqdm")
    p("a")
    p("b")
    assert p.bar.n == 2 and "2/2" in stream.getvalue() and "\r" in stream.getvalue()  # redrawn in place


def test_pcie_without_cuda_is_skipped_with_a_note_and_no_progress_bar(monkeypatch, capsys):
    """A CPU-only node has no PCIe: `zerotier bench pcie` says it was skipped and shows no progress
    bar of four "(no CUDA)" steps (issue 26 item 7); `bench all` counts no pcie steps."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.run(("pcie",)) == {"pcie": None}
    assert capsys.readouterr().err == ""
    assert "skipped: no CUDA" in bench.format_table({"pcie": None})
    monkeypatch.setattr(bench, "bench_memory", lambda *a, tick, **k: (tick("m1"), tick("m2"), tick("m3"), {})[-1])
    bench.run(("mem", "pcie"))
    err = capsys.readouterr().err
    assert "3/3" in err and "pcie" not in err and "/7" not in err


@pytest.mark.cuda
def test_pcie_measures_pinned_and_pageable():
    out = measure.bench_pcie(8 << 20, repeat=2)
    for key in ("h2d_pinned", "d2h_pinned", "h2d_pageable", "d2h_pageable"):
        assert out[key + "_GBps"] > 0


def test_adam_quick_size_is_out_of_cache(monkeypatch):
    """bench --quick measures Adam over a working set of at least 4x the L3 (issue 13 item 7)."""
    import cpuinfo
    monkeypatch.setattr(cpuinfo, "get_cpu_info", lambda: {"l3_cache_size": 256 << 20})
    assert measure.adam_numel(measure.QUICK_SIZES["adam"]) * measure.ADAM_BYTES_PER_PARAM >= 4 * (256 << 20)
    monkeypatch.setattr(cpuinfo, "get_cpu_info", lambda: {})
    assert measure.adam_numel(measure.QUICK_SIZES["adam"]) == measure.QUICK_SIZES["adam"]


def _finite_positive(figures: dict, suffix: str) -> list[str]:
    keys = [k for k in figures if k.endswith(suffix)]
    assert all(math.isfinite(figures[k]) and figures[k] > 0 for k in keys), figures
    return keys


def test_the_cpu_update_is_measured_per_rule_and_state_dtype(bench_file, monkeypatch):
    """Issue 34 item 1: `zerotier bench adam` measures each rule's native update per state dtype pair
    (the engine's call), and load_rates gives them to the planner as cpu_<rule>_<master>_<moments>."""
    from zerotier.optim.state_layout import StateLayout

    outs = []  # [Note: the CPU rate's new parameters]: timed writing them out, in the master's dtype
    step_pieces = StateLayout.step_pieces
    monkeypatch.setattr(StateLayout, "step_pieces", lambda self, *a, **kw: (
        outs.append((kw["out"].dtype, a[1].dtype)), step_pieces(self, *a, **kw))[1])
    out = measure.bench_state_rates(4096 * 3, repeat=1, threads=1)
    assert outs and all(dtype == master for dtype, master in outs)
    want = {f"{r}_{m}_{mo}_params_per_s" for r in ("adamw", "lion") for m in ("fp32", "bf16")
            for mo in ("fp32", "bf16", "int8")}
    assert set(_finite_positive(out, "_params_per_s")) == want and out["state_threads"] == 1
    table = bench.format_table({"adam": {**out, "numel": 1, "simd": "x", "threads": 1, "fp32_params_per_s": 1e9,
                                         "bf16_params_per_s": 1e9}})
    assert "cpu adamw bf16 master, int8 moments" in table and "cpu lion fp32 master, fp32 moments" in table
    bench.save({"adam": {"fp32_params_per_s": 1e9, "params_out": True, **out}})
    rates = bench.load_rates()
    assert "cpu_params_out" not in rates  # timed writing the new parameters, as the engine's update does
    assert rates["cpu_adamw_bf16_int8"] == out["adamw_bf16_int8_params_per_s"]
    assert rates["cpu_lion_fp32_int8"] == out["lion_fp32_int8_params_per_s"] and rates["cpu_adam"] == 1e9
    assert not any(k.startswith("device_") for k in rates)  # no device step measured, none written
    bench.save({"adam": {"fp32_params_per_s": 1e9}})  # a file from before: timed without them
    assert bench.load_rates()["cpu_params_out"] == 0.0


def test_the_device_update_is_measured_on_the_device_it_is_given(bench_file):
    """Issue 34 item 2: the device step's rate (kernel bytes/s, as the planner counts them) of each
    rule's device variant per state dtype pair, here on the CPU as the device; without CUDA and no
    device given, nothing is measured and nothing written."""
    numel = 4096 * 2
    out = measure.bench_device_step(numel, device="cpu", repeat=1)
    assert out["device"] == "cpu" and out["numel"] == numel
    assert len(_finite_positive(out, "_GBps")) == 12
    bench.save({"step": out})
    rates = bench.load_rates()
    assert rates["device_adam"] == pytest.approx(out["adamw_fp32_fp32_GBps"] * 1e9)
    assert rates["device_adamw_bf16_int8"] == pytest.approx(out["adamw_bf16_int8_GBps"] * 1e9)
    assert rates["device_lion_bf16_bf16"] == pytest.approx(out["lion_bf16_bf16_GBps"] * 1e9)
    assert "device adamw bf16 master, int8 moments" in bench.format_table({"step": out})
    if not torch.cuda.is_available():
        assert measure.bench_device_step(numel) is None
        bench_file.unlink()
        bench.save({"step": None})
        assert bench.load_rates() is None
        assert "device step" in bench.format_table({"step": None})


def test_a_crafted_per_state_rate_is_refused(tmp_path):
    path = tmp_path / "node.json"
    path.write_text(json.dumps({"format": 1, "hosts": {"n": {"step": {"adamw_bf16_int8_GBps": -1}}}}))
    with pytest.raises(ConfigError, match=r"hosts\.n\.step\.adamw_bf16_int8_GBps: expected a measured rate"):
        bench.rates_from_file(path)


@pytest.mark.cuda
def test_the_device_update_on_cuda():
    out = measure.bench_device_step(1 << 20, repeat=2)
    assert out["device"] != "cpu" and len(_finite_positive(out, "_GBps")) == 12
