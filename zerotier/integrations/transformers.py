"""transformers' Trainer over a zerotier engine.

    from zerotier.integrations.transformers import ZerotierTrainer
    trainer = ZerotierTrainer(model=model, args=training_args, train_dataset=ds,
                              zerotier_config="zerotier.toml")
    trainer.train()

The engine is created on the model before the Trainer sees it, and the Trainer never moves the
model itself (the engine places every parameter). TrainingArguments supply the optimizer's
hyper-parameters (learning_rate, weight_decay, adam_beta1/2, adam_epsilon) and max_grad_norm;
the zerotier config supplies tiers, placement and precision. Training runs through the plain
PyTorch loop ([Note: the plain PyTorch loop] in engine.py): Trainer's backward, its
optimizer.step() and zero_grad() are the engine's, and the grad_norm it logs is the engine's
global gradient norm before clipping (Trainer would otherwise read p.grad, which zerotier
never leaves on the parameters). Trainer's checkpoints (save_steps, resume_from_checkpoint)
carry the engine's own checkpoint in `checkpoint-N/zerotier/` (fp32 masters, Adam moments,
step counts; docs/checkpoint.md), and resuming loads it instead of pouring the saved model
weights into parameters zerotier manages. Trainer's exemption of biases and LayerNorm
weights from weight decay becomes optimizer.no_weight_decay: engine.optimizer's second param
group, with weight_decay 0, as in Trainer's own AdamW ([Note: param groups] in
optim/torch_optimizer.py). optimizer.pt holds the param groups only: the Adam state is in
`zerotier/`, written and read once.
"""
from __future__ import annotations

import glob
import os

import torch
from transformers import Trainer

from ..config import Config
from ..engine import initialize
from ..errors import ZerotierError

ENGINE_DIR = "zerotier"  # the engine's checkpoint inside each Trainer checkpoint-N/


class ZerotierTrainer(Trainer):
    def __init__(self, model=None, args=None, *posargs, zerotier_config=None, **kwargs):
        if model is None or args is None:
            raise TypeError("ZerotierTrainer needs model= and args= (TrainingArguments)")
        if kwargs.get("optimizers", (None, None))[0] is not None:
            raise TypeError("ZerotierTrainer makes its own optimizer (the engine's): do not pass optimizers=")
        cfg = Config.coerce(zerotier_config).to_dict()
        cfg["optimizer"].update(lr=args.learning_rate, weight_decay=args.weight_decay,
                                betas=[args.adam_beta1, args.adam_beta2], eps=args.adam_epsilon)
        cfg["train"]["max_grad_norm"] = args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None
        decayed = set(self.get_decay_parameter_names(model))  # Trainer exempts biases and norm weights
        cfg["optimizer"]["no_weight_decay"] = [glob.escape(n) for n, _ in model.named_parameters() if n not in decayed]
        self.engine = initialize(model, cfg)
        kwargs["optimizers"] = (self.engine.optimizer, kwargs.get("optimizers", (None, None))[1])
        super().__init__(model, args, *posargs, **kwargs)

    def _move_model_to_device(self, model, device):
        pass  # the engine placed every parameter and buffer

    def _clip_grad_norm(self, model):
        return torch.tensor(self.engine.grad_norm())  # the engine clips by train.max_grad_norm itself

    def _get_grad_norm(self, model, grad_norm=None):
        return float(grad_norm) if grad_norm is not None else self.engine.grad_norm()

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        with self.engine.optimizer.groups_only():  # optimizer.pt: the groups; the state goes below
            super()._save_optimizer_and_scheduler(output_dir)
        self.engine.save_checkpoint(os.path.join(output_dir, ENGINE_DIR))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        path = os.path.join(resume_from_checkpoint, ENGINE_DIR)
        if not os.path.isdir(path):
            raise ZerotierError(f"resume_from_checkpoint={resume_from_checkpoint}: no {ENGINE_DIR}/ in it; it was not "
                                "written by a ZerotierTrainer, so it holds no optimizer state for zerotier to resume")
        self.engine.load_checkpoint(path)
