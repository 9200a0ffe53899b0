"""A home per tier ([Note: homes] in zerotier/tiers/homes.py): every tier's home takes a unit's state
and gives it back to the device by the same verbs, each move bracketed by its tiers' accounting."""
from __future__ import annotations

import pytest
import torch

from zerotier.config import IOConfig, TiersConfig
from zerotier.state import Location
from zerotier.tiers import HostPool, make_device_tier
from zerotier.tiers.homes import HOMES, Tiers
from zerotier.tiers.nvme import NVMeStore

NUMEL = 1000  # bf16: 2000 B, not a multiple of the pool's or the drive's alignment


@pytest.mark.parametrize("loc", list(Location), ids=lambda loc: loc.value)
def test_every_home_moves_state_by_the_same_verbs(loc, tmp_path):
    device, pool = make_device_tier(1 << 24, "cpu"), HostPool(1 << 24, pin=False)
    store = NVMeStore(TiersConfig(device=1 << 24, host=1 << 24, nvme=1 << 24, nvme_path=str(tmp_path)), IOConfig()) \
        if loc is Location.NVME else None
    home = HOMES[loc].reserve("unit.param", NUMEL, torch.bfloat16, Tiers(device, pool, store))
    assert home.location is loc and home.name == loc.value and home.nbytes == 2 * NUMEL
    assert (home.view() is None) is (not home.in_memory) is (loc is Location.NVME)
    assert home.on_device is (loc is Location.DEVICE)

    values = torch.randn(NUMEL).to(torch.bfloat16)
    src = pool.alloc(home.nbytes, torch.bfloat16, "write-back")
    src.tensor.copy_(values)
    ticket = home.write_from(src)  # the home's bytes: from a pool block, as a write-back sends them
    assert (ticket is None) is (loc is not Location.NVME)  # memory on the block's side: copied on the spot
    if ticket is not None:
        ticket.wait()
    pool.free(src, after=ticket)
    if home.view() is not None:
        assert torch.equal(home.view(), values)

    flat = device.alloc((NUMEL,), torch.bfloat16, "device flat")
    in_before = device.stats()["bytes_in"]
    fetched = home.read_into(flat)  # a fetch: home -> the device
    fetched.wait()
    assert torch.equal(flat, values)
    crossed = device.stats()["bytes_in"] - in_before
    assert crossed == (0 if home.on_device else home.nbytes)  # only a copy over the link counts as one

    # at rest the home holds its own blocks only: the NVMe read's staging block went back to the pool
    assert pool.stats()["live_buffers"] == home.blocks_at_rest
    if loc is Location.NVME:
        assert store.nbytes("unit.param") == home.nbytes
        store.close()
    device.close()

