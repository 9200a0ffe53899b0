"""benchmarks/bench_gpu.py, its cases, predict_table.py and gpu_run.sh's scale list on the CPU: the
tiny rehearsal of the GPU path end to end (its rows, its files, figures that are sane), never a
result; the GPU figures are read on a GPU machine."""
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
import gpu_model as gm  # noqa: E402
import predict_table  # noqa: E402

CASES = ["torch", "zt-opt-host", "zt-params-nvme", "ds-z2-offload"]
GiB = 1 << 30


def _env(tmp_path):
    """No saved `zerotier bench` results: the engine's plan uses default rates wherever this runs."""
    return dict(os.environ, ZEROTIER_BENCH_FILE=str(tmp_path / "no-bench.json"), PYTHON=sys.executable)


def _tiny_run(tmp_path, cases):
    """bench_gpu.py --tiny over `cases`, 1 warm-up + 2 timed steps: (the finished process, its --out)."""
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_gpu.py"), "--tiny",
                        "--cases", ",".join(cases), "--steps", "2", "--warmup", "1", "--threads", "1",
                        "--out", str(out), "--nvme-path", str(tmp_path)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, env=_env(tmp_path))
    return r, out


@pytest.mark.slow  # five processes importing torch: ~25 s of CPU
def test_tiny_run_writes_every_row_with_sane_figures(tmp_path):
    r, out = _tiny_run(tmp_path, CASES)
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
        assert row["tflops"] == pytest.approx(gm.model_flops_per_token("tiny") * row["tokens_per_step"]
                                              / row["step_s"] / 1e12)
        assert row["mfu_pct"] > 0 and row["x_torch"] > 0 and row["peak_rss"] > 0
        assert row["max_abs_dloss"] < 2e-2  # bf16 params + fp32 master against fp32 params under bf16 autocast
    for case in ("zt-opt-host", "zt-params-nvme"):
        plan = rows[case]["plan"]
        assert plan["need"]["host"] > 0 and plan["predicted_step_s"] >= 0 and plan["rates_measured"] is False
        assert rows[case]["zt_link_overlap_pct"] and all(0 <= v <= 100 for v in rows[case]["zt_link_overlap_pct"].values())
        assert rows[case]["zt_verdict"]
        split = rows[case]["setup_split_s"]
        assert 0 < split["of which drawing weights"] < split["initialize"] < rows[case]["setup_s"]
        pred = rows[case]["predicted"]  # predict_table's, for the H200 (a CPU has no GPU node of its own)
        assert pred["fits"] and pred["node"] == "h200" and pred["predicted_step_s"] > 0
        assert pred["placement"] == plan["placement"]
    assert plan["placement"] == {"params": "nvme", "gradients": "host", "optimizer": "nvme"}
    assert "nvme->host" in rows["zt-params-nvme"]["zt_link_overlap_pct"]
    assert any(k["link"] == "nvme->host" and k["GBps"] > 0 for k in rows["zt-params-nvme"]["zt_links"])
    assert rows["zt-params-nvme"]["nvme_bytes"] > 0 and rows["zt-params-nvme"]["nvme_traffic"]["read"] > 0
    assert rows["zt-opt-host"]["nvme_bytes"] == 0
    md = (out / "bench_gpu.md").read_text()
    for case in CASES:
        assert f"| {case} | " in md
    assert "CPU smoke run (not a result)" in md and "| ds-z2-offload | n/a (--tiny" in md
    assert "## Predicted / measured" in md and md.count("| h200 |") == 2
    assert os.listdir(tmp_path) == ["out"]  # the cases' swap directories are gone


