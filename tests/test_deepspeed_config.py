"""DeepSpeed configs in zerotier ([Note: DeepSpeed keys] in zerotier/deepspeed_config.py): the
example configs of DeepSpeed's ZeRO-Offload and ZeRO-Infinity documentation convert, each key
with a zerotier meaning is mapped, every other key is named in one warning."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import warnings

import pytest

from zerotier import config_files, deepspeed_config
from zerotier.config import Config
from zerotier.errors import ConfigError

# docs: deepspeed.ai/tutorials/zero-offload (with the training keys of its config example)
ZERO_OFFLOAD = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 4,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500,
             "hysteresis": 2, "min_loss_scale": 1},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "contiguous_gradients": True,
                          "overlap_comm": True},
}
# docs: deepspeed.ai/docs/config-json (ZeRO-Infinity: parameter and optimizer offload to NVMe)
ZERO_INFINITY = {
    "train_batch_size": 64,
    "bf16": {"enabled": True},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True,
                              "buffer_count": 4, "fast_init": False},
        "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True, "buffer_count": 5,
                          "buffer_size": 1e8, "max_in_cpu": 1e9},
        "stage3_param_persistence_threshold": 1e4, "stage3_prefetch_bucket_size": 5e7,
        "reduce_bucket_size": 5e8,
    },
    "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False,
            "overlap_events": True},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 100}},
}


def convert(ds):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = Config.from_deepspeed(ds)
    messages = [str(w.message) for w in caught]
    assert len(messages) <= 1, messages  # one warning at most
    return cfg, (messages[0] if messages else "")


def test_zero_offload_example():
    cfg, warning = convert(ZERO_OFFLOAD)
    assert cfg.zero.stage == 2 and cfg.zero.overlap_comm is True
    assert cfg.offload.optimizer == "host" and cfg.offload.params == "auto"
    assert cfg.precision.param_dtype == "fp16" and cfg.precision.loss_scale == "dynamic"
    assert (cfg.precision.initial_scale_power, cfg.precision.loss_scale_window, cfg.precision.hysteresis) == (12, 500, 2)
    assert cfg.train.grad_accum_steps == 4 and cfg.train.max_grad_norm == 1.0
    assert cfg.optimizer.type == "adamw"  # DeepSpeed's Adam has adam_w_mode on by default
    assert cfg.optimizer.lr == 1e-4 and cfg.optimizer.betas == (0.9, 0.95) and cfg.optimizer.weight_decay == 0.1
    assert warning.startswith("DeepSpeed config keys with no zerotier meaning (not used): ")
    assert "train_micro_batch_size_per_gpu" in warning and "contiguous_gradients" not in warning


def test_zero_infinity_example():
    cfg, warning = convert(ZERO_INFINITY)
    assert cfg.zero.stage == 3 and cfg.zero.persistence_threshold == 10_000
    assert cfg.offload.optimizer == "nvme" and cfg.offload.params == "nvme"
    assert cfg.tiers.nvme_path == "/local_nvme"
    assert cfg.precision.param_dtype == "bf16"
    assert cfg.prefetch.max_bytes == 5 * 10**7 * 2 and cfg.zero.reduce_bucket_size == 5 * 10**8 * 4
    assert (cfg.io.block_size, cfg.io.queue_depth, cfg.io.threads) == (1 << 20, 8, 1)
    for key in ("train_batch_size", "scheduler.type", "scheduler.params.warmup_num_steps",
                "offload_param.buffer_size", "offload_param.max_in_cpu", "offload_optimizer.buffer_count",
                "offload_optimizer.fast_init", "aio.single_submit", "aio.overlap_events"):
        assert key in warning, key
    assert "pin_memory" not in warning  # zerotier always pins


# what HF's DeepSpeed integration writes (its docs' ZeRO-3 example): "auto" for the trainer to fill
HF_AUTO = {
    "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"},
                          "reduce_bucket_size": "auto"},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
}
FILLED = ("precision.param_dtype", "optimizer.lr", "optimizer.betas", "optimizer.eps", "optimizer.weight_decay",
          "train.grad_accum_steps", "train.max_grad_norm")


def test_auto_values_are_kept_for_the_trainer_to_fill():
    cfg, warning = convert(HF_AUTO)
    assert all(cfg.value(key) == "auto" for key in FILLED)
    assert cfg.offload.params == "host" and cfg.zero.stage == 3
    for key in ("gradient_accumulation_steps", "gradient_clipping", "optimizer.params", "bf16", "fp16",
                "train_batch_size", "train_micro_batch_size_per_gpu", "scheduler.params"):
        assert key not in warning, key  # filled by the trainer: not "no zerotier meaning"
    assert 'reduce_bucket_size = "auto" (zerotier\'s default is kept)' in warning and "scheduler.type" in warning


def test_a_plain_run_with_auto_keys_warns_once_naming_each_default():
    import torch

    import zerotier

    cfg, _ = convert(HF_AUTO)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = zerotier.initialize(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)), cfg)
    ours = [str(w.message) for w in caught if "auto" in str(w.message)]
    assert len(ours) == 1, ours
    for text in ("precision.param_dtype = 'fp32'", "optimizer.lr = 0.001", "optimizer.betas = (0.9, 0.999)",
                 "optimizer.eps = 1e-08", "optimizer.weight_decay = 0.01", "train.grad_accum_steps = 1",
                 "train.max_grad_norm = None", "ZerotierTrainer"):
        assert text in ours[0], text
    assert engine.cfg.optimizer.lr == 1e-3 and engine.cfg.train.max_grad_norm is None
    engine.close()


def test_zerotier_trainer_fills_auto_from_training_arguments(tmp_path):
    """As HF's HfTrainerDeepSpeedConfig.trainer_config_process fills a DeepSpeed config; an explicit
    value that differs from TrainingArguments is refused, naming both (HF's mismatch error)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from zerotier.integrations.transformers import ZerotierTrainer

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), bf16=True, learning_rate=2e-3, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6,
        weight_decay=0.05, max_grad_norm=0.7, gradient_accumulation_steps=3, per_device_train_batch_size=2,
        use_cpu=True, report_to=[])
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32,
                                                                 n_positions=8))
    cfg, _ = convert(HF_AUTO)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # filled: no "defaults used" warning
        trainer = ZerotierTrainer(model=model, args=args, zerotier_config=cfg)
    engine = trainer.engine
    assert engine.cfg.precision.param_dtype == "bf16" and engine.lp_dtype == torch.bfloat16
    assert (engine.cfg.optimizer.lr, engine.cfg.optimizer.betas, engine.cfg.optimizer.eps,
            engine.cfg.optimizer.weight_decay) == (2e-3, (0.8, 0.95), 1e-6, 0.05)
    assert (engine.cfg.train.max_grad_norm, engine.cfg.train.grad_accum_steps) == (0.7, 3)
    assert engine.grads.grad_dtype == torch.bfloat16  # bf16 accumulators under bf16 parameters (the default)
    engine.close()

    explicit = {**HF_AUTO, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    cfg, _ = convert(explicit)
    with pytest.raises(ConfigError, match=r"optimizer\.lr = 0\.0001 .* learning_rate gives 0\.002"):
        ZerotierTrainer(model=model, args=args, zerotier_config=cfg)


@pytest.mark.parametrize("grad_dtype, expected", [(None, "bfloat16"), ("fp32", "float32")])
def test_bf16_parameters_accumulate_in_bf16_unless_fp32_is_asked_for(grad_dtype, expected):
    import torch

    import zerotier

    precision = {"param_dtype": "bf16", **({"grad_dtype": grad_dtype} if grad_dtype else {})}
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    with zerotier.initialize(model, {"precision": precision}) as engine:
        assert engine.grads.grad_dtype == getattr(torch, expected)
        assert engine.plan.grad_dtype == {"bfloat16": "bf16", "float32": "fp32"}[expected]


@pytest.mark.parametrize("ds, match", [
    ({"optimizer": {"type": "Lamb"}}, "Adam/AdamW only"),
    ({"zero_optimization": {"offload_param": {"device": "gpu"}}}, "expected cpu, nvme or none"),
    ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "choose one"),
])
def test_what_zerotier_cannot_do_is_an_error(ds, match):
    with pytest.raises(ConfigError, match=match):
        Config.from_deepspeed(ds)


