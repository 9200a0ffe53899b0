"""Configuration: one frozen dataclass per component; the only home of defaults.

Each component's constructor receives only its own section (e.g. the NVMe store
gets `IOConfig` and `TiersConfig`, never the whole `Config`).

Sizes are stored as int bytes, or the string "auto" where "auto" is allowed.
Sources: `Config.from_dict`, `Config.load` (.toml / .json / .yaml), or
`Config.coerce` (any of those, a path, or None for the defaults). `docs/config.md`
lists every key.

[Note: validation on construction]
Every section validates and normalizes itself in `__post_init__` (sizes such as
"24GiB" become int bytes, ints given for floats become floats, lists become
tuples), driven by the field type hints plus the value rules in `_FIELD_RULES`.
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
import functools
import json
import math
import os
import re
import reprlib
import types
import warnings
from dataclasses import dataclass, field
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Annotated, Any, Callable, Literal, Mapping, Union, get_args, get_origin, get_type_hints

from .errors import ConfigError

_BYTES = "bytes"  # Annotated marker: an int count of bytes, writable as "24GiB" in config sources
Bytes = Annotated[int, _BYTES]
Size = Union[Bytes, Literal["auto"]]
Placement = Literal["auto", "device", "host", "nvme"]
Auto = Literal["auto"]  # a trainer-filled key: [Note: keys a trainer fills]
TierFractions = dict[Literal["device", "host", "nvme"], float]  # offload.optimizer split: tier -> fraction


class _Section:
    """Base of every config section: validates and normalizes its fields when built.

    See [Note: validation on construction] at the top of this module.
    """

    def __post_init__(self) -> None:
        section = _SECTION_NAMES[type(self)]
        hints = _type_hints(type(self))
        for f in dataclasses.fields(self):
            path = f"{section}.{f.name}"
            value = _convert(getattr(self, f.name), hints[f.name], path)
            _check_field_rule(path, value)
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
    optimizer: Union[Placement, TierFractions] = "auto"  # or a split {host = 0.6, nvme = 0.4} (planner.py)


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
    type: Literal["adamw", "adam"] = "adamw"   # adam = L2 weight decay added to the gradient
    lr: float | Auto = 1e-3
    betas: tuple[float, float] | Auto = (0.9, 0.999)
    eps: float | Auto = 1e-8
    weight_decay: float | Auto = 0.01
    no_weight_decay: tuple[str, ...] = ()      # parameter-name globs exempt from weight decay ("*.bias")
    bias_correction: bool = True
    threads: int | Literal["auto"] = "auto"    # CPU Adam threads; auto = physical cores
    simd: Literal["auto", "avx512", "avx2", "scalar"] = "auto"
    pipeline_depth: int = 3                    # NVMe optimizer staging sets (reads ahead = depth - 2)


@dataclass(frozen=True)
class TrainConfig(_Section):
    grad_accum_steps: int | Auto = 1
    max_grad_norm: float | None | Auto = None  # global grad-norm clipping; None disables
    early_step: bool = False               # Adam during the window's last backward ([Note: early step])
    # Adam during the last backward even with clipping / a dynamic loss scale, undone when the global
    # check disagrees ([Note: speculative step] in speculation.py). auto: on when either is set
    speculative_step: bool | Literal["auto"] = "auto"
    # the update of each window runs during the next one, which reads weights one step stale (ZeRO-Offload's
    # DPU): not the same training ([Note: delayed update] in delayed.py)
    delayed_update: bool = False
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
        reader = _FILE_READERS.get(path.suffix.lower())
        if reader is None:
            raise ConfigError(
                f"{path}: unknown config file extension {path.suffix!r}; use .toml, .json, .yaml or .yml"
            )
        try:
            data = reader(path)
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
        if data is None:  # an empty YAML file
            data = {}
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
        from . import deepspeed_config

        converted = deepspeed_config.load(source)
        deepspeed_config.warn_unmapped(converted.unmapped)
        return deepspeed_config.build(converted)  # "auto" keys stay "auto" ([Note: keys a trainer fills])

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
# Files


def _read_toml(path: Path) -> Any:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise ConfigError(f"{path}: reading TOML on Python 3.10 needs tomli: pip install tomli") from None
    with open(path, "rb") as f:
        try:
            return tomllib.load(f)
        except (ValueError, RecursionError) as exc:  # TOMLDecodeError is a ValueError
            raise _not_valid(path, "TOML", exc) from None


def _read_json(path: Path) -> Any:
    with open(path, "rb") as f:
        try:
            return json.load(f)
        except (ValueError, RecursionError) as exc:
            raise _not_valid(path, "JSON", exc) from None


def _read_yaml(path: Path) -> Any:
    try:
        import yaml
    except ImportError:
        raise ConfigError(
            f"{path}: reading YAML needs PyYAML: pip install pyyaml (or use a .toml or .json file)"
        ) from None
    with open(path, "rb") as f:
        try:
            return yaml.safe_load(f)
        except (yaml.YAMLError, ValueError, RecursionError) as exc:  # ValueError: a bad date, a 5000-digit int
            raise _not_valid(path, "YAML", exc) from None


def _not_valid(path: Path, kind: str, exc: Exception) -> ConfigError:
    """Any parser error (bad syntax, not UTF-8, nested too deeply, a value the parser's own
    constructor refuses) as a ConfigError naming the file: a bad file is never a traceback."""
    if isinstance(exc, UnicodeDecodeError):
        why = f"not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); save it as UTF-8"
    elif isinstance(exc, RecursionError):
        why = "nested too deeply"
    else:
        why = str(exc)
    return ConfigError(f"{path}: not valid {kind}: {why}")


_FILE_READERS: dict[str, Callable[[Path], Any]] = {
    ".toml": _read_toml,
    ".json": _read_json,
    ".yaml": _read_yaml,
    ".yml": _read_yaml,
}


# ---------------------------------------------------------------------------------------------
# Sizes: IEC units (KiB, MiB, ...) and bare letters (K, M, ...) are binary; SI units (KB, MB, ...)
# are decimal. Case does not matter. "1.5TB" == 1_500_000_000_000; "4k" == 4096.

_SIZE_UNITS = {"": 1, "b": 1}
for _power, _letter in enumerate("kmgtp", start=1):
    _SIZE_UNITS[_letter] = _SIZE_UNITS[_letter + "ib"] = 1024**_power
    _SIZE_UNITS[_letter + "b"] = 1000**_power
_SIZE_RE = re.compile(r"([+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?)\s*([a-z]*)", re.IGNORECASE)
_SIZE_LIMIT = 1 << 63  # sizes are int64 in the native code (8 EiB)


def parse_size(value: Any, path: str = "size", *, allow_auto: bool = False) -> int | Literal["auto"]:
    """Bytes as an int from an int, an integral float, or a string like "24GiB", "1.5TB", "4k", "0".

    "auto" is returned unchanged when `allow_auto`. Raises ConfigError naming `path` otherwise.
    """
    expected = "expected an int or a string like '24GiB' / '1.5TB'" + (" / 'auto'" if allow_auto else "")
    invalid = f"{path}: invalid size {_shown(value)}: {expected}"
    if isinstance(value, bool):
        raise ConfigError(invalid)
    if isinstance(value, str):
        text = value.strip()
        if text.lower() == "auto":
            if allow_auto:
                return "auto"
            raise ConfigError(f"{path}: 'auto' is not allowed here; give a size like '24GiB'")
        match = _SIZE_RE.fullmatch(text)
        if match is None:
            raise ConfigError(invalid)
        number, unit = match.groups()
        if unit.lower() not in _SIZE_UNITS:
            raise ConfigError(
                f"{invalid}; units: B, K/KiB, M/MiB, G/GiB, T/TiB, P/PiB (binary), KB, MB, GB, TB, PB (decimal)"
            )
        magnitude = Decimal(number).adjusted() if Decimal(number) else 0  # "1e999999999": no 10**999999999
        if magnitude > 40:
            raise ConfigError(f"{path}: size {_shown(value)} is out of range (0 to 8 EiB)")
        if magnitude < -40:
            raise ConfigError(f"{path}: size {_shown(value)} is not a whole number of bytes")
        exact = Fraction(number) * _SIZE_UNITS[unit.lower()]
    elif isinstance(value, int):
        exact = Fraction(value)
    elif isinstance(value, float) and math.isfinite(value):
        exact = Fraction(value)
    else:
        raise ConfigError(invalid)
    if exact < 0:
        raise ConfigError(f"{path}: size must be >= 0, got {_shown(value)}")
    if exact >= _SIZE_LIMIT:
        raise ConfigError(f"{path}: size {_shown(value)} is out of range (0 to 8 EiB)")
    if exact.denominator != 1:
        raise ConfigError(f"{path}: size {_shown(value)} is not a whole number of bytes ({float(exact)} B)")
    return int(exact)


def _shown(value: Any) -> str:
    """repr(value) for messages, bounded: a YAML alias bomb or a 5000-digit int (whose repr
    raises) is shown in brief, never expanded."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        return f"<an int of {value.bit_length()} bits>"
    return _REPR.repr(value)


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 3, 200, 200, 40


