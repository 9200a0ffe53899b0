"""The swap-traffic profiler: trace shape and nesting, summary vs trace, stalls, verdicts, CLI, plot, labels.

Most tests craft events with explicit perf_counter_ns times (`record`, `record_wait`,
`record_compute`) so numbers are exact; the threaded test uses the live begin/end API.
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections import defaultdict

import pytest

from zerotier import cli
from zerotier.config import ProfileConfig
from zerotier.errors import ZerotierError
from zerotier.profiler import REASONS, ROLES, TIERS, Profiler, load_trace, plot_trace, summarize

MS = 1_000_000  # ns
TRANSFER_ARGS = {"tensor", "role", "src", "dst", "bytes", "reason", "stall_us", "stream"}


def make_profiler(**kw) -> Profiler:
    kw.setdefault("record_function", False)
    residency = kw.pop("residency", None)
    peak_rates = kw.pop("peak_rates", None)
    unit_names = kw.pop("unit_names", None)
    planned = kw.pop("planned_rollback_rate", None)
    return Profiler(ProfileConfig(enabled=True, **kw), residency=residency, peak_rates=peak_rates if peak_rates
                    is not None else {}, unit_names=unit_names, planned_rollback_rate=planned)


def at(prof: Profiler, ms: float) -> int:
    """perf_counter_ns of `ms` milliseconds after the profiler's time 0."""
    return prof.t0_ns + int(ms * MS)


def xfer(prof, name, src, dst, start_ms, end_ms, reason="prefetch", role="param", nbytes=1 << 20, stream="worker",
         stall_ms=0.0):
    prof.record(name, role, src, dst, nbytes, reason, at(prof, start_ms), at(prof, end_ms), stream=stream,
                stall_ns=int(stall_ms * MS))


def span(prof, kind, start_ms, end_ms, thread="main", numel=0):
    prof.record_compute(kind, at(prof, start_ms), at(prof, end_ms), numel=numel, thread=thread)


def check_well_formed(trace: dict) -> None:
    """Every event has its fields; X events nest on every (pid, tid); every used track is named."""
    named = set()
    tracks = defaultdict(list)
    for e in trace["traceEvents"]:
        assert {"name", "ph", "pid", "tid"} <= set(e), e
        if e["ph"] == "M":
            assert e["name"] in {"process_name", "process_sort_index", "thread_name", "thread_sort_index"}
            if e["name"] == "thread_name":
                named.add((e["pid"], e["tid"]))
        elif e["ph"] == "X":
            assert {"ts", "dur", "cat", "args"} <= set(e), e
            assert e["dur"] >= 0 and e["ts"] >= 0
            tracks[(e["pid"], e["tid"])].append(e)
            if e["cat"] == "transfer":
                args = e["args"]
                assert set(args) - {"module"} == TRANSFER_ARGS  # module: when the unit's path is known
                assert args["reason"] in REASONS and args["role"] in ROLES
                assert args["src"] in TIERS and args["dst"] in TIERS and args["src"] != args["dst"]
                assert args["bytes"] >= 0 and args["stall_us"] >= 0
            else:
                assert e["cat"] in {"compute", "stall"}
        elif e["ph"] == "i":  # [Note: speculation counters]: a speculated window
            assert e["cat"] == "speculation" and e["s"] == "p" and set(e["args"]) == {
                "speculated", "rolled_back", "undo_bytes", "rollback_bytes", "rollback_s"}
        else:
            assert e["ph"] == "C" and e["cat"] in {"residency", "bandwidth"}
            assert all(isinstance(v, (int, float)) for v in e["args"].values())
    assert set(tracks) <= named
    for key, events in tracks.items():
        events.sort(key=lambda e: (e["ts"], -(e["ts"] + e["dur"])))
        open_ends: list[float] = []
        for e in events:
            while open_ends and open_ends[-1] <= e["ts"]:
                open_ends.pop()
            end = e["ts"] + e["dur"]
            assert not open_ends or end <= open_ends[-1], f"partial overlap on track {key}: {e}"
            open_ends.append(end)


def busy_profile() -> Profiler:
    """A small crafted step: forward with prefetches, backward with grad offload, NVMe optimizer."""
    prof = make_profiler(peak_rates={"h2d": 10e9, "d2h": 10e9, "nvme_read": 5e9, "nvme_write": 2e9})
    span(prof, "forward", 0, 10)
    span(prof, "backward", 10, 30)
    for i in range(4):
        xfer(prof, f"u{i:05d}.param", "nvme", "host", 2 * i, 2 * i + 3, nbytes=(i + 1) << 20)
        xfer(prof, f"u{i:05d}.param", "host", "device", 2 * i + 3, 2 * i + 4, nbytes=(i + 1) << 20)
        xfer(prof, f"u{i:05d}.grad", "device", "host", 12 + 4 * i, 13 + 4 * i, reason="grad-offload", role="grad",
             nbytes=(i + 1) << 22, stream="cuda:d2h")
    prof.record_wait("u00003.param", at(prof, 9), at(prof, 10), thread="main")
    span(prof, "step", 30, 45)
    for i, key in enumerate(("master", "exp_avg", "exp_avg_sq")):
        xfer(prof, f"u00000.{key}", "nvme", "host", 30 + i, 33 + i, reason="optimizer-read", role=key, nbytes=4 << 20)
        xfer(prof, f"u00000.{key}", "host", "nvme", 38 + i, 42 + i, reason="optimizer-write", role=key,
             nbytes=4 << 20)
    span(prof, "optimizer", 35, 38, numel=3 << 20)
    prof.prefetch_issued("u00001.param")
    prof.prefetch_issued("u00002.param")
    prof.prefetch_used("u00001.param", True)
    prof.prefetch_used("u00003.param", False)
    prof.prefetch_wasted("u00002.param")
    prof.sample({"device": (1 << 20, 8 << 20), "host": (4 << 20, 64 << 20)}, t_ns=at(prof, 0))
    prof.sample({"device": (3 << 20, 8 << 20), "host": (2 << 20, 64 << 20)}, t_ns=at(prof, 20))
    return prof


# ---------------------------------------------------------------------------------------------
# recording and the trace


def test_threads_trace_parses_is_complete_and_nests(tmp_path):
    samples = []

    def residency():
        samples.append(1)
        return {"device": (len(samples) << 20, 64 << 20), "host": (1 << 30, 4 << 30)}

    path = tmp_path / "trace.json"
    prof = make_profiler(residency=residency, sample_interval_ms=1.0, trace_path=str(path))
    per_thread = 50

    def worker(k: int) -> None:
        for i in range(per_thread):
            name = f"u{k:02d}{i:03d}.param"
            with prof.transfer(name, "param", "host", "device", 4096, "prefetch"):
                pass
            tok = prof.begin(f"u{k:02d}{i:03d}.master", "master", "nvme", "host", 8192, "optimizer-read")
            prof.end(tok)
            prof.prefetch_issued(name)

    threads = [threading.Thread(target=worker, args=(k,), name=f"zerotier-fetch_{k}") for k in range(4)]
    with prof.compute("forward"):
        for t in threads:
            t.start()
        for t in threads:
            with prof.waiting("u00000.param"):
                t.join()
    # async tickets issued by one thread, completing out of order: they partly overlap
    now = time.perf_counter_ns()
    for i in range(5):
        prof.record(f"u09{i:03d}.exp_avg", "exp_avg", "host", "nvme", 1 << 16, "optimizer-write",
                    now + i * 1000, now + i * 1000 + 2500 + (i % 2) * 3000, stream="nvme-io")
    time.sleep(0.01)
    assert prof.close() == str(path)
    assert prof.close() is None  # idempotent

    with open(path) as f:
        trace = json.load(f)
    check_well_formed(trace)
    transfers = [e for e in trace["traceEvents"] if e.get("cat") == "transfer"]
    assert len(transfers) == 4 * per_thread * 2 + 5
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert {f"zerotier-fetch_{k}" for k in range(4)} <= names
    assert "nvme-io" in names and "nvme-io #2" in names  # overlapping tickets went to a second lane
    residency_events = [e for e in trace["traceEvents"] if e.get("cat") == "residency"]
    assert len(residency_events) >= 2 * 2 and {e["name"] for e in residency_events} == {"residency device",
                                                                                          "residency host"}
    assert trace["zerotier"]["prefetch"]["issued"] == 4 * per_thread
    summary = summarize(trace)
    assert summary.stall_s > 0 and summary.transfers == len(transfers)


