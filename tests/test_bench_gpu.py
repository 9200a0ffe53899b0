"""benchmarks/bench_gpu.py --tiny on the CPU, end to end: a smoke test of the script (its rows, its
files, figures that are sane), never a result. The GPU figures are read on a GPU machine."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import bench_gpu  # noqa: E402

CASES = ["torch", "zt-opt-host", "zt-params-nvme", "ds-z2-offload"]


@pytest.mark.slow  # five processes importing torch: ~25 s of CPU
def test_tiny_run_writes_every_row_with_sane_figures(tmp_path):
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_gpu.py"), "--tiny",
                        "--cases", ",".join(CASES), "--steps", "2", "--warmup", "1", "--threads", "1",
                        "--out", str(out), "--nvme-path", str(tmp_path)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:] + (out / "cases.log").read_text()[-5000:]
    report = json.loads((out / "bench_gpu.json").read_text())
    rows = {c["case"]: c for c in report["cases"]}
    assert list(rows) == CASES
    assert report["env"]["matmul_peak_tflops"] > 0 and report["env"]["torch"]
    assert rows["ds-z2-offload"]["status"] == "n/a" and "--tiny" in rows["ds-z2-offload"]["reason"]
    for case in CASES[:3]:
        row = rows[case]
        assert row["status"] == "ok", row
        assert len(row["losses"]) == 3 and all(math.isfinite(v) for v in row["losses"])
        assert row["step_s"] > 0 and row["tokens_per_s"] == pytest.approx(row["tokens_per_step"] / row["step_s"])
        assert row["mfu_pct"] > 0 and row["x_torch"] > 0 and row["peak_rss"] > 0
        assert row["max_abs_dloss"] < 2e-2  # bf16 params + fp32 master against fp32 params under bf16 autocast
    for case in ("zt-opt-host", "zt-params-nvme"):
        plan = rows[case]["plan"]
        assert plan["need"]["host"] > 0 and plan["predicted_step_s"] >= 0 and plan["rates_measured"] is False
        assert rows[case]["zt_link_overlap_pct"] and all(0 <= v <= 100 for v in rows[case]["zt_link_overlap_pct"].values())
        assert rows[case]["zt_verdict"]
    assert plan["placement"] == {"params": "nvme", "gradients": "host", "optimizer": "nvme"}
    assert "nvme->host" in rows["zt-params-nvme"]["zt_link_overlap_pct"]
    assert any(k["link"] == "nvme->host" and k["GBps"] > 0 for k in rows["zt-params-nvme"]["zt_links"])
    assert rows["zt-params-nvme"]["nvme_bytes"] > 0 and rows["zt-params-nvme"]["nvme_traffic"]["read"] > 0
    assert rows["zt-opt-host"]["nvme_bytes"] == 0
    md = (out / "bench_gpu.md").read_text()
    for case in CASES:
        assert f"| {case} | " in md
    assert "CPU smoke run (not a result)" in md and "| ds-z2-offload | n/a (--tiny" in md
    assert os.listdir(tmp_path) == ["out"]  # the cases' swap directories are gone


def test_memcpy_overlap_from_a_kineto_trace():
    """HtoD half under a kernel, DtoH wholly under one, the GPU running kernels 2/3 of the window."""
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 10},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 20, "dur": 10},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 5, "dur": 10},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 25, "dur": 5},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "ts": 0, "dur": 30},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 30},
    ]}
    out = bench_gpu.memcpy_overlap(trace)
    assert out["h2d_pct"] == pytest.approx(50.0) and out["d2h_pct"] == pytest.approx(100.0)
    assert out["gpu_busy_pct"] == pytest.approx(100.0 * 20 / 30)
    assert bench_gpu.memcpy_overlap({"traceEvents": []})["h2d_pct"] is None


@pytest.mark.parametrize("case", ["zt-opt-host-early", "torchao-offload"])
def test_a_case_that_cannot_clip_is_refused_not_run_without_it(tmp_path, case):
    """train.early_step ignores clipping and torchao cannot clip: with --clip the row says so
    instead of timing a run that silently trains differently from the others."""
    args = bench_gpu.parse_args(["--tiny", "--clip", "1.0", "--nvme-path", str(tmp_path)])
    with pytest.raises(bench_gpu.NotApplicable, match="--clip none"):
        bench_gpu.setup(case, args, torch.device("cpu"), {})
