"""`zerotier demo` (examples/train_gpt.py) runs end to end and ends with the swap table."""
import json
import re
import subprocess
import sys


def test_demo_runs_and_prints_swap_table(tmp_path):
    trace = tmp_path / "demo.json"
    out = subprocess.run([sys.executable, "-m", "zerotier.cli", "demo", "--steps", "3", "--nvme-path", str(tmp_path),
                          "--trace", str(trace)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"optimizer +nvme", out.stdout)   # the plan put Adam state on NVMe
    assert "host->nvme" in out.stdout and "verdict:" in out.stdout
    assert json.loads(trace.read_text())["traceEvents"]
    profile = subprocess.run([sys.executable, "-m", "zerotier.cli", "profile", str(trace)],
                             capture_output=True, text=True, timeout=120)
    assert profile.returncode == 0 and "verdict:" in profile.stdout
