"""transformers' Trainer over a zerotier engine.

    from zerotier.integrations.transformers import ZerotierTrainer
    trainer = ZerotierTrainer.from_pretrained("path/to/model", training_args, train_dataset=ds,
                                              zerotier_config="zerotier.toml")   # weights streamed
    # LoRA, the frozen base streamed: ZerotierTrainer.from_pretrained(..., peft_config=LoraConfig(...))
    trainer = ZerotierTrainer(model=model, args=training_args, train_dataset=ds,
                              zerotier_config="zerotier.toml")                    # a model in RAM
    trainer.train()

`ZerotierTrainer(model=engine.module, args=...)` also takes a model an engine already manages
(`zerotier.from_pretrained(dir, config)`); its config is then that engine's. The Trainer never
moves the model itself (the engine places every parameter), and does not autocast: under
TrainingArguments' bf16 / fp16 the engine's parameters are bf16 / fp16 (precision.param_dtype).

[Note: TrainingArguments and the zerotier config]
TrainingArguments fill the zerotier keys HF's DeepSpeed integration fills
(HfTrainerDeepSpeedConfig.trainer_config_process): precision.param_dtype (bf16 / fp16),
optimizer.lr / betas / eps / weight_decay, train.max_grad_norm and train.grad_accum_steps, and
optimizer.no_weight_decay from Trainer's own get_decay_parameter_names (biases and norm
weights: the second param group, weight_decay 0, as in Trainer's AdamW). A key the zerotier
config left "auto" or did not give is filled; one it gave with another value is a ConfigError
naming both values ([Note: keys a trainer fills] in config.py). For a model an engine already
manages, the filling happens on the live engine: the param groups' hyper-parameters
([Note: param groups] in optim/torch_optimizer.py), the exempt parameters moved into their own
group by add_param_group, and engine.cfg's train keys (assigning engine.cfg puts the new Config
in the runtime record's settings, which the window reads at each call: [Note: the runtime
record] in engine/runtime.py); its parameter dtype cannot change, so a differing bf16 / fp16 is
refused with the fix.
A plain `transformers.Trainer` given `optimizers=(engine.optimizer, None)` applies none of
this (Trainer builds its exemptions only into an optimizer it makes): at its first training
step, `check_plain_trainer` (engine/trainer_guard.py, installed by initialize) refuses a run
in which weight decay would reach a parameter Trainer exempts, naming the fix. Its max_grad_norm goes through clip_grad_norm_, which the
engine honours ([Note: the user's clipping] in clip.py).

Training runs through the plain PyTorch loop ([Note: the plain PyTorch loop] in window.py):
Trainer's backward, its optimizer.step() and zero_grad() are the engine's, and the grad_norm
it logs is the engine's global gradient norm before clipping (Trainer would otherwise read
p.grad, which zerotier never leaves on the parameters). Trainer's checkpoints (save_steps,
resume_from_checkpoint) carry the engine's own checkpoint in `checkpoint-N/zerotier/` (fp32
masters, Adam moments, step counts; docs/checkpoint.md), and resuming loads it instead of
pouring the saved model weights into parameters zerotier manages. optimizer.pt holds the
param groups only: the Adam state is in `zerotier/`, written and read once. A `zerotier/` of
another step than the Trainer's own state is refused ([Note: one step in a Trainer checkpoint]).
"""
from __future__ import annotations

import fnmatch
import glob
import os
from typing import Any

import torch
from transformers import Trainer

from ..config import Config
from ..engine.engine import Engine, initialize
from ..errors import ConfigError, ZerotierError
from ..engine.trainer_guard import decayed_exempt, no_decay_names

ENGINE_DIR = "zerotier"  # the engine's checkpoint inside each Trainer checkpoint-N/

# zerotier key -> the TrainingArguments field(s) it comes from
_ARGUMENT = {"precision.param_dtype": "bf16 / fp16", "optimizer.lr": "learning_rate",
             "optimizer.betas": "(adam_beta1, adam_beta2)", "optimizer.eps": "adam_epsilon",
             "optimizer.weight_decay": "weight_decay", "train.max_grad_norm": "max_grad_norm",
             "train.grad_accum_steps": "gradient_accumulation_steps"}


def training_values(args) -> dict[str, Any]:
    """The zerotier value of each key TrainingArguments fill
    ([Note: TrainingArguments and the zerotier config])."""
    return {"precision.param_dtype": "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
            "optimizer.lr": float(args.learning_rate),
            "optimizer.betas": (float(args.adam_beta1), float(args.adam_beta2)),
            "optimizer.eps": float(args.adam_epsilon), "optimizer.weight_decay": float(args.weight_decay),
            "train.max_grad_norm": float(args.max_grad_norm) if args.max_grad_norm and args.max_grad_norm > 0 else None,
            "train.grad_accum_steps": int(args.gradient_accumulation_steps)}


