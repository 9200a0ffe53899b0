"""The NVMe optimizer pipeline's staging sets, packed ([Note: packed staging sets] in
optim/staging_sets.py): units take aligned ranges of a set, not whole sets, so beside a large
unit the last backward reads the state of every small one."""
import time

import pytest
import torch

import zerotier
from zerotier.models import TinyGPT, batches
from zerotier.optim.staging_sets import StagingSets
from zerotier.tiers.host import HostPool

ALIGN = 4096


def _ranges(lease):
    return {k: (v.data_ptr(), v.data_ptr() + v.numel()) for k, v in lease.views.items()}


def test_small_units_share_a_set_and_a_set_comes_back_with_its_last_unit():
    pool = HostPool(64 << 20, alignment=ALIGN, pin=False)
    sets = StagingSets(pool, {"master": 10 * ALIGN, "exp_avg": 10 * ALIGN}, depth=2)
    small = {"master": 3 * ALIGN - 100, "exp_avg": 3 * ALIGN - 100}   # 3 aligned pages each
    a, b, c = (sets.take(small) for _ in range(3))
    assert a.set_index == b.set_index == c.set_index == 0    # 9 of 10 pages of set 0
    big = sets.take({"master": 10 * ALIGN, "exp_avg": 10 * ALIGN})
    assert big.set_index == 1                                 # a whole set: the empty one
    assert sets.take(small) is None                           # no room left anywhere
    for lease in (a, b, c):
        assert all(v.data_ptr() % ALIGN == 0 and v.numel() == small[k] for k, v in lease.views.items())
    spans = sorted(r for lease in (a, b, c) for r in _ranges(lease).values())
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))   # disjoint
    sets.give_back(a)
    sets.give_back(b)
    assert sets.take({"master": 10 * ALIGN, "exp_avg": 10 * ALIGN}) is None  # set 0 still holds c
    sets.give_back(c)
    again = sets.take({"master": 10 * ALIGN, "exp_avg": 10 * ALIGN})
    assert again is not None and again.set_index == 0
    sets.close()
    pool.close()


@pytest.mark.parametrize("params", ["device", "nvme"])
def test_last_backward_reads_every_small_units_state_beside_a_large_one(params, tmp_path):
    """TinyGPT's root unit (embedding, tied head) is ~8x a block: with whole sets the backward read
    only `pipeline_depth` units' state and step() read the rest on its critical path; packed, every
    unit's read is issued during backward. The training result is the in-memory run's (bitwise)."""
    def run(offload):
        torch.manual_seed(0)
        model = TinyGPT(vocab=4096, dim=64, layers=4, heads=2, seq=16)
        cfg = {"offload": offload, "tiers": {"nvme_path": str(tmp_path)}, "optimizer": {"pipeline_depth": 3},
               "train": {"handle_signals": False}}
        issued = []
        with zerotier.initialize(model, cfg) as engine:
            for x, y in batches(4096, 16, 2, 3):
                engine.backward(engine(x, y))
                if engine.unit_optimizer.state.has_nvme:
                    issued.append(len(engine.unit_optimizer.state._reads))
                engine.step()
            engine.synchronize()
            state = [engine.unit_optimizer.state.read_state(u) for u in engine.units]
        return issued, len(engine.units), state

    issued, units, on_nvme = run({"params": params, "gradients": "host", "optimizer": "nvme"})
    assert units == 5 and issued == [units] * 3, issued     # 5 > pipeline_depth
    _, _, in_memory = run({"params": "device", "gradients": "host", "optimizer": "host"})
    for a, b in zip(on_nvme, in_memory):
        for k in a:
            assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("clip", [None, 1.0], ids=["plain", "speculated"])
