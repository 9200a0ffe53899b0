"""Configuration: one frozen dataclass per component; the only home of defaults.

Each component's constructor receives only its own section (e.g. the NVMe store
gets `IOConfig` and `TiersConfig`, never the whole `Config`).

Sizes are stored as int bytes, or the string "auto" where "auto" is allowed.
Sources: `Config.from_dict`, `Config.load` (.toml / .json / .yaml, read by config_files.py),
`Config.from_deepspeed` (deepspeed_config.py), or `Config.coerce` (any of those, a path, or None
for the defaults). `docs/config.md` lists every key; sizes such as "24GiB" are units.py's.

[Note: validation on construction]
Every section validates and normalizes itself in `__post_init__` (sizes such as
"24GiB" become int bytes, ints given for floats become floats, lists become
tuples), driven by the field type hints plus the value rules of config_schema.py.
`Config.__post_init__` adds the rules that span sections. So a `Config` obtained
any way - from a file, a dict, direct construction, `dataclasses.replace` - is
valid, and every error names the key path, e.g. `tiers.host`.

[Note: keys a trainer fills]
The keys in TRAINER_KEYS (optimizer.lr / betas / eps / weight_decay, train.grad_accum_steps /
max_grad_norm, precision.param_dtype) may be "auto", meaning what Hugging Face's DeepSpeed
integration means by it: the trainer fills the key from its own arguments (ZerotierTrainer
from TrainingArguments, as HF's HfTrainerDeepSpeedConfig.trainer_config_process does).
`zerotier.initialize` gives a key still "auto" zerotier's default, with one warning naming
each default used (`Config.auto_to_defaults`). A trainer fills a key the config left "auto" or
did not give, and refuses one the config gave with another value, naming both (HF refuses such
a mismatch in a DeepSpeed config too). `Config.given(path)`: the keys the source of
`from_dict` / `load` held; for a Config built otherwise, the keys that differ from the default.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Union

from . import config_files, deepspeed_config
from .config_schema import (OVERLAP, TRAINER_KEYS, Auto, Bytes, Placement, Size, TierFractions, check_field_rule,
                            convert_value, resolve_aliases, type_hints)
from .errors import ConfigError
from .tier_names import TIER_NAMES
from .units import format_size


class _Section:
    """Base of every config section: validates and normalizes its fields when built.

    See [Note: validation on construction] at the top of this module.
    """

    def __post_init__(self) -> None:
        section = _SECTION_NAMES[type(self)]
        hints = type_hints(type(self))
        for f in dataclasses.fields(self):
            path = f"{section}.{f.name}"
            value = convert_value(getattr(self, f.name), hints[f.name], path)
            check_field_rule(path, value)
            object.__setattr__(self, f.name, value)  # frozen: normalizing here is the only write
        for check in _SECTION_CHECKS.get(section, ()):
            check(self)


@dataclass(frozen=True)
class ZeroConfig(_Section):
    stage: int = 0                        # 0 = plain data parallel, 1/2/3 = ZeRO stages
    reduce_bucket_size: Bytes = 25 << 20  # bytes per gradient reduce(-scatter) bucket
    allgather_bucket_size: Bytes = 25 << 20  # bytes per parameter all-gather bucket
    persistence_threshold: int = 100_000  # params with fewer elements are never partitioned (stage 3)
    overlap_comm: bool = True             # run collectives on their own stream/thread
    timeout_s: float = 600.0              # collective timeout


@dataclass(frozen=True)
class TiersConfig(_Section):
    device: Size = "auto"                 # accelerator (or CPU "device" pool) budget
    device_reserve: Size = "auto"         # left out of an auto device budget: activations etc.
    host: Size = "auto"                   # pinned host memory budget
    nvme: Size = "auto"                   # NVMe budget; auto = free space at nvme_path; 0 disables the tier
    nvme_path: str | None = None          # directory for swap files (a per-run subdir is made)


@dataclass(frozen=True)
class OffloadConfig(_Section):
    params: Placement = "auto"
    gradients: Placement = "auto"       # nvme: a file per unit, folded into as backward goes (grads.py)
    optimizer: Union[Placement, TierFractions] = "auto"  # or a split {host = 0.6, nvme = 0.4} (planner/sizes.py)


@dataclass(frozen=True)
class PrecisionConfig(_Section):
    param_dtype: Literal["fp32", "bf16", "fp16", "auto"] = "fp32"
    master_dtype: Literal["fp32", "bf16"] = "fp32"  # optimizer's master weights; bf16: stochastic rounding
    moment_dtype: Literal["fp32", "bf16", "int8"] = "fp32"  # Adam's moments; int8: blockwise, per-block absmax
    grad_dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"  # accumulators; auto: bf16 with bf16 params, else fp32
    loss_scale: Union[float, Literal["dynamic"]] = 1.0  # "dynamic" for fp16
    initial_scale_power: int = 16          # dynamic scaling starts at 2**power
    loss_scale_window: int = 1000          # good steps before the scale doubles
    hysteresis: int = 2                    # overflows tolerated before halving
    min_loss_scale: float = 1.0

    @property
    def accumulator_dtype(self) -> str:
        """The gradient accumulators' dtype: grad_dtype, or for "auto" bf16 under bf16 parameters
        (half the bytes; each micro-batch is added in fp32 and rounded once, docs/config.md) and
        fp32 otherwise."""
        if self.grad_dtype != "auto":
            return self.grad_dtype
        return "bf16" if self.param_dtype == "bf16" else "fp32"


@dataclass(frozen=True)
class OptimizerConfig(_Section):
    # the update rule (optim/rules/): adam = L2 weight decay added to the gradient; lion = Lion (one
    # moment), whose lr / betas / weight_decay left at these defaults become 1e-4 / (0.9, 0.99) / 0.0
    type: Literal["adamw", "adam", "lion"] = "adamw"
    lr: float | Auto = 1e-3
    betas: tuple[float, float] | Auto = (0.9, 0.999)
    eps: float | Auto = 1e-8
    weight_decay: float | Auto = 0.01
    no_weight_decay: tuple[str, ...] = ()      # parameter-name globs exempt from weight decay ("*.bias")
    bias_correction: bool = True
    threads: int | Literal["auto"] = "auto"    # CPU Adam threads; auto = physical cores
    simd: Literal["auto", "avx512vbmi", "avx512", "avx2", "scalar"] = "auto"
    pipeline_depth: int = 3                    # NVMe optimizer staging sets (reads ahead = depth - 2)
    # where a host/NVMe unit's update runs ([Note: where the update runs] in planner/step_on.py):
    # cpu = the native CPU kernel; device = staged to the device and updated there; auto = the planner's
    # choice: the rate-balanced split, every unit on the CPU or every unit on the device, the fastest step
    step_on: Literal["cpu", "device", "auto"] = "auto"


@dataclass(frozen=True)
class TrainConfig(_Section):
    grad_accum_steps: int | Auto = 1
    max_grad_norm: float | None | Auto = None  # global grad-norm clipping; None disables
    # what of a window's update overlaps its backward or the next window ([Note: overlap policies] in
    # overlap/base.py): none | early | speculative | delayed | auto. Old keys: early_step, speculative_step,
    # delayed_update (aliases, one warning each)
    overlap: OVERLAP = "auto"
    device: str = "auto"                   # auto | cpu | cuda | cuda:N (see zerotier/device.py)
    wrap: Literal["auto"] | tuple[str, ...] = "auto"  # unit boundaries: auto | module class names (state.py)
    handle_signals: bool = True            # SIGTERM/SIGINT stop at a step boundary ([Note: graceful stop])
    checkpoint_on_signal: str | None = None  # directory for the checkpoint written on such a stop


@dataclass(frozen=True)
class PrefetchConfig(_Section):
    enabled: bool = True
    lookahead: int = 2                     # modules ahead of the one running
    max_bytes: Size = 256 << 20            # bytes in flight for prefetch


@dataclass(frozen=True)
class IOConfig(_Section):
    backend: Literal["auto", "io_uring", "threads", "aiofiles"] = "auto"
    block_size: Bytes = 1 << 20            # bytes per submitted I/O request
    queue_depth: int = 32                  # requests in flight per engine
    threads: int = 4                       # pthread-pool backend worker count
    o_direct: bool = True                  # falls back to buffered I/O (one warning) if unsupported
    alignment: Bytes = 4096                # file offsets/sizes/buffers aligned to this
    checksum: Literal["none", "crc32c"] = "crc32c"  # swap files verified on read: a planted/zeroed file fails


@dataclass(frozen=True)
class ProfileConfig(_Section):
    enabled: bool = False
    trace_path: str | None = None          # Chrome/Perfetto trace JSON written here
    sample_interval_ms: float = 10.0       # residency sampling period
    record_function: bool = True           # emit torch.profiler record_function labels
    max_events: int = 200_000              # newest records kept per kind (bounded memory on long runs)


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

    def __post_init__(self) -> None:
        for name, section_cls in _SECTIONS.items():
            section = getattr(self, name)
            if not isinstance(section, section_cls):
                raise ConfigError(
                    f"{name}: expected a {section_cls.__name__}, got {type(section).__name__}"
                    " (use Config.from_dict to build from plain dicts)"
                )
        _check_nvme_placement(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Config:
        """Build from `{section: {key: value}}`; sections and keys left out keep their defaults.

        A section may also be given as its dataclass instance, or as None (= defaults).
        """
        if not isinstance(data, Mapping):
            raise ConfigError(f"config must be a mapping of sections, got {type(data).__name__}")
        sections = {}
        for name, value in data.items():
            section_cls = _SECTIONS.get(name)
            if section_cls is None:
                raise _unknown_key_error(str(name), "", _SECTIONS)
            sections[name] = _section_from_value(section_cls, name, value)
        cfg = cls(**sections)
        given = {f"{name}.{key}" for name, value in data.items() if isinstance(value, Mapping) for key in value}
        object.__setattr__(cfg, "_given", frozenset(given))  # [Note: keys a trainer fills]
        return cfg

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Config:
        """Read a .toml, .json, .yaml or .yml file; errors are prefixed with the file name."""
        path = Path(path)
        data = config_files.read(path)
        try:
            return cls.from_dict(data)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None

    @classmethod
    def coerce(cls, source: Config | Mapping[str, Any] | str | os.PathLike[str] | None) -> Config:
        """The one entry point for user-facing APIs: a Config, a dict, a file path, or None (defaults)."""
        if source is None:
            return cls()
        if isinstance(source, Config):
            return source
        if isinstance(source, Mapping):
            return cls.from_dict(source)
        if isinstance(source, (str, os.PathLike)):
            return cls.load(source)
        raise ConfigError(
            f"cannot make a Config from {type(source).__name__}; pass a Config, a dict, "
            "a path to a .toml/.json/.yaml file, or None for the defaults"
        )

    @classmethod
    def from_deepspeed(cls, source: Mapping[str, Any] | str | os.PathLike[str]) -> Config:
        """A zerotier Config from a DeepSpeed config (dict or JSON file): every key with a zerotier
        meaning mapped, "auto" kept for the trainer to fill, the others listed in one warning ([Note: DeepSpeed keys] in
        deepspeed_config.py)."""
        converted = deepspeed_config.load(source)
        deepspeed_config.warn_unmapped(converted.unmapped)
        return cls.from_converted(converted)  # "auto" keys stay "auto" ([Note: keys a trainer fills])

    @classmethod
    def from_converted(cls, converted: deepspeed_config.Converted) -> Config:
        """The Config of a DeepSpeed conversion; a value zerotier refuses is a ConfigError naming the
        DeepSpeed key (and file) it came from, not only the zerotier key the user never wrote."""
        try:
            return cls.from_dict(converted.sections)
        except ConfigError as exc:
            text = str(exc)
            key = next((k for k in converted.origins if text.startswith((f"{k}:", f"{k} "))), None)
            origin = f"DeepSpeed {converted.origins[key]} -> " if key is not None else ""
            raise ConfigError((f"{converted.file}: " if converted.file else "") + origin + text) from None

    def value(self, path: str) -> Any:
        """The value at "section.key"."""
        section, key = path.split(".")
        return getattr(getattr(self, section), key)

    def given(self, path: str) -> bool:
        """Whether the config's source set `path` ([Note: keys a trainer fills])."""
        given = self.__dict__.get("_given")
        if given is not None:
            return path in given
        section, key = path.split(".")
        return self.value(path) != next(f.default for f in dataclasses.fields(getattr(self, section))
                                        if f.name == key)

    def with_values(self, values: Mapping[str, Any]) -> Config:
        """This config with the "section.key" paths of `values` set (validated as any Config); those
        count as filled, not given, and `given` answers as before for every other key."""
        changes: dict[str, dict[str, Any]] = {}
        for path, value in values.items():
            section, key = path.split(".")
            changes.setdefault(section, {})[key] = value
        out = dataclasses.replace(self, **{name: dataclasses.replace(getattr(self, name), **kv)
                                           for name, kv in changes.items()})
        object.__setattr__(out, "_given", frozenset(p for p in _paths() if self.given(p) and p not in values))
        return out

    def auto_to_defaults(self) -> Config:
        """Keys still "auto" that a trainer was to fill get zerotier's defaults, with one warning
        naming each ([Note: keys a trainer fills]); the config itself when none is."""
        left = [path for path in TRAINER_KEYS if self.value(path) == "auto"]
        if not left:
            return self
        defaults = {path: _DEFAULTS[path] for path in left}
        warnings.warn("config keys left \"auto\" (filled by a trainer) take zerotier's defaults: "
                      + ", ".join(f"{p} = {v!r}" for p, v in defaults.items())
                      + ". Set them in the config, or let ZerotierTrainer fill them from TrainingArguments",
                      UserWarning, stacklevel=3)
        return self.with_values(defaults)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain JSON-serializable dict (sizes as int bytes, tuples as lists); from_dict accepts it back."""
        plain: dict[str, dict[str, Any]] = {}
        for name in _SECTIONS:
            section = getattr(self, name)
            values = {f.name: getattr(section, f.name) for f in dataclasses.fields(section)}
            plain[name] = {key: list(v) if isinstance(v, tuple) else dict(v) if isinstance(v, dict) else v
                           for key, v in values.items()}
        return plain


def _section_from_value(section_cls: type, name: str, value: Any) -> Any:
    if value is None:
        return section_cls()
    if isinstance(value, section_cls):
        return value
    if not isinstance(value, Mapping):
        raise ConfigError(f"config section '{name}' must be a table of keys, got {type(value).__name__}")
    value = resolve_aliases(name, value)  # old keys of train.overlap
    valid = {f.name: f for f in dataclasses.fields(section_cls)}
    for key in value:
        if key not in valid:
            raise _unknown_key_error(str(key), name, valid)
    return section_cls(**value)


def _unknown_key_error(key: str, section: str, valid: Mapping[str, Any]) -> ConfigError:
    prefix = f"{section}." if section else ""
    close = difflib.get_close_matches(key, list(valid), n=1)
    hint = f"; did you mean '{prefix}{close[0]}'?" if close else ";"
    return ConfigError(f"unknown config key '{prefix}{key}'{hint} valid keys: {', '.join(sorted(valid))}")


# ---------------------------------------------------------------------------------------------
# Rules that span the fields of a section, or sections


def _check_nvme_budget_has_path(tiers: TiersConfig) -> None:
    if tiers.nvme != "auto" and tiers.nvme > 0 and tiers.nvme_path is None:
        raise ConfigError(
            f"tiers.nvme = {format_size(tiers.nvme)} needs tiers.nvme_path: set it to a directory on the NVMe drive"
        )


def _check_io_block_size(io: IOConfig) -> None:
    if io.block_size % io.alignment:
        raise ConfigError(f"io.block_size: must be a multiple of io.alignment ({io.alignment}), got {io.block_size}")


def _check_optimizer_split(offload: OffloadConfig) -> None:
    """offload.optimizer as {tier: fraction}: fractions of the parameters, > 0, summing to 1, over host
    and nvme ([Note: optimizer split] in planner/sizes.py); a one-tier table becomes that tier's name."""
    split = offload.optimizer
    if not isinstance(split, dict):
        return
    shown = ", ".join(f"{t} = {f:g}" for t, f in split.items())
    if not split:
        raise ConfigError("offload.optimizer: an empty table; give tier fractions such as "
                          "{host = 0.6, nvme = 0.4}, or one tier name")
    bad = [t for t, f in split.items() if not 0 < f <= 1]
    if bad:
        raise ConfigError(f"offload.optimizer = {{{shown}}}: each fraction must be in (0, 1] "
                          f"(leave a tier out instead of giving it 0); {', '.join(bad)} is not")
    if abs(sum(split.values()) - 1) > 1e-6:
        raise ConfigError(f"offload.optimizer = {{{shown}}}: the fractions must sum to 1, they sum to "
                          f"{sum(split.values()):g}")
    if len(split) > 1 and "device" in split:
        raise ConfigError(f"offload.optimizer = {{{shown}}}: a split spans host and nvme only (the device "
                          "tier holds the whole optimizer state or none of it): drop device, or set "
                          "offload.optimizer = 'device'")
    normalized = {t: split[t] for t in TIER_NAMES if t in split}  # fastest first: the first units go there
    object.__setattr__(offload, "optimizer", next(iter(normalized)) if len(normalized) == 1 else normalized)


