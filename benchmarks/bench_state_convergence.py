"""Convergence with compact optimizer state (issue 27 item 2): TinyGPT on the demo's text.

Trains the same model from the same seed on the same batches with each optimizer-state
choice (precision.master_dtype / moment_dtype) and prints the loss curves and the final
losses relative to fp32 state (the target: within 2%). The final loss is the mean of the
last `--tail` steps' losses (one step's loss is one batch's: noisier than the state's effect).

    python benchmarks/bench_state_convergence.py --steps 300 --plot docs/state-convergence.png
    python benchmarks/bench_state_convergence.py --model both --llama-steps 100   # and a transformers Llama
    python benchmarks/bench_state_convergence.py --model both --seeds 0 1 2       # seeds: model init, batches

The plot needs matplotlib (optional: without it the curves are printed only).
tests/test_state_dtypes.py::test_compact_state_converges_like_fp32 runs a short version.
"""
from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

import torch

import zerotier
from zerotier.models import TinyGPT

ROOT = Path(__file__).resolve().parent.parent
CHOICES = (("fp32", "fp32"), ("bf16", "bf16"), ("bf16", "int8"), ("fp32", "int8"))


def demo_tokens() -> tuple[torch.Tensor, int]:
    """The demo's text (examples/train_gpt.py) as character ids, and the vocabulary size."""
    text = runpy.run_path(str(ROOT / "examples" / "train_gpt.py"))["TEXT"]
    chars = sorted(set(text))
    return torch.tensor([chars.index(c) for c in text]), len(chars)


def make_model(kind: str, vocab: int, seq: int, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM
        return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=seq))
    return TinyGPT(vocab=vocab, dim=64, layers=2, heads=4, seq=seq)


def loss_curve(master: str, moments: str, steps: int, *, kind: str = "tinygpt", seq: int = 32, batch: int = 16,
               lr: float = 3e-3, offload: str = "host", nvme_path: str | None = None,
               seed: int = 0) -> list[float]:
    """Each optimizer step's training loss with the given state dtypes (same model, seed and batches:
    `seed` initializes the model, seed + 1 draws the batches)."""
    data, vocab = demo_tokens()
    model = make_model(kind, vocab, seq, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    cfg = {"optimizer": {"lr": lr, "weight_decay": 0.01}, "precision": {"master_dtype": master, "moment_dtype": moments},
           "offload": {"params": "device", "gradients": "device", "optimizer": offload}}
    if nvme_path is not None:
        cfg["tiers"] = {"nvme_path": nvme_path}
    losses = []
    with zerotier.initialize(model, cfg) as engine:
        for _ in range(steps):
            starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
            chunk = torch.stack([data[s: s + seq + 1] for s in starts])
            x, y = chunk[:, :-1], chunk[:, 1:]
            if kind == "llama":
                loss = engine(input_ids=x, labels=y).loss
            else:
                loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
    return losses


def final_loss(curve: list[float], tail: int) -> float:
    return sum(curve[-tail:]) / len(curve[-tail:])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300, help="TinyGPT's steps (default 300)")
    ap.add_argument("--llama-steps", type=int, default=100, help="the Llama's steps (default 100)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="model and batch seeds (default 0)")
    ap.add_argument("--tail", type=int, default=20, help="final loss: the mean of the last TAIL steps")
    ap.add_argument("--model", choices=("tinygpt", "llama", "both"), default="tinygpt",
                    help="TinyGPT, a small transformers Llama from config, or both (default tinygpt)")
    ap.add_argument("--plot", default=None, help="write the curves to this PNG (needs matplotlib)")
    args = ap.parse_args(argv)
    kinds = ["tinygpt", "llama"] if args.model == "both" else [args.model]
    steps = {"tinygpt": args.steps, "llama": args.llama_steps}
    curves = {}
    for seed in args.seeds:
        for kind in kinds:
            for master, moments in CHOICES:
                curves[kind, master, moments, seed] = curve = loss_curve(master, moments, steps[kind], kind=kind,
                                                                         seed=seed)
                print(f"{kind} seed {seed} master {master} moments {moments}: "
                      + " ".join(f"{v:.3f}" for v in curve[::25]), flush=True)
    print(f"\nfinal loss (mean of the last {args.tail} steps), vs fp32 state (master fp32, moments fp32):")
    print(f"  {'model':8s} {'steps':>5s} {'seed':>4s} {'master':6s} {'moments':7s} {'final':>7s} {'vs fp32':>8s}")
    for kind in kinds:
        for seed in args.seeds:
            base = final_loss(curves[kind, "fp32", "fp32", seed], args.tail)
            for master, moments in CHOICES:
                f = final_loss(curves[kind, master, moments, seed], args.tail)
                print(f"  {kind:8s} {steps[kind]:5d} {seed:4d} {master:6s} {moments:7s} {f:7.4f} "
                      f"{(f / base - 1) * 100:+7.2f}%")
    if args.plot:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
            return
        fig, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4), squeeze=False)
        for ax, kind in zip(axes[0], kinds):
            for master, moments in CHOICES:
                ax.plot(curves[kind, master, moments, args.seeds[0]], label=f"master {master}, moments {moments}",
                        linewidth=0.8)
            ax.set_title(f"{kind} on the demo's text: optimizer-state dtypes (seed {args.seeds[0]})")
            ax.set_xlabel("optimizer step")
            ax.set_ylabel("training loss")
            ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=100)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