def format_duration(seconds: float) -> str:
    """Human-readable duration for messages: 0.000412 -> '412 µs', 0.0123 -> '12.3 ms', 4.2 -> '4.20 s',
    162.1 -> '2.7 min', 7300 -> '2.03 h'."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    if seconds < 120:
        return f"{seconds:.2f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def format_size(nbytes: int | float | str) -> str:
    """Human-readable binary size for messages: 512 -> '512 B', 1.5 * 2**30 -> '1.50 GiB'.

    "auto" (an unresolved Size) is returned as is.
    """
    if isinstance(nbytes, str):
        return nbytes
    if abs(nbytes) < 1024:
        return f"{nbytes:.0f} B"
    scaled = float(nbytes)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        scaled /= 1024
        if abs(scaled) < 1024 or unit == "PiB":
            break
    return f"{scaled:.2f} {unit}"


def format_setting(nbytes: int) -> str:
    """A size to advise as a setting, in a form parse_size accepts: at least `nbytes`, a whole number
    of the largest binary unit that divides it or of which it is >= 100 (rounded up, so under 1% more):
    '7.01 MiB' is no whole number of bytes and would be refused, '7179 KiB' is one."""
    nbytes = int(nbytes)
    for unit, scale in (("PiB", 1 << 50), ("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= 100 * scale or (nbytes >= scale and nbytes % scale == 0):
            return f"{-(-nbytes // scale)} {unit}"
    return f"{nbytes} B"


# ---------------------------------------------------------------------------------------------
# Conversion by type hint: the schema's annotations say what each key accepts.


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls, include_extras=True)


def _is_bytes(hint: Any) -> bool:
    return get_origin(hint) is Annotated and _BYTES in get_args(hint)[1:]


def _convert(value: Any, hint: Any, path: str) -> Any:
    """Check `value` against type `hint` and return it normalized; ConfigError naming `path` if it does not fit."""
    origin, args = get_origin(hint), get_args(hint)
    if _is_bytes(hint):
        return parse_size(value, path)
    if origin in (Union, types.UnionType):
        if any(_is_bytes(arm) for arm in args):  # Size
            return parse_size(value, path, allow_auto=Literal["auto"] in args)
        if path in TRAINER_KEYS and len(args) == 2 and value != "auto":  # a trainer key: the value arm's own message
            return _convert(value, next(arm for arm in args if arm != Auto), path)
        for arm in args:
            try:
                return _convert(value, arm, path)
            except ConfigError:
                continue
    elif origin is Literal:
        if any(type(value) is type(choice) and value == choice for choice in args):
            return value
        choices = ", ".join(repr(choice) for choice in args)
        raise ConfigError(f"{path}: must be one of {choices}, got {_shown(value)}")
    elif origin is dict:  # keys and values converted; key order kept
        if isinstance(value, Mapping):
            return {_convert(k, args[0], path): _convert(v, args[1], f"{path}.{k}") for k, v in value.items()}
    elif origin is tuple and len(args) == 2 and args[1] is Ellipsis:  # tuple[X, ...]: any length
        if isinstance(value, (list, tuple)):
            return tuple(_convert(item, args[0], f"{path}[{i}]") for i, item in enumerate(value))
    elif origin is tuple:
        if isinstance(value, (list, tuple)) and len(value) == len(args):
            return tuple(_convert(item, arm, f"{path}[{i}]") for i, (item, arm) in enumerate(zip(value, args)))
    elif hint is type(None):
        if value is None:
            return None
    elif hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        number = _as_float(value)
        if number is not None:
            if not math.isfinite(number):
                raise ConfigError(f"{path}: must be a finite number, got {_shown(value)}")
            return number
    elif hint is str:
        if isinstance(value, str):
            return value
    else:  # pragma: no cover - a schema annotation this function does not know
        raise TypeError(f"{path}: unsupported config annotation {hint!r}")
    raise ConfigError(f"{path}: expected {_describe(hint)}, got {_shown(value)}")


def _as_float(value: Any) -> float | None:
    """Numbers, and numeric strings: PyYAML reads `lr: 1e-3` (no decimal point) as the string '1e-3'."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:  # an int past 1.8e308: not finite either
            return math.inf
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _describe(hint: Any) -> str:
    if _is_bytes(hint):
        return "a size like '24GiB'"
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(arm) for arm in args)
    if origin is Literal:
        return " or ".join(repr(choice) for choice in args)
    if origin is dict:
        return f"a table of {_describe(args[0])} -> {_describe(args[1])}"
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return f"a list of {_describe(args[0])}s"
    if origin is tuple:
        return f"a list of {len(args)} items [{', '.join(_describe(arm) for arm in args)}]"
    names = {bool: "true or false", int: "an int", float: "a number", str: "a string", type(None): "null / left out"}
    return names.get(hint, repr(hint))


