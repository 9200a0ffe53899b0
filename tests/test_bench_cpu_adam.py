"""benchmarks/bench_cpu_adam.py's memory-bandwidth rows (issue 36 item 5): the STREAM-style copy and
triad it times beside the state-dtype kernels, and the GB/s and share of triad it prints."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_cpu_adam  # noqa: E402


def test_stream_copy_and_triad_count_their_bytes_over_the_tables_params():
    fns = bench_cpu_adam.stream_fns(1000, 10)
    copy, triad = (fns[k] for k in bench_cpu_adam.STREAM)
    assert copy.bytes_per_param * 10 == 8 * 1000 and triad.bytes_per_param * 10 == 12 * 1000
    copy()
    triad()


def test_state_table_reports_gbps_and_the_share_of_triad(capsys):
    n = 1_000_000
    rows = {"zerotier fp32 master, fp32 moments": 0.01, "torch fused (fp32 state)": 0.02,
            "stream copy": 0.5, "stream triad": 0.5}
    moved = {"zerotier fp32 master, fp32 moments": 28, "torch fused (fp32 state)": 28,
             "stream copy": 8 * 64, "stream triad": 12 * 64}
    gbps = bench_cpu_adam.report_states(rows, n, moved, threads=2)
    assert gbps["zerotier fp32 master, fp32 moments"] == pytest.approx(2.8)
    assert gbps["stream triad"] == pytest.approx(12 * 64 * n / 0.5 / 1e9)
    out = capsys.readouterr().out
    share = 100 * 2.8 / gbps["stream triad"]
    assert f"{share:8.0f}%" in out and "triad 1.5 GB/s" in out and "\n  stream" not in out
