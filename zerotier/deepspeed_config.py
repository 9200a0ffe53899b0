"""DeepSpeed JSON configs into zerotier configs: `Config.from_deepspeed(path_or_dict)` and
`zerotier convert ds_config.json`.

[Note: DeepSpeed keys]
Every DeepSpeed key is either mapped to the zerotier key with the same meaning, known to be
what zerotier always does (no warning), or listed in the one warning `from_deepspeed` gives
(never ignored silently). "auto" (what HF's integration writes) means what HF means: filled by
the trainer. On a key with a zerotier counterpart among TRAINER_KEYS (precision, lr, betas,
eps, weight_decay, clipping, accumulation) the zerotier key is "auto" too, and ZerotierTrainer
fills it from TrainingArguments ([Note: keys a trainer fills] in config.py); the batch sizes and
scheduler.params are the Trainer's own (its per_device_train_batch_size, lr_scheduler_type and
warmup), so zerotier has no key for them. `zerotier convert` lists both kinds as "auto (filled
by the trainer)". Any other "auto" (bucket sizes, thresholds) keeps zerotier's default and is
in the warning. What each key maps to:

  zero_optimization.stage                      zero.stage
  zero_optimization.offload_optimizer.device   offload.optimizer (cpu -> host, nvme, none -> device)
  zero_optimization.offload_param.device       offload.params    (same)
  ...offload_*.nvme_path                       tiers.nvme_path
  ...offload_*.pin_memory = true               always (host memory is pinned on CUDA machines)
  zero_optimization.reduce_bucket_size         zero.reduce_bucket_size (elements x 4 bytes: fp32 buckets)
  zero_optimization.allgather_bucket_size      zero.allgather_bucket_size (elements x 2 bytes)
  zero_optimization.overlap_comm               zero.overlap_comm
  zero_optimization.stage3_param_persistence_threshold   zero.persistence_threshold
  zero_optimization.stage3_prefetch_bucket_size          prefetch.max_bytes (elements x 2 bytes)
  aio.block_size / queue_depth / thread_count  io.block_size / io.queue_depth / io.threads
  bf16.enabled / fp16.enabled                  precision.param_dtype (fp32 master always)
  fp16.loss_scale (0: dynamic) / initial_scale_power / loss_scale_window / hysteresis /
      min_loss_scale                           precision.*
  gradient_accumulation_steps                  train.grad_accum_steps
  gradient_clipping (0: off)                   train.max_grad_norm
  optimizer.type Adam / AdamW (+ adam_w_mode)  optimizer.type adamw / adam
  optimizer.params lr / betas / eps / weight_decay   optimizer.*
DeepSpeed counts bucket sizes in elements; zerotier in bytes (fp32 gradients, bf16/fp16
parameters by default).
Boolean keys (enabled, overlap_comm, pin_memory, adam_w_mode) are read as DeepSpeed's pydantic
models read them: true/false, 1/0 and the strings "true"/"false", "yes"/"no", "on"/"off", "1"/"0"
(any case); any other value is a ConfigError, never Python truthiness ("false" is not true).
Numbers are ints, floats or numeric strings ("5e8"), never a bool, NaN or inf; a count (stage,
sizes, steps) must be whole (2.5 steps is an error, not 2). A value zerotier refuses is a
ConfigError naming the DeepSpeed key, whether convert() or Config.from_dict finds it
(Config.from_converted). This module knows nothing of Config: it turns DeepSpeed's dict into
zerotier's {section: {key: value}}, which config.py builds.
"""
from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path
from typing import Any, Mapping, NamedTuple

from .errors import ConfigError

_DEVICE = {"cpu": "host", "nvme": "nvme", "none": "device"}
# Keys zerotier always honours as DeepSpeed means them: no warning.
_ALWAYS = {"zero_optimization.contiguous_gradients", "zero_optimization.offload_optimizer.pin_memory",
           "zero_optimization.offload_param.pin_memory", "optimizer.params.torch_adam",
           "optimizer.params.adam_w_mode", "bf16.enabled", "fp16.enabled", "zero_optimization.round_robin_gradients"}


_TRUE = {"true", "yes", "on", "1", "t", "y"}
_FALSE = {"false", "no", "off", "0", "f", "n"}