# ---------------------------------------------------------------------------------------------
# Value rules: what the type hints cannot say. Each is (holds(value), what the value must be).


def _positive(v: Any) -> bool:
    return v > 0


def _non_negative(v: Any) -> bool:
    return v >= 0


def _at_least_one(v: Any) -> bool:
    return v >= 1


def _power_of_two_from_512(v: int) -> bool:
    return v >= 512 and v & (v - 1) == 0


def _not_blank(v: str | None) -> bool:
    return v is None or v.strip() != ""


_FIELD_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "zero.stage": (lambda v: v in (0, 1, 2, 3), "must be 0, 1, 2 or 3"),
    "zero.reduce_bucket_size": (_positive, "must be > 0"),
    "zero.allgather_bucket_size": (_positive, "must be > 0"),
    "zero.persistence_threshold": (_non_negative, "must be >= 0"),
    "zero.timeout_s": (_positive, "must be > 0"),
    "tiers.nvme_path": (_not_blank, "must be a directory path, or left out"),
    "precision.loss_scale": (lambda v: v == "dynamic" or v > 0, "must be > 0 or 'dynamic'"),
    "precision.initial_scale_power": (_non_negative, "must be >= 0"),
    "precision.loss_scale_window": (_at_least_one, "must be >= 1"),
    "precision.hysteresis": (_at_least_one, "must be >= 1"),
    "precision.min_loss_scale": (_positive, "must be > 0"),
    "optimizer.lr": (_non_negative, "must be >= 0"),
    "optimizer.betas": (lambda v: all(0 <= beta < 1 for beta in v), "must be two numbers in [0, 1)"),
    "optimizer.eps": (_positive, "must be > 0"),
    "optimizer.weight_decay": (_non_negative, "must be >= 0"),
    "optimizer.threads": (lambda v: v == "auto" or v >= 1, "must be >= 1 or 'auto'"),
    "optimizer.pipeline_depth": (lambda v: v >= 3, "must be >= 3 (one set read ahead, one stepped, one written)"),
    "train.grad_accum_steps": (_at_least_one, "must be >= 1"),
    "train.max_grad_norm": (lambda v: v is None or v > 0, "must be > 0, or left out to disable clipping"),
    "train.device": (lambda v: v in ("auto", "cpu", "cuda") or (v.startswith("cuda:") and v[5:].isdigit()),
                     "must be auto, cpu, cuda or cuda:N"),
    "prefetch.lookahead": (_non_negative, "must be >= 0"),
    # the I/O limits live here only (issue 23): the engines take them as validated
    "io.block_size": (lambda v: 0 < v <= 1 << 30, "must be in (0, 1 GiB]"),
    "io.queue_depth": (lambda v: 1 <= v <= 4096, "must be in [1, 4096] (io_uring's ring limit)"),
    "io.threads": (lambda v: 1 <= v <= 1024, "must be in [1, 1024]"),
    "io.alignment": (_power_of_two_from_512, "must be a power of two >= 512"),
    "profile.trace_path": (_not_blank, "must be a file path, or left out"),
    "train.checkpoint_on_signal": (_not_blank, "must be a checkpoint directory, or left out"),
    "profile.sample_interval_ms": (_positive, "must be > 0"),
    "profile.max_events": (lambda v: v >= 1000, "must be >= 1000"),
}


