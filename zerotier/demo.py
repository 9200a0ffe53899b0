"""`zerotier demo`: run examples/train_gpt.py, the README's demo, with its defaults.

The example is a plain script, so the demo a user runs is the code they read: in a source
checkout (README: `pip install -e .`) examples/train_gpt.py itself; in an installed package
the copy the build puts at zerotier/_examples/train_gpt.py (setup.py), so `pip install` +
`zerotier demo` works from any directory. The demo's text is inside the script.
"""
from __future__ import annotations

import runpy
from pathlib import Path

from .errors import ZerotierError

# How long the default demo takes, said wherever it is promised (cli.py's --steps help, the
# example's docstring). Measured: new-user trial at 8424d6b on a quiet 2-core VM, 81 s of training
# and 1:27 with start-up (not "~1 min"). On this VM shared with other jobs (issue 26 item 7, one run
# each, never quiet): 4 steps at load 4-6 trained in 42 s (10.6 s a step), 12 steps at load 12 in
# 179 s (14.9 s a step, 204 s wall: the default 120 would take ~30 min), and at load 16 plain PyTorch
# ran the same model as slowly as the demo (~30 s a step): busy cores, not zerotier.
DURATION = "~1.5 min on a quiet 2-core CPU"
DURATION_BUSY = "much longer while other jobs share the cores; the progress bar shows the estimate"

HERE = Path(__file__).resolve().parent
CANDIDATES = (HERE / "_examples" / "train_gpt.py",              # installed package
              HERE.parent / "examples" / "train_gpt.py")        # source checkout


def run(argv: list[str]) -> None:
    example = next((path for path in CANDIDATES if path.exists()), None)
    if example is None:
        raise ZerotierError(f"the demo script is missing (looked for {', '.join(map(str, CANDIDATES))}): "
                            "reinstall zerotier from its checkout (pip install -e .)")
    module = runpy.run_path(str(example), run_name="zerotier_demo")
    module["main"](argv)