def _bool(path: str, value: Any) -> bool | None:
    """A DeepSpeed boolean as pydantic's lax mode reads it; None stays None ([Note: DeepSpeed keys])."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ConfigError(f"{path} = {value!r}: expected true or false")


def _number(path: str, value: Any, whole: bool = False) -> int | float:
    """A DeepSpeed number: an int, a float (5e8) or a numeric string ("5e8"); never a bool, NaN or inf."""
    number = value
    if isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            number = None
    if isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number):
        raise ConfigError(f"{path} = {value!r}: expected a {'whole ' if whole else ''}number")
    if whole:
        if number != int(number):
            raise ConfigError(f"{path} = {value!r}: expected a whole number")
        return int(number)
    return float(number)


# Keys holding settings: a value that is not an object drops them all, so it is an error, not a warning.
_SECTIONS = ("zero_optimization", "zero_optimization.offload_optimizer", "zero_optimization.offload_param",
             "optimizer", "optimizer.params", "bf16", "fp16", "aio")


# "auto" DeepSpeed keys that TrainingArguments fill and the Trainer itself applies (no zerotier key)
_TRAINERS_OWN = {"train_batch_size": "per_device_train_batch_size x gradient_accumulation_steps",
                 "train_micro_batch_size_per_gpu": "per_device_train_batch_size"}


class Converted(NamedTuple):
    sections: dict[str, dict[str, Any]]  # {section: {key: value}} for Config.from_dict
    unmapped: list[str]                  # DeepSpeed keys with no zerotier meaning (the warning)
    by_trainer: list[str]                # "auto" keys the trainer fills: "ds key -> zerotier key" lines
    origins: dict[str, str]              # "section.key" -> the DeepSpeed key it came from (for errors)
    file: str | None = None              # the JSON file it was read from


# DeepSpeed keys whose "auto" zerotier maps to a trainer-filled key; any other "auto" keeps the default
_AUTO_OK = {"gradient_accumulation_steps", "gradient_clipping", "optimizer.params.lr", "optimizer.params.eps",
            "optimizer.params.weight_decay", "optimizer.params.betas", "bf16.enabled", "fp16.enabled"}


class _Reading:
    """One conversion's state: the DeepSpeed keys read so far and the zerotier keys written."""

    def __init__(self, ds: Mapping[str, Any]) -> None:
        self.ds = ds
        self.out: dict[str, dict[str, Any]] = {}
        self.unmapped: list[str] = []
        self.by_trainer: list[str] = []
        self.seen: set[str] = set()
        self.origins: dict[str, str] = {}

    def get(self, path: str) -> Any:
        """The value at a dotted DeepSpeed key, marked as read; None if absent, or "auto" where
        zerotier keeps its default (listed in the warning)."""
        node: Any = self.ds
        for part in path.split("."):
            if not isinstance(node, Mapping) or part not in node:
                return None
            node = node[part]
        self.seen.add(path)
        if node == "auto" and path not in _AUTO_OK:
            self.unmapped.append(f"{path} = \"auto\" (zerotier's default is kept)")
            return None
        return node

    def put(self, section: str, key: str, value: Any, source: str) -> None:
        self.out.setdefault(section, {})[key] = value
        self.origins[f"{section}.{key}"] = source
        if value == "auto":
            self.by_trainer.append(f"{section}.{key}")


def convert(ds: Mapping[str, Any]) -> Converted:
    """A DeepSpeed config in zerotier's terms ([Note: DeepSpeed keys])."""
    if not isinstance(ds, Mapping):
        raise ConfigError(f"a DeepSpeed config is a JSON object, got {type(ds).__name__}")
    for section in _SECTIONS:
        value = _value_at(ds, section)
        if value is not None and not isinstance(value, Mapping):
            raise ConfigError(f"{section} = {value!r}: expected an object of DeepSpeed settings")
    r = _Reading(ds)
    for read_section in (_zero_stage, _offload, _buckets_and_aio, _precision, _accumulation_and_clipping, _optimizer):
        read_section(r)
    trainer_lines = [f"{_ds_key(ds, k)} -> {k}" for k in r.by_trainer]
    for path in _leaves(ds):
        if path in r.seen or path in _ALWAYS:
            continue
        if _value_at(ds, path) == "auto" and (path in _TRAINERS_OWN or path.startswith("scheduler.params.")):
            trainer_lines.append(f"{path} -> the Trainer's own "
                                 f"{_TRAINERS_OWN.get(path, 'scheduler (lr_scheduler_type, warmup_steps)')}")
        else:
            r.unmapped.append(path)
    return Converted(r.out, r.unmapped, trainer_lines, r.origins)


