"""Sizes and durations as users write and read them: "24GiB" -> int bytes (`parse_size`), and bytes,
seconds and settings as messages show them (`format_size`, `format_duration`, `format_setting`).

IEC units (KiB, MiB, ...) and bare letters (K, M, ...) are binary; SI units (KB, MB, ...) are
decimal. Case does not matter. "1.5TB" == 1_500_000_000_000; "4k" == 4096.
"""
from __future__ import annotations

import math
import re
import reprlib
from decimal import Decimal
from fractions import Fraction
from typing import Any, Literal

from .errors import ConfigError

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
    invalid = f"{path}: invalid size {shown(value)}: {expected}"
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
            raise ConfigError(f"{path}: size {shown(value)} is out of range (0 to 8 EiB)")
        if magnitude < -40:
            raise ConfigError(f"{path}: size {shown(value)} is not a whole number of bytes")
        exact = Fraction(number) * _SIZE_UNITS[unit.lower()]
    elif isinstance(value, int):
        exact = Fraction(value)
    elif isinstance(value, float) and math.isfinite(value):
        exact = Fraction(value)
    else:
        raise ConfigError(invalid)
    if exact < 0:
        raise ConfigError(f"{path}: size must be >= 0, got {shown(value)}")
    if exact >= _SIZE_LIMIT:
        raise ConfigError(f"{path}: size {shown(value)} is out of range (0 to 8 EiB)")
    if exact.denominator != 1:
        raise ConfigError(f"{path}: size {shown(value)} is not a whole number of bytes ({float(exact)} B)")
    return int(exact)


def shown(value: Any) -> str:
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