def test_interleaved_spans_on_one_thread_are_split_into_nested_lanes():
    prof = make_profiler()
    xfer(prof, "a", "host", "device", 0, 10, stream="s")
    xfer(prof, "b", "host", "device", 5, 15, stream="s")      # partial overlap with a
    xfer(prof, "c", "host", "device", 6, 8, stream="s")       # nests in a (and b)
    xfer(prof, "d", "host", "device", 10, 12, stream="s")     # starts where a ends
    xfer(prof, "e", "host", "device", 12.5, 12.5, stream="s")  # zero length
    span(prof, "backward", 0, 10)
    span(prof, "forward", 5, 20)                              # a caller's interleaved begin/end
    trace = prof.trace()
    check_well_formed(trace)
    lanes = {e["tid"] for e in trace["traceEvents"] if e.get("cat") == "transfer"}
    assert len(lanes) == 2


def test_transfer_validation_and_disabled_config():
    prof = make_profiler()
    with pytest.raises(ValueError, match="reason 'swap'"):
        prof.begin("x", "param", "host", "device", 1, "swap")
    with pytest.raises(ValueError, match="role 'weights'"):
        prof.record("x", "weights", "host", "device", 1, "demand", 0, 1)
    with pytest.raises(ValueError, match="'host' -> 'host'"):
        prof.record("x", "param", "host", "host", 1, "demand", 0, 1)
    with pytest.raises(ValueError, match="is before start_ns"):
        prof.record("x", "param", "host", "device", 1, "demand", 10, 9)
    with pytest.raises(ValueError, match="compute kind"):
        prof.compute_begin("loss")
    with pytest.raises(ValueError, match="no residency callable"):
        prof.sample()
    assert Profiler.from_config(ProfileConfig()) is None
    assert isinstance(Profiler.from_config(ProfileConfig(enabled=True, record_function=False)), Profiler)


def test_sampler_error_is_reported_not_raised():
    sampled = threading.Event()  # the sampler thread ran: no timing assumed, however loaded the machine

    def broken():
        sampled.set()
        raise RuntimeError("no stats")

    with pytest.warns(RuntimeWarning, match="residency sampling stopped: RuntimeError: no stats"):
        prof = make_profiler(residency=broken, sample_interval_ms=1.0)  # in the block: its thread warns here
        assert sampled.wait(timeout=60), "the sampler thread did not sample in 60 s"
        prof.close()  # joins the sampler thread: its warning is out before the block ends
    assert prof.trace()["zerotier"]["sampler_error"] == "RuntimeError: no stats"


def test_hot_path_costs_microseconds():
    prof = make_profiler()
    n = 20_000
    t0 = time.perf_counter()
    for _ in range(n):
        token = prof.begin("u00003.param", "param", "host", "device", 4096, "prefetch")
        prof.end(token)
    per_pair_us = (time.perf_counter() - t0) / n * 1e6
    assert per_pair_us < 25, f"{per_pair_us:.1f} µs per begin/end pair"  # ~1-2 µs here; loose for noisy CI


# ---------------------------------------------------------------------------------------------
# summary


def test_summary_matches_the_trace_and_the_saved_trace(tmp_path):
    prof = busy_profile()
    trace = prof.trace()
    summary = prof.report()
    transfers = [e["args"] for e in trace["traceEvents"] if e.get("cat") == "transfer"]
    per_link = defaultdict(int)
    for a in transfers:
        per_link[f"{a['src']}->{a['dst']}"] += a["bytes"]
    assert {k.link: k.bytes for k in summary.links} == per_link
    assert summary.total_bytes == sum(per_link.values()) and summary.transfers == len(transfers) == 18
    assert {r.reason: r.bytes for r in summary.reasons} == {
        reason: sum(a["bytes"] for a in transfers if a["reason"] == reason) for reason in {a["reason"] for a in
                                                                                         transfers}}
    assert [r.reason for r in summary.reasons] == ["prefetch", "optimizer-read", "optimizer-write", "grad-offload"]
    # grads: 4, 8, 12, 16 MiB; the largest (u00003.grad) leads
    assert summary.top_tensors[0].name == "u00003.grad" and summary.top_tensors[0].bytes == 16 << 20
    assert [t.bytes for t in summary.top_tensors] == sorted((t.bytes for t in summary.top_tensors), reverse=True)
    assert len(summary.top_tensors) == 10
    assert summary.top_tensors[2].reasons == ("optimizer-read", "optimizer-write")  # 8 MiB, after u00002.grad
    # nvme->host: u0000k.param (k+1 MiB, 3 ms each, overlapping) + 3 x 4 MiB optimizer reads
    nvme_read = next(k for k in summary.links if k.link == "nvme->host")
    assert nvme_read.bytes == (1 + 2 + 3 + 4 << 20) + (12 << 20)
    assert nvme_read.busy_s == pytest.approx((9 + 5) / 1e3)       # [0, 9] and [30, 35] ms
    assert nvme_read.gbps == pytest.approx(nvme_read.bytes / 14e-3 / 1e9)
    assert nvme_read.peak_gbps == 5.0 and nvme_read.pct_of_peak == pytest.approx(20 * nvme_read.gbps)
    assert summary.wall_s == pytest.approx(0.045)
    assert (summary.prefetch_issued, summary.prefetch_hits, summary.prefetch_misses, summary.prefetch_wasted) == \
        (2, 1, 1, 1)
    assert summary.prefetch_hit_rate == 0.5
    assert {r.tier: (r.peak_bytes, r.budget_bytes) for r in summary.residency} == \
        {"device": (3 << 20, 8 << 20), "host": (4 << 20, 64 << 20)}
    assert summary.optimizer_params_per_s == pytest.approx((3 << 20) / 3e-3)

    for name in ("trace.json", "trace.json.gz"):
        path = tmp_path / name
        prof.save(str(path))
        assert summarize(load_trace(str(path))) == summary
    json.dumps(summary.to_dict())
    table = summary.table()
    for text in ("nvme->host", "optimizer-read", "u00003.grad", "50.0% hit rate", "verdict:", "peak GB/s"):
        assert text in table