def _zero_stage(r: _Reading) -> None:
    stage = r.get("zero_optimization.stage")
    if stage is not None:
        stage_n = _number("zero_optimization.stage", stage, whole=True)
        if stage_n not in (0, 1, 2, 3):
            raise ConfigError(f"zero_optimization.stage = {stage!r}: expected 0, 1, 2 or 3")
        r.put("zero", "stage", stage_n, "zero_optimization.stage")


def _offload(r: _Reading) -> None:
    nvme_paths: dict[str, str] = {}
    nvme_users: list[str] = []
    for kind, ds_key in (("optimizer", "offload_optimizer"), ("params", "offload_param")):
        source = f"zero_optimization.{ds_key}.device"
        device = r.get(source)
        if device is not None:
            if not isinstance(device, str) or device not in _DEVICE:
                raise ConfigError(f"{source} = {device!r}: expected cpu, nvme or none")
            r.put("offload", kind, _DEVICE[device], source)
            if device == "nvme":
                nvme_users.append(source)
        path = r.get(f"zero_optimization.{ds_key}.nvme_path")
        if path is not None:
            if not isinstance(path, str) or not path:
                raise ConfigError(f"zero_optimization.{ds_key}.nvme_path = {path!r}: expected a directory path")
            nvme_paths[f"zero_optimization.{ds_key}.nvme_path"] = path
            r.put("tiers", "nvme_path", path, f"zero_optimization.{ds_key}.nvme_path")
        pin = f"zero_optimization.{ds_key}.pin_memory"
        if _bool(pin, r.get(pin)) is False:
            r.unmapped.append(f"zero_optimization.{ds_key}.pin_memory = false (zerotier always pins host memory "
                              "on CUDA machines)")
    if len(set(nvme_paths.values())) > 1:
        raise ConfigError(f"{' and '.join(f'{k} = {v!r}' for k, v in nvme_paths.items())} differ: zerotier keeps "
                          "all its swap files in one directory (tiers.nvme_path); give both the same path")
    if nvme_users and not nvme_paths:
        raise ConfigError(f"{nvme_users[0]} = 'nvme' needs {nvme_users[0].rsplit('.', 1)[0]}.nvme_path: set it to "
                          "a directory on the NVMe drive")


def _buckets_and_aio(r: _Reading) -> None:
    for ds_key, section, key, scale in (("reduce_bucket_size", "zero", "reduce_bucket_size", 4),
                                        ("allgather_bucket_size", "zero", "allgather_bucket_size", 2),
                                        ("stage3_param_persistence_threshold", "zero", "persistence_threshold", 1),
                                        ("stage3_prefetch_bucket_size", "prefetch", "max_bytes", 2)):
        source = f"zero_optimization.{ds_key}"
        value = r.get(source)
        if value is not None:
            r.put(section, key, _number(source, value, whole=True) * scale, source)
    overlap = r.get("zero_optimization.overlap_comm")
    if overlap is not None:
        r.put("zero", "overlap_comm", _bool("zero_optimization.overlap_comm", overlap),
              "zero_optimization.overlap_comm")
    for ds_key, key in (("block_size", "block_size"), ("queue_depth", "queue_depth"), ("thread_count", "threads")):
        value = r.get(f"aio.{ds_key}")
        if value is not None:
            r.put("io", key, _number(f"aio.{ds_key}", value, whole=True), f"aio.{ds_key}")


def _precision(r: _Reading) -> None:
    bf16, fp16 = r.get("bf16.enabled"), r.get("fp16.enabled")
    bf16, fp16 = (v if v == "auto" else _bool(f"{k}.enabled", v) for k, v in (("bf16", bf16), ("fp16", fp16)))
    if bf16 is True and fp16 is True:
        raise ConfigError("bf16.enabled and fp16.enabled are both true: choose one")
    if bf16 is True:
        r.put("precision", "param_dtype", "bf16", "bf16.enabled")
    elif "auto" in (bf16, fp16) and fp16 is not True:
        r.put("precision", "param_dtype", "auto", "bf16.enabled")  # TrainingArguments' bf16 / fp16
    if fp16 is True or fp16 == "auto":  # "auto": the scaling applies if the trainer turns fp16 on
        if fp16 is True:
            r.put("precision", "param_dtype", "fp16", "fp16.enabled")
        scale = r.get("fp16.loss_scale")
        if fp16 is True or scale is not None:
            scale = _number("fp16.loss_scale", scale) if scale is not None else 0
            r.put("precision", "loss_scale", "dynamic" if not scale else scale, "fp16.loss_scale")
        for key in ("initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale"):
            value = r.get(f"fp16.{key}")
            if value is not None:
                r.put("precision", key, _number(f"fp16.{key}", value, whole=key != "min_loss_scale"), f"fp16.{key}")


