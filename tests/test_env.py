"""`zerotier env`: the report's shape, its text form, and the CLI's help."""
from __future__ import annotations

import json
import platform
import subprocess
import sys
import textwrap

import pytest
import torch

import zerotier
from zerotier import cli, envinfo
from zerotier.cli import node_commands

REPORT_KEYS = {"versions", "cuda", "cpu", "memory", "native", "simd_level", "io_uring", "nvme_path"}


def test_env_json_subprocess(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "zerotier.cli", "env", "--json", "--nvme-path", str(tmp_path)],
        capture_output=True, text=True, timeout=120, check=True,
    )
    report = json.loads(done.stdout)
    assert set(report) == REPORT_KEYS
    assert report["versions"]["zerotier"] == zerotier.__version__
    assert report["versions"]["torch"] == torch.__version__
    assert report["versions"]["python"] == platform.python_version()
    assert set(report["cpu"]["simd_flags"]) == set(envinfo.SIMD_FLAGS)
    assert report["cpu"]["logical_cores"] >= report["cpu"]["physical_cores"] >= 1
    assert report["memory"]["total_bytes"] >= report["memory"]["available_bytes"] > 0
    assert set(report["native"]) == {"_zt_cpu", "_zt_io"}
    assert isinstance(report["simd_level"], str)
    assert set(report["io_uring"]) == {"usable", "reason"}
    assert report["nvme_path"]["path"] == str(tmp_path)
    assert 0 < report["nvme_path"]["free_bytes"] <= report["nvme_path"]["total_bytes"]
    if not torch.cuda.is_available():
        assert report["cuda"]["devices"] == []