def test_stall_attribution():
    prof = make_profiler()
    span(prof, "forward", 0, 100)
    # prefetch on a worker from 0-10 ms; compute waits on it 5-12 ms: 5 ms overlap + 2 ms tail -> 7 ms
    xfer(prof, "u1.param", "host", "device", 0, 10)
    prof.record_wait("u1.param", at(prof, 5), at(prof, 12), thread="main")
    # a demand fetch made by the compute thread itself, inside forward: all 4 ms are stall
    xfer(prof, "u2.param", "host", "device", 20, 24, reason="demand", stream="main")
    # the same, but also inside an explicit wait: counted once
    prof.record_wait("u3.param", at(prof, 30), at(prof, 36), thread="main")
    xfer(prof, "u3.param", "nvme", "host", 30, 33, reason="demand", stream="main")
    xfer(prof, "u3.param", "host", "device", 33, 35, reason="demand", stream="main")
    # the caller knew the stall; a wait on a tensor never transferred is unmatched but counts
    xfer(prof, "u4.master", "nvme", "host", 40, 50, reason="optimizer-read", role="master", stall_ms=1.5)
    prof.record_wait("nothing", at(prof, 60), at(prof, 61), thread="main")
    trace = prof.trace()
    stall = {(e["args"]["tensor"], e["args"]["dst"]): e["args"]["stall_us"] / 1e3
             for e in trace["traceEvents"] if e.get("cat") == "transfer"}
    assert stall == pytest.approx({("u1.param", "device"): 7.0, ("u2.param", "device"): 4.0,
                                   ("u3.param", "host"): 3.0, ("u3.param", "device"): 3.0,
                                   ("u4.master", "host"): 1.5})
    matched = [e["args"]["matched"] for e in trace["traceEvents"] if e.get("cat") == "stall"]
    assert matched == [True, True, False]
    summary = summarize(trace)
    assert summary.stall_s == pytest.approx((7 + 4 + 6 + 1.5 + 1) / 1e3)
    assert {t.name: t.stall_s for t in summary.top_tensors}["u3.param"] == pytest.approx(6e-3)


def test_overlap_counts_only_compute_on_other_threads_outside_stalls():
    prof = make_profiler()
    span(prof, "forward", 0, 10)
    span(prof, "step", 20, 40)                              # a marker: hides nothing
    xfer(prof, "a", "host", "device", 5, 15)                # 5 of 10 ms under forward
    xfer(prof, "b", "host", "device", 0, 4, stream="main")  # the compute thread's own copy: not hidden
    xfer(prof, "c", "nvme", "host", 25, 35)                 # under "step" only
    prof.record_wait("x", at(prof, 8), at(prof, 9), thread="main")   # 1 ms of forward was a stall
    summary = prof.report()
    assert summary.overlap_pct == pytest.approx(100 * 4 / (10 + 4 + 10))
    assert summary.busy_s["compute"] == pytest.approx((10 - 4 - 1) / 1e3)


@pytest.mark.parametrize("verdict, build", [
    ("compute-bound", lambda p: (span(p, "forward", 0, 40), span(p, "backward", 40, 90),
                                 xfer(p, "a", "host", "device", 0, 20), xfer(p, "b", "nvme", "host", 30, 60))),
    ("PCIe-bound", lambda p: (span(p, "forward", 0, 20), xfer(p, "a", "host", "device", 0, 50),
                              xfer(p, "g", "device", "host", 40, 70, reason="grad-offload", role="grad"))),
    ("NVMe-bound", lambda p: (span(p, "backward", 0, 20), span(p, "optimizer", 20, 40),
                              xfer(p, "m", "nvme", "host", 0, 30, reason="optimizer-read", role="master"),
                              xfer(p, "m", "host", "nvme", 30, 70, reason="optimizer-write", role="master"))),
    ("CPU-optimizer-bound", lambda p: (span(p, "forward", 0, 10), span(p, "optimizer", 10, 60, numel=1000),
                                       xfer(p, "m", "nvme", "host", 10, 30, reason="optimizer-read",
                                            role="exp_avg_sq"))),
])
def test_verdict(verdict, build):
    prof = make_profiler()
    build(prof)
    summary = prof.report()
    assert summary.verdict == verdict
    assert summary.verdict_line.startswith(f"verdict: {verdict}:")
    assert summary.table().splitlines()[-1] == summary.verdict_line


def test_verdict_of_an_empty_profile_and_stalls_do_not_count_as_compute():
    prof = make_profiler()
    assert prof.report().verdict == "no activity"
    # 50 ms of forward, of which 40 ms waiting on a 40 ms PCIe copy: PCIe-bound, not compute-bound
    span(prof, "forward", 0, 50)
    xfer(prof, "a", "host", "device", 5, 45)
    prof.record_wait("a", at(prof, 5), at(prof, 45), thread="main")
    assert prof.report().verdict == "PCIe-bound"


def test_peak_rates_from_zerotier_bench(monkeypatch):
    import types

    fake = types.ModuleType("zerotier.bench")
    fake.load_rates = lambda: {"h2d": 25e9, "d2h": 20e9, "nvme_read": 7e9, "nvme_write": 4e9, "cpu_adam": 1.9e9}
    monkeypatch.setitem(sys.modules, "zerotier.bench", fake)
    prof = Profiler(ProfileConfig(enabled=True, record_function=False))
    xfer(prof, "a", "host", "device", 0, 1)
    link = prof.report().links[0]
    assert link.peak_gbps == 25.0 and prof.trace()["zerotier"]["peak_rates"]["cpu_adam"] == 1.9e9

    monkeypatch.setitem(sys.modules, "zerotier.bench", None)  # no bench module: no peaks, no error
    prof = Profiler(ProfileConfig(enabled=True, record_function=False))
    xfer(prof, "a", "host", "device", 0, 1)
    assert prof.report().links[0].peak_gbps is None and "-" in prof.report().table()


# ---------------------------------------------------------------------------------------------
# CLI and plot


def test_cli_profile_prints_the_table(tmp_path):
    path = tmp_path / "trace.json"
    busy_profile().save(str(path))
    done = subprocess.run([sys.executable, "-m", "zerotier.cli", "profile", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == summarize(load_trace(str(path))).table()
    assert "verdict: compute-bound" in done.stdout


def test_cli_profile_json_and_errors(tmp_path, capsys):
    path = tmp_path / "trace.json"
    busy_profile().save(str(path))
    assert cli.main(["profile", str(path), "--json", "--top", "3"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["verdict"] == "compute-bound" and len(report["top_tensors"]) == 3

    assert cli.main(["profile", str(tmp_path / "missing.json")]) == 1
    assert "cannot read trace" in capsys.readouterr().err
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"traceEvents": []}))
    assert cli.main(["profile", str(other)]) == 1
    assert "not a zerotier trace" in capsys.readouterr().err


def test_plot_png(tmp_path):
    """matplotlib is in the test extra: the plot is drawn, never skipped (its absence is tested below)."""
    prof = busy_profile()
    out = tmp_path / "profile.png"
    assert prof.report().plot(str(out)) == str(out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    trace_path = tmp_path / "trace.json"
    prof.save(str(trace_path))
    out2 = tmp_path / "cli.png"
    assert cli.main(["profile", str(trace_path), "--plot", str(out2)]) == 0
    assert out2.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)   # import fails as if not installed
    with pytest.raises(ZerotierError, match="pip install matplotlib"):
        plot_trace(busy_profile().trace(), str(tmp_path / "x.png"))


def test_profile_plot_without_matplotlib_fails_before_the_report(tmp_path, monkeypatch, capsys):
    trace_path = tmp_path / "trace.json"
    busy_profile().save(str(trace_path))
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)   # import fails as if not installed (also after a plot)
    assert cli.main(["profile", str(trace_path), "--plot", str(tmp_path / "x.png")]) == 1
    out, err = capsys.readouterr()
    assert out == "" and "pip install matplotlib" in err and "zerotier-offload[plot]" in err


