"""The lagging device ([Note: the lagging device] in zerotier/tiers/lagging.py): a CPU DeviceTier whose
copies complete late, as a GPU's do, so that a missing wait fails in the CPU suite (issue 22 item 3b).
A test instrument, never a GPU result. The suite turns it on for every test (tests/conftest.py)."""
from __future__ import annotations

import os
import time

import pytest
import torch

from zerotier.errors import ZerotierError
from zerotier.tiers import lagging as device_mod
from zerotier.tiers.lagging import LaggingDeviceTier, LateTicket, make_device_tier
from zerotier.tiers.host import HostPool

LAG = 0.5  # s: long enough that nothing below completes by itself unless it waits for it


def tier(lag=LAG):
    return LaggingDeviceTier(1 << 20, "cpu", lag_s=lag)


def expect_violation(match):
    """The violation this test provokes, taken off the suite's list (the fixture fails on any left)."""
    assert any(match in v for v in device_mod.lagging_violations), device_mod.lagging_violations
    device_mod.lagging_violations.clear()


def test_on_for_the_whole_suite_and_off_by_the_environment(monkeypatch):
    if os.environ.get("ZEROTIER_LAGGING_DEVICE") == "0":
        pytest.skip("ZEROTIER_LAGGING_DEVICE=0 was given: the suite runs without the instrument, by request")
    assert make_device_tier(1 << 10, "cpu").lagging, "tests/conftest.py sets ZEROTIER_LAGGING_DEVICE=1"
    monkeypatch.setenv("ZEROTIER_LAGGING_DEVICE", "0")
    assert not make_device_tier(1 << 10, "cpu").lagging


def test_destination_is_nan_until_joined_and_the_event_comes_late():
    dev = tier()
    src = torch.randn(1000)
    dst = torch.zeros(1000)
    ticket = dev.copy_h2d(dst, src)
    assert isinstance(ticket, LateTicket)
    assert dst.isnan().all(), "reading the destination before join/wait must see poison"
    assert not ticket.done()
    dev.join(ticket)  # compute waits: the bytes are there, the host still does not know the event
    assert torch.equal(dst, src) and not ticket.done()
    assert ticket.wait() == src.nbytes and ticket.done()
    dev.close()


def test_copies_complete_on_their_own_worker_after_the_lag():
    dev = tier(lag=0.02)
    ints = torch.arange(64, dtype=torch.int32)
    dst = torch.zeros(64, dtype=torch.int32)
    ticket = dev.copy_d2h(dst, ints)
    assert (dst.view(torch.uint8) == 0xA5).all(), "integers are poisoned with a sentinel"
    deadline = time.monotonic() + 5
    while not ticket.done() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert ticket.done() and torch.equal(dst, ints)
    dev.close()


def test_a_source_reused_after_join_before_the_event_fails_loudly():
    """GPU review N5 at the tier: compute joined the copy, then the source block was handed to the
    next read before the copy's event. On a GPU the copy may read the new bytes."""
    dev = tier()
    pool = HostPool(1 << 20, pin=False)
    block = pool.alloc(4096, torch.float32)
    block.tensor.copy_(torch.randn(1024))
    dst = torch.empty(1024)
    ticket = dev.copy_h2d(dst, block.tensor)
    dev.join(ticket)
    pool.free(block)  # the defect: no after=ticket
    reused = pool.alloc(4096, torch.float32)
    assert reused.tensor.data_ptr() == block.tensor.data_ptr(), "the pool hands the block out again"
    reused.tensor.fill_(7.0)  # the next O_DIRECT read into it
    with pytest.raises(ZerotierError, match="written after compute joined the copy"):
        ticket.wait()
    assert dst.isnan().all(), "the destination holds undefined bytes"
    with pytest.raises(ZerotierError, match="N5"):  # the tier stays failed: every later call says so
        dev.copy_h2d(torch.empty(4), torch.ones(4))
    with pytest.raises(ZerotierError, match="N5"):
        dev.close()
    expect_violation("N5")
    pool.free(reused)
    pool.close()


def test_free_after_the_ticket_parks_the_block_until_the_copy_ran():
    """The fix of N5: free(block, after=ticket) keeps the block out of the pool until the late copy
    completed, whatever compute joined meanwhile; no violation."""
    dev = tier()
    pool = HostPool(1 << 20, pin=False)
    block = pool.alloc(4096, torch.float32)
    block.tensor.copy_(torch.randn(1024))
    expected = block.tensor.clone()
    dst = torch.empty(1024)
    ticket = dev.copy_h2d(dst, block.tensor)
    dev.join(ticket)
    pool.free(block, after=ticket)
    other = pool.alloc(4096, torch.float32)
    assert other.tensor.data_ptr() != block.tensor.data_ptr(), "a parked block was handed out"
    other.tensor.fill_(7.0)
    ticket.wait()
    again = pool.alloc(4096, torch.float32)
    assert again.tensor.data_ptr() == block.tensor.data_ptr(), "once the copy ran the block comes back"
    assert torch.equal(dst, expected)
    pool.free(other)
    pool.free(again)
    pool.close()
    dev.close()


@pytest.mark.pins("design#cpu-checks-of-the-gpu-classes")
def test_a_source_written_before_the_copy_delivered_gives_nan_not_data():
    """Written while the copy was in flight and not joined: the copy's bytes are undefined, so the
    destination is NaN for whoever uses it (a prefetch that is dropped unused is harmless)."""
    dev = tier()
    src = torch.randn(256)
    dst = torch.empty(256)
    ticket = dev.copy_h2d(dst, src)
    src.add_(1.0)  # e.g. the optimizer writing a home in place while a prefetch reads it
    dev.join(ticket)
    assert dst.isnan().all()
    ticket.wait()  # not the N5 pattern: no violation, the NaN is the loud part
    assert not device_mod.lagging_violations
    dev.close()


def test_a_copy_ordered_after_compute_completes_the_copies_compute_joined():
    """Stream order: a later copy waits for compute, which waited for the joined ones; likewise a
    synchronous CPU copy (count_in/count_out) and the release of a copy's destination."""
    dev = tier()
    a, b = torch.empty(8), torch.empty(8)
    first = dev.copy_h2d(a, torch.ones(8))
    dev.join(first)
    second = dev.copy_d2h(b, a)
    assert first.done() and not second.done()
    dev.join(second)
    dev.count_out(32)
    assert second.done()
    flat = torch.empty(8)
    flat.untyped_storage().resize_(0)
    dev.fill_storage(flat, "flat")  # a streamed unit's flat ([Note: freeing by storage resize])
    third = dev.copy_h2d(flat, torch.ones(8))
    dev.join(third)
    dev.free_storage(flat)  # compute is done with it
    assert third.done()
    dev.close()
