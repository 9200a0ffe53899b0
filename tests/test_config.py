"""Config parsing and validation: sources, sizes, unknown keys, value rules, immutability."""
from __future__ import annotations

import dataclasses
import json
import random
import sys
from pathlib import Path

import pytest
import torch

from zerotier.config import Config, IOConfig, OptimizerConfig, TiersConfig
from zerotier.units import format_setting, format_size, parse_size
from zerotier.errors import ConfigError

GiB = 1 << 30

# A config that moves every field of interest off its default, in the forms users write.
USER_CONFIG = {
    "zero": {"stage": 3, "reduce_bucket_size": "50MiB", "overlap_comm": False},
    "tiers": {"device": "20GiB", "host": "200GiB", "nvme": "2TiB", "nvme_path": "/mnt/nvme"},
    "offload": {"params": "nvme", "gradients": "host", "optimizer": "nvme"},
    "precision": {"param_dtype": "bf16", "grad_dtype": "bf16", "loss_scale": "dynamic"},
    "optimizer": {"lr": 3e-4, "betas": [0.9, 0.95], "threads": 2, "weight_decay": 0},
    "train": {"grad_accum_steps": 4, "max_grad_norm": 1.0},
    "prefetch": {"max_bytes": "auto"},
    "io": {"block_size": "4MiB", "alignment": "4KiB", "queue_depth": 8},
    "profile": {"enabled": True, "trace_path": "trace.json"},
}

USER_TOML = """
[zero]
stage = 3
reduce_bucket_size = "50MiB"
overlap_comm = false

[tiers]
device = "20GiB"
host = "200GiB"
nvme = "2TiB"
nvme_path = "/mnt/nvme"

[offload]
params = "nvme"
gradients = "host"
optimizer = "nvme"

[precision]
param_dtype = "bf16"
grad_dtype = "bf16"
loss_scale = "dynamic"

[optimizer]
lr = 3e-4
betas = [0.9, 0.95]
threads = 2
weight_decay = 0

[train]
grad_accum_steps = 4
max_grad_norm = 1.0

[prefetch]
max_bytes = "auto"

[io]
block_size = "4MiB"
alignment = "4KiB"
queue_depth = 8

[profile]
enabled = true
trace_path = "trace.json"
"""


def test_from_dict_normalizes_values():
    cfg = Config.from_dict(USER_CONFIG)
    assert cfg.zero.reduce_bucket_size == 50 << 20
    assert cfg.tiers.device == 20 * GiB and cfg.tiers.nvme == 2 << 40
    assert cfg.optimizer.betas == (0.9, 0.95)
    assert isinstance(cfg.optimizer.weight_decay, float)
    assert cfg.prefetch.max_bytes == "auto"
    assert cfg.io.block_size == 4 << 20 and cfg.io.alignment == 4096
    assert cfg.optimizer.eps == OptimizerConfig().eps  # keys left out keep their defaults


def test_to_dict_is_plain_json_and_round_trips():
    cfg = Config.from_dict(USER_CONFIG)
    plain = cfg.to_dict()
    assert json.loads(json.dumps(plain)) == plain
    assert Config.from_dict(plain) == cfg
    assert Config.from_dict(Config().to_dict()) == Config()


def test_toml_json_yaml_files_agree(tmp_path):
    yaml = pytest.importorskip("yaml")
    expected = Config.from_dict(USER_CONFIG)
    (tmp_path / "c.toml").write_text(USER_TOML)
    (tmp_path / "c.json").write_text(json.dumps(USER_CONFIG))
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(USER_CONFIG))
    (tmp_path / "c.yml").write_text(yaml.safe_dump(expected.to_dict()))
    for name in ("c.toml", "c.json", "c.yaml", "c.yml"):
        assert Config.load(tmp_path / name) == expected, name


def test_yaml_exponent_without_point_is_a_number(tmp_path):
    # PyYAML reads `1e-4` (no decimal point) as a string; float keys accept it anyway.
    (tmp_path / "c.yaml").write_text("optimizer:\n  lr: 1e-4\n  eps: 1e-6\n")
    cfg = Config.load(tmp_path / "c.yaml")
    assert cfg.optimizer.lr == 1e-4 and cfg.optimizer.eps == 1e-6