# ---------------------------------------------------------------------------------------------
# torch.profiler labels


def test_record_function_labels_appear_in_torch_profiler():
    import torch
    from torch.profiler import ProfilerActivity, profile

    prof = make_profiler(record_function=True)
    quiet = make_profiler(record_function=False)
    outside = prof.begin("u00001.param", "param", "host", "device", 64, "prefetch")
    assert outside[-1] is None  # no torch profiler running: no label, no cost
    prof.end(outside)
    with profile(activities=[ProfilerActivity.CPU]) as tp:
        with prof.compute("forward"):
            with prof.transfer("u00003.param", "param", "host", "device", 4 * 64, "prefetch"):
                torch.ones(64).add_(1)
            with prof.waiting("u00004.param"):
                pass
        token = prof.begin("u00005.master", "master", "nvme", "host", 64, "optimizer-read")
        prof.end(token)
        with quiet.transfer("u00009.param", "param", "host", "device", 64, "demand"):
            pass
    labels = {e.name for e in tp.events()}
    assert {"zerotier::prefetch u00003.param host->device", "zerotier::forward", "zerotier::stall u00004.param",
            "zerotier::optimizer-read u00005.master nvme->host"} <= labels
    assert not any("u00009" in label for label in labels)
    assert len(prof.trace()["traceEvents"]) > 0


def test_compute_bound_verdict_does_not_claim_hidden_transfers_it_did_not_hide():
    """90 ms of compute, then a 30 ms copy after it: compute is busiest, but 0% of the transfer ran
    under it; the verdict must not say "transfers are hidden" (issue 13 item 7)."""
    prof = make_profiler()
    span(prof, "forward", 0, 90)
    xfer(prof, "a", "host", "device", 90, 120)
    summary = prof.report()
    assert summary.verdict == "compute-bound" and summary.overlap_pct == pytest.approx(0.0)
    assert "hidden" not in summary.verdict_line and "only 0% of transfer time" in summary.verdict_line


def test_long_runs_keep_the_newest_max_events_records():
    """profile.max_events bounds memory: the newest records are kept, and the trace says so."""
    prof = make_profiler(max_events=1000)
    for i in range(1500):
        with prof.transfer(f"u{i}.param", "param", "nvme", "host", 4096, "prefetch"):
            pass
    with pytest.warns(RuntimeWarning, match=r"newest 1,000 records of transfers \(profile\.max_events\)"):
        snap = prof.snapshot()
    assert len(snap["transfers"]) == 1000 and snap["transfers"][0][0] == "u500.param"
    prof.close()


def test_whole_run_totals_outlive_the_kept_window(tmp_path):
    """Past profile.max_events the tables cover the newest records, and the summary still gives
    the whole run's transfers and bytes per link (kept as running totals) and its prefetch
    outcomes (counted), also from a saved trace."""
    prof = make_profiler(max_events=1000)
    for i in range(1200):
        xfer(prof, f"u{i}.param", "nvme", "host", i, i + 0.5, nbytes=4096)
    for i in range(300):
        xfer(prof, f"u{i}.master", "host", "nvme", 1200 + i, 1200.5 + i, reason="optimizer-write", role="master",
             nbytes=8192)
    for i in range(1500):  # prefetch outcomes are counted, never dropped
        prof.prefetch_issued(f"u{i}.param")
        prof.prefetch_used(f"u{i}.param", hit=i % 3 != 0)
    with pytest.warns(RuntimeWarning, match="profile.max_events"):
        summary = prof.report()
    assert (summary.prefetch_issued, summary.prefetch_hits, summary.prefetch_misses) == (1500, 1000, 500)
    assert summary.transfers == 1000 and summary.total_bytes == 700 * 4096 + 300 * 8192
    assert summary.run_transfers == 1500 and summary.run_bytes == 1200 * 4096 + 300 * 8192
    assert summary.run_links == (("nvme->host", 1200, 1200 * 4096), ("host->nvme", 300, 300 * 8192))
    assert "  whole run: 1,500 transfers, 7.03 MiB moved (nvme->host 4.69 MiB, host->nvme 2.34 MiB); the figures " \
           "below cover the newest 1,000 (profile.max_events)" in summary.table().splitlines()
    path = tmp_path / "trace.json"
    with pytest.warns(RuntimeWarning):
        prof.save(str(path))
    trace = load_trace(str(path))
    assert trace["zerotier"]["run_totals"]["by_reason"] == {
        "prefetch": {"transfers": 1200, "bytes": 1200 * 4096}, "optimizer-write": {"transfers": 300, "bytes": 300 * 8192}}
    assert summarize(trace) == summary
    prof.close()

    small = make_profiler()  # nothing dropped: no whole-run line
    xfer(small, "a", "nvme", "host", 0, 1)
    assert small.report().run_transfers == 1 and "whole run" not in small.report().table()
    small.close()

    trace["zerotier"]["run_totals"]["by_link"]["nvme->host"]["bytes"] = -1
    path.write_text(json.dumps(trace))
    with pytest.raises(ZerotierError, match=r"zerotier\.run_totals\.by_link\.nvme->host\.bytes is -1, not a count"):
        load_trace(str(path))


class _FakeEvent:
    """A CUDA timing event as the profiler uses it: reached (query) after `lag` later records."""

    clock = 0

    def __init__(self, lag):
        _FakeEvent.clock += 1
        self.t, self.reached_at = _FakeEvent.clock, _FakeEvent.clock + lag

    def query(self):
        return _FakeEvent.clock >= self.reached_at

    def synchronize(self):
        _FakeEvent.clock = max(_FakeEvent.clock, self.reached_at)


def test_cuda_timing_records_stay_bounded(monkeypatch):
    """GPU review N11, checked on the CPU with fake events: event-timed records were kept until the
    report (millions on a long run); reached ones are now resolved as they pile up and the pending
    list never exceeds MAX_PENDING, whatever the device's lag ([Note: pending timings are bounded])."""
    import torch

    from zerotier.profiler import events as ev
    from zerotier.profiler.cuda_timing import PendingTimings

    class FakeClock:
        def __init__(self, device):
            pass

        def record(self, stream=None):
            return _FakeEvent(lag=3000)  # the device runs 3000 records behind the host

        def ns(self, event):
            event.synchronize()
            return event.t * 1000

    monkeypatch.setattr(ev, "CudaClock", FakeClock)
    prof = ev.Recorder(ProfileConfig(enabled=True, max_events=100_000, record_function=False),
                       device=torch.device("cuda"))
    timings = prof._cuda
    assert isinstance(timings, PendingTimings) and isinstance(timings.clock, FakeClock)
    most = 0
    for i in range(20_000):
        token = prof.wait_begin(f"u{i}", device=True)  # a device-side wait: timed by two events
        prof.wait_end(token)
        most = max(most, len(timings.pending))
    assert most <= PendingTimings.MAX_PENDING
    timings.resolve()
    assert not timings.pending and len(prof.snapshot()["waits"]) == 20_000


