"""GPU review N14: at ZeRO-3 with parameters on NVMe, a prefetch's shard is read by a fetch
worker, not by the compute thread ([Note: ZeRO-3 reads off the compute thread] in params_gather.py).

2 gloo ranks, each NVMe read of a parameter shard slowed down. The compute thread reads only
the shards of the fetches it demands without a prefetch; every prefetch's read runs on a
fetch worker. The weights are bitwise those of the same run without prefetching (every read
and gather issued by the compute thread as it needs the unit, the old path's order of work)
and of parameters on host."""
from __future__ import annotations

import collections
import threading
import time

import pytest
import torch

import zerotier
from zerotier.dist import spawn
from zerotier.models import TinyGPT

VOCAB, SEQ, BATCH, STEPS = 64, 16, 2, 3
READ_DELAY_S = 0.02  # each parameter-shard read; a read on the compute thread would block forward


def make_model():
    torch.manual_seed(0)
    return TinyGPT(vocab=VOCAB, dim=32, layers=4, heads=2, seq=SEQ)


def batches(rank):
    gen = torch.Generator().manual_seed(1 + rank)
    for _ in range(STEPS):
        data = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
        yield data[:, :-1], data[:, 1:]


def train_rank(rank, world_size, nvme_dir):
    results = {}
    for name, params, prefetch in (("nvme-prefetch", "nvme", True), ("nvme-demand", "nvme", False),
                                   ("host-prefetch", "host", True)):
        cfg = {"zero": {"stage": 3, "persistence_threshold": 200, "reduce_bucket_size": 4096},
               "offload": {"params": params, "gradients": "host", "optimizer": "host"},
               "tiers": {"nvme_path": nvme_dir}, "prefetch": {"enabled": prefetch, "lookahead": 2},
               "optimizer": {"lr": 1e-2}, "train": {"max_grad_norm": 1.0}}
        reads, starts = [], collections.Counter()
        with zerotier.initialize(make_model(), cfg) as engine:
            store, params_store = engine.params.store, engine.params
            if params == "nvme":
                real_read, real_start = store.read, params_store._start

                def slow_read(key, *args, **kwargs):
                    if key.endswith(".param"):
                        reads.append(threading.current_thread().name)
                        time.sleep(READ_DELAY_S)
                    return real_read(key, *args, **kwargs)

                def counted_start(unit, reason):
                    if params_store.sharding.gathered(unit):
                        starts[reason] += 1
                    return real_start(unit, reason)
                store.read, params_store._start = slow_read, counted_start
            for x, y in batches(rank):
                engine.backward(engine(x, y))
                engine.step()
            weights = engine.parameters_fp32()
        results[name] = (weights, reads, dict(starts))
    return results


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return spawn(train_rank, 2, str(tmp_path_factory.mktemp("nvme")), timeout_s=600)


def test_prefetched_shards_are_read_off_the_compute_thread(two_ranks):
    for results in two_ranks:
        _, reads, starts = results["nvme-prefetch"]
        on_compute = [t for t in reads if not t.startswith("zerotier-fetch")]
        assert starts["prefetch"] > 0 and starts["prefetch"] > starts.get("demand", 0)
        assert len(on_compute) == starts.get("demand", 0), (starts, collections.Counter(reads))
        assert len(reads) - len(on_compute) == starts["prefetch"]
        _, reads, starts = results["nvme-demand"]  # no prefetch: every read is the compute thread's
        assert set(starts) == {"demand"} and len(reads) == starts["demand"]
        assert not any(t.startswith("zerotier-fetch") for t in reads)


def test_reads_off_the_compute_thread_train_bitwise_as_before(two_ranks):
    for results in two_ranks:
        weights = results["nvme-prefetch"][0]
        assert weights.keys() == results["nvme-demand"][0].keys()
        for other in ("nvme-demand", "host-prefetch"):
            for key, value in weights.items():
                assert torch.equal(value, results[other][0][key]), (other, key)
    assert all(torch.equal(a, b) for a, b in zip(two_ranks[0]["nvme-prefetch"][0].values(),
                                                 two_ranks[1]["nvme-prefetch"][0].values()))