def test_env_text_lists_versions_and_aligns_values(capsys, tmp_path):
    assert cli.main(["env", "--nvme-path", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = dict(line.split(None, 1) for line in lines if line.split()[0] in ("zerotier", "torch", "python"))
    assert rows == {"zerotier": zerotier.__version__, "torch": torch.__version__,
                    "python": platform.python_version()}
    value_columns = {len(line) - len(line.split("  ", 1)[1].lstrip()) for line in lines}  # keys: no "  "
    assert len(value_columns) == 1, lines
    assert any(line.startswith("nvme path") and str(tmp_path) in line and "free of" in line for line in lines)
    if not torch.cuda.is_available():
        assert any(line.startswith("cuda devices") and "none" in line for line in lines)


def test_env_reports_a_missing_nvme_path(capsys, tmp_path):
    missing = tmp_path / "not-there"
    assert cli.main(["env", "--nvme-path", str(missing)]) == 0
    out = capsys.readouterr().out
    assert f"error: {missing} does not exist" in out


def test_env_survives_missing_optional_components(monkeypatch):
    monkeypatch.setitem(sys.modules, "zerotier.optim", None)
    monkeypatch.setitem(sys.modules, "zerotier.io", None)
    report = envinfo.collect(".")
    assert report["simd_level"].startswith("unavailable: ")
    assert report["io_uring"]["usable"] is None
    assert report["io_uring"]["reason"].startswith("unavailable: ")
    assert "zerotier" in report["versions"]


def test_env_reports_a_broken_part_without_hiding_the_rest(monkeypatch):
    def broken() -> dict:
        raise RuntimeError("no /proc/cpuinfo")

    monkeypatch.setattr(envinfo, "_cpu", broken)
    report = envinfo.collect(".")
    assert report["cpu"] == {"error": "RuntimeError: no /proc/cpuinfo"}
    assert "total_bytes" in report["memory"]
    rows = dict(node_commands.env_rows(report))
    assert rows["cpu"] == "RuntimeError: no /proc/cpuinfo"


def test_help_describes_every_option(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    top = capsys.readouterr().out
    for command in cli.COMMANDS:
        assert command.name in top and command.summary.split()[0] in top

    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command").choices
    for name, sub in subparsers.items():
        for action in sub._actions:
            assert action.help, f"zerotier {name} {action.option_strings} has no help text"

    with pytest.raises(SystemExit):
        cli.main(["env", "--help"])
    env_help = capsys.readouterr().out
    assert "--json" in env_help and "--nvme-path" in env_help


def test_help_does_not_import_torch():
    """`zerotier --help` and each `zerotier COMMAND --help` answer without loading torch (seconds at
    start-up): `import zerotier` is light, commands import their heavy modules when they run."""
    script = textwrap.dedent("""
        import contextlib, io, sys
        from zerotier import cli
        for argv in [["--help"]] + [[c.name, "--help"] for c in cli.COMMANDS]:
            with contextlib.redirect_stdout(io.StringIO()):
                try:
                    cli.main(argv)
                except SystemExit:
                    pass
            print(" ".join(argv), "torch" in sys.modules)
        """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 1 + len(cli.COMMANDS) and all(line.endswith(" False") for line in lines), lines


def test_no_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([])
    assert exit_info.value.code == 2
    assert "COMMAND" in capsys.readouterr().err


def test_plan_model_imports_from_the_current_directory(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_model_zt.py").write_text(
        "import torch\ndef build():\n    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert cli.main(["plan", "--model", "my_model_zt:build"]) == 0
    assert "trainable parameters" in capsys.readouterr().out


def test_output_closed_by_the_reader_is_not_a_traceback(monkeypatch):
    class ClosedPipe:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            pass
    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert cli.main(["plan", "--params", "10M"]) == 0  # `zerotier plan ... | head -1`


def test_plan_for_an_nvme_path_that_is_not_on_this_machine(capsys):
    """Planning for another machine: its NVMe directory need not exist here (issue 13 item 7)."""
    assert cli.main(["plan", "--params", "10M", "--nvme-path", "/nonexistent/zt-nvme", "--offload",
                     "optimizer=nvme"]) == 0
    out = capsys.readouterr()
    assert "fits: yes" in out.out and "does not exist on this machine" in out.err and "--nvme SIZE" in out.err


def _fake_cgroup(root, version: int, limit: str, usage: int, inactive_file: int = 0, nested: bool = True):
    """A /proc/self/cgroup and a cgroup mount under `root`, the process in /job/step (its parent /job has the limit)."""
    (root / "proc/self").mkdir(parents=True)
    if version == 2:
        (root / "proc/self/cgroup").write_text("0::/job/step\n")
        mount = root / "sys/fs/cgroup"
        mount.mkdir(parents=True)
        (mount / "cgroup.controllers").write_text("cpu memory\n")
        names = ("memory.max", "memory.current", "inactive_file")
    else:
        (root / "proc/self/cgroup").write_text("5:cpu,cpuacct:/\n4:memory:/job/step\n0::/\n")
        mount = root / "sys/fs/cgroup/memory"
        names = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    job = mount / "job"
    step = job / "step"
    step.mkdir(parents=True)
    for directory, lim in ((mount, "max" if version == 2 else "9223372036854771712"), (job, limit),
                           (step, "max" if version == 2 else "9223372036854771712")):
        (directory / names[0]).write_text(lim + "\n")
        (directory / names[1]).write_text(f"{usage}\n")
        (directory / "memory.stat").write_text(f"anon {usage}\n{names[2]} {inactive_file}\n")
    return job


MIB = 1 << 20


@pytest.mark.parametrize("version", [1, 2])
def test_usable_memory_is_capped_by_the_cgroup_limit(monkeypatch, tmp_path, version):
    """Issue 37 row 15: in a 700 MiB cgroup, RAM is 700 MiB, free RAM the limit less the working set
    (usage minus reclaimable inactive file cache), read from every cgroup up the hierarchy."""
    job = _fake_cgroup(tmp_path, version, str(700 * MIB), usage=300 * MIB, inactive_file=100 * MIB)
    monkeypatch.setattr(envinfo, "FS_ROOT", tmp_path)
    memory = envinfo.usable_memory()
    assert memory.cgroup_limit == memory.total == 700 * MIB
    assert memory.available == 500 * MIB
    assert memory.cgroup == str(job)


def test_usable_memory_without_a_cgroup_limit_is_the_machines(monkeypatch, tmp_path):
    import psutil

    _fake_cgroup(tmp_path, 2, "max", usage=300 * MIB)
    monkeypatch.setattr(envinfo, "FS_ROOT", tmp_path)
    memory = envinfo.usable_memory()
    assert memory.cgroup_limit is None and memory.total == psutil.virtual_memory().total
    monkeypatch.setattr(envinfo, "FS_ROOT", tmp_path / "no-proc-here")
    assert envinfo.usable_memory().cgroup_limit is None


def test_auto_budgets_plans_and_env_respect_a_cgroup_limit(monkeypatch, tmp_path, capsys):
    """Issue 37 row 15: automatic budgets took ~9 GiB in a 700 MiB cgroup and the plan said an 812 MiB
    run fits; both must use the cgroup's limit, and `zerotier env` must show it."""
    from zerotier.config import OffloadConfig, PrecisionConfig, TiersConfig
    from zerotier.planner.budgets import resolve_budgets
    from zerotier.planner.inputs import ModelFacts, Node, PlanConfig
    from zerotier.planner.messages import PlanDoesNotFit
    from zerotier.planner.planner import make_plan

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    job = _fake_cgroup(tmp_path / "fs", 2, str(700 * MIB), usage=100 * MIB)
    monkeypatch.setattr(envinfo, "FS_ROOT", tmp_path / "fs")
    budgets = resolve_budgets(TiersConfig(), torch.device("cpu"))
    assert budgets["host"] == int(600 * MIB * 0.4) and budgets["device"] == int(600 * MIB * 0.4)
    units = [17_000_000] * 4  # 68M fp32 params: over 1 GiB of weights, gradients and Adam state
    offload = OffloadConfig(params="host", gradients="host", optimizer="host")
    precision = PrecisionConfig(param_dtype="fp32")
    args = ModelFacts.of_sizes(units), PlanConfig(offload=offload, precision=precision), Node()
    with pytest.raises(PlanDoesNotFit):
        make_plan(*args)
    monkeypatch.setattr(envinfo, "FS_ROOT", tmp_path / "no-cgroup")
    assert make_plan(*args).to_dict()["fits"]  # the machine's RAM holds it
    monkeypatch.setattr(envinfo, "FS_ROOT", tmp_path / "fs")
    assert cli.main(["env", "--nvme-path", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert any(line.startswith("cgroup memory limit") and line.endswith(f"700.00 MiB ({job})")
               for line in out.splitlines()), out
    assert any(line.startswith("ram") and "700.00 MiB total" in line for line in out.splitlines())


@pytest.mark.parametrize("flag", ["--params", "--frozen-params"])
@pytest.mark.parametrize("count, message", [
    ("1e30", "1e30 is more than 10^15 parameters (1000T), the most zerotier plans for"),  # was an AssertionError
    ("1e400", "1e400 is more than 10^15 parameters"),  # was an OverflowError traceback
    ("1001T", "1001T is more than 10^15 parameters"),
    ("nan", "cannot read 'nan'; use a whole count"),
    ("inf", "cannot read 'inf'"),
    ("2.5", "cannot read '2.5'"),
    ("1e-400", "cannot read '1e-400'"),
    ("-7B", "cannot read '-7B'"),
    ("0", "cannot read '0'"),
])
def test_plan_params_counts_out_of_range_are_one_line(capsys, flag, count, message):
    """Issue 37 row 16: --params 1e30 ended in an AssertionError, 1e400 in a traceback."""
    assert cli.main(["plan", "--params=7B", f"{flag}={count}", "--host", "1PiB", "--nvme", "0"]) == 1
    err = capsys.readouterr().err
    assert err == f"zerotier plan: error: {flag}: {message}" + err.split(message, 1)[1] and err.count("\n") == 1, err


def test_plan_params_at_the_bound_plans(capsys):
    assert cli.main(["plan", "--params", "1000T", "--device", "7000PiB", "--nvme", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["numel"] == 10**15