def test_scale_rehearsal_runs_the_priority_list_under_its_time_limit(tmp_path):
    """gpu_run.sh scale --tiny: issue 36's priority list through every step of the script, bench_gpu
    and predict_table, on the CPU. The table is written after each case, in the list's order; a
    55 s limit stops the list part-way (the rest reads "not run"), as 9 minutes do on the GPU."""
    out = tmp_path / "out"
    env = dict(_env(tmp_path), GPU_RUN_SECONDS="55")
    r = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_run.sh"), str(out), "scale", "--tiny"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    logs = "".join(p.read_text()[-3000:] for p in sorted(out.rglob("*.log")))
    report = json.loads((out / "scale" / "bench_gpu.json").read_text())
    listed = subprocess.run(["bash", "-c", f"source <(grep '^SCALE_' {ROOT}/benchmarks/gpu_run.sh); "
                             "echo $SCALE_FIRST,$SCALE_THEN,$SCALE_REST,$SCALE_STEP_ON"], capture_output=True, text=True).stdout
    order = listed.strip().split(",")
    assert order[:2] == ["7b:zt-opt-host", "7b:ds-z2-offload"] and "20b:zt-compact-auto" in order, order
    rows = report["cases"]
    assert [row["label"] for row in rows] == order, r.stdout + logs
    ran = [row for row in rows if row["status"] == "ok"]
    assert ran and ran[0]["label"] == "7b:zt-opt-host" and ran[0]["size"] == "tiny", (rows, r.stdout, logs)
    for row in ran:  # predicted beside measured
        assert row["predicted"]["fits"] and row["predicted"]["predicted_step_s"] > 0 and row["step_s"] > 0
    assert ran[0]["predicted"]["placement"] == {"params": "device", "gradients": "host", "optimizer": "host"}
    for row in rows:
        framework = bench_gpu.CASES[row["case"]][0]
        if framework != "zerotier":
            assert row["status"] == "n/a" and "--tiny" in row["reason"]
        else:  # ran, or left for want of time (a case started late may be stopped by its own limit)
            assert row["status"] in ("ok", "not run") or "timed out" in row.get("reason", ""), row
    assert any(row["status"] == "not run" for row in rows), "55 s ran the whole list: the limit was not rehearsed"
    md = (out / "scale" / "bench_gpu.md").read_text()
    assert "| 7b:zt-opt-host | ok |" in md and "## Predicted / measured" in md
    summary = (out / "summary.txt").read_text()
    assert "machine" in summary and "scale" in summary and "venv" not in summary  # --tiny: no venv
    assert not list(out.glob("**/.bench_gpu_nvme.*"))  # the swap directories are gone


STEP_ON_CASES = ["zt-opt-host-on-cpu", "zt-compact-host-on-device", "zt-compact-auto-on-auto"]


@pytest.mark.slow  # four processes importing torch
def test_step_on_cases_record_where_the_update_ran_its_exposed_time_and_pcie_bytes(tmp_path):
    """Issue 34's cases (optimizer.step_on = cpu / device / auto) in the tiny rehearsal: the key reaches
    the engine's plan (every unit's update on the CPU or on the device as asked), and each row records
    the optimizer's exposed time (within the step) and the PCIe bytes per step, in the json and in the
    table's step_on section."""
    from gpu_case_list import zerotier_config
    for case, on in zip(STEP_ON_CASES, ("cpu", "device", "auto")):
        assert zerotier_config(case, None, 1, None, 1, "cpu")["optimizer"]["step_on"] == on
    assert "step_on" not in zerotier_config("zt-opt-host", None, 1, None, 1, "cpu")["optimizer"]
    r, out = _tiny_run(tmp_path, STEP_ON_CASES)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:] + (out / "cases.log").read_text()[-5000:]
    rows = {c["case"]: c for c in json.loads((out / "bench_gpu.json").read_text())["cases"]}
    for case in STEP_ON_CASES:
        row = rows[case]
        assert row["status"] == "ok", row
        assert 0 <= row["zt_optimizer_exposed_s"] <= row["step_s"]
        assert set(row["zt_pcie_bytes_per_step"]) == {"h2d", "d2h"}
        assert all(v >= 0 for v in row["zt_pcie_bytes_per_step"].values())
    assert set(rows["zt-opt-host-on-cpu"]["zt_step_on"]) == {"cpu"}
    assert set(rows["zt-compact-host-on-device"]["zt_step_on"]) == {"device"}
    assert rows["zt-opt-host-on-cpu"]["zt_optimizer_exposed_s"] > 0  # the CPU Adam after the last backward
    assert rows["zt-opt-host-on-cpu"]["zt_pcie_bytes_per_step"]["d2h"] > 0  # gradients to the host
    md = (out / "bench_gpu.md").read_text()
    assert "## Where the update runs" in md
    for case, on in zip(STEP_ON_CASES, ("cpu", "device", "auto")):
        assert f"| {case} | {on} | " in md


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