def _fill(cfg: Config, args, *, live: bool) -> tuple[dict[str, Any], list[str]]:
    """({key: TrainingArguments' value} for the keys to fill, [conflicts]). live: the config is
    a built engine's, whose parameter dtype is fixed."""
    fills, conflicts = {}, []
    for path, value in training_values(args).items():
        have = cfg.value(path)
        if have == value:
            continue
        if have == "auto" or not (cfg.given(path) or (live and path == "precision.param_dtype")):
            fills[path] = value
        else:
            conflicts.append(f"{path} = {have!r} in the zerotier config but TrainingArguments' {_ARGUMENT[path]} "
                             f"gives {value!r}")
    if fills.get("precision.param_dtype") == "fp16" and not cfg.given("precision.loss_scale"):
        fills["precision.loss_scale"] = "dynamic"  # what DeepSpeed's fp16 does by default (loss_scale 0)
    return fills, conflicts


def _decay_conflict(cfg: Config, model, exempt: set[str], weight_decay: float) -> str | None:
    """The conflict between the config's no_weight_decay and Trainer's exemptions, if the decay matters."""
    if not cfg.given("optimizer.no_weight_decay") or weight_decay == 0:
        return None
    theirs = {n for n, p in model.named_parameters() if p.requires_grad
              and any(fnmatch.fnmatchcase(n, g) for g in cfg.optimizer.no_weight_decay)}
    if theirs == exempt:
        return None
    differ = sorted(theirs ^ exempt)
    return (f"optimizer.no_weight_decay = {list(cfg.optimizer.no_weight_decay)} exempts {len(theirs)} parameters but "
            f"Trainer exempts {len(exempt)} (get_decay_parameter_names: biases and norm weights); they differ on "
            + ", ".join(differ[:4]) + (" ..." if len(differ) > 4 else ""))


_SET_IT = "Set the zerotier key to the Trainer's value, or to \"auto\" (or leave it out) to take TrainingArguments'"


def _refuse(conflicts: list[str], fix: str) -> None:
    if conflicts:
        raise ConfigError("ZerotierTrainer: the zerotier config and TrainingArguments disagree: "
                          + "; ".join(conflicts) + f". {fix}")


