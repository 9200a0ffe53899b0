"""`zerotier demo`: run examples/train_gpt.py, the README's demo, with its defaults.

The example is a plain script in the source checkout (README: `pip install -e .`),
so the demo a user runs is the code they read.
"""
from __future__ import annotations

import runpy
from pathlib import Path

from .errors import ZerotierError

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_gpt.py"


def run(argv: list[str]) -> None:
    if not EXAMPLE.exists():
        raise ZerotierError(f"{EXAMPLE} not found: the demo runs from a source checkout "
                            "(git clone, then `pip install -e .`)")
    module = runpy.run_path(str(EXAMPLE), run_name="zerotier_demo")
    module["main"](argv)
