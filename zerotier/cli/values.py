"""Values the subcommands read from their arguments."""
from __future__ import annotations

from zerotier.errors import ZerotierError

MAX_PARAMS = 10**15


def parameter_count(text: str, flag: str = "--params") -> int:
    """A count of parameters as written: 7B, 350M, 7.5e9 or 1200000; a one-line error otherwise."""
    from decimal import Decimal, InvalidOperation

    scale = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
    given, text = text, text.strip().upper().replace("_", "")
    try:
        value = Decimal(text[:-1]) * scale[text[-1]] if text and text[-1] in scale else Decimal(text)
    except InvalidOperation:
        value = Decimal(-1)
    if not value.is_finite() or value < 1 or value != value.to_integral_value():
        raise ZerotierError(f"{flag}: cannot read {given!r}; use a whole count like 7B, 350M, 7.5e9 or 1200000")
    if value > MAX_PARAMS:  # the planner's byte counts and times are floats: far past any model, they overflow
        raise ZerotierError(f"{flag}: {given} is more than 10^15 parameters (1000T), the most zerotier plans "
                            "for; use a count like 7B, 350M, 7.5e9 or 1200000")
    return int(value)