# ---------------------------------------------------------------------------------------------
# output that tells the truth (issue 26 item 7)


def _line(build, **kw):
    prof = make_profiler(**kw)
    build(prof)
    summary = prof.report()
    return summary, summary.verdict_line


def test_no_transfers_get_no_transfer_advice():
    """A run that moves nothing is told what bounds it, not to raise prefetch.lookahead."""
    summary, line = _line(lambda p: (span(p, "forward", 0, 40), span(p, "backward", 40, 90)))
    assert summary.verdict == "compute-bound"
    assert "nothing moved between tiers" in line and "compute alone" in line
    for advice in ("lookahead", "offload", "hidden", "prefetch"):
        assert advice not in line, line
    summary, line = _line(lambda p: (span(p, "forward", 0, 10), span(p, "optimizer", 10, 60, numel=100)))
    assert summary.verdict == "CPU-optimizer-bound" and "nothing moved" in line and "optimizer.threads" in line


@pytest.mark.parametrize("build, verdict, want, unwanted", [
    # the demo: params on the device, gradients copied off it after backward, nothing prefetched
    (lambda p: (span(p, "forward", 0, 40), span(p, "backward", 40, 90),
                xfer(p, "g", "device", "host", 90, 100, reason="grad-offload", role="grad")),
     "compute-bound", "offload.gradients", "lookahead"),
    (lambda p: (span(p, "forward", 0, 20),
                xfer(p, "g", "device", "host", 20, 70, reason="grad-offload", role="grad")),
     "PCIe-bound", "offload.gradients", "lookahead"),
    (lambda p: (span(p, "backward", 0, 20), span(p, "optimizer", 20, 40),
                xfer(p, "m", "host", "nvme", 40, 90, reason="optimizer-write", role="master")),
     "NVMe-bound", "offload.optimizer", "lookahead"),
    # parameters fetched by compute itself with prefetch off: turn it on, not "raise lookahead"
    (lambda p: (span(p, "forward", 0, 20), xfer(p, "w", "host", "device", 20, 70, reason="demand")),
     "PCIe-bound", "prefetch.enabled = true", "raise prefetch.lookahead"),
    # late prefetches: here lookahead is the advice
    (lambda p: (span(p, "forward", 0, 20), xfer(p, "w", "host", "device", 20, 70), p.prefetch_issued("w")),
     "PCIe-bound", "raise prefetch.lookahead", "offload.gradients"),
])
def test_transfer_advice_names_the_reason_that_was_exposed(build, verdict, want, unwanted):
    summary, line = _line(build)
    assert summary.verdict == verdict
    assert want in line and unwanted not in line, line


def test_a_link_faster_than_its_saved_peak_marks_the_peak_stale():
    """'% of peak' read 154-277%: a figure above 100% is no share of a peak, it says the saved
    peak is stale; the table says so and how to measure again (issue 26 item 7)."""
    def build(p):
        span(p, "optimizer", 0, 1, numel=4_000_000)                      # 4e9 params/s
        xfer(p, "m", "host", "nvme", 0, 1, reason="optimizer-write", role="master", nbytes=3_000_000)
        xfer(p, "m", "nvme", "host", 2, 3, reason="optimizer-read", role="master", nbytes=500_000)
    summary, _ = _line(build, peak_rates={"nvme_write": 1e9, "nvme_read": 1e9, "cpu_adam": 1e9})
    write, read = summary.links
    assert write.peak_stale and write.pct_of_peak == pytest.approx(300.0)
    assert not read.peak_stale and read.pct_of_peak == pytest.approx(50.0)
    table = summary.table()
    assert "300%" not in table and "400%" not in table
    assert "host->nvme ran at 3.00 GB/s, above its saved peak of 1.00 GB/s: that figure is stale" in table
    assert "`zerotier bench io --path DIR_ON_THE_DRIVE`" in table
    assert "above the saved cpu_adam peak of 1,000 M: that figure is stale" in table
    assert "50%" in table


def test_prefetch_line_when_params_stay_on_the_device():
    """`prefetch 0 issued, 0 hits ...` meant nothing with params on the device (issue 26 item 7)."""
    summary, _ = _line(lambda p: (span(p, "backward", 0, 10),
                                  xfer(p, "g", "device", "host", 5, 8, reason="grad-offload", role="grad")))
    table = summary.table()
    assert "  prefetch: params on device: nothing to prefetch (no parameter was fetched onto it)" in table
    assert "issued" not in table
    summary, _ = _line(lambda p: (span(p, "forward", 0, 10), xfer(p, "w", "host", "device", 0, 1, reason="demand"),
                                  p.prefetch_used("w", False)))
    assert summary.param_fetches == 1 and "prefetch 0 issued, 0 hits, 1 misses" in summary.table()


def _three_steps() -> Profiler:
    """Three steps of 100 ms: forward 20, backward 40, a gradient copy 60-70 that compute waits on
    for 5 ms, CPU Adam 70-90 on the optimizer thread, an NVMe read 90-95 while nothing runs."""
    prof = make_profiler(peak_rates={"nvme_read": 1e9})
    for k in range(3):
        o = 100 * k
        span(prof, "forward", o, o + 20)
        span(prof, "backward", o + 20, o + 60)
        xfer(prof, "g", "device", "host", o + 60, o + 70, reason="grad-offload", role="grad")
        prof.record_wait("g", at(prof, o + 60), at(prof, o + 65), thread="main")
        span(prof, "optimizer", o + 70, o + 90, thread="opt", numel=1000)
        xfer(prof, "m", "nvme", "host", o + 90, o + 95, reason="optimizer-read", role="master", stream="io")
    prof.sample({"device": (1 << 20, 2 << 20), "host": (3 << 20, 1 << 40)}, t_ns=at(prof, 0))
    return prof


def test_step_times_add_up_to_each_step():
    """The plot's bars ([Note: step time]): steps cut at the first forward after optimizer work;
    compute, stall, CPU optimizer, exposed transfer and other add up to the step's wall time."""
    from zerotier.profiler import step_times

    steps = step_times(_three_steps().trace())
    assert [round(s.start_s, 6) for s in steps] == [0.0, 0.1, 0.2]
    for s in steps:
        assert (s.compute_s, s.stall_s, s.cpu_optimizer_s, s.exposed_transfer_s) == pytest.approx(
            (0.060, 0.005, 0.020, 0.010))
        assert s.compute_s + s.stall_s + s.cpu_optimizer_s + s.exposed_transfer_s + s.other_s == \
            pytest.approx(s.wall_s)
    assert steps[0].other_s == pytest.approx(0.005) and steps[-1].wall_s == pytest.approx(0.095)
    # accumulation: two forwards with no optimizer work between them are one step
    prof = make_profiler()
    span(prof, "forward", 0, 10), span(prof, "backward", 10, 20), span(prof, "forward", 20, 30)
    span(prof, "backward", 30, 40), span(prof, "optimizer", 40, 50), span(prof, "forward", 50, 60)
    assert [round(s.wall_s, 6) for s in step_times(prof.trace())] == [0.05, 0.01]


