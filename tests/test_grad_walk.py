"""One unit's gradient walk from backward to the CPU Adam (issue 33: at most 8 files), taken at
run time by tools/grad_walk.py."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

import grad_walk  # noqa: E402


@pytest.mark.pins("design#one-unit-s-gradient-walk-crosses-at-most-8-files")
def test_one_units_gradient_walk_reaches_the_kernel_in_at_most_8_files():
    """The walk follows one unit from its gradient in backward to the native kernel, through at
    most 8 files; it must reach the kernel door, so it cannot pass by following nothing."""
    summary = grad_walk.walk()
    files = summary["file_list"]
    assert summary["route"][0].startswith("grads.py"), summary["route"][:3]  # it starts at the gradient
    assert "optim/_kernels.py" in files, files  # and reaches the CPU Adam's door
    assert "optim/offload.py" in files, files
    assert summary["files"] == len(files) <= 8, files