def test_empty_yaml_and_empty_sections_mean_defaults(tmp_path):
    (tmp_path / "empty.yaml").write_text("")
    (tmp_path / "bare.yaml").write_text("tiers:\n")
    assert Config.load(tmp_path / "empty.yaml") == Config()
    assert Config.load(tmp_path / "bare.yaml") == Config()


def test_load_errors_name_the_file(tmp_path):
    bad_value = tmp_path / "bad.json"
    bad_value.write_text(json.dumps({"zero": {"stage": 7}}))
    with pytest.raises(ConfigError, match=r"bad\.json: zero\.stage: must be 0, 1, 2 or 3, got 7"):
        Config.load(bad_value)
    broken = tmp_path / "broken.toml"
    broken.write_text("[zero\nstage = 1")
    with pytest.raises(ConfigError, match=r"broken\.toml: not valid TOML"):
        Config.load(broken)
    with pytest.raises(ConfigError, match=r"unknown config file extension '\.ini'.*\.toml, \.json, \.yaml or \.yml"):
        Config.load(tmp_path / "c.ini")
    with pytest.raises(ConfigError, match=r"cannot read config file .*missing\.toml"):
        Config.load(tmp_path / "missing.toml")
    top_list = tmp_path / "list.json"
    top_list.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must be a mapping of sections, got list"):
        Config.load(top_list)


def test_missing_pyyaml_says_how_to_install(tmp_path, monkeypatch):
    (tmp_path / "c.yaml").write_text("zero:\n  stage: 1\n")
    monkeypatch.setitem(sys.modules, "yaml", None)  # makes `import yaml` raise ImportError
    with pytest.raises(ConfigError, match="pip install pyyaml"):
        Config.load(tmp_path / "c.yaml")


def test_coerce_accepts_every_source(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"zero": {"stage": 2}}))
    cfg = Config.from_dict({"zero": {"stage": 2}})
    assert Config.coerce(None) == Config()
    assert Config.coerce(cfg) is cfg
    assert Config.coerce({"zero": {"stage": 2}}) == cfg
    assert Config.coerce(path) == cfg
    assert Config.coerce(str(path)) == cfg
    with pytest.raises(ConfigError, match="cannot make a Config from int"):
        Config.coerce(3)


def test_sections_may_be_given_as_dataclasses():
    io = IOConfig(queue_depth=4)
    assert Config.from_dict({"io": io}).io is io


def test_config_and_sections_are_frozen():
    cfg = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.zero = None
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.io.block_size = 1


def test_direct_construction_and_replace_are_validated():
    assert TiersConfig(host="24GiB").host == 24 * GiB
    with pytest.raises(ConfigError, match=r"^io\.queue_depth: must be in \[1, 4096\] \(io_uring's ring limit\), got 0$"):
        IOConfig(queue_depth=0)
    with pytest.raises(ConfigError, match=r"^zero\.stage"):
        dataclasses.replace(Config().zero, stage=9)
    with pytest.raises(ConfigError, match=r"^zero: expected a ZeroConfig, got dict"):
        Config(zero={"stage": 1})


# ---------------------------------------------------------------------------------------------
# Sizes

