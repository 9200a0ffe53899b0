"""CI version of benchmarks/bench_rss_scale.py: with params, gradients and optimizer state on
NVMe, host memory does not grow with the model — 4x the layers (same largest unit) moves
the host pool's peak and the process's peak RSS by no more than allocator noise, while a
host-resident model would add ~16 bytes per parameter."""
import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "zt_rss_scale", Path(__file__).parent.parent / "benchmarks" / "bench_rss_scale.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

MiB = 1 << 20


def test_host_memory_is_flat_in_model_size(tmp_path):
    r = bench.run(dim=512, layers=[2, 8], nvme_path=str(tmp_path), host="1GiB")
    small, large = r["rows"]
    added = large["numel"] - small["numel"]
    assert added > 18_000_000  # 16 B per added parameter would be ~290 MB of host memory
    # The pool's peak is the staging of the largest unit and the units in flight: equal up to
    # which writes happened to be in flight at the peak.
    assert abs(large["host_pool_peak"] - small["host_pool_peak"]) < 16 * MiB, r
    # RSS: the same, plus allocator noise and per-unit bookkeeping (32 more units).
    assert large["peak_rss"] - small["peak_rss"] < 32 * MiB, r
    assert not list(tmp_path.iterdir()), "run directories left behind"
