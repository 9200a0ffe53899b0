"""Shared pytest hooks.

Tests marked `@pytest.mark.cuda` need a CUDA device; on machines without one they are
skipped with the reason "needs CUDA" (they run on the lent GPU machine). Every other test
runs its engines on the CPU, on any host.

Two test instruments are on for the whole CPU suite (issue 22 item 3), never counted as GPU
results: the registration ledger below, and the lagging device ([Note: the lagging device] in
zerotier/tiers/lagging.py, picked by make_device_tier): every CPU copy completes late on its own worker, its destination
is NaN until then and a write into its source before then fails. It is switched on here by
ZEROTIER_LAGGING_DEVICE=1, set before anything is imported so that ranks spawned by the tests
inherit it; run with ZEROTIER_LAGGING_DEVICE=0 to turn it off.
"""
from __future__ import annotations

import os
import threading

os.environ.setdefault("ZEROTIER_LAGGING_DEVICE", "1")

import pytest


class RegistrationLedger:
    """cudaHostRegister's bookkeeping on any host (issue 22 item 3a; [Note: registrations end with
    the pool] in zerotier/tiers/host.py): every host-pool block is registered here, pinned or not,
    and a registration overlapping one still held fails as the driver's would (error 712). A test
    instrument for the CPU suite, never a GPU result."""

    def __init__(self):
        self.ranges: dict[int, int] = {}  # ptr -> nbytes
        self._lock = threading.Lock()

    def register(self, ptr: int, nbytes: int) -> None:
        with self._lock:
            for p, n in self.ranges.items():
                if ptr < p + n and p < ptr + nbytes:
                    raise RuntimeError(f"registration ledger: [{ptr:#x}, +{nbytes}) overlaps a range still "
                                       f"registered [{p:#x}, +{n}): a block was freed while registered "
                                       "(cudaHostRegister would fail with 712)")
            self.ranges[ptr] = nbytes

    def unregister(self, ptr: int) -> None:
        with self._lock:
            if self.ranges.pop(ptr, None) is None:
                raise RuntimeError(f"registration ledger: unregister of {ptr:#x}, which is not registered")


_LEDGER = RegistrationLedger()


@pytest.fixture(autouse=True, scope="session")
def _registration_ledger():
    """On for the whole CPU suite: a leaked registration fails the test that reuses its range."""
    from zerotier.tiers import host

    host.ledger = _LEDGER
    yield _LEDGER
    host.ledger = None


@pytest.fixture(autouse=True)
def _lagging_device_clean():
    """A copy whose source was written before its event fails the test that did it, even where
    the engine swallowed the tier's error (spawned ranks raise it from their own engine)."""
    from zerotier.tiers import lagging

    lagging.lagging_violations.clear()
    yield
    found = list(lagging.lagging_violations)
    lagging.lagging_violations.clear()
    assert not found, f"{len(found)} lagging-device violation(s): {found[0]}"


@pytest.fixture
def ledger(_registration_ledger):
    return _registration_ledger


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
