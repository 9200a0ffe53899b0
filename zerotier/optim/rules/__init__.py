"""Update rules (the seam: base.py): one class per optimizer algorithm,
chosen by `optimizer.type`. Adding one: a module here and a line in RULES."""
from __future__ import annotations

from .adamw import AdamW
from .base import UpdateRule
from .lion import Lion

RULES = {
    "adamw": lambda: AdamW(decoupled=True),
    "adam": lambda: AdamW(decoupled=False),  # L2 weight decay added to the gradient
    "lion": Lion,
}


def make_rule(kind: str) -> UpdateRule:
    """The rule `optimizer.type` names (the config checked the name against RULES)."""
    return RULES[kind]()


__all__ = ["RULES", "UpdateRule", "make_rule"]