@pytest.mark.parametrize("text, nbytes", [
    (0, 0),
    (4096, 4096),
    (1e9, 10**9),
    ("0", 0),
    ("512", 512),
    ("512B", 512),
    ("4k", 4096),
    ("4K", 4096),
    ("4KiB", 4096),
    ("4KB", 4000),
    ("512MiB", 512 << 20),
    ("100MB", 100 * 10**6),
    ("24GiB", 24 * GiB),
    ("24 GiB", 24 * GiB),
    ("24gib", 24 * GiB),
    ("2G", 2 * GiB),
    ("1.5GiB", 3 * GiB // 2),
    ("1.5TB", 1_500_000_000_000),
    ("2TiB", 2 << 40),
    ("1T", 1 << 40),
    (".5KiB", 512),
    ("1e3", 1000),
])
def test_parse_size(text, nbytes):
    assert parse_size(text, "x") == nbytes


def test_parse_size_auto():
    assert parse_size("auto", "tiers.host", allow_auto=True) == "auto"
    assert parse_size(" AUTO ", "tiers.host", allow_auto=True) == "auto"
    with pytest.raises(ConfigError, match="io.block_size: 'auto' is not allowed here"):
        parse_size("auto", "io.block_size")


@pytest.mark.parametrize("value, message", [
    ("12 potatoes", r"^tiers\.host: invalid size '12 potatoes': expected an int or a string like '24GiB' / '1\.5TB'"),
    ("", r"invalid size ''"),
    ("GiB", r"invalid size 'GiB'"),
    ("1.5.5GiB", r"invalid size"),
    (True, r"invalid size True"),
    (None, r"invalid size None"),
    ([1], r"invalid size \[1\]"),
    (float("inf"), r"invalid size inf"),
    (-1, r"^tiers\.host: size must be >= 0, got -1$"),
    ("-2GiB", r"size must be >= 0, got '-2GiB'"),
    ("1.5B", r"size '1\.5B' is not a whole number of bytes"),
    ("0.0001KB", r"not a whole number"),
    (0.5, r"size 0\.5 is not a whole number of bytes"),
])
def test_parse_size_errors(value, message):
    with pytest.raises(ConfigError, match=message):
        parse_size(value, "tiers.host")


def test_size_errors_inside_config_name_the_key():
    with pytest.raises(ConfigError, match=r"^tiers\.host: invalid size '12 potatoes'.*/ 'auto'"):
        Config.from_dict({"tiers": {"host": "12 potatoes"}})
    with pytest.raises(ConfigError, match=r"^zero\.reduce_bucket_size: 'auto' is not allowed"):
        Config.from_dict({"zero": {"reduce_bucket_size": "auto"}})


@pytest.mark.parametrize("nbytes, text", [
    (0, "0 B"),
    (512, "512 B"),
    (1023, "1023 B"),
    (1024, "1.00 KiB"),
    (3 * GiB // 2, "1.50 GiB"),
    (2 << 40, "2.00 TiB"),
    (-GiB, "-1.00 GiB"),
    ("auto", "auto"),
])
def test_format_size(nbytes, text):
    assert format_size(nbytes) == text


@pytest.mark.parametrize("nbytes, text", [
    (0, "0 B"), (1000, "1000 B"), (12 * 1024, "12 KiB"), (4 * GiB, "4 GiB"),
    (7350518, "7179 KiB"),  # 7.01 MiB: issue 37 row 16, a BudgetError advised it and the config refused it
    (int(1.01 * GiB), "1035 MiB"), (150 * GiB + 1, "151 GiB"), (99 * 2**20 + 5, "101377 KiB"),
])
def test_a_size_advised_as_a_setting_parses_to_at_least_it(nbytes, text):
    assert format_setting(nbytes) == text
    assert nbytes <= parse_size(text) <= nbytes * 1.01 + 1


def test_every_size_advised_as_a_setting_parses_to_at_least_it():
    rng = random.Random(37)
    for nbytes in [rng.randrange(1 << rng.randrange(1, 60)) for _ in range(2000)]:
        assert nbytes <= parse_size(format_setting(nbytes), "tiers.host") <= nbytes * 1.01 + 1, nbytes


# ---------------------------------------------------------------------------------------------
# Unknown keys

def test_unknown_top_level_key_suggests_the_closest():
    with pytest.raises(ConfigError) as info:
        Config.from_dict({"tier": {}})
    assert str(info.value) == (
        "unknown config key 'tier'; did you mean 'tiers'? valid keys: "
        "io, offload, optimizer, precision, prefetch, profile, tiers, train, zero"
    )


def test_unknown_nested_key_suggests_the_closest():
    with pytest.raises(ConfigError) as info:
        Config.from_dict({"tiers": {"nvm_path": "/mnt"}})
    assert str(info.value) == (
        "unknown config key 'tiers.nvm_path'; did you mean 'tiers.nvme_path'? "
        "valid keys: device, device_reserve, host, nvme, nvme_path"
    )


def test_unknown_key_without_a_close_match_lists_valid_keys():
    with pytest.raises(ConfigError, match=r"^unknown config key 'io\.zzz'; valid keys: alignment, backend"):
        Config.from_dict({"io": {"zzz": 1}})


def test_section_must_be_a_table():
    with pytest.raises(ConfigError, match="config section 'tiers' must be a table of keys, got int"):
        Config.from_dict({"tiers": 5})


# ---------------------------------------------------------------------------------------------
# Value rules: each (section, values, expected message)

INVALID = [
    ("zero", {"stage": 4}, r"zero\.stage: must be 0, 1, 2 or 3, got 4"),
    ("zero", {"stage": -1}, r"zero\.stage: must be 0, 1, 2 or 3"),
    ("zero", {"stage": 1.0}, r"zero\.stage: expected an int, got 1\.0"),
    ("zero", {"overlap_comm": "yes"}, r"zero\.overlap_comm: expected true or false, got 'yes'"),
    ("zero", {"overlap_comm": 1}, r"zero\.overlap_comm: expected true or false, got 1"),
    ("zero", {"timeout_s": 0}, r"zero\.timeout_s: must be > 0"),
    ("offload", {"params": "disk"}, r"offload\.params: must be one of 'auto', 'device', 'host', 'nvme', got 'disk'"),
    ("precision", {"param_dtype": "float32"}, r"precision\.param_dtype: must be one of 'fp32', 'bf16', 'fp16'"),
    ("precision", {"master_dtype": "int8"}, r"precision\.master_dtype: must be one of 'fp32', 'bf16', got 'int8'"),
    ("precision", {"moment_dtype": "fp16"}, r"precision\.moment_dtype: must be one of 'fp32', 'bf16', 'int8', got 'fp16'"),
    ("precision", {"grad_dtype": "int8"}, r"precision\.grad_dtype: must be one of"),
    ("precision", {"loss_scale": 0}, r"precision\.loss_scale: must be > 0 or 'dynamic', got 0\.0"),
    ("precision", {"loss_scale": "dyn"}, r"precision\.loss_scale: expected a number or 'dynamic', got 'dyn'"),
    ("optimizer", {"type": "sgd"}, r"optimizer\.type: must be one of 'adamw', 'adam'"),
    ("optimizer", {"lr": -1e-3}, r"optimizer\.lr: must be >= 0"),
    ("optimizer", {"lr": "fast"}, r"optimizer\.lr: expected a number, got 'fast'"),
    ("optimizer", {"lr": float("nan")}, r"optimizer\.lr: must be a finite number"),
    ("optimizer", {"betas": [0.9]}, r"optimizer\.betas: expected a list of 2 items"),
    ("optimizer", {"betas": 0.9}, r"optimizer\.betas: expected a list of 2 items"),
    ("optimizer", {"betas": [0.9, 1.0]}, r"optimizer\.betas: must be two numbers in \[0, 1\)"),
    ("optimizer", {"betas": [-0.1, 0.9]}, r"optimizer\.betas: must be two numbers in \[0, 1\)"),
    ("optimizer", {"betas": ["a", 0.9]}, r"optimizer\.betas\[0\]: expected a number, got 'a'"),
    ("optimizer", {"eps": 0}, r"optimizer\.eps: must be > 0"),
    ("optimizer", {"weight_decay": -0.1}, r"optimizer\.weight_decay: must be >= 0"),
    ("optimizer", {"threads": 0}, r"optimizer\.threads: must be >= 1 or 'auto', got 0"),
    ("optimizer", {"threads": "many"}, r"optimizer\.threads: expected an int or 'auto', got 'many'"),
    ("optimizer", {"simd": "sse"}, r"optimizer\.simd: must be one of"),
    ("optimizer", {"bias_correction": "no"}, r"optimizer\.bias_correction: expected true or false"),
    ("optimizer", {"step_on": "gpu"}, r"optimizer\.step_on: must be one of 'cpu', 'device', 'auto', got 'gpu'"),
    ("train", {"grad_accum_steps": 0}, r"train\.grad_accum_steps: must be >= 1, got 0"),
    ("train", {"max_grad_norm": 0}, r"train\.max_grad_norm: must be > 0, or left out to disable clipping"),
    ("train", {"max_grad_norm": "big"}, r"train\.max_grad_norm: expected a number or null"),
    ("prefetch", {"lookahead": -1}, r"prefetch\.lookahead: must be >= 0"),
    ("io", {"alignment": 1000}, r"io\.alignment: must be a power of two >= 512, got 1000"),
    ("io", {"alignment": 256}, r"io\.alignment: must be a power of two >= 512, got 256"),
    ("io", {"block_size": "1000KB"}, r"io\.block_size: must be a multiple of io\.alignment \(4096\), got 1000000"),
    ("io", {"block_size": 0}, r"io\.block_size: must be in \(0, 1 GiB\], got 0"),
    ("io", {"block_size": "2GiB"}, r"io\.block_size: must be in \(0, 1 GiB\], got 2147483648"),
    ("io", {"queue_depth": 0}, r"io\.queue_depth: must be in \[1, 4096\] \(io_uring's ring limit\), got 0"),
    ("io", {"queue_depth": 4097}, r"io\.queue_depth: must be in \[1, 4096\] \(io_uring's ring limit\), got 4097"),
    ("io", {"threads": 0}, r"io\.threads: must be in \[1, 1024\], got 0"),
    ("io", {"threads": 1025}, r"io\.threads: must be in \[1, 1024\], got 1025"),
    ("io", {"o_direct": "true"}, r"io\.o_direct: expected true or false, got 'true'"),
    ("io", {"backend": "libaio"}, r"io\.backend: must be one of"),
    ("profile", {"sample_interval_ms": 0}, r"profile\.sample_interval_ms: must be > 0"),
    ("profile", {"trace_path": 3}, r"profile\.trace_path: expected a string or null"),
    ("tiers", {"nvme_path": ""}, r"tiers\.nvme_path: must be a directory path, or left out"),
    ("tiers", {"nvme": "1TiB"}, r"tiers\.nvme = 1\.00 TiB needs tiers\.nvme_path"),
]


@pytest.mark.parametrize("section, values, message", INVALID, ids=[f"{s}-{next(iter(v))}" for s, v, _ in INVALID])
@pytest.mark.pins("design#config-tells-the-truth")
def test_invalid_values_name_the_key_and_the_rule(section, values, message):
    with pytest.raises(ConfigError, match="^" + message):
        Config.from_dict({section: values})


@pytest.mark.parametrize("placement", ["params", "gradients", "optimizer"])
def test_nvme_placement_needs_a_path_and_a_budget(placement):
    with pytest.raises(ConfigError, match=rf"^offload\.{placement} = 'nvme' needs tiers\.nvme_path"):
        Config.from_dict({"offload": {placement: "nvme"}})
    with pytest.raises(ConfigError, match=rf"^offload\.{placement} = 'nvme' but tiers\.nvme = 0"):
        Config.from_dict({"offload": {placement: "nvme"}, "tiers": {"nvme_path": "/mnt/nvme", "nvme": 0}})
    cfg = Config.from_dict({"offload": {placement: "nvme"}, "tiers": {"nvme_path": "/mnt/nvme"}})
    assert getattr(cfg.offload, placement) == "nvme"


def test_valid_edge_values_are_accepted():
    cfg = Config.from_dict({
        "zero": {"stage": 0},
        "optimizer": {"lr": 0, "betas": (0.0, 0.0), "weight_decay": 0, "threads": "auto"},
        "precision": {"loss_scale": 128},
        "io": {"alignment": 512, "block_size": 512},
        "train": {"max_grad_norm": None},
    })
    assert cfg.precision.loss_scale == 128.0 and isinstance(cfg.precision.loss_scale, float)
    assert cfg.io.alignment == 512


# ---------------------------------------------------------------------------------------------
# docs/config.md stays in step with the schema

DOCS = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def test_docs_list_every_key_under_its_section():
    text = DOCS.read_text()
    for section, values in Config().to_dict().items():
        heading = f"### `{section}`"
        assert heading in text, f"docs/config.md has no section {heading}"
        body = text.split(heading, 1)[1].split("\n### ", 1)[0]
        for key in values:
            assert f"| `{key}` |" in body, f"docs/config.md does not document {section}.{key}"


def test_docs_toml_example_is_valid():
    tomllib = pytest.importorskip("tomllib")
    example = DOCS.read_text().split("```toml\n", 1)[1].split("```", 1)[0]
    cfg = Config.from_dict(tomllib.loads(example))
    assert cfg.optimizer.betas == (0.9, 0.95)


# ------------------------------------------------------------------ train.device and per-node sharing

def test_device_key_is_validated():
    with pytest.raises(ConfigError, match=r"train\.device: must be auto, cpu, cuda or cuda:N"):
        Config.from_dict({"train": {"device": "gpu0"}})
    assert Config.from_dict({"train": {"device": "cuda:3"}}).train.device == "cuda:3"


@pytest.mark.pins("design#device-and-group-first")
def test_device_choice(monkeypatch):
    from zerotier.device import choose

    assert choose("cpu") == torch.device("cpu")
    monkeypatch.setenv("ZEROTIER_DEVICE", "cpu")
    assert choose("auto") == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"train\.device = 'cuda', but this torch has no usable CUDA device"):
            choose("cuda")


def test_auto_budgets_and_adam_threads_are_shared_by_the_ranks_of_a_node(monkeypatch, tmp_path):
    from zerotier.optim.offload import UnitOptimizer
    from zerotier.planner.budgets import resolve_budgets
    from zerotier.state import Location

    tiers = TiersConfig(nvme_path=str(tmp_path))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    one = resolve_budgets(tiers, torch.device("cpu"))
    threads_one = UnitOptimizer([], OptimizerConfig(), Location.HOST, None, None, None).threads
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    four = resolve_budgets(tiers, torch.device("cpu"))
    for tier in ("host", "nvme"):  # RAM and disk change a little between the two readings
        assert abs(four[tier] * 4 - one[tier]) <= 0.05 * one[tier], (tier, one, four)
    assert UnitOptimizer([], OptimizerConfig(), Location.HOST, None, None, None).threads == max(1, threads_one // 4)


def test_durations_in_human_units():
    from zerotier.units import format_duration
    assert [format_duration(s) for s in (412e-6, 0.0123, 4.2, 162.1, 7300)] == \
        ["412 µs", "12.3 ms", "4.20 s", "2.7 min", "2.03 h"]


@pytest.mark.parametrize("old,value,mode", [("early_step", True, "early"), ("speculative_step", True, "speculative"),
                                            ("speculative_step", False, "none"), ("speculative_step", "auto", "auto"),
                                            ("delayed_update", True, "delayed"), ("early_step", False, "auto")])
def test_the_old_overlap_keys_are_read_as_train_overlap_with_one_warning(old, value, mode):
    with pytest.warns(FutureWarning) as record:
        cfg = Config.from_dict({"train": {old: value}})
    assert cfg.train.overlap == mode
    assert [str(w.message) for w in record if w.category is FutureWarning] == \
        [f"train.{old} is an old key of train.overlap: set train.overlap = {mode!r} instead"]
    assert "early_step" not in cfg.to_dict()["train"] and Config.from_dict(cfg.to_dict()).train.overlap == mode


@pytest.mark.parametrize("train,match", [
    ({"overlap": "fast"}, r"^train\.overlap: must be one of 'none', 'early', 'speculative', 'delayed', 'auto', "
                          r"got 'fast'$"),
    ({"early_step": True, "speculative_step": True}, r"^train\.early_step = true and train\.speculative_step = true: "
                                                     r"each is a value of train\.overlap now \('early', 'speculative'\)"),
    ({"overlap": "none", "early_step": True}, r"^train\.overlap = 'none' and train\.early_step = true: .*set "
                                              r"train\.overlap alone$"),
    ({"delayed_update": True, "speculative_step": True}, r"^train\.delayed_update = true cannot run here: "
                                                         r"train\.speculative_step = true updates units during backward"),
    ({"early_step": "yes"}, r"^train\.early_step: expected true or false, got 'yes' \(an old key: set train\.overlap"),
])
@pytest.mark.pins("design#the-overlap-seam")
def test_train_overlap_takes_one_value(train, match):
    with pytest.raises(ConfigError, match=match):
        Config.from_dict({"train": train})


@pytest.mark.pins("design#the-overlap-seam")
def test_every_overlap_value_has_a_policy_and_every_policy_a_value():
    """train.overlap's values (config_schema.OVERLAP: the config imports nothing of overlap/) and the
    policy registry (overlap.POLICIES) are one list: a policy added to one and not the other is
    either unreachable from a config or a value that fails at initialize."""
    import typing

    from zerotier.config_schema import OVERLAP
    from zerotier.overlap import POLICIES

    assert set(typing.get_args(OVERLAP)) == set(POLICIES)


def test_optimizer_step_on_takes_cpu_device_or_auto_and_names_them_otherwise():
    """optimizer.step_on ([Note: where the update runs] in planner/step_on.py): "auto" by default, the
    three values accepted, anything else a ConfigError naming the choices; the config's Literal and
    the planner's STEP_ON are one list."""
    import typing

    from zerotier.planner.step_on import STEP_ON

    assert Config().optimizer.step_on == "auto"
    for value in ("cpu", "device", "auto"):
        assert Config.from_dict({"optimizer": {"step_on": value}}).optimizer.step_on == value
    with pytest.raises(ConfigError, match=r"^optimizer\.step_on: must be one of 'cpu', 'device', 'auto', got 'GPU'"):
        Config.from_dict({"optimizer": {"step_on": "GPU"}})
    assert typing.get_args(typing.get_type_hints(OptimizerConfig)["step_on"]) == STEP_ON
