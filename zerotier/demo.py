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
