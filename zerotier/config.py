"""Configuration: one frozen dataclass per component; the only home of defaults.

Each component's constructor receives only its own section (e.g. the NVMe store
gets `IOConfig` and `TiersConfig`, never the whole `Config`).

Sizes are stored as int bytes, or the string "auto" where "auto" is allowed.
Parsing/validation (dict / TOML / JSON / YAML sources, "24GiB" sizes, unknown-key
suggestions) lives in `Config.from_dict` / `Config.load` below.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Union

Size = Union[int, Literal["auto"]]
Placement = Literal["auto", "device", "host", "nvme"]


@dataclass(frozen=True)
class ZeroConfig:
    stage: int = 0                        # 0 = plain data parallel, 1/2/3 = ZeRO stages
    reduce_bucket_size: int = 25 << 20    # bytes per gradient reduce(-scatter) bucket
    allgather_bucket_size: int = 25 << 20 # bytes per parameter all-gather bucket
    persistence_threshold: int = 100_000  # params with fewer elements are never partitioned (stage 3)
    overlap_comm: bool = True             # run collectives on their own stream/thread
    timeout_s: float = 600.0              # collective timeout


@dataclass(frozen=True)
class TiersConfig:
    device: Size = "auto"                 # accelerator (or CPU "device" pool) budget
    host: Size = "auto"                   # pinned host memory budget
    nvme: Size = 0                        # NVMe budget; 0 disables the tier
    nvme_path: str | None = None          # directory for swap files (a per-run subdir is made)


@dataclass(frozen=True)
class OffloadConfig:
    params: Placement = "auto"
    gradients: Placement = "auto"
    optimizer: Placement = "auto"


@dataclass(frozen=True)
class PrecisionConfig:
    param_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    master_dtype: Literal["fp32"] = "fp32"
    grad_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    loss_scale: Union[float, Literal["dynamic"]] = 1.0  # "dynamic" for fp16
    initial_scale_power: int = 16          # dynamic scaling starts at 2**power
    loss_scale_window: int = 1000          # good steps before the scale doubles
    hysteresis: int = 2                    # overflows tolerated before halving
    min_loss_scale: float = 1.0


@dataclass(frozen=True)
class OptimizerConfig:
    type: Literal["adamw", "adam"] = "adamw"   # adam = L2 weight decay added to the gradient
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    bias_correction: bool = True
    threads: int | Literal["auto"] = "auto"    # CPU Adam threads; auto = physical cores
    simd: Literal["auto", "avx512", "avx2", "scalar"] = "auto"
    subgroup_size: int = 100_000_000           # elements per optimizer sub-group (NVMe pipeline unit)
    delayed_update: bool = False               # one-step-stale CPU update (off: exact)


@dataclass(frozen=True)
class TrainConfig:
    grad_accum_steps: int = 1
    max_grad_norm: float | None = None     # global grad-norm clipping; None disables


@dataclass(frozen=True)
class PrefetchConfig:
    enabled: bool = True
    lookahead: int = 2                     # modules ahead of the one running
    max_bytes: Size = 256 << 20            # bytes in flight for prefetch


@dataclass(frozen=True)
class IOConfig:
    backend: Literal["auto", "io_uring", "threads", "aiofiles"] = "auto"
    block_size: int = 1 << 20              # bytes per submitted I/O request
    queue_depth: int = 32                  # requests in flight per engine
    threads: int = 4                       # pthread-pool backend worker count
    o_direct: bool = True                  # falls back to buffered I/O (one warning) if unsupported
    alignment: int = 4096                  # file offsets/sizes/buffers aligned to this
    checksum: Literal["none", "crc32c"] = "none"
    max_inflight_bytes: Size = 1 << 30     # tier manager bound on bytes in flight


@dataclass(frozen=True)
class ProfileConfig:
    enabled: bool = False
    trace_path: str | None = None          # Chrome/Perfetto trace JSON written here
    sample_interval_ms: float = 10.0       # residency sampling period
    record_function: bool = True           # emit torch.profiler record_function labels


@dataclass(frozen=True)
class Config:
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    tiers: TiersConfig = field(default_factory=TiersConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    io: IOConfig = field(default_factory=IOConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