def _accumulation_and_clipping(r: _Reading) -> None:
    accum = r.get("gradient_accumulation_steps")
    if accum is not None:
        r.put("train", "grad_accum_steps",
              accum if accum == "auto" else _number("gradient_accumulation_steps", accum, whole=True),
              "gradient_accumulation_steps")
    clip = r.get("gradient_clipping")
    if clip is not None:
        clip = clip if clip == "auto" else _number("gradient_clipping", clip)
        r.put("train", "max_grad_norm", clip if clip != 0 else None, "gradient_clipping")


def _optimizer(r: _Reading) -> None:
    opt_type = r.get("optimizer.type")
    if opt_type is not None:
        kind = str(opt_type).lower()
        if kind not in ("adam", "adamw"):
            raise ConfigError(f"optimizer.type = {opt_type!r}: zerotier trains with Adam/AdamW only")
        w_mode = _bool("optimizer.params.adam_w_mode", r.get("optimizer.params.adam_w_mode"))
        decoupled = kind == "adamw" or (w_mode is None or w_mode)  # DeepSpeed's Adam is AdamW by default
        r.put("optimizer", "type", "adamw" if decoupled else "adam", "optimizer.type")
    for key in ("lr", "eps", "weight_decay"):
        value = r.get(f"optimizer.params.{key}")
        if value is not None:
            r.put("optimizer", key, value if value == "auto" else _number(f"optimizer.params.{key}", value),
                  f"optimizer.params.{key}")
    betas = r.get("optimizer.params.betas")
    if betas is not None:
        if betas != "auto" and (not isinstance(betas, (list, tuple)) or len(betas) != 2):
            raise ConfigError(f"optimizer.params.betas = {betas!r}: expected two numbers, e.g. [0.9, 0.999]")
        r.put("optimizer", "betas",
              betas if betas == "auto" else [_number("optimizer.params.betas", b) for b in betas],
              "optimizer.params.betas")
    # Adam variants zerotier's Adam is not: refused, since training would differ (their defaults are fine)
    for key, default, what in (("amsgrad", False, "has no AMSGrad"), ("bias_correction", True,
                                                                       "always corrects the moments' bias")):
        value = _bool(f"optimizer.params.{key}", r.get(f"optimizer.params.{key}"))
        if value is not None and value != default:
            raise ConfigError(f"optimizer.params.{key} = {str(value).lower()}: zerotier's Adam {what}; remove "
                              "the key to train with plain Adam/AdamW (its results differ)")


_DS_KEY = {"train.grad_accum_steps": "gradient_accumulation_steps", "train.max_grad_norm": "gradient_clipping",
           "optimizer.lr": "optimizer.params.lr", "optimizer.eps": "optimizer.params.eps",
           "optimizer.weight_decay": "optimizer.params.weight_decay", "optimizer.betas": "optimizer.params.betas"}


def _ds_key(ds: Mapping[str, Any], key: str) -> str:
    if key == "precision.param_dtype":
        return " / ".join(k for k in ("bf16.enabled", "fp16.enabled") if _value_at(ds, k) == "auto")
    return _DS_KEY[key]


def _value_at(ds: Mapping[str, Any], path: str) -> Any:
    node: Any = ds
    for part in path.split("."):
        node = node.get(part) if isinstance(node, Mapping) else None
    return node


def _leaves(node: Mapping[str, Any], prefix: str = "") -> list[str]:
    paths = []
    for key, value in node.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            paths.extend(_leaves(value, path + "."))
        else:
            paths.append(path)
    return paths


def load(source: Mapping[str, Any] | str | os.PathLike[str]) -> Converted:
    """convert() of a dict or a DeepSpeed JSON file."""
    if isinstance(source, Mapping):
        return convert(source)
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigError(f"a DeepSpeed config is a dict or a JSON file's path, got {type(source).__name__}")
    path = Path(source)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read DeepSpeed config {path}: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not a JSON DeepSpeed config ({exc})") from None
    try:
        return convert(data)._replace(file=str(path))
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def warn_unmapped(unmapped: list[str]) -> None:
    """The one warning naming every DeepSpeed key zerotier does not use ([Note: DeepSpeed keys])."""
    if unmapped:
        warnings.warn("DeepSpeed config keys with no zerotier meaning (not used): " + "; ".join(unmapped),
                      UserWarning, stacklevel=3)