class ZerotierTrainer(Trainer):
    applies_zerotier_exemptions = True  # check_plain_trainer leaves it alone (it reconciles the groups itself)

    def __init__(self, model=None, args=None, *posargs, zerotier_config=None, **kwargs):
        if model is None or args is None:
            raise TypeError("ZerotierTrainer needs model= and args= (TrainingArguments)")
        if kwargs.get("optimizers", (None, None))[0] is not None:
            raise TypeError("ZerotierTrainer makes its own optimizer (the engine's): do not pass optimizers=")
        owner = getattr(model, "_zerotier_engine", None)
        engine = owner() if owner is not None else None
        exempt = set(no_decay_names(self, model))
        if engine is None:
            cfg = Config.coerce(zerotier_config)
            fills, conflicts = _fill(cfg, args, live=False)
            wd = fills.get("optimizer.weight_decay", cfg.optimizer.weight_decay)
            conflicts += filter(None, [_decay_conflict(cfg, model, exempt, wd)])
            _refuse(conflicts, _SET_IT)
            if not cfg.given("optimizer.no_weight_decay"):
                fills["optimizer.no_weight_decay"] = tuple(glob.escape(n) for n in sorted(exempt))
            self.engine = initialize(model, cfg.with_values(fills))
        else:
            if zerotier_config is not None:
                raise TypeError("ZerotierTrainer: this model is managed by an engine already, whose config is the "
                                "one used: do not pass zerotier_config= (give it to zerotier.from_pretrained / "
                                "zerotier.initialize, or use ZerotierTrainer.from_pretrained(dir, args, "
                                "zerotier_config=...))")
            self.engine = engine
            self._fill_live(args, exempt)
        kwargs["optimizers"] = (self.engine.optimizer, kwargs.get("optimizers", (None, None))[1])
        super().__init__(model, args, *posargs, **kwargs)

    @classmethod
    def from_pretrained(cls, path, args, *posargs, zerotier_config=None, model_cls=None, wrap=None,
                        peft_config=None, **kwargs):
        """A ZerotierTrainer over the transformers model saved in the Hugging Face directory `path`,
        its weights streamed into the tiers ([Note: streamed pretrained loading] in pretrained.py),
        the config's "auto" and unset keys filled from `args` ([Note: TrainingArguments and the
        zerotier config]). model_cls / wrap / peft_config (a peft.LoraConfig: the base frozen and
        streamed under the adapters): as for zerotier.from_pretrained; the rest: Trainer's."""
        from ..pretrained import from_pretrained

        cfg = Config.coerce(zerotier_config)
        fills, conflicts = _fill(cfg, args, live=False)
        _refuse(conflicts, _SET_IT)
        engine = from_pretrained(path, cfg.with_values(fills), model_cls=model_cls, wrap=wrap, peft_config=peft_config)
        try:  # the exemptions need the model: filled on the live engine
            return cls(engine.module, args, *posargs, **kwargs)
        except BaseException:
            engine.close()
            raise

    def _fill_live(self, args, exempt: set[str]) -> None:
        """[Note: TrainingArguments and the zerotier config] on an engine that is built already."""
        engine: Engine = self.engine
        cfg = engine.cfg
        fills, conflicts = _fill(cfg, args, live=True)
        wd = fills.get("optimizer.weight_decay", cfg.optimizer.weight_decay)
        conflicts += filter(None, [_decay_conflict(cfg, engine.module, exempt, wd)])
        _refuse(conflicts, "The engine is built already: build it with these values (the config given to "
                           "zerotier.from_pretrained / zerotier.initialize), or let ZerotierTrainer.from_pretrained"
                           "(dir, args, zerotier_config=...) build it from TrainingArguments")
        optimizer = engine.optimizer
        hyper = {"lr": "optimizer.lr", "betas": "optimizer.betas", "eps": "optimizer.eps"}
        for group in optimizer.param_groups:
            for key, path in hyper.items():
                if path in fills:
                    group[key] = fills[path]
            if "optimizer.weight_decay" in fills and group["weight_decay"] == cfg.optimizer.weight_decay:
                group["weight_decay"] = fills["optimizer.weight_decay"]  # the decayed groups; exempt ones stay 0
        optimizer.defaults.update({key: fills[path] for key, path in hyper.items() if path in fills})
        if "optimizer.weight_decay" in fills:
            optimizer.defaults["weight_decay"] = fills["optimizer.weight_decay"]
        if exempt and not cfg.given("optimizer.no_weight_decay") and len(optimizer.param_groups) == 1:
            # out of the one group zerotier built into Trainer's exempt group ([Note: param groups])
            optimizer.add_param_group({"params": [p for n, p in engine.module.named_parameters() if n in exempt],
                                       "weight_decay": 0.0})
            fills["optimizer.no_weight_decay"] = tuple(glob.escape(n) for n in sorted(exempt))
        _refuse(decayed_exempt(self, engine.module, optimizer.param_groups),
                "Exempt them in optimizer.no_weight_decay, as Trainer does")
        engine.cfg = cfg.with_values(fills)

    def _build_accelerator_args(self, **kwargs):
        args = super()._build_accelerator_args(**kwargs)
        args["mixed_precision"] = "no"  # the engine computes in precision.param_dtype: no autocast
        return args

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
        _check_same_step(resume_from_checkpoint, path)
        self.engine.load_checkpoint(path)


def _check_same_step(trainer_dir: str, engine_root: str) -> None:
    """[Note: one step in a Trainer checkpoint] checkpoint-N/trainer_state.json (Trainer's step, its
    scheduler and data position resume from it) and checkpoint-N/zerotier/ (the weights and Adam
    state) must be of the same step: a zerotier/ copied in from another step would resume the
    schedule and the data at one step and the weights at another. Refused before anything loads."""
    import json

    from ..checkpoint_read import read_manifest, resolve
    try:
        with open(os.path.join(trainer_dir, "trainer_state.json")) as fh:
            trainer_step = json.load(fh)["global_step"]
    except FileNotFoundError:
        return  # Trainer starts from step 0 then, and says so
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ZerotierError(f"resume_from_checkpoint={trainer_dir}: trainer_state.json cannot be read "
                            f"({type(exc).__name__}: {exc}); resume from another checkpoint") from None
    ckpt = resolve(engine_root)
    engine_step = read_manifest(ckpt)["global_steps"]
    if engine_step != trainer_step:
        raise ZerotierError(f"resume_from_checkpoint={trainer_dir}: its trainer_state.json is at step {trainer_step} "
                            f"but the engine's checkpoint {ckpt} is at step {engine_step}: the {ENGINE_DIR}/ part comes "
                            f"from another step (copied or replaced), and resuming would train the weights of one step "
                            f"with the schedule and data of the other. Resume from a checkpoint-N directory as the "
                            f"Trainer wrote it (nothing was loaded)")
