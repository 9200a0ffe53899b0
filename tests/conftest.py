"""Shared pytest hooks.

Tests marked `@pytest.mark.cuda` need a CUDA device; on machines without one they are
skipped with the reason "needs CUDA" (they run on the lent GPU machine). Every other test
runs its engines on the CPU, on any host.
"""
from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _cpu_device_unless_cuda(request, monkeypatch):
    """The CPU suite runs unchanged on a GPU host: engines with train.device = "auto" compute on
    the CPU ($ZEROTIER_DEVICE, inherited by spawned ranks), except in tests marked cuda."""
    if request.node.get_closest_marker("cuda") is None:
        monkeypatch.setenv("ZEROTIER_DEVICE", "cpu")


def pytest_collection_modifyitems(config, items):
    cuda_items = [item for item in items if item.get_closest_marker("cuda") is not None]
    if not cuda_items:
        return
    import torch  # only when a cuda test was collected

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is False)")
    for item in cuda_items:
        item.add_marker(skip)
