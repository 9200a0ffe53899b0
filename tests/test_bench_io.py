"""benchmarks/bench_io.py's store-vs-fio rounds ([Note: store vs fio rounds]): the order alternates
inside each round, the verdict is the median of the rounds' ratios, fio's absence is said, and
nothing is left on disk. Sizes are tiny: these check the bookkeeping, not the drive."""
from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_io  # noqa: E402

ARGS = ["--rounds", "3", "--total", "4MiB", "--shard", "1MiB"]


def test_without_fio_the_store_runs_alone_and_says_why(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))
    assert bench_io.main([*ARGS, "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "fio: n/a (fio not found on PATH" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["1"], ["2"], ["3"])]
    assert len(rows) == 3 and all(r[4] == "n/a" and float(r[5]) > 0 for r in rows), out
    assert "PASS" not in out and "MISS" not in out  # no verdict without the reference
    assert os.listdir(tmp_path) == []  # the run directory and every file are gone


class FakeFio:
    """Stands in for fio_phase: a fixed rate per call, each call logged beside the store's phases."""

    def __init__(self, log: list, rates: list[float]):
        self.log, self.rates = log, iter(rates)

    def __call__(self, cfg, directory, rw, total, shard, prealloc):
        assert len(os.listdir(os.path.dirname(directory))) == 2  # fio/ and store/ side by side
        self.log.append(("fio", rw))
        return bench_io.Result(next(self.rates), 0.0)


def test_rounds_alternate_the_order_and_take_the_median_of_ratios(tmp_path, monkeypatch, capsys):
    log: list = []
    # fio's rate per call: first write, then (write, read) per round
    fio = FakeFio(log, [9.0, 1.0, 1.0, 0.01, 0.01, 100.0, 100.0])
    monkeypatch.setattr(bench_io, "fio_unavailable", lambda: None)
    monkeypatch.setattr(bench_io, "fio_phase", fio)
    store_rates: list = []
    phase = bench_io.StoreBench.phase

    def logged(self, op):
        res = phase(self, op)
        log.append(("store", op))
        store_rates.append(res.gbps)
        return res

    monkeypatch.setattr(bench_io.StoreBench, "phase", logged)
    jsonl = tmp_path / "rounds.jsonl"
    assert bench_io.main([*ARGS, "--dir", str(tmp_path), "--json", str(jsonl)]) == 0
    out = capsys.readouterr().out
    assert log == [("store", "write"), ("fio", "write"), ("store", "write"),              # new files
                   ("fio", "write"), ("store", "write"), ("fio", "read"), ("store", "read"),  # round 1
                   ("store", "write"), ("fio", "write"), ("store", "read"), ("fio", "read"),  # round 2
                   ("fio", "write"), ("store", "write"), ("fio", "read"), ("store", "read")]  # round 3
    fio_rates = {"write": [1.0, 0.01, 100.0], "read": [1.0, 0.01, 100.0]}
    store = {"write": [store_rates[2], store_rates[4], store_rates[6]],
             "read": [store_rates[3], store_rates[5], store_rates[7]]}
    for op in ("write", "read"):
        # fio's swings (x100 each way) dominate: the median ratio is the middle round's,
        # far from the ratio of the medians
        want = sorted(s / f for s, f in zip(store[op], fio_rates[op]))[1]
        assert f"store/fio {op}: median {want:.2f}x over 3 rounds" in out, out
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [r["order"] for r in rows] == ["fio,store", "store,fio", "fio,store"]
    assert [r["fio_write"] for r in rows] == fio_rates["write"]
    assert all("load" in r and "checksum=crc32c" in r["setting"] for r in rows)
    # --summary gives the same medians from the file
    assert bench_io.main(["--summary", str(jsonl)]) == 0
    again = capsys.readouterr().out
    for op in ("write", "read"):
        want = sorted(s / f for s, f in zip(store[op], fio_rates[op]))[1]
        assert f"store/fio {op}: median {want:.2f}x over 3 rounds" in again
    assert sorted(os.listdir(tmp_path)) == ["rounds.jsonl"]


def test_median_of_ratios_not_ratio_of_medians(capsys):
    rows = [{"round": i + 1, "order": "fio,store", "load": 1.0, "fio_write": f, "store_write": s,
             "store_write_cpu": 0.1, "fio_read": 1.0, "store_read": 1.0, "store_read_cpu": 0.1}
            for i, (f, s) in enumerate([(1.0, 2.0), (4.0, 2.0), (2.0, 1.0)])]
    got = bench_io.print_rounds(rows, None)
    assert got["write"] == 0.5  # ratios 2, 0.5, 0.5; the medians' ratio would be 2 / 2 = 1
    assert got["read"] == 1.0
    assert "store/fio write: median 0.50x over 3 rounds (range 0.50-2.00), target >= 0.9x: MISS" in \
        capsys.readouterr().out


@pytest.mark.parametrize("knobs", [["--checksum", "none", "--source", "staged", "--files", "fresh"],
                                   ["--block", "256KiB", "--qd", "4", "--inflight", "2"]])
def test_store_knobs_move_the_same_bytes(tmp_path, monkeypatch, capsys, knobs):
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))
    assert bench_io.main(["--rounds", "1", "--total", "3MiB", "--shard", "1MiB", "--dir", str(tmp_path),
                          *knobs]) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    for k, v in zip(knobs[::2], knobs[1::2]):
        name = {"--block": "block", "--qd": "qd", "--inflight": "inflight"}.get(k, k[2:])
        assert f"{name}={v}" in first, first
