"""Convergence with compact optimizer state (issue 27 item 2): TinyGPT on the demo's text.

Trains the same model from the same seed on the same batches with each optimizer-state
choice (precision.master_dtype / moment_dtype) and prints the loss curves and the final
losses relative to fp32 state (the target: within 2%). The final loss is the mean of the
last `--tail` steps' losses (one step's loss is one batch's: noisier than the state's effect).

    python benchmarks/bench_state_convergence.py --steps 300 --plot docs/state-convergence.png
    python benchmarks/bench_state_convergence.py --model both   # and a transformers Llama from config

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


def make_model(kind: str, vocab: int, seq: int) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM
        return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=seq))
    return TinyGPT(vocab=vocab, dim=64, layers=2, heads=4, seq=seq)


def loss_curve(master: str, moments: str, steps: int, *, kind: str = "tinygpt", seq: int = 32, batch: int = 16,
               lr: float = 3e-3, offload: str = "host", nvme_path: str | None = None) -> list[float]:
    """Each optimizer step's training loss with the given state dtypes (same model, seed and batches)."""
    data, vocab = demo_tokens()
    model = make_model(kind, vocab, seq)
    gen = torch.Generator().manual_seed(1)
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
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--tail", type=int, default=20, help="final loss: the mean of the last TAIL steps")
    ap.add_argument("--model", choices=("tinygpt", "llama", "both"), default="tinygpt",
                    help="TinyGPT, a small transformers Llama from config, or both (default tinygpt)")
    ap.add_argument("--plot", default=None, help="write the curves to this PNG (needs matplotlib)")
    args = ap.parse_args(argv)
    kinds = ["tinygpt", "llama"] if args.model == "both" else [args.model]
    curves = {}
    for kind in kinds:
        for master, moments in CHOICES:
            curves[kind, master, moments] = curve = loss_curve(master, moments, args.steps, kind=kind)
            print(f"{kind} master {master} moments {moments}: " + " ".join(f"{v:.3f}" for v in curve[::25]),
                  flush=True)
    print(f"\nfinal loss (mean of the last {args.tail} steps of {args.steps}), vs fp32 state:")
    for kind in kinds:
        base = final_loss(curves[kind, "fp32", "fp32"], args.tail)
        for master, moments in CHOICES:
            f = final_loss(curves[kind, master, moments], args.tail)
            print(f"  {kind:8s} master {master} moments {moments}: {f:.4f} ({(f / base - 1) * 100:+.2f}%)")
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
                ax.plot(curves[kind, master, moments], label=f"master {master}, moments {moments}", linewidth=0.8)
            ax.set_title(f"{kind} on the demo's text: optimizer-state dtypes")
            ax.set_xlabel("optimizer step")
            ax.set_ylabel("training loss")
            ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=100)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
