"""DeepSpeed configs in zerotier ([Note: DeepSpeed keys] in zerotier/deepspeed_config.py): the
example configs of DeepSpeed's ZeRO-Offload and ZeRO-Infinity documentation convert, each key
with a zerotier meaning is mapped, every other key is named in one warning."""
from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest

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


def test_auto_values_keep_defaults_and_are_listed():
    cfg, warning = convert({"gradient_accumulation_steps": "auto", "zero_optimization": {"stage": 3}})
    assert cfg.train.grad_accum_steps == 1 and cfg.zero.stage == 3
    assert 'gradient_accumulation_steps = "auto"' in warning


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
