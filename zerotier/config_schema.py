"""What a config key accepts: its value converted by the schema's type hint, then checked by its value rule.

The section dataclasses (config.py) annotate each key with a type from here (`Bytes`, `Size`,
`Placement`, ...); `convert_value` reads the annotation, and `check_field_rule` adds what a type
cannot say ("> 0", "a power of two"). Every refusal is a ConfigError naming the key path.
"""
from __future__ import annotations

import functools
import math
import types
import warnings
from typing import Annotated, Any, Callable, Literal, Mapping, Union, get_args, get_origin, get_type_hints

from .errors import ConfigError
from .tier_names import TIER_NAMES
from .units import parse_size, shown

_BYTES = "bytes"  # Annotated marker: an int count of bytes, writable as "24GiB" in config sources
Bytes = Annotated[int, _BYTES]
Size = Union[Bytes, Literal["auto"]]
Placement = Literal[("auto",) + TIER_NAMES]
Auto = Literal["auto"]  # a trainer-filled key: [Note: keys a trainer fills] in config.py
TierFractions = dict[Literal[TIER_NAMES], float]  # offload.optimizer split: tier -> fraction

# the keys a trainer may fill ([Note: keys a trainer fills] in config.py)
TRAINER_KEYS = ("precision.param_dtype", "optimizer.lr", "optimizer.betas", "optimizer.eps",
                "optimizer.weight_decay", "train.grad_accum_steps", "train.max_grad_norm")


# ---------------------------------------------------------------------------------------------
# Conversion by type hint: the schema's annotations say what each key accepts.


@functools.cache
def type_hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls, include_extras=True)


def _is_bytes(hint: Any) -> bool:
    return get_origin(hint) is Annotated and _BYTES in get_args(hint)[1:]


def convert_value(value: Any, hint: Any, path: str) -> Any:
    """Check `value` against type `hint` and return it normalized; ConfigError naming `path` if it does not fit."""
    origin, args = get_origin(hint), get_args(hint)
    if _is_bytes(hint):
        return parse_size(value, path)
    if origin in (Union, types.UnionType):
        if any(_is_bytes(arm) for arm in args):  # Size
            return parse_size(value, path, allow_auto=Literal["auto"] in args)
        if path in TRAINER_KEYS and len(args) == 2 and value != "auto":  # a trainer key: the value arm's own message
            return convert_value(value, next(arm for arm in args if arm != Auto), path)
        for arm in args:
            try:
                return convert_value(value, arm, path)
            except ConfigError:
                continue
    elif origin is Literal:
        if any(type(value) is type(choice) and value == choice for choice in args):
            return value
        choices = ", ".join(repr(choice) for choice in args)
        raise ConfigError(f"{path}: must be one of {choices}, got {shown(value)}")
    elif origin is dict:  # keys and values converted; key order kept
        if isinstance(value, Mapping):
            return {convert_value(k, args[0], path): convert_value(v, args[1], f"{path}.{k}") for k, v in value.items()}
    elif origin is tuple and len(args) == 2 and args[1] is Ellipsis:  # tuple[X, ...]: any length
        if isinstance(value, (list, tuple)):
            return tuple(convert_value(item, args[0], f"{path}[{i}]") for i, item in enumerate(value))
    elif origin is tuple:
        if isinstance(value, (list, tuple)) and len(value) == len(args):
            return tuple(convert_value(item, arm, f"{path}[{i}]") for i, (item, arm) in enumerate(zip(value, args)))
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
                raise ConfigError(f"{path}: must be a finite number, got {shown(value)}")
            return number
    elif hint is str:
        if isinstance(value, str):
            return value
    else:  # pragma: no cover - a schema annotation this function does not know
        raise TypeError(f"{path}: unsupported config annotation {hint!r}")
    raise ConfigError(f"{path}: expected {_describe(hint)}, got {shown(value)}")


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


def check_field_rule(path: str, value: Any) -> None:
    rule = _FIELD_RULES.get(path)
    if path in TRAINER_KEYS and value == "auto":
        return
    if rule is not None and not rule[0](value):
        raise ConfigError(f"{path}: {rule[1]}, got {shown(value)}")


# ---------------------------------------------------------------------------------------------
# Old keys kept as aliases of a newer one: each given one warns once, naming the new key.

OVERLAP = Literal["none", "early", "speculative", "delayed", "auto"]  # train.overlap ([Note: overlap policies])
_OVERLAP_ALIASES = ("delayed_update", "early_step", "speculative_step")  # train.overlap's old keys


def _alias_mode(key: str, v: Any) -> "str | None":
    """The train.overlap value an old key's value asks for (None: no opinion)."""
    if key == "speculative_step":
        return {True: "speculative", False: "none"}.get(v, "auto") if isinstance(v, bool) or v == "auto" else None
    return ("delayed" if key == "delayed_update" else "early") if v is True else None


def resolve_aliases(section: str, value: Mapping[str, Any]) -> Mapping[str, Any]:
    """A section's keys with train.early_step / speculative_step / delayed_update given as
    train.overlap (one FutureWarning each). Keys that ask for different policies (two old ones, or
    one beside train.overlap) are a ConfigError: one key, one value."""
    given = [k for k in _OVERLAP_ALIASES if k in value] if section == "train" else []
    if not given:
        return value
    wanted = {"overlap": value["overlap"]} if "overlap" in value else {}
    weak = None  # speculative_step = false / 'auto': the policy when nothing else is asked for
    for key in given:
        v, auto = value[key], key == "speculative_step"
        if not (isinstance(v, bool) or (auto and v == "auto")):
            choices = "true, false or 'auto'" if auto else "true or false"
            raise ConfigError(f"train.{key}: expected {choices}, got {shown(v)} (an old key: set train.overlap instead)")
        if auto and v is not True:
            weak = _alias_mode(key, v)
        elif _alias_mode(key, v) is not None:
            wanted[key] = _alias_mode(key, v)
    if len(set(wanted.values())) > 1:
        items = list(wanted.items())
        other = next(kv for kv in items if kv[1] != items[0][1])
        (a, mode_a), (b, mode_b) = (other, items[0]) if other[1] == "delayed" else (items[0], other)

        def said(k: str) -> str:
            v = value[k]
            return f"train.{k} = {str(v).lower() if isinstance(v, bool) else repr(v)}"
        if mode_a == "delayed" and mode_b in ("early", "speculative"):
            cause = f"{said(a)} cannot run here: {said(b)} updates units during backward, under the pending update"
        else:
            cause = f"{said(a)} and {said(b)}"
        raise ConfigError(f"{cause}: each is a value of train.overlap now ({mode_a!r}, {mode_b!r}), which "
                          "takes one: set train.overlap alone")
    mode = next(iter(wanted.values()), weak or "auto")
    for key in given:
        warnings.warn(f"train.{key} is an old key of train.overlap: set train.overlap = {mode!r} instead",
                      FutureWarning, stacklevel=5)
    out = {k: v for k, v in value.items() if k not in _OVERLAP_ALIASES}
    out["overlap"] = mode
    return out