def test_zerotier_convert_cli(tmp_path):
    src = tmp_path / "ds_config.json"
    src.write_text(json.dumps(ZERO_INFINITY))
    out = tmp_path / "zerotier.toml"
    proc = subprocess.run([sys.executable, "-m", "zerotier.cli", "convert", str(src), "--to", str(out)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "not used (no zerotier meaning): scheduler.type" in proc.stderr
    cfg = Config.load(out)
    assert cfg.zero.stage == 3 and cfg.offload.params == "nvme" and cfg.tiers.nvme_path == "/local_nvme"
    assert out.read_text().endswith("\n")


def test_to_toml_round_trips_through_tomllib_and_ends_with_a_newline():
    """convert's TOML is written by hand (tomli-w is not a dependency): what tomllib reads back is
    what was written, for strings that need escaping, nested tables, floats, bools and lists."""
    tomllib = pytest.importorskip("tomllib")
    sections = {
        "tiers": {"nvme_path": 'C:\\swap\\"quoted" dir', "device": "24GiB", "host": None},
        "odd": {"tab\tnewline\ncr\rdel\x7fnul\x00": "é ✓ 😀 \x1b[0m", "a.b": "dotted key", "": "empty key"},
        "optimizer": {"lr": 1e-4, "eps": 1e-08, "big": 1e20, "tiny": 5e-324, "third": 1 / 3, "inf": float("inf"),
                      "neg": -0.0, "betas": [0.9, 0.95], "adam_w_mode": True, "fused": False, "steps": 10**15,
                      "flags": [True, False], "names": ["a\"b", "c\\d"]},
        "train": {"grad_accum_steps": 2, "nested": {"inner": {"x": 1, "s": "y"}, "z": 0.5}},
        "empty": {"only": None},
    }
    text = config_files.to_toml(sections)
    assert text.endswith("\n") and not text.endswith("\n\n")
    back = tomllib.loads(text)
    expected = {k: {kk: vv for kk, vv in v.items() if vv is not None} for k, v in sections.items()}
    del expected["empty"]  # a table of only None values is left out
    assert back == expected
    assert math.copysign(1, back["optimizer"]["neg"]) == -1
    assert config_files.to_toml({}) == "\n" and tomllib.loads("\n") == {}


def test_zerotier_convert_prints_auto_keys_as_filled_by_the_trainer(tmp_path):
    src = tmp_path / "ds_config.json"
    src.write_text(json.dumps(HF_AUTO))
    proc = subprocess.run([sys.executable, "-m", "zerotier.cli", "convert", str(src)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    for line in ("auto (filled by the trainer): optimizer.params.lr -> optimizer.lr",
                 "auto (filled by the trainer): bf16.enabled / fp16.enabled -> precision.param_dtype",
                 "auto (filled by the trainer): gradient_clipping -> train.max_grad_norm",
                 "auto (filled by the trainer): train_micro_batch_size_per_gpu -> the Trainer's own "
                 "per_device_train_batch_size"):
        assert line in proc.stderr, line
    assert 'lr = "auto"' in proc.stdout and 'max_grad_norm = "auto"' in proc.stdout
    out = tmp_path / "zerotier.toml"
    out.write_text(proc.stdout)
    assert Config.load(out).optimizer.lr == "auto"  # the TOML keeps them for ZerotierTrainer


@pytest.mark.parametrize("value, dtype", [
    ("false", "fp32"), ("False", "fp32"), ("no", "fp32"), ("0", "fp32"), (0, "fp32"), (False, "fp32"),
    ("true", "bf16"), ("TRUE", "bf16"), ("on", "bf16"), (1, "bf16"), (True, "bf16"),
])
def test_boolean_strings_read_as_deepspeed_reads_them(value, dtype):
    """DeepSpeed's pydantic config reads "false" as False; Python's truthiness would turn bf16 on."""
    cfg, _ = convert({"bf16": {"enabled": value}})
    assert cfg.precision.param_dtype == dtype
    cfg, _ = convert({"fp16": {"enabled": value}, "zero_optimization": {"overlap_comm": value}})
    assert cfg.precision.param_dtype == ("fp16" if dtype == "bf16" else "fp32")
    assert cfg.zero.overlap_comm is (dtype == "bf16")


def test_string_false_leaves_adam_w_mode_off_and_both_precisions_allowed_off():
    cfg, _ = convert({"optimizer": {"type": "Adam", "params": {"adam_w_mode": "false"}}})
    assert cfg.optimizer.type == "adam"
    cfg, _ = convert({"bf16": {"enabled": "false"}, "fp16": {"enabled": "true"}})
    assert cfg.precision.param_dtype == "fp16"


@pytest.mark.parametrize("value", ["maybe", "", 2, [True], {"x": 1}])
def test_unknown_boolean_is_an_error(value):
    with pytest.raises(ConfigError, match=r"bf16\.enabled = .*expected true or false"):
        Config.from_deepspeed({"bf16": {"enabled": value}})


Z = "zero_optimization"
# Odd DeepSpeed configs (issue 37 row 16): each was a traceback (ValueError, TypeError), a silent
# reading (stage true as 1, 2.5 steps as 2, a second nvme_path overwriting the first, amsgrad warned
# and dropped) or an error naming only the zerotier key the user never wrote.
ODD = [
    ({Z: {"stage": "three"}}, r"^zero_optimization\.stage = 'three': expected a whole number$"),
    ({Z: {"stage": True}}, r"^zero_optimization\.stage = True: expected a whole number$"),
    ({Z: {"stage": 4}}, r"^zero_optimization\.stage = 4: expected 0, 1, 2 or 3$"),
    ({Z: {"stage": 2.5}}, r"^zero_optimization\.stage = 2\.5: expected a whole number$"),
    ({Z: 3}, r"^zero_optimization = 3: expected an object of DeepSpeed settings$"),
    ({Z: {"offload_param": "cpu"}}, r"^zero_optimization\.offload_param = 'cpu': expected an object"),
    ({Z: {"offload_param": {"device": ["cpu"]}}}, r"^zero_optimization\.offload_param\.device = \['cpu'\]: expected cpu, nvme or none$"),
    ({Z: {"stage": 3, "offload_param": {"device": "nvme"}}},
     r"^zero_optimization\.offload_param\.device = 'nvme' needs zero_optimization\.offload_param\.nvme_path: set "
     r"it to a directory on the NVMe drive$"),
    ({Z: {"offload_param": {"device": "nvme", "nvme_path": 5}}}, r"^zero_optimization\.offload_param\.nvme_path = 5: expected a directory path$"),
    ({Z: {"offload_param": {"device": "nvme", "nvme_path": "/a"},
          "offload_optimizer": {"device": "nvme", "nvme_path": "/b"}}},
     r"^zero_optimization\.offload_optimizer\.nvme_path = '/b' and zero_optimization\.offload_param\.nvme_path = "
     r"'/a' differ: zerotier keeps all its swap files in one directory"),
    ({Z: {"reduce_bucket_size": "abc"}}, r"^zero_optimization\.reduce_bucket_size = 'abc': expected a whole number$"),
    ({Z: {"reduce_bucket_size": True}}, r"^zero_optimization\.reduce_bucket_size = True: expected a whole number$"),
    ({Z: {"reduce_bucket_size": [1]}}, r"^zero_optimization\.reduce_bucket_size = \[1\]: expected a whole number$"),
    ({Z: {"stage3_prefetch_bucket_size": float("nan")}}, r"^zero_optimization\.stage3_prefetch_bucket_size = nan: expected a whole"),
    ({Z: {"reduce_bucket_size": -5}},
     r"^DeepSpeed zero_optimization\.reduce_bucket_size -> zero\.reduce_bucket_size: size must be >= 0"),
    ({"aio": {"block_size": "1M"}}, r"^aio\.block_size = '1M': expected a whole number$"),
    ({"fp16": {"enabled": True, "loss_scale": "x"}}, r"^fp16\.loss_scale = 'x': expected a number$"),
    ({"fp16": "auto"}, r"^fp16 = 'auto': expected an object of DeepSpeed settings$"),
    ({"bf16": True}, r"^bf16 = True: expected an object"),
    ({"gradient_accumulation_steps": 2.5}, r"^gradient_accumulation_steps = 2\.5: expected a whole number$"),
    ({"gradient_accumulation_steps": True}, r"^gradient_accumulation_steps = True: expected a whole number$"),
    ({"gradient_accumulation_steps": 0},
     r"^DeepSpeed gradient_accumulation_steps -> train\.grad_accum_steps: must be >= 1, got 0$"),
    ({"gradient_clipping": "x"}, r"^gradient_clipping = 'x': expected a number$"),
    ({"gradient_clipping": True}, r"^gradient_clipping = True: expected a number$"),
    ({"optimizer": ["Adam"]}, r"^optimizer = \['Adam'\]: expected an object"),
    ({"optimizer": {"type": "Adam", "params": "x"}}, r"^optimizer\.params = 'x': expected an object"),
    ({"optimizer": {"params": {"lr": "x"}}}, r"^optimizer\.params\.lr = 'x': expected a number$"),
    ({"optimizer": {"params": {"lr": True}}}, r"^optimizer\.params\.lr = True: expected a number$"),
    ({"optimizer": {"params": {"betas": 0.9}}}, r"^optimizer\.params\.betas = 0\.9: expected two numbers"),
    ({"optimizer": {"params": {"betas": "0.9"}}}, r"^optimizer\.params\.betas = '0\.9': expected two numbers"),
    ({"optimizer": {"params": {"eps": -1}}}, r"^DeepSpeed optimizer\.params\.eps -> optimizer\.eps: must be > 0"),
    ({"optimizer": {"type": "Adam", "params": {"amsgrad": True}}},
     r"^optimizer\.params\.amsgrad = true: zerotier's Adam has no AMSGrad; remove the key"),
    ({"optimizer": {"type": "Adam", "params": {"bias_correction": "false"}}},
     r"^optimizer\.params\.bias_correction = false: zerotier's Adam always corrects the moments' bias"),
]


@pytest.mark.parametrize("ds, match", ODD, ids=[f"{i}-{next(iter(d))}" for i, (d, _) in enumerate(ODD)])
def test_an_odd_deepspeed_config_is_a_config_error_naming_the_deepspeed_key(tmp_path, capsys, ds, match):
    import re

    from zerotier import cli

    with pytest.raises(ConfigError, match=match):
        Config.from_deepspeed(ds)
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ds))
    with pytest.raises(ConfigError, match=re.escape(f"{path}: ") + match.lstrip("^")):
        Config.from_deepspeed(path)
    assert cli.main(["convert", str(path)]) == 1  # one line, no traceback
    err = capsys.readouterr().err
    assert err.startswith(f"zerotier convert: error: {path}: ") and err.count("\n") == 1, err


@pytest.mark.parametrize("ds", [[1, 2], "not a path/x.json", 3])
def test_a_deepspeed_config_that_is_not_an_object(tmp_path, ds):
    if isinstance(ds, list):
        path = tmp_path / "list.json"
        path.write_text(json.dumps(ds))
        with pytest.raises(ConfigError, match=r"list.json: a DeepSpeed config is a JSON object, got list"):
            Config.from_deepspeed(path)
    with pytest.raises(ConfigError, match=r"(a DeepSpeed config is a dict or a JSON file's path, got|cannot read "
                                          r"DeepSpeed config)"):
        Config.from_deepspeed(ds)


def test_the_defaults_of_adam_variants_and_numeric_strings_are_read_quietly():
    cfg, warning = convert({Z: {"stage": 3.0, "reduce_bucket_size": "5e8"}, "gradient_accumulation_steps": "4",
                            "optimizer": {"type": "AdamW", "params": {"amsgrad": False, "bias_correction": True,
                                                                      "lr": "1e-4"}}})
    assert (cfg.zero.stage, cfg.zero.reduce_bucket_size, cfg.train.grad_accum_steps) == (3, 2_000_000_000, 4)
    assert cfg.optimizer.lr == 1e-4 and warning == ""


def test_deepspeed_config_knows_nothing_of_config():
    """The arrow runs config -> deepspeed_config only: the converter turns DeepSpeed's dict into
    {section: {key: value}} and Config.from_converted builds it. No import, not even one inside a
    function, may close the old config <-> deepspeed_config circle."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(deepspeed_config.__file__).read_text())
    zerotier_modules = {node.module for node in ast.walk(tree)
                        if isinstance(node, ast.ImportFrom) and node.level > 0}
    absolute = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    absolute |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 0}
    assert zerotier_modules == {"errors"}, zerotier_modules
    assert not any(name.startswith("zerotier") for name in absolute), absolute