def _check_field_rule(path: str, value: Any) -> None:
    rule = _FIELD_RULES.get(path)
    if path in TRAINER_KEYS and value == "auto":
        return
    if rule is not None and not rule[0](value):
        raise ConfigError(f"{path}: {rule[1]}, got {_shown(value)}")


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
    and nvme ([Note: optimizer split] in planner.py); a one-tier table becomes that tier's name."""
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
    order = ("device", "host", "nvme")  # fastest first: the first units go to the fastest tier
    normalized = {t: split[t] for t in order if t in split}
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


TRAINER_KEYS = ("precision.param_dtype", "optimizer.lr", "optimizer.betas", "optimizer.eps",
                "optimizer.weight_decay", "train.grad_accum_steps", "train.max_grad_norm")

_SECTIONS: dict[str, type] = {f.name: _type_hints(Config)[f.name] for f in dataclasses.fields(Config)}
_SECTION_NAMES: dict[type, str] = {cls: name for name, cls in _SECTIONS.items()}


def _paths() -> list[str]:
    return [f"{name}.{f.name}" for name, cls in _SECTIONS.items() for f in dataclasses.fields(cls)]


_DEFAULTS: dict[str, Any] = {path: next(f.default for f in dataclasses.fields(_SECTIONS[path.split(".")[0]])
                                        if f.name == path.split(".")[1]) for path in TRAINER_KEYS}
