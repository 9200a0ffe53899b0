"""Train a small GPT with zerotier: the three-line change to a plain PyTorch loop.

    python examples/train_gpt.py --config examples/offload_nvme.toml --steps 50
"""
import argparse

import torch

import zerotier
from zerotier.models import TinyGPT, batches


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None, help="zerotier config file (TOML/JSON/YAML); default: all on device")
    ap.add_argument("--steps", type=int, default=50, help="micro-batches to train")
    ap.add_argument("--dim", type=int, default=256, help="model width")
    ap.add_argument("--layers", type=int, default=4, help="transformer blocks")
    args = ap.parse_args()

    torch.manual_seed(0)
    model = TinyGPT(vocab=512, dim=args.dim, layers=args.layers, heads=8, seq=64)
    engine = zerotier.initialize(model, args.config)                 # 1: instead of the optimizer
    print(engine.plan.summary())
    for step, (x, y) in enumerate(batches(512, 64, 8, args.steps), 1):
        x, y = x.to(engine.device), y.to(engine.device)
        loss = engine(x, y)                                          # 2: engine(...) (or model(...))
        engine.backward(loss)                                        # 3: instead of loss.backward()
        engine.step()                                                #    and optimizer.step()/zero_grad()
        if step % 10 == 0:
            print(f"step {step}: loss {loss.item():.4f}")
    engine.close()


if __name__ == "__main__":
    main()