_SECTION_CHECKS: dict[str, tuple[Callable[[Any], None], ...]] = {
    "tiers": (_check_nvme_budget_has_path,),
    "offload": (_check_optimizer_split,),
    "io": (_check_io_block_size,),
}


def _check_nvme_placement(cfg: Config) -> None:
    for f in dataclasses.fields(cfg.offload):
        value = getattr(cfg.offload, f.name)
        if value != "nvme" and not (isinstance(value, dict) and "nvme" in value):
            continue
        shown = "'nvme'" if value == "nvme" else f"{{{', '.join(f'{t} = {x:g}' for t, x in value.items())}}}"
        if cfg.tiers.nvme_path is None:
            raise ConfigError(
                f"offload.{f.name} = {shown} needs tiers.nvme_path: set it to a directory on the NVMe drive"
            )
        if cfg.tiers.nvme == 0:
            raise ConfigError(
                f"offload.{f.name} = {shown} but tiers.nvme = 0 disables the NVMe tier:"
                " set tiers.nvme to a size such as '500GiB', or 'auto'"
            )


_SECTIONS: dict[str, type] = {f.name: type_hints(Config)[f.name] for f in dataclasses.fields(Config)}
_SECTION_NAMES: dict[type, str] = {cls: name for name, cls in _SECTIONS.items()}


def _paths() -> list[str]:
    return [f"{name}.{f.name}" for name, cls in _SECTIONS.items() for f in dataclasses.fields(cls)]


_DEFAULTS: dict[str, Any] = {path: next(f.default for f in dataclasses.fields(_SECTIONS[path.split(".")[0]])
                                        if f.name == path.split(".")[1]) for path in TRAINER_KEYS}
