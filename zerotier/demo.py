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

# How long the demo takes, said wherever it is promised (cli/run_commands.py's help, the example's docstring).
# The long run (--long; the default until issue 35) was measured on a quiet 2-core VM at 8424d6b:
# 81 s of training, 1:27 with start-up. The default run does a sixth of its work (steps x layers x
# batch: 60 x 4 x 8 against 120 x 6 x 16) but not a sixth of its time: 4-step runs of each,
# alternated, at load 11-12 (issue 35; no quiet VM in that session) trained 6.0-7.2 s a step against
# 11.5-16.0 s (~2.1x per step: the NVMe optimizer and per-step work do not shrink with the batch),
# so ~4x less time in all. Measured on a quiet 2-core VM (load 0.7) at aaf37da: `zerotier demo` 17.1 s
# wall, 13.2 s of training (loss 3.653 -> 1.340).
DURATION = "~20 s on a quiet 2-core CPU"
DURATION_LONG = "~1.5 min on a quiet 2-core CPU"
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
