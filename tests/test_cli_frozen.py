"""`zerotier plan` counts frozen (requires_grad=False) weights as the engine does ([Note: frozen units]):
params bytes for them, no gradient or optimizer state, shown apart from the trainable ones."""
from __future__ import annotations

import json

import pytest
import torch

from zerotier.cli import main

FACTORY = """
import torch

def lora_like(device=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256, device=device) for _ in range(4)])
    model.requires_grad_(False)
    model.append(torch.nn.Linear(256, 8, device=device))  # the only trainable layer
    return model
"""


def plan_json(capsys, *args) -> dict:
    assert main(["plan", *args, "--device", "1GiB", "--host", "20GiB", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_of_a_model_factory_counts_its_frozen_weights_apart(tmp_path, monkeypatch, capsys):
    (tmp_path / "frozen_factory.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    plan = plan_json(capsys, "--model", "frozen_factory:lora_like")
    frozen, trainable = 4 * (256 * 256 + 256), 256 * 8 + 8
    assert plan["numel"] == trainable and plan["frozen_numel"] == frozen
    assert plan["frozen_param_bytes"] == 4 * frozen
    # all trainable: the same model planned with every weight trained needs gradients and Adam state for them
    every = plan_json(capsys, "--params", str(frozen + trainable), "--layers", "1")
    assert every["frozen_numel"] == 0
    assert plan["state_bytes"]["params"] == every["state_bytes"]["params"]
    assert plan["per_rank_bytes"] < every["per_rank_bytes"] / 3  # no gradient or optimizer state for the base


def test_plan_with_params_takes_frozen_params(capsys):
    plain = plan_json(capsys, "--params", "10M")
    lora = plan_json(capsys, "--params", "10M", "--frozen-params", "1B")
    assert lora["numel"] == plain["numel"] == 10_000_000 and lora["frozen_numel"] == 10**9
    assert lora["state_bytes"]["params"] == plain["state_bytes"]["params"] + 4 * 10**9
    assert lora["state_bytes"]["gradients"] == plain["state_bytes"]["gradients"]
    assert lora["state_bytes"]["optimizer"] == plain["state_bytes"]["optimizer"]
    assert main(["plan", "--params", "10M", "--frozen-params", "lots"]) == 1
    assert "--frozen-params: cannot read" in capsys.readouterr().err


def test_frozen_params_with_a_model_factory_is_refused(capsys):
    assert main(["plan", "--model", "torch.nn:Linear", "--frozen-params", "1M"]) == 1
    assert "--frozen-params goes with --params" in capsys.readouterr().err
