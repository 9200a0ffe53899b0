"""benchmarks/bench_setup.py on the CPU: the --quick run end to end, its accounting checked (every
element materialized, checked and placed once; the NVMe bytes written; the extrapolation's terms),
never its timings."""
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import bench_setup  # noqa: E402


@pytest.mark.slow  # two processes importing torch, a 22M model initialized in each
def test_quick_run_accounts_for_every_element(tmp_path, capsys):
    out = tmp_path / "setup.json"
    assert bench_setup.main(["--quick", "--placement", "opt-host", "nvme", "--nvme-path", str(tmp_path),
                             "--to", "7b", "20b", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    runs = {run["placement"]: run for run in result["runs"]}
    assert set(runs) == {"opt-host", "nvme"} and result["here"]["memory_GBps"] > 0
    for name, run in runs.items():
        n = run["numel"]
        assert n == bench_setup.param_count(bench_setup.SHAPES["30m"]) and run["units"] == 5
        phases = run["phases"]
        for phase in ("fill", "init", "check", "cast", "optimizer", "params", "grads"):
            assert phases[phase]["numel"] == n and phases[phase]["seconds"] > 0, (name, phase, phases[phase])
        assert run["ahead"] == 1 and phases["wait"]["seconds"] > 0  # materialized on the worker
        assert 0 < run["materialize_bound"] <= run["host_pool_peak"]
        for size, row in run["extrapolated"]["sizes"].items():
            assert row["ahead_s"] <= row["serial_s"] and row["other_s"] > 0, (size, row)
        assert f"{name}, ahead=1" in printed
    # params (bf16, 2 B) and the exact optimizer state (fp32 master + two moments, 12 B) written at initialize
    assert runs["nvme"]["nvme_written"] >= runs["nvme"]["numel"] * (2 + 12)
    assert runs["opt-host"]["nvme_written"] == 0
    nvme_20b = runs["nvme"]["extrapolated"]["sizes"]["20b"]
    assert nvme_20b["nvme_s"] > 0 and nvme_20b["ahead_s"] >= nvme_20b["nvme_s"]  # the drive bounds it
