"""transformers' own Trainer over engine.optimizer: the check of its weight-decay exemptions.

A plain `transformers.Trainer` given `optimizers=(engine.optimizer, None)` builds its exemptions
(biases and norm weights) only into an optimizer it makes ([Note: TrainingArguments and the
zerotier config] in integrations/transformers.py). initialize installs `check_plain_trainer` as
engine.optimizer's first-train() callback; it imports nothing of transformers or of the engine
(it finds the running Trainer on the stack, through `sys.modules`), so neither the optimizer nor
the engine reaches up into the integration.
"""
from __future__ import annotations

import sys

import torch

from ..errors import ZerotierError


def no_decay_names(trainer, model: torch.nn.Module) -> list[str]:
    """The trainable parameters `trainer` exempts from weight decay (its get_decay_parameter_names)."""
    decayed = set(trainer.get_decay_parameter_names(model))
    return [n for n, p in model.named_parameters() if p.requires_grad and n not in decayed]


def decayed_exempt(trainer, module: torch.nn.Module, param_groups: list) -> list[str]:
    """The parameters `trainer` exempts from weight decay that `param_groups` decay, as one message (or none)."""
    exempt = set(no_decay_names(trainer, module))
    decayed = {id(p) for g in param_groups if g["weight_decay"] != 0 for p in g["params"]}
    wrong = [n for n, p in module.named_parameters() if n in exempt and id(p) in decayed]
    if not wrong:
        return []
    return [f"{len(wrong)} parameters Trainer exempts from weight decay ({', '.join(wrong[:3])}"
            f"{' ...' if len(wrong) > 3 else ''}) are in a param group of engine.optimizer with weight_decay > 0"]


def check_plain_trainer(module: torch.nn.Module, param_groups: list) -> None:
    """[Note: TrainingArguments and the zerotier config] Called at the first training step of a
    transformers Trainer over engine.optimizer (Trainer.training_step -> AcceleratedOptimizer.train
    -> EngineOptimizer.train -> here): refuses weight decay on a parameter Trainer exempts. A
    Trainer that applies zerotier's exemptions itself (ZerotierTrainer) says so with
    `applies_zerotier_exemptions`."""
    transformers = sys.modules.get("transformers")
    if transformers is None:  # no Trainer can be running
        return
    frame, trainer = sys._getframe(1), None
    for _ in range(8):
        if frame is None:
            break
        if isinstance(frame.f_locals.get("self"), transformers.Trainer):
            trainer = frame.f_locals["self"]
            break
        frame = frame.f_back
    if trainer is None or getattr(trainer, "applies_zerotier_exemptions", False):
        return
    wrong = decayed_exempt(trainer, module, param_groups)
    if wrong:
        raise ZerotierError(
            f"transformers.Trainer over engine.optimizer: {wrong[0]}; Trainer builds its exemptions only into an "
            "optimizer it makes. Use ZerotierTrainer(model=engine.module, args=...) from "
            "zerotier.integrations.transformers, which applies them and reconciles TrainingArguments with the engine, "
            "or exempt them in the zerotier config (optimizer.no_weight_decay, e.g. ['*bias', '*ln_*.weight']), or "
            "set optimizer.weight_decay = 0")