def test_the_sizes_are_the_llama_shapes_they_name():
    """Llama-2-7B and -13B's parameter counts (untied head, RMSNorm weights), LLaMA-33B's."""
    assert gm.param_count("7b") == 6_738_415_616 and gm.param_count("13b") == 13_015_864_320
    assert gm.param_count("30b") == 32_528_943_616 and 20.0e9 < gm.param_count("20b") < 20.5e9
    assert sum(p.numel() for p in gm.llama("7b", "meta").parameters()) == gm.param_count("7b")
    # the Megatron formula: 6 x (layers' matmuls + head) + 12 x seq x dim per layer
    assert gm.model_flops_per_token("7b") == 6 * (32 * (4 * 4096**2 + 3 * 4096 * 11008) + 32000 * 4096) \
        + 12 * 32 * 2048 * 4096


def test_every_way_of_building_gives_the_same_initial_weights(tmp_path):
    """[Note: the same weights everywhere]: built on the device, or on meta and materialized unit by
    unit by zerotier's init_fn, the fp32 weights are the same bytes, parameter by parameter."""
    import zerotier
    gen = torch.device("cpu")
    built = dict(gm.build("tiny", torch.device("cpu"), gen).named_parameters())
    meta = gm.llama("tiny", "meta")
    cfg = {"offload": {"params": "host", "gradients": "host", "optimizer": "nvme"},
           "tiers": {"nvme_path": str(tmp_path)}, "train": {"handle_signals": False, "device": "cpu"}}
    engine = zerotier.initialize(meta, cfg, init_fn=gm.zerotier_init_fn(meta, gen))
    try:
        masters = engine.parameters_fp32()  # the fp32 master weights, read back from NVMe
    finally:
        engine.close(restore_weights=False)
    assert sorted(masters) == sorted(built)
    for name, value in masters.items():
        assert torch.equal(value, built[name].detach()), name
    assert not torch.equal(built["layers.0.q.weight"], built["layers.1.q.weight"])  # seeded per name


def test_a_plan_that_cannot_fit_says_what_it_needs_on_each_tier():
    rates = predict_table.node_rates("h200")
    row = predict_table.predict("30b", "zt-opt-host", rates, predict_table.node_budgets("h200"), None)
    assert row["fits"] is False
    assert row["need"]["host"] > predict_table.node_budgets("h200")["host"]
    for tier in ("device", "host", "nvme"):
        assert f"{tier} " in row["reason"] and "GiB (has " in row["reason"]


def test_the_delayed_update_is_charged_its_copies():
    """Its gradient copies and staged parameters are beyond the plan's need: a 7B exact run that fits
    the host without them does not with them (the row must not read 'fits')."""
    rates, budgets = predict_table.node_rates("h200"), predict_table.node_budgets("h200")
    plain = predict_table.predict("7b", "zt-opt-host", rates, budgets, None)
    delayed = predict_table.predict("7b", "zt-opt-host-delayed", rates, budgets, None)
    assert plain["fits"] and not delayed["fits"]
    assert delayed["need"]["host"] - plain["need"]["host"] >= 4 * gm.param_count("7b")  # bf16 grads + params


def test_the_docs_table_is_what_predict_table_prints():
    """docs/benchmarks.md's predictions were generated by predict_table.py (regenerate them with
    `python benchmarks/predict_table.py --write docs/benchmarks.md` when the planner changes)."""
    with open(os.path.join(ROOT, "docs", "benchmarks.md")) as f:
        doc = f.read()
    rates = predict_table.node_rates("h200")
    rows = [predict_table.predict(size, case, rates, predict_table.node_budgets("h200"),
                                  rates["compute_bf16"] * predict_table.efficiency())
            for size, case in (("7b", "zt-opt-host-early"), ("20b", "zt-compact-auto"), ("30b", "zt-opt-host"))]
    begin, end = predict_table.markers("h200")
    section = doc.split(begin, 1)[1].split(end, 1)[0]
    for line in predict_table.table(rows, "h200").splitlines()[2:5]:
        assert line in section, line
