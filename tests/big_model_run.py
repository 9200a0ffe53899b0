"""Train a ~1B-parameter GPT for 2 steps with params and optimizer on NVMe; print peak RSS as JSON.

Run by tests/test_big_model.py in a fresh process so RSS is this run's alone.
    python tests/big_model_run.py NVME_DIR HOST_BUDGET
"""
import json
import sys
import time

import torch

import zerotier
from zerotier.measure import PeakRSS
from zerotier.models import TinyGPT, batches


def main(nvme_dir: str, host_budget: str) -> None:
    with PeakRSS() as rss:
        torch.manual_seed(0)
        with torch.device("cpu"):
            model = TinyGPT(vocab=256, dim=2048, layers=20, heads=16, seq=16, checkpointing=True).to(torch.bfloat16)
        numel = sum(p.numel() for p in set(model.parameters()))
        t0 = time.perf_counter()
        cfg = {"tiers": {"host": host_budget, "device": "4GiB", "nvme_path": nvme_dir},
               "offload": {"params": "nvme", "gradients": "host", "optimizer": "nvme"},
               "precision": {"param_dtype": "bf16"}, "prefetch": {"lookahead": 1}, "optimizer": {"lr": 1e-4},
               # units per Linear, not per block: the optimizer's NVMe staging sets are sized by the
               # largest unit (3 x 12 B x a 50M-param block = 1.8 GB), until sub-groups split units
               "train": {"wrap": ["Linear", "Embedding"]}}
        losses = []
        with zerotier.initialize(model, cfg) as engine:
            init_s = time.perf_counter() - t0
            for x, y in batches(256, 4, 1, 2):  # 4 tokens: the RSS bound, not compute (bf16 gemm is slow without AVX-512)
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
                losses.append(float(loss.detach().float()))
            nvme_peak = engine.store.stats()["peak"]
    print(json.dumps({"numel": numel, "peak_rss": rss.peak, "losses": losses, "init_s": init_s,
                      "total_s": time.perf_counter() - t0, "nvme_peak": nvme_peak}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