def test_the_unit_final_last_has_its_state_read_at_the_next_backwards_start(clip, tmp_path):
    """[Note: the last final unit's read] The root unit (embedding, tied head) is final last in
    backward: in the first window its state read is issued last; from the second window on, right
    after the first unit's, so it runs under the backward instead of on step()'s critical path.
    Also when each unit is speculated as it becomes final (clipping, train.overlap auto)."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=4096, dim=64, layers=4, heads=2, seq=16)
    cfg = {"offload": {"params": "nvme", "gradients": "host", "optimizer": "nvme"},
           "tiers": {"nvme_path": str(tmp_path)}, "train": {"handle_signals": False, "max_grad_norm": clip}}
    orders = []
    with zerotier.initialize(model, cfg) as engine:
        state = engine.unit_optimizer.state
        root = next(u.index for u in engine.units if not u.name)
        issue = state._issue_read

        def issue_read(unit, block):
            issue(unit, block)
            if unit.index in state._reads and unit.index not in orders[-1]:
                orders[-1].append(unit.index)
        state._issue_read = issue_read
        for x, y in batches(4096, 16, 2, 3):
            orders.append([])
            engine.backward(engine(x, y))
            engine.step()
        speculated = engine.window.overlap.speculation.windows
    assert speculated == (0 if clip is None else 3)
    assert orders[0][-1] == root, orders                        # nothing learnt yet: read as it became final
    assert [o.index(root) for o in orders[1:]] == [1, 1], orders  # next to the first unit final
    assert all(sorted(o) == sorted(orders[0]) for o in orders)    # the same reads, only earlier


class _InterruptedWrite:
    """A state write in flight `lag` s longer than its drive's; with `interrupt`, a Ctrl-C (as a
    second SIGINT raises it) interrupts its first wait(): it still reads its source until it is done."""

    def __init__(self, ticket, src: torch.Tensor, lag: float, interrupt: bool):
        self.ticket, self.interrupt = ticket, interrupt
        self.span = (src.data_ptr(), src.data_ptr() + src.numel() * src.element_size())
        self.ready_at = time.monotonic() + lag

    def done(self) -> bool:
        return self.ticket.done() and time.monotonic() >= self.ready_at

    def wait(self):
        if self.interrupt:
            self.interrupt = False
            raise KeyboardInterrupt
        time.sleep(max(0.0, self.ready_at - time.monotonic()))
        return self.ticket.wait()


def test_a_write_whose_wait_a_ctrl_c_interrupts_keeps_its_ranges_until_it_lands(tmp_path, monkeypatch):
    """[Note: NVMe optimizer pipeline] A Ctrl-C while the store waits a unit's write-back (the first
    of its tickets) is held until every ticket of it is done, then raised: only then do its ranges
    of the staging set come back. Silently wrong before: the ranges came back before the wait, so
    after the Ctrl-C the next read was handed ranges the write still read (the file would get the
    other unit's bytes)."""
    from zerotier.tiers.homes import NVMeHome
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, dim=32, layers=2, heads=2, seq=16)
    cfg = {"offload": {"params": "device", "gradients": "host", "optimizer": "nvme"},
           "tiers": {"nvme_path": str(tmp_path)}, "optimizer": {"pipeline_depth": 3}, "train": {"handle_signals": False}}
    with zerotier.initialize(model, cfg) as engine:
        state = engine.unit_optimizer.state
        first, second = engine.units[0], engine.units[1]
        writes, write_from = [], NVMeHome.write_from

        def slow_write(home, src):
            interrupt = not writes  # the first key's write: the others are waited after it
            ticket = _InterruptedWrite(write_from(home, src), src.tensor, lag=1.0 if interrupt else 0.0,
                                       interrupt=interrupt)
            writes.append(ticket)
            return ticket
        monkeypatch.setattr(NVMeHome, "write_from", slow_write)
        state.read_ahead([first], block=True)
        with state.staged(first):
            pass  # the update: its write-back is issued after the block, left in flight
        monkeypatch.undo()
        assert len(writes) == len(state.layout.keys) > 1
        with pytest.raises(KeyboardInterrupt):
            state.finish()
        in_flight = [w.span for w in writes if not w.done()]
        state.read_ahead([second], block=True)  # the next read takes ranges of the staging sets
        lease, tickets = state._reads[second.index]
        taken = [(v.data_ptr(), v.data_ptr() + v.numel()) for v in lease.views.values()]
        assert not [(a, b) for a in taken for b in in_flight if a[0] < b[1] and b[0] < a[1]], \
            "a read was handed ranges a write still reads"
        assert all(w.done() for w in writes)  # the Ctrl-C was raised once they had landed
        state.drop_prefetched()
