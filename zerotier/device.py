"""Which device a process computes on, and how many ranks share its node.

[Note: choosing the device]
`train.device` picks it before anything is allocated or a process group exists:
  cpu       the CPU (the "device" tier is then a budgeted region of RAM);
  cuda      cuda:LOCAL_RANK (torchrun's per-node rank; 0 without a launcher), or cuda:0
            when the process sees exactly one GPU (SLURM --gpus-per-task=1, Kubernetes);
  cuda:N    that GPU, whatever LOCAL_RANK says;
  auto      $ZEROTIER_DEVICE if set (the test suite sets cpu, so it runs unchanged on a
            GPU host), else cuda:LOCAL_RANK when CUDA is available, else cpu.
A CUDA device is made current (`torch.cuda.set_device`) at once, so streams, events,
NCCL and the caching allocator of this process all use it. Worker threads do not inherit
the current device: they call `enter(device)` first.

The ranks of one node share its RAM, disk and CPU cores: `local_world_size()` (torchrun's
LOCAL_WORLD_SIZE, else 1) divides the "auto" host and NVMe budgets and the CPU Adam threads.
"""
from __future__ import annotations

import os

import torch

from .errors import ConfigError


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def local_world_size() -> int:
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def choose(setting: str) -> torch.device:
    """The device `train.device` names ([Note: choosing the device]); CUDA ones become current."""
    if setting == "auto":
        setting = os.environ.get("ZEROTIER_DEVICE", "").strip() or \
            ("cuda" if torch.cuda.is_available() else "cpu")
    if setting == "cpu":
        return torch.device("cpu")
    if not setting.startswith("cuda"):
        raise ConfigError(f"device {setting!r} (train.device or $ZEROTIER_DEVICE): use auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise ConfigError(f"train.device = {setting!r}, but this torch has no usable CUDA device "
                          f"(torch {torch.__version__}, cuda {torch.version.cuda}); use 'cpu' or 'auto'")
    if setting == "cuda":
        index = 0 if torch.cuda.device_count() == 1 else local_rank()
    else:
        index = int(setting.split(":", 1)[1])
    if index >= torch.cuda.device_count():
        raise ConfigError(f"device cuda:{index} does not exist: {torch.cuda.device_count()} visible CUDA "
                          f"device(s) (LOCAL_RANK={local_rank()}, CUDA_VISIBLE_DEVICES="
                          f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})")
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)
    return device


def enter(device: torch.device) -> None:
    """Make `device` current on the calling (worker) thread; a no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
