"""A run that does not fit, fixed with `zerotier plan`: a 20B full fine-tune on one 80 GB GPU.

Written for: one NVIDIA H100 80 GB, 256 GB of RAM, NVMe at /mnt/nvme.

    zerotier plan --params 20B --layers 48 --config examples/plan_too_big.toml   # refused, with the fixes
    zerotier plan --params 20B --layers 48 --config examples/plan_fixed.toml     # fits
    python examples/plan_fix.py                                                  # both, in order (no GPU needed)

The exact optimizer state of 20B parameters (fp32 master + two fp32 moments, 12 B/param: 224 GiB)
and its fp32 gradient accumulators do not fit 256 GiB of host memory. `zerotier plan` says so
before anything is allocated, prints the whole plan's table (needed / budget / missing per tier)
and the cheapest fixes in order; the second one, compact optimizer state (bf16 master weights +
int8 moments, about 4 B/param), is plan_fixed.toml, and then finetune_full.py trains it
(finetune_20b_compact.toml is the same placement).
"""
from __future__ import annotations

import sys

from zerotier.cli import main as zerotier_cli

from recipe_common import HERE


def main(argv=None) -> dict:
    plan = ["plan", "--params", "20B", "--layers", "48", "--config"]
    print("$ zerotier plan --params 20B --layers 48 --config examples/plan_too_big.toml", flush=True)
    refused = zerotier_cli([*plan, str(HERE / "plan_too_big.toml")])
    print(f"(exit status {refused})\n", flush=True)
    print("$ zerotier plan --params 20B --layers 48 --config examples/plan_fixed.toml", flush=True)
    fixed = zerotier_cli([*plan, str(HERE / "plan_fixed.toml")])
    print(f"(exit status {fixed})", flush=True)
    return {"refused": refused, "fixed": fixed}


if __name__ == "__main__":
    sys.exit(0 if main(sys.argv[1:])["fixed"] == 0 else 1)