def test_plot_shows_step_time_bandwidth_and_residency_with_legends_outside(tmp_path, monkeypatch):
    """Issue 26 item 7: a stacked bar per step, bandwidth per link with its saved peak, one readable
    residency panel per tier against its budget; no legend over the data."""
    from matplotlib.figure import Figure

    drawn = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (drawn.append(fig), save(fig, *a, **k))[1])
    out = tmp_path / "p.png"
    plot_trace(_three_steps().trace(), str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size < 200_000
    fig, = drawn
    steps, bandwidth, device, host = fig.axes
    assert steps.get_title() == ("where step time goes (3 steps: compute 61%, stall 5%, CPU optimizer 20%, "
                                 "exposed transfer 10%, other 3%)")   # 180, 15, 60, 30, 10 of 295 ms
    assert [t.get_text() for t in steps.get_legend().get_texts()][:4] == [
        "compute", "stall (compute waits on a transfer)", "CPU optimizer", "exposed transfer (nothing else runs)"]
    assert len(steps.patches) == 3 * 5                        # five parts per bar
    assert "nvme->host saved peak 1.00 GB/s" in [t.get_text() for t in bandwidth.get_legend().get_texts()]
    assert device.get_title().startswith("device: peak 1.00 MiB of 2.00 MiB (50%)\n(dashed: budget)")
    assert host.get_title() == "host: peak 3.00 MiB of 1.00 TiB (0%)\n(budget off this scale)"
    assert host.get_ylim()[1] < 4                             # MiB: the curve is not squashed by the budget
    renderer = fig.canvas.get_renderer()
    for ax in (steps, bandwidth):
        assert ax.get_legend().get_window_extent(renderer).x0 >= ax.get_window_extent(renderer).x1


def test_plot_marks_steps_and_rollbacks_keeps_compute_thin_and_draws_the_plan(tmp_path):
    """Issue 35 item 8: compute is a thin band, not a grey fill under the whole bandwidth panel; each link
    its own line style; step boundaries and rollbacks marked in the time panels; with a plan, its
    components beside the measured ones."""
    from zerotier.profiler import plot as plot_module

    prof = _three_steps()
    xfer(prof, "p", "host", "nvme", 92, 96, reason="optimizer-write", role="master", stream="io2")
    prof.speculation(2, 2, 0, 0, 0.0)
    prof.speculation(2, 0, 0, 0, 0.0)
    trace = prof.trace()
    marks = [e for e in trace["traceEvents"] if e.get("cat") == "speculation"]
    start_us = trace["zerotier"]["window_us"][0]
    marks[0]["ts"], marks[1]["ts"] = start_us + 150_000, start_us + 250_000  # rolled back in step 2, validated in 3
    plan = {"predicted_step_s": 0.09, "breakdown_s": {"forward": 0.020, "backward": 0.030, "grad_norm": 0.001}}
    fig = plot_module.figure(trace, plan)
    steps, planned, bandwidth, device, host = fig.axes
    gids = lambda ax: [a.get_gid() for a in ax.get_children() if a.get_gid()]  # noqa: E731
    # compute: one thin band along the bottom (axes height 0.035), no full-height span
    band, = [a for a in bandwidth.collections if a.get_gid() == "compute-band"]
    heights = {round(p.get_extents().height, 6) for p in band.get_paths()}
    assert heights == {0.035} and len(band.get_paths()) == 3 * 2   # forward+backward and the optimizer, per step
    assert not [p for p in bandwidth.patches if p.get_height() >= 1.0]
    # links: distinct line styles, the busiest drawn widest
    lines = {a.get_gid(): a for a in bandwidth.lines if (a.get_gid() or "").startswith("link ")}
    assert set(lines) == {"link device->host", "link nvme->host", "link host->nvme"}
    assert len({(a.get_linestyle(), a.get_color()) for a in lines.values()}) == 3
    # step boundaries at 100 and 200 ms in the bandwidth and residency panels
    for ax in (bandwidth, device, host):
        assert sorted(round(a.get_xdata()[0], 6) for a in ax.lines if a.get_gid() == "step-boundary") == [0.1, 0.2]
    # the rollback: a triangle on top of the bandwidth panel, a line in residency, a mark over step 2's bar
    top, = [a for a in bandwidth.lines if a.get_gid() == "rollback"]
    assert list(top.get_xdata()) == [pytest.approx(0.15)] and top.get_marker() == "v"
    assert [round(a.get_xdata()[0], 6) for a in device.lines if a.get_gid() == "rollback"] == [0.15]
    over, = [a for a in steps.lines if a.get_gid() == "rollback"]
    assert list(over.get_xdata()) == [2] and list(over.get_ydata()) == [pytest.approx(100.0)]
    assert "speculation rolled back" in [t.get_text() for t in bandwidth.get_legend().get_texts()]
    assert "step boundary" in [t.get_text() for t in bandwidth.get_legend().get_texts()]
    # the plan: planned beside measured per component (forward 20 ms per step measured, 20 planned)
    bars = {gid: [p for p in planned.patches if p.get_gid() == gid] for gid in ("plan-planned", "plan-measured")}
    names = [t.get_text() for t in planned.get_yticklabels()]
    assert names[::-1][:3] == ["forward", "backward", "grad_norm"]
    widths = {gid: dict(zip(names, [round(p.get_width(), 3) for p in v])) for gid, v in bars.items()}
    assert widths["plan-planned"]["forward"] == 20.0 and widths["plan-measured"]["forward"] == 20.0
    assert widths["plan-planned"]["backward"] == 30.0 and widths["plan-measured"]["backward"] == 40.0
    assert widths["plan-measured"]["grad_norm"] == 0.0 and "not timed" in [t.get_text().strip() for t in planned.texts]
    assert planned.get_title().startswith("planned vs measured (furthest: ")
    # without a plan: no plan panel; the CLI draws one with --plan
    assert len(plot_module.figure(trace).axes) == 4
    path, plan_path = tmp_path / "t.json", tmp_path / "plan.json"
    prof.save(str(path))
    plan_path.write_text(json.dumps(plan))
    assert cli.main(["profile", str(path), "--plan", str(plan_path), "--plot", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_link_bound_run_whose_transfers_were_all_hidden_is_told_so():
    """PCIe busier than compute and than the optimizer, every transfer under one or the other: no
    advice about a reason that exposed nothing."""
    def build(p):
        span(p, "forward", 0, 30)
        span(p, "optimizer", 20, 50, thread="opt")
        xfer(p, "w", "host", "device", 0, 50)
    summary, line = _line(build)
    assert summary.verdict == "PCIe-bound" and summary.overlap_pct == pytest.approx(100.0)
    assert line.endswith("its transfers all ran under compute or the optimizer: none was exposed"), line


# ---------------------------------------------------------------------------------------------
# the speculative step ([Note: speculation counters])


def speculating_profile() -> Profiler:
    """busy_profile's step, then 40 speculated windows of 32 units each, two of them rolled back."""
    prof = busy_profile()
    for step in range(40):
        if step in (7, 30):
            prof.speculation(32, 32, 3 << 20, 5 << 20, 0.25)
        else:
            prof.speculation(32, 0, 3 << 20, 0, 0.0)
    return prof


def test_speculation_counts_reach_the_trace_the_summary_and_a_saved_trace(tmp_path):
    prof = speculating_profile()
    trace = prof.trace()
    check_well_formed(trace)
    assert trace["zerotier"]["speculation"] == {
        "windows": 40, "rolled_back_windows": 2, "speculated_units": 1280, "rolled_back_units": 64,
        "undo_bytes": 120 << 20, "rollback_bytes": 10 << 20, "rollback_s": 0.5}
    marks = [e for e in trace["traceEvents"] if e.get("cat") == "speculation"]
    assert [e["name"] for e in marks].count("speculation rolled back") == 2 and len(marks) == 40
    s = summarize(trace)
    assert (s.speculation_windows, s.rolled_back_windows, s.speculated_units, s.rolled_back_units) == (40, 2, 1280, 64)
    assert s.rollback_rate == 0.05 and s.undo_bytes == 120 << 20 and s.rollback_bytes == 10 << 20
    assert s.rollback_s == 0.5 and s.to_dict()["rollback_rate"] == 0.05
    assert ("speculative step: 40 windows speculated (1,280 units), 2 rolled back: rollback rate 5.0%; undo "
            "copies 120.00 MiB; rollbacks moved 10.00 MiB and took 500.0 ms (250.0 ms each)") in s.table()
    path = tmp_path / "trace.json.gz"
    prof.save(str(path))
    assert summarize(load_trace(str(path))) == s


def test_speculation_counts_outlive_the_kept_records_and_a_run_without_speculation_prints_nothing():
    prof = make_profiler(max_events=1000)
    for _ in range(1099):
        prof.speculation(2, 0, 100, 0, 0.0)
    prof.speculation(2, 2, 100, 300, 0.01)
    with pytest.warns(RuntimeWarning, match="records of speculation"):
        trace = prof.trace()
    assert len([e for e in trace["traceEvents"] if e.get("cat") == "speculation"]) == 1000
    s = summarize(trace)
    assert s.speculation_windows == 1100 and s.rollback_rate == pytest.approx(1 / 1100)
    plain = summarize(busy_profile().trace())
    assert plain.rollback_rate is None and "speculative step" not in plain.table()


def test_speculation_arguments_are_checked():
    prof = make_profiler()
    for args in ((2, 3, 0, 0, 0.0), (-1, 0, 0, 0, 0.0), (2, 0, 1.5, 0, 0.0), (2, 2, 0, 0, -1.0),
                 (2, 2, 0, 0, float("nan"))):
        with pytest.raises(ValueError, match="profiler.speculation"):
            prof.speculation(*args)
    assert summarize(prof.trace()).speculation_windows == 0  # nothing half-recorded


def test_a_damaged_speculation_object_is_refused(tmp_path):
    trace = speculating_profile().trace()
    trace["zerotier"]["speculation"]["rolled_back_windows"] = 41
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(trace))
    with pytest.raises(ZerotierError, match="more windows rolled back than speculated"):
        load_trace(str(path))
    trace["zerotier"]["speculation"]["rolled_back_windows"] = "2"
    path.write_text(json.dumps(trace))
    with pytest.raises(ZerotierError, match="rolled_back_windows"):
        load_trace(str(path))


def test_cli_profile_prints_the_rollback_rate_and_compares_it_with_the_plan(tmp_path, capsys):
    path = tmp_path / "trace.json"
    speculating_profile().save(str(path))
    assert cli.main(["profile", str(path)]) == 0
    assert "rollback rate 5.0%" in capsys.readouterr().out
    plan = {"predicted_step_s": 0.05, "breakdown_s": {"forward": 0.010, "backward": 0.020, "speculation": 0.002},
            "speculative": True, "rollback_rate": 0.01,
            "speculation_step_s": {"commit": 0.040, "rollback": 0.080, "expected": 0.0404, "without": 0.050}}
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(plan))
    assert cli.main(["profile", str(path), "--plan", str(plan_path)]) == 0
    out = capsys.readouterr().out
    # 5% of windows rolled back: 0.95 x 40 ms + 0.05 x 80 ms = 42 ms
    assert ("plan: rollback rate measured 5.0% (2 of 40 windows) vs planned 1.0%; at the measured rate the plan "
            "expects 42.0 ms per step (commit 40.0 ms, rollback 80.0 ms, without speculation 50.0 ms)") in out
    assert "furthest from the plan: speculation" not in out  # not a span of its own: never the verdict
    assert cli.main(["profile", str(path), "--plan", str(plan_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["rollback_rate"] == 0.05 and "measured 5.0%" in report["plan"]["speculation"]
    plain = tmp_path / "plain.json"
    busy_profile().save(str(plain))
    assert cli.main(["profile", str(plain), "--plan", str(plan_path)]) == 0
    assert "no window speculated in the trace" in capsys.readouterr().out


GOOD_PLAN = {"predicted_step_s": 0.05, "breakdown_s": {"forward": 0.010, "backward": 0.020, "speculation": 0.002},
             "speculative": True, "rollback_rate": 0.01,
             "speculation_step_s": {"commit": 0.040, "rollback": 0.080, "expected": 0.0404, "without": 0.050}}
# Crafted `zerotier profile --plan` files (issue 37 row 16): nine of these were tracebacks (AttributeError,
# TypeError, ValueError, KeyError), the others passed silently into the comparison.
CRAFTED_PLANS = [
    ("not JSON", "{", r"--plan: cannot read .*Expecting"),
    ("a list", "[1]", r"the file: expected a JSON object, got 'list'"),
    ("null", "null", r"the file: expected a JSON object"),
    ("no breakdown", {"breakdown_s": None}, r"breakdown_s: expected an object of seconds per component"),
    ("breakdown a list", {"breakdown_s": [1]}, r"breakdown_s: expected an object"),
    ("a string time", {"breakdown_s": {"forward": "1"}}, r"breakdown_s\.forward: expected seconds, a number from 0"),
    ("a null time", {"breakdown_s": {"forward": None}}, r"breakdown_s\.forward: .*got None"),
    ("a NaN time", {"breakdown_s": {"forward": float("nan")}}, r"breakdown_s\.forward: .*got nan"),
    ("a negative time", {"breakdown_s": {"forward": -1}}, r"breakdown_s\.forward: .*got -1"),
    ("a bool time", {"breakdown_s": {"forward": True}}, r"breakdown_s\.forward: .*got True"),
    ("a huge time", {"breakdown_s": {"forward": 1e308}}, r"breakdown_s\.forward: .*got 1e\+308"),
    ("predicted a string", {"predicted_step_s": "x"}, r"predicted_step_s: expected seconds.* or null, got 'x'"),
    ("predicted infinite", {"predicted_step_s": float("inf")}, r"predicted_step_s: .*got inf"),
    ("rollback rate a string", {"rollback_rate": "x"}, r"rollback_rate: expected a share from 0 to 1"),
    ("rollback rate above 1", {"rollback_rate": 5}, r"rollback_rate: .*got 5"),
    ("speculative a string", {"speculative": "yes"}, r"speculative: expected true, false or null"),
    ("speculation cases a list", {"speculation_step_s": [1]}, r"speculation_step_s: expected an object"),
    ("no step without speculation", {"speculation_step_s": {"commit": 1, "rollback": 2}},
     r"speculation_step_s\.without: .*got None"),
    ("a string case", {"speculation_step_s": {"commit": "1", "rollback": 2, "without": 3}},
     r"speculation_step_s\.commit: .*got '1'"),
]


@pytest.mark.parametrize("name, corruption, message", CRAFTED_PLANS, ids=[c[0] for c in CRAFTED_PLANS])
def test_a_crafted_plan_file_is_refused_naming_the_file_and_key(tmp_path, capsys, name, corruption, message):
    """Issue 37 row 16: a damaged --plan file is one ConfigError line naming the file and the key."""
    import re

    from zerotier.errors import ConfigError
    from zerotier.profiler.versus_plan import load_plan

    trace = tmp_path / "trace.json"
    speculating_profile().save(str(trace))
    plan = tmp_path / "plan.json"
    plan.write_text(corruption if isinstance(corruption, str) else json.dumps({**GOOD_PLAN, **corruption}))
    with pytest.raises(ConfigError, match=message) as raised:
        load_plan(str(plan))
    assert str(plan) in str(raised.value)
    assert cli.main(["profile", str(trace), "--plan", str(plan)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(message, err) and err.startswith("zerotier profile: error: "), err
    plan.write_text(json.dumps(GOOD_PLAN))
    assert load_plan(str(plan)) == GOOD_PLAN


# ---------------------------------------------------------------------------------------------
# tensors named by their module (issue 35 item 8)


def test_tensors_are_named_by_their_module_in_the_table_and_the_trace(tmp_path):
    """`unit_names` (the engine's unit key -> module path) names each tensor `layers.3 (u00003).exp_avg`
    in the table, in the Perfetto slice names and as the events' `module` arg; a saved trace keeps it."""
    prof = make_profiler(unit_names={"u00000": "", "u00001": "layers.1", "u00003": "layers.3"})
    xfer(prof, "u00003.exp_avg", "nvme", "host", 0, 2, reason="optimizer-read", role="exp_avg", nbytes=8 << 20)
    xfer(prof, "u00000.param", "host", "device", 2, 3, nbytes=4 << 20, stream="main")
    xfer(prof, "u00002.param", "host", "device", 3, 4, nbytes=2 << 20)  # no path given: stays its key
    span(prof, "forward", 0, 5)
    prof.record_wait("u00003.exp_avg", at(prof, 1), at(prof, 2), thread="main")
    trace = prof.trace()
    check_well_formed(trace)
    names = {e["name"]: e["args"] for e in trace["traceEvents"] if e.get("ph") == "X" and e["cat"] != "compute"}
    assert names["optimizer-read layers.3 (u00003).exp_avg nvme->host"]["module"] == "layers.3"
    assert names["prefetch <root> (u00000).param host->device"]["module"] == "<root>"
    assert "module" not in names["prefetch u00002.param host->device"]
    assert names["stall layers.3 (u00003).exp_avg"] == {"tensor": "u00003.exp_avg", "matched": True,
                                                        "thread": "main", "module": "layers.3"}
    s = summarize(trace)
    table = s.table()
    assert "  1  layers.3 (u00003).exp_avg exp_avg" in table, table
    assert "<root> (u00000).param" in table and " u00002.param " in table
    assert [t.name for t in s.top_tensors] == ["u00003.exp_avg", "u00000.param", "u00002.param"]
    path = tmp_path / "trace.json"
    prof.save(str(path))
    assert summarize(load_trace(str(path))) == s
    saved = json.loads(path.read_text())
    saved["zerotier"]["unit_names"]["u00001"] = 3
    path.write_text(json.dumps(saved))
    with pytest.raises(ZerotierError, match="unit_names.u00001"):
        load_trace(str(path))


def test_host_device_moves_on_a_cpu_only_machine_get_no_bandwidth():
    """[Note: same memory] On the CPU the device is host RAM: a host->device "transfer" of 1 GiB in 1 ms is
    no 1000 GB/s link; the same records from a GPU keep their bandwidth (issue 35 item 8)."""
    for device in ("cpu", "cuda"):
        prof = Profiler(ProfileConfig(enabled=True, record_function=False), peak_rates={"nvme_read": 2e9})
        prof.device_type = device  # the machine the trace was taken on (a CUDA clock is not wanted here)
        xfer(prof, "u00001.param", "host", "device", 0, 1, nbytes=1 << 30)
        xfer(prof, "u00001.param", "nvme", "host", 1, 3, nbytes=1 << 20)
        s = summarize(prof.trace())
        links = {k.link: k for k in s.links}
        assert links["nvme->host"].gbps == pytest.approx((1 << 20) / 2e-3 / 1e9) and not links["nvme->host"].same_memory
        if device == "cpu":
            assert links["host->device"].same_memory and links["host->device"].gbps is None
            assert links["host->device"].pct_of_peak is None and not links["host->device"].peak_stale
            assert "  host->device (same memory)" in s.table() and "1073.74" not in s.table()
            assert s.to_dict()["links"][0]["gbps"] is None
        else:
            assert not links["host->device"].same_memory and "(same memory)" not in s.table()
            assert links["host->device"].gbps == pytest.approx(1073.74, rel=1e-3)


def test_a_rollback_rate_far_above_the_plans_is_warned_about_with_what_to_do(tmp_path, capsys):
    """The plan assumes 1% of speculated windows roll back; a fresh model rolled back 3 of 3 (issue 35 item 8):
    the summary puts the measured rate beside the assumed one and, past 3x, warns and says what to do."""
    prof = make_profiler(planned_rollback_rate=0.01)
    span(prof, "forward", 0, 5)
    for _ in range(3):
        prof.speculation(4, 4, 1 << 20, 1 << 20, 0.01)
    s = summarize(prof.trace())
    assert s.planned_rollback_rate == 0.01 and s.rollback_rate == 1.0
    table = s.table()
    assert "rolled back: rollback rate 100.0% (the plan assumed 1.0%)" in table
    assert ("warning: 100.0% of the speculated windows rolled back (3 of 3), 100.0x the 1.0% the plan assumed: its "
            "expected step is optimistic") in table
    assert "set train.overlap = 'none', or plan at the measured rate: zerotier.plan(..., rollback_rate=1.00)" \
        in table and "zerotier plan --rollback-rate 1.00" in table
    path = tmp_path / "trace.json"
    prof.save(str(path))
    assert summarize(load_trace(str(path))) == s
    # within 3x of the plan: the rate beside the plan's, no warning; no plan recorded: no comparison
    near = make_profiler(planned_rollback_rate=0.05)
    for k in range(40):
        near.speculation(4, 4 if k in (3, 9) else 0, 0, 0, 0.0)
    assert "rollback rate 5.0% (the plan assumed 5.0%)" in summarize(near.trace()).table()
    assert "warning" not in summarize(near.trace()).table()
    assert "the plan assumed" not in summarize(speculating_profile().trace()).table()
    # zerotier profile --plan warns the same, from the plan file's rate: 5% measured vs 1% planned
    speculating_profile().save(str(path))
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(GOOD_PLAN))
    assert cli.main(["profile", str(path), "--plan", str(plan_path)]) == 0
    out = capsys.readouterr().out
    assert "plan: warning: 5.0% of the speculated windows rolled back (2 of 40), 5.0x the 1.0% the plan assumed" in out
    assert "warning" not in capsys.readouterr().out
    path.write_text(path.read_text().replace('"planned_rollback_rate":null', '"planned_rollback_rate":2'))
    with pytest.raises(ZerotierError, match="planned_rollback_rate is 2"):
        load_trace(str(path))
